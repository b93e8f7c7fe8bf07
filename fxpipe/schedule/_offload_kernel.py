"""The numba kernel of :func:`fxpipe.schedule.offload_search.offload_list_schedule`.

One run of the offload-aware list scheduler (the rules are in the docstring of
:mod:`fxpipe.schedule.offload_search`) on per-stage arrays; it returns the timed ops as field
arrays in the order they were started. Compiled on its first call (numba is imported then:
the schedule package loads no heavy package when imported), with the partitioner's flags
(:mod:`fxpipe.partition._numba`: ``cache=True``, ``nogil=True``; ``NUMBA_DISABLE_JIT=1`` runs
it as Python). No fastmath: the times are those of the same IEEE operations in Python.

The kernel is one long function on purpose: its helpers are closures, which numba inlines.
Module-level jitted helpers (the compute stream's choice, the ready-time events) gave the same
schedules but ran 3.8x slower per policy (14.2 ms against 3.7 ms, 32 stages x 32 micro-batches,
measured 2026-11-26).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

_EPS = 1e-9
_F, _B, _W, _O, _R = 0, 1, 2, 3, 4  # op type codes (sort_ops' type order)
_COMPILED = []  # the compiled kernel, once compiled


def list_schedule(*args):
    """:func:`_list_schedule`, compiled on the first call."""
    if not _COMPILED:
        from numba import njit  # noqa: PLC0415 (lazy: importing numba costs time)

        _COMPILED.append(njit(cache=True, nogil=True)(_list_schedule))
    return _COMPILED[0](*args)


def _list_schedule(M, tF, tB, tW, tO, comm, mF, mB, mW, trB, off, lim, res_of, n_res,
                   cap, keep, w_first, delay, reload_ahead, reload_stages, margin, eager_w):
    """Ops ``(stage, mb, type code, start, end)`` of one policy, as arrays, and their count (-1: deadlock).

    Per-stage float64 arrays (S,): durations ``tF, tB, tW, tO``, ``comm`` (to the next stage),
    memory deltas ``mF, mB, mW``, a recomputing B's transient ``trB``, offloaded bytes ``off``
    and the device limit ``lim``; ``res_of`` (S, k) int64: the copy resources of each stage
    (-1 padded; ``n_res`` in all); the policy: int64 ``cap, keep, w_first`` and float64
    ``delay`` (S,), ``reload_ahead``, ``reload_stages``, ``margin``, ``eager_w``.
    """
    S = tF.shape[0]
    inf = math.inf
    tol = 1 + 1e-12

    def _f_ready(s, j, F_end, comm, delay):
        """When the input of F(s, j) has arrived (plus the stage's first-forward delay)."""
        if s == 0:
            return delay[0] if j == 0 else 0.0
        r = F_end[s - 1, j] + comm[s - 1]
        return r + delay[s] if j == 0 else r

    def _b_ready(s, j, F_end, B_end, comm):
        """When the gradient of B(s, j) has arrived."""
        return F_end[s, j] if s == S - 1 else B_end[s + 1, j] + comm[s]

    def _near(s, j, t, nb, B_start, reload_ahead, reload_stages):
        """The backward of stash j is at most ``reload_ahead`` micro-batches or ``reload_stages`` stages away."""
        if j - nb[s] < reload_ahead:
            return True
        for k in range(s + 1, min(S, s + 1 + reload_stages)):
            if B_start[k, j] <= t:
                return True
        return False
    # per stage and micro-batch: end of F, start and end of B, end of the offload and reload
    F_end = np.full((S, M), inf)
    B_start = np.full((S, M), inf)
    B_end = np.full((S, M), inf)
    O_end = np.full((S, M), inf)
    R_end = np.full((S, M), inf)
    # stash state: 0 resident, 1 offloading (O running), 2 offloaded, 3 reloading, 4 reloaded
    state = np.zeros((S, M), np.int64)
    nf = np.zeros(S, np.int64)
    nb = np.zeros(S, np.int64)
    nw = np.zeros(S, np.int64)
    comp_free = np.zeros(S)
    res_free = np.zeros(n_res)  # every copy resource is free from this time on
    mem = np.zeros(S)  # memory at the current time, all starts and ends so far applied
    can_off = np.zeros(S, np.bool_)
    for s in range(S):
        can_off[s] = off[s] > 0 and math.isfinite(lim[s])
    n_max = 5 * S * M  # every F, B, W and at most one offload and one reload per stash
    o_s = np.empty(n_max, np.int64)
    o_j = np.empty(n_max, np.int64)
    o_ty = np.empty(n_max, np.int64)
    o_t0 = np.empty(n_max)
    o_t1 = np.empty(n_max)
    n_ops = 0
    pend = [(0.0, 0, 0, 0.0)]  # (time, kind, stage, delta): memory changes ahead (a heap)
    pend.pop()
    events = [0.0]  # times to look at (a heap)
    pushed = np.full((S, 2), np.nan)  # per stage: the forward and backward ready times last pushed
    n_total = 3 * S * M
    n_done = 0
    while n_done < n_total:
        if len(events) == 0:
            return o_s, o_j, o_ty, o_t0, o_t1, -1
        t = heapq.heappop(events)
        while len(events) > 0 and events[0] <= t + _EPS:  # events within _EPS of t are t
            heapq.heappop(events)
        while len(pend) > 0 and pend[0][0] <= t + _EPS:  # memory changes due by t
            due = heapq.heappop(pend)
            mem[due[2]] += due[3]
        for s in range(S):  # stashes whose offload (reload) ended by t are offloaded (reloaded)
            for j in range(nb[s], nf[s]):
                if state[s, j] == 1 and O_end[s, j] <= t + _EPS:
                    state[s, j] = 2
                elif state[s, j] == 3 and R_end[s, j] <= t + _EPS:
                    state[s, j] = 4
        progressed = False
        for s in range(S - 1, -1, -1):
            # ---- compute stream
            if comp_free[s] <= t + _EPS:
                choice = -1
                jb = nb[s]
                if (jb < nf[s] and _b_ready(s, jb, F_end, B_end, comm) <= t + _EPS
                        and (state[s, jb] == 0 or state[s, jb] == 4)):
                    rise = mB[s] + trB[s]  # > 0 only for a recomputing B replaying its forward
                    if rise <= 0 or mem[s] + rise <= lim[s] * tol + _EPS:
                        choice = _B
                if choice < 0 and nw[s] < nb[s] and B_end[s, nw[s]] <= t + _EPS and nb[s] - nw[s] >= w_first[s]:
                    choice = _W
                if choice < 0 and nf[s] < M and _f_ready(s, nf[s], F_end, comm, delay) <= t + _EPS \
                        and nf[s] - nb[s] < cap[s]:
                    reserve = 0.0  # room kept for the reload of the next backward once it is near
                    if nb[s] < M and state[s, nb[s]] == 2 and _near(s, nb[s], t, nb, B_start, reload_ahead,
                                                                      reload_stages):
                        reserve = off[s]
                    if mem[s] + mF[s] + reserve <= lim[s] * tol + _EPS:
                        choice = _F
                if choice < 0 and nw[s] < nb[s] and B_end[s, nw[s]] <= t + _EPS:
                    if eager_w:
                        choice = _W
                    else:
                        nxt = min(_b_ready(s, jb, F_end, B_end, comm) if jb < nf[s] else inf,
                                  _f_ready(s, nf[s], F_end, comm, delay) if nf[s] < M else inf)
                        if t + tW[s] <= nxt + _EPS:
                            choice = _W
                if choice >= 0:
                    if choice == _B:
                        j, d = jb, tB[s]
                        B_start[s, j] = t
                        B_end[s, j] = t + d
                        mem[s] += mB[s] + trB[s]
                        if trB[s] != 0:
                            heapq.heappush(pend, (t + d, 0, s, -trB[s]))
                        nb[s] += 1
                    elif choice == _W:
                        j, d = nw[s], tW[s]
                        mem[s] += mW[s]
                        nw[s] += 1
                    else:
                        j, d = nf[s], tF[s]
                        F_end[s, j] = t + d
                        mem[s] += mF[s]
                        nf[s] += 1
                    o_s[n_ops], o_j[n_ops], o_ty[n_ops], o_t0[n_ops], o_t1[n_ops] = s, j, choice, t, t + d
                    n_ops += 1
                    heapq.heappush(events, t + d)
                    comp_free[s] = t + d
                    progressed = True
                    n_done += 1
            # ---- copy stream
            if not can_off[s]:
                continue
            copy_free = True
            for r in res_of[s]:
                if r >= 0 and not res_free[r] <= t + _EPS:
                    copy_free = False
            if not copy_free:
                continue
            # reload the oldest offloaded stash whose backward is near
            jr = -1
            for j in range(nb[s], nf[s]):
                if state[s, j] == 2:
                    jr = j
                    break
            if jr >= 0 and _near(s, jr, t, nb, B_start, reload_ahead, reload_stages) \
                    and mem[s] + off[s] <= lim[s] * tol + _EPS:
                j, ty = jr, _R
                state[s, j] = 3
                R_end[s, j] = t + tO[s]
                mem[s] += off[s]
            elif mem[s] + margin * mF[s] > lim[s] + _EPS:
                # offload the stash needed last (resident, its F ended) under memory pressure
                j = -1
                for k in range(nf[s] - 1, nb[s] + keep[s] - 1, -1):
                    if state[s, k] == 0 and F_end[s, k] <= t + _EPS:
                        j = k
                        break
                if j < 0:
                    continue
                ty = _O
                state[s, j] = 1
                O_end[s, j] = t + tO[s]
                heapq.heappush(pend, (t + tO[s], 1, s, -off[s]))
            else:
                continue
            o_s[n_ops], o_j[n_ops], o_ty[n_ops], o_t0[n_ops], o_t1[n_ops] = s, j, ty, t, t + tO[s]
            n_ops += 1
            heapq.heappush(events, t + tO[s])
            for r in res_of[s]:
                if r >= 0:
                    res_free[r] = t + tO[s]
            progressed = True
        if progressed:
            heapq.heappush(events, t)  # a start at t may enable another op at t (e.g. a reload after an offload ends)
        # the future ready times of every stage's next forward and backward are events (a time
        # already pushed for the stage is not pushed again: repeats are dropped when popped)
        for s in range(S):
            if nf[s] < M:
                ready = _f_ready(s, nf[s], F_end, comm, delay)
                if ready != pushed[s, 0] and math.isfinite(ready) and ready > t + _EPS:
                    heapq.heappush(events, ready)
                    pushed[s, 0] = ready
            if nb[s] < nf[s]:
                ready = _b_ready(s, nb[s], F_end, B_end, comm)
                if ready != pushed[s, 1] and math.isfinite(ready) and ready > t + _EPS:
                    heapq.heappush(events, ready)
                    pushed[s, 1] = ready
    return o_s, o_j, o_ty, o_t0, o_t1, n_ops
