"""Execute a stage's activation-checkpoint policy (issue 28): segments carved out of the stage program.

A :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` names, in the plan's node names, the
segments of a stage that the backward replays and the nodes inside them whose outputs are kept
(``save``). This module turns it into the stage's program; :mod:`fxpipe.codegen.stash` runs it.

Names
    :func:`captured_policies` maps the plan's node names to this process's capture through the
    structural matching the stage map uses (:func:`fxpipe.passes.structure.match_nodes`), so a
    worker whose capture names nodes differently runs exactly the planned segments.

Carving (:func:`apply_checkpoint`)
    Each segment becomes one ``call_module`` of a :class:`CheckpointSegment` in the stage's
    ``GraphModule`` (edited in place and reversibly: a later call with another policy, or
    ``None``, restores the plain program first). Its inputs are the values the segment reads
    from outside (activations, and the parameters and buffers it uses, read by the stage's own
    ``get_attr`` nodes so that FSDP2's unsharded parameters are what it gets), its outputs the
    values used after it. A segment is the span of the stage program from its first to its last
    listed node (the trivial ops a plan does not list - views, ``getitem`` - come with it). It is
    cut where it must not replay: at an op that updates in place a tensor made outside the
    segment (replaying it would update it twice), and a span whose input is updated in place
    after it is not carved (its replay would read the new value). Each piece is contiguous in
    program order, hence convex (no path leaves it and comes back).

Replay (:mod:`fxpipe.codegen.stash`)
    Inside a stage forward run by the stash, a :class:`CheckpointSegment` runs its body under
    saved-tensor hooks that keep *placeholders* instead of what autograd saves (non-reentrant
    checkpointing, Chen et al. 2016; torch's ``torch.utils.checkpoint(use_reentrant=False)``
    mechanism); the first time the backward needs one, the segment's body runs again on its
    kept inputs, with the random-number state and the updated state of the original forward,
    and fills every placeholder by position. Outside a stash (shape inference, a plain call,
    ``torch.no_grad``) the body runs as is.

Kept outputs (``save``)
    The op-level selective checkpointing of torch (``create_selective_checkpoint_contexts``)
    decides per ATen op; a plan decides per fx node. Each kept node of a body calls its op
    through a :class:`KeptOp`, so the current node is known while its ops dispatch; a dispatch interceptor
    (:func:`fxpipe.codegen.runtime.op_interceptor`) sees every ATen op of a kept node, and when
    the node has run the stash keeps exactly the op results whose storage *is* the node's output
    (not views of its inputs, not temporaries of a decomposed op); the replay returns those
    instead of running the op, keyed by (node, op, occurrence) as torch keys its cache by
    (op, occurrence). torch's own contexts cannot be used as they are: their cache is a private
    dict that neither the stash's accounting nor its offload can reach, and their policy runs
    before the node's output is known.

``compile_stages``
    Inductor partitions the joint graph itself; :func:`tag_for_compile` marks the segments'
    nodes ``PREFER_RECOMPUTE`` and the kept ones ``MUST_SAVE`` with one ``ac_graph_id`` per
    segment (the tags torch's selective checkpointing gives ``torch.compile``), which the
    min-cut partitioner honours. The stash does not see inside compiled stages, so they are not
    measured.

References
----------
Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174, 2016;
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023
(selective recomputation); torchtitan's selective op AC (``apply_ac``, every other ``mm`` saved).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.errors import InputError

__all__ = [
    "CheckpointSegment",
    "CarvedStage",
    "captured_policies",
    "apply_checkpoint",
    "tag_for_compile",
    "segment_scope",
    "run_segment_body",
    "policy_kind",
    "rewrite_under_checkpoint",
]

logger = logging.getLogger(__name__)

_COMPUTE = ("call_function", "call_method", "call_module")
#: split's own wrappers (fxpipe.codegen.split): never part of a segment
_WRAPPERS = ("stage_input", "stage_output", "last_stage_output")
_ACTIVE = threading.local()


def policy_kind(policy: Any) -> str:
    """``policy.kind`` of a :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` (``"none"`` for None)."""
    return "none" if policy is None else str(getattr(policy, "kind", "none"))


# ----------------------------------------------------------------------------- names
def captured_policies(policies: Sequence[Any] | None, num_stages: int,
                      names: Mapping[str, str] | None = None) -> tuple:
    """Per-stage policies with their node names in this process's capture.

    Parameters
    ----------
    policies : sequence of CheckpointPolicy or None
        One per stage (``plan.activation_checkpointing``), or None (no policy anywhere).
    num_stages : int
    names : Mapping[str, str], optional
        Plan node name -> captured node name (:func:`fxpipe.passes.structure.match_nodes`);
        None when both agree. Plan nodes without a match (trivial ops the capture lacks) are
        dropped from segments; a kept node without a match is an error.

    Returns
    -------
    tuple
        ``num_stages`` entries (None for no policy).

    Raises
    ------
    InputError
        For a list of the wrong length, an entry that is not a policy, or a kept node this
        capture lacks.
    """
    if policies is None:
        return (None,) * num_stages
    pols = tuple(policies)
    if len(pols) != num_stages:
        raise InputError(f"activation_checkpointing has {len(pols)} policies for {num_stages} stages: give one per stage")
    out = []
    for s, p in enumerate(pols):
        if p is None:
            out.append(None)
            continue
        if not hasattr(p, "kind") or not hasattr(p, "segments"):
            raise InputError(f"activation_checkpointing[{s}] must be a CheckpointPolicy, got {type(p).__name__}")
        if names is None:
            out.append(p)
            continue
        segs = tuple(tuple(names[n] for n in seg if n in names) for seg in p.segments)
        lost = [n for n in p.save if n not in names]
        if lost:
            raise InputError(f"activation_checkpointing[{s}].save names nodes this capture of the model lacks: {lost[:3]}")
        out.append(dataclasses.replace(p, segments=tuple(seg for seg in segs if seg), save=tuple(names[n] for n in p.save)))
    return tuple(out)


# ----------------------------------------------------------------------------- the segment module
class CheckpointSegment(torch.nn.Module):
    """One replayed piece of a stage program (holds no state: parameters come in as inputs).

    Attributes
    ----------
    body : torch.fx.GraphModule
        The piece's ops: placeholders (its inputs), the ops, a tuple of its outputs.
    index : int
        Position among the stage's pieces (program order).
    segment : int
        The policy segment it comes from.
    save : frozenset[str]
        Body nodes whose outputs are kept from the forward to the backward.
    writes_state : tuple[int, ...]
        Positions of inputs (parameters, buffers) the body updates in place (BatchNorm's
        running statistics): a replay sets them back to their value before the forward and
        restores them after.
    """

    def __init__(self, body: fx.GraphModule, index: int, segment: int, save: frozenset, writes_state: tuple = ()):
        super().__init__()
        self.body = body
        self.index = index
        self.segment = segment
        self.save = frozenset(save)
        self.writes_state = tuple(writes_state)

    def forward(self, *args):
        run = getattr(_ACTIVE, "run", None)
        if run is None or not torch.is_grad_enabled():
            return self.body(*args)
        return run(self, args)


class segment_scope:
    """Context: inside it, every :class:`CheckpointSegment` call goes to ``run(segment, args)``.

    The stash enters it around a stage forward (:meth:`fxpipe.codegen.stash.DeviceStash.forward`).
    """

    def __init__(self, run: Callable[[CheckpointSegment, tuple], Any]):
        self.run = run
        self.prev = None

    def __enter__(self):
        self.prev = getattr(_ACTIVE, "run", None)
        _ACTIVE.run = self.run
        return self

    def __exit__(self, *exc):
        _ACTIVE.run = self.prev
        return False


# ----------------------------------------------------------------------------- kept outputs
def _storages(value: Any) -> set[int]:
    out: set[int] = set()
    for t in _tensor_leaves(value):
        if t.untyped_storage().nbytes():
            out.add(t.untyped_storage().data_ptr())
    return out


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The plain tensors of ``value`` (a DTensor by its local shard: what holds its storage under tensor parallelism)."""
    if isinstance(value, torch.Tensor):
        from fxpipe.codegen.runtime import dtensor_local

        local = dtensor_local(value)
        if local is not None:
            value = local
        return [value] if type(value) is torch.Tensor or type(value) is torch.nn.Parameter else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


class _Keeper:
    """The kept op results of one segment run: recorded in the forward, returned in the replay.

    ``keep(key, value)`` (the stash) stores a result and returns a handle; ``fetch(handle)``
    gives it back (None when it is gone: then the op runs again).
    """

    def __init__(self, keep: Callable[[tuple, Any], Any] | None, fetch: Callable[[Any], Any] | None,
                 handles: dict | None = None):
        self.keep, self.fetch = keep, fetch
        self.handles = {} if handles is None else handles  # (node, op, occurrence) -> handle
        self.replay = keep is None
        self.node: str | None = None
        self.count: dict = {}
        self.seen: list = []

    def op(self, func, args, kwargs):
        n = self.count.get(func, 0)
        self.count[func] = n + 1
        key = (self.node, str(func), n)
        if self.replay:
            h = self.handles.get(key)
            if h is not None:
                got = self.fetch(h)
                if got is not None:
                    return got
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        ins = _storages((list(args), list(kwargs.values())))
        fresh = _storages(out)
        if fresh and not (fresh & ins):  # not a view of an input: a result the op made
            self.seen.append((key, out, fresh))
        return out

    def node_done(self, result: Any) -> None:
        """The kept node ran: keep the op results whose storage is its output's."""
        want = _storages(result)
        if not self.replay:
            for key, out, fresh in self.seen:
                if fresh & want:
                    self.handles[key] = self.keep(key, out)
        self.seen = []
        self.node = None
        self.count = {}


class KeptOp:
    """The target of a kept (``save``) node in a segment body: calls the node's op, its ATen ops seen by
    the running segment's keeper (under the dispatch interceptor) when there is one."""

    def __init__(self, name: str, target: Callable):
        self.name = name
        self.target = target
        self.__name__ = f"kept_{getattr(target, '__name__', 'op')}"

    def __call__(self, *args, **kwargs):
        keeper = getattr(_ACTIVE, "keeper", None)
        if keeper is None:
            return self.target(*args, **kwargs)
        from fxpipe.codegen.runtime import op_interceptor  # the dispatch mode is a private torch API

        keeper.node, keeper.count, keeper.seen = self.name, {}, []
        with op_interceptor(keeper.op):
            result = self.target(*args, **kwargs)
        keeper.node_done(result)
        return result


def run_segment_body(segment: CheckpointSegment, args: Sequence[Any], *, keep: Callable | None = None,
                     fetch: Callable | None = None, handles: dict | None = None) -> tuple[Any, dict]:
    """Run ``segment``'s body on ``args``: ``(outputs, handles of its kept op results)``.

    Without ``save`` nodes this is ``segment.body(*args)``. With them, the forward (``keep``
    given) calls ``keep((node, op, occurrence), result)`` for every kept result and collects
    the returned handles; the replay (``fetch`` and ``handles`` given) returns
    ``fetch(handle)`` instead of running those ops (the op runs when ``fetch`` gives None).
    """
    if not segment.save:
        return segment.body(*args), {}
    keeper = _Keeper(keep, fetch, handles)
    prev = getattr(_ACTIVE, "keeper", None)
    _ACTIVE.keeper = keeper
    try:
        out = segment.body(*args)
    finally:
        _ACTIVE.keeper = prev
    return out, keeper.handles


# ----------------------------------------------------------------------------- carving
@dataclass
class CarvedStage:
    """What :func:`apply_checkpoint` did to one stage module.

    Attributes
    ----------
    kind : str
        The policy's kind.
    pieces : list[str]
        Names of the :class:`CheckpointSegment` submodules, in program order.
    dropped : list[str]
        Why parts of segments stay stashed (in-place updates), one line each.
    """

    kind: str
    pieces: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


_PLAIN = "_fxpipe_plain_graph"
_CARVED = "_fxpipe_checkpoint"
_POLICY = "_fxpipe_checkpoint_policy"  # (policy, CarvedStage) of the last apply_checkpoint


def _restore(module: fx.GraphModule) -> None:
    plain = getattr(module, _PLAIN, None)
    if plain is None:
        return
    for name in list(getattr(module, _CARVED, ()) or ()):
        if hasattr(module, name):
            delattr(module, name)
    module.graph = plain
    module.recompile()
    setattr(module, _CARVED, ())


def _runs(nodes: list[fx.Node], members: set[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs of ``members`` in program order, cut at every compute node that is not a member."""
    runs: list[list[fx.Node]] = []
    cur: list[fx.Node] = []
    for n in nodes:
        if n in members:
            cur.append(n)
        elif n.op in _COMPUTE and cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _is_wrapper(n: fx.Node) -> bool:
    """split's own wrappers, and submodule calls (export's ``_guards_fn``): never inside a segment."""
    return n.op == "call_module" or (n.op == "call_function" and getattr(n.target, "__name__", "") in _WRAPPERS)


def apply_checkpoint(module: fx.GraphModule, policy: Any, stage: int = 0) -> CarvedStage:
    """Carve ``policy``'s segments out of a stage module, in place (see the module docstring).

    Parameters
    ----------
    module : torch.fx.GraphModule
        A stage module of :func:`fxpipe.codegen.split.split_stages` (node names of this capture).
    policy : CheckpointPolicy or None
        The stage's policy in this capture's names (:func:`captured_policies`). ``None``,
        ``"none"`` and ``"stage"`` (run by the stash's whole-stage recomputation) carve nothing;
        the module gets its plain program back.
    stage : int
        For messages.

    Returns
    -------
    CarvedStage

    Raises
    ------
    InputError
        When no segment names a node the stage computes (another capture's names), or for
        segments whose spans overlap. A segment none of whose nodes the stage computes (the
        split moved them to another stage) is skipped (``CarvedStage.dropped`` says so).
    """
    from fxpipe.codegen.effects import analyze
    from fxpipe.codegen.runtime import copy_graph_codegen

    _restore(module)
    kind = policy_kind(policy)
    done = CarvedStage(kind)
    setattr(module, _POLICY, None)
    if kind in ("none", "stage") or not policy.segments:
        return done
    plain = module.graph
    g = fx.Graph()
    copy_graph_codegen(g, plain)
    out = g.graph_copy(plain, {})
    g.output(out)
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes if n.op in _COMPUTE and not _is_wrapper(n)}
    eff = analyze(SimpleNamespace(graph=g))
    save = set(policy.save)
    owner: dict[fx.Node, int] = {}
    spans = []
    for k, seg in enumerate(policy.segments):
        listed = [by_name[n] for n in seg if n in by_name]
        if not listed:  # e.g. BatchNorm counter updates the split moved to their module's stage
            done.dropped.append(f"segment {k}: none of its nodes is computed on this stage ({', '.join(seg[:3])})")
            continue
        lo, hi = min(pos[n] for n in listed), max(pos[n] for n in listed)
        span = [n for n in nodes[lo:hi + 1] if n.op in _COMPUTE and not _is_wrapper(n)]
        for n in span:
            if n in owner:
                raise InputError(f"stage {stage}: activation-checkpoint segments {owner[n]} and {k} overlap at node "
                                 f"{n.name!r} (segments are disjoint spans of the stage program)")
            owner[n] = k
        spans.append((k, span))
    if not spans:
        raise InputError(f"stage {stage}: no node of the activation-checkpoint segments is computed on this stage "
                         f"(first: {policy.segments[0][:3]}): the policy names another capture's nodes")
    writers = {}
    for w, b in eff.writes:
        writers.setdefault(b, []).append(w)
    pieces: list[tuple[int, list[fx.Node], tuple[int, ...]]] = []
    for k, span in spans:
        members = set(span)
        for n in span:  # an in-place update of a tensor made outside the segment must not replay
            for w, b in eff.writes:
                if w is n and b not in members and b not in eff.state_target:
                    members.discard(n)
                    done.dropped.append(f"segment {k}: {n.name} updates {b.name} (made outside the segment) in place")
        for run in _runs(nodes, members):
            inset = set(run)
            ins = _inputs(run, inset)
            last = pos[run[-1]]
            late = [w for a in ins for w in writers.get(eff.base.get(a, a), ()) if pos[w] > last
                    and eff.base.get(a, a) not in eff.state_target]
            if late:
                done.dropped.append(f"segment {k}: {late[0].name} updates an input of {run[0].name}..{run[-1].name} "
                                    "in place after it")
                continue
            state_in = tuple(i for i, a in enumerate(ins) if eff.base.get(a, a) in eff.state_target
                             and any(w in inset for w in writers.get(eff.base.get(a, a), ())))
            pieces.append((k, run, state_in))
    for idx, (k, run, state_in) in enumerate(pieces):
        name = f"fxpipe_segment_{idx}"
        _carve_run(g, module, run, name, CheckpointSegment, idx, k, {n.name for n in run} & save, state_in)
        done.pieces.append(name)
    if done.dropped:
        logger.info("stage %d: parts of activation-checkpoint segments stay stashed: %s", stage, "; ".join(done.dropped))
    g.lint()
    setattr(module, _PLAIN, plain)
    module.graph = g
    module.recompile()
    setattr(module, _CARVED, tuple(done.pieces))
    setattr(module, _POLICY, (policy, done))
    return done


def rewrite_under_checkpoint(module: fx.GraphModule, rewrite: Callable[[fx.GraphModule], None], stage: int = 0) -> None:
    """Rewrite a stage program in place with its checkpoint segments carved again afterwards.

    ``rewrite(module)`` edits the plain program (the segments taken out first); the policy of the
    last :func:`apply_checkpoint` is then carved into the rewritten program, so its segments hold
    the new ops as well. Tensor parallelism (:meth:`fxpipe.codegen.tensor_parallel.TensorParallelRank.shard_stage`)
    inserts the layout conversions between its domains this way: a conversion inside a block
    (the all-gather before an attention or MLP region, the reduce-scatter after it) becomes part
    of the block's segment and replays with it, as in Megatron-LM's and torchtitan's per-block
    checkpointing (Korthikanti et al. 2022, Sec. 5). The :class:`CarvedStage` the first carving
    returned is updated in place.
    """
    policy, done = getattr(module, _POLICY, None) or (None, None)
    _restore(module)
    rewrite(module)
    if policy is None:
        return
    again = apply_checkpoint(module, policy, stage)
    done.pieces[:], done.dropped[:] = again.pieces, again.dropped
    setattr(module, _POLICY, (policy, done))


def _inputs(run: list[fx.Node], inset: set[fx.Node]) -> list[fx.Node]:
    ins: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in run:
        for a in n.all_input_nodes:
            if a not in inset and a not in seen:
                seen.add(a)
                ins.append(a)
    return ins


def _carve_run(g: fx.Graph, module: fx.GraphModule, run: list[fx.Node], name: str, cls, index: int, segment: int,
               save: set[str], state_in: tuple[int, ...]) -> None:
    """Replace ``run`` (contiguous compute nodes of ``g``) by one ``call_module`` of a new segment module."""
    inset = set(run)
    ins = _inputs(run, inset)
    outs = [n for n in run if any(u not in inset for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in ins:
        ph = body.placeholder(a.name)
        ph.meta = dict(a.meta)
        env[a] = ph
    for n in run:
        if n.name in save and n.op == "call_function":  # its ATen ops go through the keeper (kept_call)
            args = fx.map_arg(n.args, lambda a: env[a])
            kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
            env[n] = body.create_node("call_function", KeptOp(n.name, n.target), args, kwargs, name=n.name)
            env[n].meta = dict(n.meta)
        else:
            env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outs))
    seg = cls(fx.GraphModule(torch.nn.Module(), body, class_name="Segment"), index, segment, frozenset(save), state_in)
    module.add_submodule(name, seg)
    with g.inserting_after(run[-1]):
        call = g.call_module(name, tuple(ins))
    getters = []
    with g.inserting_after(call):
        for i, o in enumerate(outs):
            getters.append(g.call_function(operator.getitem, (call, i)))
    for o, get in zip(outs, getters):
        get.meta = dict(o.meta)
        o.replace_all_uses_with(get, delete_user_cb=lambda u: u not in inset)
    for n in reversed(run):
        g.erase_node(n)


# ----------------------------------------------------------------------------- compile_stages
def tag_for_compile(module: fx.GraphModule, policy: Any) -> int:
    """Mark ``policy``'s segments for Inductor's partitioner (``compile_stages=True``); returns tagged nodes.

    Every node of a segment gets ``meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE``
    (``MUST_SAVE`` for the kept ones) and ``meta["ac_graph_id"]`` = its segment: the tags
    ``torch.utils.checkpoint``'s selective contexts give ``torch.compile``, which
    AOTAutograd's min-cut partitioner honours. Tags of an earlier call are removed first.
    """
    from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

    _restore(module)
    for n in module.graph.nodes:
        n.meta.pop("recompute", None)
        n.meta.pop("ac_graph_id", None)
    kind = policy_kind(policy)
    by_name = {n.name: n for n in module.graph.nodes if n.op in _COMPUTE and not _is_wrapper(n)}
    segments = tuple(getattr(policy, "segments", ()) or ())
    if kind == "stage" and not segments:
        segments = (tuple(by_name),)
    if kind == "none" or not segments:
        return 0
    save = set(policy.save)
    tagged = 0
    for k, seg in enumerate(segments):
        listed = [by_name[n] for n in seg if n in by_name]
        if not listed:
            continue
        nodes = list(module.graph.nodes)
        lo, hi = nodes.index(listed[0]), nodes.index(listed[-1])
        for n in nodes[lo:hi + 1]:
            if n.op in _COMPUTE and not _is_wrapper(n):
                n.meta["recompute"] = TorchPolicy.MUST_SAVE if n.name in save else TorchPolicy.PREFER_RECOMPUTE
                n.meta["ac_graph_id"] = k + 1
                tagged += 1
    return tagged

