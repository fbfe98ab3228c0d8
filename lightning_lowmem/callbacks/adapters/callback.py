"""``Adapters``: fine-tune a frozen (optionally 4-bit/8-bit) base model through PEFT LoRA or DoRA adapters, by flag."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks.adapters.quantize_base import QUANT_TYPES, quantize_linears
from lightning_lowmem.core.atomic import replace_dir, temp_path
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.optional import require
from lightning_lowmem.core.reproducible import Reproducible

Kind = Literal["lora", "dora"]
KINDS: tuple[str, ...] = get_args(Kind)
_MARK = "_lowmem_adapters"  # set on the PeftModel this callback made: a later fit/validate finds it applied


#: ``*-true`` half precisions and their compute dtype
_HALF_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16}

def _validate(kind: Any, r: Any, alpha: Any, dropout: Any, target_modules: Any, quantize_base: Any, attribute: Any,
              seed: Any) -> tuple[list[str], bool]:
    problems, wrong_type = [], False

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if kind not in KINDS:
        problems.append(f"`kind={kind!r}`; expected one of {', '.join(repr(k) for k in KINDS)}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        problems.append(f"`r={r!r}`; expected an int >= 1 (the rank of each adapter)")
        wrong_type |= isinstance(r, bool) or not isinstance(r, int)
    if not number(alpha) or alpha <= 0:
        problems.append(f"`alpha={alpha!r}`; expected a number > 0 (the update is scaled by alpha / r)")
        wrong_type |= not number(alpha)
    if not number(dropout) or not 0 <= dropout < 1:
        problems.append(f"`dropout={dropout!r}`; expected a number in [0, 1) (dropout on each adapter's input)")
        wrong_type |= not number(dropout)
    names_ok = isinstance(target_modules, str) and target_modules != "" or (
        isinstance(target_modules, Sequence) and not isinstance(target_modules, str) and len(target_modules) > 0
        and all(isinstance(t, str) and t for t in target_modules)
    )
    if not names_ok:
        problems.append(f"`target_modules={target_modules!r}`; expected 'all-linear', a list of module names "
                        "(['q_proj', 'v_proj']) or a regular expression over the full module names")
        wrong_type |= not isinstance(target_modules, (str, Sequence))
    if quantize_base is not None and quantize_base not in QUANT_TYPES:
        problems.append(f"`quantize_base={quantize_base!r}`; expected None (the base keeps its dtype) or one of "
                        f"{', '.join(repr(q) for q in QUANT_TYPES)}")
    if not isinstance(attribute, str) or not attribute.isidentifier():
        problems.append(f"`attribute={attribute!r}`; expected the name of your LightningModule's model attribute "
                        "(e.g. 'model')")
        wrong_type |= not isinstance(attribute, str)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        problems.append(f"`seed={seed!r}`; expected an int (the adapters' initialisation) or None (the global RNG)")
        wrong_type = True
    return problems, wrong_type


def find_peft_model(root: nn.Module) -> nn.Module:
    """The one ``peft.PeftModel`` under ``root`` (``root`` itself included)."""
    from peft import PeftModel

    found = [m for m in root.modules() if isinstance(m, PeftModel)]
    if len(found) != 1:
        raise ValueError(
            f"Expected one `peft.PeftModel` in the `{type(root).__name__}` passed, found {len(found)}. Train it with "
            "`Adapters(...)` in the Trainer's callbacks (or wrap your model with `peft.get_peft_model`) first."
        )
    return found[0]


class Adapters(Reproducible, Callback):
    """Train LoRA or DoRA adapters (Hugging Face PEFT) on a frozen base model, which can be 4-bit or 8-bit.

    In ``setup`` the model at ``pl_module.<attribute>`` is replaced by ``peft.get_peft_model(model, LoraConfig(...))``
    (docs/techniques/adapters.md); ``training_step`` and ``configure_optimizers`` stay.

    Memory saved: the base's gradients and optimizer state (Adam: 4 + 8 B per fp32 parameter); the adapters are
    ``r * (in + out)`` per targeted layer (LLaMA-7B, r=16, all-linear: 0.6 % of the base). ``quantize_base="nf4"``/
    ``"fp4"`` stores each frozen base linear but the output head in about 0.56 B per parameter, ``"int8"`` in 1 B
    plus a scale per row. Cost: the activations are the full model's; each adapted layer runs two small extra
    matmuls (DoRA: also its weight's norm); a quantized base is dequantized in each forward and backward (slower,
    and the model trained on is the rounded one). The checkpoint holds the whole module: resume with the callback.

    Args:
        kind: ``"lora"`` or ``"dora"`` (weight-decomposed LoRA, ``LoraConfig(use_dora=True)``).
        r, alpha, dropout: the adapters' rank, scale (the update is ``alpha / r * B @ A``) and input dropout.
        target_modules: ``"all-linear"`` (every linear layer but the output head), a list of module names or
            a regular expression (PEFT's ``target_modules``).
        quantize_base: None, or ``"nf4"``, ``"fp4"`` (4-bit) or ``"int8"``: quantize the frozen base linears with
            bitsandbytes before the adapters are added (QLoRA). bitsandbytes 0.50 runs these on the CPU too.
        attribute: the name of your LightningModule's attribute holding the model.
        seed: seeds the adapters' initialisation without touching the global RNG (None: drawn from it).

    A model built in ``configure_model``: end your ``configure_model`` with ``adapters.apply(self)`` (else refused).

    Example (the demo module's model is ``self.model``; its ``configure_optimizers`` is left as it is):

        >>> from lightning_lowmem import Adapters
        >>> module = tiny_model()
        >>> trainer = L.Trainer(callbacks=[Adapters("lora", r=4, alpha=8, target_modules=["c_attn"])],
        ...                     max_steps=1, enable_progress_bar=False, enable_model_summary=False, logger=False)
        >>> trainer.fit(module, tiny_data())
        >>> sorted({n.split(".")[-3] for n, p in module.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """

    def __init__(self, kind: Kind = "lora", r: int = 16, alpha: float = 32, dropout: float = 0.05,
                 target_modules: str | list[str] = "all-linear",
                 quantize_base: Literal["nf4", "fp4", "int8"] | None = None, attribute: str = "model",
                 seed: int | None = 0) -> None:
        problems, wrong_type = _validate(kind, r, alpha, dropout, target_modules, quantize_base, attribute, seed)
        if problems:
            raise (TypeError if wrong_type else ValueError)("Adapters: passed " + "; passed ".join(problems) + ".")
        call = f"Adapters(kind={kind!r}, r={r}, quantize_base={quantize_base!r})"
        require("peft", call)
        if quantize_base is not None:
            require("bitsandbytes", call)
        self.kind, self.r, self.alpha, self.dropout = kind, r, alpha, float(dropout)
        self.target_modules = target_modules if isinstance(target_modules, str) else list(target_modules)
        self.quantize_base, self.attribute, self.seed = quantize_base, attribute, seed
        self.quantized: list[str] = []  # names of the base linears quantized by the last apply
        self._dtype: torch.dtype | None = None  # the compute dtype the base is quantized from (set at setup)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.kind!r}, r={self.r}, alpha={self.alpha}, dropout={self.dropout}, "
                f"target_modules={self.target_modules!r}, quantize_base={self.quantize_base!r}, "
                f"attribute={self.attribute!r}, seed={self.seed})")

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` this callback applies."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self.target_modules, use_dora=self.kind == "dora")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer of Adapters")
        sharded = (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)
        if self.quantize_base is not None and isinstance(trainer.strategy, sharded):
            raise ValueError(
                f"Passed `{self!r}` with `{type(trainer.strategy).__name__}`: bitsandbytes' packed weights "
                "cannot be sharded or partitioned here. Use a single device, `strategy='ddp'` or "
                "`strategy='lowmem_offload'`, or `quantize_base=None`."
            )
        # NOTE: every stage: `trainer.validate(ckpt_path=...)` restores the adapters' names. A `*-true` half precision
        # computes with half weights: the base is quantized from them (the plugin converts the module after this)
        self._dtype = _HALF_TRUE.get(str(trainer.precision))
        builds_later = type(pl_module).configure_model is not L.LightningModule.configure_model
        if isinstance(getattr(pl_module, self.attribute, None), nn.Module) or not builds_later:
            self.apply(pl_module)  # NOTE: raises here when there is no model and no `configure_model` to build it

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: a model `configure_model` built after `setup` is refused without adapters: added now, they would be
        # missing from the optimizer (only the module's own code can add them there)
        if getattr(getattr(pl_module, self.attribute, None), _MARK, False):
            return
        raise ValueError(
            f"Passed `{self!r}`, but `{type(pl_module).__name__}.{self.attribute}` has no adapters: it was built (or "
            "replaced) in `configure_model`, which Lightning runs after the callbacks' `setup` and right before "
            "`configure_optimizers`, with no callback hook between. End your `configure_model` with "
            "`adapters.apply(self)` (the Adapters object you pass to the Trainer, e.g. "
            "`next(c for c in self.trainer.callbacks if isinstance(c, Adapters)).apply(self)`), or build the model "
            "in `__init__`."
        )

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def apply(self, pl_module: nn.Module) -> nn.Module:
        """Replace ``pl_module.<attribute>`` by its PEFT model (once; a later call returns it). Returns the PEFT model."""
        model = getattr(pl_module, self.attribute, None)
        if not isinstance(model, nn.Module):
            children = ", ".join(f"`{n}` ({type(m).__name__})" for n, m in pl_module.named_children()) or "none"
            raise ValueError(  # noqa: TRY004  (a missing model, not a wrong argument type)
                f"Passed `{self!r}`, but `{type(pl_module).__name__}.{self.attribute}` is "
                f"{type(model).__name__ if model is not None else 'missing'}; its child modules: {children}. Pass "
                "`attribute=` naming the model to adapt (build it in `__init__` or `configure_model`)."
            )
        if getattr(model, _MARK, False):
            return model
        # NOTE: `model` is, or holds, PEFT adapter layers (checked through `sys.modules`: peft is loaded if it does)
        tuners, peft_model = sys.modules.get("peft.tuners.tuners_utils"), sys.modules.get("peft.peft_model")
        if ((peft_model is not None and isinstance(model, peft_model.PeftModel))
                or (tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in model.modules()))):
            raise ValueError(
                f"`{type(pl_module).__name__}.{self.attribute}` already holds PEFT adapters "
                f"(`{type(model).__name__}`): `{self!r}` would wrap them a second time. Remove the Adapters callback "
                "and keep your own PEFT model (the lowmem strategies and callbacks work with it as it is), or build "
                "the plain model and let the callback add the adapters."
            )
        from peft import get_peft_model

        if self.quantize_base is not None:
            self.quantized = quantize_linears(model, self.quantize_base, self._dtype)
            # NOTE: PEFT dispatches its bitsandbytes LoRA layers (which merge, and DoRA, need) on the flags
            # `from_pretrained(quantization_config=...)` sets on a quantized Hugging Face model
            flag = "is_loaded_in_8bit" if self.quantize_base == "int8" else "is_loaded_in_4bit"
            object.__setattr__(model, flag, True)
        # NOTE: LoRA's A is drawn from the RNG; a forked RNG leaves the run's own stream (dropout, data) untouched
        with torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            peft_model = get_peft_model(model, self.lora_config())
        object.__setattr__(peft_model, _MARK, True)
        setattr(pl_module, self.attribute, peft_model)
        return peft_model

    @staticmethod
    def export_merged(pl_module: nn.Module, path: str | os.PathLike, safe_serialization: bool = True) -> str:
        """Write the adapted model, adapters merged into the base weights, as a Hugging Face directory (loaded
        without peft by ``from_pretrained(path)``). The merge runs on a copy (one more copy of the model in memory);
        the directory appears whole or not at all. ``ValueError``: not one PEFT model in ``pl_module``, or a quantized
        base (merging would re-quantize the adapters away)."""
        peft_model = find_peft_model(pl_module)
        bnb_nn = sys.modules.get("bitsandbytes.nn")
        quantized = [n for n, m in peft_model.named_modules()
                     if bnb_nn is not None and isinstance(m, (bnb_nn.Linear4bit, bnb_nn.Linear8bitLt))]
        if quantized:
            raise ValueError(
                f"export_merged: the base of the PEFT model is quantized ({len(quantized)} bitsandbytes layers, e.g. "
                f"`{quantized[0]}`); merging would re-quantize the adapters into it. Load the base in full precision, "
                "attach the adapters' weights (`peft_model.save_pretrained` writes them alone) and export that."
            )
        base = peft_model.get_base_model()
        if not hasattr(base, "save_pretrained"):
            raise ValueError(
                f"export_merged writes a Hugging Face directory; the base model is a `{type(base).__name__}`, which "
                "has no `save_pretrained`. Use `peft_model.merge_and_unload()` on a copy and save it yourself."
            )
        merged = copy.deepcopy(peft_model).merge_and_unload()
        target = os.fspath(path)
        tmp = temp_path(target)
        merged.save_pretrained(tmp, safe_serialization=safe_serialization)
        replace_dir(tmp, target)
        return target
