"""Workers of tests/test_recv_buffers.py (imported by name in the spawned ranks)."""

from __future__ import annotations


class ReturnsHidden:
    """A 4-layer MLP returning its output and a hidden state the last stage receives unchanged."""

    @staticmethod
    def make():
        import torch
        import torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

            def forward(self, x):
                h = torch.relu(self.a(x))
                g = torch.tanh(self.b(h))
                return self.d(torch.relu(self.c(g))), h

        torch.manual_seed(0)
        return M()


def step_outputs(ctx, plan_path: str) -> dict:
    """One training step of the plan on this rank: the merged outputs' difference from the model's."""
    import torch

    import fxpipe

    plan = fxpipe.load_plan(plan_path)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    _, sched = plan.build(ctx.rank, model=ReturnsHidden.make(), args=(x[:2],), kwargs={},
                          loss_fn=lambda out, t: ((out[0] - t) ** 2).mean())
    out = sched.step(x, target=torch.zeros(8, 8), losses=[])
    if out is None:
        return {}
    # the reference runs the same micro-batches (rows 2j, 2j+1): a matmul over 8 rows may round
    # differently from four over 2 (the CPU's kernels depend on the shape), so equality stays exact
    model = ReturnsHidden.make()
    parts = [model(x[i:i + 2]) for i in range(0, 8, 2)]
    ref = tuple(torch.cat([p[k] for p in parts]) for k in range(2))
    return {"y": float((out[0] - ref[0]).abs().max()), "h": float((out[1] - ref[1]).abs().max()),
            "buffers": [st.fxpipe_recv_buffers for st in sched.stages]}
