"""Partitioning an OpGraph into acyclic pipeline stages (no torch here).

- :mod:`~fxpipe.partition.objective`: the Contract-2 objective, :class:`Partition`, validator.
- :mod:`~fxpipe.partition.slicegraph`: optimal slicing of one topological order (numba DP,
  Archer et al. 2024 Algorithm 1).
- :mod:`~fxpipe.partition.orders`: Kahn's algorithm with priorities and structured orders.
- :mod:`~fxpipe.partition.brkga`: biased random-key genetic search over orders.
- :mod:`~fxpipe.partition.search`: :func:`partition`, the entry point (stops when its partition
  is proven optimal or stops improving).
- :mod:`~fxpipe.partition.chain`: the chain of gates of a graph; exact relay DP and the
  ``chain`` lower bound.
- :mod:`~fxpipe.partition.contract`: exact contraction of trivial ops for the order search.
- :mod:`~fxpipe.partition.colocate`: ops with data-dependent output sizes stay on their
  consumers' stage (contraction for the search, the check and its error).
- :mod:`~fxpipe.partition.memory`: the partitioner's view of fxpipe's memory model (:mod:`fxpipe.memory`).
- :mod:`~fxpipe.partition.baselines`: equal-layer, parameter-balanced, time-balanced, random-T.
- :mod:`~fxpipe.partition.loaders`: graphs of other projects (dnn-partitioning, PipeDream).
- :mod:`~fxpipe.partition.bounds`: MIP lower bounds (SCIP) and certificates.
"""

from fxpipe.partition.memory import PartitionMemory
from fxpipe.partition.objective import Partition, block_costs, validate_partition

__all__ = ["Partition", "block_costs", "validate_partition", "partition", "slice_order", "PartitionMemory", "BRKGAParams"]


def __getattr__(name):  # lazy: importing numba kernels costs time
    if name == "partition":
        from fxpipe.partition.search import partition

        return partition
    if name == "slice_order":
        from fxpipe.partition.slicegraph import slice_order

        return slice_order
    if name == "BRKGAParams":
        from fxpipe.partition.brkga import BRKGAParams

        return BRKGAParams
    raise AttributeError(f"module 'fxpipe.partition' has no attribute {name!r}")
