"""A griffe extension: the package's public names and docstrings, as mkdocstrings renders them.

Two things, neither of which changes the package:

1. ``lightning_lowmem/__init__.py`` exports its public classes through a table (``_LAZY``: name -> defining
module) read by a module ``__getattr__``, so that ``import lightning_lowmem`` stays light. Static analysis
cannot follow that, so this extension reads the same table from the source and adds each name to the package
as an alias of its definition: the API pages then say ``::: lightning_lowmem.OffloadStrategy`` (the name users
import) and keep working when the defining module moves, as long as the table says where it went.
2. The docstrings are written for ``help()`` and doctest: Sphinx roles (``:class:`~a.b.C```) and ``Example:``
   sections of ``>>>`` lines. Roles become code spans (the last component under ``~``), and ``Example:`` becomes
   Google style's ``Examples:`` so that the ``>>>`` lines render as code, not as nested quotes.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

PACKAGE = "lightning_lowmem"
TABLE = "_LAZY"
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|obj|data|exc|const):`(~?)([^`]+)`")
EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def markdown_docstring(text: str) -> str:
    """Sphinx roles as code spans, ``Example:`` as ``Examples:`` (see the module docstring)."""
    text = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return EXAMPLE.sub(r"\1Examples:", text)


def lazy_table(source: str) -> dict[str, str]:
    """The ``_LAZY = {...}`` literal of the package's ``__init__.py``; a clear error when it is gone."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == TABLE for t in targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(
        f"docs/_griffe_lazy.py: no `{TABLE} = {{...}}` literal in {PACKAGE}/__init__.py; the API pages resolve the "
        "public names through it. Update this extension to the package's new export table."
    )


class LazyExports(griffe.Extension):
    """Adds ``lightning_lowmem.<Name>`` aliases for every entry of the package's lazy export table."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.path != PACKAGE:
            return
        _rewrite_docstrings(pkg)
        for name, module in lazy_table(pkg.filepath.read_text()).items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=pkg))


def _rewrite_docstrings(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = markdown_docstring(obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite_docstrings(member)
