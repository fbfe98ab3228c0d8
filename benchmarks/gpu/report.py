"""A stage's results as one JSON file and one markdown file (rewritten after every entry, so a cut run keeps its part)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LOG_LIMIT_BYTES = 12 * 2**20  # NOTE: files coming back from the GPU machine may be 16 MiB each at most


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


def write(payload: dict[str, Any], dirs: list[Path], log: Path | None = None) -> None:
    """``stage{N}.json`` and ``stage{N}.md`` (and the log, capped) into each of ``dirs``, atomically."""
    name = f"stage{payload['stage']}"
    text_json = json.dumps(payload, indent=1, default=str) + "\n"
    text_md = markdown(payload)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        for path, text in ((d / f"{name}.json", text_json), (d / f"{name}.md", text_md)):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        if log is not None and log.is_file() and log.parent.resolve() != d.resolve():
            data = log.read_bytes()[-LOG_LIMIT_BYTES:]
            (d / f"{name}.log").write_bytes(data)
