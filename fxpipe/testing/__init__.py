"""Test support: small real models, the architecture matrix and the docs check, for fxpipe's own tests and benchmarks.

Not user API: nothing here is re-exported by ``fxpipe``, and it may change with the tests it
serves. It ships inside the package (rather than under ``tests/``) because spawned gloo workers
and the benchmarks import it by module path.

* :mod:`fxpipe.testing.zoo`: small real architectures (Hugging Face ``transformers`` configs
  with random weights, no download) and hand-written DAGs that stress the runtime, as
  picklable factories (``fxpipe.testing.zoo.get("mixtral")``). Imports torch.
* :mod:`fxpipe.testing.matrix`: the architecture matrix, every zoo model x pipeline size x
  schedule planned, trained on local gloo ranks and compared with one process
  (``tests/test_arch_matrix*.py``, ``benchmarks/arch_matrix.py``).
* :mod:`fxpipe.testing.docs`: the claims of README.md and docs/ (``python -m
  fxpipe.testing.docs --check``): output blocks rerun and compared by structure, every command
  parsed, every path, link and figure checked (``tests/test_docs.py``).
* :mod:`fxpipe.testing.checkpoint_policies`: activation-checkpoint policies built by hand from a
  plan's graph (per-block segments, every-other-matmul keep sets), for the runtime's tests and
  ``benchmarks/bench_checkpoint_memory.py`` (issue 28). Torch-free.

This package's ``__init__`` imports nothing, so that importing one module does not pull in
torch or the others.
"""
