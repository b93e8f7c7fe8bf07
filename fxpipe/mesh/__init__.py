"""The device mesh around the pipeline: ``pp`` x ``dp_shard`` x ``dp_replicate`` x ``tp`` (torch-free).

* :mod:`fxpipe.mesh.layout`: the mesh's dimensions (torchtitan's names), rank order and
  rank coordinates, parsing and formatting (``pp=2 x dp_shard=4``);
* :mod:`fxpipe.mesh.costs`: what a mesh costs: its links (:class:`Topology`), data-parallel
  synchronisation, the host optimizer step, the predicted step of a pipeline on the mesh;
* :mod:`fxpipe.mesh.search`: ``mesh="auto"``, the search over meshes pruned by lower bounds
  (imported on its own: it plans, so it sits above :mod:`fxpipe.planner`);
* :mod:`fxpipe.mesh.tensor_parallel`: what tensor parallelism splits at a degree ``tp`` (the
  graph's column / row regions resolved, placements, refusals, per-stage reasons) and one
  tensor-parallel rank's costs and memory (:func:`~fxpipe.mesh.tensor_parallel.tensor_parallel_graph`,
  which :func:`pipeline_graph` applies; its names are not re-exported here).

The runtime half (a rank's stages on a ``DeviceMesh``, wrapped by FSDP2 / DDP) is
:mod:`fxpipe.codegen.mesh`. Everything in ``layout`` and ``costs`` is re-exported here, so
``from fxpipe.mesh import normalize_mesh, Topology`` works.
"""

from fxpipe.mesh.costs import *  # noqa: F401,F403
from fxpipe.mesh.costs import __all__ as _costs_all
from fxpipe.mesh.layout import *  # noqa: F401,F403
from fxpipe.mesh.layout import __all__ as _layout_all

__all__ = list(_layout_all) + list(_costs_all)
