"""One-line explanations of bad ``lowmem fit`` input (private helper of ``cli/main.py``).

``LowMemCLI`` makes jsonargparse raise (``exit_on_error=False``) and :func:`explain` turns the error into one sentence:
first by checking the config files' ``class_path`` and ``init_args`` (with a did-you-mean), else by condensing
jsonargparse's chain of causes.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError

from lightning_lowmem.cli.commands import SUBCOMMANDS
from lightning_lowmem.strategies.offload.strategy import NonFiniteGradientError

__all__ = ["ArgumentError", "NonFiniteGradientError", "check_config_files", "explain", "one_line"]


def config_paths(args: Sequence[str]) -> list[str]:
    """The files given with ``--config FILE``, ``--config=FILE`` or ``-c FILE``."""
    out = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
    return out


def check_config_files(args: Sequence[str]) -> None:
    """Refuse an unknown subcommand, and a missing, empty or non-mapping ``--config`` file, before jsonargparse reads
    them."""
    import yaml

    if args and not args[0].startswith("-") and args[0] not in SUBCOMMANDS:
        raise ValueError(_subcommand_message(args[0]))

    for path in config_paths(args):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"Passed `--config {path}`, which is not a file. Check the path (relative to {Path.cwd()}).")
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip() or not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
            raise ValueError(
                f"Passed `--config {path}`, which is empty (only blanks and comments). Put `trainer:`, `model:` and `data:` "
                "sections in it; see `configs/demo.yaml`, or `lowmem fit --print_config` for every key."
            )
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"Passed `--config {path}`, which is not valid YAML: {' '.join(str(err).split())}") from err
        if not isinstance(loaded, dict):
            raise ValueError(  # noqa: TRY004  (a file's content, not an argument's type)
                f"Passed `--config {path}`, whose top level is a {type(loaded).__name__}, not a mapping of sections "
                "(`trainer:`, `model:`, `data:`)."
            )


def one_line(err: BaseException, args: Sequence[str], root: BaseException) -> str:
    """The one line ``lowmem`` prints for ``err`` (``root``: the innermost bad-input error behind it): jsonargparse's
    errors (also a class's refusal inside a union) explained (:func:`explain`), anything else ``root``'s text."""
    if isinstance(err, ArgumentError) or any(_UNION in str(e) for e in _chain(err)):
        return explain(err, args)
    return explain(root, args) if isinstance(root, ArgumentError) else str(root)


def explain(err: BaseException, args: Sequence[str]) -> str:
    """One line for a jsonargparse ``ArgumentError``."""
    m = re.search(r"argument subcommand: invalid choice: '([^']*)'", str(err))
    if m is not None:
        return _subcommand_message(m.group(1))
    try:
        found = list(_check_class_paths(args))
    except Exception:  # noqa: BLE001  NOTE: the diagnosis must never hide the original error
        found = []
    return " ".join(found) if found else _condense(err, args)


def _subcommand_message(given: str) -> str:
    close = difflib.get_close_matches(given, list(SUBCOMMANDS), n=1, cutoff=0.5)
    hint = f" Did you mean `lowmem {close[0]}`?" if close else ""
    return (f"Passed the subcommand {given!r}, which lowmem does not have.{hint} The subcommands are "
            f"{', '.join(SUBCOMMANDS)} (`lowmem --help` describes each).")


def _entries(args: Sequence[str]) -> Iterator[tuple[str, Any, type]]:
    """``(key, entry, base class)`` for every ``class_path`` entry of the config files."""
    import lightning.pytorch as pl
    import yaml

    for path in config_paths(args):
        try:
            cfg = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        cfg = cfg.get("fit", cfg) if isinstance(cfg, dict) else {}
        trainer = cfg.get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        for i, cb in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
            yield f"trainer.callbacks[{i}]", cb, pl.Callback
        if isinstance(trainer.get("strategy"), dict):
            yield "trainer.strategy", trainer["strategy"], pl.strategies.Strategy
        for key, base in (("model", pl.LightningModule), ("data", pl.LightningDataModule)):
            if isinstance(cfg.get(key), dict):
                yield key, cfg[key], base


def _subclasses(base: type) -> dict[str, type]:
    out: dict[str, type] = {}
    todo = [base]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if not sub.__name__.startswith("_"):
                out.setdefault(sub.__name__, sub)
                out.setdefault(f"{sub.__module__}.{sub.__qualname__}", sub)
            todo.append(sub)
    return out


def _resolve(class_path: str, known: dict[str, type]) -> tuple[type | None, str | None]:
    """The class named by ``class_path`` (or None), and why its module failed to import if it exists but did."""
    if class_path in known:
        return known[class_path], None
    module, _, name = class_path.rpartition(".")
    if not module:
        return None, None
    try:
        return getattr(importlib.import_module(module), name, None), None
    except Exception as err:  # noqa: BLE001  the module exists but fails to import: say so, not "did you mean"
        if isinstance(err, ModuleNotFoundError) and err.name and module.startswith(err.name):
            return None, None  # the module itself does not exist: a misspelling
        return None, f"{type(err).__name__}: {err}"


def _check_class_paths(args: Sequence[str]) -> Iterator[str]:
    for key, entry, base in _entries(args):
        if not isinstance(entry, dict) or "class_path" not in entry:
            continue
        class_path = str(entry["class_path"])
        known = _subclasses(base)
        cls, import_error = _resolve(class_path, known)
        if import_error is not None:
            yield f"Passed `{key}.class_path={class_path!r}`, whose module fails to import: {import_error}"
            continue
        if cls is None:
            short = sorted(n for n in known if "." not in n)
            close = difflib.get_close_matches(class_path.rpartition(".")[2], short, n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            ours = ", ".join(n for n in short if known[n].__module__.startswith("lightning_lowmem"))
            yield (
                f"Passed `{key}.class_path={class_path!r}`, which is not a {base.__name__} class.{hint} Give a class "
                f"name (lightning_lowmem's: {ours or 'none'}; Lightning's: ModelCheckpoint, EarlyStopping, ...) or a "
                "full import path such as `my_package.callbacks.MyCallback`."
            )
            continue
        init_args = entry.get("init_args") or {}
        if isinstance(init_args, dict):
            yield from _check_init_args(key, cls, init_args)


def _check_init_args(key: str, cls: type, init_args: dict[str, Any]) -> Iterator[str]:
    try:
        params = inspect.signature(cls.__init__).parameters
        hints = typing.get_type_hints(cls.__init__)
    except (TypeError, ValueError, NameError):
        return
    names = [n for n in params if n != "self"]
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in init_args.items():
        where = f"`{key}` ({cls.__name__})"
        if name not in params:
            if takes_kwargs:
                continue
            close = difflib.get_close_matches(name, names, n=2, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            yield f"Passed `init_args.{name}` to {where}, which takes no such argument.{hint} It takes: {', '.join(names)}."
            continue
        expected = _mismatch(hints.get(name), value)
        if expected is not None:
            yield f"Passed `{name}={value!r}` to {where}; expected {expected}."


_SIMPLE = {bool: "True or False", int: "an int", float: "a number", str: "a string"}


def _fits(kind: type, value: Any) -> bool:
    """Whether ``value`` is a ``kind`` of :data:`_SIMPLE` (a bool is no number; an int is a float)."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def _is_container(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, (list, tuple, dict, set, Sequence))


def _mismatch(annotation: Any, value: Any) -> str | None:
    """What ``annotation`` expects, when ``value`` clearly is not it (Literal choices, bool/int/float/str); else None
    (what this cannot judge is left to jsonargparse)."""
    if annotation is None:
        return None
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    alternatives = typing.get_args(annotation) if union else (annotation,)
    if value is None and type(None) in alternatives:
        return None
    choices = [c for a in alternatives if typing.get_origin(a) is typing.Literal for c in typing.get_args(a)]
    simple = [a for a in alternatives if a in _SIMPLE]
    other = [a for a in alternatives if a not in _SIMPLE and a is not type(None) and typing.get_origin(a) is not typing.Literal]
    if value in choices or any(_fits(a, value) for a in simple):
        return None
    if other and not (isinstance(value, str) and choices and all(_is_container(a) for a in other)):
        return None
    if not choices and not simple:
        return None
    parts = (["one of " + ", ".join(repr(c) for c in choices)] if choices else []) + [_SIMPLE[a] for a in simple]
    parts += [_type_name(a) for a in other] + (["null"] if type(None) in alternatives else [])
    return ", or ".join(parts)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("collections.abc.", "")
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rpartition(".")[2], text)
    text = re.sub(r"Union\[([^\[\]]*)\]", lambda m: " or ".join(t.strip() for t in m.group(1).split(",")), text)
    return re.sub(r"^(?:Sequence|list|List|tuple|Tuple)\[(.*)\]$", r"a list of \1", text)


_UNION = "Does not validate against any of the Union subtypes"


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _union_summary(text: str) -> str | None:
    """One sentence for jsonargparse's "does not validate against any of the Union subtypes" block, or None: a class's
    own refusal wins over "Expected a <class 'str'>"; else the alternatives as one "expected" with a did-you-mean."""
    if _UNION not in text:
        return None
    bullets = [line.strip()[2:].strip() for line in text.splitlines() if line.strip().startswith("- ")]
    specific = [b for b in bullets if not b.startswith("Expected a ")]
    if specific:
        return specific[0]
    given = re.search(r"^\s*Given value: (.*)$", text, re.MULTILINE)
    value = given.group(1).strip() if given else None
    choices: list[str] = []
    kinds: list[str] = []
    for bullet in bullets:
        literal = re.match(r"Expected a typing\.Literal\[(.*)\]$", bullet)
        if literal:
            choices += [c.strip() for c in literal.group(1).split(",")]
            continue
        kind = re.match(r"Expected a <class '([\w.]+)'>", bullet)
        name = kind.group(1).rpartition(".")[2] if kind else bullet.removeprefix("Expected a ")
        kinds.append("null" if name == "NoneType" else f"{'an' if name[:1] in 'aeiou' else 'a'} {name}")
    expected = ", or ".join((["one of " + ", ".join(choices)] if choices else []) + kinds)
    close = difflib.get_close_matches(value or "", [c.strip("'\"") for c in choices], n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"got {value!r}; expected {expected}.{hint}" if value is not None else f"expected {expected}.{hint}"


def _key_of_class(message: str, args: Sequence[str]) -> str | None:
    """The config key whose ``class_path`` names the class a message starts with (``OffloadStrategy: ...``)."""
    name = message.split(":", 1)[0].strip()
    try:
        return next((key for key, entry, _ in _entries(args) if isinstance(entry, dict)
                     and str(entry.get("class_path", "")).rpartition(".")[2] == name), None)
    except Exception:  # noqa: BLE001  NOTE: the diagnosis must never hide the original error
        return None


def _condense(err: BaseException, args: Sequence[str] = ()) -> str:
    """jsonargparse's chain of causes as one line: the keys from outside in, then the innermost complaint."""
    keys: list[str] = []
    innermost = str(err)
    union = None
    for e in _chain(err):
        text = str(e).strip()
        union = union or _union_summary(text)
        first = text.splitlines()[0] if text else ""
        for pattern in (r'Parser key "([^"]+)"', r"Problem with given class_path '([^']+)'"):
            m = re.match(pattern, first)
            if m and m.group(1) not in keys:
                keys.append(m.group(1))
        if text:
            innermost = text
    if union is not None:
        innermost = union
        if not keys and (key := _key_of_class(union, args)) is not None:
            keys.append(key)
    line = " ".join(innermost.split())
    line = re.sub(r"typing\.Literal\[([^\]]*)\]", r"one of \1", line)
    where = " > ".join(keys)
    return f"{where}: {line}" if where and not line.startswith(where) else line or "invalid arguments"
