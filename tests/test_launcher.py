"""The one local process launcher (fxpipe.launcher) as the backend's run_local uses it."""

import pytest

pytest.importorskip("torch")

from fxpipe.dynamo.local import run_local  # noqa: E402
from fxpipe.errors import FxpipeError, WorkerError  # noqa: E402


def _check(message: str):
    raise ValueError(message)


def fails_on_rank_1(rank: int, world: int, message: str):
    """Rank 1 raises (a library's wrapper around the user's ValueError); rank 0 waits at a barrier
    for it and loses its connection."""
    import torch.distributed as dist

    if rank == 1:
        try:
            _check(message)
        except ValueError as exc:
            raise RuntimeError("a library failed to run the user's function") from exc
    dist.barrier()
    return rank


def test_a_failing_rank_is_named_with_its_cause():
    """The first real failure leads (rank, what it ran, the root cause under the wrapper and the
    line that raised it), as a WorkerError with its traceback; rank 0's lost connection follows in
    one line."""
    with pytest.raises(WorkerError) as info:
        run_local(fails_on_rank_1, 2, args=("boom on purpose",), timeout_s=120)
    err = info.value
    first = str(err).splitlines()[0]
    assert isinstance(err, FxpipeError) and isinstance(err, RuntimeError)
    assert first == "local worker rank 1 (running fails_on_rank_1) failed: ValueError: boom on purpose", first
    assert (err.rank, err.cause_type, err.cause, err.phase) == (1, "ValueError", "boom on purpose", "running fails_on_rank_1")
    assert "traceback of rank 1" in str(err) and "traceback" not in err.summary
    assert err.summary.splitlines()[1] == f'  raised at: File "{__file__}", line {_check.__code__.co_firstlineno + 1}, in _check: raise ValueError(message)'
    assert err.frame and "a library failed" not in err.summary
