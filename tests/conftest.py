import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture()
def single_rank_group(tmp_path):
    """A gloo process group of one rank in this process (torch's pipeline runtime needs one)."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only for the tests that ask for the group)

    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
