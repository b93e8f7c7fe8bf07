"""The built-in calibration suite: transformer and conv blocks at several sizes.

:func:`run_suite` captures each block and profiles it (:func:`fxpipe.cost.profile.profile_graph`),
so that ``hardware="measured"`` can calibrate a device before any model was profiled on it;
:func:`measured_hardware` is that spec (what :func:`fxpipe.cost.hardware.get_hardware` returns
for ``"measured"``).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from fxpipe.cost.database import CostDatabase, default_db_path
from fxpipe.cost.measure import _with_device_memory, base_hardware, device_info, measured_profile, profile_graph
from fxpipe.cost.specs import HardwareSpec
from fxpipe.passes.capture import capture

__all__ = ["SUITE", "SUITE_QUICK", "measured_hardware", "run_suite"]

class _SuiteTransformer(torch.nn.Module):
    """A pre-norm transformer block with embedding and head: the ops of decoder LMs."""

    def __init__(self, d: int, heads: int, vocab: int, ff: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, ff)
        self.fc2 = torch.nn.Linear(ff, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.heads = heads

    def forward(self, ids):
        b, s = ids.shape
        x = self.emb(ids)
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        y2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + y2 * 0.5
        h = self.ln2(x)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        x = x + torch.nn.functional.silu(x) * torch.tanh(x)
        return self.head(x)


class _SuiteConv(torch.nn.Module):
    """Conv / group-norm / up-sampling ops of a UNet level."""

    def __init__(self, ch: int):
        super().__init__()
        self.c1 = torch.nn.Conv2d(ch, ch, 3, padding=1)
        self.n1 = torch.nn.GroupNorm(min(8, ch), ch)
        self.down = torch.nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.c2 = torch.nn.Conv2d(2 * ch, ch, 1)

    def forward(self, x):
        h = torch.nn.functional.silu(self.n1(self.c1(x)))
        d = torch.relu(self.down(h))
        u = self.up(d)
        u2 = torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(h, 2), scale_factor=2.0, mode="nearest")
        return self.c2(torch.cat([u + u2, x], dim=1))


#: (kind, sizes) of the built-in suite: transformer (d_model, heads, seq, batch) and conv (channels, side, batch).
SUITE = (
    ("transformer", (64, 2, 32, 1)), ("transformer", (128, 4, 64, 1)), ("transformer", (256, 4, 64, 2)),
    ("transformer", (384, 6, 128, 1)), ("transformer", (512, 8, 128, 2)),
    ("conv", (8, 32, 1)), ("conv", (16, 32, 2)), ("conv", (32, 16, 2)), ("conv", (64, 16, 1)),
)
SUITE_QUICK = (("transformer", (32, 2, 16, 1)), ("transformer", (64, 2, 32, 1)), ("conv", (8, 16, 1)), ("conv", (16, 8, 1)))


def _suite_model(kind: str, size: tuple) -> tuple[torch.nn.Module, tuple]:
    g = torch.Generator().manual_seed(0)
    if kind == "transformer":
        d, heads, seq, batch = size
        vocab = 4 * d
        return _SuiteTransformer(d, heads, vocab, 4 * d), (torch.randint(0, vocab, (batch, seq), generator=g),)
    ch, side, batch = size
    return _SuiteConv(ch), (torch.rand(batch, ch, side, side, generator=g),)


def run_suite(db: CostDatabase | str | os.PathLike | None = None, *, device: str | torch.device | None = None,
              threads: int | None = None, quick: bool = False, progress: bool = False, **opts: Any) -> list[str]:
    """Profile the built-in calibration suite (transformer and conv blocks at several sizes).

    Returns
    -------
    list[str]
        The op keys the suite covers (measured now or found in the database).
    """
    keys: list[str] = []
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    suite = SUITE_QUICK if quick else SUITE
    it: Iterable = suite
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(suite, desc="calibration suite", unit="model")
    for kind, size in it:
        with torch.random.fork_rng(devices=[]):
            model, args = _suite_model(kind, size)
        cap = capture(model, args)
        rep = profile_graph(cap.gm, db=db, device=device, threads=threads, example_inputs=(args, {}), save=False, **opts)
        keys.extend(rep.keys.values())
        if rep.interrupted:
            break
    db.save()
    return sorted(set(keys))


def measured_hardware(db: CostDatabase | str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                      threads: int | None = None, min_measurements: int = 20, progress: bool = True) -> HardwareSpec:
    """The spec of this process's device, calibrated from measured op times (``hardware="measured"``).

    If the database holds fewer than ``min_measurements`` successful measurements of this
    device (name, torch version, thread count), the built-in suite (:func:`run_suite`) is
    profiled first and stored.

    Returns
    -------
    HardwareSpec
        Named ``"measured"``; ``.profile`` holds the :class:`CostProfile`; ``memory_bytes`` is
        the device's memory read from the machine (:func:`device_memory_bytes`).
    """
    info = device_info(device, threads)
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    base = base_hardware(info)
    usable = [m for m in db.entries(info).values() if m.ok and m.roofline_spec == base.name]
    if len(usable) < min_measurements:
        run_suite(db, device=device, threads=info.threads, progress=progress)
    # the capacity is this machine's memory, not the roofline base's datasheet figure
    return _with_device_memory(measured_profile(db, device=device, threads=info.threads, name="measured").hardware(),
                               device)
