"""``schedule="auto"``: the best schedule that fits memory, offloading and recomputing only
where memory forces it.

:func:`auto_schedule` is what ``fxpipe.compile`` and ``fxpipe plan`` run by default. It works
on the Contract-3 problem alone (no graph) and returns the problem it finally schedules (with
the activation recomputation it chose, :meth:`ScheduleProblem.with_recompute`) and a valid
schedule of it:

1. **Does memory bind?** Every heuristic that neither offloads nor recomputes and takes the
   placement (one stage per device: ZB-H2, ZB-H1, 1F1B, the Zero Bubble greedy, GPipe;
   several stages per device: ZB-V, DualPipe-V, interleaved 1F1B, the device greedy) is
   generated without a memory limit. If the fastest fits ``mem_limit``, memory costs
   nothing: it is chosen, nothing is offloaded or recomputed, steps 2-4 are skipped.
   Otherwise the limit binds and the same heuristics are generated under it (the Zero
   Bubble greedy adapts its warm-up to the budget; they are candidates like all below).
2. **Fewer in flight, offload** (memory binds): 1F1B with the largest
   warm-up that fits (:func:`limited_1f1b`; one micro-batch at a time,
   :func:`~fxpipe.schedule.milp.feasibility.sequential_schedule`, on other placements);
   with one stage per device, PipeOffload with the fewest offloads that fit
   (``minimal=True``, longest-lived stashes first, Wan et al. 2025 Section 2),
   AdaOffload (OptPipe Appendix D) and the offload-aware list-scheduling search
   (:mod:`fxpipe.schedule.offload_search`), which decides offloads with the compute order.
   They run after step 3 and are skipped when the problem's lower bound
   (:func:`~fxpipe.schedule.bounds.combinatorial_lower_bound`, valid with offload) is above
   the best candidate of steps 1 and 3: none of them could be chosen. On a large problem
   (over :data:`JUMP_MIN_OPS` compute ops) that step 3 fits, only the offload search runs
   (PipeOffload and AdaOffload time a whole schedule per warm-up or offload set), and the
   step-1 heuristics under the limit run after step 3, skipped when the bound of the problem
   without offload is above the best found. PipeOffload, which
   times every warm-up from ``p - 1`` down until one fits, runs last of them and stops at the
   first warm-up whose :func:`limited_1f1b_bound` is above the best found; warm-ups that
   overflow whatever is offloaded (:func:`~fxpipe.schedule.heuristics.warmup_overflow_bytes`)
   are not timed.
3. **Activation checkpointing** (memory binds and ``recompute=True``): every stage has a menu
   of checkpoint options (:attr:`~fxpipe.ir.ScheduleProblem.checkpoint_menu`: none, per-block
   selective / budgeted / full checkpointing, whole-stage recomputation, each with its replay
   time, kept bytes and B peak; :mod:`fxpipe.memory.checkpoint`; the default menu of a problem
   without one is none and whole-stage recomputation, ``recompute_mem_f``). Devices whose
   1F1B-family schedule without offload exceeds their limit (:func:`plain_peak`, simulated
   without a limit) move one stage one step along its :func:`checkpoint_ladder` (options by
   increasing replay time, each keeping fewer bytes than those before): the step that adds the
   least replay time among the device's stages (with the default menu: recomputation of the
   stage with the smallest forward); the step-1 heuristics (else the offload ones, else the
   fewer-in-flight ones) run on the new problem and are candidates; repeated, one more step
   per still-overflowing device each round, until 1F1B fits every device or no step is left.
   1F1B with every stage on one kind (whole-stage recomputation, per-block ``"full"``,
   ``"selective"``; where it saves memory) is a candidate too, so ``auto`` is never worse than
   those common fallbacks (one stage per device).
4. **Choice.** The schedule with the lowest objective among steps 1-3: fewer micro-batches
   in flight costs bubbles, offload is free while the copy stream keeps up, recomputation
   costs one forward per micro-batch of each recomputing stage; the fastest wins.
5. **MILP.** Within ``time_limit_s`` and for problems of at most ``milp_max_ops`` compute
   ops, the OptPipe MILP (:mod:`fxpipe.schedule.milp`) is solved for the chosen problem
   (the recomputation fixed), warm-started from the chosen schedule, unless that schedule
   already meets the combinatorial lower bound. The MILP keeps the warm start when it finds
   nothing better.

``lower_bound_s`` of the result is a proven bound for the returned problem, i.e. for the
chosen recomputation (the flags themselves are not proven optimal); it counts the memory that
recomputation forces (a recomputing stage's pending W passes hold the replayed activations,
part 6 of :mod:`fxpipe.schedule.bounds`). A bound valid for every recomputation choice of the
input problem is :func:`~fxpipe.schedule.bounds.recompute_lower_bound` (not computed here).

References
----------
Qi et al. 2024 (Zero Bubble), Wan et al. 2025 (PipeOffload), OptPipe (Li et al. 2025)
Appendix D and Section 3; Chen et al. 2016 (activation recomputation).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fxpipe.errors import InfeasibleError, InputError, SolverError
from fxpipe.ir import Schedule, ScheduleProblem
import fxpipe.schedule.registry as registry
from fxpipe.schedule.bounds import combinatorial_lower_bound, limited_1f1b_bound
from fxpipe.schedule.device_greedy import min_device_memory
import fxpipe.schedule.heuristics as heuristics
from fxpipe.schedule.heuristics import orders_1f1b
import fxpipe.schedule.milp as milp
from fxpipe.schedule.milp.feasibility import sequential_schedule
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import check_schedule, peak_memory, place_fused_w

__all__ = ["AutoResult", "auto_schedule", "checkpoint_ladder", "least_memory", "limited_1f1b", "plain_peak", "PLAIN_METHODS",
           "PLAIN_MULTI_METHODS", "OFFLOAD_METHODS", "AUTO_MILP_MAX_OPS"]

#: Step 1 with one stage per device (ties: the first); from :mod:`fxpipe.schedule.registry`.
PLAIN_METHODS = registry.auto_candidates("plain", one_stage_per_device=True)
#: Step 1 with several stages on a device (each raises on a placement it does not schedule).
PLAIN_MULTI_METHODS = registry.auto_candidates("plain", one_stage_per_device=False)
#: Step 2 (one stage per device).
OFFLOAD_METHODS = registry.auto_candidates("offload", one_stage_per_device=True)
#: Step 5 runs the MILP only on problems with at most this many compute ops (3 S m).
AUTO_MILP_MAX_OPS = 240


@dataclass(frozen=True)
class AutoResult:
    """What :func:`auto_schedule` chose.

    Attributes
    ----------
    problem : ScheduleProblem
        The scheduled problem: the input with the chosen stages recomputing.
    schedule : Schedule
        Valid for ``problem``; ``method`` is the generator that made it, ``meta["auto"]``
        records the choice (also in :attr:`tried`).
    tried : dict[str, Any]
        Every candidate: ``"<round>/<method>"`` -> objective value (seconds) or the reason
        it failed; rounds are ``unlimited`` (step 1 without a limit), ``plain``,
        ``offload``, ``recompute<i>`` (and ``recompute<i>`` -> the recomputing stages),
        ``milp``; ``binding`` says whether memory binds.
    recompute_stages : tuple[int, ...]
        Stages that checkpoint (replay part or all of their forward during B).
    """

    @property
    def checkpoint(self) -> tuple[str, ...]:
        """The checkpoint option of every stage (``problem.checkpoint``)."""
        return self.problem.checkpoint

    problem: ScheduleProblem
    schedule: Schedule
    tried: dict[str, Any] = field(default_factory=dict)
    recompute_stages: tuple[int, ...] = ()

    @property
    def offloaded(self) -> int:
        """Number of stashes the schedule offloads."""
        return sum(1 for o in self.schedule.ops if o.type == "O")


def _reason(exc: Exception) -> str:
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{type(exc).__name__}: {msg[:200]}"


def _plain_methods(problem: ScheduleProblem) -> tuple[str, ...]:
    return PLAIN_METHODS if problem.one_stage_per_device else PLAIN_MULTI_METHODS


def _degraded(problem: ScheduleProblem, tag: str, tried: dict, beat: float | None = None) -> list[Schedule]:
    """Plain schedules with fewer micro-batches in flight: 1F1B with a limited warm-up, else
    one micro-batch at a time (the least memory any schedule without offload needs).

    ``beat``: the best value found elsewhere; warm-ups whose :func:`limited_1f1b_bound` is
    above it are not timed (nor, when that stops the search, the one-at-a-time fallback,
    whose value is at least the bound of warm-up 0).
    """
    if problem.identity_placement:
        try:
            return [_checked(problem, limited_1f1b(problem, beat=beat), tag, "1f1b-limited", tried)]
        except _CannotBeat as exc:
            tried[f"{tag}/1f1b-limited"] = str(exc)
            return []
        except (InfeasibleError, InputError) as exc:
            tried[f"{tag}/1f1b-limited"] = _reason(exc)
        except _Invalid:
            pass
    return _run(problem, ("sequential",), tag, tried)


class ScheduleCannotBeat(InfeasibleError):
    """Raised by :func:`auto_schedule` with ``beat_s`` when it found no schedule: none of the methods
    it ran (those whose lower bounds are below ``beat_s``) found one that fits."""


class _CannotBeat(InfeasibleError):
    """A candidate skipped because its lower bound is above a schedule already found."""


class _Invalid(Exception):
    pass


def _checked(problem: ScheduleProblem, sched: Schedule, tag: str, m: str, tried: dict) -> Schedule:
    sched = place_fused_w(problem, sched)
    bad = check_schedule(problem, sched)
    if bad:
        tried[f"{tag}/{m}"] = f"invalid: {bad[0][:200]}"
        raise _Invalid
    tried[f"{tag}/{m}"] = float(sched.value)
    return sched


def limited_1f1b(problem: ScheduleProblem, *, beat: float | None = None) -> Schedule:
    """1F1B with the largest uniform warm-up that fits memory, no offload (method ``1f1b-limited``).

    Stage s runs ``min(w, p - s - 1)`` warm-up forwards for ``w = p - 1, ..., 0`` (PipeOffload
    Section 3.2's warm-up knob without its offload); the first that fits is returned. ``w = 0``
    runs one micro-batch at a time per stage, which needs only ``stash_footprint``.

    Parameters
    ----------
    problem : ScheduleProblem
    beat : float, optional
        Stop (raising InfeasibleError) at the first warm-up whose :func:`limited_1f1b_bound`
        exceeds this value: neither it nor any smaller warm-up can do better.

    Raises
    ------
    InputError
        Unless the placement is one stage per device, stage s on device s.
    InfeasibleError
        If no warm-up fits (or none can beat ``beat``).
    """
    if not problem.identity_placement:
        raise InputError("1f1b-limited schedules stage s on device s")
    p, M = problem.num_stages, problem.num_microbatches
    top = p - 1
    if _large(problem) and p > 8:  # start near the largest warm-up that fits: a bisection on the fit
        floor = 0 if beat is None else _least_warmup_within(problem, beat)
        top = _largest_fitting_warmup(problem, floor)
        if top is None:  # no warm-up from the floor up fits, and every one below it is bounded above beat
            lb = limited_1f1b_bound(problem, floor - 1)
            fit = "" if floor >= p else f"warm-up {floor} or more does not fit memory, and "
            raise _CannotBeat(f"skipped: {fit}warm-up {floor - 1} or less is at least {lb:.6g} s (its lower bound), "
                              f"more than the {beat:.6g} s found")
    for w in range(top, -1, -1):
        if beat is not None:
            lb = limited_1f1b_bound(problem, w)
            if lb > beat * (1 + 1e-9) + 1e-12:
                raise _CannotBeat(f"skipped: warm-up {w} or less is at least {lb:.6g} s (its lower bound), "
                                  f"more than the {beat:.6g} s found")
        warm = [min(w, p - s - 1, M) for s in range(p)]
        if heuristics.warmup_overflow_bytes(problem, warm) > 0:
            continue  # check_schedule would refuse it (rule 5): not timed
        sched = simulate(problem, orders_1f1b(p, M, warm), method="1f1b-limited", meta={"warmup": warm})
        if not check_schedule(problem, sched):
            return sched
    raise InfeasibleError("1f1b-limited: not even one micro-batch at a time fits mem_limit")


def _least_warmup_within(problem: ScheduleProblem, beat: float) -> int:
    """The least uniform warm-up ``w`` whose :func:`limited_1f1b_bound` is at most ``beat`` (seconds; the bound
    falls as ``w`` grows: more micro-batches in flight), by bisection; ``p`` when none is."""
    lo, hi = 0, problem.num_stages  # the answer lies in [lo, hi]; hi = p: none
    while lo < hi:
        mid = (lo + hi) // 2
        if limited_1f1b_bound(problem, mid) <= beat * (1 + 1e-9) + 1e-12:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _largest_fitting_warmup(problem: ScheduleProblem, floor: int = 0) -> int | None:
    """The largest uniform 1F1B warm-up at least ``floor`` whose schedule fits memory, by bisection (a warm-up
    holds at least the micro-batches of every smaller one); ``p - 1`` when it fits, 0 when none does
    (``floor`` 0), None when warm-up ``floor > 0`` does not fit (nor then any larger one). Used to start
    :func:`limited_1f1b`'s scan on a large problem, which otherwise times every warm-up from ``p - 1``."""
    p, M = problem.num_stages, problem.num_microbatches

    def fits(w: int) -> bool:
        warm = [min(w, p - s - 1, M) for s in range(p)]
        if heuristics.warmup_overflow_bytes(problem, warm) > 0:
            return False
        return not check_schedule(problem, simulate(problem, orders_1f1b(p, M, warm)))

    if floor >= p or (floor > 0 and not fits(floor)):
        return None
    lo, hi = floor, p - 1  # fits(lo) (assumed for 0); the answer lies in [lo, hi]
    if hi == lo or fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _sequential(problem: ScheduleProblem) -> Schedule:
    return sequential_schedule(problem)


def _run(problem: ScheduleProblem, methods, tag: str, tried: dict, beat: float | None = None) -> list[Schedule]:
    out = []
    for m in methods:
        try:
            if m == "pipeoffload":
                sched = heuristics.pipeoffload(problem, minimal=True, beat=beat)
            elif m == "1f1b-limited":
                sched = limited_1f1b(problem)
            elif m == "sequential":
                sched = _sequential(problem)
            else:
                sched = heuristics.generate(problem, m)
        except (InfeasibleError, InputError) as exc:
            tried[f"{tag}/{m}"] = _reason(exc)
            continue
        sched = place_fused_w(problem, sched)  # a fused stage's W right after its B (one full backward)
        bad = check_schedule(problem, sched)
        if bad:  # over the limit (the sequential fallback), or a generator's bug: never used
            tried[f"{tag}/{m}"] = f"invalid: {bad[0][:200]}"
            continue
        tried[f"{tag}/{m}"] = float(sched.value)
        out.append(sched)
    return out


def _best_value(cands: list[tuple[ScheduleProblem, Schedule]]) -> float | None:
    """The best objective value among ``cands`` (None if there is none)."""
    return min((s.value for _, s in cands), default=None)


def _run_unless_hopeless(problem: ScheduleProblem, methods, tag: str, tried: dict, beat: float | None,
                         bound_problem: ScheduleProblem | None = None) -> list[Schedule]:
    """:func:`_run`, unless the problem's lower bound (:func:`combinatorial_lower_bound`, valid
    for every schedule of it, offloading or not; of ``bound_problem`` when given, e.g. the problem
    without offload for methods that never offload) is above ``beat``, a value already found:
    then no method can give the best candidate, and each is recorded as skipped. PipeOffload
    runs after the others, with the best of ``beat`` and their values as its ``beat``."""
    if beat is not None:
        lb = combinatorial_lower_bound(problem if bound_problem is None else bound_problem)
        if lb > beat * (1 + 1e-9) + 1e-12:
            for m in methods:
                tried[f"{tag}/{m}"] = (f"skipped: every schedule of this problem takes at least {lb:.6g} s "
                                       f"(its lower bound), more than the {beat:.6g} s found")
            return []
    if "pipeoffload" not in methods or len(methods) == 1:
        return _run(problem, methods, tag, tried, beat)
    # PipeOffload (the costly one: every warm-up from p - 1 down until one fits) runs last,
    # against the best of the others too; results and `tried` keep the methods' order
    others = [m for m in methods if m != "pipeoffload"]
    sub: dict = {}
    got = dict(zip(others, _run_each(problem, others, tag, sub)))
    best = min([beat] * (beat is not None) + [s.value for s in got.values() if s is not None], default=None)
    got["pipeoffload"] = _run_each(problem, ["pipeoffload"], tag, sub, best)[0]
    for m in methods:
        tried[f"{tag}/{m}"] = sub[f"{tag}/{m}"]
    return [got[m] for m in methods if got[m] is not None]


def _run_each(problem: ScheduleProblem, methods, tag: str, tried: dict, beat: float | None = None) -> list[Schedule | None]:
    """:func:`_run` method by method: the schedule of each, None where it failed."""
    return [(found[0] if found else None) for found in (_run(problem, [m], tag, tried, beat) for m in methods)]


def _best(cands: list[tuple[ScheduleProblem, Schedule]]) -> tuple[ScheduleProblem, Schedule] | None:
    best = None
    for p, s in cands:
        if best is None or s.value < best[1].value - 1e-12 * max(1.0, abs(best[1].value)):
            best = (p, s)
    return best


def _can_offload(problem: ScheduleProblem) -> bool:
    lim = np.asarray(problem.mem_limit)[np.asarray(problem.device_of_stage)]
    return problem.one_stage_per_device and bool(np.any((np.asarray(problem.offload_bytes) > 0) & np.isfinite(lim)))


def plain_peak(problem: ScheduleProblem) -> np.ndarray:
    """Activation peak of every device under the 1F1B family without offload (float64 (D,)).

    One stage per device: 1F1B's orders; several: the least peak of the multi-stage
    generators that take the placement (ZB-V, DualPipe-V, interleaved 1F1B), each timed
    without a memory limit; when none applies, the one-micro-batch-at-a-time minimum
    (:func:`fxpipe.schedule.device_greedy.min_device_memory`).
    """
    free = problem.replace(mem_limit=math.inf)
    if problem.one_stage_per_device and problem.identity_placement:
        sched = simulate(free, orders_1f1b(problem.num_stages, problem.num_microbatches))
        return peak_memory(free, sched)
    best = None
    for m in PLAIN_MULTI_METHODS:
        if "any" in registry.get(m).placements:  # the placement-specific ones (not the device greedy)
            continue
        try:
            peak = peak_memory(free, heuristics.generate(free, m))
        except (InfeasibleError, InputError):
            continue
        best = peak if best is None else np.minimum(best, peak)
    return min_device_memory(problem, offload=False) if best is None else best


def _uniform_1f1b(problem: ScheduleProblem, tried: dict, beat: float | None = None) -> list[tuple[ScheduleProblem, Schedule]]:
    """1F1B with every stage on one checkpoint kind where it saves memory: ``"stage"`` (whole-stage
    recomputation, the practitioners' old fallback), ``"full"`` and ``"selective"`` per block
    (torchtitan's two AC modes); candidates so that ``auto`` is never worse than them (one stage per
    device). A kind whose problem's lower bound is above ``beat`` (seconds, a value already found) is not
    timed: it cannot be the best."""
    if problem.num_devices != problem.num_stages:
        return []
    out = []
    for name, tag in (("stage", "recompute-all"), ("full", "full-all"), ("selective", "selective-all")):
        choice = {s: name for s in range(problem.num_stages) if problem.checkpoint[s] == "none"
                  and any(o.name == name and o.kept_bytes < problem.checkpoint_option(s).kept_bytes
                          for o in problem.checkpoint_menu[s])}
        if not choice:
            continue
        uniform = problem.with_checkpoint(choice)
        out += [(uniform, s) for s in _run_unless_hopeless(uniform, ("1f1b",), tag, tried, beat)]
    return out


def _footprint(problem: ScheduleProblem, stage: int, opt, least: int = 1) -> float:
    """Memory of ``stage`` under 1F1B running checkpoint option ``opt``: ``n = min(S - s, m)`` (at least
    ``least``) micro-batches in flight, ``n - 1`` of them kept and the oldest in its B (its level; without
    checkpointing a B only frees)."""
    c = float(problem.pooled_bytes[stage])
    n = max(1, least, min(problem.num_stages - stage, problem.num_microbatches))
    return (n - 1) * (opt.kept_bytes + c) + (opt.b_level(c) if opt.name != "none" else opt.kept_bytes + c)


def checkpoint_ladder(problem: ScheduleProblem, stage: int) -> list[str]:
    """The options ``auto`` steps ``stage`` through, from the one it runs: by increasing replay time (a split
    backward before a fused one: its W can still fill bubbles), each needing less memory under 1F1B than
    every option before it (``max(2, min(S - s, m))`` micro-batches in
    flight, the oldest in its B: :func:`_footprint`), the Pareto front of replay time and footprint of its
    :attr:`~fxpipe.ir.ScheduleProblem.checkpoint_menu`. The footprint falls strictly along it, so the steps
    of ``auto`` never cycle."""
    cur = problem.checkpoint_option(stage)

    def footprint(o) -> float:  # at least two in flight: the stash kept beside a B is what a device adds up
        return _footprint(problem, stage, o, least=2)

    opts = sorted((o for o in problem.checkpoint_menu[stage] if o.name != "none" and o.replay_s >= cur.replay_s),
                  key=lambda o: (o.replay_s, o.fused, footprint(o), o.name))  # split before fused: W may fill bubbles
    out, foot = [cur.name], footprint(cur)
    for o in opts:  # the footprint falls strictly along a ladder: steps never cycle
        if o.name != cur.name and footprint(o) < foot * (1 - 1e-12):
            out.append(o.name)
            foot = footprint(o)
    return out


#: Problems of more compute ops than this (3 S m) start checkpointing with :func:`_jump_checkpoint`.
JUMP_MIN_OPS = 300


def _large(problem: ScheduleProblem) -> bool:
    return 3 * problem.num_stages * problem.num_microbatches > JUMP_MIN_OPS


def _overflows_1f1b(problem: ScheduleProblem, free: ScheduleProblem, tried: dict) -> bool:
    """Whether 1F1B without a limit overflows ``problem``'s (recorded in ``tried`` as the unlimited round's)."""
    got = _run(free, ("1f1b",), "unlimited", tried)
    return not got or bool(check_schedule(problem, got[0]))


def least_memory(problem: ScheduleProblem) -> ScheduleProblem:
    """``problem`` with every stage on the option of its menu whose one micro-batch needs the least memory
    (``max(kept + pooled, B's level)``, :attr:`~fxpipe.ir.ScheduleProblem.stash_footprint`), if that is less
    than what it runs: the floor of every checkpoint choice (:func:`fxpipe.schedule.device_greedy.min_device_memory`
    of it)."""
    choice = {}
    for s in range(problem.num_stages):
        c = float(problem.pooled_bytes[s])
        cur = float(problem.stash_footprint[s])
        best = min(((max(o.kept_bytes + c, o.b_level(c)), o.name) for o in problem.checkpoint_menu[s]
                    if o.name != "none"), default=None)
        if best is not None and best[0] < cur * (1 - 1e-12):
            choice[s] = best[1]
    return problem.with_checkpoint(choice) if choice else problem


def _jump_checkpoint(problem: ScheduleProblem) -> dict[int, str]:
    """The first round of checkpointing on a pipeline of one stage per device (stage s on device s): every
    stage whose device overflows under 1F1B takes the first option of its :func:`checkpoint_ladder` whose
    1F1B footprint (:func:`_footprint`) fits the device's limit, else the ladder's last; the steps of
    :func:`_next_checkpoint` refine it. With many stages far over their limits (a deep pipeline of a large
    model) this reaches in one round what steps would in many, each scheduling the whole pipeline."""
    if not problem.identity_placement:
        return {}
    peak = plain_peak(problem)
    lim = np.asarray(problem.mem_limit, dtype=float)
    out: dict[int, str] = {}
    for s in np.flatnonzero(peak > lim * (1 + 1e-12)):
        s = int(s)
        ladder = checkpoint_ladder(problem, s)
        if len(ladder) < 2:
            continue
        fit = [n for n in ladder[1:] if _footprint(problem, s, problem.checkpoint_option(s, n)) <= lim[s]]
        out[s] = fit[0] if fit else ladder[-1]
    return out


def _next_checkpoint(problem: ScheduleProblem) -> dict[int, str]:
    """One more step of checkpointing on every device whose plain peak exceeds its limit: among the device's
    stages, the next option of its :func:`checkpoint_ladder` that adds the least replay time (ties: the
    lower stage). With the default menu (none, stage) this recomputes the stage with the cheapest forward."""
    peak = plain_peak(problem)
    lim = np.asarray(problem.mem_limit, dtype=float)
    add: dict[int, str] = {}
    for d in np.flatnonzero(peak > lim * (1 + 1e-12)):
        moves = []
        for s in problem.stages_of_device(int(d)):
            ladder = checkpoint_ladder(problem, s)
            if len(ladder) > 1:
                nxt = problem.checkpoint_option(s, ladder[1])
                moves.append((nxt.replay_s - problem.checkpoint_option(s).replay_s, s, nxt.name))
        if moves:
            _, s, name = min(moves)
            add[s] = name
    return add


def auto_schedule(
    problem: ScheduleProblem,
    *,
    recompute: bool = True,
    time_limit_s: float = 10.0,
    milp_max_ops: int = AUTO_MILP_MAX_OPS,
    progress: bool = False,
    beat_s: float | None = None,
) -> AutoResult:
    """The best schedule of ``problem`` that fits its memory limits (module docstring).

    Parameters
    ----------
    problem : ScheduleProblem
        Contract-3 problem; its ``recompute_mem_f`` says what recomputation would save.
    recompute : bool
        Allow step 3, activation checkpointing from the problem's menus (otherwise the returned
        problem is ``problem`` itself).
    time_limit_s : float
        MILP budget of step 5 in seconds (0: no MILP).
    milp_max_ops : int
        Largest problem (3 S m compute ops) the MILP is tried on.
    progress : bool
        MILP progress bar.
    beat_s : float, optional
        A value found elsewhere (seconds; the mesh search's best predicted step, which every
        candidate's predicted step is at least its schedule's value): methods and checkpoint rounds
        whose own lower bound (:func:`~fxpipe.schedule.bounds.combinatorial_lower_bound`, or the
        limited warm-ups' bound) is above it are not run, as methods are skipped against the best
        found here. Schedules below ``beat_s`` are found exactly as without it.

    Returns
    -------
    AutoResult

    Raises
    ------
    ScheduleCannotBeat
        With ``beat_s``, when no schedule was found: every method either could not beat it by its
        bound or found nothing that fits.
    InfeasibleError
        When no candidate fits: the message names the device that overflows most in the
        least-memory attempt and by how many bytes, and whether offload / recomputation were
        tried.
    """
    t0 = time.perf_counter()

    def _beat(found: list[tuple[ScheduleProblem, Schedule]]) -> float | None:
        """The value a method must beat: the best of ``found`` and ``beat_s``."""
        v = _best_value(found)
        return beat_s if v is None else (v if beat_s is None else min(v, beat_s))

    tried: dict[str, Any] = {}
    cands: list[tuple[ScheduleProblem, Schedule]] = []
    free = problem.replace(mem_limit=math.inf)
    large = _large(problem)
    methods = _plain_methods(problem)
    if large and "1f1b" in methods and _overflows_1f1b(problem, free, tried):
        # a large problem whose 1F1B overflows: the others hold at least as much without a limit
        for m in methods:
            tried.setdefault(f"unlimited/{m}", "skipped: 1F1B already overflows mem_limit and holds the least of them")
        free_best = None
    else:
        free_best = _best([(problem, s) for s in _run(free, methods, "unlimited", tried)])
    if free_best is not None and not check_schedule(problem, free_best[1]):
        cands.append(free_best)  # memory does not bind: nothing to offload or recompute
        tried["binding"] = False
    else:
        tried["binding"] = True
        if not (large and recompute):  # a large one's plain schedules run after the checkpoint rounds, if they can win
            cands += [(problem, s) for s in _run(problem, methods, "plain", tried)]
        # fewer in flight (1F1B with a smaller warm-up) is tried last, against the best of the
        # others: warm-ups that provably cannot beat it are not timed; the offload heuristics
        # (the costly ones) run after the recomputation rounds, and not at all when the
        # problem's lower bound is above the best found; results and `tried` keep their order
        at, tried_head = len(cands), dict(tried)
        tried.clear()
        rounds: list[tuple[ScheduleProblem, Schedule]] = []
        if recompute:
            cur = problem
            max_rounds = sum(len(problem.checkpoint_menu[s]) for s in range(problem.num_stages))
            for rnd in range(1, max_rounds + 1):
                add = (_jump_checkpoint(cur) if rnd == 1 and _large(cur) else {}) or _next_checkpoint(cur)
                if not add:
                    tried[f"recompute{rnd}"] = "1F1B fits every device, or no stage is left whose checkpointing saves memory"
                    break
                cur = cur.with_checkpoint(add)
                tag = f"recompute{rnd}"
                tried[tag] = list(cur.recompute_stages)
                if any(c not in ("none", "stage") for c in cur.checkpoint):
                    tried[f"checkpoint{rnd}"] = {s: c for s, c in enumerate(cur.checkpoint) if c != "none"}
                if beat_s is not None:  # this round's methods only where they may beat beat_s
                    found = [(cur, s) for s in _run_unless_hopeless(cur, _plain_methods(cur), tag, tried, beat_s)]
                else:
                    found = [(cur, s) for s in _run(cur, _plain_methods(cur), tag, tried)]
                if not found and not large and _can_offload(cur):
                    found = [(cur, s) for s in _run_unless_hopeless(cur, OFFLOAD_METHODS, tag, tried, _beat(cands + rounds))]
                if not found and not large:  # a large problem: fewer in flight only after the last round
                    found = [(cur, s) for s in _degraded(cur, tag, tried, beat=_beat(cands + rounds))]
                rounds += found
            if large and not rounds and cur is not problem:
                rounds += [(cur, s) for s in _degraded(cur, tag, tried, beat=_beat(cands))]
            rounds += _uniform_1f1b(problem, tried, _beat(cands + rounds))
        if large and recompute:  # bounded as schedules without offload (none of these offloads)
            cands += [(problem, s) for s in _run_unless_hopeless(problem, methods, "plain", tried, _beat(rounds),
                                                                  bound_problem=problem.replace(offload_bytes=0.0))]
        tried_rounds = dict(tried)
        tried.clear()
        if _can_offload(problem):
            # a large problem that checkpointing fits runs only the offload search, which decides offloads with
            # the compute order (PipeOffload and AdaOffload time a whole schedule per warm-up / offload set)
            offload = OFFLOAD_METHODS if not (large and rounds) else tuple(m for m in OFFLOAD_METHODS if m == "offload-search")
            for m in OFFLOAD_METHODS:
                if m not in offload:
                    tried[f"offload/{m}"] = "skipped: a large problem that activation checkpointing fits (offload-search runs)"
            cands += [(problem, s) for s in _run_unless_hopeless(problem, offload, "offload", tried,
                                                                 _beat(cands + rounds))]
        tried_offload = dict(tried)
        tried.clear()
        tried.update(tried_head)
        cands += rounds
        beat = _beat(cands)
        cands[at:at] = [(problem, s) for s in _degraded(problem, "plain", tried, beat=beat)]
        tried.update(tried_offload)
        tried.update(tried_rounds)
    chosen = _best(cands)
    if chosen is None and beat_s is not None:
        raise ScheduleCannotBeat(f"no schedule found that may beat {beat_s:.6g} s: the methods whose lower bounds "
                                 "allow it found none that fits", tried=tried)
    if chosen is None:
        least = least_memory(problem) if recompute else problem
        floor = np.minimum(min_device_memory(problem, offload=True), min_device_memory(least, offload=True))
        lim = np.asarray(problem.mem_limit, dtype=float)
        d = int(np.argmax(floor - lim))
        need = float(floor[d])
        what = ("plain schedules" + (", offload" if _can_offload(problem) else "")
                + (", activation checkpointing" if recompute else ""))
        if need > lim[d]:
            msg = (f"no schedule fits: device {d} needs at least {need:.6g} bytes of activations for one micro-batch, "
                   f"over its limit {lim[d]:.6g} by {need - lim[d]:.6g}")
        else:
            peak = plain_peak(problem)
            d = int(np.argmax(peak - lim))
            msg = (f"no schedule found that fits: device {d} holds {peak[d]:.6g} bytes of activations under 1F1B, "
                   f"over its limit {lim[d]:.6g} by {peak[d] - lim[d]:.6g}, and no heuristic fit it")
        raise InfeasibleError(f"{msg} (tried {what}); raise the memory, use more devices or fewer micro-batches in flight",
                              tried=tried)
    best_p, best_s = chosen
    bound = combinatorial_lower_bound(best_p)
    n_ops = 3 * best_p.num_stages * best_p.num_microbatches
    if time_limit_s > 0 and n_ops <= milp_max_ops and best_s.value > bound * (1 + 1e-6):
        try:
            ms = place_fused_w(best_p, milp.solve(best_p, time_limit_s=time_limit_s, warm_start=best_s,
                                                  progress=progress))
            if check_schedule(best_p, ms):
                raise SolverError("the MILP returned a schedule that breaks Contract 3")
            tried["milp"] = {"value_s": float(ms.value), "status": ms.status, "lower_bound_s": float(ms.lower_bound_s)}
            bound = max(bound, float(ms.lower_bound_s))
            if ms.value < best_s.value - 1e-12 * max(1.0, abs(best_s.value)):
                best_s = ms
            elif ms.status == "optimal":  # the MILP proved the heuristic schedule optimal
                best_s = dataclasses.replace(best_s, status="optimal")
        except (SolverError, InfeasibleError, InputError) as exc:
            tried["milp"] = _reason(exc)
    elif time_limit_s > 0:
        tried["milp"] = ("skipped: the schedule meets the lower bound" if best_s.value <= bound * (1 + 1e-6)
                         else f"skipped: {n_ops} compute ops > {milp_max_ops}")
    if best_s.value <= bound * (1 + 1e-6) and best_s.status != "optimal":  # its own proven bound: optimal
        best_s = dataclasses.replace(best_s, status="optimal")
    rec = best_p.recompute_stages
    meta = {**best_s.meta, "auto": {"tried": tried, "recompute_stages": list(rec),
                                     "checkpoint": list(best_p.checkpoint),
                                     "offloaded": sum(1 for o in best_s.ops if o.type == "O")}}
    sched = dataclasses.replace(best_s, lower_bound_s=max(float(best_s.lower_bound_s), bound), meta=meta,
                                solver_time_s=time.perf_counter() - t0, objective=best_p.objective)
    return AutoResult(problem=best_p, schedule=sched, tried=tried, recompute_stages=rec)
