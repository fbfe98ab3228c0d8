"""Frozen block weights streamed by ``lowmem_offload_params`` keep no fp32 host master: the stream's host copy is their value.

Before, a LoRA fine-tune under parameter streaming kept an fp32 master (4 B/param, never stepped) for every frozen
floating-point weight of the repeated blocks (LLaMA-70B: 255 GiB of host RAM), and handed them back fp32 after fit.
Now, where the compute dtype holds the whole value (``*-true``), the host copy in the stream is the value: the view
of the masters, the checkpoint, an unfreeze and the module given back read it. Checked through
``Trainer.fit`` on a tiny LLaMA against plain Lightning (``32-true``: every weight and buffer), and under ``bf16-true``
against plain Lightning for the frozen base and against the resident ``lowmem_offload`` run for everything (the
adapters step fp32 masters there, bf16 weights in plain bf16-true).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_lowmem import Adapters
from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.callbacks.test_adapters import LitLM, fit, state
from tests.helpers.runif import RunIf
from tests.strategies.test_offload_frozen import UnfreezeAt

pytestmark = [pytest.mark.integration, RunIf(peft=True)]

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


def _streamed() -> OffloadStrategy:
    return OffloadStrategy(host_optimizer="as_is", offload_params=True)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_buffers()}  # NOTE: non-persistent ones too (rotary)


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


class Held(Callback):
    """What the strategy holds on the host during training, and the values a view of the masters shows."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        strategy = trainer.strategy
        if not isinstance(strategy, OffloadStrategy):
            return
        self.masters = sorted(strategy.masters)
        self.master_bytes = sum(m.numel() * m.element_size() for m in strategy.masters.values())
        self.grad_buffers = sum(g is not None for g in strategy._masters.grad_host)
        self.streamed = {n for n, p in pl_module.named_parameters() if id(p) in strategy._stream.shapes}
        with strategy.masters_view():
            self.shown = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.checkpoint = {k: v.detach().clone() for k, v in strategy.lightning_module_state_dict().items()}


def _lora_fit(strategy, precision: str, *callbacks) -> LitLM:
    module = LitLM(None)
    fit(module, [Adapters("lora", **LORA), *callbacks], strategy, precision)
    return module


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_streamed_lora_base_has_no_master_and_trains_as_plain_lightning(precision):
    plain = _lora_fit("auto", precision)
    held = Held()
    streamed = _lora_fit(_streamed(), precision, held)
    trainable = sorted(n for n, p in streamed.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    frozen_streamed = held.streamed - set(trainable)
    assert len(frozen_streamed) == 2 * 9  # 2 layers x (7 linears + 2 norms)
    # NOTE: failed before: every frozen streamed weight kept an fp32 master (4 B/param, never stepped)
    assert held.masters == trainable and held.grad_buffers == len(trainable)
    assert held.master_bytes == 4 * sum(p.numel() for n, p in streamed.named_parameters() if n in trainable)
    want, got = state(plain), state(streamed)
    if precision == "32-true":
        assert _differ(got, want) == [] and _differ(_buffers(streamed), _buffers(plain)) == []
    else:
        resident = _lora_fit(OffloadStrategy(host_optimizer="as_is"), precision)
        base = [k for k in want if "lora_" not in k]
        # NOTE: failed before: the frozen streamed weights came back as their fp32 masters
        assert _differ({k: got[k] for k in base}, {k: want[k] for k in base}) == []
        assert _differ(got, state(resident)) == [] and _differ(_buffers(streamed), _buffers(resident)) == []
    # the view of the masters shows each frozen streamed weight's value, the checkpoint holds it
    for name in frozen_streamed:
        value = dict(streamed.named_parameters())[name]
        assert torch.equal(held.shown[name], value) and torch.equal(held.checkpoint[name], value), name
        assert held.checkpoint[name].dtype == value.dtype, name  # bf16-true: bf16, as plain Lightning saves it


def test_host_bytes_needed_counts_no_master_for_streamed_frozen_weights():
    """The host check counts what the strategy allocates (failed before: 4 B for every streamed frozen weight)."""
    module = LitLM(None)
    Adapters("lora", **LORA).apply(module)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    need = _streamed().host_bytes_needed(module, [])
    assert need["masters"] == 4 * trainable and need["gradient_buffers"] == 4 * trainable
    assert need["streamed_weights"] > 0


def test_checkpoint_of_a_streamed_lora_run_equals_plain_lightning(tmp_path):
    """The checkpoint saves the frozen streamed weights from their host copies (not their placeholders, NaN), mid-fit,
    and the next forward after each save still finds its blocks."""

    def run(strategy, where):
        cbs = [ModelCheckpoint(dirpath=where, save_last=True, every_n_train_steps=1)]
        module = LitLM(None)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true", max_steps=4,
                            callbacks=[Adapters("lora", **LORA), *cbs], logger=False, enable_progress_bar=False,
                            enable_model_summary=False)
        L.seed_everything(1, verbose=False)
        trainer.fit(module)
        return state(module), torch.load(where / "last.ckpt", weights_only=False)

    want, want_ckpt = run("auto", tmp_path / "plain")
    got, got_ckpt = run(_streamed(), tmp_path / "streamed")
    assert _differ(got, want) == []
    assert _differ(got_ckpt["state_dict"], want_ckpt["state_dict"]) == []


def test_streamed_lora_resumes_in_a_new_process_identically(tmp_path):
    """A checkpoint after the 2nd step of a bf16-true streamed LoRA run, resumed in a new process: the same weights as
    the run that was not stopped. The checkpoint holds the frozen base in bf16 (its value: no master)."""
    from tests.test_resume_across_processes import assert_resumes_identical

    assert_resumes_identical(tmp_path, "lowmem_offload_params", "bf16-true", steps=4, save_at=[1], model="llama",
                             adapters=LORA)
    saved = torch.load(tmp_path / "batch=1.ckpt", weights_only=True)["state_dict"]
    base = [k for k in saved if ".layers." in k and "lora_" not in k]
    assert base and all(saved[k].dtype == torch.bfloat16 for k in base)  # NOTE: failed before: fp32 masters
    assert all(saved[k].dtype == torch.float32 for k in saved if "lora_" in k)  # the adapters' masters


class Backbone(LitLM):
    """The first decoder layer (a streamed block) as the backbone; the optimizer holds the trainable parameters only."""

    def __init__(self) -> None:
        super().__init__(None)
        self.backbone = self.model.model.layers[0]

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


class AtEpochs(Callback):
    """The masters of the backbone at the end of each epoch (it is unfrozen at the start of epoch 1)."""

    def __init__(self) -> None:
        self.masters: list[set[str]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        if isinstance(trainer.strategy, OffloadStrategy):
            self.masters.append({n for n in trainer.strategy.masters if n.startswith("model.model.layers.0.")})


def _backbone_fit(strategy, precision: str, *callbacks) -> Backbone:
    module = Backbone()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_epochs=2, limit_train_batches=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[UnfreezeAt(), *callbacks],
    )  # fmt: skip
    L.seed_everything(1, verbose=False)
    trainer.fit(module)
    return module


def test_unfreezing_streamed_block_weights_trains_as_plain_lightning():
    """32-true: the backbone, frozen at setup, has no master while frozen; unfrozen at epoch 1 its masters are made
    from the stream's host copies (before: from the parameters, placeholders while their block is released) and the
    run equals plain Lightning's, every weight and buffer."""
    plain = _backbone_fit("auto", "32-true")
    seen = AtEpochs()
    streamed = _backbone_fit(_streamed(), "32-true", seen)
    assert seen.masters[0] == set()  # NOTE: failed before: the frozen backbone kept its masters
    assert len(seen.masters[1]) == 9
    assert _differ(state(streamed), state(plain)) == [] and _differ(_buffers(streamed), _buffers(plain)) == []
    assert not torch.equal(state(streamed)["model.model.layers.0.mlp.up_proj.weight"],
                           state(Backbone())["model.model.layers.0.mlp.up_proj.weight"])  # it trained


def test_backbone_unfrozen_under_bf16_true_gets_its_master_from_the_exact_host_copy(monkeypatch):
    """bf16-true: unfrozen, the backbone's masters are its bf16 host copies upcast, exactly (as the resident run's come
    from its bf16 compute weights), and the streamed run equals the resident one (failed before: the streamed backbone
    kept its fp32 initial values as masters, the resident one the bf16 rounding of them)."""
    from lightning_lowmem.strategies.offload.masters import HostMasters

    made: list[tuple[str, torch.Tensor]] = []
    original = HostMasters.master_unfrozen

    def spy(self, value_of):
        new = original(self, value_of)
        made.extend((self.names[i], self.p_host[i].detach().clone()) for i in new)
        return new

    monkeypatch.setattr(HostMasters, "master_unfrozen", spy)
    resident = _backbone_fit(OffloadStrategy(host_optimizer="as_is"), "bf16-true")
    from_resident, made[:] = list(made), []
    streamed = _backbone_fit(_streamed(), "bf16-true")
    assert len(made) == 9 and [n for n, _ in made] == [n for n, _ in from_resident]
    initial = Backbone().state_dict()
    for (name, master), (_, want) in zip(made, from_resident):
        assert torch.equal(master, want) and torch.equal(master, initial[name].bfloat16().float()), name
    assert _differ(state(streamed), state(resident)) == [] and _differ(_buffers(streamed), _buffers(resident)) == []


def test_dry_run_counts_the_streamed_host_copies_and_no_staging_for_the_frozen_base():
    """CUDA target: the pinned staging covers the adapters' masters only, and the streamed blocks' host copies are host
    weights (the tracker counts them: `mark_host_weights`; their bytes, not the padding of CUDA's pinned buckets; the
    trained adapters keep none); at
    depth 12 the extrapolated
    figure equals the one traced at full depth (before: staging for every streamed frozen weight's master, the copies
    themselves and the masters untraced)."""
    from lightning_lowmem import ActivationCheckpointing, estimate_memory
    from lightning_lowmem.demo.module import CausalLMModule
    from lightning_lowmem.strategies.offload.transfer import pinned_staging_bytes

    config = {"num_hidden_layers": 12, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 258}
    module = CausalLMModule(model_type="llama", config=config)
    Adapters("lora", **LORA).apply(module)
    # the blocks' frozen weights, in bf16 (a trained adapter's fetch rounds its master: no host copy)
    streamed = [(p.numel(), torch.bfloat16) for n, p in module.named_parameters() if ".layers." in n and not p.requires_grad]
    trainable = [(p.numel(), torch.bfloat16) for p in module.parameters() if p.requires_grad]
    figures = {}
    for extrapolate in (True, False):
        est = estimate_memory({"model_type": "llama", **config}, 1, 16, precision="bf16-true", target="cuda",
                              strategy="lowmem_offload_params", extrapolate=extrapolate,
                              callbacks=[Adapters("lora", **LORA), ActivationCheckpointing("all")])
        figures[extrapolate] = {c.name: c.bytes for c in est.corrections}
        figures[extrapolate]["host weights"] = est.phases["optimizer"].host["weights"]
    # NOTE: failed before: the staging counted a master for every streamed frozen weight (not the extrapolated run's:
    # its staging is scaled from the traced depth by the parameter count), and the copies were not counted at all
    # + the upload ring of the trained streamed weights: prefetch + 2 slots of a block's adapters, each 512-B aligned
    ring = 3 * max(sum(-(-p.numel() * 2 // 512) * 512 for p in layer.parameters() if p.requires_grad)
                   for layer in module.model.model.model.layers)
    assert figures[False]["pinned_staging"] == pinned_staging_bytes(trainable) + ring
    assert figures[False]["host weights"] == sum(2 * n for n, _ in streamed)
    assert figures[True]["host weights"] == figures[False]["host weights"]
