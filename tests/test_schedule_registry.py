"""One registry of schedule methods (issue 20, item 1): every list of names derives from it,
every entry's generator runs, and its placement claims are true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxpipe.errors import InputError
from fxpipe.ir import ScheduleProblem, looped_placement, v_placement
from fxpipe.schedule import dispatch, heuristics, registry
from fxpipe.schedule.validate import check_schedule

ROOT = Path(__file__).resolve().parents[1]

PLACEMENTS = {  # kind -> (device_of_stage, num_devices)
    "one": (list(range(4)), 4),
    "permuted": ([1, 0, 3, 2], 4),
    "looped": (looped_placement(2, 2), 2),
    "v": (v_placement(2, 2), 2),
    "uneven": ([0, 0, 0, 1], 2),
}


def _problem(dev, p):
    S = len(dev)
    return ScheduleProblem.create(num_stages=S, num_microbatches=4, num_devices=p, device_of_stage=dev,
                                  t_f=1.0, t_b=1.0, t_w=0.5, t_comm=0.1, t_offload=0.5,
                                  mem_f=1.0, mem_b=-0.5, mem_w=-0.5, offload_bytes=0.5, mem_limit=1e9)


def test_every_list_of_names_derives_from_the_registry():
    import fxpipe.api as api
    from fxpipe.schedule import auto
    from fxpipe.schedule.milp import warm_start

    names = registry.names()
    assert len(set(names)) == len(names)
    assert api.SCHEDULES == names == dispatch.METHODS
    assert set(heuristics.ALL_METHODS) == set(registry.names("heuristic"))
    assert set(heuristics.V_METHODS) == {m.name for m in registry.REGISTRY if m.placements == ("v",)}
    assert set(auto.OFFLOAD_METHODS) == {m.name for m in registry.REGISTRY if m.auto_step == "offload"}
    assert all(registry.get(m).offloads for m in auto.OFFLOAD_METHODS)
    assert set(auto.PLAIN_METHODS) | set(auto.PLAIN_MULTI_METHODS) == {
        m.name for m in registry.REGISTRY if m.auto_step == "plain"}
    assert warm_start.WARM_METHODS == registry.warm_start_order()
    assert set(warm_start.WARM_METHODS) == set(heuristics.ALL_METHODS)


def test_no_module_lists_schedule_names_by_hand():
    """A tuple or list naming three or more schedule methods outside the registry is a second
    list that can drift (test support in fxpipe/testing/matrix.py derives its subsets from the registry too)."""
    names = set(registry.names())
    literal = re.compile(r"[\(\[]\s*((?:\"[a-z0-9-]+\"\s*,\s*){2,}\"[a-z0-9-]+\"\s*,?\s*)[\)\]]")
    offenders = []
    for path in (ROOT / "fxpipe").rglob("*.py"):
        if path.name == "registry.py":
            continue
        for m in literal.finditer(path.read_text()):
            items = re.findall(r"\"([a-z0-9-]+)\"", m.group(1))
            if sum(i in names for i in items) >= 3:
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0)[:80]}")
    assert not offenders, offenders


def test_cli_choices_are_the_registry():
    from fxpipe.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "schedule" in a.choices)
    for command, flag in (("schedule", "--method"), ("plan", "--schedule")):
        action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
        assert tuple(action.choices) == registry.names(), command


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_placement_claims_are_true(kind):
    """Every heuristic admitted on a placement schedules it validly; every heuristic not
    admitted refuses it with an InputError (so the registry neither over- nor under-claims)."""
    dev, p = PLACEMENTS[kind]
    problem = _problem(dev, p)
    admitted = dispatch.methods_for_placement(dev, p)
    assert "greedy" in admitted and "milp" in admitted and "auto" in admitted
    assert dispatch.default_method(dev, p) in admitted
    for name in registry.names("heuristic"):
        if name in admitted:
            sched = heuristics.generate(problem, name)
            assert check_schedule(problem, sched.ops) == [], name
        else:
            with pytest.raises(InputError):
                heuristics.generate(problem, name)


def test_registry_rejects_inconsistent_entries():
    with pytest.raises(ValueError, match="placements"):
        registry.ScheduleMethod("x", "heuristic", ("diagonal",), "m:f")
    with pytest.raises(ValueError, match="generator"):
        registry.ScheduleMethod("x", "heuristic", ("one",))
    with pytest.raises(TypeError):
        registry.get("milp").generate(None)
    with pytest.raises(KeyError):
        registry.get("zb-h9")
