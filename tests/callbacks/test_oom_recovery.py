"""Out-of-memory recovery (``AccumulationScheduler(on_oom="split")``, ``OOMRecovery``) through ``Trainer.fit``.

The error is injected as ``torch.OutOfMemoryError`` (the class torch raises on CUDA) whenever a micro-batch larger
than a limit runs: from inside the forward (a block's forward hook, after part of the graph exists) or from inside
the backward (a hook on the gradient of the logits: before any parameter's gradient; or of the first block's
output: after the later blocks', the final norm's, but not the tied embedding's gradients were accumulated).
Every recovered run is compared with a run that used the smaller micro-batch from the start.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch

import lightning_lowmem  # noqa: F401  (registers "lowmem_offload")
from lightning_lowmem.callbacks.accumulation.oom_split import MicroBatchOutOfMemoryError, split_batch
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.oom_recovery import OOMRecovery
from tests.callbacks.test_accumulation_integration import (
    ListData,
    assert_close_rel,
    fit_kwargs,
    make_module,
    padded_samples,
)
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration

# fp32: the split changes the order of additions only for parameters whose gradient the failed backward had
# completed (their whole micro-batch's gradient is kept, instead of the sum of the halves'): relative error in norm
# of that step's gradients. AdamW divides by sqrt(v) and so amplifies such differences on near-zero elements:
# later steps' gradients and the weights get a looser bound (ATOL_WEIGHTS is 1/10 of the learning rate 1e-3)
FP32_RTOL = 1e-5
LATER_RTOL = 1e-4
ATOL_WEIGHTS = 1e-4


class InjectOOM(L.Callback):
    """Raise ``torch.OutOfMemoryError`` when a micro-batch of more than ``limit`` samples runs, from step ``after``."""

    def __init__(self, limit: int, where: str = "forward", after: int = 0) -> None:
        self.limit, self.where, self.after = limit, where, after
        self.raised = 0
        self.active = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        target = {"forward": model.transformer.h[0], "middle": model.transformer.h[0], "logits": model.lm_head}[self.where]
        target.register_forward_hook(self._forward_hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.active = trainer.global_step >= self.after

    def _raise(self, *args: Any) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 MiB (injected, {self.where})")

    def _forward_hook(self, module: Any, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if not (self.active and torch.is_grad_enabled() and out.size(0) > self.limit):
            return
        if self.where == "forward":
            self._raise()
        out.register_hook(self._raise)


class SeenOrder(L.Callback):
    """The samples of every *completed* forward of the model, in order (a failed forward never completes)."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def seen(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            self.ids.append(kwargs["input_ids"].detach().clone())

        pl_module.model.register_forward_hook(seen, with_kwargs=True)


class Record(L.Callback):
    """What each optimizer step was built from, and what was logged."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        params = getattr(trainer.strategy, "masters", None) or dict(pl_module.named_parameters())
        self.grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append(trainer.global_step)
        self.losses.append(float(outputs["loss"]))


def logging_module(mode: str, warmup: int = 3) -> Any:
    """``make_module`` whose ``self.log`` calls that reach Lightning are recorded (name, value), with an LR warm-up."""
    module = make_module(mode)
    module.hparams.warmup_steps = warmup
    module.logged = []
    log = module.log

    def counting(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        module.logged.append((name, float(value)))
        log(name, value, *args, **kwargs)

    module.log = counting  # NOTE: the splitter shadows it while a chunk runs, and calls it once per batch
    return module


def fit(mode: str, samples: list, steps: int, callback: L.Callback, inject: InjectOOM | None = None,
        module: Any = None, batch_size: int = 1, extra: list | None = None,
        **trainer_kwargs: Any) -> tuple[Any, Any, Record, L.Trainer]:
    module = module if module is not None else make_module(mode)
    module0 = copy.deepcopy(module)
    record = Record()
    trainer_kwargs.setdefault("precision", "32-true")
    trainer = L.Trainer(max_steps=steps, callbacks=[callback, record, *([inject] if inject else []), *(extra or [])],
                        **fit_kwargs(**trainer_kwargs))
    trainer.fit(module, ListData(samples, batch_size))
    return module0, module, record, trainer


def weights(module: Any, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    masters = getattr(trainer.strategy, "masters", None)
    return {n: p.detach().clone() for n, p in (masters or dict(module.named_parameters())).items()}


def assert_close_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=ATOL_WEIGHTS, msg=name)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name} differs by {(got[name] - w).abs().max():.3e}"


def test_split_batch_slices_every_batch_tensor():
    batch = {"x": torch.arange(10).view(5, 2), "scalar": torch.tensor(3.0), "name": "a"}
    pieces = split_batch(batch, 3)
    assert [p["x"].shape[0] for p in pieces] == [3, 2]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), batch["x"]) and pieces[1]["name"] == "a"
    assert all(p["scalar"] is batch["scalar"] for p in pieces)


@pytest.mark.parametrize("mode", ["samples", "tokens"])
def test_forward_oom_equals_the_smaller_micro_batch_from_the_start(mode):
    # windows of 16 in loader micro-batches of 8; every micro-batch of more than 4 runs out of memory in forward
    samples = padded_samples(48)
    inject, order = InjectOOM(limit=4, where="forward"), SeenOrder()
    module0, module, record, trainer = fit(
        mode, samples, 3, AccumulationScheduler(16, 8, loss_normalization=mode, on_oom="split"), inject,
        extra=[order],
    )
    _, ref_module, ref, ref_trainer = fit(
        mode, samples, 3, AccumulationScheduler(16, 4, loss_normalization=mode), module=copy.deepcopy(module0)
    )
    callback = trainer.callbacks[0]
    assert inject.raised == 1  # the first micro-batch; every later one ran split to 4 from the start
    assert callback.oom_recoveries == 1 and callback._splitter.piece == 4
    assert len(record.grads) == len(ref.grads) == 3
    for got, want in zip(record.grads, ref.grads):
        assert_equal(got, want)
    assert_equal(weights(module, trainer), weights(ref_module, ref_trainer))
    assert record.lrs == ref.lrs and trainer.global_step == ref_trainer.global_step == 3
    assert callback.last_window.samples == 16 and callback.last_window.micro_batches == 4
    # data order: every sample once, in the loader's order, in micro-batches of 4
    assert [len(ids) for ids in order.ids] == [4] * 12
    assert torch.equal(torch.cat(order.ids), torch.stack([s["input_ids"] for s in samples]))


@pytest.mark.parametrize("where", ["logits", "middle"])
def test_backward_oom_keeps_every_sample_once(where, mode="tokens"):
    samples = padded_samples(32)
    inject = InjectOOM(limit=4, where=where)
    module0, module, record, trainer = fit(
        mode, samples, 2, AccumulationScheduler(16, 8, loss_normalization=mode, on_oom="split"), inject
    )
    _, ref_module, ref, ref_trainer = fit(
        mode, samples, 2, AccumulationScheduler(16, 4, loss_normalization=mode), module=copy.deepcopy(module0)
    )
    assert inject.raised == 1 and trainer.callbacks[0].last_window.samples == 16
    if where == "logits":  # raised before any parameter's gradient: the halves compute all of them
        for got, want in zip(record.grads, ref.grads, strict=True):
            assert_equal(got, want)
        assert_equal(weights(module, trainer), weights(ref_module, ref_trainer))
    else:  # the later blocks' gradients are the failed micro-batch's own (another order of fp32 additions)
        assert_close_rel(record.grads[0], ref.grads[0], rtol=FP32_RTOL)
        assert_close_rel(record.grads[1], ref.grads[1], rtol=LATER_RTOL)
        assert_close_weights(weights(module, trainer), weights(ref_module, ref_trainer))
        assert any(not torch.equal(record.grads[0][n], ref.grads[0][n]) for n in ref.grads[0])  # it did take that path


def test_one_loss_logged_per_batch_and_the_schedule_unchanged(mode="tokens"):
    # OOMRecovery (no accumulation): batches of 8, the forward of more than 2 runs out of memory (8 -> 4 -> 2)
    samples = padded_samples(24)
    inject = InjectOOM(limit=2, where="forward")
    _, module, record, trainer = fit(
        mode, samples, 3, OOMRecovery(loss_normalization=mode), inject, module=logging_module(mode), batch_size=8
    )
    _, clean_module, clean, clean_trainer = fit(
        mode, samples, 3, OOMRecovery(loss_normalization=mode), module=logging_module(mode), batch_size=8
    )
    names = [n for n, _ in module.logged]
    assert names.count("train_loss") == 3  # one per batch (each ran as four chunks)
    assert inject.raised == 2 and trainer.callbacks[0]._splitter.piece == 2
    got = [v for n, v in module.logged if n == "train_loss"]
    want = [v for n, v in clean_module.logged if n == "train_loss"]
    assert got == pytest.approx(want, rel=1e-6)  # the token mean over the whole batch, as without the error
    assert record.losses == pytest.approx(clean.losses, rel=1e-6)
    assert record.lrs == clean.lrs and len(set(record.lrs)) == 3  # the warm-up went on step by step
    assert trainer.global_step == clean_trainer.global_step == 3
    assert_close_rel(record.grads[0], clean.grads[0], rtol=FP32_RTOL)  # chunks' sums vs one batch's: fp32 order
    for g, w in zip(record.grads[1:], clean.grads[1:], strict=True):
        assert_close_rel(g, w, rtol=LATER_RTOL)


def test_oom_recovery_equals_accumulation_of_halves(mode="samples"):
    samples = padded_samples(32)
    inject = InjectOOM(limit=4, where="middle")
    module0, module, record, trainer = fit(mode, samples, 4, OOMRecovery(mode, regrow_after=1), inject, batch_size=8)
    _, ref_module, ref, ref_trainer = fit(
        mode, samples, 4, AccumulationScheduler(8, 4, loss_normalization=mode), module=copy.deepcopy(module0)
    )
    # regrow_after=1: step 1 splits 8 into 4 + 4, step 2 runs at 4 without error, so step 3 tries 8 again, fails in
    # backward again and splits; step 4 is clean at 4 and the size grows back to the loader's 8
    callback = trainer.callbacks[0]
    assert inject.raised == 2 and callback.oom_recoveries == 2 and callback._splitter.piece is None
    assert_close_rel(record.grads[0], ref.grads[0], rtol=FP32_RTOL)
    for got, want in zip(record.grads[1:], ref.grads[1:], strict=True):
        assert_close_rel(got, want, rtol=LATER_RTOL)
    assert_close_weights(weights(module, trainer), weights(ref_module, ref_trainer))


def test_under_lowmem_offload_host_buffers_keep_the_completed_micro_batches(mode="tokens"):
    samples = padded_samples(32)
    inject = InjectOOM(limit=4, where="forward")
    kwargs = {"strategy": "lowmem_offload", "precision": "32-true"}
    module0, module, record, trainer = fit(
        mode, samples, 2, AccumulationScheduler(16, 8, loss_normalization=mode, on_oom="split"), inject, **kwargs
    )
    _, ref_module, ref, ref_trainer = fit(
        mode, samples, 2, AccumulationScheduler(16, 4, loss_normalization=mode), module=copy.deepcopy(module0), **kwargs
    )
    assert inject.raised == 1
    for got, want in zip(record.grads, ref.grads, strict=True):
        assert_equal(got, want)
    assert_equal(weights(module, trainer), weights(ref_module, ref_trainer))

    # a failed backward in the second micro-batch of a window: the host buffers hold the first one's gradients
    inject = InjectOOM(limit=4, where="middle", after=1)
    module0, module, record, trainer = fit(
        mode, samples, 2, AccumulationScheduler(16, 8, loss_normalization=mode, on_oom="split"), inject,
        module=copy.deepcopy(module0), **kwargs
    )
    assert inject.raised == 1
    # step 1 ran at 8, step 2 at 4 after the error: compare with the same micro-batches, run without error
    want = _second_step_grads(module0, samples, mode, kwargs)
    assert_close_rel(record.grads[1], want, rtol=FP32_RTOL)
    assert any(not torch.equal(record.grads[1][n], want[n]) for n in want)  # some were the failed backward's own


def _second_step_grads(module0: Any, samples: list, mode: str, kwargs: dict) -> dict[str, torch.Tensor]:
    class Switch(AccumulationScheduler):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # step 1 whole, step 2 split to 4
            if trainer.global_step == 1 and self._splitter.piece is None:
                self._splitter.piece = 4
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    _, _, record, _ = fit(mode, samples, 2, Switch(16, 8, loss_normalization=mode, on_oom="split"),
                          module=copy.deepcopy(module0), **kwargs)
    return record.grads[1]


def test_one_sample_that_does_not_fit_saves_the_last_step_and_resumes(tmp_path, mode="samples"):
    samples = padded_samples(32)
    inject = InjectOOM(limit=0, where="middle", after=1)  # from the second step, nothing fits
    module = make_module(mode)
    record = Record()
    callback = OOMRecovery(mode)
    trainer = L.Trainer(max_steps=4, callbacks=[callback, record, inject],
                        **fit_kwargs(precision="32-true", default_root_dir=tmp_path))
    with pytest.raises(MicroBatchOutOfMemoryError, match=r"a micro-batch of 1 sample runs out of memory in the "
                       r"backward .*Saved the last completed step \(global step 1\) to .*oom-emergency.ckpt"):
        trainer.fit(module, ListData(samples, batch_size=4))
    path = tmp_path / "oom-emergency.ckpt"
    assert path.is_file() and not list(tmp_path.glob(".*tmp*"))
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == 1
    # the weights of the last completed step (the failed window's partial gradients never stepped)
    assert_equal({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")},
                 module.model.state_dict())

    resumed = make_module(mode)
    trainer = L.Trainer(max_steps=3, callbacks=[OOMRecovery(mode)], **fit_kwargs(precision="32-true"))
    trainer.fit(resumed, ListData(samples, batch_size=4), ckpt_path=path)
    assert trainer.global_step == 3
    assert trainer.callbacks[0]._splitter.piece == 1  # the smaller micro-batch came back with the checkpoint


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on_oom": "retry"}, ValueError, r"`on_oom='retry'`; expected 'split', 'raise' or None"),
        ({"regrow_after": 0}, ValueError, r"`regrow_after=0` must be a positive int"),
        # a wrong type among them: a TypeError, naming both
        ({"regrow_after": 1.5, "on_oom": "x"}, TypeError, r"`regrow_after=1.5`.*`on_oom='x'`"),
    ],
)
def test_bad_arguments_are_repeated_back(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumulationScheduler(16, 8, **kwargs)


def test_oom_recovery_bad_arguments():
    with pytest.raises(TypeError, match=r"OOMRecovery: `loss_normalization='mean'`.*`regrow_after=True`"):  # a type among them
        OOMRecovery("mean", regrow_after=True)


def test_default_is_split_for_auto_only():
    trainer = L.Trainer(**fit_kwargs())
    for micro, split in (("auto", True), (8, False)):
        callback = AccumulationScheduler(16, micro, memory_budget=10**9)
        callback._engine = False
        callback._check_on_oom(trainer)
        assert (callback._splitter is not None) is split


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_refused_where_it_cannot_recover():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=2), logger=False)
    with pytest.raises(ValueError, match=r"OOMRecovery: `on_oom='split'` is not available with DeepSpeed"):
        OOMRecovery().setup(trainer, make_module("samples"), "fit")
    trainer = L.Trainer(**fit_kwargs(accumulate_grad_batches=2))
    with pytest.raises(ValueError, match=r"OOMRecovery is for runs without accumulation"):
        OOMRecovery().setup(trainer, make_module("samples"), "fit")


def test_memory_report_names_the_recoveries():
    from types import SimpleNamespace

    from lightning_lowmem.report.memory_report import _oom_line

    quiet = SimpleNamespace(callbacks=[SimpleNamespace(oom_recoveries=0)])
    assert _oom_line(quiet) == ""
    recovered = SimpleNamespace(callbacks=[object(), SimpleNamespace(oom_recoveries=2, oom_bytes_freed=3 * 2**20,
                                                                     oom_micro_batch=4)])
    assert _oom_line(recovered) == ("\nout-of-memory recoveries: 2 (micro-batches split to 4; 3.00 MiB returned by "
                                    "empty_cache)")
