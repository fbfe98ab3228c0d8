"""What the package's docstring examples find without importing it (``pytest --doctest-modules lightning_lowmem``).

Every example sees ``L`` (``lightning``), ``torch``, and two builders small enough to train in a second:
``tiny_model(**kwargs)``, the demo ``CausalLMModule`` with a 2-layer, 32-wide GPT-2 (keyword arguments go to the
module), and ``tiny_data(**kwargs)``, the demo ``StdlibTextDataModule`` with 32-token sequences, 2 per batch, from
8 KB of text. Each example runs in its own temporary directory (``lightning_logs/`` and checkpoints land there), with
a fixed seed, and leaves the process as it found it: RNG, default dtype, grad mode, float32 matmul precision,
``torch.nn.functional.linear`` (DeepSpeed patches it) and environment variables (``seed_everything`` sets one).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import pytest
import torch
from _pytest.doctest import DoctestItem


def tiny_model(**kwargs: Any) -> Any:
    from lightning_lowmem.demo.module import CausalLMModule

    config = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, **kwargs.pop("config", {})}
    return CausalLMModule(config=config, **kwargs)


def tiny_data(**kwargs: Any) -> Any:
    from lightning_lowmem.demo.data import StdlibTextDataModule

    return StdlibTextDataModule(**{"seq_len": 32, "batch_size": 2, "max_bytes": 8192, **kwargs})


@functools.cache
def _deepspeed_accelerator_chosen() -> None:
    # NOTE: DeepSpeed prints "Setting accelerator to CPU" to stdout the first time it picks its accelerator; picked
    # here, outside any example, an example's output does not depend on whether it is the first to use DeepSpeed.
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator()


@pytest.fixture(autouse=True)
def _doctest_names(request: pytest.FixtureRequest) -> Any:
    if not isinstance(request.node, DoctestItem):  # NOTE: the tests under tests/ have their own conftest
        yield
        return
    _deepspeed_accelerator_chosen()
    namespace = request.getfixturevalue("doctest_namespace")
    # NOTE: lightning is imported here, not at the top: imported while pytest loads this conftest (before its log
    # capture has put a handler on the root logger) it sets `propagate=False` on its logger, and caplog then sees
    # none of Lightning's (or the package's rank_zero_info) records in the tests
    import lightning as L

    namespace.update(L=L, torch=torch, tiny_model=tiny_model, tiny_data=tiny_data)
    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    environ = dict(os.environ)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    matmul, linear = torch.get_float32_matmul_precision(), torch.nn.functional.linear
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.set_float32_matmul_precision(matmul)
    torch.nn.functional.linear = linear
    os.environ.clear()
    os.environ.update(environ)
