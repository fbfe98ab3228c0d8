"""``RunIf``: skip a test, with the reason, when the machine lacks what it needs (our own; not Lightning's private one)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_lowmem.core.optional import package_available

#: the full sweep (`make test-sweep`): the extra cases of the slow tests that `make test` runs one case per cause of
SWEEP = os.environ.get("LOWMEM_SWEEP") == "1"


def RunIf(
    *,
    min_cuda_gpus: int = 0,
    bf16_cuda: bool = False,
    deepspeed: bool = False,
    bitsandbytes: bool = False,
    peft: bool = False,
    min_processes_cpus: int = 0,
    sweep: bool = False,
) -> pytest.MarkDecorator:
    """Return a ``skipif`` mark naming every unmet requirement.

    Example::

        @RunIf(min_cuda_gpus=1)
        def test_pinned_copy(): ...
    """
    reasons = []
    if min_cuda_gpus and torch.cuda.device_count() < min_cuda_gpus:
        reasons.append(f"needs {min_cuda_gpus} CUDA GPU(s), found {torch.cuda.device_count()}")
    if bf16_cuda and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        reasons.append("needs a CUDA GPU with bf16")
    if deepspeed and not package_available("deepspeed"):
        reasons.append("needs `pip install 'lightning-lowmem[deepspeed]'`")
    if bitsandbytes and not package_available("bitsandbytes"):
        reasons.append("needs `pip install 'lightning-lowmem[bnb]'`")
    if peft and not package_available("peft"):
        reasons.append("needs `pip install 'lightning-lowmem[peft]'`")
    if min_processes_cpus and (os.cpu_count() or 1) < min_processes_cpus:
        reasons.append(f"needs {min_processes_cpus} CPU cores")
    if sweep and not SWEEP:
        reasons.append("a case of the full sweep: `make test-sweep` (LOWMEM_SWEEP=1); `make test` runs one case per cause")
    # NOTE: `needs_cuda` lets tests/conftest.py add the `cuda` marker, so `pytest -m cuda` (make gpu-check STAGE=1) selects them
    return pytest.mark.skipif(
        bool(reasons), reason="; ".join(reasons) or "requirements met", needs_cuda=bool(min_cuda_gpus or bf16_cuda)
    )
