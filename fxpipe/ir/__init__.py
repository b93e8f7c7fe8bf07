"""Plain-data intermediate representations shared by every part of fxpipe.

No torch here: these are the objects the partitioner and scheduler see (DESIGN.md,
"Data flow").

* :mod:`fxpipe.ir.opgraph`: :class:`OpGraph`, Contract 1 (``fxpipe.opgraph/1``).
* :mod:`fxpipe.ir.schedule`: :class:`ScheduleProblem` (Contract 3, ``fxpipe.schedproblem/1``)
  and the timed :class:`Schedule` / :class:`ScheduledOp` (``fxpipe.schedule/1``); the
  typed untimed IR: :class:`Action` (``"2F0"``), per-device :class:`Orders` with the
  placement, and :func:`schedule_to_orders`, the one function from a timed schedule to orders.
* :mod:`fxpipe.ir.lowering`: the typed lowering passes ``list[Action] -> list[Action]``
  (leave out O/R, fuse a B with its W into a full backward ``BW``, and back).
* :mod:`fxpipe.ir.torch_csv`: torch's action vocabulary (:data:`~fxpipe.ir.torch_csv.TORCH_TYPE`)
  and its CSV schedule format (``_load_csv`` / ``_dump_csv``), as text, without importing torch.
* Atomic JSON / text writing and JSON reading live in :mod:`fxpipe.io` and are re-exported
  here, so ``from fxpipe.ir import write_json_atomic`` keeps working.

Files are JSON, written atomically (:func:`write_json_atomic`), never pickle.
"""

from fxpipe.io import _json_default, read_json, write_json_atomic, write_text_atomic
from fxpipe.ir.opgraph import NODE_FLOAT_FIELDS, OPGRAPH_FORMAT, OpGraph
from fxpipe.ir.schedule import (
    OBJECTIVES,
    OP_TYPES,
    ORDERS_FORMAT,
    SCHEDPROBLEM_FORMAT,
    SCHEDULE_FORMAT,
    Action,
    CheckpointOption,
    Orders,
    Schedule,
    ScheduledOp,
    ScheduleProblem,
    identity_placement,
    looped_placement,
    program_order,
    schedule_to_orders,
    sort_ops,
    v_placement,
)
from fxpipe.ir.torch_csv import orders_from_torch_csv, orders_to_torch_csv

__all__ = [
    "Action",
    "CheckpointOption",
    "Orders",
    "ORDERS_FORMAT",
    "identity_placement",
    "looped_placement",
    "orders_from_torch_csv",
    "orders_to_torch_csv",
    "program_order",
    "schedule_to_orders",
    "v_placement",
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
