"""LeanOptimizer through Trainer.fit: the same updates as each package's optimizer built by hand on the same model
(bit-identical), alone, under lowmem_offload, with accumulation and clipping, with a warm-up schedule; bad input."""

from __future__ import annotations

import copy
import importlib.util

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.callbacks.lean_optimizer.build import PACKAGES
from tests.helpers.models import random_batch, tiny_llama

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]
LR, WD, RANK, GAP = 1e-2, 0.1, 8, 2  # GAP 2: a new projection within the 4 steps


def _installed(kind: str) -> bool:
    return importlib.util.find_spec(PACKAGES[kind][0].split(".")[0]) is not None


class LM(L.LightningModule):
    """A tiny LLaMA whose ``configure_optimizers`` returns AdamW with a warm-up, or ``make_opt(model)`` (by hand)."""

    def __init__(self, make_opt=None) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.make_opt = make_opt

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        opt = self.make_opt(self.model) if self.make_opt else torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _projected(model: torch.nn.Module) -> list[torch.Tensor]:
    """GaLore's/APOLLO's own recipe, by hand: the attention and MLP linear weights (not the LM head)."""
    return [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]


def by_hand(kind: str):
    """The package's optimizer as its README builds it on ``model``."""

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        proj = _projected(model)
        others = [p for p in model.parameters() if all(p is not q for q in proj)]
        common = {"lr": LR, "weight_decay": WD, "eps": 1e-8, "betas": (0.9, 0.999)}
        if kind == "galore":
            from galore_torch import GaLoreAdamW

            low = {"rank": RANK, "update_proj_gap": GAP, "scale": 0.25, "proj_type": "std"}
            return GaLoreAdamW([{"params": others}, {"params": proj, **low}], no_deprecation_warning=True, **common)
        if kind in ("apollo", "apollo_mini"):
            from apollo_torch import APOLLOAdamW

            rank, scale, scale_type = (RANK, 1.0, "channel") if kind == "apollo" else (1, 128.0, "tensor")
            low = {"rank": rank, "update_proj_gap": GAP, "scale": scale, "proj_type": "std", "proj": "random",
                   "scale_type": scale_type}
            return APOLLOAdamW([{"params": others}, {"params": proj, **low}], **common)
        if kind == "adam_mini":
            from adam_mini import Adam_mini

            cfg = model.config
            return Adam_mini(model.named_parameters(), lr=LR, weight_decay=WD, eps=1e-8, dim=cfg.hidden_size,
                             n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, verbose=False)
        import torchao.optim

        return getattr(torchao.optim, {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[kind])(
            model.parameters(), **common)

    return make


def callback(kind: str) -> LeanOptimizer:
    if kind in ("galore", "apollo"):
        return LeanOptimizer(kind=kind, rank=RANK, update_proj_gap=GAP)
    if kind == "apollo_mini":
        return LeanOptimizer(kind=kind, update_proj_gap=GAP)
    return LeanOptimizer(kind=kind)


def fit(module: L.LightningModule, steps: int = 4, n_batches: int = 8, ckpt_path: str | None = None,
        **kwargs) -> L.Trainer:
    batches = [random_batch(batch_size=2, seq_len=16, seed=i) for i in range(n_batches)]
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        max_steps=steps, **kwargs)
    trainer.fit(module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def assert_same(ref: L.LightningModule, got: L.LightningModule) -> None:
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):  # weights and buffers
        assert torch.equal(a, b), name


FAST = ("galore", "apollo", "apollo_mini", "adam_mini")
SETUPS = {
    "plain": {},
    "offload": {"strategy": "lowmem_offload"},
    "accumulate+clip": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    "offload+accumulate+clip": {"strategy": "lowmem_offload", "accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
}


# NOTE: the single setups are slow-marked: the combined one covers them in CI's time
@pytest.mark.parametrize("setup", ["plain", pytest.param("offload", marks=pytest.mark.slow),
                                   pytest.param("accumulate+clip", marks=pytest.mark.slow), "offload+accumulate+clip"])
@pytest.mark.parametrize("kind", [*FAST, pytest.param("adamw8bit", marks=pytest.mark.slow),
                                  pytest.param("adamw4bit", marks=pytest.mark.slow)])
def test_same_updates_as_the_package_by_hand(kind, setup):
    if not _installed(kind):
        pytest.skip(f"{PACKAGES[kind][0]} is not installed")
    if kind in ("adamw8bit", "adamw4bit") and setup != "plain" and setup != "offload+accumulate+clip":
        pytest.skip("torchao compiles each shape: the plain and the combined setups cover it")
    torch.manual_seed(0)
    reference = LM(make_opt=by_hand(kind))
    swapped = LM()
    swapped.load_state_dict(reference.state_dict())
    fit(reference, **({k: v for k, v in SETUPS[setup].items() if k != "strategy"}))
    trainer = fit(swapped, callbacks=[callback(kind)], **SETUPS[setup])
    assert type(trainer.optimizers[0]) is type(reference.trainer.optimizers[0])
    assert_same(reference, swapped)
    if kind != "adam_mini":  # the learning rates of every group (the projected ones follow the warm-up too)
        got = [float(g["lr"]) for g in trainer.optimizers[0].param_groups]
        assert got == [float(g["lr"]) for g in reference.trainer.optimizers[0].param_groups]


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError, match="passed") as err:
        LeanOptimizer(kind="galore4", update_proj_gap=0, scale=-1.0, proj_type="up")  # type: ignore[arg-type]
    for part in ("kind='galore4'", "update_proj_gap=0", "scale=-1.0", "proj_type='up'"):
        assert part in str(err.value)
    with pytest.raises(ValueError, match=r"`rank=4` with kind='adam_mini'.*`block_size=64` with kind='adam_mini'"):
        LeanOptimizer(kind="adam_mini", rank=4, block_size=64)
    with pytest.raises(TypeError, match="rank='8'"):
        LeanOptimizer(kind="galore", rank="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_heads must be a multiple"):
        LeanOptimizer(kind="adam_mini", n_heads=4, n_kv_heads=3)


class NoMatrices(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        return (self.emb(batch) * self.scale).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.skipif(not _installed("galore"), reason="galore-torch is not installed")
def test_galore_on_a_model_with_no_2d_weight_is_refused_before_the_first_step():
    module = NoMatrices()
    before = copy.deepcopy(module.state_dict())
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[LeanOptimizer("galore")])
    with pytest.raises(ValueError, match=r"LeanOptimizer\(kind='galore'.*`NoMatrices` has no 2-D weight to project"):
        trainer.fit(module, DataLoader([torch.tensor([1, 2])], batch_size=None))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


@pytest.mark.skipif(not _installed("galore"), reason="galore-torch is not installed")
def test_rank_above_every_weight_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"rank=64 on its smaller side.*Pass a smaller `rank`"):
        fit(LM(), steps=1, callbacks=[LeanOptimizer("galore", rank=64)])


@pytest.mark.skipif(not _installed("adam_mini"), reason="adam-mini is not installed")
def test_an_optimizer_other_than_adamw_is_refused_naming_it():
    torch.manual_seed(0)
    module = LM(make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"LeanOptimizer\(kind='adam_mini'.*returns `torch.optim.sgd.SGD`"):
        fit(module, steps=1, callbacks=[LeanOptimizer("adam_mini")])


@pytest.mark.parametrize("kind", ["galore", "apollo_mini", "adam_mini", "adamw4bit"])
def test_a_missing_package_names_its_extra(kind, monkeypatch):
    import sys

    name = PACKAGES[kind][0]
    for mod in [m for m in sys.modules if m == name.split(".")[0] or m.startswith(name.split(".")[0] + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, name.split(".")[0], None)  # import fails as if not installed
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[LeanOptimizer(kind)])
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'lightning-lowmem\[{PACKAGES[kind][1]}\]'"):
        trainer.fit(NoMatrices(), DataLoader([torch.tensor([1, 2])], batch_size=None))


RESUME_RUN = """
import sys, torch, lightning as L
from tests.callbacks.test_lean_optimizer import LM, callback, fit
torch.manual_seed(1)  # a different init: everything must come from the checkpoint
module = LM()
fit(module, steps=6, n_batches=3, callbacks=[callback(sys.argv[1])], ckpt_path=sys.argv[2])
torch.save(module.state_dict(), sys.argv[3])
"""


@pytest.mark.parametrize("kind", ["galore", "apollo_mini", "adam_mini"])
def test_resume_in_a_new_process_is_identical(kind, tmp_path):
    """3 steps, a checkpoint (loaded weights-only: the projectors are saved as plain tensors), 3 more steps in a new
    process: the weights and buffers of 6 straight steps (the projections are re-computed at step 4 and 6)."""
    import subprocess
    import sys
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    if not _installed(kind):
        pytest.skip(f"{PACKAGES[kind][0]} is not installed")
    torch.manual_seed(0)
    straight = LM()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_last=False)
    fit(straight, steps=6, n_batches=3, callbacks=[callback(kind), ckpt], enable_checkpointing=True)
    path = next(p for p in tmp_path.iterdir() if "step=3" in p.name)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "resumed.pt"
    subprocess.run([sys.executable, "-c", RESUME_RUN, kind, str(path), str(out)], cwd=root, check=True,
                   capture_output=True, timeout=600)
    resumed = torch.load(out, weights_only=True)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed[name]), name


@pytest.mark.parametrize("kind", ["galore", "apollo_mini"])
def test_layer_wise_with_optimizer_in_backward_matches_the_normal_step(kind):
    """GaLore's layer-wise update (the benchmark's 24 GiB rows): each weight stepped in backward by the same
    optimizer, bit-identical to the normal step; accumulation stays refused by OptimizerInBackward."""
    from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward

    if not _installed(kind):
        pytest.skip(f"{PACKAGES[kind][0]} is not installed")
    torch.manual_seed(0)
    normal = LM()
    layer_wise = LM()
    layer_wise.load_state_dict(normal.state_dict())
    fit(normal, callbacks=[callback(kind)])
    trainer = fit(layer_wise, callbacks=[callback(kind), OptimizerInBackward()])
    assert type(trainer.optimizers[0]) is type(normal.trainer.optimizers[0])
    assert_same(normal, layer_wise)
    with pytest.raises(ValueError, match="accumulate"):
        fit(LM(), steps=1, callbacks=[callback(kind), OptimizerInBackward()], accumulate_grad_batches=2)
