"""Setup shared by the benchmarks that train a small GPT-2 on local gloo ranks
(``bench_mesh.py``, ``bench_recv_buffers.py``); imported as ``_common`` when a benchmark runs as
``python benchmarks/NAME.py``."""

from __future__ import annotations

import argparse


def add_small_gpt2_arguments(ap: argparse.ArgumentParser, *, microbatches: int, microbatches_help: str | None = None) -> None:
    """``--layers --width --seq-len --microbatch-size --microbatches``: the model and batch of :func:`small_gpt2`."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=microbatches, help=microbatches_help)


def small_gpt2(args: argparse.Namespace):
    """The :class:`fxpipe.cli.plan_cmd.HFFactory` of the GPT-2 the arguments of
    :func:`add_small_gpt2_arguments` describe: 2 heads, a 256-token vocabulary, seed 0."""
    from fxpipe.cli.plan_cmd import HFFactory  # noqa: PLC0415 (torch and transformers after argument parsing)

    cfg = {"n_layer": args.layers, "n_embd": args.width, "n_head": 2, "vocab_size": 256, "n_positions": args.seq_len}
    return HFFactory("gpt2", cfg, args.microbatches, args.microbatch_size, args.seq_len, 0)
