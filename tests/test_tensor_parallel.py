"""Tensor parallelism (issue 29): the ``tp`` mesh dimension, the sharding found on the graph, the plan.

No process group here (the runs on gloo ranks are ``tests/test_tensor_parallel_run.py``):

* the mesh: ``tp`` parsed, formatted, innermost in the rank order (a bijection), never offered
  by ``mesh="auto"``, and plans saved before it load with ``tp = 1``;
* the pattern finder on real architectures of the zoo, structurally: a Llama (grouped-query
  attention, SwiGLU MLP, vocab-parallel embedding and output projection, sequence parallelism),
  BERT (biases, a tied decoder, an MLM head refused at its layer norm), a ViT (a sequence of 17
  tokens: no sequence parallelism at tp=2), a ResNet and a conv-only U-Net (no pattern, the
  reason given), GQA with fewer kv heads than tp, odd widths and vocabularies;
* the view rule against a brute-force oracle (every element labelled by its rank);
* ``fxpipe.compile`` with a pinned ``tp``: the warnings, the refusals, the plan file round trip
  and an edited ``tensor_parallel`` refused.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.errors import InputError, PlanWarning  # noqa: E402
from fxpipe.mesh import (candidate_meshes, dim_strides, format_mesh, normalize_mesh, normalize_rank_order,  # noqa: E402
                         parse_mesh, rank_coords, rank_of)
from fxpipe.mesh.tensor_parallel import (REPLICATE, check_tensor_parallel,  # noqa: E402
                                         graph_tensor_parallel, resolve_tensor_parallel, stage_tensor_parallel)
from fxpipe.passes import trace_model  # noqa: E402
from fxpipe.passes.tensor_parallel import _view_map  # noqa: E402
from fxpipe.plan import Plan, load_plan  # noqa: E402
from fxpipe.testing import zoo  # noqa: E402


@pytest.fixture(scope="module")
def traced():
    """A cache of zoo captures (trace_model: capture, costs, the OpGraph with the tensor-parallel record)."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            model, args, kwargs = zoo.get(name).one_microbatch()
            cache[name] = trace_model(model, args, kwargs)
        return cache[name]

    return get


# ----------------------------------------------------------------------------- the mesh
def test_tp_is_innermost_parsed_formatted_and_a_bijection():
    assert parse_mesh("pp=2,tp=2") == {"pp": 2, "dp_shard": 1, "dp_replicate": 1, "tp": 2}
    assert normalize_mesh({"pp": 2, "dp_shard": 2}, 4) == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}  # no tp key at 1
    assert normalize_mesh({"pp": 2, "tp": 1}, 2) == {"pp": 2, "dp_shard": 1, "dp_replicate": 1}
    assert format_mesh({"pp": 2, "dp_shard": 2, "tp": 4}) == "pp=2 x dp_shard=2 x tp=4"
    with pytest.raises(InputError, match=r"pp \* dp_shard \* dp_replicate \* tp"):
        normalize_mesh({"pp": 2, "tp": 2}, 8)
    with pytest.raises(InputError, match="tp is always the innermost"):
        normalize_rank_order(["pp", "tp", "dp_shard"])
    assert normalize_rank_order(["pp", "dp_replicate", "dp_shard", "tp"]) == ("pp", "dp_replicate", "dp_shard")
    for order in (None, ["pp", "dp_replicate", "dp_shard"]):
        mesh = {"pp": 3, "dp_shard": 2, "dp_replicate": 2, "tp": 2}
        seen = set()
        for rank in range(24):
            c = rank_coords(rank, mesh, order)
            assert c["tp"] == rank % 2  # innermost: consecutive ranks
            assert rank_of(mesh, pp=c["pp"], replica=c["replica"], order=order, tp=c["tp"]) == rank
            seen.add((c["pp"], c["replica"], c["tp"]))
        assert len(seen) == 24
        assert dim_strides(mesh, order)["tp"] == 1 and min(v for k, v in dim_strides(mesh, order).items() if k != "tp") == 2
    # candidate_meshes offers tp only for the degrees it is given (the search passes those the graph admits)
    assert all("tp" not in m for m in candidate_meshes(16, 16, replicate=True))


# ----------------------------------------------------------------------------- the pattern finder
def _placements(graph, tp):
    return graph_tensor_parallel(graph, tp).params


def test_decoder_llama_column_row_pairs_vocab_parallel_and_sequence_parallel(traced):
    g = traced("llama").graph
    rec = g.meta["tensor_parallel"]
    assert [r["kind"] for r in rec["regions"]] == ["embedding", "attention", "mlp", "attention", "mlp", "output"]
    assert rec["regions"][1]["module"] == "model.layers.0.self_attn" and rec["regions"][2]["module"] == "model.layers.0.mlp"
    p = _placements(g, 2)
    for i in (0, 1):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert p[f"model.layers.{i}.{name}.weight"] == "Shard(0)", name  # column: output features
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert p[f"model.layers.{i}.{name}.weight"] == "Shard(1)", name  # row: input features
        assert f"model.layers.{i}.input_layernorm.weight" not in p  # replicated
    assert p["model.embed_tokens.weight"] == "Shard(0)" and p["lm_head.weight"] == "Shard(0)"  # over the vocabulary
    roles = [e.get("tp_role") for e in g.extra]
    assert roles.count("column") == 12 and roles.count("row") == 4 and roles.count("sequence") > 0
    # the norms run on the sequence shard: the rsqrt of every RMSNorm is a sequence-parallel op
    assert all(e.get("tp_role") == "sequence" for e in g.extra if e["target"] == "aten.rsqrt.default")
    assert rec["sequence_sizes"] == [8] and graph_tensor_parallel(g, 2).sequence_parallel
    # the structure does not depend on node names: a second capture finds the same regions
    model, args, kwargs = zoo.get("llama").one_microbatch()
    assert trace_model(model, args, kwargs).graph.meta["tensor_parallel"] == rec


def test_grouped_query_attention_replicates_kv_below_tp_and_refuses_what_does_not_divide(traced):
    g = traced("llama").graph  # 4 heads, 2 kv heads
    four = graph_tensor_parallel(g, 4)
    assert four.params["model.layers.0.self_attn.k_proj.weight"] == REPLICATE  # 2 kv heads < tp = 4
    assert four.params["model.layers.0.self_attn.v_proj.weight"] == REPLICATE
    assert four.params["model.layers.0.self_attn.q_proj.weight"] == "Shard(0)"
    assert four.replicated_columns and not four.refusals
    with pytest.raises(InputError, match=r"tp=8 does not divide the 4 heads of model.layers.0.self_attn.q_proj.weight"):
        check_tensor_parallel(g, 8)
    with pytest.raises(InputError, match=r"tp=3 does not divide .* degrees that divide every block: \[2\]"):
        check_tensor_parallel(g, 3)


def test_encoder_biases_tied_decoder_and_a_rejected_head(traced):
    g = traced("bert").graph
    rec = g.meta["tensor_parallel"]
    p = _placements(g, 2)
    layer = "bert.encoder.layer.0"
    assert p[f"{layer}.attention.self.query.bias"] == "Shard(0)"  # a column's bias is split with its outputs
    assert p[f"{layer}.output.dense.bias"] == REPLICATE  # a row's bias is added once, after the reduction
    assert p["bert.embeddings.word_embeddings.weight"] == "Shard(0)"  # tied: the embedding and the MLM decoder
    assert any(r["kind"] == "output" and "bert.embeddings.word_embeddings.weight" in r["columns"][0]["params"]
               for r in rec["regions"])
    head = next(r for r in rec["rejected"] if r["module"] == "cls.predictions.transform.dense")
    assert "layer_norm on a sharded tensor" in head["reason"]
    # 2 token types do not divide by 4: that table stays replicated, with a note (no refusal)
    four = graph_tensor_parallel(g, 4)
    assert "bert.embeddings.token_type_embeddings.weight" not in four.params and not four.refusals
    assert any("vocabulary of 2 rows of bert.embeddings.token_type_embeddings.weight" in n for n in four.notes)


def test_vit_splits_its_blocks_without_sequence_parallelism_on_17_tokens(traced):
    g = traced("vit").graph
    layout = graph_tensor_parallel(g, 2)
    kinds = [r["kind"] for r in g.meta["tensor_parallel"]["regions"]]
    assert kinds.count("attention") == 2 and kinds.count("mlp") == 2
    assert not layout.sequence_parallel and any("sequence length 17" in n for n in layout.notes)
    assert len(layout.regions) == len(kinds)


def test_conv_nets_get_no_tensor_parallelism_with_the_reason(traced):
    g = traced("resnet").graph  # convolutions, then a linear classifier of 10 classes
    layout = graph_tensor_parallel(g, 2)
    n = g.n
    assignment = np.array([0] * (n - 4) + [1] * 4)  # the convolutions on stage 0, the classifier's tail on stage 1
    rows = stage_tensor_parallel(g, assignment, 2, layout)
    assert rows[0]["split_flops_share"] == 0.0 and "no matmul with a parameter weight" in rows[0]["reason"]
    assert "conv" in rows[0]["reason"]
    unet = traced("unet").graph  # convolutions only
    with pytest.raises(InputError, match="nothing in the model can be split"):
        check_tensor_parallel(unet, 2)


class _MLP(torch.nn.Module):
    """An embedding and a residual MLP (default: width 6 under a vocabulary of 10, which tp=4 divides neither)."""

    def __init__(self, vocab: int = 10, width: int = 6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.up = torch.nn.Linear(8, width)
        self.down = torch.nn.Linear(width, 8)

    def forward(self, ids):
        h = self.emb(ids)
        return self.down(torch.relu(self.up(h))) + h


def test_odd_widths_are_refused_with_the_width_named():
    model = _MLP()
    g = trace_model(model, (torch.zeros(2, 4, dtype=torch.long),)).graph
    assert graph_tensor_parallel(g, 2).params["up.weight"] == "Shard(0)"
    with pytest.raises(InputError, match=r"tp=4 does not divide the 6 output features of up.bias, up.weight"):
        check_tensor_parallel(g, 4)
    assert any("vocabulary of 10 rows" in n for n in resolve_tensor_parallel(g.meta["tensor_parallel"], 4).notes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_view_rule_is_sound_against_labelled_elements(dims, data):
    """Shard dim ``d`` of ``src`` over 2 ranks, view as ``dst``: where the rule says the shard lands (dim, units),
    every element's rank must be its chunk index along that dim, and 2 must divide the units."""
    src = [2 * x if i == 0 else x for i, x in enumerate(dims)]
    d = data.draw(st.integers(0, len(src) - 1))
    if src[d] % 2:
        return
    # a random regrouping of the same elements
    total = int(np.prod(src))
    factors = [f for f in range(1, total + 1) if total % f == 0]
    dst, rest = [], total
    while rest > 1 and len(dst) < 4:
        f = data.draw(st.sampled_from([x for x in factors if rest % x == 0]))
        dst.append(f)
        rest //= f
    dst.append(rest)
    label = np.indices(src)[d] // (src[d] // 2)  # the rank holding each element
    m = _view_map(tuple(src), tuple(dst), d)
    if m is None:
        return
    o, units = m
    units = units or src[d]
    if units % 2:
        return
    got = label.reshape(dst)
    assert dst[o] % 2 == 0, (src, d, dst, m)  # the shard must split its dim evenly
    expect = np.indices(dst)[o] // (dst[o] // 2)
    assert (got == expect).all(), (src, d, dst, m)


# ----------------------------------------------------------------------------- the plan
def test_a_pinned_tp_mesh_plans_warns_saves_and_refuses_edits(tmp_path):
    zm = zoo.get("llama")
    model, args, kwargs = zm.one_microbatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh={"pp": 2, "tp": 2}, schedule="1f1b",
                              time_limit_s=0.3, seed=0)
    assert [str(w.message) for w in caught if issubclass(w.category, PlanWarning)] == []  # costs modelled, all split
    assert plan.mesh == {"pp": 2, "dp_shard": 1, "dp_replicate": 1, "tp": 2}
    assert (plan.devices, plan.tp, plan.world_size, plan.microbatches) == (2, 2, 4, 4)  # tp does not divide the batch
    assert "tensor parallelism tp=2" in plan.summary() and "sequence parallelism on" in plan.summary()
    path = plan.save(tmp_path / "tp.plan.json")
    doc = json.loads(path.read_text())
    assert doc["tensor_parallel"]["params"]["lm_head.weight"] == "Shard(0)" and doc["mesh"]["tp"] == 2
    loaded = load_plan(path)
    assert loaded.tp == 2 and loaded.tensor_parallel == plan.tensor_parallel
    doc["tensor_parallel"]["params"]["lm_head.weight"] = "Shard(1)"
    with pytest.raises(InputError, match="tensor_parallel differs"):
        Plan.from_dict(doc)
    # a file saved before tensor parallelism (no tp, no tensor_parallel) is a tp = 1 plan
    pure = fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, mesh={"pp": 2}, schedule="1f1b",
                          time_limit_s=0.3, seed=0)
    doc = json.loads(pure.save(tmp_path / "pure.json").read_text())
    assert "tensor_parallel" not in doc and "tp" not in doc["mesh"]
    assert Plan.from_dict(doc).tp == 1 and Plan.from_dict(doc).tensor_parallel_warnings() == []
    # refused before planning: a degree that does not divide the heads; one wider than a node (h100-sxm: 8 GPUs)
    with pytest.raises(InputError, match="tp=8 does not divide the 4 heads"):
        fxpipe.compile(model, args, kwargs, devices=16, microbatches=4, mesh={"pp": 2, "tp": 8}, time_limit_s=0.3)
    wide = _MLP(vocab=48, width=48)  # 16 and 3 divide its widths and vocabulary, not the nodes of 8 GPUs
    for tp in (16, 3):
        with pytest.raises(InputError, match=f"tp={tp}: tensor parallelism runs inside a node"):
            fxpipe.compile(wide, (torch.zeros(2, 4, dtype=torch.long),), devices=tp, microbatches=4, mesh={"tp": tp},
                           time_limit_s=0.3)


def test_cli_mesh_with_tp_that_does_not_divide_exits_2(capsys):
    from fxpipe.cli import main

    code = main(["plan", "--hf", "gpt2", "--config", "n_layer=1", "n_embd=16", "n_head=2", "--seq-len", "4",
                 "--mesh", "pp=1,tp=3", "--microbatches", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "tp=3 does not divide the 64 output features" in err and "Traceback" not in err, err
