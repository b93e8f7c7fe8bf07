"""Partitioner benchmark: SliceGraph decode, cold start, Python baseline, BRKGA.

Run:  python3 benchmarks/bench_partition.py [--quick]

Prints each figure next to its target and (where there is one) a baseline measured in the
same run. The machine is shared, so timings are noisy: medians of several repetitions.

Figures
-------
1. One decode (Kahn + SliceGraph DP, no incumbent) on a synthetic 2,000-op transformer-like
   OpGraph, k=16 (target <= 20 ms).
   [1m] The same with a binding memory capacity (training, fxpipe.memory's model, 1F1B in-flight rule).
2. The same on a 20,000-op graph, k=64 (target <= 2 s).
3. First call in a fresh process with the numba cache warm (import + first decode; target
   <= 2 s), measured in a subprocess.
4. Speed-up over a straightforward Python implementation of Archer et al. Algorithms 1 and
   4-5 (n x n io table with numpy rectangle updates, then the O(n^2 k) DP in Python) on the
   same 500-op graph.
5. BRKGA with 10^4 evaluations (population 100; elites are not re-decoded, so 10^4 decodes
   take 124 generations) on a 200-op graph (target
   <= 10 s); baselines: the same 10^4 decodes one at a time on one thread, and the best of
   10^4 random orders (quality).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxpipe.ir import OpGraph  # noqa: E402
from fxpipe.partition.brkga import BRKGAParams, PopulationDecoder, run_brkga  # noqa: E402
from fxpipe.memory import MemoryModel  # noqa: E402
from fxpipe.partition.memory import PartitionMemory, stage_memory_bytes  # noqa: E402
from fxpipe.partition.orders import kahn_kernel, node_classes  # noqa: E402
from fxpipe.partition.slicegraph import kernel_inputs, slice_kernel  # noqa: E402

# one transformer layer: (name, preds as offsets into this layer's list or "in"/"res")
_LAYER = [
    ("ln1", ["in"]), ("q", [0]), ("k", [0]), ("v", [0]), ("view_q", [1]), ("view_k", [2]), ("view_v", [3]),
    ("qk", [4, 5]), ("scale", [7]), ("softmax", [8]), ("dropout", [9]), ("av", [10, 6]), ("view_o", [11]),
    ("proj", [12]), ("add1", [13, "in"]), ("ln2", [14]), ("fc1", [15]), ("gelu", [16]), ("fc2", [17]), ("add2", [18, 14]),
]


def transformer_like(n_target: int, seed: int = 0, hidden: int = 1024, seq: int = 512) -> OpGraph:
    """Synthetic transformer-like OpGraph with at least ``n_target`` ops (20 per layer + 4).

    Layers are chains LayerNorm -> q/k/v -> attention -> projection -> residual add ->
    LayerNorm -> MLP -> residual add, with the residual skip edges of a pre-LN transformer.
    """
    rng = np.random.default_rng(seed)
    layers = max(1, math.ceil((n_target - 4) / len(_LAYER)))
    names, ops, edges = ["input_ids"], ["placeholder"], []
    prev = len(names)
    names.append("embed")
    ops.append("call_module")
    edges.append([0, prev])
    for i in range(layers):
        base = len(names)
        for j, (nm, preds) in enumerate(_LAYER):
            names.append(f"l{i}.{nm}")
            ops.append("call_function")
            for p in preds:
                edges.append([prev if p == "in" else base + p, base + j])
        prev = base + len(_LAYER) - 1
    names.append("lm_head")
    ops.append("call_module")
    edges.append([prev, len(names) - 1])
    names.append("output")
    ops.append("output")
    edges.append([len(names) - 2, len(names) - 1])
    n = len(names)
    act = 2.0 * seq * hidden  # bf16 activation of one token block
    heavy = np.array(["q" in s or "k" in s or "v" in s or "proj" in s or "fc" in s for s in names])
    t_fwd = np.where(heavy, 2e-4, 2e-5) * rng.uniform(0.8, 1.2, n)
    size_out = np.where(np.char.find(np.array(names), "fc1") >= 0, 4 * act, act) * rng.uniform(0.9, 1.1, n)
    params = np.where(heavy, 2.0 * hidden * hidden, 0.0)
    return OpGraph.from_arrays(
        t_fwd_s=t_fwd, t_bwd_input_s=t_fwd, t_bwd_weight_s=np.where(heavy, t_fwd, 0.0), size_out_bytes=np.round(size_out),
        size_param_bytes=params, act_bytes=np.round(size_out), edges=edges, names=names, ops=ops,
        bandwidth_bytes_per_s=5e10, name=f"transformer-like-{n}",
    )


def decode_once(graph: OpGraph, k: int, keys: np.ndarray, inputs, cls) -> float:
    base, mem = inputs
    order = kahn_kernel(keys, cls, base[0], base[1], base[2])
    best, _ = slice_kernel(order, *base, math.inf, *mem)
    return best


def time_decode(graph: OpGraph, k: int, reps: int, objective: str = "inference", memory=None) -> tuple[float, float]:
    inputs = kernel_inputs(graph, k, objective, "dag", memory)
    cls = node_classes(graph)
    keys = np.random.default_rng(1).random(graph.n)
    decode_once(graph, k, keys, inputs, cls)  # compile / load cache
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        val = decode_once(graph, k, keys, inputs, cls)
        times.append(time.perf_counter() - t)
    return statistics.median(times), val


# ---------------------------------------------------------------- Python baseline (Archer Alg. 1, 4-5)


def python_slicegraph(graph: OpGraph, order: np.ndarray, k: int) -> float:
    """Archer Algorithm 4-5 io table (numpy rectangle updates) + Algorithm 1 DP in Python (inference, dag)."""
    n = graph.n
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    io = np.full((n, n), float(graph.size_out_bytes.sum()))
    for u in range(n):
        q = sorted([int(pos[u])] + [int(pos[v]) for v in graph.successors(u)])
        s = graph.size_out_bytes[u]
        io[: q[0], : q[0]] -= s  # segments before every endpoint
        for a, b in zip(q, q[1:]):
            io[a + 1 : b, a + 1 : b] -= s  # segments strictly between two endpoints
        io[q[-1] + 1 :, q[-1] + 1 :] -= s  # segments after every endpoint
        io[: q[0] + 1, q[-1] :] -= s  # segments containing all endpoints
    work = np.concatenate([[0.0], np.cumsum(graph.t_fwd_s[order])])
    B = graph.bandwidth_bytes_per_s

    def cost(l, r):  # inclusive, 0-based
        return work[r + 1] - work[l] + io[l, r] / B

    iol = io.tolist()
    wl = work.tolist()
    prev = [wl[r + 1] + iol[0][r] / B for r in range(n)]  # one block
    best = prev[-1]
    for _ in range(2, k + 1):
        cur = [math.inf] * n
        for r in range(n):
            ans = math.inf
            row_r = wl[r + 1]
            for l in range(1, r + 1):
                a = prev[l - 1]
                if a >= ans:
                    continue
                b = row_r - wl[l] + iol[l][r] / B
                v = a if a > b else b
                if v < ans:
                    ans = v
            cur[r] = min(ans, prev[r])
        prev = cur
        best = min(best, prev[-1])
    return best


def cold_start(n: int, k: int) -> float:
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import numpy as np, math, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from bench_partition import transformer_like, decode_once\n"
        "from fxpipe.partition.orders import node_classes\n"
        "from fxpipe.partition.slicegraph import kernel_inputs\n"
        f"g = transformer_like({n}); t1 = time.perf_counter()\n"
        f"decode_once(g, {k}, np.random.default_rng(0).random(g.n), kernel_inputs(g, {k}, 'inference', 'dag'), node_classes(g))\n"
        "t2 = time.perf_counter(); print(t2 - t0 - (t1 - t0) + 0.0, t1 - t0)\n"
    )
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return time.perf_counter() - t, float(out[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    reps = 3 if args.quick else 10
    print(f"numba threads: {__import__('numba').config.NUMBA_NUM_THREADS}; shared machine, timings are noisy (medians)")

    g2k = transformer_like(2000)
    t, val = time_decode(g2k, 16, reps)
    print(f"[1] decode (Kahn + DP), {g2k.n} ops, k=16: {t * 1e3:.2f} ms (target <= 20 ms); bottleneck {val * 1e3:.3f} ms")

    base, mem = kernel_inputs(g2k, 16, "training", "dag")
    order = kahn_kernel(np.random.default_rng(1).random(g2k.n), node_classes(g2k), base[0], base[1], base[2])
    free_val, cuts = slice_kernel(order, *base, math.inf, *mem)
    a = np.empty(g2k.n, dtype=np.int64)
    for b in range(16):
        a[order[cuts[b]:cuts[b + 1]]] = b
    rule = PartitionMemory(MemoryModel(reserved_fraction=0.0), num_microbatches=16, activation="1f1b")
    cap = 0.8 * stage_memory_bytes(g2k, a, 16, "training", rule, "dag").max()
    t, val = time_decode(g2k, 16, reps, "training",
                        PartitionMemory(MemoryModel(capacity_bytes=cap, reserved_fraction=0.0), num_microbatches=16, activation="1f1b"))
    print(f"[1m] memory-aware decode, {g2k.n} ops, k=16, training, capacity 0.8 x the unconstrained slicing's peak "
          f"({cap / 2**30:.2f} GiB): {t * 1e3:.2f} ms; bottleneck {val * 1e3:.3f} ms vs {free_val * 1e3:.3f} ms unconstrained")

    g20k = transformer_like(20000)
    t, val = time_decode(g20k, 64, max(2, reps // 3))
    print(f"[2] decode (Kahn + DP), {g20k.n} ops, k=64: {t:.3f} s (target <= 2 s); bottleneck {val * 1e3:.3f} ms")

    total, first = cold_start(2000, 16)
    print(f"[3] fresh process, numba cache warm: first decode {first:.3f} s after import (target <= 2 s); whole process incl. imports {total:.2f} s")

    g500 = transformer_like(500)
    inputs = kernel_inputs(g500, 16, "inference", "dag")
    cls = node_classes(g500)
    keys = np.random.default_rng(2).random(g500.n)
    base = inputs[0]
    order = kahn_kernel(keys, cls, base[0], base[1], base[2])
    t = time.perf_counter()
    py_val = python_slicegraph(g500, order, 16)
    t_py = time.perf_counter() - t
    t_nb, nb_val = time_decode(g500, 16, reps)
    nb_val = slice_kernel(order, *base, math.inf, *inputs[1])[0]
    agree = abs(py_val - nb_val) <= 1e-9 * py_val
    print(f"[4] {g500.n} ops, k=16: Python Alg. 1+4 {t_py:.2f} s vs kernel decode {t_nb * 1e3:.3f} ms: "
          f"speed-up {t_py / t_nb:,.0f}x (same optimum: {agree}, {py_val * 1e3:.4f} vs {nb_val * 1e3:.4f} ms)")

    g200 = transformer_like(180)
    for k in (8,):
        dec = PopulationDecoder(g200, k, "training", "relay")
        dec(np.random.default_rng(0).random((2, g200.n)))  # compile / load cache
        t = time.perf_counter()
        res = run_brkga(dec, BRKGAParams(population=100, max_generations=None, max_evaluations=10_000), seed=0)
        t_brkga = time.perf_counter() - t
        # baseline: 10^4 random orders, decoded one at a time on one thread, no incumbent
        inputs = kernel_inputs(g200, k, "training", "relay")
        cls = node_classes(g200)
        rng = np.random.default_rng(0)
        n_rand = res.evaluations
        t = time.perf_counter()
        best_rand = min(decode_once(g200, k, rng.random(g200.n), inputs, cls) for _ in range(n_rand))
        t_serial = time.perf_counter() - t
        print(f"[5] BRKGA {res.evaluations} evaluations (population 100, {res.generations} generations), {g200.n} ops, k={k}, training/relay: "
              f"{t_brkga:.2f} s (target <= 10 s), best {res.best_fitness * 1e3:.4f} ms; baseline {n_rand} random orders "
              f"decoded serially: {t_serial:.2f} s, best {best_rand * 1e3:.4f} ms")


if __name__ == "__main__":
    main()
