"""The dry run per module: ``MemoryReport``'s prediction (the dry run of the same run on fake tensors) against its
own measurement of the real ``Trainer.fit``, device and host, for plain fp32 and for the founding recipe
(``lowmem_offload`` bf16-true with ``ActivationCheckpointing("all")``).

Verdict ``ok`` (within ``BOUND``), ``bound`` (above the measured peak by more than ``BOUND``, from sizes the dry run
states it took at their upper bound for data-dependent ops: the estimate's ``bounds``, e.g. a mixture of experts'
routing taken as every token to every expert; below the measured peak it is ``off`` all the same), ``off`` (further), ``refused`` (the dry run named an op and the model's line it
cannot run: ``DryRunUnsupportedError``), ``crash`` (the prediction failed otherwise) or ``n/a`` (the real run itself
refuses or fails: the cells of the sweep judge that).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import lightning as L

from tests.conformance.cell import STEPS, _message
from tests.conformance.corpus import ModuleSpec

BOUND = 0.01
CONFIGS = ("plain@32-true", "lowmem_offload@bf16-true+ckpt(all)")


def _run(spec: ModuleSpec, config: str, save_dir: str) -> Any:
    from lightning_lowmem import ActivationCheckpointing, MemoryReport

    report = MemoryReport(every_n_steps=1, plot=False, save_dir=save_dir)
    kwargs: dict[str, Any] = {}
    if config != "plain@32-true":
        kwargs = {"strategy": "lowmem_offload", "precision": "bf16-true"}
    callbacks = [ActivationCheckpointing("all")] if "ckpt" in config else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=STEPS, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=save_dir, callbacks=[*callbacks, report], **kwargs)
    L.seed_everything(1, verbose=False)
    module = spec.build()
    trainer.fit(module, train_dataloaders=_first_batch_repeated(module))
    return report


def _first_batch_repeated(module: L.LightningModule) -> Any:
    """The module's first training batch, ``STEPS`` times: what ``MemoryReport`` predicts is a step on the run's first
    batch, so every measured step runs on it. NOTE: batches of other sizes (variable-length sequences: ``lstm_packed``,
    whose third batch holds 70,088 bytes of activations at its peak against 66,640 for its first) peak elsewhere:
    the batch differs, not the dry run."""
    from torch.utils.data import DataLoader

    first = next(iter(module.train_dataloader()))
    return DataLoader([first] * STEPS, batch_size=None)


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else (0.0 if predicted == 0 else float("inf"))


def check(spec: ModuleSpec, config: str) -> dict[str, Any]:
    """One dry-run row of the results."""
    started = time.perf_counter()
    row: dict[str, Any] = {"module": spec.name, "flag": f"dry_run:{config}", "kind": "dry_run"}
    with tempfile.TemporaryDirectory(prefix="conformance-dry-") as tmp:
        try:
            report = _run(spec, config, tmp)
        except Exception as err:  # noqa: BLE001 - a run that fails (the cells judge it) has no peak to predict
            row.update(verdict="n/a", detail=f"the run itself fails: {_message(err, 300)}")
            row["seconds"] = round(time.perf_counter() - started, 2)
            return row
    predicted = report.predicted or {}
    if "error" in predicted:
        unsupported = predicted["error"].startswith("DryRunUnsupportedError")
        row.update(verdict="refused" if unsupported else "crash", detail=predicted["error"][:500])
    else:
        worst = max(report.steps, key=lambda r: r["peak_bytes"])
        steady_host = max((r["peak_bytes_host"] for r in report.steps if r["window"] >= 1), default=0)
        device, host = predicted["peak_device"], predicted["peak_host"]
        err_device, err_host = _error(device, worst["peak_bytes"]), _error(host, steady_host)
        # NOTE: host peaks of a few KiB (Lightning's scalars) are compared within 1 KiB, as the package's tests do
        host_ok = abs(err_host) <= BOUND or abs(host - steady_host) <= 1024
        row.update(predicted_device=device, measured_device=worst["peak_bytes"], error_device=round(err_device, 6),
                   predicted_host=host, measured_host=steady_host, error_host=round(err_host, 6))
        ok = abs(err_device) <= BOUND and host_ok
        bounded = not ok and bool(predicted.get("bounds")) and err_device > 0 and host_ok
        detail = (f"device {device} predicted vs {worst['peak_bytes']} measured ({err_device:+.3%}); "
                  f"host {host} vs {steady_host} ({err_host:+.3%})")
        if bounded:
            detail += "; an upper bound, stated: " + "; ".join(f"{b['op']}: {b['assumption']}" for b in predicted["bounds"])
        row.update(verdict="ok" if ok else "bound" if bounded else "off", detail=detail[:500])
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row
