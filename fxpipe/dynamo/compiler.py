"""The ``torch.compile`` backend: ``torch.compile(model, backend="fxpipe", options={"devices": 8})``.

Registered by name through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so after
``pip install fxpipe`` no import is needed; :func:`backend` returns the same backend as a callable
(``torch.compile(model, backend=fxpipe.backend(devices=8))``). The options are the keyword
arguments of :func:`fxpipe.compile` plus the backend's own (:class:`~fxpipe.dynamo.options.BackendOptions`).

What happens when Dynamo hands over a graph (:meth:`FxpipeBackend.__call__`):

1. **Graph breaks.** A graph that ends at a graph break is only part of the model: it raises
   :class:`~fxpipe.errors.InputError` naming the break (Dynamo's reason and the user's source
   line, the entries ``torch._dynamo.explain`` lists) and what to do, unless
   ``graph_breaks="separate"`` asks to plan every subgraph on its own.
2. **Planning from Dynamo's graph.** :class:`~fxpipe.dynamo.lift.LiftedGraph` turns the
   parameters and buffers Dynamo lifted to graph inputs back into module state, and
   :func:`fxpipe.compile` plans it (capture of the lifted graph, costs, partition, schedule) for
   one micro-batch of the call's inputs (micro-batches come from the batch dimension). The plan
   is :func:`last_plan`; a report is written when ``report=`` names a file. Under a process
   group rank 0 plans and broadcasts the plan (the partition search is time-limited, so ranks
   planning on their own could disagree).
3. **Execution.** In one process (no process group, or ``pipeline="never"``) the graph runs
   eagerly (default: outputs are eager's, safe on any script), with Inductor, or as the planned
   stages one after the other (``execution``). Under ``torchrun`` / a process group whose size is
   ``devices``, every call runs **pipelined inference** across the ranks
   (:class:`fxpipe.codegen.inference.InferencePipeline`) and returns the outputs on every rank;
   training goes through the plan (``fxpipe.last_plan().build(rank, loss_fn=...)``), never
   silently through a forward without gradients.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

import fxpipe
from fxpipe import errors
from fxpipe.codegen.compare import random_ops_warning
from fxpipe.codegen.effects import analyze, random_ops
from fxpipe.codegen.inference import InferencePipeline, merged_output_meta, run_stages, stage_runner
from fxpipe.codegen.interface import split_microbatches
from fxpipe.codegen.runtime import concrete_int, graph_break_info, inductor_compile, outside_dynamo_tracing
from fxpipe.codegen.shapes import stage_io
from fxpipe.codegen.split import split_stages
from fxpipe.cost.hardware import HARDWARE
from fxpipe.dynamo.lift import LiftedGraph, graph_name
from fxpipe.dynamo.options import BackendOptions
from fxpipe.errors import FxpipeError, InputError
from fxpipe.passes import trace_model
from fxpipe.plan import Plan
from fxpipe.report import write_plan_report

__all__ = ["FxpipeBackend", "backend", "fxpipe_backend", "last_plan", "plans", "clear_plans", "graph_break_message"]

logger = logging.getLogger(__name__)

_PLANS: list = []  # every plan made by the backend in this process, oldest first
_REPORT_COUNT: dict[str, int] = {}


def last_plan():
    """The plan of the graph the fxpipe backend compiled last (:class:`fxpipe.Plan`).

    Raises
    ------
    InputError
        If the backend has not planned any graph in this process yet (``torch.compile`` is
        lazy: call the compiled model once first).
    """
    if not _PLANS:
        raise InputError(
            "the fxpipe backend has not planned any graph yet: torch.compile compiles at the first call, so call "
            "the compiled model once (e.g. compiled(*inputs)) before fxpipe.last_plan()"
        )
    return _PLANS[-1]


def plans() -> list:
    """Every plan the backend made in this process, oldest first (one per compiled graph)."""
    return list(_PLANS)


def clear_plans() -> None:
    """Forget the plans made so far (``torch._dynamo.reset()`` does not)."""
    _PLANS.clear()


def graph_break_message(reason: str, user_stack: Sequence[str], *, subgraph: str = "") -> str:
    """The error for a graph break: what happened, where (Dynamo's explain entry), what to do."""
    lines = [ln.rstrip() for ln in str(reason).strip().splitlines() if ln.strip()]
    shown = "\n    ".join(lines[:8]) + ("\n    ..." if len(lines) > 8 else "")
    where = "\n    ".join(user_stack[-3:]) if user_stack else "(Dynamo recorded no user frame)"
    return (
        f"torch.compile(backend='fxpipe') got a graph that ends at a graph break{subgraph}: Dynamo split the function "
        "into several graphs, so no graph holds the whole model for fxpipe to partition into pipeline stages.\n"
        f"  Graph break (as torch._dynamo.explain reports it):\n    Reason: {shown}\n  User stack:\n    {where}\n"
        "What to do: remove the break at that line (e.g. a print, .item() / .tolist() on a tensor, data-dependent "
        "Python control flow -> torch.where / torch.cond, an unsupported library call); run "
        "torch._dynamo.explain(model)(*inputs) to list every break, or torch.compile(..., fullgraph=True) to stop at "
        "the first; or pass options={'graph_breaks': 'separate'} to plan and pipeline every subgraph on its own."
    )


def _process_group_size(group) -> int | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(group)


def _auto_microbatches(batch: int | None, limit: int) -> int:
    """The largest divisor of the batch size up to ``limit`` that leaves micro-batches of >= 2 samples
    (size-1 micro-batches only when the batch is too small for anything else)."""
    if batch is None:
        return 1
    divisors = [d for d in range(1, min(batch, limit) + 1) if batch % d == 0]
    roomy = [d for d in divisors if d >= 2 and batch // d >= 2]
    return max(roomy) if roomy else max(divisors)


def _batch_size(user_inputs: Sequence[Any]) -> int | None:
    for t in user_inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def _signature(user_inputs: Sequence[Any]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("const", repr(t)) for t in user_inputs)


class FxpipeBackend:
    """The fxpipe ``torch.compile`` backend with fixed options (see the module docstring).

    Parameters
    ----------
    options : BackendOptions or mapping
        Validated options (:class:`~fxpipe.dynamo.options.BackendOptions.from_mapping`).

    Notes
    -----
    Called by Dynamo as ``backend(gm, example_inputs)`` for every graph it compiles; returns a
    callable taking Dynamo's flat inputs (user inputs, parameters, buffers) and returning the
    graph's outputs.
    """

    def __init__(self, options: BackendOptions | Mapping[str, Any] | None = None):
        self.options = options if isinstance(options, BackendOptions) else BackendOptions.from_mapping(options)
        self.__name__ = "fxpipe"  # torch.compile names the backend after this

    def __repr__(self) -> str:
        return f"fxpipe.backend({', '.join(f'{k}={v!r}' for k, v in self.options.to_dict().items())})"

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``; plans stay available (:func:`clear_plans`)."""

    # ------------------------------------------------------------------ compile one graph
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        if kwargs.get("mode") not in (None, "default"):
            raise InputError(f"the fxpipe backend takes no mode= (got {kwargs['mode']!r}); pass its settings as options={{...}}")
        opts = self.options
        if kwargs.get("options"):
            opts = BackendOptions.from_mapping({**_as_mapping(self.options), **kwargs["options"]})
        info = graph_break_info(gm)
        if info.graph_break and opts.graph_breaks == "error":
            raise InputError(graph_break_message(info.reason, info.user_stack))
        return _GraphCompiler(gm, list(example_inputs), opts).compile()


def _as_mapping(opts: BackendOptions) -> dict[str, Any]:
    out = dict(opts.compile_kwargs)
    default = BackendOptions()
    for name in ("execution", "pipeline", "compile_stages", "graph_breaks", "report", "bounds_time_limit_s", "group",
                 "max_auto_microbatches"):
        if getattr(opts, name) != getattr(default, name):
            out[name] = getattr(opts, name)
    return out


class _GraphCompiler:
    """Plans one Dynamo graph and builds the callable that runs it (one per compiled graph)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, opts: BackendOptions):
        self.gm = gm
        self.opts = opts
        self.example_inputs = example_inputs
        t0 = time.perf_counter()
        self.lifted = LiftedGraph(gm, example_inputs)
        self.lift_s = time.perf_counter() - t0
        self.name = graph_name(gm)
        self.group = opts.group
        world = _process_group_size(self.group)
        self.pipelined = opts.pipeline == "always" or (opts.pipeline == "auto" and world is not None)
        if self.pipelined and world is None:
            raise InputError("option pipeline='always' needs torch.distributed initialised (run under torchrun or call "
                             "torch.distributed.init_process_group first)")
        self.world = world
        ckw = dict(opts.compile_kwargs)
        if self.pipelined:
            devices = ckw.setdefault("devices", world)
            if devices != world:
                raise InputError(
                    f"devices={devices} but the process group has {world} ranks: pipelined execution runs one stage per "
                    f"rank; pass devices={world} (or leave it out), or pipeline='never' to run in this process"
                )
            if ckw.get("stages_per_device", 1) != 1:
                raise InputError(
                    f"stages_per_device={ckw['stages_per_device']!r}: the backend's forward-only pipeline runs one stage "
                    "per rank; leave stages_per_device out (1), or train a looped / V placement through "
                    "fxpipe.last_plan().build(rank, ...)"
                )
        self.ckw = ckw
        self.runners: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ planning
    def _compile_kwargs(self, user_inputs: Sequence[Any]) -> tuple[dict, Any]:
        ckw = dict(self.ckw)
        batch = _batch_size(user_inputs)
        m = ckw.get("microbatches")
        ok, why = self.lifted.batch_dimension()
        if m is None:
            m = _auto_microbatches(batch, self.opts.max_auto_microbatches) if ok else 1
            if not ok:
                logger.info("fxpipe backend: one micro-batch per call: %s", why)
        elif m > 1 and not ok:
            raise InputError(f"microbatches={m} needs micro-batches cut from the batch dimension, but {why}; "
                             "or pass microbatches=1")
        self.microbatch_note = "" if ok else why
        try:
            mb = split_microbatches(tuple(user_inputs), m, "the compiled call's inputs")[0] if m > 1 else tuple(user_inputs)
        except InputError as exc:
            raise InputError(f"{exc}; micro-batches are taken from dim 0 of every input: pass options={{'microbatches': "
                             f"k}} with k dividing the batch size {batch}, or 1") from None
        ckw["microbatches"] = m
        if ckw.get("objective") is None:
            grads = torch.is_grad_enabled() and any(
                isinstance(t, torch.nn.Parameter) and t.requires_grad for t in self.lifted.state)
            ckw["objective"] = "inference" if self.pipelined or not grads else "training"
        if ckw.get("schedule") is None and ckw["objective"] == "inference":
            ckw["schedule"] = "gpipe"  # a forward-only pipeline runs GPipe's forward half
        ckw.setdefault("name", self.name)
        ckw["mesh"] = "pipeline"  # the backend runs one pipeline over its devices (its runners know no mesh)
        return ckw, mb

    def _plan(self, user_inputs: Sequence[Any]):
        ckw, mb = self._compile_kwargs(user_inputs)
        t0 = time.perf_counter()
        if not self.pipelined:
            with torch.enable_grad():
                plan = fxpipe.compile(self.lifted, mb, {}, **ckw)
        else:
            plan = self._plan_collectively(mb, ckw)
        plan = plan.replace(  # a Plan is frozen: the backend's figures go into a copy
            timings_s={"dynamo_lift": self.lift_s, **plan.timings_s, "backend_total": time.perf_counter() - t0 + self.lift_s},
            options={**plan.options, "backend": self.opts.to_dict(),
                     "dynamo_compile_id": str(self.gm.meta.get("dynamo_compile_id", "")), "pipelined": self.pipelined,
                     "microbatch_note": self.microbatch_note})
        if self.opts.report is not None and (not self.pipelined or self._rank() == 0):
            plan = plan.replace(options={**plan.options, "report": str(_write_report(plan, self.opts))})
        _PLANS.append(plan)
        return plan, mb

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def _plan_collectively(self, mb: tuple, ckw: dict):
        """Rank 0 plans and broadcasts the plan; every rank captures the lifted graph and checks it."""
        import torch.distributed as dist

        rank = self._rank()
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        payload: list[Any] = [None]
        plan = None
        if rank == 0:
            try:
                with torch.enable_grad():
                    plan = fxpipe.compile(self.lifted, mb, {}, **ckw)
                payload[0] = {"plan": plan.to_dict()}
            except FxpipeError as exc:
                payload[0] = {"error": (type(exc).__name__, str(exc))}
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, or they wait forever
                payload[0] = {"error": ("CaptureError", f"rank 0 failed while planning: {type(exc).__name__}: {exc}")}
        dist.broadcast_object_list(payload, src=src, group=self.group)
        doc = payload[0]
        if "error" in doc:  # every rank raises rank 0's planning error
            raise _error_of(*doc["error"])
        if rank != 0:
            plan = Plan.from_dict(doc["plan"], source="the plan broadcast by rank 0")
            with torch.enable_grad():
                traced = trace_model(self.lifted, mb, {}, hardware=_hardware_for_capture(plan), name=plan.name)
            try:  # by structure: node names may differ between ranks (PYTHONHASHSEED, meta vs real tensors)
                plan.adopt_capture(traced)
            except InputError as exc:
                raise InputError(f"rank {rank} captured a different graph than rank 0 (other input shapes or another "
                                 f"model?): every rank must run the same model on inputs of the same shapes ({exc})"
                                 ) from None
        return plan

    # ------------------------------------------------------------------ execution
    def compile(self) -> Callable:
        with outside_dynamo_tracing():  # export, fake shape inference and Inductor see no Dynamo tracing context
            return self._compile()

    def _compile(self) -> Callable:
        opts = self.opts
        example_user = tuple(concrete_int(v) for v in self.lifted.user_inputs(self.example_inputs))
        self.plan, self.mb = self._plan(example_user)
        gm = self.gm
        if not self.pipelined and opts.execution == "eager":
            self.example_inputs = None
            return _named(lambda *args: gm(*args), "fxpipe_eager")
        if not self.pipelined and opts.execution == "inductor":
            fn, self.example_inputs = inductor_compile(gm, self.example_inputs), None
            return fn
        self._check_pipelinable(self.plan)
        runner = self.runners[self._key(self.example_inputs)] = self._build_runner(self.plan, self.mb)
        self._check_output_shapes(runner)
        self.example_inputs = None  # do not keep the first call's batch alive
        run = self._run
        return _named(lambda *args: run(*args), "fxpipe_pipeline" if self.pipelined else "fxpipe_stages")

    def _key(self, flat_inputs: Sequence[Any]) -> tuple:
        return (_signature(self.lifted.user_inputs(flat_inputs)), self.lifted.same_state(flat_inputs))

    def _check_pipelinable(self, plan) -> None:
        gm = plan.captured().gm
        written = analyze(gm).written_state()
        if written:
            names = ", ".join(sorted(written)[:4]) + (" ..." if len(written) > 4 else "")
            raise InputError(
                f"the graph updates module state in place ({names}; BatchNorm in training mode updates its running "
                "statistics): run per micro-batch on separate ranks these updates cannot equal one eager call on the "
                "whole batch; call model.eval() for pipelined inference, or use execution='eager'/'inductor' in one "
                "process and train through fxpipe.last_plan().build(rank, ...)"
            )
        random_ops_warning([str(o) for o in random_ops(gm)], stacklevel=6)

    def _check_output_shapes(self, runner) -> None:
        """Merged micro-batch outputs must have the shapes of Dynamo's graph on the whole batch."""
        kind, staged, what, m = runner
        if kind == "pipeline":
            got = [meta.shape for meta in what.output_meta]
        else:
            flat = staged.interface.example_inputs(self.mb)
            got = [meta.shape for meta in merged_output_meta(staged, stage_io(staged, staged.num_stages - 1, flat).outputs, m)]
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        want = []
        for node in _flat_nodes(out_node.args[0]):
            v = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
            if isinstance(v, torch.Tensor):
                want.append(tuple(concrete_int(d) for d in v.shape))
        if len(got) == len(want) and all(tuple(g) == tuple(w) for g, w in zip(got, want)):
            return
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if tuple(g) != tuple(w)), min(len(got), len(want)))
        raise InputError(
            f"output {bad} of the graph is not batch-major: merged from {m} micro-batches it would have shape "
            f"{tuple(got[bad]) if bad < len(got) else None} instead of {want[bad] if bad < len(want) else None} "
            "(an output reduced over the batch, or a batch dimension other than 0); return per-sample outputs, or pass "
            "options={'microbatches': 1}"
        )

    def _build_runner(self, plan, mb: tuple):
        staged = split_stages(plan.captured().gm, plan.captured_stage_of(), plan.num_stages)
        if not self.pipelined:
            modules = [stage_runner(staged, s, compile_stages=self.opts.compile_stages) for s in range(staged.num_stages)]
            return ("stages", staged, modules, plan.microbatches)
        import torch.distributed as dist

        error = None
        pipe = None
        try:
            pipe = InferencePipeline(staged, self._rank(), num_microbatches=plan.microbatches, example_microbatch_inputs=mb,
                                     group=self.group, compile_stages=self.opts.compile_stages)
        except FxpipeError as exc:
            error = (type(exc).__name__, f"rank {self._rank()}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, or they wait forever
            error = ("CaptureError", f"rank {self._rank()} failed to build its stages: {type(exc).__name__}: {exc}")
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise _error_of(*first)
        return ("pipeline", staged, pipe, plan.microbatches)

    def _run(self, *flat_inputs):
        if torch.is_grad_enabled() and any(isinstance(t, torch.nn.Parameter) and t.requires_grad for t in self.lifted.state):
            raise InputError(
                "the fxpipe backend runs a forward-only pipeline (inference): call the compiled model under "
                "torch.no_grad() or torch.inference_mode(); to train, use the plan: "
                "stage, schedule = fxpipe.last_plan().build(rank, loss_fn=...) (see the README)"
            )
        key = self._key(flat_inputs)
        runner = self.runners.get(key)
        if runner is None:
            runner = self._rebuild(flat_inputs)
        kind, staged, what, m = runner
        user = self.lifted.user_inputs(flat_inputs)
        if kind == "stages":
            out = run_stages(staged, tuple(user), m, what)
        else:
            out = what(tuple(user))
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _rebuild(self, flat_inputs: Sequence[Any]):
        """New input shapes (or a replaced parameter): plan and build again for this call (every rank does)."""
        if not self.lifted.same_state(flat_inputs):
            logger.info("fxpipe backend: a parameter or buffer object was replaced; re-capturing the graph")
            self.lifted = LiftedGraph(self.gm, list(flat_inputs))
        else:
            logger.info("fxpipe backend: new input shapes %s; planning again", _signature(self.lifted.user_inputs(flat_inputs)))
        plan, mb = self._plan(self.lifted.user_inputs(flat_inputs))
        self._check_pipelinable(plan)
        runner = self.runners[self._key(flat_inputs)] = self._build_runner(plan, mb)
        return runner


def _flat_nodes(value: Any) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat_nodes(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat_nodes(v)]
    return [value]


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = name
    return fn


def _error_of(kind: str, message: str) -> FxpipeError:
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, FxpipeError)):
        cls = InputError
    return cls(message)


def _hardware_for_capture(plan) -> str:
    """Hardware to re-cost a broadcast plan's graph with (only its structure is compared)."""
    return plan.hardware if str(plan.hardware).lower() in HARDWARE else "h100-sxm"


def _write_report(plan, opts: BackendOptions) -> Path:
    base = Path(opts.report)
    n = _REPORT_COUNT[str(base)] = _REPORT_COUNT.get(str(base), 0) + 1
    path = base if n == 1 else base.with_name(f"{base.stem}-{n}{base.suffix}")
    written = write_plan_report(plan, path, bounds_time_limit_s=opts.bounds_time_limit_s,
                                command=f"torch.compile(model, backend='fxpipe', options={opts.to_dict()!r})")
    return Path(written["html"])


def backend(**options: Any) -> FxpipeBackend:
    """The fxpipe ``torch.compile`` backend as a callable: ``torch.compile(model, backend=fxpipe.backend(devices=8))``.

    Parameters
    ----------
    **options
        The keyword arguments of :func:`fxpipe.compile` (``devices``, ``microbatches``,
        ``hardware``, ``costs``, ``objective``, ``schedule``, ``mem_limit_bytes``, ``time_limit_s``,
        ``seed``, ...) and the backend's own: ``execution`` (``"eager"``, ``"inductor"``,
        ``"stages"``), ``pipeline`` (``"auto"``, ``"always"``, ``"never"``), ``compile_stages``,
        ``graph_breaks`` (``"error"``, ``"separate"``), ``report`` (a path), ``bounds_time_limit_s``,
        ``group``, ``max_auto_microbatches`` (:class:`~fxpipe.dynamo.options.BackendOptions`).

    Returns
    -------
    FxpipeBackend
        The same backend ``torch.compile(model, backend="fxpipe", options=options)`` uses.

    Raises
    ------
    InputError
        For an unknown option (the message lists the valid ones) or a bad value.
    """
    return FxpipeBackend(BackendOptions.from_mapping(options))


def fxpipe_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None,
                   mode: str | None = None) -> Callable:
    """The ``torch_dynamo_backends`` entry point: ``torch.compile(model, backend="fxpipe", options={...})``.

    torch passes ``options=`` (and ``mode=``, which fxpipe refuses) as keywords
    (``torch._TorchCompileWrapper``). See :func:`backend` for the options.
    """
    return FxpipeBackend(BackendOptions.from_mapping(options))(gm, example_inputs, mode=mode)
