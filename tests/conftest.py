from __future__ import annotations

import os

import pytest
import torch

# NOTE: 2 cores on CI; more threads than cores only adds contention between test processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Give every test the default dtype, seed-independent grad mode and no leftover process group."""
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
