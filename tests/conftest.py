import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def dist_single(tmp_path_factory):
    """One-process gloo group and Megatron parallel state, shared by the in-process tests."""
    from megatron_multilevel.distributed import init_distributed

    path = tmp_path_factory.mktemp("rdv") / "file"
    init_distributed(1, init_method=f"file://{path}", rank=0, world_size=1)
    yield
