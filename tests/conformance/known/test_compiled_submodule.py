"""A ``torch.compile``-d submodule is not bit-identical to plain Lightning under two techniques that claim it:

- ``lowmem_offload`` with ``precision="bf16-mixed"`` (``host_optimizer="as_is"``): the compiled Linear layers'
  weights and biases differ from plain ``bf16-mixed`` after 3 steps (|diff|/|update| ~5e-4 in the sweep).
  Cause (confirmed): the strategy kept bf16 copies of the weights autocast would cast, so the compiled graph was
  traced on bf16 parameters instead of fp32 parameters cast inside the graph, and inductor fuses the cast with the
  bias add (no bf16 rounding of the fp32 bias) where eager autocast rounds. Fixed: the parameters of compiled modules
  keep fp32 under ``*-mixed`` (``master_half._compiled_params``); this test passes.
- ``MemoryReport`` (sampled steps): weights differed from the run without it by ~3e-6 of the update. Cause
  (confirmed): dynamo skips every frame while a ``TorchDispatchMode`` whose ``ignore_compile_internals()`` is False
  is on the stack, so the compiled region ran eagerly in the sampled steps. Fixed: the tracker's mode ignores compile
  internals (``measure/tracker.py``, [compiled regions]): the compiled code runs as untracked; this test passes.

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


def test_memory_report_with_a_compiled_submodule_matches_plain(tmp_path):
    plain = train(Compiled)
    torch.compiler.reset()
    report = MemoryReport(every_n_steps=1, predict=False, plot=False, save_dir=tmp_path)
    assert not differing(train(Compiled, callbacks=[report]), plain)


class CompiledTrunk(Classifier):
    """The conformance corpus's compiled module: a conv stem, a compiled trunk, an eager head (16x16 images)."""

    def __init__(self) -> None:
        from tests.conformance.corpus_nets import CompiledSubmodule

        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 3, (16,), generator=g))
        super().__init__(CompiledSubmodule(), data, lambda params: torch.optim.AdamW(params, lr=2e-3))


def test_offload_with_activation_checkpointing_of_a_compiled_submodule_matches_plain():
    """Found when the MemoryReport fix let the compiled trunk run compiled in the recipe cells: with
    ``ActivationCheckpointing("sqrt")`` at ``bf16-mixed`` the first step failed inside the compiled backward
    ("expected size 32==32, stride 1==32": a saved weight's strides), under ``lowmem_offload`` and plain Lightning
    alike. Cause: under autocast the trunk holds over half of the activations, so the measurement chose the Linear
    layers inside the compiled trunk, and the sqrt segment (closed by a forward hook) ran inside the compiled region.
    Fixed: the callback never checkpoints a compiled module or inside one (``core.blocks.outside_compiled``)."""
    from lightning_lowmem import ActivationCheckpointing

    plain = train(CompiledTrunk, precision="bf16-mixed")
    torch.compiler.reset()
    checkpointing = ActivationCheckpointing("sqrt")
    got = train(CompiledTrunk, precision="bf16-mixed", strategy=OffloadStrategy(host_optimizer="as_is"),
                callbacks=[checkpointing])
    assert not any(name.startswith("net.trunk") for name in checkpointing.wrapped), checkpointing.wrapped
    assert not differing(got, plain)


def test_checkpointing_all_at_bf16_true_leaves_a_compiled_submodule_alone():
    """``ActivationCheckpointing("all")`` at ``bf16-true`` (the founding recipe, the dry-run row): checkpointing the
    compiled trunk whole failed in the recompute (torch's ``CheckpointError``: "Recomputed values ... have different
    metadata": the compiled code saved other tensors), under plain Lightning as under ``lowmem_offload``."""
    from lightning_lowmem import ActivationCheckpointing

    plain = train(CompiledTrunk, precision="bf16-true")
    torch.compiler.reset()
    assert not differing(train(CompiledTrunk, precision="bf16-true", callbacks=[ActivationCheckpointing("all")]), plain)
    torch.compiler.reset()
    # NOTE: lowmem_offload at bf16-true keeps fp32 masters (judged `close` by the sweep): here, that it runs
    got = train(CompiledTrunk, precision="bf16-true", strategy=OffloadStrategy(host_optimizer="as_is"),
                callbacks=[ActivationCheckpointing("all")])
    assert got.keys() == plain.keys()


def test_checkpointing_classes_inside_a_compiled_submodule_is_bit_identical():
    """``ActivationCheckpointing(["Linear"])`` checkpointed the Linear layers inside the compiled trunk: the
    checkpoint was traced into the compiled graph, which inductor partitions and fuses otherwise (|diff|/|update|
    2.9e-6 on 7 of 8 tensors after 3 fp32 steps; bit-identical with ``backend="aot_eager"``, so the kernels, not lost
    terms). Fixed: the Linear layers inside the compiled trunk are left alone, with a warning naming it."""
    from lightning_lowmem import ActivationCheckpointing

    plain = train(CompiledTrunk)
    torch.compiler.reset()
    checkpointing = ActivationCheckpointing(["Linear"])
    with pytest.warns(UserWarning, match="not checkpointing inside torch.compile-d modules \\(`net.trunk` holds"):
        got = train(CompiledTrunk, callbacks=[checkpointing])
    assert checkpointing.wrapped == ["net.head"]
    assert not differing(got, plain)


def test_naming_only_a_compiled_submodule_is_refused_before_the_first_step():
    from lightning_lowmem import ActivationCheckpointing

    with pytest.raises(ValueError, match="cannot checkpoint the blocks it found: `net.trunk` holds `net.trunk`"):
        train(CompiledTrunk, callbacks=[ActivationCheckpointing(blocks=["net.trunk"])])
