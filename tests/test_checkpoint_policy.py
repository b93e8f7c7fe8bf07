"""Activation-checkpoint policies of a stage (issue 28): the menu's costs on random block chains, the
budget's knapsack against brute force, the blocks found on graphs, and the policy's file form."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.memory.checkpoint import (
    CHECKPOINT_KINDS,
    CheckpointPolicy,
    _evaluate,
    _graph_model,
    find_blocks,
    kind_of,
    knapsack_keep,
    partition_floor,
    stage_menu,
)

KINDS = ("elementwise", "matmul_param", "matmul", "attention", "shape")


def block_chain(seed: int, blocks: int, per_block: int, *, identity: bool = True, integer: bool = False) -> OpGraph:
    """A captured-like graph: an input, an embedding, ``blocks`` blocks of ``per_block`` ops (module paths
    ``layers.<i>.op<j>``, a random DAG inside each whose first op reads the previous block's last, and a tensor
    from before the blocks read by every block, like a rotary table), then a head and the output. Ids are
    program order. Every op saves a random subset of its inputs (and an attention op its output); its
    ``act_bytes`` are the tensors it saves first plus random private bytes, as the capture counts them."""
    rng = np.random.default_rng(seed)
    names, mods, kinds, edges = ["x"], [""], ["input"], []
    ops = ["placeholder"]

    def add(name, mod, kind, preds):
        names.append(name)
        mods.append(mod)
        kinds.append(kind)
        ops.append("call_function")
        for p in preds:
            edges.append((p, len(names) - 1))
        return len(names) - 1

    emb = add("emb", "embed", "embedding", [0])
    table = add("table", "rotary", "elementwise", [0])
    prev = emb
    for b in range(blocks):
        ids = []
        for j in range(per_block):
            preds = [prev] if j == 0 else sorted(set(rng.choice(ids, size=min(len(ids), int(rng.integers(1, 3))),
                                                                 replace=False).tolist()))
            if j == 1:
                preds = sorted(set(preds + [table]))
            kind = "matmul_param" if j == 1 else (str(rng.choice(KINDS[:4])) if j else "elementwise")
            ids.append(add(f"b{b}_{j}", f"layers.{b}.op{j}" if j else f"layers.{b}", kind, preds))
        last = add(f"b{b}_res", f"layers.{b}", "elementwise", [ids[-1], prev])
        prev = last
    head = add("head", "lm_head", "matmul_param", [prev])
    add("output", "", "output", [head])
    ops[-1] = "output"
    n = len(names)
    draw = (lambda lo, hi: rng.integers(lo, hi, n).astype(float)) if integer else (lambda lo, hi: rng.uniform(lo, hi, n))
    size = np.round(draw(1, 50))
    t_fwd = draw(1, 10) * 1e-3
    t_w = np.where(np.isin(kinds, ("matmul_param", "embedding")), draw(1, 5) * 1e-3, 0.0)
    preds = {v: [] for v in range(n)}
    for u, v in edges:
        preds[v].append(u)
    extra, act, first = [], np.zeros(n), set()
    for v in range(n):
        saved = [u for u in preds[v] if ops[u] != "placeholder" and rng.random() < 0.6]
        if kinds[v] == "attention":
            saved.append(v)
        if ops[v] in ("placeholder", "output"):
            saved = []
        private = float(np.round(rng.uniform(0, 5))) if saved or rng.random() < 0.3 else 0.0
        act[v] = sum(size[u] for u in saved if u not in first) + private
        first.update(saved)
        e = {"module": mods[v], "kind": kinds[v], "target": kinds[v]}
        if identity and saved:
            e["saved"] = [names[u] for u in saved]
        extra.append(e)
    t_fwd[0] = t_fwd[-1] = 0.0
    return OpGraph.from_arrays(t_fwd_s=t_fwd, t_bwd_input_s=t_fwd * 1.5, t_bwd_weight_s=t_w, size_out_bytes=size,
                               size_param_bytes=np.where(t_w > 0, 100.0, 0.0), act_bytes=act, edges=edges,
                               names=names, ops=ops, extra=extra, bandwidth_bytes_per_s=1e3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), blocks=st.integers(1, 4), per_block=st.integers(2, 7), identity=st.booleans(),
       cut=st.data())
def test_the_menu_of_any_stage_keeps_no_more_than_none_and_replays_what_it_drops(seed, blocks, per_block, identity, cut):
    g = block_chain(seed, blocks, per_block, identity=identity)
    lo = cut.draw(st.integers(0, g.n - 2))
    hi = cut.draw(st.integers(lo + 1, g.n))
    nodes = np.arange(lo, hi)
    menu = stage_menu(g, nodes)
    names = [e.name for e in menu]
    assert names[0] == "none" and len(set(names)) == len(names)
    none = menu[0].policy
    assert none.replay_s == 0.0 and none.replay_peak_bytes == 0.0 and menu[0].peak_bytes == 0.0
    assert none.kept_bytes == pytest.approx(float(g.act_bytes[nodes].sum()))  # the stash as the memory model counts it
    body_t = float(g.t_fwd_s[nodes].sum())
    by = {e.name: e for e in menu}
    for e in menu[1:]:
        p = e.policy
        assert p.kind == kind_of(e.name) and p.kind in CHECKPOINT_KINDS
        assert p.kept_bytes < none.kept_bytes  # an option that keeps as much is never offered
        assert 0.0 <= p.replay_s <= body_t + 1e-12
        # the segments are disjoint runs of the stage in program order; kept outputs lie inside them
        seg_ids = [[g.names.index(x) for x in seg] for seg in p.segments]
        flat = [v for seg in seg_ids for v in seg]
        assert len(flat) == len(set(flat)) and set(flat) <= set(nodes.tolist())
        assert all(seg == sorted(seg) for seg in seg_ids)
        assert set(p.save) <= {g.names[v] for v in flat}
        # replay time: every op of a segment that is not kept
        keep = {g.names.index(x) for x in p.save}
        assert p.replay_s == pytest.approx(sum(float(g.t_fwd_s[v]) for v in flat if v not in keep), abs=1e-12)
        assert p.replay_peak_bytes >= 0 and e.peak_bytes >= 0 and e.w_bytes >= 0
        if e.name.endswith("-fused"):
            assert e.w_bytes == 0.0 and e.fused_w_s == pytest.approx(float(g.t_bwd_weight_s[nodes].sum()))
            assert p.kept_bytes + e.peak_bytes < by[e.name[:-6]].policy.kept_bytes + \
                max(by[e.name[:-6]].peak_bytes, by[e.name[:-6]].w_bytes - by[e.name[:-6]].policy.kept_bytes)
    if "stage" in by:  # the whole stage as one segment: replays every op, keeps nothing of its own
        body = [v for v in nodes if g.ops[v] not in ("placeholder", "output")]
        assert by["stage"].policy.replay_s == pytest.approx(float(g.t_fwd_s[body].sum()))
    if "full" in by:  # per block the least kept: selective and budget keep outputs on top of full's inputs
        for name in ("selective", "budget-1", "budget-2", "budget-3"):
            if name in by:
                assert by[name].policy.kept_bytes >= by["full"].policy.kept_bytes - 1e-9
                assert by[name].policy.replay_s <= by["full"].policy.replay_s + 1e-12


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), blocks=st.integers(2, 3), per_block=st.integers(2, 5))
def test_kept_bytes_grow_by_the_outputs_kept_and_replay_shrinks_by_their_forwards(seed, blocks, per_block):
    """Keeping an output (selective / budget) costs its bytes unless something keeps it already and saves its
    forward: kept and replayed time are additive in the kept set, which makes the budget a knapsack."""
    g = block_chain(seed, blocks, per_block)
    sm, found = _graph_model(g)
    nodes = np.arange(g.n)
    segs = [np.flatnonzero(found.block_of == b) for b in range(found.count)]
    base = _evaluate(sm, nodes, segs, set())
    rng = np.random.default_rng(seed)
    cand = np.concatenate(segs)
    keep = {int(v) for v in cand if rng.random() < 0.5}
    got = _evaluate(sm, nodes, segs, keep)
    kept_full = {u for u in range(g.n) if any(u in sm.saves[v] for v in nodes if found.block_of[v] < 0)}
    kept_full |= {u for seg in segs for v in seg for u in g.predecessors(int(v)).tolist()
                  if found.block_of[u] != found.block_of[int(v)] and g.ops[u] != "placeholder"}
    extra = sum(float(g.size_out_bytes[v]) for v in keep if v not in kept_full)
    assert got.kept_bytes == pytest.approx(base.kept_bytes + extra)
    assert got.replay_s == pytest.approx(base.replay_s - sum(float(g.t_fwd_s[v]) for v in keep))


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.integers(0, 9), min_size=1, max_size=9), weights=st.data(), cap=st.integers(0, 30))
def test_knapsack_is_the_brute_force_optimum_on_integer_bytes(values, weights, cap):
    w = weights.draw(st.lists(st.integers(0, 12), min_size=len(values), max_size=len(values)))
    chosen, total = knapsack_keep(values, w, cap)
    assert sum(w[i] for i in chosen) <= cap
    assert total == pytest.approx(sum(values[i] for i in chosen))
    best = max(sum(values[i] for i in c) for r in range(len(values) + 1) for c in itertools.combinations(range(len(values)), r)
               if sum(w[i] for i in c) <= cap)
    assert total == pytest.approx(best)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), per_block=st.integers(3, 4))
def test_budget_replays_least_of_every_kept_set_within_its_budget(seed, per_block):
    """The brute-force oracle on a tiny chain: among every set of kept outputs whose kept bytes fit a budget
    option's own bytes, none replays less than the option (integer sizes: the DP is exact)."""
    g = block_chain(seed, 2, per_block, integer=True)
    menu = stage_menu(g, np.arange(g.n), kinds=("none", "budget"))
    sm, found = _graph_model(g)
    nodes = np.arange(g.n)
    segs = [np.flatnonzero(found.block_of == b) for b in range(found.count)]
    cand = [int(v) for v in np.concatenate(segs) if g.t_fwd_s[v] > 0]
    assert len(cand) <= 10
    figs = {}
    for r in range(len(cand) + 1):
        for c in itertools.combinations(cand, r):
            f = _evaluate(sm, nodes, segs, set(c))
            figs[c] = (f.kept_bytes, f.replay_s)
    full_kept = figs[()][0]
    for e in menu:
        if not e.name.startswith("budget") or e.name.endswith("-fused"):
            continue
        level = int(e.name.split("-")[1])
        budget = full_kept + (0.25 * level) * (float(g.act_bytes.sum()) - full_kept)
        assert e.policy.kept_bytes <= budget + 1e-9
        best = min(rep for kept, rep in figs.values() if kept <= budget + 1e-9)
        assert e.policy.replay_s == pytest.approx(best, abs=1e-12)


def test_blocks_are_the_outermost_repeated_containers():
    def graph(modules, kinds):
        n = len(modules)
        return OpGraph.from_arrays(t_fwd_s=np.ones(n), size_out_bytes=np.ones(n), edges=[(i, i + 1) for i in range(n - 1)],
                                   extra=[{"module": m, "kind": k} for m, k in zip(modules, kinds)])

    mods = ["embed", "encoder.block.0.layer.0.q", "encoder.block.0.layer.1.wi", "encoder.block.1.layer.0.q",
            "encoder.block.1.layer.1.wi", "decoder.block.0.experts.0.w", "decoder.block.0.experts.1.w",
            "decoder.block.0", "decoder.block.1.experts.0.w", "head"]
    kinds = ["embedding"] + ["matmul_param"] * 8 + ["matmul_param"]
    b = find_blocks(graph(mods, kinds))
    assert b.names == ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    assert b.block_of.tolist() == [-1, 0, 0, 1, 1, 2, 2, 2, 3, -1]
    # a container whose indices hold no compute (or only one) is no stack of blocks
    assert find_blocks(graph(["a.0", "a.1", "b.0.x"], ["elementwise", "elementwise", "matmul"])).count == 0
    assert find_blocks(graph(["", "", ""], ["matmul"] * 3)).count == 0


def test_the_partitioner_floor_is_blocks_inputs_and_outside_stashes():
    g = block_chain(3, 3, 4)
    floor, allowance = partition_floor(g)
    assert np.all(floor >= 0) and allowance > 0
    sm, found = _graph_model(g)
    whole = stage_menu(g, np.arange(g.n), kinds=("none", "full"))
    full = next(e for e in whole if e.name == "full").policy
    # full checkpointing of the whole graph keeps at most the per-node floor (inputs counted once per producer)
    assert full.kept_bytes <= float(floor.sum()) + 1e-9
    assert full.replay_peak_bytes <= allowance + 1e-9


def test_policy_round_trips_and_names_the_bad_field():
    p = CheckpointPolicy("selective", segments=(("a", "b"), ("c",)), save=("b",), replay_s=1e-3, kept_bytes=10,
                         replay_peak_bytes=5)
    assert CheckpointPolicy.from_dict(p.to_dict()) == p
    assert p.nodes == frozenset({"a", "b", "c"})
    for doc, field in (({"segments": []}, "kind"), ({"kind": "fancy"}, "kind"),
                       ({"kind": "full", "segments": [["a"], ["a"]]}, "disjoint"),
                       ({"kind": "full", "segments": [["a"]], "save": ["z"]}, "save"),
                       ({"kind": "full", "replay_s": -1}, "replay_s"),
                       ({"kind": "none", "segments": [["a"]]}, "none"),
                       ({"kind": "full", "kept_bytes": math.nan}, "kept_bytes")):
        with pytest.raises(InputError, match=field) as info:
            CheckpointPolicy.from_dict(doc, source="plan.json: activation_checkpointing[3]")
        assert "plan.json: activation_checkpointing[3]" in str(info.value)
    with pytest.raises(InputError, match="choose from"):
        stage_menu(block_chain(0, 1, 2), [0, 1], kinds=("none", "everything"))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), blocks=st.integers(2, 4), per_block=st.integers(3, 6), m=st.integers(1, 4),
       squeeze=st.floats(0.001, 0.99))
def test_a_stage_admitted_with_checkpointing_has_a_schedule(seed, blocks, per_block, m, squeeze):
    """The partitioner admits a stage whose static state and one stash overflow when per-block checkpointing
    keeps it within the capacity (issue 28): a capacity between the two rules for the whole graph on one
    device plans, checkpointing (every option keeps at most the partitioner's per-node floor and replays at
    most one block beyond it at a time; one micro-batch at a time needs no more)."""
    from fxpipe.api import plan_graph
    from fxpipe.memory import MemoryModel
    from fxpipe.partition.memory import PartitionMemory, stage_memory_bytes

    g = block_chain(seed, blocks, per_block)
    a = np.zeros(g.n, dtype=np.int64)
    need = [float(stage_memory_bytes(g, a, 1, "training", PartitionMemory(MemoryModel(), m, checkpointing=c), "relay")[0])
            for c in (True, False)]
    assert need[0] <= need[1]
    if need[0] == need[1]:
        return  # nothing to gain on this graph
    cap = (need[0] + squeeze * (need[1] - need[0])) / 0.9  # fits only by the checkpointing rule
    part, problem, sched, _ = plan_graph(g, devices=1, microbatches=m, memory_bytes=cap, time_limit_s=0.2,
                                         schedule_time_limit_s=0)
    assert any(c != "none" for c in problem.checkpoint)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), blocks=st.integers(1, 3), per_block=st.integers(3, 7))
def test_no_policy_keeps_an_output_a_later_in_place_op_may_write(seed, blocks, per_block):
    """A kept output is the forward's tensor object: when an in-place op (``aten.add_``) reads it, the selective
    and budget keep sets leave it (and its views) to the replay; without the in-place op it may be kept."""
    import dataclasses

    g = block_chain(seed, blocks, per_block)
    nodes = np.arange(g.n)
    kept = {n for e in stage_menu(g, nodes, fused=False) for n in e.policy.save}
    if not kept:
        return
    index = {name: i for i, name in enumerate(g.names)}
    read = [index[n] for n in sorted(kept) if g.successors(index[n]).size]
    if not read:
        return
    victim = read[0]
    writer = int(g.successors(victim)[0])
    extra = [dict(e) for e in g.extra]
    extra[writer]["target"] = "aten.add_.Tensor"
    g2 = dataclasses.replace(g, extra=extra)
    kept2 = {index[n] for e in stage_menu(g2, nodes, fused=False) for n in e.policy.save}
    written = {victim} | {int(u) for u in g2.predecessors(writer)}
    assert not kept2 & written, (sorted(kept2 & written), g.names[writer])
