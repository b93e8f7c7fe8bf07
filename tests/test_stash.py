"""The activation stash (saved-tensor hooks) and per-rank materialization, in one process (issue 9).

Offload/reload moves a micro-batch's stash to a separate host buffer and back and the backward
gives the gradients of a plain run; a backward whose stash was never reloaded fails loudly;
recomputation replays the forward with the original random state (dropout) and gives the same
gradients with one micro-batch's inputs kept; live saved bytes are counted per stage. O/R
programs that cannot run are rejected before anything runs. A stage materialized from ``meta``
gets bit-identical values to the whole model under the same seed, or the checkpoint's values.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fxpipe.codegen.materialize import MetaInit, StateSource, materialize_model, materialize_stage  # noqa: E402
from fxpipe.codegen.offload import offload_all, offload_program  # noqa: E402
from fxpipe.codegen.stash import DeviceStash, StashError  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.ir import Action, Orders  # noqa: E402


class _MLP(torch.nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _make_mlp():
    return _MLP(), (torch.randn(4, 8),)


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _plain_grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return _grads(model)


def _assert_backward_gives(stash, model, out, want):
    """The backward of ``out`` (stage 0, micro-batch 0 of ``stash``) and its release give the
    gradients ``want`` of :func:`_plain_grads` bit for bit."""
    out.square().sum().backward()
    stash.release(0, 0)
    got = _grads(model)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_offload_moves_the_stash_to_host_and_reload_restores_gradients():
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(4, 8, requires_grad=True)
    want = _plain_grads(model, x)
    model.zero_grad()
    stash = DeviceStash("cpu")
    out = stash.forward(0, 0, model, (x,), {}, list(model.parameters()))
    saved = stash.live_saved_bytes(0)
    assert saved > 0 and stash.offloaded_bytes() == 0
    before = [t.data_ptr() for t in stash.stash_tensors(0, 0)]
    stash.offload(0, 0)
    assert stash.live_saved_bytes(0) == 0 and stash.offloaded_bytes(0) == saved
    stash.reload(0, 0)
    after = [t.data_ptr() for t in stash.stash_tensors(0, 0)]
    assert stash.live_saved_bytes(0) == saved and stash.offloaded_bytes() == 0
    assert not set(before) & set(after)  # new storage: the values went through the host buffer
    _assert_backward_gives(stash, model, out, want)
    st = stash.stats().stages[0]
    assert st.offloads == 1 and st.reloads == 1 and st.peak_offloaded_bytes == saved and st.peak_saved_bytes == saved
    assert stash.live_saved_bytes() == 0


def test_backward_without_reload_fails_naming_stage_and_microbatch():
    model, x = _MLP(), torch.randn(4, 8, requires_grad=True)
    stash = DeviceStash("cpu")
    out = stash.forward(2, 5, model, (x,), {}, list(model.parameters()))
    stash.offload(2, 5)
    with pytest.raises(StashError, match=r"stage 2, micro-batch 5.*2R5"):
        out.sum().backward()


def test_live_bytes_count_two_microbatches_and_release():
    model = _MLP()
    stash = DeviceStash("cpu")
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    outs = [stash.forward(1, j, model, (x,), {}, list(model.parameters())) for j, x in enumerate(xs)]
    one = stash.stats().stages[1].max_microbatch_bytes
    # tanh output (4x16 fp32) and the tanh output saved for b: 64 floats each, a's input is the stage input
    assert one == 4 * 16 * 4
    assert stash.live_saved_bytes(1) == 2 * one
    for j, o in enumerate(outs):
        o.sum().backward()
        stash.release(1, j)
    assert stash.live_saved_bytes(1) == 0 and stash.stats().stages[1].peak_saved_bytes == 2 * one


def test_recompute_replays_dropout_and_keeps_only_inputs():
    model, x = _MLP(p=0.5), torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    want = _plain_grads(model, x)
    model.zero_grad()
    stash = DeviceStash("cpu", recompute_stages=[0])
    torch.manual_seed(3)
    out = stash.forward(0, 0, model, (x,), {}, list(model.parameters()))
    torch.rand(100)  # the random state moves on before the backward
    assert stash.live_saved_bytes(0) == 0  # only the stage input (resident) is kept
    _assert_backward_gives(stash, model, out, want)
    st = stash.stats().stages[0]
    assert st.recomputes == 1 and st.peak_saved_bytes > 0


def test_offload_program_checks_pairs_and_anchors():
    prog = [Action.parse(a) for a in ("0F0", "0O0", "0F1", "0R0", "0B0", "0W0", "0B1", "0W1")]
    torch_actions = ["0F0", "0F1", "0B0", "0B1"]  # B + W fused to full backwards
    p = offload_program(prog, torch_actions)
    assert [str(a) for a in p.memops_after("0F0")] == ["0O0"] and [str(a) for a in p.memops_after("0F1")] == ["0R0"]
    with pytest.raises(InputError, match="no reload"):
        offload_program([a for a in prog if str(a) != "0R0"], torch_actions)
    bad = [Action.parse(a) for a in ("0F0", "0O0", "0F1", "0B0", "0R0", "0W0", "0B1", "0W1")]
    with pytest.raises(InputError, match="before the backward"):
        offload_program(bad, torch_actions)


def test_offload_all_inserts_pairs_on_every_device_program():
    rows = [[f"{s}{t}{j}" for j in range(2) for t in "FBW"] for s in range(2)]
    o = offload_all(Orders((0, 1), tuple(tuple(Action.parse(a) for a in r) for r in rows)))
    assert o.offloaded() == {(0, 0), (0, 1)}
    assert [str(a) for a in o.of_device(0)][:4] == ["0F0", "0O0", "0R0", "0B0"]
    with pytest.raises(InputError, match="outside"):
        offload_all(o, stages=[5])


def test_materialized_stage_equals_whole_model_under_the_same_seed():
    from fxpipe.codegen.interface import ModelInputs
    from fxpipe.codegen.launch import _capture
    from fxpipe.codegen.split import split_stages

    whole, _ = MetaInit(_make_mlp, seed=11)()
    with torch.device("meta"):
        model, (x,) = _make_mlp()
    gm = _capture(model, ModelInputs((torch.empty(4, 8, device="meta"),), {}))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    cut = next(i for i, n in enumerate(nodes) if "tanh" in n.name)
    stage_of = {n.name: (0 if i <= cut else 1) for i, n in enumerate(nodes)}
    staged = split_stages(gm, stage_of, 2)
    want = dict(whole.named_parameters())
    for s in (1, 0):  # order does not matter
        rep = materialize_stage(staged, s, StateSource(seed=11, model=model))
        assert rep.param_bytes > 0
        for fqn, p in staged.stages[s].named_parameters().items():
            assert not p.is_meta
            torch.testing.assert_close(p.detach(), want[fqn].detach(), rtol=0, atol=0)
    other, _ = MetaInit(_make_mlp, seed=12)()
    assert not torch.equal(other.a.weight, whole.a.weight)  # the seed matters: the comparison can fail


def test_checkpoint_loads_by_name_and_reports_missing_parameters(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    src, _ = _make_mlp()
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    with torch.device("meta"):
        model, _ = _make_mlp()
    materialize_model(model, StateSource(checkpoint=str(path)))
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    torch.save({k: v for k, v in src.state_dict().items() if k != "b.bias"}, tmp_path / "part.pt")
    with torch.device("meta"):
        model, _ = _make_mlp()
    with pytest.raises(InputError, match="b.bias"):
        materialize_model(model, StateSource(checkpoint=str(tmp_path / "part.pt")))
