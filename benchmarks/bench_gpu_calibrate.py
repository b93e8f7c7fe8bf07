"""The prepared GPU calibration: profile a Llama block, check the profile on whole stages, ship it if it holds.

One command for a lent GPU (fxpipe importable, e.g. ``PYTHONPATH=.`` from the repository root)::

    python benchmarks/bench_gpu_calibrate.py --out gpu_calibrate.json [--profile-out DIR/h100-sxm.json]

It writes ONE JSON document (rewritten after every section; each section in its own ``try``,
so one failure keeps the others) and prints a summary. Sections, in order:

1. **device**: ``total_memory``, pinned host copies, a device copy and a bf16 8192^3 matmul
   against the spec (``bench_gpu_profile.section_device``).
2. **profile**: the ops of one Llama block stage (``--dims`` widths: decoder layer, final norm,
   LM head, ``logits.float().sum()``; bf16, SDPA) at 4096 and 8192 tokens, each op's F, B and W
   timed with CUDA events by fxpipe's profiler (:func:`fxpipe.cost.profile.trace_measured`); the
   measurements and their calibration become a hardware profile (``fxpipe.hwprofile/1``) named
   after the GPU (``h100-sxm``, ``h200``, ``a100-80gb``).
3. **stages**: one pipeline stage of 2, 4 and 8 Llama blocks (the same stage module, fed the
   embedding's output so that its input needs a gradient) at 4096 tokens, captured by fxpipe
   and run as the captured graph on the GPU (what fxpipe's runtime runs): forward F, backward
   to the input only B (``torch.autograd.grad``) and the weight gradients W (the full backward
   less B), medians of CUDA-event timings; beside each, fxpipe's prediction with the achieved
   spec (``h100-sxm``), the datasheet roofline (``h100-sxm-datasheet``) and the new profile.
   The eager Hugging Face forward + backward of the same stage is timed too (the README's
   figures were eager).
4. **saved**: for the same stages, the bytes autograd saves for the backward (saved-tensor hooks
   during the captured graph's forward, distinct storages, parameters and the input excluded)
   against fxpipe's memory model (the stage's stash ``mem_f``, :mod:`fxpipe.memory`).
5. **ship**: the profile is written into the package (``fxpipe/cost/profiles/<gpu>.json``, i.e.
   ``hardware="profile:<gpu>"``) only if its F + B + W prediction of every stage is within
   ``--ship-tolerance`` (10 %) of the measurement; ``--profile-out`` gets a copy either way
   (the device tool returns only files under ``$OUT``), and the JSON says why it shipped or not.

Expected wall time on one H100: about 6-8 minutes (profiling 2 x ~60 op signatures, 3
captures on ``meta`` and 3 on the GPU, and the timed stages); ``--stage-layers`` and
``--profile-seq-lens`` shorten it. ``--smoke`` runs every section on the CPU with a tiny Llama
in seconds (checks the script, not the model) and never writes into the package.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_profile import DIMS, TINY, run_section, section_device  # noqa: E402 (the sibling benchmark)

REPO = Path(__file__).resolve().parents[1]


class Stage(torch.nn.Module):
    """Decoder blocks, final norm and LM head of a Hugging Face Llama, fed the embedding's output.

    A pipeline stage whose input needs a gradient (so B, the gradient to the input, and W, the
    weight gradients, are separate), closed by ``logits.float().sum()`` as in the H100 run.
    """

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, embeds):
        return self.hf(inputs_embeds=embeds, use_cache=False, return_dict=True).logits.float().sum()


def build_stage(dims: str, layers: int, seq_len: int, smoke: bool, device: str) -> tuple[Stage, torch.Tensor]:
    """The stage module and its input ``(1, seq_len, hidden)`` on ``device`` (``"meta"``: shapes only); weights are
    built on the device directly (random; values do not change the timings)."""
    from fxpipe.models import build_hf_model

    dtype = torch.float32 if smoke else torch.bfloat16
    over = {**(TINY if smoke else DIMS[dims]), "num_hidden_layers": layers, "seq_len": seq_len,
            "attn_implementation": "sdpa"}
    if device == "meta":
        model, _, _ = build_hf_model("llama", over, device="meta", dtype=dtype)
    else:
        with torch.device(device):  # build_hf_model honours the default device: no CPU copy of the weights
            model, _, _ = build_hf_model("llama", over, device="cpu", dtype=dtype)
    hidden = model.model.config.hidden_size
    embeds = torch.randn(1, seq_len, hidden, dtype=dtype, device=device) if device != "meta" else \
        torch.empty(1, seq_len, hidden, dtype=dtype, device="meta")
    return Stage(model.model), embeds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def time_fbw(fn, x: torch.Tensor, params, device: torch.device, repeats: int, warmup: int) -> dict:
    """Median F, B and W seconds of ``fn(x)``: forward; gradient to ``x`` only; full backward less that."""
    f, b, w = [], [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        x = x.detach().requires_grad_(True)
        t0 = _now(device)
        out = fn(x)
        t1 = _now(device)
        torch.autograd.grad(out, [x], retain_graph=True)
        t2 = _now(device)
        out.backward()
        t3 = _now(device)
        if i >= warmup:
            f.append(t1 - t0)
            b.append(t2 - t1)
            w.append((t3 - t2) - (t2 - t1))
    return {"F_s": statistics.median(f), "B_s": statistics.median(b), "W_s": max(statistics.median(w), 0.0)}


def saved_bytes(fn, x: torch.Tensor, params) -> int:
    """Bytes of the distinct storages autograd saves during ``fn(x)``'s forward (parameters and ``x`` excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x.detach().requires_grad_(True))
    del out
    return int(sum(seen.values()))


def predicted_fbw(stage_meta: Stage, embeds_meta: torch.Tensor, specs: dict) -> dict:
    """fxpipe's F, B, W sums (s), activation bytes and one-stage stash of the stage, per spec."""
    import numpy as np

    from fxpipe.passes.annotate import AnnotateCosts
    from fxpipe.passes.capture import capture
    from fxpipe.passes.costing import COST_KEY
    from fxpipe.passes.to_opgraph import to_opgraph
    from fxpipe.schedule.from_partition import problem_from_partition

    cap = capture(stage_meta, (embeds_meta,), replicate="never")
    out = {}
    for name, spec in specs.items():
        AnnotateCosts(spec)(cap.gm)
        costs = [n.meta[COST_KEY] for n in cap.gm.graph.nodes]
        g, _ = to_opgraph(cap.gm, spec, name="stage")
        p = problem_from_partition(g, np.zeros(g.n, dtype=np.int64), num_microbatches=1)
        out[name] = {"F_s": sum(c.t_fwd_s for c in costs), "B_s": sum(c.t_bwd_input_s for c in costs),
                     "W_s": sum(c.t_bwd_weight_s for c in costs), "act_bytes": sum(c.act_bytes for c in costs),
                     "stash_bytes": float(p.mem_f[0])}
    return out


def gpu_name(spec_name: str) -> str:
    """``"h100-sxm-datasheet"`` -> ``"h100-sxm"``: the profile's name (``profile:<gpu>``)."""
    return spec_name[: -len("-datasheet")] if spec_name.endswith("-datasheet") else f"{spec_name}-measured"


def section_profile(device: torch.device, args, work: Path) -> dict:
    from fxpipe.cost.calibrate import cross_validate
    from fxpipe.cost.profile import base_hardware, device_info, measured_profile, trace_measured

    info = device_info(str(device), None)
    name = gpu_name(base_hardware(info).name)
    db = work / "costdb.json"
    opts = {"warmup": 1, "min_repeats": 2, "max_repeats": 3, "min_time_s": 0.0} if args.smoke else {}
    runs = {}
    for seq in args.profile_seq_lens:
        stage, embeds = build_stage(args.dims, 1, seq, args.smoke, "meta")
        t0 = time.perf_counter()
        traced, report = trace_measured(stage, (embeds,), {}, hardware="measured", db=str(db), device=str(device), **opts)
        runs[str(seq)] = {"ops": traced.graph.n, "measured": report.measured, "reused": report.reused,
                          "failed": dict(list(report.failed.items())[:5]), "wall_s": time.perf_counter() - t0}
    prof = measured_profile(str(db), device=str(device), name=name,
                            made_with="python benchmarks/bench_gpu_calibrate.py " + " ".join(sys.argv[1:]),
                            description=f"ops of a {args.dims} Llama block stage at {args.profile_seq_lens} tokens, bf16, "
                                        f"SDPA, measured on {info.device} (torch {torch.__version__})")
    path = work / f"{name}.json"
    prof.save(path)
    cv = cross_validate(list(prof.measurements.values()), prof.base)
    return {"name": name, "path": str(path), "measurements": len(prof.measurements), "runs": runs,
            "cross_validated_error": cv}


def section_stages(device: torch.device, args, profile_path: str | None) -> dict:
    from fxpipe.cost.hardware import get_hardware
    from fxpipe.cost.measure import base_hardware, device_info
    from fxpipe.passes.capture import capture

    sheet = base_hardware(device_info(str(device), None))
    specs = {"datasheet": sheet}
    if sheet.name.endswith("-datasheet"):
        specs["achieved"] = get_hardware(sheet.name[: -len("-datasheet")])
    if profile_path:
        specs["profile"] = get_hardware(profile_path)
    res = {"specs": {k: v.name for k, v in specs.items()}, "stages": {}}
    for layers in args.stage_layers:
        row: dict = {}
        res["stages"][str(layers)] = row
        stage_meta, embeds_meta = build_stage(args.dims, layers, args.stage_seq_len, args.smoke, "meta")
        row["predicted"] = predicted_fbw(stage_meta, embeds_meta, specs)
        stage, embeds = build_stage(args.dims, layers, args.stage_seq_len, args.smoke, str(device))
        params = list(stage.parameters())
        gm = capture(stage, (embeds,), replicate="never").gm  # what fxpipe's runtime runs
        gparams = list(gm.parameters())
        row["measured_graph"] = time_fbw(gm, embeds, gparams, device, args.repeats, args.warmup)
        row["measured_eager"] = time_fbw(stage, embeds, params, device, args.repeats, args.warmup)
        try:
            row["saved_bytes_graph"] = saved_bytes(gm, embeds, gparams)
        except Exception as exc:  # noqa: BLE001 - the timings stand without it
            row["saved_bytes_graph"] = None
            row["saved_error"] = f"{type(exc).__name__}: {exc}"
        meas = row["measured_graph"]
        tot = meas["F_s"] + meas["B_s"] + meas["W_s"]
        row["error"] = {}
        for name, p in row["predicted"].items():
            ptot = p["F_s"] + p["B_s"] + p["W_s"]
            row["error"][name] = {"F": p["F_s"] / meas["F_s"] - 1, "B": p["B_s"] / max(meas["B_s"], 1e-12) - 1,
                                  "W": p["W_s"] / max(meas["W_s"], 1e-12) - 1, "FBW": ptot / tot - 1,
                                  "stash_over_saved": (p["stash_bytes"] / row["saved_bytes_graph"]
                                                       if row["saved_bytes_graph"] else None)}
        del stage, gm, params, gparams
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def section_ship(doc: dict, args) -> dict:
    prof, stages = doc.get("profile", {}), doc.get("stages", {}).get("stages", {})
    if "path" not in prof:
        return {"shipped": False, "why": "no profile (the profile section failed)"}
    errs = {k: v.get("error", {}).get("profile", {}).get("FBW") for k, v in stages.items()}
    ok = bool(errs) and all(e is not None and abs(e) <= args.ship_tolerance for e in errs.values())
    out = {"stage_fbw_errors": errs, "tolerance": args.ship_tolerance, "shipped": False}
    if args.profile_out:
        Path(args.profile_out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(prof["path"], args.profile_out)
        out["copied_to"] = args.profile_out
    if not ok:
        out["why"] = f"a stage's F+B+W prediction by the profile is off by more than {args.ship_tolerance:.0%} (or missing)"
    elif args.smoke or args.no_ship:
        out["why"] = "--smoke / --no-ship: would ship, not written into the package"
        out["would_ship"] = True
    else:
        dest = REPO / "fxpipe" / "cost" / "profiles" / f"{prof['name']}.json"
        shutil.copyfile(prof["path"], dest)
        out.update(shipped=True, path=str(dest), use=f"hardware='profile:{prof['name']}'")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="llama-3-8b", choices=sorted(DIMS))
    ap.add_argument("--profile-seq-lens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--stage-layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stage-seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ship-tolerance", type=float, default=0.10)
    ap.add_argument("--no-ship", action="store_true", help="never write the profile into the package")
    ap.add_argument("--profile-out", default=None, help="copy the profile here as well (e.g. $OUT/h100-sxm.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, in seconds (checks the script)")
    ap.add_argument("--out", default=None, help="the JSON document")
    ap.add_argument("--skip", nargs="*", default=[], choices=["device", "profile", "stages", "saved", "ship"])
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.profile_seq_lens = [32]
        args.stage_layers, args.stage_seq_len, args.repeats, args.warmup = [1, 2], 32, 2, 1
    from fxpipe.cost.measure import base_hardware, device_info

    spec = base_hardware(device_info(str(device), None))
    doc: dict = {"format": "fxpipe.gpu-calibration/1", "torch": torch.__version__, "device": str(device),
                 "spec": spec.name, "dims": args.dims, "smoke": args.smoke, "argv": sys.argv[1:],
                 "section_wall_s": {}}
    if device.type == "cuda":
        doc["device_name"] = torch.cuda.get_device_name(device)
    work = Path(tempfile.mkdtemp(prefix="fxpipe_calibrate_"))
    t_start = time.perf_counter()

    def run(name, fn):
        run_section(doc, name, fn, skip=args.skip, out=args.out, max_print=4000)

    run("device", lambda: section_device(device, spec, args.smoke))
    run("profile", lambda: section_profile(device, args, work))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run("stages", lambda: section_stages(device, args, doc.get("profile", {}).get("path")))
    run("saved", lambda: {k: {"saved_bytes_graph": v.get("saved_bytes_graph"),
                              **{f"{s}_stash_over_saved": e.get("stash_over_saved") for s, e in v.get("error", {}).items()}}
                          for k, v in doc.get("stages", {}).get("stages", {}).items()})
    run("ship", lambda: section_ship(doc, args))
    doc["wall_s"] = time.perf_counter() - t_start
    if args.out:
        from fxpipe.io import write_text_atomic

        write_text_atomic(args.out, json.dumps(doc, indent=1, default=str) + "\n")
    print(f"total {doc['wall_s']:.1f} s; profile shipped: {doc.get('ship', {}).get('shipped')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
