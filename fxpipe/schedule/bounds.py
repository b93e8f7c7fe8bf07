"""Combinatorial lower bounds on pipeline schedules (no solver).

For every stage s write ``F, B, W`` for its op times, ``m`` for the number of
micro-batches and

``D_s = sum_{k > s} (t_f[k] + t_b[k]) + 2 sum_{k = s}^{S-2} t_comm[k]``

for the round trip a micro-batch makes after ``F(s, j)`` ends and before ``B(s, j)`` may
start (forward through every later stage, back through their backwards, with comm each
way; ``D_{S-1} = 0``). Facts used (Contract 3 rules 2-3):

* before the first B of stage s only forwards run on s (a W needs its B first);
* after the last F of stage s ends only backwards and weight passes run on s;
* the first B of stage s, of micro-batch j, starts at least ``D_s`` after ``F(s, j)`` ends;
  the B of the last forward's micro-batch starts at least ``D_s`` after that forward ends.

Stage span (from the first F start to the last W end of stage s, OptPipe Eq. 3). Let
``tB`` be the first B start and ``tF`` the last F end of s.

* If ``tF <= tB`` (all forwards first): the head ``[t0, tB]`` lasts at least
  ``max(mF, F + D)``, then all ``m(B + W)`` work follows; also the last forward's
  micro-batch needs ``D + B + W`` after ``tF >= t0 + mF``. So
  ``span >= max(max(mF, F + D) + m(B + W), mF + D + B + W)``.
* If ``tB < tF`` (needs m >= 2): with x forwards in the head (``1 <= x <= m - 1``) and y
  backward work in the tail (``B + W <= y <= m(B + W) - B``; the first B lies between),
  ``span >= m(F + B + W) + max(0, F + D - xF) + max(0, D + B + W - y)``, smallest at
  ``x = m - 1``, ``y = m(B + W) - B``.

The stage's bound is the smaller of the two cases; the problem's bound the largest over
stages. Makespan (OptPipe Eq. 4): stage s cannot start before ``A_s = sum_{k<s}(t_f[k] +
t_comm[k])`` and its last B is followed by ``Z_s = sum_{k<s}(t_comm[k] + t_b[k]) + t_w[0]``,
so ``makespan >= max_s max(A_s + span bound_s, A_s + m(F_s + B_s) + Z_s)``.

Memory limits and offload only add constraints, so the bounds hold for every problem.

References
----------
OptPipe Eq. 3-6 (objectives and dependencies); Qi et al. 2024 Section 2 (bubble analysis
of 1F1B / ZB-H1: the ``(p - 1)(F + B)`` warm-up/cool-down is what ``D_s`` generalises).
"""

from __future__ import annotations

import numpy as np

from fxpipe.ir import ScheduleProblem

__all__ = ["combinatorial_lower_bound", "stage_span_bounds"]


def _round_trip(problem: ScheduleProblem) -> np.ndarray:
    S = problem.num_stages
    D = np.zeros(S)
    for s in range(S - 2, -1, -1):
        D[s] = D[s + 1] + problem.t_f[s + 1] + problem.t_b[s + 1] + 2.0 * problem.t_comm[s]
    return D


def stage_span_bounds(problem: ScheduleProblem) -> np.ndarray:
    """Lower bound on the span of every stage (float64 array (S,), seconds).

    See the module docstring for the derivation.
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


def combinatorial_lower_bound(problem: ScheduleProblem) -> float:
    """A sound lower bound on the problem's objective (``stage_span`` or ``makespan``).

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
    spans = stage_span_bounds(problem)
    if problem.objective == "stage_span":
        return float(spans.max())
    S, m = problem.num_stages, problem.num_microbatches
    best = 0.0
    A = 0.0
    for s in range(S):
        if s > 0:
            A += float(problem.t_f[s - 1] + problem.t_comm[s - 1])
        Z = float(sum(problem.t_comm[k] + problem.t_b[k] for k in range(s))) + float(problem.t_w[0])
        best = max(best, A + spans[s], A + m * float(problem.t_f[s] + problem.t_b[s]) + Z)
    return best
