"""``benchmarks/results/conformance.json`` and ``conformance.md`` from the sweep's store: the latest row of every cell
of the corpus, whatever code it ran at, each labelled with its code fingerprint. The headline says how many cells ran
at the current code and how many carry an earlier fingerprint (which, with the commit its sessions recorded), and how
many never ran: a cell not re-run after a change is reported as what it was, at the code it ran on."""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

VERDICTS = ("exact", "close", "refused", "differs", "crash", "n/a")
DRY_VERDICTS = ("ok", "bound", "off", "refused", "n/a", "crash")
COMMAND = "python tests/conformance/run.py"


def _lines(store: Path) -> list[dict[str, Any]]:
    out = []
    for line in store.read_text().splitlines() if store.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def latest(store: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The last row of each (module, cell) in the store (rows are appended as cells finish), at any fingerprint."""
    return {(r["module"], r["flag"]): r for r in _lines(store) if "verdict" in r and "fingerprint" in r}


def universe() -> set[tuple[str, str]]:
    """(module, cell) of the whole sweep over the current corpus."""
    from tests.conformance.corpus import MODULES
    from tests.conformance.worker import GROUPS, cell_name, cells

    return {(m, cell_name(f, c)) for m in MODULES for g in GROUPS for f, c in cells(m, g)}


def _rows(store: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, int]:
    """The latest row of each cell of the current corpus, the sessions, the cells never run and the rows of cells
    no longer in the corpus (left out)."""
    cells, want = latest(store), universe()
    rows = [dict(r) for k, r in cells.items() if k in want]
    return rows, [r for r in _lines(store) if "session" in r], len(want - cells.keys()), len(cells.keys() - want)


def _codes(rows: list[dict[str, Any]], sessions: list[dict[str, Any]], fp: str) -> list[dict[str, Any]]:
    """Each fingerprint the reported rows carry: cells, the dates its cells finished, the commit(s) its sessions ran
    at (when recorded), current or earlier."""
    by_fp: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_fp[r["fingerprint"]].append(r)
    out = []
    for code, rs in sorted(by_fp.items(), key=lambda kv: (kv[0] != fp, -len(kv[1]))):
        dates = sorted(r["finished"] for r in rs if r.get("finished"))
        commits = sorted({s["commit"] for s in sessions if s.get("fingerprint") == code and s.get("commit")})
        out.append({"fingerprint": code, "current": code == fp, "cells": len(rs),
                    "first": dates[0] if dates else None, "last": dates[-1] if dates else None,
                    "commits": commits or ["not recorded"]})
    return out


def _machine() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _harness import machine

    return machine()


def write(store: Path, fp: str, results: Path) -> tuple[Path, Path]:
    from tests.conformance.companions import COMPANIONS
    from tests.conformance.corpus import CALLBACK_HOSTS, MODULES
    from tests.conformance.flags import FLAGS
    from tests.conformance.known_bugs import classify

    rows, all_sessions, never_run, left_out = _rows(store)
    codes = _codes(rows, all_sessions, fp)
    shown = {c["fingerprint"] for c in codes}
    sessions = [s for s in all_sessions if s.get("fingerprint") in shown]
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
        "codes": codes,
        "cells_at_current_code": sum(c["cells"] for c in codes if c["current"]),
        "cells_at_earlier_code": sum(c["cells"] for c in codes if not c["current"]),
        "cells_never_run": never_run,
        "rows_of_cells_no_longer_in_the_corpus": left_out,
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
    print(f"wrote {json_path} and {md_path}: {dict(counts)}; {_provenance(payload)}")
    return json_path, md_path


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _provenance(p: dict[str, Any]) -> str:
    """Which code the reported cells ran at: the headline's sentence."""
    current = next((c for c in p["codes"] if c["current"]), None)
    earlier = [c for c in p["codes"] if not c["current"]]
    total = p["cells_at_current_code"] + p["cells_at_earlier_code"]
    text = (f"{p['cells_at_current_code']} of {total} cells ran at the current code (fingerprint `{p['fingerprint']}`"
            + (f", commit {', '.join(current['commits'])}" if current else "") + ")")
    if earlier:
        text += "; " + "; ".join(f"{c['cells']} carry the earlier fingerprint `{c['fingerprint']}` (commit "
                                 f"{', '.join(c['commits'])}, run {c['first']} to {c['last']})" for c in earlier)
        text += " and were not re-run at the current code"
    if p["cells_never_run"]:
        text += f"; {p['cells_never_run']} cells of the corpus never ran"
    return text + "."


def _code_counts(rows: list[dict[str, Any]]) -> str:
    """``fingerprint: cells`` of these rows, the most frequent first."""
    return ", ".join(f"{fp} ({n})" for fp, n in Counter(r["fingerprint"] for r in rows).most_common())


def _corpus_line(p: dict[str, Any]) -> str:
    """What the corpus holds, counted honestly: transformers families (one architecture each, grouped by task head)
    apart from the hand-written modules (grouped by what they exercise), and where the left-out families are listed."""
    hf = [m for m in p["modules"] if "hf" in m["tags"] and m["name"].startswith("hf_")]
    own = [m for m in p["modules"] if m not in hf]
    hf_kinds, own_kinds = sorted({m["kind"] for m in hf}), sorted({m["kind"] for m in own})
    screened = ("the transformers model types left out, each with its reason, are listed at the end (`screen.py`)"
                if p["families"] else "no screen of the other transformers model types is in this report (run "
                "`python tests/conformance/screen.py` to list which are left out and why)")
    return (f"{len(p['modules'])} modules: {len(hf)} transformers model families (architectures; task heads: "
            f"{', '.join(hf_kinds)}) and {len(own)} hand-written modules of {len(own_kinds)} kinds "
            f"({', '.join(own_kinds)}): {len(hf) + len(own_kinds)} families and kinds in all, "
            f"{len(hf_kinds) + len(own_kinds)} if each transformers task head counts once; {screened}.")


def _markdown(p: dict[str, Any]) -> str:
    m = p["machine"]
    header = (f"Report of {p['date']}, cells run on {m['processor']}, {m['cpu_count']} cores, GPU: {m['gpu'] or 'none'}; torch "
              f"{m['torch']}, lightning {m['lightning']}, transformers {m.get('transformers', '-')}. Command: "
              f"`{p['command']}`. {_provenance(p)} Sweep wall time {p['sweep_seconds'] / 60:.1f} "
              f"min (cells alone {p['cell_seconds'] / 60:.1f} min) over the sessions of these fingerprints, one worker "
              "at a time, nice 10, one torch thread.")
    method = ("Each cell trains a fresh module for 3 optimizer steps (or the Lightning callback's schedule) with the "
              "flag and compares every parameter and buffer with plain Lightning at the same precision and optimizer "
              "(`tests/conformance/compare.py` says what `close` allows, per flag; `flags.py` gives each reason).")
    out = [f"# {p['title']}", "", header, "", method, "", "## Corpus", "", _corpus_line(p), "",
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
                mine = [r for r in rows if r["known"]["what"] == what]
                known_rows.append([what, where, n, ", ".join(sorted({r["module"] for r in mine}))[:200],
                                   _code_counts(mine)])
    out += [_table(["known bug", "where", "cells", "modules", "code"], known_rows) if known_rows else "", ""]
    unexplained = groups.get("unexplained", [])
    out += ["### Not yet explained", "", _table(["module", "flag", "verdict", "code", "detail"], [
        [r["module"], r["flag"], r["verdict"], r["fingerprint"], r["detail"]] for r in unexplained])
        if unexplained else "none", ""]
    per_module: dict[str, Counter] = defaultdict(Counter)
    for r in p["cells"]:
        per_module[r["module"]][r["verdict"]] += 1
    codes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in p["cells"]:
        codes[r["module"]].append(r)
    out += ["## Per module", "", _table(["module", "kind", *VERDICTS, "code"], [
        [m["name"], m["kind"], *[per_module[m["name"]].get(v, 0) for v in VERDICTS], _code_counts(codes[m["name"]])]
        for m in p["modules"] if m["name"] in per_module]), ""]
    per_flag: dict[str, Counter] = defaultdict(Counter)
    for r in p["cells"]:
        per_flag[r["flag"].split(" + ")[0]][r["verdict"]] += 1
    out += ["## Per flag (with and without Lightning's callbacks)", "", _table(["flag", *VERDICTS], [
        [f["name"], *[per_flag[f["name"]].get(v, 0) for v in VERDICTS]] for f in p["flags"] if f["name"] in per_flag]),
        ""]
    out += ["## Dry run: predicted vs measured peak (MemoryReport), per module", "",
            _table(list(DRY_VERDICTS), [[p["dry_run_counts"][v] for v in DRY_VERDICTS]]), "",
            _table(["module", "run", "verdict", "code", "device error", "host error", "detail"], [
                [r["module"], r["flag"].removeprefix("dry_run:"), r["verdict"], r["fingerprint"],
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
