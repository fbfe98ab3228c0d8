"""What `lowmem estimate` costs a newcomer (issue 48): the README's GPT-2-XL table and a 70B estimate of one recipe,
as commands, in CPU seconds (the child's user + system time: what a loaded machine does not inflate as it inflates
wall time) and wall seconds, with each row's own time as the command prints it.

    python benchmarks/bench_estimate_cli.py                       # this tree
    python benchmarks/bench_estimate_cli.py --before /tmp/old     # and a checkout of an earlier commit, side by side
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import write_results

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "README table (gpt2-xl, 13 combinations, 12GB)": ["--model", "gpt2-xl", "--batch-size", "4", "--seq-len", "1024",
                                                       "--budget", "12GB"],
    "llama-70b QLoRA, one recipe": ["--model", "llama-70b", "--batch-size", "1", "--seq-len", "2048", "--adapters",
                                    "lora", "--quantize-base", "nf4", "--only",
                                    "offload + ckpt(all) + act. offload + chunked loss"],
}


def run(tree: Path, argv: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lightning_lowmem.cli", "estimate", *argv], check=False,
                         capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    rows = [line for line in out.stdout.splitlines() if " GiB " in line or "refused" in line or "failed" in line]
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "load_at_start": round(load, 1),
            "exit": out.returncode, "rows": len(rows), "traced_rows": sum(" dry_run" in r for r in rows),
            "output": out.stdout[-6000:], "error": out.stderr[-1500:] if out.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default=None, help="a checkout of an earlier commit (its root), run the same way")
    args = parser.parse_args()
    trees = {"this tree": ROOT, **({"before": Path(args.before)} if args.before else {})}
    rows = []
    for what, argv in COMMANDS.items():
        for label, tree in trees.items():
            rows.append({"command": what, "code": label, **run(tree, argv)})
            print({k: v for k, v in rows[-1].items() if k not in ("output", "error")}, flush=True)
    write_results(
        "estimate_cli", rows, ["command", "code", "cpu_s", "wall_s", "load_at_start", "rows", "traced_rows", "exit"],
        title="lowmem estimate as a newcomer runs it: CPU and wall seconds per command",
        notes=[("cpu_s: the command's user + system CPU seconds (start-up, imports, every row); wall_s depends on how "
               "busy the shared machine was (load_at_start: its 1-minute load average on 2 cores)."),
               ("rows: rows printed; traced_rows: rows predicted by a dry run (the others: ruled out by the closed form "
               "against the budget, refused, or failed: each row's line is in the JSON's `output`).")],
    )


if __name__ == "__main__":
    main()
