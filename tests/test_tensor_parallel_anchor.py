"""Every layer's attention is split across tensor-parallel ranks when constants are copied per layer (issue 29).

At long sequences :mod:`fxpipe.passes.duplicate_constants` gives every layer after the first its
own copy of the causal mask, tied to the layer by an empty view (``as_strided(h, [0], [1], 0)``)
of an input ``h`` of the layer's first reader, in an attention layer the head-sharded query.
DTensor has no rule for ``as_strided`` of a sharded tensor, and the finder used to reject those
attention regions: attention stayed replicated on every tensor-parallel rank in every layer but
the first. The anchor reads no element, so the finder now replicates it without cutting the
region (role ``shape``) and the runtime computes it from the query's local heads:

* the capture of a Llama of the matrix at 1536 tokens (a 2.4M-element mask, copied per layer)
  has an attention and an MLP region in every layer, nothing rejected;
* the runtime's stage graph reads every anchor's input as the rank's local tensor (no gather);
* at ``{"tp": 2}`` on 2 gloo ranks it trains equal to one process (losses, gradients, parameters);
  slow: the same at ``{"pp": 2, "tp": 2}`` on 4 ranks.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fxpipe  # noqa: E402
from fxpipe.cli.plan_cmd import HFFactory, _BatchFn  # noqa: E402
from fxpipe.codegen.launch import reference_train, spawn_train_many  # noqa: E402
from fxpipe.passes.duplicate_constants import DUPLICATED_KEY, REPORT_KEY  # noqa: E402
from fxpipe.passes.structure import module_path  # noqa: E402
from fxpipe.passes.tensor_parallel import find_tensor_parallel, reads_no_value  # noqa: E402

from helpers import assert_same_training  # noqa: E402

#: the matrix's Llama (grouped-query attention) at a sequence whose causal mask is worth recomputing per layer
SEQ, LAYERS, MB = 1536, 3, 2
CONFIG = {"num_hidden_layers": LAYERS, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": SEQ}


def _factory(layers: int = LAYERS) -> HFFactory:
    return HFFactory("llama", {**CONFIG, "num_hidden_layers": layers}, microbatches=MB, microbatch_size=1,
                     seq_len=SEQ, seed=0)


@pytest.fixture(scope="module")
def plan():
    model, args, kwargs = _factory().one_microbatch()
    return fxpipe.compile(model, args, kwargs, devices=2, microbatches=MB, mesh={"tp": 2}, schedule="1f1b",
                          time_limit_s=0.3, seed=0)


def _layer(module: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", module + ".")
    return int(m.group(1)) if m else None


def test_every_layer_attention_is_split_with_copied_constants(plan):
    gm = plan.capture.traced.gm
    assert gm.meta[REPORT_KEY]["duplicated"], "the mask is copied per layer at this sequence"
    st = find_tensor_parallel(gm)
    kinds: dict[int, list[str]] = {}
    for r in st.regions:
        if _layer(r["module"]) is not None:
            kinds.setdefault(_layer(r["module"]), []).append(r["kind"])
    assert kinds == {i: ["attention", "mlp"] for i in range(LAYERS)}, (kinds, st.rejected)
    assert not st.rejected
    # the anchors of the copies: replicated empty vectors read from a split attention's query
    shape = [n for n in gm.graph.nodes if st.roles.get(n.name) == "shape"]
    assert shape and all(reads_no_value(n) for n in shape)
    anchored = [n for n in shape if any(st.node_region.get(a.name) is not None for a in n.all_input_nodes)]
    prefix = gm.meta.get("fxpipe_module_prefix", "")
    assert {_layer(module_path(n, prefix)) for n in anchored} == set(range(1, LAYERS))
    # and they tie copies of the mask (the region reads them as a replicated operand)
    copies = [n for n in gm.graph.nodes if DUPLICATED_KEY in n.meta]
    assert copies and not any(st.roles.get(n.name) for n in copies)
    # the plan prices a split attention in every layer
    assert len(plan.tensor_parallel.regions) == len(st.regions)


class _Mesh:
    """The ``tp`` sub-mesh's size, all a graph rewrite reads of it (the conversions it inserts are not run here)."""

    def size(self) -> int:
        return 2


def test_the_runtime_reads_an_anchor_from_the_local_heads(plan):
    from fxpipe.codegen.split import split_stages
    from fxpipe.codegen.tensor_parallel import TensorParallelRank

    gm = plan.capture.traced.gm
    st = find_tensor_parallel(gm)
    staged = split_stages(gm, {n.name: 0 for n in gm.graph.nodes}, 1)
    spec = staged.stages[0]
    tpr = TensorParallelRank(st, _Mesh())
    tpr._rewrite(spec, spec.module)
    seen = 0
    for n in spec.module.graph.nodes:
        if st.roles.get(n.name) != "shape":
            continue
        for a in n.all_input_nodes:
            conv = getattr(a.target, "__name__", "") if a.op == "call_function" else ""
            if conv.startswith("tp_"):
                assert conv in ("tp_dt_local", "tp_sp_local", "tp_param_local"), (n.name, conv)
                seen += conv == "tp_dt_local"
    assert seen == LAYERS - 1  # one anchor per copying layer, each on its query's local heads


def _train_equal(layers: int, mesh: dict) -> None:
    """The repro Llama planned with ``mesh`` trains on gloo ranks like one process."""
    fac = _factory(layers=layers)
    model, args, kwargs = fac.one_microbatch()
    world = 1
    for v in mesh.values():
        world *= v
    p = fxpipe.compile(model, args, kwargs, devices=world, microbatches=MB, mesh=mesh, schedule="1f1b",
                       time_limit_s=0.3, seed=0)
    assert p.capture.traced.gm.meta[REPORT_KEY]["duplicated"]
    assert [r["kind"] for r in find_tensor_parallel(p.capture.traced.gm).regions].count("attention") == layers
    run = dict(make_model=fac, stage_of=p.worker_stage_of(), orders=p.orders(), num_microbatches=MB,
               make_batch=_BatchFn(fac), loss=fac.loss, steps=2, lr=0.05, mesh={**p.mesh, "order": p.rank_order},
               model_key="llama-copied-mask", tensor_parallel_params=p.tensor_parallel.params)
    res = spawn_train_many([run], world_size=world, timeout_s=900)
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=MB, steps=2, lr=0.05, loss=fac.loss)
    assert ref.losses[1] != ref.losses[0]
    assert_same_training(res[0], ref, f"llama at {SEQ} tokens, {mesh}")


def test_tp2_with_copied_constants_trains_like_one_process():
    _train_equal(2, {"tp": 2})


@pytest.mark.slow
def test_pp2_tp2_with_copied_constants_trains_like_one_process():
    # the copying layers on the second stage, whose inputs arrive as sequence shards
    _train_equal(LAYERS, {"pp": 2, "tp": 2})
