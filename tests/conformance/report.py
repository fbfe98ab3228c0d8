"""``benchmarks/results/conformance.json`` and ``conformance.md`` from the sweep's store (the rows of one code
fingerprint; the last row of each cell wins)."""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

VERDICTS = ("exact", "close", "refused", "differs", "crash", "n/a")
DRY_VERDICTS = ("ok", "off", "refused", "n/a", "crash")
COMMAND = "python tests/conformance/run.py"


def _rows(store: Path, fp: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    sessions = []
    for line in store.read_text().splitlines() if store.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("fingerprint") != fp:
            continue
        if "session" in row:
            sessions.append(row)
        elif "verdict" in row:
            cells[(row["module"], row["flag"])] = row
    return list(cells.values()), sessions


def _machine() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _harness import machine

    return machine()


def write(store: Path, fp: str, results: Path) -> tuple[Path, Path]:
    from tests.conformance.companions import COMPANIONS
    from tests.conformance.corpus import CALLBACK_HOSTS, MODULES
    from tests.conformance.flags import FLAGS
    from tests.conformance.known_bugs import classify

    rows, sessions = _rows(store, fp)
    for r in rows:
        known = classify(r)
        if known is not None:
            r["known"] = {"what": known.what, "where": known.where}
    cells = [r for r in rows if r.get("kind") != "dry_run"]
    dry = [r for r in rows if r.get("kind") == "dry_run"]
    counts = Counter(r["verdict"] for r in cells)
    families_path = results / "conformance_families.json"
    families = json.loads(families_path.read_text()) if families_path.exists() else None
    payload = {
        "benchmark": "conformance",
        "title": "Conformance corpus: every technique on modules unlike ours, against plain Lightning (CPU)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": COMMAND,
        "machine": _machine(),
        "fingerprint": fp,
        "sweep_seconds": round(sum(s["seconds"] for s in sessions), 1),
        "cell_seconds": round(sum(r.get("seconds") or 0 for r in rows), 1),
        "counts": {v: counts.get(v, 0) for v in VERDICTS},
        "dry_run_counts": {v: Counter(r["verdict"] for r in dry).get(v, 0) for v in DRY_VERDICTS},
        "modules": [{"name": m.name, "kind": m.kind, "note": m.note, "tags": sorted(m.tags)} for m in MODULES.values()],
        "flags": [{"name": f.name, "compare": f.compare, "reason": f.reason, "group": f.group} for f in FLAGS],
        "lightning_callbacks": {"hosts": list(CALLBACK_HOSTS), "callbacks": [c.name for c in COMPANIONS]},
        "families": families,
        "cells": sorted(cells, key=lambda r: (r["module"], r["flag"])),
        "dry_run": sorted(dry, key=lambda r: (r["module"], r["flag"])),
    }
    results.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results / "conformance.json", results / "conformance.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md_path.write_text(_markdown(payload))
    print(f"wrote {json_path} and {md_path}: {dict(counts)}")
    return json_path, md_path


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _markdown(p: dict[str, Any]) -> str:
    m = p["machine"]
    header = (f"Run {p['date']} on {m['processor']}, {m['cpu_count']} cores, GPU: {m['gpu'] or 'none'}; torch "
              f"{m['torch']}, lightning {m['lightning']}, transformers {m.get('transformers', '-')}. Command: "
              f"`{p['command']}` (code fingerprint `{p['fingerprint']}`). Sweep wall time {p['sweep_seconds'] / 60:.1f} "
              f"min (cells alone {p['cell_seconds'] / 60:.1f} min), one worker at a time, nice 10, one torch thread.")
    method = ("Each cell trains a fresh module for 3 optimizer steps (or the Lightning callback's schedule) with the "
              "flag and compares every parameter and buffer with plain Lightning at the same precision and optimizer "
              "(`tests/conformance/compare.py` says what `close` allows, per flag; `flags.py` gives each reason).")
    out = [f"# {p['title']}", "", header, "", method, "",
           "## Verdicts", "", _table(list(VERDICTS), [[p["counts"][v] for v in VERDICTS]]), ""]
    bad = [r for r in p["cells"] if r["verdict"] in ("differs", "crash")]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in bad:
        groups[r.get("known", {}).get("where", "unexplained")].append(r)
    summary = (f"{len(bad)} cells: {len(bad) - len(groups.get('unexplained', []))} are known bugs "
               "(`tests/conformance/known_bugs.py`: being fixed, or reproduced under `tests/conformance/known/`).")
    out += ["## differs and crash", "", summary, ""]
    known_rows = []
    for where, rows in sorted(groups.items()):
        if where != "unexplained":
            for what, n in Counter(r["known"]["what"] for r in rows).items():
                known_rows.append([what, where, n, ", ".join(sorted({r["module"] for r in rows
                                                                     if r["known"]["what"] == what}))[:200]])
    out += [_table(["known bug", "where", "cells", "modules"], known_rows) if known_rows else "", ""]
    unexplained = groups.get("unexplained", [])
    out += ["### Not yet explained", "", _table(["module", "flag", "verdict", "detail"], [
        [r["module"], r["flag"], r["verdict"], r["detail"]] for r in unexplained]) if unexplained else "none", ""]
    per_module: dict[str, Counter] = defaultdict(Counter)
    for r in p["cells"]:
        per_module[r["module"]][r["verdict"]] += 1
    out += ["## Per module", "", _table(["module", "kind", *VERDICTS], [
        [m["name"], m["kind"], *[per_module[m["name"]].get(v, 0) for v in VERDICTS]] for m in p["modules"]
        if m["name"] in per_module]), ""]
    per_flag: dict[str, Counter] = defaultdict(Counter)
    for r in p["cells"]:
        per_flag[r["flag"].split(" + ")[0]][r["verdict"]] += 1
    out += ["## Per flag (with and without Lightning's callbacks)", "", _table(["flag", *VERDICTS], [
        [f["name"], *[per_flag[f["name"]].get(v, 0) for v in VERDICTS]] for f in p["flags"] if f["name"] in per_flag]),
        ""]
    out += ["## Dry run: predicted vs measured peak (MemoryReport), per module", "",
            _table(list(DRY_VERDICTS), [[p["dry_run_counts"][v] for v in DRY_VERDICTS]]), "",
            _table(["module", "run", "verdict", "device error", "host error", "detail"], [
                [r["module"], r["flag"].removeprefix("dry_run:"), r["verdict"],
                 f"{r['error_device']:+.3%}" if "error_device" in r else "-",
                 f"{r['error_host']:+.3%}" if "error_host" in r else "-",
                 r["detail"][:160] if r["verdict"] not in ("ok",) else ""] for r in p["dry_run"]]), ""]
    refused: dict[str, Counter] = defaultdict(Counter)
    for r in p["cells"]:
        if r["verdict"] in ("refused", "n/a"):
            refused[r["verdict"]][r["detail"][:110]] += 1
    for verdict, reasons in refused.items():
        out += [f"## {verdict}: the messages (cells)", "", _table(["cells", "message (start)"], [
            [n, text] for text, n in reasons.most_common()]), ""]
    if p["families"]:
        fam = p["families"]
        out += ["## transformers families", "", fam.get("summary", ""), "", _table(["model type", "kind", "status"], [
            [f["model_type"], f["kind"], f["status"]] for f in fam["families"]]), ""]
    return "\n".join(out) + "\n"
