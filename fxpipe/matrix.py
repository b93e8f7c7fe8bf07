"""The real-architecture matrix: every zoo model x pipeline size x schedule, trained and compared.

For each model of :mod:`fxpipe.zoo` and each pipeline size ``k`` the model is planned with
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

__all__ = ["SCHEDULES", "MatrixCell", "MatrixResult", "run_matrix"]

#: the schedules the runtime runs: torch's B/W-fused and split-backward families and the MILP's
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "milp")
#: the schedules of several stages per device (``stages_per_device >= 2``) and the placement each runs on
MULTI_STAGE_SCHEDULES = {"interleaved-1f1b": "looped", "zb-v": "v", "dualpipe-v": "v", "greedy": "v", "milp": "v"}


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
    log: Callable[[str], None] | None = None,
) -> MatrixResult:
    """Plan, train and compare every model x pipeline size x schedule.

    Parameters
    ----------
    models : sequence of str, optional
        Zoo names (default: all of :func:`fxpipe.zoo.names`).
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
    log : callable(str), optional
        Progress messages.

    ``MatrixCell.compile_s`` is the wall time of ``fxpipe.compile`` (capture, cost, partition,
    schedule) plus the rescheduling into that cell's schedule.

    Returns
    -------
    MatrixResult
    """
    import os
    import tempfile

    import fxpipe
    from fxpipe import zoo
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import RunError, reference_train, spawn_train_many
    from fxpipe.codegen.materialize import MetaInit
    from fxpipe.errors import InputError

    say = log or (lambda msg: None)
    names = list(models) if models is not None else zoo.names()
    unknown = sorted(set(meta_checkpoint) - set(names))
    if unknown:
        raise InputError(f"meta_checkpoint models {unknown} are not among the matrix's models; add them to models")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    zms = {n: zoo.get(n, microbatches=microbatches, microbatch_size=microbatch_size) for n in names}

    t0 = time.perf_counter()
    refs = {}
    for n, zm in zms.items():
        refs[n] = reference_train(zm, zm.batch, num_microbatches=microbatches, steps=steps, lr=lr, loss=zm.loss)
    tmp = tempfile.TemporaryDirectory(prefix="fxpipe-matrix-") if meta_checkpoint else None
    checkpoints: dict[str, str] = {}
    meta_errors: dict[str, str] = {}
    for n in meta_checkpoint:  # the zoo's weights saved whole; each rank reads its stages (the rest seeded)
        from safetensors.torch import save_model

        try:
            path = os.path.join(tmp.name, f"{n}.safetensors")
            save_model(zms[n]()[0], path)
            refs[("meta", n)] = reference_train(MetaInit(zms[n], checkpoint=path), zms[n].batch,
                                                num_microbatches=microbatches, steps=steps, lr=lr, loss=zms[n].loss)
            checkpoints[n] = path
        except Exception as exc:  # noqa: BLE001 - a failure is a matrix cell, not a crash
            meta_errors[n] = _tail(f"meta build from the checkpoint in one process failed: {exc!r}")
    timings["reference_s"] = time.perf_counter() - t0
    say(f"references of {len(names)} models in {timings['reference_s']:.1f} s")

    cells: list[MatrixCell] = []
    for k in ranks:
        t0 = time.perf_counter()
        runs, keys, planned = [], [], []
        meta_runs: dict[str, tuple[dict, tuple]] = {}
        for n, zm in zms.items():
            model, args, kwargs = zm.one_microbatch()
            compile_s: dict[str, float] = {}
            try:
                by_placement: dict[str, Any] = {}
                placement_s: dict[str, float] = {}
                plans = {}
                for s in schedules:
                    pl = "looped" if stages_per_device == 1 else MULTI_STAGE_SCHEDULES.get(s, "looped")
                    if pl not in by_placement:
                        tc = time.perf_counter()
                        by_placement[pl] = fxpipe.compile(
                            model, args, kwargs, devices=k, microbatches=microbatches, stages_per_device=stages_per_device,
                            placement=pl, time_limit_s=partition_time_limit_s, schedule=None,  # rescheduled below
                            schedule_time_limit_s=milp_time_limit_s, name=n)
                        placement_s[pl] = time.perf_counter() - tc
                    plan = by_placement[pl]
                    tc = time.perf_counter()
                    plans[s] = plan if s == plan.options.get("schedule") else plan.reschedule(
                        s, time_limit_s=milp_time_limit_s)
                    compile_s[s] = placement_s[pl] + time.perf_counter() - tc
            except Exception as exc:  # noqa: BLE001 - a planning failure is a matrix cell, not a crash
                for s in [*schedules, *([f"meta-ckpt:{schedules[0]}"] if n in meta_checkpoint else [])]:
                    cells.append(MatrixCell(n, zm.family, k, s, False, error=_tail(f"planning failed: {exc!r}")))
                continue
            for s in schedules:
                runs.append(dict(make_model=zm, make_batch=zm.batch, loss=zm.loss,
                                 stage_of=plans[s].worker_stage_of(), orders=plans[s].orders(),
                                 recompute_stages=plans[s].recompute_stages(),
                                 num_microbatches=microbatches, steps=steps, lr=lr, model_key=n))
                keys.append((n, s, compile_s[s]))
            if n in meta_errors:
                cells.append(MatrixCell(n, zm.family, k, f"meta-ckpt:{schedules[0]}", False, error=meta_errors[n]))
            if n in checkpoints:  # built on meta in every worker, each rank reading its stages
                s = schedules[0]
                meta_runs[n] = (dict(runs[-len(schedules)], state={"seed": 0, "checkpoint": checkpoints[n]}),
                                (n, f"meta-ckpt:{s}", compile_s[s]))
            planned.append(n)
        for n in meta_checkpoint:  # after every other run, in the caller's order: a failing run ends the
            if n in meta_runs:     # job and restarts the workers, so runs expected to fail go last
                runs.append(meta_runs[n][0])
                keys.append(meta_runs[n][1])
        timings[f"plan_{k}_s"] = time.perf_counter() - t0
        say(f"{k} ranks: planned {len(planned)} models x {len(schedules)} schedules in {timings[f'plan_{k}_s']:.1f} s")
        t0 = time.perf_counter()
        results = spawn_train_many(runs, world_size=k, on_error="record", run_timeout_s=run_timeout_s,
                                   timeout_s=run_timeout_s, warn_random=False) if runs else []
        timings[f"train_{k}_s"] = time.perf_counter() - t0
        say(f"{k} ranks: trained {len(runs)} runs in {timings[f'train_{k}_s']:.1f} s")
        for (n, s, c_s), res in zip(keys, results):
            fam = zms[n].family
            if isinstance(res, RunError):
                cells.append(MatrixCell(n, fam, k, s, False, error=_tail(res.message), compile_s=c_s))
                continue
            ref = refs[("meta", n)] if s.startswith("meta-ckpt:") else refs[n]
            cmp = compare_training(res, ref, loss_rtol=loss_rtol, rtol=rtol,
                                   random_ops=res.meta.get("random_ops", ()))
            cells.append(MatrixCell(
                n, fam, k, s, cmp.ok and not cmp.random_ops, loss_rel_diff=cmp.loss_rel_diff,
                max_grad_rel_diff=cmp.max_grad_rel_diff, max_param_rel_diff=cmp.max_param_rel_diff,
                max_buffer_rel_diff=cmp.max_buffer_rel_diff, worst_param_grad_rel_diff=cmp.worst_param_grad_rel_diff,
                worst_param=cmp.worst_param, problems=cmp.problems + [f"random ops: {cmp.random_ops[:3]}"] * bool(cmp.random_ops),
                full_backward_stages=sorted(int(r) for r, f in res.meta.get("fused_full_backward", {}).items() if f),
                moved_nodes=len(res.meta.get("moved_nodes", {})),
                cloned_inputs=sum(len(v) for v in res.meta.get("cloned", {}).values()),
                compile_s=c_s,
            ))
    if tmp is not None:
        tmp.cleanup()
    timings["wall_s"] = time.perf_counter() - t_start
    settings = dict(models=names, ranks=list(ranks), schedules=list(schedules), stages_per_device=stages_per_device,
                    steps=steps, lr=lr,
                    microbatches=microbatches, microbatch_size=microbatch_size,
                    partition_time_limit_s=partition_time_limit_s, milp_time_limit_s=milp_time_limit_s,
                    loss_rtol=loss_rtol, rtol=rtol, meta_checkpoint=list(meta_checkpoint))
    return MatrixResult(cells, timings, settings)
