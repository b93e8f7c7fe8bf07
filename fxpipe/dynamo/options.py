"""Options of the ``torch.compile`` backend: ``options={...}`` of ``torch.compile(backend="fxpipe")``.

The options are the keyword arguments of :func:`fxpipe.compile` (read from its signature, so
the two never drift apart) plus what only the backend needs: where the graph runs (eager,
Inductor, the planned stages in one process, or pipelined across the ranks of a process
group), Inductor per stage, what to do at a graph break, and a report path.

No torch import here: options are validated before anything heavy happens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from fxpipe.api import compile as fx_compile
from fxpipe.errors import InputError

__all__ = ["BackendOptions", "EXECUTIONS", "PIPELINE_MODES", "GRAPH_BREAK_POLICIES", "compile_option_names",
           "valid_option_names"]

#: single-process execution of the graph Dynamo hands over
EXECUTIONS = ("eager", "inductor", "stages")
#: when to run pipelined across the ranks of a process group
PIPELINE_MODES = ("auto", "always", "never")
#: what a graph break does
GRAPH_BREAK_POLICIES = ("error", "separate")

#: arguments of fxpipe.compile that are not options (the model and its example inputs come from Dynamo)
_NOT_OPTIONS = ("model", "args", "kwargs")


def compile_option_names() -> tuple[str, ...]:
    """Keyword arguments of :func:`fxpipe.compile` accepted as backend options (its signature, in order)."""
    params = inspect.signature(fx_compile).parameters
    return tuple(p for p in params if p not in _NOT_OPTIONS)


@dataclass(frozen=True)
class BackendOptions:
    """Validated options of the fxpipe ``torch.compile`` backend.

    Attributes
    ----------
    compile_kwargs : dict
        Keyword arguments passed to :func:`fxpipe.compile` (``devices``, ``microbatches``,
        ``hardware``, ``costs``, ``objective``, ``schedule``, ``mem_limit_bytes``, ...). A missing
        ``microbatches`` becomes the largest divisor of the batch size that is at most
        :attr:`max_auto_microbatches`; a missing ``objective`` is ``"inference"`` when the graph runs
        pipelined or without gradients, else ``"training"``; a missing ``schedule`` is
        ``"gpipe"`` for inference (the forward half of GPipe is what a forward-only pipeline runs),
        else :func:`fxpipe.compile`'s default.
    execution : {"eager", "inductor", "stages"}
        How the graph runs in one process (no process group, or ``pipeline="never"``):
        ``"eager"`` (Dynamo's graph as is; the default, safe on any script), ``"inductor"`` (the
        whole graph compiled by Inductor, as ``backend="inductor"``), ``"stages"`` (the planned
        stage modules one after the other on every micro-batch: the code the ranks run, in one
        process).
    pipeline : {"auto", "always", "never"}
        ``"auto"``: run pipelined inference across the ranks when ``torch.distributed`` is
        initialised with a world size equal to ``devices`` (another world size is an error).
        ``"always"``: require such a process group. ``"never"``: always run in this process.
    compile_stages : bool
        Compile every stage module with Inductor (forward, backward-input and backward-weight
        graphs separately: :mod:`fxpipe.codegen.compiled`).
    graph_breaks : {"error", "separate"}
        ``"error"``: a graph break raises :class:`~fxpipe.errors.InputError` naming the break
        and what to do. ``"separate"``: every subgraph Dynamo hands over is planned (and
        pipelined) on its own.
    report : str or None
        Path of an HTML report (and a Markdown twin) of every plan: stage table, lower-bound
        certificates, Gantt chart. Later subgraphs of the same backend get ``-2``, ``-3`` ...
        suffixes.
    bounds_time_limit_s : float
        Time limit of each lower-bound MIP of the report.
    group : ProcessGroup or None
        Pipeline process group (default: the world).
    max_auto_microbatches : int
        Upper bound of the automatic micro-batch count.
    """

    compile_kwargs: dict = field(default_factory=dict)
    execution: str = "eager"
    pipeline: str = "auto"
    compile_stages: bool = False
    graph_breaks: str = "error"
    report: str | None = None
    bounds_time_limit_s: float = 30.0
    group: Any = None
    max_auto_microbatches: int = 8

    @property
    def devices(self) -> int:
        return int(self.compile_kwargs.get("devices", 4))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "BackendOptions":
        """Validate ``options`` (names and the values checked here; fxpipe.compile checks the rest).

        Raises
        ------
        InputError
            For an unknown option (the message lists the valid ones) or a bad value.
        """
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise InputError(f"fxpipe backend options must be a dict, got {type(options).__name__}")
        compile_names = compile_option_names()
        own = tuple(f.name for f in fields(cls) if f.name != "compile_kwargs")
        unknown = sorted(str(k) for k in options if k not in compile_names and k not in own)
        if unknown:
            raise InputError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for the fxpipe torch.compile backend; valid options: "
                f"{', '.join(valid_option_names())}"
            )
        ckw = {k: v for k, v in options.items() if k in compile_names}
        mine = {k: v for k, v in options.items() if k in own}
        out = cls(compile_kwargs=ckw, **mine)
        out._check()
        return out

    def _check(self) -> None:
        def one_of(name: str, value: Any, allowed: tuple) -> None:
            if value not in allowed:
                raise InputError(f"option {name!r} must be one of {allowed}, got {value!r}")

        one_of("execution", self.execution, EXECUTIONS)
        one_of("pipeline", self.pipeline, PIPELINE_MODES)
        one_of("graph_breaks", self.graph_breaks, GRAPH_BREAK_POLICIES)
        if not isinstance(self.compile_stages, bool):
            raise InputError(f"option 'compile_stages' must be True or False, got {self.compile_stages!r}")
        for name in ("devices", "microbatches"):
            v = self.compile_kwargs.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InputError(f"option {name!r} must be an integer >= 1, got {v!r}")
        obj = self.compile_kwargs.get("objective")
        if obj is not None:
            one_of("objective", obj, ("training", "inference"))
        if self.report is not None and not isinstance(self.report, (str,)) and not hasattr(self.report, "__fspath__"):
            raise InputError(f"option 'report' must be a file path, got {self.report!r}")
        if isinstance(self.bounds_time_limit_s, bool) or not isinstance(self.bounds_time_limit_s, (int, float)) \
                or not self.bounds_time_limit_s > 0:
            raise InputError(f"option 'bounds_time_limit_s' must be a number > 0, got {self.bounds_time_limit_s!r}")
        if isinstance(self.max_auto_microbatches, bool) or not isinstance(self.max_auto_microbatches, int) \
                or self.max_auto_microbatches < 1:
            raise InputError(f"option 'max_auto_microbatches' must be an integer >= 1, got {self.max_auto_microbatches!r}")

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data (for the plan's ``options``; the process group is named, not stored)."""
        out = {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in self.compile_kwargs.items()}
        out.update(execution=self.execution, pipeline=self.pipeline, compile_stages=self.compile_stages,
                   graph_breaks=self.graph_breaks, report=None if self.report is None else str(self.report))
        return out


def valid_option_names() -> tuple[str, ...]:
    """Every option the backend accepts: fxpipe.compile's keyword arguments, then the backend's own."""
    own = tuple(f.name for f in fields(BackendOptions) if f.name != "compile_kwargs")
    return compile_option_names() + own
