"""Every figure of the README and docs/, written from ``benchmarks/results/*.json`` (one script, nothing typed by hand).

    python benchmarks/figures.py           # rewrite the marked blocks of README.md and docs/**/*.md (make figures)
    python benchmarks/figures.py --check   # exit 1 naming each block that differs (tests/test_docs_figures.py)
    python benchmarks/figures.py --list    # the block names and the result files each reads

A page marks a block with two HTML comments, which render as nothing::

    <!-- figures:estimate_gpt2xl -->
    (written by this script)
    <!-- /figures -->

and everything between them is replaced by what the block's function (``benchmarks/_figure_blocks.py``) makes of the
results. Each block ends with its source line: the label (**CPU**, **GPU** or **dry run**, read from the JSON: the
machine's ``gpu`` field, the rows' ``method``/``part``, the target the results name), the JSON file, the date and the
command that produced it. A benchmark re-run changes the JSON; ``make figures`` then changes the pages, and the test
fails until the pages are committed with it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a file, only benchmarks/ is on the path
    sys.path.insert(0, str(ROOT))

from benchmarks._figure_blocks import BLOCKS, Results

# NOTE: markers count only on lines of their own, so a page may quote them inline (as the benchmarks page does)
BLOCK = re.compile(r"^(<!-- figures:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)^(<!-- /figures -->)$",
                   re.DOTALL | re.MULTILINE)
OPENER = re.compile(r"^<!-- figures:([\w.-]+) -->$", re.MULTILINE)


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may hold blocks: the README and every markdown page of the docs site."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def render(text: str, results: Results) -> str:
    """``text`` with every marked block rewritten; an unknown name or an unclosed block is an error."""
    names = OPENER.findall(text)
    closed = [m.group("name") for m in BLOCK.finditer(text)]
    if names != closed:
        raise ValueError(f"a `<!-- figures:NAME -->` block without its `<!-- /figures -->` line "
                         f"(opened: {names}, closed: {closed}).")
    unknown = sorted(set(names) - set(BLOCKS))
    if unknown:
        raise ValueError(f"unknown figure block(s) {unknown}; expected one of: {', '.join(sorted(BLOCKS))}.")

    def block(m: re.Match[str]) -> str:
        body = BLOCKS[m.group("name")](results).strip("\n")
        return f"{m.group(1)}\n{body}\n\n{m.group(4)}"  # NOTE: blank lines, so no renderer reads the comment as HTML

    return BLOCK.sub(block, text)


def run(check: bool, root: Path = ROOT) -> list[str]:
    """Rewrite (or, with ``check``, compare) every page; returns the problems found, one line each."""
    results = Results(root / "benchmarks" / "results")
    problems, used = [], set()
    for page in pages(root):
        if not page.is_file():
            continue
        text = page.read_text()
        used.update(OPENER.findall(text))
        try:
            new = render(text, results)
        except (ValueError, KeyError, FileNotFoundError) as err:
            problems.append(f"{page.relative_to(root)}: {err}")
            continue
        if new != text:
            if check:
                stale = [m.group("name") for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new))
                         if m.group(0) != n.group(0)]
                problems.append(f"{page.relative_to(root)}: figure block(s) {stale} differ from benchmarks/results/ "
                                "(run `make figures` and commit the pages).")
            else:
                page.write_text(new)
    unused = sorted(set(BLOCKS) - used)
    if unused:
        problems.append(f"figure block(s) {unused} are defined in benchmarks/_figure_blocks.py but used on no page.")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a page differs")
    parser.add_argument("--list", action="store_true", help="print the block names and the files they read")
    args = parser.parse_args(argv)
    if args.list:
        for name, fn in sorted(BLOCKS.items()):
            print(f"{name:28s} {', '.join(getattr(fn, 'sources', ()))}")
        return 0
    problems = run(check=args.check)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
