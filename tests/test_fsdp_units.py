"""Per-block FSDP2 units (``MemoryModel.fsdp_units="block"``): the memory model's working set and the costs.

Oracles: brute force over the (stage, block) units of random block chains, the parameters of a real
captured model counted from its torch modules (not from the graph), and the collective formulas
evaluated by hand.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint_policy import block_chain

from fxpipe.errors import InputError
from fxpipe.memory import MemoryModel
from fxpipe.memory.fsdp import additive_unsharded, block_units, unsharded_params
from fxpipe.mesh import mesh_memory
from fxpipe.mesh.costs import block_fsdp_parts_s, pipeline_dp_sync_s
from fxpipe.partition.memory import PartitionMemory, memory_inputs, num_params, stage_memory_bytes
from fxpipe.testing import zoo


def _brute_unsharded(graph, assignment, k):
    """Root parameters of each stage plus its two largest (stage, block) units, by enumeration."""
    unit = block_units(graph)
    p = num_params(graph)
    out = []
    for s in range(k):
        mine = [v for v in range(graph.n) if assignment[v] == s]
        root = sum(p[v] for v in mine if unit[v] < 0)
        per_block: dict[int, float] = {}
        for v in mine:
            if unit[v] >= 0:
                per_block[unit[v]] = per_block.get(unit[v], 0.0) + p[v]
        out.append(root + sum(sorted(per_block.values(), reverse=True)[:2]))
    return np.array(out)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), blocks=st.integers(1, 6), per_block=st.integers(2, 5), k=st.integers(1, 4),
       cuts=st.data())
def test_unsharded_params_are_the_root_and_two_largest_blocks_and_the_partitioner_bounds_them(seed, blocks, per_block,
                                                                                              k, cuts):
    g = block_chain(seed, blocks, per_block)
    bounds = sorted(cuts.draw(st.lists(st.integers(1, g.n - 1), min_size=k - 1, max_size=k - 1)))
    a = np.searchsorted(np.array(bounds), np.arange(g.n), side="right")  # contiguous stages in program order
    got = unsharded_params(g, a, k, num_params(g))
    np.testing.assert_allclose(got, _brute_unsharded(g, a, k))
    per_node, per_stage = additive_unsharded(g, num_params(g))
    additive = np.bincount(a, weights=per_node, minlength=k) + per_stage
    assert np.all(additive >= got - 1e-9)  # the kernels' per-node sum never counts less
    # the partitioner's exact count and its kernel arrays agree with the model on every stage
    model = MemoryModel(capacity_bytes=1e12, data_parallel=4, zero_stage=3, fsdp_units="block")
    exact = stage_memory_bytes(g, a, k, "training", PartitionMemory(model))
    plain = stage_memory_bytes(g, a, k, "training", PartitionMemory(MemoryModel(capacity_bytes=1e12, data_parallel=4,
                                                                                zero_stage=3)))
    np.testing.assert_allclose(exact - plain, got * 4.0)  # mixed-adam: 2 bytes of weights + 2 of gradients, full
    mem_param, *_rest = memory_inputs(g, k, "training", PartitionMemory(model))
    usable = _rest[2]
    kernel = np.bincount(a, weights=mem_param, minlength=k) + (model.usable_bytes - usable)
    plain_param = memory_inputs(g, k, "training", PartitionMemory(MemoryModel(capacity_bytes=1e12, data_parallel=4,
                                                                              zero_stage=3)))[0]
    assert np.all(kernel - np.bincount(a, weights=plain_param, minlength=k) >= got * 4.0 - 1e-6)


def test_block_units_shard_everything_and_add_the_working_set():
    m = MemoryModel(capacity_bytes=1e12, data_parallel=8, zero_stage=3, fsdp_units="block")
    assert m.block_units and m.unsharded_bytes_per_param("training") == 4.0
    p, g, o = m.static_bytes([800.0, 1600.0], "training", [100.0, 300.0])
    np.testing.assert_allclose(p, [800 * 2 / 8 + 100 * 2, 1600 * 2 / 8 + 300 * 2])
    np.testing.assert_allclose(g, [800 * 2 / 8 + 100 * 2, 1600 * 2 / 8 + 300 * 2])
    np.testing.assert_allclose(o, [800 * 12 / 8, 1600 * 12 / 8])
    # without block units (or in inference) the working set is not counted
    for other in (MemoryModel(capacity_bytes=1e12, data_parallel=8, zero_stage=3),
                  MemoryModel(capacity_bytes=1e12, data_parallel=8, zero_stage=1, fsdp_units="block")):
        assert not other.block_units
        np.testing.assert_allclose(other.static_bytes([800.0], "training", [100.0])[0],
                                   other.static_bytes([800.0], "training")[0])
    assert m.unsharded_bytes_per_param("inference") == 0.0
    with pytest.raises(InputError, match="unsharded_params_per_stage"):
        m.static_bytes([1.0, 2.0], "training", [1.0])


def test_mesh_memory_records_the_units_and_old_plan_files_read_as_whole_stages():
    base = MemoryModel(capacity_bytes=80e9)
    assert mesh_memory(base, {"pp": 1, "dp_shard": 4}).zero_stage == 1
    blk = mesh_memory(MemoryModel(capacity_bytes=80e9, fsdp_units="block"), {"pp": 1, "dp_shard": 4})
    assert (blk.zero_stage, blk.data_parallel, blk.fsdp_units) == (3, 4, "block")
    assert MemoryModel.from_dict(blk.to_dict()) == blk
    old = blk.to_dict()
    del old["fsdp_units"]
    old["zero_stage"] = 1
    assert MemoryModel.from_dict(old).fsdp_units is None and not MemoryModel.from_dict(old).block_units
    with pytest.raises(InputError, match="fsdp_units"):
        MemoryModel(fsdp_units="layer")
    with pytest.raises(InputError, match="fsdp_units"):
        MemoryModel.from_dict({**blk.to_dict(), "fsdp_units": 3})


def test_block_collectives_follow_the_ring_formulas():
    g = block_chain(7, 4, 4)
    a = np.zeros(g.n, dtype=np.int64)
    mesh = {"pp": 1, "dp_shard": 4}
    bw = g.bandwidth_bytes_per_s
    unit = block_units(g)
    pb = np.asarray(g.size_param_bytes)
    ring = 3 / 4 / bw
    blocks = [pb[unit == b].sum() for b in range(int(unit.max()) + 1)]
    root = pb[unit < 0].sum()
    for m in (1, 3):
        (gather, reduce, exposed, total), = block_fsdp_parts_s(g, a, [0], mesh, m)
        assert math.isclose(total, root * 2 * ring + m * sum(3 * b * ring for b in blocks))
        assert math.isclose(gather, root * ring + max(blocks) * ring)
        assert math.isclose(reduce, root * ring + max(blocks) * ring)
        want = 0.0
        for b in range(len(blocks)):
            f = np.asarray(g.t_fwd_s)[unit == b].sum()
            bw_t = (np.asarray(g.t_bwd_input_s) + np.asarray(g.t_bwd_weight_s))[unit == b].sum()
            want += max(0.0, blocks[b] * ring - f) + max(0.0, 2 * blocks[b] * ring - bw_t)
        assert math.isclose(exposed, m * want)
        blk = mesh_memory(MemoryModel(fsdp_units="block"), mesh)
        assert math.isclose(pipeline_dp_sync_s(g, a, [0], mesh, memory=blk, num_microbatches=m), total)
    # HSDP: every block's gradient shard is also all-reduced over dp_replicate each micro-batch, the root's once
    hsdp = {"pp": 1, "dp_shard": 2, "dp_replicate": 3}
    ring2, ar = 1 / 2 / bw, 2 * 2 / 3 / 2 / bw  # over 2 shards; all-reduce of a 1/2 shard over 3 replicas
    (_, reduce, _, total), = block_fsdp_parts_s(g, a, [0], hsdp, 2)
    assert math.isclose(total, root * (2 * ring2 + ar) + 2 * sum(b * (3 * ring2 + ar) for b in blocks))
    assert math.isclose(reduce, root * (ring2 + ar) + max(blocks) * (ring2 + ar))
    # links fast enough: every block's collectives hide behind its compute
    fast = dataclasses.replace(g, bandwidth_bytes_per_s=1e15)
    assert block_fsdp_parts_s(fast, a, [0], mesh, 8)[0][2] == 0.0


def test_a_captured_llama_plans_per_block_units_with_its_modules_parameters():
    """The device table of a dp_shard=2 plan with block units holds the sharded state plus the root's and two
    layers' full weights and gradients, counted here from the torch modules (not from the graph)."""
    import fxpipe
    from fxpipe.testing import zoo

    model, a, k = zoo.get("llama").one_microbatch()
    plan = fxpipe.compile(model, a, k, devices=2, microbatches=2, mesh={"dp_shard": 2}, hardware="h100-sxm",
                          memory=MemoryModel(fsdp_units="block"), time_limit_s=1, schedule_time_limit_s=0)
    assert plan.memory.fsdp_units == "block" and plan.memory.zero_stage == 3
    per_layer: dict[str, int] = {}
    root = 0
    for name, prm in model.named_parameters():
        parts = name.split(".")
        if "layers" in parts:
            key = ".".join(parts[:parts.index("layers") + 2])
            per_layer[key] = per_layer.get(key, 0) + prm.numel()
        else:
            root += prm.numel()
    total = root + sum(per_layer.values())
    working = root + sum(sorted(per_layer.values(), reverse=True)[:2])
    row = plan.device_table[0]
    assert math.isclose(row.params_bytes, total * 2 / 2 + working * 2, rel_tol=1e-9)
    assert math.isclose(row.grads_bytes, total * 2 / 2 + working * 2, rel_tol=1e-9)
    assert math.isclose(row.optimizer_bytes, total * 12 / 2, rel_tol=1e-9)
    again = fxpipe.Plan.from_dict(plan.to_dict())
    assert again.memory.fsdp_units == "block" and again.device_table[0].params_bytes == row.params_bytes
    assert "FSDP2 unit per block" in plan.memory_summary()


# ----------------------------------------------------------------------------- runtime on 2 gloo ranks
class _Llama4(zoo.ZooModel):
    """The matrix's tiny Llama with 4 layers (2 would put every block in the unsharded working set)."""

    def _make(self, batch, g, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model, args, kwargs, target = zoo._decoder("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=4)(
                batch, g, build)
        if model is not None:
            model.eval()
        return model, args, kwargs, target


def test_per_block_units_train_like_one_process_and_hold_what_the_model_predicts():
    """dp_shard=2 with per-block FSDP2 units trains to the single-process gradients, each rank holds at most
    the root's and two blocks' parameters unsharded (measured), and whole-stage units hold all of them."""
    import fxpipe
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.plan.build import fsdp_blocks

    zm = _Llama4("llama")
    model, a, k = zm.one_microbatch()
    plans = {(units, ac): fxpipe.compile(model, a, k, devices=2, microbatches=4, mesh={"dp_shard": 2}, schedule="1f1b",
                                         memory=MemoryModel(fsdp_units=units), activation_checkpointing=ac,
                                         time_limit_s=1, schedule_time_limit_s=0)
             for units, ac in (("block", "none"), ("stage", "none"), ("block", "full"))}
    assert {p.kind for p in plans["block", "full"].activation_checkpointing} == {"full"}
    assert fsdp_blocks(plans["block", "none"]) == tuple(f"model.layers.{i}" for i in range(4))
    assert fsdp_blocks(plans["stage", "none"]) is None
    runs = [dict(make_model=zm, stage_of=p.worker_stage_of(), orders=p.orders(), num_microbatches=p.global_microbatches,
                 make_batch=zm.batch, loss=zm.loss, steps=2, lr=0.05, mesh={**p.mesh, "order": p.rank_order},
                 fsdp_blocks=fsdp_blocks(p), activation_checkpointing=p.activation_checkpointing) for p in plans.values()]
    # what they do not run with yet is refused before any worker starts
    with pytest.raises(InputError, match="whole-stage recomputation"):
        spawn_train_many([{**runs[0], "recompute_stages": (0,)}], world_size=2)
    with pytest.raises(InputError, match="optimizer offload"):
        spawn_train_many([{**runs[0], "offload_optimizer": True}], world_size=2)
    block, stage, full = spawn_train_many(runs, world_size=2, timeout_s=600)
    ref = reference_train(zm, zm.batch, num_microbatches=4, steps=2, lr=0.05, loss=zm.loss)
    for res in (block, stage, full):
        cmp = compare_training(res, ref)
        assert cmp.ok, cmp.problems
    assert block.meta["fsdp_blocks"][0] == full.meta["fsdp_blocks"][0] == [f"model.layers.{i}" for i in range(4)]
    # the checkpoint segments ran inside the blocks: replayed in the backward
    assert full.meta["checkpointing"][0]["pieces"]
    for r in (0, 1):
        st = next(iter(full.meta["activation"][r]["stages"].values()))
        assert st["replays"] >= 4 * 4 and st["segment_runs"] >= 4 * 4  # 4 layers x 4 micro-batches, each step
    p = plans["block", "none"]
    a0 = np.zeros(p.graph.n, dtype=np.int64)
    predicted = float(unsharded_params(p.graph, a0, 1, num_params(p.graph))[0])
    total = float(num_params(p.graph).sum())
    layer = sum(prm.numel() for prm in model.model.layers[0].parameters())
    for r in (0, 1):
        for res in (block, full):
            measured = res.meta["unsharded_peak_params"][r][0]
            assert total - 4 * layer + layer <= measured <= predicted  # at least the root and one block, at most two
        assert stage.meta["unsharded_peak_params"][r][0] == total > predicted


def test_the_search_and_a_pinned_mesh_turn_to_per_block_units_when_whole_stages_do_not_fit():
    """Memory between what dp_shard=4 needs with per-block units and with whole-stage units: a pinned
    {"dp_shard": 4} plans with block units (recorded in the plan), and the mesh search plans that candidate
    beside the whole-stage one it skips (planning only)."""
    import fxpipe
    from fxpipe.mesh.search import BLOCK_UNITS_SUFFIX

    zm = _Llama4("llama")
    model, a, k = zm.one_microbatch()
    kw = dict(devices=4, microbatches=4, activation_checkpointing="none", time_limit_s=1, schedule_time_limit_s=0,
              hardware="h100-sxm")
    need = {}
    for units in ("stage", "block"):
        d = fxpipe.compile(model, a, k, mesh={"dp_shard": 4}, memory=MemoryModel(fsdp_units=units), **kw).device_table[0]
        need[units] = d.memory_bytes - d.reserved_bytes
    assert need["block"] < need["stage"]  # 4 layers over 4 ranks: the root and two layers unsharded cost less
    cap = (need["block"] + need["stage"]) / 2 / 0.9  # 10 % reserved
    pinned = fxpipe.compile(model, a, k, mesh={"dp_shard": 4}, memory_bytes=cap, **kw)
    assert pinned.memory.fsdp_units == "block" and pinned.memory.zero_stage == 3
    assert all(d.fits for d in pinned.device_table)
    with pytest.raises(fxpipe.errors.InfeasibleError):
        fxpipe.compile(model, a, k, mesh={"dp_shard": 4}, memory_bytes=cap, memory=MemoryModel(fsdp_units="stage"), **kw)
    plan = fxpipe.compile(model, a, k, mesh="auto", memory_bytes=cap, **kw)
    rows = {r["mesh_text"]: r for r in plan.options["mesh_search"]}
    assert "predicted_step_s" in rows["dp_shard=4" + BLOCK_UNITS_SUFFIX] and "skipped" in rows["dp_shard=4"]
    assert plan.memory.fsdp_units == ("block" if BLOCK_UNITS_SUFFIX in next(
        t for t, r in rows.items() if r.get("chosen")) else None)


@pytest.mark.slow
def test_per_block_units_on_4_ranks_with_pipelining_hsdp_and_checkpointing():
    """pp=2 x dp_shard=2 (1F1B; ZB-H1 with "full" segments, its W fused into B) and HSDP dp_shard=2 x
    dp_replicate=2 ("selective") with per-block units train like one process."""
    import fxpipe
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.plan.build import fsdp_blocks

    zm = _Llama4("llama")
    model, a, k = zm.one_microbatch()
    cases = [({"pp": 2, "dp_shard": 2}, "1f1b", "none"), ({"pp": 2, "dp_shard": 2}, "zb-h1", "full"),
             ({"dp_shard": 2, "dp_replicate": 2}, "1f1b", "selective")]
    runs = []
    for mesh, schedule, ac in cases:
        p = fxpipe.compile(model, a, k, devices=4, microbatches=4, mesh=mesh, schedule=schedule,
                           memory=MemoryModel(fsdp_units="block"), activation_checkpointing=ac, time_limit_s=1,
                           schedule_time_limit_s=0)
        assert p.memory.block_units and {c.kind for c in p.activation_checkpointing} == {ac}
        runs.append(dict(make_model=zm, stage_of=p.worker_stage_of(), orders=p.orders(),
                         num_microbatches=p.global_microbatches, make_batch=zm.batch, loss=zm.loss, steps=2, lr=0.05,
                         mesh={**p.mesh, "order": p.rank_order}, fsdp_blocks=fsdp_blocks(p),
                         activation_checkpointing=p.activation_checkpointing))
    ref = reference_train(zm, zm.batch, num_microbatches=4, steps=2, lr=0.05, loss=zm.loss)
    for (mesh, schedule, ac), res in zip(cases, spawn_train_many(runs, world_size=4, timeout_s=900)):
        cmp = compare_training(res, ref)
        assert cmp.ok, (mesh, schedule, ac, cmp.problems)
        assert all(res.meta["fused_full_backward"].values())  # a block reduces its gradients after its backward
        assert sorted(b for blocks in res.meta["fsdp_blocks"].values() for b in blocks)[-1] == "model.layers.3"


def test_the_search_tries_block_units_where_whole_stage_units_expose_the_sync():
    """A candidate whose whole-stage units leave more than BLOCK_UNITS_SYNC_SHARE of its step to exposed sync is
    planned with per-block units too, and the search keeps whichever predicts the shorter step."""
    import warnings

    import fxpipe
    from fxpipe.mesh.search import BLOCK_UNITS_SUFFIX, BLOCK_UNITS_SYNC_SHARE
    from fxpipe.models import build_hf_model

    model, args, kwargs = build_hf_model("gpt2", {"n_layer": 8, "n_embd": 256, "n_head": 4, "seq_len": 64},
                                         device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxpipe.compile(model, args, kwargs, devices=4, microbatches=8, time_limit_s=1.0, seed=0)
    rows = plan.options["mesh_search"]
    planned = [r for r in rows if r.get("predicted_step_s") is not None]
    exposed = [r for r in planned if r["fsdp_units"] == "stage" and not r["offload_optimizer"]
               and r["exposed_sync_s"] > BLOCK_UNITS_SYNC_SHARE * r["predicted_step_s"]
               and r["mesh"].get("dp_shard", 1) > 1]
    assert exposed, [(r["mesh_text"], r.get("exposed_sync_s")) for r in planned]
    for r in exposed:  # each has its per-block twin in the table
        assert any(b["mesh_text"] == r["mesh_text"] + BLOCK_UNITS_SUFFIX for b in rows), r["mesh_text"]
    best = min(r["predicted_step_s"] for r in planned)
    assert plan.predicted_step_s == pytest.approx(best)
    quiet = [r for r in planned if r["fsdp_units"] == "stage" and r["mesh"].get("dp_shard", 1) > 1
             and r["exposed_sync_s"] <= BLOCK_UNITS_SYNC_SHARE * r["predicted_step_s"] and not r["offload_optimizer"]]
    for r in quiet:  # a whole-stage candidate that hides its sync and fits gets no per-block twin
        assert not any(b["mesh_text"] == r["mesh_text"] + BLOCK_UNITS_SUFFIX for b in rows), r["mesh_text"]
