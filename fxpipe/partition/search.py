"""Partition search: SliceGraph over many topological orders (structured, random, BRKGA),
the chain DP, and a search that stops when it is done.

:func:`partition` is the partitioner's public entry point: it searches topological orders
(Archer et al. 2024, Section 4.1: every acyclic partition is a slicing of some topological
order) and slices each one optimally with the SliceGraph DP. Around that search:

* **Lower bound first.** Lemma 3.3 and, for relay communication, the chain DP of
  :mod:`fxpipe.partition.chain`, which also yields a partition (optimal on chain-structured
  models such as transformers: every layer boundary is a gate).
* **Stopping rule.** The search stops as soon as the incumbent is within
  :data:`PROVEN_RTOL` of the lower bound (it is then proven optimal; nothing is searched at
  all when a seed already is), when BRKGA has not improved for
  :data:`STALL_GENERATIONS` generations (only for time-limited runs: with ``evaluations``
  the budget is the rule), or at the time limit.
* **Seeds.** The structured orders of the original graph and of the contracted graph, the
  chain partition's order and ``warm_start`` are decoded first and put into BRKGA's
  initial population.
* **Contraction.** The order search runs on the graph with trivial ops merged into their
  neighbours (:mod:`fxpipe.partition.contract`, exact for Contract 2), so a stage never
  holds only views or the ``output`` node; the result is expanded and re-scored on the
  original graph. Finally any stage that still holds only zero-work ops is merged into a
  neighbour when that does not raise the bottleneck.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024, Section 4 and Appendix C.1.
"""

from __future__ import annotations

import copy
import math
import time
import weakref
from dataclasses import replace

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.brkga import BRKGAParams, PopulationDecoder, run_brkga
from fxpipe.partition.chain import boundary_weighted_bound, solve_chain
from fxpipe.partition.colocate import contract_colocated, forbidden_cut_edges
from fxpipe.partition.contract import contract_trivial
from fxpipe.partition.memory import (
    as_partition_memory,
    fewest_stages_to_try,
    infeasible_error,
    memory_inputs,
    stage_memory_bytes,
)
from fxpipe.partition.objective import Partition, block_costs, check_objective
from fxpipe.partition.orders import kahn_order, keys_from_order, structured_orders
from fxpipe.partition.slicegraph import _check_k, assignment_from_cuts, check_order, kernel_inputs, slice_order_arrays
from fxpipe.progress import Search

__all__ = ["partition", "METHODS", "PROVEN_RTOL", "STALL_GENERATIONS", "merge_trivial_stages"]

METHODS = ("brkga", "orders")
#: The search stops when the incumbent is within this relative tolerance of the lower bound.
PROVEN_RTOL = 1e-6
#: A time-limited BRKGA run stops after this many generations without improvement.
STALL_GENERATIONS = 30

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
        return _order_of_assignment(graph, a)
    return check_order(graph, warm_start)


def _order_of_assignment(graph: OpGraph, assignment: np.ndarray) -> np.ndarray:
    """A topological order listing the blocks one after another (blocks in pipeline order):
    Kahn with priority ``block * n + position in the id-order Kahn order``."""
    base = kahn_order(graph, np.arange(graph.n, dtype=np.float64))
    pos = np.empty(graph.n)
    pos[base] = np.arange(graph.n)
    return kahn_order(graph, np.asarray(assignment, dtype=np.float64) * float(graph.n) + pos)


def merge_trivial_stages(graph: OpGraph, part: Partition, objective: str, memory=None) -> Partition:
    """Merge every stage whose ops all have zero work into a neighbouring stage.

    A stage that holds only views, aliases, model inputs or the ``output`` node does no
    work but pays for communication (the ``output`` node alone receives the model output).
    Each such stage is merged into the previous or the next stage, whichever gives the
    lower bottleneck, when that bottleneck is not above the current one; the freed stage
    becomes an empty stage at the end. Costs are recomputed from scratch (Contract 2); with
    ``memory`` (see :func:`partition`) a merge must keep every stage within the usable
    capacity.

    Returns
    -------
    Partition
        ``part`` itself if nothing changed; ``meta["trivial_stages_merged"]`` counts merges
        and ``meta["trivial_stages"]`` lists those left (merging would raise the bottleneck).
    """
    k = part.k
    model = as_partition_memory(memory)
    a = np.asarray(part.assignment, dtype=np.int64).copy()
    work = np.asarray(graph.work_s(objective))
    merged = 0
    left: list[int] = []
    bn = part.bottleneck
    changed = True
    while changed:
        changed = False
        load = np.bincount(a, weights=work, minlength=k)
        count = np.bincount(a, minlength=k)
        for b in range(k):
            if count[b] == 0 or load[b] > 0 or b in left:
                continue
            best = None
            for t in (b - 1, b + 1):
                if t < 0 or t >= k or count[t] == 0:
                    continue
                a2 = a.copy()
                a2[a == b] = t
                if model is not None:
                    used = np.unique(a2)  # positions after empty stages move last
                    remap = np.full(k, k - 1, dtype=np.int64)
                    remap[used] = np.arange(used.size)
                    if stage_memory_bytes(graph, remap[a2], k, objective, model, part.comm).max() > model.usable_bytes:
                        continue
                c = float(block_costs(graph, a2, k, part.objective, part.comm).max())
                if best is None or c < best[0]:
                    best = (c, a2)
            if best is not None and best[0] <= bn * (1 + 1e-12):
                a, bn = best[1], best[0]
                merged += 1
                changed = True
                break
            left.append(b)
    if not merged:
        if left:
            part.meta["trivial_stages"] = left
        return part
    out = Partition.from_assignment(graph, a, k, part.objective, part.comm, order=None, meta=dict(part.meta))
    out.meta["trivial_stages_merged"] = merged
    work_b = np.bincount(out.assignment, weights=work, minlength=k)
    cnt_b = np.bincount(out.assignment, minlength=k)
    rest = [int(b) for b in range(k) if cnt_b[b] and work_b[b] <= 0]
    if rest:
        out.meta["trivial_stages"] = rest
    return out


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
    contract: bool = True,
    chain: bool = True,
    merge_trivial: bool = True,
    colocate: bool = True,
    _explain: bool = True,
    _gap_rtol: float = PROVEN_RTOL,
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
        Wall-clock budget in seconds (>= 0; checked between seed orders and between
        batches/generations, so a run may overshoot by one slicing or one batch; at least one
        seed is decoded; ``meta["seeds_left"]`` counts the seeds the limit left undecoded).
        ``0`` decodes every seed and nothing else.
    seed : int
        Seed of the only random generator; with ``evaluations`` set (and a generous time
        limit) the result is reproducible.
    evaluations : int, optional
        Maximum number of orders decoded by the search. For ``brkga`` without it, the run
        stops after ``brkga_params.max_generations`` (default 100) generations, after
        :data:`STALL_GENERATIONS` generations without improvement, or at the time limit.
    memory : float, MemoryModel or PartitionMemory, optional
        Per-device capacity in bytes, a :class:`fxpipe.memory.MemoryModel`, or a
        :class:`fxpipe.partition.memory.PartitionMemory` (model, micro-batches, activation
        rule): stages whose static state, stashes and receive buffers exceed the usable
        capacity are infeasible (:mod:`fxpipe.partition.memory`).
    progress : bool
        tqdm progress bar.
    warm_start : Partition or int array (n,), optional
        A partition or topological order to start from (its order is always decoded).
    brkga_params : BRKGAParams, optional
        Population size, elite/mutant fractions, rho_e and stopping rules for ``brkga``.
    contract : bool
        Search on the graph with trivial ops merged (module docstring).
    chain : bool
        With relay communication, run the chain DP first (bound and seed partition).
    merge_trivial : bool
        Merge stages holding only zero-work ops into a neighbour
        (:func:`merge_trivial_stages`).
    colocate : bool
        Never cut the output edges of ops whose output size depends on the data
        (:attr:`OpGraph.data_dependent <fxpipe.ir.OpGraph.data_dependent>`): the search runs on
        the graph with those ops contracted with their consumers
        (:mod:`fxpipe.partition.colocate`) and the result is expanded; ``meta["colocated"]``
        says how many groups were contracted and whether the contraction is exact (then the
        lower bound, computed on the contracted graph, is a bound of the constrained problem;
        otherwise the work bound of the contracted graph is used). False: ignore the flags.

    Returns
    -------
    Partition
        Blocks in pipeline order with Contract-2 costs recomputed from scratch.
        ``meta`` holds ``method``, ``evaluations``, ``seconds``, ``seed``, ``order`` (a
        topological order whose slicing is the partition, list of node ids), ``rule`` (which
        seed or search found it: a structured rule, ``"chain"``, ``"random"``, ``"brkga"``),
        ``lower_bound_s`` and ``lower_bound_method`` (the bound the search compared with),
        ``proven_optimal``, ``stop_reason`` (``"bound"``, ``"stall"``, ``"time"``,
        ``"generations"``, ``"evaluations"``, ``"interrupted"``), ``interrupted`` (Ctrl-C),
        ``search_nodes`` (size of the contracted graph) and, with ``memory``,
        ``stage_memory_bytes`` (by the partitioner's rule) and ``usable_bytes``.

    Raises
    ------
    InputError
        Bad ``k``, objective, comm, method, time limit, evaluations or warm start.
    InfeasibleError
        With ``memory``, when no partition found fits; the message gives the overflow of the
        biggest stage and the device count / capacity that would fit, also available as the
        attributes ``overflow_bytes``, ``required_capacity_bytes``, ``stage`` and ``min_devices``
        (``None`` if no device count up to ``min(n, 4k)`` fits); see
        :func:`fxpipe.partition.memory.infeasible_error`.

    References
    ----------
    Archer et al. 2024, Section 4 (SliceGraph, random weights, BRKGA); the chain DP and its
    bound: :mod:`fxpipe.partition.chain`.
    """
    k, time_limit_s, evaluations = _check_arguments(graph, k, objective, comm, method, time_limit_s, evaluations, seed)
    model = as_partition_memory(memory)
    warm_order = None if warm_start is None else _warm_order(graph, warm_start)
    if colocate and graph.data_dependent.any():
        con = contract_colocated(graph)
        if con is not None:
            return _partition_colocated(
                graph, con, k, warm_order, objective=objective, comm=comm, method=method, time_limit_s=time_limit_s,
                seed=seed, evaluations=evaluations, memory=model, progress=progress, brkga_params=brkga_params,
                contract=contract, chain=chain, merge_trivial=merge_trivial, _explain=_explain, _gap_rtol=_gap_rtol)

    t0 = time.perf_counter()
    if model is not None and chain and comm == "relay" and graph.n > 1 and _memory_tight(graph, k, objective, model):
        need = memory_lower_bound(graph, k, objective, model)
        if need > memory_inputs(graph, k, objective, model)[3] * (1 + 1e-9):  # no search can find a fitting one
            if not _explain:
                raise InfeasibleError(f"no partition into {k} stages fits in {model.usable_bytes:.0f} usable bytes: every "
                                      f"one has a stage whose static state, least stash and receive buffers need {need:.0f} bytes")
            raise _infeasible_error(graph, k, objective, comm, model)
    st = None
    with Search("partition") as run:  # Ctrl-C: the best partition so far, with meta["interrupted"]
        lower, lower_method, chain_part = _lower_bound(graph, k, objective, comm, model, chain)
        # the search stops within _gap_rtol of its lower bound (proven optimal only within PROVEN_RTOL, _finish)
        # time_limit_s == 0: every seed is decoded (and nothing else)
        st = _SearchState(run, t0, lower * (1.0 + max(PROVEN_RTOL, float(_gap_rtol))),
                          kernel_inputs(graph, k, objective, comm, model),
                          deadline=t0 + time_limit_s if time_limit_s > 0 else math.inf)
        seeds = _seed_orders(graph, chain_part, warm_order, evaluations)
        run.best_payload = (seeds[0][1], seeds[0][0])  # decoded below even if Ctrl-C came already
        # the chain partition is a slicing of its own order: that order's best slicing is no worse
        known = {} if chain_part is None else {"chain": chain_part.bottleneck * (1 + 1e-9)}
        st.decode(seeds, st.inputs, known=known)
        budget_left = None if evaluations is None else evaluations - st.evals
        if not st.done and not st.timed_out and (budget_left is None or budget_left > 0):
            _search_contracted(st, graph, k, objective, comm, model, method=method, time_limit_s=time_limit_s,
                               seed=seed, evaluations=evaluations, progress=progress, brkga_params=brkga_params,
                               contract=contract)
    if st is None or st.run.best_payload is None:
        raise KeyboardInterrupt  # pressed before the search had anything to return
    return _finish(graph, k, objective, comm, model, st, method=method, seed=seed, lower=lower,
                   lower_method=lower_method, chain_part=chain_part, merge_trivial=merge_trivial, explain=_explain)


def _check_arguments(graph, k, objective, comm, method, time_limit_s, evaluations, seed) -> tuple:
    """Validate :func:`partition`'s arguments; returns ``(k, time_limit_s, evaluations)`` normalised."""
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
    return k, time_limit_s, evaluations


def _memory_tight(graph: OpGraph, k: int, objective: str, memory) -> bool:
    """Whether the stages' memory is on average over 80 % of the usable bytes (or a node alone is over them): only
    then is :func:`memory_lower_bound` worth its chain decomposition."""
    mem_param, mem_act, inflight, cap = memory_inputs(graph, k, objective, memory)[:4]
    weights = mem_param + mem_act * float(np.min(inflight))
    return bool(weights.sum() / k > 0.8 * cap or (weights.size and weights.max() > cap))


def memory_lower_bound(graph: OpGraph, k: int, objective: str, memory) -> float:
    """A lower bound on the largest stage's memory over every partition into ``k`` stages (bytes).

    The per-node memory the kernels count (:func:`fxpipe.partition.memory.memory_inputs`: static state and
    stash per node) plus the receive buffers of the stage's two relay boundaries, each weighted by the least
    factor any stage applies to it (:meth:`fxpipe.memory.MemoryModel.comm_buffer_factors`: ``f_in`` of the
    stages after the first, ``f_out`` on the gradients; only the tensors that carry one, :func:`differentiable`,
    are counted on either boundary, so never more than a stage needs), is a partition objective of its own;
    the relaxed chain DP (:func:`fxpipe.partition.chain.boundary_weighted_bound`, valid for every partition)
    bounds its bottleneck. When it exceeds the usable bytes no partition fits, which the search would only
    find out at its time limit.
    """
    mem_param, mem_act, inflight, _cap, f_in, f_out, size_grad = memory_inputs(graph, k, objective, memory)
    weights = mem_param + mem_act * float(np.min(inflight))
    scale = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
    in_per_byte = float(np.min(f_in[1:])) if k > 1 else 0.0
    surrogate = replace(graph, t_fwd_s=weights / scale, t_bwd_input_s=np.zeros(graph.n), t_bwd_weight_s=np.zeros(graph.n),
                        size_out_bytes=np.asarray(size_grad, dtype=np.float64), bandwidth_bytes_per_s=1e300)
    return boundary_weighted_bound(surrogate, k, in_per_byte / scale, float(f_out) / scale) * scale


#: :func:`_chain_solution`'s results per graph object, ``graph -> {(k, objective): ChainResult}`` (weakly keyed, as
#: :func:`fxpipe.partition.chain.cached_decomposition` is: the mesh search partitions one graph object per pipeline
#: link and tensor-parallel degree into the same stage counts under many memory models).
_CHAIN_SOLUTIONS: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def _chain_solution(graph: OpGraph, k: int, objective: str):
    """:func:`fxpipe.partition.chain.solve_chain` of ``graph`` into ``k`` stages with its partition, relay
    communication: memory-blind, so computed once per graph object, stage count and objective (the mesh search
    partitions one graph into ``k`` stages under each candidate's memory model)."""
    per = _CHAIN_SOLUTIONS.setdefault(graph, {})
    key = (int(k), objective)
    if key not in per:
        per[key] = solve_chain(graph, k, objective, "relay", partition=True)
    return per[key]


def _lower_bound(graph: OpGraph, k: int, objective: str, comm: str, model, chain: bool) -> tuple:
    """The instant lower bound ``(lower_s, method, chain_partition or None)``: Lemma 3.3, and for
    relay communication the chain DP's bound and its partition (dropped if it does not fit)."""
    from fxpipe.partition.bounds.simple import simple_work_bound  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    lower, lower_method = simple_work_bound(graph.work_s(objective), k), "simple"
    chain_part = None
    if chain and comm == "relay" and graph.n > 1:
        res = _chain_solution(graph, k, objective)
        if res.lower_bound_s > lower:
            lower, lower_method = res.lower_bound_s, "chain"
        cand = copy.deepcopy(res.partition)
        if cand is not None and model is not None:
            if stage_memory_bytes(graph, cand.assignment, k, objective, model, comm).max() > model.usable_bytes:
                cand = None
        chain_part = cand
    return lower, lower_method, chain_part


#: :func:`fxpipe.partition.orders.structured_orders` per graph object (weakly keyed, as :data:`_CHAIN_SOLUTIONS`:
#: the mesh search partitions one graph object into several stage counts under many memory models).
_STRUCTURED_ORDERS: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def _seed_orders(graph: OpGraph, chain_part, warm_order, evaluations) -> list[tuple[str, np.ndarray]]:
    """The orders decoded first, ``(rule, order)``: the warm start, the chain partition's order,
    the structured orders (copies of those computed once per graph object); at most ``evaluations``."""
    if graph not in _STRUCTURED_ORDERS:
        _STRUCTURED_ORDERS[graph] = structured_orders(graph)
    seeds: list[tuple[str, np.ndarray]] = [(rule, o.copy()) for rule, o in _STRUCTURED_ORDERS[graph].items()]
    if chain_part is not None:
        seeds.insert(0, ("chain", _order_of_assignment(graph, chain_part.assignment)))
    if warm_order is not None:
        seeds.insert(0, ("warm_start", warm_order))
    return seeds if evaluations is None else seeds[:evaluations]


class _SearchState:
    """What :func:`partition`'s search has so far: the :class:`~fxpipe.progress.Search` (stop
    flag; best bottleneck and ``(order on the original graph, rule)``), the evaluations, the
    reason it stopped and the target (the lower bound within :data:`PROVEN_RTOL`)."""

    def __init__(self, run: Search, t0: float, target: float, inputs: tuple, deadline: float = math.inf):
        self.run, self.t0, self.target, self.inputs, self.deadline = run, t0, target, inputs, deadline
        self.evals = 0
        self.seeds_left = 0  # seed orders not decoded because the time limit came first
        self.stop_reason = "time"
        self.extra_meta: dict = {}
        self.search_n: int | None = None
        self._unbounded: dict = {}  # id(order) -> (order, its slicing) of the seeds sliced without a bound

    def slicing(self, order: np.ndarray) -> tuple[float, np.ndarray]:
        """``slice_order_arrays(order, self.inputs, inf)``: the slicing :meth:`decode` made of this order
        object while it had no bound (the kernel is deterministic), else a new one."""
        known = self._unbounded.get(id(order))
        if known is not None and known[0] is order:
            return known[1]
        return slice_order_arrays(order, self.inputs, math.inf)

    @property
    def best(self) -> float:
        return self.run.best

    @property
    def done(self) -> bool:
        """Proven optimal or interrupted: nothing more to search."""
        return self.stop_reason in ("bound", "interrupted")

    def offer(self, value: float, order: np.ndarray, rule: str) -> None:
        """Keep ``order`` (on the original graph) if it beats the best so far; note a proof."""
        self.run.offer(value, (order, rule))
        if self.best <= self.target:
            self.stop_reason = "bound"

    def check_interrupt(self) -> bool:
        """True (and the stop reason noted) once Ctrl-C was pressed."""
        if self.run.stopped:
            self.stop_reason = "interrupted"
        return self.run.stopped

    def decode(self, seeds, inputs, to_original=None, prefix: str = "", known: dict | None = None) -> None:
        """Slice every seed order optimally (SliceGraph) until one is proven optimal, Ctrl-C, or the
        deadline once a partition exists (a slicing of a deep pipeline on a large graph takes seconds:
        the time limit holds for the seeds too, a seed is sliced only when the last slicing's time says it
        ends before the deadline, and ``seeds_left`` counts the ones not decoded).

        ``known`` maps a seed's rule to a bottleneck some slicing of its order is known to meet: the
        slicing searches below it first (the SliceGraph DP with any bound at or above the optimum
        returns the unbounded result, value and cuts: every state on the optimal slicing's path, and
        every candidate that ties with it, has a cost within the bound), and as before if none is found.
        """
        last_s = 0.0
        for i, (rule, o) in enumerate(seeds):
            now = time.perf_counter()
            if self.run.best_payload is not None and self.evals and now + last_s >= self.deadline:
                self.seeds_left += len(seeds) - i
                self.stop_reason = "time"
                return
            bound = self.best
            hint = (known or {}).get(rule, math.inf)
            val, cuts = slice_order_arrays(o, inputs, min(bound, hint))
            if hint < bound and not val < math.inf:  # not met in the kernel's arithmetic or memory
                val, cuts = slice_order_arrays(o, inputs, bound)
            last_s = time.perf_counter() - now
            if bound == math.inf and inputs is self.inputs:
                self._unbounded[id(o)] = (o, (val, cuts))
            self.evals += 1
            self.offer(float(val), o if to_original is None else to_original(o), prefix + rule)
            if self.done or self.check_interrupt():
                return

    @property
    def timed_out(self) -> bool:
        """The deadline came while seeds were left: no further search."""
        return self.seeds_left > 0


def _search_contracted(st: _SearchState, graph: OpGraph, k: int, objective: str, comm: str, model, *, method: str,
                       time_limit_s: float, seed: int, evaluations, progress: bool, brkga_params, contract: bool) -> None:
    """The search on the graph with trivial ops contracted (module docstring): its structured
    orders, then random orders or BRKGA seeded with the best order so far."""
    con = None
    if contract:
        con = contract_trivial(graph, objective)
        if con.identity:
            con = None
    sg = graph if con is None else con.graph
    st.search_n = sg.n
    decoder = PopulationDecoder(sg, k, objective, comm, model)

    def to_search(order: np.ndarray) -> np.ndarray:
        return order if con is None else con.order_from_original(order)

    def to_original(order: np.ndarray) -> np.ndarray:
        return order if con is None else con.order_to_original(order)

    try:
        s_seeds: list[tuple[str, np.ndarray]] = []
        if con is not None:
            # with a budget, the best order so far counts as one of the decoded seeds
            s_seeds = list(structured_orders(sg).items())[: None if evaluations is None else evaluations - st.evals - 1]
            st.decode(s_seeds, kernel_inputs(sg, k, objective, comm, model), to_original, "contracted-")
        budget_left = None if evaluations is None else evaluations - st.evals
        if st.done or st.timed_out or (budget_left is not None and budget_left <= 0):
            return
        if method == "orders":
            _random_orders(st, decoder, to_original, seed=seed, time_limit_s=time_limit_s, evaluations=evaluations,
                           progress=progress)
        elif method == "brkga" and time_limit_s > 0:
            init_orders = [to_search(st.run.best_payload[0])] + [o for _, o in s_seeds]
            _brkga(st, decoder, to_original, init_orders, seed=seed, time_limit_s=time_limit_s,
                   budget_left=budget_left, progress=progress, brkga_params=brkga_params)
    finally:
        decoder.close()


def _random_orders(st: _SearchState, decoder, to_original, *, seed: int, time_limit_s: float, evaluations,
                   progress: bool) -> None:
    """``method="orders"``: random Kahn priorities in parallel batches until the time limit,
    the evaluation budget, a proof of optimality or Ctrl-C."""
    rng = np.random.default_rng(seed)
    n = decoder.graph.n
    with Search("orders", unit="order", total=evaluations, progress=progress) as bar:
        while time.perf_counter() - st.t0 < time_limit_s and not st.check_interrupt():
            size = _ORDERS_BATCH if n <= 5000 else 4 * decoder.threads  # keep time checks frequent
            batch = size if evaluations is None else min(size, evaluations - st.evals)
            if batch <= 0:
                st.stop_reason = "evaluations"
                return
            keys = rng.random((batch, n))
            fit = decoder(keys, st.best)
            st.evals += batch
            i = int(np.argmin(fit))
            if fit[i] < st.best:
                st.offer(float(fit[i]), to_original(decoder.order(keys[i])), "random")
            bar.update(batch, best=f"{st.best:.6g}")
            if st.done:
                return
    st.check_interrupt()


def _brkga(st: _SearchState, decoder, to_original, init_orders, *, seed: int, time_limit_s: float, budget_left,
           progress: bool, brkga_params) -> None:
    """``method="brkga"``: BRKGA whose initial population holds the seed orders, within what is
    left of the time limit and of the evaluation budget."""
    params = brkga_params or BRKGAParams(stall_generations=None if budget_left is not None else STALL_GENERATIONS)
    params = replace(
        params,
        time_limit_s=max(0.0, time_limit_s - (time.perf_counter() - st.t0)) if params.time_limit_s is None
        else min(params.time_limit_s, time_limit_s),
        max_evaluations=budget_left if budget_left is not None else params.max_evaluations,
        max_generations=None if budget_left is not None else params.max_generations,
    )
    init = np.stack([keys_from_order(o) for o in init_orders])
    res = run_brkga(decoder, params, seed=int(seed), initial_keys=init, progress=progress, target=st.target)
    st.evals += res.evaluations
    st.stop_reason = "bound" if res.stop_reason == "target" else res.stop_reason
    st.extra_meta = {"generations": res.generations, "history": [list(h) for h in res.history if math.isfinite(h[3])]}
    if res.best_fitness < st.best:
        st.offer(res.best_fitness, to_original(res.best_order), "brkga")


def _finish(graph: OpGraph, k: int, objective: str, comm: str, model, st: _SearchState, *, method: str, seed: int,
            lower: float, lower_method: str, chain_part, merge_trivial: bool, explain: bool) -> Partition:
    """The best partition found, re-scored on the original graph (or the chain partition on a
    tie), trivial stages merged, with its proof status and search figures in ``meta``."""
    if st.stop_reason != "bound":
        st.check_interrupt()  # also a KeyboardInterrupt that ended the search's body
    best_order, best_rule = st.run.best_payload
    best_val_kernel, cuts = st.slicing(best_order)  # when nothing fits, the first seed's slicing, made before any bound
    if not math.isfinite(best_val_kernel) and chain_part is None:
        if model is not None:
            if not explain:
                raise InfeasibleError(f"no partition into {k} stages found that fits in {model.usable_bytes:.0f} usable bytes")
            raise _infeasible_error(graph, k, objective, comm, model)
        raise AssertionError("SliceGraph found no slicing without a memory limit (bug)")  # pragma: no cover
    meta = {
        "method": method,
        "evaluations": st.evals,
        "seed": int(seed),
        "rule": best_rule,
        "interrupted": st.run.stopped,
        "kernel_bottleneck": float(best_val_kernel),
        "lower_bound_s": float(lower),
        "lower_bound_method": lower_method,
        "search_nodes": int(graph.n if st.search_n is None else st.search_n),
        "seeds_left": int(st.seeds_left),
        **st.extra_meta,
    }
    if model is not None:
        meta["usable_bytes"] = float(model.usable_bytes)
    part = None
    if math.isfinite(best_val_kernel):
        a = assignment_from_cuts(best_order, cuts)
        part = Partition.from_assignment(graph, a, k, objective, comm, order=best_order, meta={**meta, "order": best_order.tolist()})
    if chain_part is not None and (part is None or chain_part.bottleneck <= part.bottleneck * (1 + 1e-12)):
        # the chain partition puts work on every stage: preferred on ties
        order = _order_of_assignment(graph, chain_part.assignment)
        part = Partition.from_assignment(
            graph, chain_part.assignment, k, objective, comm, order=order,
            meta={**meta, "rule": "chain", "order": order.tolist(), "kernel_bottleneck": chain_part.bottleneck},
        )
    if merge_trivial:
        part = merge_trivial_stages(graph, part, objective, model)
    if "order" not in part.meta or part.order is None:
        order = _order_of_assignment(graph, part.assignment)
        part = Partition(k=part.k, assignment=part.assignment, block_costs=part.block_costs, bottleneck=part.bottleneck,
                         objective=objective, comm=comm, order=order, meta={**part.meta, "order": order.tolist()})
    return _with_proof(graph, part, k, objective, comm, model, lower, st.stop_reason, st.t0)


def _with_proof(graph: OpGraph, part: Partition, k: int, objective: str, comm: str, model, lower: float,
                stop_reason: str, t0: float) -> Partition:
    """Note in ``part.meta`` whether ``part`` is proven optimal by ``lower`` (and why the search
    stopped), its gap, the seconds since ``t0`` and, with ``model``, its stage memory."""
    proven = part.bottleneck <= lower * (1.0 + PROVEN_RTOL)
    part.meta.update(
        lower_bound_s=float(lower),
        proven_optimal=bool(proven),
        stop_reason="bound" if proven else stop_reason,
        gap=float(max(0.0, (part.bottleneck - lower) / part.bottleneck)) if part.bottleneck > 0 else 0.0,
        seconds=time.perf_counter() - t0,
    )
    if model is not None:
        part.meta["stage_memory_bytes"] = stage_memory_bytes(graph, part.assignment, k, objective, model, comm).tolist()
    return part


def _infeasible_error(graph: OpGraph, k: int, objective: str, comm: str, model) -> InfeasibleError:
    """The :class:`InfeasibleError` of :func:`fxpipe.partition.memory.infeasible_error`, with its
    figures searched here: the best partition into ``k`` stages ignoring memory, and the
    smallest feasible stage count up to ``min(n, 4k)`` (structured orders only)."""
    quick = dict(method="orders", time_limit_s=0.0, seed=0, chain=False, contract=False)  # structured orders only
    free = partition(graph, k, objective=objective, comm=comm, **quick)
    max_k = min(graph.n, 4 * k)
    fit_k = None
    for kk in range(fewest_stages_to_try(graph, k, objective, model), max_k + 1):
        try:
            partition(graph, kk, objective=objective, comm=comm, memory=model, _explain=False, **quick)
        except InfeasibleError:
            continue
        fit_k = kk
        break
    return infeasible_error(graph, k, objective, comm, model, free_assignment=free.assignment, min_devices=fit_k,
                            max_k=max_k)


def _partition_colocated(graph: OpGraph, con, k: int, warm_order, *, objective: str, comm: str, memory, **kwargs) -> Partition:
    """:func:`partition` of ``graph`` whose data-dependent groups ``con``
    (:class:`fxpipe.partition.colocate.ColocatedContraction`) must each stay on one stage:
    search the contracted graph, expand, re-score on ``graph`` (Contract 2)."""
    from fxpipe.partition.bounds.simple import simple_work_bound  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    t0 = time.perf_counter()
    sub_warm = None if warm_order is None else con.order_from_original(warm_order)
    try:
        sub = partition(con.graph, k, objective=objective, comm=comm, memory=memory, warm_start=sub_warm, colocate=False,
                        **kwargs)
    except InfeasibleError as exc:  # say that the constraint took part (attributes of exc are kept)
        work = np.bincount(con.group, weights=graph.work_s(objective), minlength=con.graph.n)
        big = int(np.argmax(work))
        exc.args = (f"{exc} (ops whose output size depends on the data stay on one stage with their consumers: "
                    f"{graph.n} ops in {con.graph.n} groups, the largest starting at {con.graph.names[big]!r})",
                    *exc.args[1:])
        raise
    a = con.expand(sub.assignment)
    order = con.order_to_original(sub.order) if sub.order is not None else _order_of_assignment(graph, a)
    meta = dict(sub.meta)
    lower, method = float(meta["lower_bound_s"]), meta["lower_bound_method"]
    if not con.exact:
        # only work-based bounds of the contracted graph bound the constrained problem (module colocate)
        lower, method = simple_work_bound(con.graph.work_s(objective), k), "simple"
    meta.update(
        order=order.tolist(),
        lower_bound_method=method,
        colocated={"groups": int(con.graph.n), "nodes": int(graph.n), "exact": bool(con.exact),
                   "forbidden_edges": int(_forbidden_count(graph))},
    )
    part = Partition.from_assignment(graph, a, k, objective, comm, order=order, meta=meta)
    return _with_proof(graph, part, k, objective, comm, memory, lower, meta["stop_reason"], t0)


def _forbidden_count(graph: OpGraph) -> int:
    return int(forbidden_cut_edges(graph).sum())
