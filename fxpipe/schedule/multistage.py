"""Schedules with several stages per device: interleaved 1F1B, ZB-V and DualPipe-V.

Each generator builds per-device :class:`~fxpipe.ir.Orders`, times them with
:func:`fxpipe.schedule.simulate.simulate` and checks them with the Contract-3 validator. It
returns a valid schedule under ``mem_limit`` or raises :class:`~fxpipe.errors.InfeasibleError`
saying which device does not fit and by how much; a problem whose placement is not the one a
schedule is defined for is refused with :class:`~fxpipe.errors.InputError`.

``interleaved-1f1b`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Section 2.2; torch's ``ScheduleInterleaved1F1B``)
    Looped placement, v >= 1 stages per device (stage s on device s mod p). Micro-batches go
    in ``max(1, m // p)`` rounds of about ``r = m / rounds >= p`` micro-batches (torch's rule;
    sizes may differ by one where torch refuses m); device d runs the forwards of round 0 on its chunk 0,
    then chunk 1, ..., then round 1, and the backwards in the same rounds with the chunks
    reversed. ``(v - 1) r + 2 (p - 1 - d)`` warm-up forwards (r of the first round), then
    one forward and one (fused, W right after B) backward alternately, then the remaining
    backwards. When memory does not fit, the
    device-dependent part of the warm-up is lowered (down to ``(v - 1) r``, the least that
    lets the first backward's micro-batch through every chunk).
``zb-v`` (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", Section 3 / 6;
torch's ``ScheduleZBVZeroBubble``)
    V placement with 2 stages per device (stages d and 2p-1-d on device d). Candidates: the
    reference ZB-V order (warm-up of ``2(p-d)-1`` chunk-0 forwards, then ``d`` pairs of
    chunk-1/chunk-0 forwards, ``p-d`` chunk-1 F/B/W triples, a steady state of
    F0 B0 W0 F1 B1 W1, and a cool-down that defers W's), which has 1F1B's peak memory
    (``2p`` chunk stashes = p full-device activations on the worst device) and zero bubble
    when F = B = W; and the memory-aware greedy
    (:mod:`fxpipe.schedule.device_greedy`, the ZB-V paper's Section 4 approach) under the
    budget "the reference order's peak, capped by the limit". The better valid one is kept,
    so ZB-V degrades gracefully under tighter memory.
``dualpipe-v`` (DeepSeek-AI 2024, DeepSeek-V3 technical report Section 3.2.1, "DualPipe"; the
cut-in-half "DualPipeV" of github.com/deepseek-ai/DualPipe; torch's ``ScheduleDualPipeV``)
    V placement with 2 stages per device and m >= 2p. The eight-step DualPipeV order:
    ``2(p-d-1)`` chunk-0 forwards, ``d+1`` F0/F1 pairs, ``p-d-1`` zero-bubble B1 W F1 steps,
    the main phase of overlapped forward/backward pairs F0+B1, F1+B0, then B1 + (F1+B0),
    B1 B0 (second half split B/W), W B0 and the remaining W's. fxpipe's devices run one
    compute op at a time (Contract 3 rule 3), so an overlapped pair runs as its forward
    followed by its full backward (B then W); the order and its memory footprint
    (``PP + 1`` activations in DualPipe's accounting) are DualPipe-V's.
"""

from __future__ import annotations

import time

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Action, Orders, Schedule, ScheduleProblem, looped_placement, v_placement
from fxpipe.schedule.device_greedy import device_greedy
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import InvalidScheduleError, check_schedule, peak_memory

__all__ = [
    "interleaved_rounds",
    "orders_interleaved_1f1b",
    "orders_zbv",
    "orders_dualpipe_v",
    "interleaved_1f1b",
    "zb_v",
    "dualpipe_v",
]


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _placement_of(problem: ScheduleProblem, kind: str, method: str) -> tuple[int, int]:
    """(p, v) of a problem whose placement is ``kind`` ("looped" or "v"), else InputError."""
    p, S = problem.num_devices, problem.num_stages
    if S % p:
        raise InputError(f"{method} needs the same number of stages on every device; {S} stages on {p} devices")
    v = S // p
    want = looped_placement(p, v) if kind == "looped" else v_placement(p, v)
    if tuple(problem.device_of_stage) != want:
        shape = "looped (stage s on device s mod p)" if kind == "looped" else "V-shape (stages d and 2p-1-d on device d)"
        raise InputError(
            f"{method} needs the {shape} placement {list(want)}, the problem has {list(problem.device_of_stage)}: "
            "use a generator for this placement (greedy, milp)"
        )
    return p, v


def _finish(problem: ScheduleProblem, sched: Schedule, t0: float, method: str, meta: dict | None = None) -> Schedule:
    """Validate; memory overflow -> InfeasibleError naming the device, anything else is a bug."""
    errs = check_schedule(problem, sched)
    if errs:
        if any(not e.startswith("rule 5") for e in errs):
            raise InvalidScheduleError(errs, method)
        peak = peak_memory(problem, sched)
        d = int(np.argmax(peak - problem.mem_limit))
        st = problem.stages_of_device(d)
        where = f"stage {st[0]} (device {d})" if len(st) == 1 else f"device {d} (stages {list(st)})"
        raise InfeasibleError(
            f"{method}: {where} needs {peak[d]:.6g} bytes of activation memory, over its limit "
            f"{float(problem.mem_limit[d]):.6g} by {peak[d] - float(problem.mem_limit[d]):.6g}; raise mem_limit or use "
            "greedy / zb-v (memory-aware) or the MILP"
        )
    return Schedule(ops=sched.ops, makespan=sched.makespan, stage_span=sched.stage_span, status="heuristic",
                    solver_time_s=time.perf_counter() - t0, method=method, objective=problem.objective,
                    meta={**sched.meta, **(meta or {})})


def _fits(problem: ScheduleProblem, sched: Schedule) -> bool:
    return not check_schedule(problem, sched)


# --------------------------------------------------------------------------------------
# interleaved 1F1B
# --------------------------------------------------------------------------------------


def interleaved_rounds(num_devices: int, num_microbatches: int) -> list[int]:
    """Micro-batch round sizes of interleaved 1F1B (they sum to m).

    torch's rule (``ScheduleInterleaved1F1B``): ``max(1, m // p)`` rounds of ``m / rounds``
    micro-batches when that divides m. Otherwise (where torch refuses) the same number of
    rounds with sizes differing by at most one, larger rounds first; every round keeps at
    least p micro-batches (a last round smaller than p deadlocks the 1F1B pairing).
    """
    p, m = int(num_devices), int(num_microbatches)
    rounds = max(1, m // p)
    base, rest = divmod(m, rounds)
    return [base + 1] * rest + [base] * (rounds - rest)


def orders_interleaved_1f1b(num_devices: int, stages_per_device: int, num_microbatches: int,
                            extra_warmup: int | None = None) -> Orders:
    """Interleaved 1F1B orders on the looped placement (module docstring).

    Parameters
    ----------
    num_devices, stages_per_device, num_microbatches : int
        p, v, m.
    extra_warmup : int, optional
        Cap on the device-dependent warm-up ``2 (p - 1 - d)`` (default: no cap, Megatron's
        warm-up); lower values trade bubbles for memory.

    Returns
    -------
    Orders
        W right after its B (a fused backward).
    """
    p, v, m = int(num_devices), int(stages_per_device), int(num_microbatches)
    rounds = interleaved_rounds(p, m)
    fwd, bwd = [], []  # (chunk, micro-batch) in the order the device runs them
    base = 0
    for size in rounds:
        for c in range(v):
            fwd += [(c, base + i) for i in range(size)]
        for c in reversed(range(v)):
            bwd += [(c, base + i) for i in range(size)]
        base += size
    total = v * m
    rows = []
    for d in range(p):
        extra = 2 * (p - 1 - d)
        if extra_warmup is not None:
            extra = min(extra, max(0, int(extra_warmup)))
        if v == 1:  # plain 1F1B: p - 1 - d warm-up forwards (Megatron's non-interleaved schedule)
            extra = min(p - 1 - d, extra)
        warm = min((v - 1) * rounds[0] + extra, total)
        row: list[Action] = []
        for k in range(warm):
            c, j = fwd[k]
            row.append(Action(c * p + d, "F", j))
        nb = 0
        for k in range(warm, total):
            c, j = fwd[k]
            row.append(Action(c * p + d, "F", j))
            c, j = bwd[nb]
            row += [Action(c * p + d, "B", j), Action(c * p + d, "W", j)]
            nb += 1
        while nb < total:
            c, j = bwd[nb]
            row += [Action(c * p + d, "B", j), Action(c * p + d, "W", j)]
            nb += 1
        rows.append(tuple(row))
    return Orders(looped_placement(p, v), tuple(rows))


def interleaved_1f1b(problem: ScheduleProblem) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021) on the looped placement.

    With v = 1 this is plain 1F1B (``p - 1 - d`` warm-up forwards). When the standard
    warm-up does not fit ``mem_limit`` the device-dependent part is lowered step by step
    (fewer micro-batches in flight, more bubbles) until it fits.

    Raises
    ------
    InputError
        If the placement is not looped.
    InfeasibleError
        If not even the least warm-up fits (message: device, bytes needed, limit).

    References
    ----------
    Narayanan et al. 2021 (SC'21), Section 2.2 and Figure 4; torch
    ``ScheduleInterleaved1F1B`` (micro-batch rounds, warm-up count).
    """
    t0 = time.perf_counter()
    p, v = _placement_of(problem, "looped", "interleaved-1f1b")
    m = problem.num_microbatches
    last = None
    for cap in [None] + list(range(2 * (p - 1) - 1, -1, -1)):
        orders = orders_interleaved_1f1b(p, v, m, cap)
        sched = simulate(problem, orders, method="interleaved-1f1b")
        last = sched
        if _fits(problem, sched):
            return _finish(problem, sched, t0, "interleaved-1f1b", {"stages_per_device": v, "warmup_cap": cap,
                                                                     "rounds": interleaved_rounds(p, m)})
    return _finish(problem, last, t0, "interleaved-1f1b")  # raises InfeasibleError with the overflow


# --------------------------------------------------------------------------------------
# ZB-V
# --------------------------------------------------------------------------------------


def orders_zbv(num_devices: int, num_microbatches: int) -> Orders:
    """The reference ZB-V order on the V placement (module docstring; torch ``ScheduleZBVZeroBubble``).

    Returns
    -------
    Orders
        Stages d (chunk 0) and 2p-1-d (chunk 1) on device d.
    """
    p, m = int(num_devices), int(num_microbatches)
    n = max(2 * p - 1, m)  # the pattern is built for at least 2p - 1 micro-batches, then trimmed
    rows = []
    for d in range(p):
        s0, s1 = d, 2 * p - 1 - d
        row: list[Action] = []
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

        def put(stage: int, kind: str, key: str, advance: bool = True) -> None:
            """Append the next action of counter ``key``; ``advance=False`` reuses it (a B's W)."""
            row.append(Action(stage, kind, cnt[key]))
            if advance:
                cnt[key] += 1

        for _ in range(2 * (p - d) - 1):
            put(s0, "F", "f0")
        for _ in range(d):
            put(s1, "F", "f1")
            put(s0, "F", "f0")
        for _ in range(p - d):
            put(s1, "F", "f1")
            put(s1, "B", "b1", advance=False)
            put(s1, "W", "b1")
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
            if cnt["f0"] < n:
                put(s0, "F", "f0")
            put(s0, "B", "b0", advance=False)
            put(s0, "W", "b0")
            put(s1, "F", "f1")
            put(s1, "B", "b1", advance=False)
            put(s1, "W", "b1")
        cnt["w0"], cnt["w1"] = cnt["b0"], cnt["b1"]
        for _ in range(d):
            put(s0, "B", "b0")
            put(s1, "B", "b1")
        for _ in range(p - d):
            put(s0, "B", "b0")
            put(s0, "W", "w0")
        while cnt["w1"] < cnt["b1"]:
            put(s1, "W", "w1")
        while cnt["w0"] < cnt["b0"]:
            put(s0, "W", "w0")
        rows.append(tuple(a for a in row if a.microbatch < m))
    return Orders(v_placement(p), tuple(rows))


def zb_v(problem: ScheduleProblem) -> Schedule:
    """ZB-V (Qi et al. 2024, controllable memory): the reference order and the memory-aware greedy.

    Candidates: :func:`orders_zbv` (when it fits ``mem_limit``) and the device greedy under
    the budget "the reference order's peak per device, capped by ``mem_limit``" (the ZB-V
    paper keeps 1F1B's peak memory); the better valid schedule is returned.

    Raises
    ------
    InputError
        If the placement is not V-shaped with 2 stages per device.
    InfeasibleError
        If neither candidate fits (a device cannot hold one micro-batch's stashes of both
        its stages, or the greedy runs out of memory).

    References
    ----------
    Qi, Wan, Huang, Lin 2024, "Pipeline Parallelism with Controllable Memory", Sections 3-4
    and 6 (ZB-V); torch ``ScheduleZBVZeroBubble``.
    """
    t0 = time.perf_counter()
    p, v = _placement_of(problem, "v", "zb-v")
    if v != 2:
        raise InputError(f"zb-v needs exactly 2 stages per device (V placement), the problem has {v}")
    ref = simulate(problem, orders_zbv(p, problem.num_microbatches), method="zb-v", meta={"source": "reference order"})
    cands = []
    peak = peak_memory(problem, ref)
    if _fits(problem, ref):
        cands.append(ref)
    budget = np.minimum(np.full(p, float(peak.max())), problem.mem_limit)
    reason = None
    try:
        g = device_greedy(problem, budget, method="zb-v")
        cands.append(Schedule(g.ops, g.makespan, g.stage_span, method="zb-v", objective=problem.objective,
                              meta={**g.meta, "source": "greedy", "budget": budget.tolist()}))
    except InfeasibleError as exc:
        reason = str(exc)
    if not cands:
        if reason is not None:
            raise InfeasibleError(f"zb-v: the reference order does not fit mem_limit and {reason}")
        return _finish(problem, ref, t0, "zb-v")
    best = min(cands, key=lambda c: c.value)
    return _finish(problem, best, t0, "zb-v")


# --------------------------------------------------------------------------------------
# DualPipe-V
# --------------------------------------------------------------------------------------


def orders_dualpipe_v(num_devices: int, num_microbatches: int) -> Orders:
    """The DualPipe-V order on the V placement (module docstring; torch ``ScheduleDualPipeV``).

    Overlapped forward/backward pairs are serialised: the forward, then the full backward
    (B immediately followed by its W).

    Raises
    ------
    InputError
        If ``num_microbatches < 2 * num_devices`` (DualPipe-V needs at least as many
        micro-batches as stages).
    """
    p, m = int(num_devices), int(num_microbatches)
    if m < 2 * p:
        raise InputError(f"dualpipe-v needs at least 2p = {2 * p} micro-batches (as many as stages), got {m}")
    rows = []
    for d in range(p):
        s0, s1 = d, 2 * p - 1 - d
        row: list[Action] = []
        nf = {s0: 0, s1: 0}
        nb = {s0: 0, s1: 0}
        nw = {s0: 0, s1: 0}
        wq: list[tuple[int, int]] = []

        def f(s: int) -> None:
            row.append(Action(s, "F", nf[s]))
            nf[s] += 1

        def full_b(s: int) -> None:
            row.extend((Action(s, "B", nb[s]), Action(s, "W", nb[s])))
            nb[s] += 1
            nw[s] += 1

        def input_b(s: int) -> None:
            row.append(Action(s, "B", nb[s]))
            wq.append((s, nb[s]))
            nb[s] += 1

        def pop_w() -> None:
            if wq:
                s, j = wq.pop(0)
                row.append(Action(s, "W", j))
                nw[s] += 1

        for _ in range(2 * (p - d - 1)):  # step 1: F0
            f(s0)
        for _ in range(d + 1):  # step 2: F0 F1
            f(s0)
            f(s1)
        for _ in range(p - d - 1):  # step 3: B1 W F1 (zero bubble)
            input_b(s1)
            pop_w()
            f(s1)
        for i in range(m - 2 * p + d + 1):  # step 4: (F0 + B1) (F1 + B0)
            f(s0)
            full_b(s1)
            f(s1)
            full_b(s0)
        for _ in range(p - d - 1):  # step 5: B1 (F1 + B0)
            full_b(s1)
            f(s1)
            full_b(s0)
        zb = False
        half = (d + 1) // 2
        for i in range(d + 1):  # step 6: B1 B0, the second half with split backward
            if i == half and d % 2 == 1:
                zb = True
            (input_b if zb else full_b)(s1)
            if i == half and d % 2 == 0:
                zb = True
            (input_b if zb else full_b)(s0)
        for _ in range(p - d - 1):  # step 7: W B0
            pop_w()
            (input_b if zb else full_b)(s0)
        while wq:  # step 8: the remaining W's
            pop_w()
        rows.append(tuple(row))
    return Orders(v_placement(p), tuple(rows))


def dualpipe_v(problem: ScheduleProblem) -> Schedule:
    """DualPipe-V (DeepSeek-V3 report Section 3.2.1, cut-in-half variant) on the V placement.

    Raises
    ------
    InputError
        If the placement is not V-shaped with 2 stages per device or m < 2p.
    InfeasibleError
        If the order's memory does not fit ``mem_limit`` (the order is fixed).

    References
    ----------
    DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Section 3.2.1 and Table 2;
    github.com/deepseek-ai/DualPipe (DualPipeV); torch ``ScheduleDualPipeV``.
    """
    t0 = time.perf_counter()
    p, v = _placement_of(problem, "v", "dualpipe-v")
    if v != 2:
        raise InputError(f"dualpipe-v needs exactly 2 stages per device (V placement), the problem has {v}")
    sched = simulate(problem, orders_dualpipe_v(p, problem.num_microbatches), method="dualpipe-v")
    return _finish(problem, sched, t0, "dualpipe-v")
