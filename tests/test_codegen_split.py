"""Single-process tests of fxpipe.codegen: stage splitting, relays, order lowering, runtime build."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from fxpipe.codegen.actions import actions_from_orders, check_orders, format_actions, fuse_backward
from fxpipe.ir import Action, Orders
from fxpipe.codegen.rank import build_rank
from fxpipe.codegen.shapes import stage_io
from fxpipe.codegen.split import canonical_param_names, split_stages
from fxpipe.errors import InputError

from _codegen_models import (
    export_gm,
    make_batch_gpt2,
    make_gpt2,
    make_t5,
    orders_1f1b,
    orders_gpipe,
    orders_zbh1,
    stage_of_by_blocks,
    stage_of_by_fraction,
)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def _check_composition(gm, staged, inputs, target):
    """Composition of stage modules == gm, forward and gradients."""
    for p in gm.parameters():
        p.grad = None
    ref = gm(*inputs)
    torch.nn.functional.cross_entropy(ref.reshape(-1, ref.shape[-1]), target.reshape(-1)).backward()
    g_ref = _grads(gm)
    for p in gm.parameters():
        p.grad = None
    out = staged.run(*inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)).backward()
    g = _grads(gm)  # stage modules share gm's parameter objects
    assert set(g) == set(g_ref) and len(g) > 0
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-5, atol=1e-7, msg=k)


def _exported(make):
    """``(model, gm, one micro-batch)`` of the model ``make()`` builds under seed 0."""
    torch.manual_seed(0)
    model, ex = make()
    gm, mb = export_gm(model, ex)
    return model, gm, mb


@pytest.fixture(scope="module")
def gpt2():
    return _exported(make_gpt2)


@pytest.fixture(scope="module")
def t5():
    return _exported(make_t5)


def test_gpt2_four_stages_compose_and_tie(gpt2):
    model, gm, mb = gpt2
    staged = split_stages(gm, stage_of_by_blocks(gm, [1, 2, 3]), 4)
    assert staged.num_stages == 4
    # stage i forward takes exactly what stage i-1 returns
    for a, b in zip(staged.stages, staged.stages[1:]):
        assert a.output_names == b.input_names
    assert staged.stages[0].input_names == ("input_ids",)
    # tied wte / lm_head: one canonical name held by the first and the last stage
    canon = canonical_param_names(model)
    wte = canon["m.lm_head.weight"]
    assert wte == canon["m.transformer.wte.weight"]
    assert staged.shared_params == {wte: (0, 3)}
    # every parameter of the model is held by some stage
    held = set().union(*(s.param_fqns for s in staged.stages))
    assert held == set(dict(model.named_parameters()))
    assert sum(staged.param_bytes()) == sum(p.numel() * 4 for p in model.parameters()) + 64 * 32 * 4
    # the causal mask (bool) is relayed through the middle stages
    assert all(s.relayed_names for s in staged.stages[1:3])
    _, tgt = make_batch_gpt2(0)
    _check_composition(gm, staged, mb, tgt[: mb[0].shape[0]])
    text = staged.describe()
    assert "stage 3" in text and "shared parameters" in text


def test_gpt2_uneven_fraction_split(gpt2):
    _, gm, mb = gpt2
    staged = split_stages(gm, stage_of_by_fraction(gm, 3), 3)
    _, tgt = make_batch_gpt2(1)
    _check_composition(gm, staged, mb, tgt[: mb[0].shape[0]])


def test_empty_stage_only_relays(gpt2):
    _, gm, mb = gpt2
    staged = split_stages(gm, stage_of_by_blocks(gm, [2, 2]), 3)  # stage 1 gets no op
    s1 = staged.stages[1]
    assert s1.node_names == () and s1.param_fqns == ()
    assert s1.relayed_names == s1.input_names == s1.output_names
    _, tgt = make_batch_gpt2(2)
    _check_composition(gm, staged, mb, tgt[: mb[0].shape[0]])


def test_dynamic_shape_capture_recomputes_sizes():
    """With dynamic shapes the graph has SymInt sizes: they are recomputed per stage, never sent."""
    capture = pytest.importorskip("fxpipe.passes.capture").capture
    torch.manual_seed(0)
    model, ex = make_gpt2()
    gm = capture(model, (ex[0][:2],), dynamic=True).gm
    sym = [n.name for n in gm.graph.nodes if n.op == "call_function" and not isinstance(n.meta.get("val"), torch.Tensor)
           and n.users and "getitem" not in n.name]
    assert sym, "expected symbolic size nodes"
    staged = split_stages(gm, stage_of_by_blocks(gm, [1, 2, 3]), 4)
    crossing = set().union(*map(set, staged.boundary_names))
    assert not crossing & set(sym)
    for b in (2, 4):  # other batch sizes run through the same stage modules
        x = ex[0][:b]
        torch.testing.assert_close(staged.run(x), model(x), rtol=1e-5, atol=1e-6)


def test_t5_encoder_output_relayed(t5):
    model, gm, mb = t5
    staged = split_stages(gm, stage_of_by_blocks(gm, [1, 1000, 1001]), 4)
    # the encoder output is produced on stage 1 and consumed by both decoder blocks (stages 2, 3):
    # stage 2 relays it (a float tensor that needs a gradient)
    relayed = staged.stages[2].relayed_names
    assert relayed
    out1 = staged.stage_inputs(2, *mb)
    float_relays = [
        name for name, t in zip(staged.stages[2].input_names, out1)
        if name in relayed and t.is_floating_point() and t.requires_grad
    ]
    assert float_relays, relayed
    # decoder_input_ids (int64) crosses stage 0 -> 1 without gradient
    assert "decoder_input_ids" in staged.stages[1].input_names
    tgt = torch.randint(0, 64, mb[1].shape)
    _check_composition(gm, staged, mb, tgt)


class _Skip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 6)

    def forward(self, x, idx):
        h = torch.tanh(self.a(x))
        p, q = torch.split(h, 3, dim=-1)
        g = torch.tanh(self.b(h))
        y = self.c(g) + h + torch.cat([q, p], dim=-1)
        return y * (idx.unsqueeze(-1) + 1).float()


def _skip_graph():
    torch.manual_seed(3)
    m = _Skip()
    x = torch.randn(4, 6)
    idx = torch.arange(4)
    gm = torch.export.export(m, (x, idx), strict=False).module()
    return m, gm, (x, idx)


def _by_target(gm, pick):
    """Stage of each node via ``pick(node) -> stage``; placeholders 0, output last."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        out[n.name] = pick(n)
    return out


def test_skip_connection_relay_gradients():
    m, gm, (x, idx) = _skip_graph()
    names = [n.name for n in gm.graph.nodes if n.op != "get_attr"]
    # stage 0 up to tanh(a(x)), stage 1 = b + tanh, stage 2 = the rest; h skips stage 1,
    # split's getitems are assigned to stage 2 but must run with split (tuple value)
    first_b = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "linear" in n.name and n.name != "linear")
    k1 = names.index(first_b)
    tanh1 = [n for n in names if n.startswith("tanh")][1]
    k2 = names.index(tanh1) + 1
    split_node = next(n for n in gm.graph.nodes if n.op == "call_function" and "split" in str(n.target))
    stage_of = {}
    for i, name in enumerate(names):
        stage_of[name] = 0 if i < k1 else (1 if i < k2 else 2)
    stage_of[split_node.name] = 0
    for u in split_node.users:
        stage_of[u.name] = 2
    stage_of["x"] = stage_of["idx"] = 0
    staged = split_stages(gm, stage_of, 3)
    assert staged.stages[1].relayed_names, staged.describe()
    xs = x.clone().requires_grad_(True)
    ref = gm(xs, idx)
    ref.square().sum().backward()
    g_ref = _grads(gm)
    gx_ref = xs.grad.clone()
    for p in gm.parameters():
        p.grad = None
    xs.grad = None
    out = staged.run(xs, idx)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    for k, v in g_ref.items():
        torch.testing.assert_close(_grads(gm)[k], v, msg=k)
    torch.testing.assert_close(xs.grad, gx_ref)
    # stage outputs are fresh, contiguous, non-view tensors (torch detaches them after I)
    ins = staged.stage_inputs(2, x, idx)
    assert all(t.is_contiguous() and not t._is_view() for t in ins)


def test_bad_stage_maps():
    _, gm, _ = _skip_graph()
    base = {n.name: 0 for n in gm.graph.nodes if n.op != "get_attr"}
    out_name = next(n.name for n in gm.graph.nodes if n.op == "output")
    with pytest.raises(InputError, match="outside"):
        split_stages(gm, {**base, out_name: 5}, 2)
    with pytest.raises(InputError, match="last stage"):
        split_stages(gm, base, 2)
    with pytest.raises(InputError, match="placeholder"):
        split_stages(gm, {**base, "x": 1, out_name: 1}, 2)
    # non-monotone: the first linear on stage 1, its consumer tanh on stage 0
    lin = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "linear" in n.name)
    with pytest.raises(InputError, match="not monotone"):
        split_stages(gm, {**base, lin: 1, out_name: 1}, 2)
    with pytest.raises(InputError, match="num_stages"):
        split_stages(gm, base, 0)


def test_non_tensor_values_are_recomputed_not_sent():
    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3)
    k = g.placeholder("k")
    k.meta["val"] = 5
    n1 = g.call_method("size", (x, 0))
    n1.meta["val"] = 3
    n2 = g.call_function(operator.mul, (n1, 2))
    n2.meta["val"] = 6
    t = g.call_function(torch.tanh, (x,))
    t.meta["val"] = torch.empty(3)
    y = g.call_function(torch.mul, (t, n2))
    y.meta["val"] = torch.empty(3)
    g.output(y)
    gm = fx.GraphModule(M(), g)
    stage_of = {"x": 0, "k": 0, n1.name: 0, n2.name: 0, t.name: 0, y.name: 1, "output": 1}
    staged = split_stages(gm, stage_of, 2)
    # the ints are recomputed on stage 1 (from x, which therefore crosses); no int is sent
    assert staged.boundary_names == (("x", t.name),)
    assert n1.name not in staged.stages[1].input_names
    inp = torch.tensor([0.1, 0.2, 0.3])
    torch.testing.assert_close(staged.run(inp, 5), gm(inp, 5))
    # with tanh on stage 1 too, only x crosses
    staged2 = split_stages(gm, {**stage_of, t.name: 1}, 2)
    assert staged2.boundary_names == (("x",),)
    torch.testing.assert_close(staged2.run(inp, 5), gm(inp, 5))
    # a non-tensor model input used after stage 0 is the constant torch.export specialised: it is
    # baked into the stage that uses it, never sent, and another value is refused clearly
    y2 = g.call_function(torch.add, (y, k))
    y2.meta["val"] = torch.empty(3)
    g.erase_node(next(n for n in g.nodes if n.op == "output"))
    g.output(y2)
    gm2 = fx.GraphModule(M(), g)
    staged3 = split_stages(gm2, {**stage_of, y2.name: 1}, 2)
    assert "k" not in staged3.input_names and all("k" not in b for b in staged3.boundary_names)
    torch.testing.assert_close(staged3.run(inp, 5), gm2(inp, 5))
    with pytest.raises(InputError, match="captured as the constant 5"):
        staged3.run(inp, 6)


def test_actions_golden_and_fusion():
    acts = actions_from_orders(orders_1f1b(2, 3), 3)
    assert format_actions(acts) == (
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\n"
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    )
    split = actions_from_orders(orders_1f1b(2, 2), 2, fuse=False)
    assert split[1] == ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]
    zb = actions_from_orders(orders_zbh1(3, 4), 4)
    assert "0I0" in zb[0] and "0W0" in zb[0] and zb[0].index("0W0") > zb[0].index("0I1")
    assert all(a[1] in "FB" for a in zb[2])  # last stage: W right after B -> fused
    assert actions_from_orders(orders_gpipe(2, 2), 2)[0] == ["0F0", "0F1", "0B0", "0B1"]
    assert fuse_backward(split)[1] == ["1F0", "1B0", "1F1", "1B1"]
    # only the named stages are fused; the input is not modified
    assert fuse_backward(split, stages=[0]) == {0: ["0F0", "0F1", "0B0", "0B1"], 1: split[1]}
    assert split[1] == ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]


def test_actions_of_several_stages_per_device():
    """Looped and V placements: each rank gets its stages' actions in device program order;
    offload/reload actions are left out of torch's actions; the orders are not modified."""
    o = Orders((0, 1, 1, 0), (
        tuple(map(Action.parse, "0F0 0O0 3F0 3B0 3W0 0R0 0B0 0W0".split())),
        tuple(map(Action.parse, "1F0 2F0 2B0 1B0 2W0 1W0".split())),
    ))
    before = o.to_dict()
    acts = actions_from_orders(o, 1)
    assert acts == {0: ["0F0", "3F0", "3B0", "0B0"], 1: ["1F0", "2F0", "2I0", "1I0", "2W0", "1W0"]}
    assert o.to_dict() == before


def test_order_errors_name_stage_and_microbatch():
    o = orders_1f1b(2, 2).stage_orders()
    with pytest.raises(InputError, match="stage 1: 1B1 is missing"):
        actions_from_orders(Orders.from_stage_orders({0: o[0], 1: [op for op in o[1] if op != ("B", 1)]}), 2)
    with pytest.raises(InputError, match="stage 0: micro-batch 0 runs out of order"):
        actions_from_orders(Orders.from_stage_orders({0: [("F", 0), ("W", 0), ("B", 0)], 1: [("F", 0), ("B", 0), ("W", 0)]}), 1)
    # deadlock: device 0 waits for B0 before F1, device 1 runs both forwards first
    bw = [("B", 0), ("W", 0), ("B", 1), ("W", 1)]
    dead = Orders.from_stage_orders({0: [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)], 1: [("F", 0), ("F", 1)] + bw})
    with pytest.raises(InputError, match="deadlock.*device 0 waits at 0B0.*device 1 waits at 1F1"):
        check_orders(dead, 2)
    # a V placement whose device 0 runs the last stage's backward before its forward arrives
    v = Orders((0, 1, 1, 0), (
        tuple(map(Action.parse, "0F0 3B0 3F0 3W0 0B0 0W0".split())),
        tuple(map(Action.parse, "1F0 2F0 2B0 2W0 1B0 1W0".split())),
    ))
    with pytest.raises(InputError, match="out of order"):
        check_orders(v, 1)
    with pytest.raises(InputError, match="micro-batch 2 outside 0..1"):
        check_orders(orders_1f1b(2, 3), 2)
    # only Orders are accepted: the old per-stage dicts get a pointer to the conversion
    with pytest.raises(InputError, match="codegen takes fxpipe.ir.Orders.*Orders.from_stage_orders"):
        actions_from_orders(o, 2)


def test_bad_action_strings_are_input_errors():
    with pytest.raises(InputError, match="rank 1, step 2: bad action string '1X0'"):
        fuse_backward({0: ["0F0"], 1: ["1F0", "1I0", "1X0"]})
    with pytest.raises(InputError, match="rank 0, step 0: action None is not a string"):
        fuse_backward({0: [None]})
    assert fuse_backward({0: ["0F0", "", "0I0", "0W0"]}) == {0: ["0F0", "0B0"]}  # "" = idle step
    with pytest.raises(InputError, match="num_microbatches must be an integer >= 1"):
        check_orders(orders_1f1b(2, 2), 0)


def test_heuristic_schedule_orders_lower_cleanly():
    """Orders of the schedule package's generators (one and several stages per device) lower to
    torch actions; codegen never calls the scheduler itself."""
    heur = pytest.importorskip("fxpipe.schedule.heuristics")
    from fxpipe.ir import ScheduleProblem, looped_placement, schedule_to_orders, v_placement

    prob = ScheduleProblem.create(num_stages=3, num_microbatches=4, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0)
    for method in ("1f1b", "zb-h1"):
        acts = actions_from_orders(schedule_to_orders(heur.generate(prob, method), prob), 4)
        assert all(len([a for a in acts[s] if "F" in a]) == 4 for s in range(3))
    for method, dev in (("interleaved-1f1b", looped_placement(2, 2)), ("zb-v", v_placement(2)), ("dualpipe-v", v_placement(2))):
        p2 = ScheduleProblem.create(num_stages=4, num_microbatches=4, t_f=1.0, t_b=1.0, t_w=1.0, device_of_stage=dev)
        acts = actions_from_orders(schedule_to_orders(heur.generate(p2, method), p2), 4)
        for s in range(4):
            assert sum(a.startswith(f"{s}F") for a in acts[dev[s]]) == 4, (method, s)
    import fxpipe.codegen as cg
    import fxpipe.codegen.launch as launch

    assert not hasattr(launch, "generate_orders") and not hasattr(cg.actions, "orders_from_schedule")


def test_split_backward_blind_parameters_detected(t5, gpt2):
    """torch's split backward drops gradients of parameters whose path meets no grad-requiring
    stage input (T5: decoder embedding on a later stage; relative position bias sent on)."""
    _, gm, mb = t5
    staged = split_stages(gm, stage_of_by_blocks(gm, [1, 1000, 1001]), 4)
    blind1 = stage_io(staged, 1, mb, fake=False).blind_params
    assert any("shared" in f or "embed_tokens" in f for f in blind1), blind1
    blind2 = stage_io(staged, 2, mb, fake=False).blind_params
    assert any("relative_attention_bias" in f for f in blind2), blind2
    _, gm2, mb2 = gpt2
    staged2 = split_stages(gm2, stage_of_by_blocks(gm2, [1, 2, 3]), 4)
    for s in range(4):
        io = stage_io(staged2, s, mb2, fake=False)
        ins, blind = io.inputs, io.blind_params
        assert blind == ()
        if s > 0:
            assert any(t.requires_grad for t in ins)


def test_static_shape_inference_matches_real_run(t5):
    """Fake-tensor prefix propagation gives the same boundary metadata as running it."""
    _, gm, mb = t5
    staged = split_stages(gm, stage_of_by_blocks(gm, [1, 1000, 1001]), 4)

    def meta(ts):
        return [(tuple(t.shape), t.dtype, t.requires_grad) for t in ts]

    for s in range(4):
        real = stage_io(staged, s, mb, fake=False)
        fake = stage_io(staged, s, mb)
        assert fake.static and not real.static
        assert meta(fake.inputs) == meta(real.inputs) and meta(fake.outputs) == meta(real.outputs)
        assert fake.blind_params == real.blind_params
        assert all(t.is_contiguous() for t in fake.inputs)


def test_single_rank_runtime_matches_eager(gpt2, single_rank_group):
    """build_rank with one stage (first == last) runs torch's runtime in-process."""
    from fxpipe.codegen.launch import cross_entropy_loss

    model, gm, mb = gpt2
    staged = split_stages(gm, {n.name: 0 for n in gm.graph.nodes if n.op != "get_attr"}, 1)
    m = 4
    for p in gm.parameters():
        p.grad = None
    orders = Orders.from_stage_orders({0: [("F", j) for j in range(m)] + [t for j in range(m) for t in (("B", j), ("W", j))]})
    (stage,), sched = build_rank(staged, 0, orders, num_microbatches=m, loss_fn=cross_entropy_loss, example_microbatch_inputs=mb)
    (ids,), tgt = make_batch_gpt2(0)
    losses: list[torch.Tensor] = []
    sched.step(ids, target=tgt, losses=losses)
    g_pipe = {k: p.grad.clone() for k, p in staged.stages[0].named_parameters().items()}
    for p in gm.parameters():
        p.grad = None
    total = sum(cross_entropy_loss(gm(i), t) for i, t in zip(ids.chunk(m), tgt.chunk(m))) / m
    total.backward()
    for k, p in gm.named_parameters():
        torch.testing.assert_close(g_pipe[k], p.grad, rtol=1e-5, atol=1e-7, msg=k)
    torch.testing.assert_close(sum(l.detach() for l in losses) / m, total.detach())
    with pytest.raises(InputError, match="build_rank takes fxpipe.ir.Orders"):
        build_rank(staged, 0, {0: ["0F0"]}, num_microbatches=1, loss_fn=None, example_microbatch_inputs=mb)
    with pytest.raises(InputError, match="the orders place 2 stages but the staged program has 1"):
        build_rank(staged, 0, orders_1f1b(2, 1), num_microbatches=1, loss_fn=None, example_microbatch_inputs=mb)
    two_devices = Orders((0, 1), orders_1f1b(2, 1).actions)
    with pytest.raises(InputError, match="uses 2 devices but the process group has 1 ranks"):
        build_rank(split_stages(gm, stage_of_by_blocks(gm, [2]), 2), 0, two_devices, num_microbatches=1,
                   loss_fn=None, example_microbatch_inputs=mb)
