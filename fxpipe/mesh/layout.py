"""The device mesh of a plan: its dimensions and rank order (torch-free, plain data).

A plan runs ``dp = dp_replicate * dp_shard`` identical pipelines (data-parallel replicas), each
over ``pp`` pipeline ranks of ``tp`` devices each; ``devices = pp * dp_shard * dp_replicate * tp``.
The dimension names are torchtitan's (``ParallelDims``): ``pp`` pipeline stages, ``dp_shard``
FSDP2 sharding (``torch.distributed.fsdp.fully_shard``, ZeRO-3), ``dp_replicate`` replication
(DDP-style ``replicate``; HSDP together with ``dp_shard``), ``tp`` tensor parallelism (Megatron's
column / row parallel matmuls on DTensor, Shoeybi et al. 2019; :mod:`fxpipe.mesh.tensor_parallel`).

Tensor parallelism is always the innermost dimension (torchtitan's place: its all-reduces and
all-gathers run in every layer, so its groups are consecutive ranks inside a node): the ``tp``
ranks of one pipeline rank of one replica are consecutive, ``rank = outer_rank * tp + tp_index``,
where ``outer_rank`` numbers the ``(pp, dp_shard, dp_replicate)`` grid in the rank order below.
A mesh dict leaves ``tp`` out when it is 1 (every mesh saved before tensor parallelism).

Rank mapping (one function, :func:`rank_coords`, used by the runtime and the docs): the ranks
form a row-major grid over the dimensions in a *rank order*, outermost first. The default,
:data:`MESH_DIMS` = ``("dp_replicate", "dp_shard", "pp")`` (what every plan without a
``rank_order`` means), puts the pipeline rank innermost::

    rank = (dp_replicate_index * dp_shard + dp_shard_index) * pp + pp_rank

so the ``pp`` consecutive ranks ``r * pp .. r * pp + pp - 1`` form data-parallel replica ``r``
(``replica = dp_replicate_index * dp_shard + dp_shard_index``), and a pure pipeline
(``dp = 1``) keeps rank = pipeline rank. torchtitan's order ``("pp", "dp_replicate",
"dp_shard")`` puts the pipeline rank outermost instead (``rank = pp_rank * dp + replica``), so
the data-parallel groups are consecutive ranks and stay inside a node, where the per-step FSDP
collectives are cheap; the pipeline's point-to-point sends then cross nodes.
:data:`RANK_ORDERS` lists the orders fxpipe runs (``dp_replicate`` always outside ``dp_shard``:
HSDP's ``(dp_replicate, dp_shard)`` sub-mesh must be sliced in the mesh's own order);
``mesh={"pp": 2, "dp_shard": 8, "order": ["pp", "dp_replicate", "dp_shard"]}`` pins one, and
the mesh search (:mod:`fxpipe.mesh.search`) picks the order with the smaller predicted step on
the hardware's :class:`~fxpipe.mesh.costs.Topology`. A rank order names the three outer
dimensions; ``"tp"`` may close it (``["pp", "dp_shard", "tp"]``) and nowhere else.

``microbatches`` of a mesh plan is the global number of micro-batches per optimizer step;
every replica runs ``microbatches // dp`` of them (:func:`microbatches_per_replica`) on its
slice of the global batch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

from fxpipe.errors import InputError

__all__ = [
    "MESH_DIMS",
    "RANK_ORDERS",
    "normalize_rank_order",
    "mesh_rank_order",
    "mesh_degrees",
    "format_rank_order",
    "dim_span",
    "normalize_mesh",
    "pure_pipeline",
    "mesh_dp",
    "is_pure_pipeline",
    "microbatches_per_replica",
    "rank_coords",
    "rank_of",
    "parse_mesh",
    "format_mesh",
    "dim_strides",
    "candidate_meshes",
    "mesh_tp",
    "TP_DIM",
]

#: Mesh dimension names in the default rank order, outermost first (pipeline rank innermost).
MESH_DIMS = ("dp_replicate", "dp_shard", "pp")

#: The rank orders fxpipe runs, outermost first: ``pp`` anywhere, ``dp_replicate`` outside ``dp_shard``;
#: tensor parallelism (:data:`TP_DIM`) is inside all of them.
RANK_ORDERS = (MESH_DIMS, ("pp", "dp_replicate", "dp_shard"), ("dp_replicate", "pp", "dp_shard"))

#: The tensor-parallel dimension: always innermost (consecutive ranks, inside a node).
TP_DIM = "tp"

#: Every degree of a mesh dict, in display order (``tp`` innermost).
_DEGREES = ("pp", "dp_shard", "dp_replicate", TP_DIM)


def normalize_rank_order(order: Any = None) -> tuple[str, str, str]:
    """A rank order as a tuple of the three dimension names, outermost first.

    Parameters
    ----------
    order : sequence of str, str or None
        ``["pp", "dp_replicate", "dp_shard"]``, the text ``"pp/dp_replicate/dp_shard"`` (or
        comma separated), or None for the default :data:`MESH_DIMS`. Dimensions left out are
        placed outermost in their default order (``["pp", "dp_shard"]`` means ``("dp_replicate",
        "pp", "dp_shard")``).

    Raises
    ------
    InputError
        For an unknown or repeated name, or ``dp_shard`` outside ``dp_replicate`` (HSDP slices
        the ``(dp_replicate, dp_shard)`` sub-mesh in the mesh's order).
    """
    if order is None:
        return MESH_DIMS
    if isinstance(order, str):
        order = [t.strip() for t in order.replace("/", ",").split(",") if t.strip()]
    try:
        names = [str(n) for n in order]
    except TypeError:
        raise InputError(f"mesh order must be a list of dimension names such as ['pp', 'dp_replicate', 'dp_shard'], "
                         f"got {order!r}") from None
    if TP_DIM in names:  # tensor parallelism is always innermost: it may only close the order
        if names.index(TP_DIM) != len(names) - 1 or names.count(TP_DIM) > 1:
            raise InputError(f"mesh order {names}: tp is always the innermost dimension (consecutive ranks inside a "
                             "node); name it last or leave it out")
        names = names[:-1]
    bad = sorted({n for n in names if n not in MESH_DIMS})
    if bad or len(set(names)) != len(names):
        raise InputError(f"mesh order {names}: {'unknown name(s) ' + str(bad) if bad else 'a name repeated'}; "
                         f"name each of {list(MESH_DIMS)} once, outermost first")
    full = tuple([d for d in MESH_DIMS if d not in names] + names)
    if full not in RANK_ORDERS:
        raise InputError(f"mesh order {list(full)}: dp_replicate must be outside dp_shard (HSDP's sub-mesh); "
                         f"use one of {[list(o) for o in RANK_ORDERS]}")
    return full


def mesh_rank_order(mesh: Any) -> tuple[str, str, str]:
    """The rank order a mesh request names under ``"order"`` (:func:`normalize_rank_order`), default :data:`MESH_DIMS`."""
    return normalize_rank_order(mesh.get("order")) if isinstance(mesh, Mapping) else MESH_DIMS


def mesh_degrees(mesh: Mapping[str, Any]) -> dict[str, int]:
    """``{"pp", "dp_shard", "dp_replicate"}`` of a mesh, plus ``"tp"`` when it is above 1 (an ``"order"``
    entry left out; missing degrees = 1)."""
    out = {d: int(mesh.get(d, 1)) for d in ("pp", "dp_shard", "dp_replicate")}
    if int(mesh.get(TP_DIM, 1)) > 1:
        out[TP_DIM] = int(mesh[TP_DIM])
    return out


def mesh_tp(mesh: Mapping[str, Any] | None) -> int:
    """The tensor-parallel degree of a mesh (1 when it names none)."""
    return 1 if not mesh else int(mesh.get(TP_DIM, 1))


def format_rank_order(order: Any = None) -> str:
    """``"pp/dp_replicate/dp_shard"`` (outermost first; tensor parallelism, always innermost, is not named)."""
    return "/".join(normalize_rank_order(order))


def _effective_order(mesh: Mapping[str, Any], order: Any = None) -> tuple[str, ...]:
    """The dimensions of degree > 1 in rank order: two orders with the same give the same rank mapping."""
    return tuple(d for d in normalize_rank_order(order) if int(mesh.get(d, 1)) > 1)


def pure_pipeline(devices: int) -> dict[str, int]:
    """The mesh of a pure pipeline over ``devices`` devices: ``{"pp": devices, "dp_shard": 1, "dp_replicate": 1}``."""
    return {"pp": int(devices), "dp_shard": 1, "dp_replicate": 1}


def normalize_mesh(mesh: Any, devices: int | None = None) -> dict[str, int]:
    """Validate a mesh and fill in missing dimensions (= 1).

    Parameters
    ----------
    mesh : Mapping[str, int], "pipeline", "auto" or None
        Degrees by torchtitan name (``"pp"``, ``"dp_shard"``, ``"dp_replicate"``, ``"tp"``);
        missing names are 1. An ``"order"`` entry (the rank order, :func:`normalize_rank_order`) is
        validated and kept. ``"pipeline"``, ``"auto"`` and None: the pure pipeline ``{"pp":
        devices}`` (a function of the degrees alone cannot search: :func:`fxpipe.compile`
        resolves its default ``"auto"`` by :func:`fxpipe.mesh.search.search_mesh` first).
    devices : int, optional
        The number of devices; the product of the degrees must equal it.

    Returns
    -------
    dict[str, int]
        ``{"pp": a, "dp_shard": b, "dp_replicate": c}`` (all three keys, this order), plus
        ``"tp"`` when it is above 1 and ``"order"`` (a tuple, outermost first) when ``mesh``
        names one.

    Raises
    ------
    InputError
        For an unknown dimension name, a degree that is not an integer >= 1, a product that is
        not ``devices``, a bad order, or ``"auto"`` without ``devices``.
    """
    if mesh is None or (isinstance(mesh, str) and mesh in ("auto", "pipeline")):
        if devices is None:
            raise InputError(f"mesh={mesh!r} needs the number of devices")
        return pure_pipeline(devices)
    if isinstance(mesh, str):
        mesh = parse_mesh(mesh)
    if not isinstance(mesh, Mapping):
        raise InputError(
            f"mesh must be 'auto', 'search', 'pipeline' or a dict of degrees such as {{'pp': 2, 'dp_shard': 2}}, "
            f"got {mesh!r}"
        )
    unknown = sorted(str(k) for k in mesh if k not in _DEGREES and k != "order")
    if unknown:
        raise InputError(f"mesh: unknown dimension(s) {unknown}; the dimensions are {list(_DEGREES)}")
    out = {}
    for name in _DEGREES:
        v = mesh.get(name, 1)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InputError(f"mesh[{name!r}] must be an integer >= 1, got {v!r}")
        v = int(v)
        if v < 1:
            raise InputError(f"mesh[{name!r}] must be an integer >= 1, got {v}")
        if name != TP_DIM or v > 1:
            out[name] = v
    if devices is not None:
        prod = math.prod(out.get(d, 1) for d in _DEGREES)
        if prod != int(devices):
            raise InputError(
                f"mesh {format_mesh(out)} has {prod} devices but devices={devices}: the product "
                "pp * dp_shard * dp_replicate * tp must equal devices"
            )
    if mesh.get("order") is not None:
        out["order"] = normalize_rank_order(mesh["order"])
    return out


def mesh_dp(mesh: Mapping[str, int]) -> int:
    """Number of data-parallel replicas: ``dp_shard * dp_replicate``."""
    return int(mesh.get("dp_shard", 1)) * int(mesh.get("dp_replicate", 1))


def is_pure_pipeline(mesh: Mapping[str, int] | None) -> bool:
    """True for None or a mesh without data parallelism."""
    return mesh is None or mesh_dp(mesh) == 1


def microbatches_per_replica(microbatches: int, mesh: Mapping[str, int]) -> int:
    """Micro-batches each data-parallel replica runs per step: ``microbatches / dp``.

    Raises
    ------
    InputError
        If ``dp_shard * dp_replicate`` does not divide ``microbatches``.
    """
    dp = mesh_dp(mesh)
    if microbatches % dp:
        raise InputError(
            f"microbatches={microbatches} (the global number per optimizer step) is not divisible by the "
            f"{dp} data-parallel replicas of mesh {format_mesh(mesh)} (dp_shard * dp_replicate): use a multiple of {dp}"
        )
    return microbatches // dp


def dim_strides(mesh: Mapping[str, Any], order: Any = None) -> dict[str, int]:
    """How many ranks apart consecutive indices of each dimension are, in the rank numbering of ``order``.

    Row-major over ``order`` (outermost first, default :data:`MESH_DIMS`) followed by ``tp``
    (always innermost, stride 1): each other dimension's stride is the product of the degrees
    inside it.
    """
    strides, step = {TP_DIM: 1}, mesh_tp(mesh)
    for d in reversed(normalize_rank_order(order)):
        strides[d] = step
        step *= int(mesh.get(d, 1))
    return strides


def dim_span(mesh: Mapping[str, Any], dim: str, order: Any = None) -> tuple[int, int]:
    """``(stride, size)`` of the groups of mesh dimension ``dim``: ``size`` ranks ``stride`` apart."""
    return dim_strides(mesh, order)[dim], int(mesh.get(dim, 1))


def rank_coords(rank: int, mesh: Mapping[str, int], order: Any = None) -> dict[str, int]:
    """Coordinates of a global rank on the mesh (see the module docstring for the layout).

    Parameters
    ----------
    rank : int
        Global rank, ``0 .. pp * dp_shard * dp_replicate * tp - 1``.
    mesh : Mapping[str, int]
        The degrees (an ``"order"`` entry is the rank order when ``order`` is None).
    order : sequence of str, optional
        The rank order, outermost first (:func:`normalize_rank_order`; default the mesh's
        ``"order"``, else :data:`MESH_DIMS`, pipeline rank innermost).

    Returns
    -------
    dict
        ``{"dp_replicate": i, "dp_shard": j, "pp": k, "replica": i * dp_shard + j, "tp": t}`` (the
        replica numbering is the same whatever the order; ``t = rank mod tp``, tensor parallelism
        being innermost).

    Raises
    ------
    InputError
        For a rank outside ``0 .. devices - 1`` or a bad order.
    """
    order = mesh_rank_order(mesh) if order is None else normalize_rank_order(order)
    ds, dr, tp = int(mesh.get("dp_shard", 1)), int(mesh.get("dp_replicate", 1)), mesh_tp(mesh)
    world = int(mesh["pp"]) * ds * dr * tp
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise InputError(f"rank must be an integer in 0..{world - 1} for mesh {format_mesh(mesh)}, got {rank!r}")
    rest, out = divmod(rank, tp)  # tp innermost
    out = {TP_DIM: out}
    for d in reversed(order):
        rest, out[d] = divmod(rest, int(mesh.get(d, 1)))
    return {"dp_replicate": out["dp_replicate"], "dp_shard": out["dp_shard"], "pp": out["pp"],
            "replica": out["dp_replicate"] * ds + out["dp_shard"], TP_DIM: out[TP_DIM]}


def rank_of(mesh: Mapping[str, int], *, pp: int, replica: int, order: Any = None, tp: int = 0) -> int:
    """The global rank of pipeline rank ``pp`` in data-parallel replica ``replica`` and tensor-parallel
    rank ``tp`` (inverse of :func:`rank_coords`).

    ``order``: the rank order (default the mesh's ``"order"``, else :data:`MESH_DIMS`).
    """
    order = mesh_rank_order(mesh) if order is None else normalize_rank_order(order)
    i, j = divmod(int(replica), int(mesh.get("dp_shard", 1)))
    strides = dim_strides(mesh, order)
    return int(pp) * strides["pp"] + j * strides["dp_shard"] + i * strides["dp_replicate"] + int(tp)


def parse_mesh(text: str) -> dict[str, int]:
    """Parse the CLI form ``"pp=4,dp_shard=8"`` or ``"pp=2,tp=2"`` (missing dimensions = 1).

    ``order=pp/dp_replicate/dp_shard`` names the rank order (outermost first,
    :func:`normalize_rank_order`).

    Raises
    ------
    InputError
        For an item that is not ``name=integer`` or an unknown name.
    """
    out: dict[str, Any] = {}
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if name == "order" and sep:
            out["order"] = value.strip().split("/")
            continue
        if not sep or not value.strip().lstrip("-").isdigit():
            raise InputError(f"mesh: {item!r} is not name=integer (example: pp=4,dp_shard=8)")
        if name in out:
            raise InputError(f"mesh: {name!r} given twice")
        out[name] = int(value)
    if not out:
        raise InputError("mesh: empty; write e.g. pp=4,dp_shard=8")
    return normalize_mesh(out)


def format_mesh(mesh: Mapping[str, int]) -> str:
    """``"pp=2 x dp_shard=2"``, ``"pp=2 x tp=2"`` (dimensions of degree 1 left out, except a lone ``pp``)."""
    parts = [f"{k}={int(mesh.get(k, 1))}" for k in _DEGREES if int(mesh.get(k, 1)) > 1]
    return " x ".join(parts) if parts else f"pp={int(mesh.get('pp', 1))}"


def candidate_meshes(devices: int, microbatches: int, *, replicate: bool = False,
                     tp_degrees: Sequence[int] = (1,)) -> list[dict[str, int]]:
    """Every mesh of ``devices`` devices whose replicas divide ``microbatches`` (pure pipeline first).

    The pinned meshes a joint search would compare: for every tensor-parallel degree ``tp`` of
    ``tp_degrees`` that divides ``devices`` (default: 1 only), ``pp * dp_shard * tp = devices`` with
    ``dp_shard | microbatches`` and, with ``replicate=True``, also every split of the
    data-parallel degree into ``dp_shard * dp_replicate``. Ordered by decreasing ``pp``, then
    increasing ``tp``; a mesh with ``tp = 1`` has no ``"tp"`` key. Which degrees a graph admits
    (its heads and widths, the node) is :func:`fxpipe.mesh.tensor_parallel.check_tensor_parallel`'s.
    """
    out = []
    for pp in range(int(devices), 0, -1):
        for tp in sorted({int(t) for t in tp_degrees}):
            if devices % (pp * tp):
                continue
            dp = devices // (pp * tp)
            if microbatches % dp:
                continue
            splits = [(dp, 1)] + ([(dp // r, r) for r in range(2, dp + 1) if dp % r == 0] if replicate else [])
            out += [{"pp": pp, "dp_shard": ds, "dp_replicate": dr, **({"tp": tp} if tp > 1 else {})}
                    for ds, dr in splits]
    return out
