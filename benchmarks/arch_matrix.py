"""The real-architecture matrix: model x pipeline size x schedule -> ok / error, loss and gradient differences.

Every model of ``fxpipe.testing.zoo`` (Hugging Face architectures built from configs with random weights,
plus hand-written DAGs) is planned with ``fxpipe.compile`` for 2 and 4 pipeline stages, trained
for 2 SGD steps on local gloo ranks with every schedule (GPipe, 1F1B, ZB-H1, ZB-H2 and the
schedule MILP's), and compared with single-process training: losses (relative), every gradient
(relative to the model's largest reference gradient), every parameter after the steps and every
buffer (relative to the largest reference value). Prints a Markdown table and the wall time.

    python benchmarks/arch_matrix.py                      # all models, ranks 2 and 4, all schedules
    python benchmarks/arch_matrix.py --models gpt2 unet --ranks 2 --json
    python benchmarks/arch_matrix.py --compact            # one row per model (the README's table)
    python benchmarks/arch_matrix.py --group second --meta-checkpoint olmo2 mamba distilbert pegasus swin \
        inception cohere lstm_gru --compact               # the second round (issue 17), with meta builds
    python benchmarks/arch_matrix.py --stages-per-device 2 --ranks 2 --schedules interleaved-1f1b zb-v dualpipe-v --compact
                                                          # 2 stages per rank: looped / V placements
    python benchmarks/arch_matrix.py --group third --ranks 2 --schedules auto --compact   # the third round (issue 30)
    python benchmarks/arch_matrix.py --models mixed_dtype t5_mixed --mesh auto --ranks 2 4 --schedules auto --compact
                                                          # bf16 + fp32 models on the mesh fxpipe.compile picks
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from fxpipe.mesh import parse_mesh
    from fxpipe.testing import zoo
    from fxpipe.testing.matrix import SCHEDULES, run_matrix

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help=f"zoo models (default all: {' '.join(zoo.names())})")
    ap.add_argument("--group", choices=zoo.GROUPS, default=None,
                    help="only the zoo's first round (core), second round (second) or third round (third) of models")
    ap.add_argument("--meta-checkpoint", nargs="*", default=[],
                    help="models also built on meta in every worker and loaded from a safetensors checkpoint "
                    "(first schedule)")
    ap.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stages-per-device", type=int, default=1,
                    help="stages per rank; with 2+ each schedule runs on its placement (interleaved-1f1b looped, "
                    "zb-v / dualpipe-v / greedy / milp V-shaped)")
    ap.add_argument("--mesh", default="pipeline",
                    help="fxpipe.compile's mesh for every model: pipeline (default: RANKS pipeline stages), auto (the "
                    "mesh search, fxpipe's default; data parallelism where it wins) or degrees such as pp=2,dp_shard=2")
    ap.add_argument("--partition-time-limit", type=float, default=0.3)
    ap.add_argument("--milp-time-limit", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    ap.add_argument("--out", help="also write the Markdown table to this file")
    ap.add_argument("--compact", action="store_true", help="one row per model, one column per pipeline size")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    models = args.models if args.models else (zoo.names(group=args.group) if args.group else None)
    mesh = args.mesh if args.mesh in ("pipeline", "auto", "search") else parse_mesh(args.mesh)
    res = run_matrix(models, args.ranks, args.schedules, steps=args.steps, stages_per_device=args.stages_per_device,
                     meta_checkpoint=args.meta_checkpoint, mesh=mesh,
                     partition_time_limit_s=args.partition_time_limit, milp_time_limit_s=args.milp_time_limit, log=log)
    table = res.markdown(compact=args.compact)
    n_ok = sum(c.ok for c in res.cells)
    summary = (f"{n_ok}/{len(res.cells)} runs equal to single-process training "
               f"({len(set(c.model for c in res.cells))} models); wall time {res.timings_s['wall_s']:.0f} s "
               f"(" + ", ".join(f"{k} {v:.0f} s" for k, v in res.timings_s.items() if k != "wall_s") + ")")
    exercised = (
        f"runs with received inputs cloned for in-place updates: {sum(c.cloned_inputs > 0 for c in res.cells)}; "
        f"with nodes moved for in-place order / state ownership: {sum(c.moved_nodes > 0 for c in res.cells)}; "
        f"with split-backward-blind stages run as full backward: {sum(bool(c.full_backward_stages) for c in res.cells)}"
    )
    summary += "\n" + exercised
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n\n" + summary + "\n")
    if args.json:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        print(table)
        print()
        print(summary)
        for c in res.failures():
            print(f"\n{c.model} ranks={c.ranks} {c.schedule}: {c.error or '; '.join(c.problems) or 'differences over tolerance'}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
