"""The public API and the registered names are those of the layout before the package moved into layers: a user's
``import``, YAML ``class_path`` and ``strategy=`` string keep working."""

from __future__ import annotations

import importlib

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_lowmem
from lightning_lowmem._registry import STRATEGIES

#: ``lightning_lowmem.__all__`` before the move, and ``Adapters`` (added with the move, in the new room),
#: ``LeanOptimizer`` (added after it) and ``pl`` (the build for the ``pytorch_lightning`` package, added after it),
#: less ``OOMRecovery`` (removed: it only refused, naming the fix; docs/techniques/accumulation.md says what to do)
ALL = ['AccumulationScheduler', 'ActivationCheckpointing', 'ActivationOffload', 'Adapters', 'AutoStrategy', 'ByteTokenizer',
       'CausalLMModule', 'ChunkedLMLoss', 'DryRunUnsupportedError', 'LeanOptimizer', 'LowBitOptimizer', 'MasterHalfPrecision',
       'MemoryBreakdown', 'MemoryEstimate', 'MemoryReport', 'OffloadStrategy', 'OptimizerInBackward',
       'RunSpec', 'StdlibTextDataModule', 'StepMemoryRecorder', 'ZeroStrategy', 'chunked_causal_lm_loss', 'dry_run', 'dry_run_peak',
       'estimate_memory', 'pl', 'plan', 'register_strategies', 'zero']
#: the registered strategy names before the move
REGISTERED = ['lowmem_auto', 'lowmem_offload', 'lowmem_offload_disk', 'lowmem_offload_params', 'lowmem_zero2', 'lowmem_zero2_offload',
              'lowmem_zero3', 'lowmem_zero3_nvme', 'lowmem_zero3_offload']
#: other public modules' ``__all__`` before the move
MODULES = {
    "lightning_lowmem.zero": ['ZeroStrategy', 'consolidate', 'consolidate_main'],
    "lightning_lowmem.plan": ['AutoStrategy', 'HardwareProfile', 'ModelShape', 'NoRecipeFitsError', 'PROFILES', 'Plan',
                              'Recipe', 'candidates', 'measure_host', 'plan', 'step_cost'],
}
#: class paths the README, docs/ and configs/ give (YAML ``class_path``, imports)
DOCUMENTED = [
    "lightning_lowmem.demo.module.CausalLMModule", "lightning_lowmem.demo.data.StdlibTextDataModule",
    "lightning_lowmem.demo.loss_log.LossLog", "lightning_lowmem.zero.consolidate",
    "lightning_lowmem.callbacks.activation_checkpointing.ActivationCheckpointing",
    "lightning_lowmem.callbacks.activation_offload.ActivationOffload",
    "lightning_lowmem.callbacks.accumulation.AccumulationScheduler",
    "lightning_lowmem.callbacks.low_bit_optimizer.LowBitOptimizer",
    "lightning_lowmem.callbacks.optimizer_in_backward.OptimizerInBackward",
    "lightning_lowmem.callbacks.chunked_lm_loss.ChunkedLMLoss",
    "lightning_lowmem.strategies.offload.OffloadStrategy", "lightning_lowmem.strategies.zero.ZeroStrategy",
    "lightning_lowmem.cli.main", "lightning_lowmem.cli.LowMemCLI",
]


def test_package_all_is_unchanged():
    assert sorted(lightning_lowmem.__all__) == ALL
    for name in ALL:
        assert getattr(lightning_lowmem, name) is not None


def test_registered_strategy_names_are_unchanged():
    assert sorted(STRATEGIES) == REGISTERED
    available = StrategyRegistry.available_strategies()
    assert all(name in available for name in REGISTERED)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_public_modules_all_is_unchanged(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == MODULES[module]
    for name in MODULES[module]:
        getattr(mod, name)


@pytest.mark.parametrize("path", DOCUMENTED)
def test_documented_class_paths_resolve(path):
    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    top = getattr(lightning_lowmem, name, None)
    assert top is None or top is obj  # the same class under both names
