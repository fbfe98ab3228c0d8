"""Repeated-block discovery: the blocks parameter streaming streams and activation checkpointing recomputes.

:func:`find_repeated_blocks` finds a model's repeated blocks, :func:`select_modules` the modules a user names,
:func:`outside_compiled` drops ``torch.compile``-d ones.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from lightning_lowmem._internals import torch as torch_internals


def find_repeated_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a model: the children of its longest ``nn.ModuleList`` of same-class modules.

    Every list of the maximal length is taken (an encoder-decoder has two), lists nested in a chosen block skipped
    (GPT-2's ``transformer.h``, LLaMA's ``model.layers``, T5's two ``block``...). ``[]`` when none has two or more.
    """
    candidates = [(name, m) for name, m in root.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(child) for child in m}) == 1]
    longest = max((len(m) for _, m in candidates), default=0)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module_list in candidates:
        if len(module_list) != longest:
            continue
        # NOTE: a list that is itself a chosen block (a list of lists) is nested too, not only a list below one
        if any(name == prefix or name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        prefix = f"{name}." if name else ""
        chosen.extend((f"{prefix}{i}", child) for i, child in enumerate(module_list))
    return chosen


def called_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules whose ``forward`` runs: a container (``nn.ModuleList``, ``nn.ModuleDict``) is replaced by its
    children (NOTE: its hooks never run: streamed, its weights would be read released)."""
    out: list[tuple[str, nn.Module]] = []
    for name, block in blocks:
        if isinstance(block, (nn.ModuleList, nn.ModuleDict)):
            out += called_blocks([(f"{name}.{child}", m) for child, m in block.named_children()])
        else:
            out.append((name, block))
    return out


def select_modules(root: nn.Module, targets: Sequence[str | type]) -> list[tuple[str, nn.Module]]:
    """Modules named by ``targets``: classes, class names, or ``fnmatch`` patterns on qualified names (an
    ``nn.ModuleList`` selects its children; modules nested in a selected one are skipped)."""
    chosen: list[tuple[str, nn.Module]] = []

    def covered(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p, _ in chosen)

    for name, module in root.named_modules():
        if covered(name):
            continue
        for target in targets:
            if isinstance(target, type):
                hit = isinstance(module, target)
            else:
                hit = type(module).__name__ == target or (bool(name) and fnmatch.fnmatchcase(name, target))
            if hit:
                if isinstance(module, nn.ModuleList):
                    chosen.extend((f"{name}.{i}", child) for i, child in enumerate(module) if not covered(f"{name}.{i}"))
                else:
                    chosen.append((name, module))
                break
    return chosen


def compiled_names(root: nn.Module) -> list[str]:
    """Qualified names of the ``torch.compile``-d submodules of ``root`` (outermost first)."""
    return [n for n, m in root.named_modules() if n and torch_internals.is_compiled_module(m)]


def in_compiled(name: str, compiled: list[str]) -> str | None:
    """The compiled module (of ``compiled``) that is ``name``, holds it or is held by it, or None (a module
    holding a compiled one runs its compiled code in its own forward: checkpointing it recomputes that code)."""
    return next((c for c in compiled if name == c or name.startswith(c + ".") or not name
                 or c.startswith(name + ".")), None)


def outside_compiled(root: nn.Module, found: list[tuple[str, nn.Module]]) -> tuple[list[tuple[str, nn.Module]], dict[str, list[str]]]:
    """``found`` without the ``torch.compile``-d modules, the modules inside them and those holding them; and
    ``{compiled module name: the names dropped}``.

    NOTE: no checkpointing composes with a compiled region bit for bit: inside it inductor fuses the recompute
    otherwise (~3e-6 off after 3 fp32 steps) or the compiled backward fails; around it the recompute saves other
    tensors at ``bf16-true`` (torch's ``CheckpointError``).
    """
    compiled = compiled_names(root)
    kept: list[tuple[str, nn.Module]] = []
    dropped: dict[str, list[str]] = {}
    for name, module in found:
        if (outer := in_compiled(name, compiled)) is None:
            kept.append((name, module))
        else:
            dropped.setdefault(outer, []).append(name)
    return kept, dropped


def owner_of(root: nn.Module, name: str) -> nn.Module:
    """The module whose ``forward`` calls the block ``name`` (the parent of its ``ModuleList``)."""
    parts = name.split(".")
    parent = root.get_submodule(".".join(parts[:-1]))  # NOTE: "" names `root` itself
    return root.get_submodule(".".join(parts[:-2])) if isinstance(parent, nn.ModuleList) else parent
