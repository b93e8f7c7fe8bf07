"""SGD steps through a schedule built by ``Plan.build``: the training loop of the multi-process
test workers (``_backend_workers``, ``_meta_models``), the same steps as
:func:`fxpipe.codegen.launch.reference_train` so a test can compare with it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxpipe.codegen.interface import as_call


def sgd_steps(sched, named: dict[str, torch.Tensor], batch: Callable, steps: int, lr: float,
              to_wire: Callable[[torch.Tensor], object]) -> tuple[list[float], dict]:
    """Train ``steps`` SGD steps (learning rate ``lr``) of the parameters ``named`` (by name) of
    this rank's schedule ``sched`` on the batches ``batch(step) -> (inputs, target)``.

    Returns this rank's mean loss over the micro-batches of each step (empty unless it holds the
    last stage) and the gradients of the last step by name, each through ``to_wire`` (None where
    a parameter has none).
    """
    opt = torch.optim.SGD(list(named.values()), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        inputs, target = batch(step)
        args, kwargs = as_call(inputs)
        opt.zero_grad(set_to_none=True)
        mb_losses: list = []
        sched.step(*args, target=target, losses=mb_losses, return_outputs=False, **kwargs)
        if sched.has_last_stage:
            losses.append(sum(float(v.detach()) for v in mb_losses) / len(mb_losses))
        grads = {n: (to_wire(p.grad) if p.grad is not None else None) for n, p in named.items()}
        opt.step()
    return losses, grads
