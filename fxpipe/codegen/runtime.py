"""Lower fxpipe per-stage F/B/W orders to a ``torch.distributed.pipelining`` runtime.

This is the only module of fxpipe that uses private torch APIs (house rule, checked by
``tests/test_capture.py::test_private_torch_apis_only_in_codegen_runtime``):
``torch.distributed.pipelining`` internals (``_PipelineScheduleRuntime``, ``_Action``,
``_backward``) and ``torch._subclasses.fake_tensor.FakeTensorMode`` for static shape
inference; everything torch-version specific lives here.

Vocabulary. fxpipe schedules (Contract 3) use ``F`` (forward), ``B`` (backward-input) and ``W``
(backward-weight). torch's actions are ``F``, ``I`` (backward-input), ``W`` (backward-weight)
and ``B`` (full backward = I and W fused). :func:`actions_from_orders` maps ``B -> I`` and fuses
an ``I`` immediately followed by the ``W`` of the same micro-batch into torch's ``B``; a stage
whose order has no ``W`` at all is read as running full backwards.

One stage per rank: rank ``r`` runs stage ``r`` (the torch runtime infers the stage -> rank map
from the per-rank action lists). Communication actions (SEND_F/RECV_F/SEND_B/RECV_B) are added
by torch's ``_add_send_recv`` lowering when the runtime loads the compute actions.

Gradient scaling matches torch's schedules: ``loss_fn`` is applied to every micro-batch's output,
the per-micro-batch gradients are summed and divided by the number of micro-batches
(``scale_grads=True``), i.e. the gradient of the mean micro-batch loss.

References
----------
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (B/W split, ZB-H1).
Narayanan et al., "PipeDream" / 1F1B, SOSP 2019.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
)
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

from fxpipe.codegen.split import StagedProgram, split_stages
from fxpipe.errors import InputError

__all__ = [
    "actions_from_orders",
    "orders_from_schedule",
    "check_orders",
    "fuse_backward",
    "build_rank",
    "build_pipeline_rank",
    "FxpipeScheduleRuntime",
    "example_inputs_from_gm",
    "format_actions",
]

logger = logging.getLogger(__name__)

_TYPES_IN = {"F": "F", "B": "I", "I": "I", "W": "W"}


def _norm_orders(orders: Mapping[int, Sequence[tuple[str, int]]], num_stages: int, num_microbatches: int | None):
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InputError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    keys = sorted(int(k) for k in orders)
    if keys != list(range(num_stages)):
        raise InputError(f"orders must have one entry per stage 0..{num_stages - 1}, got stages {keys}")
    out: dict[int, list[tuple[str, int]]] = {}
    for s in range(num_stages):
        ops = []
        for item in orders[s] if s in orders else orders[str(s)]:  # type: ignore[index]
            try:
                t, j = item
            except (TypeError, ValueError):
                raise InputError(f"stage {s}: order items must be (type, microbatch) pairs, got {item!r}") from None
            t = str(t)
            if t in ("O", "R"):  # offload/reload do not change compute order
                continue
            if t not in _TYPES_IN:
                raise InputError(f"stage {s}: unknown op type {t!r} (expected F, B, W; O/R are ignored)")
            try:
                ok = not isinstance(j, (bool, str, bytes)) and int(j) == j and int(j) >= 0
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise InputError(f"stage {s}: micro-batch index must be an integer >= 0, got {j!r}")
            ops.append((_TYPES_IN[t], int(j)))
        out[s] = ops
    # micro-batch bookkeeping
    m = num_microbatches
    if m is None:
        m = 1 + max((j for ops in out.values() for _, j in ops), default=-1)
    for s, ops in out.items():
        has_w = any(t == "W" for t, _ in ops)
        seen: dict[str, set[int]] = {"F": set(), "I": set(), "W": set()}
        for t, j in ops:
            if j >= m:
                raise InputError(f"stage {s}, micro-batch {j}: index >= number of micro-batches {m}")
            if j in seen[t]:
                raise InputError(f"stage {s}, micro-batch {j}: op {t} appears twice")
            if t == "I" and j not in seen["F"]:
                raise InputError(f"stage {s}, micro-batch {j}: backward before its forward")
            if t == "W" and j not in seen["I"]:
                raise InputError(f"stage {s}, micro-batch {j}: W (backward-weight) before its B (backward-input)")
            seen[t].add(j)
        for t in ("F", "I"):
            missing = sorted(set(range(m)) - seen[t])
            if missing:
                name = "F" if t == "F" else "B"
                raise InputError(f"stage {s}: no {name} for micro-batches {missing}")
        if has_w and seen["W"] != seen["I"]:
            raise InputError(f"stage {s}: no W for micro-batches {sorted(seen['I'] - seen['W'])}")
    return out, m


def check_orders(orders: Mapping[int, Sequence[tuple[str, int]]], num_stages: int, num_microbatches: int | None = None) -> None:
    """Check that per-stage orders are complete and can run without deadlock.

    Each stage executes its list in order; ``F(s, j)`` waits for ``F(s-1, j)`` and a backward
    ``B(s, j)`` waits for ``B(s+1, j)`` (and for ``F(s, j)`` on the last stage), as in the
    runtime. The check simulates the stages and reports the op each blocked stage waits on.

    Raises
    ------
    InputError
        On a missing/duplicate op, an op before its dependency on the same stage, or a
        deadlock (naming the blocked stage, op and micro-batch).
    """
    norm, _ = _norm_orders(orders, num_stages, num_microbatches)
    _check_deadlock(norm, num_stages)


def _check_deadlock(norm: Mapping[int, Sequence[tuple[str, int]]], num_stages: int) -> None:
    """Simulate normalised orders (``_norm_orders`` output); InputError on a deadlock."""
    S = num_stages
    done: set[tuple[int, str, int]] = set()
    ptr = {s: 0 for s in range(S)}
    total = sum(len(v) for v in norm.values())
    count = 0
    while count < total:
        progress = False
        for s in range(S):
            while ptr[s] < len(norm[s]):
                t, j = norm[s][ptr[s]]
                if t == "F":
                    ok = s == 0 or (s - 1, "F", j) in done
                elif t == "I":
                    ok = (s, "F", j) in done and (s == S - 1 or (s + 1, "I", j) in done)
                else:
                    ok = (s, "I", j) in done
                if not ok:
                    break
                done.add((s, t, j))
                ptr[s] += 1
                count += 1
                progress = True
        if not progress:
            blocked = []
            for s in range(S):
                if ptr[s] < len(norm[s]):
                    t, j = norm[s][ptr[s]]
                    blocked.append(f"stage {s} waits at {'B' if t == 'I' else t} of micro-batch {j}")
            raise InputError("the per-stage orders deadlock: " + "; ".join(blocked))


def actions_from_orders(
    orders: Mapping[int, Sequence[tuple[str, int]]],
    num_stages: int,
    *,
    num_microbatches: int | None = None,
    fuse: bool = True,
) -> dict[int, list[str]]:
    """Convert fxpipe per-stage op orders to torch action strings, one list per rank.

    Parameters
    ----------
    orders : Mapping[int, Sequence[tuple[str, int]]]
        ``{stage: [(type, microbatch), ...]}`` with type ``F``, ``B`` (backward-input) or ``W``
        (backward-weight); ``O``/``R`` (offload/reload) are ignored here. A stage with no
        ``W`` at all runs full backwards.
    num_stages : int
        Number of stages S (= ranks).
    num_microbatches : int, optional
        Checked against the orders; inferred when omitted.
    fuse : bool
        Fuse a ``B`` immediately followed by the ``W`` of the same micro-batch into torch's
        full backward ``B`` (one autograd pass instead of two).

    Returns
    -------
    dict[int, list[str]]
        ``{rank: ["0F0", "0F1", "0I0", "0W0", "0B1", ...]}`` with rank = stage.

    Raises
    ------
    InputError
        If the orders are incomplete, inconsistent or deadlock (see :func:`check_orders`).

    Examples
    --------
    >>> actions_from_orders({0: [("F", 0), ("B", 0), ("W", 0)], 1: [("F", 0), ("B", 0), ("W", 0)]}, 2)
    {0: ['0F0', '0B0'], 1: ['1F0', '1B0']}
    """
    norm, _ = _norm_orders(orders, num_stages, num_microbatches)
    _check_deadlock(norm, num_stages)
    out: dict[int, list[str]] = {}
    for s, ops in norm.items():
        has_w = any(t == "W" for t, _ in ops)
        acts: list[str] = []
        i = 0
        while i < len(ops):
            t, j = ops[i]
            if t == "I" and not has_w:
                acts.append(f"{s}B{j}")
            elif t == "I" and fuse and i + 1 < len(ops) and ops[i + 1] == ("W", j):
                acts.append(f"{s}B{j}")
                i += 1
            else:
                acts.append(f"{s}{t}{j}")
            i += 1
        out[s] = acts
    return out


def fuse_backward(actions: Mapping[int, Sequence[str]]) -> dict[int, list[str]]:
    """Fallback: replace every split backward (``I`` ... ``W``) by a full backward ``B`` at the ``I``.

    Use when a stage's split backward is not supported (e.g. custom autograd functions whose
    weight gradients cannot be separated); the forward/backward-input order is unchanged, so a
    deadlock-free schedule stays deadlock-free.

    Raises
    ------
    InputError
        If an action string does not parse (the message names rank and step).
    """
    out: dict[int, list[str]] = {}
    for r, acts in actions.items():
        new = []
        for step, a in enumerate(acts):
            act = _parse_one(a, f"rank {r}, step {step}")
            if act is None:
                continue
            if act.computation_type.value == "W":
                continue
            if act.computation_type.value == "I":
                new.append(f"{act.stage_index}B{act.microbatch_index}")
            else:
                new.append(str(act))
        out[r] = new
    return out


def orders_from_schedule(schedule: Any, num_stages: int | None = None) -> dict[int, list[tuple[str, int]]]:
    """Per-stage compute order of an ``fxpipe.ir.Schedule`` (ops sorted by start time).

    Parameters
    ----------
    schedule : fxpipe.ir.Schedule or Mapping
        Anything with ``ops`` whose items have ``stage``, ``microbatch``, ``type``, ``start_s``
        (attributes or dict keys).
    num_stages : int, optional
        Number of stages; defaults to 1 + the largest stage index.

    Returns
    -------
    dict[int, list[tuple[str, int]]]
        ``{stage: [(type, microbatch), ...]}`` with only F, B, W ops, ordered by
        ``(start_s, F < B < W, microbatch)``.
    """
    ops = schedule["ops"] if isinstance(schedule, Mapping) else schedule.ops

    def get(o, k):
        return o[k] if isinstance(o, Mapping) else getattr(o, k)

    rank = {"F": 0, "B": 1, "W": 2}
    S = num_stages if num_stages is not None else 1 + max(int(get(o, "stage")) for o in ops)
    out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(S)}
    rows = sorted(
        (float(get(o, "start_s")), rank[str(get(o, "type"))], int(get(o, "microbatch")), int(get(o, "stage")), str(get(o, "type")))
        for o in ops
        if str(get(o, "type")) in rank
    )
    for _, _, j, s, t in rows:
        if s not in out:
            raise InputError(f"schedule op on stage {s} outside 0..{S - 1}")
        out[s].append((t, j))
    return out


def format_actions(actions: Mapping[int, Sequence[str]]) -> str:
    """Text table of per-rank actions (one row per rank), for logs and golden tests."""
    return "\n".join(f"rank {r}: " + " ".join(actions[r]) for r in sorted(actions))


class FxpipeScheduleRuntime(_PipelineScheduleRuntime):
    """torch's schedule runtime plus gradient summation of tied parameters across stages.

    After every ``step`` (all micro-batches' backward done and gradients scaled), the
    gradients of parameters held by several stages (``StagedProgram.shared_params``) are
    all-reduced (sum) over the ranks holding them, so each copy gets the full gradient and an
    optimizer keeps the copies equal, exactly as in single-process training.
    """

    def __init__(self, *args, shared_grads: Sequence[tuple[torch.nn.Parameter, Any]] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self._shared_grads = list(shared_grads)

    def step(self, *args, **kwargs):  # noqa: D401 - same contract as torch's step
        out = super().step(*args, **kwargs)
        if self._has_backward:
            self.sync_shared_grads()
        return out

    def sync_shared_grads(self) -> None:
        """All-reduce (sum) the gradients of tied parameters over the ranks that hold them."""
        for p, grp in self._shared_grads:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=grp)


def example_inputs_from_gm(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """Zero tensors shaped like ``gm``'s placeholders (from ``node.meta['val']``).

    Zeros are valid indices for embeddings, so they are safe example inputs for shape
    inference of token-id models.

    Raises
    ------
    InputError
        If a placeholder has no recorded tensor value.
    """
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise InputError(
                f"placeholder {n.name!r} has no tensor metadata (node.meta['val']); pass "
                f"example_microbatch_inputs explicitly"
            )
        out.append(torch.zeros(tuple(int(d) for d in v.shape), dtype=v.dtype))
    return tuple(out)


def _example_io(staged: StagedProgram, stage: int, mb_inputs: Sequence[Any]):
    """Example (inputs, outputs, split-backward-blind parameters) of ``stage`` for one micro-batch.

    Inputs and outputs carry the right ``requires_grad``. The third result names the
    parameters whose gradient torch's split backward (I then W) would silently drop or truncate:
    on a stage other than the first, ``stage_backward_input`` only keeps the autograd nodes where
    a parameter's path meets a path from a grad-requiring stage input, and W back-propagates from
    those nodes only. A gradient path from a stage output to a parameter that meets no input path
    (a decoder embedding of token ids received from the previous stage; T5's relative position
    bias, computed from positions and sent on to the next stage) is lost. Such stages must run
    full backwards.
    """
    spec = staged.stages[stage]
    with torch.enable_grad():
        x = staged.stage_inputs(stage, *mb_inputs)
        x = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in x)
        out = spec.module(*x)
        outs = out if isinstance(out, tuple) else (out,)
        blind: list[str] = []
        if stage > 0:
            roots = [_get_grad_fn_or_grad_acc(t) for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
            in_fns = [_get_grad_fn_or_grad_acc(t) for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
            named = spec.named_parameters()
            w_fns = {fqn: _get_grad_fn_or_grad_acc(p) for fqn, p in named.items() if p.requires_grad}
            root_set = {r for r in roots if r is not None}
            rev = construct_reverse_graph(list(root_set))
            in_closure, _ = reverse_closure([f for f in in_fns if f is not None], set(), rev)
            for fqn, fn in w_fns.items():
                if fn is None or (fn not in rev and fn not in root_set):
                    continue  # parameter does not reach the outputs
                # nodes reachable from the parameter before meeting an input path: if an output
                # is among them, part of the gradient bypasses every I/W intermediate
                closure, _ = reverse_closure([fn], in_closure, rev)
                if closure & root_set:
                    blind.append(fqn)
            blind.sort()
    outs = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in outs)
    ins = tuple(t.detach() if isinstance(t, torch.Tensor) and not t.requires_grad else t for t in x)
    return ins, outs, blind


def _example_io_static(staged: StagedProgram, stage: int, mb_inputs: Sequence[Any]):
    """:func:`_example_io` without computing: the prefix runs on fake tensors (shapes only).

    Returns zero tensors with the inferred shapes, dtypes and ``requires_grad`` (all
    ``PipelineStage`` needs for static shape inference) and the split-backward-blind
    parameters. Falls back to a real run when the graph cannot run on fake tensors (e.g.
    data-dependent output shapes).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        return (tuple(int(d) for d in t.shape), t.dtype, bool(t.requires_grad))

    def real(m):
        if not isinstance(m, tuple):
            return m
        shape, dtype, rg = m
        z = torch.zeros(shape, dtype=dtype)
        return z.requires_grad_(True) if rg else z

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in mb_inputs)
            ins, outs, blind = _example_io(staged, stage, fake)
            m_in, m_out = [meta(t) for t in ins], [meta(t) for t in outs]
    except Exception as exc:  # noqa: BLE001 - any failure of fake propagation: compute for real
        logger.info("stage %d: fake-tensor shape inference failed (%s); running the prefix for real", stage, exc)
        return _example_io(staged, stage, mb_inputs)
    return tuple(real(m) for m in m_in), tuple(real(m) for m in m_out), blind


def _parse_one(a: Any, where: str) -> _Action | None:
    """One torch action string -> ``_Action`` (None for an empty string); InputError if bad."""
    if not isinstance(a, str):
        raise InputError(f"{where}: action {a!r} is not a string like '0F1' (stage, type, micro-batch)")
    try:
        return _Action.from_str(a)
    except (RuntimeError, ValueError, AttributeError) as exc:
        raise InputError(f"{where}: bad action string {a!r}: {exc}") from None


def _parse_actions(actions: Mapping[int, Sequence[str]], num_stages: int) -> dict[int, list[_Action]]:
    """Parse and check per-rank action strings; an empty string (an idle step) is skipped.

    Raises
    ------
    InputError
        Naming rank and step for an action that is not a string, does not parse, is not a
        compute action or is for another stage.
    """
    parsed: dict[int, list[_Action]] = {}
    for r in sorted(actions):
        lst = []
        for step, a in enumerate(actions[r]):
            where = f"rank {r}, step {step}"
            act = _parse_one(a, where)
            if act is None:
                continue
            if act.computation_type.value not in ("F", "B", "I", "W"):
                raise InputError(f"{where}: action {a!r} is not a compute action (F, B, I, W)")
            if act.stage_index != r:
                raise InputError(
                    f"{where}: action {a!r} is for stage {act.stage_index}; fxpipe runs one stage per "
                    f"rank (stage s on rank s)"
                )
            if not 0 <= act.stage_index < num_stages:
                raise InputError(f"{where}: action {a!r} names a stage outside 0..{num_stages - 1}")
            lst.append(act)
        parsed[int(r)] = lst
    return parsed


def _shared_param_groups(staged: StagedProgram, stage_index: int, group, module: torch.nn.Module):
    """Create (collectively, on every rank) one process group per set of ranks sharing parameters."""
    sets: dict[tuple[int, ...], list[str]] = {}
    for fqn, stages in sorted(staged.shared_params.items()):
        sets.setdefault(tuple(sorted(stages)), []).append(fqn)
    result = []
    spec = staged.stages[stage_index]
    for ranks, fqns in sorted(sets.items()):
        global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
        grp = dist.new_group(ranks=global_ranks)
        if stage_index in ranks:
            for fqn in fqns:
                result.append((module.get_parameter(spec.param_targets[fqn]), grp))
    return result


def build_rank(
    staged: StagedProgram,
    rank: int,
    actions: Mapping[int, Sequence[str]],
    *,
    num_microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Sequence[Any] | None = None,
    fused_backward: bool = False,
) -> tuple[PipelineStage, FxpipeScheduleRuntime]:
    """This rank's ``PipelineStage`` and a schedule runtime loaded with the per-rank actions.

    Must be called on every rank of ``group`` (it creates process groups for tied parameters
    collectively), after ``torch.distributed.init_process_group``.

    Parameters
    ----------
    staged : StagedProgram
        From :func:`fxpipe.codegen.split.split_stages`, built identically on every rank.
    rank : int
        This process's rank in ``group`` (= its stage index).
    actions : Mapping[int, Sequence[str]]
        Per-rank compute actions (``"0F1"``, ``"1I0"``, ``"1W0"``, ``"2B3"``) for *all* ranks,
        e.g. from :func:`actions_from_orders`.
    num_microbatches : int
        Micro-batches per step.
    loss_fn : callable(output, target) -> scalar tensor, or None
        Applied to every micro-batch's output on the last stage; ``None`` = forward only.
    group : ProcessGroup, optional
        Pipeline group (default: world).
    device : str or torch.device
        Device of this stage.
    example_microbatch_inputs : sequence of tensors
        One micro-batch of model inputs, used to infer the shapes, dtypes and requires_grad of
        every tensor crossing a stage (static shape inference, no P2P metadata exchange). The
        stages before this rank run on fake tensors (no compute, no activation memory).
    fused_backward : bool
        Fallback: run full backwards instead of split backward-input / backward-weight.

    Returns
    -------
    (PipelineStage, FxpipeScheduleRuntime)
        ``schedule.step(*inputs, target=..., losses=[...])`` runs one training step; pass
        model inputs on rank 0 and the target on the last rank.

    Raises
    ------
    InputError
        On malformed actions, a rank outside the pipeline, or a schedule torch rejects (the
        message names rank, stage and micro-batch).
    """
    S = staged.num_stages
    world = dist.get_world_size(group)
    if world != S:
        raise InputError(f"the pipeline has {S} stages but the process group has {world} ranks; one stage per rank")
    if not 0 <= rank < S:
        raise InputError(f"rank must lie in 0..{S - 1}, got {rank}")
    if sorted(int(r) for r in actions) != list(range(S)):
        raise InputError(f"actions must list every rank 0..{S - 1}, got {sorted(actions)}")
    acts = {int(r): list(v) for r, v in actions.items()}
    parsed = _parse_actions(acts, S)  # validate before anything reads the actions
    if fused_backward:
        acts = fuse_backward(acts)
        parsed = _parse_actions(acts, S)
    mb = example_microbatch_inputs
    if mb is None:
        raise InputError("example_microbatch_inputs is required (one micro-batch of model inputs)")
    ins, outs, blind = _example_io_static(staged, rank, tuple(mb))
    fused_here = False
    if blind and any(a.computation_type.value == "I" for a in parsed[rank]):
        # Split backward would drop these parameters' gradients: run full backwards on this
        # rank. Other ranks' communication is unaffected (B sends/receives exactly like I).
        logger.warning(
            "stage %d: split backward (I/W) cannot compute gradients of %s (their paths do not meet "
            "a grad-requiring stage input); running full backwards on this stage", rank, blind,
        )
        acts[rank] = fuse_backward({rank: acts[rank]})[rank]
        fused_here = True
        parsed = _parse_actions(acts, S)
    dev = torch.device(device)
    spec = staged.stages[rank]
    module = spec.module.to(dev)
    ins = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in ins)
    outs = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in outs)
    for name, t in zip(spec.input_names, ins):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"stage {rank} input {name!r} is a {type(t).__name__}; only tensors can cross stages")
    stage = PipelineStage(
        module,
        stage_index=rank,
        num_stages=S,
        device=dev,
        input_args=ins,
        output_args=outs if len(outs) > 1 else outs[0],
        group=group,
    )
    shared = _shared_param_groups(staged, rank, group, module)
    sched = FxpipeScheduleRuntime([stage], num_microbatches, loss_fn=loss_fn, scale_grads=True, shared_grads=shared)
    sched.pipeline_order = {r: list(v) for r, v in parsed.items()}
    sched.fxpipe_fused_full_backward = fused_here or fused_backward
    sched.fxpipe_actions = {r: [str(a) for a in v] for r, v in parsed.items()}
    try:
        sched._prepare_schedule_with_comms({r: list(v) for r, v in parsed.items()})
    except AssertionError as exc:
        raise InputError(f"torch rejected the schedule on rank {rank}: {exc}") from None
    return stage, sched


def build_pipeline_rank(
    gm: torch.fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
    rank: int,
    orders: Mapping[int, Sequence[tuple[str, int]]] | Any,
    *,
    num_microbatches: int,
    loss_fn: Callable | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Sequence[Any] | None = None,
    fuse: bool = True,
    fused_backward: bool = False,
) -> tuple[PipelineStage, FxpipeScheduleRuntime]:
    """Split ``gm``, lower the orders and build this rank's stage and runtime (one call).

    ``orders`` is ``{stage: [(type, microbatch), ...]}`` or an ``fxpipe.ir.Schedule`` (converted
    with :func:`orders_from_schedule`). See :func:`split_stages`, :func:`actions_from_orders`
    and :func:`build_rank` for the other parameters and errors. Example inputs default to
    zeros shaped like ``gm``'s placeholders (``gm`` must have been captured with one
    micro-batch).
    """
    if not isinstance(orders, Mapping):
        orders = orders_from_schedule(orders, num_stages)
    staged = split_stages(gm, stage_of, num_stages)
    actions = actions_from_orders(orders, num_stages, num_microbatches=num_microbatches, fuse=fuse)
    if example_microbatch_inputs is None:
        example_microbatch_inputs = example_inputs_from_gm(gm)
    return build_rank(
        staged,
        rank,
        actions,
        num_microbatches=num_microbatches,
        loss_fn=loss_fn,
        group=group,
        device=device,
        example_microbatch_inputs=example_microbatch_inputs,
        fused_backward=fused_backward,
    )
