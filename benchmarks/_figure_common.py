"""What every figure block uses: the results files, labels read from them, number formats, markdown tables."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Block = Callable[["Results"], str]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class Results:
    """The JSON files of ``benchmarks/results/`` (and ``gpu/``), each read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._cache: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: run `python benchmarks/run.py {name.split('/')[-1]}`.")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]

    def gpu_stages(self) -> list[dict[str, Any]]:
        """The GPU checks' stage results (``make gpu-check STAGE=N`` writes ``gpu/stageN.json``), oldest stage first."""
        stages = [self[f"gpu/{p.stem}"] for p in sorted((self.folder / "gpu").glob("stage*.json"))]
        return [s for s in stages if s.get("mode") == "GPU"]  # NOTE: a CPU rehearsal's figures are no GPU figures


def block(*sources: str) -> Callable[[Block], Block]:
    """Marks a block function with the result files it reads (``figures.py --list``)."""

    def mark(fn: Block) -> Block:
        fn.sources = sources  # type: ignore[attr-defined]
        return fn

    return mark


# --- labels: read from the results, never typed per table ---------------------------------------------------------
def where(doc: dict[str, Any]) -> str:
    """**GPU** (its name) when the machine that wrote the file had one, else **CPU**."""
    gpu = doc.get("machine", {}).get("gpu")
    return f"**GPU** ({gpu})" if gpu else "**CPU**"


def target(doc: dict[str, Any]) -> str:
    """The target a dry run predicted for, as the results name it (title or notes)."""
    text = " ".join([doc.get("title", ""), *map(str, doc.get("notes", []))])
    if re.search(r"cuda target|target[ =:']*'?cuda", text, re.IGNORECASE):
        return "CUDA target, uncalibrated until a GPU run confirms it"
    return "CPU target"


def dry_run(doc: dict[str, Any]) -> str:
    return f"**dry run** ({target(doc)}; computed on the {where(doc).strip('*').split(' ')[0]})"


def is_dry_run(rows: Iterable[dict[str, Any]]) -> bool:
    """Rows that say they are predictions: ``method`` starting with ``dry_run`` or ``part`` naming an estimate."""
    rows = list(rows)
    return bool(rows) and all(str(r.get("method", r.get("part", ""))).startswith(("dry_run", "estimate")) for r in rows)


def machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    gpu = m.get("gpu")
    return f"{m.get('cpu_count', '?')} CPU cores, " + (f"GPU {gpu}" if gpu else "no GPU")


def source(doc: dict[str, Any], label: str, name: str | None = None) -> str:
    """The line under every table: label, file, date, machine, command."""
    name = name or doc["benchmark"]
    return (f"Source: {label} · `benchmarks/results/{name}.json` ({doc['date'][:10]}, {machine(doc)}) · "
            f"`{doc['command']}`")


# --- numbers -------------------------------------------------------------------------------------------------------
def parse_bytes(text: str | float) -> float:
    """``"112.31 MiB"`` -> bytes (the results' human-readable columns)."""
    if isinstance(text, (int, float)):
        return float(text)
    value, unit = str(text).split()
    return float(value) * UNITS[unit]


def human(n: float, digits: int = 2) -> str:
    """Bytes in the largest binary unit below them: ``1.96 GiB``, ``8.00 KiB``, ``0 B``."""
    if n == 0:
        return "0 B"
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit]:
            return f"{n / UNITS[unit]:.{digits}f} {unit}"
    return f"{n:.0f} B"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float, digits: int = 1) -> str:
    return f"{n / 2**20:,.{digits}f} MiB"


def x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}x"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if c is None else str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def note(doc: dict[str, Any], startswith: str) -> str:
    """The results' own note starting with ``startswith`` (a clear error when the benchmark no longer writes it)."""
    for n in doc.get("notes", []):
        if str(n).startswith(startswith):
            return str(n)
    raise KeyError(f"benchmarks/results/{doc['benchmark']}.json has no note starting {startswith!r}")


def rows(doc: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    """The rows whose fields equal ``match`` (in file order)."""
    return [r for r in doc["rows"] if all(r.get(k) == v for k, v in match.items())]


def one(doc: dict[str, Any], **match: Any) -> dict[str, Any]:
    found = rows(doc, **match)
    if len(found) != 1:
        raise KeyError(f"benchmarks/results/{doc['benchmark']}.json: {len(found)} rows match {match}, expected 1")
    return found[0]
