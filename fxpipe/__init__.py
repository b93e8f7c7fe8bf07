"""fxpipe: automatic, certified pipeline parallelism for PyTorch models."""

__version__ = "0.1.0"
