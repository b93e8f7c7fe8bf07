"""A tiny model with boolean-mask indexing (``x[mask]``) in the middle: the rows kept, and so
the size of the masked tensor, depend on the data (issue 17, item 3).

Everything here is picklable at module level (used by spawned gloo workers).
"""

from __future__ import annotations

import torch

D = 16
BATCH = 16
MICROBATCHES = 4


class MaskedMLP(torch.nn.Module):
    """``h = a(x)``; rows of ``h`` whose first feature is positive go through ``b`` and ``c``
    (a data-dependent number of rows), their mean is added back to every row, ``d`` maps out."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, 4 * D)
        self.c = torch.nn.Linear(4 * D, D)
        self.d = torch.nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        mask = h[:, 0] > 0
        sel = h[mask]  # data-dependent row count
        s = self.c(torch.relu(self.b(sel)))
        pooled = s.sum(0, keepdim=True) / (mask.sum() + 1)
        return self.d(h + pooled)


class MaskedRows(torch.nn.Module):
    """Returns the rows of ``b(relu(a(x)))`` whose first feature is positive (a data-dependent count)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return h[h[:, 0] > 0]


def _x(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_masked():
    torch.manual_seed(0)
    return MaskedMLP(), (_x((BATCH, D), 1),)


def batch_masked(step: int):
    return (_x((BATCH, D), 10 + step),), _x((BATCH, D), 20 + step)
