"""lowmem_offload vs lowmem_zero2_offload vs lowmem_zero3_offload on the CPU: step time and peak process memory.

    python benchmarks/run.py zero [--layers 6 --hidden 512 --batch 4 --seq 128 --steps 6 --rounds 2]

Each variant trains a GPT-2-architecture model (random weights, bf16-mixed, AdamW) with the same batch in
its own process, so that each process's peak RSS is its own. Rounds alternate the variants (A B C A B C)
so machine noise hits them alike; a figure is the median over rounds of each run's median step time.

Memory metric: peak RSS during ``Trainer.fit`` (``VmHWM`` after resetting it through
``/proc/self/clear_refs`` once the model is built), minus the RSS at that moment, with
``MALLOC_MMAP_THRESHOLD_=65536`` (per the memory reference: +0.5-1.8 % over the tensor peak instead of
+13-18 % with glibc's defaults). On a CPU-only machine "device" and "host" are the same memory, so this is
the total a CPU user pays; the split a GPU user cares about is in the notes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path

VARIANTS = ("lowmem_offload", "lowmem_zero2_offload", "lowmem_zero3_offload")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    import lightning_lowmem  # noqa: F401  (registers the names)
    from benchmarks._harness import bench_trainer, lm_sample, step_clock
    from lightning_lowmem.demo.module import CausalLMModule

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    L.seed_everything(0)
    config = {"n_layer": args.layers, "n_embd": args.hidden, "n_head": args.hidden // 64, "n_positions": args.seq,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    module = CausalLMModule(config=config, learning_rate=1e-4)
    n_params = sum(p.numel() for p in module.parameters())
    g = torch.Generator().manual_seed(0)
    n = args.batch * (args.steps + 2)
    ids = torch.randint(0, 256, (n, args.seq), generator=g)
    data = [lm_sample(ids[i]) for i in range(n)]
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)

    clock = step_clock()
    trainer = bench_trainer(strategy=args.child, precision=args.precision, max_steps=args.steps + 2,
                            use_distributed_sampler=False, callbacks=[clock])
    try:
        Path("/proc/self/clear_refs").write_text("5")  # NOTE: resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    rss0 = _status_kib("VmRSS") * 1024
    trainer.fit(module, loader)
    peak = _status_kib("VmHWM") * 1024
    out = {
        "variant": args.child,
        "params": n_params,
        "step_s": statistics.median(clock.wall[2:]),
        "rss_at_start_bytes": rss0,
        "peak_rss_bytes": peak,
        "peak_rss_growth_bytes": peak - rss0 if reset else None,
        "vmhwm_reset": reset,
        "optimizer": type(getattr(trainer.strategy.optimizers[0], "optimizer", trainer.strategy.optimizers[0])).__name__,
    }
    Path(args.out).write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        return child(args)

    from benchmarks._harness import fmt_bytes, write_results

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    failures: dict[str, str] = {}
    out = Path("/tmp") / f"bench_zero_{os.getpid()}.json"
    for _ in range(args.rounds):
        for variant in VARIANTS:
            if variant in failures:
                continue
            cmd = [sys.executable, __file__, "--child", variant, "--out", str(out)] + [
                f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "batch", "seq", "steps", "precision")
            ]
            proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                failures[variant] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                print(f"{variant} failed: {proc.stderr[-3000:]}", file=sys.stderr)
                continue
            runs[variant].append(json.loads(out.read_text()))
    out.unlink(missing_ok=True)

    rows = []
    base = None
    for variant in VARIANTS:
        if not runs[variant]:
            rows.append({"variant": variant, "error": failures.get(variant)})
            continue
        rs = runs[variant]
        step = statistics.median(r["step_s"] for r in rs)
        growth = max(r["peak_rss_growth_bytes"] or 0 for r in rs)
        row = {
            "variant": variant,
            "params": rs[0]["params"],
            "optimizer": rs[0]["optimizer"],
            "step_s": step,
            "peak_rss": fmt_bytes(max(r["peak_rss_bytes"] for r in rs)),
            "peak_rss_growth": fmt_bytes(growth),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            "peak_rss_growth_bytes": growth,
            "runs": rs,
        }
        if base is None:
            base = row
        row["step_vs_offload"] = step / base["step_s"] if base["variant"] == "lowmem_offload" else None
        row["growth_vs_offload"] = growth / base["peak_rss_growth_bytes"] if base["variant"] == "lowmem_offload" else None
        rows.append(row)
    notes = [
        (f"GPT-2 architecture, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens, "
        f"precision {args.precision}, AdamW (DeepSpeedCPUAdam under the zero presets), 1 process, "
        f"{args.steps} timed steps after 2 warm-up steps, {args.rounds} interleaved rounds, a fresh process per run."),
        ("peak_rss_growth: VmHWM (reset via /proc/self/clear_refs after the model is built) minus the RSS then, "
        "MALLOC_MMAP_THRESHOLD_=65536; peak_rss: the process's whole peak (imports included)."),
    ]
    if failures:
        notes.append("Failed variants: " + "; ".join(f"{k}: {v}" for k, v in failures.items()))
    write_results("zero", rows, ["variant", "params", "optimizer", "step_s", "step_vs_offload", "peak_rss_growth",
                                 "growth_vs_offload", "peak_rss"],
                  title="ZeRO presets vs lowmem_offload on the CPU (one process)", notes=notes)


if __name__ == "__main__":
    main()
