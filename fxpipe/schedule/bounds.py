"""Combinatorial lower bounds on pipeline schedules (no solver).

Families of per-stage bounds on the stage span (from the first F start to the last W
end of a stage, OptPipe Eq. 3), all purely combinatorial and sound for every schedule that
satisfies Contract 3 of DESIGN.md; :func:`combinatorial_lower_bound` returns the largest.

Notation
--------
For stage s write ``F, B, W`` for its op times, ``m`` for the number of micro-batches,
``a = mem_f[s] > 0``, ``b = mem_b[s] <= 0``, ``w = mem_w[s] <= 0``, ``o = offload_bytes[s]``,
``tau = t_offload[s]``, ``L = mem_limit[s]`` and

``D_s = sum_{k > s} (t_f[k] + t_b[k]) + 2 sum_{k = s}^{S-2} t_comm[k]``

for the round trip a micro-batch makes after ``F(s, j)`` ends and before ``B(s, j)`` may
start (forward through every later stage, back through their backwards, with comm each
way; ``D_{S-1} = 0``). ``t0`` is the first F start of s, ``t1`` its first B start,
``sigma_k`` the start of its k-th F (in time order, ``k = 1..m``). The span is the busy
time ``m (F + B + W)`` plus the idle time of the stage's compute stream in ``[t0, end]``.

1. Round-trip bound (:func:`stage_span_bounds`, memory-blind)
--------------------------------------------------------------
Facts (Contract 3 rules 2-3): before the first B of stage s only forwards run on s (a W
needs its B first); after the last F of stage s ends only backwards and weight passes run
on s; the first B of stage s, of micro-batch j, starts at least ``D_s`` after ``F(s, j)``
ends; the B of the last forward's micro-batch starts at least ``D_s`` after that forward
ends.

* If ``tF <= tB`` (``tF`` the last F end; all forwards first): the head ``[t0, tB]`` lasts
  at least ``max(mF, F + D)``, then all ``m(B + W)`` work follows; also the last forward's
  micro-batch needs ``D + B + W`` after ``tF >= t0 + mF``. So
  ``span >= max(max(mF, F + D) + m(B + W), mF + D + B + W)``.
* If ``tB < tF`` (needs m >= 2): with x forwards in the head (``1 <= x <= m - 1``) and y
  backward work in the tail (``B + W <= y <= m(B + W) - B``; the first B lies between),
  ``span >= m(F + B + W) + max(0, F + D - xF) + max(0, D + B + W - y)``, smallest at
  ``x = m - 1``, ``y = m(B + W) - B``.

2. Memory-aware bound (:func:`memory_stage_span_bounds`, needs ``F > 0``)
-------------------------------------------------------------------------
The same head/tail decomposition, but the number of forwards in the head and the backward
work left for the tail are limited by the memory limit (rule 5) and by how fast the copy
stream can offload (rules 3-4). Facts, for ``F > 0``:

(M1) F ops of one stage do not overlap, so exactly ``k - 1`` forwards start before
     ``sigma_k``, ``sigma_k >= t0 + (k - 1) F`` and the i-th forward (in time order) ends at
     ``e_i >= t0 + iF``.
(M2) Before ``t1`` no B and no W has started on s (W(s, j) needs B(s, j) ended). Memory at
     ``sigma_k < t1`` is ``k a - o n`` with ``n`` the number of stashes with
     ``O.end <= sigma_k < R.start``; ``n`` is at most the number of O ops ended by
     ``sigma_k``. Memory is checked at every op start, so ``k a - o n <= L``: at least
     ``r_k = ceil((k a - L) / o)`` offloads have ended by ``sigma_k`` (none possible when
     ``o = 0``: then ``k a <= L``), and since an O starts only after its own F ends, only the
     ``k - 1`` earlier forwards can have been offloaded: ``r_k <= k - 1``.
(M3) O/R ops of one stage never overlap and ``O(s, j).start >= F(s, j).end``. The first i
     O ops (in time order) belong to i distinct forwards, the latest of which ends at
     ``>= e_i``; so the i-th O ends at ``>= t0 + max(F + i tau, iF + tau)``.

Head. Let ``x`` be the number of forwards starting before ``t1``. Only those x forwards
start in ``[t0, t1)``, so its idle time is at least ``(t1 - t0) - xF``, and
``t1 - t0 >= F + D`` (the first B's micro-batch). By (M1)-(M3), for every ``k <= x`` with
``r_k >= 1``: ``sigma_k - t0 >= max(F + r_k tau, r_k F + tau)`` while only ``k - 1``
forwards ran before ``sigma_k``, so the idle time in ``[t0, sigma_k) c [t0, t1)`` is at least
``g_k = max(F + r_k tau, r_k F + tau) - (k - 1) F``. Hence
``head_idle >= h(x) = max(0, F + D - xF, max_{k <= x} g_k)``, and x is infeasible when some
``k <= x`` has ``r_k > k - 1`` (or ``o = 0`` and ``k a > L``).

Tail. Let ``y_B, y_W`` be the numbers of B and W ops started by ``sigma_m`` (the last
forward's start). Positive-length ops that start before ``sigma_m`` end by it (F > 0, no
overlap), so the work in ``[sigma_m, end]`` is at most ``F + (m - y_B) B + (m - y_W) W``.
The span ends at least ``F + D + B + W`` after ``sigma_m`` (the last forward's micro-batch).
Memory at ``sigma_m`` is ``m a + y_B b + y_W w - o n <= L`` where the ``n`` off-device
stashes (``O.end <= sigma_m < R.start``) all have their B after ``sigma_m`` and none is the
last forward's (its O ends after ``sigma_m + F``): ``n <= m - y_B - 1``. Their R ops start
after ``sigma_m`` and are serial, and the last R is followed by its B and W, so the span
also ends at least ``n tau + B + W`` after ``sigma_m``. With ``n_req`` the least n meeting
the limit, ``tail_idle >= t(y_B, y_W) = max(0, max(F + D + B + W, n_req tau + B + W) -
F - (m - y_B) B - (m - y_W) W)``; ``y_W <= y_B`` (a W needs its B ended).

Cases. If ``sigma_m < t1`` (all forwards before the first B): ``x = m``, ``y_B = y_W = 0``,
idle ``>= max(h(m), t(0, 0))`` (the two windows overlap, so the larger, not the sum). Else
``t1 <= sigma_m``: ``x <= m - 1``, ``1 <= y_B <= m - 1`` and the windows ``[t0, t1)`` and
``[sigma_m, end]`` are disjoint, so idle ``>= min_x h(x) + min_{y_B, y_W} t(y_B, y_W)``
(minimised independently, a relaxation). The stage bound is ``m(F + B + W)`` plus the
smaller of the two cases (an infeasible case is skipped).

For ``mem_limit = inf`` every x and y is feasible and the memory-aware bound equals the
round-trip bound; with a limit and no (or slow) offload it adds the warm-up bubble that the
limit forces, e.g. Zero Bubble's toy instances (p = 4, m = 12, F/B/W = 5/6/4, limits of 5
and 7 stashes): ``180 + (38 - 25) = 193`` and ``180 + (38 - 35) = 183``, their optima.

3. Memory-time bound (:func:`memory_time_stage_span_bounds`, Little's law)
--------------------------------------------------------------------------
Memory of stage s rises only at F starts and R starts, which are op starts where rule 5
checks it, so ``mem(t) <= L`` at every time t of the span ``[t0, end]``, and every stash's
contribution is ``>= 0``. Hence ``L * span >= sum_j integral of stash j's memory``. Stash j
holds ``a`` from ``F.start`` to ``B.start`` (``Delta >= F + D`` later) and ``a + b`` from
``B.start`` to ``W.start`` (``>= B``). If it is offloaded, ``o`` of it is off the device
only during ``[O.end, R.start)``, of length at most ``Delta - F - 2 tau`` (rules 4 and
1), and ``Delta >= F + 2 tau``. So its integral is at least
``c_keep = a (F + D) + (a + b) B`` or, offloaded,
``c_off = a F + (a - o) max(D, 2 tau) + 2 o tau + (a + b) B``. The n offloaded stashes
also need ``2 n tau`` of the stage's copy stream inside the span. Therefore
``span >= min_{0 <= n <= m} max((n c_off + (m - n) c_keep) / L, 2 n tau)``
(only ``n = 0`` when ``o = 0``). This is what bounds stages that must run almost one
micro-batch at a time (a limit of one or two stashes with slow or no offload).

4. Device warm-up/drain bound (:func:`device_span_bounds`)
----------------------------------------------------------
With several stages per device (``device_of_stage``; comm between stages on one device is
free, so every ``t_comm`` above is the *effective* one), the span of device d runs from the
start ``t0`` of its first op to the end of its last. Let ``s_1 < ... < s_k`` be its stages.
Every forward of the device needs the forward of its micro-batch on ``s_1`` first (stages form
a chain), so the first op is an F of ``s_1``; the last F is an F of ``s_k``. Before the
device's first B (at ``t1``) only forwards run on it, and every B of the device needs a
forward of ``s_1`` started at ``>= t0`` plus the chain to the last stage and back, so
``t1 - t0 >= H = sum_{x >= s_1} F_x + sum_{b >= s_1} c_b + sum_{x > s_k} B_x + sum_{b >= s_k} c_b``.
After the start ``sigma`` of the device's last forward (of ``s_k``), its micro-batch still
needs ``T = F_{s_k} + D_{s_k} + sum_{x = s_1}^{s_k} B_x + sum_{b = s_1}^{s_k - 1} c_b + W_{s_1}``
(back down to ``s_1`` and its W). The device's busy time is ``sum_{x on d} m (F_x + B_x + W_x)``;
the idle time in ``[t0, t1)`` is at least ``H`` minus the forward work that fits there, and in
``[sigma, end]`` at least ``T`` minus the work left at ``sigma``. Without offload on the device
and with a finite limit ``L``, the forwards in the head hold their stashes together, so their
work is at most the fractional knapsack ``max sum n_x F_x`` with ``sum n_x a_x <= L``, and at
``sigma`` every stash is allocated, so B/W work freeing at least ``sum m a_x - L`` (fractional
knapsack, least time) has run before ``sigma``. Two cases as in part 2: every forward before
the first B (idle ``>= max`` of the two, only if ``sum m a_x <= L`` without offload), or not
(the windows are disjoint: idle ``>=`` the sum, the last forward not in the head, at least
one B before ``sigma``). The bound is the busy time plus the smaller case. Every stage's
bound from parts 1-3 (with the device's limit: a stage's memory is part of its device's)
also bounds the device's span, which contains the stage's span.

5. Device memory-time bound
---------------------------
Part 3 summed over the stages of a device: the device's memory is the sum of its stages' and
never exceeds ``L`` inside its span, which contains every stash's lifetime, so
``L * span >= sum_{s on d} (n_s c_off(s) + (m - n_s) c_keep(s))``, while the device's one copy
stream needs ``sum_s 2 n_s tau_s <= span``. Relaxing the offload counts ``n_s`` to reals in
``[0, m]`` (a lower bound on the integer minimum), the minimum of the two is found by taking
the stages with the best memory saving per copy second first.

6. Downstream chain bound (:func:`chain_stage_span_bounds`)
-----------------------------------------------------------
Stage s's span also contains the work of every later stage k > s, passed through the chain.
Let ``t0`` be the first F start of s and ``phi_k`` the first F start of k: the micro-batch of
that F passed stages s..k-1 in order, starting on s at ``>= t0``, so
``phi_k >= t0 + sum_{i=s}^{k-1} (F_i + c_i)`` (Contract 3 rule 2; ``c`` the effective comm).
Let ``tau`` be the start of the last-starting B of stage k (micro-batch ``j*``). Every F of k
ended by ``tau`` (it precedes its own B), the other ``m - 1`` B of k ended by ``tau`` (they
started no later and do not overlap ``B(k, j*)``, ``B_k > 0``), and so did every W of k that
started before ``tau``; all of them lie in ``[phi_k, tau]`` on k's compute stream (rule 3).
With ``n_W`` such W, ``B(k, j*)`` ends at ``T_k >= phi_k + m (F_k + B_k) + n_W W_k``. Its
gradient then travels back: ``B(s, j*)`` starts ``>= T_k + sum_{i=s}^{k-1} c_i +
sum_{i=s+1}^{k-1} B_i`` and ``W(s, j*)`` ends ``B_s + W_s`` later, inside the span of s. So

``span_s >= sum_{i=s}^{k-1} (F_i + B_i + 2 c_i) + m (F_k + B_k) + n_W W_k + W_s``  for every k > s.

Memory bounds ``n_W`` from below (``P_k``, the most W a stage may still owe at ``tau``): at
``tau`` (rule 5, all deltas of ops started by ``tau``) each of the ``m - 1 - n_W`` other
micro-batches whose W has not started holds ``a_k + b_k = -w_k >= 0`` (an offload only lasts
until the R before its B), ``j*`` holds ``a_k + b_k + tr_k`` (its stash is back, its B has
started; ``tr`` the replay transient of a recomputing stage), and every other stash or stage
of the device holds ``>= 0``. So ``(m - 1 - n_W)(-w_k) + a_k + b_k + tr_k <= L`` and
``n_W >= m - 1 - P_k`` with ``P_k = floor((L - a_k - b_k - tr_k) / (-w_k))`` (``P_k = m - 1``
without a limit, with ``w_k = 0`` or with ``B_k = 0``, where the W term is dropped). With a
recomputing stage each pending W holds the recomputed activations, so a binding limit
forces most W passes of a stage before its last B: this is what bounds the 70B pipelines
of issue 19, whose late stages' work reaches stage 0 only through the chain.

7. Over every recomputation choice (:func:`recompute_lower_bound`)
-------------------------------------------------------------------
(Written for the default menu, none or whole-stage recomputation; :func:`recompute_lower_bound`
takes every stage's checkpoint menu, see its docstring: the same threshold argument with the
least-replay option below each threshold.)
``auto`` chooses which stages recompute (:meth:`ScheduleProblem.with_recompute`); a bound
valid for every choice ``x`` (``x_i = 1``: stage i recomputes) is
``min_x LB(x)``, with ``2^S`` choices. Split the terms: ``h_i(x_i)``, the bounds of parts
1-3 on stage i (plus ``A_i`` for the makespan) with stage i's choice and every *other* stage
not recomputing (the least round trip ``D_i``: parts 1-3 grow with ``D_i``, so this is a
bound for every choice of the others), and ``C(x)``, the objective bound of parts 1, 4
(memory-blind) and 6 (with the limits) of the problem with choice ``x``. ``C`` never
decreases when a stage starts recomputing: its B grows by the replayed forward (every term
of parts 1, 4 and 6 grows with the B times, part 4's drain shrinks by at most the ``(m - 1)``
B it adds to the busy time), and part 6's ``P_k`` falls (at its start a recomputing B holds
``a - c + r >= a >= -w`` bytes, ``r >= c`` the inputs, ``c`` the pooled bytes; ``-w`` is
unchanged). So ``LB(x) >= R(x) = max(max_i h_i(x_i), C(x))``
and ``min_x R(x)`` is attained at a threshold choice: for ``x*`` optimal with value V, the
choice ``x'_i = 1`` iff ``h_i(0) > V`` has ``x' <= x*`` (where ``x*_i = 0``, ``h_i(0) <= V``), so
``C(x') <= C(x*) <= V``, and ``h_i(x'_i) <= V`` (``x'_i = 1`` forces ``x*_i = 1``). Trying the
``S + 1`` thresholds ``V`` in ``{h_i(0)}`` and ``-inf`` gives ``min_x R(x)``, a lower bound on
every schedule of every recomputation choice (stages that already recompute stay so).

Objectives
----------
Stage span (the largest per-device span): the largest device bound. Makespan (OptPipe
Eq. 4): stage s cannot start before ``A_s = sum_{k<s}(t_f[k] + t_comm[k])`` and its last B is
followed by ``Z_s = sum_{k<s} (t_comm[k] + t_b[k]) + t_w[0]``, so ``makespan >= max_s
max(A_s + span bound_s, A_s + m(F_s + B_s) + Z_s)``, and for device d ``>= A_{s_1} +`` its
device bound.

Memory comparisons use a relative tolerance of ``1e-7`` in the schedule's favour (the
validator accepts ``1e-9``), so rounding can only weaken the bound.

References
----------
OptPipe Eq. 3-6 (objectives and dependencies); Qi et al. 2024 (Zero Bubble) Section 2 (bubble
analysis of 1F1B / ZB-H1: the ``(p - 1)(F + B)`` warm-up/cool-down is what ``D_s``
generalises) and its toy instances; PipeOffload Section 2 (offload/reload of stashes on a
copy stream); DESIGN.md Contract 3.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fxpipe.ir import ScheduleProblem

__all__ = [
    "chain_stage_span_bounds",
    "combinatorial_lower_bound",
    "device_span_bounds",
    "limited_1f1b_bound",
    "memory_lower_bound",
    "memory_stage_span_bounds",
    "memory_time_stage_span_bounds",
    "recompute_lower_bound",
    "round_trip_lower_bound",
    "stage_span_bounds",
]

_MEM_RTOL = 1e-7


def _round_trip(problem: ScheduleProblem) -> np.ndarray:
    S = problem.num_stages
    c = problem.t_comm_effective
    D = np.zeros(S)
    for s in range(S - 2, -1, -1):
        D[s] = D[s + 1] + problem.t_f[s + 1] + problem.t_b[s + 1] + 2.0 * c[s]
    return D


def stage_span_bounds(problem: ScheduleProblem) -> np.ndarray:
    """Memory-blind lower bound on the span of every stage (float64 array (S,), seconds).

    See part 1 of the module docstring for the derivation.
    """
    m = problem.num_microbatches
    D = _round_trip(problem)
    out = np.zeros(problem.num_stages)
    for s in range(problem.num_stages):
        F, B, W, d = float(problem.t_f[s]), float(problem.t_b[s]), float(problem.t_w[s]), float(D[s])
        case_fwd_first = max(max(m * F, F + d) + m * (B + W), m * F + d + B + W)
        best = case_fwd_first
        if m >= 2:
            x, y = m - 1, m * (B + W) - B
            case_mixed = m * (F + B + W) + max(0.0, F + d - x * F) + max(0.0, d + B + W - y)
            best = min(best, case_mixed)
        out[s] = best
    return out


def chain_stage_span_bounds(problem: ScheduleProblem, *, memory: bool = True,
                            w_extra_s: np.ndarray | None = None) -> np.ndarray:
    """Downstream chain lower bound on the span of every stage (float64 array (S,), seconds).

    Part 6 of the module docstring: stage s's span contains the path of one micro-batch to a
    later stage k and back plus all of k's F and B work, and (``memory``) the W passes of k
    that its memory limit forces before its last B.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem (any placement; comm between stages of one device is free).
    memory : bool
        Use the memory limits (False: the memory-blind bound, ``P_k = m - 1``).
    w_extra_s : float64 array (S,), optional
        The W work memory forces before stage k's last B, given (seconds; replaces what ``memory``
        would compute): :func:`recompute_lower_bound` passes the least over a stage's checkpoint options.

    Returns
    -------
    float64 array (S,)
        Seconds; every valid schedule's span of stage s is at least entry s (``-inf`` for the
        last stage, which has no later stage).

    References
    ----------
    DESIGN.md Contract 3 rules 2, 3 and 5; OptPipe Eq. 3.
    """
    S, m = problem.num_stages, problem.num_microbatches
    c = problem.t_comm_effective
    F, B, W = (np.asarray(x, dtype=float) for x in (problem.t_f, problem.t_b, problem.t_w))
    core = m * (F + B)
    if w_extra_s is not None:
        core = core + np.asarray(w_extra_s, dtype=float)
    elif memory:
        a, b = np.asarray(problem.mem_f, dtype=float), np.asarray(problem.mem_b, dtype=float)
        tr = np.asarray(problem.mem_b_transient, dtype=float)
        held = -np.asarray(problem.mem_w, dtype=float)  # a + b: what a micro-batch holds until its W
        for k in range(S):
            L = problem.device_mem_limit(k)
            if not math.isfinite(L) or held[k] <= 0.0 or B[k] <= 0.0 or W[k] <= 0.0:
                continue
            L_eff = L + _MEM_RTOL * max(1.0, abs(L), float(problem.stash_footprint[k]))  # in the schedule's favour
            owed = math.floor((L_eff - a[k] - b[k] - tr[k]) / held[k])
            core[k] += max(0, m - 1 - min(m - 1, max(0, owed))) * W[k]
    out = np.full(S, -math.inf)
    # path[s] = sum_{i < s} (F_i + B_i + 2 c_i): the bound of s is max_{k > s} (path[k] + core[k]) - path[s] + W_s
    path = np.concatenate([[0.0], np.cumsum(F[:-1] + B[:-1] + 2.0 * np.asarray(c, dtype=float))])
    best = -math.inf
    for s in range(S - 2, -1, -1):
        best = max(best, float(path[s + 1] + core[s + 1]))
        out[s] = best - float(path[s]) + float(W[s])
    return out


def _offloads_needed(excess: np.ndarray, o: float, scale: float) -> np.ndarray:
    """Least number of offloaded stashes that brings ``excess`` (bytes over the limit) to <= 0.

    Returns a float array: 0 where ``excess <= tol``; ``inf`` where offloading cannot help
    (``o = 0``).
    """
    tol = _MEM_RTOL * scale
    need = np.zeros_like(excess, dtype=float)
    over = excess > tol
    if o <= 0.0:
        need[over] = math.inf
    else:
        need[over] = np.ceil((excess[over] - tol) / o)
    return need


def _memory_stage_bound(problem: ScheduleProblem, s: int, d: float) -> float:
    m = problem.num_microbatches
    F, B, W = float(problem.t_f[s]), float(problem.t_b[s]), float(problem.t_w[s])
    a, b, w = float(problem.mem_f[s]), float(problem.mem_b[s]), float(problem.mem_w[s])
    o, tau, L = float(problem.offload_bytes[s]), float(problem.t_offload[s]), problem.device_mem_limit(s)
    busy = m * (F + B + W)
    if F <= 0.0 or not math.isfinite(L):
        return -math.inf  # the round-trip bound covers these (part 2 needs F > 0 and a limit)
    scale = max(1.0, abs(L), abs(a) * m)

    # ---- head: h(x) for x = 1..m (index x - 1)
    k = np.arange(1, m + 1, dtype=float)
    r = _offloads_needed(k * a - L, o, scale)
    bad = r > k - 1  # includes inf (o = 0 and k a > L)
    with np.errstate(invalid="ignore"):
        g = np.where((r >= 1) & ~bad, np.maximum(F + r * tau, r * F + tau) - (k - 1) * F, 0.0)
    g_prefix = np.maximum.accumulate(np.maximum(g, 0.0))
    feasible_x = ~np.logical_or.accumulate(bad)  # x feasible iff no k <= x is bad
    h = np.maximum(np.maximum(0.0, F + d - k * F), g_prefix)  # h[x-1]

    # ---- tail: t(y_B, y_W)
    def tail_idle(yB: np.ndarray, yW: np.ndarray) -> np.ndarray:
        n_req = _offloads_needed(m * a + yB * b + yW * w - L, o, scale)
        ok = n_req <= (m - yB - 1)
        n_use = np.where(ok, n_req, 0.0)
        length = np.maximum(F + d + B + W, n_use * tau + B + W)
        idle = np.maximum(0.0, length - F - (m - yB) * B - (m - yW) * W)
        return np.where(ok, idle, math.inf)

    cases = []
    # all forwards before the first B: x = m, y_B = y_W = 0
    if feasible_x[m - 1]:
        t00 = float(tail_idle(np.array([0.0]), np.array([0.0]))[0])
        if math.isfinite(t00):
            cases.append(max(float(h[m - 1]), t00))
    # mixed: x <= m - 1, 1 <= y_B <= m - 1, 0 <= y_W <= y_B
    if m >= 2 and feasible_x[0]:
        head = float(np.min(h[: m - 1][feasible_x[: m - 1]]))
        yB, yW = np.meshgrid(np.arange(1, m, dtype=float), np.arange(0, m, dtype=float), indexing="ij")
        valid = yW <= yB
        t = tail_idle(yB[valid], yW[valid])
        tail = float(np.min(t)) if t.size else math.inf
        if math.isfinite(tail):
            cases.append(head + tail)
    if not cases:
        # no case is feasible: impossible for a problem with mem_f <= mem_limit (the
        # one-at-a-time schedule is a mixed case); fall back to the busy time
        return busy
    return busy + min(cases)


def memory_stage_span_bounds(problem: ScheduleProblem) -> np.ndarray:
    """Memory-aware lower bound on the span of every stage (float64 array (S,), seconds).

    Part 2 of the module docstring: the warm-up (head) and drain (tail) bubbles that the
    memory limit forces when offloading is absent or slower than the forwards. Entries
    are ``-inf`` where the argument does not apply (``t_f[s] = 0`` or no memory limit);
    the round-trip bound (:func:`stage_span_bounds`) covers those stages.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem.

    Returns
    -------
    float64 array (S,)
        Seconds; every valid schedule's span of stage s is at least entry s.

    References
    ----------
    DESIGN.md Contract 3 rules 2-5; PipeOffload Section 2.
    """
    D = _round_trip(problem)
    return np.array([_memory_stage_bound(problem, s, float(D[s])) for s in range(problem.num_stages)])


def memory_time_stage_span_bounds(problem: ScheduleProblem) -> np.ndarray:
    """Memory-time (Little's law) lower bound on the span of every stage (float64 (S,), s).

    Part 3 of the module docstring; ``-inf`` where the stage has no memory limit.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem.

    Returns
    -------
    float64 array (S,)
        Seconds; every valid schedule's span of stage s is at least entry s.

    References
    ----------
    DESIGN.md Contract 3 rules 1, 4, 5; Little's law (memory = arrival rate x holding time).
    """
    D = _round_trip(problem)
    return np.array([_memory_time_stage_bound(problem, s, float(D[s])) for s in range(problem.num_stages)],
                    dtype=np.float64)


def _memory_time_stage_bound(problem: ScheduleProblem, s: int, d: float) -> float:
    """:func:`memory_time_stage_span_bounds` of stage s alone (``d`` its round trip, :func:`_round_trip`)."""
    m = problem.num_microbatches
    L = problem.device_mem_limit(s)
    if not math.isfinite(L):
        return -math.inf
    F, B = float(problem.t_f[s]), float(problem.t_b[s])
    a, b, o, tau = (float(problem.mem_f[s]), float(problem.mem_b[s]), float(problem.offload_bytes[s]),
                    float(problem.t_offload[s]))
    c_keep = a * (F + d) + (a + b) * B
    c_off = a * F + (a - o) * max(d, 2.0 * tau) + 2.0 * o * tau + (a + b) * B
    L_eff = L * (1.0 + _MEM_RTOL)  # the validator's memory tolerance, in the schedule's favour
    ns = range(m + 1) if o > 0.0 else range(1)
    return min(max((n * c_off + (m - n) * c_keep) / L_eff, 2.0 * n * tau) for n in ns)


def _knapsack_max(values: list[float], weights: list[float], cap: float, count: int) -> float:
    """Fractional knapsack: max sum v_i n_i with sum w_i n_i <= cap, 0 <= n_i <= count (w_i > 0)."""
    best, left = 0.0, cap
    for v, w in sorted(zip(values, weights), key=lambda x: -x[0] / x[1]):
        if left <= 0:
            break
        n = min(float(count), left / w)
        best += v * n
        left -= w * n
    return best


def _device_head_tail(problem: ScheduleProblem, d: int, memory: bool) -> float:
    """Part 4 of the module docstring: the device's busy time plus forced warm-up/drain idle."""
    stages = problem.stages_of_device(d)
    S, m = problem.num_stages, problem.num_microbatches
    c = problem.t_comm_effective
    F, B, W = problem.t_f, problem.t_b, problem.t_w
    s1, sk = stages[0], stages[-1]
    busy = float(sum(m * (F[x] + B[x] + W[x]) for x in stages))
    f_all = float(sum(m * F[x] for x in stages))
    bw_all = float(sum(m * (B[x] + W[x]) for x in stages))
    H = float(F[s1:].sum() + c[s1:].sum() + B[sk + 1:].sum() + c[sk:].sum())
    D_sk = float(F[sk + 1:].sum() + B[sk + 1:].sum() + 2.0 * c[sk:].sum())
    T = float(F[sk]) + D_sk + float(B[s1:sk + 1].sum() + c[s1:sk].sum()) + float(W[s1])
    L = float(problem.mem_limit[d])
    use_mem = memory and math.isfinite(L) and all(float(problem.offload_bytes[x]) <= 0.0 for x in stages)
    L_eff = L * (1.0 + _MEM_RTOL)
    stash_all = float(sum(m * problem.mem_f[x] for x in stages))
    # head: forward work that can run before the device's first B
    f_head = f_all - float(F[sk])  # mixed case: the last forward (of sk) starts after the first B
    free_bw = 0.0  # least B/W work that must run before the last F to make room for it
    if use_mem:
        f_head = min(f_head, _knapsack_max([float(F[x]) for x in stages], [float(problem.mem_f[x]) for x in stages],
                                           L_eff, m))
        need = stash_all - L_eff
        if need > 0:
            vals, wts = [], []
            for x in stages:
                for t, mem in ((B[x], -problem.mem_b[x]), (W[x], -problem.mem_w[x])):
                    if mem > 0:
                        vals.append(float(mem))
                        wts.append(float(t))
            if any(w <= 0 for w in wts):
                free_bw = 0.0
            else:  # least time to free `need`: fractional knapsack in memory per second
                free_bw = math.inf
                left, cost = need, 0.0
                for mem, t in sorted(zip(vals, wts), key=lambda x: -x[0] / x[1]):
                    take = min(float(m), left / mem)
                    cost += take * t
                    left -= take * mem
                    if left <= 1e-12 * max(1.0, need):
                        free_bw = cost
                        break
    first_b = float(min(B[x] for x in stages))
    cases = []
    # (a) every forward of the device before its first B
    if not use_mem or stash_all <= L_eff:
        cases.append(max(0.0, H - f_all, T - float(F[sk]) - bw_all))
    # (b) the first B before the last F: the head and tail windows are disjoint
    if m >= 2:
        cases.append(max(0.0, H - f_head) + max(0.0, T - float(F[sk]) - (bw_all - max(free_bw, first_b))))
    if not cases or not all(math.isfinite(x) for x in cases):
        cases = [x for x in cases if math.isfinite(x)] or [0.0]
    return busy + min(cases)


def _device_memory_time(problem: ScheduleProblem, d: int) -> float:
    """Part 5 of the module docstring: Little's law over all stages of a device."""
    L = float(problem.mem_limit[d])
    if not math.isfinite(L):
        return -math.inf
    Dr = _round_trip(problem)
    m = problem.num_microbatches
    L_eff = L * (1.0 + _MEM_RTOL)
    A = 0.0
    items = []  # (saving g per offloaded stash, copy time h per offloaded stash)
    for s in problem.stages_of_device(d):
        F, B = float(problem.t_f[s]), float(problem.t_b[s])
        a, b, o, tau = (float(problem.mem_f[s]), float(problem.mem_b[s]), float(problem.offload_bytes[s]),
                        float(problem.t_offload[s]))
        c_keep = a * (F + Dr[s]) + (a + b) * B
        c_off = a * F + (a - o) * max(Dr[s], 2.0 * tau) + 2.0 * o * tau + (a + b) * B
        A += m * c_keep / L_eff
        if o > 0.0 and c_off < c_keep:
            items.append(((c_keep - c_off) / L_eff, 2.0 * tau))
    # min over 0 <= n_s <= m (relaxed to reals) of max(A - sum g n, sum h n): best ratio first
    H = 0.0
    for g, h in sorted(items, key=lambda x: -(x[0] / x[1]) if x[1] > 0 else -math.inf):
        if h <= 0.0:
            A -= g * m
            continue
        if A - g * m >= H + h * m:
            A -= g * m
            H += h * m
        else:
            delta = max(0.0, (A - H) / (g + h))
            return H + h * delta
    return max(A, H)


def device_span_bounds(problem: ScheduleProblem, *, memory: bool = True) -> np.ndarray:
    """Lower bound on the span of every device (float64 array (D,), seconds).

    The largest of: the device's busy time; the per-stage bounds of the stages it holds
    (a device's span contains each of its stages' spans; the downstream chain bound of part
    6, with the limits when ``memory``); the device warm-up/drain bound
    (part 4 of the module docstring) and, with ``memory``, the per-stage memory-aware and
    memory-time bounds and the device memory-time bound (part 5).

    Parameters
    ----------
    problem : ScheduleProblem
    memory : bool
        Use the memory limit (False: the memory-blind bound).

    Returns
    -------
    float64 array (D,)
        Seconds; every valid schedule's span of device d is at least entry d.
    """
    stage = np.maximum(stage_span_bounds(problem), chain_stage_span_bounds(problem, memory=memory))
    if memory:
        stage = np.maximum(stage, memory_stage_span_bounds(problem))
        stage = np.maximum(stage, memory_time_stage_span_bounds(problem))
    return _device_spans(problem, stage, memory)


def _device_spans(problem: ScheduleProblem, stage: np.ndarray, memory: bool) -> np.ndarray:
    """:func:`device_span_bounds` from its per-stage bounds ``stage`` (float64 (S,), seconds)."""
    out = np.zeros(problem.num_devices)
    for d, stages in enumerate(problem.device_stages):
        b = max(float(stage[list(stages)].max()), _device_head_tail(problem, d, memory))
        if memory:
            b = max(b, _device_memory_time(problem, d))
        out[d] = b
    return out


def _objective_bound(problem: ScheduleProblem, spans: np.ndarray, dev_spans: np.ndarray) -> float:
    if problem.objective == "stage_span":
        return float(max(spans.max(), dev_spans.max()))
    S, m = problem.num_stages, problem.num_microbatches
    c = problem.t_comm_effective
    best = 0.0
    A = np.zeros(S)  # earliest start of stage s's first forward
    for s in range(1, S):
        A[s] = A[s - 1] + float(problem.t_f[s - 1] + c[s - 1])
    for s in range(S):
        Z = float(sum(c[k] + problem.t_b[k] for k in range(s))) + float(problem.t_w[0])
        best = max(best, A[s] + spans[s], A[s] + m * float(problem.t_f[s] + problem.t_b[s]) + Z)
    for d, stages in enumerate(problem.device_stages):
        best = max(best, A[stages[0]] + dev_spans[d])
    return float(best)


def round_trip_lower_bound(problem: ScheduleProblem) -> float:
    """The memory-blind bound (parts 1, 4 and 6 without limits of the module docstring) on the objective.

    Parameters
    ----------
    problem : ScheduleProblem

    Returns
    -------
    float
        Seconds; every valid schedule's objective value is at least this large.

    References
    ----------
    OptPipe Eq. 3 and 4; Zero Bubble Section 2.
    """
    spans = np.maximum(stage_span_bounds(problem), chain_stage_span_bounds(problem, memory=False))
    return _objective_bound(problem, spans, device_span_bounds(problem, memory=False))


def memory_lower_bound(problem: ScheduleProblem) -> float:
    """The memory-aware bound (parts 2 to 6 of the module docstring) on the objective.

    Uses, per stage, the largest of the round-trip, the warm-up/drain, the memory-time and
    the downstream chain stage span bounds, and per device :func:`device_span_bounds`.

    Parameters
    ----------
    problem : ScheduleProblem

    Returns
    -------
    float
        Seconds; every valid schedule's objective value is at least this large.

    References
    ----------
    DESIGN.md Contract 3; OptPipe Eq. 3 and 4; PipeOffload Section 2.
    """
    spans = np.maximum(stage_span_bounds(problem), memory_stage_span_bounds(problem))
    spans = np.maximum(spans, memory_time_stage_span_bounds(problem))
    spans = np.maximum(spans, chain_stage_span_bounds(problem))
    return _objective_bound(problem, spans, device_span_bounds(problem))


def combinatorial_lower_bound(problem: ScheduleProblem) -> float:
    """A sound lower bound on the problem's objective (``stage_span`` or ``makespan``).

    The larger of :func:`round_trip_lower_bound` and :func:`memory_lower_bound`.

    Parameters
    ----------
    problem : ScheduleProblem

    Returns
    -------
    float
        Seconds (the problem's time unit); every valid schedule has an objective value at
        least this large.

    References
    ----------
    Module docstring (derivation); OptPipe Eq. 3 and 4 for the objectives.
    """
    # round_trip_lower_bound and memory_lower_bound, each per-stage bound computed once (the same maxima)
    base = stage_span_bounds(problem)
    blind = np.maximum(base, chain_stage_span_bounds(problem, memory=False))
    aware = np.maximum(np.maximum(base, memory_stage_span_bounds(problem)), memory_time_stage_span_bounds(problem))
    aware = np.maximum(aware, chain_stage_span_bounds(problem))
    return max(_objective_bound(problem, blind, _device_spans(problem, blind, False)),
               _objective_bound(problem, aware, _device_spans(problem, aware, True)))


def limited_1f1b_bound(problem: ScheduleProblem, w: int) -> float:
    """Lower bound (seconds, both objectives) on 1F1B with warm-up ``w`` or less, no offload.

    With ``k = min(w, p - s - 1, m) + 1`` micro-batches in flight on stage s, its program runs
    ``F(j + k)`` right after ``W(j)``, so ``B(s, j + k)`` starts at least one round trip
    ``C_s`` after ``B(s, j)`` does: B and W of s, the forwards of stages s..p-1, the backwards
    of s+1..p-1 and the transfers between them both ways. Hence the span of device s is at
    least ``t_f + floor((m - 1) / k) C_s + t_b + t_w``; fewer in flight only lengthens it.
    """
    p, M = problem.num_stages, problem.num_microbatches
    tf, tb, tw = problem.t_f, problem.t_b, problem.t_w
    comm = [problem.comm(s) for s in range(p - 1)]
    best = 0.0
    fwd = back = cm = 0.0  # suffix sums over stages s..p-1 (backwards over s+1..p-1)
    for s in range(p - 1, -1, -1):
        fwd += float(tf[s])
        if s < p - 1:
            back += float(tb[s + 1])
            cm += comm[s]
        k = min(w, p - s - 1, M) + 1
        cycle = float(tb[s]) + float(tw[s]) + fwd + back + 2.0 * cm
        best = max(best, float(tf[s]) + ((M - 1) // k) * cycle + float(tb[s]) + float(tw[s]))
    return best


def _stage_terms(problem: ScheduleProblem, s: int, d: float | None = None) -> float:
    """Parts 1-3 of the module docstring for stage s alone (seconds; ``+ A_s`` for makespan; ``d`` its round
    trip, :func:`_round_trip`, computed when not given)."""
    d = float(_round_trip(problem)[s]) if d is None else float(d)
    m = problem.num_microbatches
    F, B, W = float(problem.t_f[s]), float(problem.t_b[s]), float(problem.t_w[s])
    best = max(max(m * F, F + d) + m * (B + W), m * F + d + B + W)
    if m >= 2:
        best = min(best, m * (F + B + W) + max(0.0, F + d - (m - 1) * F) + max(0.0, d + B + W - (m * (B + W) - B)))
    best = max(best, _memory_stage_bound(problem, s, d), _memory_time_stage_bound(problem, s, d))
    if problem.objective == "makespan":
        c = problem.t_comm_effective
        best += float(sum(problem.t_f[k] + c[k] for k in range(s)))
    return best


class _StageView:
    """``problem.with_checkpoint({stage: name})`` as :func:`_stage_terms` reads it for ``stage`` (its
    fields by :meth:`~fxpipe.ir.ScheduleProblem.stage_fields_with`; every other stage, and so the
    round trip of ``stage``, which reads only later stages, as in ``problem``): a bound per stage
    and option without building a problem per option (O(S) each)."""

    def __init__(self, problem: ScheduleProblem, stage: int, name: str):
        self._p = problem
        t_b, t_w, mem_f, mem_b, mem_w, _trans, off = problem.stage_fields_with(stage, name)
        t_w = 0.0 if abs(t_w) < 1e-15 else t_w
        self.t_f = problem.t_f
        self.t_b = _patched(problem.t_b, stage, max(t_b, 0.0))
        self.t_w = _patched(problem.t_w, stage, max(t_w, 0.0))
        self.mem_f, self.mem_b, self.mem_w = (_patched(getattr(problem, k), stage, v)
                                              for k, v in (("mem_f", mem_f), ("mem_b", mem_b), ("mem_w", mem_w)))
        self.offload_bytes = _patched(problem.offload_bytes, stage, off)
        self.num_microbatches, self.num_stages, self.objective = (problem.num_microbatches, problem.num_stages,
                                                                   problem.objective)
        self.t_offload, self.t_comm_effective = problem.t_offload, problem.t_comm_effective

    def device_mem_limit(self, stage: int) -> float:
        return self._p.device_mem_limit(stage)


def _patched(arr, i: int, value: float) -> np.ndarray:
    out = np.array(arr, dtype=np.float64)
    out[i] = value
    return out


def _forced_w_s(problem: ScheduleProblem, k: int, opt, t_b0: float, t_w0: float) -> float:
    """Part 6's W work before stage k's last B that memory forces when k runs checkpoint option ``opt``
    (``t_b0`` / ``t_w0`` the stage's B and W times without replay, with a split backward; a fused option
    owes none): ``max(0, m - 1 - P) * t_w0`` with ``P = floor((L - level) / held)``, ``level`` the memory of
    a micro-batch whose B started and ``held`` what it keeps until its W."""
    m, L = problem.num_microbatches, problem.device_mem_limit(k)
    c = float(problem.pooled_bytes[k])
    held = opt.w_bytes + c
    if opt.fused or not math.isfinite(L) or held <= 0.0 or t_w0 <= 0.0 or t_b0 + opt.replay_s <= 0.0:
        return 0.0
    level = held if opt.name == "none" else opt.b_level(c)
    L_eff = L + _MEM_RTOL * max(1.0, abs(L), max(opt.kept_bytes + c, level))
    owed = math.floor((L_eff - level) / held)
    return max(0, m - 1 - min(m - 1, max(0, owed))) * t_w0


def _reachable(problem: ScheduleProblem, s: int) -> list:
    """The checkpoint options stage s may run from ``problem`` (a checkpointing stage never goes back to none)."""
    if problem.checkpoint[s] == "none":
        return list(problem.checkpoint_menu[s])
    return [o for o in problem.checkpoint_menu[s] if o.name != "none"]


def recompute_lower_bound(problem: ScheduleProblem) -> float:
    """A lower bound on every schedule of ``problem`` under *any* choice of checkpoint options.

    Part 7 of the module docstring, over the menus (:attr:`~fxpipe.ir.ScheduleProblem.checkpoint_menu`;
    with the default menu, the old recomputation choice): ``min`` over the choices ``x`` of a
    relaxation of :func:`combinatorial_lower_bound` of ``problem.with_checkpoint(x)``. ``h_i(o)``
    are parts 1-3 on stage i running option o, every other stage on its lightest option (the least
    replayed forward, the least round trip). ``C(x)`` are parts 1, 4 (memory-blind) and 6, with
    every stage's B taken as its split-backward time plus the option's replay (a fused option moves
    W's time into B, which never lowers these terms: part 1's mixed case grows with B at fixed
    ``B + W``, the round trips with B, part 4's sums are unchanged) and part 6's forced W work
    the least over the stage's options; so ``C`` grows with each stage's replay time, and for
    every threshold ``V`` the choice of the least-replay option with ``h_i <= V`` attains the
    minimum of ``max(max_i h_i, C)`` among choices with every ``h_i <= V``. Trying every ``V`` in
    ``{h_i(o)}`` gives a bound on every schedule of every choice (stages that already checkpoint
    stay checkpointing). The thresholds are tried in increasing order: the choice at ``V`` is reached first at
    ``V = max_i h_i`` of it (the choice at that threshold is the same), so a threshold that repeats the
    choice before it adds nothing, and once ``V`` reaches the least value found no later choice can be
    lower (it is worth at least its own ``max_i h_i``, at least ``V``): the same minimum, fewer relaxations
    evaluated.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem with its checkpoint menus.

    Returns
    -------
    float
        Seconds; every valid schedule of ``problem.with_checkpoint(x)``, for every reachable ``x``,
        has an objective value at least this large.

    References
    ----------
    Module docstring parts 1-7; Chen et al. 2016 (activation recomputation).
    """
    opts, h, value = _recompute_terms(problem)
    best, seen = math.inf, None
    for theta in sorted({-math.inf} | {v for hs in h for v in hs.values()}):
        if theta >= best:  # a choice first reached at theta is worth at least its largest h_i, theta itself
            break
        pick = _threshold_choice(opts, h, theta)
        if pick is None or pick == seen:  # none, or the same choice as at the threshold before: its value
            continue
        seen = pick
        best = min(best, value(pick))
    return best


def _threshold_choice(opts: list, h: list[dict], theta: float) -> list | None:
    """Every stage's least-replay option whose ``h_i`` is at most ``theta`` (None if a stage has none)."""
    pick = []
    for s, menu in enumerate(opts):
        ok = [o for o in menu if h[s][o.name] <= theta]
        if not ok:
            return None
        pick.append(min(ok, key=lambda o: o.replay_s))
    return pick


def _recompute_terms(problem: ScheduleProblem):
    """The pieces of :func:`recompute_lower_bound`: ``(opts, h, value)``, every stage's reachable options, their
    ``h_i`` (``{name: seconds}`` per stage) and ``value(choice)``, the relaxation ``max(max_i h_i, C)`` of a
    choice (one option per stage)."""
    S = problem.num_stages
    opts = [_reachable(problem, s) for s in range(S)]
    cur = [problem.checkpoint_option(s) for s in range(S)]
    tb0 = np.array([float(problem.t_b[s]) - cur[s].replay_s - cur[s].fused_w_s for s in range(S)])
    tw0 = np.array([float(problem.t_w[s]) + cur[s].fused_w_s for s in range(S)])
    light = {s: min(opts[s], key=lambda o: (o.replay_s + o.fused_w_s, o.name)).name for s in range(S)}
    lightest = problem.with_checkpoint({s: n for s, n in light.items() if n != problem.checkpoint[s]})
    d_light = _round_trip(lightest)  # stage s's round trip reads only later stages: the same under s's options
    h = [{o.name: _stage_terms(_StageView(lightest, s, o.name), s, d_light[s]) for o in opts[s]} for s in range(S)]
    extra = np.array([min(_forced_w_s(problem, s, o, float(tb0[s]), float(tw0[s])) for o in opts[s]) for s in range(S)])

    def value(pick: list) -> float:
        relaxed = dataclasses.replace(problem, t_b=_frozen(tb0 + [p.replay_s for p in pick]), t_w=_frozen(tw0))
        spans = np.maximum(stage_span_bounds(relaxed), chain_stage_span_bounds(relaxed, w_extra_s=extra))
        return max(max(h[s][pick[s].name] for s in range(S)),
                   _objective_bound(relaxed, spans, device_span_bounds(relaxed, memory=False)))

    return opts, h, value


def _frozen(arr) -> np.ndarray:
    out = np.ascontiguousarray(np.asarray(arr, dtype=np.float64))
    out.setflags(write=False)
    return out
