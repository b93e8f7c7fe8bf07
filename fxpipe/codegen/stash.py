"""The activation stash of a pipeline rank: saved-tensor hooks, live-byte accounting, offload/reload, recomputation, checkpointed segments.

Every stage forward that the runtime runs goes through :meth:`DeviceStash.forward`, which
installs ``torch.autograd.graph.saved_tensors_hooks`` for that (stage, micro-batch). Autograd
then keeps, instead of each tensor it saves for the backward, a small handle (a *slot*) that
points into the stash of that micro-batch; the stash groups the slots by storage (views of one
tensor, e.g. q/k/v split from one projection, share one storage and are counted and moved once).

What counts
    A micro-batch's stash is every storage autograd saves during that stage's forward, except
    what stays resident anyway: the stage's parameters and buffers (and views of them) and the
    stage's inputs (the model inputs on the first stage, torch's receive buffers elsewhere,
    which :mod:`fxpipe.memory` counts as communication buffers). This is the quantity the cost
    model's ``act_bytes`` predicts (Contract 1: "what one micro-batch's forward keeps alive for
    its backward"). The loss computed on the last stage is outside the stage forward and not
    counted. Live bytes per stage and per device are updated on every save and every release,
    so the recorded peaks are exact at tensor granularity.

Lifetime
    A slot dies when autograd drops it (a full backward frees each node's saved tensors as it
    runs) or, at the latest, when the micro-batch's last backward on the stage ends (the
    ``W``, or the full ``B``): :meth:`DeviceStash.release` then empties every slot still
    referenced by a graph that outlives its backward (torch's split backward keeps the graph
    with ``retain_graph=True``; the last stage's loss keeps it until the end of the step).

Offload / reload (``O`` / ``R``; :mod:`fxpipe.codegen.offload` says when they run)
    ``O(s, j)`` copies every device storage of the stash to host memory and drops the device
    references, so the device storage is freed; ``R(s, j)`` allocates device storage, copies
    back and rebuilds every saved view on it (same dtype, size, stride and offset). On CUDA the
    host buffers are pinned (kept in a pool of exact sizes for reuse) and both directions run on
    one copy stream per device (PipeOffload Sec. 4.2): an offload waits for the compute stream
    (an event), its device storage is released once the copy has finished (polled, never
    blocking the compute stream); the backward that needs a reloaded stash makes the compute
    stream wait for the reload's event. On CPU both copies are synchronous copies into separate
    buffers, so the same code path runs in CI. A backward that needs a stash that is still on the
    host raises :class:`StashError` naming the stage and micro-batch (never a silent recompute).

Recomputation (a stage in ``recompute_stages``)
    The stage forward runs with hooks that keep nothing but the resident tensors above (so only
    the stage inputs stay alive, as with ``torch.utils.checkpoint``); the first time the
    backward needs a saved tensor of the micro-batch, the stage forward is run again on the same
    inputs, with the random-number state of the original forward and the stage's mutated
    buffers (BatchNorm's running statistics, counters) set back to their values before that
    forward (and restored after), and every saved tensor is filled in by position (stopping as
    soon as all are there). The recomputed tensors stay in the stash until the micro-batch's
    last backward ends, so a split backward (``B`` now, ``W`` later) recomputes **once**.
    ``torch.utils.checkpoint`` (non-reentrant) recomputes once per autograd graph task; torch's
    split backward runs one task for ``B`` and one per parameter group for ``W`` (measured with
    torch 2.13 on a stage of 4 ``Linear`` layers: 5 replays of the forward per micro-batch, 1 for
    ``I`` and 4 for ``W``, instead of 1), which is why the stash does it itself. A recomputation
    that saves tensors of other shapes or fewer tensors than the original forward raises
    :class:`StashError`.

Checkpointed segments (a stage's activation-checkpoint policy, :mod:`fxpipe.codegen.checkpointing`)
    A segment carved into the stage program runs, inside the stage forward, under its own hooks:
    its inputs are kept (as slots: counted, offloaded with the stash), what autograd saves inside
    it leaves a *placeholder* (unless the stash already holds that storage: an input, a kept op
    result, another op's stash), and the planned op results (``save``) are kept as slots. The
    first time a backward needs a placeholder, the segment's body runs again on its kept inputs,
    with the forward's random-number state and updated state, returning the kept results instead
    of recomputing them, and fills every placeholder of the segment by position (once per
    micro-batch). Under a full backward autograd frees each node's saved tensors as it runs, so
    the backward holds one segment's replay at a time. Under a split backward (``B`` now, ``W``
    later) a replayed tensor is dropped as soon as ``B`` has read it unless the autograd node
    reading it runs again in ``W`` (:class:`_WeightNeeds`: torch's backward-weight pass starts
    at the nodes where a parameter's gradient path meets the stage inputs'), so ``W`` finds what
    it needs without a second replay and ``B`` holds one segment's replay plus what ``W`` reads.
    torch's ``torch.utils.checkpoint`` replays once per autograd graph task instead: once for ``B``
    and once per parameter group for ``W`` (``benchmarks/bench_checkpoint_memory.py``, torch 2.13:
    a segment of 4 Linear + tanh layers under ``stage_backward_input`` / ``stage_backward_weight``
    replays 5 times per micro-batch, the stash once, same gradients), each ``W`` replay holding
    its unconsumed tensors until the graph is freed; its ``GraphExecGroup`` (one replay for
    several backward calls) refuses B then W, which read the same saved tensors.
    Measured per micro-batch: ``max_microbatch_bytes`` (what the forward kept),
    ``max_replay_peak_bytes`` (replayed tensors held at once during its backward),
    ``max_w_held_bytes`` (left for ``W`` by a split ``B``), ``segment_runs`` and ``replays``.

Data parallelism (:mod:`fxpipe.codegen.mesh`)
    A stage wrapped by FSDP2's ``fully_shard`` or ``replicate`` holds sharded (or replicated)
    DTensor parameters outside its forward and, inside it, the unsharded parameters (other
    tensor objects, all-gathered by FSDP2's pre-forward hook), which are what the forward saves.
    The runtime therefore passes the resident tensors as a callable, read again at the first
    saved tensor (inside the forward), so unsharded parameters are never stashed, counted or
    offloaded, whether or not FSDP2 reshards after the forward. A recomputation replays the
    forward with ``recompute_fn`` (the module's forward without FSDP2's hooks).

Tensor parallelism (:mod:`fxpipe.codegen.tensor_parallel`)
    Inside a tensor-parallel stage autograd saves DTensor wrappers (a region's activations, the
    sequence shard of a norm's input). A slot holds a DTensor's *local shard* and its layout (mesh,
    placements, global shape; no data): the shard is what is counted (one rank's bytes), grouped by
    storage, offloaded, reloaded and filled by a replay, and the unpack hook wraps it again into a
    DTensor of that layout, without communication. A DTensor parameter (and its local storage) is
    resident. A replay re-runs the segment's layout conversions, i.e. its collectives, on every
    tensor-parallel rank of the stage at the same point of their identical backwards.

Public torch APIs are used (``saved_tensors_hooks``, ``UntypedStorage``, CUDA streams and events);
a DTensor's local shard and layout through :mod:`fxpipe.codegen.runtime`'s adapters.

References
----------
Wan et al., "PipeOffload", 2025, Sec. 4 and App. C (offload implementation); Chen et al.,
"Training Deep Nets with Sublinear Memory Cost", 2016 (recomputation); Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 (B/W split).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fxpipe.codegen.checkpointing import apply_checkpoint, policy_kind, run_segment_body, segment_scope
from fxpipe.codegen.effects import analyze
from fxpipe.codegen.offload import OffloadProgram, offload_program, programs_of
from fxpipe.codegen.runtime import current_autograd_node, dtensor_from_local, dtensor_local, dtensor_spec, grad_fn_or_grad_acc
from fxpipe.errors import InputError

__all__ = ["StashError", "StageActivationStats", "ActivationStats", "DeviceStash", "device_stash", "mutated_state",
           "measure_stage"]


class StashError(RuntimeError):
    """A backward needs a stash that is not on the device (never reloaded, already released),
    or a recomputation did not reproduce the original forward's saved tensors."""


@dataclass
class StageActivationStats:
    """What the saved-tensor hooks measured on one stage (bytes; counts).

    Attributes
    ----------
    stage : int
    peak_saved_bytes : int
        Largest live stash of the stage (all micro-batches together) on the device.
    peak_offloaded_bytes : int
        Largest amount of the stage's stashes held in host memory at once.
    max_microbatch_bytes : int
        Largest stash of one micro-batch right after its forward (the measured counterpart of
        the cost model's per-micro-batch ``mem_f``).
    max_input_saved_bytes : int
        Largest amount of one micro-batch's *stage inputs* that autograd saved (not stashed:
        they live in torch's receive buffers, or the caller's model inputs, anyway). A cost
        model that counts what every op saves includes them in the stage's stash.
    offloads, reloads, recomputes : int
        Micro-batch stashes offloaded, reloaded and recomputed.
    offloaded_bytes_total : int
        Bytes copied to the host, summed over all offloads.
    recompute : bool
        The stage recomputes its forward.
    segment_runs, replays : int
        Checkpointed segments run forward, and replayed during backwards (all micro-batches;
        equal when every segment replays once per micro-batch).
    max_replay_peak_bytes : int
        Largest amount of replayed saved tensors one micro-batch's backward held at once (the
        measured counterpart of a policy's ``replay_peak_bytes``, gradients not included).
    max_backward_extra_bytes : int
        Largest excess, during one micro-batch's backward, of its live stash over what its
        forward left (kept and replayed tensors together, minus what the backward freed).
    max_w_held_bytes : int
        Largest amount of replayed saved tensors a split backward-input ``B`` left for the
        micro-batch's ``W`` (what the weight gradients still need).
    """

    stage: int
    peak_saved_bytes: int = 0
    peak_offloaded_bytes: int = 0
    max_microbatch_bytes: int = 0
    max_input_saved_bytes: int = 0
    offloads: int = 0
    reloads: int = 0
    recomputes: int = 0
    offloaded_bytes_total: int = 0
    recompute: bool = False
    segment_runs: int = 0
    replays: int = 0
    max_replay_peak_bytes: int = 0
    max_backward_extra_bytes: int = 0
    max_w_held_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ActivationStats:
    """Measured activation memory of one rank (device): per stage and the device total."""

    device: str
    stages: dict[int, StageActivationStats] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    peak_offloaded_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "peak_saved_bytes": self.peak_saved_bytes,
            "peak_offloaded_bytes": self.peak_offloaded_bytes,
            "stages": {int(s): st.to_dict() for s, st in self.stages.items()},
        }


# ----------------------------------------------------------------------------- storage groups and slots
class _Group:
    """One storage saved by one micro-batch's forward (every saved view of it shares the group)."""

    __slots__ = ("stash", "ptr", "nbytes", "device", "slots", "live", "state", "host", "event", "pending", "counted",
                 "replayed")

    def __init__(self, stash: "_MicrobatchStash", ptr: int, nbytes: int, device: torch.device):
        self.stash = stash
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.slots: list[weakref.ref] = []  # weak: autograd owns the slots, their death is observed
        self.live = 0
        self.state = "device"  # device | host | released
        self.host: torch.Tensor | None = None  # uint8 host copy while offloaded (and during a CUDA reload)
        self.event = None  # CUDA: the reload's copy has finished
        self.pending = None  # CUDA: (event, device tensors) of an offload whose copy is in flight
        self.counted = False
        self.replayed = False  # made by a checkpointed segment's replay

    def alive_slots(self) -> list["_Slot"]:
        return [s for s in (r() for r in self.slots) if s is not None]


class _Slot:
    """What autograd keeps for one saved tensor: a handle into the stash."""

    __slots__ = ("owner", "group", "tensor", "index", "dtype", "size", "stride", "offset", "seg", "spec", "__weakref__")

    def __init__(self, owner: "_MicrobatchStash", group: _Group | None, tensor: torch.Tensor | None, index: int,
                 like: torch.Tensor, seg: "_SegmentRun | None" = None, spec: Any = None):
        self.seg = seg  # a placeholder of this checkpointed segment run (filled by its replay)
        self.spec = spec  # a DTensor's layout (``like`` and ``tensor`` are then its local shard), else None
        self.owner = owner
        self.group = group
        self.tensor = tensor
        self.index = index
        self.dtype = like.dtype
        self.size = tuple(like.size())
        self.stride = tuple(like.stride())
        self.offset = like.storage_offset()

    def value(self) -> torch.Tensor | None:
        """What autograd saved: the tensor, or the DTensor of ``spec`` over the local shard held (None when empty)."""
        t = self.tensor
        if t is None or self.spec is None:
            return t
        return dtensor_from_local(t, self.spec)

    def __del__(self):  # autograd dropped the saved tensor
        g = self.group
        if g is not None:
            try:
                g.stash.owner._slot_died(g)
            except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
                pass


class _MicrobatchStash:
    """The stash of one (stage, micro-batch)."""

    __slots__ = ("owner", "stage", "mb", "groups", "slots", "recompute", "npacks", "state", "inputs", "kwargs", "fn",
                 "rng", "cuda_rng", "state_before", "recomputed", "live_ptr", "segments", "live", "replay_live", "kept",
                 "in_backward", "bwd_peak", "replay_peak", "__weakref__")

    def __init__(self, owner: "DeviceStash", stage: int, mb: int):
        self.owner = owner
        self.stage = stage
        self.mb = mb
        self.groups: dict[int, _Group] = {}
        self.slots: list[weakref.ref] = []  # recompute: the placeholder slots
        self.recompute = False
        self.npacks = 0
        self.state = "forward"  # forward | stashed | offloaded | released
        self.inputs: tuple = ()
        self.kwargs: dict = {}
        self.fn: Callable | None = None
        self.rng = None
        self.cuda_rng = None
        self.state_before: list = []
        self.recomputed = False
        self.live_ptr: dict[int, _Group] = {}  # storage address -> its group, while the storage is on the device
        self.segments: list[_SegmentRun] = []  # checkpointed segments run by the forward
        self.live = 0  # device bytes of this micro-batch's groups (unique storages)
        self.replay_live = 0  # ... of the groups made by replays
        self.kept = 0  # bytes right after the forward
        self.in_backward = False
        self.bwd_peak = 0
        self.replay_peak = 0


class _SegmentRun:
    """One forward of a checkpointed segment (:class:`fxpipe.codegen.checkpointing.CheckpointSegment`) of a micro-batch.

    ``inputs``: per input, ``(value, requires_grad)`` where value is a kept-input :class:`_Slot`
    (counted, offloaded with the stash) or the object itself (resident tensors, non-tensors).
    ``slots``: weak references to the placeholders its saved tensors left; ``handles``: its kept
    op results (:func:`fxpipe.codegen.checkpointing.run_segment_body`), slots until its first replay.
    """

    __slots__ = ("module", "inputs", "rng", "cuda_rng", "state_before", "slots", "handles", "npacks", "__weakref__")

    def __init__(self, module):
        self.module = module
        self.inputs: list[tuple[Any, bool | None]] = []
        self.rng = None
        self.cuda_rng = None
        self.state_before: list = []
        self.slots: list[weakref.ref] = []
        self.handles: dict = {}
        self.npacks = 0


class _StopRecompute(Exception):
    pass


class _WeightNeeds:
    """Which autograd nodes a split backward's ``W`` runs again (Zero Bubble's B/W split as torch does it).

    torch's backward-weight pass back-propagates from the *intermediates*, the nodes where a
    parameter's gradient path meets the stage inputs' (``get_param_groups``), to the
    parameters. A node that the backward-input pass runs is run again by ``W`` iff one of its
    next functions does not reach a stage input but reaches a parameter's gradient
    accumulator: then it is such an intermediate. Walks memoised per backward.
    """

    def __init__(self, input_nodes: Iterable[Any]):
        self.inputs = set(input_nodes)
        self._to_input: dict[Any, bool] = {}
        self._to_param: dict[Any, bool] = {}

    def _reach(self, root, memo: dict, hit: Callable[[Any], bool]) -> bool:
        if root in memo:
            return memo[root]
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if n in memo:
                continue
            kids = [m for m, _ in getattr(n, "next_functions", ()) if m is not None]
            if expanded:
                memo[n] = hit(n) or any(memo.get(m, False) for m in kids)
                continue
            if hit(n):
                memo[n] = True
                continue
            stack.append((n, True))
            stack.extend((m, False) for m in kids if m not in memo)
        return memo[root]

    def needed(self, node) -> bool:
        for m, _ in getattr(node, "next_functions", ()):
            if m is None:
                continue
            if not self._reach(m, self._to_input, lambda n: n in self.inputs) and \
                    self._reach(m, self._to_param, lambda n: hasattr(n, "variable") and n not in self.inputs):
                return True
        return False


class _BackwardScope:
    def __init__(self, stash: "DeviceStash", stage: int, mb: int, inputs):
        self.stash, self.stage, self.mb, self.inputs = stash, stage, mb, inputs

    def __enter__(self):
        nodes = []
        for t in self.inputs or ():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                n = grad_fn_or_grad_acc(t)
                if n is not None:
                    nodes.append(n)
        self.prev = self.stash._split_b
        self.stash._split_b = (self.stage, self.mb, _WeightNeeds(nodes))
        return self

    def __exit__(self, *exc):
        self.stash._split_b = self.prev
        return False


def _plain(t: Any) -> bool:
    """A dense tensor with its own storage that the stash can count and move."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.layout == torch.strided and not t.is_meta


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _local(t: Any) -> Any:
    """A DTensor's local shard (the storage it holds on this rank), anything else as it is."""
    local = dtensor_local(t)
    return t if local is None else local


def _parts(t: Any) -> tuple[Any, Any]:
    """``(local tensor, DTensor layout or None)``: what a slot holds for a saved tensor. Under tensor parallelism
    autograd saves DTensor wrappers (:mod:`fxpipe.codegen.tensor_parallel`); the stash counts, moves and replays
    their local shards and wraps them again when the backward reads them."""
    local = dtensor_local(t)
    return (t, None) if local is None else (local, dtensor_spec(t))


def _resident(t: Any, resident_ptrs: set[int]) -> bool:
    """Whether a saved tensor stays on the device anyway: not a plain tensor, a storage of the stage's
    resident tensors, or a parameter (or a view of one): a per-block FSDP2 unit's unsharded parameters
    (:mod:`fxpipe.codegen.fsdp_blocks`) are unsharded only around the block's own forward and backward,
    after the stage's resident tensors were read, and FSDP2 refills their storage before the block's
    backward reads them."""
    if isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter):
        return True  # (a DTensor parameter, or a view of one, too)
    local = _local(t)
    return not _plain(local) or _ptr(local) in resident_ptrs


def _resident_ptrs(tensors: Iterable[Any]) -> set[int]:
    """Storage addresses of the plain tensors among ``tensors``, and of the local shards of the DTensors (a
    tensor-parallel parameter; a sharded FSDP2 parameter's shard is harmless: the forward saves the unsharded
    parameter, another tensor, whose address the stash reads again inside the forward)."""
    return {_ptr(local) for t in tensors if _plain(local := _local(t))}


def mutated_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers a stage's forward updates in place (``(target, tensor)``).

    Read from the graph of an fx stage module (:func:`fxpipe.codegen.effects.analyze`): BatchNorm's
    running statistics and counter, any buffer written by an in-place op. Empty for other modules.
    """
    if not isinstance(module, torch.fx.GraphModule):
        return []

    out = []
    for target in sorted(analyze(module).written_state()):
        try:
            t = module.get_buffer(target)
        except AttributeError:
            try:
                t = module.get_parameter(target)
            except AttributeError:
                continue
        out.append((target, t))
    return out


class _HostPool:
    """Host buffers of exact sizes, kept for reuse (pinned on CUDA: pinning is slow)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}

    def get(self, nbytes: int) -> torch.Tensor:
        lst = self.free.get(nbytes)
        if lst:
            return lst.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def put(self, buf: torch.Tensor) -> None:
        if self.pin:  # unpinned CPU buffers are cheap: let them go
            self.free.setdefault(buf.numel(), []).append(buf)


# ----------------------------------------------------------------------------- the device stash
class DeviceStash:
    """The activation stashes of one device (all its stages): hooks, accounting, O/R, recompute.

    Parameters
    ----------
    device : torch.device or str
        The device the stages compute on.
    program : OffloadProgram, optional
        When to issue the device's O/R actions (:func:`fxpipe.codegen.offload.offload_program`).
    recompute_stages : iterable of int
        Stages that recompute their forward during the backward instead of stashing.
    mutated : Mapping[int, sequence of (str, Tensor)], optional
        Per recomputing stage, the state its forward updates in place (:func:`mutated_state`).

    Notes
    -----
    The runtime calls :meth:`forward` around each stage forward, :meth:`after` after every torch
    compute action (``"0F1"``, ``"0I1"``, ``"0B1"``, ``"0W1"``), :meth:`before_backward` before a
    backward, :meth:`release` when a micro-batch's last backward on a stage ends, and
    :meth:`begin_step` / :meth:`end_step` around each step. Measured peaks accumulate over steps
    (:meth:`stats`).
    """

    def __init__(self, device, program: OffloadProgram | None = None, recompute_stages: Iterable[int] = (),
                 mutated: Mapping[int, Sequence[tuple[str, torch.Tensor]]] | None = None):
        self.device = torch.device(device)
        self.program = program or OffloadProgram()
        self.recompute_stages = frozenset(int(s) for s in recompute_stages)
        self.mutated = {int(k): list(v) for k, v in (mutated or {}).items()}
        self._lock = threading.RLock()
        self._stashes: dict[tuple[int, int], _MicrobatchStash] = {}
        self._stats: dict[int, StageActivationStats] = {}
        self._saved: dict[int, int] = {}  # stage -> live device bytes
        self._host: dict[int, int] = {}  # stage -> bytes on the host
        self._stage_ptrs: dict[int, dict[int, int]] = {}  # stage -> storage ptr -> number of groups holding it
        self._device_saved = 0
        self._device_host = 0
        self._peak_device_saved = 0
        self._peak_device_host = 0
        cuda = self.device.type == "cuda"
        self._cuda = cuda
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._pool = _HostPool(pin=cuda)
        self._in_flight: list[_Group] = []  # CUDA offloads whose device memory is not released yet
        self._replaying = False  # a checkpointed segment's replay is filling placeholders
        self._split_b = None  # (stage, microbatch, _WeightNeeds) while a split backward-input B runs
        #: per stage, what makes its parameters usable for a replay outside FSDP2's own unshard (``module.unshard``)
        self.before_replay: dict[int, Callable[[], None]] = {}

    # ------------------------------------------------------------------ accounting
    def _stage_stats(self, stage: int) -> StageActivationStats:
        st = self._stats.get(stage)
        if st is None:
            st = self._stats[stage] = StageActivationStats(stage, recompute=stage in self.recompute_stages)
        return st

    def _count(self, g: _Group, device_delta: int, host_delta: int) -> None:
        s = g.stash.stage
        st = self._stage_stats(s)
        if device_delta:
            ms = g.stash  # this micro-batch's own bytes (its groups are unique storages)
            ms.live += device_delta
            if g.replayed:
                ms.replay_live += device_delta
            if ms.in_backward:
                ms.bwd_peak = max(ms.bwd_peak, ms.live)
                ms.replay_peak = max(ms.replay_peak, ms.replay_live)
            ptrs = self._stage_ptrs.setdefault(s, {})
            if device_delta > 0:
                n = ptrs.get(g.ptr, 0)
                ptrs[g.ptr] = n + 1
                if n:  # the storage is already counted on this stage (saved by another micro-batch)
                    device_delta = 0
            else:
                n = ptrs.get(g.ptr, 1) - 1
                if n > 0:
                    ptrs[g.ptr] = n
                    device_delta = 0
                else:
                    ptrs.pop(g.ptr, None)
            self._saved[s] = self._saved.get(s, 0) + device_delta
            self._device_saved += device_delta
            st.peak_saved_bytes = max(st.peak_saved_bytes, self._saved[s])
            self._peak_device_saved = max(self._peak_device_saved, self._device_saved)
        if host_delta:
            self._host[s] = self._host.get(s, 0) + host_delta
            self._device_host += host_delta
            st.peak_offloaded_bytes = max(st.peak_offloaded_bytes, self._host[s])
            self._peak_device_host = max(self._peak_device_host, self._device_host)

    def _slot_died(self, g: _Group) -> None:
        with self._lock:
            g.live -= 1
            if g.live <= 0 and g.state != "released":
                self._drop_group(g)

    def _drop_group(self, g: _Group) -> None:
        """Stop counting ``g`` and drop its memory (called with the lock held)."""
        if g.stash.live_ptr.get(g.ptr) is g:
            del g.stash.live_ptr[g.ptr]
        if g.pending is not None:
            self._finish_offload(g, wait=True)
        if g.event is not None:  # a reload still reading the host buffer
            g.event.synchronize()
            g.event = None
        if g.counted:
            if g.state == "host":
                self._count(g, 0, -g.nbytes)
            else:
                self._count(g, -g.nbytes, 0)
            g.counted = False
        if g.host is not None:
            self._pool.put(g.host)
        g.host = None
        for slot in g.alive_slots():
            slot.tensor = None
        g.state = "released"

    def stats(self) -> ActivationStats:
        """Measured peaks so far (all steps)."""
        with self._lock:
            return ActivationStats(
                str(self.device), {s: StageActivationStats(**st.to_dict()) for s, st in sorted(self._stats.items())},
                self._peak_device_saved, self._peak_device_host,
            )

    def live_saved_bytes(self, stage: int | None = None) -> int:
        """Bytes of stashes live on the device now (of one stage, or of all)."""
        with self._lock:
            return self._device_saved if stage is None else self._saved.get(stage, 0)

    def offloaded_bytes(self, stage: int | None = None) -> int:
        """Bytes of stashes held in host memory now (of one stage, or of all)."""
        with self._lock:
            return self._device_host if stage is None else self._host.get(stage, 0)

    # ------------------------------------------------------------------ forward
    def forward(self, stage: int, mb: int, fn: Callable, args: tuple, kwargs: dict,
                resident: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
                recompute_fn: Callable | None = None):
        """Run ``fn(*args, **kwargs)`` (stage ``stage``'s forward of micro-batch ``mb``) under the stash hooks.

        Parameters
        ----------
        resident : iterable of Tensor, or a callable returning them
            Tensors that stay alive anyway (the stage's parameters and buffers); saved tensors
            sharing their storage, or the storage of a tensor in ``args``/``kwargs``, are not
            stashed. A callable is also called again when the forward saves its first tensor,
            i.e. inside ``fn``, after its module's forward pre-hooks: FSDP2 swaps a module's
            sharded parameters (DTensors) for the unsharded ones there, and only those are
            what the forward saves.
        recompute_fn : callable, optional
            What a recomputing stage runs again during the backward (default ``fn``), on the
            same inputs; it must save the same tensors in the same order as ``fn`` does
            (:mod:`fxpipe.codegen.runtime` gives the module's forward without FSDP2's hooks).
        """
        key = (int(stage), int(mb))
        with self._lock:
            old = self._stashes.pop(key, None)
            if old is not None:
                self._release(old)
            ms = _MicrobatchStash(self, key[0], key[1])
            self._stashes[key] = ms
            self._stage_stats(key[0])
        lazy = resident if callable(resident) else None
        ptrs = _resident_ptrs(resident() if lazy is not None else resident)
        inputs: dict[int, int] = {}
        for t in list(args) + list(kwargs.values()):
            if _plain(t) and _ptr(t) not in ptrs:
                inputs[_ptr(t)] = t.untyped_storage().nbytes()
        ptrs |= set(inputs)
        if stage in self.recompute_stages:
            return self._forward_recompute(ms, fn, args, kwargs, ptrs, lazy, recompute_fn or fn)
        saved_inputs: set[int] = set()
        run = functools.partial(self._segment_forward, ms, ptrs, lazy)
        with torch.autograd.graph.saved_tensors_hooks(self._packer(ms, ptrs, inputs, saved_inputs, lazy), self._unpack), \
                segment_scope(run):
            out = fn(*args, **kwargs)
        self._stashed(ms, sum(inputs[p] for p in saved_inputs))
        return out

    def _stashed(self, ms: _MicrobatchStash, input_bytes: int = 0) -> None:
        with self._lock:
            ms.state = "stashed"
            n = sum(g.nbytes for g in ms.groups.values() if g.counted)
            ms.kept = ms.live
            st = self._stage_stats(ms.stage)
            st.max_microbatch_bytes = max(st.max_microbatch_bytes, n)
            st.max_input_saved_bytes = max(st.max_input_saved_bytes, int(input_bytes))

    def _new_group(self, ms: _MicrobatchStash, t: torch.Tensor) -> _Group:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        g = ms.live_ptr.get(ptr)
        if g is None:
            g = _Group(ms, ptr, storage.nbytes(), t.device)
            ms.groups[id(g)] = ms.live_ptr[ptr] = g
            g.counted = True
            g.replayed = self._replaying
            self._count(g, g.nbytes, 0)
        return g

    def _add_slot(self, ms: _MicrobatchStash, slot: _Slot, t: torch.Tensor) -> None:
        with self._lock:
            g = self._new_group(ms, t)
            slot.group = g
            slot.tensor = t
            g.slots.append(weakref.ref(slot))
            g.live += 1

    def _packer(self, ms: _MicrobatchStash, resident_ptrs: set[int], inputs: Mapping[int, int] | None = None,
                saved_inputs: set[int] | None = None, lazy: Callable | None = None):
        inputs = inputs or {}

        def pack(t):
            if ms.npacks == 0 and lazy is not None:  # inside the forward: FSDP2 has unsharded the parameters
                resident_ptrs.update(_resident_ptrs(lazy()))
            ms.npacks += 1
            if _resident(t, resident_ptrs):
                if saved_inputs is not None and _plain(t) and _ptr(t) in inputs:
                    saved_inputs.add(_ptr(t))
                return t
            local, spec = _parts(t)
            slot = _Slot(ms, None, None, ms.npacks - 1, local, spec=spec)
            self._add_slot(ms, slot, local)
            return slot

        return pack

    def _unpack(self, x):
        if not isinstance(x, _Slot):
            return x
        t = x.tensor
        if t is not None:
            g = x.group
            if g is not None and g.event is not None:  # CUDA reload in flight
                torch.cuda.current_stream(g.device).wait_event(g.event)
            value = x.value()
            if x.seg is not None:
                self._after_replayed_unpack(x)
            return value
        ms, g = x.owner, x.group
        where = f"stage {ms.stage}, micro-batch {ms.mb}"
        if g is not None and g.state == "host":
            raise StashError(
                f"{where}: the backward needs activations that were offloaded to host memory and never reloaded: the "
                f"device program must issue the reload {ms.stage}R{ms.mb} after {ms.stage}O{ms.mb} and before the "
                "backward of this micro-batch"
            )
        if x.seg is not None and ms.state != "released":
            self._replay_segment(ms, x.seg)
            t = x.value()
            if t is not None:
                self._after_replayed_unpack(x)
                return t
            raise StashError(f"{where}: replaying checkpointed segment {x.seg.module.index} did not reproduce saved "
                             f"tensor #{x.index}")
        if ms.recompute and g is None and ms.state != "released":
            self._recompute(ms)
            if x.tensor is not None:
                return x.value()
            raise StashError(f"{where}: recomputing the stage forward did not reproduce saved tensor #{x.index}")
        raise StashError(
            f"{where}: the backward needs activations that were already released (a backward of this micro-batch "
            "after its last one?)"
        )

    # ------------------------------------------------------------------ checkpointed segments
    def _segment_forward(self, ms: _MicrobatchStash, resident_ptrs: set[int], lazy: Callable | None, seg, args: tuple):
        """Forward of a checkpointed segment inside a stage forward: keep its inputs, leave placeholders for what
        autograd saves (a storage the stash already holds is kept as is), keep the planned op results."""
        if lazy is not None:  # inside the stage forward: FSDP2 has put the unsharded parameters in place
            resident_ptrs.update(_resident_ptrs(lazy()))
        rec = _SegmentRun(seg)
        rec.rng = torch.get_rng_state()
        if self._cuda:
            rec.cuda_rng = torch.cuda.get_rng_state(self.device)
        for a in args:
            if not isinstance(a, torch.Tensor):
                rec.inputs.append((a, None))
            elif not _resident(a, resident_ptrs):
                local, spec = _parts(a)
                slot = _Slot(ms, None, None, -1, local, spec=spec)
                self._add_slot(ms, slot, local.detach())
                rec.inputs.append((slot, a.requires_grad))
            else:
                rec.inputs.append((a, a.requires_grad))
        if seg.writes_state:
            with torch.no_grad():
                rec.state_before = [(args[i], args[i].detach().clone()) for i in seg.writes_state]

        def pack(t):
            ms.npacks += 1
            i = rec.npacks
            rec.npacks += 1
            if _resident(t, resident_ptrs):
                return t
            local, spec = _parts(t)
            if _ptr(local) in ms.live_ptr:  # kept anyway (an input, a kept op result, the stash of another op)
                slot = _Slot(ms, None, None, i, local, spec=spec)
                self._add_slot(ms, slot, local)
                return slot
            slot = _Slot(ms, None, None, i, local, seg=rec, spec=spec)
            rec.slots.append(weakref.ref(slot))
            return slot

        keep = functools.partial(self._keep_result, ms) if seg.save else None
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out, rec.handles = run_segment_body(seg, args, keep=keep)
        with self._lock:
            ms.segments.append(rec)
            self._stage_stats(ms.stage).segment_runs += 1
        return out

    def _keep_result(self, ms: _MicrobatchStash, key: tuple, value: Any) -> tuple:
        """Keep an op result of a segment's forward (the planned ``save`` set) as slots: counted, offloaded."""
        if isinstance(value, torch.Tensor):
            return ("t", self._kept_slot(ms, value))
        return ("seq", type(value), [self._kept_slot(ms, v) if isinstance(v, torch.Tensor) else ("v", v) for v in value])

    def _kept_slot(self, ms: _MicrobatchStash, t: torch.Tensor):
        local, spec = _parts(t)
        if not _plain(local):
            return ("v", t)
        slot = _Slot(ms, None, None, -1, local, spec=spec)
        self._add_slot(ms, slot, local.detach())
        return slot

    @staticmethod
    def _fetch_result(handle: tuple):
        """A kept op result for the replay (None when any part of it is gone: the op then runs again)."""

        def one(h):
            if isinstance(h, _Slot):
                return None if h.tensor is None else h.value().detach()
            return h[1]

        if handle[0] == "t":
            return one(handle[1])
        parts = [one(h) for h in handle[2]]
        if any(p is None and isinstance(h, _Slot) for p, h in zip(parts, handle[2])):
            return None
        return handle[1](parts)

    def _replay_segment(self, ms: _MicrobatchStash, rec: _SegmentRun) -> None:
        """Run a segment's forward again on its kept inputs and fill its empty placeholders (by position)."""
        wanted = {s.index: s for s in (r() for r in rec.slots) if s is not None and s.tensor is None}
        if not wanted:
            return
        where = f"stage {ms.stage}, micro-batch {ms.mb}, checkpointed segment {rec.module.index}"
        args = []
        for value, rg in rec.inputs:
            if isinstance(value, _Slot):
                if value.tensor is None:
                    g = value.group
                    state = "on the host (offloaded, never reloaded)" if g is not None and g.state == "host" else "released"
                    raise StashError(f"{where}: its kept inputs are {state}: the backward cannot replay it")
                value = value.value()
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if rg and (value.is_floating_point() or value.is_complex()):
                    value.requires_grad_(True)
            args.append(value)
        prepare = self.before_replay.get(ms.stage)
        if prepare is not None:
            prepare()
        try:
            self._refill(ms, wanted, lambda: run_segment_body(rec.module, args, fetch=self._fetch_result,
                                                              handles=rec.handles),
                         rec.rng, rec.cuda_rng, rec.state_before, where, "segment's forward")
        finally:
            with self._lock:
                self._stage_stats(ms.stage).replays += 1
                for h in rec.handles.values():  # the replay took them (what it saved shares their storage)
                    for part in ([h[1]] if h[0] == "t" else h[2]):
                        if isinstance(part, _Slot):
                            self._drop_slot(part)
                rec.handles = {}

    def _refill(self, ms: _MicrobatchStash, wanted: dict[int, _Slot], run: Callable[[], Any], rng, cuda_rng,
                state_before: list, where: str, what: str) -> None:
        """Replay a forward (``run()``) and fill the placeholder slots ``wanted`` by position, stopping at the last.

        The random-number state is set to the forward's (``rng``, ``cuda_rng``) and the state the
        forward updates in place (``state_before``: ``(tensor, value before)``) to its value
        before it, both restored after. Raises :class:`StashError` naming ``where`` when the
        replay saves another tensor at a wanted position or fewer tensors.
        """
        last = max(wanted, default=-1)
        counter = [0]

        def pack(t):
            i = counter[0]
            counter[0] += 1
            slot = wanted.get(i)
            if slot is not None:
                local, spec = _parts(t)
                if not _plain(local) or tuple(local.shape) != slot.size or local.dtype != slot.dtype \
                        or (spec is None) != (slot.spec is None):
                    raise StashError(
                        f"{where}: the replay saved a different tensor at position {i} "
                        f"({getattr(local, 'dtype', type(t).__name__)} {tuple(getattr(local, 'shape', ()))} instead "
                        f"of {slot.dtype} {slot.size}): the {what} is not deterministic"
                    )
                self._add_slot(ms, slot, local.detach())
            if i >= last:
                raise _StopRecompute
            return t

        current = []
        with torch.no_grad():
            for t, before in state_before:
                current.append(t.detach().clone())
                t.copy_(before)
        self._replaying = True  # what the replay makes is measured as such (max_replay_peak_bytes)
        try:
            with torch.random.fork_rng(devices=[self.device] if self._cuda else []):
                torch.set_rng_state(rng)
                if self._cuda:
                    torch.cuda.set_rng_state(cuda_rng, self.device)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.enable_grad():
                    try:
                        run()
                    except _StopRecompute:
                        pass
        finally:
            self._replaying = False
            with torch.no_grad():
                for (t, _), now in zip(state_before, current):
                    t.copy_(now)
        missing = [i for i, s in wanted.items() if s.tensor is None]
        wanted.clear()  # the pack closure outlives this call (tracebacks): it must not keep the slots alive
        if missing:
            raise StashError(f"{where}: the replay saved fewer tensors than the forward ({len(missing)} missing, first "
                             f"at position {missing[0]}): the {what} is not deterministic")

    def _drop_slot(self, slot: _Slot) -> None:
        """Let go of one slot's tensor now (its group's memory goes with its last slot). Lock held."""
        g = slot.group
        slot.tensor = None
        slot.group = None
        if g is not None:
            g.live -= 1
            if g.live <= 0 and g.state != "released":
                self._drop_group(g)

    def _after_replayed_unpack(self, x: _Slot) -> None:
        """A split backward-input ``B`` read a replayed tensor: drop it unless the micro-batch's ``W`` reads it again."""
        scope = self._split_b
        ms = x.owner
        if scope is None or scope[0] != ms.stage or scope[1] != ms.mb:
            return
        node = current_autograd_node()
        if node is None or scope[2].needed(node):
            return
        with self._lock:
            self._drop_slot(x)

    def backward_scope(self, stage: int, mb: int, inputs: Sequence[Any] | None = None):
        """Context around a split backward-input ``B`` of ``(stage, mb)`` (``inputs``: the stage's input values).

        Inside it, a replayed saved tensor is dropped right after the ``B`` reads it unless the
        autograd node reading it will run again in the micro-batch's ``W`` (:class:`_WeightNeeds`),
        so a checkpointed stage holds one segment's replay at a time plus what ``W`` needs.
        """
        return _BackwardScope(self, int(stage), int(mb), inputs)

    def _begin_backward(self, stage: int, mb: int) -> None:
        ms = self._stashes.get((int(stage), int(mb)))
        if ms is None or ms.in_backward:
            return
        ms.in_backward = True
        ms.bwd_peak = ms.live
        ms.replay_peak = ms.replay_live

    def _end_backward(self, ms: _MicrobatchStash, split: bool) -> None:
        if not ms.in_backward:
            return
        ms.in_backward = False
        st = self._stage_stats(ms.stage)
        st.max_replay_peak_bytes = max(st.max_replay_peak_bytes, ms.replay_peak)
        st.max_backward_extra_bytes = max(st.max_backward_extra_bytes, ms.bwd_peak - ms.kept)
        if split:
            st.max_w_held_bytes = max(st.max_w_held_bytes, ms.replay_live)

    # ------------------------------------------------------------------ recompute
    def _forward_recompute(self, ms: _MicrobatchStash, fn, args, kwargs, resident_ptrs: set[int],
                           lazy: Callable | None = None, recompute_fn: Callable | None = None):
        ms.recompute = True
        ms.fn, ms.inputs, ms.kwargs = recompute_fn or fn, tuple(args), dict(kwargs)
        ms.rng = torch.get_rng_state()
        if self._cuda:
            ms.cuda_rng = torch.cuda.get_rng_state(self.device)
        with torch.no_grad():
            ms.state_before = [(t, t.detach().clone()) for _, t in self.mutated.get(ms.stage, ())]

        def pack(t):
            if ms.npacks == 0 and lazy is not None:  # inside the forward: FSDP2 has unsharded the parameters
                resident_ptrs.update(_resident_ptrs(lazy()))
            ms.npacks += 1
            if _resident(t, resident_ptrs):
                return t
            local, spec = _parts(t)
            slot = _Slot(ms, None, None, ms.npacks - 1, local, spec=spec)
            ms.slots.append(weakref.ref(slot))
            return slot

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = fn(*args, **kwargs)
        with self._lock:
            ms.state = "stashed"
        return out

    def _recompute(self, ms: _MicrobatchStash) -> None:
        """Run the stage forward again and fill every placeholder slot (once per micro-batch)."""
        if ms.recomputed:
            return
        ms.recomputed = True
        wanted = {s.index: s for s in (r() for r in ms.slots) if s is not None}
        try:
            self._refill(ms, wanted, lambda: ms.fn(*ms.inputs, **ms.kwargs), ms.rng, ms.cuda_rng, ms.state_before,
                         f"stage {ms.stage}, micro-batch {ms.mb}", "stage forward (do not recompute this stage)")
        finally:
            with self._lock:
                self._stage_stats(ms.stage).recomputes += 1

    # ------------------------------------------------------------------ offload / reload
    def after(self, torch_action) -> None:
        """Issue the O/R actions anchored after ``torch_action`` (a typed action of
        :mod:`fxpipe.ir.lowering`, or its text) and poll copies in flight."""
        self._poll()
        for a in self.program.memops_after(torch_action):
            if a.type == "O":
                self.offload(a.stage, a.microbatch)
            else:
                self.reload(a.stage, a.microbatch)

    def _get(self, stage: int, mb: int, what: str) -> _MicrobatchStash:
        ms = self._stashes.get((int(stage), int(mb)))
        if ms is None:
            raise StashError(f"{what} {stage}/{mb}: stage {stage} has no stash of micro-batch {mb} (its forward has not run)")
        return ms

    def offload(self, stage: int, mb: int) -> None:
        """``O(stage, mb)``: move the micro-batch's stash to host memory and release the device copies.

        Raises
        ------
        StashError
            When the stash is not on the device (no forward yet, already offloaded or released).
        """
        with self._lock:
            ms = self._get(stage, mb, "offload")
            if ms.state != "stashed":
                raise StashError(f"offload {stage}O{mb}: the stash is {ms.state}, expected it on the device after the forward")
            ms.state = "offloaded"
            st = self._stage_stats(stage)
            st.offloads += 1
            for g in list(ms.groups.values()):
                slots = g.alive_slots()
                if g.state != "device" or g.live <= 0 or not slots:
                    continue
                src = torch.empty(0, dtype=torch.uint8, device=g.device).set_(slots[0].tensor.untyped_storage())
                host = self._pool.get(g.nbytes)
                if self._cuda:
                    ready = torch.cuda.current_stream(self.device).record_event()
                    with torch.cuda.stream(self._copy_stream):
                        self._copy_stream.wait_event(ready)
                        host.copy_(src, non_blocking=True)
                        done = self._copy_stream.record_event()
                    g.pending = (done, [s.tensor for s in slots], src)  # device memory kept until the copy is done
                    self._in_flight.append(g)
                else:
                    host.copy_(src)
                    self._count(g, -g.nbytes, 0)
                del src
                for s in slots:
                    s.tensor = None
                if ms.live_ptr.get(g.ptr) is g:
                    del ms.live_ptr[g.ptr]
                g.host = host
                g.state = "host"
                self._count(g, 0, g.nbytes)
                st.offloaded_bytes_total += g.nbytes

    def reload(self, stage: int, mb: int) -> None:
        """``R(stage, mb)``: copy the micro-batch's stash back to the device and rebuild its saved views.

        Raises
        ------
        StashError
            When the stash is not offloaded.
        """
        with self._lock:
            ms = self._get(stage, mb, "reload")
            if ms.state != "offloaded":
                raise StashError(f"reload {stage}R{mb}: the stash is {ms.state}, not offloaded")
            ms.state = "stashed"
            self._stage_stats(stage).reloads += 1
            for g in ms.groups.values():
                if g.state != "host":
                    continue
                dev = torch.empty(g.nbytes, dtype=torch.uint8, device=g.device)
                if self._cuda:
                    self._finish_offload(g, wait=True)
                    ready = torch.cuda.current_stream(self.device).record_event()
                    with torch.cuda.stream(self._copy_stream):
                        self._copy_stream.wait_event(ready)
                        dev.copy_(g.host, non_blocking=True)
                        g.event = self._copy_stream.record_event()
                    self._in_flight.append(g)  # the host buffer returns to the pool when the copy is done
                else:
                    dev.copy_(g.host)
                    self._pool.put(g.host)
                    g.host = None
                storage = dev.untyped_storage()
                for s in g.alive_slots():
                    s.tensor = torch.empty(0, dtype=s.dtype, device=g.device).set_(storage, s.offset, s.size, s.stride)
                self._count(g, 0, -g.nbytes)
                g.ptr = storage.data_ptr()
                ms.live_ptr[g.ptr] = g
                g.state = "device"
                self._count(g, g.nbytes, 0)

    def _finish_offload(self, g: _Group, wait: bool) -> bool:
        """CUDA: release the device memory of an offload whose copy has finished (True when done)."""
        if g.pending is None:
            return True
        done = g.pending[0]
        if wait:
            done.synchronize()
        elif not done.query():
            return False
        g.pending = None
        if g.counted:
            self._count(g, -g.nbytes, 0)
        return True

    def _poll(self, wait: bool = False) -> None:
        """CUDA: release what finished copies no longer need (``wait``: wait for all copies)."""
        if not self._in_flight:
            return
        with self._lock:
            keep = []
            for g in self._in_flight:
                if g.pending is not None:
                    self._finish_offload(g, wait)
                if g.event is not None:
                    if wait:
                        g.event.synchronize()
                    if wait or g.event.query():
                        g.event = None
                        if g.host is not None and g.state == "device":
                            self._pool.put(g.host)
                            g.host = None
                if g.pending is not None or g.event is not None:
                    keep.append(g)
            self._in_flight = keep

    def before_backward(self, stage: int, mb: int) -> None:
        """Make the compute stream wait for the reload of ``(stage, mb)`` (CUDA; nothing on CPU)."""
        self._poll()
        with self._lock:
            self._begin_backward(stage, mb)
        if not self._cuda:
            return
        ms = self._stashes.get((int(stage), int(mb)))
        if ms is None:
            return
        stream = torch.cuda.current_stream(self.device)
        for g in ms.groups.values():
            if g.event is not None:
                stream.wait_event(g.event)

    # ------------------------------------------------------------------ release / steps
    def release(self, stage: int, mb: int) -> None:
        """The micro-batch's last backward on ``stage`` ended: drop whatever its stash still holds."""
        with self._lock:
            ms = self._stashes.pop((int(stage), int(mb)), None)
            if ms is not None:
                self._end_backward(ms, split=False)
                self._release(ms)

    def end_backward_input(self, stage: int, mb: int) -> None:
        """A split backward-input ``B`` of ``(stage, mb)`` ended (its ``W`` comes later): record its measurements."""
        with self._lock:
            ms = self._stashes.get((int(stage), int(mb)))
            if ms is not None:
                self._end_backward(ms, split=True)

    def _release(self, ms: _MicrobatchStash) -> None:
        for g in ms.groups.values():
            if g.state != "released":
                self._drop_group(g)
        for r in ms.slots:
            slot = r()
            if slot is not None:
                slot.tensor = None
        ms.state = "released"
        ms.inputs, ms.kwargs, ms.fn, ms.state_before = (), {}, None, []
        ms.segments = []
        ms.live_ptr = {}

    def begin_step(self) -> None:
        """Start of a training step: no stash may be left from the previous one."""
        self.end_step()

    def end_step(self) -> None:
        """End of a step: finish copies in flight and release every stash (forward-only steps keep theirs until here)."""
        self._poll(wait=True)
        with self._lock:
            for key in list(self._stashes):
                self._release(self._stashes.pop(key))
            self._in_flight = []

    # ------------------------------------------------------------------ introspection (tests)
    def stash_tensors(self, stage: int, mb: int) -> list[torch.Tensor]:
        """The device tensors the stash of ``(stage, mb)`` holds now (for tests and debugging)."""
        ms = self._stashes.get((int(stage), int(mb)))
        if ms is None:
            return []
        return [s.tensor for g in ms.groups.values() for s in g.alive_slots() if s.tensor is not None]


# ----------------------------------------------------------------------------- measurement
def measure_stage(staged, stage: int, policy: Any, stage_inputs: Sequence[Any], seed: int = 0,
                  repeat: int = 1) -> dict[str, Any]:
    """Run one micro-batch of one stage under ``policy`` in this process and measure it (saved-tensor hooks).

    The stage's forward runs under a :class:`DeviceStash` as on a
    pipeline rank (its inputs are leaves that stay resident, as torch's receive buffers), then
    a full backward from random output gradients (seeded).

    Parameters
    ----------
    staged : StagedProgram
        From :func:`fxpipe.codegen.split.split_stages` (node names of this capture).
    stage : int
    policy : CheckpointPolicy or None
        In this capture's names (``"stage"``: the stash's whole-stage recomputation).
    stage_inputs : sequence
        The stage's inputs for one micro-batch (:meth:`StagedProgram.stage_inputs`).
    seed : int
        Seed of the output gradients.
    repeat : int
        Forward + backward runs (the measurements are the largest over them; the gradients
        those of the last).

    Returns
    -------
    dict
        ``kept_bytes`` (what the forward left saved: unique storages, the measured counterpart
        of ``CheckpointPolicy.kept_bytes``), ``replay_peak_bytes`` (replayed saved tensors held
        at once during the backward, gradients not included), ``backward_extra_bytes``,
        ``replays`` and ``segment_runs`` (per run), ``pieces`` (carved segment modules),
        ``wall_s`` (seconds of each run's forward + backward) and ``grads`` (parameter
        gradients, canonical names).
    """

    spec = staged.stages[stage]
    module = spec.module
    whole = policy_kind(policy) == "stage"
    carved = apply_checkpoint(module, None if whole else policy, stage)
    try:
        stash = DeviceStash("cpu", recompute_stages=[stage] if whole else [],
                            mutated={stage: mutated_state(module)} if whole else None)
        walls = []
        runs = max(1, int(repeat))
        for _ in range(runs):
            for p in module.parameters():
                p.grad = None
            args = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                         for x in stage_inputs)
            t0 = time.perf_counter()
            out = stash.forward(stage, 0, module, args, {}, lambda: list(module.parameters()) + list(module.buffers()))
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            g = torch.Generator().manual_seed(seed)
            grads = [torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.dtype) for o in outs]
            stash.before_backward(stage, 0)
            if outs:
                torch.autograd.backward(outs, grads)
            stash.release(stage, 0)
            walls.append(time.perf_counter() - t0)
            del out, outs, args
        st = stash.stats().stages[stage]
        return {
            "kept_bytes": st.max_microbatch_bytes,
            "replay_peak_bytes": st.max_replay_peak_bytes,
            "backward_extra_bytes": st.max_backward_extra_bytes,
            "replays": (st.replays + st.recomputes) // runs,
            "segment_runs": st.segment_runs // runs,
            "pieces": list(carved.pieces),
            "wall_s": walls,
            "grads": {fqn: (p.grad.detach().clone() if p.grad is not None else None)
                      for fqn, p in spec.named_parameters().items()},
        }
    finally:
        apply_checkpoint(module, None, stage)


def device_stash(device_index: int, orders: Any, torch_actions: Sequence[Any], recompute_stages: Iterable[int],
                 modules: Mapping[int, torch.nn.Module], device, track: bool = True) -> DeviceStash | None:
    """The :class:`DeviceStash` of one device (all its stages; None when it has nothing to do).

    Parameters
    ----------
    device_index : int
        The device (rank) in the placement; its program is ``orders.of_device(device_index)``.
    orders : fxpipe.ir.Orders or Mapping[int, list[(type, microbatch)]]
        The device programs with their O/R actions (:func:`fxpipe.ir.schedule_to_orders` keeps
        them); the per-stage form is read with one stage per device.
    torch_actions : sequence of typed actions (or their text)
        The device's compute actions as the runtime executes them (after fusion,
        :func:`fxpipe.codegen.actions.lower_orders`).
    recompute_stages : iterable of int
        Stages (of the whole pipeline) that recompute their forward.
    modules : Mapping[int, torch.nn.Module]
        This device's stage modules (their in-place updated state is restored around a recomputation).
    device : torch.device or str
    track : bool
        Create a stash for accounting even without offload or recomputation.

    Raises
    ------
    InputError
        For a recompute stage outside ``0..num_stages-1`` or O/R actions the device cannot run
        (see :func:`fxpipe.codegen.offload.offload_program`).
    """
    programs = programs_of(orders)
    num_stages = programs.num_stages
    rec = set()
    for s in recompute_stages:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_stages:
            raise InputError(f"recompute_stages must be stage indices in 0..{num_stages - 1}, got {s!r}")
        rec.add(int(s))
    prog = programs.of_device(device_index)
    program = offload_program(prog, torch_actions) if any(not a.is_compute for a in prog) else None
    local = {s for s in rec if s in modules}
    if not track and (program is None or program.empty) and not local:
        return None
    return DeviceStash(device, program, local, {s: mutated_state(modules[s]) for s in local})
