"""The wheels the GPU stages carry to the GPU machine (``make gpu-wheels``), and the checks that they will do there.

The GPU machine has no network: what its image lacks travels as wheels inside the working tree, in the ignored
``.whl/`` folder (the whole tree that travels: at most 64 MiB). ``python benchmarks/gpu/wheels.py download`` fetches
exactly :data:`WHEELS` (pure-Python or manylinux, for CPython 3.12) with ``pip download --no-deps``;
``... check`` verifies, without a network:

- each wheel of :data:`WHEELS` is there once, at its pinned version, and nothing else is (two versions of one package
  stop the install there);
- every requirement of every wheel (with the extras the package asks for: ``jsonargparse[signatures]``), evaluated for
  CPython 3.12 on Linux, is another wheel of the folder or a package of the image (``image_packages.txt``);
- ``.whl/`` holds at most 60 MiB, and the tree that travels (tracked files, untracked files git does not ignore, and
  ``.whl/``) less than 64 MiB.

DeepSpeed is not carried: it is published as a source distribution only and its ops compile with nvcc on the
machine that runs them, which belongs in a later stage of its own (see ``stage3.py``'s planned ``deepspeed_zero``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
WHEEL_LIMIT = 60 * MiB
TREE_LIMIT = 64 * MiB

#: (distribution, version, why the GPU stages need it): what the image lacks
WHEELS = (
    ("bitsandbytes", "0.50.2", "LowBitOptimizer's CUDA kernels (stage 3) and the bnb-marked tests"),
    ("jsonargparse", "4.53.0", "the package's CLI dependency: test modules import it at collection (stage 1)"),
    ("docstring-parser", "0.18.0", "jsonargparse[signatures]"),
    ("typeshed-client", "2.14.0", "jsonargparse[signatures]"),
    ("liger-kernel", "0.8.5", "ChunkedLMLoss(backend='liger') (stage 3)"),
    ("cut-cross-entropy", "25.1.1", "ChunkedLMLoss(backend='cce') (stage 3)"),
    ("galore-torch", "1.0", "LeanOptimizer(kind='galore') (stage 4)"),
    ("apollo-torch", "1.0.3", "LeanOptimizer(kind='apollo_mini') (stage 4)"),
    ("adam-mini", "1.1.1", "LeanOptimizer(kind='adam_mini') (stage 4)"),
    ("torchao", "0.18.0", "LeanOptimizer(kind='adamw8bit'|'adamw4bit') (stage 4); its optimizers need torch >= 2.11"),
)
#: extras of a carried distribution that the package uses (their requirements must be met too)
EXTRAS = {"jsonargparse": ("signatures",)}
#: the GPU machine's python3
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_system": "Linux", "sys_platform": "linux",
          "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
          "platform_python_implementation": "CPython"}
PLATFORMS = ("manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "any")


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: str
    requires: tuple[str, ...]


def read_wheel(path: Path) -> Wheel:
    """Name, version and ``Requires-Dist`` lines from a wheel's ``*.dist-info/METADATA``."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        lines = z.read(meta).decode("utf-8", "replace").split("\n\n", 1)[0].splitlines()
    fields: dict[str, list[str]] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), []).append(value.strip())
    return Wheel(path, fields["Name"][0], fields["Version"][0], tuple(fields.get("Requires-Dist", [])))


IMAGE_PACKAGES = Path(__file__).with_name("image_packages.txt")


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    """The normalized names of ``image_packages.txt`` (the GPU image's preinstalled Python packages)."""
    return {norm(line) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def unmet(wheels: list[Wheel], image: set[str]) -> list[str]:
    """Requirements of ``wheels`` (with :data:`EXTRAS`) that neither another wheel nor the image meets."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # NOTE: a bare python3 (no packaging installed) still has pip's copy
        from pip._vendor.packaging.requirements import Requirement

    by_name = {norm(w.name): w for w in wheels}
    problems: list[str] = []
    todo = [(w, extra) for w in wheels for extra in ("", *EXTRAS.get(norm(w.name), ()))]
    seen: set[tuple[str, str]] = set()
    while todo:
        wheel, extra = todo.pop()
        if (norm(wheel.name), extra) in seen:
            continue
        seen.add((norm(wheel.name), extra))
        for line in wheel.requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**TARGET, "extra": extra}):
                continue
            name = norm(req.name)
            what = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "") + str(req.specifier)
            if name in by_name:
                carried = by_name[name]
                if req.specifier and not req.specifier.contains(carried.version, prereleases=True):
                    problems.append(f"{wheel.name}{f'[{extra}]' if extra else ''} needs {what}, the wheel is "
                                    f"{carried.version}")
                todo += [(carried, e) for e in req.extras]
            elif name not in image:
                problems.append(f"{wheel.name}{f'[{extra}]' if extra else ''} needs {what}: neither a wheel in the "
                                "folder nor a package of the GPU image")
    return sorted(set(problems))


def travel_bytes(repo: Path, wheel_dir: Path) -> int:
    """Bytes of the tree that travels: tracked + untracked-not-ignored files (git), plus the wheels."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.decode().split("\0")
    files = {repo / f for f in listed if f}
    total = sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())
    return total + sum(f.stat().st_size for f in wheel_dir.glob("*") if f.is_file()) if wheel_dir.is_dir() else total


def check(wheel_dir: Path, image: set[str], tree_bytes: int, wanted: Iterable[tuple[str, str, str]] = WHEELS,
          wheel_limit: int = WHEEL_LIMIT, tree_limit: int = TREE_LIMIT) -> tuple[list[str], list[str]]:
    """``(report lines, problems)`` for the wheels of ``wheel_dir`` (see the module's docstring)."""
    files = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    wheels = [read_wheel(f) for f in files]
    problems: list[str] = []
    wanted = list(wanted)
    for name, version, why in wanted:
        have = [w for w in wheels if norm(w.name) == norm(name)]
        if not have:
            problems.append(f"missing {name}=={version} ({why}): run `make gpu-wheels`")
        elif len(have) > 1 or have[0].version != version:
            problems.append(f"{name}: expected {version} once, found {', '.join(w.path.name for w in have)}")
    names = {norm(n) for n, _, _ in wanted}
    problems += [f"{w.path.name} is not in the list of benchmarks/gpu/wheels.py (remove it)"
                 for w in wheels if norm(w.name) not in names]
    problems += unmet(wheels, image)
    size = sum(f.stat().st_size for f in files)
    lines = [f"{f.name}: {f.stat().st_size / MiB:.2f} MiB" for f in files]
    lines.append(f".whl total: {size / MiB:.2f} MiB (limit {wheel_limit / MiB:.0f} MiB)")
    lines.append(f"tree that travels (tracked + untracked-not-ignored + .whl): {tree_bytes / MiB:.2f} MiB "
                 f"(limit: under {tree_limit / MiB:.0f} MiB)")
    if size > wheel_limit:
        problems.append(f".whl holds {size / MiB:.2f} MiB, over {wheel_limit / MiB:.2f} MiB")
    if tree_bytes >= tree_limit:
        problems.append(f"the tree that travels is {tree_bytes / MiB:.2f} MiB, not under {tree_limit / MiB:.2f} MiB")
    return lines, problems


def download(wheel_dir: Path, wanted: Iterable[tuple[str, str, str]] = WHEELS) -> None:
    """``pip download --no-deps`` each wanted wheel for CPython 3.12 on manylinux x86-64 (skipping those present)."""
    wheel_dir.mkdir(exist_ok=True)
    present = {(norm(w.name), w.version) for w in map(read_wheel, wheel_dir.glob("*.whl"))}
    for name, version, _ in wanted:
        if (norm(name), version) in present:
            continue
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *(x for p in PLATFORMS for x in ("--platform", p)), "-d", str(wheel_dir), f"{name}=={version}"]
        subprocess.run(cmd, check=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("download", "check"):
        print("usage: python benchmarks/gpu/wheels.py download|check [WHEEL_DIR]", file=sys.stderr)
        return 2
    wheel_dir = Path(argv[1]) if len(argv) > 1 else REPO / ".whl"
    if argv[0] == "download":
        download(wheel_dir)
    lines, problems = check(wheel_dir, image_packages(), travel_bytes(REPO, wheel_dir))
    print("\n".join(lines))
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
