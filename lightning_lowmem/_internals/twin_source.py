"""The compiler of ``lightning_lowmem.pl`` (:mod:`.twin`): a file of this package with its imports, and the module
paths its strings name, rewritten for the standalone ``pytorch_lightning`` package (:func:`.twin.twin_name`).

NOTE: apart from :mod:`.twin` so that ``import lightning_lowmem`` does not import ``ast`` (tens of milliseconds).
"""

from __future__ import annotations

import ast
import importlib.abc
import re
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_lowmem._internals.twin import PREFIX, twin_name

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class Rewrite(ast.NodeTransformer):
    """Rewrites a module's imports and the module paths its strings name (see the module docstring)."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            new = twin_name(alias.name)
            if new != alias.name and alias.asname is None:
                if "." in alias.name:  # NOTE: `import a.b` binds `a`, which a rename would not bind
                    raise ImportError(f"{self.filename}:{node.lineno}: `import {alias.name}` cannot be rewritten for "
                                      f"{PREFIX}; write `import {alias.name} as name` or `from ... import ...`")
                alias.asname = alias.name
            alias.name = new
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level == 0 and node.module is not None:
            node.module = twin_name(node.module)
        return node

    @override
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
            node.value = twin_name(node.value)
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.JoinedStr:
        return node  # NOTE: the text of an f-string is a message, never a module path to import


class Loader(importlib.abc.SourceLoader):
    """Compiles a file of this package with :class:`Rewrite`, in memory (NOTE: no bytecode cache: ``path_stats`` is not
    defined, so the real module's ``__pycache__`` entry, keyed by the same path, is neither read nor written)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def get_filename(self, fullname: str) -> str:
        return self.path

    @override
    def get_data(self, path: str) -> bytes:
        return Path(path).read_bytes()

    @override
    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        tree = Rewrite(str(path)).visit(ast.parse(data, filename=str(path)))
        return compile(tree, str(path), "exec", dont_inherit=True, optimize=_optimize)
