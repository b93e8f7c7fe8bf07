"""One minimal test per stage-runtime fix (issue 8, item 2), each placing a boundary exactly where
the bug lives. Single-process except the two ``train_local`` tests at the end.

Each test failed before the fix (see the report of branch h-runtime): strided gradients sent
backward, in-place updates of received tensors (and their order across stages), BatchNorm's
counter on another stage than its BatchNorm, shape inference advancing real buffers, unused
parameters owned by no stage, pytree outputs/inputs, split backward with shared weights,
per-parameter gradient ratios of ~0 gradients as the verdict, silent random ops.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import _runtime_models as M
from fxpipe.codegen.split import split_stages

D = M.D


def _export(model, *args, **kwargs):
    return torch.export.export(model, args, kwargs, strict=False).module()


def _leaves(xs):
    return [t.detach().requires_grad_(t.is_floating_point()) for t in xs]


def test_split_backward_input_gradients_are_contiguous():
    """Gradients of a transposed use, a ``cat`` slice and a stride-0 expansion of received
    tensors come out of torch's backward-input pass (``autograd.grad``) strided; gloo sends
    need dense tensors. Every gradient a stage sends back must be contiguous."""
    torch.manual_seed(0)
    model = M.StridedGrads()
    x = torch.randn(2, 4, D)
    gm = _export(model, x)
    staged = split_stages(gm, M._cut(gm, "linear_2"), 2)
    assert staged.stages[1].input_names == ("linear", "linear_1", "linear_2")
    ins = _leaves(staged.stage_inputs(1, x))
    out = staged.stages[1].module(*ins)
    loss = out[0].square().sum() if isinstance(out, tuple) else out.square().sum()
    params = list(staged.stages[1].module.parameters())
    grads, _ = stage_backward_input([loss], None, ins, iter(params))
    assert all(g is not None and g.is_contiguous() for g in grads), [g.stride() for g in grads]
    # the values are the true gradients
    ref = _leaves(staged.stage_inputs(1, x))
    out = staged.stages[1].module(*ref)
    (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r.grad)


def test_inplace_update_of_a_received_input_is_cloned():
    """Falcon's ``mlp_output += attention_output`` with a boundary between the two: the stage
    updates a received tensor (an autograd leaf) in place."""
    torch.manual_seed(0)
    model = M.InplaceOnReceived()
    x = torch.randn(4, D)
    gm = _export(model, x)
    staged = split_stages(gm, M._cut(gm, "linear_1"), 2)  # c = l2(...) crosses, c += a on stage 1
    ins = _leaves(staged.stage_inputs(1, x))
    out = staged.stages[1].module(*ins)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    # gradients reach both received tensors
    assert all(t.grad is not None for t in ins if t.requires_grad)
    assert staged.stages[1].cloned_inputs == ("linear_1",)


@pytest.mark.parametrize("cut", ["matmul_5", "matmul_1"])
def test_falcon_inplace_updates_on_a_cut(cut):
    """The real Falcon decoder (transformers config, parallel attention): ``mlp_output +=
    attention_output`` (``add_`` after ``matmul_5``) and the attention scores' ``/=``
    (``div_`` after ``matmul_1``) with a boundary right before the update."""
    pytest.importorskip("transformers")
    from fxpipe.testing import zoo
    from fxpipe.passes.capture import capture

    model, args, kwargs = zoo.get("falcon").one_microbatch()
    gm = capture(model, args, kwargs).gm
    staged = split_stages(gm, M._cut(gm, cut), 2)
    ins = _leaves(staged.stage_inputs(1, *args, **kwargs))
    out = staged.stages[1].module(*ins)
    out = out if isinstance(out, tuple) else (out,)
    out[0].float().square().mean().backward()
    torch.testing.assert_close(out[0], model(*args, **kwargs)["logits"])
    assert all(t.grad is not None for t in ins if t.requires_grad)
    assert cut in staged.stages[1].cloned_inputs


def test_inplace_update_order_across_stages():
    """``c[:, :2].mul_(0.5)`` on stage 1 while ``l3(c)``, later in program order, was mapped to
    stage 0: it would read ``c`` before the update (a silently wrong result). The reader moves
    to the writer's stage."""
    torch.manual_seed(0)
    model = M.InplaceOnReceived()
    x = torch.randn(4, D)
    gm = _export(model, x)
    stage_of = {n.name: 0 for n in gm.graph.nodes if n.op != "get_attr"}
    stage_of.update({"slice_1": 1, "mul_": 1, "add": 1, "output": 1})
    staged = split_stages(gm, stage_of, 2)
    torch.testing.assert_close(staged.run(x), model(x))
    assert staged.moved_nodes == {"linear_2": (0, 1)}


def test_batchnorm_counter_runs_with_its_batchnorm_and_shape_inference_touches_no_state():
    torch.manual_seed(0)
    model = M.BNUnused().train()
    x = torch.randn(4, D)
    gm = _export(model, x)
    staged = split_stages(gm, M._cut(gm, "add_"), 2)  # the plan puts the counter before the cut
    s1 = staged.stages[1]
    assert "add_" in s1.node_names and "batch_norm" in s1.node_names
    assert staged.moved_nodes == {"add_": (0, 1)}
    assert staged.buffer_owner == {"bn.running_mean": 1, "bn.running_var": 1, "bn.num_batches_tracked": 1}
    assert not staged.stages[0].buffer_targets

    from fxpipe.codegen.shapes import stage_io

    before = {k: v.clone() for k, v in gm.named_buffers()}
    for fake in (True, False):
        io = stage_io(staged, 1, (x,), fake=fake)
        assert [tuple(t.shape) for t in io.inputs] == [(4, 16)] and io.static is fake
    for k, v in gm.named_buffers():
        assert torch.equal(v, before[k]), f"shape inference changed {k}"


def test_unused_parameters_are_held_by_a_stage():
    torch.manual_seed(0)
    model = M.BNUnused()
    gm = _export(model, torch.randn(4, D))
    staged = split_stages(gm, M._cut(gm, "batch_norm"), 2)
    held = set().union(*(s.param_fqns for s in staged.stages))
    assert held == {k for k, _ in model.named_parameters()}
    assert "never_used" in staged.stages[0].param_fqns  # a root-level parameter: stage 0


def test_split_backward_with_weights_shared_across_layers():
    """torch's W pass fails when one parameter is used in several places (its group then has
    an intermediate downstream of another); fxpipe's stage merges groups and keeps the graph,
    and gets the full-backward gradients exactly."""
    from fxpipe.codegen.runtime import merge_param_groups

    torch.manual_seed(0)
    model = M.SharedLayers()
    x = torch.randn(4, D)
    gm = _export(model, x)
    staged = split_stages(gm, M._cut(gm, "linear"), 2)
    mod = staged.stages[1].module
    params = list(mod.parameters())

    def forward():
        ins = _leaves(staged.stage_inputs(1, x))
        out = mod(*ins)
        return ins, (out[0] if isinstance(out, tuple) else out).square().sum()

    ins, loss = forward()
    _, groups = stage_backward_input([loss], None, ins, iter(params))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        stage_backward_weight(iter(params), groups)  # torch's own W
    for p in params:
        p.grad = None
    ins, loss = forward()
    _, groups = stage_backward_input([loss], None, ins, iter(params))
    stage_backward_weight(iter(params), merge_param_groups(groups), retain_graph=True)
    split = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    ins, loss = forward()
    loss.backward()
    for a, p in zip(split, params):
        torch.testing.assert_close(a, p.grad)


def test_pytree_inputs_and_outputs_reach_loss_fn(single_rank_group):
    """A positional dict with a nested list, keyword constants; a dict output with a nested
    tuple, a 0-dim auxiliary output, a non-batch tensor and a constant: ``loss_fn`` sees the
    model's structure per micro-batch, and the merged outputs follow the documented rule."""
    from fxpipe.codegen import build_rank
    from fxpipe.ir import Orders

    torch.manual_seed(0)
    model = M.PytreeIO()
    m = 4
    x, a, b = M.pytree_tensors(1, M.BATCH // m)
    mb_kwargs = {"scale": 2.0, "mode": "sum"}
    gm = _export(model, {"x": x, "parts": [a, b]}, **mb_kwargs)
    staged = split_stages(gm, {n.name: 0 for n in gm.graph.nodes if n.op != "get_attr"}, 1)
    orders = Orders.from_stage_orders({0: [("F", j) for j in range(m)] + [t for j in range(m) for t in (("B", j), ("W", j))]})
    _, sched = build_rank(staged, 0, orders, num_microbatches=m, loss_fn=M.pytree_loss,
                              example_microbatch_inputs=(x, a, b))  # the tensor inputs, flattened
    x, a, b = M.pytree_tensors(2, M.BATCH)
    target = {"y": torch.randn(M.BATCH, D), "w": torch.tensor(0.5)}
    losses: list[torch.Tensor] = []
    merged = sched.step({"x": x, "parts": [a, b]}, scale=2.0, mode="sum", target=target, losses=losses)
    g_pipe = {k: p.grad.clone() for k, p in staged.stages[0].named_parameters().items()}
    for p in gm.parameters():
        p.grad = None
    outs = [gm({"x": xj, "parts": [aj, bj]}, **mb_kwargs) for xj, aj, bj in zip(x.chunk(m), a.chunk(m), b.chunk(m))]
    tgts = [{"y": y, "w": target["w"]} for y in target["y"].chunk(m)]
    (sum(M.pytree_loss(o, t) for o, t in zip(outs, tgts)) / m).backward()
    for k, p in gm.named_parameters():
        torch.testing.assert_close(g_pipe[k], p.grad, msg=k)
    assert len(losses) == m
    # merged: batch tensors concatenated, the 0-dim aux and the (D,) statistics stacked per micro-batch
    assert merged["y"].shape == (M.BATCH, D) and merged["tag"] == 3
    aux, (h, stats) = merged["aux"]
    assert aux.shape == (m,) and stats.shape == (m, D) and h.shape == (M.BATCH, D)
    torch.testing.assert_close(aux, torch.stack([o["aux"][0] for o in outs]).detach())
    # a different constant than the captured one is refused, not silently ignored
    from fxpipe.errors import InputError

    with pytest.raises(InputError, match="captured as the constant 2.0"):
        sched.step({"x": x, "parts": [a, b]}, scale=3.0, mode="sum", target=target)


def test_compare_verdict_is_relative_to_the_largest_gradient():
    """A bias in front of a BatchNorm has true gradient 0: rounding noise makes its
    per-parameter ratio ~1 on a correct run. The verdict uses the model's largest gradient."""
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import TrainResult

    g = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.tensor([1e-9], dtype=torch.float64),
         "unused": None}
    p = {"w": torch.ones(2), "b": torch.zeros(1), "unused": torch.ones(3)}
    ref = TrainResult([1.0, 0.9], g, p, {"rm": torch.ones(2), "n": torch.tensor(4)})
    pipe = TrainResult([1.0, 0.9], {"w": g["w"] + 1e-7, "b": torch.tensor([2e-9], dtype=torch.float64),
                                                   "unused": None}, dict(p),
                       {"rm": torch.ones(2), "n": torch.tensor(4)})
    c = compare_training(pipe, ref)
    assert c.ok and c.max_grad_rel_diff == pytest.approx(5e-8, rel=1e-3)
    assert c.worst_param == "b" and c.worst_param_grad_rel_diff == pytest.approx(1.0)
    bad = TrainResult(pipe.losses, {**pipe.grads, "unused": torch.zeros(3)}, p, {"rm": torch.ones(2), "n": torch.tensor(3)})
    c = compare_training(bad, ref)
    assert not c.ok and any("unused" in x for x in c.problems) and any("integer buffer n" in x for x in c.problems)
    missing = TrainResult(pipe.losses, pipe.grads, p, {"n": torch.tensor(4)})
    assert any("buffer rm missing" in x for x in compare_training(missing, ref).problems)


def test_random_ops_are_detected():
    from fxpipe.codegen.effects import random_ops

    x = torch.randn(4, D)
    assert [o.node for o in random_ops(_export(M.DropoutMLP(0.1).train(), x))] == ["dropout"]
    assert random_ops(_export(M.DropoutMLP(0.0).train(), x)) == []
    assert random_ops(_export(M.DropoutMLP(0.1).eval(), x)) == []


@pytest.mark.slow
def test_train_local_compares_buffers_and_unused_parameters():
    """BatchNorm in training mode with a bias in front (true gradient 0) and an unused
    parameter: the pipeline equals single-process training, buffers included, and the
    gradient verdict is not fooled by ~0 gradients."""
    import fxpipe

    model, (x,) = M.make_bn_unused()
    plan = fxpipe.compile(model, (x[: M.BATCH // M.MICROBATCHES],), devices=2, microbatches=M.MICROBATCHES,
                          time_limit_s=0.5, mesh="pipeline")
    res = plan.train_local(M.make_bn_unused, M.batch_bn_unused, steps=2, lr=0.1, loss="mse", timeout_s=300)
    assert res["ok"], res["comparison"]
    assert res["num_buffers"] == 3 and res["max_grad_rel_diff"] < 1e-5
    pipe, ref = res["results"]
    assert pipe.grads["never_used"] is None and ref.grads["never_used"] is None
    assert int(pipe.buffers["bn.num_batches_tracked"]) == 2 * M.MICROBATCHES
    torch.testing.assert_close(pipe.buffers["bn.running_mean"], ref.buffers["bn.running_mean"])


@pytest.mark.slow
def test_train_local_warns_about_active_dropout():
    import fxpipe
    from fxpipe.codegen.compare import RandomOpsWarning

    model, (x,) = M.make_dropout()
    plan = fxpipe.compile(model, (x[:2],), devices=2, microbatches=M.MICROBATCHES, time_limit_s=0.5, mesh="pipeline")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = plan.train_local(M.make_dropout, M.batch_bn_unused, steps=1, loss="mse", timeout_s=300)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RandomOpsWarning)]
    assert len(msgs) == 1 and "model.eval()" in msgs[0] and "dropout" in msgs[0]
    assert res["random_ops"] and res["comparison"]["random_ops"]


def test_stage_io_cache_never_serves_another_program_at_the_same_address():
    """Shape inference is cached per staged program; a mesh run splits the graph afresh, and CPython may
    allocate the new program where a collected one lived. An entry left under that address (here one made
    for another split of the same graph) must not be served to the new program: it gave a 4-stage V
    partition the stage inputs of a 2-stage one (``forward() takes 4 positional arguments but 5 were given``)."""
    from fxpipe.codegen.rank import _stage_ios

    torch.manual_seed(0)
    x = torch.randn(2, 4, D)
    gm = _export(M.StridedGrads(), x)
    staged = split_stages(gm, M._cut(gm, "linear_2"), 2)
    other = split_stages(gm, M._cut(gm, "linear"), 2)
    flat = staged.interface.example_inputs((x,))
    shape_key = tuple((tuple(t.shape), t.dtype) for t in flat)
    def shapes(io):
        return [tuple(t.shape) for t in io.inputs]

    stale = _stage_ios(other, [1], flat, None)[1]
    fresh = _stage_ios(staged, [1], flat, None)[1]
    assert shapes(stale) != shapes(fresh)  # the two splits' stage 1 receives different tensors
    for entry in (stale, (other, stale)):  # the old format; held for another program
        cache = {(id(staged), 1, shape_key): entry}
        assert shapes(_stage_ios(staged, [1], flat, cache)[1]) == shapes(fresh)


def test_an_in_place_update_of_a_copy_is_not_lost_at_a_stage_boundary():
    """Issue 30, item 15 (data2vec-vision at 4 devices, a relative-position-bias table 3.5e-5 off, every
    schedule): BEiT builds its relative position index by updating ``permute(...).contiguous()`` in place.
    ``contiguous`` of a non-contiguous tensor copies, but its schema says its output may alias the input,
    and the split took it for a view: a stage after the first in-place update recomputed the copy from
    the uncopied input and lost that update, so the index gathered the wrong table entries. The forward
    was right while the table was zero (its initial value) and the table's gradient went to the wrong
    entries; in float64 the difference stays (0.49 of the table's own gradient): a defect, not summation
    order. Cut between the updates, the stages must compute what the model computes."""
    from fxpipe.codegen.effects import analyze

    torch.manual_seed(0)
    model = M.RelativeIndex()
    x = torch.randn(2, 9, D)
    gm = _export(model, x)
    cont = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.contiguous.default)
    eff = analyze(gm)
    assert eff.base[cont] is cont and cont not in eff.views  # a copy, not a view of the permuted input
    first_update = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    staged = split_stages(gm, M._cut(gm, first_update.name), 2)
    ins = _leaves(staged.stage_inputs(1, x))
    out = staged.stages[1].module(*ins)
    out = out[0] if isinstance(out, tuple) else out
    xr = x.clone()
    ref = model(xr)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(gm.get_parameter("table").grad, model.table.grad, rtol=1e-6, atol=1e-7)
