"""``plan``, ``lowmem plan`` and ``lowmem_auto``: the chosen recipe fits when measured, none faster fits, it runs."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

import lightning_lowmem  # noqa: F401  (registers lowmem_auto)
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.measure.recorder import StepMemoryRecorder
from lightning_lowmem.plan.auto import AutoStrategy
from lightning_lowmem.plan.search import NoRecipeFitsError, plan
from lightning_lowmem.predict.dry_run import dry_run
from tests.helpers.models import random_batch, tiny_lm_module

pytestmark = pytest.mark.integration

BATCH, SEQ = 4, 32
#: without DeepSpeed (its start-up costs seconds per trace); test_recipes_and_cost covers its candidates
BASES = ("fp32", "mixed", "offload")
CACHE: dict = {}  # arch -> (module, data, dry runs): shared by the tests of this file


class TokenData(L.LightningDataModule):
    """Fixed random token batches from a data module with a ``batch_size`` (the plan's micro-batches set it)."""

    def __init__(self, batch_size: int = BATCH, seq_len: int = SEQ) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        batch = random_batch(16, self.seq_len)
        rows = [{k: v[i] for k, v in batch.items()} for i in range(16)]
        return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)


def _module(arch: str) -> L.LightningModule:
    torch.manual_seed(0)
    return tiny_lm_module(arch, config={"n_layer": 2} if arch == "gpt2" else {"num_hidden_layers": 2})


def _measured_device_peak(module: L.LightningModule, run, steps: int = 2) -> int:
    recorder = StepMemoryRecorder(every_n_steps=1)
    kwargs = run.trainer_kwargs()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        **{**kwargs, "callbacks": [*kwargs["callbacks"], recorder]})
    trainer.fit(module, datamodule=TokenData())
    return max(p["device"]["total"] for r in recorder.steps for p in r["phases"].values())


def _plan(arch: str, budget: int, **kwargs):
    """A plan for the module and data of ``arch`` (the same objects every time: their dry runs are cached)."""
    if arch not in CACHE:
        CACHE[arch] = (_module(arch), TokenData(), {})
    module, data, cache = CACHE[arch]
    return plan(module, data=data, device_memory=budget, target="cpu", bases=BASES, cache=cache, **kwargs), module


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_chosen_recipe_fits_when_measured_and_no_faster_candidate_fits(arch):
    roomy, _ = _plan(arch, 2**40)
    fastest = min(roomy.rows, key=lambda r: r.cost.total_s)
    assert roomy.chosen is fastest  # nothing is too big: the fastest candidate wins
    for fraction in (0.5,):
        budget = int(fastest.peak_device * fraction)
        result, module = _plan(arch, budget)
        chosen = result.chosen
        assert chosen.peak_device <= budget
        assert _measured_device_peak(copy.deepcopy(module), result.run) <= budget, chosen.name
        faster = result.rows[: result.rows.index(chosen)]  # ranked ahead of the chosen one
        assert faster and all(r.status in ("too big", "refused") for r in faster)
        traced = [r for r in faster if r.estimate is not None]
        assert traced and all(r.peak_device > budget for r in traced)
        # the candidates not traced were taken to be too big: trace the one ranked nearest the chosen one
        pruned = [r for r in faster if r.estimate is None and r.status == "too big"][-1:]
        for row in pruned:
            assert dry_run(module, TokenData(), run=row.recipe.run(BATCH), target="cpu").peak_device > budget, row.name


def test_no_recipe_fits_names_the_smallest_memory_any_recipe_needs():
    with pytest.raises(NoRecipeFitsError, match=r"No recipe fits a device budget of 0\.10 MiB\. The smallest device "
                                                r"peak of any recipe is 0\.\d\d MiB \(lowmem_offload \+ ckpt\(all\).*To fit: "
                                                r"a device with at least that memory, or a smaller batch"):
        _plan("gpt2", 100 * 1024)


def test_a_technique_that_refuses_the_module_is_traced_once_per_base():
    # the classifier steps SGD, which LowBitOptimizer refuses: its other 8-bit candidates are ruled out untraced
    from tests.helpers.foreign import make

    p = plan(make("classifier"), device_memory="1GB", bases=("fp32",), target="cpu")
    eight_bit = [r for r in p.rows if r.recipe.optimizer_8bit and r.status != "not traced"]
    assert p.traces == 2 and not p.chosen.recipe.optimizer_8bit and p.chosen.status == "fits"
    assert len(eight_bit) > 1 and all(r.status == "refused" for r in eight_bit)
    assert sum(r.estimate is None and "refused this module" in r.why for r in eight_bit) == len(eight_bit) - 1


def test_bad_arguments_are_reported_at_once():
    with pytest.raises(ValueError) as err:
        plan("gpt2", 4, None, device_memory="12 GX", hardware="rtx9090")
    text = str(err.value)
    assert "12 GX" in text and "rtx9090" in text and "seq_len" in text
    with pytest.raises(ValueError, match="Passed neither `device_memory` nor `hardware`"):
        plan("gpt2", 4, 32)
    with pytest.raises(ValueError, match=r"Passed `bases=\['offlaod'\]`"):
        plan("gpt2", 4, 32, device_memory="1GB", bases=["offlaod"])
    with pytest.raises(TypeError) as err:  # a wrong type among the problems: TypeError, still naming all of them
        plan("gpt2", 4, 32, device_memory=[12], hardware="rtx9090")
    assert "[12]" in str(err.value) and "rtx9090" in str(err.value)


def test_lowmem_auto_applies_the_plan_keeps_the_users_checkpointing_and_trains():
    module = copy.deepcopy(_plan("gpt2", 2**40)[1])
    initial = copy.deepcopy(module)
    users = ActivationCheckpointing("all")
    roomy, _ = _plan("gpt2", 2**40, fixed_callbacks=[users])
    budget = int(roomy.chosen.peak_device * 0.6)
    auto = AutoStrategy(device_budget=budget)
    trainer = L.Trainer(strategy=auto, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[users])
    trainer.fit(module, datamodule=TokenData())
    assert trainer.strategy is auto.chosen_strategy and auto.plan.chosen.peak_device <= budget
    planned = auto.plan.run
    want = "SingleDeviceStrategy" if isinstance(planned.strategy, str) else type(planned.strategy).__name__
    assert type(trainer.strategy).__name__ == want and trainer.precision == planned.precision
    added = {type(c).__name__ for c in planned.callbacks}
    assert added <= {type(c).__name__ for c in trainer.callbacks}
    ckpts = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
    assert ckpts == [users]  # the user's own, not doubled
    assert trainer.global_step == 2
    assert any(not torch.equal(p.float(), q) for p, q in zip(module.parameters(), initial.parameters()))


def test_lowmem_auto_on_cpu_asks_for_a_budget():
    trainer = L.Trainer(strategy="lowmem_auto", accelerator="cpu", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"`strategy='lowmem_auto'` on 'cpu' has no device memory to plan for; pass "
                                         r"`AutoStrategy\(device_budget='8GB'\)`"):
        trainer.fit(_module("gpt2"), datamodule=TokenData())
    with pytest.raises(ValueError, match=r"Passed `device_budget` 'lots' that does not parse"):
        AutoStrategy(device_budget="lots")


def test_lowmem_plan_writes_a_yaml_that_lowmem_fit_runs(tmp_path, capsys):
    from lightning_lowmem.cli import main

    out = tmp_path / "plan.yaml"
    shape = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2", "--set", "n_positions=32",
             "--set", "vocab_size=258"]
    assert main(["plan", "--model", "gpt2", *shape, "--batch-size", "4", "--seq-len", "16", "--device-memory", "2MB",
                 "--target", "cpu", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen:" in printed and "Python: L.Trainer(" in printed and out.is_file()
    text = out.read_text()
    assert text.startswith("# Written by `lowmem plan --model gpt2")
    assert main(["fit", "--config", str(out), "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
                 "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                 "--trainer.default_root_dir", str(tmp_path), "--data.init_args.max_bytes", "20000"]) == 0


def test_a_yamls_effective_batch_and_loss_normalisation_are_kept():
    """configs/demo.yaml: effective batch 16 from micro-batches of 4, token-mean loss: every candidate keeps both."""
    from pathlib import Path

    from lightning_lowmem.plan.recipes import Recipe
    from lightning_lowmem.plan.source import Source as _Source

    problems: list[str] = []
    source = _Source.of(str(Path(__file__).parents[2] / "configs" / "demo.yaml"), None, None, None, problems)
    assert not problems and (source.batch_size, source.loader_batch) == (16, 4)
    assert source.scheduler["loss_normalization"] == "tokens"
    for micro in (16, 2):
        run = Recipe("offload", micro, "all").run(source.batch_size, "bf16", source.loader_batch, source.scheduler)
        (scheduler,) = [c for c in run.callbacks if type(c).__name__ == "AccumulationScheduler"]
        assert (scheduler.effective_batch_size, scheduler.micro_batch_size) == (16, micro)
        assert scheduler.loss_normalization == "tokens"


def test_lowmem_plan_of_a_module_class_fed_by_a_data_module(capsys):
    """`--model CLASS_PATH --data CLASS_PATH --data.init_args.KEY VALUE`: a module without `train_dataloader`."""
    from lightning_lowmem.cli import main
    from tests.memory._modules import AutoEncoder, Images

    assert main(["plan", "--model", "tests.memory._modules.AutoEncoder", "--data", "tests.memory._modules.Images",
                 "--data.init_args.batch_size", "8", "--device-memory", "1GB", "--target", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("tests.memory._modules.AutoEncoder on tests.memory._modules.Images;")
    expected = plan(AutoEncoder, data=Images(batch_size=8), device_memory="1GB", target="cpu").summary()
    assert expected in printed.splitlines()
