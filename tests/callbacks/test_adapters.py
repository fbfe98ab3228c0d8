"""``Adapters``: a LoRA/DoRA run by flag is the plain PEFT run of the same model, seed and optimizer, bit for bit.

The reference wraps the model with ``peft.get_peft_model`` in the LightningModule's ``__init__`` (as PEFT's and
Lightning's examples do); the run under test builds the plain model and adds ``Adapters(...)`` to the callbacks.
Both draw the adapters' initialisation from a generator seeded with 0 and the dropout masks from the global RNG
seeded with 1 before ``fit``; every parameter and buffer (frozen base included) is compared with ``torch.equal``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem import AccumulationScheduler, ActivationCheckpointing, Adapters
from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.helpers.models import random_batch, tiny_llama
from tests.helpers.runif import RunIf

pytestmark = [RunIf(peft=True)]

LORA = {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": "all-linear"}


def peft_wrap(model: nn.Module, kind: str = "lora", seed: int = 0, **kw) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    opts = {**LORA, **kw}
    config = LoraConfig(r=opts["r"], lora_alpha=opts["alpha"], lora_dropout=opts["dropout"], bias="none",
                        target_modules=opts["target_modules"], use_dora=kind == "dora")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


class LitLM(L.LightningModule):
    """A causal-LM fine-tune whose optimizer is built over ``self.parameters()`` (frozen ones included)."""

    def __init__(self, peft_kind: str | None = None, batch_size: int = 2, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_llama(num_hidden_layers=layers)
        if peft_kind is not None:
            self.model = peft_wrap(self.model, peft_kind)
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        rows = [{k: v[0] for k, v in random_batch(1, 16, seed=i).items()} for i in range(16)]
        return DataLoader(rows, batch_size=self.batch_size)


def fit(module: L.LightningModule, callbacks=(), strategy="auto", precision="32-true", steps=3) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                        callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    L.seed_everything(1, verbose=False)  # the dropout masks
    trainer.fit(module)
    return trainer


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    lora_b = [k for k in want if "lora_B" in k]
    assert lora_b and all(want[k].abs().sum() > 0 for k in lora_b)  # the adapters trained
    bad = [f"{k}: {(got[k].float() - v.float()).abs().max()}" for k, v in want.items() if not torch.equal(got[k], v)]
    assert not bad, bad


CASES = {
    "lora": ("lora", {}, [], "auto", "32-true"),
    "dora": ("dora", {}, [], "auto", "32-true"),
    "offload-32": ("lora", {}, [], "offload", "32-true"),
    "offload-bf16-mixed": ("lora", {}, [], "offload", "bf16-mixed"),
    "dora-offload-bf16-mixed": ("dora", {}, [], "offload", "bf16-mixed"),
    "checkpointing": ("lora", {}, ["ckpt"], "auto", "32-true"),
    "accumulation": ("lora", {"batch_size": 4}, ["accum"], "auto", "32-true"),
    "accumulation-offload": ("lora", {"batch_size": 4}, ["accum"], "offload", "32-true"),
}


def _callbacks(names: list[str]) -> list[L.Callback]:
    out: list[L.Callback] = []
    if "ckpt" in names:
        out.append(ActivationCheckpointing("all"))
    if "accum" in names:
        out.append(AccumulationScheduler(effective_batch_size=4, micro_batch_size=2))
    return out


def _strategy(name: str):
    return OffloadStrategy(host_optimizer="as_is") if name == "offload" else "auto"


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_by_flag_equal_plain_peft(case):
    kind, module_kw, extra, strategy, precision = CASES[case]
    # the reference: plain PEFT in __init__, plain Lightning (the same technique callbacks but the adapters)
    reference = LitLM(kind, **module_kw)
    want_trainer = fit(reference, _callbacks([e for e in extra if e != "ckpt"]), "auto", precision)
    want = state(reference)
    ours = LitLM(None, **module_kw)
    trainer = fit(ours, [Adapters(kind, **LORA), *_callbacks(extra)], _strategy(strategy), precision)
    assert_equal_states(state(ours), want)
    # no optimizer state for the frozen base: only the adapters were stepped
    trained = {id(p) for p in reference.parameters() if p.requires_grad}
    assert set(map(id, want_trainer.optimizers[0].state)) == trained
    if strategy == "auto":
        assert len(trainer.optimizers[0].state) == len(trained)


def test_frozen_base_is_frozen_and_adapters_only_are_trained():
    module = LitLM(None)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    fit(module, [Adapters("lora", **LORA)])
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in module.model.state_dict().items()}
    assert all(torch.equal(after[k], v) for k, v in base.items())


def test_a_model_already_wrapped_by_peft_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"already holds PEFT adapters.*Remove the Adapters callback"):
        fit(LitLM("lora"), [Adapters("lora", **LORA)], steps=1)


def test_a_second_fit_keeps_the_adapters_it_applied():
    module = LitLM(None)
    callback = Adapters("lora", **LORA)
    fit(module, [callback], steps=1)
    first = module.model
    fit(module, [callback], steps=2)
    assert module.model is first


class _Late(LitLM):
    """The model exists only after ``configure_model``, which ends with the Trainer's Adapters (when ``adapt``)."""

    def __init__(self, adapt: bool = True):
        super().__init__(None)
        del self.model
        self.adapt = adapt

    def configure_model(self):
        if not hasattr(self, "model"):
            with torch.random.fork_rng(devices=[]):  # the run's dropout masks stay the reference's
                torch.manual_seed(0)
                self.model = tiny_llama(num_hidden_layers=2)
        if self.adapt:
            next(c for c in self.trainer.callbacks if isinstance(c, Adapters)).apply(self)


def test_a_model_built_in_configure_model_gets_adapters_from_its_own_call():
    want = LitLM("lora")
    fit(want, [])
    got = _Late()
    fit(got, [Adapters("lora", **LORA)])
    assert_equal_states(state(got), state(want))


def test_a_model_built_in_configure_model_without_the_call_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"`_Late.model` has no adapters.*End your `configure_model` with "
                                         r"`adapters.apply\(self\)`"):
        fit(_Late(adapt=False), [Adapters("lora", **LORA)], steps=1)


def test_a_missing_model_attribute_names_the_children():
    with pytest.raises(ValueError, match=r"`LitLM.net` is missing; its child modules: `model` \(LlamaForCausalLM\)"):
        fit(LitLM(None), [Adapters("lora", attribute="net")], steps=1)


def test_constructor_reports_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        Adapters("lorax", r=0, alpha=-1, dropout=1.5, target_modules=[], quantize_base="nf3", attribute="a.b")
    msg = str(err.value)
    for part in ("`kind='lorax'`", "`r=0`", "`alpha=-1`", "`dropout=1.5`", "`target_modules=[]`",
                 "`quantize_base='nf3'`", "`attribute='a.b'`"):
        assert part in msg
    with pytest.raises(TypeError, match=r"`r='8'`.*`seed=1.5`"):
        Adapters(r="8", seed=1.5)


def test_missing_peft_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-lowmem\[peft\]'"):
        Adapters()


def test_dry_run_sees_adapters_weights_without_base_gradients_or_state():
    """The dry run runs the callback itself on fake tensors: the frozen base counts as weights only."""
    from lightning_lowmem import dry_run

    def factory():
        return LitLM(None, layers=2)

    full = dry_run(factory, batch_size=2, seq_len=16, extrapolate=False).phases["optimizer"].device
    lora = dry_run(factory, batch_size=2, seq_len=16, callbacks=[Adapters("lora", **LORA)],
                   extrapolate=False).phases["optimizer"].device
    real = LitLM(None)
    base = [p for p in real.parameters()]
    adapters = [p for p in peft_wrap(LitLM(None).model).parameters() if p.requires_grad]
    n_base, n_lora = sum(p.numel() for p in base), sum(p.numel() for p in adapters)
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    assert full["weights"] == 4 * n_base + buffers
    assert lora["weights"] == 4 * (n_base + n_lora) + buffers
    assert full["gradients"] == 4 * n_base and lora["gradients"] == 4 * n_lora
    # AdamW: two fp32 moments per element and one fp32 step counter per tensor
    assert full["optimizer_state"] == 8 * n_base + 4 * len(base)
    assert lora["optimizer_state"] == 8 * n_lora + 4 * len(adapters)


def test_lightning_cli_yaml_names_the_callback_by_short_name(tmp_path):
    import yaml

    from lightning_lowmem.cli import LowMemCLI
    from tests.test_cli import TINY

    trainer = {**TINY["trainer"], "callbacks": [
        {"class_path": "Adapters", "init_args": {"r": 2, "alpha": 4, "target_modules": ["c_attn"]}}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**TINY, "trainer": trainer}))
    cli = LowMemCLI(args=["fit", "--config", str(path)])
    trained = {n for n, p in cli.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained) and cli.trainer.global_step == 1
