"""Biased random-key genetic algorithm (BRKGA) over Kahn priorities, decoded by SliceGraph.

A chromosome is a vector of random keys ``x in [0, 1)^n``; it is decoded by Kahn's
algorithm with priorities ``x`` (:func:`fxpipe.partition.orders.kahn_kernel`) followed by
the optimal slicing of that order (:func:`fxpipe.partition.slicegraph.slice_kernel`); its
fitness is the resulting bottleneck (Archer et al. 2024, Algorithm 2,
``BrkgaSortAndSliceDecoder``).

Each generation (Goncalves & Resende 2011, Section 2):

1. the ``elite_fraction * population`` best chromosomes are copied unchanged;
2. ``mutant_fraction * population`` fresh random chromosomes are added;
3. the rest are offspring of one elite and one non-elite parent (both uniform), each gene
   taken from the elite parent with probability ``rho_e``.

Only offspring and mutants are decoded. They are decoded with the worst elite fitness as
the SliceGraph incumbent: a chromosome that cannot reach it cannot enter the next elite set
(elites are kept). The elite set is the ``n_elite`` best (stable sort) and the non-elite
chromosomes keep their positions (BRKGA draws non-elite parents uniformly and never needs
their fitness), so pruning never changes the run, it only speeds up decoding. The
population is decoded in parallel: contiguous slices of it go to a thread pool whose
threads run the ``nogil`` numba decoder (one thread per core; chromosomes are independent,
so the result does not depend on the number of threads). Threads rather than numba
``prange``: on a loaded machine OpenMP's spinning barrier made ``prange`` 4-7x slower than
one thread, while the pool never is.

Stopping: when the best fitness reaches ``target`` (a proven lower bound: the incumbent is
then optimal), after ``max_evaluations`` decodes, ``max_generations`` generations,
``stall_generations`` generations or ``stall_time_s`` seconds without improvement, or
``time_limit_s`` seconds (checked between chunks of a few chromosomes per thread;
chromosomes left undecoded when time runs out count as unfit), whichever comes first.
:class:`BRKGAResult` says which rule stopped the run. With the same seed, a run stopped by
evaluations or generations is reproducible whatever the timing.

References
----------
Goncalves, J. F. and Resende, M. G. C. "Biased random-key genetic algorithms for
combinatorial optimization", Journal of Heuristics 17(5):487-525, 2011.
Archer et al. 2024, Section 4.2, Algorithm 2, Appendix C.1 (population 100, 100 generations).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition._numba import NJIT, njit
from fxpipe.partition.orders import kahn_kernel, node_classes
from fxpipe.partition.slicegraph import kernel_inputs, slice_kernel
from fxpipe.progress import Search

__all__ = ["BRKGAParams", "BRKGAResult", "run_brkga", "decode_population", "PopulationDecoder"]


@njit(**NJIT)
def decode_population(
    keys,
    cls,
    succ_ptr,
    succ_idx,
    pred_ptr,
    pred_idx,
    work,
    size_out,
    io_scale,
    relay,
    k,
    bounds,
    mem_param,
    mem_act,
    inflight,
    mem_cap,
    buf_in,
    buf_out,
    size_grad,
):
    """Fitness of every chromosome: Kahn with priorities, then SliceGraph.

    Runs without the GIL (``nogil=True``): :class:`PopulationDecoder` calls it on slices of
    the population from several threads.

    Parameters
    ----------
    keys : float64 (p, n)
        Random keys, one chromosome per row.
    cls : int64 (n,)
        Kahn node classes (:func:`fxpipe.partition.orders.node_classes`).
    bounds : float64 (p,)
        Incumbent for each chromosome (``inf``: none).
    Other arguments as in :func:`fxpipe.partition.slicegraph.slice_kernel`.

    Returns
    -------
    float64 (p,)
        Bottleneck of each chromosome's optimal slicing (seconds); ``inf`` where it cannot
        beat its bound or no slicing fits in memory.
    """
    p = keys.shape[0]
    fit = np.empty(p)
    for i in range(p):
        order = kahn_kernel(keys[i], cls, succ_ptr, succ_idx, pred_ptr)
        best, _cuts = slice_kernel(
            order, succ_ptr, succ_idx, pred_ptr, pred_idx, work, size_out, io_scale, relay, k, bounds[i],
            mem_param, mem_act, inflight, mem_cap, buf_in, buf_out, size_grad,
        )
        fit[i] = best
    return fit


class PopulationDecoder:
    """Decode batches of chromosomes for one (graph, k, objective, comm, memory) problem.

    Parameters
    ----------
    graph : OpGraph
    k : int
    objective, comm : str
    memory : float, MemoryModel, PartitionMemory or None
    threads : int, optional
        Decoding threads (default: ``numba.config.NUMBA_NUM_THREADS``, the core count).
    """

    def __init__(self, graph: OpGraph, k: int, objective: str, comm: str, memory=None, *, threads: int | None = None) -> None:
        import numba  # noqa: PLC0415

        self.graph = graph
        self.cls = node_classes(graph)
        self.base, self.mem = kernel_inputs(graph, k, objective, comm, memory)
        self.evaluations = 0
        self.threads = max(1, int(threads or numba.config.NUMBA_NUM_THREADS))
        self._pool = None

    def _decode(self, keys: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        sp, si, pp, pi, work, size, scale, relay, k = self.base
        return decode_population(keys, self.cls, sp, si, pp, pi, work, size, scale, relay, k, bounds, *self.mem)

    def __call__(self, keys: np.ndarray, bound: float | np.ndarray = math.inf) -> np.ndarray:
        """Fitness (float64 (p,)) of ``keys`` (float64 (p, n)) with incumbent ``bound``."""
        keys = np.ascontiguousarray(keys, dtype=np.float64)
        p = keys.shape[0]
        bounds = np.broadcast_to(np.asarray(bound, dtype=np.float64), (p,)).copy()
        if p == 0:
            return np.empty(0)
        nchunks = min(self.threads, p)
        if nchunks <= 1:
            fit = self._decode(keys, bounds)
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="fxpipe-decode")
            edges = np.linspace(0, p, nchunks + 1).astype(int)
            futs = [self._pool.submit(self._decode, keys[a:b], bounds[a:b]) for a, b in zip(edges[:-1], edges[1:])]
            fit = np.concatenate([f.result() for f in futs])
        self.evaluations += p
        return fit

    def close(self) -> None:
        """Shut the thread pool down (also done when the decoder is garbage-collected)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def order(self, keys: np.ndarray) -> np.ndarray:
        """The Kahn order of one chromosome, int64 (n,)."""
        sp, si, pp = self.base[0], self.base[1], self.base[2]
        return kahn_kernel(np.ascontiguousarray(keys, dtype=np.float64), self.cls, sp, si, pp)


def _elite_first(fit: np.ndarray, ne: int) -> np.ndarray:
    """Permutation: the ``ne`` fittest (stable), then everyone else in their current order."""
    elite = np.argsort(fit, kind="stable")[:ne]
    rest = np.ones(fit.shape[0], dtype=bool)
    rest[elite] = False
    return np.concatenate([elite, np.flatnonzero(rest)])


@dataclass(frozen=True)
class BRKGAParams:
    """BRKGA parameters; defaults follow Archer et al. (App. C.1) and Goncalves & Resende.

    Attributes
    ----------
    population : int
        Chromosomes per generation (default 100, as in Archer's brkga-10000).
    elite_fraction : float
        Fraction kept as elite (default 0.2; G&R recommend 0.10-0.25).
    mutant_fraction : float
        Fraction replaced by random mutants (default 0.15; G&R recommend 0.10-0.30).
    rho_e : float
        Probability that an offspring gene comes from the elite parent (default 0.7).
    max_generations : int or None
        Stop after this many generations after the initial one (default 100).
    max_evaluations : int or None
        Stop after this many decodes (including the initial population).
    stall_generations : int or None
        Stop after this many generations without improvement (default None: no rule).
    stall_time_s : float or None
        Stop after this many seconds without improvement (default None: no rule).
    time_limit_s : float or None
        Wall-clock budget in seconds, checked between decoding chunks (default None).
    """

    population: int = 100
    elite_fraction: float = 0.2
    mutant_fraction: float = 0.15
    rho_e: float = 0.7
    max_generations: int | None = 100
    max_evaluations: int | None = None
    stall_generations: int | None = None
    stall_time_s: float | None = None
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if int(self.population) < 2:
            raise InputError(f"population must be >= 2, got {self.population}")
        if not 0 < self.elite_fraction < 1:
            raise InputError(f"elite_fraction must be in (0, 1), got {self.elite_fraction}")
        if not 0 <= self.mutant_fraction < 1 or self.elite_fraction + self.mutant_fraction > 1:
            raise InputError("mutant_fraction must be in [0, 1) with elite_fraction + mutant_fraction <= 1")
        if not 0.5 <= self.rho_e <= 1:
            raise InputError(f"rho_e must be in [0.5, 1], got {self.rho_e}")
        for name in ("max_generations", "max_evaluations", "stall_generations"):
            v = getattr(self, name)
            if v is not None and int(v) < 0:
                raise InputError(f"{name} must be >= 0, got {v}")
        for name in ("time_limit_s", "stall_time_s"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise InputError(f"{name} must be >= 0, got {v}")

    @property
    def n_elite(self) -> int:
        return max(1, int(round(self.elite_fraction * self.population)))

    @property
    def n_mutant(self) -> int:
        return min(self.population - self.n_elite, int(round(self.mutant_fraction * self.population)))


@dataclass
class BRKGAResult:
    """Outcome of :func:`run_brkga`.

    Attributes
    ----------
    best_fitness : float
        Best bottleneck found (seconds); ``inf`` if nothing fits in memory.
    best_keys : float64 (n,)
    best_order : int64 (n,)
    evaluations, generations : int
    seconds : float
    interrupted : bool
        True if stopped by Ctrl-C (KeyboardInterrupt).
    history : list of (generation, evaluations, seconds, best_fitness)
        One entry per improvement.
    stop_reason : str
        ``"target"`` (reached the lower bound), ``"generations"``, ``"evaluations"``,
        ``"stall"`` (no improvement for ``stall_generations`` / ``stall_time_s``),
        ``"time"`` or ``"interrupted"``.
    """

    best_fitness: float
    best_keys: np.ndarray
    best_order: np.ndarray
    evaluations: int
    generations: int
    seconds: float
    interrupted: bool = False
    history: list = field(default_factory=list)
    stop_reason: str = ""


def run_brkga(
    decoder: PopulationDecoder,
    params: BRKGAParams = BRKGAParams(),
    *,
    seed: int = 0,
    initial_keys: np.ndarray | None = None,
    progress: bool = False,
    target: float = -math.inf,
) -> BRKGAResult:
    """Run BRKGA (module docstring) with a :class:`PopulationDecoder`.

    Parameters
    ----------
    decoder : PopulationDecoder
    params : BRKGAParams
    seed : int
        Seed of the numpy ``Generator`` (the only source of randomness).
    initial_keys : float64 (q, n), optional
        Chromosomes placed in the initial population (e.g. keys reproducing structured
        orders, :func:`fxpipe.partition.orders.keys_from_order`); at most ``population``
        are used, the rest of the population is random.
    progress : bool
        Show a tqdm bar (generation, best bottleneck, evaluations/s).
    target : float
        Stop as soon as the best fitness is <= ``target`` (e.g. a proven lower bound times
        ``1 + tolerance``).

    Returns
    -------
    BRKGAResult
        Ctrl-C during the run returns the best so far with ``interrupted=True``.

    References
    ----------
    Goncalves & Resende 2011; Archer et al. 2024, Algorithm 2.
    """
    n = decoder.graph.n
    P, ne = int(params.population), params.n_elite
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    pop = rng.random((P, n))
    if initial_keys is not None and len(initial_keys):
        init = np.asarray(initial_keys, dtype=np.float64)[:P]
        pop[: init.shape[0]] = init
    budget = params.max_evaluations
    evals = gen = stall = 0
    stop = "time"
    history: list = []
    fit = np.full(P, math.inf)
    best, best_keys = math.inf, pop[0].copy()
    with Search("brkga", unit="gen", total=params.max_generations, progress=progress) as run:
        decode = _ChunkedDecoder(decoder, math.inf if params.time_limit_s is None else t0 + params.time_limit_s, run)
        first = P if budget is None else min(P, int(budget))
        fit[:first], done = decode(pop[:first])
        evals += done
        pop, fit = _elite_sorted(pop, fit, ne)
        best, best_keys = float(fit[0]), pop[0].copy()
        history.append((0, evals, time.perf_counter() - t0, best))
        t_improved = time.perf_counter()
        while not run.stopped:
            stop = _stop_rule(params, best, target, gen, evals, stall, t0, t_improved)
            if stop:
                break
            n_new = P - ne if budget is None else min(P - ne, int(budget) - evals)
            new = _offspring_and_mutants(rng, pop, params)[:n_new]
            new_fit, done = decode(new, float(fit[ne - 1]))  # the worst elite prunes the decoding
            evals += done
            gen += 1
            pop, fit = _elite_sorted(np.concatenate([pop[:ne], new]), np.concatenate([fit[:ne], new_fit]), ne)
            if fit[0] < best:
                best, best_keys = float(fit[0]), pop[0].copy()
                stall, t_improved = 0, time.perf_counter()
                history.append((gen, evals, time.perf_counter() - t0, best))
            else:
                stall += 1
            run.update(1, best=f"{best:.6g}", evals=evals,
                       evals_per_s=f"{evals / max(time.perf_counter() - t0, 1e-9):.0f}")
    if run.interrupted:
        stop = "interrupted"
    return BRKGAResult(
        best_fitness=best,
        best_keys=best_keys,
        best_order=decoder.order(best_keys),
        evaluations=evals,
        generations=gen,
        seconds=time.perf_counter() - t0,
        interrupted=run.interrupted,
        history=history,
        stop_reason=stop,
    )


class _ChunkedDecoder:
    """Decode a population in chunks of a few chromosomes per thread, stopping at the
    deadline or on Ctrl-C (undecoded rows get fitness inf): returns ``(fitness, rows decoded)``."""

    def __init__(self, decoder: PopulationDecoder, deadline: float, run: Search):
        self.decoder, self.deadline, self.run = decoder, deadline, run
        self.chunk = max(8, 4 * decoder.threads)

    def __call__(self, keys: np.ndarray, bound: float = math.inf) -> tuple[np.ndarray, int]:
        out = np.full(keys.shape[0], math.inf)
        done = 0
        while done < keys.shape[0]:
            if done and (time.perf_counter() >= self.deadline or self.run.stopped):
                break
            nxt = min(keys.shape[0], done + self.chunk)
            out[done:nxt] = self.decoder(keys[done:nxt], bound)
            done = nxt
        return out, done


def _elite_sorted(pop: np.ndarray, fit: np.ndarray, ne: int) -> tuple[np.ndarray, np.ndarray]:
    """The population and fitness with the ``ne`` fittest first (:func:`_elite_first`)."""
    perm = _elite_first(fit, ne)
    return pop[perm], fit[perm]


def _stop_rule(params: BRKGAParams, best: float, target: float, gen: int, evals: int, stall: int, t0: float,
               t_improved: float) -> str:
    """The rule that stops the run now (module docstring), or ``""`` to go on."""
    now = time.perf_counter()
    if best <= target:
        return "target"
    if params.max_generations is not None and gen >= params.max_generations:
        return "generations"
    if params.max_evaluations is not None and evals >= params.max_evaluations:
        return "evaluations"
    if params.time_limit_s is not None and now - t0 >= params.time_limit_s:
        return "time"
    if params.stall_generations is not None and stall >= params.stall_generations:
        return "stall"
    if params.stall_time_s is not None and now - t_improved >= params.stall_time_s:
        return "stall"
    return ""


def _offspring_and_mutants(rng: np.random.Generator, pop: np.ndarray, params: BRKGAParams) -> np.ndarray:
    """The non-elite part of the next generation (module docstring, steps 2 and 3): offspring
    of an elite and a non-elite parent, then fresh mutants; ``pop`` has its elite first."""
    P, n = pop.shape
    ne, nm = params.n_elite, params.n_mutant
    no = P - ne - nm
    elite = pop[:ne]
    nonelite = pop[ne:] if P > ne else pop[:ne]
    mutants = rng.random((nm, n))
    a = rng.integers(0, ne, size=no)
    b = rng.integers(0, nonelite.shape[0], size=no)
    take_elite = rng.random((no, n)) < params.rho_e
    offspring = np.where(take_elite, elite[a], nonelite[b])
    return np.concatenate([offspring, mutants])
