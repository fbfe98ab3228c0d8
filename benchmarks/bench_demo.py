"""The demo: steps per second and peak process memory, plain Lightning vs the demo config, side by side; and
(``--make-demo``) what `make demo` costs end to end on this machine, at the precision its probe picks and at 32-true
(the precision a CPU without native bf16 gets), with the machine's bf16 status.

Each variant runs in its own process (so its peak RSS is its own), alternating A B A B for
``--rounds`` rounds. Peak RSS is read with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps
freed memory and overshoots the tensor peak by 13-18%; see the memory-measurement notes).
"plain" is the same model and data with Lightning's defaults: no lowmem strategy, no callbacks,
fp32, and the demo's effective batch in one micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import fmt_bytes, write_results

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import lightning as L
from lightning_lowmem.cli import LowMemCLI

times = []
class Clock(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        times.append(time.perf_counter())

cli = LowMemCLI(args=sys.argv[1:], run=False)  # run=False: no subcommand
cli.trainer.callbacks.append(Clock())
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
steps = cli.trainer.global_step
batches = len(times)
warm = max(1, batches // 5)  # the first fifth is warm-up (allocator, first-step optimizer state)
rate = (batches - warm) / (times[-1] - times[warm - 1])
print("RESULT " + json.dumps({
    "optimizer_steps": steps, "batches": batches,
    "batches_per_s": rate, "steps_per_s": rate * steps / batches,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "final_train_loss": float(cli.trainer.callback_metrics.get("train_loss", float("nan"))),
}))
"""


def plain_overrides(config: dict) -> list[str]:
    """Lightning's defaults for the same model and data: no lowmem strategy, plugins or callbacks, fp32."""
    data = config["data"]["init_args"]
    effective = data.get("batch_size", 8)
    for cb in config["trainer"].get("callbacks") or []:
        if str(cb.get("class_path", "")).endswith("AccumulationScheduler"):
            effective = cb["init_args"]["effective_batch_size"]
    return [
        "--trainer.strategy=auto", "--trainer.precision=32-true", "--trainer.callbacks=null",
        "--trainer.plugins=null", "--trainer.accumulate_grad_batches=1", f"--data.init_args.batch_size={effective}",
    ]


def run(config: Path, extra: list[str], max_steps: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    args = ["--config", str(config), f"--trainer.max_steps={max_steps}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", *extra]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=False, env=env, capture_output=True, text=True, cwd="/tmp")
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"variant failed ({' '.join(extra)}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[0][len("RESULT "):])


def bf16_status() -> dict:
    """The CPU's bf16 instructions (``/proc/cpuinfo``) and the probe's timed matmuls (one thread)."""
    from lightning_lowmem.demo.probe import demo_precision

    flags = set()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    precision, why = demo_precision()
    return {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "avx2": "avx2" in flags,
            "probe": precision, "probe_says": why}


def make_demo(config: Path, precision: str, threads: int | None) -> dict:
    """`lowmem fit --config demo.yaml --trainer.precision P` in a child process: wall and CPU seconds (children's
    rusage), the training's own time (LossLog's pace x steps), the loss's first and last value."""
    import resource
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lightning_lowmem.cli", "fit", "--config", str(config),
                          f"--trainer.precision={precision}", "--trainer.default_root_dir=/tmp/lowmem-bench-demo"],
                         check=False, env=env, capture_output=True, text=True, cwd="/tmp")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"make demo at {precision} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    pace = float(steps[-1].split("  ")[-1].split(" s/step")[0])
    losses = [line for line in out.stdout.splitlines() if line.startswith("train_loss ")]
    return {"precision": precision, "threads": threads or "default", "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "training_s": round(pace * int(steps[-1].split()[1].split("/")[0]), 1), "loss": losses[-1] if losses else "",
            "report": next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("On a GPU")),
                           "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--make-demo", action="store_true", help="time `make demo` end to end instead")
    parser.add_argument("--threads", type=int, default=1, help="with --make-demo: also with this OMP_NUM_THREADS (a "
                        "busy shared machine makes torch's default threads wait on each other)")
    args = parser.parse_args()
    if args.make_demo:
        status = bf16_status()
        rows = [make_demo(Path(args.config), p, t) for p in dict.fromkeys([status["probe"], "32-true"])
                for t in dict.fromkeys([None, args.threads or 1])]
        native = status["avx512_bf16"] or status["amx_bf16"]
        write_results(
            "demo_time", rows, ["precision", "threads", "wall_s", "cpu_s", "training_s", "loss", "report"],
            title="make demo end to end: the probe's precision and 32-true (a CPU without native bf16)",
            notes=[(f"this CPU: avx512_bf16 {status['avx512_bf16']}, amx_bf16 {status['amx_bf16']}, avx2 "
                   f"{status['avx2']}: {'native' if native else 'no native'} bf16; the probe: {status['probe_says']}"),
                   ("training_s: LossLog's seconds per step x steps (the fit's loop, without start-up and the report); "
                   "cpu_s: the child's user + system CPU seconds (start-up, training, the report's dry runs)."),
                   ("32-true is what `make demo` trains at on a CPU that emulates bf16 (a bf16 matmul ~10x slower "
                   "there): its training time here is an upper bound's stand-in only where this CPU's fp32 is "
                   "no faster than that host's.")],
            extra={"bf16": status})
        return
    config = yaml.safe_load(Path(args.config).read_text())
    variants = {"plain Lightning": plain_overrides(config), "demo config": []}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, extra in variants.items():
            results[name].append(run(Path(args.config), extra, args.max_steps))
    rows = []
    for name, runs in results.items():
        best = max(runs, key=lambda r: r["steps_per_s"])
        rows.append({
            "variant": name,
            "optimizer steps/s": max(r["steps_per_s"] for r in runs),
            "peak RSS": fmt_bytes(min(r["peak_rss_bytes"] for r in runs)),
            "peak_rss_bytes": min(r["peak_rss_bytes"] for r in runs),
            "final train loss": best["final_train_loss"],
            "runs": runs,
        })
    plain, demo = rows
    notes = [
        (f"speed ratio demo/plain: {demo['optimizer steps/s'] / plain['optimizer steps/s']:.2f}x; "
        f"peak RSS ratio demo/plain: {demo['peak_rss_bytes'] / plain['peak_rss_bytes']:.2f}x"),
        ("Peak RSS is the whole process (interpreter, libraries, data) and on CPU the host role too: the demo's "
        "device-role saving is in MemoryReport's table, not here."),
        (f"best of {args.rounds} alternating rounds per variant, {args.max_steps} optimizer steps each, first fifth "
        "of the batches excluded from the rate."),
    ]
    write_results(
        "demo", rows, ["variant", "optimizer steps/s", "peak RSS", "final train loss"],
        title="The demo: plain Lightning vs configs/demo.yaml", notes=notes,
    )


if __name__ == "__main__":
    main()
