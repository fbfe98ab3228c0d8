"""``estimate_memory``: the predicted peak memory of a run, before any training (``docs/estimate.md``).

A dry run (:func:`~lightning_lowmem.predict.dry_run.dry_run`) of the run as the Trainer, a LightningCLI YAML or keyword
shorthands describe it; closed forms (:mod:`~lightning_lowmem.predict.analytic`) are a bound beside it.

Example (a tiny GPT-2 shape here; ``"gpt2-xl"`` and the other shipped names are given the same way, and
``estimate_memory("configs/demo.yaml")`` predicts the run a YAML describes, with its own data):

    >>> from lightning_lowmem import ActivationCheckpointing, LowBitOptimizer, estimate_memory
    >>> shape = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}
    >>> est = estimate_memory(shape, batch_size=2, seq_len=32, strategy="lowmem_offload", precision="bf16-true",
    ...                       callbacks=[ActivationCheckpointing("all"), LowBitOptimizer("adamw8bit")])
    >>> est.peak_device > 0, est.peak_host > 0, est.binding_phase      # bytes, bytes, the phase of the peak
    (True, True, 'backward')
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.adapters.callback import Adapters
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.callbacks.lean_optimizer.build import import_package
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.core.units import fmt_size
from lightning_lowmem.predict.analytic import analytic_phases, zero_states
from lightning_lowmem.predict.configs import causal_lm_factory, max_positions, resolve_config, shipped_shapes
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.fake import DryRunUnsupportedError
from lightning_lowmem.predict.result import MemoryEstimate
from lightning_lowmem.predict.run_config import load_run_config
from lightning_lowmem.predict.run_spec import LEAN_OPTIMIZERS, SHORTHANDS, RunSpec

PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
CHECKPOINTING = ("all", "every_n", "sqrt", "selective", None)
OPTIMIZERS = ("adamw", "adamw8bit", *LEAN_OPTIMIZERS)
ZERO_STAGES = (0, 2, 3)


def lean_extra_problem(optimizer: str, call: str) -> str | None:
    """Why the ``LeanOptimizer`` shorthand ``optimizer`` cannot run here (its package is missing: names the extra),
    or None (also for a shorthand that is no lean optimizer)."""
    if optimizer not in LEAN_OPTIMIZERS:
        return None
    try:
        import_package(LEAN_OPTIMIZERS[optimizer], call)
    except ModuleNotFoundError as err:
        return str(err)
    return None


def validate_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"Passed `{name}={value!r}`; expected one of {', '.join(repr(c) for c in choices)}.")


def estimate_memory(
    model_or_config: Any,
    batch_size: int | None = None,
    seq_len: int | None = None,
    *,
    strategy: Any = "auto",
    precision: str = "32-true",
    callbacks: Sequence[Any] = (),
    accumulate_grad_batches: int = 1,
    data: Any = None,
    target: Literal["cpu", "cuda"] | None = None,
    method: Literal["dry_run", "analytic"] = "dry_run",
    extrapolate: bool | None = None,
    offload: bool = False,
    offload_params: bool = False,
    checkpointing: Literal["all", "every_n", "sqrt", "selective"] | None = None,
    checkpointing_every_n: int = 2,
    activation_offload: bool = False,
    micro_batch_size: int | None = None,
    optimizer: Literal["adamw", "adamw8bit", "galore", "apollo", "apollo_mini", "adam_mini", "adamw4bit",
                       "torchao_adamw8bit"] | None = None,
    optimizer_in_backward: bool = False,
    zero_stage: Literal[0, 2, 3] = 0,
    world_size: int = 1,
    chunked_loss: int | None = None,
    adapters: Literal["lora", "dora"] | None = None,
    adapter_r: int | None = None,
    quantize_base: Literal["nf4", "fp4", "int8"] | None = None,
    disk: str | None = None,
    skip_above: int | None = None,
) -> MemoryEstimate:
    """Predict peak memory per phase, role and category of one run.

    Args:
        model_or_config: a LightningModule (or a callable building one; its own ``training_step`` and
            ``configure_optimizers`` run), a LightningCLI YAML path (``*.yaml``: model, data, trainer and callbacks
            as ``lowmem fit --config`` reads them), or a model shape: a shipped name (``gpt2``, ``gpt2-medium``,
            ``gpt2-large``, ``gpt2-xl``, ``opt-1.3b``, ``llama-7b``, ...), a ``config.json`` path, a model type, a dict
            or a ``transformers`` config (run with the demo ``CausalLMModule``'s causal-LM step).
        batch_size, seq_len: a causal-LM token batch (the effective batch with ``micro_batch_size``); for a module
            with ``data`` (or its own dataloader) leave them out.
        strategy, precision, callbacks, accumulate_grad_batches: what ``Trainer`` is given (names or objects).
        data: a LightningDataModule or dataloader for a module (its first batches).
        target: ``"cuda"`` applies the listed CPU-vs-GPU corrections; ``"cpu"`` predicts a CPU run as traced.
            Default: a YAML's ``trainer.accelerator`` (``auto``: CUDA where this machine has it, else the CPU);
            ``"cuda"`` for everything else. The result's ``target`` says which was used.
        method: ``"analytic"`` skips the trace (closed form only; 21 % low to 6 % high against the measured peaks of
            ``benchmarks/results/estimate.md``).
        extrapolate: see :func:`~lightning_lowmem.predict.dry_run.dry_run`.
        offload, offload_params, checkpointing, checkpointing_every_n, activation_offload, micro_batch_size: shorthands
            for ``OffloadStrategy`` (with ``offload_params=True``), ``ActivationCheckpointing``, ``ActivationOffload``
            and ``AccumulationScheduler``; not together with ``strategy``/``callbacks`` (nor are those below).
        optimizer, optimizer_in_backward, zero_stage, world_size, chunked_loss: shorthands for ``LowBitOptimizer``
            (``"adamw8bit"``: bitsandbytes') or ``LeanOptimizer(kind)`` at its defaults (the other names; no analytic
            fallback), ``OptimizerInBackward``, the ``lowmem_zero*`` presets, the number of processes and
            ``ChunkedLMLoss(chunk_tokens=)``.
        adapters, adapter_r, quantize_base: ``Adapters(adapters, r=adapter_r, quantize_base=quantize_base)`` (LoRA or
            DoRA on a frozen, optionally 4-/8-bit base; the callback's own code runs in the dry run); not together
            with ``strategy``/``callbacks``. The closed form does not model adapters: no analytic fallback.
        disk: a directory for the disk tier (``OffloadStrategy(disk=disk)``, with ``offload=True`` and
            ``optimizer_in_backward=True``): the fp32 masters and optimizer state predicted on the disk
            (``MemoryEstimate.peak_disk``), not in host RAM; the dry run creates no file there.
        skip_above: a device budget in bytes: a model shape whose model states alone (weights, optimizer state and,
            unless stepped in backward, gradients: exact per-parameter sizes in closed form) exceed it on the device
            is not traced; the result is the closed form, and ``fallback_reason`` says why.

    Raises:
        ValueError / TypeError: a bad argument (named, with the accepted values), or a combination the real run
            refuses (with the real run's message).
        ModuleNotFoundError: a lean ``optimizer`` whose package is not installed (names the extra to install).
    """
    validate_choice("precision", precision, PRECISIONS)
    validate_choice("checkpointing", checkpointing, CHECKPOINTING)
    validate_choice("optimizer", optimizer, (*OPTIMIZERS, None))
    if optimizer in LEAN_OPTIMIZERS:  # NOTE: a missing package said before anything is traced, naming the extra
        import_package(LEAN_OPTIMIZERS[optimizer], f"`optimizer={optimizer!r}`")
    validate_choice("zero_stage", zero_stage, ZERO_STAGES)
    validate_choice("target", target, ("cpu", "cuda", None))
    validate_choice("method", method, ("dry_run", "analytic"))
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"Passed `{name}={value!r}`; expected a positive integer.")
    if micro_batch_size is not None and (batch_size is None or not isinstance(micro_batch_size, int)
                                         or not 1 <= micro_batch_size <= batch_size or batch_size % micro_batch_size):
        raise ValueError(
            f"Passed `micro_batch_size={micro_batch_size!r}` with `batch_size={batch_size!r}`; expected a divisor "
            "of the batch size (AccumulationScheduler steps on whole micro-batches)."
        )
    flags = {"offload": offload, "offload_params": offload_params, "checkpointing": checkpointing,
             "activation_offload": activation_offload, "micro_batch_size": micro_batch_size, "optimizer": optimizer,
             "optimizer_in_backward": optimizer_in_backward, "zero_stage": zero_stage, "chunked_loss": chunked_loss,
             "adapters": adapters, "adapter_r": adapter_r, "quantize_base": quantize_base, "disk": disk}
    used = [k for k in SHORTHANDS if flags[k] not in (None, False, 0, "adamw")]
    if used and (strategy != "auto" or callbacks):
        raise ValueError(
            f"Passed the shorthand(s) {used} together with `strategy`/`callbacks`; describe the run one way: either "
            "the shorthands, or the Trainer's own `strategy=` and `callbacks=[...]`."
        )
    if zero_stage and optimizer_in_backward:
        raise ValueError("Passed `zero_stage` and `optimizer_in_backward=True`; DeepSpeed runs its own optimizer step.")
    if used:
        run = RunSpec.from_flags(precision=precision, checkpointing_every_n=checkpointing_every_n,
                                 batch_size=batch_size, world_size=world_size, **flags)
    else:
        run = RunSpec(strategy=strategy, precision=precision, callbacks=list(callbacks),
                      accumulate_grad_batches=accumulate_grad_batches, world_size=world_size)

    module, config = None, None
    source = "target=" if target is not None else "the default for a model without a Trainer"
    if isinstance(model_or_config, (str, Path)) and str(model_or_config).endswith((".yaml", ".yml")):
        if used or strategy != "auto" or callbacks:
            raise ValueError(f"Passed the YAML `{model_or_config}` with technique arguments; the YAML describes the run.")
        module, data, run = load_run_config(model_or_config)
        if target is None:
            target, source = run.target or "cuda", run.target_source or "the default"
    elif is_module(model_or_config):
        module = model_or_config
    elif (cls := module_class(model_or_config)) is not None:
        module = cls  # built on the meta device with no arguments, its own data unless a token batch is given
    else:
        config = resolve_config(model_or_config)
        if batch_size is None or seq_len is None:
            raise ValueError(f"Passed the model shape {model_or_config!r} without `batch_size` and `seq_len`.")
        positions = max_positions(config)
        if positions is not None and seq_len > positions and getattr(config, "model_type", "") in ("gpt2", "opt"):
            raise ValueError(f"Passed `seq_len={seq_len}`, beyond the {positions} positions of the model; "
                             f"use at most {positions} or set `n_positions`/`max_position_embeddings`.")
    target = target or "cuda"
    # NOTE: no closed-form fallback for an adapter run or a lean optimizer: it would be the full fine-tune's AdamW
    # figure under their name
    unmodelled = False
    for kind, what in ((Adapters, "adapters (a frozen base, adapters' gradients and state only)"),
                       (LeanOptimizer, "lean optimizers (AdamW's state only)")):
        found = next((c for c in run.callbacks if isinstance(c, kind)), None)
        unmodelled = unmodelled or found is not None
        if found is not None and method == "analytic":
            raise ValueError(f"Passed `method='analytic'` with `{found!r}`: the closed form does not model {what}; "
                             "use method='dry_run'.")
    if getattr(run.strategy, "disk", None) not in (None, False) or run.strategy_name == "lowmem_offload_disk":
        unmodelled = True  # NOTE: the closed form keeps the masters and optimizer state in host RAM
        if method == "analytic":
            raise ValueError("Passed `method='analytic'` with the disk tier: the closed form does not model it (it "
                             "puts the masters and optimizer state in host RAM); use method='dry_run'.")
    bound = None if config is None or unmodelled else _analytic_bound(
        config, batch_size, micro_batch_size, seq_len, run, target)
    fallback = est = None
    floor = None if bound is None or skip_above is None else _states_floor(bound, run)
    if floor is not None and floor > skip_above:  # type: ignore[operator]
        method, fallback = "analytic", (f"not traced: the model states alone need {fmt_size(floor)} on the device "
                                        f"(closed form), more than the budget of {fmt_size(skip_above)}")
    if method == "dry_run":
        try:
            factory = module if module is not None else causal_lm_factory(config)
        except ValueError as err:
            factory, fallback = None, str(err)
        if factory is not None:
            tokens = {"batch_size": batch_size, "seq_len": seq_len} if config is not None or (
                data is None and batch_size and seq_len) else {}
            try:
                est = dry_run(factory, data, run=run, target=target, extrapolate=extrapolate, **tokens)
            except DryRunUnsupportedError as err:
                if bound is None:
                    raise
                fallback = str(err)
    if est is None:
        if bound is None:
            raise ValueError(f"Cannot estimate this model: {fallback or 'no trace and no transformer config'}.")
        est = MemoryEstimate(phases=bound[0], method="analytic", target=target, num_params=bound[1],
                             fallback_reason=fallback, run=run.describe(),
                             notes=["closed form (analytic.py): no trace; 21 % low to 6 % high on the benchmarked HF models"])
    est.target_source = source
    if bound is not None:
        est.analytic_bound = {phase: bd.total("device") for phase, bd in bound[0].items()}
        est.analytic_bound["peak"] = max(est.analytic_bound.values())
    return est


def module_class(name: Any, given: str = "model=") -> Any:
    """The LightningModule class a dotted path such as ``my_project.models.MyModule`` names; None for what is no
    class path (a shape name, a ``config.json`` path, a model type, a ``transformers`` config class).

    Raises:
        ValueError: a class path whose module does not import, or that names no LightningModule: what was given
            (as ``given``: ``"model="`` or ``"--model "``), what failed and what to do.
    """
    from transformers import PretrainedConfig

    if not isinstance(name, str) or "." not in name or not all(p.isidentifier() for p in name.split(".")):
        return None
    module_name, _, attr = name.rpartition(".")
    call = f"`{given}{name!r}`" if given.endswith("=") else f"`{given}{name}`"
    try:
        cls = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as err:
        raise ValueError(
            f"Passed {call}, a LightningModule class path, but importing `{module_name}` failed ({type(err).__name__}: "
            f"{err}). A class path is imported from the current directory ({os.getcwd()}) and the installed packages: "
            f"run from the folder that holds `{module_name.split('.')[0]}`, or fix its import; a model shape is a "
            f"shipped name ({', '.join(shipped_shapes())}), a config.json path or a model type (e.g. llama)."
        ) from None
    if isinstance(cls, type) and issubclass(cls, L.LightningModule):
        return cls
    if isinstance(cls, type) and issubclass(cls, PretrainedConfig):
        return None  # NOTE: `transformers.GPT2Config`: a model shape (`resolve_config`)
    found = "nothing" if cls is None else f"a {type(cls).__name__}" if not isinstance(cls, type) else f"class {cls.__name__}"
    raise ValueError(f"Passed {call}: `{module_name}.{attr}` is {found}, not a LightningModule subclass; give the class "
                     f"path of your LightningModule (e.g. `{module_name}.MyModule`), or a model shape.")


def is_module(obj: Any) -> bool:
    return isinstance(obj, L.LightningModule) or (
        callable(obj) and not isinstance(obj, (str, Path, dict)) and not hasattr(obj, "model_type")
    )


def _analytic_bound(config: Any, batch_size: int | None, micro: int | None, seq_len: int | None, run: RunSpec,
                    target: str) -> tuple[dict, int | None] | None:
    """The closed-form bound of a transformer config, with exact parameter counts from a meta model."""
    if batch_size is None or seq_len is None:
        return None
    num_params = largest = None
    try:
        unique = {id(p): p for p in causal_lm_factory(config)().model.parameters()}.values()
        num_params = sum(p.numel() for p in unique)
        largest = max(p.numel() for p in unique)
    except Exception:  # noqa: BLE001, S110  NOTE: any architecture transformers cannot build: closed-form counts
        pass
    ckpt = next((c for c in reversed(run.callbacks) if isinstance(c, ActivationCheckpointing)), None)
    low_bit = any(isinstance(c, LowBitOptimizer) for c in run.callbacks)
    zero = run.zero()
    precision = run.precision
    if zero is not None:
        precision = {"bf16-mixed": "bf16-true", "16-mixed": "16-true"}.get(precision, precision)
    try:
        phases = analytic_phases(
            config, micro or batch_size, seq_len, precision=precision, optimizer="adamw8bit" if low_bit else "adamw",
            checkpointing=getattr(ckpt, "policy", None) if ckpt is not None else None,
            checkpointing_every_n=getattr(ckpt, "n", None) or 2, num_params=num_params, largest_param=largest,
            flash_attention=True if target == "cuda" else None,
            offload="offload" in run.strategy_name and zero is None,
        )
    except ValueError:
        return None
    return phases, num_params


def _states_floor(bound: tuple[dict, int | None], run: RunSpec) -> int | None:
    """Device bytes of the model states alone at the optimizer step, in closed form: weights, optimizer state and
    the gradients (not when stepped in backward), DeepSpeed's partitioned ones for ZeRO; None where the closed form
    does not say (streamed parameters)."""
    if run.strategy_name == "lowmem_offload_params" or getattr(run.strategy, "offload_params", False):
        return None
    est = MemoryEstimate(phases=copy.deepcopy(bound[0]), method="analytic", num_params=bound[1])
    zero = run.zero()
    if zero is not None:
        if bound[1] is None:
            return None
        zero_states(est, zero, precision=run.precision, gathered_params=None)
    device = est.phases["optimizer"].device
    in_backward = any(isinstance(c, OptimizerInBackward) for c in run.callbacks)
    return device["weights"] + device["optimizer_state"] + (0 if in_backward else device["gradients"])


COMBINATIONS: list[tuple[str, dict[str, Any]]] = [
    ("fp32 AdamW (baseline)", {}),
    ("bf16-mixed", {"precision": "bf16-mixed"}),
    ("bf16-true", {"precision": "bf16-true"}),
    ("bf16-true + ckpt(all)", {"precision": "bf16-true", "checkpointing": "all"}),
    ("bf16-true + ckpt(all) + 8-bit AdamW", {"precision": "bf16-true", "checkpointing": "all",
                                             "optimizer": "adamw8bit"}),
    ("offload + ckpt(all)", {"precision": "bf16-true", "offload": True, "checkpointing": "all"}),
    ("offload + ckpt(all) + 8-bit AdamW", {"precision": "bf16-true", "offload": True, "checkpointing": "all",
                                           "optimizer": "adamw8bit"}),
    ("offload + ckpt(all) + act. offload", {"precision": "bf16-true", "offload": True, "checkpointing": "all",
                                            "activation_offload": True}),
    ("offload + ckpt(all) + act. offload + chunked loss", {"precision": "bf16-true", "offload": True,
                                                            "checkpointing": "all", "activation_offload": True,
                                                            "chunked_loss": 128}),
    ("offload params + ckpt(all) + act. offload + chunked loss", {"precision": "bf16-true", "offload": True,
                                                                   "offload_params": True, "checkpointing": "all",
                                                                   "activation_offload": True, "chunked_loss": 128}),
    ("bf16-true + ckpt(all) + opt-in-bwd", {"precision": "bf16-true", "checkpointing": "all",
                                            "optimizer_in_backward": True}),
    ("ZeRO-2", {"precision": "bf16-mixed", "zero_stage": 2}),
    ("ZeRO-3 + offload", {"precision": "bf16-mixed", "zero_stage": 3, "offload": True}),
]


__all__ = ["COMBINATIONS", "MemoryEstimate", "estimate_memory", "is_module", "lean_extra_problem", "module_class",
           "validate_choice"]
