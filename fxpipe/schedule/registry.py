"""The one registry of schedule methods: every list of schedule names derives from it.

A schedule method is named once, here, with what it needs to know about itself: the function
that generates it, the placements it schedules, whether it offloads, its role in
``schedule="auto"`` and its rank as a MILP warm start. ``fxpipe.compile(schedule=...)``'s
choices (:data:`fxpipe.api.SCHEDULES`), the CLI's ``--method`` / ``--schedule`` choices,
:data:`fxpipe.schedule.dispatch.METHODS`, :data:`fxpipe.schedule.heuristics.METHODS` /
``V_METHODS`` / ``ALL_METHODS``, ``auto``'s candidate lists and the warm-start order are all
read from :data:`REGISTRY`. Adding a schedule is one :class:`ScheduleMethod` entry (and its
generator); ``tests/test_schedule_registry.py`` checks that the derived lists agree.

This module is a leaf (no fxpipe imports, no torch): generators are named as
``"module:function"`` and imported when first called, so the registry never creates an
import cycle.

Placements (``ScheduleMethod.placements``)
------------------------------------------
``"one"``: one stage per device (any ``device_of_stage`` with ``D = S``); ``"looped"``: stage
``s`` on device ``s mod p`` with ``v >= 1`` stages per device (``v = 1`` is the identity
placement, where ``interleaved-1f1b`` is 1F1B); ``"v"``: the V placement with two stages per
device (``d`` and ``2p - 1 - d``); ``"any"``: every placement. The kinds of a concrete
placement: :func:`fxpipe.schedule.dispatch.placement_kinds`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "ScheduleMethod",
    "REGISTRY",
    "get",
    "names",
    "heuristic_names",
    "auto_candidates",
    "warm_start_order",
    "default_for",
    "PLACEMENT_KINDS",
]

#: The placement kinds a method can admit (module docstring).
PLACEMENT_KINDS = ("one", "looped", "v", "any")


@dataclass(frozen=True)
class ScheduleMethod:
    """One schedule method.

    Attributes
    ----------
    name : str
        The user-facing name (``"zb-h1"``); lower case.
    kind : {"heuristic", "milp", "auto"}
        A heuristic is a function ``ScheduleProblem -> Schedule``
        (:func:`fxpipe.schedule.heuristics.generate`); ``milp`` and ``auto`` are dispatched by
        :func:`fxpipe.schedule.dispatch.make_schedule`.
    placements : tuple of str
        Kinds of :data:`PLACEMENT_KINDS` it schedules.
    generator : str
        ``"module:function"`` of a heuristic's generator (empty for ``milp`` / ``auto``).
    offloads : bool
        Whether its schedules may carry O/R ops.
    auto_step : {"plain", "offload", None}
        Where ``schedule="auto"`` tries it (:func:`fxpipe.schedule.auto.auto_schedule`):
        step 1 (plain schedules) or step 2 (offloading, one stage per device).
    auto_rank : int
        Order within its auto step (ties: the first).
    warm_rank : int or None
        Order in which the MILP's warm start tries it (None: never).
    default_rank : int or None
        ``fxpipe.compile``'s default on a placement: the admitted method with the smallest
        rank (``greedy`` schedules every placement, so a default always exists).
    reference : str
        Where the algorithm comes from.
    """

    name: str
    kind: str
    placements: tuple[str, ...]
    generator: str = ""
    offloads: bool = False
    auto_step: str | None = None
    auto_rank: int = 0
    warm_rank: int | None = None
    default_rank: int | None = None
    reference: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("heuristic", "milp", "auto"):
            raise ValueError(f"{self.name}: kind must be heuristic, milp or auto, got {self.kind!r}")
        bad = [p for p in self.placements if p not in PLACEMENT_KINDS]
        if bad or not self.placements:
            raise ValueError(f"{self.name}: placements must be a non-empty subset of {PLACEMENT_KINDS}, got {self.placements}")
        if (self.kind == "heuristic") != bool(self.generator):
            raise ValueError(f"{self.name}: a heuristic names its generator, milp/auto do not")
        if self.auto_step not in (None, "plain", "offload"):
            raise ValueError(f"{self.name}: auto_step must be plain, offload or None, got {self.auto_step!r}")

    def admits(self, placement_kinds: set[str] | frozenset[str]) -> bool:
        """Whether it schedules a placement of the given kinds (see :func:`fxpipe.schedule.dispatch.placement_kinds`)."""
        return "any" in self.placements or bool(set(self.placements) & set(placement_kinds))

    def generate(self, problem: Any) -> Any:
        """Run the generator (heuristics only): ``ScheduleProblem -> Schedule``."""
        if self.kind != "heuristic":
            raise TypeError(f"{self.name} is not a heuristic; use fxpipe.schedule.dispatch.make_schedule")
        return _resolve(self.generator)(problem)


_RESOLVED: dict[str, Callable] = {}


def _resolve(path: str) -> Callable:
    fn = _RESOLVED.get(path)
    if fn is None:
        module, _, attr = path.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        _RESOLVED[path] = fn
    return fn


_H = "fxpipe.schedule.heuristics"
_M = "fxpipe.schedule.multistage"

#: Every schedule method, in the order the user-facing lists show them.
REGISTRY: tuple[ScheduleMethod, ...] = (
    ScheduleMethod("gpipe", "heuristic", ("one",), f"{_H}:gpipe", auto_step="plain", auto_rank=4, warm_rank=7,
                   reference="Huang et al., GPipe, NeurIPS 2019"),
    ScheduleMethod("1f1b", "heuristic", ("one",), f"{_H}:one_f_one_b", auto_step="plain", auto_rank=2, warm_rank=4,
                   reference="Narayanan et al., PipeDream-flush (2021); Fan et al., DAPPLE (2021)"),
    ScheduleMethod("zb-h1", "heuristic", ("one",), f"{_H}:zb_h1", auto_step="plain", auto_rank=1, warm_rank=3,
                   default_rank=0, reference="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, Section 2.1"),
    ScheduleMethod("zb-h2", "heuristic", ("one",), f"{_H}:zb_h2", auto_step="plain", auto_rank=0, warm_rank=2,
                   reference="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, Section 2.2"),
    ScheduleMethod("pipeoffload", "heuristic", ("one",), f"{_H}:pipeoffload", offloads=True, auto_step="offload",
                   auto_rank=0, warm_rank=6, reference="Wan et al., PipeOffload (2025)"),
    ScheduleMethod("adaoffload", "heuristic", ("one",), f"{_H}:adaoffload", offloads=True, auto_step="offload",
                   auto_rank=1, warm_rank=0, reference="OptPipe (2025), adaptive offload heuristic"),
    ScheduleMethod("offload-search", "heuristic", ("one",), f"{_H}:offload_search_schedule", offloads=True,
                   auto_step="offload", auto_rank=2, warm_rank=1,
                   reference="fxpipe.schedule.offload_search (list scheduling with a policy search)"),
    ScheduleMethod("greedy", "heuristic", ("any",), f"{_H}:greedy", auto_step="plain", auto_rank=3, warm_rank=5,
                   default_rank=3, reference="Qi et al. 2024, Section 3 (automatic scheduling)"),
    ScheduleMethod("interleaved-1f1b", "heuristic", ("looped",), f"{_M}:interleaved_1f1b",
                   auto_step="plain", auto_rank=2, warm_rank=9, default_rank=2,
                   reference="Narayanan et al., Megatron-LM, SC 2021 (interleaved schedule)"),
    ScheduleMethod("zb-v", "heuristic", ("v",), f"{_M}:zb_v", auto_step="plain", auto_rank=0, warm_rank=8,
                   default_rank=1, reference="Qi et al., Pipeline Parallelism with Controllable Memory, NeurIPS 2024"),
    ScheduleMethod("dualpipe-v", "heuristic", ("v",), f"{_M}:dualpipe_v", auto_step="plain", auto_rank=1,
                   warm_rank=10, reference="DeepSeek-V3 technical report (2024), DualPipe; the V variant"),
    ScheduleMethod("milp", "milp", ("any",), reference="OptPipe (2025) MILP; PipeOffload offload variables"),
    ScheduleMethod("auto", "auto", ("any",), reference="fxpipe.schedule.auto.auto_schedule"),
)

_BY_NAME = {m.name: m for m in REGISTRY}


def get(name: str) -> ScheduleMethod:
    """The method called ``name`` (case-insensitive).

    Raises
    ------
    KeyError
        For an unknown name (callers turn it into an :class:`fxpipe.errors.InputError`).
    """
    return _BY_NAME[str(name).lower()]


def names(kind: str | None = None) -> tuple[str, ...]:
    """Every method name (of one ``kind`` if given), in registry order."""
    return tuple(m.name for m in REGISTRY if kind is None or m.kind == kind)


def heuristic_names(placement: str | None = None) -> tuple[str, ...]:
    """Heuristics in registry order; with ``placement``, those whose placements include it."""
    return tuple(m.name for m in REGISTRY if m.kind == "heuristic" and (placement is None or placement in m.placements))


def auto_candidates(step: str, one_stage_per_device: bool) -> tuple[str, ...]:
    """The methods ``schedule="auto"`` tries in ``step`` (``"plain"`` / ``"offload"``), in order.

    With one stage per device: the step's one-stage methods (``interleaved-1f1b`` is 1F1B
    there and is left out); otherwise the step's multi-stage methods (``looped``, ``v``,
    ``any``), each of which raises on a placement it does not schedule.
    """
    if one_stage_per_device:
        sel = [m for m in REGISTRY if m.auto_step == step and ("one" in m.placements or "any" in m.placements)]
    else:
        sel = [m for m in REGISTRY if m.auto_step == step and (set(m.placements) & {"looped", "v", "any"})]
        # multi-stage order: the V schedules first, then looped, then any (best first on ties)
        group = {"v": 0, "looped": 1, "any": 2}
        sel.sort(key=lambda m: (min(group.get(p, 3) for p in m.placements), m.auto_rank))
        return tuple(m.name for m in sel)
    sel.sort(key=lambda m: m.auto_rank)
    return tuple(m.name for m in sel)


def warm_start_order() -> tuple[str, ...]:
    """Heuristics the MILP warm start tries, in order of preference on ties."""
    sel = sorted((m for m in REGISTRY if m.warm_rank is not None), key=lambda m: m.warm_rank)
    return tuple(m.name for m in sel)


def default_for(admitted: tuple[str, ...] | list[str]) -> str:
    """``fxpipe.compile``'s default among the ``admitted`` methods (smallest ``default_rank``)."""
    ranked = sorted((m for m in REGISTRY if m.name in admitted and m.default_rank is not None),
                    key=lambda m: m.default_rank)
    return ranked[0].name if ranked else "greedy"
