"""Deep models from shallow traces: the parts of a step whose peaks grow linearly with depth, and their lines.

A deep model is traced cut to 3, 4 and 5 repeated blocks, each forward and backward cut into the part before the
blocks, the blocks and the part after them (:class:`DepthWindows`); each part is extrapolated linearly (the parts
outside the blocks event by event), and the third depth must confirm every line (:data:`AGREEMENT`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.core.accounting import CATEGORIES, ROLES
from lightning_lowmem.measure.recorder import PHASES, StepMemoryRecorder, phase_maxima

#: extrapolation is used when the third depth lands this close to the line through the first two (per value)
AGREEMENT = 1e-4
#: the cut models keep at least this many blocks (the first depth traced): the blocks before may differ
KEPT = 3


def _signature(block: torch.nn.Module) -> tuple[Any, ...]:
    """What two blocks must share to be interchangeable: class, every parameter's and buffer's name, shape and dtype,
    and the printed configuration of every submodule (a convolution's stride, a dropout's rate)."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return type(block), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors), repr(block)


def _interchangeable(blocks: torch.nn.ModuleList) -> bool:
    """Whether every block a cut may end on (from the ``KEPT``-th on) is like every later one.

    NOTE: a cut model feeds its last kept block's output to the part after the list: one class of blocks may change
    shape (MobileNetV2's channels, stage by stage). Blocks before the ``KEPT``-th are always kept (T5's first holds
    the relative position bias).
    """
    later = list(blocks)[KEPT - 1:]
    first = _signature(later[0]) if later else None
    return all(_signature(b) == first for b in later[1:])


def find_blocks(module: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList] | None:
    """The model's repeated blocks: the longest ModuleList of >= 2 same-class children, the later of which are
    interchangeable (:func:`_interchangeable`)."""
    best, best_size = None, (-1, -1)
    for parent in module.modules():
        for name, child in parent.named_children():
            if (isinstance(child, torch.nn.ModuleList) and len(child) >= 2 and len({type(c) for c in child}) == 1
                    and _interchangeable(child)):
                size = (len(child), sum(p.numel() for p in child.parameters()))
                if size > best_size:
                    best, best_size = (parent, name, child), size
    return best


def fewer_layers(module: torch.nn.Module, full: int, keep: int) -> None:
    """Tell the configs of a model cut from ``full`` to ``keep`` repeated blocks (a fake copy) its new depth.

    NOTE: Hugging Face loops over ``layers[: config.num_hidden_layers]``.
    """
    for sub in module.modules():
        config = getattr(sub, "config", None)
        for attr in ("num_hidden_layers", "n_layer", "num_layers"):
            if config is not None and getattr(config, attr, None) == full:
                setattr(config, attr, keep)


#: Hugging Face's LayerDrop rates (``config.layerdrop`` in wav2vec2, HuBERT, WavLM; the encoder/decoder ones in
#: BART, Whisper and their kin): each layer is skipped when a draw falls below them
LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def keep_every_layer(module: torch.nn.Module) -> list[str]:
    """Turn LayerDrop off in ``module`` (a dry run's copy); the settings turned off.

    NOTE: which layers a step skips depends on the draws (a dry run predicted wav2vec2 17 % low); the dry run predicts
    the largest step, the one that skips none.
    """
    changed = []
    for sub in module.modules():
        config = getattr(sub, "config", None)
        for attr in LAYERDROP:
            rate = getattr(config, attr, None) if config is not None else None
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
                setattr(config, attr, 0.0)
                changed.append(f"{attr}={rate}")
    return sorted(set(changed))


class DepthWindows(L.Callback):
    """Cuts forward and backward into the part before the repeated blocks, the blocks and the part after them.

    NOTE: each part grows linearly with depth, but the phase's peak may move between parts as the model deepens (a
    shallow GPT-2's backward peaks at the LM head, a deep one's at the last block).
    """

    def __init__(self, recorder: StepMemoryRecorder) -> None:
        self.recorder = recorder
        self.handles: list[Any] = []
        self.block_params: list[torch.Tensor] = []
        self.seen: set[int] = set()

    def _window(self, name: str, phase: str) -> None:
        tracker = self.recorder.tracker
        if tracker is not None and tracker.phase_name == phase:
            # NOTE: before and after the blocks the ops do not depend on depth: extrapolated event by event, as a
            # transient that grows with depth (a KV cache dropped with the model's output) can move the peak
            tracker.set_window(name, events=name != "blocks")

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        found = find_blocks(pl_module)
        if found is None:
            return
        blocks = found[2]
        self.handles.append(blocks[0].register_forward_pre_hook(lambda *a: self._window("blocks", "forward")))
        self.handles.append(blocks[-1].register_forward_hook(lambda *a: self._window("tail", "forward")))
        self.block_params = [p for p in blocks.parameters() if p.requires_grad]
        for p in self.block_params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._grad))

    def _grad(self, p: torch.Tensor) -> None:
        if not self.seen:
            self._window("blocks", "backward")
        self.seen.add(id(p))
        if len(self.seen) == len(self.block_params):
            self._window("tail", "backward")

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self._window("head", "forward")

    @override
    def on_before_backward(self, *args: Any) -> None:
        self.seen = set()
        self._window("head", "backward")

    @override
    def on_train_end(self, *args: Any) -> None:
        for handle in self.handles:
            handle.remove()


def values_of(steps: list[dict[str, Any]], windows: bool = False) -> dict[tuple[str, str, str], int]:
    """``{(scope, role, category): bytes}`` at each scope's peak (highest over steps); scopes are the phases, or
    with ``windows`` the parts of each phase (``"backward@blocks"``...)."""
    names = {name for r in steps for name in r["phases"]}
    if windows:  # a phase cut into parts is represented by its parts
        scopes = sorted(n for n in names if "@" in n or not any(m.startswith(f"{n}@") for m in names))
    else:
        scopes = list(PHASES)
    maxima = phase_maxima(steps, scopes)
    return {(scope, role, cat): maxima.get(scope, {}).get(role, {}).get(cat, 0)
            for scope in scopes for role in ROLES for cat in CATEGORIES}


def events(steps: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """The last traced step's live bytes after every increase, per window that recorded them."""
    for record in reversed(steps):
        if "window_events" in record:
            return record["window_events"]
    return {}


def event_values(ea: dict, eb: dict, ec: dict, depths: tuple[int, int, int], n: int
                  ) -> tuple[dict[tuple[str, str, str], int], tuple[Any, int] | None]:
    """Event-by-event lines of the windows that run the same ops at every depth; the values at depth ``n``.

    Returns the extrapolated ``{(window, role, category): bytes}`` at each window's highest extrapolated event
    (per role), and the first disagreement (a window whose event count changes with depth, or an event the
    third depth does not confirm), or None.
    """
    out: dict[tuple[str, str, str], int] = {}
    (da, db, dc) = depths
    for key, c in ec.items():
        a, b = ea.get(key), eb.get(key)
        if a is None or b is None or not (len(a) == len(b) == len(c)) or not c:
            return out, ((key, "events"), len(c) - len(b or []))
        for r, role in enumerate(ROLES):
            best_total, best = -1, None
            for i in range(len(c)):
                va, vb, vc = a[i][1 + r], b[i][1 + r], c[i][1 + r]  # NOTE: [seq, device, host, disk]
                line = [round(x + (y - x) * (dc - da) / (db - da)) for x, y in zip(va, vb)]
                if abs(sum(line) - sum(vc)) > max(AGREEMENT * sum(vc), 4096):
                    return out, ((key, role, i), sum(line) - sum(vc))
                at_n = [round(y + (z - y) * (n - db) / (dc - db)) for y, z in zip(vb, vc)]
                if sum(at_n) > best_total:
                    best_total, best = sum(at_n), at_n
            for cat, value in zip(CATEGORIES, best):  # type: ignore[arg-type]
                out[(key, role, cat)] = value
    return out, None


def phases_of(values: dict[tuple[str, str, str], int]) -> dict[tuple[str, str, str], int]:
    """Per phase and role, the categories of its highest-total scope (a phase, or the largest of its windows)."""
    out = {}
    scopes = {k[0] for k in values}
    for phase in PHASES:
        mine = [sc for sc in scopes if sc.split("@")[0] == phase]
        for role in ROLES:
            best = max(mine, key=lambda sc: sum(values[(sc, role, c)] for c in CATEGORIES), default=None)
            for cat in CATEGORIES:
                out[(phase, role, cat)] = values[(best, role, cat)] if best is not None else 0
    return out


def line(va: dict, vb: dict, na: int, nb: int, n: int) -> dict:
    return {k: round(va.get(k, 0) + (vb.get(k, 0) - va.get(k, 0)) * (n - na) / (nb - na)) for k in {*va, *vb}}


def disagreement(predicted: dict, traced: dict) -> tuple[Any, int] | None:
    """The first value the line misses by more than ``AGREEMENT`` (relative, at least 4 KiB), or None."""
    for key in {*predicted, *traced}:
        value = traced.get(key, 0)
        if abs(predicted.get(key, 0) - value) > max(AGREEMENT * abs(value), 4096):
            return key, predicted.get(key, 0) - value
    return None


def non_negative(values: list[int]) -> dict[str, int]:
    """Categories with no negative entry and the same total.

    NOTE: extrapolated per category, a category that shrinks with depth at the chosen moment can come out
    negative; clamping it alone would inflate the total, so the deficit is taken from the largest category.
    """
    deficit = sum(v for v in values if v < 0)
    out = [max(0, v) for v in values]
    if deficit:
        largest = max(range(len(out)), key=out.__getitem__)
        out[largest] = max(0, out[largest] + deficit)
    return dict(zip(CATEGORIES, out))


def depth_unit(spec: Any) -> int | None:
    """Blocks per repeating unit of the run's techniques, or None when a technique is not linear in depth."""
    if getattr(spec.strategy, "offload_params", None) == "auto":
        return None  # NOTE: the blocks kept resident come from a device budget: all of them fit a shallow trace
    unit = 1
    for cb in spec.callbacks:
        policy = getattr(cb, "policy", None)
        if not isinstance(cb, ActivationCheckpointing):
            continue
        if policy not in ("all", "selective", "every_n") or getattr(cb, "blocks", None):
            return None  # sqrt segments, a budget or an explicit list do not repeat per block
        if policy == "every_n":
            unit = cb.n
    return unit


__all__ = ["AGREEMENT", "DepthWindows", "depth_unit", "disagreement", "event_values", "events", "fewer_layers",
           "find_blocks", "keep_every_layer", "line", "non_negative", "phases_of", "values_of"]
