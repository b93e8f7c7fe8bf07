"""Partition search: SliceGraph over many topological orders (structured, random, BRKGA).

:func:`partition` is the partitioner's public entry point: it searches topological orders
(Archer et al. 2024, Section 4.1: every acyclic partition is a slicing of some topological
order) and slices each one optimally with the SliceGraph DP.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024, Section 4 and Appendix C.1.
"""

from __future__ import annotations

import math
import time

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.brkga import BRKGAParams, PopulationDecoder, run_brkga
from fxpipe.partition.memory import as_memory_model, infeasible_error, stage_memory_bytes
from fxpipe.partition.objective import Partition, check_objective
from fxpipe.partition.orders import keys_from_order, structured_orders
from fxpipe.partition.slicegraph import _check_k, assignment_from_cuts, check_order, kernel_inputs, slice_order_arrays

__all__ = ["partition", "METHODS"]

METHODS = ("brkga", "orders")

#: Random chromosomes decoded per parallel batch by ``method="orders"``.
_ORDERS_BATCH = 32


def _warm_order(graph: OpGraph, warm_start) -> np.ndarray:
    """A topological order from a Partition (its blocks, then its order) or an order."""
    if isinstance(warm_start, Partition):
        a = np.asarray(warm_start.assignment, dtype=np.int64)
        if a.shape != (graph.n,):
            raise InputError(f"warm_start partition has {a.shape[0]} nodes, the graph has {graph.n}")
        if warm_start.order is not None:
            return check_order(graph, warm_start.order)
        from fxpipe.partition.orders import kahn_order  # noqa: PLC0415

        # blocks first, then node id: a topological order when the blocks are in pipeline order
        base = kahn_order(graph, np.arange(graph.n, dtype=np.float64))
        pos = np.empty(graph.n)
        pos[base] = np.arange(graph.n)
        return kahn_order(graph, a * float(graph.n) + pos)
    return check_order(graph, warm_start)


def partition(
    graph: OpGraph,
    k: int,
    *,
    objective: str = "inference",
    comm: str = "dag",
    method: str = "brkga",
    time_limit_s: float = 10.0,
    seed: int = 0,
    evaluations: int | None = None,
    memory=None,
    progress: bool = False,
    warm_start=None,
    brkga_params: BRKGAParams | None = None,
    _explain: bool = True,
) -> Partition:
    """Partition ``graph`` into at most ``k`` pipeline stages minimising the bottleneck.

    Parameters
    ----------
    graph : OpGraph
    k : int
        Number of pipeline stages (devices), ``>= 1``. ``k > n`` is accepted here and leaves
        ``k - n`` blocks empty (``fxpipe.compile`` rejects more devices than ops).
    objective : {"inference", "training"}
    comm : {"dag", "relay"}
        Contract-2 cost model (DESIGN.md).
    method : {"brkga", "orders"}
        ``"orders"``: the structured orders of
        :func:`fxpipe.partition.orders.structured_orders`, then random Kahn priorities
        until ``time_limit_s`` or ``evaluations``. ``"brkga"``: BRKGA over Kahn priorities
        whose initial population contains the structured orders (and ``warm_start``).
    time_limit_s : float
        Wall-clock budget in seconds (>= 0; checked between batches/generations, so a run
        may overshoot by one batch). ``0`` decodes only the structured orders (``orders``)
        or the initial population (``brkga``).
    seed : int
        Seed of the only random generator; with ``evaluations`` set (and a generous time
        limit) the result is reproducible.
    evaluations : int, optional
        Maximum number of orders decoded. For ``brkga`` without it, the run stops after
        ``brkga_params.max_generations`` (default 100) generations or the time limit.
    memory : float or MemoryModel, optional
        Per-device capacity in bytes (or a :class:`fxpipe.partition.memory.MemoryModel`):
        stages that do not fit are infeasible.
    progress : bool
        tqdm progress bar.
    warm_start : Partition or int array (n,), optional
        A partition or topological order to start from (its order is always decoded).
    brkga_params : BRKGAParams, optional
        Population size, elite/mutant fractions, rho_e and stopping rules for ``brkga``.

    Returns
    -------
    Partition
        Blocks in pipeline order with Contract-2 costs recomputed from scratch.
        ``meta`` holds ``method``, ``evaluations``, ``seconds``, ``seed``, ``order`` (the
        best topological order, list of node ids), ``rule`` (which order won when it was a
        structured one), ``interrupted`` (Ctrl-C) and, with ``memory``,
        ``stage_memory_bytes``.

    Raises
    ------
    InputError
        Bad ``k``, objective, comm, method, time limit, evaluations or warm start.
    InfeasibleError
        With ``memory``, when no partition found fits; the message gives the overflow of the
        biggest stage and the device count / capacity that would fit, also available as the
        attributes ``overflow_bytes``, ``required_capacity_bytes`` and ``min_devices``
        (``None`` if no device count up to ``min(n, 4k)`` fits); see
        :func:`fxpipe.partition.memory.infeasible_error`.

    References
    ----------
    Archer et al. 2024, Section 4 (SliceGraph, random weights, BRKGA).
    """
    if not isinstance(graph, OpGraph):
        raise InputError(f"graph must be an OpGraph, got {type(graph).__name__}")
    k = _check_k(k)
    check_objective(objective, comm)
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    try:
        time_limit_s = float(time_limit_s)
    except (TypeError, ValueError):
        raise InputError(f"time_limit_s must be a number of seconds, got {time_limit_s!r}") from None
    if not time_limit_s >= 0:
        raise InputError(f"time_limit_s must be >= 0, got {time_limit_s}")
    if evaluations is not None:
        if isinstance(evaluations, bool) or not isinstance(evaluations, (int, np.integer)) or evaluations < 1:
            raise InputError(f"evaluations must be a positive integer, got {evaluations!r}")
        evaluations = int(evaluations)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"seed must be an integer, got {seed!r}")
    model = as_memory_model(memory)

    t0 = time.perf_counter()
    inputs = kernel_inputs(graph, k, objective, comm, model)
    decoder = PopulationDecoder(graph, k, objective, comm, model)
    structured = structured_orders(graph)
    seeds: list[tuple[str, np.ndarray]] = list(structured.items())
    if warm_start is not None:
        seeds.insert(0, ("warm_start", _warm_order(graph, warm_start)))
    if evaluations is not None:
        seeds = seeds[:evaluations]

    best_val, best_order, best_rule = math.inf, seeds[0][1], seeds[0][0]
    evals = 0
    interrupted = False
    extra_meta: dict = {}
    try:
        for rule, o in seeds:  # structured orders, serially with the incumbent
            val, _ = slice_order_arrays(o, inputs, best_val)
            evals += 1
            if val < best_val:
                best_val, best_order, best_rule = float(val), o, rule
    except KeyboardInterrupt:
        interrupted = True

    if not interrupted and method == "orders":
        rng = np.random.default_rng(seed)
        bar = None
        if progress:
            from tqdm.auto import tqdm  # noqa: PLC0415

            bar = tqdm(desc="orders", unit="order", total=evaluations, leave=False)
        try:
            while time.perf_counter() - t0 < time_limit_s:
                size = _ORDERS_BATCH if graph.n <= 5000 else 4 * decoder.threads  # keep time checks frequent
                batch = size if evaluations is None else min(size, evaluations - evals)
                if batch <= 0:
                    break
                keys = rng.random((batch, graph.n))
                fit = decoder(keys, best_val)
                evals += batch
                i = int(np.argmin(fit))
                if fit[i] < best_val:
                    best_val, best_order, best_rule = float(fit[i]), decoder.order(keys[i]), "random"
                if bar is not None:
                    bar.update(batch)
                    bar.set_postfix(best=f"{best_val:.6g}", refresh=False)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if bar is not None:
                bar.close()
    elif not interrupted and method == "brkga" and time_limit_s > 0:
        params = brkga_params or BRKGAParams()
        from dataclasses import replace  # noqa: PLC0415

        remaining = None if evaluations is None else max(0, evaluations - evals)
        params = replace(
            params,
            time_limit_s=max(0.0, time_limit_s - (time.perf_counter() - t0)) if params.time_limit_s is None else min(params.time_limit_s, time_limit_s),
            max_evaluations=remaining if remaining is not None else params.max_evaluations,
            max_generations=None if remaining is not None else params.max_generations,
        )
        if remaining is None or remaining > 0:
            init = np.stack([keys_from_order(o) for _, o in seeds])
            res = run_brkga(decoder, params, seed=int(seed), initial_keys=init, progress=progress)
            evals += res.evaluations
            interrupted = res.interrupted
            extra_meta = {"generations": res.generations, "history": [list(h) for h in res.history if math.isfinite(h[3])]}
            if res.best_fitness < best_val:
                best_val, best_order, best_rule = res.best_fitness, res.best_order, "brkga"

    best_val_kernel, cuts = slice_order_arrays(best_order, inputs, math.inf)
    if not math.isfinite(best_val_kernel):
        if model is not None:
            if not _explain:
                raise InfeasibleError(f"no partition into {k} stages found that fits in {model.capacity_bytes:.0f} bytes")
            raise infeasible_error(graph, k, objective, comm, model)
        raise AssertionError("SliceGraph found no slicing without a memory limit (bug)")  # pragma: no cover
    a = assignment_from_cuts(best_order, cuts)
    meta = {
        "method": method,
        "evaluations": evals,
        "seconds": time.perf_counter() - t0,
        "seed": int(seed),
        "rule": best_rule,
        "interrupted": interrupted,
        "kernel_bottleneck": float(best_val_kernel),
        "order": best_order.tolist(),
        **extra_meta,
    }
    if model is not None:
        meta["memory_capacity_bytes"] = float(model.capacity_bytes)
    part = Partition.from_assignment(graph, a, k, objective, comm, order=best_order, meta=meta)
    if model is not None:
        mem = stage_memory_bytes(graph, part.assignment, k, objective, model)
        part.meta["stage_memory_bytes"] = mem.tolist()
    return part
