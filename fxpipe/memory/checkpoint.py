"""Activation-checkpoint policies of pipeline stages (issue 28): plain data shared by the planner and the runtime.

A stage's policy says what its forward keeps for the backward and what the backward replays:

``"none"``
    stash everything (every tensor autograd saves stays until the backward);
``"full"``
    per-block segments: each segment's forward is replayed as one unit during the backward
    (non-reentrant checkpointing: the segment keeps only its inputs);
``"selective"``
    per-block segments that keep the outputs of their matmul / attention ops (torchtitan's
    op-level selective activation checkpointing, with its every-other-matmul rule) and replay
    the rest;
``"budget"``
    per-block segments whose kept set is chosen for a memory budget;
``"stage"``
    the whole stage's forward is one replayed unit (what plans before issue 28 called
    recomputation; an old plan file's recomputing stages load as this).

This module is a leaf: plain data and numpy only (the planning packages import it; torch never).
The runtime executes a policy in :mod:`fxpipe.codegen.checkpointing` and measures it with the
saved-tensor hooks of :mod:`fxpipe.codegen.stash`.

.. note::
   Minimal version written by the runtime side of issue 28 (h-28run) so that its branch
   builds on its own: :class:`CheckpointPolicy` follows the shared contract exactly; the
   predictor :func:`predict_checkpoint_bytes` is the contract's simple rule (sums of the
   OpGraph's ``size_out_bytes`` / ``act_bytes``) and is meant to be replaced by the planning
   side's memory model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fxpipe.errors import InputError

__all__ = ["CHECKPOINT_KINDS", "CheckpointPolicy", "predict_checkpoint_bytes"]

#: Policy kinds: "none" (stash everything), "full" (per-block segments, replay all of a block),
#: "selective" (per-block segments keeping matmul / attention outputs, torchtitan's op SAC with
#: its every-other-matmul rule), "budget" (per-block segments, the kept set chosen for a memory
#: budget), "stage" (the whole stage's forward is one segment: what plans before issue 28 called
#: recompute; an old plan file's recompute stages load as this).
CHECKPOINT_KINDS = ("none", "full", "selective", "budget", "stage")

_NUMBERS = ("replay_s", "kept_bytes", "replay_peak_bytes")


@dataclass(frozen=True)
class CheckpointPolicy:
    """The activation-checkpoint policy of one pipeline stage.

    Attributes
    ----------
    kind : str
        One of :data:`CHECKPOINT_KINDS`.
    segments : tuple[tuple[str, ...], ...]
        OpGraph node names (the plan's fx node names) of the stage, one tuple per segment; each
        segment is replayed as one unit during the backward (non-reentrant checkpointing).
        Segments are disjoint, each listed in the stage's program order; ops in no segment are
        stashed as without a policy.
    save : tuple[str, ...]
        Nodes inside segments whose outputs are kept from the forward to the backward (not
        replayed): empty for ``"full"`` and ``"stage"``; the planned keep set for
        ``"selective"`` / ``"budget"``.
    replay_s : float
        Forward time (seconds) the backward replays per micro-batch (sum over segments).
    kept_bytes : float
        Bytes the forward of one micro-batch keeps under this policy (the stash).
    replay_peak_bytes : float
        Bytes a backward holds on top of the kept stash while it replays (the largest
        segment's replayed activations and their gradients).
    """

    kind: str
    segments: tuple[tuple[str, ...], ...] = ()
    save: tuple[str, ...] = ()
    replay_s: float = 0.0
    kept_bytes: float = 0.0
    replay_peak_bytes: float = 0.0

    def __post_init__(self):
        _check(self, "CheckpointPolicy")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the plan file's ``"activation_checkpointing"`` entries)."""
        return {"kind": self.kind, "segments": [list(s) for s in self.segments], "save": list(self.save),
                "replay_s": float(self.replay_s), "kept_bytes": float(self.kept_bytes),
                "replay_peak_bytes": float(self.replay_peak_bytes)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "plan") -> "CheckpointPolicy":
        """Read :meth:`to_dict`'s form.

        Raises
        ------
        InputError
            Naming ``source`` and the field for a missing or unknown kind, segments that are
            not lists of node names or overlap, saved nodes outside the segments, or numbers
            that are not finite and non-negative.
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{source}: an activation-checkpoint policy must be an object, got {type(doc).__name__}")
        where = f"{source}: activation_checkpointing"
        segs = doc.get("segments", ())
        if not isinstance(segs, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in segs):
            raise InputError(f"{where}.segments must be a list of lists of node names")
        save = doc.get("save", ())
        if not isinstance(save, (list, tuple)):
            raise InputError(f"{where}.save must be a list of node names")
        nums = {}
        for k in _NUMBERS:
            v = doc.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InputError(f"{where}.{k} must be a number >= 0, got {v!r}")
            nums[k] = float(v)
        try:
            return cls(kind=doc.get("kind"), segments=tuple(tuple(s) for s in segs), save=tuple(save), **nums)
        except InputError as exc:
            raise InputError(str(exc).replace("CheckpointPolicy", where, 1)) from None


def _check(p: CheckpointPolicy, where: str) -> CheckpointPolicy:
    """Validate ``p`` (InputError naming ``where`` and the field)."""
    if p.kind not in CHECKPOINT_KINDS:
        raise InputError(f"{where}.kind must be one of {', '.join(CHECKPOINT_KINDS)}, got {p.kind!r}")
    seen: set[str] = set()
    for i, seg in enumerate(p.segments):
        if not seg or not all(isinstance(n, str) and n for n in seg):
            raise InputError(f"{where}.segments[{i}] must be a non-empty list of node names")
        dup = seen.intersection(seg)
        if dup or len(set(seg)) != len(seg):
            raise InputError(f"{where}.segments[{i}] repeats node(s) {sorted(dup or seg)[:3]}: segments are disjoint")
        seen.update(seg)
    if p.kind == "none" and p.segments:
        raise InputError(f"{where}: kind 'none' has no segments, got {len(p.segments)}")
    outside = [n for n in p.save if not isinstance(n, str) or n not in seen]
    if outside:
        raise InputError(f"{where}.save names nodes outside every segment: {outside[:3]}")
    for k in _NUMBERS:
        v = getattr(p, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise InputError(f"{where}.{k} must be a finite number >= 0, got {v!r}")
    return p


def predict_checkpoint_bytes(graph, stage_nodes: Sequence[int], policy: CheckpointPolicy | None) -> tuple[float, float]:
    """Kept bytes and replay peak of one micro-batch of a stage under ``policy`` (a stand-in predictor).

    Parameters
    ----------
    graph : fxpipe.ir.OpGraph
        The costed graph: ``size_out_bytes``, ``act_bytes`` (bytes of one micro-batch), edges,
        and per node ``extra["saves"]``, the base tensors its backward reads
        (:data:`fxpipe.passes.costing.SAVES_KEY`; without it every saved byte counts as the op's own).
    stage_nodes : sequence of int
        OpGraph ids of the stage's nodes.
    policy : CheckpointPolicy or None
        The stage's policy (node names of ``graph``); None or ``"none"``: stash everything.

    Returns
    -------
    (kept_bytes, replay_peak_bytes) : tuple[float, float]
        Unique tensors, as the saved-tensor hooks count them. A node's ``act_bytes`` splits into
        the bases its backward reads (``saves``) and its *own* bytes (statistics, masks, copies
        made inside the op). ``kept_bytes``: the own bytes of the ops in no segment, plus every
        base made on the stage that stays from the forward to the backward: read by an op in no
        segment, a segment input, or a saved (``save``) node. ``replay_peak_bytes``: the largest
        over segments of what its replay rebuilds, the own bytes of its ops plus the bases they
        read that are not kept (a base made inside the segment is rebuilt unless saved, even
        when an op after the segment keeps it too; ``"stage"``: the whole stage is one segment
        whose inputs are the stage's). Gradients are not counted. Bases made on earlier stages (the stage's
        inputs, held by receive buffers) and model inputs are never counted; a view's base is
        found through shape-only ops (``extra["kind"] == "shape"``).

    Notes
    -----
    ``act_bytes`` counts each base once, on the first node that reads it (Contract 1), so a
    node's own bytes are its ``act_bytes`` less the bases it is the first to read.
    """
    n = graph.n
    stage = [int(i) for i in stage_nodes]
    on_stage = set(stage)
    index = {name: i for i, name in enumerate(graph.names)}
    ext = graph.extra or ({},) * n
    size = [float(x) for x in graph.size_out_bytes]
    act = [float(x) for x in graph.act_bytes]
    preds = [[int(u) for u in graph.pred_idx[graph.pred_ptr[i]:graph.pred_ptr[i + 1]]] for i in range(n)]
    saves = [[index[b] for b in ((ext[i] or {}).get("saves") or ()) if b in index] for i in range(n)]
    first: dict[int, int] = {}
    for i in range(n):
        for b in saves[i]:
            first.setdefault(b, i)
    own = [max(act[i] - sum(size[b] for b in saves[i] if first[b] == i), 0.0) for i in range(n)]

    def base(u: int) -> int:
        seen = set()
        while (ext[u] or {}).get("kind") == "shape" and len(preds[u]) == 1 and u not in seen:
            seen.add(u)
            u = preds[u][0]
        return u

    def made_here(b: int) -> bool:
        return b in on_stage and graph.ops[b] != "placeholder"

    kind = "none" if policy is None else policy.kind
    if kind == "stage":
        segs = [stage]
    else:
        segs = [[index[m] for m in seg if m in index and index[m] in on_stage] for seg in (policy.segments if policy else ())]
    seg_of = {i: k for k, seg in enumerate(segs) for i in seg}
    kept_bases: set[int] = set()
    kept = 0.0
    for i in stage:
        if i not in seg_of:
            kept += own[i]
            kept_bases.update(b for b in saves[i] if made_here(b))
    saved_nodes: set[int] = set()
    if kind != "stage":
        for i in seg_of:
            for u in preds[i]:
                if seg_of.get(u) != seg_of[i] and made_here(base(u)):
                    kept_bases.add(base(u))
        saved_nodes = {base(index[m]) for m in (policy.save if policy else ()) if m in index}
        kept_bases |= saved_nodes
    kept += sum(size[b] for b in kept_bases)
    peak = 0.0
    for k, seg in enumerate(segs):
        # a base made inside the segment and read by its ops is rebuilt even when an op after it keeps it too
        # (the forward saved it inside the segment first); one made outside is kept (an input)
        rebuilt = {b for i in seg for b in saves[i] if made_here(b) and b not in saved_nodes
                   and (seg_of.get(b) == k or b not in kept_bases)}
        peak = max(peak, sum(own[i] for i in seg) + sum(size[b] for b in rebuilt))
    return float(kept), float(peak)
