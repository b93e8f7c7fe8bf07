"""Build a schedule problem (Contract 3) from a costed OpGraph and a partition (Contract 2).

Stage s of the pipeline is block s of the partition (blocks are numbered in pipeline order).
Per stage:

* ``t_f[s] = sum t_fwd_s``, ``t_b[s] = sum t_bwd_input_s``, ``t_w[s] = sum t_bwd_weight_s`` over
  its nodes (seconds, one micro-batch);
* ``t_comm[s]`` = relay bytes crossing boundary s (tensors produced at a stage ``<= s`` and
  consumed at a stage ``> s``, each counted once; Contract 2 ``comm="relay"``, i.e. the
  ``out`` bytes of :func:`fxpipe.partition.objective.io_bytes`) divided by the graph's
  bandwidth. The same time is used for activations forward and gradients backward;
* ``mem_f[s] = sum act_bytes`` of its nodes (``a``) plus ``pooled_buffer_bytes[s]`` (``r``,
  default 0): the activation receive buffers a runtime that reuses them holds for the
  micro-batch from its F to its W (:meth:`fxpipe.memory.MemoryModel.pooled_buffer_bytes`). A
  stage whose nodes keep nothing (or an empty stage) gets ``mem_f = 1`` byte, because
  Contract 3 needs ``mem_f > 0``; one byte is negligible next to any real limit;
* ``mem_b[s] = -a * t_b / (t_b + t_w)`` and ``mem_w[s] = -mem_f[s] - mem_b[s]``: B frees
  the share of the stash proportional to its share of the backward time (half each when
  both times are 0), W the rest and the pooled buffers. This is the simplest documented
  split; Zero Bubble's transformer accounting (Qi et al. 2024 Table 1) frees most
  activations at B and keeps the inputs of linear layers for W;
* ``recompute_mem_f[s]`` = the relay bytes stage s receives (its inputs, what a stage that
  recomputes its forward during B keeps from F; :meth:`ScheduleProblem.with_recompute`), at
  least 1 byte and at most ``mem_f[s]``. With ``pooled_buffer_bytes`` the inputs are the
  receive buffers: ``pooled_bytes = r`` and ``recompute_mem_f = max(r, 1)`` (on a stage whose
  buffers are not pooled they are counted for the whole step, outside ``mem_f``, so keeping
  them costs nothing more);
* ``offload_bytes[s] = a`` and ``t_offload[s] = a / host_bandwidth`` (or the given
  ``t_offload_s``): the pooled buffers stay on the device. Without either, offload is disabled: ``offload_bytes = 0``, so an
  offload frees nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import CheckpointOption, OpGraph, ScheduleProblem
from fxpipe.partition.objective import Partition, io_bytes

__all__ = ["problem_from_partition"]

#: mem_f of a stage that keeps no activations (bytes); Contract 3 needs mem_f > 0.
MIN_STASH_BYTES = 1.0


def problem_from_partition(
    graph: OpGraph,
    partition: Partition | Sequence[int] | np.ndarray,
    *,
    num_microbatches: int,
    mem_limit_bytes: float | Sequence[float] = math.inf,
    t_offload_s: float | Sequence[float] | None = None,
    host_bandwidth_bytes_per_s: float | None = None,
    objective: str = "stage_span",
    pcie_groups: Sequence[Sequence[int]] = (),
    name: str | None = None,
    device_of_stage: Sequence[int] | None = None,
    pooled_buffer_bytes: Sequence[float] | np.ndarray | None = None,
    checkpoint_menu: Sequence[Sequence[CheckpointOption]] | None = None,
) -> ScheduleProblem:
    """The scheduling problem of running ``graph`` split by ``partition`` as a pipeline.

    Parameters
    ----------
    graph : OpGraph
        Costed op graph (Contract 1); times are per micro-batch.
    partition : Partition or int array (n,)
        Block of every node, blocks in pipeline order (every edge goes to the same or a later
        block). A bare assignment uses ``k = max + 1`` stages.
    num_microbatches : int
        m >= 1.
    mem_limit_bytes : float or float array (D,)
        Activation memory per device (``inf``: unlimited); with one stage per device, per stage.
    t_offload_s : float or float array (k,), optional
        One-way offload time of one micro-batch's stash; overrides the bandwidth.
    host_bandwidth_bytes_per_s : float, optional
        Device-host bandwidth; ``t_offload = mem_f / bandwidth``.
    objective : {"stage_span", "makespan"}
    pcie_groups : sequence of sequence of int
        Stages whose host transfers must not overlap.
    name : str, optional
        Problem name (default: the graph's).
    device_of_stage : int array (k,), optional
        Placement of the stages on devices (default one stage per device; looped and V
        placements from :func:`fxpipe.ir.looped_placement` / :func:`fxpipe.ir.v_placement`).
        Comm between stages on one device is free (Contract 3).
    pooled_buffer_bytes : float array (k,), optional
        Receive-buffer bytes each stage holds per micro-batch in flight (added to ``mem_f``,
        freed by W, never offloaded); default none. A ``mem_limit_bytes`` from
        :func:`fxpipe.memory.plan_view.schedule_mem_limit` leaves these out of the static state,
        so pass them with it: ``stage_static(...).pooled_buffer_bytes`` of the same memory model
        and placement (what ``fxpipe.planner`` does).
    checkpoint_menu : sequence (k,) of sequences of CheckpointOption, optional
        The activation-checkpoint options of every stage besides ``"none"``
        (:func:`fxpipe.memory.checkpoint.stage_menu`'s, as :meth:`MenuEntry.option`); the problem's
        menu is ``"none"`` (the stage as built here: ``kept_bytes = mem_f - pooled``, ``w_bytes =
        -mem_w - pooled``) followed by them, each keeping at least the 1-byte floor
        (``mem_f > 0``). Default: the default menu (none, and whole-stage recomputation from
        ``recompute_mem_f``).

    Returns
    -------
    ScheduleProblem

    Raises
    ------
    InputError
        On a malformed assignment, an edge to an earlier block, or bad parameters.

    References
    ----------
    DESIGN.md Contracts 2 and 3; OptPipe Section 3 (per-stage F/B/W/O/R parameters).
    """
    if isinstance(partition, Partition):
        a = np.asarray(partition.assignment, dtype=np.int64)
        k = int(partition.k)
    else:
        a = np.asarray(partition)
        if a.shape != (graph.n,) or a.dtype.kind not in "iu":
            raise InputError(f"partition must be a Partition or an integer array of {graph.n} block ids")
        a = a.astype(np.int64)
        if a.size and a.min() < 0:
            raise InputError("block ids must be >= 0")
        k = int(a.max()) + 1 if a.size else 1
    in_b, out_b = io_bytes(graph, a, k, "relay")  # raises InputError on a backward edge
    t_f = np.bincount(a, weights=graph.t_fwd_s, minlength=k)
    t_b = np.bincount(a, weights=graph.t_bwd_input_s, minlength=k)
    t_w = np.bincount(a, weights=graph.t_bwd_weight_s, minlength=k)
    stash = np.bincount(a, weights=graph.act_bytes, minlength=k)
    pooled = np.zeros(k) if pooled_buffer_bytes is None else np.asarray(pooled_buffer_bytes, dtype=np.float64)
    if pooled.shape != (k,) or not np.all(np.isfinite(pooled)) or np.any(pooled < 0):
        raise InputError(f"pooled_buffer_bytes must be {k} finite bytes >= 0, got {pooled_buffer_bytes!r}")
    stash = np.where(stash > 0, stash, np.where(pooled > 0, 0.0, MIN_STASH_BYTES))
    mem_f = stash + pooled
    tot = t_b + t_w
    share = np.where(tot > 0, t_b / np.where(tot > 0, tot, 1.0), 0.5)
    mem_b = -stash * share
    mem_w = -mem_f - mem_b
    t_comm = out_b[: k - 1] / graph.bandwidth_bytes_per_s
    if t_offload_s is not None:
        t_off = np.broadcast_to(np.asarray(t_offload_s, dtype=float), (k,)).copy()
        off_bytes = stash.copy()
    elif host_bandwidth_bytes_per_s is not None:
        bw = float(host_bandwidth_bytes_per_s)
        if not math.isfinite(bw) or bw <= 0:
            raise InputError(f"host_bandwidth_bytes_per_s must be a positive number, got {host_bandwidth_bytes_per_s!r}")
        t_off = stash / bw
        off_bytes = stash.copy()
    else:
        t_off = np.zeros(k)
        off_bytes = np.zeros(k)
    menu = None
    if checkpoint_menu is not None:
        if len(checkpoint_menu) != k:
            raise InputError(f"checkpoint_menu must list the options of each of the {k} stages, got {len(checkpoint_menu)}")
        menu = []
        for s in range(k):
            c = float(pooled[s])
            none = CheckpointOption("none", 0.0, float(mem_f[s]) - c, 0.0, max(float(-mem_w[s]) - c, 0.0))
            floor = max(MIN_STASH_BYTES - c, 0.0)  # Contract 3: mem_f > 0
            menu.append([none] + [dataclasses.replace(o, kept_bytes=max(o.kept_bytes, floor))
                                  for o in checkpoint_menu[s] if o.name != "none"])
    return ScheduleProblem.create(
        num_stages=k,
        num_microbatches=num_microbatches,
        t_f=t_f,
        t_b=t_b,
        t_w=t_w,
        t_comm=t_comm,
        t_offload=t_off,
        mem_f=mem_f,
        mem_b=mem_b,
        mem_w=mem_w,
        offload_bytes=off_bytes,
        recompute_mem_f=(np.minimum(np.maximum(in_b, MIN_STASH_BYTES), mem_f) if pooled_buffer_bytes is None
                         else np.maximum(pooled, MIN_STASH_BYTES)),
        pooled_bytes=pooled,
        mem_limit=mem_limit_bytes,
        pcie_groups=pcie_groups,
        objective=objective,
        name=graph.name if name is None else name,
        device_of_stage=device_of_stage,
        checkpoint_menu=menu,
    )
