"""Plain-data intermediate representations shared by every part of fxpipe.

No torch here: these are the objects the partitioner and scheduler see (DESIGN.md,
"Data flow").

* :mod:`fxpipe.ir.opgraph`: :class:`OpGraph`, Contract 1 (``fxpipe.opgraph/1``).
* :mod:`fxpipe.ir.schedule`: :class:`ScheduleProblem` (Contract 3, ``fxpipe.schedproblem/1``)
  and the timed :class:`Schedule` / :class:`ScheduledOp` (``fxpipe.schedule/1``).
* Atomic JSON / text writing and JSON reading live in :mod:`fxpipe.io` and are re-exported
  here, so ``from fxpipe.ir import write_json_atomic`` keeps working.

Files are JSON, written atomically (:func:`write_json_atomic`), never pickle.
"""

from fxpipe.io import _json_default, read_json, write_json_atomic, write_text_atomic
from fxpipe.ir.opgraph import NODE_FLOAT_FIELDS, OPGRAPH_FORMAT, OpGraph
from fxpipe.ir.schedule import (
    OBJECTIVES,
    OP_TYPES,
    SCHEDPROBLEM_FORMAT,
    SCHEDULE_FORMAT,
    Schedule,
    ScheduledOp,
    ScheduleProblem,
    sort_ops,
)

__all__ = [
    "NODE_FLOAT_FIELDS",
    "OBJECTIVES",
    "OPGRAPH_FORMAT",
    "OP_TYPES",
    "SCHEDPROBLEM_FORMAT",
    "SCHEDULE_FORMAT",
    "OpGraph",
    "Schedule",
    "ScheduledOp",
    "ScheduleProblem",
    "_json_default",
    "read_json",
    "sort_ops",
    "write_json_atomic",
    "write_text_atomic",
]
