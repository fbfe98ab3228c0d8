"""A stage's results as one JSON file and one markdown file, and ``summary.md``: every stage's figures, each beside
its dry-run prediction and the CPU figure it replaces (rewritten after every figure, so a cut run keeps its part).

An entry's ``figures`` are the lines a person reads: ``{"figure": what, "gpu": the measured value, "dry_run": the
prediction or None, "cpu": the CPU figure (or earlier dry run) it replaces, with its file, or None, "headline":
whether the README's headline table shows it}``. ``make figures`` puts the headline ones in the README
(:func:`headline_rows`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LOG_LIMIT_BYTES = 12 * 2**20  # NOTE: files coming back from the GPU machine may be 16 MiB each at most
SUMMARY = "summary.md"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value, default=str)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    if not columns:
        return ""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def figures(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures of every entry of ``stages`` (stage payloads), in stage and entry order, with where they came from."""
    out = []
    for payload in sorted(stages, key=lambda p: p["stage"]):
        for e in payload["entries"]:
            for fig in e.get("figures", []):
                out.append({**fig, "stage": payload["stage"], "entry": e["name"], "status": e["status"],
                            "mode": payload["mode"], "device": payload["machine"].get("device"),
                            "date": payload["date"][:10]})
    return out


def figures_table(figs: list[dict[str, Any]]) -> str:
    return table([{"figure": f["figure"], "measured": f["gpu"], "dry-run prediction": f.get("dry_run"),
                   "CPU figure it replaces": f.get("cpu"), "entry": f"stage {f['stage']} `{f['entry']}` ({f['status']})"}
                  for f in figs])


def headline_rows(stages: list[dict[str, Any]]) -> list[list[str]]:
    """``[figure, value, label, results file stem]`` of the headline figures of GPU ``stages``, for the README's
    table (``make figures``)."""
    return [[f["figure"], f["gpu"] + (f"; dry run {f['dry_run']}" if f.get("dry_run") else ""),
             f"**GPU** ({f['device']}, {f['date']})", f"gpu/stage{f['stage']}"]
            for f in figures(stages) if f.get("headline") and f["status"] in ("ok", "failed", "timeout", "running")]


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    out = [
        f"# GPU stage {payload['stage']}: {payload['title']}",
        "",
        (f"{payload['mode']}, {payload['date']}. Device: {m.get('device') or 'none'}; driver {m.get('driver') or '-'}; "
         f"torch {m.get('torch')} (CUDA {m.get('torch_cuda') or '-'}); python {m.get('python')}; "
         f"{m.get('cpu_count')} CPUs. Command: `{payload['command']}`. Stage time {payload['seconds']} s of "
         f"{payload['budget_s']} s."),
        "",
        f"Wheels installed from `{payload['wheels']['dir']}`: {', '.join(payload['wheels']['installed']) or 'none'}.",
        "",
        table([{"entry": e["name"], "status": e["status"], "seconds": e.get("seconds"), "budget_s": e["budget_s"],
                "what": e["what"]} for e in payload["entries"]]),
    ]
    figs = figures([payload])
    if figs:
        out += ["", "## Figures", "", figures_table(figs)]
    for e in payload["entries"]:
        if e["status"] == "planned":
            continue
        out += ["", f"## {e['name']}: {e['status']}", "", e["what"] + "."]
        if e.get("rows"):
            out += ["", table(e["rows"])]
        out += [f"- {n}" for n in [""] + list(e.get("notes", []))][1:] if e.get("notes") else []
        for key in ("reason", "error"):
            if e.get(key):
                out += ["", f"**{key}**: {e[key]}"]
        if e.get("traceback"):
            out += ["", "```", *e["traceback"].strip().splitlines()[-15:], "```"]
    planned = [e for e in payload["entries"] if e["status"] == "planned"]
    if planned:
        out += ["", "## Planned entries (slots kept for later work)", ""]
        out += [f"- `{e['name']}`: {e['what']}. {e.get('reason', '')}" for e in planned]
    return "\n".join(out) + "\n"


def stages_in(folder: Path) -> list[dict[str, Any]]:
    """The stage payloads of ``folder`` (``stage{N}.json``), by stage."""
    return sorted((json.loads(p.read_text()) for p in folder.glob("stage*.json")), key=lambda p: p["stage"])


def summary(stages: list[dict[str, Any]]) -> str:
    """The results page: every figure of ``stages`` beside its dry-run prediction and the CPU figure it replaces."""
    out = ["# GPU figures", "",
           ("Each figure measured by `make gpu-check STAGE=N` (docs/gpu-checks.md) beside the dry run's prediction of "
            "the same run and the CPU figure (or earlier dry run) it replaces. Written by `benchmarks/gpu/run_stage.py`"
            " from the `stageN.json` beside this page; the details, notes and raw rows are in each `stageN.md`."), ""]
    if not stages:
        return "\n".join(out + ["No stage has run yet.", ""])
    out += [table([{"stage": p["stage"], "title": p["title"], "mode": p["mode"], "device": p["machine"].get("device"),
                    "date": p["date"][:10], "seconds": p["seconds"],
                    "entries": ", ".join(f"{e['name']} {e['status']}" for e in p["entries"] if e["status"] != "planned")}
                   for p in stages]), ""]
    figs = figures(stages)
    out += [figures_table(figs) if figs else "No figure recorded yet.", ""]
    return "\n".join(out)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(payload: dict[str, Any], dirs: list[Path], log: Path | None = None) -> None:
    """``stage{N}.json`` and ``stage{N}.md`` (and the log, capped) into each of ``dirs``, atomically, then
    ``summary.md`` of every stage in ``dirs[0]`` (the results folder) into each."""
    name = f"stage{payload['stage']}"
    text_json = json.dumps(payload, indent=1, default=str) + "\n"
    text_md = markdown(payload)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        _write(d / f"{name}.json", text_json)
        _write(d / f"{name}.md", text_md)
        if log is not None and log.is_file() and log.parent.resolve() != d.resolve():
            (d / f"{name}.log").write_bytes(log.read_bytes()[-LOG_LIMIT_BYTES:])
    text_summary = summary(stages_in(dirs[0]))
    for d in dirs:
        _write(d / SUMMARY, text_summary)
