"""The GPU stages rehearsed on the CPU, offline, under the GPU machine's conditions as far as a CPU can mimic them.

``make gpu-rehearsal`` (the network cut with ``unshare -n`` where it can): runs ``run_stage.py --rehearsal`` for
stages 1 to 6 (tiny sizes; the CUDA transfer logic on the deferred stand-in) and fails on what would fail on
the GPU machine: a wheel missing or unmet (``wheels.py check``), a registry or hub call (no network), a
package taken from this interpreter's environment that the GPU image does not have (they are hidden: see
:func:`image_mimic`), an entry that errors or runs out of time (here at ``REHEARSAL_SLACK`` times its budget), a stage
over its 7 minutes, results that could not come back from the machine (over 8 files, folders deeper than 2, odd
names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import site
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu import wheels
from benchmarks.gpu.registry import STAGE_BUDGET_S, STAGES

OK = {"ok", "skipped", "planned"}
MAX_FILES = 8
NAME = re.compile(r"^[A-Za-z0-9._-]+$")

_SITECUSTOMIZE = '''"""The GPU-image mimic of the rehearsal: this interpreter's site-packages replaced by a copy without what the image lacks."""
import sys

_FARM = {farm!r}
_SITES = {sites!r}
sys.path[:] = [_FARM if p in _SITES else p for p in sys.path]
'''


def network_cut() -> bool:
    """Whether this process's network namespace has no interface but the loopback (``unshare -n``)."""
    import socket

    return {name for _, name in socket.if_nameindex()} <= {"lo"}


def _top_levels(dist: metadata.Distribution) -> set[str]:
    names = set()
    for f in dist.files or []:
        first = f.parts[0] if f.parts else ""
        if first and first != ".." and not first.endswith((".dist-info", ".egg-info", ".pth")):
            names.add(first.removesuffix(".py"))
    return names


def _needed(requirement: str) -> bool:
    """Whether a ``Requires-Dist`` line applies here without extras."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    return req.marker is None or req.marker.evaluate({"extra": ""})


def image_mimic(root: Path, image: set[str]) -> tuple[Path, list[str]]:
    """A ``sitecustomize`` that swaps this interpreter's site-packages for a symlink copy without the distributions the
    GPU image lacks (DeepSpeed, the carried ones, ...): a test collection or entry that imports one fails here as it
    would there, and the carried ones come from the wheels only. Returns the folder to put first on ``PYTHONPATH``
    and the hidden distributions."""
    sites = [s for s in site.getsitepackages() if Path(s).is_dir()]
    dists = {wheels.norm(d.metadata["Name"]): d for d in metadata.distributions(path=sites) if d.metadata["Name"]}
    # NOTE: what the image's packages need stays visible too: here their versions may differ from the image's and
    # need other distributions (hiding those would fail for a reason the GPU machine does not have)
    visible = {n for n in dists if n in image}
    todo = list(visible)
    while todo:
        for line in dists[todo.pop()].requires or []:
            name = wheels.norm(re.split(r"[ ;<>=!~\[(]", line, maxsplit=1)[0])
            if name in dists and name not in visible and _needed(line):
                visible.add(name)
                todo.append(name)
    visible_top: set[str] = set()
    hidden_top: set[str] = set()
    hidden_info: set[str] = set()
    hidden: list[str] = []
    for name, dist in dists.items():
        if name in visible:
            visible_top |= _top_levels(dist)
            continue
        hidden.append(dist.metadata["Name"])
        hidden_top |= _top_levels(dist)
        hidden_info |= {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0].endswith(".dist-info")}
    farm = root / "site-packages"
    farm.mkdir(parents=True)
    for s in sites:
        for entry in Path(s).iterdir():
            stem = entry.name.removesuffix(".py")
            if entry.name in hidden_info or (stem in hidden_top and stem not in visible_top):
                continue
            if not (farm / entry.name).exists():
                (farm / entry.name).symlink_to(entry)
    shim = root / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(farm=str(farm), sites=sites))
    return shim, sorted(hidden, key=str.lower)


def check_stage(stage: int, results: Path, seconds: float) -> list[str]:
    path = results / f"stage{stage}.json"
    if not path.is_file():
        return [f"stage {stage}: no results file {path}"]
    payload = json.loads(path.read_text())
    problems = [f"stage {stage}: {e['name']} {e['status']}: {e.get('reason') or e.get('error') or ''}"[:600]
                for e in payload["entries"] if e["status"] not in OK]
    for e in payload["entries"]:  # NOTE: within REHEARSAL_SLACK x its budget, or it would have stopped
        if (e.get("seconds") or 0) > e["budget_s"] > 0:
            print(f"note: stage {stage}: {e['name']} took {e['seconds']} s here, over its {e['budget_s']} s GPU budget")
    if seconds > STAGE_BUDGET_S:
        problems.append(f"stage {stage}: {seconds:.0f} s, over its {STAGE_BUDGET_S} s budget")
    if stage == 1:
        env = next(e for e in payload["entries"] if e["name"] == "environment")
        for name, _, _ in wheels.WHEELS:
            module = wheels.norm(name).replace("-", "_")
            row = next((r["value"] for r in env.get("rows", []) if r["fact"] == f"package {module}"), "")
            if "/site" not in row or "lowmem-gpu-stage" not in row:
                problems.append(f"stage 1: {module} not imported from the installed wheels ({row or 'not listed'})")
    return problems


def check_out(out: Path) -> list[str]:
    """What the GPU machine would not send back: over 8 files, deeper than 2 folders, odd names, over 16 MiB."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files in the results folder, more than {MAX_FILES}"] if len(files) > MAX_FILES else []
    for f in files:
        rel = f.relative_to(out)
        if len(rel.parts) > 3 or not all(NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: too deep or an odd name")
        if f.stat().st_size > 16 * 2**20:
            problems.append(f"{rel}: over 16 MiB")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--network-up-ok", action="store_true", help="run with the network up (pip stays --no-index)")
    parser.add_argument("--keep", type=Path, default=None, help="copy the results here")
    args = parser.parse_args(argv)
    problems: list[str] = []
    if not network_cut() and not args.network_up_ok:
        print("The network is up: run `make gpu-rehearsal` (unshare -n as root) or pass --network-up-ok.", file=sys.stderr)
        return 2
    image = wheels.image_packages()
    lines, wheel_problems = wheels.check(args.wheels, image, wheels.travel_bytes(REPO, args.wheels))
    print("\n".join(lines))
    problems += wheel_problems
    times = {}
    with tempfile.TemporaryDirectory(prefix="lowmem-gpu-rehearsal-") as tmp:
        shim, hidden = image_mimic(Path(tmp) / "mimic", image)
        print(f"hidden from this interpreter (not on the GPU image): {', '.join(hidden) or 'none'}")
        # NOTE: torch.compile'd code (torchao's optimizer steps) runs eagerly here: its C++ builds take minutes on 2
        # shared cores and tell nothing of the GPU machine's Triton builds
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "PIP_NO_INDEX": "1", "TORCHDYNAMO_DISABLE": "1"}
        results = Path(tmp) / "results"
        for stage in map(int, args.stages.split(",")):
            out = Path(tmp) / f"out{stage}"  # NOTE: on the GPU machine each stage is one command with its own folder
            t0 = time.time()
            cmd = [sys.executable, str(REPO / "benchmarks/gpu/run_stage.py"), "--stage", str(stage), "--rehearsal",
                   "--wheels", str(args.wheels), "--results", str(results), "--out", str(out)]
            rc = subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
            times[stage] = time.time() - t0
            problems += check_stage(stage, results, times[stage])
            if rc not in (0, 1):
                problems.append(f"stage {stage}: run_stage.py exited {rc}")
            problems += [f"stage {stage}: {p}" for p in check_out(out)]
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for f in out.iterdir():
                    (args.keep / f.name).write_bytes(f.read_bytes())
    print("\nrehearsal: " + ", ".join(f"stage {s} {t:.0f} s" for s, t in times.items())
          + f" (budget {STAGE_BUDGET_S} s each on the GPU); network {'cut' if network_cut() else 'UP'}")
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    print("rehearsal " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
