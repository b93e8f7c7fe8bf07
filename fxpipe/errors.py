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


class PlanWarning(UserWarning):
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
        Type name and message of the worker's exception.
    summary : str
        The message without the traceback (what the CLI prints).
    """

    def __init__(self, message: str, *, rank=None, stages=(), action=None, phase=None, cause_type=None,
                 cause=None, summary: str | None = None):
        super().__init__(message)
        self.summary = summary if summary is not None else message
        self.rank = rank
        self.stages = tuple(stages)
        self.action = action
        self.phase = phase
        self.cause_type = cause_type
        self.cause = cause
