"""Exceptions raised by fxpipe.

Every error a user can cause derives from :class:`FxpipeError`; its message says what is
wrong and what to do. The CLI turns these into a one-line message on stderr and exit code 2.
"""

from __future__ import annotations


class FxpipeError(Exception):
    """Base class of every user-facing fxpipe error."""


class InputError(FxpipeError, ValueError):
    """Bad input: a malformed graph or problem file, an out-of-range argument, a cycle."""


class InfeasibleError(FxpipeError):
    """No solution exists under the given constraints (memory capacity, device count).

    The figures behind the message, where the raiser knows them (``None`` otherwise):

    Attributes
    ----------
    overflow_bytes : float or None
        By how much the tightest device or stage is over its usable memory.
    required_capacity_bytes : float or None
        The device memory the best partition ignoring memory would need.
    stage : int or None
        The stage (or device) that overflows.
    min_devices : int or None
        The smallest device count that fits (``None``: none up to the searched maximum).
    remedies : dict[str, str]
        What would help, keyed ``"devices"``, ``"offload"``, ``"recompute"``, ``"zero"``.
    tried : dict
        What the schedule search tried (``schedule="auto"``).
    """

    def __init__(self, message: str = "", *, overflow_bytes: float | None = None,
                 required_capacity_bytes: float | None = None, stage: int | None = None,
                 min_devices: int | None = None, remedies: dict | None = None, tried: dict | None = None):
        super().__init__(message)
        self.overflow_bytes = overflow_bytes
        self.required_capacity_bytes = required_capacity_bytes
        self.stage = stage
        self.min_devices = min_devices
        self.remedies = dict(remedies) if remedies else {}
        self.tried = dict(tried) if tried else {}


class CaptureError(FxpipeError):
    """The model could not be captured with torch.export (the message names the node)."""


class SolverError(FxpipeError):
    """A MILP/MIP solver failed in a way that is not a time-out (time-outs return results)."""


class MissingDependencyError(FxpipeError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class DataDependentCutError(InfeasibleError, InputError):
    """A tensor whose size depends on the data (``x[mask]``, ``nonzero``, ``unique``, ...) would
    cross a pipeline stage boundary; the message names the op, the user's source line and what
    to do. An :class:`InfeasibleError` when no partition into the requested stages avoids it,
    an :class:`InputError` when given stages (a pinned ``stage_of``) cut it."""


class TrainingError(FxpipeError, RuntimeError):
    """A training step produced a value it must not go on with: a loss that is not finite (the
    message names the step, the stage and the micro-batch), or copies of a tied parameter on
    several ranks whose gradients or values disagree (the message names the parameter). Raised
    by the pipeline runtime (``schedule.step``) on the rank that sees it."""


class FxpipeWarning(UserWarning):
    """Base class of fxpipe's warnings. ``fxpipe.compile`` records those it raises while making a
    plan in the plan (``plan.options["warnings"]``, :meth:`fxpipe.plan.Plan.all_warnings`), so the
    summary and ``fxpipe plan --json`` carry them, as well as warning them."""


class PlanWarning(FxpipeWarning):
    """A plan that runs but wastes devices (stages with almost no work, fewer micro-batches than
    devices); the message says what would be better. ``fxpipe.compile`` warns with it and
    ``Plan.summary()`` repeats it (``Plan.waste_warnings()``)."""


class WorkerError(FxpipeError, RuntimeError):
    """A pipeline worker process failed (:func:`fxpipe.codegen.launch.spawn_train_many`).

    The message leads with the first real failure: the rank, its stages, the action or phase it
    was running and the cause (exception type and message), then that rank's traceback; the
    secondary failures of the other ranks (a closed connection to the failed peer) follow in one
    line each.

    Attributes
    ----------
    rank : int or None
        Pipeline rank that failed first.
    stages : tuple[int, ...]
        Stages of that rank (the failing action's stage first when known).
    action : str or None
        The schedule action it was running (torch's text form, e.g. ``"1F3"``), if any.
    phase : str or None
        What the worker was doing (``"capturing the model"``, ``"training step 2"``, ...).
    cause_type, cause : str or None
        Type name and message of the root cause: the worker's exception, or the exception it was
        raised from (``raise ... from``) when a wrapper (torch's "failed to run forward") hid it.
    microbatch : int or None
        The micro-batch of the failing action, if any.
    frame : str or None
        Where in the model's code: ``"File \"model.py\", line 12, in forward: h = self.attn(x)"``,
        the source line of the graph node that raised (``node.meta["stack_trace"]``) or the
        innermost frame of the user's own code in the cause's traceback.
    op : str or None
        The graph node and its operator that raised (``"embedding (aten.embedding.default)"``).
    summary : str
        The message without the traceback (what the CLI prints).
    """

    def __init__(self, message: str, *, rank=None, stages=(), action=None, phase=None, cause_type=None,
                 cause=None, summary: str | None = None, microbatch=None, frame=None, op=None):
        super().__init__(message)
        self.summary = summary if summary is not None else message
        self.rank = rank
        self.stages = tuple(stages)
        self.action = action
        self.phase = phase
        self.cause_type = cause_type
        self.cause = cause
        self.microbatch = microbatch
        self.frame = frame
        self.op = op


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Ranks that did not finish in time, or a rank stuck in one schedule action
    (:func:`fxpipe.launcher.launch`'s ``timeout_s`` / ``action_timeout_s``).

    A :class:`WorkerError` whose ``rank``, ``action``, ``phase`` and ``stages`` name the rank that
    is late (from the ranks' heartbeats: what each was doing and since when); also a
    ``TimeoutError`` (an ``OSError``) for callers that catch time-outs. ``idle_s`` is how long
    that rank had made no progress (seconds).
    """

    def __init__(self, message: str, *, idle_s: float | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.idle_s = idle_s
