"""Running ops for the profiler: inputs of recorded shapes, the graph-mode and isolated runs.

Graph mode (:func:`run_graph_mode`) executes the whole captured graph node by node on fresh
random weights, timing every op where it runs; each op's activation inputs are cut from their
producers (:func:`_cut`) so that its B and W are timed on its own autograd graph. Isolated mode
(:func:`run_isolated_mode`) times each op signature alone on tensors of its recorded shapes,
dtypes and strides (:func:`_materialise`). See :func:`fxpipe.cost.profile.profile_graph`.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from fxpipe.cost.database import CostDatabase, DeviceInfo, Measurement
from fxpipe.cost.signature import cost_of, input_role, op_class_of, param_source, phases_of
from fxpipe.cost.specs import HardwareSpec
from fxpipe.cost.timers import median_spread
from fxpipe.passes.capture import _to_int, getattr_path

__all__ = ["run_graph_mode", "run_isolated_mode"]


@dataclass
class _Inputs:
    args: tuple
    kwargs: dict
    b_leaves: list
    w_leaves: list


def _fill(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype, device=device).add_(0.5)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) < 0.5
    return torch.zeros(shape, dtype=dtype, device=device)


def _random_like(val: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:

    dt = dtype if (dtype is not None and val.dtype.is_floating_point) else val.dtype
    shape = [_to_int(s) for s in val.shape]
    try:
        contiguous = bool(val.is_contiguous())
        stride = [_to_int(s) for s in val.stride()]
    except Exception:  # noqa: BLE001
        contiguous, stride = True, []
    if contiguous or any(s == 0 for s in shape):
        return _fill(shape, dt, device)
    need = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
    return _fill([need], dt, device).as_strided(shape, stride)


def _materialise(node: torch.fx.Node, device: torch.device, dtype: torch.dtype | None,
                 known: Mapping[torch.fx.Node, torch.Tensor]) -> _Inputs:

    made: dict[torch.fx.Node, Any] = {}
    b_leaves: list[torch.Tensor] = []
    w_leaves: list[torch.Tensor] = []
    root = node.graph.owning_module

    def value(val: Any, inp: torch.fx.Node) -> Any:
        if isinstance(val, torch.Tensor):
            real = known.get(inp)
            if real is None and inp.op == "get_attr" and root is not None:
                obj = getattr_path(root, inp.target)
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and not obj.dtype.is_floating_point:
                    real = obj
            if real is not None and tuple(real.shape) == tuple(_to_int(s) for s in val.shape):
                return real.detach().to(device).clone()
            return _random_like(val, dtype, device)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _to_int(val) if isinstance(val, torch.SymInt) else val.node.hint
        if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
            return type(val)(value(v, inp) for v in val) if isinstance(val, tuple) else [value(v, inp) for v in val]
        return val

    def make(inp: torch.fx.Node) -> Any:
        if inp in made:
            return made[inp]
        v = value(inp.meta.get("val"), inp)
        role = input_role(inp)
        if role and isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
            v = v.detach().requires_grad_(True)
            (w_leaves if role == "w" else b_leaves).append(v)
        made[inp] = v
        return v

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), make)
    args, kwargs = _fix_args((args, kwargs), device, dtype)
    return _Inputs(tuple(args), dict(kwargs), b_leaves, w_leaves)


def _grad_outputs(node: torch.fx.Node, out: Any) -> list[torch.Tensor]:
    """The op's outputs that receive a gradient in this graph."""
    def ok(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)

    if isinstance(out, torch.Tensor):
        return [out] if ok(out) else []
    if isinstance(out, (list, tuple)):
        idx = set()
        direct = False
        for u in node.users:
            c = cost_of(u)
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
                if c is not None and c.requires_grad:
                    idx.add(u.args[1])
            else:
                direct = True
        picked = [out[i] for i in sorted(idx) if i < len(out)] if not direct else list(out)
        return [t for t in picked if ok(t)]
    return []


def _integer_values(gm: torch.fx.GraphModule, example_inputs: tuple[Sequence[Any], Mapping[str, Any]] | None
                    ) -> dict[torch.fx.Node, torch.Tensor]:
    """Integer / bool values of every node, from one forward of ``gm`` on the example inputs.

    Empty when the model has no real weights (``meta``), no example inputs are given, or
    the inputs do not map one-to-one onto the graph's placeholders.
    """
    if example_inputs is None:
        return {}
    args, kwargs = example_inputs
    flat = list(args) + list((kwargs or {}).values())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders) or not all(isinstance(x, torch.Tensor) for x in flat):
        return {}
    if any(x.device.type == "meta" for x in flat) or any(p.device.type == "meta" for p in gm.parameters()) \
            or any(b.device.type == "meta" for b in gm.buffers()):
        return {}
    vals: dict[torch.fx.Node, torch.Tensor] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n):  # noqa: D401 - fx API
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and not (out.dtype.is_floating_point or out.dtype.is_complex):
                vals[n] = out
            return out

    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat, enable_io_processing=False)
    except Exception:  # noqa: BLE001 - fall back to zero indices; the profile is still valid
        return {}
    return vals


def _measure_node(node: torch.fx.Node, op: str, args_sig: str, *, device: torch.device, dtype: torch.dtype | None,
                  known: Mapping[torch.fx.Node, torch.Tensor], timer: Callable[..., list[float]], base: HardwareSpec,
                  call_overhead_s: float, node_floor_s: float, opts: dict) -> Measurement:
    c = cost_of(node)
    assert c is not None
    feats = dict(op=op, args=args_sig, op_class=op_class_of(node), kind=c.kind, flops=float(c.flops), bytes=float(c.bytes),
                 dtype=c.dtype, roofline_spec=base.name, roofline_s=(c.t_fwd_s, c.t_bwd_input_s, c.t_bwd_weight_s),
                 method="isolated")
    needs = phases_of(node)
    try:
        inp = _materialise(node, device, dtype, known)
        fn = node.target

        def fwd():
            return fn(*inp.args, **inp.kwargs)

        spreads = []
        ft = timer(fwd, **opts)
        t_f, sp = median_spread(ft)
        spreads.append(sp)
        t_b = t_w = 0.0
        reps = len(ft)
        if needs[1] or needs[2]:
            out = fwd()
            outs = _grad_outputs(node, out)
            grads = [torch.rand_like(o) for o in outs]
            for want, leaves, slot in ((needs[1], inp.b_leaves, "b"), (needs[2], inp.w_leaves, "w")):
                if not (want and leaves and outs):
                    continue
                ts = timer(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True), **opts)
                raw, sp = median_spread(ts)
                spreads.append(sp)
                # one autograd call per stage for B, one per parameter group for W (see module doc)
                t = max(raw - call_overhead_s, node_floor_s, 1e-9) if slot == "b" else max(raw, 1e-9)
                if slot == "b":
                    t_b = t
                else:
                    t_w = t
            del out, outs, grads
        return Measurement(t_fwd_s=t_f, t_bwd_input_s=t_b, t_bwd_weight_s=t_w, repeats=reps, spread=max(spreads), **feats)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - any op may fail on random inputs; record why
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return Measurement(error=msg or type(exc).__name__, **feats)


def _param_node(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``get_attr`` node of the parameter behind ``node`` (itself or a shape-only view chain)."""
    if param_source(node) is None:
        return None
    while node.op != "get_attr":
        node = node.all_input_nodes[0]
    return node


def _fix_args(x: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``x`` (args / kwargs of a node) with devices set to ``device``, floating dtypes to
    ``dtype`` (when given) and symbolic ints made concrete."""

    def fix(v: Any) -> Any:
        if isinstance(v, torch.device):
            return device
        if isinstance(v, torch.dtype) and dtype is not None and v.is_floating_point:
            return dtype
        if isinstance(v, torch.SymInt):
            return _to_int(v)
        return v

    return torch.fx.node.map_aggregate(x, fix)


def _body_on(body: torch.fx.GraphModule, device: torch.device, dtype: torch.dtype | None) -> torch.fx.GraphModule:
    """A copy of a higher-order op's body (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``, ``cond``
    branches: graphs the op's node reaches through a ``get_attr``) whose nodes, nested bodies included, read
    devices, dtypes and sizes as :func:`_fix_args` makes them for the top-level nodes. A capture on ``meta``
    records ``device=meta`` in its bodies too (``_assert_tensor_metadata``, ``to``, factories), which would fail
    on the profiling device, inside a ``no_grad`` body that then never turns gradients back on."""
    import copy

    out = copy.deepcopy(body)
    for sub in out.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                node.args, node.kwargs = _fix_args((node.args, node.kwargs), device, dtype)
            sub.recompile()
    return out


def _graph_values(gm: torch.fx.GraphModule, device: torch.device, dtype: torch.dtype | None,
                  example_inputs: tuple[Sequence[Any], Mapping[str, Any]] | None) -> dict[torch.fx.Node, Any]:
    """Values of the placeholders and ``get_attr`` nodes for a graph-mode run.

    Parameters become fresh leaves of the same shape (uniform values, ``requires_grad`` as the
    parameter; never the model's own tensors, whose ``.grad`` must not change); integer and
    bool buffers keep their real values when the model has them; placeholders take the example
    inputs when they are real and match the placeholders one to one, else random tensors of the
    recorded shapes (zeros for integers). Higher-order ops' bodies become copies on ``device``
    (:func:`_body_on`).
    """

    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat: list[Any] | None = None
    if example_inputs is not None:
        args, kwargs = example_inputs
        cand = list(args) + list((kwargs or {}).values())
        if len(cand) == len(placeholders) and all(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in cand):
            flat = cand
    for i, n in enumerate(placeholders):
        val = n.meta.get("val")
        if flat is not None:
            x = flat[i].detach().to(device)
            env[n] = x.to(dtype) if (dtype is not None and x.dtype.is_floating_point) else x
        elif isinstance(val, torch.Tensor):
            env[n] = _random_like(val, dtype, device)
        else:
            env[n] = _materialise_value(val, dtype, device)
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        obj = getattr_path(gm, n.target)
        if isinstance(obj, torch.Tensor):
            if not (obj.dtype.is_floating_point or obj.dtype.is_complex) and obj.device.type != "meta":
                env[n] = obj.detach().to(device).clone()
            else:
                t = _random_like(obj, dtype, device)
                if isinstance(obj, torch.nn.Parameter) and obj.requires_grad:
                    t = t.detach().requires_grad_(True)
                env[n] = t
        elif isinstance(obj, torch.fx.GraphModule):
            env[n] = _body_on(obj, device, dtype)
        else:
            env[n] = obj
    return env


def _materialise_value(val: Any, dtype: torch.dtype | None, device: torch.device) -> Any:

    if isinstance(val, torch.Tensor):
        return _random_like(val, dtype, device)
    if isinstance(val, torch.SymInt):
        return _to_int(val)
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        return val.node.hint
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        items = [_materialise_value(v, dtype, device) for v in val]
        return tuple(items) if isinstance(val, tuple) else items
    return val


def _cut(value: Any, role: str) -> Any:
    """An activation input as a fresh autograd leaf (``requires_grad`` iff it needs a gradient).

    Each op then has an autograd graph of its own: ``torch.autograd.grad`` walks every node
    reachable from its outputs (``Engine::compute_dependencies``), so without the cut a B/W
    measurement late in the graph would pay for the whole upstream graph.
    """
    if isinstance(value, torch.Tensor):
        if not (value.requires_grad or value.grad_fn is not None):
            return value
        v = value.detach()
        return v.requires_grad_(True) if role == "g" and (v.dtype.is_floating_point or v.dtype.is_complex) else v
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_cut(x, role) for x in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: Mapping[torch.fx.Node, Any], device: torch.device,
              dtype: torch.dtype | None, inputs: dict | None = None) -> Callable[[], Any]:
    """A no-argument callable that runs ``node`` on the values in ``env``.

    With ``inputs`` (a dict), activation inputs are cut from their producers (:func:`_cut`),
    weights (and views of them) stay attached to the weight leaves; ``inputs`` receives the
    node's input values by input node.
    """
    def get(n: torch.fx.Node) -> Any:
        if inputs is None:
            return env[n]
        if n not in inputs:
            inputs[n] = env[n] if _param_node(n) is not None else _cut(env[n], input_role(n))
        return inputs[n]

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), get)
    args, kwargs = _fix_args((args, kwargs), device, dtype)
    if node.op == "call_function":
        fn = node.target
        return lambda: fn(*args, **kwargs)
    if node.op == "call_method":
        return lambda: getattr(args[0], node.target)(*args[1:], **kwargs)
    mod = gm.get_submodule(node.target)
    return lambda: mod(*args, **kwargs)


def run_graph_mode(gm: torch.fx.GraphModule, todo: Mapping[str, Any], keys: Mapping[str, str], *, device: torch.device,
                dtype: torch.dtype | None, example_inputs, stopwatch, warmup: int, min_repeats: int, max_repeats: int,
                min_time_s: float, call_s: float, node_s: float, base: HardwareSpec, clock: str = "wall",
                progress: bool = False) -> tuple[list[Measurement], bool]:
    """Run the whole graph forward and backward ``warmup + R`` times, timing every op.

    Returns the measurements of the keys in ``todo`` and whether Ctrl-C stopped the runs.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    want = {n for n in nodes if keys.get(n.name) in todo}
    plan_b: dict[torch.fx.Node, tuple[list, list]] = {}
    for n in want:
        c = cost_of(n)
        f, nb, nw = phases_of(n)
        if c is not None and c.kind == "shape":
            nw = False  # a view of a weight: its gradient is part of the consumer's W
        if not (nb or nw):
            continue
        ins = list(dict.fromkeys(n.all_input_nodes))
        b_in = [i for i in ins if input_role(i) == "g"] if nb else []
        w_in = list(dict.fromkeys(p for p in (_param_node(i) for i in ins if input_role(i) == "w") if p is not None)) if nw else []
        plan_b[n] = (b_in, w_in)
    samples: dict[str, list[list[float]]] = {k: [[], [], []] for k in todo}
    errors: dict[str, str] = {}
    grad_cache: dict[torch.fx.Node, list[torch.Tensor]] = {}
    base_env = _graph_values(gm, device, dtype, example_inputs)
    sw = stopwatch
    interrupted = False

    def err(key: str, exc: BaseException) -> None:
        errors.setdefault(key, " ".join(f"{type(exc).__name__}: {exc}".split())[:300])

    grad_mode = torch.is_grad_enabled()

    def one_rep(record: bool) -> None:
        torch.set_grad_enabled(grad_mode)
        env = dict(base_env)
        for p in base_env.values():
            if isinstance(p, torch.Tensor) and p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # W accumulates into .grad, as every micro-batch after the first
        fwd: list[tuple[str, Any]] = []
        ins: dict[torch.fx.Node, dict] = {}
        for n in nodes:
            try:
                ins[n] = {}
                call = _run_node(gm, n, env, device, dtype, ins[n])
                h = sw.start()
                out = call()
                t = sw.stop(h)
            except Exception as exc:  # noqa: BLE001 - keep the data flow going with a stand-in value
                # an op failing inside a no_grad body (wrap_with_set_grad_enabled) leaves gradients off:
                # every later op would run without autograd and measure B = W = 0
                torch.set_grad_enabled(grad_mode)
                if n.name in keys:
                    err(keys[n.name], exc)
                out, t = _materialise_value(n.meta.get("val"), dtype, device), None
            env[n] = out
            if record and t is not None and n in want:
                fwd.append((keys[n.name], t))
        bwd: list[tuple[str, int, Any]] = []
        for n in reversed(nodes):
            if n not in plan_b:
                continue
            key = keys[n.name]
            b_in, w_in = plan_b[n]
            try:
                outs = _grad_outputs(n, env[n])
                if not outs:
                    continue
                grads = grad_cache.get(n)
                if grads is None or len(grads) != len(outs):
                    grads = grad_cache[n] = [torch.rand_like(o) for o in outs]
                bt = [x for x in (ins[n].get(i) for i in b_in) if isinstance(x, torch.Tensor) and x.requires_grad]
                if bt:
                    h = sw.start()
                    torch.autograd.grad(outs, bt, grads, retain_graph=True, allow_unused=True)
                    bwd.append((key, 1, sw.stop(h)))
                wt = [env[i] for i in w_in if isinstance(env[i], torch.Tensor) and env[i].requires_grad]
                if wt:
                    h = sw.start()
                    torch.autograd.backward(outs, grads, inputs=wt, retain_graph=True)
                    bwd.append((key, 2, sw.stop(h)))
            except Exception as exc:  # noqa: BLE001
                err(key, exc)
        sw.synchronize()
        ins.clear()
        if record:
            for key, h in fwd:
                samples[key][0].append(sw.seconds(h))
            for key, p, h in bwd:
                t = sw.seconds(h)
                # one autograd call per stage for B, one per parameter group for W (see module doc)
                samples[key][p].append(max(t - call_s, node_s, 1e-9) if p == 1 else max(t, 1e-9))
        del env

    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            one_rep(False)
        rep_s = (time.perf_counter() - t0) / max(warmup, 1)
        reps = int(min(max_repeats, max(min_repeats, round(min_time_s / max(rep_s, 1e-9)))))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=reps, desc=f"profiling {len(todo)} ops (graph runs)", unit="run")
        try:
            for _ in range(reps):
                one_rep(True)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        torch.set_grad_enabled(grad_mode)
        if enabled:
            gc.enable()
    out = []
    for key, node in todo.items():
        c = cost_of(node)
        feats = dict(op=key.split("(", 1)[0], args=key[key.index("(") + 1:-1], op_class=op_class_of(node), kind=c.kind,
                     flops=float(c.flops), bytes=float(c.bytes), dtype=c.dtype, roofline_spec=base.name,
                     roofline_s=(c.t_fwd_s, c.t_bwd_input_s, c.t_bwd_weight_s), method="graph", clock=clock)
        f, b, w = samples[key]
        if key in errors or not f:
            if not interrupted or key in errors:
                out.append(Measurement(error=errors.get(key, "not run"), **feats))
            continue
        stats = [median_spread(x) if x else (0.0, 0.0) for x in (f, b, w)]
        out.append(Measurement(t_fwd_s=stats[0][0], t_bwd_input_s=stats[1][0], t_bwd_weight_s=stats[2][0], repeats=len(f),
                               spread=max(sp for _, sp in stats), **feats))
    return out, interrupted


def run_isolated_mode(db: CostDatabase, info: DeviceInfo, todo: Mapping[str, torch.fx.Node], *, device: torch.device,
                   dtype: torch.dtype | None, example_inputs, timer, base: HardwareSpec, call_s: float, node_s: float,
                   progress: bool, opts: dict, clock: str = "wall") -> tuple[int, bool]:
    gm, ex = example_inputs
    known = _integer_values(gm, ex)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="profiling ops", unit="op")
    done = 0
    try:
        for key, node in todo.items():
            op, args_sig = key.split("(", 1)[0], key[key.index("(") + 1:-1]
            m = _measure_node(node, op, args_sig, device=device, dtype=dtype, known=known, timer=timer, base=base,
                              call_overhead_s=call_s, node_floor_s=node_s, opts=opts)
            db.put(info, dataclasses.replace(m, clock=clock))
            done += 1
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        return done, True
    finally:
        if bar is not None:
            bar.close()
    return done, False
