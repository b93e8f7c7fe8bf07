"""A pipeline schedule as a picture: a Gantt chart with memory curves underneath.

:func:`gantt` draws one row per device for its compute stream (F/B/W of all the stages it
holds; a box is labelled with its micro-batch, and with ``stage:micro-batch`` when the device
holds several stages) and one for its copy stream (O/R), and underneath the activation memory
of every device over time (Contract 3 rule 5, from
:func:`fxpipe.schedule.validate.device_memory_profile`) with its limit. PNG or SVG, chosen by
the file suffix; matplotlib's Agg backend (no display needed). The interactive twin is the
Chrome/Perfetto trace of :mod:`fxpipe.report.trace`.

References
----------
Zero Bubble (Qi et al. 2024) and OptPipe Figure 4 draw schedules the same way.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

from fxpipe.errors import InputError
from fxpipe.io import binary_unit, write_text_atomic
from fxpipe.ir import Schedule, ScheduleProblem
from fxpipe.schedule.validate import device_memory_profile

__all__ = ["COLORS", "gantt", "gantt_rows"]

#: Colour of each op type (F blue, B green, W orange, O purple, R pink).
COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "O": "#8172B3", "R": "#DA8BC3"}


def gantt(problem: ScheduleProblem, schedule: Schedule, path: str | os.PathLike, *, title: str | None = None,
          label_ops: bool | None = None) -> Path:
    """Draw ``schedule`` as a Gantt chart (a row per device) with per-device memory curves underneath.

    Parameters
    ----------
    problem : ScheduleProblem
        The problem (for memory deltas and limits).
    schedule : Schedule
        Timed ops (seconds).
    path : str or PathLike
        Output file; ``.png`` or ``.svg`` (``.pdf`` also works).
    title : str, optional
        Defaults to method, objective value and bound.
    label_ops : bool, optional
        Write the micro-batch number in each box (default: when there are <= 400 ops).

    Returns
    -------
    Path
        The file written (atomically: drawn to a temp file, then renamed).

    Raises
    ------
    InputError
        On an unsupported suffix or a schedule whose stages do not match the problem.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg", "pdf"):
        raise InputError(f"gantt: unsupported file type {path.suffix!r}; use .png or .svg")
    if not isinstance(schedule, Schedule):
        raise InputError(f"gantt: expected a Schedule, got {type(schedule).__name__}")
    S, D = problem.num_stages, problem.num_devices
    if any(not 0 <= o.stage < S for o in schedule.ops):
        raise InputError(f"gantt: the schedule names stages outside 0..{S - 1} of the problem")
    if label_ops is None:
        label_ops = len(schedule.ops) <= 400
    dev = problem.device_of_stage
    multi = not problem.one_stage_per_device

    t_end = max((o.end_s for o in schedule.ops), default=1.0)
    t_beg = min((o.start_s for o in schedule.ops), default=0.0)
    # time in ms below 1 s, so that tick labels stay plain numbers (no offset or 1e-3 factor)
    tscale, tunit = (1e3, "ms") if max(abs(t_end), abs(t_beg)) < 1.0 else (1.0, "s")
    lanes, labels = gantt_rows(problem, schedule)
    height = 1.2 + 0.5 * len(labels) + 2.5
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, height), sharex=True,
                                  gridspec_kw={"height_ratios": [max(len(labels), 2), 5]})
    for o in schedule.ops:
        lane = 1 if o.type in ("O", "R") else 0
        y = lanes[(dev[o.stage], lane)]
        h = 0.8 if lane == 0 else 0.5
        ax.broken_barh([(o.start_s * tscale, max(o.end_s - o.start_s, 0.0) * tscale)], (y - h / 2, h),
                       facecolors=COLORS.get(o.type, "grey"), edgecolors="black", linewidth=0.3)
        if label_ops and o.end_s > o.start_s:
            text = f"{o.stage}:{o.microbatch}" if multi else str(o.microbatch)
            ax.text((o.start_s + o.end_s) / 2 * tscale, y, text, ha="center", va="center",
                    fontsize=6 if not multi else 5, color="white")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    kinds = {o.type for o in schedule.ops}
    names = {"F": "F forward", "B": "B backward-input", "W": "W backward-weight", "O": "O offload", "R": "R reload"}
    # the legend sits outside the plot, right of it, so it covers no bar
    ax.legend(handles=[Patch(color=c, label=names[t]) for t, c in COLORS.items() if t in kinds], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    if title is None:
        title = (f"{problem.name}: {schedule.method or 'schedule'}  {problem.objective} = "
                 f"{schedule.value * tscale:.3f} {tunit}"
                 + (f"  (bound {schedule.lower_bound_s * tscale:.3f} {tunit})" if schedule.lower_bound_s else ""))
    ax.set_title(title, fontsize=9)

    cmap = plt.get_cmap("tab10")
    any_limit = hidden_limit = False
    curves = [(d, *device_memory_profile(problem, schedule.ops, d)) for d in range(D)]
    most = max([float(max(mem, default=0.0)) for _, _, mem in curves] + [1.0])
    munit, mdiv = binary_unit(most, largest="GiB")
    for d, times, mem in curves:
        if len(times) == 0:
            continue
        xs = [t_beg * tscale] + [t * tscale for t in times] + [t_end * tscale]
        ys = [0.0] + [float(m) / mdiv for m in mem] + [float(mem[-1]) / mdiv]
        name = f"device {d}" if multi or not problem.identity_placement else f"stage {d}"
        axm.step(xs, ys, where="post", color=cmap(d % 10), linewidth=1, label=name)
        lim = float(problem.mem_limit[d])
        # a limit far above the curves would flatten them: drawn only when within 4x of the peak
        if math.isfinite(lim) and lim <= 4 * most:
            any_limit = True
            axm.axhline(lim / mdiv, color=cmap(d % 10), linestyle="--", linewidth=0.6)
        elif math.isfinite(lim):
            hidden_limit = True
    axm.set_ylabel(f"activation memory ({munit})" + ("\n(dashed: limit)" if any_limit else "")
                   + ("\n(limits far above, not drawn)" if hidden_limit and not any_limit else ""), fontsize=8)
    axm.set_xlabel(f"time ({tunit})", fontsize=8)
    axm.ticklabel_format(axis="both", style="plain", useOffset=False)
    if D <= 16:
        axm.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    fig.tight_layout()

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=fmt, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return write_text_atomic(path, buf.getvalue())


def gantt_rows(problem: ScheduleProblem, schedule: Schedule) -> tuple[dict[tuple[int, int], int], list[str]]:
    """The Gantt chart's rows: only those that carry data.

    Every device gets a compute row; its copy row (O/R) only when the device offloads or
    reloads in ``schedule``. Returns ``({(device, 0 compute | 1 copy): row}, row labels)``.
    """
    dev = problem.device_of_stage
    multi = not problem.one_stage_per_device
    copies = {dev[o.stage] for o in schedule.ops if o.type in ("O", "R")}
    lanes: dict[tuple[int, int], int] = {}
    labels: list[str] = []
    for d in range(problem.num_devices):
        st = problem.stages_of_device(d)
        name = f"stage {st[0]}" if not multi and problem.identity_placement else f"device {d} (stages {','.join(map(str, st))})"
        lanes[(d, 0)] = len(labels)
        labels.append(name)
        if d in copies:
            lanes[(d, 1)] = len(labels)
            labels.append(f"{name} copy")
    return lanes, labels
