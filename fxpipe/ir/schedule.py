"""Schedule problems and timed schedules: Contract 3 of DESIGN.md.

* :class:`ScheduleProblem` is the problem half (``fxpipe.schedproblem/1``).
* :class:`Schedule` / :class:`ScheduledOp` are the result half (``fxpipe.schedule/1``).

No torch here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import _as_count, _as_float_array, _as_index, _check_finite_nonneg, _freeze, read_json, write_json_atomic

__all__ = [
    "SCHEDPROBLEM_FORMAT",
    "SCHEDULE_FORMAT",
    "OP_TYPES",
    "OBJECTIVES",
    "ScheduleProblem",
    "ScheduledOp",
    "Schedule",
    "sort_ops",
]

SCHEDPROBLEM_FORMAT = "fxpipe.schedproblem/1"
SCHEDULE_FORMAT = "fxpipe.schedule/1"

OP_TYPES = ("F", "B", "W", "O", "R")
OBJECTIVES = ("stage_span", "makespan")


@dataclass(frozen=True, eq=False)
class ScheduleProblem:
    """A pipeline scheduling problem: Contract 3 of DESIGN.md (``fxpipe.schedproblem/1``).

    S stages (one per device), m micro-batches. Times in seconds (or any consistent unit),
    memory in bytes (or any consistent unit).

    Attributes
    ----------
    num_stages : int
        S >= 1.
    num_microbatches : int
        m >= 1.
    t_f, t_b, t_w : float64 array (S,)
        Forward, backward-input and backward-weight time of one micro-batch on stage s.
    t_comm : float64 array (S-1,)
        ``t_comm[s]`` is the one-way transfer time between stage s and s+1 (activations
        forward, gradients backward). A scalar in JSON means the same for every boundary.
    t_offload : float64 array (S,)
        One-way D2H (or H2D) time of one micro-batch's offloadable stash on stage s.
    mem_f, mem_b, mem_w : float64 array (S,)
        Memory deltas of F (> 0), B (<= 0) and W (<= 0); ``mem_f + mem_b + mem_w == 0``.
    offload_bytes : float64 array (S,)
        Bytes freed by an offload, ``0 <= offload_bytes <= mem_f``.
    mem_limit : float64 array (S,)
        Memory available for activations on stage s (``inf`` = unlimited).
    pcie_groups : tuple[tuple[int, ...], ...]
        Stages whose host transfers (O/R) must not overlap.
    objective : str
        ``"stage_span"`` (default, OptPipe Eq. 3) or ``"makespan"`` (OptPipe Eq. 4).
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
    ) -> "ScheduleProblem":
        """Build and validate a problem; scalars are broadcast to every stage.

        Defaults: ``mem_b = -mem_f / 2``, ``mem_w = -mem_f - mem_b`` when not given (half of
        the stash freed by B, the rest by W), ``offload_bytes = mem_f``.

        Raises
        ------
        InputError
            On a negative or non-finite time, ``mem_f <= 0``, positive ``mem_b``/``mem_w``,
            deltas that do not sum to zero, ``offload_bytes`` outside ``[0, mem_f]``, a
            non-positive limit, a bad pcie group or an unknown objective.
        """
        S = _as_count(num_stages, "num_stages")
        M = _as_count(num_microbatches, "num_microbatches")
        if S < 1:
            raise InputError(f"num_stages must be >= 1, got {S}")
        if M < 1:
            raise InputError(f"num_microbatches must be >= 1, got {M}")

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
        lim_a = vec(mem_limit, "mem_limit")
        for key, arr in (("t_f", t_f_a), ("t_b", t_b_a), ("t_w", t_w_a), ("t_comm", t_comm_a), ("t_offload", t_off_a)):
            _check_finite_nonneg(arr, key)
        for key, arr in (("mem_f", mem_f_a), ("mem_b", mem_b_a), ("mem_w", mem_w_a), ("offload_bytes", off_a)):
            if not np.all(np.isfinite(arr)):
                raise InputError(f"{key} must be finite, got {arr.tolist()}")
        if np.any(mem_f_a <= 0):
            raise InputError(f"mem_f must be > 0 on every stage (F allocates its stash), got {mem_f_a.tolist()}")
        if np.any(mem_b_a > 0) or np.any(mem_w_a > 0):
            raise InputError("mem_b and mem_w must be <= 0 (B and W free memory)")
        total = mem_f_a + mem_b_a + mem_w_a
        if np.any(np.abs(total) > 1e-9 * np.maximum(1.0, np.abs(mem_f_a))):
            s = int(np.argmax(np.abs(total)))
            raise InputError(
                f"stage {s}: mem_f + mem_b + mem_w = {total[s]:g}, must be 0 "
                "(everything F allocates is freed by B and W)"
            )
        if np.any(off_a < 0) or np.any(off_a > mem_f_a * (1 + 1e-12)):
            raise InputError("offload_bytes must lie in [0, mem_f] on every stage")
        if np.any(np.isnan(lim_a)) or np.any(lim_a <= 0):
            raise InputError(f"mem_limit must be > 0 on every stage, got {lim_a.tolist()}")
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
        )

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
        """Transfer time between stage ``boundary`` and ``boundary + 1``."""
        return float(self.t_comm[boundary])

    def with_objective(self, objective: str) -> "ScheduleProblem":
        """A copy with another objective."""
        return ScheduleProblem.create(**{**self._create_kwargs(), "objective": objective})

    def _create_kwargs(self) -> dict[str, Any]:
        return dict(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
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
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.schedproblem/1`` document; an infinite limit is written as null."""
        doc: dict[str, Any] = {"format": SCHEDPROBLEM_FORMAT}
        for key, val in self._create_kwargs().items():
            if isinstance(val, np.ndarray):
                val = val.tolist()
            doc[key] = val
        doc["mem_limit"] = [None if math.isinf(x) else x for x in self.mem_limit.tolist()]
        doc["pcie_groups"] = [list(g) for g in self.pcie_groups]
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "problem") -> "ScheduleProblem":
        """Parse a ``fxpipe.schedproblem/1`` document (null limits mean unlimited).

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
            "num_stages", "num_microbatches", "t_f", "t_b", "t_w", "t_comm", "t_offload", "mem_f",
            "mem_b", "mem_w", "offload_bytes", "mem_limit", "pcie_groups", "objective", "name",
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
        Largest per-stage span, first F start to last W end (OptPipe Eq. 3).
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
        """Ops of one stage in start-time order."""
        return sorted(
            (o for o in self.ops if o.stage == stage), key=lambda o: (o.start_s, _TYPE_RANK.get(o.type, 9), o.microbatch)
        )

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
