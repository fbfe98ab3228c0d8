from __future__ import annotations

import os

import pytest
import torch

# NOTE: 2 cores on CI; more threads than cores only adds contention between test processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# NOTE: an in-process DeepSpeed/DDP run leaves these in os.environ (and DeepSpeed keeps its store listening on
# MASTER_PORT): a later two-process test would reuse the port and fail with EADDRINUSE / connection refused.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE")


def pytest_collection_modifyitems(config, items):
    for item in items:  # RunIf(min_cuda_gpus=...) / RunIf(bf16_cuda=True) tests are `cuda` tests (`pytest -m cuda`)
        if any(m.kwargs.get("needs_cuda") for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


# NOTE: taken once, when the session starts: a module-scoped fixture that trains in-process (DeepSpeed sets MASTER_PORT
# and keeps its store listening there) runs before a test's own snapshot, which would then keep its values for every
# later test, and a child process started later would inherit a port that is still taken (EADDRINUSE).
_SESSION_DIST_ENV = {k: os.environ.get(k) for k in _DIST_VARS}
_SESSION_LINEAR = torch.nn.functional.linear


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Give every test the default dtype, grad mode, distributed environment and no leftover process group."""
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    dist_env = _SESSION_DIST_ENV
    linear = _SESSION_LINEAR  # NOTE: DeepSpeed ZeRO-3 patches it (its own autograd function) globally
    autocast_cache = torch.is_autocast_cache_enabled()
    matmul_precision = torch.get_float32_matmul_precision()
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.nn.functional.linear = linear
    torch.set_autocast_cache_enabled(autocast_cache)
    torch.set_float32_matmul_precision(matmul_precision)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in dist_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(params=["immediate", "deferred"])
def transfer_mode(request):
    """Run a test on the plain CPU transfers, then on the CUDA transfer logic with copies deferred (``DeferredOps``).

    Yields ``(mode, ops)``: ``ops`` lists the ``DeferredOps`` built (empty in ``"immediate"``), so a test can check
    that copies really were in flight.
    """
    from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in

    if request.param == "immediate":
        yield request.param, []
        return
    built: list[DeferredOps] = []

    def factory() -> DeferredOps:
        built.append(DeferredOps("run_ahead"))
        return built[-1]

    with cpu_stand_in(factory):
        yield request.param, built
