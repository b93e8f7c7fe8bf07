"""Lower-bound certificates for pipeline partitions: the MIP hierarchy of Archer et al.

Methods, weakest and cheapest first:

``simple``
    Lemma 3.3, closed form (:mod:`fxpipe.partition.bounds.simple`).
``lp``
    LP relaxation of the exact MIP (plus ``bottleneck >= simple``): a fast tier.
``bottleneck``
    The three-superblock MIP of Section 3.2 with constraint (14).
``guess``
    Guess-the-bottleneck-block, Section 3.3: k three-superblock MIPs ``LB_j`` solved in
    parallel worker processes; the bound is ``min_j LB_j`` (each ``LB_j`` being the dual
    bound its solve reached).
``chain``
    Dynamic programming over the chain of gates of the graph (relay communication only;
    :mod:`fxpipe.partition.chain`): exact on chain-structured models, it stays tight for
    large k where the MIPs cannot be solved. Every MIP run after it starts from its bound.
``exact``
    The MIP of Figure 3 (x eliminated through Eq. 11, c continuous), with relay
    pass-through terms in relay mode, warm-started with the best known partition, and
    started from the best bound the methods before it proved (so exact >= every bound
    run before it, even when it runs out of time). Likewise each guess sub-MIP starts from
    the simple/lp/bottleneck bound, so guess >= bottleneck on time-outs too.

Every method supports ``objective`` in {inference, training}, ``comm`` in {dag, relay}
(Contract 2 of DESIGN.md) and an optional per-device memory capacity, in which case every
bound holds for the partitions that fit the capacity. :func:`compute_bounds` runs a set of
methods and returns a :class:`BoundsReport`.

Memory capacity model
---------------------
The capacity model is the partitioner's (:mod:`fxpipe.partition.memory`, an adapter onto
fxpipe's one memory model :mod:`fxpipe.memory`): the stage at pipeline position s holds
``num_params * static_bytes_per_param + inflight[s] * act_bytes`` of its nodes (16 bytes per
parameter for mixed-precision Adam; ``inflight`` by the activation rule, one stash for the
default ``"floor"``) plus its receive buffers, within ``capacity - reserved``. ``memory``
is a capacity in bytes, a :class:`fxpipe.memory.MemoryModel` or a
:class:`~fxpipe.partition.memory.PartitionMemory`. The MIPs leave the receive buffers out
(they depend on the cut, not on the nodes alone): they constrain fewer partitions than the
partitioner, so their dual bounds stay valid for it.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024, Section 3 and Appendix A.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.bounds.certificate import (
    CERTIFICATE_FORMAT,
    Certificate,
    graph_fingerprint,
    read_certificate,
    write_certificate,
)
from fxpipe.partition.bounds.models import (
    MipData,
    assignment_from_y,
    build_bottleneck,
    build_exact,
    build_guess,
    warm_start_values,
)
from fxpipe.partition.bounds.chain import chain_certificate
from fxpipe.partition.bounds.simple import simple_bound, simple_work_bound
from fxpipe.mip import SolveResult, scip_version, solve_model
from fxpipe.partition.memory import PartitionMemory, as_partition_memory, memory_inputs, stage_memory_bytes
from fxpipe.memory import inflight_stashes
from fxpipe.partition.objective import Partition, check_objective
from fxpipe.progress import Search

__all__ = [
    "METHODS",
    "DEFAULT_METHODS",
    "BoundsReport",
    "Certificate",
    "compute_bounds",
    "bound",
    "make_mip_data",
    "initial_partition",
    "PartitionMemory",
    "write_certificate",
    "read_certificate",
    "simple_bound",
    "simple_work_bound",
    "chain_certificate",
]

METHODS = ("simple", "chain", "lp", "bottleneck", "guess", "exact")
#: Position in the hierarchy: a method starts from the best bound of the lower-ranked
#: methods run before it (every MIP from chain, guess from bottleneck, exact from everything).
_RANK = {m: i for i, m in enumerate(METHODS)}
DEFAULT_METHODS = ("simple", "chain", "bottleneck", "guess", "exact")
#: The MIP methods are skipped once the best partition is proven optimal to this relative
#: tolerance (their bound could not exceed the partition's bottleneck anyway).
PROVEN_RTOL = 1e-6
#: SCIP primal heuristics for a warm-started exact MIP (chosen by measurement, see
#: ``benchmarks/bench_bounds.py --settings``).
WARM_HEURISTICS = "default"
#: SCIP cutting-plane setting per method (chosen by measurement, see
#: ``benchmarks/bench_bounds.py --settings``).
SEPARATING = {"lp": "default", "bottleneck": "fast", "guess": "fast", "exact": "default"}
#: Worker processes for the ``guess`` sub-MIPs.
GUESS_WORKERS = 2


# --------------------------------------------------------------------------------------
# plain data
# --------------------------------------------------------------------------------------


def _check_capacity(data: MipData, graph: OpGraph) -> None:
    """Clear errors for capacities no partition can meet (before any solver runs)."""
    fl = np.ones(data.k) if data.inflight is None else data.inflight
    least = float(fl.min())
    mem = data.mem_bytes + (0.0 if data.act_bytes is None else least * data.act_bytes)
    cap = float(data.capacity_bytes)
    if mem.size and mem.max() > cap:
        v = int(np.argmax(mem))
        raise InfeasibleError(
            f"node {v} ({graph.names[v]!r}) needs {mem[v]:.6g} bytes but a device holds {cap:.6g}: "
            "no partition fits; raise the memory capacity or split the op"
        )
    total = float(mem.sum())
    if total > data.k * cap * (1 + 1e-12):
        raise InfeasibleError(
            f"the model needs at least {total:.6g} bytes but {data.k} devices hold {data.k * cap:.6g}: no partition into "
            f"{data.k} stages fits; raise the memory capacity or use more devices"
        )


def make_mip_data(
    graph: OpGraph,
    k: int,
    objective: str = "inference",
    comm: str = "dag",
    *,
    memory=None,
) -> MipData:
    """Convert an OpGraph to the scaled plain data the MIP builders read.

    ``memory`` is a capacity in bytes, a :class:`fxpipe.memory.MemoryModel` or a
    :class:`~fxpipe.partition.memory.PartitionMemory`; ``capacity_bytes`` of the data is its
    usable part. The scale is the Lemma 3.3 bound in seconds (or the largest cost if that is
    0), so the model's numbers are of order 1.

    Raises
    ------
    InputError
        On a bad objective, comm, k or capacity.
    InfeasibleError
        If the capacity cannot hold one node, or the whole model in k devices.
    """
    check_objective(objective, comm)
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    work = np.asarray(graph.work_s(objective), dtype=np.float64)
    alpha = 2.0 if objective == "training" else 1.0
    comm_cost = alpha * np.asarray(graph.size_out_bytes, dtype=np.float64) / float(graph.bandwidth_bytes_per_s)
    L = simple_work_bound(work, int(k))
    scale = L if L > 0 else float(max(comm_cost.max(initial=0.0), 1e-300))
    if not scale > 0:
        scale = 1.0
    mem = act = inflight = None
    cap = None
    model = as_partition_memory(memory)
    if model is not None:
        mem, act, inflight, cap = memory_inputs(graph, int(k), objective, model)[:4]  # no receive buffers (docstring)
    data = MipData(
        n=graph.n,
        edges=np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2),
        work=work / scale,
        comm_cost=comm_cost / scale,
        comm=comm,
        k=int(k),
        simple_work=L / scale,
        mem_bytes=mem,
        capacity_bytes=cap,
        scale=scale,
        act_bytes=act,
        inflight=inflight,
    )
    if model is not None:
        _check_capacity(data, graph)
    return data


# --------------------------------------------------------------------------------------
# warm start
# --------------------------------------------------------------------------------------


def _fits(graph: OpGraph, assignment: np.ndarray, k: int, objective: str, memory, comm: str = "relay") -> bool:
    """Whether a pipeline-order assignment meets the capacity (always True without one)."""
    model = as_partition_memory(memory)
    if model is None:
        return True
    per = stage_memory_bytes(graph, assignment, k, objective, model, comm)
    return bool(per.max() <= model.usable_bytes * (1 + 1e-12))


def _contiguous_split(graph: OpGraph, k: int, objective: str, comm: str) -> Partition:
    """Cut a topological order into k contiguous pieces of about equal work (fallback)."""
    import networkx as nx

    order = np.array(list(nx.lexicographical_topological_sort(graph.to_networkx())), dtype=np.int64)
    w = np.asarray(graph.work_s(objective), dtype=np.float64)[order]
    cum = np.cumsum(w)
    total = cum[-1] if cum.size else 0.0
    best = None
    for shift in (0.0, 0.25, 0.5, 0.75):
        if total > 0:
            blk = np.minimum(((cum - w * shift) / total * k).astype(np.int64), k - 1)
        else:
            blk = np.minimum(np.arange(order.size) * k // max(order.size, 1), k - 1)
        blk = np.maximum.accumulate(blk)
        a = np.empty(graph.n, dtype=np.int64)
        a[order] = blk
        p = Partition.from_assignment(graph, a, k, objective, comm, order=order, meta={"method": "contiguous-split"})
        if best is None or p.bottleneck < best.bottleneck:
            best = p
    return best


def initial_partition(
    graph: OpGraph,
    k: int,
    objective: str,
    comm: str,
    *,
    time_limit_s: float = 10.0,
    seed: int = 0,
    memory=None,
) -> Partition | None:
    """The best partition the searcher finds, used to warm-start the exact MIP.

    Uses ``fxpipe.partition.search.partition(..., method="brkga")`` (memory-aware when
    ``memory`` is given) when it is installed, else a contiguous split of a topological
    order. Returns None if the searcher finds no partition meeting the capacity.
    """
    try:
        from fxpipe.partition.search import partition as _search  # noqa: PLC0415 (lazy: numba kernels)
    except ImportError:
        _search = None
    if _search is not None and graph.n > 0:
        kwargs = {} if memory is None else {"memory": memory}
        try:
            return _search(graph, k, objective=objective, comm=comm, method="brkga", time_limit_s=time_limit_s, seed=seed, **kwargs)
        except InfeasibleError:
            return None
    part = _contiguous_split(graph, k, objective, comm)
    return part if _fits(graph, part.assignment, k, objective, memory, comm) else None


# --------------------------------------------------------------------------------------
# one method
# --------------------------------------------------------------------------------------


def _model_size(model) -> dict[str, int]:
    return {"variables": int(model.getNVars()), "constraints": int(model.getNConss())}


def _lb_from(res: SolveResult, data: MipData, start_lb_s: float = 0.0) -> float:
    """Lower bound in seconds from a solve.

    Never below Lemma 3.3 (which the model implies) nor below the valid bound the model was
    started from (``start_lb_s``, a constraint of the model), even when SCIP stops before it
    has a dual bound of its own.
    """
    if res.status == "infeasible":
        return math.inf
    dual = res.dual if math.isfinite(res.dual) else -math.inf
    return max(dual * data.scale, data.simple_work * data.scale, start_lb_s)


def _status(statuses: Iterable[str]) -> str:
    st = list(statuses)
    for s in ("userinterrupt", "timelimit"):
        if s in st:
            return s
    if all(s in ("optimal", "infeasible") for s in st):
        return "optimal"
    return st[0] if st else "optimal"


def _infeasible(data: MipData, which: str) -> InfeasibleError:
    cap = "the memory capacity" if data.capacity_bytes is None else f"a memory capacity of {data.capacity_bytes:.6g} bytes"
    return InfeasibleError(
        f"no partition into {data.k} stages fits {cap} per device ({which} is infeasible); "
        "raise the capacity or the number of stages"
    )


def _solve_guess_j(args: tuple) -> tuple[int, dict]:
    data, j, deadline, workers, params, heuristics, emphasis, separating, known = args
    # fair share of the time left: the sub-MIPs still to start (about k - j + 1 of them)
    # share the workers; time left over by easy guesses goes to the later ones
    left = deadline - time.time()
    limit = max(0.5, min(left, left * workers / (data.k - j + 1)))
    model, mv = build_guess(data, j, known_lower_bound=known)
    size = _model_size(model)
    res = solve_model(model, time_limit_s=limit, params=params, heuristics=heuristics, emphasis=emphasis, separating=separating)
    return j, {
        "status": res.status, "dual": res.dual, "nodes": res.nodes, "wall_s": res.wall_s, "time_limit_s": limit, "params": res.params, **size,
    }


def bound(
    method: str,
    data: MipData,
    *,
    time_limit_s: float = 60.0,
    warm_start: np.ndarray | None = None,
    params: dict | None = None,
    workers: int = GUESS_WORKERS,
    heuristics: str | None = None,
    emphasis: str | None = None,
    separating: str | None = None,
    known_lower_bound_s: float = 0.0,
) -> tuple[Certificate, np.ndarray | None]:
    """Run one MIP-based method on prepared data.

    Parameters
    ----------
    method : {"lp", "bottleneck", "guess", "exact"}
    data : MipData
        From :func:`make_mip_data`.
    time_limit_s : float
        Budget of the method, seconds (``guess`` shares it among its k sub-MIPs so that
        the wall time with ``workers`` processes is about the budget: each sub-MIP gets
        its fair share of the time left when it starts).
    warm_start : int array (n,), optional
        A 0-based pipeline-order assignment given to the exact MIP as a MIP start.
    params : dict, optional
        Extra SCIP parameters.
    workers : int
        Processes for the ``guess`` sub-MIPs (1: solve in this process).
    heuristics, emphasis, separating : str, optional
        SCIP settings (see :func:`~fxpipe.partition.bounds.solve.solve_model`); the
        heuristics default is :data:`WARM_HEURISTICS` for a warm-started exact MIP and
        SCIP's default otherwise; separating defaults to :data:`SEPARATING`.
    known_lower_bound_s : float
        A bound already proven for the same problem (seconds); the exact MIP and every
        guess sub-MIP start from it (the certificate records it as
        ``details["start_lower_bound_s"]``).

    Returns
    -------
    certificate : Certificate
        ``lower_bound`` in seconds; ``primal_value`` not yet set.
    assignment : int array (n,) or None
        The exact MIP's incumbent (0-based blocks in pipeline order), if any.

    Raises
    ------
    InfeasibleError
        If the model has no solution (memory capacity too small).
    """
    settings = dict(params=params, heuristics=heuristics, emphasis=emphasis, separating=separating)
    if method in ("exact", "lp"):
        return _bound_exact(data, relax=method == "lp", time_limit_s=time_limit_s, warm_start=warm_start,
                            known_lower_bound_s=known_lower_bound_s, **settings)
    if method == "bottleneck":
        return _bound_bottleneck(data, time_limit_s=time_limit_s, **settings), None
    if method == "guess":
        return _bound_guess(data, time_limit_s=time_limit_s, workers=workers, known_lower_bound_s=known_lower_bound_s,
                            **settings), None
    raise InputError(f"unknown bound method {method!r}; choose from {METHODS}")


def _bound_exact(data: MipData, *, relax: bool, time_limit_s: float, warm_start, known_lower_bound_s: float,
                 params, heuristics, emphasis, separating) -> tuple[Certificate, np.ndarray | None]:
    """:func:`bound` by the exact MIP (Figure 3), warm-started and started from the known
    bound, or by its LP relaxation (``relax``); returns the certificate and the incumbent."""
    method = "lp" if relax else "exact"
    t0 = time.perf_counter()
    start_lb = max(0.0, float(known_lower_bound_s)) if not relax else 0.0
    model, mv = build_exact(data, relax=relax, known_lower_bound=start_lb / data.scale)
    size = _model_size(model)
    ws = None
    if warm_start is not None and not relax and data.k > 1:
        ws = warm_start_values(data, data.k, warm_start)
    res = solve_model(
        model,
        time_limit_s=time_limit_s,
        params=params,
        warm_start=ws,
        read_vars=mv.y if not relax else None,
        heuristics=heuristics or (WARM_HEURISTICS if ws is not None else "default"),
        emphasis=emphasis,
        separating=separating or SEPARATING[method],
    )
    if res.status == "infeasible":
        raise _infeasible(data, "the exact MIP")
    incumbent = None
    if res.values:
        incumbent = assignment_from_y(res.values, data.n, data.k)
    elif not relax and data.k == 1:
        incumbent = np.zeros(data.n, dtype=np.int64)
    cert = Certificate(
        method=method,
        lower_bound=_lb_from(res, data, start_lb),
        status=res.status,
        nodes=res.nodes,
        wall_time_s=time.perf_counter() - t0,
        solver=scip_version(),
        params=res.params,
        details={
            **size,
            "warm_started": ws is not None,
            "start_lower_bound_s": start_lb,
            "mip_primal_s": res.primal * data.scale if math.isfinite(res.primal) else None,
        },
    )
    return cert, incumbent


def _bound_bottleneck(data: MipData, *, time_limit_s: float, params, heuristics, emphasis, separating) -> Certificate:
    """:func:`bound` by the three-superblock MIP (Section 3.2, constraint 14)."""
    t0 = time.perf_counter()
    model, _ = build_bottleneck(data)
    size = _model_size(model)
    res = solve_model(
        model, time_limit_s=time_limit_s, params=params, heuristics=heuristics or "default", emphasis=emphasis,
        separating=separating or SEPARATING["bottleneck"],
    )
    if res.status == "infeasible":
        raise _infeasible(data, "the three-superblock MIP")
    return Certificate(method="bottleneck", lower_bound=_lb_from(res, data), status=res.status, nodes=res.nodes,
                       wall_time_s=time.perf_counter() - t0, solver=scip_version(), params=res.params, details=size)


def _bound_guess(data: MipData, *, time_limit_s: float, workers: int, known_lower_bound_s: float, params, heuristics,
                 emphasis, separating) -> Certificate:
    """:func:`bound` by guess-the-bottleneck-block (Section 3.3): ``min_j LB_j`` over the k
    sub-MIPs, solved by ``workers`` processes, each from the known bound."""
    t0 = time.perf_counter()
    k = data.k
    workers = max(1, min(workers, k))
    start_lb = max(0.0, float(known_lower_bound_s))
    results = _solve_guesses(data, time_limit_s=time_limit_s, workers=workers, start_lb=start_lb, params=params,
                             heuristics=heuristics, emphasis=emphasis, separating=separating)
    lbs = {
        j: (
            math.inf
            if r["status"] == "infeasible"
            else max((r["dual"] if math.isfinite(r["dual"]) else 0.0) * data.scale, data.simple_work * data.scale, start_lb)
        )
        for j, r in results.items()
    }
    # a guess that was never solved (interrupted run) proves only what every guess starts from
    floor = max(data.simple_work * data.scale, start_lb)
    lb = min(lbs.get(j, floor) for j in range(1, k + 1))
    if not math.isfinite(lb):
        raise _infeasible(data, "every guess-the-bottleneck MIP")
    details = {
        "per_guess": {
            str(j): {
                "lower_bound": lbs[j], "status": results[j]["status"], "nodes": results[j]["nodes"],
                "wall_s": results[j]["wall_s"], "time_limit_s": results[j]["time_limit_s"],
            }
            for j in sorted(results)
        },
        "workers": workers,
        "start_lower_bound_s": start_lb,
        "variables": results[1]["variables"],
        "constraints": results[1]["constraints"],
    }
    return Certificate(
        method="guess",
        lower_bound=lb,
        status=_status(r["status"] for r in results.values()),
        nodes=sum(r["nodes"] for r in results.values()),
        wall_time_s=time.perf_counter() - t0,
        solver=scip_version(),
        params=results[1]["params"],
        details=details,
    )


def _solve_guesses(data: MipData, *, time_limit_s: float, workers: int, start_lb: float, params, heuristics, emphasis,
                   separating) -> dict[int, dict]:
    """Solve the guess sub-MIPs ``j = 1..k`` (in a process pool when ``workers > 1``), each
    with its fair share of the time left; in this process a Ctrl-C stops the rest."""
    deadline = time.time() + time_limit_s
    jobs = [
        (data, j, deadline, workers, params, heuristics or "default", emphasis, separating or SEPARATING["guess"],
         start_lb / data.scale)
        for j in range(1, data.k + 1)
    ]
    results: dict[int, dict] = {}
    if workers > 1:
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ctx.Pool(workers) as pool:
            for j, r in pool.imap_unordered(_solve_guess_j, jobs):
                results[j] = r
    else:
        for job in jobs:
            j, r = _solve_guess_j(job)
            results[j] = r
            if r["status"] == "userinterrupt":  # Ctrl-C inside SCIP: the other guesses are not run
                break
    return results


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------


@dataclass
class BoundsReport:
    """Lower bounds of every method run and the best partition known.

    Attributes
    ----------
    k : int
    objective, comm : str
    partition : Partition or None
        Best partition known (warm start or the exact MIP's incumbent); None if no
        partition meeting the memory capacity is known.
    certificates : dict[str, Certificate]
        By method, in the order run.
    capacity_bytes : float or None
        Bytes of one device (its usable part is what a stage may hold).
    capacity_model : dict
        How node memory is counted (:meth:`PartitionMemory.to_dict`, the usable bytes and
        the in-flight stashes per position).
    graph_summary : dict
        Name, n, m, total work and bytes of the graph.
    interrupted : bool
        True if Ctrl-C stopped the run; the certificates are those finished before it.
    """

    k: int
    objective: str
    comm: str
    partition: Partition | None
    certificates: dict
    capacity_bytes: float | None = None
    capacity_model: dict = field(default_factory=dict)
    graph_summary: dict = field(default_factory=dict)
    interrupted: bool = False

    @property
    def best_lower_bound(self) -> float:
        """The largest bound over the methods run, seconds."""
        return max((c.lower_bound for c in self.certificates.values()), default=0.0)

    @property
    def ratio(self) -> float | None:
        """``best_lower_bound / bottleneck`` of the best partition (1.0 = proven optimal)."""
        if self.partition is None:
            return None
        bn = self.partition.bottleneck
        return 1.0 if bn == 0 else self.best_lower_bound / bn

    def to_dict(self) -> dict[str, Any]:
        """Contract 4 shape of ``fxpipe bounds --json``."""
        p = self.partition
        versions = sorted({c.solver for c in self.certificates.values() if c.solver})
        return {
            "k": self.k,
            "objective": self.objective,
            "comm": self.comm,
            "solution": None if p is None else {"bottleneck": p.bottleneck, "assignment": p.assignment.tolist(), "block_costs": p.block_costs.tolist(), "meta": p.meta},
            "lower_bounds": {m: c.lower_bound for m, c in self.certificates.items()},
            "best_lower_bound": self.best_lower_bound,
            "ratio": self.ratio,
            "solver": {
                "version": versions[0] if versions else scip_version(),
                "capacity_bytes": self.capacity_bytes,
                "capacity_model": self.capacity_model,
                "interrupted": self.interrupted,
                "certificates": {m: c.to_dict() for m, c in self.certificates.items()},
            },
        }

    def to_certificate_dict(self, graph: OpGraph | None = None) -> dict[str, Any]:
        """The ``fxpipe.certificate/1`` document (see :func:`write_certificate`)."""
        g = dict(self.graph_summary)
        if graph is not None:
            g["sha256"] = graph_fingerprint(graph)
        p = self.partition
        return {
            "format": CERTIFICATE_FORMAT,
            "graph": g,
            "k": self.k,
            "objective": self.objective,
            "comm": self.comm,
            "capacity_bytes": self.capacity_bytes,
            "capacity_model": self.capacity_model,
            "partition": None if p is None else p.to_dict(),
            "best_lower_bound": self.best_lower_bound,
            "ratio": self.ratio,
            "certificates": {m: c.to_dict() for m, c in self.certificates.items()},
            "how_to_check": (
                "Re-score partition.assignment with fxpipe.partition.objective.block_costs (Contract 2) to check "
                "partition.bottleneck; every lower_bound is a SCIP dual bound, Lemma 3.3, or the chain DP "
                "(fxpipe.partition.chain, deterministic, re-run with solve_chain) for the same objective, "
                "comm mode and memory capacity, reproducible with the listed SCIP version and parameters."
            ),
        }

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per method: method, bound (s), ratio to the best partition, status, time."""
        bn = None if self.partition is None else self.partition.bottleneck
        rows = []
        for m, c in self.certificates.items():
            rows.append(
                {
                    "method": m,
                    "lower_bound_s": c.lower_bound,
                    "ratio": (c.lower_bound / bn) if bn else None,
                    "status": c.status,
                    "wall_time_s": c.wall_time_s,
                    "nodes": c.nodes,
                }
            )
        return rows

    def format_table(self) -> str:
        """Plain-text table of :meth:`table_rows`."""
        lines = [f"{'method':<11} {'bound (s)':>13} {'ratio':>8} {'status':<13} {'time (s)':>9}"]
        for r in self.table_rows():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.4f}"
            lines.append(f"{r['method']:<11} {r['lower_bound_s']:>13.6g} {ratio:>8} {r['status']:<13} {r['wall_time_s']:>9.2f}")
        if self.partition is not None:
            meta = self.partition.meta
            how = str(meta.get("method", "?")) + (f", found by {meta['rule']}" if meta.get("rule") else "")
            lines.append(f"best partition bottleneck: {self.partition.bottleneck:.6g} s ({how})")
        return "\n".join(lines)


def _graph_summary(graph: OpGraph, objective: str) -> dict[str, Any]:
    return {
        "name": graph.name,
        "n": graph.n,
        "m": graph.m,
        "total_work_s": float(np.sum(graph.work_s(objective))),
        "total_size_out_bytes": float(np.sum(graph.size_out_bytes)),
        "total_param_bytes": float(np.sum(graph.size_param_bytes)),
        "bandwidth_bytes_per_s": float(graph.bandwidth_bytes_per_s),
    }


def compute_bounds(
    graph: OpGraph,
    k: int,
    *,
    objective: str = "inference",
    comm: str = "dag",
    methods: Sequence[str] = DEFAULT_METHODS,
    time_limit_s: float = 60.0,
    memory=None,
    warm_start: Partition | np.ndarray | Sequence[int] | None = None,
    search_time_limit_s: float | None = None,
    workers: int = GUESS_WORKERS,
    params: dict | None = None,
    heuristics: str | None = None,
    emphasis: str | None = None,
    separating: str | None = None,
    progress: bool | None = None,
    stop_when_proven: bool = True,
) -> BoundsReport:
    """Lower bounds on the optimal bottleneck of ``graph`` split into ``k`` pipeline stages.

    Parameters
    ----------
    graph : OpGraph
    k : int
        Number of stages (blocks), >= 1.
    objective : {"inference", "training"}
    comm : {"dag", "relay"}
        Contract 2 of DESIGN.md.
    methods : sequence of str
        Subset of :data:`METHODS`, run in the given order.
    time_limit_s : float
        Budget of each MIP method, seconds; a method that runs out returns the best dual
        bound it reached with status ``"timelimit"``.
    memory : float, MemoryModel or PartitionMemory, optional
        Per-device capacity in bytes, a :class:`fxpipe.memory.MemoryModel` or a
        :class:`~fxpipe.partition.memory.PartitionMemory`; every bound then holds for the
        partitions whose stages all fit (stage memory of :mod:`fxpipe.partition.memory`).
    warm_start : Partition or int array (n,), optional
        Best known partition (used as the incumbent and as the exact MIP's start). If
        omitted, :func:`initial_partition` computes one.
    search_time_limit_s : float, optional
        Time for the warm-start search (default ``min(10, time_limit_s)``).
    workers : int
        Processes for the ``guess`` sub-MIPs.
    params : dict, optional
        Extra SCIP parameters for every solve.
    heuristics, emphasis, separating : str, optional
        SCIP settings for every solve (see :func:`bound`).
    progress : bool, optional
        Show a tqdm bar over methods (default: when stderr is a terminal).
    stop_when_proven : bool
        Skip the MIP methods still to run once the best partition is proven optimal within
        :data:`PROVEN_RTOL` (their certificates get status ``"skipped"`` and the bound they
        would have started from).

    Returns
    -------
    BoundsReport

    Raises
    ------
    InputError
        On an unknown method, objective or comm, a bad k, capacity or warm start.
    InfeasibleError
        If no partition fits the memory capacity.

    References
    ----------
    Archer et al. 2024, Section 3 (Lemma 3.3, Eq. 14, Section 3.3, Figure 3).
    """
    check_objective(objective, comm)
    methods = list(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise InputError(f"unknown bound method(s) {bad}; choose from {', '.join(METHODS)}")
    if not (time_limit_s > 0):
        raise InputError(f"time limit must be > 0 seconds, got {time_limit_s}")
    data = make_mip_data(graph, k, objective, comm, memory=memory)
    mem_model = as_partition_memory(memory)
    if progress is None:
        progress = sys.stderr.isatty()
    settings = dict(params=params, workers=workers, heuristics=heuristics, emphasis=emphasis, separating=separating)
    certs: dict[str, Certificate] = {}
    best = None
    # Ctrl-C (here, in the partition search or in a SCIP solve) stops the whole run: the
    # search returns its best partition so far, SCIP a valid bound, and only the instant
    # bounds are computed after it
    with Search("bounds", unit="method", total=len(methods), progress=progress) as run:
        best = _best_known_partition(run, graph, k, objective, comm, mem_model, warm_start,
                                     min(10.0, time_limit_s) if search_time_limit_s is None else search_time_limit_s)
        for m in methods:
            if run.stopped and m != "simple":
                break
            certs[m], best = _run_method(m, graph, k, objective, comm, data, mem_model, certs, best,
                                         time_limit_s=time_limit_s, stop_when_proven=stop_when_proven, **settings)
            run.update(1, method=m)
            if certs[m].status == "userinterrupt":
                run.stop()  # SCIP stopped with a valid bound: stop the whole run
    primal = None if best is None else best.bottleneck
    certs = {m: c.with_primal(primal) for m, c in certs.items()}
    return BoundsReport(
        k=int(k),
        objective=objective,
        comm=comm,
        partition=best,
        certificates=certs,
        capacity_bytes=None if mem_model is None else float(mem_model.capacity_bytes),
        capacity_model=_capacity_model(mem_model, k, objective),
        graph_summary=_graph_summary(graph, objective),
        interrupted=run.interrupted,
    )


def _capacity_model(mem_model: PartitionMemory | None, k: int, objective: str) -> dict:
    """How :func:`compute_bounds` counted node memory (empty without a capacity)."""
    if mem_model is None:
        return {}
    return {
        "kind": "fxpipe.memory",
        **mem_model.to_dict(),
        "usable_bytes": float(mem_model.usable_bytes),
        "static_bytes_per_param": mem_model.model.static_bytes_per_param(objective),
        "inflight": inflight_stashes(int(k), mem_model.num_microbatches, mem_model.activation, objective).tolist(),
    }


def _best_known_partition(run: Search, graph: OpGraph, k: int, objective: str, comm: str, mem_model, warm_start,
                          search_time_limit_s: float) -> Partition | None:
    """The incumbent the bounds are compared with: ``warm_start`` or a search's partition
    (None if it does not fit the capacity). An interrupted search stops ``run``."""
    if warm_start is None:
        try:
            best = initial_partition(graph, k, objective, comm, time_limit_s=search_time_limit_s, memory=mem_model)
        except KeyboardInterrupt:
            # Ctrl-C outside the search's own handling (a handler other than the Search's):
            # no partition, only the instant bounds
            run.stop()
            return None
    elif isinstance(warm_start, Partition):
        if warm_start.k != k or warm_start.objective != objective or warm_start.comm != comm:
            best = Partition.from_assignment(graph, warm_start.assignment, k, objective, comm, meta=dict(warm_start.meta))
        else:
            best = warm_start
    else:
        best = Partition.from_assignment(graph, np.asarray(warm_start), k, objective, comm, meta={"method": "warm_start"})
    if best is not None and best.meta.get("interrupted"):
        run.stop()  # the search was interrupted
    if best is not None and not _fits(graph, best.assignment, k, objective, mem_model, comm):
        best = None  # not a feasible partition under the capacity
    return best


def _run_method(m: str, graph: OpGraph, k: int, objective: str, comm: str, data: MipData, mem_model,
                certs: dict[str, Certificate], best: Partition | None, *, time_limit_s: float, stop_when_proven: bool,
                params, workers, heuristics, emphasis, separating) -> tuple[Certificate, Partition | None]:
    """One method's certificate and the best partition after it (a MIP or the chain DP may
    find a better one than ``best``); MIPs start from the bounds in ``certs`` before them."""
    if m == "simple":
        return simple_bound(graph, k, objective, comm), best
    if m == "chain":
        cert, cand = chain_certificate(graph, k, objective, comm)
        return cert, _better(graph, k, objective, comm, mem_model, best, cand)
    known = max((c.lower_bound for mm, c in certs.items() if _RANK[mm] < _RANK[m]), default=0.0)
    proven = max((c.lower_bound for c in certs.values()), default=0.0)
    if stop_when_proven and best is not None and proven >= best.bottleneck * (1 - PROVEN_RTOL):
        # "stop when done": the partition is already proven optimal, no MIP can say more
        by = max(certs, key=lambda mm: certs[mm].lower_bound)
        return Certificate(
            method=m, lower_bound=known, status="skipped", wall_time_s=0.0,
            details={"reason": f"the partition is already proven optimal by {by}", "start_lower_bound_s": known},
        ), best
    cert, inc = bound(m, data, time_limit_s=time_limit_s, warm_start=None if best is None else best.assignment,
                      params=params, workers=workers, heuristics=heuristics, emphasis=emphasis, separating=separating,
                      known_lower_bound_s=known)
    if inc is not None:
        cand = Partition.from_assignment(graph, inc, k, objective, comm, meta={"method": f"scip-{m}"})
        best = _better(graph, k, objective, comm, mem_model, best, cand)
    return cert, best


def _better(graph: OpGraph, k: int, objective: str, comm: str, mem_model, best: Partition | None,
            cand: Partition | None) -> Partition | None:
    """``cand`` if it fits the capacity and beats ``best``, else ``best``."""
    if cand is not None and _fits(graph, cand.assignment, k, objective, mem_model, comm) and (
        best is None or cand.bottleneck < best.bottleneck * (1 - 1e-12)
    ):
        return cand
    return best
