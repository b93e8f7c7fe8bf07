"""What the runtime cannot run on a mesh, recorded with the captured graph (torch-free).

The mesh search (:mod:`fxpipe.mesh.search`) must offer only meshes the runtime executes. Some
limits depend on the model, not on the costs: they are found on the captured module (torch side,
:func:`fxpipe.codegen.mesh.data_parallel_limit`) when ``fxpipe.compile`` captures it, recorded in
the graph's ``meta["runtime_limits"]`` (kept in plan files) and read here by the search, which
skips every candidate such a limit rules out with the reason in its row of the candidate table.

Limits (issue 30, item 2):

``"data_parallel"``
    Why the stage modules cannot be wrapped by FSDP2 (``fully_shard`` / ``replicate``): every
    FSDP2 unit needs trainable parameters of one dtype, and fxpipe forms one unit per dtype from
    the submodules holding them (:func:`fxpipe.codegen.mesh.dtype_units`); a submodule holding
    trainable parameters of two dtypes itself cannot be split so. Rules out meshes with
    ``dp_shard * dp_replicate > 1`` and the optimizer state on the host (which wraps every stage in
    FSDP2 too, :func:`fxpipe.codegen.mesh.data_parallel_wrapper`); the pure pipeline with the
    optimizer on the device always runs.
"""

from __future__ import annotations

from typing import Any, Mapping

from fxpipe.mesh.layout import mesh_dp

__all__ = ["LIMITS_KEY", "record_runtime_limits", "runtime_limits", "mesh_runtime_limit"]

#: The key of the graph's ``meta`` that holds the limits (``{limit name: reason}``).
LIMITS_KEY = "runtime_limits"


def record_runtime_limits(graph: Any, **limits: str | None) -> None:
    """Record ``limits`` (name -> reason, None: no limit) in ``graph.meta[LIMITS_KEY]`` (in place)."""
    found = {k: str(v) for k, v in limits.items() if v}
    if found:
        graph.meta[LIMITS_KEY] = {**(graph.meta.get(LIMITS_KEY) or {}), **found}


def runtime_limits(graph: Any) -> dict[str, str]:
    """The limits recorded with ``graph`` (empty for a graph from a file or without any)."""
    found = (getattr(graph, "meta", None) or {}).get(LIMITS_KEY) or {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, Mapping) else {}


def mesh_runtime_limit(mesh: Mapping[str, int], offload_optimizer: bool, limits: Mapping[str, str]) -> str | None:
    """Why the runtime cannot run ``mesh`` (with the optimizer state on the host or not), or None.

    Parameters
    ----------
    mesh : Mapping[str, int]
        ``pp``, ``dp_shard``, ``dp_replicate``.
    offload_optimizer : bool
        The candidate keeps the optimizer state on the host (FSDP2's ``CPUOffloadPolicy``).
    limits : Mapping[str, str]
        :func:`runtime_limits` of the graph.

    Returns
    -------
    str or None
        The reason, worded for the candidate table.
    """
    why = limits.get("data_parallel")
    if why and (mesh_dp(mesh) > 1 or offload_optimizer):
        what = "data parallelism" if mesh_dp(mesh) > 1 else "the optimizer state on the host"
        return f"the runtime cannot run {what} for this model: {why}"
    return None
