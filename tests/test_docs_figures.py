"""The README and docs/ stay true and navigable: every figure block is what benchmarks/figures.py writes from the
committed results, the README stays short, every relative link of the README resolves, and the site builds with
``mkdocs build --strict`` (broken links inside docs/, unresolved API names)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks._figure_common import Results, where

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target), ![image](target)


def copy_tree(tmp_path: Path) -> Path:
    """README, docs/ and the results, as the figures script sees them, in a scratch folder."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", root / "benchmarks" / "results")
    return root


def test_committed_pages_hold_what_the_figures_script_writes():
    problems = figures.run(check=True)
    assert not problems, "\n".join(problems)


def test_a_changed_result_is_caught(tmp_path):
    root = copy_tree(tmp_path)
    path = root / "benchmarks" / "results" / "low_bit_optimizer.json"
    doc = json.loads(path.read_text())
    doc["rows"][1]["opt_B/param"] = 2.5  # the 8-bit AdamW state of a (pretend) new run
    path.write_text(json.dumps(doc))
    problems = figures.run(check=True, root=root)
    assert any("README.md" in p and "headline" in p for p in problems), problems
    assert any("low-bit-optimizers.md" in p and "low_bit_optimizer" in p for p in problems), problems
    assert figures.run(check=False, root=root) == []  # `make figures` rewrites them ...
    assert "**2.50 B/param**" in (root / "README.md").read_text()
    assert figures.run(check=True, root=root) == []  # ... and then they agree


def test_hand_edited_figure_is_caught(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs" / "estimate.md"
    text = page.read_text()
    assert "6.32 GiB" in text
    page.write_text(text.replace("6.32 GiB", "6.00 GiB", 1))
    problems = figures.run(check=True, root=root)
    assert any("estimate.md" in p for p in problems), problems


def test_unknown_block_is_named(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs" / "cli.md"
    page.write_text(page.read_text() + "\n<!-- figures:no_such_block -->\n<!-- /figures -->\n")
    assert any("unknown figure block(s) ['no_such_block']" in p for p in figures.run(check=True, root=root))


def test_unclosed_block_is_named(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs" / "cli.md"
    page.write_text(page.read_text() + "\n<!-- figures:demo -->\n")
    assert any("without its `<!-- /figures -->`" in p for p in figures.run(check=True, root=root))


def test_block_used_on_no_page_is_named(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs" / "benchmarks.md"
    page.write_text(re.sub(r"^<!-- figures:demo -->\n.*?^<!-- /figures -->\n", "", page.read_text(),
                           flags=re.DOTALL | re.MULTILINE))
    assert any("['demo'] are defined" in p for p in figures.run(check=True, root=root))


def test_labels_come_from_the_results(tmp_path):
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    assert where({"machine": {"gpu": None}}) == "**CPU**"
    assert where({"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}) == "**GPU** (NVIDIA H100 80GB HBM3)"
    stage = {"stage": 1, "mode": "GPU", "date": "2026-12-01T00:00:00", "machine": {"device": "NVIDIA H100"},
             "entries": [{"status": "ok"}]}
    (results / "gpu" / "stage1.json").write_text(json.dumps(stage))
    (results / "gpu" / "stage2.json").write_text(json.dumps({**stage, "stage": 2, "mode": "CPU rehearsal"}))
    assert [s["stage"] for s in Results(results).gpu_stages()] == [1]  # a rehearsal's figures are no GPU figures
    from benchmarks._figure_predict import gpu_results

    assert "NVIDIA H100" in gpu_results(Results(results))
    assert "No GPU results yet" in gpu_results(Results(tmp_path / "empty"))


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the details into a docs/ page and link it.")


def _anchors(page: Path) -> set[str]:
    """The heading anchors mkdocs makes for a page (its `toc` slug: lowercase, punctuation dropped, '-' for spaces)."""
    slugs = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = re.sub(r"[^\w\s-]", "", line.lstrip("#").strip().lower())
            slugs.add(re.sub(r"[-\s]+", "-", text).strip("-"))
    return slugs


def test_readme_relative_links_resolve():
    readme = ROOT / "README.md"
    broken = []
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (readme.parent / path) if path else readme
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {path or 'README.md'}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)


def test_readme_link_check_sees_a_broken_link(tmp_path):
    assert LINK.findall("[a](docs/nope.md) [b](https://x.org) ![img](x.png) [c](docs/index.md#x)") == [
        "docs/nope.md", "https://x.org", "x.png", "docs/index.md#x"]
    page = tmp_path / "p.md"
    page.write_text("# The dry run: `lowmem estimate`\n## Out-of-memory recovery (`on_oom`)\n")
    assert _anchors(page) == {"the-dry-run-lowmem-estimate", "out-of-memory-recovery-on_oom"}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_site_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, check=False,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
