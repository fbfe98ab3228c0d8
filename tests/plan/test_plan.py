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

    # 8-bit AdamW listed first (allowed, preferred): refused once, the module's own optimizer planned after it
    p = plan(make("classifier"), device_memory="1GB", bases=("fp32",), target="cpu", hardware="rtx3060-12gb",
             optimizers=("adamw8bit", "adamw"))
    eight_bit = [r for r in p.rows if r.recipe.optimizer == "adamw8bit" and r.status != "not traced"]
    assert p.chosen.recipe.optimizer is None and p.chosen.status == "fits"
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
    """configs/demo.yaml: effective batch 8 from micro-batches of 4, token-mean loss: every candidate keeps both."""
    from pathlib import Path

    from lightning_lowmem.plan.recipes import Recipe
    from lightning_lowmem.plan.source import Source as _Source

    problems: list[str] = []
    source = _Source.of(str(Path(__file__).parents[2] / "configs" / "demo.yaml"), None, None, None, problems)
    assert not problems and (source.batch_size, source.loader_batch) == (8, 4)
    assert source.scheduler["loss_normalization"] == "tokens"
    for micro in (8, 2):
        run = Recipe("offload", micro, "all").run(source.batch_size, "bf16", source.loader_batch, source.scheduler)
        (scheduler,) = [c for c in run.callbacks if type(c).__name__ == "AccumulationScheduler"]
        assert (scheduler.effective_batch_size, scheduler.micro_batch_size) == (8, micro)
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


NEWCOMER = '''
import lightning as L
import torch
from torch import nn


class NewcomerGPT(L.LightningModule):
    """A module of one's own: its own data, no data module, no init arguments."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(width, 2, 64, batch_first=True) for _ in range(2)])
        self.batch_size = 8

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[0])
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)
'''


def test_a_plan_of_ones_own_module_writes_its_model(tmp_path, monkeypatch, capsys):
    """Issue 48 item 3: `lowmem plan --model my_module.MyGPT --write plan12.yaml` wrote no `model:` section, so the
    `lowmem fit --config plan12.yaml` it printed failed with "the following arguments are required: fit.model"."""
    import yaml

    from lightning_lowmem.cli import main

    (tmp_path / "newcomer_gpt.py").write_text(NEWCOMER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "newcomer_gpt.NewcomerGPT", "--device-memory", "1GB", "--hardware",
                 "rtx3060-12gb", "--target", "cpu", "--write", "plan12.yaml"]) == 0
    assert "wrote plan12.yaml: run it with `lowmem fit --config plan12.yaml`" in capsys.readouterr().out
    written = yaml.safe_load((tmp_path / "plan12.yaml").read_text())
    assert written["model"] == {"class_path": "newcomer_gpt.NewcomerGPT", "init_args": {"vocab": 64, "width": 32}} \
        or written["model"] == {"class_path": "newcomer_gpt.NewcomerGPT"}
    assert main(["fit", "--config", "plan12.yaml", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
                 "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]) == 0


def test_the_optimizer_is_never_changed_unasked():
    """Issue 48 item 4: both budgets chose "bf16-mixed + 8-bit AdamW" for a module whose fp32 AdamW fits; 8-bit AdamW
    is another optimizer, planned only where the user lists it."""
    p, _ = _plan("gpt2", 10**9)
    assert not any(r.recipe.optimizer for r in p.rows) and p.chosen.recipe.optimizer is None


def test_planning_a_cpu_yaml_targets_the_cpu_as_estimate_does(tmp_path):
    """Issue 48 item 4: `lowmem plan` of a CPU YAML planned for CUDA while `lowmem estimate` of it predicted the CPU;
    both take the YAML's `trainer.accelerator` now, and the plan says so. A CPU is priced at its measured rates."""
    from tests.test_estimate_cli import YAML

    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    p = plan(str(path), device_memory="1GB", bases=("fp32",))
    assert p.notes[0].endswith("dry runs (cpu target, from the YAML's trainer.accelerator: cpu), "
                               f"{len(p.rows)} candidates")
    assert p.hardware.name == "measured-host" and p.chosen.estimate.target == "cpu"
    assert "cuda target" in plan(str(path), device_memory="1GB", bases=("fp32",), target="cuda").notes[0]


def _lstm_and_data(refuse_half: bool = False):
    from tests.memory._modules import Recurrent, make

    class HalfRefusing(Recurrent):
        """A CPU whose LSTM kernel refuses half precision (oneDNN without AVX-512 BF16 on bf16, most CPUs on fp16)."""

        def training_step(self, batch, batch_idx):
            if torch.is_autocast_enabled("cpu") or self.rnn.weight_ih_l0.dtype != torch.float32:
                raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
            return super().training_step(batch, batch_idx)

    module, (x, y, lengths) = make("lstm")
    if refuse_half:
        module = HalfRefusing()
    return module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, lengths), batch_size=8)


def test_a_candidate_this_cpu_cannot_run_is_dropped_and_the_plan_goes_on():
    """Issue 47 item 3: `AutoStrategy` crashed pricing a bf16-mixed LSTM candidate on a CPU whose kernel refuses bf16
    ("could not create a primitive descriptor for the LSTM forward propagation primitive") where fp32 fits: the
    candidate is dropped with its reason, the plan goes on."""
    module, data = _lstm_and_data(refuse_half=True)
    p = plan(module, data=data, device_memory="256MB", host_memory="4GB", target="cpu", hardware="rtx3060-12gb",
             bases=("fp32", "mixed"))
    traced = [r for r in p.rows if r.recipe.base == "mixed" and r.status != "not traced"]
    assert traced and all(r.status == "refused" for r in traced)
    assert any(r.why == "cannot run: RuntimeError: could not create a primitive descriptor for the LSTM forward "
                        "propagation primitive" for r in traced)
    assert p.chosen.recipe.base == "fp32" and p.chosen.status == "fits"


def test_a_real_cpu_kernel_refusing_the_inputs_is_a_dry_run_refusal():
    """The dry run asks oneDNN's LSTM for its workspace size by running it: where this CPU's kernel refuses the
    dtype, the run itself would fail the same way: a refusal naming it, not a crash inside the probe."""
    from lightning_lowmem.predict.fake import DryRunUnsupportedError
    from lightning_lowmem.predict.kernels import KernelMatch

    def broken(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive. Run "
                           "workload with environment variable ONEDNN_VERBOSE=all")

    match = KernelMatch(lambda op, detail: DryRunUnsupportedError(op, detail, None))
    with pytest.raises(DryRunUnsupportedError, match=r"this CPU's kernel refuses these inputs \(could not create a "
                                                     r"primitive descriptor for the LSTM forward propagation primitive\)"):
        match._real(broken, (torch.zeros(2),), {}, match.refuse)


def test_lowmem_auto_on_a_cpu_logs_the_dropped_candidates_and_this_machines_rates(caplog):
    import logging

    module, data = _lstm_and_data(refuse_half=True)
    auto = AutoStrategy(device_budget="256MB", host_budget="4GB")
    trainer = L.Trainer(strategy=auto, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(module, train_dataloaders=data)
    text = caplog.text
    assert "lowmem_auto: chosen:" in text and "on measured-host" in text and "rtx3060" not in text
    assert "dropped" in text and "cannot run: RuntimeError: could not create a primitive descriptor" in text
    assert trainer.global_step == 1


def test_lowmem_auto_does_not_plan_a_recipe_that_refuses_the_trainers_own_callbacks(caplog):
    """The strategies' own checks of the Trainer's Lightning callbacks run before planning: a base whose strategy would
    refuse them at setup is not planned (lowmem_auto chose the step in backward on a CPU, which then refused a
    GradientAccumulationScheduler; found by the conformance sweep)."""
    import logging

    from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler

    from lightning_lowmem.plan.auto import refused_bases
    from lightning_lowmem.plan.recipes import DISK

    quiet = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False}
    module = tiny_lm_module()
    assert refused_bases(L.Trainer(**quiet), module) == {}
    steps_late = L.Trainer(callbacks=[GradientAccumulationScheduler({1: 2})], **quiet)
    # the disk bases step in backward too
    assert set(refused_bases(steps_late, module)) == {"offload_obw", "offload_params_obw", *DISK}
    unfreezes = L.Trainer(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)], **quiet)
    assert set(refused_bases(unfreezes, module)) == {"offload", "offload_obw", "offload_params", "offload_params_obw",
                                                     *DISK}

    auto = AutoStrategy(device_budget="256MB", host_budget="4GB")
    trainer = L.Trainer(strategy=auto, max_steps=1, callbacks=[GradientAccumulationScheduler({1: 2})], **quiet)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(module, datamodule=TokenData())
    assert not getattr(trainer.strategy, "optimizer_in_backward", False) and trainer.global_step == 1
    assert "not planned: lowmem_offload + opt-in-bwd: `GradientAccumulationScheduler(scheduling=" in caplog.text
