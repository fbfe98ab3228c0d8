"""LoRA adapters (``Adapters``) against full fine-tuning: predicted memory at LLaMA scale, CPU step time.

Part 1 (dry run, CUDA target): ``estimate_memory("llama-7b"/"llama-70b", 1, 2048, precision="bf16-true",
checkpointing="all")`` (the shipped shapes; the dry run traces the real ``Trainer.fit`` on fake tensors and
extrapolates over depth) with and without ``Adapters("lora", r=16, alpha=32, target_modules="all-linear")``, on one
device and under ``lowmem_offload`` (frozen base weights have no fp32 host master: the host holds the adapters'
masters, gradients and optimizer state). For LLaMA-70B also the low-memory QLoRA recipe: checkpointing, activation
offload at the block boundaries, a chunked loss, and the base streamed (``lowmem_offload_params``) or resident.

The 4-bit (nf4) base is traced like the bf16 one: bitsandbytes' own ``Linear4bit`` and quantize op run on fake
weights (the dry run's stand-in for ``Params4bit``, which cannot wrap a fake tensor, is a plain parameter carrying the
same ``quant_state``); the packed bytes and their quantization state count as weights.

Part 2 (CPU): one small LLaMA, fp32, batch 2 x 128, the same data; full fine-tuning, LoRA and QLoRA (nf4 base)
alternated run by run in one process (so the shared machine's load hits all alike); median step time of the last
steps of each run.

    python benchmarks/run.py adapters            # both parts
    python benchmarks/run.py adapters --quick    # 7B only, fewer CPU steps
    python benchmarks/run.py adapters --step-time-only  # part 2 only
    python benchmarks/run.py adapters --memory-only     # part 1 only
    ... --reuse-single-device  # keep the results file's single-device rows (not lowmem_offload's code), dated
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import fmt_bytes, write_results

GiB = 2**30
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}


def _row(shape: str, label: str, strategy: str, callbacks: list[Any], **flags: Any) -> dict[str, Any]:
    from lightning_lowmem import estimate_memory

    t0 = time.perf_counter()
    est = estimate_memory(shape, 1, 2048, precision="bf16-true", callbacks=callbacks, target="cuda",
                          strategy=strategy, **flags)
    opt = est.phases["optimizer"]
    row = {
        "model": shape, "run": label, "strategy": strategy if strategy != "auto" else "single device",
        "figure": "dry run (CUDA target)", "peak_device": est.peak_device, "peak_host": est.peak_host,
        "device_weights": opt.device["weights"], "device_gradients": opt.device["gradients"],
        "device_optimizer_state": opt.device["optimizer_state"], "host_total": opt.host and sum(opt.host.values()),
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_device_h": fmt_bytes(est.peak_device), "peak_host_h": fmt_bytes(est.peak_host),
    }
    print(row, flush=True)
    return row


def _previous_single_device() -> dict[tuple[str, str], dict[str, Any]]:
    """``--reuse-single-device``: the single-device rows of the results file, labelled with their date."""
    import json

    previous = json.loads((Path(__file__).parent / "results" / "adapters.json").read_text())
    # NOTE: a row already re-used keeps the date of the run that measured it
    return {(r["model"], r["run"]): {**r, "figure": r["figure"] if "from the run of" in r["figure"]
                                     else f"{r['figure']}, from the run of {previous['date'][:16]}"}
            for r in previous["rows"] if r["strategy"] == "single device" and r["wall_s"] is not None}


def memory_rows(shapes: list[str], reuse_single_device: bool = False) -> list[dict[str, Any]]:
    from lightning_lowmem import ActivationCheckpointing, ActivationOffload, Adapters, ChunkedLMLoss

    previous = _previous_single_device() if reuse_single_device else {}
    rows = []
    for shape in shapes:
        for label, offload, adapters in [("full fine-tune", False, None), ("full fine-tune", True, None),
                                         ("LoRA r=16 all-linear", False, {}), ("LoRA r=16 all-linear", True, {}),
                                         ("QLoRA nf4 base r=16", False, {"quantize_base": "nf4"})]:
            callbacks = [ActivationCheckpointing("all"), *([Adapters("lora", **LORA, **adapters)]
                                                            if adapters is not None else [])]
            # NOTE: a single-device run does not touch lowmem_offload's code: its previous figure may be re-used
            kept = previous.get((shape, label)) if not offload else None
            rows.append(kept or _row(shape, label, "lowmem_offload" if offload else "auto", callbacks))
        if shape != "llama-70b":
            continue
        # the low-memory QLoRA recipe: checkpointing + boundary activation offload + chunked loss
        for strategy, what in [("lowmem_offload_params", "streamed"), ("lowmem_offload", "resident")]:
            for quant in [None, "nf4"]:
                callbacks = [ActivationCheckpointing("all"), ActivationOffload(), ChunkedLMLoss(chunk_tokens=128),
                             Adapters("lora", **LORA, quantize_base=quant)]
                name = "LoRA r=16, bf16 base" if quant is None else "QLoRA r=16, nf4 base"
                rows.append(_row(shape, f"{name} {what}, ckpt + act. offload + chunked loss", strategy, callbacks))
    return rows


def step_time_rows(runs: int, steps: int) -> list[dict[str, Any]]:
    import lightning as L

    from lightning_lowmem import Adapters
    from lightning_lowmem.demo.module import CausalLMModule

    config = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 258}

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 128), generator=g)
    data = [{"input_ids": ids[0], "attention_mask": torch.ones_like(ids[0]), "labels": ids[0]}] * 64
    # NOTE: the three runs side by side in one process, alternated run by run (the shared machine's load hits all)
    adapters = {"full fine-tune": None, "LoRA r=16 all-linear": {}, "QLoRA nf4 base, LoRA r=16 all-linear":
                {"quantize_base": "nf4"}}
    times: dict[str, list[float]] = {label: [] for label in adapters}
    for _ in range(runs):
        for label, extra in adapters.items():
            torch.manual_seed(0)
            module = CausalLMModule(model_type="llama", config=config)
            timer = Timer()
            cbs = [timer] + ([Adapters("lora", **LORA, **extra)] if extra is not None else [])
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=cbs, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
            times[label] += timer.times[2:]  # NOTE: the first steps allocate the optimizer state
    full = statistics.median(times["full fine-tune"])
    n = sum(p.numel() for p in CausalLMModule(model_type="llama", config=config).parameters())
    return [{"model": f"LLaMA 4 x 256 ({n / 1e6:.1f} M params)", "run": label, "figure": "CPU", "median_step_s": statistics.median(t),
             "vs_full": statistics.median(t) / full, "steps_timed": len(t)} for label, t in times.items()]


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    quick = "--quick" in argv
    if "--step-time-only" in argv:
        return _write_step_time(quick)
    rows = memory_rows(["llama-7b"] if quick else ["llama-7b", "llama-70b"], "--reuse-single-device" in argv)
    memory_only = "--memory-only" in argv
    write_results("adapters", rows, ["model", "run", "strategy", "figure", "peak_device_h", "peak_host_h", "wall_s"],
                  title="LoRA adapters vs full fine-tuning: batch 1 x 2048, bf16-true, activation checkpointing",
                  notes=[("Dry run (CUDA target, uncalibrated corrections), every row: the nf4 rows run bitsandbytes' "
                          "own 4-bit layers on fake weights (packed bytes and quantization state count as weights)."),
                         ("lowmem_offload: a frozen base weight has no fp32 host master (bf16-true: its bf16 compute "
                          "weight is its value; streamed, its bf16 host copy is), nor do packed 4-bit ones."),
                         ("Reference figures (their authors', not measured here): Unsloth 41 GB, QLoRA 48 GB for "
                          "LLaMA-70B QLoRA fine-tuning.")])
    if not memory_only:
        _write_step_time(quick)


def _write_step_time(quick: bool) -> None:
    cpu = step_time_rows(2 if quick else 3, 8 if quick else 12)
    write_results("adapters_step_time", cpu, ["model", "run", "figure", "median_step_s", "vs_full", "steps_timed"],
                  title="CPU step time, QLoRA (nf4 base) vs LoRA r=16 all-linear vs full fine-tuning (fp32, batch 2 x 128)",
                  notes=[("CPU, 2 shared cores: the three runs in one process, alternated run by run; median of each "
                          "run's steps after the second."),
                         ("QLoRA on the CPU: bitsandbytes 0.50 without its optional fused CPU kernel (the `kernels` "
                          "package, not installed here) dequantizes each 4-bit base linear in every forward and "
                          "backward; its CPU time is no guide to a GPU's.")])


if __name__ == "__main__":
    main(sys.argv[1:])
