"""Schedule problems and timed schedules: Contract 3 of DESIGN.md.

* :class:`ScheduleProblem` is the problem half (``fxpipe.schedproblem/1``).
* :class:`Schedule` / :class:`ScheduledOp` are the result half (``fxpipe.schedule/1``).

No torch here.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import (MAX_BYTES, MAX_TIME_S, _as_count, _as_float_array, _as_index, _check_finite_nonneg, _freeze,
                       read_json, write_json_atomic)

__all__ = [
    "SCHEDPROBLEM_FORMAT",
    "SCHEDULE_FORMAT",
    "OP_TYPES",
    "OBJECTIVES",
    "CheckpointOption",
    "ScheduleProblem",
    "ScheduledOp",
    "Schedule",
    "sort_ops",
    "Action",
    "ACTION_TYPES",
    "FULL_BACKWARD",
    "split_action_text",
    "Orders",
    "ORDERS_FORMAT",
    "program_order",
    "schedule_to_orders",
    "identity_placement",
    "looped_placement",
    "v_placement",
    "MAX_MICROBATCHES",
    "MAX_STAGES",
    "MAX_OPS",
]

SCHEDPROBLEM_FORMAT = "fxpipe.schedproblem/1"
SCHEDULE_FORMAT = "fxpipe.schedule/1"

OP_TYPES = ("F", "B", "W", "O", "R")
OBJECTIVES = ("stage_span", "makespan")

#: The most micro-batches a schedule problem may have: the memory lower bounds
#: (:mod:`fxpipe.schedule.bounds`) take O(m^2) time and memory per stage (m = 4096: about 1 GB, tens of
#: seconds; m = 10^6 would need 7 TiB), and pipelines run tens to hundreds of micro-batches per replica.
MAX_MICROBATCHES = 4096
#: The most stages a schedule problem may have.
MAX_STAGES = 4096
#: The most F, B and W operations a schedule problem may have (``3 * num_stages * num_microbatches``).
MAX_OPS = 3 * 2**20


def identity_placement(num_stages: int) -> tuple[int, ...]:
    """One stage per device: stage s on device s (the default placement)."""
    return tuple(range(int(num_stages)))


def looped_placement(num_devices: int, stages_per_device: int) -> tuple[int, ...]:
    """Looped placement of ``v * p`` stages: stage s on device ``s mod p``.

    The placement of interleaved 1F1B (Narayanan et al. 2021, Section 2.2): device d holds
    the model chunks d, d + p, d + 2p, ...

    Parameters
    ----------
    num_devices : int
        p >= 1.
    stages_per_device : int
        v >= 1.

    Returns
    -------
    tuple of int, length v * p
    """
    p, v = _devices_and_chunks(num_devices, stages_per_device, "looped")
    return tuple(s % p for s in range(v * p))


def v_placement(num_devices: int, stages_per_device: int = 2) -> tuple[int, ...]:
    """V-shape (zig-zag) placement: stages s and 2p - 1 - s on device s.

    The placement of ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
    Section 3) and DualPipe-V: the first p stages go down the devices, the next p come back
    up, so device 0 holds the first and the last stage. With ``stages_per_device > 2`` the
    zig-zag continues (torch's ``generate_stage_to_rank_mapping(style="v")``).

    Parameters
    ----------
    num_devices : int
        p >= 1.
    stages_per_device : int
        v >= 1 (2 for ZB-V and DualPipe-V).

    Returns
    -------
    tuple of int, length v * p
    """
    p, v = _devices_and_chunks(num_devices, stages_per_device, "V")
    return tuple(s % p if (s // p) % 2 == 0 else p - 1 - s % p for s in range(v * p))


def _devices_and_chunks(num_devices: Any, stages_per_device: Any, kind: str) -> tuple[int, int]:
    """Validated ``(p, v)`` of a ``kind`` placement (InputError unless both are integers >= 1)."""
    p, v = _as_count(num_devices, "num_devices"), _as_count(stages_per_device, "stages_per_device")
    if p < 1 or v < 1:
        raise InputError(f"{kind} placement needs p >= 1 devices and v >= 1 stages per device, got p={p}, v={v}")
    return p, v


def _placement(device_of_stage: Any, num_devices: Any, S: int) -> tuple[int, tuple[int, ...]]:
    """Validated (num_devices, device_of_stage) for S stages (identity by default)."""
    if device_of_stage is None:
        D = S if num_devices is None else _as_count(num_devices, "num_devices")
        if D != S:
            raise InputError(
                f"num_devices is {D} but num_stages is {S} and no device_of_stage is given: give device_of_stage "
                "(the device of every stage), e.g. looped [s % p] or V-shape"
            )
        return S, identity_placement(S)
    if isinstance(device_of_stage, (str, bytes)) or not hasattr(device_of_stage, "__len__"):
        raise InputError(f"device_of_stage must be a list of {S} device indices, got {device_of_stage!r:.200}")
    if len(device_of_stage) != S:
        raise InputError(f"device_of_stage must have one entry per stage ({S}), got {len(device_of_stage)}")
    try:
        dev = tuple(_as_index(d) for d in device_of_stage)
    except (TypeError, ValueError):
        raise InputError(f"device_of_stage must list integer device indices, got {list(device_of_stage)!r:.200}") from None
    D = (max(dev) + 1 if dev else 0) if num_devices is None else _as_count(num_devices, "num_devices")
    if D < 1:
        raise InputError(f"num_devices must be >= 1, got {D}")
    bad = [s for s, d in enumerate(dev) if not 0 <= d < D]
    if bad:
        raise InputError(f"device_of_stage[{bad[0]}] = {dev[bad[0]]} names a device outside 0..{D - 1}")
    empty = sorted(set(range(D)) - set(dev))
    if empty:
        raise InputError(
            f"device {empty[0]} holds no stage ({len(empty)} empty device(s)): every device of num_devices = {D} "
            "must hold at least one stage; lower num_devices or change device_of_stage"
        )
    return D, dev


#: Name of the option of a stage that checkpoints nothing (its stash is ``mem_f``, as built).
NO_CHECKPOINT = "none"


@dataclass(frozen=True)
class CheckpointOption:
    """One activation-checkpoint option of a stage: what it costs per micro-batch.

    An entry of :attr:`ScheduleProblem.checkpoint_menu`; :meth:`ScheduleProblem.with_checkpoint`
    applies it. The option's policy (which segments B replays, which outputs F keeps) lives
    with the plan (:class:`fxpipe.memory.checkpoint.CheckpointPolicy`); the schedule needs only
    these figures (bytes and seconds of one micro-batch of the stage, the stage's pooled receive
    buffers, :attr:`ScheduleProblem.pooled_bytes`, not included).

    Attributes
    ----------
    name : str
        Unique in the stage's menu; ``"none"`` is the stage as built (nothing replayed).
    replay_s : float
        Forward time B replays (added to ``t_b``), >= 0; 0 for ``"none"``.
    kept_bytes : float
        What F keeps for the backward (the stash), >= 0.
    peak_bytes : float
        What a B holds at its worst moment beyond ``kept_bytes`` (the replayed segment's
        activations, the W-inputs of the segments already done), >= 0.
    w_bytes : float
        What the stage holds from the end of a B to its W (the inputs the weight gradients
        need), >= 0.
    fused_w_s : float
        0 for an option with a split backward. > 0 for a *fused* one: B and W of a micro-batch
        run as one full backward (torch's ``B``; the runtime fuses a B its device runs right
        before its W, :func:`fxpipe.ir.lowering.merge_backward`), so nothing is held for W
        (``w_bytes = 0``); this is the stage's weight-gradient time, which the option moves into
        ``t_b`` (``t_w`` becomes 0; :func:`fxpipe.schedule.validate.place_fused_w` puts every W of
        such a stage right after its B).
    """

    name: str
    replay_s: float = 0.0
    kept_bytes: float = 0.0
    peak_bytes: float = 0.0
    w_bytes: float = 0.0
    fused_w_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"a checkpoint option needs a non-empty name, got {self.name!r}")
        for key in ("replay_s", "kept_bytes", "peak_bytes", "w_bytes", "fused_w_s"):
            val = getattr(self, key)
            try:
                val = float(val)
            except (TypeError, ValueError):
                raise InputError(f"checkpoint option {self.name!r}: {key} must be a number, got {val!r}") from None
            if not (math.isfinite(val) and val >= 0):
                raise InputError(f"checkpoint option {self.name!r}: {key} must be finite and >= 0, got {val!r}")
            object.__setattr__(self, key, val)

    @property
    def fused(self) -> bool:
        """B and W run as one full backward (``fused_w_s > 0``)."""
        return self.fused_w_s > 0

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "replay_s": self.replay_s, "kept_bytes": self.kept_bytes,
               "peak_bytes": self.peak_bytes, "w_bytes": self.w_bytes}
        if self.fused_w_s:
            out["fused_w_s"] = self.fused_w_s
        return out

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "checkpoint option") -> "CheckpointOption":
        """Parse :meth:`to_dict`'s document (InputError naming the field)."""
        if not isinstance(doc, Mapping) or "name" not in doc:
            raise InputError(f"{source}: expected an object with 'name', 'replay_s', 'kept_bytes', 'peak_bytes', "
                             f"'w_bytes', got {doc!r:.200}")
        try:
            return cls(str(doc["name"]), **{k: doc.get(k, 0.0) for k in ("replay_s", "kept_bytes", "peak_bytes",
                                                                          "w_bytes", "fused_w_s")})
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None

    def b_level(self, pooled: float) -> float:
        """Memory of the micro-batch while its B runs: ``max(kept + pooled + peak, w + pooled)`` (bytes)."""
        return max(self.kept_bytes + pooled + self.peak_bytes, self.w_bytes + pooled)


def _legacy_menu(f: Mapping[str, np.ndarray], rec: Sequence[bool]) -> tuple[tuple[CheckpointOption, ...], ...]:
    """The default menu of a problem built without one: ``"none"`` and whole-stage ``"stage"`` recomputation,
    from the fields as :meth:`ScheduleProblem.with_recompute` has always read them (``recompute_mem_f`` what a
    recomputing F keeps, ``mem_f - pooled`` the stash B replays, ``-mem_w`` what W needs)."""
    out = []
    for s, r in enumerate(rec):
        c, w = float(f["pooled"][s]), max(-float(f["mem_w"][s]) - float(f["pooled"][s]), 0.0)
        if r:  # the fields describe the recomputing stage: its replayed stash is what B holds beyond mem_f
            kept = max(float(f["mem_f"][s]) - c, 0.0)
            stash = max(float(f["mem_b"][s]) + float(f["trans"][s]), 0.0)
            none = CheckpointOption(NO_CHECKPOINT, 0.0, stash, 0.0, w)
            stage = CheckpointOption("stage", float(f["t_f"][s]), kept, stash, w)
        else:
            stash = max(float(f["mem_f"][s]) - c, 0.0)
            none = CheckpointOption(NO_CHECKPOINT, 0.0, stash, 0.0, w)
            stage = CheckpointOption("stage", float(f["t_f"][s]), max(float(f["rmf"][s]) - c, 0.0), stash, w)
        out.append((none, stage))
    return tuple(out)


def _parse_menu(menu: Any, S: int) -> tuple[tuple[CheckpointOption, ...], ...]:
    """Validated ``checkpoint_menu`` (S lists of options, each with a ``"none"`` and unique names)."""
    if isinstance(menu, (str, bytes)) or not hasattr(menu, "__len__") or len(menu) != S:
        raise InputError(f"checkpoint_menu must list the options of each of the {S} stages, got {menu!r:.200}")
    out = []
    for s, opts in enumerate(menu):
        if isinstance(opts, (str, bytes, Mapping)) or not hasattr(opts, "__iter__"):
            raise InputError(f"checkpoint_menu[{s}] must be a list of options, got {opts!r:.200}")
        row = tuple(o if isinstance(o, CheckpointOption) else
                    CheckpointOption.from_dict(o, source=f"checkpoint_menu[{s}]") for o in opts)
        names = [o.name for o in row]
        if len(set(names)) != len(names):
            raise InputError(f"checkpoint_menu[{s}] names an option twice: {names}")
        if NO_CHECKPOINT not in names:
            raise InputError(f"checkpoint_menu[{s}] must hold the option {NO_CHECKPOINT!r} (the stage as built), got {names}")
        none = row[names.index(NO_CHECKPOINT)]
        if none.replay_s != 0.0 or none.peak_bytes != 0.0:
            raise InputError(f"checkpoint_menu[{s}]: option 'none' replays nothing: its replay_s and peak_bytes must be 0")
        out.append(row)
    return tuple(out)


def _checkpoint_names(checkpoint: Any, rec: Sequence[bool], S: int, *, explicit_recompute: bool) -> list[str] | None:
    """Validated ``checkpoint`` names (None when not given); they must agree with an explicit ``recompute``."""
    if checkpoint is None:
        return None
    if isinstance(checkpoint, (str, bytes)) or not hasattr(checkpoint, "__len__") or len(checkpoint) != S:
        raise InputError(f"checkpoint must name the option of each of the {S} stages, got {checkpoint!r:.200}")
    names = [str(c) if isinstance(c, str) else c for c in checkpoint]
    if not all(isinstance(c, str) and c for c in names):
        raise InputError(f"checkpoint must list option names (strings), got {list(checkpoint)!r:.200}")
    if explicit_recompute:
        bad = [s for s in range(S) if rec[s] != (names[s] != NO_CHECKPOINT)]
        if bad:
            raise InputError(f"stage {bad[0]}: recompute is {rec[bad[0]]} but checkpoint is {names[bad[0]]!r} "
                             "(a stage recomputes exactly when its checkpoint option is not 'none')")
    return names


def _check_checkpoint_fields(f: Mapping[str, np.ndarray], ckpt: Sequence[str], menu, derived: bool) -> None:
    """Every stage runs an option of its menu, and (a menu given, not ``derived`` from the fields) a
    checkpointing stage's fields are its option's figures."""
    for s, name in enumerate(ckpt):
        by_name = {o.name: o for o in menu[s]}
        if name not in by_name:
            raise InputError(f"stage {s}: checkpoint option {name!r} is not in its menu {sorted(by_name)}")
        if derived:
            continue
        o, c = by_name[name], float(f["pooled"][s])
        mem_f = float(f["mem_f"][s])
        want = {"mem_f (kept_bytes + pooled_bytes)": (mem_f, o.kept_bytes + c)}
        if name != NO_CHECKPOINT:
            want["-mem_w (w_bytes + pooled_bytes)"] = (-float(f["mem_w"][s]), o.w_bytes + c)
            want["mem_f + mem_b + mem_b_transient (the B's level)"] = (
                mem_f + float(f["mem_b"][s]) + float(f["trans"][s]), o.b_level(c))
            if float(f["t_b"][s]) < (o.replay_s + o.fused_w_s) * (1 - 1e-9) - 1e-15:
                raise InputError(f"stage {s}: t_b = {float(f['t_b'][s]):g} s is below the replay time "
                                 f"{o.replay_s:g} s (+ the fused W's {o.fused_w_s:g} s) of its checkpoint option {name!r}")
            if o.fused_w_s and float(f["t_w"][s]) > 1e-12 * max(1.0, o.fused_w_s):
                raise InputError(f"stage {s}: its checkpoint option {name!r} fuses W into B, so t_w must be 0, "
                                 f"got {float(f['t_w'][s]):g}")
        elif o.kept_bytes == 0.0 and mem_f > 0 and mem_f <= max(c, 1.0):
            continue  # an empty stage: mem_f holds the 1-byte floor of Contract 3
        for what, (got, exp) in want.items():
            if abs(got - exp) > 1e-6 * max(1.0, abs(got), abs(exp)):
                raise InputError(f"stage {s}: {what} is {got:.9g} but its checkpoint option {name!r} gives {exp:.9g}: "
                                 "derive a checkpointing stage with ScheduleProblem.with_checkpoint")


@dataclass(frozen=True, eq=False)
class ScheduleProblem:
    """A pipeline scheduling problem: Contract 3 of DESIGN.md (``fxpipe.schedproblem/1``).

    S stages placed on D devices (``device_of_stage``, default one stage per device), m
    micro-batches. Times in seconds (each in [0, :data:`fxpipe.io.MAX_TIME_S` = 1e6]), memory in
    bytes (magnitudes up to :data:`fxpipe.io.MAX_BYTES` = 1e18). At most :data:`MAX_STAGES` stages,
    :data:`MAX_MICROBATCHES` micro-batches and :data:`MAX_OPS` F/B/W operations. Stages form a chain: micro-batch j's forward runs through stages
    0, 1, ..., S-1 and its backward back from S-1 to 0, whatever devices they are on.

    Attributes
    ----------
    num_stages : int
        1 <= S <= :data:`MAX_STAGES`.
    num_microbatches : int
        1 <= m <= :data:`MAX_MICROBATCHES`.
    num_devices : int
        D >= 1; every device holds at least one stage.
    device_of_stage : tuple[int, ...], length S
        Device of every stage (identity by default; looped: :func:`looped_placement`,
        V-shape: :func:`v_placement`). The F/B/W ops of all stages of a device share one
        compute stream, their O/R ops one copy stream, and their memory one ``mem_limit``.
    t_f, t_b, t_w : float64 array (S,)
        Forward, backward-input and backward-weight time of one micro-batch on stage s.
    t_comm : float64 array (S-1,)
        ``t_comm[s]`` is the one-way transfer time between stage s and s+1 (activations
        forward, gradients backward) when they are on different devices; a transfer between
        stages on one device is free (see :attr:`t_comm_effective`). A scalar in JSON means
        the same for every boundary.
    t_offload : float64 array (S,)
        One-way D2H (or H2D) time of one micro-batch's offloadable stash on stage s.
    mem_f, mem_b, mem_w : float64 array (S,)
        Memory deltas of F (> 0), B (<= 0) and W (<= 0); ``mem_f + mem_b + mem_w == 0``.
    offload_bytes : float64 array (S,)
        Bytes freed by an offload, ``0 <= offload_bytes <= mem_f``.
    mem_limit : float64 array (D,)
        Memory available for activations on device d (``inf`` = unlimited), shared by the
        stages it holds. With one stage per device this is the old per-stage limit.
    pcie_groups : tuple[tuple[int, ...], ...]
        Stages whose host transfers (O/R) must not overlap (on top of the per-device copy
        stream).
    recompute : tuple[bool, ...], length S
        Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
        Cost"): stage s checkpoints (its :attr:`checkpoint` option is not ``"none"``), so B
        replays some of its forward and F keeps less. For such a stage the other per-stage
        fields already describe the checkpointing stage (:meth:`with_checkpoint` derives them):
        ``t_b`` includes the replayed forward, ``mem_f`` is what F keeps, ``mem_b`` may be
        positive (after B the recomputed activations the W needs are held), ``mem_b_transient``
        is what B holds only while it runs (the replayed activations), and ``offload_bytes`` is
        0. Default: no stage recomputes.
    checkpoint : tuple[str, ...], length S
        The activation-checkpoint option every stage runs (a name of its
        :attr:`checkpoint_menu`); ``"none"`` (the default) is the stage as built, ``"stage"``
        the whole-stage recomputation of :meth:`with_recompute`. ``recompute[s]`` is
        ``checkpoint[s] != "none"``.
    checkpoint_menu : tuple[tuple[CheckpointOption, ...], ...], length S
        The options every stage may run (issue 28: none, per-block full, selective op
        checkpointing, budgeted keep sets, whole-stage recomputation; built by
        :mod:`fxpipe.memory.checkpoint`), each with its replay time, kept bytes, peak of B
        beyond the kept bytes and W inputs. Default (problems without a menu, e.g. files
        written before it): ``"none"`` and ``"stage"``, derived from the fields as before
        (``recompute_mem_f``). The current option's figures agree with the fields:
        ``mem_f = kept + pooled``, ``-mem_w = w + pooled``, ``mem_f + mem_b +
        mem_b_transient = max(kept + pooled + peak, w + pooled)`` on a checkpointing stage.
    mem_b_transient : float64 array (S,)
        Bytes a B of stage s holds only while it runs, ``>= 0`` (default 0): memory rises by
        ``mem_b + mem_b_transient`` at the start of the B and falls by ``mem_b_transient`` at
        its end (Contract 3 rule 5). One B runs at a time on a device, so at most one such
        transient counts per device at any moment.
    recompute_mem_f : float64 array (S,)
        Bytes an F of stage s would keep if the stage recomputed (one micro-batch of the
        stage's inputs), ``> 0``; default ``mem_f`` (recomputing saves nothing). Used by
        :meth:`with_recompute`; for a recomputing stage it equals ``mem_f``.
    pooled_bytes : float64 array (S,)
        Bytes of ``mem_f`` that stay on the device from a micro-batch's F to its W whatever is
        done, ``0 <= pooled_bytes <= mem_f`` (default 0): the stage's pooled receive buffers
        (:meth:`fxpipe.memory.MemoryModel.pooled_buffer_bytes`). An offload cannot move them
        (``offload_bytes <= mem_f - pooled_bytes``), and a recomputing stage's inputs
        (``recompute_mem_f``) are them, so its B replays only ``mem_f - pooled_bytes``
        (:meth:`with_recompute`).
    objective : str
        ``"stage_span"`` (default) or ``"makespan"`` (OptPipe Eq. 4). ``stage_span`` is the
        largest *per-device span*: for device d, the end of the last W op of any stage on d
        minus the start of the first F op of any stage on d (these are the device's last and
        first compute ops); the objective is the maximum over devices. With one stage per
        device it is OptPipe Eq. 3's per-stage span (first F to last W of a stage), the
        "post-validation" objective of Zero Bubble where consecutive iterations overlap.
    name : str
        Free-form label.
    """

    num_stages: int
    num_microbatches: int
    t_f: np.ndarray
    t_b: np.ndarray
    t_w: np.ndarray
    t_comm: np.ndarray
    t_offload: np.ndarray
    mem_f: np.ndarray
    mem_b: np.ndarray
    mem_w: np.ndarray
    offload_bytes: np.ndarray
    mem_limit: np.ndarray
    pcie_groups: tuple[tuple[int, ...], ...] = ()
    objective: str = "stage_span"
    name: str = "problem"
    num_devices: int = 0
    device_of_stage: tuple[int, ...] = ()
    recompute: tuple[bool, ...] = ()
    mem_b_transient: np.ndarray | None = None
    recompute_mem_f: np.ndarray | None = None
    pooled_bytes: np.ndarray | None = None
    checkpoint: tuple[str, ...] = ()
    checkpoint_menu: tuple[tuple[CheckpointOption, ...], ...] = ()

    @classmethod
    def create(
        cls,
        *,
        num_stages: int,
        num_microbatches: int,
        t_f: float | Sequence[float],
        t_b: float | Sequence[float],
        t_w: float | Sequence[float],
        t_comm: float | Sequence[float] = 0.0,
        t_offload: float | Sequence[float] = 0.0,
        mem_f: float | Sequence[float] = 1.0,
        mem_b: float | Sequence[float] | None = None,
        mem_w: float | Sequence[float] | None = None,
        offload_bytes: float | Sequence[float] | None = None,
        mem_limit: float | Sequence[float] = math.inf,
        pcie_groups: Sequence[Sequence[int]] = (),
        objective: str = "stage_span",
        name: str = "problem",
        num_devices: int | None = None,
        device_of_stage: Sequence[int] | None = None,
        recompute: Sequence[bool] | None = None,
        mem_b_transient: float | Sequence[float] | None = None,
        recompute_mem_f: float | Sequence[float] | None = None,
        pooled_bytes: float | Sequence[float] | None = None,
        checkpoint: Sequence[str] | None = None,
        checkpoint_menu: Sequence[Sequence[CheckpointOption | Mapping[str, Any]]] | None = None,
    ) -> "ScheduleProblem":
        """Build and validate a problem; scalars are broadcast to every stage (device).

        Defaults: ``mem_b = -mem_f / 2``, ``mem_w = -mem_f - mem_b`` when not given (half of
        the stash freed by B, the rest by W), ``offload_bytes = mem_f``, one stage per
        device, no recomputation (``recompute`` all False, ``mem_b_transient = 0``,
        ``recompute_mem_f = mem_f``), ``pooled_bytes = 0``, ``checkpoint`` ``"stage"`` where
        ``recompute`` is set else ``"none"``, the menu of :attr:`checkpoint_menu`'s default.
        ``mem_limit`` is per device (D entries, or a scalar).

        Raises
        ------
        InputError
            On more stages, micro-batches or operations than :data:`MAX_STAGES`,
            :data:`MAX_MICROBATCHES`, :data:`MAX_OPS` allow (before anything is allocated), a
            negative, non-finite or too large time (> 1e6 s), a memory figure beyond 1e18 bytes, ``mem_f <= 0``, positive ``mem_b`` on a stage
            that does not recompute, positive ``mem_w``, deltas that do not sum to zero,
            ``offload_bytes`` outside ``[0, mem_f]`` (0 on a recomputing stage), a negative
            ``mem_b_transient``, ``recompute_mem_f <= 0``, ``pooled_bytes`` outside ``[0, mem_f]``,
            ``offload_bytes + pooled_bytes > mem_f`` or ``recompute_mem_f < pooled_bytes`` (a
            recomputing stage keeps at least its pooled inputs), a non-positive limit, a bad pcie
            group, an unknown objective, a placement that names a device outside
            ``0..D-1`` or leaves a device without a stage, a checkpoint menu without ``"none"``,
            with a repeated name or a bad figure, a ``checkpoint`` naming an option outside its
            stage's menu or disagreeing with ``recompute``, or a checkpointing stage whose
            fields disagree with its option's figures.
        """
        S = _as_count(num_stages, "num_stages")
        M = _as_count(num_microbatches, "num_microbatches")
        if not 1 <= S <= MAX_STAGES:
            raise InputError(f"num_stages is {S}, allowed: 1..{MAX_STAGES}")
        if not 1 <= M <= MAX_MICROBATCHES:
            raise InputError(f"num_microbatches is {M}, allowed: 1..{MAX_MICROBATCHES} per pipeline (per data-parallel "
                             "replica): the schedule's memory lower bounds take time and memory quadratic in it; "
                             "use larger micro-batches")
        if 3 * S * M > MAX_OPS:
            raise InputError(f"num_stages x num_microbatches = {S} x {M} gives {3 * S * M} F/B/W operations, allowed: "
                             f"at most {MAX_OPS}: use fewer stages or larger micro-batches")
        D, placement = _placement(device_of_stage, num_devices, S)

        def vec(val, key, length=S):
            if val is None:
                raise InputError(f"{key} is null: give a number or a list of {length} numbers")
            if np.ndim(val) == 0:
                try:
                    return np.full(length, float(val))
                except (TypeError, ValueError):
                    raise InputError(f"{key} must be a number or a list of numbers, got {val!r}") from None
            return _as_float_array(val, key, length)

        t_f_a, t_b_a, t_w_a = vec(t_f, "t_f"), vec(t_b, "t_b"), vec(t_w, "t_w")
        t_comm_a = vec(t_comm, "t_comm", max(S - 1, 0))
        t_off_a = vec(t_offload, "t_offload")
        mem_f_a = vec(mem_f, "mem_f")
        for key, arr in (("t_f", t_f_a), ("t_b", t_b_a), ("t_w", t_w_a), ("mem_f", mem_f_a)):
            if np.any(np.isnan(arr)):
                raise InputError(f"{key} contains NaN: give finite numbers")
        mem_b_a = vec(mem_b, "mem_b") if mem_b is not None else -mem_f_a / 2.0
        mem_w_a = vec(mem_w, "mem_w") if mem_w is not None else -mem_f_a - mem_b_a
        off_a = vec(offload_bytes, "offload_bytes") if offload_bytes is not None else mem_f_a.copy()
        lim_a = vec(mem_limit, "mem_limit", D)
        for key, arr in (("t_f", t_f_a), ("t_b", t_b_a), ("t_w", t_w_a), ("t_comm", t_comm_a), ("t_offload", t_off_a)):
            _check_finite_nonneg(arr, key, high=MAX_TIME_S)
        for key, arr in (("mem_f", mem_f_a), ("mem_b", mem_b_a), ("mem_w", mem_w_a), ("offload_bytes", off_a)):
            if not np.all(np.isfinite(arr)):
                raise InputError(f"{key} must be finite, got {arr.tolist()}")
            if np.any(np.abs(arr) > MAX_BYTES):
                raise InputError(f"{key} must lie in [-{MAX_BYTES:g}, {MAX_BYTES:g}] bytes, got {arr.tolist()}")
        if np.any(mem_f_a <= 0):
            raise InputError(f"mem_f must be > 0 on every stage (F allocates its stash), got {mem_f_a.tolist()}")
        if recompute is None:
            rec = (False,) * S
        else:
            if isinstance(recompute, (str, bytes)) or not hasattr(recompute, "__len__") or len(recompute) != S:
                raise InputError(f"recompute must be a list of {S} booleans (one per stage), got {recompute!r:.200}")
            if any(not isinstance(x, (bool, np.bool_)) and x not in (0, 1) for x in recompute):
                raise InputError(f"recompute must list booleans, got {list(recompute)!r:.200}")
            rec = tuple(bool(x) for x in recompute)
        names = _checkpoint_names(checkpoint, rec, S, explicit_recompute=recompute is not None)
        if names is not None:
            rec = tuple(c != NO_CHECKPOINT for c in names)
        rec_a = np.asarray(rec, dtype=bool)
        trans_a = np.zeros(S) if mem_b_transient is None else vec(mem_b_transient, "mem_b_transient")
        if not np.all(np.isfinite(trans_a)) or np.any(trans_a < 0):
            raise InputError(f"mem_b_transient must be finite and >= 0 on every stage, got {trans_a.tolist()}")
        rmf_a = mem_f_a.copy() if recompute_mem_f is None else vec(recompute_mem_f, "recompute_mem_f")
        if not np.all(np.isfinite(rmf_a)) or np.any(rmf_a <= 0):
            raise InputError(f"recompute_mem_f must be finite and > 0 on every stage, got {rmf_a.tolist()}")
        if np.any(mem_b_a[~rec_a] > 0) or np.any(mem_w_a > 0):
            raise InputError("mem_b and mem_w must be <= 0 (B and W free memory; only a recomputing stage's B may add)")
        total = mem_f_a + mem_b_a + mem_w_a
        if np.any(np.abs(total) > 1e-9 * np.maximum(1.0, np.abs(mem_f_a))):
            s = int(np.argmax(np.abs(total)))
            raise InputError(
                f"stage {s}: mem_f + mem_b + mem_w = {total[s]:g}, must be 0 "
                "(everything F allocates is freed by B and W)"
            )
        if np.any(off_a < 0) or np.any(off_a > mem_f_a * (1 + 1e-12)):
            raise InputError("offload_bytes must lie in [0, mem_f] on every stage")
        pool_a = np.zeros(S) if pooled_bytes is None else vec(pooled_bytes, "pooled_bytes")
        if not (np.all(pool_a >= 0) and np.all(off_a + pool_a <= mem_f_a * (1 + 1e-12)) and np.all(rmf_a >= pool_a * (1 - 1e-12))):
            raise InputError(f"pooled_bytes must be >= 0 with offload_bytes + pooled_bytes <= mem_f (no offload moves them) "
                             f"and pooled_bytes <= recompute_mem_f (a recomputing stage keeps them), got {pool_a.tolist()}")
        if np.any(off_a[rec_a] > 0):
            raise InputError("a recomputing stage offloads nothing: offload_bytes must be 0 where recompute is set")
        if np.any(np.isnan(lim_a)) or np.any(lim_a <= 0):
            raise InputError(f"mem_limit must be > 0 on every device, got {lim_a.tolist()}")
        fields_ = dict(t_f=t_f_a, t_b=t_b_a, t_w=t_w_a, mem_f=mem_f_a, mem_b=mem_b_a, mem_w=mem_w_a, trans=trans_a, pooled=pool_a,
                       rmf=rmf_a)
        menu = (_legacy_menu(fields_, rec) if checkpoint_menu is None else _parse_menu(checkpoint_menu, S))
        ckpt = tuple(names) if names is not None else tuple("stage" if r else NO_CHECKPOINT for r in rec)
        _check_checkpoint_fields(fields_, ckpt, menu, derived=checkpoint_menu is None)
        groups = []
        if pcie_groups is None or isinstance(pcie_groups, (str, bytes)):
            raise InputError("pcie_groups must be a list of lists of stage indices")
        for g in pcie_groups:
            try:
                grp = tuple(_as_index(s) for s in g)
            except (TypeError, ValueError):
                raise InputError(f"pcie group {g!r} must be a list of integer stage indices") from None
            if any(not 0 <= s < S for s in grp):
                raise InputError(f"pcie group {list(grp)} names a stage outside 0..{S - 1}")
            groups.append(grp)
        if objective not in OBJECTIVES:
            raise InputError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        return cls(
            num_stages=S,
            num_microbatches=M,
            t_f=_freeze(t_f_a),
            t_b=_freeze(t_b_a),
            t_w=_freeze(t_w_a),
            t_comm=_freeze(t_comm_a),
            t_offload=_freeze(t_off_a),
            mem_f=_freeze(mem_f_a),
            mem_b=_freeze(mem_b_a),
            mem_w=_freeze(mem_w_a),
            offload_bytes=_freeze(off_a),
            mem_limit=_freeze(lim_a),
            pcie_groups=tuple(groups),
            objective=objective,
            name=str(name),
            num_devices=D,
            device_of_stage=placement,
            recompute=tuple(c != NO_CHECKPOINT for c in ckpt),
            mem_b_transient=_freeze(trans_a),
            recompute_mem_f=_freeze(rmf_a),
            pooled_bytes=_freeze(pool_a),
            checkpoint=ckpt,
            checkpoint_menu=menu,
        )

    # ---------------------------------------------------------------- recomputation
    @property
    def recompute_stages(self) -> tuple[int, ...]:
        """The stages that recompute their forward during B, in increasing order."""
        return tuple(s for s, r in enumerate(self.recompute) if r)

    @property
    def mem_b_start(self) -> np.ndarray:
        """Memory rise at the start of a B of every stage: ``mem_b + mem_b_transient`` (S,)."""
        return np.asarray(self.mem_b) + np.asarray(self.mem_b_transient)

    @property
    def stash_footprint(self) -> np.ndarray:
        """Least activation memory one micro-batch needs on stage s alone (S,), bytes.

        ``max(mem_f, mem_f + mem_b + mem_b_transient)``: an F's own stash is on the device
        when it starts, and so is the stash when its B starts (a reload ends before), plus
        the B's rise (the replayed forward of a recomputing stage). No schedule, offloading
        or not, runs stage s within less.
        """
        return np.maximum(self.mem_f, self.mem_f + self.mem_b_start)

    def checkpoint_option(self, stage: int, name: str | None = None) -> CheckpointOption:
        """The option ``name`` (default: the one it runs) of ``stage``'s :attr:`checkpoint_menu`."""
        name = self.checkpoint[stage] if name is None else name
        for o in self.checkpoint_menu[stage]:
            if o.name == name:
                return o
        raise InputError(f"stage {stage}: no checkpoint option {name!r}; its menu has "
                         f"{[o.name for o in self.checkpoint_menu[stage]]}")

    def with_checkpoint(self, choice: Mapping[int, str] | Sequence[str]) -> "ScheduleProblem":
        """The problem in which every stage of ``choice`` runs the named checkpoint option.

        For stage s running option ``c`` and asked to run ``o`` (both of its menu), with ``p =
        pooled_bytes[s]`` (the receive buffers, held from F to W whatever is done): ``t_b`` trades
        ``c``'s replayed forward for ``o``'s (``t_b += o.replay_s - c.replay_s``); F keeps
        ``o.kept_bytes + p`` (``mem_f``); B holds ``o.b_level(p) = max(kept + p + peak, w + p)``
        while it runs (``mem_b + mem_b_transient``: the kept stash, one replayed segment and
        the W inputs of the segments already done) and ``o.w_bytes + p`` after it, until W
        frees them (``mem_w = -(w + p)``); a checkpointing stage offloads nothing
        (``offload_bytes = 0``). Going back to ``"none"`` from a checkpointing stage is
        refused (the offload it had is not recorded): derive from the problem as built.

        Parameters
        ----------
        choice : mapping stage -> option name, or S names

        Returns
        -------
        ScheduleProblem

        Raises
        ------
        InputError
            On a stage outside ``0..S-1``, a name outside the stage's menu, or ``"none"`` for a
            stage that checkpoints.

        References
        ----------
        Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost" (replay a
        segment's forward in its backward); Korthikanti et al. 2022, "Reducing Activation
        Recomputation in Large Transformer Models", Sec. 4-5 (per-layer and selective
        recomputation).
        """
        S = self.num_stages
        if isinstance(choice, Mapping):
            items = list(choice.items())
        elif isinstance(choice, (str, bytes)) or not hasattr(choice, "__len__") or len(choice) != S:
            raise InputError(f"choice must map stages to option names or name one option per stage ({S}), "
                             f"got {choice!r:.200}")
        else:
            items = list(enumerate(choice))
        t_b, t_w = np.array(self.t_b, dtype=float), np.array(self.t_w, dtype=float)
        mem_f, mem_b, mem_w = (np.array(x, dtype=float) for x in (self.mem_f, self.mem_b, self.mem_w))
        trans, off = np.array(self.mem_b_transient, dtype=float), np.array(self.offload_bytes, dtype=float)
        names = list(self.checkpoint)
        for s, name in items:
            if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 0 <= s < S:
                raise InputError(f"checkpoint choice names stage {s!r} outside 0..{S - 1}")
            s = int(s)
            cur, new = self.checkpoint_option(s), self.checkpoint_option(s, name)
            if new.name == cur.name:
                continue
            if new.name == NO_CHECKPOINT:
                raise InputError(f"stage {s} checkpoints ({cur.name!r}): a derived problem cannot go back to 'none' "
                                 "(its offload is not recorded); derive from the problem as built")
            t_b[s], t_w[s], mem_f[s], mem_b[s], mem_w[s], trans[s], off[s] = self.stage_fields_with(
                s, new.name, float(t_b[s]), float(t_w[s]))
            names[s] = new.name
        if names == list(self.checkpoint):
            return self
        return ScheduleProblem.create(**{**self._create_kwargs(), "t_b": np.maximum(t_b, 0.0),
                                         "t_w": np.maximum(np.where(np.abs(t_w) < 1e-15, 0.0, t_w), 0.0), "mem_f": mem_f,
                                         "mem_b": mem_b, "mem_w": mem_w, "mem_b_transient": trans,
                                         "offload_bytes": off, "recompute": None, "checkpoint": names,
                                         "checkpoint_menu": self.checkpoint_menu})

    def stage_fields_with(self, stage: int, name: str, t_b: float | None = None,
                          t_w: float | None = None) -> tuple[float, float, float, float, float, float, float]:
        """Stage ``stage``'s ``(t_b, t_w, mem_f, mem_b, mem_w, mem_b_transient, offload_bytes)`` (seconds,
        bytes) when it runs its menu's option ``name`` instead of the one it runs (the rule of
        :meth:`with_checkpoint`, before it clips negative times; the option it runs: its fields as
        they are; ``t_b`` / ``t_w``: the stage's times to start from, default the problem's). For bounds that look at one stage under each of its
        options without building a problem per option."""
        cur, new = self.checkpoint_option(stage), self.checkpoint_option(stage, name)
        t_b = float(self.t_b[stage]) if t_b is None else t_b
        t_w = float(self.t_w[stage]) if t_w is None else t_w
        if new.name == cur.name:  # the option it runs: its fields as they are (offload included)
            return (t_b, t_w, float(self.mem_f[stage]), float(self.mem_b[stage]), float(self.mem_w[stage]),
                    float(self.mem_b_transient[stage]), float(self.offload_bytes[stage]))
        c = float(self.pooled_bytes[stage])
        mem_f = new.kept_bytes + c
        mem_w = -(new.w_bytes + c)
        return (t_b + new.replay_s + new.fused_w_s - cur.replay_s - cur.fused_w_s, t_w + cur.fused_w_s - new.fused_w_s,
                mem_f, -mem_f - mem_w, mem_w, max(new.b_level(c) - (new.w_bytes + c), 0.0), 0.0)

    def with_recompute(self, stages: Sequence[int] | Sequence[bool]) -> "ScheduleProblem":
        """The problem in which ``stages`` (also) recompute their whole forward during B.

        :meth:`with_checkpoint` with the option ``"stage"`` (its default-menu figures: for a
        stage with stash ``mem_f[s]`` of which ``p = -mem_w[s]`` is what W needs, ``c =
        pooled_bytes[s]`` stay anyway, and inputs ``r = recompute_mem_f[s]`` (which include the
        pooled ``c``): F keeps ``r``; B replays the forward (``t_b += t_f``) and holds, while it
        runs, the inputs and the replayed stash ``a = mem_f[s] - c``, ``r + a`` for this
        micro-batch, and afterwards the ``p`` bytes W needs; W frees them; nothing is
        offloaded). Stages that already checkpoint are left as they are.

        Parameters
        ----------
        stages : sequence of int, or sequence of S bools
            Stage indices, or a flag per stage.

        Returns
        -------
        ScheduleProblem

        Raises
        ------
        InputError
            On a stage outside ``0..S-1``, or one whose menu has no ``"stage"`` option.

        References
        ----------
        Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost"
        (recompute a segment's forward in its backward); Korthikanti et al. 2022, "Reducing
        Activation Recomputation in Large Transformer Models", Sec. 4 (full recomputation of a
        transformer layer keeps only its input).
        """
        S = self.num_stages
        if len(stages) == S and all(isinstance(x, (bool, np.bool_)) for x in stages):
            want = {s for s, x in enumerate(stages) if x}
        else:
            want = set()
            for s in stages:
                if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 0 <= s < S:
                    raise InputError(f"recompute stages must be stage indices in 0..{S - 1}, got {list(stages)!r:.200}")
                want.add(int(s))
        return self.with_checkpoint({s: "stage" for s in sorted(want - set(self.recompute_stages))})

    # ---------------------------------------------------------------- placement views
    def stages_of_device(self, device: int) -> tuple[int, ...]:
        """The stages device ``device`` holds, in increasing order."""
        return tuple(s for s, d in enumerate(self.device_of_stage) if d == device)

    @property
    def device_stages(self) -> tuple[tuple[int, ...], ...]:
        """``device_stages[d]`` = :meth:`stages_of_device` (d), for every device."""
        out: list[list[int]] = [[] for _ in range(self.num_devices)]
        for s, d in enumerate(self.device_of_stage):
            out[d].append(s)
        return tuple(tuple(x) for x in out)

    @property
    def one_stage_per_device(self) -> bool:
        """True when every device holds exactly one stage (any permutation)."""
        return self.num_devices == self.num_stages

    @property
    def identity_placement(self) -> bool:
        """True when stage s is on device s for every s (the classic pipeline)."""
        return self.device_of_stage == tuple(range(self.num_stages))

    @property
    def t_comm_effective(self) -> np.ndarray:
        """Transfer time of every boundary, 0 where both stages are on one device (S-1,)."""
        dev = np.asarray(self.device_of_stage, dtype=np.int64)
        same = dev[:-1] == dev[1:]
        return np.where(same, 0.0, self.t_comm)

    def device_mem_limit(self, stage: int) -> float:
        """The memory limit of the device that holds ``stage``."""
        return float(self.mem_limit[self.device_of_stage[stage]])

    def duration(self, stage: int, op_type: str) -> float:
        """Duration of one op of ``op_type`` (F, B, W, O or R) on ``stage``."""
        if op_type == "F":
            return float(self.t_f[stage])
        if op_type == "B":
            return float(self.t_b[stage])
        if op_type == "W":
            return float(self.t_w[stage])
        if op_type in ("O", "R"):
            return float(self.t_offload[stage])
        raise InputError(f"unknown op type {op_type!r}; expected one of {OP_TYPES}")

    def comm(self, boundary: int) -> float:
        """Transfer time between stage ``boundary`` and ``boundary + 1`` (0 on one device)."""
        if self.device_of_stage[boundary] == self.device_of_stage[boundary + 1]:
            return 0.0
        return float(self.t_comm[boundary])

    def with_objective(self, objective: str) -> "ScheduleProblem":
        """A copy with another objective."""
        return ScheduleProblem.create(**{**self._create_kwargs(), "objective": objective})

    def replace(self, **changes: Any) -> "ScheduleProblem":
        """A validated copy with some :meth:`create` arguments changed (e.g. ``mem_limit``)."""
        return ScheduleProblem.create(**{**self._create_kwargs(), **changes})

    def _create_kwargs(self) -> dict[str, Any]:
        return dict(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            num_devices=self.num_devices,
            device_of_stage=self.device_of_stage,
            t_f=self.t_f,
            t_b=self.t_b,
            t_w=self.t_w,
            t_comm=self.t_comm,
            t_offload=self.t_offload,
            mem_f=self.mem_f,
            mem_b=self.mem_b,
            mem_w=self.mem_w,
            offload_bytes=self.offload_bytes,
            mem_limit=self.mem_limit,
            pcie_groups=self.pcie_groups,
            objective=self.objective,
            name=self.name,
            recompute=self.recompute,
            mem_b_transient=self.mem_b_transient,
            recompute_mem_f=self.recompute_mem_f,
            pooled_bytes=self.pooled_bytes,
            # a menu derived from the fields is derived again (so replace() of a field keeps them in step)
            checkpoint=None if self._legacy_menu() else self.checkpoint,
            checkpoint_menu=None if self._legacy_menu() else self.checkpoint_menu,
        )

    def _legacy_menu(self) -> bool:
        """Whether :attr:`checkpoint_menu` is the default one derived from the fields (none and stage)."""
        f = dict(t_f=self.t_f, t_b=self.t_b, mem_f=self.mem_f, mem_b=self.mem_b, mem_w=self.mem_w,
                 trans=self.mem_b_transient, pooled=self.pooled_bytes, rmf=self.recompute_mem_f)
        return (self.checkpoint_menu == _legacy_menu(f, self.recompute)
                and self.checkpoint == tuple("stage" if r else NO_CHECKPOINT for r in self.recompute))

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.schedproblem/1`` document; an infinite limit is written as null.

        The recomputation keys are written only when they differ from their defaults, so a
        problem without recomputation has the same document as before they existed;
        ``checkpoint`` and ``checkpoint_menu`` (issue 28) only when the menu is not the default
        one (none and stage) derived from the fields.
        """
        doc: dict[str, Any] = {"format": SCHEDPROBLEM_FORMAT}
        for key, val in self._create_kwargs().items():
            if key in ("checkpoint", "checkpoint_menu"):
                if val is None:  # the default menu (none and stage) is derived from the fields again
                    continue
                val = list(val) if key == "checkpoint" else [[o.to_dict() for o in row] for row in val]
            elif key == "recompute":
                if not any(val):
                    continue
                val = list(val)
            elif key in ("mem_b_transient", "pooled_bytes") and not np.any(val):
                continue
            elif key == "recompute_mem_f" and np.array_equal(val, self.mem_f):
                continue
            if isinstance(val, np.ndarray):
                val = val.tolist()
            doc[key] = val
        doc["device_of_stage"] = list(self.device_of_stage)
        doc["mem_limit"] = [None if math.isinf(x) else x for x in self.mem_limit.tolist()]
        doc["pcie_groups"] = [list(g) for g in self.pcie_groups]
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "problem") -> "ScheduleProblem":
        """Parse a ``fxpipe.schedproblem/1`` document (null limits mean unlimited).

        ``num_devices`` and ``device_of_stage`` are optional (default: one stage per
        device), so files written before placements existed stay valid.

        Raises
        ------
        InputError
            If a key is missing or a value is invalid (message names the key).
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{source}: expected a JSON object")
        fmt = doc.get("format", SCHEDPROBLEM_FORMAT)
        if fmt != SCHEDPROBLEM_FORMAT:
            raise InputError(f"{source}: format is {fmt!r}, expected {SCHEDPROBLEM_FORMAT!r}")
        kwargs = {k: v for k, v in doc.items() if k != "format"}
        for key in ("num_stages", "num_microbatches", "t_f", "t_b", "t_w"):
            if key not in kwargs:
                raise InputError(f"{source}: missing required key {key!r}")
        lim = kwargs.get("mem_limit", math.inf)
        if lim is None:
            lim = math.inf
        elif isinstance(lim, list):
            lim = [math.inf if x is None else x for x in lim]
        kwargs["mem_limit"] = lim
        known = {
            "num_stages", "num_microbatches", "num_devices", "device_of_stage", "t_f", "t_b", "t_w", "t_comm",
            "t_offload", "mem_f", "mem_b", "mem_w", "offload_bytes", "mem_limit", "pcie_groups", "objective", "name",
            "recompute", "mem_b_transient", "recompute_mem_f", "pooled_bytes", "checkpoint", "checkpoint_menu",
        }
        kwargs = {k: v for k, v in kwargs.items() if k in known}  # unknown keys are ignored
        try:
            return cls.create(**kwargs)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ScheduleProblem":
        """Read a ``fxpipe.schedproblem/1`` JSON file (raises InputError on bad input)."""
        return cls.from_dict(read_json(path, "problem file"), source=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the problem as JSON, atomically."""
        return write_json_atomic(path, self.to_dict())


@dataclass(frozen=True)
class ScheduledOp:
    """One timed op of a schedule: ``type`` in F, B, W, O, R on ``stage`` for ``microbatch``."""

    stage: int
    microbatch: int
    type: str
    start_s: float
    end_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "microbatch": self.microbatch,
            "type": self.type,
            "start_s": self.start_s,
            "end_s": self.end_s,
        }

    def __str__(self) -> str:  # torch's action vocabulary: "2F0" = stage 2, forward, micro-batch 0
        return f"{self.stage}{self.type}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A timed schedule: Contract 3 result half (``fxpipe.schedule/1``).

    Attributes
    ----------
    ops : tuple[ScheduledOp, ...]
        Every op, sorted by (start_s, stage, type, microbatch).
    makespan : float
        Latest end minus earliest start (OptPipe Eq. 4).
    stage_span : float
        Largest per-device span, first F start to last W end over the stages of a device
        (OptPipe Eq. 3 with one stage per device; see :class:`ScheduleProblem`).
    lower_bound_s : float
        Best proven lower bound on the problem's objective (0 when none is known).
    status : str
        ``"heuristic"``, ``"optimal"``, ``"timelimit"``, ``"feasible"``, ...
    solver_time_s : float
        Wall time spent producing the schedule.
    method : str
        Generator name (``"1f1b"``, ``"zb-h1"``, ``"milp"``, ...).
    objective : str
        The objective ``lower_bound_s`` refers to.
    meta : dict
        Extra facts (gap, nodes, incumbents, ...).
    """

    ops: tuple[ScheduledOp, ...]
    makespan: float
    stage_span: float
    lower_bound_s: float = 0.0
    status: str = "heuristic"
    solver_time_s: float = 0.0
    method: str = ""
    objective: str = "stage_span"
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def value(self) -> float:
        """The value of the schedule's objective."""
        return self.stage_span if self.objective == "stage_span" else self.makespan

    def ops_of_stage(self, stage: int) -> list[ScheduledOp]:
        """Ops of one stage in program order (:func:`program_order`)."""
        return program_order(o for o in self.ops if o.stage == stage)

    def ops_of_device(self, device: int, device_of_stage: Sequence[int]) -> list[ScheduledOp]:
        """Ops of all stages of one device in program order (:func:`program_order`)."""
        return program_order(o for o in self.ops if 0 <= o.stage < len(device_of_stage) and device_of_stage[o.stage] == device)

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.schedule/1`` document."""
        return {
            "format": SCHEDULE_FORMAT,
            "method": self.method,
            "objective": self.objective,
            "makespan": self.makespan,
            "stage_span": self.stage_span,
            "lower_bound_s": self.lower_bound_s,
            "status": self.status,
            "solver_time_s": self.solver_time_s,
            "meta": self.meta,
            "ops": [o.to_dict() for o in self.ops],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "schedule") -> "Schedule":
        """Parse a ``fxpipe.schedule/1`` document.

        Raises
        ------
        InputError
            If keys are missing or an op is malformed.
        """
        if not isinstance(doc, Mapping) or "ops" not in doc:
            raise InputError(f"{source}: expected a JSON object with 'ops'")
        if not isinstance(doc["ops"], list):
            raise InputError(f"{source}: 'ops' must be a list of ops")
        ops = []
        for i, o in enumerate(doc["ops"]):
            try:
                op = ScheduledOp(int(o["stage"]), int(o["microbatch"]), str(o["type"]), float(o["start_s"]), float(o["end_s"]))
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{source}: ops[{i}] is malformed: {o!r:.200}") from None
            if op.type not in OP_TYPES:
                raise InputError(f"{source}: ops[{i}] has type {op.type!r}; expected one of {OP_TYPES}")
            ops.append(op)
        if not isinstance(doc.get("meta", {}), Mapping):
            raise InputError(f"{source}: 'meta' must be an object")
        try:
            figures = {k: float(doc.get(k) or 0.0) for k in ("makespan", "stage_span", "lower_bound_s", "solver_time_s")}
        except (TypeError, ValueError):
            raise InputError(f"{source}: makespan, stage_span, lower_bound_s and solver_time_s must be numbers") from None
        return cls(
            ops=tuple(sort_ops(ops)),
            makespan=figures["makespan"],
            stage_span=figures["stage_span"],
            lower_bound_s=figures["lower_bound_s"],
            status=str(doc.get("status", "")),
            solver_time_s=figures["solver_time_s"],
            method=str(doc.get("method", "")),
            objective=str(doc.get("objective", "stage_span")),
            meta=dict(doc.get("meta", {})),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Schedule":
        """Read a ``fxpipe.schedule/1`` JSON file."""
        return cls.from_dict(read_json(path, "schedule file"), source=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the schedule as JSON, atomically."""
        return write_json_atomic(path, self.to_dict())


_TYPE_RANK = {t: i for i, t in enumerate(OP_TYPES)}


def sort_ops(ops: Iterable[ScheduledOp]) -> list[ScheduledOp]:
    """Ops sorted by (start_s, stage, type F<B<W<O<R, microbatch): the canonical order."""
    return sorted(ops, key=lambda o: (o.start_s, o.stage, _TYPE_RANK.get(o.type, 9), o.microbatch))



# --------------------------------------------------------------------------------------
# Actions and per-device orders (the typed schedule IR that codegen consumes)
# --------------------------------------------------------------------------------------

#: A full backward: the B and W of one stage and micro-batch in one autograd pass (torch's
#: ``B``). Made only by lowering (:func:`fxpipe.ir.lowering.merge_backward`); schedules and
#: :class:`Orders` hold F, B, W, O and R.
FULL_BACKWARD = "BW"

#: The types an :class:`Action` may have: :data:`OP_TYPES` and the lowered :data:`FULL_BACKWARD`.
ACTION_TYPES = OP_TYPES + (FULL_BACKWARD,)

#: THE action text grammar, ``<stage><type><micro-batch>`` (torch's ``_Action`` text, ``"2F0"``),
#: read by :func:`split_action_text` for fxpipe's vocabulary (:meth:`Action.parse`) and torch's
#: (:func:`fxpipe.ir.torch_csv.parse_torch_action`). The type is upper-case letters (with ``_``
#: for torch's communication actions such as ``"1SEND_F0"``); the micro-batch may be absent
#: (torch's ``"0UNSHARD"``); blanks around the parts are allowed.
_ACTION_TEXT = re.compile(r"^\s*(\d+)\s*([A-Z][A-Z_]*?)\s*(\d*)\s*$")


def split_action_text(text: Any) -> tuple[int, str, int | None] | None:
    """``(stage, type, micro-batch)`` of ``text`` in the action grammar, or None if it is not.

    The one parser of action text (fxpipe's ``"2B0"`` and torch's ``"2I0"``, ``"1SEND_F0"``);
    the caller checks the type against its vocabulary. The micro-batch is None when absent.

    Examples
    --------
    >>> split_action_text("2F0"), split_action_text("0UNSHARD"), split_action_text("F0")
    ((2, 'F', 0), (0, 'UNSHARD', None), None)
    """
    if not isinstance(text, str):
        return None
    m = _ACTION_TEXT.match(text)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), (int(m.group(3)) if m.group(3) else None)


@dataclass(frozen=True, slots=True)
class Action:
    """One untimed op of a pipeline program: ``type`` of ``microbatch`` on ``stage``.

    The text form follows torch's action strings (``torch.distributed.pipelining``'s
    ``_Action``): ``"2F0"`` is stage 2, forward, micro-batch 0. Types are fxpipe's F
    (forward), B (backward-input, torch's ``I``), W (backward-weight), O (offload the
    stash to the host) and R (reload it); :mod:`fxpipe.ir.torch_csv` translates to
    torch's vocabulary.

    Attributes
    ----------
    stage : int
        Pipeline stage, >= 0.
    type : str
        One of :data:`OP_TYPES`, or :data:`FULL_BACKWARD` (``"BW"``) in a lowered program.
    microbatch : int
        Micro-batch index, >= 0.

    Raises
    ------
    InputError
        On a negative or non-integer index or an unknown type.
    """

    stage: int
    type: str
    microbatch: int

    def __post_init__(self) -> None:
        for key in ("stage", "microbatch"):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
                raise InputError(f"action {key} must be an integer >= 0, got {val!r}")
            object.__setattr__(self, key, int(val))
        if self.type not in ACTION_TYPES:
            raise InputError(f"action type must be one of {', '.join(ACTION_TYPES)}, got {self.type!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written as ``text`` (``"2F0"``, ``"0W13"``): the inverse of ``str``.

        Raises
        ------
        InputError
            If ``text`` is not ``<stage><type><micro-batch>`` with type in F, B, W, O, R.
        """
        if not isinstance(text, str):
            raise InputError(f"an action is written as text like '2F0', got {text!r:.100}")
        parts = split_action_text(text)
        if parts is None or parts[1] not in ACTION_TYPES or parts[2] is None:
            raise InputError(
                f"bad action {text!r}: expected <stage><type><micro-batch> with type in F, B, W, O, R "
                "(F forward, B backward-input, W backward-weight, O offload, R reload), e.g. '2F0'"
            )
        return cls(*parts)

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW (the compute stream); False for O and R (the copy stream)."""
        return self.type not in ("O", "R")


ORDERS_FORMAT = "fxpipe.orders/1"


@dataclass(frozen=True, eq=True)
class Orders:
    """Untimed per-device programs: the ordered actions of every device, with the placement.

    ``actions[d]`` is the program of device d: the F/B/W actions of all stages device d
    holds in the order its compute stream runs them, with O/R actions at the position where
    they are issued (they run on the device's copy stream). This is what a pipeline runtime
    executes (torch's ``pipeline_order``), what :func:`fxpipe.schedule.simulate.simulate`
    times, and what :func:`schedule_to_orders` extracts from a timed schedule.

    Attributes
    ----------
    device_of_stage : tuple[int, ...], length S
        Device of every stage.
    actions : tuple[tuple[Action, ...], ...], length D
        Program of every device.

    Raises
    ------
    InputError
        If an action's stage is outside the placement or runs on a device that does not
        hold it, or an action appears twice.
    """

    device_of_stage: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _, dev = _placement(list(self.device_of_stage), len(self.actions) if self.actions else None, len(self.device_of_stage))
        object.__setattr__(self, "device_of_stage", dev)
        acts = []
        seen = set()
        for d, row in enumerate(self.actions):
            row = tuple(a if isinstance(a, Action) else Action.parse(a) for a in row)
            for a in row:
                if not 0 <= a.stage < len(dev):
                    raise InputError(f"device {d}: action {a} names stage {a.stage} outside 0..{len(dev) - 1}")
                if dev[a.stage] != d:
                    raise InputError(f"device {d}: action {a} belongs to stage {a.stage}, which is on device {dev[a.stage]}")
                if a.type == FULL_BACKWARD:
                    raise InputError(
                        f"device {d}: action {a} is a full backward, which only lowering makes: orders hold "
                        "F, B, W, O and R (write its B and W)"
                    )
                if a in seen:
                    raise InputError(f"device {d}: action {a} appears twice")
                seen.add(a)
            acts.append(row)
        object.__setattr__(self, "actions", tuple(acts))

    # ---------------------------------------------------------------- views
    @property
    def num_devices(self) -> int:
        """D, the number of device programs."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """S, the number of stages of the placement."""
        return len(self.device_of_stage)

    def of_device(self, device: int) -> tuple[Action, ...]:
        """The program of ``device``."""
        return self.actions[device]

    def of_stage(self, stage: int) -> list[Action]:
        """The actions of ``stage`` in the order its device runs them."""
        return [a for a in self.actions[self.device_of_stage[stage]] if a.stage == stage]

    def compute_only(self) -> "Orders":
        """The same programs without O/R actions."""
        return Orders(self.device_of_stage, tuple(tuple(a for a in row if a.is_compute) for row in self.actions))

    def offloaded(self) -> set[tuple[int, int]]:
        """``(stage, microbatch)`` of every stash the programs offload (an O action)."""
        return {(a.stage, a.microbatch) for row in self.actions for a in row if a.type == "O"}

    def stage_orders(self) -> dict[int, list[tuple[str, int]]]:
        """The older per-stage form ``{stage: [(type, microbatch), ...]}`` (F/B/W only).

        With several stages per device this loses how a device interleaves its stages; use
        the per-device :attr:`actions` there.
        """
        out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(self.num_stages)}
        for row in self.actions:
            for a in row:
                if a.is_compute:
                    out[a.stage].append((a.type, a.microbatch))
        return out

    @classmethod
    def from_stage_orders(
        cls,
        stage_orders: Mapping[int, Sequence[tuple[str, int]]],
        device_of_stage: Sequence[int] | None = None,
    ) -> "Orders":
        """Per-device orders from the per-stage form ``{stage: [(type, microbatch), ...]}``.

        Only for placements with one stage per device: with several, the per-stage form does
        not say how a device interleaves its stages.

        Raises
        ------
        InputError
            On a placement with several stages on a device, or a malformed entry.
        """
        S = (max(stage_orders) + 1) if stage_orders else 0
        dev = tuple(range(S)) if device_of_stage is None else tuple(device_of_stage)
        if len(set(dev)) != len(dev):
            raise InputError(
                "per-stage orders do not say how a device interleaves its stages: give per-device orders "
                "(Orders) for placements with several stages on a device"
            )
        extra = set(stage_orders) - set(range(len(dev)))
        if extra:
            raise InputError(f"orders name stages {sorted(extra)} outside 0..{len(dev) - 1}")
        rows: list[list[Action]] = [[] for _ in range(len(dev))]
        for s, seq in stage_orders.items():
            for item in seq:
                try:
                    t, j = item
                    rows[dev[s]].append(Action(int(s), str(t), int(j)))
                except (TypeError, ValueError):
                    raise InputError(f"stage {s}: order entry {item!r} is not a (type, microbatch) pair") from None
        return cls(dev, tuple(tuple(r) for r in rows))

    def check(self, num_microbatches: int) -> list[str]:
        """What keeps these programs from being a complete pipeline step (empty if nothing).

        Every stage needs exactly one F, B and W of every micro-batch, each O its R (and the
        reverse), and per stage and micro-batch the program order F before B before W and
        O after F, R after O and before B.
        """
        errs = []
        M = int(num_microbatches)
        for s in range(self.num_stages):
            pos = {}
            for i, a in enumerate(self.of_stage(s)):
                if not 0 <= a.microbatch < M:
                    errs.append(f"stage {s}: {a} names micro-batch {a.microbatch} outside 0..{M - 1}")
                pos[(a.type, a.microbatch)] = i
            for j in range(M):
                for t in "FBW":
                    if (t, j) not in pos:
                        errs.append(f"stage {s}: {s}{t}{j} is missing")
                if (("O", j) in pos) != (("R", j) in pos):
                    errs.append(f"stage {s}: micro-batch {j} has an offload without its reload (or the reverse)")
                chain = [pos.get((t, j)) for t in ("F", "O", "R", "B", "W")]
                chain = [x for x in chain if x is not None]
                if chain != sorted(chain):
                    errs.append(f"stage {s}: micro-batch {j} runs out of order (expected F, O, R, B, W)")
        return errs

    # ---------------------------------------------------------------- text / JSON
    def to_text(self) -> str:
        """One line per device: ``device d: 0F0 0F1 0B0 ...``."""
        return "\n".join(f"device {d}: " + " ".join(map(str, row)) for d, row in enumerate(self.actions))

    def __str__(self) -> str:
        return self.to_text()

    def to_dict(self) -> dict[str, Any]:
        """``{"format": "fxpipe.orders/1", "device_of_stage": [...], "actions": [["0F0", ...], ...]}``."""
        return {
            "format": ORDERS_FORMAT,
            "device_of_stage": list(self.device_of_stage),
            "actions": [[str(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "orders") -> "Orders":
        """Parse :meth:`to_dict`'s document.

        Raises
        ------
        InputError
            On a wrong format, missing keys or bad actions (message names the source).
        """
        if not isinstance(doc, Mapping) or "actions" not in doc or "device_of_stage" not in doc:
            raise InputError(f"{source}: expected a JSON object with 'device_of_stage' and 'actions'")
        if doc.get("format", ORDERS_FORMAT) != ORDERS_FORMAT:
            raise InputError(f"{source}: format is {doc.get('format')!r}, expected {ORDERS_FORMAT!r}")
        if not isinstance(doc["actions"], list) or not all(isinstance(r, list) for r in doc["actions"]):
            raise InputError(f"{source}: 'actions' must be a list of lists of action strings")
        try:
            return cls(tuple(doc["device_of_stage"]), tuple(tuple(Action.parse(a) for a in row) for row in doc["actions"]))
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
        except TypeError:
            raise InputError(f"{source}: 'device_of_stage' must be a list of device indices") from None


#: Program-order rank of each type at one instant: F, then its offload, the reload, B, W.
_PHASE = {"F": 0, "O": 1, "R": 2, "B": 3, "W": 4}


def _program_key(o: ScheduledOp) -> tuple:
    # ops that start together: the shorter first (a zero-length op ends before a longer one
    # starting with it); then F < O < R < B < W (the dependency order within a micro-batch);
    # forward-direction ops by increasing stage, backward ones by decreasing stage (the
    # direction data flows between stages); then micro-batch order.
    phase = _PHASE.get(o.type, 9)
    stage = o.stage if phase <= 2 else -o.stage
    return (o.start_s, o.end_s, phase, stage, o.microbatch)


def program_order(ops: Iterable[ScheduledOp]) -> list[ScheduledOp]:
    """Timed ops in the order a device issues them: by start time, ties broken consistently.

    Ties (only possible with zero-length ops, or between the compute and the copy stream)
    are broken by end time, then F < O < R < B < W, then by stage in the direction data
    flows (increasing for F/O/R, decreasing for B/W), then by micro-batch. Every dependency
    of Contract 3 between two ops that start at the same instant is respected, so the
    result is a valid program order for any valid schedule.

    Parameters
    ----------
    ops : iterable of ScheduledOp

    Returns
    -------
    list of ScheduledOp
    """
    return sorted(ops, key=_program_key)


def schedule_to_orders(schedule: "Schedule | Iterable[ScheduledOp]", device_of_stage: Any = None) -> Orders:
    """The per-device programs of a timed schedule: THE schedule-to-orders function.

    Every device's ops (F/B/W and O/R of all its stages) in :func:`program_order`.
    ``Orders.stage_orders()`` gives the older ``{stage: [(type, microbatch)]}`` form.

    Parameters
    ----------
    schedule : Schedule or iterable of ScheduledOp
    device_of_stage : sequence of int, ScheduleProblem or None
        The placement (a problem's ``device_of_stage`` is used when a problem is given);
        None means one stage per device over stages ``0..max stage``.

    Returns
    -------
    Orders

    Raises
    ------
    InputError
        If an op names a stage outside the placement.
    """
    ops = list(schedule.ops) if isinstance(schedule, Schedule) else list(schedule)
    if isinstance(device_of_stage, ScheduleProblem):
        dev = tuple(device_of_stage.device_of_stage)
    elif device_of_stage is None:
        dev = tuple(range(1 + max((int(o.stage) for o in ops), default=-1)))
    else:
        dev = tuple(int(d) for d in device_of_stage)
    D = 1 + max(dev, default=-1)
    rows: list[list[ScheduledOp]] = [[] for _ in range(D)]
    for o in ops:
        if not 0 <= o.stage < len(dev):
            raise InputError(f"schedule op {o} names stage {o.stage} outside 0..{len(dev) - 1} of the placement")
        rows[dev[o.stage]].append(o)
    return Orders(dev, tuple(tuple(Action(o.stage, o.type, o.microbatch) for o in program_order(r)) for r in rows))
