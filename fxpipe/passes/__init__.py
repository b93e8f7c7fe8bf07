"""fx side of fxpipe: capture (torch.export), cost annotation, OpGraph export."""

from fxpipe.passes.annotate import COST_KEY, AnnotateCosts, annotate_costs
from fxpipe.passes.capture import Captured, capture
from fxpipe.passes.to_opgraph import TracedModel, to_opgraph, trace_model

__all__ = ["COST_KEY", "AnnotateCosts", "annotate_costs", "Captured", "capture", "TracedModel",
           "to_opgraph", "trace_model"]
