"""fxpipe's memory: the one memory model and its views.

* :mod:`fxpipe.memory.model`: the model itself, a leaf (plain numbers and numpy arrays; it
  imports nothing of fxpipe but :mod:`fxpipe.errors` and :mod:`fxpipe.io`): precision
  policies, ZeRO sharding, receive buffers, the reserved fraction, the activation budget,
  the memory row of every table (:data:`~fxpipe.memory.model.ROW_FIELDS`,
  :class:`~fxpipe.memory.model.MemoryRow`) and its capacity check.
* :mod:`fxpipe.memory.plan_view`: the model applied to a costed graph, its partition, the
  placement and a schedule (static state per stage, Contract 3's ``mem_limit``, the stage
  and device tables of a plan).
* :mod:`fxpipe.memory.checkpoint`: activation checkpointing (issue 28): the repeated blocks of
  a graph, each stage's menu of policies (none, per-block full / selective / budgeted,
  whole-stage) with what F keeps, what B replays and holds, and the plan's
  :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` per stage.
* :mod:`fxpipe.memory.fsdp`: per-block FSDP2 units (``MemoryModel.fsdp_units="block"``): the
  parameters each stage holds unsharded at its peak (its root unit and two blocks).
* The partitioner's view (the per-stage memory the SliceGraph DP and the bounds count) is
  :mod:`fxpipe.partition.memory`: it lives beside the partitioner, which must stay free of
  anything but plain numbers.

``from fxpipe.memory import MemoryModel`` and the other names of the model work as before;
this package imports the model only, so that the partitioner can import it without pulling
in the plan view.
"""

from fxpipe.memory.model import *  # noqa: F403 (the package's names are the model's)
from fxpipe.memory.model import __all__  # noqa: F401
