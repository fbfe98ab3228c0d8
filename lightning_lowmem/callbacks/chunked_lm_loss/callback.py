"""``ChunkedLMLoss``: a causal LM's training loss without its full logits tensor."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.chunked_lm_loss.chunked_ce import (
    BACKENDS,
    Backend,
    linear_cross_entropy_sum,
    require_kernel,
)
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible

__all__ = ["ChunkedLMLoss", "chunked_causal_lm_loss", "chunked_causal_lm_loss_sum", "is_chunked"]

IGNORE_INDEX = -100
# NOTE: logit values passed through the model's own post-processing once per model, to check that we reproduce it
_PROBE = (-30.0, -4.0, -1.0, -0.25, 0.0, 0.5, 2.0, 7.0, 30.0)


def _validate(chunk_tokens: Any, backend: Any, ignore_index: Any = IGNORE_INDEX) -> list[str]:
    problems = []
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        problems.append(f"`chunk_tokens={chunk_tokens!r}`; expected a positive int (rows of logits per chunk)")
    if backend not in BACKENDS:
        problems.append(f"`backend={backend!r}`; expected one of {', '.join(map(repr, BACKENDS))}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        problems.append(f"`ignore_index={ignore_index!r}`; expected an int")
    return problems


def chunked_causal_lm_loss_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, *, head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX, chunk_tokens: int = 1024, shift: bool = True, logit_scale: float | None = None,
    logit_softcap: float | None = None, backend: Backend = "auto", recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token cross-entropy and the number of tokens it sums over: ``(loss_sum, num_tokens)``.

    What ``AccumulationScheduler(loss_normalization="tokens")`` reads from ``training_step``:
    ``return {"loss": loss_sum, "num_tokens": num_tokens}``. Arguments as :func:`chunked_causal_lm_loss`.
    """
    problems = _validate(chunk_tokens, backend, ignore_index)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        problems.append(f"`hidden` of shape {tuple(getattr(hidden, 'shape', ()))}; expected [..., tokens, hidden_size]")
    elif not isinstance(head_weight, torch.Tensor) or head_weight.dim() != 2 or head_weight.size(1) != hidden.size(-1):
        problems.append(
            f"`head_weight` of shape {tuple(getattr(head_weight, 'shape', ()))}; expected [vocab_size, "
            f"{hidden.size(-1)}] (the LM head's `weight`, e.g. `model.get_output_embeddings().weight`)"
        )
    elif not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        problems.append(
            f"`labels` of shape {tuple(getattr(labels, 'shape', ()))}; expected {tuple(hidden.shape[:-1])} "
            "(the hidden states' shape without the last dimension)"
        )
    if head_bias is not None and (head_bias.dim() != 1 or head_bias.size(0) != head_weight.size(0)):
        problems.append(f"`head_bias` of shape {tuple(head_bias.shape)}; expected [{head_weight.size(0)}]")
    if problems:
        raise ValueError("chunked_causal_lm_loss: passed " + "; ".join(problems) + ".")
    if shift:
        # NOTE: as Hugging Face's ForCausalLMLoss; shifting the labels keeps `hidden` a view (no activation copy)
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = labels.reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.size(-1))
    loss_sum = linear_cross_entropy_sum(
        rows, head_weight, targets, bias=head_bias, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
        scale=logit_scale, softcap=logit_softcap, backend=backend, recompute=recompute,
    )
    return loss_sum, (targets != ignore_index).sum()


def chunked_causal_lm_loss(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, *, head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX, chunk_tokens: int = 1024, reduction: Literal["mean", "sum"] = "mean",
    shift: bool = True, logit_scale: float | None = None, logit_softcap: float | None = None,
    backend: Backend = "auto", recompute: bool = True,
) -> torch.Tensor:
    """Next-token cross-entropy of ``hidden @ head_weight^T`` computed ``chunk_tokens`` rows at a time.

    Same result as ``F.cross_entropy(logits[..., :-1, :].float(), labels[..., 1:], ignore_index=-100)`` with
    ``logits = hidden @ head_weight^T (+ head_bias)``, but the logits exist one chunk at a time, in forward and
    in backward (recomputed there): the loss's memory is about 1.5 x ``chunk_tokens x vocab x 4`` bytes instead of
    ``tokens x vocab x (2 + 4 + 4)``. Cost: the head's matmul runs twice (once more in backward).

    Args:
        hidden: the last hidden states, ``[..., tokens, hidden_size]`` (after the final norm).
        head_weight: the LM head's weight ``[vocab, hidden_size]``; ``head_bias`` its bias, if any.
        labels: ``[..., tokens]`` token ids, ``ignore_index`` where no loss is wanted (padding, prompts).
        chunk_tokens: rows of logits per chunk.
        reduction: ``"mean"`` over the labelled tokens (0 when there are none), or ``"sum"``.
        shift: labels are the inputs (shifted inside, as Hugging Face does); ``False``: already aligned.
        logit_scale, logit_softcap: ``softcap * tanh(scale * logits / softcap)`` (Cohere's ``logit_scale``,
            Gemma's ``final_logit_softcapping``), applied in fp32.
        backend: ``"auto"`` (Liger Kernel, else Cut Cross-Entropy where installed and on CUDA, else ours),
            ``"chunked"`` (ours), ``"liger"``, ``"cce"``.
        recompute: ours recomputes each chunk's logits in backward. ``False``: computes the gradients in forward
            (no second head matmul) and holds them (``[tokens, hidden]`` and ``[vocab, hidden]``) until backward.

    Example (``model`` a Hugging Face ``GPT2LMHeadModel``; the same loss as its ``labels=`` one):

        >>> model = tiny_model().model.eval()  # no dropout
        >>> ids = torch.randint(0, model.config.vocab_size, (2, 32))
        >>> out = model.transformer(input_ids=ids)                         # hidden states only
        >>> loss = chunked_causal_lm_loss(out.last_hidden_state, model.lm_head.weight, ids, chunk_tokens=16)
        >>> torch.allclose(loss, model(input_ids=ids, labels=ids).loss)
        True
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_causal_lm_loss: passed `reduction={reduction!r}`; expected 'mean' or 'sum'.")
    loss_sum, count = chunked_causal_lm_loss_sum(
        hidden, head_weight, labels, head_bias=head_bias, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
        shift=shift, logit_scale=logit_scale, logit_softcap=logit_softcap, backend=backend, recompute=recompute,
    )
    return loss_sum if reduction == "sum" else loss_sum / count.clamp(min=1)


@dataclass(frozen=True)
class _Settings:
    chunk_tokens: int
    backend: str
    recompute: bool


@dataclass
class _Call:
    """One training call of a wrapped model: its labels, then the loss its head's pre-hook computed."""

    labels: torch.Tensor
    shifted: bool  # `shift_labels` given: already aligned with the hidden states
    num_items: Any
    ignore_index: int
    loss_sum: torch.Tensor | None = None
    count: torch.Tensor | None = None
    probe_dtype: torch.dtype | None = None
    probe_shape: tuple[int, ...] = ()


class _ChunkedHooks:
    """The forward hooks of one causal LM and of its output embeddings (picklable, deep-copyable with the model): the
    head computes the loss from its input, then returns a probe whose post-processing by the model is checked once."""

    def __init__(self, settings: _Settings, transform: tuple[float | None, float | None]) -> None:
        self.settings, self.transform = settings, transform  # (logit scale, logit softcap): `head_transform`
        self.verified = False  # NOTE: the model's post-processing matched once; no probe values (a host copy) after
        self._calls: list[_Call | None] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_calls": []}

    def model_pre(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call, changed = None, None
        if model.training:
            try:
                bound = inspect.signature(model.forward).bind(*args, **kwargs)
            except TypeError:
                bound = None  # NOTE: let the model raise its own message
            if bound is not None:
                call, changed = _take_labels(bound)
        self._calls.append(call)
        return changed

    def head_pre(self, head: nn.Module, args: tuple) -> tuple | None:
        call = self._calls[-1] if self._calls else None
        if call is None:
            return None
        if call.loss_sum is not None:
            raise RuntimeError("ChunkedLMLoss: the model calls its LM head twice in one forward; compute the loss "
                               "with `chunked_causal_lm_loss` in your own training_step instead.")
        hidden, settings = args[0], self.settings
        scale, softcap = self.transform
        call.loss_sum, call.count = chunked_causal_lm_loss_sum(
            hidden, head.weight, call.labels.to(hidden.device), head_bias=head.bias, ignore_index=call.ignore_index,
            chunk_tokens=settings.chunk_tokens, shift=not call.shifted, logit_scale=scale, logit_softcap=softcap,
            backend=settings.backend, recompute=settings.recompute,  # type: ignore[arg-type]
        )
        dtype = torch.promote_types(hidden.dtype, head.weight.dtype)
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        call.probe_dtype, call.probe_shape = dtype, (*([1] * (hidden.dim() - 1)), len(_PROBE))
        return (hidden[..., :0, :],)  # NOTE: the head computes no logits

    def head_post(self, head: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
        call = self._calls[-1] if self._calls else None
        if call is None or call.probe_dtype is None:
            return None
        if self.verified:  # NOTE: no host-to-device copy (a sync on CUDA) after the first step
            return output.new_zeros(call.probe_shape, dtype=call.probe_dtype)
        return torch.tensor(_PROBE, dtype=call.probe_dtype, device=output.device).reshape(call.probe_shape)

    def model_post(self, model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        call = self._calls.pop() if self._calls else None
        if call is None or out is None:
            return None
        if call.loss_sum is None or call.count is None:
            raise RuntimeError(f"ChunkedLMLoss: `{type(model).__name__}`'s forward never called its output embeddings; "
                               "compute the loss with `chunked_causal_lm_loss` instead.")
        logits = out.logits if hasattr(out, "logits") else out[0]
        if not self.verified:
            self.verified = _verify(model, logits, call.probe_dtype, *self.transform)
        loss_sum, count, num_items = call.loss_sum, call.count, call.num_items
        if num_items is not None:  # NOTE: Hugging Face's convention: the caller's token count for the whole batch
            loss = loss_sum / (num_items.to(loss_sum.device) if torch.is_tensor(num_items) else num_items)
        else:
            loss = loss_sum / count.clamp(min=1)
        if isinstance(out, tuple):
            return (loss, *out[1:])
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        new = type(out)(loss=loss, **fields)
        new["loss_sum"], new["num_tokens"] = loss_sum, count
        return new


def _take_labels(bound: inspect.BoundArguments) -> tuple[_Call | None, tuple[tuple, dict] | None]:
    """A training call's labels taken out of its arguments: the call and the arguments without them; (None, None)
    without labels or with ``logits_to_keep`` (the model runs untouched)."""
    arguments = bound.arguments
    extra_name = next((n for n, p in bound.signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = dict(arguments.get(extra_name, {})) if extra_name else {}

    def get(name: str, default: Any = None) -> Any:
        return arguments.get(name, extra.get(name, default))

    labels, shift_labels, keep = get("labels"), get("shift_labels"), get("logits_to_keep")
    if (labels is None and shift_labels is None) or not (keep is None or (isinstance(keep, int) and keep == 0)):
        return None, None
    call = _Call(labels if shift_labels is None else shift_labels, shift_labels is not None,
                 get("num_items_in_batch"), get("ignore_index", IGNORE_INDEX))
    for name in ("labels", "shift_labels", "num_items_in_batch", "ignore_index"):
        arguments.pop(name, None)
        extra.pop(name, None)
    if extra_name:
        arguments[extra_name] = extra
    return call, (bound.args, bound.kwargs)


def is_chunked(model: nn.Module) -> bool:
    """Whether ``ChunkedLMLoss`` chunks the loss of ``model`` or of a model inside it (then its training forward with
    labels returns no logits)."""
    return any(isinstance(getattr(h, "__self__", None), _ChunkedHooks)
               for m in model.modules() for h in torch_internals.forward_pre_hooks(m).values())


def head_transform(model: nn.Module) -> tuple[float | None, float | None]:
    """``(scale, softcap)`` the model applies to ``lm_head``'s output: Cohere, Granite, Gemma. Checked by a probe."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(model, "logit_scale", None)  # Cohere: logits * logit_scale
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    scaling = getattr(text, "logits_scaling", None)  # Granite: logits / logits_scaling
    if isinstance(scaling, (int, float)) and scaling not in (0, 1):
        scale = (scale or 1.0) / float(scaling)
    softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(logits / cap)
    return scale, (float(softcap) if softcap else None)


def _verify(model: nn.Module, logits: Any, dtype: torch.dtype | None, scale: float | None,
            softcap: float | None) -> bool:
    """Whether the model's post-processing of the probe its head returned is what the loss applies (raises if not);
    False in a dry run (fake logits have no values to compare)."""
    if torch.is_tensor(logits) and (torch_internals.is_fake(logits) or logits.device.type == "meta"):
        return False
    probe = torch.tensor(_PROBE, dtype=dtype)
    expected = probe.double()
    if scale is not None:
        expected = expected * scale
    if softcap is not None:
        expected = torch.tanh(expected / softcap) * softcap
    ok = torch.is_tensor(logits) and logits.numel() == probe.numel()
    if ok:
        tol = 1e-5 if probe.dtype in (torch.float32, torch.float64) else 2e-2
        ok = torch.allclose(logits.detach().double().cpu().reshape(-1), expected, rtol=tol, atol=tol * 10)
    if not ok:
        raise ValueError(
            f"ChunkedLMLoss cannot reproduce `{type(model).__name__}`'s logits: its forward changes the LM head's "
            f"output in a way the callback does not know (it knows Cohere's `logit_scale`, Granite's "
            "`logits_scaling` and Gemma's `final_logit_softcapping`). Remove the callback and compute the loss in "
            "your training_step with `chunked_causal_lm_loss(hidden, head.weight, labels, logit_scale=..., "
            "logit_softcap=...)`."
        )
    return True


def find_causal_lms(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face causal LMs under ``root`` (a class of, or derived from, an ``AutoModelForCausalLM``;
    a masked LM's or seq2seq model's ``labels`` are not shifted)."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ([v] if isinstance(v, str) else v)}
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if not isinstance(module, PreTrainedModel) or not any(c.__name__ in causal for c in type(module).__mro__):
            continue
        if getattr(module.config, "is_encoder_decoder", False):
            continue
        try:
            head = module.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            found.append((name, module))
    return found


class ChunkedLMLoss(Reproducible, pl.Callback):
    """Compute a Hugging Face causal LM's training loss ``chunk_tokens`` tokens at a time, without the full logits.

    Memory: the logits of a step (``tokens x vocab``: 4 x 1024 x 50257 for GPT-2-XL at batch 4, 0.39 GiB in bf16,
    0.77 GiB more upcast to fp32, as much again for their gradient) never exist; one chunk's logits do (about
    1.5 x ``chunk_tokens x vocab x 4`` bytes at the loss's peak: 128 tokens keep GPT-2-XL's loss under 64 MiB).
    Cost: the head's matmul runs once more, in backward (each chunk's logits are recomputed there).

    Forward hooks make the model's ``lm_head`` compute its ``labels=`` loss, chunked; in training the output has
    ``loss``, ``loss_sum`` and ``num_tokens`` and **``logits`` is ``None``** (docs/techniques/chunked-lm-loss.md).

    Args:
        chunk_tokens: rows of logits per chunk (smaller: less memory, more, smaller matmuls).
        backend: ``"auto"``: Liger Kernel's fused linear cross-entropy, else Apple's Cut Cross-Entropy, where
            installed (``pip install 'lightning-lowmem[kernels]'``) and on CUDA; our chunked loss otherwise.
            ``"chunked"``, ``"liger"`` or ``"cce"`` force one.
        recompute: our loss recomputes each chunk's logits in backward (one more head matmul). ``False``
            computes the gradients in the loss's forward and holds them until backward: no extra matmul, about the
            same peak.

    Example (the demo module's ``training_step`` computes ``self.model(input_ids=ids, labels=ids).loss``):

        >>> from lightning_lowmem import ChunkedLMLoss
        >>> chunked = ChunkedLMLoss(chunk_tokens=16)
        >>> trainer = L.Trainer(strategy="lowmem_offload", precision="bf16-true", callbacks=[chunked],
        ...                     max_steps=1, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> trainer.global_step
        1

    Attributes:
        wrapped: qualified names of the wrapped models, from ``on_fit_start`` to the end of fit (then ``[]``).
    """

    def __init__(self, chunk_tokens: int = 1024, backend: Backend = "auto", recompute: bool = True) -> None:
        super().__init__()
        problems = _validate(chunk_tokens, backend)
        if not isinstance(recompute, bool):
            problems.append(f"`recompute={recompute!r}`; expected True or False")
        if problems:
            wrong_type = isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or not isinstance(recompute, bool)
            raise (TypeError if wrong_type else ValueError)("ChunkedLMLoss: passed " + "; ".join(problems) + ".")
        if backend in ("liger", "cce"):
            require_kernel(backend, f"ChunkedLMLoss(backend={backend!r})")
        self.chunk_tokens = chunk_tokens
        self.backend = backend
        self.recompute = recompute
        self.wrapped: list[str] = []
        self._handles: list[Any] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_lightning_object(trainer, "the Trainer of ChunkedLMLoss")
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) and (strategy.config or {}).get("zero_optimization", {}).get("stage") == 3:
            raise ValueError(
                f"ChunkedLMLoss cannot run under `{type(strategy).__name__}` with ZeRO stage 3: DeepSpeed re-gathers "
                "a partitioned weight only for its module's own backward, not for the loss's. Use ZeRO stage 2, "
                "`strategy='lowmem_offload'`, or remove the callback."
            )
        if self.backend in ("liger", "cce") and strategy.root_device.type != "cuda":
            raise ValueError(
                f"Passed `backend={self.backend!r}` with the Trainer on `{strategy.root_device}`; the {self.backend} "
                "kernels are Triton (CUDA only). Use backend='auto' (ours off CUDA) or backend='chunked'."
            )
        if self.backend == "cce" and not str(trainer.precision).startswith(("bf16", "16")):
            raise ValueError(
                f"Passed `backend='cce'` with `Trainer(precision={trainer.precision!r})`; Cut Cross-Entropy runs only "
                "in float16/bfloat16. Use precision='bf16-mixed' (or '16-mixed'), or backend='auto'/'chunked'."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # NOTE: here, not in setup: a model built in `configure_model` exists now (the loss changes no parameter)
        self.apply(pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.remove()  # NOTE: as soon as training ends: a MemoryReport's teardown then copies the model as built

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.remove()

    def apply(self, root: nn.Module) -> list[str]:
        """Chunk the loss of the causal LMs under ``root`` (what ``on_fit_start`` does). Returns their names."""
        if self._handles:
            return self.wrapped
        found = find_causal_lms(root)
        if not found:
            raise ValueError(
                f"ChunkedLMLoss found no Hugging Face causal LM in `{type(root).__name__}` (a model class of "
                "`AutoModelForCausalLM`, or derived from one, with output embeddings: GPT2LMHeadModel, "
                "LlamaForCausalLM, ...). For a head of your own, call `chunked_causal_lm_loss(hidden, head_weight, labels)` "
                "in training_step instead of the callback."
            )
        problems = []
        for name, model in found:
            head = model.get_output_embeddings()
            plain = isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            if not plain or not head.weight.is_floating_point():
                problems.append(
                    f"`{name or type(model).__name__}`'s output embeddings are a `{type(head).__name__}` with a "
                    f"{getattr(getattr(head, 'weight', None), 'dtype', None)} weight; the chunked loss needs a plain "
                    "`nn.Linear` with a floating-point weight (not quantized, not LoRA-wrapped)"
                )
            elif self.backend == "cce" and head.bias is not None:
                problems.append(f"`{name or type(model).__name__}`'s LM head has a bias and backend='cce' was passed; "
                                "Cut Cross-Entropy takes no bias (backend='auto' picks Liger or ours for it)")
        if problems:
            raise ValueError("ChunkedLMLoss: " + "; ".join(problems) + ".")
        chunked = [name or type(model).__name__ for name, model in found if is_chunked(model)]
        if chunked:
            raise ValueError(f"ChunkedLMLoss: {', '.join(chunked)} chunk their loss already (another ChunkedLMLoss); "
                             "keep one of the callbacks.")
        settings = _Settings(self.chunk_tokens, self.backend, self.recompute)
        for _, model in found:
            hooks = _ChunkedHooks(settings, head_transform(model))
            head = model.get_output_embeddings()
            # NOTE: the model's pre-hook last (it sees the call's own arguments) and its forward hook first; the head's
            # pre-hook last, so hooks that fetch the head's weight around its forward have run when the loss reads it
            self._handles += [
                model.register_forward_pre_hook(hooks.model_pre, with_kwargs=True),
                model.register_forward_hook(hooks.model_post, with_kwargs=True, prepend=True, always_call=True),
                head.register_forward_pre_hook(hooks.head_pre),
                head.register_forward_hook(hooks.head_post, prepend=True),
            ]
        self.wrapped = [name or type(model).__name__ for name, model in found]
        rank_zero_info(f"ChunkedLMLoss: chunked training loss for {', '.join(self.wrapped)} "
                       f"(chunk_tokens={self.chunk_tokens}, backend={self.backend!r}, recompute={self.recompute})")
        return self.wrapped

    def remove(self) -> None:
        """Remove the hooks: the models compute their own loss again."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.wrapped = [], []
