"""``fxpipe plan``: the whole pass on a Hugging Face architecture built from its config.

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
import time
from dataclasses import dataclass, field
from typing import Any

from fxpipe.api import PLACEMENTS, SCHEDULES
from fxpipe.cli.common import add_memory_arguments, check_writable, emit, memory_model_from_args, parse_bytes, status
from fxpipe.cost.hardware import list_hardware
from fxpipe.errors import InputError



def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="plan pipeline parallelism for a Hugging Face architecture (random weights, no download)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf", required=True, metavar="ARCH", help="architecture built from its config: gpt2, t5, llama, mixtral or llama-2-7b"
    )
    p.add_argument(
        "--config", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="config overrides, e.g. n_layer=8 n_embd=256 (repeat the flag to add more; a later value of the same key wins)",
    )
    p.add_argument("--devices", type=int, default=None,
                   help="devices (default 4, or the product of --mesh); without --mesh they are the pipeline ranks")
    p.add_argument(
        "--mesh", default=None, metavar="pp=A,dp_shard=B,dp_replicate=C|auto|search",
        help="pipeline x data parallelism (torchtitan's names, missing = 1, product = devices): dp_shard * dp_replicate "
        "replicas of a pipeline over pp devices, FSDP2 over dp_shard (HSDP with dp_replicate), replicate over "
        "dp_replicate; --microbatches is then the global count, divided among the replicas; 'search': plan every "
        "pp x dp_shard and keep the smallest predicted step that fits (default auto: a pure pipeline)",
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
    p.add_argument("--time-limit", type=float, default=10.0, help="partition search budget in seconds (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--meta", action="store_true",
        help="build the model on the meta device (no weights). This is the default without --run: planning needs "
        "shapes only, so a 70B config plans on a laptop; with --run the model is built with real weights",
    )
    p.add_argument("--out", metavar="PLAN.json", help="save the plan as JSON")
    p.add_argument("--report", metavar="REPORT.html", help="write an HTML report (and REPORT.md): stages, lower-bound certificates, Gantt chart")
    p.add_argument("--bounds-time-limit", type=float, default=60.0, metavar="S", help="time limit per lower-bound MIP for --report (default 60)")
    p.add_argument("--run", action="store_true", help="train a few steps on local gloo ranks next to a single-process reference")
    p.add_argument("--steps", type=int, default=2, help="training steps with --run (default 2)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate with --run")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=run)
    return p


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
    sequences; ``batch(step) -> (inputs, target)`` gives step ``step``'s batch, the target
    being next-token ids (random tokens, fixed by the seed).
    """

    arch: str
    overrides: dict = field(default_factory=dict)
    microbatches: int = 1
    microbatch_size: int = 1
    seq_len: int = 16
    seed: int = 0

    def one_microbatch(self, device: str = "cpu"):
        from fxpipe.models import build_hf_model

        over = {**self.overrides, "batch_size": self.microbatch_size, "seq_len": self.seq_len}
        return build_hf_model(self.arch, over, device=device, seed=self.seed)

    def __post_init__(self):
        clash = sorted({"batch_size", "seq_len"} & set(self.overrides))
        if clash:
            raise InputError(f"set {clash} with --microbatch-size / --seq-len, not --config")

    def vocab_size(self) -> int:
        return _vocab_size(self.arch, tuple(sorted(self.overrides.items())))

    def __call__(self):
        model, _, _ = self.one_microbatch()
        inputs, _ = self.batch(0)
        return model, inputs

    def batch(self, step: int, model=None):
        """Step ``step``'s full batch: ``(inputs, target)``, next-token targets (``model`` is unused)."""
        import torch

        vocab = self.vocab_size()
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        b = self.microbatches * self.microbatch_size
        ids = torch.randint(0, vocab, (b, self.seq_len + 1), generator=g)
        if self.arch == "t5":
            dec_len = int(self.overrides.get("decoder_seq_len") or self.seq_len)
            dec = torch.randint(0, vocab, (b, dec_len + 1), generator=g)
            return (ids[:, :-1], dec[:, :-1]), dec[:, 1:]
        return (ids[:, :-1],), ids[:, 1:]


@functools.lru_cache(maxsize=8)
def _vocab_size(arch: str, overrides: tuple) -> int:
    """Vocabulary size of an architecture's config (built once per process, on meta)."""
    from fxpipe.models import build_hf_model

    model, _, _ = build_hf_model(arch, {**dict(overrides), "seq_len": 1}, device="meta")
    return int(model.model.config.vocab_size)


@dataclass(frozen=True)
class _BatchFn:
    factory: HFFactory

    def __call__(self, step: int):
        return self.factory.batch(step)


def run(args: argparse.Namespace) -> int:
    import fxpipe
    from fxpipe.models import parse_overrides

    if args.profile_threads is not None and args.profile_threads < 1:
        raise InputError(f"--profile-threads must be >= 1, got {args.profile_threads}")
    mesh = "auto"
    if args.mesh in ("auto", "search"):
        mesh = args.mesh
    elif args.mesh is not None:
        from fxpipe.mesh import microbatches_per_replica, normalize_mesh, parse_mesh

        mesh = parse_mesh(args.mesh)
        if args.devices is None:
            args.devices = math.prod(mesh.values())
        microbatches_per_replica(args.microbatches, normalize_mesh(mesh, args.devices))  # fail before the model is built
    if args.devices is None:
        args.devices = 4
    if args.stages_per_device != "auto" and args.stages_per_device < 1:
        raise InputError(f"--stages-per-device must be >= 1 or 'auto', got {args.stages_per_device}")
    for name in ("devices", "microbatches", "microbatch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.meta and args.run:
        raise InputError("--meta builds a model without weights, which cannot be trained: drop --meta or --run")
    if args.report and args.bounds_time_limit <= 0:
        raise InputError(f"--bounds-time-limit must be > 0 seconds, got {args.bounds_time_limit}")
    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path:
            check_writable(path, flag)
    overrides = parse_overrides(args.config)
    factory = HFFactory(args.hf, overrides, args.microbatches, args.microbatch_size, args.seq_len, args.seed)
    t0 = time.perf_counter()
    # planning needs shapes only: without --run the model is built on the meta device (no weight memory)
    model, margs, mkwargs = factory.one_microbatch("cpu" if args.run else "meta")
    build_s = time.perf_counter() - t0
    plan = fxpipe.compile(
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
        name=args.hf,
        memory=memory_model_from_args(args, math.inf),
        memory_bytes=None if args.memory is None else parse_bytes(args.memory, allow_inf=True),
        mesh=mesh,
    )
    doc: dict[str, Any] = {
        "model": args.hf,
        "config": overrides,
        "build_s": build_s,
        "plan": {k: v for k, v in plan.to_dict().items() if k not in ("graph", "problem", "schedule", "stage_of")},
    }
    text = [plan.summary()]
    if args.out:
        plan.save(args.out)
        doc["plan_file"] = args.out
        text.append(f"plan written to {args.out}")
    if args.report:
        doc["report"] = _write_report(plan, args)
        text.append(f"report written to {doc['report']['html']} (bounds: {doc['report']['bounds']})")
    if args.run:
        from fxpipe.codegen.compare import TrainingComparison

        status(f"training {args.steps} steps on {plan.world_size} local gloo ranks, then a single-process reference ...")
        result = plan.train_local(factory, _BatchFn(factory), steps=args.steps, lr=args.lr, reference=True)
        doc["run"] = {k: v for k, v in result.items() if k != "results"}
        text.append(
            "pipeline losses:  " + ", ".join(f"{x:.6f}" for x in result["pipeline_losses"])
            + "\nreference losses: " + ", ".join(f"{x:.6f}" for x in result["reference_losses"])
            + f"\npipelined vs single-process training: {TrainingComparison(**result['comparison']).summary()}"
            + f"\npipeline run {result['pipeline_wall_s']:.1f} s"
        )
    emit(args, doc, "\n".join(text))
    # a pipelined run that does not match single-process training is a failure of fxpipe, not of the input
    return 1 if args.run and not result["ok"] else 0


def _write_report(plan, args: argparse.Namespace) -> dict[str, Any]:
    """HTML + Markdown report of a plan: certificates for its partition and its schedule's Gantt chart."""
    import shlex
    import sys

    from fxpipe.report import write_plan_report

    return write_plan_report(
        plan,
        args.report,
        bounds_time_limit_s=args.bounds_time_limit,
        command="fxpipe " + shlex.join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("fxpipe") else None,
    )
