"""One training step of a LightningModule on fake tensors: the peak of a model too big to build.

:func:`dry_run` builds the user's LightningModule on the ``meta`` device, gives every parameter and
buffer a fake CPU storage (``FakeTensorMode``: shapes, dtypes and storage sizes, no bytes), and runs
their own ``training_step`` and ``configure_optimizers`` for two optimizer steps in Lightning's
automatic-optimization order (``training_step`` -> ``zero_grad`` -> ``backward`` -> ``step``), under
:class:`~lightning_lowmem.memory.measure.MemoryTracker`. Nothing is allocated; the tracker counts what
*would* be. The techniques of the suite are applied in the trace itself (precision, activation
checkpointing of the repeated blocks, activation offload, CPU-master offload, optimizer-in-backward,
accumulation), so their effect is traced, not guessed.

Deep models are traced at 2 and 4 repeated blocks and extrapolated linearly, per phase, role and
category (each is affine in the block count; a probe matched a 48-layer trace within 1 MiB).

Traps handled here, named because each one silently gives a wrong figure or kills the process:

* ``Module.to_empty`` unties shared weights (HF's ``lm_head``/``wte``): parameters are swapped in
  through one memo per parameter object, so a tied weight stays one storage.
* bitsandbytes' optimizers call ``.tolist()`` in their constructor: ``configure_optimizers`` runs
  *outside* the fake mode (its parameters are already fake; its own small tensors stay real).
* Fake ``cuda`` tensors abort a CPU-only build at the first autograd edge (C++ terminate): the trace
  is always on fake CPU tensors. A GPU target gets explicit corrections instead (see
  :func:`dry_run`'s ``target``), each listed in the result and marked uncalibrated.

Example::

    from lightning_lowmem import dry_run
    from lightning_lowmem.demo.module import CausalLMModule

    est = dry_run(lambda: CausalLMModule(config={"n_layer": 48, "n_embd": 1600, "n_head": 25}),
                  batch_size=4, seq_len=1024, precision="bf16-true", checkpointing="all")
    print(est.peak_device, est.binding_phase)
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch._subclasses import fake_tensor as _fake

from lightning_lowmem.memory.categories import CATEGORIES, MemoryBreakdown, mark_host
from lightning_lowmem.memory.estimate import (
    CHECKPOINTING,
    PRECISIONS,
    Correction,
    MemoryEstimate,
    validate_choice,
)
from lightning_lowmem.memory.measure import MemoryTracker

PHASES = ("forward", "backward", "optimizer")
_HALF = {"bf16": torch.bfloat16, "16": torch.float16}
#: CUDA context + cuBLAS workspace on a recent driver with lazy module loading (uncalibrated)
CUDA_CONTEXT_BYTES = 512 * 2**20
_FAKE_ERRORS = (
    _fake.UnsupportedOperatorException,
    _fake.DataDependentOutputException,
    _fake.DynamicOutputShapeException,
    _fake.UnsupportedFakeTensorException,
)


class DryRunUnsupportedError(RuntimeError):
    """The model runs an op that fake tensors cannot execute (no fake/meta kernel, data-dependent output)."""

    def __init__(self, op: str, detail: str) -> None:
        self.op = op
        super().__init__(
            f"The dry run cannot trace op `{op}`: it has no fake-tensor implementation or its output depends on "
            f"tensor values ({detail}). Register one with `torch.library.register_fake`, or use the analytic "
            "estimate (`estimate_memory(..., method='analytic')`)."
        )


# --- the model on fake storage ---------------------------------------------------------------------------
def _swap_in_fake(module: torch.nn.Module, fake_mode: _fake.FakeTensorMode, dtype: torch.dtype | None) -> list:
    """Give every parameter and buffer a fake CPU storage; returns what restores the originals.

    NOTE: one memo per tensor object keeps tied weights tied (``to_empty`` does not).
    """
    memo: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict, str, Any]] = []

    def fake_of(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(t) not in memo:
            cast = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            with fake_mode:
                f = torch.empty_strided(t.size(), t.stride(), dtype=cast, device="cpu")
            memo[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if is_param else f
        return memo[id(t)]

    for mod in module.modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is not None:
                    undo.append((table, name, t))
                    table[name] = fake_of(t, is_param)
    return undo


def _restore(undo: list) -> None:
    for table, name, value in reversed(undo):
        table[name] = value


def find_blocks(module: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList] | None:
    """The model's repeated blocks: the longest ModuleList of >= 2 same-class children (as ActivationCheckpointing)."""
    best, best_size = None, (-1, -1)
    for parent in module.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) >= 2:
                if len({type(c) for c in child}) != 1:
                    continue
                size = (len(child), sum(p.numel() for p in child.parameters()))
                if size > best_size:
                    best, best_size = (parent, name, child), size
    return best


def _truncate_blocks(module: torch.nn.Module, keep: int) -> int:
    """Keep the first ``keep`` repeated blocks (on the meta model); returns the original count."""
    found = find_blocks(module)
    if found is None:
        raise ValueError("Cannot extrapolate: the model has no ModuleList of repeated blocks.")
    parent, name, blocks = found
    full = len(blocks)
    setattr(parent, name, torch.nn.ModuleList(list(blocks)[:keep]))
    for sub in module.modules():  # NOTE: HF loops over `layers[: config.num_hidden_layers]`
        config = getattr(sub, "config", None)
        for attr in ("num_hidden_layers", "n_layer", "num_layers"):
            if config is not None and getattr(config, attr, None) == full:
                setattr(config, attr, keep)
    return full


# --- techniques applied in the trace ---------------------------------------------------------------------
def _apply_checkpointing(module: torch.nn.Module, policy: str | None, every_n: int) -> Callable[[], None]:
    """Checkpoint the blocks exactly as the ``ActivationCheckpointing`` callback does; returns the undo."""
    if policy is None:
        return lambda: None
    from lightning_lowmem.callbacks import _blocks
    from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing

    if _blocks.checkpointed_modules(module):
        return lambda: None  # NOTE: already checkpointed (the user's module inside a fit): trace it as it is
    n = every_n if policy == "every_n" else None
    callback = ActivationCheckpointing(policy=policy, n=n)  # type: ignore[arg-type]
    quiet = [logging.getLogger(name) for name in ("lightning_lowmem.callbacks.activation_checkpointing",
                                                  "lightning.pytorch.utilities.rank_zero")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        # NOTE: `_apply` is the callback's own application of its policy (what its `configure_model` wrapper
        # calls); it needs no Trainer, so the trace checkpoints exactly the blocks a real run would.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            callback._apply(module)  # type: ignore[arg-type]
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)

    def undo() -> None:
        for _, wrapped, _ in _blocks.checkpointed_modules(module):
            _blocks.unwrap(wrapped)
        for handle in callback._hook_handles:
            handle.remove()
        for config, value in callback._use_cache:
            config.use_cache = value

    return undo


@contextlib.contextmanager
def _activation_offload(param_keys: set[int], enabled: bool = True, min_bytes: int = 1024) -> Iterator[None]:
    """Saved activations go to the host in forward and come back for backward, as ``ActivationOffload`` does.

    Per storage, once (views of one storage share the host copy); storages under ``min_bytes`` (the callback's
    default 1024) and weights stay. Restored device copies live while autograd holds a view of them.
    NOTE: identity by storage object, not ``data_ptr`` (every fake storage has address 0).
    """
    if not enabled:
        yield
        return
    packed: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
    restored: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def pack(t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st._cdata
        if key in param_keys or st.nbytes() < min_bytes:
            return t
        hit = packed.get(key)
        if hit is None or hit[0]() is not st:  # NOTE: a freed storage's key can be reused by a new one
            host = torch.empty(st.nbytes(), dtype=torch.uint8)
            mark_host(host)
            hit = packed[key] = (weakref.ref(st), host)
        return (hit[1], t.dtype, t.size(), t.stride(), t.storage_offset())

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        host, dtype, size, stride, offset = saved
        device = restored.get(id(host))
        if device is None:
            device = restored[id(host)] = torch.empty(host.numel(), dtype=torch.uint8)
        return device.view(dtype).as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def _cuda_kernels(counts: dict[str, int]) -> Iterator[None]:
    """Trace CUDA's kernel choices on CPU: fused dropout with a 1-byte mask, SDPA with O(s) saved state."""
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and input.numel():
            # NOTE: CUDA's at::dropout runs native_dropout (bool mask); CPU's keeps a float mask of 4 B/elem
            if torch.is_grad_enabled() and input.requires_grad:
                counts["dropout_mask_elements"] += input.numel()
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def cuda_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        # NOTE: CPU falls back to the math kernel (s^2 probabilities kept) when dropout_p > 0; CUDA's flash /
        # memory-efficient kernels keep O(s) state with dropout too. Values are fake, so dropping p is exact.
        if kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            counts["sdpa_dropout_calls"] += 1
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return sdpa(*args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = cuda_dropout, cuda_sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


# --- optimizers ------------------------------------------------------------------------------------------
def optimizers_from(conf: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in any output of ``configure_optimizers`` (optimizer, list, dict, (opts, scheds))."""
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, dict):
        return optimizers_from(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)):
        if len(conf) == 2 and isinstance(conf[0], (list, tuple)):
            return optimizers_from(list(conf[0]))
        return [o for c in conf for o in optimizers_from(c)]
    raise TypeError(
        f"`configure_optimizers` returned {type(conf).__name__}; the dry run needs an optimizer, a list of "
        "optimizers, a dict with key 'optimizer', or ([optimizers], [schedulers])."
    )


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"`training_step` returned {type(output).__name__}; the dry run needs a loss tensor or a dict with "
            "key 'loss'."
        )
    return loss


# --- one trace ---------------------------------------------------------------------------------------------
def _trace(
    build: Callable[[], torch.nn.Module],
    batch: Any,
    *,
    precision: str,
    checkpointing: str | None,
    checkpointing_every_n: int,
    activation_offload: bool,
    offload: bool,
    optimizer_in_backward: bool,
    accumulate_grad_batches: int,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None,
    target: str,
    steps: int,
    counts: dict[str, int],
) -> dict[tuple[str, str, str], int]:
    """Run the steps once under fake tensors; returns ``{(phase, role, category): bytes}``."""
    import lightning as L

    kind, _, mode = precision.partition("-")
    half = _HALF.get(kind)
    fake_mode = _fake.FakeTensorMode(allow_non_fake_inputs=True)
    module = build()
    undo = _swap_in_fake(module, fake_mode, half if mode == "true" else None)
    handles: list[Any] = []
    undo_checkpointing: Callable[[], None] = lambda: None  # noqa: E731
    was_training = module.training
    try:
        module.train()
        undo_checkpointing = _apply_checkpointing(module, checkpointing, checkpointing_every_n)
        params = [p for p in module.parameters() if p.requires_grad]
        param_keys = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
        # NOTE: outside the fake mode: bitsandbytes' constructor needs real `.tolist()`
        if optimizer is not None:
            opts = [optimizer(params)]
        elif isinstance(module, L.LightningModule):
            opts = optimizers_from(module.configure_optimizers())
        else:
            raise TypeError(f"Passed a {type(module).__name__}; `dry_run` needs a LightningModule or an `optimizer=`.")

        host_opt: list[torch.optim.Optimizer] = []
        masters: dict[int, torch.Tensor] = {}
        if offload:
            # device keeps compute weights; fp32 masters, fp32 gradients and the optimizer live on the host
            with fake_mode:
                for p in params:
                    master = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32))
                    master.grad = torch.zeros(p.shape, dtype=torch.float32)
                    mark_host(master, master.grad)
                    masters[id(p)] = master
            for opt in opts:
                for group in opt.param_groups:
                    group["params"] = [masters[id(p)] for p in group["params"]]
                    # NOTE: as OffloadStrategy(host_optimizer="auto"): torch's fused CPU kernel for Adam/AdamW
                    if type(opt) in (torch.optim.Adam, torch.optim.AdamW) and not group.get("foreach"):
                        group["fused"], group["foreach"] = True, False
            host_opt, opts = opts, []

            def to_host(p: torch.Tensor) -> None:
                masters[id(p)].grad.add_(p.grad)  # NOTE: the real strategy copies on a side stream on CUDA
                p.grad = None

            handles += [p.register_post_accumulate_grad_hook(to_host) for p in params]
        elif optimizer_in_backward:
            # NOTE: one optimizer per parameter with its group's settings (as OptimizerInBackward does)
            per_param = {
                id(p): type(o)([{**g, "params": [p]}]) for o in opts for g in o.param_groups for p in g["params"]
            }

            def step_now(p: torch.Tensor) -> None:
                per_param[id(p)].step()
                p.grad = None

            handles += [p.register_post_accumulate_grad_hook(step_now) for p in params]
            opts = list(per_param.values())

        if target == "cuda":
            for opt in opts:  # NOTE: device optimizers default to foreach on CUDA (+4 B/param of temporaries)
                for group in opt.param_groups:
                    if group.get("foreach", False) is None and not group.get("fused"):
                        group["foreach"] = True
                        counts["foreach_groups"] += 1
        fake_batch = torch.utils._pytree.tree_map(
            lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, _without_trivial_mask(batch)
        )
        if mode == "mixed":
            forward_ctx: Callable[[], Any] = lambda: torch.autocast("cpu", dtype=half)  # noqa: E731
        elif half is not None:
            forward_ctx = lambda: _default_dtype(half)  # noqa: E731
        else:
            forward_ctx = contextlib.nullcontext
        step_fn = module.training_step if isinstance(module, L.LightningModule) else None
        tracker = MemoryTracker(module=module, optimizers=opts)
        host_tracker = MemoryTracker(module=None, optimizers=host_opt)
        with fake_mode, contextlib.ExitStack() as stack:
            if target == "cuda":
                stack.enter_context(_cuda_kernels(counts))
            stack.enter_context(_hf_value_checks(batch))
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=".*self.log.*")
            warnings.filterwarnings("ignore", message=".*trainer.*")
            with tracker:
                tracker.track(fake_batch)
                if offload:
                    tracker.track(list(masters.values()), category="optimizer_state")
                    tracker.track([m.grad for m in masters.values()], category="gradients")
                for _ in range(steps):
                    for micro in range(accumulate_grad_batches):
                        with tracker.phase("forward"):
                            with forward_ctx(), _activation_offload(param_keys, activation_offload):
                                loss = _loss_of(step_fn(fake_batch, 0))
                            if accumulate_grad_batches > 1:
                                loss = loss / accumulate_grad_batches
                            if micro == 0:
                                for opt in opts:
                                    opt.zero_grad()
                        with tracker.phase("backward"):
                            loss.backward()
                        del loss
                    if optimizer_in_backward:
                        continue
                    with tracker.phase("optimizer"):
                        for opt in opts:
                            opt.step()
                        if offload:
                            with torch.no_grad():
                                for p in params:
                                    p.copy_(masters[id(p)])
            if offload:
                # NOTE: the host step is traced apart, after the device trace: its state and temporaries are
                # host memory, which the device tracker (every unmarked storage is `device`) would misfile.
                with host_tracker:
                    with host_tracker.phase("optimizer"):
                        for _ in range(steps):
                            for opt in host_opt:
                                opt.step()
    except _FAKE_ERRORS as err:
        op = getattr(err, "func", None)
        raise DryRunUnsupportedError(str(op) if op is not None else type(err).__name__, str(err)) from err
    finally:
        for h in handles:
            h.remove()
        undo_checkpointing()
        _restore(undo)
        module.train(was_training)
    return _flatten(tracker, host_tracker if offload else None)


def _without_trivial_mask(batch: Any) -> Any:
    """The batch with an all-ones ``attention_mask`` replaced by None.

    NOTE: Hugging Face models skip an all-ones mask (SDPA then runs causal, no mask tensor), but on fake
    tensors they cannot look at its values and build the (b, 1, s, s) mask, and GQA models then repeat K/V
    for SDPA: ~2-3 % more activations than the real run. None is what an all-ones mask means to them.
    """
    if isinstance(batch, dict) and isinstance(batch.get("attention_mask"), torch.Tensor):
        mask = batch["attention_mask"]
        if not isinstance(mask, _fake.FakeTensor) and not mask.is_meta and bool(mask.all()):
            return {**batch, "attention_mask": None}
    return batch


@contextlib.contextmanager
def _hf_value_checks(batch: Any) -> Iterator[None]:
    """Answer Hugging Face's value checks from the real batch, as a real run would.

    NOTE: without a KV cache (training with checkpointing) HF looks for packed sequences in ``position_ids``;
    on fake tensors it cannot read them, assumes packing and builds a (b, 1, s, s) mask that the real run
    skips. Default positions (none in the batch) are never packed; given ones are checked on real values.
    """
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    real_positions = batch.get("position_ids") if isinstance(batch, dict) else None

    def find_packed(position_ids: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(position_ids, _fake.FakeTensor):
            return original(position_ids)
        if not isinstance(real_positions, torch.Tensor) or isinstance(real_positions, _fake.FakeTensor):
            return None
        with _fake.unset_fake_temporarily():
            return original(real_positions.expand(position_ids.shape[0], -1))

    masking.find_packed_sequence_indices = find_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _flatten(tracker: MemoryTracker, host_tracker: MemoryTracker | None) -> dict[tuple[str, str, str], int]:
    out: dict[tuple[str, str, str], int] = {}
    peaks = tracker.peaks
    for phase in PHASES:
        peak = peaks.get(phase)
        for cat in CATEGORIES:
            out[(phase, "device", cat)] = peak.by_category[cat] if peak else 0
            out[(phase, "host", cat)] = peak.host_by_category[cat] if peak else 0
    if host_tracker is not None:
        # NOTE: in the host trace the (marked) masters and their gradients are `host`, while the optimizer's
        # state and temporaries, created unmarked, are `device`: on the host machine they add up.
        step = host_tracker.peaks["optimizer"]
        state = host_tracker.breakdown().device["optimizer_state"]
        for phase in ("forward", "backward"):
            out[(phase, "host", "optimizer_state")] += state
        for cat in CATEGORIES:
            out[("optimizer", "host", cat)] = step.host_by_category[cat] + step.by_category[cat]
    return out


def _extrapolate(v_a: dict, v_b: dict, n_a: int, n_b: int, n: int) -> dict:
    return {k: max(0, round(v_a[k] + (v_b[k] - v_a[k]) * (n - n_a) / (n_b - n_a))) for k in v_a}


# --- public entry -------------------------------------------------------------------------------------------
def dry_run(
    module: Any,
    batch: Any = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32-true",
    checkpointing: Literal["all", "every_n", "sqrt", "selective"] | None = None,
    checkpointing_every_n: int = 2,
    activation_offload: bool = False,
    offload: bool = False,
    optimizer_in_backward: bool = False,
    accumulate_grad_batches: int = 1,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    target: Literal["cpu", "cuda"] = "cpu",
    extrapolate: bool | None = None,
    steps: int = 2,
) -> MemoryEstimate:
    """Predict the peak memory of training ``module`` by running its step once on fake tensors.

    Args:
        module: a LightningModule instance (its parameters are swapped for fake ones during the run and
            restored after), or a zero-argument callable returning one (a class, a lambda): it is built
            on the ``meta`` device, so a model far larger than this machine's memory costs nothing.
        batch: the batch passed to ``training_step`` (real tensors are fine: they are converted to fake
            ones). Default: a causal-LM batch ``{"input_ids", "attention_mask", "labels"}`` of
            ``batch_size x seq_len`` token ids.
        precision: a Lightning precision string: ``"32-true"``, ``"bf16-true"``/``"16-true"`` (module cast
            to half precision), ``"bf16-mixed"``/``"16-mixed"`` (autocast around ``training_step``).
        checkpointing: activation checkpointing of the repeated blocks (non-reentrant
            ``torch.utils.checkpoint``): ``"all"``, ``"every_n"`` (every ``checkpointing_every_n``-th
            block), ``"sqrt"`` (segments of sqrt(L) blocks), ``"selective"`` (each block's attention).
        activation_offload: saved activations (not weights) kept in the host role between forward and backward.
        offload: ``lowmem_offload``: compute weights on the device, gradients moved to fp32 host buffers as
            they are produced, fp32 masters and the optimizer on the host.
        optimizer_in_backward: each parameter steps as soon as its gradient is ready, then drops it.
        accumulate_grad_batches: micro-batches per optimizer step (``batch`` is one micro-batch).
        optimizer: builds the optimizer from the parameters instead of ``configure_optimizers``.
        target: ``"cpu"`` predicts this trace as is. ``"cuda"`` applies the known CPU-vs-CUDA differences:
            fused dropout's 1-byte mask and SDPA's flash kernel are traced, foreach optimizers are traced,
            the CUDA context is added; each is listed in ``result.corrections`` (uncalibrated: no GPU run yet).
        extrapolate: trace 2 and 4 blocks and extrapolate linearly. Default: when ``module`` is a callable
            and the model has more than 8 blocks (not with ``checkpointing="sqrt"``, which is not linear).
        steps: optimizer steps traced (2: the first creates the optimizer state, the second is steady state).

    Returns:
        A :class:`~lightning_lowmem.memory.estimate.MemoryEstimate` (per phase, role and category).

    Raises:
        DryRunUnsupportedError: an op of the model has no fake implementation (the op is named).
        ValueError / TypeError: bad arguments, each naming what was given.
    """
    validate_choice("precision", precision, PRECISIONS)
    validate_choice("checkpointing", checkpointing, CHECKPOINTING)
    validate_choice("target", target, ("cpu", "cuda"))
    for name, value in (("accumulate_grad_batches", accumulate_grad_batches), ("steps", steps),
                        ("checkpointing_every_n", checkpointing_every_n)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Passed `{name}={value!r}`; expected a positive integer.")
    if offload and optimizer_in_backward:
        raise ValueError(
            "Passed `offload=True` and `optimizer_in_backward=True`; choose one (the offload steps on the host)."
        )
    if batch is None:
        if not batch_size or not seq_len:
            raise ValueError("Pass `batch`, or `batch_size` and `seq_len` for a causal-LM batch of token ids.")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    is_factory = callable(module) and not isinstance(module, torch.nn.Module)
    if not is_factory and not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"Passed `module` of type {type(module).__name__}; expected a LightningModule or a callable returning one."
        )

    def build_meta(keep: int | None = None) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            with torch.device("meta"):
                m = module()
            if keep is not None:
                _truncate_blocks(m, keep)
            return m

        return build

    counts = {"dropout_mask_elements": 0, "sdpa_dropout_calls": 0, "foreach_groups": 0}
    kw = dict(precision=precision, checkpointing=checkpointing, checkpointing_every_n=checkpointing_every_n,
              activation_offload=activation_offload, offload=offload, optimizer_in_backward=optimizer_in_backward,
              accumulate_grad_batches=min(accumulate_grad_batches, 2), optimizer=optimizer, target=target,
              steps=steps, counts=counts)
    t0 = time.perf_counter()
    notes: list[str] = []
    num_blocks = None
    if is_factory:
        probe = build_meta()()
        found = find_blocks(probe)
        num_blocks = len(found[2]) if found else None
        num_params = sum(p.numel() for p in {id(p): p for p in probe.parameters()}.values())
        del probe
    else:
        found = find_blocks(module)
        num_blocks = len(found[2]) if found else None
        num_params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    unit = checkpointing_every_n if checkpointing == "every_n" else 1
    can_extrapolate = is_factory and num_blocks is not None and checkpointing != "sqrt" and num_blocks > 4 * unit
    if extrapolate is None:
        extrapolate = can_extrapolate and num_blocks > 8
    elif extrapolate and not can_extrapolate:
        raise ValueError(
            "Passed `extrapolate=True`, but extrapolation needs `module` as a callable (to rebuild it with fewer "
            "blocks), a ModuleList of repeated blocks with more than 4 blocks per checkpointing unit, and a policy "
            f"linear in depth (not 'sqrt'); got {'a callable' if is_factory else 'an instance'}, "
            f"{num_blocks} blocks, checkpointing={checkpointing!r}."
        )
    if extrapolate:
        n_a, n_b = 2 * unit, 4 * unit
        v_a = _trace(build_meta(n_a), batch, **kw)
        v_b = _trace(build_meta(n_b), batch, **kw)
        values = _extrapolate(v_a, v_b, n_a, n_b, num_blocks)
        notes.append(f"traced {n_a} and {n_b} of {num_blocks} blocks, extrapolated linearly per phase/role/category")
    else:
        values = _trace(build_meta() if is_factory else (lambda: module), batch, **kw)
        notes.append(f"traced all {num_blocks or 'the'} blocks")
    wall = time.perf_counter() - t0

    phases = {}
    for phase in PHASES:
        bd = MemoryBreakdown()
        for role in ("device", "host"):
            for cat in CATEGORIES:
                bd.add(role, cat, values[(phase, role, cat)])  # type: ignore[arg-type]
        phases[phase] = bd
    if optimizer_in_backward:
        notes.append("optimizer-in-backward: no separate optimizer phase; the step happens inside backward")
    staging = num_params * (4 if precision == "32-true" else 2) if offload else 0
    corrections = _cuda_corrections(counts, phases, staging, extrapolate) if target == "cuda" else []
    return MemoryEstimate(
        phases=phases, method="dry_run", target=target, corrections=corrections, notes=notes, wall_s=wall,
        num_params=num_params,
    )


def _cuda_corrections(counts: dict[str, int], phases: dict[str, MemoryBreakdown], staging_bytes: int,
                      extrapolated: bool) -> list[Correction]:
    scale = " (counted in the traced blocks)" if extrapolated else ""
    out = [
        Correction("dropout_mask_1_byte", 0, True,
                   f"F.dropout traced as CUDA's native_dropout: bool masks, {counts['dropout_mask_elements']:,} "
                   f"mask elements per step{scale} at 1 B instead of 4 B (CPU)"),
        Correction("sdpa_flash_kernel", 0, True,
                   f"{counts['sdpa_dropout_calls']} SDPA calls with dropout traced without the CPU math fallback "
                   "(no s^2 probabilities kept), as CUDA's flash/memory-efficient kernels"),
        Correction("foreach_optimizer", 0, True,
                   f"{counts['foreach_groups']} torch optimizer param groups traced with foreach=True, CUDA's default"),
        Correction("cuda_context", CUDA_CONTEXT_BYTES, False,
                   "CUDA context + cuBLAS workspace added to every phase's device `other` (lazy loading; "
                   "driver-dependent, 300-600 MiB)"),
    ]
    for bd in phases.values():
        bd.add("device", "other", CUDA_CONTEXT_BYTES)
        bd.add("host", "other", staging_bytes)
    if staging_bytes:
        out.append(Correction("pinned_staging", staging_bytes, False,
                              "OffloadStrategy's pinned host staging buffers in the compute dtype (CUDA only), "
                              "added to every phase's host `other`"))
    out.append(Correction("allocator_rounding", 0, False,
                          "the caching allocator rounds blocks to 512 B and reserves more than it allocates; "
                          "fragmentation is not modelled (size: to be calibrated on a GPU)"))
    return out
