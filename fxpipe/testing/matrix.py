"""The real-architecture matrix: every zoo model x pipeline size x schedule, trained and compared.

Test support (:mod:`fxpipe.testing`), not user API. For each model of :mod:`fxpipe.testing.zoo` and each pipeline size ``k`` the model is planned with
fxpipe's own defaults (``fxpipe.compile`` with a short partition time limit; the plan's
partition is then scheduled by every method, :meth:`fxpipe.plan.Plan.reschedule`, the MILP with
a short time limit), trained for a few SGD steps on ``k`` local gloo ranks, and compared with
single-process training (:func:`fxpipe.codegen.compare.compare_training`: losses, every
gradient, every parameter after the steps, every buffer).

Worker start-up and capture dominate the cost, so all runs of one pipeline size share one set
of worker processes and the runs of one model follow each other (each worker captures a model
once and reuses it for every schedule, :func:`fxpipe.codegen.launch.spawn_train_many`). A run
that fails is recorded as an error and the others go on.

``meta_checkpoint`` models also run once (first schedule) with the model built on ``meta`` in
every worker and each rank materializing only its stages from a safetensors checkpoint
(``state={"checkpoint": ...}`` of :func:`~fxpipe.codegen.launch.spawn_train_many`), compared with
the whole model loaded from that checkpoint in one process; their cells' ``schedule`` is
``"meta-ckpt:<schedule>"``.

``python benchmarks/arch_matrix.py`` prints the table; ``tests/test_arch_matrix.py`` and
``tests/test_arch_matrix2.py`` assert it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import fxpipe
from fxpipe.errors import InputError
from fxpipe.mesh import format_mesh
from fxpipe.schedule.registry import REGISTRY

__all__ = ["SCHEDULES", "MULTI_STAGE_SCHEDULES", "MatrixCell", "MatrixResult", "run_matrix"]

#: The schedules of one stage per device the matrix trains by default, read from the registry
#: (:data:`fxpipe.schedule.registry.REGISTRY`): the heuristics written for one stage per
#: device that do not offload (torch's B/W-fused and split-backward families) and the MILP.
SCHEDULES = tuple(m.name for m in REGISTRY
                  if not m.offloads and ((m.kind == "heuristic" and "one" in m.placements) or m.kind == "milp"))
#: The schedules of several stages per device (``stages_per_device >= 2``), read from the
#: registry (every non-offloading method but ``auto`` that schedules more than one stage per
#: device), and the placement each runs on: ``looped`` where the method schedules it, else ``v``.
MULTI_STAGE_SCHEDULES = {m.name: ("looped" if "looped" in m.placements else "v") for m in REGISTRY
                         if m.kind != "auto" and not m.offloads and set(m.placements) - {"one"}}


@dataclass
class MatrixCell:
    """One (model, pipeline size, schedule) result.

    ``ok`` is the verdict of :func:`fxpipe.codegen.compare.compare_training` (False on error);
    the figures are its relative differences; ``error`` the failure message (last lines).
    """

    model: str
    family: str
    ranks: int
    schedule: str
    ok: bool
    error: str = ""
    loss_rel_diff: float = float("nan")
    max_grad_rel_diff: float = float("nan")
    max_param_rel_diff: float = float("nan")
    max_buffer_rel_diff: float = float("nan")
    worst_param_grad_rel_diff: float = float("nan")
    worst_param: str = ""
    problems: list[str] = field(default_factory=list)
    full_backward_stages: list[int] = field(default_factory=list)
    moved_nodes: int = 0
    cloned_inputs: int = 0
    compile_s: float = float("nan")
    mesh: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MatrixResult:
    """All cells plus timings (seconds): ``plan_s``, ``reference_s``, ``train_s`` per pipeline size, ``wall_s``."""

    cells: list[MatrixCell]
    timings_s: dict[str, float]
    settings: dict[str, Any]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cells)

    def failures(self) -> list[MatrixCell]:
        return [c for c in self.cells if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "cells": [c.to_dict() for c in self.cells], "timings_s": self.timings_s,
                "settings": self.settings}

    def markdown(self, compact: bool = False) -> str:
        """A Markdown table: one row per model and pipeline size, one column per schedule
        (``ok``, ``error`` or ``DIFF``), the worst loss / gradient / parameter / buffer
        differences over the row, and the compile time of the first schedule (seconds:
        ``fxpipe.compile`` plus rescheduling). ``compact``: one row per model, one column per pipeline size
        (``ok`` when every schedule is, else the failing schedules)."""
        schedules = list(dict.fromkeys(c.schedule for c in self.cells))
        rows: dict[tuple[str, int], list[MatrixCell]] = {}
        for c in self.cells:
            rows.setdefault((c.model, c.ranks), []).append(c)

        def worst(cells, attr):
            vals = [getattr(c, attr) for c in cells if not c.error]
            return f"{max(vals):.1e}" if vals else "-"

        def compile_col(cells, ranks):  # fxpipe.compile + the first schedule (the matrix's default)
            out = []
            for k in ranks:
                vals = [c.compile_s for c in cells if c.ranks == k and c.schedule == schedules[0]]
                out.append(f"{vals[0]:.1f}" if vals and vals[0] == vals[0] else "-")
            return " / ".join(out)

        if compact:
            ranks = list(dict.fromkeys(c.ranks for c in self.cells))
            models: dict[str, list[MatrixCell]] = {}
            for c in self.cells:
                models.setdefault(c.model, []).append(c)
            head = ["model", "family", *[f"{k} ranks ({', '.join(schedules)})" for k in ranks],
                    "loss rel", "grad rel", "param rel", "buffer rel",
                    "compile s (" + " / ".join(f"{k}" for k in ranks) + " ranks)"]
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for model, cells in models.items():
                cols = []
                for k in ranks:
                    bad = [c.schedule + (" error" if c.error else " DIFF") for c in cells if c.ranks == k and not c.ok]
                    cols.append("ok" if not bad else ", ".join(bad))
                lines.append("| " + " | ".join([model, cells[0].family, *cols, worst(cells, "loss_rel_diff"),
                                                worst(cells, "max_grad_rel_diff"), worst(cells, "max_param_rel_diff"),
                                                worst(cells, "max_buffer_rel_diff"), compile_col(cells, ranks)]) + " |")
            return "\n".join(lines)
        head = ["model", "family", "ranks", *schedules, "loss rel", "grad rel", "param rel", "buffer rel", "compile s"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for (model, ranks), cells in rows.items():
            by = {c.schedule: c for c in cells}
            marks = [("ok" if by[s].ok else ("error" if by[s].error else "DIFF")) if s in by else "" for s in schedules]
            lines.append("| " + " | ".join([model, cells[0].family, str(ranks), *marks, worst(cells, "loss_rel_diff"),
                                            worst(cells, "max_grad_rel_diff"), worst(cells, "max_param_rel_diff"),
                                            worst(cells, "max_buffer_rel_diff"), compile_col(cells, [ranks])]) + " |")
        return "\n".join(lines)


def _tail(text: str, n: int = 1200) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


@dataclass(frozen=True)
class _Settings:
    """The knobs of one matrix run (see :func:`run_matrix`), shared by its steps."""

    schedules: tuple[str, ...]
    steps: int
    lr: float
    microbatches: int
    microbatch_size: int
    partition_time_limit_s: float
    milp_time_limit_s: float
    run_timeout_s: float
    loss_rtol: float
    rtol: float
    stages_per_device: int
    meta_checkpoint: tuple[str, ...]
    mesh: Any = "pipeline"


def _references(zms: dict, cfg: _Settings, tmp_dir: str | None) -> tuple[dict, dict[str, str], dict[str, str]]:
    """Single-process training of every model (the verdicts' reference) and, for the
    ``meta_checkpoint`` models, their weights saved whole to ``tmp_dir`` and trained from that
    checkpoint on meta. Returns ``(refs, checkpoints, meta_errors)``: ``refs[name]`` and
    ``refs[("meta", name)]``, the checkpoint path of each meta model, and the failure of each
    meta model whose one-process build failed (a matrix cell, not a crash)."""
    import os

    from fxpipe.codegen.launch import reference_train  # lazy: torch
    from fxpipe.codegen.materialize import MetaInit  # lazy: torch

    refs: dict = {}
    for n, zm in zms.items():
        refs[n] = reference_train(zm, zm.batch, num_microbatches=cfg.microbatches, steps=cfg.steps, lr=cfg.lr,
                                  loss=zm.loss)
    checkpoints: dict[str, str] = {}
    meta_errors: dict[str, str] = {}
    for n in cfg.meta_checkpoint:  # the zoo's weights saved whole; each rank reads its stages (the rest seeded)
        from safetensors.torch import save_model

        try:
            path = os.path.join(tmp_dir, f"{n}.safetensors")
            save_model(zms[n]()[0], path)
            refs[("meta", n)] = reference_train(MetaInit(zms[n], checkpoint=path), zms[n].batch,
                                                num_microbatches=cfg.microbatches, steps=cfg.steps, lr=cfg.lr,
                                                loss=zms[n].loss)
            checkpoints[n] = path
        except Exception as exc:  # noqa: BLE001 - a failure is a matrix cell, not a crash
            meta_errors[n] = _tail(f"meta build from the checkpoint in one process failed: {exc!r}")
    return refs, checkpoints, meta_errors


def _plan_model(zm, name: str, k: int, cfg: _Settings) -> tuple[dict, dict[str, float]]:
    """Plan one model on ``k`` ranks once per placement its schedules need (``fxpipe.compile``)
    and reschedule that plan into every schedule. Returns ``(plan per schedule, compile
    seconds per schedule)``: the compile plus the rescheduling. Planning errors propagate."""
    model, args, kwargs = zm.one_microbatch()
    compile_s: dict[str, float] = {}
    by_placement: dict[str, Any] = {}
    placement_s: dict[str, float] = {}
    plans = {}
    for s in cfg.schedules:
        pl = "looped" if cfg.stages_per_device == 1 else MULTI_STAGE_SCHEDULES.get(s, "looped")
        if pl not in by_placement:
            tc = time.perf_counter()
            by_placement[pl] = fxpipe.compile(
                model, args, kwargs, devices=k, microbatches=cfg.microbatches, stages_per_device=cfg.stages_per_device,
                placement=pl, time_limit_s=cfg.partition_time_limit_s, schedule=None,  # rescheduled below
                schedule_time_limit_s=cfg.milp_time_limit_s, name=name, mesh=cfg.mesh)
            placement_s[pl] = time.perf_counter() - tc
        plan = by_placement[pl]
        tc = time.perf_counter()
        plans[s] = plan if s == plan.options.get("schedule") else plan.reschedule(s, time_limit_s=cfg.milp_time_limit_s)
        compile_s[s] = placement_s[pl] + time.perf_counter() - tc
    return plans, compile_s


def _plan_runs(zms: dict, k: int, cfg: _Settings, checkpoints: dict[str, str], meta_errors: dict[str, str],
               cells: list[MatrixCell]) -> tuple[list[dict], list[tuple[str, str, float]], list[str]]:
    """The training runs of pipeline size ``k``: one per planned model and schedule, then the
    meta-checkpoint runs in the caller's order (a failing run ends the job and restarts the
    workers, so runs expected to fail go last). Planning failures and failed meta builds
    become error cells in ``cells``. Returns ``(runs, keys (model, schedule, compile_s),
    planned models)``."""
    runs, keys, planned = [], [], []
    meta_runs: dict[str, tuple[dict, tuple]] = {}
    first = cfg.schedules[0]
    for n, zm in zms.items():
        try:
            plans, compile_s = _plan_model(zm, n, k, cfg)
        except Exception as exc:  # noqa: BLE001 - a planning failure is a matrix cell, not a crash
            for s in [*cfg.schedules, *([f"meta-ckpt:{first}"] if n in cfg.meta_checkpoint else [])]:
                cells.append(MatrixCell(n, zm.family, k, s, False, error=_tail(f"planning failed: {exc!r}")))
            continue
        for s in cfg.schedules:
            run = dict(make_model=zm, make_batch=zm.batch, loss=zm.loss,
                       stage_of=plans[s].worker_stage_of(), orders=plans[s].orders(),
                       recompute_stages=plans[s].recompute_stages(),
                       activation_checkpointing=getattr(plans[s], "activation_checkpointing", None),
                       num_microbatches=cfg.microbatches, steps=cfg.steps, lr=cfg.lr, model_key=n)
            runs.append({**run, **_mesh_run(plans[s])})
            keys.append((n, s, compile_s[s], format_mesh(plans[s].mesh)))
        if n in meta_errors:
            cells.append(MatrixCell(n, zm.family, k, f"meta-ckpt:{first}", False, error=meta_errors[n]))
        if n in checkpoints:  # built on meta in every worker, each rank reading its stages
            meta_runs[n] = (dict(runs[-len(cfg.schedules)], state={"seed": 0, "checkpoint": checkpoints[n]}),
                            (n, f"meta-ckpt:{first}", compile_s[first], format_mesh(plans[first].mesh)))
        planned.append(n)
    for n in cfg.meta_checkpoint:
        if n in meta_runs:
            runs.append(meta_runs[n][0])
            keys.append(meta_runs[n][1])
    return runs, keys, planned


def _mesh_run(plan) -> dict:
    """The run keys of a mesh plan (:meth:`fxpipe.plan.Plan.train_local`'s): none for a pure pipeline."""
    if plan.world_size == plan.devices and not getattr(plan.memory, "offload_optimizer", False):
        return {}
    from fxpipe.plan.build import fsdp_blocks  # noqa: PLC0415

    return {"mesh": {**plan.mesh, "order": plan.rank_order}, "num_microbatches": plan.global_microbatches,
            "offload_optimizer": bool(getattr(plan.memory, "offload_optimizer", False)), "fsdp_blocks": fsdp_blocks(plan)}


def _verdict_cell(name: str, family: str, k: int, schedule: str, compile_s: float, result, ref,
                  cfg: _Settings, mesh: str = "") -> MatrixCell:
    """The cell of one finished run: an error, or its comparison with the reference
    (:func:`fxpipe.codegen.compare.compare_training`; random ops make it fail)."""
    from fxpipe.codegen.compare import compare_training  # lazy: torch
    from fxpipe.codegen.launch import RunError  # lazy: torch

    if isinstance(result, RunError):
        return MatrixCell(name, family, k, schedule, False, error=_tail(result.message), compile_s=compile_s, mesh=mesh)
    cmp = compare_training(result, ref, loss_rtol=cfg.loss_rtol, rtol=cfg.rtol,
                           random_ops=result.meta.get("random_ops", ()))
    return MatrixCell(
        name, family, k, schedule, cmp.ok and not cmp.random_ops, loss_rel_diff=cmp.loss_rel_diff,
        max_grad_rel_diff=cmp.max_grad_rel_diff, max_param_rel_diff=cmp.max_param_rel_diff,
        max_buffer_rel_diff=cmp.max_buffer_rel_diff, worst_param_grad_rel_diff=cmp.worst_param_grad_rel_diff,
        worst_param=cmp.worst_param, problems=cmp.problems + [f"random ops: {cmp.random_ops[:3]}"] * bool(cmp.random_ops),
        full_backward_stages=sorted(int(r) for r, f in result.meta.get("fused_full_backward", {}).items() if f),
        moved_nodes=len(result.meta.get("moved_nodes", {})),
        cloned_inputs=sum(len(v) for v in result.meta.get("cloned", {}).values()),
        compile_s=compile_s, mesh=mesh,
    )


def run_matrix(
    models: Sequence[str] | None = None,
    ranks: Sequence[int] = (2, 4),
    schedules: Sequence[str] = SCHEDULES,
    *,
    steps: int = 2,
    lr: float = 0.05,
    microbatches: int = 4,
    microbatch_size: int = 2,
    partition_time_limit_s: float = 0.3,
    milp_time_limit_s: float = 2.0,
    run_timeout_s: float = 180.0,
    loss_rtol: float = 1e-4,
    rtol: float = 1e-5,
    stages_per_device: int = 1,
    meta_checkpoint: Sequence[str] = (),
    mesh: Any = "pipeline",
    log: Callable[[str], None] | None = None,
) -> MatrixResult:
    """Plan, train and compare every model x pipeline size x schedule.

    Parameters
    ----------
    models : sequence of str, optional
        Zoo names (default: all of :func:`fxpipe.testing.zoo.names`).
    ranks : sequence of int
        Pipeline sizes (local gloo processes).
    schedules : sequence of str
        Schedule methods (default :data:`SCHEDULES`).
    steps, lr : int, float
        SGD steps and learning rate.
    microbatches, microbatch_size : int
        Micro-batches per step and samples per micro-batch.
    partition_time_limit_s, milp_time_limit_s : float
        ``fxpipe.compile``'s partition search budget and the schedule MILP's.
    run_timeout_s : float
        Limit for one training run (a run over it is recorded as an error).
    loss_rtol, rtol : float
        Verdict tolerances (:func:`~fxpipe.codegen.compare.compare_training`).
    stages_per_device : int
        v: every model is cut into ``v * ranks`` stages, v per rank (``fxpipe.compile``'s
        ``stages_per_device``). With v >= 2 each schedule runs on the placement
        :data:`MULTI_STAGE_SCHEDULES` gives it (e.g. ``interleaved-1f1b`` looped, ``zb-v`` V-shaped).
    meta_checkpoint : sequence of str
        Models that also train once per pipeline size (with the first schedule) built on
        ``meta`` in every worker, each rank materializing only its stages from a safetensors
        checkpoint of the zoo model's weights (whatever it lacks from the seeded initializers);
        compared with the whole model built on meta and loaded from that checkpoint in one
        process. Cells ``"meta-ckpt:<schedule>"``. These runs come after all others, in this
        order (a failed run restarts the workers: put the runs expected to fail last).
    mesh : str or dict
        ``fxpipe.compile``'s ``mesh`` for every model: ``"pipeline"`` (the default: ``ranks`` pipeline
        stages), ``"auto"`` (the mesh search, fxpipe's default: the runs train the chosen
        ``pp x dp_shard x dp_replicate`` on ``ranks`` processes, :mod:`fxpipe.codegen.mesh`) or
        pinned degrees. The chosen mesh is each cell's ``mesh``.
    log : callable(str), optional
        Progress messages.

    ``MatrixCell.compile_s`` is the wall time of ``fxpipe.compile`` (capture, cost, partition,
    schedule) plus the rescheduling into that cell's schedule.

    Returns
    -------
    MatrixResult
    """
    import tempfile

    from fxpipe.codegen.launch import spawn_train_many  # lazy: torch
    from fxpipe.testing import zoo  # lazy: torch

    say = log or (lambda msg: None)
    names = list(models) if models is not None else zoo.names()
    unknown = sorted(set(meta_checkpoint) - set(names))
    if unknown:
        raise InputError(f"meta_checkpoint models {unknown} are not among the matrix's models; add them to models")
    cfg = _Settings(tuple(schedules), steps, lr, microbatches, microbatch_size, partition_time_limit_s,
                    milp_time_limit_s, run_timeout_s, loss_rtol, rtol, stages_per_device, tuple(meta_checkpoint), mesh)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    zms = {n: zoo.get(n, microbatches=microbatches, microbatch_size=microbatch_size) for n in names}

    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="fxpipe-matrix-") if meta_checkpoint else None
    refs, checkpoints, meta_errors = _references(zms, cfg, tmp.name if tmp is not None else None)
    timings["reference_s"] = time.perf_counter() - t0
    say(f"references of {len(names)} models in {timings['reference_s']:.1f} s")

    cells: list[MatrixCell] = []
    for k in ranks:
        t0 = time.perf_counter()
        runs, keys, planned = _plan_runs(zms, k, cfg, checkpoints, meta_errors, cells)
        timings[f"plan_{k}_s"] = time.perf_counter() - t0
        say(f"{k} ranks: planned {len(planned)} models x {len(schedules)} schedules in {timings[f'plan_{k}_s']:.1f} s")
        t0 = time.perf_counter()
        results = spawn_train_many(runs, world_size=k, on_error="record", run_timeout_s=run_timeout_s,
                                   timeout_s=run_timeout_s, warn_random=False) if runs else []
        timings[f"train_{k}_s"] = time.perf_counter() - t0
        say(f"{k} ranks: trained {len(runs)} runs in {timings[f'train_{k}_s']:.1f} s")
        for (n, s, c_s, mesh_text), res in zip(keys, results):
            ref = refs[("meta", n)] if s.startswith("meta-ckpt:") else refs[n]
            cells.append(_verdict_cell(n, zms[n].family, k, s, c_s, res, ref, cfg, mesh_text))
    if tmp is not None:
        tmp.cleanup()
    timings["wall_s"] = time.perf_counter() - t_start
    settings = dict(models=names, ranks=list(ranks), schedules=list(schedules), stages_per_device=stages_per_device,
                    mesh=mesh,
                    steps=steps, lr=lr,
                    microbatches=microbatches, microbatch_size=microbatch_size,
                    partition_time_limit_s=partition_time_limit_s, milp_time_limit_s=milp_time_limit_s,
                    loss_rtol=loss_rtol, rtol=rtol, meta_checkpoint=list(meta_checkpoint))
    return MatrixResult(cells, timings, settings)
