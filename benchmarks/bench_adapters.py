"""LoRA adapters (``Adapters``) against full fine-tuning: predicted memory at LLaMA scale, CPU step time.

Part 1 (dry run, CUDA target): ``estimate_memory("llama-7b"/"llama-70b", 1, 2048, precision="bf16-true",
checkpointing="all")`` (the shipped shapes; the dry run traces the real ``Trainer.fit`` on fake tensors and
extrapolates over depth) with and without ``Adapters("lora", r=16, alpha=32, target_modules="all-linear")``, on one
device and under ``lowmem_offload``. A 4-bit (nf4) base cannot be traced (bitsandbytes' ``Params4bit`` cannot wrap
a fake tensor): its row is *derived* from the bf16 LoRA row by replacing the base linears' bf16 bytes by their
packed size, measured by ``packed_bytes`` on a real quantized 4096 x 4096 layer (bitsandbytes' own layout).

Part 2 (CPU): one small LLaMA, fp32, batch 2 x 128, the same data; full fine-tuning, LoRA and QLoRA (nf4 base)
alternated run by run in one process (so the shared machine's load hits all alike); median step time of the last
steps of each run.

    python benchmarks/run.py adapters            # both parts
    python benchmarks/run.py adapters --quick    # 7B only, fewer CPU steps
    python benchmarks/run.py adapters --step-time-only  # part 2 only
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


def _nf4_bytes_per_param() -> float:
    from lightning_lowmem.callbacks.adapters.quantize_base import packed_bytes, quantize_linears

    layer = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False))
    quantize_linears(layer, "nf4")
    return packed_bytes(layer[0]) / 4096**2


def _base_linear_params(shape: str) -> int:
    import json

    from lightning_lowmem.predict import shapes

    cfg = json.loads((Path(shapes.__path__[0]) / f"{shape}.json").read_text())
    cfg = cfg.get("config", cfg)
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return n * (2 * h * h + 2 * h * kv + 3 * h * i)


def memory_rows(shapes: list[str]) -> list[dict[str, Any]]:
    from lightning_lowmem import ActivationCheckpointing, Adapters, estimate_memory

    nf4 = _nf4_bytes_per_param()
    rows = []
    for shape in shapes:
        for label, offload, adapters in [("full fine-tune", False, False), ("full fine-tune", True, False),
                                         ("LoRA r=16 all-linear", False, True), ("LoRA r=16 all-linear", True, True)]:
            t0 = time.perf_counter()
            callbacks = [ActivationCheckpointing("all"), *([Adapters("lora", **LORA)] if adapters else [])]
            est = estimate_memory(shape, 1, 2048, precision="bf16-true", callbacks=callbacks, target="cuda",
                                  strategy="lowmem_offload" if offload else "auto")
            wall = time.perf_counter() - t0
            opt = est.phases["optimizer"]
            rows.append({
                "model": shape, "run": label, "strategy": "lowmem_offload" if offload else "single device",
                "figure": "dry run (CUDA target)", "peak_device": est.peak_device, "peak_host": est.peak_host,
                "device_weights": opt.device["weights"], "device_gradients": opt.device["gradients"],
                "device_optimizer_state": opt.device["optimizer_state"], "host_total": opt.host and sum(
                    opt.host.values()), "wall_s": round(wall, 1),
                "peak_device_h": fmt_bytes(est.peak_device), "peak_host_h": fmt_bytes(est.peak_host),
            })
            print(rows[-1], flush=True)
            if adapters and not offload:
                saved = int(_base_linear_params(shape) * (2 - nf4))
                rows.append({**rows[-1], "run": "QLoRA nf4 base r=16 (derived)",
                             "figure": f"derived: bf16 LoRA dry run - base linears x (2 - {nf4:.4f}) B",
                             "peak_device": rows[-1]["peak_device"] - saved,
                             "device_weights": rows[-1]["device_weights"] - saved,
                             "peak_device_h": fmt_bytes(rows[-1]["peak_device"] - saved), "wall_s": None})
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
    rows = memory_rows(["llama-7b"] if quick else ["llama-7b", "llama-70b"])
    write_results("adapters", rows, ["model", "run", "strategy", "figure", "peak_device_h", "peak_host_h", "wall_s"],
                  title="LoRA adapters vs full fine-tuning: batch 1 x 2048, bf16-true, activation checkpointing",
                  notes=[("Dry run (CUDA target, uncalibrated corrections) except the QLoRA row, derived from the "
                          "bf16 LoRA row (the dry run cannot trace bitsandbytes' quantized parameters).")])
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
