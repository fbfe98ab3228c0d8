"""`strategy="lowmem_offload"` through `Trainer.fit` on a Hugging Face GPT-2-architecture model.

Every numerical test compares against a plain-PyTorch loop doing the same maths by hand (fp32 masters,
gradients cast from the compute dtype, accumulated in fp32, clipped and stepped on the masters, then
rounded back into the compute weights) with `torch.equal`: the maths is the same, so are the bits.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_lowmem  # noqa: F401  (registers "lowmem_offload")
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.models import GPT2_TINY, random_batch
from tests.helpers.streams import assert_copies_were_deferred

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# no dropout: the runs compared must be deterministic
TINY = dict(GPT2_TINY, n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class Batches(Dataset):
    def __init__(self, n: int, seq_len: int = 16) -> None:
        self.items = [{k: v[0] for k, v in random_batch(1, seq_len, seed=i).items()} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


class LM(CausalLMModule):
    """The demo causal LM with a choice of optimizer, a step-wise LR schedule, and an optional planted inf."""

    def __init__(
        self, opt: str = "adamw", fused: bool | None = None, inf_at_step: int | None = None, batch_by_step: bool = False
    ) -> None:
        super().__init__(model_type="gpt2", config=TINY, learning_rate=1e-2)
        self.opt, self.fused, self.inf_at_step, self.batch_by_step = opt, fused, inf_at_step, batch_by_step

    def training_step(self, batch, batch_idx):
        if self.batch_by_step:
            # NOTE: Lightning restarts a plain DataLoader from its first batch on resume (it cannot fast-forward
            # it), so the resume test draws each step's batch from the step number instead of the loader.
            batch = random_batch(2, 16, seed=1000 + self.trainer.global_step)
        loss = super().training_step(batch, batch_idx)
        if self.inf_at_step is not None and self.trainer.global_step == self.inf_at_step:
            loss = loss * float("inf")  # a planted overflow: every gradient of this step is inf/nan
        return loss

    def configure_optimizers(self):
        return make_optimizer(self, self.opt, self.fused)


def make_optimizer(module: torch.nn.Module, kind: str, fused: bool | None = None, params=None, min_8bit_size=4096):
    params = list(params if params is not None else module.parameters())
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)
    elif kind == "adamw8bit":  # the reference of LowBitOptimizer("adamw8bit"): bitsandbytes' class used by hand
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(groups, lr=1e-2, betas=(0.9, 0.95), min_8bit_size=min_8bit_size)
    else:
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(strategy="lowmem_offload", precision="bf16-true", steps=10, **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu", strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        **kwargs,
    )


class RecordGrads(Callback):
    """The master gradients Lightning hands to the optimizer, before clipping (on_before_optimizer_step)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: m.grad.clone() for n, m in trainer.strategy.masters.items() if m.grad is not None})


def reference_loop(module: LM, batches, *, precision: str, kind: str, fused: bool | None, steps: int, accumulate: int,
                   clip: float | None, scale: float = 1.0, snapshots: list | None = None, **opt_kwargs):
    """The same maths as lowmem_offload, by hand, in plain PyTorch. Returns (masters by name, grads per step);
    ``snapshots`` (a list) gets a copy of the masters by name after every step."""
    dtype = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}[precision.split("-")[0]]
    model = copy.deepcopy(module)
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    config = make_optimizer(model, kind, fused, params=masters, **opt_kwargs)
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    if precision.endswith("-mixed"):
        # plain mixed precision: the fp32 module under autocast (Lightning's settings), fp32 weights kept
        ctx = lambda: torch.autocast("cpu", dtype=dtype, cache_enabled=False)
    else:
        model.to(dtype)

        @contextlib.contextmanager
        def ctx():
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
    grads_per_step, it = [], iter(batches)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            batch = next(it)
            with ctx():
                loss_sum, n = model.loss_sum_and_tokens(batch)
                loss = loss_sum / n.clamp(min=1)
            ((loss / accumulate) * scale).backward()
            for p, m in zip(model.parameters(), masters):
                g = p.grad.float()  # the gradient leaves the device in the compute dtype, is cast on the host
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None
        if scale != 1.0:
            for m in masters:
                m.grad.mul_(1.0 / scale)
        grads_per_step.append({n: m.grad.clone() for n, m in zip(names, masters)})
        if clip:  # NOTE: in param-group order, as Lightning passes them: the norm's summation order is part of the bits
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        opt.step()
        sched.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)  # round to nearest into the compute dtype
        if snapshots is not None:
            snapshots.append({n: m.detach().clone() for n, m in zip(names, masters)})
    return dict(zip(names, masters)), grads_per_step


def batches_of(dataset: Batches, batch_size: int):
    return list(DataLoader(dataset, batch_size=batch_size))


@pytest.mark.parametrize(
    ("precision", "kind", "steps", "accumulate"),
    [("bf16-true", "adamw", 10, 4), ("bf16-true", "sgd", 10, 4), ("bf16-mixed", "adamw", 4, 2), ("16-true", "sgd", 4, 2)],
)
def test_parity_with_hand_written_loop(precision, kind, steps, accumulate, transfer_mode):
    """Norm clipping, accumulation, an LR schedule; gradients and weights identical at every step.

    The default host optimizer runs AdamW with torch's fused CPU kernel; the reference uses the same kernel.
    (The mixed and fp16 cases run fewer steps: they add the autocast forward and the loss scale, not new step maths.)
    """
    torch.manual_seed(0)
    module = LM(kind)
    data = Batches(2 * steps * accumulate)
    clip = 0.5
    plugins = []
    scale = 1.0
    if precision == "16-true":
        scale = 2.0**8  # NOTE: a fixed power-of-two scale (no overflow at this size): unscaling is exact
        plugins = [MasterHalfPrecision("16-true", init_scale=scale)]
    ref_masters, ref_grads = reference_loop(
        module, batches_of(data, 2), precision=precision, kind=kind, fused=True if kind == "adamw" else None,
        steps=steps, accumulate=accumulate, clip=clip, scale=scale,
    )
    rec = RecordGrads()
    t = trainer(precision=None if plugins else precision, plugins=plugins, steps=steps, accumulate_grad_batches=accumulate,
                gradient_clip_val=clip, callbacks=[rec])
    t.fit(module, DataLoader(data, batch_size=2))
    assert len(rec.grads) == steps
    for step, (got, want) in enumerate(zip(rec.grads, ref_grads)):
        for name, g in want.items():
            assert torch.equal(got[name], g), f"gradient of {name} differs at step {step}"
    for name, p in module.named_parameters():  # teardown gave the module the fp32 masters back
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), ref_masters[name].detach()), f"{name} differs after {steps} steps"
    assert_copies_were_deferred(transfer_mode)


@pytest.mark.parametrize("host_optimizer", ["as_is", "auto"])
def test_32_true_matches_plain_lightning_bit_for_bit(host_optimizer):
    """"32-true": only gradients and optimizer state leave the device; training is plain fp32 training.

    With `host_optimizer="auto"` the AdamW runs torch's fused kernel, so the plain run asks for it too.
    """
    torch.manual_seed(0)
    plain = LM("adamw", fused=True if host_optimizer == "auto" else None)
    offloaded = copy.deepcopy(plain)
    offloaded.fused = None
    data = Batches(12)
    kwargs = {"precision": "32-true", "steps": 4, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    trainer(strategy="auto", **kwargs).fit(plain, DataLoader(data, batch_size=2))
    trainer(strategy=OffloadStrategy(host_optimizer=host_optimizer), **kwargs).fit(offloaded, DataLoader(data, batch_size=2))
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name


def test_fp16_planted_overflow_skips_exactly_that_step_and_halves_the_scale(caplog, tmp_path):
    torch.manual_seed(0)
    module = LM("sgd", inf_at_step=2)

    class Snapshots(Callback):
        def __init__(self):
            self.weights, self.scales = [], []

        def on_train_batch_end(self, trainer, *args):
            self.weights.append({n: m.detach().clone() for n, m in trainer.strategy.masters.items()})
            self.scales.append(trainer.precision_plugin.scaler.scale)

    snaps = Snapshots()
    t = trainer(precision=None, plugins=[MasterHalfPrecision("16-true", init_scale=2.0**8)], steps=5, callbacks=[snaps])
    with caplog.at_level(logging.INFO, logger="lightning_lowmem.strategies.offload.precision"):
        t.fit(module, DataLoader(Batches(10), batch_size=2))
    assert snaps.scales == [256.0, 256.0, 128.0, 128.0, 128.0]
    changed = [any(not torch.equal(a[n], b[n]) for n in a) for a, b in zip(snaps.weights, snaps.weights[1:])]
    assert changed == [True, False, True, True]  # step 2 (the planted inf) left the masters untouched
    assert all(torch.isfinite(w).all() for snap in snaps.weights for w in snap.values())
    assert "overflow" in caplog.text and "from 256 to 128" in caplog.text
    assert t.callback_metrics["lowmem/skipped_steps"] == 1.0
    # the scaler's state is in the checkpoint and comes back on resume
    t.save_checkpoint(tmp_path / "fp16.ckpt")
    ckpt = torch.load(tmp_path / "fp16.ckpt", weights_only=False)
    assert ckpt["MasterHalfPrecision"]["loss_scaler"]["scale"] == 128.0


RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch.utils.data import DataLoader
    sys.path.insert(0, {root!r})
    from tests.strategies.test_offload_integration import LM, Batches, trainer
    torch.manual_seed(123)  # a different seed: everything must come from the checkpoint
    module = LM("adamw", batch_by_step=True)
    t = trainer(steps=6, gradient_clip_val=0.5)
    t.fit(module, DataLoader(Batches(8), batch_size=2), ckpt_path={ckpt!r})
    torch.save({{n: p.detach() for n, p in module.named_parameters()}}, {out!r})
    print(json.dumps({{"global_step": t.global_step}}))
    """
)


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    """6 steps straight (saving at step 3) == resuming that checkpoint in a new process for 3 more steps.

    AdamW (fused host kernel), a step-wise LR schedule and norm clipping: masters, moments, step counters and
    the schedule must all come back exactly.
    """
    torch.manual_seed(0)
    straight = LM("adamw", batch_by_step=True)
    ckpt_dir = tmp_path / "ckpts"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer(steps=6, gradient_clip_val=0.5, callbacks=[saver], enable_checkpointing=True).fit(
        straight, DataLoader(Batches(8), batch_size=2)
    )
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step=3.ckpt", "step=6.ckpt"]  # atomic: no temp files left
    ckpt = ckpt_dir / "step=3.ckpt"

    saved = torch.load(ckpt, weights_only=False)
    assert all(v.dtype == torch.float32 for v in saved["state_dict"].values() if v.is_floating_point())
    assert all(s["exp_avg"].device.type == "cpu" for s in saved["optimizer_states"][0]["state"].values())
    plain = CausalLMModule(model_type="gpt2", config=TINY)
    plain.load_state_dict(saved["state_dict"])  # a plain fp32 module loads the weights

    out = tmp_path / "resumed.pt"
    script = RESUME_SCRIPT.format(root=str(ROOT), ckpt=str(ckpt), out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"global_step": 6}
    resumed = torch.load(out)
    for name, p in straight.named_parameters():
        assert torch.equal(p.detach(), resumed[name]), name


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_optimizer_in_backward_matches_the_normal_step(kind, transfer_mode):
    torch.manual_seed(0)
    normal = LM(kind)
    in_backward = copy.deepcopy(normal)
    data = Batches(8)
    trainer(steps=4).fit(normal, DataLoader(data, batch_size=2))
    t = trainer(strategy=OffloadStrategy(optimizer_in_backward=True), steps=4)
    t.fit(in_backward, DataLoader(data, batch_size=2))
    for (name, a), b in zip(normal.named_parameters(), in_backward.parameters()):
        assert torch.equal(a, b), name
    assert_copies_were_deferred(transfer_mode)


def test_optimizer_in_backward_value_clipping_matches_the_normal_step():
    torch.manual_seed(0)
    normal = LM("sgd")
    in_backward = copy.deepcopy(normal)
    data = Batches(6)
    kwargs = {"steps": 3, "gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value"}
    trainer(**kwargs).fit(normal, DataLoader(data, batch_size=2))
    trainer(strategy=OffloadStrategy(optimizer_in_backward=True), **kwargs).fit(in_backward, DataLoader(data, batch_size=2))
    for (name, a), b in zip(normal.named_parameters(), in_backward.parameters()):
        assert torch.equal(a, b), name


class SwapOptimizer(Callback):
    """What LowBitOptimizer does: build a new optimizer over the strategy's param groups (the masters) in on_fit_start."""

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        old = strategy.optimizers[0]
        keep = ("params", "lr", "initial_lr", "weight_decay")
        new = torch.optim.SGD([{k: g[k] for k in keep} for g in old.param_groups], momentum=0.9)
        for config in strategy.lr_scheduler_configs:
            config.scheduler.optimizer = new
        strategy.optimizers = [new]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")
@pytest.mark.parametrize("in_backward", [False, True])
def test_optimizer_swapped_in_on_fit_start_is_the_one_that_steps(in_backward):
    torch.manual_seed(0)
    reference = LM("sgd")
    swapped = copy.deepcopy(reference)
    swapped.opt = "adamw"  # configure_optimizers returns AdamW; the callback replaces it with the reference's SGD
    data = Batches(6)
    trainer(steps=3).fit(reference, DataLoader(data, batch_size=2))
    strategy = OffloadStrategy(optimizer_in_backward=in_backward)
    trainer(strategy=strategy, steps=3, callbacks=[SwapOptimizer()]).fit(swapped, DataLoader(data, batch_size=2))
    for (name, a), b in zip(reference.named_parameters(), swapped.parameters()):
        assert torch.equal(a, b), name


class ManualLM(LM):
    def __init__(self) -> None:
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss_sum, n = self.loss_sum_and_tokens(batch)
        opt.zero_grad()
        self.manual_backward(loss_sum / n)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()


def test_manual_optimization_matches_automatic():
    torch.manual_seed(0)
    manual = ManualLM()
    automatic = LM("sgd")
    automatic.load_state_dict(manual.state_dict())
    data = Batches(6)
    trainer(steps=3, gradient_clip_val=0.5).fit(automatic, DataLoader(data, batch_size=2))
    trainer(steps=3).fit(manual, DataLoader(data, batch_size=2))
    for (name, a), b in zip(automatic.named_parameters(), manual.parameters()):
        assert torch.equal(a, b), name


def test_what_the_device_keeps_and_what_the_user_gets_back():
    torch.manual_seed(0)
    module = LM("adamw")
    before = copy.deepcopy(module.state_dict())
    seen = {}

    class Inspect(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen["dtypes"] = {p.dtype for p in pl_module.parameters()}
            seen["device_grads"] = [p.grad for p in pl_module.parameters() if p.grad is not None]

        def on_train_batch_end(self, trainer, pl_module, *args):
            # NOTE: the module's parameters hold the compute weights here; the strategy's view shows the fp32 masters
            # with their gradients (as plain Lightning's fp32 parameters); a breakdown taken inside still counts what
            # the device holds
            strategy = trainer.strategy
            seen["compute"] = {(p.dtype, p.grad is not None) for p in pl_module.parameters()}
            with strategy.masters_view(grads=True):
                seen["shown"] = {(p.dtype, p.grad is not None) for p in pl_module.parameters()}
                seen["breakdown"] = strategy.memory_breakdown().to_dict()
            seen["numel"] = sum(p.numel() for p in strategy.masters.values())

    t = trainer(steps=2, callbacks=[Inspect()])
    t.fit(module, DataLoader(Batches(4), batch_size=2))
    assert seen["dtypes"] == {torch.bfloat16} and seen["device_grads"] == []
    assert seen["compute"] == {(torch.bfloat16, False)} and seen["shown"] == {(torch.float32, True)}
    n, mb = seen["numel"], seen["breakdown"]
    assert mb["device"]["gradients"] == 0 and mb["device"]["optimizer_state"] == 0
    assert mb["host"]["optimizer_state"] >= 12 * n  # fp32 masters + AdamW's two fp32 moments
    assert mb["host"]["gradients"] == 4 * n
    # after fit: an fp32 module, its optimizer pointing at the module's own parameters
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    opt = t.optimizers[0]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in module.parameters()}
    assert not all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    # validate only: weights come back bit for bit (masters are kept for the run, the module is cast back)
    after_fit = copy.deepcopy(module.state_dict())
    trainer(steps=1).validate(module, DataLoader(Batches(2), batch_size=2), verbose=False)
    assert all(torch.equal(after_fit[k], v) for k, v in module.state_dict().items())
