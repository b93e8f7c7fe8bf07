"""An oracle read from a real eager run: the bytes autograd saves for the backward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_tensor_bytes(run: Callable[[], object], resident: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves while ``run()`` runs (a forward): distinct storages,
    each counted once, those of ``resident`` tensors (parameters, inputs the caller holds for
    the whole step) left out."""
    skip = {t.untyped_storage().data_ptr() for t in resident}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())
