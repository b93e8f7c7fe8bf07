"""Cost annotation pass: one :class:`~fxpipe.cost.roofline.OpCost` per fx node.

:class:`AnnotateCosts` is the roofline costing of :mod:`fxpipe.passes.costing` (what is
counted and how: see there) for a hardware given by name (:func:`fxpipe.cost.hardware.get_hardware`:
a datasheet, a shipped or measured profile), with the measured-cost hook of a profiled spec
(:class:`fxpipe.cost.measure.MeasuredCosts`).

Layering: this module sits above the cost profiler (a ``"measured"`` hardware may profile a
calibration suite, which runs :class:`~fxpipe.passes.costing.RooflineCosts`), so nothing
below it imports it.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpipe.cost.hardware import HardwareSpec, get_hardware
from fxpipe.passes.costing import COST_KEY, RooflineCosts

__all__ = ["COST_KEY", "AnnotateCosts", "annotate_costs"]


class AnnotateCosts(RooflineCosts):
    """Annotate every node of a captured ``GraphModule`` with an :class:`OpCost`.

    Parameters
    ----------
    hardware : str or HardwareSpec
        Device the costs are for (``"h100-sxm"``, ``"a100-80gb"``, ``"h200"``, ``"cpu"``).
    dtype : torch.dtype, optional
        Cost floating-point tensors as this dtype (bytes and peak FLOP/s), e.g. capture a
        float32 model on ``meta`` and cost it as ``torch.bfloat16``. Parameter bytes are
        scaled too. Default: each tensor's own dtype.
    allow_tf32 : bool
        Cost float32 matmuls at the TF32 tensor-core peak instead of the FP32 peak.
    cost_model : callable(node, OpCost) -> OpCost, optional
        Per-op hook run after the roofline costs are computed: it may replace a node's
        F/B/W times (e.g. by measured ones). Default: when ``hardware`` carries a measured
        profile (``HardwareSpec.profile``), :class:`fxpipe.cost.measure.MeasuredCosts` of it
        (measured times for profiled op signatures, calibrated roofline for the others);
        else none (pure roofline).

    Notes
    -----
    After the pass, ``node.meta["fxpipe_cost"]`` holds an :class:`OpCost` for every node
    (placeholders, get_attr and output get zero-time records). ``gm.meta["fxpipe_param_owner"]``
    maps each get_attr target of a parameter to the name of its owning node, and
    ``gm.meta["fxpipe_param_numel"]`` each owning node's name to the number of parameters it
    owns (what :mod:`fxpipe.memory` counts its bytes per parameter against).

    Raises
    ------
    InputError
        From ``requires`` if a node lacks ``meta["val"]`` (capture the model with
        :func:`fxpipe.passes.capture.capture`), or for an unknown hardware.

    References
    ----------
    Roofline: Williams et al., CACM 2009. F/B/W split: Qi et al., Zero Bubble Pipeline
    Parallelism, ICLR 2024, Section 2.
    """

    def __init__(self, hardware: str | HardwareSpec = "h100-sxm", dtype: torch.dtype | None = None,
                 *, allow_tf32: bool = False, cost_model=None):
        hw = get_hardware(hardware)
        if cost_model is None and getattr(hw, "profile", None) is not None:
            # imported here: the profiler imports fxpipe.passes.capture, whose package
            # __init__ imports this module (a module-level import would be circular at run time)
            from fxpipe.cost.measure import MeasuredCosts

            cost_model = MeasuredCosts(hw.profile, dtype)  # measured / calibrated times per op
        super().__init__(hw, dtype, allow_tf32=allow_tf32, cost_model=cost_model)


def annotate_costs(gm: torch.fx.GraphModule, hardware: str | HardwareSpec = "h100-sxm",
                   dtype: torch.dtype | None = None, **kwargs) -> torch.fx.GraphModule:
    """Functional form of :class:`AnnotateCosts`: annotate ``gm`` in place and return it."""
    AnnotateCosts(hardware, dtype, **kwargs)(gm)
    return gm
