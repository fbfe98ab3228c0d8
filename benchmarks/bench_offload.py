"""``lowmem_offload``: device bytes per parameter, host optimizer throughput, training-step time on CPU.

Three measurements, each side by side in one run:

1. **Device-resident bytes per parameter, by category.** A GPT-2-architecture model (the demo's
   ``CausalLMModule``) is trained through ``Trainer.fit``; the second training step is measured by
   ``MemoryTracker`` (forward/backward/optimizer phases set from Lightning hooks). Rows: plain fp32
   AdamW (``strategy="auto"``, ``"32-true"``) and ``lowmem_offload`` in ``"bf16-true"`` and ``"32-true"``.
   ``model_state_B/param`` is weights + gradients + optimizer state of the device role at the
   device-role peak, divided by the parameter count; activations and other are listed beside it.
   On this CPU-only machine "device" means the tensors kept in the compute role: the strategy marks
   its masters, gradient buffers and optimizer state as host (``mark_host``).
2. **Host optimizer step throughput** (parameters per second) on ``--opt-params`` flat fp32 parameters
   (100M by default: 1.6 GB of parameters, gradients and AdamW state, far beyond any CPU's last-level
   cache, so the step streams from DRAM as a real model's does), interleaved: the strategy's host AdamW
   (the user's ``torch.optim.AdamW`` with the fused flags set by ``host_optimizer="auto"``), torch AdamW
   for-loop (CPU default), foreach, fused, and ``DeepSpeedCPUAdam``; plus memory bandwidth measured in the
   same rounds by an in-place ``a += b`` over two 256 MB buffers, and each optimizer's fraction of the
   bandwidth bound (28 B moved per parameter: read param, grad, m, v; write param, m, v = 7 x 4 B).
3. **Training-step time on CPU**: median step time of ``lowmem_offload`` against plain Lightning at the
   same precision, fits interleaved round after round.

Run from the repository root: ``python benchmarks/run.py offload`` or ``python benchmarks/bench_offload.py``
(``--layers 4 --width 256 --seq 128 --batch 4 --rounds 3 --step-steps 8 --opt-params 1e8``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import (
    add_int_args,
    bench_trainer,
    fmt_bytes,
    interleaved,
    last_level_cache_bytes,
    lm_batches,
    step_probe,
    write_results,
)
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload import host_optimizer as _host_optimizer


def fit(args, strategy, precision, steps, probe: L.Callback) -> CausalLMModule:
    torch.manual_seed(0)
    config = {"n_layer": args.layers, "n_embd": args.width, "n_head": 4, "n_positions": args.seq,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    module = CausalLMModule(model_type="gpt2", config=config, learning_rate=1e-4)
    trainer = bench_trainer(strategy=strategy, precision=precision, max_steps=steps, limit_val_batches=0, callbacks=[probe])
    trainer.fit(module, DataLoader(lm_batches(steps * args.batch, (args.seq,)), batch_size=args.batch))
    return module


VARIANTS = {
    "plain fp32 AdamW (auto, 32-true)": ("auto", "32-true"),
    "lowmem_offload bf16-true": ("lowmem_offload", "bf16-true"),
    "lowmem_offload 32-true": ("lowmem_offload", "32-true"),
    "plain bf16-true (no masters)": ("auto", "bf16-true"),
}


def memory_rows(args) -> list[dict]:
    rows = []
    for name, (strategy, precision) in list(VARIANTS.items())[:3]:
        probe = step_probe(1)
        module = fit(args, strategy, precision, 2, probe)
        n = sum(p.numel() for p in module.parameters())
        peak = probe.tracker.peak_breakdown().device
        model_state = peak["weights"] + peak["gradients"] + peak["optimizer_state"]
        rows.append({
            "variant": name,
            "params": n,
            "model_state_B/param": model_state / n,
            "weights_B/param": peak["weights"] / n,
            "gradients_B/param": peak["gradients"] / n,
            "optimizer_state_B/param": peak["optimizer_state"] / n,
            "activations": fmt_bytes(peak["activations"]),
            "other": fmt_bytes(peak["other"]),
            "device_peak": fmt_bytes(probe.tracker.peak_bytes),
            "peak_phase": probe.tracker.peak_phase,
            "host_peak": fmt_bytes(probe.tracker.peak_bytes_role("host")),
            "report": probe.tracker.report(),
        })
    return rows


BANDWIDTH_NUMEL = 64_000_000  # two 256 MB fp32 buffers for the bandwidth probe


def optimizer_rows(args) -> tuple[list[dict], dict]:
    n_tensor = int(args.opt_params) // 8
    n = 8 * n_tensor
    torch.manual_seed(0)
    # NOTE: one set of parameters and gradients for every optimizer (each keeps its own m and v): a set each
    # would hold 5 x 0.8 GB more at 100M parameters on a shared machine, and a step reads and writes the same
    # 28 B/param whatever values the parameters hold
    params = [torch.nn.Parameter(torch.randn(n_tensor)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)

    ours = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # what configure_optimizers returns ...
    if _host_optimizer.why_not_fused(ours) is not None:
        raise RuntimeError(f"the host AdamW would not be fused here: {_host_optimizer.why_not_fused(ours)}")
    _host_optimizer.enable_fused(ours.param_groups)  # ... after OffloadStrategy(host_optimizer="auto") re-points it
    optimizers = {
        "ours (lowmem_offload host AdamW)": ours,
        "torch AdamW for-loop (CPU default)": torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False),
        "torch AdamW foreach": torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True),
        "torch AdamW fused": torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizers["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    except Exception as err:  # noqa: BLE001 - the extra is optional; say why it is missing
        warnings.warn(f"DeepSpeedCPUAdam unavailable: {err}")
    a, b = torch.randn(BANDWIDTH_NUMEL), torch.randn(BANDWIDTH_NUMEL)
    variants = {name: opt.step for name, opt in optimizers.items()}
    # NOTE: the bound is measured with the optimizer's own access pattern, read-modify-write (a += b: read a and
    # b, write a back). A copy_ (the earlier probe) writes lines it never read; a write-allocate cache reads each
    # of them first, so 3 transfers count as 2 and the "bandwidth" comes out up to 1.5x low, a bound that an
    # optimizer then appears to beat. The copy stays in the rounds, reported beside it.
    variants["bandwidth: a += b"] = lambda: a.add_(b)
    variants["bandwidth: a.copy_(b)"] = lambda: a.copy_(b)
    load_before = os.getloadavg()
    timings = interleaved(variants, rounds=args.rounds + 2, warmup=1)
    load_after = os.getloadavg()
    add, copy = timings.pop("bandwidth: a += b"), timings.pop("bandwidth: a.copy_(b)")
    bandwidth = 3 * BANDWIDTH_NUMEL * 4 / add["min_s"]  # best round: the most the machine was seen to move
    ds = timings.get("DeepSpeedCPUAdam", {}).get("median_s")
    llc = last_level_cache_bytes()
    rows = []
    for name, t in timings.items():
        rate = n / t["median_s"]
        rows.append({
            "optimizer": name,
            "params": n,
            "Mparams/s": rate / 1e6,
            "step_ms": 1e3 * t["median_s"],
            "x_DeepSpeedCPUAdam": (ds / t["median_s"]) if ds else None,
            "fraction_of_bandwidth_bound": 28 * rate / bandwidth,
        })
    facts = {
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_median_bytes_per_s": 3 * BANDWIDTH_NUMEL * 4 / add["median_s"],
        "copy_bandwidth_bytes_per_s": 2 * BANDWIDTH_NUMEL * 4 / copy["min_s"],
        "optimizer_working_set_bytes": 16 * n,
        "last_level_cache_bytes": llc,
        # NOTE: 8x the cache: below that a good part of the state may still be cached between steps
        "beyond_cache": llc is not None and 16 * n >= 8 * llc,
        "loadavg_before_after": [load_before, load_after],
    }
    return rows, facts


def step_rows(args) -> list[dict]:
    pairs = {name: VARIANTS[name] for name in VARIANTS}
    steps = args.step_steps
    medians: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(args.rounds):
        for name, (strategy, precision) in pairs.items():
            probe = step_probe(None)
            fit(args, strategy, precision, steps, probe)
            medians[name].append(statistics.median(probe.times[2:]))  # first two steps: warm-up, lazy state
    out = {name: statistics.median(v) for name, v in medians.items()}
    base = {"32-true": out["plain fp32 AdamW (auto, 32-true)"], "bf16-true": out["plain bf16-true (no masters)"]}
    rows = []
    for name, (strategy, precision) in pairs.items():
        rows.append({
            "variant": name,
            "step_ms": 1e3 * out[name],
            "x_plain_same_precision": out[name] / base[precision],
            "rounds": args.rounds,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_int_args(parser, layers=4, width=256, seq=128, batch=4, rounds=3, step_steps=8)
    parser.add_argument("--opt-params", type=float, default=1e8,
                        help="parameters of the host-optimizer table (their state must dwarf the last-level cache)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    mem = memory_rows(args)
    opt, facts = optimizer_rows(args)
    steps = step_rows(args)

    rows = (
        [{"table": "device bytes/param", **{k: v for k, v in r.items() if k != "report"}} for r in mem]
        + [{"table": "host optimizer", **r} for r in opt]
        + [{"table": "step time", **r} for r in steps]
    )
    ours = next(r for r in opt if r["optimizer"].startswith("ours"))
    offload = next(r for r in mem if r["variant"] == "lowmem_offload bf16-true")
    notes = [
        (f"Device model state under lowmem_offload bf16-true: {offload['model_state_B/param']:.3f} B/param at the device "
         f"peak (target <= 2.1) vs {mem[0]['model_state_B/param']:.2f} B/param for plain fp32 AdamW; activations extra."),
        (f"Host optimizer table: {ours['params'] / 1e6:.0f}M fp32 parameters, working set (param, grad, m, v) "
         f"{fmt_bytes(facts['optimizer_working_set_bytes'])} = "
         f"{facts['optimizer_working_set_bytes'] / (facts['last_level_cache_bytes'] or float('nan')):.1f}x the "
         f"{fmt_bytes(facts['last_level_cache_bytes'])} last-level cache"
         + (", so every step streams from DRAM." if facts["beyond_cache"] else
            ": NOT well beyond it, so the step partly runs from cache and the 'bound' is no bound.")),
        (f"Memory bandwidth (in-place a += b over two 256 MB buffers, 12 B moved per element, best of rounds): "
         f"{facts['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (median round {facts['bandwidth_median_bytes_per_s'] / 1e9:.2f}); "
         f"AdamW bound at 28 B/param = {facts['bandwidth_bytes_per_s'] / 28 / 1e6:.1f} Mparams/s. "
         f"fraction_of_bandwidth_bound: median step vs that bound (the best round of the probe: the most the machine was seen to move)."),
        (f"A 256 MB copy_ in the same rounds reads as {facts['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s counting "
         "read + write (2 x 4 B/element): a copy's destination lines are read into the cache before they are written "
         "(write-allocate), a transfer it does not count, so it is no bound for a read-modify-write kernel."),
        *([(f"Fractions above 1 ({', '.join(r['optimizer'] for r in opt if r['fraction_of_bandwidth_bound'] > 1)}): "
           "the bound is the a += b probe's bandwidth, an estimate measured in the same rounds (its best and median "
           "rounds differ by the figures above), not a hard ceiling; the state is far beyond the cache, so such an "
           "optimizer runs at the memory bandwidth within the probe's accuracy.")]
          if any(r["fraction_of_bandwidth_bound"] > 1 for r in opt) else []),
        (f"Host AdamW: ours {ours['Mparams/s']:.1f} Mparams/s = {ours['x_DeepSpeedCPUAdam'] or float('nan'):.2f}x "
         "DeepSpeedCPUAdam (target >= 0.9x)."),
        ("Step time: median of per-step wall times (steps 3..N of each fit), median over rounds; fits interleaved. "
         "The machine is shared (2 cores): figures are ratios measured side by side."),
         "Load average (1, 5, 15 min) before / after the host-optimizer rounds: "
        + " / ".join(", ".join(f"{x:.2f}" for x in load) for load in facts["loadavg_before_after"]) + ".",
    ]
    write_results(
        "offload",
        rows,
        ["table", "variant", "optimizer", "params", "model_state_B/param", "weights_B/param", "gradients_B/param",
         "optimizer_state_B/param", "activations", "other", "device_peak", "host_peak", "Mparams/s", "x_DeepSpeedCPUAdam",
         "fraction_of_bandwidth_bound", "step_ms", "x_plain_same_precision"],
        title="lowmem_offload: device bytes per parameter, host optimizer throughput, step time (CPU)",
        notes=notes,
        extra={"args": vars(args), **facts, "memory_reports": {r["variant"]: r["report"] for r in mem}},
    )


if __name__ == "__main__":
    main()
