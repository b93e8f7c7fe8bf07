"""Measured step times: does fxpipe's partition train faster, and how good are its predictions?

For every model, the op costs are *measured* on this machine (``fxpipe.compile(...,
costs="measured")``: every op's forward, backward-input and backward-weight timed on one CPU
thread, cached in a cost database) and three partitions into ``--ranks`` pipeline stages are
built on the same costed graph:

* ``fxpipe``: fxpipe's partition (SliceGraph DP + BRKGA on the measured costs);
* ``equal-layer``: equal numbers of repeated layers per stage (torchtitan / hand-written
  ``torch.distributed.pipelining`` split points), :func:`fxpipe.partition.baselines.equal_layers`;
* ``param-balanced``: DeepSpeed's ``partition_method="parameters"``,
  :func:`fxpipe.partition.baselines.parameter_balanced`.

Each is scheduled with the same method (default 1F1B) and *predicted*: the schedule's stage
span (DESIGN.md contract 3, the steady-state period of back-to-back steps when no step
synchronises all stages), or its makespan when tied parameters are shared by several stages
(their gradient all-reduce synchronises those ranks once per step), plus the per-step
parameter update, with the runtime's own cost per micro-batch added to every stage: that cost
is measured in the same worker processes on a two-layer MLP whose compute is negligible
(:class:`TinyMLP`), so the prediction of a model never uses that model's training run. The
link between the ranks is measured too (a gloo ping-pong, :func:`fxpipe.cost.links.measure_p2p`,
just before each model): the planner prices transfers at the link's effective bandwidth for the
model's median tensor size, and the prediction prices every tensor crossing a boundary at the
measured time of a message of its size.

Why 1F1B by default: torch 2.13's split backward (``stage_backward_input`` followed later by
``stage_backward_weight``, which Zero Bubble schedules such as ZB-H1 use for the deferred W)
costs much more than the fused backward on CPU (measured here on the GPT-2-like model: about
4 ms more per micro-batch on a stage holding the LM head, a third of that stage's compute);
the op-level cost model does not include that runtime overhead, so ZB-H1 predictions are
optimistic by that much (``--schedule zb-h1`` shows it). Then each is *trained* for a few SGD steps on local gloo ranks (one
process per stage, one intra-op thread each, each process pinned to its own core) through
fxpipe's ``torch.distributed.pipelining`` runtime (:func:`fxpipe.codegen.launch.spawn_train_many`,
the three partitions of a model in one set of worker processes). The *measured* step time is
the median, over the timed steps and the ranks, of the time between the starts of consecutive
steps on a rank (after warm-up steps); a stage's *busy* time is its main thread's CPU time
per step (compute plus runtime overhead, without waiting), next to the predicted
``microbatches * (F + B + W)`` of the stage.

Usage::

    python benchmarks/bench_measured.py --quick          # GPT-2-like decoder + UNet, a few minutes
    python benchmarks/bench_measured.py                  # + Llama-like decoder and T5-like encoder-decoder, larger
    python benchmarks/bench_measured.py --quick --json   # {"rows": [{"model", "partition", "predicted_step_s", "measured_step_s", ...}]}

The machine's load matters: timings taken while other processes compete for the cores are
noisy (the report prints the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# --------------------------------------------------------------------------------------
# models (module level, so that spawned workers can unpickle the factories)
# --------------------------------------------------------------------------------------


class ResBlock(torch.nn.Module):
    """GroupNorm -> SiLU -> 3x3 conv, twice, plus a (1x1 conv) skip: the UNet's building block."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.n1 = torch.nn.GroupNorm(min(8, cin), cin)
        self.c1 = torch.nn.Conv2d(cin, cout, 3, padding=1)
        self.n2 = torch.nn.GroupNorm(min(8, cout), cout)
        self.c2 = torch.nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = torch.nn.Conv2d(cin, cout, 1) if cin != cout else torch.nn.Identity()

    def forward(self, x):
        h = self.c1(torch.nn.functional.silu(self.n1(x)))
        h = self.c2(torch.nn.functional.silu(self.n2(h)))
        return h + self.skip(x)


class Down(torch.nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.block = ResBlock(cin, cout)
        self.pool = torch.nn.Conv2d(cout, cout, 3, stride=2, padding=1)

    def forward(self, x):
        s = self.block(x)
        return s, self.pool(s)


class Up(torch.nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(cin, cin, 2, stride=2)
        self.block = ResBlock(cin + cskip, cout)

    def forward(self, x, skip):
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(torch.nn.Module):
    """A small UNet (Ronneberger et al. 2015) with residual blocks and GroupNorm (no BatchNorm
    buffers to synchronise): stem, ``len(channels) - 1`` down levels, a middle block, as many
    up levels with skip connections, and a 1x1 head."""

    def __init__(self, in_ch: int = 3, channels: tuple = (32, 64, 128), out_ch: int = 3):
        super().__init__()
        c = list(channels)
        self.stem = torch.nn.Conv2d(in_ch, c[0], 3, padding=1)
        self.down = torch.nn.ModuleList([Down(c[i], c[i + 1]) for i in range(len(c) - 1)])
        self.mid = ResBlock(c[-1], c[-1])
        self.up = torch.nn.ModuleList([Up(c[i + 1], c[i + 1], c[i]) for i in reversed(range(len(c) - 1))])
        self.head = torch.nn.Conv2d(c[0], out_ch, 1)

    def forward(self, x):
        h = self.stem(x)
        skips = []
        for d in self.down:
            s, h = d(h)
            skips.append(s)
        h = self.mid(h)
        for u in self.up:
            h = u(h, skips.pop())
        return self.head(h)


@dataclass(frozen=True)
class UNetFactory:
    """Picklable ``make_model`` / ``make_batch`` of the UNet workload (denoising-style MSE)."""

    channels: tuple = (32, 64, 128)
    side: int = 32
    in_ch: int = 3
    microbatches: int = 8
    microbatch_size: int = 2
    seed: int = 0

    def one_microbatch(self, device: str = "cpu"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = UNet(self.in_ch, self.channels, self.in_ch)
        x = torch.rand(self.microbatch_size, self.in_ch, self.side, self.side, generator=torch.Generator().manual_seed(self.seed))
        return model, (x,), {}

    def __call__(self):
        model, _, _ = self.one_microbatch()
        return model, self.batch(0)[0]

    def batch(self, step: int, model=None):
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        b = self.microbatches * self.microbatch_size
        x = torch.rand(b, self.in_ch, self.side, self.side, generator=g)
        return (x,), x.flip(-1)


class TinyMLP(torch.nn.Module):
    """Two 8-wide linear layers: a pipeline whose compute is negligible, so its stages' busy
    time is the runtime's own cost per micro-batch (used to calibrate it)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@dataclass(frozen=True)
class TinyFactory:
    microbatches: int = 8

    def one_microbatch(self, device: str = "cpu"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = TinyMLP()
        return model, (torch.rand(1, 8),), {}

    def __call__(self):
        model, _, _ = self.one_microbatch()
        return model, self.batch(0)[0]

    def batch(self, step: int, model=None):
        x = torch.rand(self.microbatches, 8, generator=torch.Generator().manual_seed(step))
        return (x,), x


@dataclass(frozen=True)
class Pinned:
    """``make_model`` wrapper run in each worker: pins the rank's process to one core and, with
    ``shims``, runs the pipeline as a training job would (see :func:`_runtime_shims`).

    The launcher (:mod:`fxpipe.codegen.launch`) already sets one intra-op thread per rank and
    initialises the process group before calling ``make_model``, so the rank is known here.
    """

    inner: Any
    cpus: tuple
    shims: bool = True

    def __call__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        _pin(self.cpus[rank % len(self.cpus)])
        _contiguous_sends()
        if self.shims:
            _runtime_shims()
        return self.inner()


def _runtime_shims() -> None:
    """Make the launcher's training loop time what a training job runs.

    :func:`fxpipe.codegen.launch.spawn_train` is the correctness harness of the code generator:
    it turns on ``torch.use_deterministic_algorithms`` (3x slower ``log_softmax`` on CPU, for
    example) and calls the schedule's ``step`` with torch's default ``return_outputs=True``, so
    the last stage concatenates every micro-batch's output at the end of each step (for
    logits, megabytes per step; a training job reads only the losses). Both are switched off
    here, in the worker, before the stage is built (``--runtime-as-is`` keeps them).
    """
    from fxpipe.codegen.runtime import FxpipeScheduleRuntime

    torch.use_deterministic_algorithms(False)
    if getattr(FxpipeScheduleRuntime.step, "_fxpipe_no_outputs", False):
        return
    orig = FxpipeScheduleRuntime.step

    def step(self, *args, **kwargs):
        kwargs.setdefault("return_outputs", False)
        return orig(self, *args, **kwargs)

    step._fxpipe_no_outputs = True
    FxpipeScheduleRuntime.step = step


@dataclass(frozen=True)
class TimedBatch:
    """``make_batch`` wrapper: records when each step starts (wall and thread CPU time) per rank."""

    inner: Any
    out_dir: str
    run: str

    def __call__(self, step: int):
        import torch.distributed as dist

        now, cpu = time.perf_counter(), time.thread_time()
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(self.out_dir, f"{self.run}.rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "wall_s": now, "cpu_s": cpu}) + "\n")
        return self.inner.batch(step)


def _contiguous_sends() -> None:
    """Work around a runtime bug seen with some cut points: a stage whose input gradient is not
    contiguous fails in gloo's ``isend`` ("input tensor has to be contiguous"). Every tensor
    torch's ``PipelineStage`` sends passes through ``stage.to_local_if_dtensor``; this makes
    it contiguous (a no-op for the usual contiguous tensors). To be removed once
    ``fxpipe.codegen`` makes boundary gradients contiguous itself."""
    import torch.distributed.pipelining.stage as stage_mod

    orig = stage_mod.to_local_if_dtensor
    if getattr(orig, "_fxpipe_contiguous", False):
        return

    def to_local_contiguous(t, *args, **kwargs):
        out = orig(t, *args, **kwargs)
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    to_local_contiguous._fxpipe_contiguous = True
    stage_mod.to_local_if_dtensor = to_local_contiguous


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            pass


# --------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------


def _workloads(quick: bool, microbatches: int) -> dict[str, tuple[Any, str]]:
    from fxpipe.cli.plan_cmd import HFFactory

    gpt2 = HFFactory("gpt2", {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 8192}, microbatches, 1, 64, 0)
    unet = UNetFactory((32, 64, 128), 32, 3, microbatches, 2, 0)
    out = {"gpt2": (gpt2, "cross_entropy"), "unet": (unet, "mse")}
    if not quick:
        out["gpt2-8l"] = (HFFactory("gpt2", {"n_layer": 8, "n_embd": 256, "n_head": 4, "vocab_size": 16384}, microbatches, 1, 128, 0),
                          "cross_entropy")
        out["llama"] = (HFFactory("llama", {"num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 688,
                                            "vocab_size": 8192}, microbatches, 1, 128, 0), "cross_entropy")
        out["unet-4"] = (UNetFactory((32, 64, 128, 256), 64, 3, microbatches, 1, 0), "mse")
    return out


# --------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------


@dataclass
class Candidate:
    name: str
    partition: Any
    problem: Any
    schedule: Any
    stage_of: dict
    rows: dict = field(default_factory=dict)


def _loss_fn(loss: str):
    from fxpipe.codegen.launch import cross_entropy_loss

    return {"cross_entropy": cross_entropy_loss, "mse": torch.nn.functional.mse_loss}[loss]


def _plan(name: str, factory, loss: str, args, link=None) -> tuple[Any, Any, float]:
    """Measured-cost graph (with the loss on the output node) and fxpipe's partition + schedule.

    This is ``fxpipe.compile(..., costs="measured")`` spelled out, because the loss, which runs
    on the last stage, is not part of the captured model: :func:`fxpipe.cost.profile.measure_loss`
    times it and :func:`~fxpipe.cost.profile.add_loss_costs` puts it on the output node.
    """
    from fxpipe.api import plan_graph
    from fxpipe.cost.calibrate import with_link_bandwidth
    from fxpipe.cost.profile import add_loss_costs, measure_loss, trace_measured

    k, m = args.ranks, args.microbatches
    model, margs, mkwargs = factory.one_microbatch()
    t0 = time.perf_counter()
    traced, report = trace_measured(model, margs, mkwargs, db=args.cost_db, threads=1, name=name, clock=args.clock)
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    out_node = out_node[0] if isinstance(out_node, (tuple, list)) else out_node
    out_val = out_node.meta["val"]
    target = factory.batch(0)[1]
    target = target[: target.shape[0] // m]
    t_lf, t_lb = measure_loss(_loss_fn(loss), torch.empty(tuple(out_val.shape), dtype=out_val.dtype), target,
                              db=args.cost_db, threads=1, clock=args.clock)
    graph = add_loss_costs(traced.graph, t_lf, t_lb)
    if link is not None:
        graph = with_link_bandwidth(graph, link)
    profile_s = time.perf_counter() - t0
    part, problem, sched, _ = plan_graph(graph, devices=k, microbatches=m, schedule=args.schedule,
                                         time_limit_s=args.time_limit)
    fx = Candidate("fxpipe", part, problem, sched, {graph.names[i]: int(part.assignment[i]) for i in range(graph.n)})
    print(f"# {name}: {graph.n} ops; {report.measured} op signatures measured, {report.reused} reused, "
          f"{len(report.failed)} failed; loss F {t_lf * 1e3:.2f} ms B {t_lb * 1e3:.2f} ms; profiling {profile_s:.1f} s; "
          f"link bandwidth {graph.bandwidth_bytes_per_s / 1e9:.3f} GB/s", file=sys.stderr)
    return graph, fx, profile_s


def _candidates(graph, fx: Candidate, k: int, m: int, schedule: str) -> list[Candidate]:
    from fxpipe.api import fill_empty_stages
    from fxpipe.partition.baselines import equal_layers, parameter_balanced
    from fxpipe.schedule.dispatch import make_schedule
    from fxpipe.schedule.from_partition import problem_from_partition

    out = [fx]
    for name, fn in (("equal-layer", equal_layers), ("param-balanced", parameter_balanced)):
        part = fill_empty_stages(graph, fn(graph, k, objective="training", comm="relay"))
        prob = problem_from_partition(graph, part, num_microbatches=m)
        sched = make_schedule(prob, schedule)
        out.append(Candidate(name, part, prob, sched, {graph.names[i]: int(part.assignment[i]) for i in range(graph.n)}))
    return out


def _read_marks(out_dir: str, run: str, ranks: int) -> list[list[dict]]:
    marks = []
    for r in range(ranks):
        path = os.path.join(out_dir, f"{run}.rank{r}.jsonl")
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        marks.append(sorted(rows, key=lambda x: x["step"]))
    return marks


def _measure(rounds: list[list[list[dict]]], warmup: int) -> tuple[float, list[float], float]:
    """(median step period, per-rank median busy CPU per step, relative spread of the periods),
    over every timed step of every round and rank."""
    periods: list[float] = []
    busy_by_rank: dict[int, list[float]] = {}
    for marks in rounds:
        for r, rows in enumerate(marks):
            w = rows[warmup:]
            periods.extend(b["wall_s"] - a["wall_s"] for a, b in zip(w, w[1:]))
            busy_by_rank.setdefault(r, []).extend(b["cpu_s"] - a["cpu_s"] for a, b in zip(w, w[1:]))
    busy = [statistics.median(busy_by_rank[r]) for r in sorted(busy_by_rank)]
    med = statistics.median(periods)
    q = statistics.quantiles(periods, n=4) if len(periods) >= 4 else [med, med, med]
    return med, busy, (q[2] - q[0]) / med


def run_model(name: str, factory, loss: str, args) -> list[dict]:
    import numpy as np

    from fxpipe.codegen.launch import spawn_train_many
    from fxpipe.ir import schedule_to_orders

    k, m = args.ranks, args.microbatches
    cpus = tuple(sorted(os.sched_getaffinity(0)))[:k] if hasattr(os, "sched_getaffinity") else tuple(range(k))
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch.use_deterministic_algorithms(bool(args.runtime_as_is))  # as the training workers (see _runtime_shims)
    _pin(cpus[0])  # profile under the workers' conditions: one thread on one core
    link = None
    if args.link:
        from fxpipe.cost.calibrate import LinkModel
        from fxpipe.cost.links import measure_p2p

        link = LinkModel.from_times(measure_p2p()[2])
    try:
        graph, fx, _ = _plan(name, factory, loss, args, link)
    finally:
        torch.use_deterministic_algorithms(False)
        if before is not None:
            os.sched_setaffinity(0, before)
    cands = _candidates(graph, fx, k, m, args.schedule)
    update = _update_costs(factory, cands, k, args, link)
    tiny = TinyFactory(m)
    tiny_stage_of, tiny_orders = _tiny_plan(tiny, k, m, args.schedule)
    print(f"# {name}: training {len(cands)} partitions x {args.rounds} rounds on {k} ranks ...", file=sys.stderr)
    steps = args.warmup_steps + args.steps + 1
    with tempfile.TemporaryDirectory(prefix="fxpipe-bench-measured-") as out_dir:
        runs = []
        for r in range(args.rounds):
            runs.append(dict(make_model=Pinned(tiny, cpus, not args.runtime_as_is), stage_of=tiny_stage_of, orders=tiny_orders,
                             num_microbatches=m, make_batch=TimedBatch(tiny, out_dir, f"runtime.{r}"), steps=steps, lr=1e-3,
                             loss="mse"))
            runs += [dict(make_model=Pinned(factory, cpus, not args.runtime_as_is), stage_of=c.stage_of,
                          orders=schedule_to_orders(c.schedule, c.problem), num_microbatches=m,
                          make_batch=TimedBatch(factory, out_dir, f"{c.name}.{r}"), steps=steps, lr=1e-3, loss=loss)
                     for c in cands]
        t0 = time.perf_counter()
        spawn_train_many(runs, world_size=k, timeout_s=args.timeout)
        train_s = time.perf_counter() - t0
        _, runtime_busy, _ = _measure([_read_marks(out_dir, f"runtime.{r}", k) for r in range(args.rounds)], args.warmup_steps)
        overhead = [b / m for b in runtime_busy] if args.runtime_overhead else [0.0] * k
        rows = []
        for c in cands:
            marks = [_read_marks(out_dir, f"{c.name}.{r}", k) for r in range(args.rounds)]
            period, busy, spread = _measure(marks, args.warmup_steps)
            upd = update[c.name]
            synced = bool(upd["shared"])
            problem = _with_overhead(c.problem, overhead, _link_times(graph, c.partition, k, link))
            sched = c.schedule if problem is c.problem else _schedule(problem, args.schedule)
            base = float(sched.makespan if synced else sched.stage_span)
            predicted = base + max(upd["update_s"]) + upd["sync_s"]
            pred_busy = (m * (np.asarray(problem.t_f) + np.asarray(problem.t_b) + np.asarray(problem.t_w))).tolist()
            rows.append({
                "model": name,
                "partition": c.name,
                "predicted_step_s": predicted,
                "measured_step_s": float(period),
                "rel_error": float((predicted - period) / period),
                "schedule_s": base,
                "schedule_objective": "makespan" if synced else "stage_span",
                "op_costs_schedule_s": float(c.schedule.makespan if synced else c.schedule.stage_span),
                "runtime_overhead_per_microbatch_s": overhead,
                "t_comm_s": [float(x) for x in problem.t_comm],
                "update_s": upd["update_s"],
                "shared_grad_sync_s": upd["sync_s"],
                "step_spread": float(spread),
                "bottleneck_s": float(c.partition.bottleneck),
                "predicted_busy_s": [b + u for b, u in zip(pred_busy, upd["update_s"])],
                "measured_busy_s": busy,
                "ops_per_stage": np.bincount(np.asarray(c.partition.assignment), minlength=k).tolist(),
            })
    print(f"# {name}: trained in {train_s:.1f} s; runtime overhead per micro-batch "
          f"{', '.join(f'{o * 1e3:.2f}' for o in overhead)} ms", file=sys.stderr)
    return rows


def _schedule(problem, method: str):
    from fxpipe.schedule.dispatch import make_schedule

    return make_schedule(problem, method)


def _with_overhead(problem, per_microbatch_s: list[float], t_comm_s: list[float] | None = None):
    """The schedule problem with the runtime's cost per micro-batch and stage added (split evenly
    over the stage's F, B and W actions) and, if given, the measured link times per boundary."""
    from fxpipe.ir import ScheduleProblem

    if not any(per_microbatch_s) and t_comm_s is None:
        return problem
    doc = problem.to_dict()
    for key in ("t_f", "t_b", "t_w"):
        doc[key] = [float(t) + o / 3.0 for t, o in zip(doc[key], per_microbatch_s)]
    if t_comm_s is not None:
        doc["t_comm"] = list(t_comm_s)
    return ScheduleProblem.from_dict(doc, source="problem with runtime overhead")


def _link_times(graph, partition, k: int, link) -> list[float] | None:
    """Per boundary: the sum over the tensors crossing it (relay: produced before, consumed after)
    of the link's one-way time at that tensor's size (one message per tensor)."""
    if link is None or k < 2:
        return None
    import numpy as np

    a = np.asarray(partition.assignment)
    last = {}
    for u, v in np.asarray(graph.edges).tolist():
        last[u] = max(last.get(u, int(a[u])), int(a[v]))
    out = [0.0] * (k - 1)
    for u, hi in last.items():
        for s in range(int(a[u]), hi):
            out[s] += link.time_s(float(graph.size_out_bytes[u]))
    return out


def _tiny_plan(tiny, k: int, m: int, schedule: str):
    """Stage assignment and orders of the runtime-calibration pipeline (nodes split evenly)."""
    from fxpipe.api import plan_graph
    from fxpipe.ir import schedule_to_orders
    from fxpipe.passes import trace_model

    model, a, kw = tiny.one_microbatch()
    g = trace_model(model, a, kw, hardware="cpu").graph
    part, problem, sched, _ = plan_graph(g, devices=k, microbatches=m, schedule=schedule, time_limit_s=0.5)
    return {g.names[i]: int(part.assignment[i]) for i in range(g.n)}, schedule_to_orders(sched, problem)


def _update_costs(factory, cands: list, k: int, args, link=None) -> dict[str, dict]:
    """Per-stage cost of the launcher's parameter update after each step, measured here.

    After the pipeline's actions, every rank keeps a copy of its gradients (the launcher's
    ``grads`` record) and takes an SGD step: ``g.clone()`` and ``p.add_(g, alpha=-lr)`` for each
    of its parameters. Parameters held by several stages (tied embeddings) also get their
    gradients all-reduced (:meth:`fxpipe.codegen.runtime.FxpipeScheduleRuntime.sync_shared_grads`),
    which synchronises those ranks once per step, so consecutive steps no longer overlap: the
    step is then the schedule's makespan, plus the all-reduce (two messages of half the
    gradient bytes each way on the measured link, or 2 x bytes / the CPU spec's bandwidth).
    Timed on one thread on this core with the profiler's clock, median of 7.
    """
    from fxpipe.cost.timers import CLOCKS, CpuTimer
    from fxpipe.passes.capture import capture, getattr_path

    model, margs, mkwargs = factory.one_microbatch()
    gm = capture(model, margs, mkwargs).gm
    timer = CpuTimer(CLOCKS[args.clock])
    out = {}
    for c in cands:
        holders: dict[str, set] = {}
        for n in gm.graph.nodes:
            if n.op != "get_attr":
                continue
            obj = getattr_path(gm, n.target)
            if not isinstance(obj, torch.nn.Parameter):
                continue
            for u in n.users:
                st = c.stage_of.get(u.name)
                if st is None:  # a view of the parameter: look one step further
                    st = next((c.stage_of[w.name] for w in u.users if w.name in c.stage_of), None)
                if st is not None:
                    holders.setdefault(n.target, set()).add(st)
        params = {n.target: getattr_path(gm, n.target) for n in gm.graph.nodes if n.target in holders}
        upd = []
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for s in range(k):
                ps = [params[t].detach().clone() for t, st in holders.items() if s in st]
                gs = [torch.rand_like(p) for p in ps]

                def step():
                    for p, g in zip(ps, gs):
                        g.clone()
                        p.add_(g, alpha=-1e-3)

                upd.append(statistics.median(timer(step, warmup=1, min_repeats=7, max_repeats=7)) if ps else 0.0)
        finally:
            torch.set_num_threads(prev)
        shared = {t for t, st in holders.items() if len(st) > 1}
        shared_bytes = sum(params[t].numel() * params[t].element_size() for t in shared)
        if not shared:
            sync = 0.0
        elif link is not None:
            sync = 2.0 * link.time_s(shared_bytes / 2.0)
        else:
            sync = 2.0 * shared_bytes / _cpu_spec_bandwidth()
        out[c.name] = {"update_s": upd, "shared": sorted(shared), "sync_s": sync}
    return out


def _cpu_spec_bandwidth() -> float:
    """Stage-to-stage bandwidth of the CPU spec (bytes/s) used for the all-reduce estimate."""
    from fxpipe.cost.hardware import get_hardware

    return get_hardware("cpu").d2d_bytes_per_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="GPT-2-like decoder and UNet only")
    ap.add_argument("--models", nargs="*", default=None, help="subset of the models")
    ap.add_argument("--ranks", type=int, default=2, help="pipeline stages = local processes (default 2)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round (default 6)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds: the partitions train in turn, this many times, to spread the machine's load (default 2)")
    ap.add_argument("--no-runtime-overhead", dest="runtime_overhead", action="store_false",
                    help="predict from the op costs alone, without the runtime's cost per micro-batch measured on a "
                         "negligible-compute pipeline (see _tiny_plan)")
    ap.add_argument("--no-link", dest="link", action="store_false",
                    help="use the CPU spec's modelled 10 GB/s link instead of measuring the gloo link (see _link_times)")
    ap.add_argument("--runtime-as-is", action="store_true",
                    help="keep the launcher's deterministic kernels and output merging (see _runtime_shims)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b",
                    help="schedule method (default 1f1b; see the module docstring for zb-h1's split backward)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search budget per model (s)")
    ap.add_argument("--cost-db", default=None, help="cost database (default $FXPIPE_COST_DB or ~/.cache/fxpipe/costdb.json)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                    help="profiler clock: the ranks' thread CPU time (default; immune to other processes time-slicing "
                         "the cores of a shared machine) or wall time")
    ap.add_argument("--timeout", type=float, default=900.0, help="limit for one model's training runs (s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", metavar="FILE.json", help="also write the JSON document to this file")
    args = ap.parse_args(argv)

    load0 = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    t_all = time.perf_counter()
    work = _workloads(args.quick, args.microbatches)
    names = args.models or list(work)
    unknown = sorted(set(names) - set(work))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {sorted(work)}")
    rows: list[dict] = []
    failures: dict[str, str] = {}
    for name in names:
        factory, loss = work[name]
        try:
            rows += run_model(name, factory, loss, args)
        except Exception as exc:  # noqa: BLE001 - report the model that failed and go on with the others
            failures[name] = " ".join(str(exc).split())[:2000]
            print(f"# {name}: FAILED: {failures[name][:500]}", file=sys.stderr)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    errs = [abs(r["rel_error"]) for r in rows]
    summary = {
        "median_abs_rel_error": statistics.median(errs) if errs else None,
        "fxpipe_vs_equal_layer": {},
        "wall_s": time.perf_counter() - t_all,
        "loadavg_before": list(load0),
        "loadavg_after": list(load1),
        "cpus": os.cpu_count(),
        "failures": failures,
    }
    for name in {r["model"] for r in rows}:
        by = {r["partition"]: r for r in rows if r["model"] == name}
        if "fxpipe" in by and "equal-layer" in by:
            summary["fxpipe_vs_equal_layer"][name] = by["equal-layer"]["measured_step_s"] / by["fxpipe"]["measured_step_s"]
    if args.out:
        from fxpipe.ir import write_json_atomic

        write_json_atomic(args.out, {"rows": rows, "summary": summary})
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0 if not failures else 1
    print("| model | partition | ops per stage | predicted step ms | measured step ms | error | stage busy predicted / measured ms |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        busy = ", ".join(f"{p * 1e3:.1f} / {b * 1e3:.1f}" for p, b in zip(r["predicted_busy_s"], r["measured_busy_s"]))
        print(f"| {r['model']} | {r['partition']} | {r['ops_per_stage']} | {r['predicted_step_s'] * 1e3:.1f} | "
              f"{r['measured_step_s'] * 1e3:.1f} | {r['rel_error']:+.1%} | {busy} |")
    print()
    if errs:
        print(f"median |predicted - measured| / measured: {summary['median_abs_rel_error']:.1%}")
    for name, x in summary["fxpipe_vs_equal_layer"].items():
        print(f"{name}: equal-layer step / fxpipe step = {x:.3f}")
    for name, msg in failures.items():
        print(f"{name}: FAILED ({msg[:300]})")
    print(f"wall {summary['wall_s']:.0f} s; load average before {load0[0]:.2f}, after {load1[0]:.2f} on {os.cpu_count()} cpus; "
          f"command: python benchmarks/bench_measured.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
