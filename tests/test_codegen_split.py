"""Single-process tests of fxpipe.codegen: stage splitting, relays, order lowering, runtime build."""

from __future__ import annotations

import operator
import os

import pytest
import torch
import torch.fx as fx

from fxpipe.codegen.actions import actions_from_orders, check_orders, format_actions, fuse_backward, orders_from_schedule
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


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model, ex = make_gpt2()
    gm, mb = export_gm(model, ex)
    return model, gm, mb


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    model, ex = make_t5()
    gm, mb = export_gm(model, ex)
    return model, gm, mb


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
    acts = actions_from_orders(orders_1f1b(2, 3), 2)
    assert format_actions(acts) == (
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\n"
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    )
    split = actions_from_orders(orders_1f1b(2, 2), 2, fuse=False)
    assert split[1] == ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]
    zb = actions_from_orders(orders_zbh1(3, 4), 3)
    assert "0I0" in zb[0] and "0W0" in zb[0] and zb[0].index("0W0") > zb[0].index("0I1")
    assert all(a[1] in "FB" for a in zb[2])  # last stage: W right after B -> fused
    # a stage without any W runs full backwards
    assert actions_from_orders(orders_gpipe(2, 2), 2)[0] == ["0F0", "0F1", "0B0", "0B1"]
    assert fuse_backward(split)[1] == ["1F0", "1B0", "1F1", "1B1"]


def test_order_errors_name_stage_and_microbatch():
    o = orders_1f1b(2, 2)
    with pytest.raises(InputError, match="stage 1: no B for micro-batches \\[1\\]"):
        actions_from_orders({0: o[0], 1: [op for op in o[1] if op != ("B", 1) and op != ("W", 1)]}, 2)
    with pytest.raises(InputError, match="stage 0, micro-batch 0: W"):
        actions_from_orders({0: [("F", 0), ("W", 0), ("B", 0)], 1: [("F", 0), ("B", 0)]}, 2)
    with pytest.raises(InputError, match="backward before its forward"):
        actions_from_orders({0: [("B", 0), ("F", 0)], 1: [("F", 0), ("B", 0)]}, 2)
    # deadlock: stage 0 waits for B0 before F1, stage 1 runs both forwards first
    dead = {0: [("F", 0), ("B", 0), ("F", 1), ("B", 1)], 1: [("F", 0), ("F", 1), ("B", 0), ("B", 1)]}
    with pytest.raises(InputError, match="deadlock.*stage 0 waits at B of micro-batch 0.*stage 1 waits at F of micro-batch 1"):
        check_orders(dead, 2)
    with pytest.raises(InputError, match="one entry per stage"):
        actions_from_orders({0: o[0]}, 2)
    with pytest.raises(InputError, match="unknown op type"):
        actions_from_orders({0: [("X", 0)], 1: o[1]}, 2)


def test_bad_microbatch_and_action_strings_are_input_errors():
    with pytest.raises(InputError, match="stage 0: micro-batch index must be an integer >= 0, got 'a'"):
        actions_from_orders({0: [("F", "a"), ("B", "a")]}, 1)
    with pytest.raises(InputError, match="micro-batch index"):
        actions_from_orders({0: [("F", 0.5), ("B", 0.5)]}, 1)
    with pytest.raises(InputError, match="rank 1, step 2: bad action string '1X0'"):
        fuse_backward({0: ["0F0"], 1: ["1F0", "1I0", "1X0"]})
    with pytest.raises(InputError, match="rank 0, step 0: action None is not a string"):
        fuse_backward({0: [None]})
    assert fuse_backward({0: ["0F0", "", "0I0", "0W0"]}) == {0: ["0F0", "0B0"]}  # "" = idle step


def test_generate_orders_come_from_the_schedule_package():
    from fxpipe.codegen.launch import generate_orders
    from fxpipe.ir import ScheduleProblem
    from fxpipe.schedule.heuristics import generate, orders_1f1b as sched_1f1b
    from fxpipe.schedule.simulate import orders_from_schedule as sched_orders

    S, m = 3, 4
    assert generate_orders("1F1B", S, m) == sched_1f1b(S, m) == orders_1f1b(S, m)
    prob = ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=1.0, t_b=1.0, t_w=1.0)
    zb = generate_orders("zb-h1", S, m)
    assert zb == sched_orders(generate(prob, "zb-h1"), S)
    check_orders(zb, S, m)
    assert any(zb[s].index(("W", 0)) > zb[s].index(("B", 1)) for s in range(S))  # some W deferred
    # GPipe: every forward before any backward; lowered to full backwards
    gp = generate_orders("gpipe", 2, 2)
    assert actions_from_orders(gp, 2)[0] == ["0F0", "0F1", "0B0", "0B1"]
    with pytest.raises(InputError, match="unknown schedule 'nope'"):
        generate_orders("nope", S, m)
    with pytest.raises(InputError):
        generate_orders("1f1b", 0, m)


def test_orders_from_schedule_sorts_by_start():
    ops = [
        {"stage": 0, "microbatch": 1, "type": "F", "start_s": 1.0},
        {"stage": 0, "microbatch": 0, "type": "F", "start_s": 0.0},
        {"stage": 0, "microbatch": 0, "type": "O", "start_s": 0.5},
        {"stage": 0, "microbatch": 0, "type": "B", "start_s": 3.0},
        {"stage": 0, "microbatch": 0, "type": "W", "start_s": 4.0},
        {"stage": 1, "microbatch": 0, "type": "F", "start_s": 1.0},
    ]
    assert orders_from_schedule({"ops": ops}) == {
        0: [("F", 0), ("F", 1), ("B", 0), ("W", 0)],
        1: [("F", 0)],
    }


def test_heuristic_schedule_orders_lower_cleanly():
    heur = pytest.importorskip("fxpipe.schedule.heuristics")
    from fxpipe.ir import ScheduleProblem

    prob = ScheduleProblem.create(num_stages=3, num_microbatches=4, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0)
    for method in ("1f1b", "zb-h1"):
        sched = heur.generate(prob, method)
        acts = actions_from_orders(orders_from_schedule(sched, 3), 3, num_microbatches=4)
        assert all(len([a for a in acts[s] if "F" in a]) == 4 for s in range(3))


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


@pytest.fixture()
def single_rank_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_single_rank_runtime_matches_eager(gpt2, single_rank_group):
    """build_rank with one stage (first == last) runs torch's runtime in-process."""
    from fxpipe.codegen.launch import cross_entropy_loss

    model, gm, mb = gpt2
    staged = split_stages(gm, {n.name: 0 for n in gm.graph.nodes if n.op != "get_attr"}, 1)
    m = 4
    for p in gm.parameters():
        p.grad = None
    acts = actions_from_orders({0: [("F", j) for j in range(m)] + [t for j in range(m) for t in (("B", j), ("W", j))]}, 1)
    stage, sched = build_rank(staged, 0, acts, num_microbatches=m, loss_fn=cross_entropy_loss, example_microbatch_inputs=mb)
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
    with pytest.raises(InputError, match="one stage per rank"):
        build_rank(staged, 0, {0: ["1F0"]}, num_microbatches=1, loss_fn=None, example_microbatch_inputs=mb)
