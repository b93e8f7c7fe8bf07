"""Hardware specifications as data, each with the datasheet it comes from.

A :class:`HardwareSpec` holds the handful of numbers the roofline cost model
(:mod:`fxpipe.cost.roofline`) and the schedule problem need: dense peak FLOP/s per dtype,
memory bandwidth, device-to-device and host link bandwidths (per direction), memory capacity
and a per-op launch overhead. Peaks are *dense* (no 2:4 sparsity) tensor-core figures for
the SXM parts, as printed in NVIDIA's datasheets.

Units: every figure uses the decimal SI prefixes of the datasheets, ``1 GB = 1e9 bytes`` and
``1 GB/s = 1e9 bytes/s``, for bandwidth and for memory capacity alike. The capacities
(``memory_bytes``) are what CUDA exposes (``total_memory``: 85.02e9 bytes on the H100 80GB and
150.11e9 on the H200, measured by fxpipe's GPU runs), not the printed "80GB" / "141GB"
(``memory_datasheet_bytes``); plans keep a reserve of 10 % of it
(:data:`fxpipe.memory.model.DEFAULT_RESERVED_FRACTION`).

Achieved and datasheet rates: each GPU is known twice, ``"h100-sxm"`` with the achieved
efficiency of every op family and link (what predictions use) and ``"h100-sxm-datasheet"``,
the plain datasheet roofline (what bounds use); see :mod:`fxpipe.cost.specs`.

The launch overhead is not a datasheet figure: it is the usual few microseconds of CUDA
kernel launch + PyTorch eager dispatch per op, a modelling constant.

Measured hardware. A spec can carry a measured profile (``HardwareSpec.profile``, a
:class:`fxpipe.cost.calibrate.CostProfile`): op times measured on the device and per-op-class
efficiency factors of the roofline fitted to them. :func:`get_hardware` returns such a spec for

* ``"measured"``: the device of this process (CUDA if available, else CPU), calibrated from
  the measurements in the cost database (:func:`fxpipe.cost.database.default_db_path`),
  profiling a built-in suite of ops first if the database has none for this device;
* a path to an ``fxpipe.hwprofile/1`` file (e.g. one measured on an H100 and copied here);
* ``"profile:<name>"``: a profile shipped with fxpipe (``fxpipe/cost/profiles/<name>.json``,
  see :func:`list_profiles`).
"""

from __future__ import annotations

import os
from pathlib import Path

from fxpipe.cost.calibrate import load_profile
from fxpipe.cost.specs import HARDWARE, HardwareSpec, list_hardware
from fxpipe.errors import InputError

__all__ = ["HARDWARE", "HardwareSpec", "PROFILE_DIR", "get_hardware", "list_hardware", "list_profiles"]

#: Folder of the hardware profiles shipped with fxpipe (``profile:<name>``).
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def list_profiles() -> list[str]:
    """Names of the shipped hardware profiles (use as ``"profile:<name>"``)."""
    if not PROFILE_DIR.is_dir():
        return []
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def get_hardware(name: str | os.PathLike | HardwareSpec) -> HardwareSpec:
    """Look up a hardware spec by name, or load / measure one with a profile.

    Parameters
    ----------
    name : str, PathLike or HardwareSpec
        A spec name (:func:`list_hardware`); ``"measured"`` (this process's device, measured,
        see the module docstring); ``"profile:<name>"`` (a shipped profile); a path to an
        ``fxpipe.hwprofile/1`` JSON file. A :class:`HardwareSpec` is returned as is.

    Raises
    ------
    InputError
        If ``name`` is none of these; the message lists the known names and profiles. Loading
        a malformed profile raises InputError too.
    """
    if isinstance(name, HardwareSpec):
        return name
    raw = os.fspath(name) if isinstance(name, os.PathLike) else str(name)
    key = raw.strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    if key == "measured":
        from fxpipe.cost.suite import measured_hardware  # lazy: torch, imported when measuring

        return measured_hardware()
    if key.startswith("profile:"):
        stem = raw.strip()[len("profile:"):]
        path = PROFILE_DIR / f"{stem}.json"
        if not path.is_file():
            raise InputError(f"no shipped hardware profile {stem!r}; shipped profiles: {', '.join(list_profiles()) or 'none'}")
        return _load_profile_spec(path)
    if raw.endswith(".json") or os.sep in raw or Path(raw).is_file():
        return _load_profile_spec(Path(raw).expanduser())
    raise InputError(
        f"unknown hardware {raw!r}; known hardware: {', '.join(sorted(HARDWARE))}; or 'measured' (this machine), "
        f"'profile:NAME' ({', '.join(list_profiles()) or 'none shipped'}) or a path to a hardware profile JSON file"
    )


def _load_profile_spec(path: Path) -> HardwareSpec:
    return load_profile(path).hardware()
