"""A ``torch.compile``-d submodule is not bit-identical to plain Lightning under two techniques that claim it:

- ``lowmem_offload`` with ``precision="bf16-mixed"`` (``host_optimizer="as_is"``): the compiled Linear layers'
  weights and biases differ from plain ``bf16-mixed`` after 3 steps (|diff|/|update| ~5e-4 in the sweep).
  Cause (confirmed): the strategy kept bf16 copies of the weights autocast would cast, so the compiled graph was
  traced on bf16 parameters instead of fp32 parameters cast inside the graph, and inductor fuses the cast with the
  bias add (no bf16 rounding of the fp32 bias) where eager autocast rounds. Fixed: the parameters of compiled modules
  keep fp32 under ``*-mixed`` (``master_half._compiled_params``); this test passes.
- ``MemoryReport`` (sampled steps): weights differ from the run without it by ~3e-6 of the update. Suspected cause:
  the tracker's ``TorchDispatchMode`` is active during the sampled step, so the compiled region runs another path
  (eager kernels or a recompile under the mode) than the unsampled run.

Found by the conformance sweep (module ``compiled_submodule``). Both are rounding differences, not lost terms; the
README claims bit-identity for both, so either the claim names the torch.compile exception or the paths are aligned.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import MemoryReport
from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.conformance.known._common import Classifier, differing, images, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Compiled(Classifier):
    def __init__(self) -> None:
        trunk = torch.compile(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.GELU(), nn.Linear(16, 3)))
        super().__init__(trunk, images(), lambda params: torch.optim.AdamW(params, lr=2e-3))


def test_offload_bf16_mixed_with_a_compiled_submodule_matches_plain():
    plain = train(Compiled, precision="bf16-mixed")
    torch.compiler.reset()
    assert not differing(train(Compiled, precision="bf16-mixed", strategy=OffloadStrategy(host_optimizer="as_is")), plain)


@pytest.mark.xfail(strict=True, reason="MemoryReport's sampled steps change a compiled submodule's rounding")
def test_memory_report_with_a_compiled_submodule_matches_plain(tmp_path):
    plain = train(Compiled)
    torch.compiler.reset()
    report = MemoryReport(every_n_steps=1, predict=False, plot=False, save_dir=tmp_path)
    assert not differing(train(Compiled, callbacks=[report]), plain)
