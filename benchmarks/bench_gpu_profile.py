"""The cost model against one real GPU: datasheet figures, op times, a layer stack's step and memory.

Run on a machine with a CUDA device (fxpipe importable, e.g. ``PYTHONPATH=.`` from the
repository root)::

    python benchmarks/bench_gpu_profile.py --out gpu_profile.json

What it measures and compares with fxpipe's model (each section in its own ``try``, so one
failure keeps the others; everything goes to one JSON document and a printed summary):

1. **device**: torch's ``total_memory`` against the hardware spec's ``memory_bytes``; a pinned
   host <-> device copy (the offload link) against ``host_bytes_per_s``; a device-to-device
   copy against ``hbm_bytes_per_s``; a bf16 8192^3 matrix product against the bf16 peak
   (``fxpipe.cost.specs.HARDWARE``, the spec :func:`fxpipe.cost.measure.base_hardware` picks
   for this GPU).
2. **ops**: a Llama-3-8B-dimension model (``--dims``; ``--layers`` decoder layers, ``--seq-len`` tokens,
   bf16, SDPA attention) costed twice: the datasheet roofline (``costs="roofline"``) and
   fxpipe's profiler on this GPU (``costs="measured"``: every op's forward, backward-input
   and backward-weight timed with CUDA events, :func:`fxpipe.cost.profile.trace_measured`).
   Per op kind / target: the summed F, B, W of both and their ratio.
3. **step**: the same model with real weights on the GPU, eager: forward and forward +
   backward times (CUDA events, median of the timed repeats) against the sum of the
   graph's F (and F + B + W), roofline and measured; and the forward's memory increase
   (what autograd saves for the backward, ``torch.cuda.max_memory_allocated``) against
   fxpipe's stash of one micro-batch on one stage (``mem_f`` of
   :func:`fxpipe.schedule.from_partition.problem_from_partition`).
4. **fsdp**: the same model wrapped by FSDP2 (``fully_shard`` per decoder layer and the root,
   one rank, NCCL) against the bare model: the runtime overhead FSDP adds to a step on one
   GPU (one rank moves no bytes; fxpipe prices the collectives of ``dp_shard > 1`` by
   bandwidth, :func:`fxpipe.mesh.dp_sync_time_s`).

``--smoke`` runs every section on the CPU with tiny sizes (to check the script, not the
model).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

LLAMA_3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
LLAMA_3_70B = {**LLAMA_3_8B, "hidden_size": 8192, "num_attention_heads": 64, "intermediate_size": 28672}
DIMS = {"llama-3-8b": LLAMA_3_8B, "llama-3-70b": LLAMA_3_70B}
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 256}


def _timer(device):
    """``time(fn, repeats)`` -> median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on CPU)."""
    def run(fn, repeats=5, warmup=2):
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        return statistics.median(out)
    return run


def section_device(device, spec, smoke: bool) -> dict:
    time_of = _timer(device)
    res: dict = {"spec": spec.name, "spec_memory_bytes": spec.memory_bytes}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        res.update(name=props.name, total_memory_bytes=int(props.total_memory), mem_get_info_total_bytes=int(total),
                   free_bytes=int(free), multiprocessors=int(props.multi_processor_count),
                   total_over_spec=props.total_memory / spec.memory_bytes)
    n = (1 << 20) if smoke else (1 << 30)  # bytes per copy
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    t_h2d = time_of(lambda: dev.copy_(host, non_blocking=True))
    t_d2h = time_of(lambda: host.copy_(dev, non_blocking=True))
    res.update(h2d_bytes_per_s=n / t_h2d, d2h_bytes_per_s=n / t_d2h, spec_host_bytes_per_s=spec.host_bytes_per_s)
    big = torch.empty(4 * n, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)
    t_d2d = time_of(lambda: big2.copy_(big))
    res.update(d2d_read_plus_write_bytes_per_s=2 * big.numel() / t_d2d, spec_hbm_bytes_per_s=spec.hbm_bytes_per_s)
    del big, big2, host, dev
    k = 256 if smoke else 8192
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(k, k, device=device, dtype=dt)
    b = torch.randn(k, k, device=device, dtype=dt)
    t_mm = time_of(lambda: a @ b, repeats=10, warmup=3)
    res.update(matmul_bf16_flops_per_s=2 * k ** 3 / t_mm, spec_bf16_flops_per_s=spec.peak_flops.get("bf16"))
    return res


def _kind(extra: dict) -> str:
    t = str(extra.get("target", "?"))
    for key, label in (("scaled_dot_product", "attention (sdpa)"), ("aten.mm", "matmul"), ("aten.addmm", "matmul"),
                       ("aten.bmm", "matmul"), ("aten.linear", "matmul"), ("embedding", "embedding"),
                       ("rsqrt", "rms norm"), ("pow", "rms norm"), ("mean", "rms norm")):
        if key in t:
            return label
    return str(extra.get("kind") or "other")


def _graph_sums(graph) -> dict:
    by = collections.defaultdict(lambda: np.zeros(3))
    for i in range(graph.n):
        by[_kind(graph.extra[i] if graph.extra else {})] += (graph.t_fwd_s[i], graph.t_bwd_input_s[i],
                                                           graph.t_bwd_weight_s[i])
    return {k: [float(x) for x in v] for k, v in by.items()}


def _model(dims: str, layers: int, seq_len: int, smoke: bool, device: str):
    from fxpipe.models import build_hf_model

    over = {**(TINY if smoke else DIMS[dims]), "num_hidden_layers": layers, "seq_len": seq_len,
            "attn_implementation": "sdpa"}
    return build_hf_model("llama", over, device=device, dtype=torch.float32 if smoke else torch.bfloat16)


def section_ops(device, spec, dims: str, layers: int, seq_len: int, smoke: bool) -> tuple[dict, object, object]:
    from fxpipe.cost.profile import trace_measured
    from fxpipe.passes import trace_model

    model, args, kwargs = _model(dims, layers, seq_len, smoke, "meta")
    t0 = time.perf_counter()
    roof = trace_model(model, args, kwargs, hardware=spec)
    db = os.path.join(tempfile.mkdtemp(prefix="fxpipe_gpu_"), "costdb.json")
    meas, report = trace_measured(model, args, kwargs, hardware="measured", db=db, device=str(device))
    rs, ms = _graph_sums(roof.graph), _graph_sums(meas.graph)
    rows = {}
    for k in sorted(set(rs) | set(ms), key=lambda k: -sum(ms.get(k, [0, 0, 0]))):
        r, m = rs.get(k, [0.0] * 3), ms.get(k, [0.0] * 3)
        rows[k] = {"roofline_fbw_s": r, "measured_fbw_s": m,
                   "measured_over_roofline": (sum(m) / sum(r)) if sum(r) > 0 else None}
    g_r, g_m = roof.graph, meas.graph
    tot = {name: [float(g.t_fwd_s.sum()), float(g.t_bwd_input_s.sum()), float(g.t_bwd_weight_s.sum())]
           for name, g in (("roofline", g_r), ("measured", g_m))}
    return ({"ops": g_m.n, "profiled_measured": report.measured, "failed": len(report.failed),
             "failed_examples": dict(list(report.failed.items())[:5]), "profile_wall_s": report.wall_s,
             "autograd_call_overhead_s": report.autograd_call_overhead_s, "capture_and_profile_s": time.perf_counter() - t0,
             "totals_fbw_s": tot, "by_kind": rows}, g_r, g_m)


def _one_stage(graph):
    from fxpipe.schedule.from_partition import problem_from_partition

    return problem_from_partition(graph, np.zeros(graph.n, dtype=np.int64), num_microbatches=1)


def section_step(device, dims: str, layers: int, seq_len: int, smoke: bool, graphs) -> dict:
    time_of = _timer(device)
    model, args, kwargs = _model(dims, layers, seq_len, smoke, "cpu")
    model = model.to(device)
    args = tuple(a.to(device) if torch.is_tensor(a) else a for a in args)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def out_tensor(o):
        return o.logits if hasattr(o, "logits") else (o[0] if isinstance(o, (tuple, list)) else o)

    def fwd():
        with torch.no_grad():
            model(*args, **kwargs)

    def fwd_bwd():
        with torch.enable_grad():
            out_tensor(model(*args, **kwargs)).float().sum().backward()

    t_f = time_of(fwd)
    t_fb = time_of(fwd_bwd)
    model.zero_grad(set_to_none=False)  # gradients allocated: the forward below adds only saved tensors
    saved = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.enable_grad():
            out = out_tensor(model(*args, **kwargs))
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(device)
        saved = after - base - out.numel() * out.element_size()  # what autograd holds for the backward
        del out
    res = {"forward_s": t_f, "forward_backward_s": t_fb, "forward_saved_bytes": saved}
    for name, g in graphs.items():
        p = _one_stage(g)
        res[name] = {"F_s": float(p.t_f[0]), "F_B_W_s": float(p.t_f[0] + p.t_b[0] + p.t_w[0]),
                     "stash_bytes": float(p.mem_f[0]),
                     "forward_measured_over_predicted": t_f / float(p.t_f[0]),
                     "step_measured_over_predicted": t_fb / float(p.t_f[0] + p.t_b[0] + p.t_w[0]),
                     "saved_measured_over_predicted": (saved / float(p.mem_f[0])) if saved else None}
    del model
    return res


def section_fsdp(device, dims: str, layers: int, seq_len: int, smoke: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    time_of = _timer(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
        res = {}
        for wrapped in (False, True):
            model, args, kwargs = _model(dims, layers, seq_len, smoke, "cpu")
            model = model.to(device)
            if wrapped:
                layers_list = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))  # decoder layers
                for layer in layers_list:
                    fully_shard(layer, mesh=mesh, reshard_after_forward=True)
                fully_shard(model, mesh=mesh, reshard_after_forward=True)
            a = tuple(x.to(device) if torch.is_tensor(x) else x for x in args)
            kw = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}

            def step():
                with torch.enable_grad():
                    out = model(*a, **kw)
                    (out.logits if hasattr(out, "logits") else out[0]).float().sum().backward()

            res["fsdp2_step_s" if wrapped else "bare_step_s"] = time_of(step)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res["fsdp_overhead"] = res["fsdp2_step_s"] / res["bare_step_s"] - 1.0
        return res
    finally:
        dist.destroy_process_group()


def run_section(doc: dict, name: str, fn, *, skip=(), out: str | None = None, max_print: int | None = None) -> None:
    """``doc[name] = fn()``, a failure recorded as ``{"error", "traceback"}`` instead of raised (one section's
    failure keeps the others); its wall time in ``doc["section_wall_s"]``; printed; ``out`` rewritten atomically."""
    if name in skip:
        return
    t = time.perf_counter()
    try:
        doc[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one section's failure keeps the others
        doc[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    doc.setdefault("section_wall_s", {})[name] = time.perf_counter() - t
    text = json.dumps(doc[name], indent=1, default=str)
    print(f"== {name} ({doc['section_wall_s'][name]:.1f} s)\n{text if max_print is None else text[:max_print]}", flush=True)
    if out:
        from fxpipe.io import write_text_atomic

        write_text_atomic(out, json.dumps(doc, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="llama-3-8b", choices=sorted(DIMS), help="decoder layer dimensions")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    ap.add_argument("--out", default=None, help="write the JSON document here")
    ap.add_argument("--skip", nargs="*", default=[], choices=["device", "ops", "step", "fsdp"])
    args = ap.parse_args(argv)
    from fxpipe.cost.measure import base_hardware, device_info

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.seq_len = min(args.seq_len, 32)
    info = device_info(str(device), None)
    spec = base_hardware(info)
    doc: dict = {"torch": torch.__version__, "device": str(device), "spec": spec.name, "dims": args.dims,
                 "layers": args.layers,
                 "seq_len": args.seq_len, "smoke": args.smoke}
    graphs = {}

    def run(name, fn):
        run_section(doc, name, fn, skip=args.skip, out=args.out)

    run("device", lambda: section_device(device, spec, args.smoke))

    def ops():
        res, g_r, g_m = section_ops(device, spec, args.dims, args.layers, args.seq_len, args.smoke)
        graphs.update(roofline=g_r, measured=g_m)
        return res

    run("ops", ops)
    doc["grad_enabled_after_ops"] = torch.is_grad_enabled()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run("step", lambda: section_step(device, args.dims, args.layers, args.seq_len, args.smoke, graphs))
    run("fsdp", lambda: section_fsdp(device, args.dims, args.layers, args.seq_len, args.smoke))
    return 0


if __name__ == "__main__":
    sys.exit(main())
