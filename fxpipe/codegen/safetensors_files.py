"""safetensors files: the one layer that checks them before their tensors are used.

Every reader of safetensors in fxpipe goes through here: materializing a stage from a
checkpoint (``plan.build(checkpoint=...)``, :mod:`fxpipe.codegen.materialize`), loading a
Hugging Face checkpoint folder (``fxpipe plan --hf FOLDER --run``, :mod:`fxpipe.models`) and
training-state checkpoints (:mod:`fxpipe.codegen.checkpoint`). An empty, truncated or garbage
file, or an index whose ``weight_map`` leaves its folder, raises :class:`~fxpipe.errors.InputError`
naming the file (and the key), never a bare ``SafetensorError: header too small``;
:func:`dtype_kind` is the rule by which a stored tensor may fill a model tensor (same kind:
floating, complex, integer or bool).

Source: the safetensors format (an 8-byte little-endian header length, a JSON header of
``{key: {"dtype", "shape", "data_offsets"}}``, the data), read with ``safetensors.safe_open``,
which checks that the header covers the file exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fxpipe.errors import InputError
from fxpipe.io import read_json

__all__ = ["dtype_kind", "open_safetensors", "safetensors_header", "safetensors_index"]


#: safetensors dtype codes by kind: a stored tensor must be of the kind of the tensor it fills
_SAFETENSORS_KIND = {"F64": "floating", "F32": "floating", "F16": "floating", "BF16": "floating",
                     "F8_E4M3": "floating", "F8_E5M2": "floating", "F8_E8M0": "floating", "F4": "floating",
                     "F6_E2M3": "floating", "F6_E3M2": "floating", "C64": "complex",
                     "I64": "integer", "I32": "integer", "I16": "integer", "I8": "integer", "U64": "integer",
                     "U32": "integer", "U16": "integer", "U8": "integer", "BOOL": "bool"}


def dtype_kind(dtype: torch.dtype | str) -> str:
    """``"floating"``, ``"complex"``, ``"integer"`` or ``"bool"``: a torch dtype's or a safetensors dtype code's kind.

    A checkpoint tensor fills a model tensor of the same kind only (a float16 value into a float32
    parameter is a cast; an int64 value into a float32 parameter is refused, not cast).
    """
    if isinstance(dtype, str):
        return _SAFETENSORS_KIND.get(dtype.upper(), dtype.lower())
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "integer"


def _safetensors_error(path: Path, exc: BaseException) -> InputError:
    cause = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    return InputError(
        f"safetensors file {path} cannot be read ({cause}): it is empty, truncated or not a safetensors file; "
        "write it again (save_pretrained, safetensors.torch.save_file) or download it again"
    )


def open_safetensors(path: Path):
    """``safetensors.safe_open`` on CPU; an unreadable file raises :class:`InputError` naming it."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise InputError(
            f"checkpoint {path} is a safetensors file but the safetensors package is not installed: "
            'from a checkout of fxpipe, pip install -e ".[checkpoint]"'
        ) from None
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the header is unreadable
        raise _safetensors_error(path, exc) from None


def safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of one ``.safetensors`` file, read from its header only: key -> (dtype code, shape).

    The one reader that checks a safetensors file before its tensors are used (materializing a
    stage, loading a Hugging Face checkpoint folder, a training-state checkpoint).

    Parameters
    ----------
    path : str or PathLike
        A ``.safetensors`` file.

    Returns
    -------
    dict[str, tuple[str, tuple[int, ...]]]
        Key -> (safetensors dtype code such as ``"F32"``, ``"I64"``; shape).

    Raises
    ------
    InputError
        When the file is missing, empty, truncated (its header names more bytes than it has) or not a
        safetensors file; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"safetensors file {path} does not exist (or is not a file)")
    with open_safetensors(path) as f:
        try:
            return {k: (str(f.get_slice(k).get_dtype()), tuple(int(n) for n in f.get_slice(k).get_shape()))
                    for k in f.keys()}
        except Exception as exc:  # noqa: BLE001 - a header entry safetensors cannot describe
            raise _safetensors_error(path, exc) from None


def safetensors_index(path: str | os.PathLike) -> dict[str, Path]:
    """The ``weight_map`` of a sharded safetensors checkpoint's ``*.safetensors.index.json``: key -> shard file.

    The names are checked as written (relative, not leaving the folder); a shard that is a symlink
    (a Hugging Face hub snapshot's shards link into its ``blobs`` folder) is followed when read.

    Raises
    ------
    InputError
        When the index is not JSON with a ``weight_map`` object of file names, or names a file outside
        the index's own folder (``../`` or an absolute path); the message names the index and the key.
    """
    path = Path(path)
    doc = read_json(path, "safetensors index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise InputError(f"safetensors index {path}: field 'weight_map' must be an object (tensor name -> file name), "
                         f"got {type(weight_map).__name__}")
    folder = path.parent
    out: dict[str, Path] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise InputError(f"safetensors index {path}: weight_map[{key!r}] must be a file name, got {name!r}")
        # the name, not where a symlink leads: a Hugging Face hub snapshot's shards are symlinks into ../../blobs
        norm = os.path.normpath(name)
        if os.path.isabs(norm) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
            raise InputError(f"safetensors index {path}: weight_map[{key!r}] = {name!r} points outside the index's "
                             f"folder {folder}: shard files must lie in that folder")
        out[key] = folder / norm
    return out
