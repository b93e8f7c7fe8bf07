"""``fxpipe plan``: the whole pass on a model built from its config, or on the user's own module.

Four ways in (``fxpipe models`` lists them)::

    fxpipe plan --hf llama-3-70b --seq-len 4096 --devices 32     # a preset (bf16, as published)
    fxpipe plan --hf qwen3 --devices 2                            # any transformers model type, small sizes
    fxpipe plan --hf whisper --task speech-seq2seq --devices 2    # ... with the head of a task
    fxpipe plan --hf path/to/config.json --devices 8              # a config file or checkpoint folder
    fxpipe plan --model mypkg.models:build --devices 2            # your own nn.Module (factory)

Example::

    fxpipe plan --hf gpt2 --config n_layer=8 --devices 4 --microbatches 8 --run
    fxpipe plan --hf gpt2 --devices 4 --stages-per-device 2 --placement v    # ZB-V
    fxpipe plan --hf llama --devices 4 --stages-per-device auto --placement auto

builds a randomly initialised model (no download), plans it for ``--devices`` devices
(``--stages-per-device`` stages on each, placed looped or V-shaped, or the best of them by
predicted step time with ``auto``), prints the stage (and device) table, and with ``--run`` trains a few steps on local gloo ranks
next to a single-process reference and prints both losses and the largest gradient
difference.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import fxpipe
from fxpipe.api import PLACEMENTS, SCHEDULES
from fxpipe.cli.common import add_command, add_memory_arguments, check_writable, emit, memory_model_from_args, parse_bytes, status
from fxpipe.cost.hardware import list_hardware
from fxpipe.errors import CaptureError, FxpipeWarning, InputError
from fxpipe.io import format_ms, ms_column
from fxpipe.memory.checkpoint import CHECKPOINT_REQUESTS
from fxpipe.mesh import microbatches_per_replica, normalize_mesh, parse_mesh
from fxpipe.progress import phase, stderr_is_terminal
from fxpipe.report import write_plan_report
from fxpipe.report.trace import chrome_trace



def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(sub, "plan", run,
                    help="plan pipeline parallelism for a Hugging Face architecture (random weights, no download)",
                    description=__doc__, raw_description=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--hf", metavar="MODEL",
        help="a preset (gpt2, t5, llama, mixtral, llama-2-7b, llama-3-8b, llama-3-70b), any transformers model type (qwen3, bert, "
        "whisper, llava, ...: built from its default config at small sizes), or a config.json / checkpoint folder "
        "(sizes as written; weights from its safetensors with --run or --checkpoint). See `fxpipe models`",
    )
    src.add_argument(
        "--model", metavar="PKG.MODULE:FACTORY",
        help="your own model: a callable returning (model, args, kwargs) of one micro-batch, or a plain nn.Module "
        "with --input-shape (see `fxpipe models`)",
    )
    p.add_argument("--task", default=None, metavar="TASK",
                   help="head of a --hf model type or config: causal-lm, seq2seq, speech-seq2seq, image-text-to-text, "
                   "masked-lm, ctc, image-classification, audio-classification, sequence-classification, "
                   "token-classification, base (default: inferred from the heads the architecture has)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="parameter dtype: float32, bfloat16 or float16 (default: the config's dtype, e.g. bfloat16 for "
                   "llama-3-70b; float32 when it names none)")
    p.add_argument("--attn-implementation", choices=("sdpa", "eager"), default=None,
                   help="attention kernel of --hf models (default: Hugging Face's, SDPA where supported)")
    p.add_argument("--checkpoint", action="store_true",
                   help="with --hf CHECKPOINT_FOLDER: build on cpu with the folder's safetensors weights, also without --run")
    p.add_argument("--input-shape", action="append", type=_shape, default=[], metavar="D0,D1,...",
                   help="with --model returning a plain nn.Module: shape of one input of one micro-batch (repeat per input)")
    p.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                   help="with --input-shape: dtype of each input, by position (default float32; int64 inputs are drawn from {0, 1})")
    p.add_argument(
        "--config", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="config overrides, e.g. n_layer=8 n_embd=256 (repeat the flag to add more; a later value of the same key wins)",
    )
    p.add_argument("--devices", type=int, default=None,
                   help="all devices (default 4, or the product of --mesh); --mesh pipeline for a pure pipeline over them")
    p.add_argument(
        "--mesh", default=None, metavar="pp=A,dp_shard=B,dp_replicate=C,tp=T|auto|search|pipeline",
        help="pipeline x data x tensor parallelism (torchtitan's names, missing = 1, product = devices): dp_shard * "
        "dp_replicate replicas of a pipeline over pp devices, FSDP2 over dp_shard (HSDP with dp_replicate), replicate "
        "over dp_replicate, tp devices sharing each stage's matmuls (innermost; pinned only: its costs are not "
        "modelled yet); --microbatches is then the global count, divided among the replicas; default auto (= search): "
        "plan every pp x dp_shard (x dp_replicate on hardware with nodes) of --devices and keep the smallest "
        "predicted step that fits, listing the candidates; 'pipeline': the pure pipeline over --devices; "
        "order=pp/dp_replicate/dp_shard (torchtitan's) places the ranks of a pinned mesh (default dp_replicate/dp_shard/pp)",
    )
    p.add_argument(
        "--stages-per-device", type=_stages_per_device, default=1, metavar="V",
        help="pipeline stages on every device (the model is cut into V x devices stages), or 'auto': try 1 and 2 "
        "and keep the best predicted step time (default 1)",
    )
    p.add_argument(
        "--placement", choices=PLACEMENTS, default="looped",
        help="placement of the stages when V > 1: looped (stage s on device s mod devices, interleaved 1F1B), v "
        "(stages s and 2*devices-1-s on device s: ZB-V, DualPipe-V) or auto (the best predicted step time) "
        "(default looped)",
    )
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    p.add_argument(
        "--hardware", default=None, metavar="HW",
        help=f"what the costs are for: {', '.join(list_hardware())}, 'measured' (this machine, calibrated from measured op "
        "times), 'profile:NAME' (a shipped profile, e.g. profile:cpu) or a hardware-profile JSON file "
        "(default h100-sxm, or measured with --costs measured)",
    )
    p.add_argument(
        "--costs", choices=("roofline", "measured"), default="roofline",
        help="roofline: op times from the hardware's model; measured: time every op of this model on this machine first "
        "(forward, backward-input, backward-weight; cached in --cost-db) (default roofline)",
    )
    p.add_argument("--cost-db", default=None, metavar="DB.json", help="cost database for --costs measured (default $FXPIPE_COST_DB or ~/.cache/fxpipe/costdb.json)")
    p.add_argument("--profile-threads", type=int, default=None, metavar="N",
                   help="intra-op threads the ops are timed with (default: 1 with --run, whose ranks run one thread each; else torch's setting)")
    p.add_argument("--objective", choices=("training", "inference"), default="training")
    p.add_argument(
        "--schedule", default="auto", choices=SCHEDULES,
        help="schedule method, one valid for the placement (default auto: the fastest that fits device memory among "
        "the heuristics and the MILP, offloading or recomputing activations only where memory forces it)",
    )
    add_memory_arguments(p, plan=True)
    p.add_argument(
        "--activation-checkpointing", choices=CHECKPOINT_REQUESTS, default="auto",
        help="activation checkpointing (training): auto (default: per stage where memory forces it, among none, "
        "per-block selective / budgeted / full and whole-stage recomputation), none, full or selective (that "
        "per-block policy on every stage)",
    )
    p.add_argument("--time-limit", type=float, default=10.0, help="partition search budget in seconds (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--meta", action=argparse.BooleanOptionalAction, default=None,
        help="build the model on the meta device (no weights). This is the default without --run: planning needs "
        "shapes only, so a 70B config plans on a laptop; with --run the model is built with real weights; "
        "--no-meta: build it on CPU with random weights for planning too (a model that cannot be traced on meta)",
    )
    p.add_argument("--out", metavar="PLAN.json", help="save the plan as JSON")
    p.add_argument("--report", metavar="REPORT.html", help="write an HTML report (and REPORT.md): stages, lower-bound certificates, Gantt chart")
    p.add_argument("--bounds-time-limit", type=float, default=60.0, metavar="S", help="time limit per lower-bound MIP for --report (default 60)")
    p.add_argument("--trace", metavar="TRACE.json", help="write the schedule as a Chrome/Perfetto trace (F/B/W/O/R per stage and "
                   "device; open in ui.perfetto.dev or chrome://tracing); linked from --report")
    p.add_argument("--run", action="store_true", help="train a few steps on local gloo ranks next to a single-process reference")
    p.add_argument("--steps", type=int, default=2, help="training steps with --run (default 2)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate with --run")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="with --run: stop the training when it has not finished after S seconds (start-up included), "
                   "naming the rank that is late and the action it is in (default 600)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _shape(text: str):
    """argparse type of --input-shape."""
    from fxpipe.models import parse_shape  # lazy: torch

    try:
        return parse_shape(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _stages_per_device(text: str):
    """argparse type of --stages-per-device: an integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


@dataclass(frozen=True)
class HFFactory:
    """Picklable model factory for worker processes: builds the model and a full batch.

    ``__call__() -> (model, full_batch_inputs)`` with ``microbatches * microbatch_size``
    samples; ``batch(step) -> (inputs, target)`` gives step ``step``'s batch. For the presets
    the target is next-token ids (random tokens, fixed by the seed); for other models it is one
    seed per sample, from which :func:`fxpipe.models.seeded_cross_entropy` draws class ids of
    the output's shape (:attr:`loss`).
    """

    arch: str
    overrides: dict = field(default_factory=dict)
    microbatches: int = 1
    microbatch_size: int = 1
    seq_len: int = 16
    seed: int = 0
    task: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None

    @property
    def is_preset(self) -> bool:
        from fxpipe.models import ARCHS  # lazy: torch

        return self.arch in ARCHS

    def _overrides(self) -> dict:
        over = {**self.overrides, "batch_size": self.microbatch_size, "seq_len": self.seq_len}
        if self.attn_implementation is not None:
            over["attn_implementation"] = self.attn_implementation
        return over

    def one_microbatch(self, device: str = "cpu"):
        from fxpipe.models import build_hf_model  # lazy: torch

        return build_hf_model(self.arch, self._overrides(), device=device, dtype=self.dtype, seed=self.seed, task=self.task)

    @property
    def loss(self):
        """The training loss for :meth:`fxpipe.plan.Plan.train_local` (picklable)."""
        from fxpipe.models import seeded_cross_entropy  # lazy: torch

        return "cross_entropy" if self.is_preset else seeded_cross_entropy

    def __post_init__(self):
        clash = sorted({"batch_size", "seq_len"} & set(self.overrides))
        if clash:
            raise InputError(f"set {clash} with --microbatch-size / --seq-len, not --config")

    def vocab_size(self) -> int:
        return _vocab_size(self.arch, tuple(sorted(self.overrides.items())))

    def __call__(self):
        model, _, _ = self.one_microbatch("cpu")
        inputs, _ = self.batch(0)
        return model, inputs

    def batch(self, step: int, model=None):
        """Step ``step``'s full batch: ``(inputs, target)`` (``model`` is unused)."""
        import torch

        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        b = self.microbatches * self.microbatch_size
        if not self.is_preset:
            from fxpipe.models import InputSpec, parse_dtype  # lazy: torch

            specs, dtype = _input_specs(self.arch, tuple(sorted((k, repr(v)) for k, v in self._overrides().items())),
                                        self.task, self.dtype)
            inputs = tuple(InputSpec(**{**s, "shape": tuple(s["shape"])}).draw(b, g, parse_dtype(dtype)) for s in specs)
            return inputs, torch.randint(0, 2**31 - 1, (b,), generator=g)
        vocab = self.vocab_size()
        ids = torch.randint(0, vocab, (b, self.seq_len + 1), generator=g)
        if self.arch == "t5":
            dec_len = int(self.overrides.get("decoder_seq_len") or self.seq_len)
            dec = torch.randint(0, vocab, (b, dec_len + 1), generator=g)
            return (ids[:, :-1], dec[:, :-1]), dec[:, 1:]
        return (ids[:, :-1],), ids[:, 1:]


@functools.lru_cache(maxsize=8)
def _input_specs(arch: str, overrides: tuple, task: str | None, dtype: str | None) -> tuple[list, str]:
    """Input recipe and dtype of a generic model (built once per process, on meta)."""
    import ast

    from fxpipe.models import build_hf_model  # lazy: torch

    over = {k: ast.literal_eval(v) for k, v in overrides}
    model, _, _ = build_hf_model(arch, {**over, "batch_size": 1}, device="meta", dtype=dtype, task=task)
    return model.fxpipe_info["input_specs"], model.fxpipe_info["dtype"]


@dataclass(frozen=True)
class ModelFactory:
    """Picklable factory of the user's ``--model package.module:factory`` for ``--run``.

    One micro-batch comes from the user's factory; a step's batch repeats it ``microbatches``
    times along dim 0 (every tensor input), and the loss is the mean square of the output's
    floating-point tensors (:func:`fxpipe.models.output_square_loss`): a training signal that
    every output structure has, enough to check pipelined against single-process training.
    """

    spec: str
    input_shapes: tuple = ()
    input_dtypes: tuple = ()
    microbatches: int = 1
    seed: int = 0
    dtype: str | None = None

    def one_microbatch(self, device: str = "cpu"):
        """The factory's ``(model, args, kwargs)``, cast to ``dtype`` when set (``device`` is the factory's choice)."""
        from fxpipe.models import cast_floating, load_model_factory, parse_dtype  # lazy: torch

        model, args, kwargs = load_model_factory(self.spec, self.input_shapes, self.input_dtypes, seed=self.seed)
        if self.dtype is not None:
            dt = parse_dtype(self.dtype)
            model = model.to(dtype=dt)
            args, kwargs = cast_floating(args, dt), cast_floating(kwargs, dt)
        return model, args, kwargs

    @property
    def loss(self):
        from fxpipe.models import output_square_loss  # lazy: torch

        return output_square_loss

    def __call__(self):
        model, _, _ = self.one_microbatch()
        inputs, _ = self.batch(0)
        return model, inputs

    def batch(self, step: int, model=None):
        import torch

        from fxpipe.codegen.interface import ModelInputs  # lazy: torch

        _, args, kwargs = self.one_microbatch()
        rep = self.microbatches

        def tile(x):
            return torch.cat([x] * rep, dim=0) if isinstance(x, torch.Tensor) and x.dim() >= 1 else x

        args = tuple(tile(a) for a in args)
        kwargs = {k: tile(v) for k, v in kwargs.items()}
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
        b = first.shape[0] if first is not None else rep
        return ModelInputs(args, kwargs), torch.zeros(b)


@functools.lru_cache(maxsize=8)
def _vocab_size(arch: str, overrides: tuple) -> int:
    """Vocabulary size of an architecture's config (built once per process, on meta)."""
    from fxpipe.models import build_hf_model  # lazy: torch

    model, _, _ = build_hf_model(arch, {**dict(overrides), "seq_len": 1}, device="meta")
    return int(model.model.config.vocab_size)


@dataclass(frozen=True)
class _BatchFn:
    factory: Any

    def __call__(self, step: int):
        return self.factory.batch(step)


def run(args: argparse.Namespace) -> int:
    from fxpipe.models import parse_overrides  # lazy: torch

    if args.profile_threads is not None and args.profile_threads < 1:
        raise InputError(f"--profile-threads must be >= 1, got {args.profile_threads}")
    mesh = "auto"
    if args.mesh in ("auto", "search", "pipeline"):
        mesh = args.mesh
    elif args.mesh is not None:
        mesh = parse_mesh(args.mesh)
        if args.devices is None:
            args.devices = math.prod(int(mesh.get(d, 1)) for d in ("pp", "dp_shard", "dp_replicate", "tp"))
        microbatches_per_replica(args.microbatches, normalize_mesh(mesh, args.devices))  # fail before the model is built
    if args.devices is None:
        args.devices = 4
    if args.stages_per_device != "auto" and args.stages_per_device < 1:
        raise InputError(f"--stages-per-device must be >= 1 or 'auto', got {args.stages_per_device}")
    for name in ("devices", "microbatches", "microbatch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise InputError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.meta and args.run:
        raise InputError("--meta builds a model without weights, which cannot be trained: drop --meta or --run")
    if args.meta and args.checkpoint:
        raise InputError("--meta builds a model without weights and --checkpoint loads them: drop one")
    if args.report and args.bounds_time_limit <= 0:
        raise InputError(f"--bounds-time-limit must be > 0 seconds, got {args.bounds_time_limit}")
    for flag, path in (("--out", args.out), ("--report", args.report), ("--trace", args.trace)):
        if path:
            check_writable(path, flag)
    progress = not args.json and stderr_is_terminal()  # phases over 2 s on stderr, for people only
    overrides = parse_overrides(args.config)
    if args.dtype is not None:
        from fxpipe.models import parse_dtype  # lazy: torch

        parse_dtype(args.dtype)  # a bad name fails here, before any model is built
    if args.model is not None:
        for flag, val in (("--config", args.config), ("--task", args.task), ("--attn-implementation", args.attn_implementation),
                          ("--checkpoint", args.checkpoint)):
            if val:
                raise InputError(f"{flag} applies to --hf models; with --model your factory builds the model as you want it")
        factory: Any = ModelFactory(args.model, tuple(args.input_shape), tuple(args.input_dtype), args.microbatches, args.seed,
                                    dtype=args.dtype)
        name = args.model
    else:
        if args.input_shape or args.input_dtype:
            raise InputError("--input-shape / --input-dtype apply to --model; --hf models build their own inputs")
        if args.checkpoint and not os.path.isdir(args.hf):
            raise InputError(f"--checkpoint loads the weights of a checkpoint folder given with --hf; {args.hf!r} is not a folder")
        factory = HFFactory(args.hf, overrides, args.microbatches, args.microbatch_size, args.seq_len, args.seed,
                            task=args.task, dtype=args.dtype, attn_implementation=args.attn_implementation)
        name = args.hf
    import warnings

    warnings.simplefilter("ignore", FxpipeWarning)  # the plan records them: its summary and --json carry them
    t0 = time.perf_counter()
    # planning needs shapes only: without --run the model is built on the meta device (no weight memory)
    model, margs, mkwargs = factory.one_microbatch("cpu" if args.run or args.checkpoint or args.meta is False else "meta")
    build_s = time.perf_counter() - t0
    info = {k: v for k, v in getattr(model, "fxpipe_info", {}).items() if k != "input_specs"}
    if info.get("source") not in (None, "preset"):
        name = info.get("model_type", name)
    try:
        plan = _compile(fxpipe, model, margs, mkwargs, args, name, progress, mesh)
    except CaptureError as exc:
        if info.get("source") in (None, "preset"):
            raise
        hint = (f" [fxpipe built {info.get('model_class')} with the inputs {info.get('inputs')} from its config"
                + (f"; at fxpipe's tiny sizes its forward failed first ({info['fallback_reason'][:200]})"
                   if info.get("fallback_reason") else "")
                + ": if it needs other inputs (image sizes, grids, masks), pass the model and its inputs with "
                "--model package.module:factory, see `fxpipe models`]")
        raise CaptureError(str(exc) + hint) from None
    doc: dict[str, Any] = {
        "model": args.hf if args.model is None else args.model,
        "config": overrides,
        "model_info": info,
        "build_s": build_s,
        "plan": {k: v for k, v in plan.to_dict().items() if k not in ("graph", "problem", "schedule", "stage_of")},
        "interrupted": plan.interrupted,
        "warnings": plan.all_warnings(),
    }
    text = [_model_line(info, args)] if info else []
    text.append(plan.summary())
    if args.out:
        plan.save(args.out)
        doc["plan_file"] = args.out
        text.append(f"plan written to {args.out}")
    if args.trace:
        doc["trace_file"] = str(chrome_trace(plan.schedule, args.trace, plan.problem))
        text.append(f"schedule trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    skipped = [flag for flag, on in (("--report", args.report), ("--run", args.run)) if on and plan.interrupted]
    if skipped:  # Ctrl-C was pressed: the plan so far is kept (--out, --trace), nothing long starts
        text.append(f"interrupted: {' and '.join(skipped)} skipped")
        args.report = args.run = None
    if args.report:
        with phase(f"report: lower-bound MIPs (up to {args.bounds_time_limit:g} s each) and charts", on=progress):
            doc["report"] = _write_report(plan, args)
        text.append(f"report written to {doc['report']['html']} and {doc['report']['markdown']}")
        text.append(format_bounds_table(doc["report"]["bounds"], plan.partition.bottleneck))
    if args.run:
        from fxpipe.codegen.compare import TrainingComparison  # lazy: torch

        status(f"training {args.steps} steps on {plan.world_size} local gloo ranks, then a single-process reference ...")
        result = plan.train_local(factory, _BatchFn(factory), steps=args.steps, lr=args.lr, loss=factory.loss, reference=True,
                                  timeout_s=args.timeout)
        doc["run"] = {k: v for k, v in result.items() if k != "results"}
        text.append(
            "pipeline losses:  " + ", ".join(f"{x:.6f}" for x in result["pipeline_losses"])
            + "\nreference losses: " + ", ".join(f"{x:.6f}" for x in result["reference_losses"])
            + f"\npipelined vs single-process training: {TrainingComparison(**result['comparison']).summary()}"
            + f"\npipeline run {result['pipeline_wall_s']:.1f} s"
        )
    emit(args, doc, "\n".join(text))
    if plan.interrupted:  # an interrupted result says so in its exit code (and "interrupted" in --json)
        return 130
    # a pipelined run that does not match single-process training is a failure of fxpipe, not of the input
    return 1 if args.run and not result["ok"] else 0


def _compile(fxpipe, model, margs, mkwargs, args: argparse.Namespace, name: str, progress: bool, mesh: Any):
    """``fxpipe.compile`` with the command's options."""
    return fxpipe.compile(
        model,
        margs,
        mkwargs,
        devices=args.devices,
        microbatches=args.microbatches,
        hardware=args.hardware,
        costs=args.costs,
        cost_db=args.cost_db,
        profile_threads=1 if (args.profile_threads is None and args.run) else args.profile_threads,
        objective=args.objective,
        schedule=args.schedule,
        stages_per_device=args.stages_per_device,
        placement=args.placement,
        time_limit_s=args.time_limit,
        seed=args.seed,
        name=name,
        memory=memory_model_from_args(args, math.inf),
        memory_bytes=None if args.memory is None else parse_bytes(args.memory, allow_inf=True),
        progress=progress,
        mesh=mesh,
        activation_checkpointing=args.activation_checkpointing,
    )


def _model_line(info: dict[str, Any], args: argparse.Namespace) -> str:
    """One line naming what was built: type, task and class, sizes, dtype, attention, weights."""
    sizes = {"tiny": "small default sizes", "shallow": "default widths, 2 layers", "preset": "preset sizes",
             "as configured": "sizes as configured"}.get(info.get("sizes"), info.get("sizes"))
    parts = [f"model: {info.get('model_type', args.hf)} ({info.get('task')}, {info.get('model_class')})", sizes,
             info.get("dtype"), f"{info.get('attn_implementation') or 'default'} attention", f"weights {info.get('weights')}",
             "inputs " + ", ".join(info.get("inputs", []))]
    return ", ".join(str(p) for p in parts if p)


def _write_report(plan, args: argparse.Namespace) -> dict[str, Any]:
    """HTML + Markdown report of a plan: certificates for its partition and its schedule's Gantt chart."""
    import shlex
    import sys

    return write_plan_report(
        plan,
        args.report,
        bounds_time_limit_s=args.bounds_time_limit,
        trace=args.trace,
        command="fxpipe " + shlex.join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("fxpipe") else None,
    )


def format_bounds_table(bounds: dict[str, Any], bottleneck_s: float) -> str:
    """The report's lower-bound certificates as a text table (ms), one row per method.

    Parameters
    ----------
    bounds : dict
        ``write_plan_report(...)["bounds"]``: ``best_lower_bound``, ``ratio`` and ``rows``
        (:meth:`fxpipe.partition.bounds.BoundsReport.table_rows`: method, lower_bound_s, ratio,
        status, wall_time_s).
    bottleneck_s : float
        The partition's per-stage bottleneck the bounds are for (seconds).
    """
    lines = [f"partition lower bounds (per-stage bottleneck {format_ms(bottleneck_s)}; a ratio of 1 proves it optimal):",
             f"  {'method':<11} {'bound ms':>10} {'ratio':>7}  {'status':<22} {'time s':>7}"]
    rows = bounds.get("rows", [])
    shown = iter(ms_column([r["lower_bound_s"] for r in rows if r["status"] != "skipped"]))
    for r in rows:
        skipped = r["status"] == "skipped"
        bound = "-" if skipped else next(shown)
        ratio = "-" if skipped or r["ratio"] is None else f"{r['ratio']:.4f}"
        lines.append(f"  {r['method']:<11} {bound:>10} {ratio:>7}  {r['status']:<22} {r['wall_time_s']:>7.2f}")
    best, ratio = bounds.get("best_lower_bound"), bounds.get("ratio")
    if best is not None:
        verdict = "proven optimal" if ratio is not None and ratio >= 1 - 1e-6 else (
            "" if ratio is None else f"at most {1 / ratio - 1:.1%} above the optimum" if ratio > 0 else "no bound")
        lines.append(f"  best bound {format_ms(best)}" + (f": the partition is {verdict}" if verdict else ""))
    return "\n".join(lines)
