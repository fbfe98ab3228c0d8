"""Run one GPU stage: ``python3 benchmarks/gpu/run_stage.py --stage 1|2|3|4|5|6`` (``make gpu-check STAGE=N``).

Offline by construction: the packages the image lacks come as wheels from ``--wheels`` (``.whl/``, filled here by
``make gpu-wheels``), installed with ``pip --no-index --no-deps --target`` into a temporary folder put on
``PYTHONPATH``; no venv, no registry. The entries (``benchmarks/gpu/stage{N}.py``) run in worker processes
(``benchmarks/gpu/worker.py``), each under its time limit: one that fails records its error, one that runs out of
time is killed and recorded with what it measured until then, and the stage goes on. The stage as a whole stops at
``--budget`` (:data:`~benchmarks.gpu.registry.STAGE_BUDGET_S`, 7 minutes).

Results: ``stage{N}.json`` + ``stage{N}.md`` and ``summary.md`` (every stage's figures in ``--results``, beside their
dry-run predictions and the CPU figures they replace) in ``--results`` (``benchmarks/results/gpu/``) and, when set,
in ``--out`` / ``$LOWMEM_GPU_OUT`` too (with ``stage{N}.log``, the workers' output): four files, no sub-folders,
rewritten as each figure is measured, so a run cut short still returns what it measured.
``--rehearsal``: the same stage on the CPU with tiny sizes (see ``benchmarks/gpu/rehearse.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu import report
from benchmarks.gpu.registry import PROCESS_START_S, REHEARSAL_SLACK, STAGE_BUDGET_S, STAGES, Entry, entries, safe_name

TITLES = {1: "the headline: GPT-2-XL's 12 GB recipe under a 12 GiB cap vs plain Lightning, CUDA tests, streaming bound",
          2: "activation offload, parameter streaming on GPT-2-XL, dry run vs measured",
          3: "LoRA/QLoRA adapters (nf4 base resident and streamed) with the dry run",
          4: "low-bit and lean optimizers",
          5: "the host step: serial vs optimizer_in_backward, the host AdamW rate, synccheck",
          6: "chunked-loss backends; planned slots"}
POLL_S = 0.5
#: a worker that has not started its first entry by then is taken as hung at start
START_LIMIT_S = 6 * PROCESS_START_S


def install_wheels(wheel_dir: Path, target: Path) -> list[str]:
    """``pip install --no-index --no-deps --target`` every wheel of ``wheel_dir``; the wheels' file names."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--disable-pip-version-check", "--target", str(target), *map(str, wheels)],
                       check=True)
    return [w.name for w in wheels]


def machine(rehearsal: bool) -> dict[str, Any]:
    """Device, driver and versions, read without creating a CUDA context here (nvidia-smi, torch's build info)."""
    import platform

    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "torch_cuda": torch.version.cuda, "cpu_count": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip().splitlines()
        name, driver, memory = (x.strip() for x in smi[0].split(","))
        facts |= {"device": name, "driver": driver, "device_memory": memory}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        facts["device"] = "none (CPU rehearsal)" if rehearsal else "no nvidia-smi answer"
    return facts


def child_env(site: Path) -> dict[str, str]:
    """The workers' environment: the checkout and the wheels first on the path; every hub and registry offline."""
    path = [str(REPO), str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1", "TOKENIZERS_PARALLELISM": "false"}


class StageRun:
    """Starts workers for a stage's entries, enforces each entry's limit, and collects what each recorded."""

    def __init__(self, stage: int, rehearsal: bool, state: Path, env: dict[str, str], log: Path, deadline: float,
                 module: str | None = None, slack: float = 1.0) -> None:
        self.stage, self.rehearsal, self.state, self.env, self.log, self.deadline, self.module, self.slack = (
            stage, rehearsal, state, env, log, deadline, module, slack)

    def _read(self, e: Entry, suffix: str) -> dict[str, Any] | None:
        import json

        path = self.state / f"{safe_name(e.name)}{suffix}"
        return json.loads(path.read_text()) if path.is_file() else None

    def _result(self, e: Entry) -> dict[str, Any] | None:
        """The entry's final result, over what it recorded while measuring (an error keeps the figures before it)."""
        final = self._read(e, ".json")
        return None if final is None else {**(self._read(e, ".partial.json") or {}), **final}

    def _partial(self, e: Entry) -> tuple[float, dict[str, Any]] | None:
        path = self.state / f"{safe_name(e.name)}.partial.json"
        try:
            return path.stat().st_mtime_ns, self._read(e, ".partial.json") or {}
        except (OSError, ValueError):
            return None  # NOTE: not written yet, or replaced between the two looks

    def _started(self, e: Entry) -> float | None:
        path = self.state / f"{safe_name(e.name)}.start"
        return path.stat().st_mtime if path.is_file() else None

    def run(self, todo: list[Entry], on_result: Any) -> None:
        """Run ``todo`` in order; call ``on_result(entry, result)`` as each finishes (or fails, or runs out of time)."""
        while todo:
            if self.deadline - time.time() < 5:
                for e in todo:
                    on_result(e, {"status": "not run", "reason": "the stage's time budget was spent"})
                return
            group = [todo[0]] + [e for e in _until_fresh(todo[1:])]
            todo = todo[len(group):]
            leftover = self._run_group(group, on_result)
            todo = leftover + todo

    def _run_group(self, group: list[Entry], on_result: Any) -> list[Entry]:
        cmd = [sys.executable, "-m", "benchmarks.gpu.worker", "--stage", str(self.stage),
               "--entries", ",".join(e.name for e in group), "--state", str(self.state)]
        cmd += ["--rehearsal"] if self.rehearsal else []
        cmd += ["--module", self.module] if self.module else []
        cmd += ["--slack", str(self.slack)] if self.slack != 1 else []
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        launched = time.time()
        pending = list(group)
        seen: dict[str, float] = {}
        while pending:
            e = pending[0]
            result = self._result(e)
            if result is not None:
                on_result(e, result)
                pending.pop(0)
                continue
            partial = self._partial(e)
            if partial is not None and seen.get(e.name) != partial[0]:
                seen[e.name] = partial[0]
                on_result(e, {**partial[1], "status": "running"})
            started, now, exited = self._started(e), time.time(), proc.poll() is not None
            limit = min((started or launched) + (self.slack * e.budget_s if started else START_LIMIT_S), self.deadline)
            if exited and self._result(e) is not None:
                continue  # NOTE: it wrote the result between the two looks
            if exited or now > limit:
                if proc.poll() is None:
                    _kill(proc)
                    slack = f" (x{self.slack:g} in the rehearsal)" if self.slack != 1 else ""
                    why = (f"ran out of its {e.budget_s} s{slack}" if started and now <= self.deadline else
                           "the stage's time budget ran out" if started else f"no worker start in {START_LIMIT_S} s")
                    status = "timeout"
                else:
                    why = f"the worker exited with code {proc.returncode} (see the stage's log)"
                    status = "error"
                on_result(e, {**(partial[1] if partial else {}), "status": status, "reason": why,
                              "seconds": round(now - (started or launched), 1), "log_tail": _tail(self.log)})
                return pending[1:]
            time.sleep(POLL_S)
        proc.wait(timeout=60)
        return []


def _until_fresh(rest: list[Entry]) -> list[Entry]:
    out = []
    for e in rest:
        if e.fresh:
            break
        out.append(e)
    return out


def _kill(proc: subprocess.Popen) -> None:
    """End the worker and what it started (its own process group: pytest, compute-sanitizer)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, choices=STAGES)
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    parser.add_argument("--out", type=Path, default=os.environ.get("LOWMEM_GPU_OUT") or None,
                        help="a second folder for the results (default: $LOWMEM_GPU_OUT)")
    parser.add_argument("--rehearsal", action="store_true", help="the CPU rehearsal: tiny sizes, deferred copies")
    parser.add_argument("--budget", type=float, default=STAGE_BUDGET_S, help="the stage's wall-clock limit (s)")
    args = parser.parse_args(argv)
    if not args.rehearsal:
        import torch

        if not torch.cuda.is_available():
            print(f"make gpu-check needs a CUDA GPU: {sys.executable} sees none (torch {torch.__version__}, "
                  "torch.cuda.is_available() is False). Without a GPU: make gpu-rehearsal.", file=sys.stderr)
            return 2
    t0 = time.time()
    deadline = t0 + args.budget
    dirs = [args.results] + ([args.out] if args.out else [])
    stage_entries = entries(args.stage)
    with tempfile.TemporaryDirectory(prefix=f"lowmem-gpu-stage{args.stage}-") as tmp:
        site, state = Path(tmp) / "site", Path(tmp) / "state"
        state.mkdir()
        installed = install_wheels(args.wheels, site)
        log = Path(tmp) / f"stage{args.stage}.log"
        payload: dict[str, Any] = {
            "stage": args.stage, "title": TITLES[args.stage],
            "mode": "CPU rehearsal (tiny sizes; figures are no GPU figures)" if args.rehearsal else "GPU",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]), "machine": machine(args.rehearsal),
            "wheels": {"dir": str(args.wheels), "installed": installed}, "budget_s": args.budget, "seconds": 0.0,
            "entries": [{"name": e.name, "what": e.what, "budget_s": e.budget_s,
                         "status": "planned" if e.fn is None else "pending",
                         **({"reason": e.planned} if e.fn is None else {})} for e in stage_entries],
        }
        slots = {e.name: slot for e, slot in zip(stage_entries, payload["entries"])}
        report.write(payload, dirs, log)  # NOTE: the stage's skeleton first: a run cut at once still names its machine
        print(f"GPU stage {args.stage} ({payload['mode']}): {len(installed)} wheels installed; "
              f"device {payload['machine'].get('device')}", flush=True)

        def on_result(e: Entry, result: dict[str, Any]) -> None:
            slots[e.name].update(result)
            payload["seconds"] = round(time.time() - t0, 1)
            report.write(payload, dirs, log)
            if result["status"] == "running":
                print(f"[{payload['seconds']:7.1f} s] {e.name}: recorded {len(result.get('rows', []))} rows", flush=True)
                return
            print(f"[{payload['seconds']:7.1f} s] {e.name}: {result['status']} ({result.get('seconds', '-')} s of "
                  f"{e.budget_s}) {result.get('reason') or result.get('error') or ''}"[:400], flush=True)

        StageRun(args.stage, args.rehearsal, state, child_env(site), log, deadline,
                 slack=REHEARSAL_SLACK if args.rehearsal else 1.0).run(
            [e for e in stage_entries if e.fn is not None], on_result)
        payload["seconds"] = round(time.time() - t0, 1)
        report.write(payload, dirs, log)
    print(report.table([{"entry": e["name"], "status": e["status"], "seconds": e.get("seconds")}
                        for e in payload["entries"]]))
    print(f"stage {args.stage}: {payload['seconds']} s; results in {', '.join(map(str, dirs))}")
    bad = [e["name"] for e in payload["entries"] if e["status"] in ("error", "timeout", "failed", "not run")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
