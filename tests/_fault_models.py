"""Models that fail on purpose inside a pipeline stage (tests/test_faults.py).

Picklable at module level (the spawned gloo ranks import this module). The faults happen only
when the stage runs on real tensors: ``torch.export`` captures the models through the fake
kernels of the custom ops, so planning and capture succeed and the fault shows up in training.
"""

from __future__ import annotations

import os
import signal
import time

import torch

BATCH = 8
WIDTH = 16
MICROBATCHES = 2


@torch.library.custom_op("fxpipe_faults::reject", mutates_args=())
def reject(x: torch.Tensor) -> torch.Tensor:
    """The user's own check: raises a ValueError on real data."""
    raise ValueError("activation rejected by the user's check (on purpose)")


@reject.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxpipe_faults::stall", mutates_args=())
def stall(x: torch.Tensor) -> torch.Tensor:
    """Never returns (a stuck rank)."""
    while True:
        time.sleep(0.05)


@stall.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxpipe_faults::die", mutates_args=())
def die(x: torch.Tensor) -> torch.Tensor:
    """The process is killed (out-of-memory killer, a node failure)."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return x.clone()


@die.register_fake
def _(x):
    return torch.empty_like(x)


class Faulty(torch.nn.Module):
    """Four Linear layers with the fault ``kind`` between the third and the fourth.

    ``kind``: ``"reject"`` (the user's check raises ValueError), ``"index"`` (an embedding
    lookup out of range at run time: an aten op fails), ``"stall"`` (never returns), ``"die"``
    (the process is killed).
    """

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)
        self.c = torch.nn.Linear(WIDTH, WIDTH)
        self.emb = torch.nn.Embedding(4, WIDTH)
        self.d = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, ids):
        h = self.c(self.b(torch.relu(self.a(x))))
        if self.kind == "index":
            h = h + self.emb(ids)
        else:
            h = getattr(torch.ops.fxpipe_faults, self.kind)(h)
        return self.d(torch.relu(h))


class FaultyFactory:
    """``make_model`` of :meth:`fxpipe.plan.Plan.train_local` (picklable): the model and a full batch."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self):
        torch.manual_seed(0)
        return Faulty(self.kind), self.batch(0)[0]

    def batch(self, step: int):
        """Step ``step``'s batch, with ids in range (what the model is captured with)."""
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, WIDTH, generator=g)
        ids = torch.zeros(BATCH, dtype=torch.long)
        return (x, ids), torch.zeros(BATCH, WIDTH)


class FaultyBatch:
    """``make_batch`` of :meth:`fxpipe.plan.Plan.train_local`: ids out of range (7 >= 4)."""

    def __call__(self, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(BATCH, WIDTH, generator=g), torch.full((BATCH,), 7, dtype=torch.long)), torch.zeros(BATCH, WIDTH)


def stall_model():
    """``fxpipe plan --model _fault_models:stall_model``: the stalling model and one micro-batch, ``(model, args, kwargs)``."""
    model, inputs = FaultyFactory("stall")()
    return model, tuple(t[: BATCH // MICROBATCHES] for t in inputs), {}
