"""Predicted (dry run) vs measured peak memory on modules users bring: recurrent nets, an MSE autoencoder, a conv +
batch-norm net and a classifier updating torchmetrics metrics in ``training_step`` (``tests/memory/_modules.py``).

"Measured" is a real ``Trainer.fit`` of three steps under ``MemoryReport`` (``MemoryTracker``: live tensor storage by
phase and role, CPU); "predicted" is the report's own prediction of the same run (``dry_run`` of the module and its
first batch on fake tensors), plain fp32 and ``lowmem_offload`` (bf16 weights on the device, fp32 masters on the
host). The ``uncorrected`` columns run the same dry run with torch's fake kernels as shipped and without the bounds
for data-dependent ops (``lightning_lowmem.predict.kernels`` and ``predict.data_dependent`` switched off): what the
prediction was before they existed.

    python benchmarks/run.py estimate_foreign            # every module at scale 4
    python benchmarks/run.py estimate_foreign --quick    # scale 1
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import bench_trainer, write_results

MiB = 2**20


def _runs() -> dict[str, Any]:
    from lightning_lowmem.predict.run_spec import RunSpec

    return {"fp32": RunSpec(), "lowmem_offload bf16": RunSpec(strategy="lowmem_offload", precision="bf16-true")}


def measure(name: str, scale: int, run_name: str) -> dict[str, Any]:
    from lightning_lowmem import MemoryReport
    from lightning_lowmem.predict.dry_run import _Repeat, dry_run
    from tests.memory._modules import make

    module, batch = make(name, scale)
    report = MemoryReport(every_n_steps=1, plot=False, save_dir=tempfile.mkdtemp(prefix="lowmem-bench-"))
    kwargs = _runs()[run_name].trainer_kwargs()
    trainer = bench_trainer(max_steps=3, limit_val_batches=0, **{**kwargs, "callbacks": [*kwargs["callbacks"], report]})
    trainer.fit(module, train_dataloaders=_Repeat(batch))
    worst = max(report.steps, key=lambda r: r["peak_bytes"])
    host = max(r["peak_bytes_host"] for r in report.steps if r["window"] >= 1)
    predicted = report.predicted
    row: dict[str, Any] = {"module": name, "run": run_name, "params": sum(p.numel() for p in module.parameters()),
                           "measured_MiB": worst["peak_bytes"] / MiB, "measured_host_MiB": host / MiB}
    if "error" in predicted:
        row["predicted_MiB"] = row["error_%"] = None
        row["notes"] = predicted["error"][:200]
    else:
        row["predicted_MiB"] = predicted["peak_device"] / MiB
        row["predicted_host_MiB"] = predicted["peak_host"] / MiB
        row["error_%"] = round(100 * (predicted["peak_device"] / worst["peak_bytes"] - 1), 3)
        row["host_error_%"] = round(100 * (predicted["peak_host"] / host - 1), 3) if host else 0.0
        row["bounds"] = len(predicted.get("bounds", []))
        row["corrections"] = "; ".join(n.split(":")[0] for n in predicted["notes"] if "fake kernel corrected" in n)
    # the same dry run with torch's fake kernels as shipped and no bounds for data-dependent ops
    from unittest import mock

    from lightning_lowmem.predict import data_dependent as _data_dependent
    from lightning_lowmem.predict import kernels as _kernels

    fresh, batch = make(name, scale)
    try:
        with (mock.patch.object(_kernels.KernelMatch, "handles", staticmethod(lambda func: False)),
              mock.patch.object(_data_dependent.DataDependent, "handles", lambda self, func: False)):
            est = dry_run(fresh, batch=batch, run=_runs()[run_name])
        row["uncorrected_MiB"] = est.peak_device / MiB
        row["uncorrected_error_%"] = round(100 * (est.peak_device / worst["peak_bytes"] - 1), 2)
    except Exception as err:  # noqa: BLE001 - a refusal is the figure here
        row["uncorrected_MiB"] = None
        row["uncorrected_error_%"] = "refused: " + str(err).split("`")[1] if "`" in str(err) else type(err).__name__
    t0 = time.perf_counter()
    dry_run(make(name, scale)[0], batch=batch, run=_runs()[run_name])
    row["dry_run_s"] = round(time.perf_counter() - t0, 2)
    return row


def main(argv: list[str]) -> None:
    # NOTE: RSS should stay near the tensor bytes between real runs (glibc keeps freed chunks otherwise)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    warnings.filterwarnings("ignore")
    import logging

    for logger in ("lightning", "lightning.pytorch", "lightning_lowmem"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    from tests.memory._modules import MODULES

    quick = "--quick" in argv
    scale = 1 if quick else 4
    torch.set_num_threads(2)
    rows = [measure(name, scale, run) for name in MODULES for run in _runs()]
    traced = [r for r in rows if r["error_%"] is not None]
    worst = max(abs(r["error_%"]) for r in traced) if traced else None
    write_results(
        "estimate_foreign" + ("_quick" if quick else ""), rows,
        ["module", "run", "params", "predicted_MiB", "measured_MiB", "error_%", "predicted_host_MiB",
         "measured_host_MiB", "host_error_%", "uncorrected_MiB", "uncorrected_error_%", "bounds", "corrections",
         "dry_run_s"],
        title=f"Dry run vs measured Trainer.fit on foreign modules (CPU, dry run; sizes x{scale})",
        notes=[
            f"Worst device-peak error of the dry run: {worst} % over {len(traced)} of {len(rows)} runs (target: 1 %).",
            ("Measured: Trainer.fit (3 steps) under MemoryReport (live tensor storage on CPU, not RSS), the step with "
             "the highest device peak; host: the steady-state (second step on) host peak. Predicted: MemoryReport's "
             "dry run of the same run and first batch."),
            ("uncorrected: the same dry run with torch's fake kernels as shipped (no oneDNN LSTM workspace, one "
             "tensor for both RNN bias gradients, 4-byte losses without their unreduced buffer) and no sizes for "
             "data-dependent ops of fake values (unique, bincount, boolean indexing of predictions are refused)."),
            ("bounds: data-dependent ops of fake values run at a stated bound (torchmetrics' unique() of the "
             "predictions: one distinct value, storage counted at the upper bound; bincount: minlength bins), listed "
             "in the estimate's `bounds`."),
            "dry_run_s: one dry run (two traced steps) on 2 CPU cores, wall time.",
        ],
        extra={"scale": scale},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
