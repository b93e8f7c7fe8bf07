"""Lowering as typed list-to-list passes (issue 20 item 3): the same per-rank actions as the old text path.

The old path went Orders -> torch strings -> regex -> TorchAction -> string; ``_old_*`` below are
copies of its lowering logic on strings (kept here only, as the oracle), compared with the
typed passes over every heuristic's orders on several placements, with and without offload.
"""

from __future__ import annotations

import pytest

from fxpipe.codegen.actions import actions_from_orders, fuse_backward, lower_orders, parse_actions, text_of_actions
from fxpipe.codegen.offload import offload_all, offload_program
from fxpipe.errors import InputError
from fxpipe.ir import Action, Orders, ScheduleProblem, looped_placement, schedule_to_orders, v_placement
from fxpipe.ir.lowering import compute_only, full_backward, merge_backward, split_full_backward
from fxpipe.ir.schedule import FULL_BACKWARD, split_action_text
from fxpipe.ir.torch_csv import orders_to_torch_csv, parse_torch_action, torch_action_rows, torch_text


# ----------------------------------------------------------------------------- the old path (oracle)
def _old_torch_action_rows(orders: Orders, fuse_backward: bool) -> list[list[str]]:
    out = []
    for row in orders.actions:
        comp = [a for a in row if a.is_compute]
        cells: list[str] = []
        i = 0
        while i < len(comp):
            a = comp[i]
            if a.type == "F":
                cells.append(f"{a.stage}F{a.microbatch}")
            elif a.type == "W":
                cells.append(f"{a.stage}W{a.microbatch}")
            else:
                nxt = comp[i + 1] if i + 1 < len(comp) else None
                if fuse_backward and nxt is not None and nxt == Action(a.stage, "W", a.microbatch):
                    cells.append(f"{a.stage}B{a.microbatch}")
                    i += 1
                else:
                    cells.append(f"{a.stage}I{a.microbatch}")
            i += 1
        out.append(cells)
    return out


def _old_fuse_backward(actions, stages=None):
    only = None if stages is None else {int(s) for s in stages}
    out = {}
    for r, acts in actions.items():
        new = []
        for a in acts:
            digits = len(a) - len(a.lstrip("0123456789"))
            stage, kind, mb = int(a[:digits]), a[digits], int(a[digits + 1:])
            if only is not None and stage not in only:
                new.append(a)
            elif kind == "W":
                continue
            else:
                new.append(f"{stage}B{mb}" if kind == "I" else a)
        out[r] = new
    return out


def _sweep() -> list[tuple[Orders, int]]:
    heur = pytest.importorskip("fxpipe.schedule.heuristics")
    cases = []
    for p, m in ((2, 3), (3, 4), (4, 6)):
        prob = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1.0, t_b=1.2, t_w=0.7, t_comm=0.1)
        for meth in ("gpipe", "1f1b", "zb-h1", "zb-h2", "greedy"):
            cases.append((schedule_to_orders(heur.generate(prob, meth), prob), m))
        probo = prob.replace(t_offload=0.3 * prob.t_f, mem_f=prob.t_f, mem_b=-0.6 * prob.t_f, mem_w=-0.4 * prob.t_f,
                             offload_bytes=0.8 * prob.t_f, mem_limit=[max(1.5, 0.6 * m)] * p)
        for meth in ("pipeoffload", "adaoffload"):
            cases.append((schedule_to_orders(heur.generate(probo, meth), probo), m))
        for meth, dev in (("interleaved-1f1b", looped_placement(p, 2)), ("zb-v", v_placement(p)),
                          ("greedy", v_placement(p, 3)), ("greedy", looped_placement(p, 3))):
            if meth == "zb-v" and m < 2 * p:
                continue
            pr = ScheduleProblem.create(num_stages=len(dev), num_microbatches=m, t_f=1.0, t_b=1.2, t_w=0.7,
                                        t_comm=0.1, device_of_stage=dev)
            cases.append((schedule_to_orders(heur.generate(pr, meth), pr), m))
    return cases


def test_typed_lowering_equals_the_old_text_path_on_every_heuristic():
    cases = _sweep()
    assert any(o.offloaded() for o, _ in cases) and any(len(set(o.device_of_stage)) < o.num_stages for o, _ in cases)
    for orders, m in cases:
        for o in (orders, offload_all(orders)):
            for fuse in (True, False):
                want = dict(enumerate(_old_torch_action_rows(o, fuse)))
                assert actions_from_orders(o, m, fuse=fuse) == want, (o, fuse)
                assert torch_action_rows(o, fuse_backward=fuse, offload="drop") == list(want.values())
                assert fuse_backward(want) == _old_fuse_backward(want)
                assert fuse_backward(want, stages=[0]) == _old_fuse_backward(want, stages=[0])
                typed = lower_orders(o, m, fuse=fuse)
                assert text_of_actions({r: full_backward(a) for r, a in typed.items()}) == _old_fuse_backward(want)


# ----------------------------------------------------------------------------- goldens captured from the old code
_ZBV = (
    "0F0 0F1 3F0 3B0 3F1 3B1 3W0 0B0 3W1 0W0 0B1 0W1",
    "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1",
)
_PIPEOFFLOAD = (
    "0F0 0O0 0F1 0O1 0R0 0B0 0W0 0F2 0R1 0O2 0B1 0W1 0F3 0R2 0O3 0B2 0W2 0R3 0B3 0W3",
    "1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2 1F3 1B3 1W3",
)


def _orders(dev, rows) -> Orders:
    return Orders(dev, tuple(tuple(map(Action.parse, r.split())) for r in rows))


def test_lowering_goldens_of_the_old_code():
    zbv = _orders((0, 1, 1, 0), _ZBV)
    acts = actions_from_orders(zbv, 2)
    assert acts == {
        0: "0F0 0F1 3F0 3I0 3F1 3I1 3W0 0I0 3W1 0W0 0B1".split(),
        1: "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1".split(),
    }
    assert fuse_backward(actions_from_orders(zbv, 2, fuse=False), stages=[0])[0] == (
        "0F0 0F1 3F0 3I0 3F1 3I1 3W0 0B0 3W1 0B1".split()
    )
    po = _orders((0, 1), _PIPEOFFLOAD)
    acts = actions_from_orders(po, 4)
    assert acts[0] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3".split()
    assert offload_program(po.of_device(0), acts[0]).describe() == (
        "0F0 -> 0O0\n0F1 -> 0O1 0R0\n0F2 -> 0R1 0O2\n0F3 -> 0R2 0O3\n0B2 -> 0R3"
    )
    # the typed lowered actions anchor the same program
    typed = lower_orders(po, 4)[0]
    assert offload_program(po.of_device(0), typed) == offload_program(po.of_device(0), acts[0])


# ----------------------------------------------------------------------------- the passes and the one grammar
def test_passes_are_list_to_list_and_invertible():
    prog = list(map(Action.parse, "0F0 0O0 0B0 0W0 0R0 1B0 1F1 1W0".split()))
    before = list(prog)
    comp = compute_only(prog)
    assert [str(a) for a in comp] == "0F0 0B0 0W0 1B0 1F1 1W0".split()
    merged = merge_backward(comp)
    assert [str(a) for a in merged] == "0F0 0BW0 1B0 1F1 1W0".split()
    assert split_full_backward(merged) == comp
    assert [str(a) for a in full_backward(comp, stages=[1])] == "0F0 0B0 0W0 1BW0 1F1".split()
    assert prog == before


def test_one_grammar_for_both_vocabularies():
    assert split_action_text("2F0") == (2, "F", 0) and split_action_text("0UNSHARD") == (0, "UNSHARD", None)
    assert split_action_text("F0") is None and split_action_text(None) is None
    assert parse_torch_action("2I0", "x") == Action(2, "B", 0)
    assert parse_torch_action("2B0", "x") == Action(2, FULL_BACKWARD, 0)
    assert parse_torch_action("", "x") is None
    with pytest.raises(InputError, match="communication"):
        parse_torch_action("1SEND_F0", "x")
    with pytest.raises(InputError, match="x: bad action string '2O0'"):
        parse_torch_action("2O0", "x")
    for text in ("0F1", "3I2", "1W0", "2B5"):
        assert torch_text(parse_torch_action(text, "x")) == text
    assert parse_actions({1: ["1F0", "", Action(1, "B", 0)]}) == {1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(InputError, match="offload"):
        torch_text(Action(0, "O", 0))
    # a full backward is a lowering product: orders refuse it
    assert Action.parse("0BW1") == Action(0, FULL_BACKWARD, 1)
    with pytest.raises(InputError, match="full backward"):
        Orders((0,), ((Action(0, "F", 0), Action(0, FULL_BACKWARD, 0)),))
    o = Orders((0,), ((Action(0, "F", 0), Action(0, "B", 0), Action(0, "W", 0)),))
    assert orders_to_torch_csv(o) == "0F0,0B0\r\n"


def test_runtime_makes_torch_actions_from_typed_actions():
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import _Action

    from fxpipe.codegen.runtime import parse_torch_actions, torch_action

    for a in map(Action.parse, ("0F1", "3B2", "1W0", "2BW5")):
        assert torch_action(a) == _Action.from_str(torch_text(a))
    got = parse_torch_actions({0: [Action(0, "F", 0), "0I0"], 1: ["1B0"]}, (0, 1))
    assert {r: [str(a) for a in v] for r, v in got.items()} == {0: ["0F0", "0I0"], 1: ["1B0"]}
    with pytest.raises(InputError, match="placement puts on rank 1"):
        parse_torch_actions({0: ["1F0"]}, (0, 1))
