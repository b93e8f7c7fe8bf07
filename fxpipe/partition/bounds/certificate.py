"""Lower-bound certificates and the certificate file (``fxpipe.certificate/1``).

A :class:`Certificate` records one method of the hierarchy: the bound it proved, the
incumbent it was compared with, SCIP's status, node count, wall time, version and the
parameters used. :func:`write_certificate` writes a self-contained JSON file (atomic) with
the graph's fingerprint, the partition, its block costs and every certificate, so that a
third party can re-score the partition with the Contract-2 objective and re-run the MIPs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, _json_default, read_json, write_json_atomic

__all__ = ["Certificate", "CERTIFICATE_FORMAT", "write_certificate", "read_certificate", "graph_fingerprint"]

CERTIFICATE_FORMAT = "fxpipe.certificate/1"


def _num(x: float | None) -> float | str | None:
    """JSON has no inf/nan: write them as strings."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _unnum(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, str):
        return float(x)
    return float(x)


@dataclass
class Certificate:
    """One lower bound of the hierarchy and how it was obtained.

    Attributes
    ----------
    method : str
        ``"simple"``, ``"chain"``, ``"lp"``, ``"bottleneck"``, ``"guess"`` or ``"exact"``.
    lower_bound : float
        Proven lower bound on the optimal bottleneck, seconds (valid for every acyclic
        partition into k blocks that meets the memory capacity, if one was given).
    primal_value : float or None
        Bottleneck of the best partition known when the report was made, seconds.
    gap : float or None
        ``(primal_value - lower_bound) / primal_value``.
    status : str
        ``"optimal"`` (the method's model was solved to optimality), ``"timelimit"``
        (the best dual bound reached in the time budget), ``"closed_form"`` (simple),
        ``"skipped"`` (a MIP not run because the partition was already proven optimal;
        the bound is the one it would have started from), ``"not_applicable"`` (chain
        with dag communication: Lemma 3.3), ``"userinterrupt"``, ...
    nodes : int
        Branch-and-bound nodes (summed over sub-MIPs for ``guess``).
    wall_time_s : float
        Wall-clock time of the method, seconds.
    solver : str
        SCIP and PySCIPOpt version (empty for ``simple``).
    params : dict
        SCIP parameters used.
    details : dict
        Method-specific facts (e.g. ``LB_j`` of every guess, model sizes).
    """

    method: str
    lower_bound: float
    primal_value: float | None = None
    gap: float | None = None
    status: str = "optimal"
    nodes: int = 0
    wall_time_s: float = 0.0
    solver: str = ""
    params: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    def with_primal(self, primal_value: float | None) -> "Certificate":
        """A copy compared against the incumbent ``primal_value``."""
        gap = None
        if primal_value is not None and math.isfinite(primal_value) and primal_value > 0:
            gap = max(0.0, (primal_value - self.lower_bound) / primal_value)
        d = asdict(self)
        d.update(primal_value=primal_value, gap=gap)
        return Certificate(**d)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (inf/nan written as strings)."""
        d = asdict(self)
        for key in ("lower_bound", "primal_value", "gap", "wall_time_s"):
            d[key] = _num(d[key])
        d["details"] = _json_safe(json.loads(json.dumps(d["details"], default=_json_default)))
        d["params"] = _json_safe(d["params"])
        return d

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Certificate":
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        InputError
            If a required key is missing.
        """
        try:
            return cls(
                method=str(doc["method"]),
                lower_bound=_unnum(doc["lower_bound"]),
                primal_value=_unnum(doc.get("primal_value")),
                gap=_unnum(doc.get("gap")),
                status=str(doc.get("status", "")),
                nodes=int(doc.get("nodes", 0)),
                wall_time_s=_unnum(doc.get("wall_time_s", 0.0)) or 0.0,
                solver=str(doc.get("solver", "")),
                params=dict(doc.get("params", {})),
                details=dict(doc.get("details", {})),
            )
        except KeyError as exc:
            raise InputError(f"certificate entry lacks the key {exc.args[0]!r}") from None


def _json_safe(obj: Any) -> Any:
    """Replace inf/nan floats anywhere in a JSON-like structure by strings."""
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def graph_fingerprint(graph: OpGraph) -> str:
    """SHA-256 of the graph's canonical Contract-1 JSON (sorted keys), hex."""
    text = json.dumps(graph.to_dict(), sort_keys=True, default=_json_default, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_certificate(path: str | os.PathLike, report, graph: OpGraph | None = None) -> Path:
    """Write a :class:`~fxpipe.partition.bounds.BoundsReport` as a certificate file.

    The file (``format: fxpipe.certificate/1``) holds the objective, comm mode, k, memory
    capacity and capacity model, the graph's name, size and SHA-256 fingerprint, the
    partition (assignment in pipeline order and its Contract-2 block costs), every
    certificate and the solver facts. Written atomically.

    Parameters
    ----------
    path : str or PathLike
    report : BoundsReport
    graph : OpGraph, optional
        Used for the fingerprint; defaults to the report's graph summary only.

    Returns
    -------
    Path
    """
    doc = report.to_certificate_dict(graph)
    doc = json.loads(json.dumps(doc, default=_json_default))
    return write_json_atomic(path, doc)


def read_certificate(path: str | os.PathLike) -> dict[str, Any]:
    """Read a certificate file; certificates come back as :class:`Certificate` objects.

    Raises
    ------
    InputError
        If the file is not an ``fxpipe.certificate/1`` document.
    """
    doc = read_json(path, "certificate file")
    if not isinstance(doc, dict) or doc.get("format") != CERTIFICATE_FORMAT:
        raise InputError(f"{str(path)!r} is not an {CERTIFICATE_FORMAT} file")
    doc = dict(doc)
    doc["certificates"] = {k: Certificate.from_dict(v) for k, v in doc.get("certificates", {}).items()}
    return doc
