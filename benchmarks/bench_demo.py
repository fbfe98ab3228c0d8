"""The demo: steps per second and peak process memory, plain Lightning vs the demo config, side by side.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
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
