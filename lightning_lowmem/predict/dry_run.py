"""The dry run: a real ``Trainer.fit`` of the user's module and data in which every weight is a fake tensor.

:func:`dry_run` runs a :class:`~lightning_lowmem.predict.run_spec.RunSpec` for two optimizer steps on fake parameters
(:mod:`lightning_lowmem.predict.fake`), measured by ``MemoryReport``'s recorder; how ZeRO, a CUDA target and deep
models are handled: ``docs/estimate.md``.

Example (GPT-2 XL's shape is ``n_layer=48, n_embd=1600, n_head=25``: the same call, about 10 s):

    >>> from lightning_lowmem import ActivationCheckpointing, dry_run
    >>> from lightning_lowmem.demo.module import CausalLMModule
    >>> est = dry_run(lambda: CausalLMModule(config={"n_layer": 2, "n_embd": 32, "n_head": 2}),
    ...               batch_size=2, seq_len=32, strategy="lowmem_offload", precision="bf16-true",
    ...               callbacks=[ActivationCheckpointing("all")])
    >>> est.peak_device > 0, est.peak_host > 0, est.binding_phase
    (True, True, 'backward')
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning_utilities import apply_to_collection
from typing_extensions import override

from lightning_lowmem._registry import STRATEGIES
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.core.accounting import CATEGORIES, ROLES, MemoryBreakdown
from lightning_lowmem.measure.recorder import PHASES, StepMemoryRecorder
from lightning_lowmem.predict.analytic import zero_states
from lightning_lowmem.predict.cuda_target import CudaOptimizerDefaults, cuda_corrections
from lightning_lowmem.predict.depth import (
    AGREEMENT,
    DepthWindows,
    depth_unit,
    disagreement,
    event_values,
    events,
    find_blocks,
    keep_every_layer,
    line,
    non_negative,
    phases_of,
    values_of,
)
from lightning_lowmem.predict.fake import DryRunUnsupportedError, FakeExecution, fake_copy, fake_execution
from lightning_lowmem.predict.result import MemoryEstimate
from lightning_lowmem.predict.run_spec import RunSpec, ZeroPlan


class _Repeat:
    """A loader that yields a copy of one batch ``n`` times (Lightning iterates any sized iterable).

    NOTE: copies, as a real loader makes new tensors for every batch: Lightning fetches the next batch before it
    runs the current one, so two batches are alive during a step.
    """

    def __init__(self, batch: Any, n: int = 10_000) -> None:
        self.batch, self.n = batch, n

    def __iter__(self) -> Iterator[Any]:
        return (apply_to_collection(self.batch, torch.Tensor, torch.clone) for _ in range(self.n))

    def __len__(self) -> int:
        return self.n


class _TokenBatches(L.LightningDataModule):
    """Causal-LM token batches whose ``batch_size`` an ``AccumulationScheduler`` sets, as it would yours."""

    def __init__(self, batch_size: int, seq_len: int) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len

    @override
    def train_dataloader(self) -> _Repeat:
        ids = torch.zeros(self.batch_size, self.seq_len, dtype=torch.long)
        return _Repeat({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})


@contextlib.contextmanager
def _data_kept(kwargs: dict[str, Any]) -> Iterator[None]:
    """Put back the micro-batch an ``AccumulationScheduler`` sets on the user's data module, and its ``trainer``.

    NOTE: otherwise the next trace of the same data module (a planner traces many) starts from this one's micro-batch.
    """
    dm = kwargs.get("datamodule")
    saved = {k: v for k, v in vars(dm).items() if k in ("batch_size", "trainer", "_trainer")} if dm is not None else {}
    try:
        yield
    finally:
        if dm is not None:
            vars(dm).update(saved)


def _fit_data(data: Any, batch: Any) -> dict[str, Any]:
    if batch is not None:
        return {"train_dataloaders": _Repeat(batch)}
    if data is None:
        return {}
    if isinstance(data, L.LightningDataModule):
        return {"datamodule": data}
    return {"train_dataloaders": data}


class _StopAfter(L.Callback):
    """Ends the fit after ``steps`` optimizer-step windows (a GAN's batch steps two optimizers: one window)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.windows, self.last = steps, 0, 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.last:
            self.windows, self.last = self.windows + 1, trainer.global_step
        if self.windows >= self.steps:
            trainer.should_stop = True


class _StepBracket(L.Callback):
    """Tells the fake execution when a training step runs (large all-real outputs stay fake there); refuses an
    optimizer whose memory follows the loss values (``LBFGS``)."""

    def __init__(self, fx: FakeExecution) -> None:
        self.fx = fx

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        for opt in trainer.optimizers:
            if isinstance(getattr(opt, "optimizer", opt), torch.optim.LBFGS):
                # NOTE: with stand-in losses its line search stops after one iteration and keeps no history: the
                # prediction was 73 % low on an MLP (a history of up to `history_size` x 2 flat parameter copies)
                code = type(pl_module).configure_optimizers.__code__
                raise DryRunUnsupportedError(
                    "torch.optim.LBFGS",
                    "its iterations per step and its history (up to `history_size` pairs of parameter-sized "
                    "tensors) depend on the loss values, which a dry run does not have",
                    f"{code.co_filename}:{code.co_firstlineno} (configure_optimizers)")

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self.fx.in_step = True

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        # NOTE: Lightning's teardown moves the module next: torch swaps a fake parameter's `.grad`, refused if weakly held
        for p in pl_module.parameters():
            p.grad = None

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.fx.in_step = False


def _trainer(spec: RunSpec, extra: list[Any], root: str, zero: ZeroPlan | None) -> L.Trainer:
    kwargs = spec.trainer_kwargs()
    if zero is not None:
        kwargs["strategy"] = "auto"
        kwargs["precision"] = {"bf16-mixed": "bf16-true", "16-mixed": "16-true"}.get(spec.precision, spec.precision)
    strategy = kwargs["strategy"]
    if isinstance(strategy, str) and zero is None and strategy.lower() in STRATEGIES:
        kwargs["strategy"] = strategy = StrategyRegistry.get(strategy.lower())  # NOTE: so its host check can be off
    if hasattr(strategy, "check_host_memory"):
        # NOTE: the run being predicted is not this machine's: its host RAM is reported, not checked
        strategy.check_host_memory = False
    return L.Trainer(
        accelerator="cpu", devices=1, **{**kwargs, "callbacks": [*kwargs["callbacks"], *extra]},
        max_steps=-1, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        # NOTE: `self.log` does nothing in barebones mode (see predict/fake.py), and nothing else a step does changes
        barebones=True,
    )


def _check_zero(spec: RunSpec, module: Any) -> None:
    """Run every callback's own checks against the real ZeRO strategy, without starting DeepSpeed."""
    kwargs = spec.trainer_kwargs()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **kwargs)
    for callback in trainer.callbacks:
        if hasattr(callback, "_init_args"):  # the suite's techniques
            callback.setup(trainer, module, "fit")
            callback.teardown(trainer, module, "fit")


def _trace(
    build: Callable[[FakeExecution], torch.nn.Module],
    spec: RunSpec,
    data: Callable[[], dict[str, Any]],
    *,
    steps: int,
    target: str,
    counts: dict[str, Any],
    stand_ins: dict[str, int],
    found: list[Any],
    windows: bool = False,
) -> list[dict[str, Any]]:
    """One fake ``Trainer.fit``; returns the recorder's per-step records (with ``windows``: per part of each phase).

    ``found`` is set to ``[notes, bounds]`` of the fake execution (kernel corrections, data-dependent bounds).
    """
    recorder = StepMemoryRecorder(every_n_steps=1, bool_masks=target == "cuda")
    zero = spec.zero()
    with tempfile.TemporaryDirectory(prefix="lowmem-dry-run-") as root, _forked_rng(), fake_execution() as fx:
        module = build(fx)
        if zero is not None:
            _check_zero(spec, module)
        extra: list[Any] = [_StepBracket(fx), recorder, *([DepthWindows(recorder)] if windows else []),
                            _StopAfter(steps)]
        if target == "cuda":
            extra.insert(0, CudaOptimizerDefaults(counts))
        trainer = _trainer(spec, extra, root, zero)
        fit_data = data()
        with _data_kept(fit_data):
            trainer.fit(module, **fit_data)
        counts["dropout_mask_elements"] += recorder.mask_elements
        counts["sdpa_math"] = fx.sdpa_math
        for key, n in fx.stand_ins.items():
            stand_ins[key] = stand_ins.get(key, 0) + n
        found[:] = [fx.notes(), [{"op": op, "where": where, "assumption": a, "calls": n}
                                 for (op, where, a), n in fx.data_dependent.bounds.items()]]
    if not recorder.steps or not any(r["phases"].get("backward") for r in recorder.steps):
        raise RuntimeError(
            "The dry run traced no backward pass: `training_step` returned None (a skipped batch) or the run stopped "
            "before its first optimizer step. A data-dependent check on a value computed from the weights (e.g. "
            "`if not loss < 1e6: return None`) sees a stand-in value (a comparison: False) in a dry run; compute "
            "such checks from the batch, or with `torch.isfinite`/`torch.isnan` (answered as in a healthy run)."
        )
    return recorder.steps


def dry_run(
    module: Any,
    data: Any = None,
    *,
    batch: Any = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    run: RunSpec | None = None,
    strategy: Any = "auto",
    precision: str = "32-true",
    callbacks: Sequence[Any] = (),
    accumulate_grad_batches: int = 1,
    target: Literal["cpu", "cuda"] = "cpu",
    extrapolate: bool | None = None,
    steps: int = 2,
    upcast_half: bool = False,
) -> MemoryEstimate:
    """Predict the memory of training ``module`` by running the real ``Trainer.fit`` on fake tensors.

    Args:
        module: a LightningModule (a fake copy is run; yours is never touched), or a callable returning one
            (a class, a lambda): it is built on the ``meta`` device, so a model far larger than this machine
            costs nothing.
        data: a LightningDataModule or a train dataloader (its first batches are used, whatever their
            structure). Default: the module's own ``train_dataloader``.
        batch: one batch, fed at every step (instead of ``data``).
        batch_size, seq_len: a causal-LM batch of token ids (``input_ids``, ``attention_mask``, ``labels``),
            from a data module whose ``batch_size`` an ``AccumulationScheduler`` sets, as it would yours.
        run: the run to predict (:class:`~lightning_lowmem.predict.run_spec.RunSpec`); or give its parts:
        strategy, precision, callbacks, accumulate_grad_batches: what ``Trainer`` accepts (registered names such as
            ``"lowmem_offload"``, strategy and callback objects: unused ones are copied, never run themselves).
        target: ``"cpu"`` predicts the traced run as is; ``"cuda"`` applies the CPU-vs-CUDA differences, each listed
            in ``result.corrections`` (uncalibrated: no GPU run yet).
        extrapolate: trace 3, 4 and 5 repeated blocks (per checkpointing unit) and extrapolate when the third depth
            confirms the line (within 0.01 %), else trace every block (noted). ``None``: try it for models of more
            than 8 units whose techniques repeat per block. ``False``: always trace every block.
        steps: optimizer steps traced (2: the first creates the optimizer state, the second is steady state).
        upcast_half: give bf16/fp16 floating parameters fp32 fakes (the module as built, before a
            half-precision plugin converted it).

    Returns:
        A :class:`~lightning_lowmem.predict.result.MemoryEstimate` (per phase, role and category; per step).

    Raises:
        DryRunUnsupportedError: an op cannot run on fake tensors (the op and the model's line are named).
        ValueError / TypeError: bad arguments, or a combination the real run refuses (with its own message).
    """
    if run is None:
        run = RunSpec(strategy=strategy, precision=precision, callbacks=list(callbacks),
                      accumulate_grad_batches=accumulate_grad_batches)
    if target not in ("cpu", "cuda"):
        raise ValueError(f"Passed `target={target!r}`; expected 'cpu' or 'cuda'.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Passed `steps={steps!r}`; expected a positive integer.")
    token_data = None
    if batch is None and data is None and (batch_size or seq_len):
        if not (batch_size and seq_len):
            raise ValueError(f"Passed `batch_size={batch_size!r}`, `seq_len={seq_len!r}`; a token batch needs both.")
        token_data = (batch_size, seq_len)
    is_factory = callable(module) and not isinstance(module, torch.nn.Module)
    if not is_factory and not isinstance(module, L.LightningModule):
        raise TypeError(
            f"Passed `module` of type {type(module).__name__}; expected a LightningModule or a callable returning one."
        )

    dropped: set[str] = set()
    if is_factory:
        with torch.device("meta"):
            module = module()  # NOTE: built once, on the meta device; every trace runs a fake copy of it

    def build(keep: int | None) -> Callable[[FakeExecution], torch.nn.Module]:
        def make(fx: FakeExecution) -> torch.nn.Module:
            copy = fake_copy(module, fx, upcast_half, blocks=keep)
            # NOTE: a module that went through a fit keeps its checkpointed blocks; the run decides its own policy
            ActivationCheckpointing.remove(copy)
            dropped.update(keep_every_layer(copy))
            return copy

        return make

    def data_kwargs() -> dict[str, Any]:
        if token_data is not None:
            return {"datamodule": _TokenBatches(*token_data)}
        return _fit_data(data, batch)

    counts: dict[str, Any] = {"dropout_mask_elements": 0, "sdpa_math": (0, 0), "foreach_groups": 0}
    stand_ins: dict[str, int] = {}
    notes = list(run.notes)
    t0 = time.perf_counter()
    found = find_blocks(module)
    num_blocks = len(found[2]) if found else None
    unique = {id(p): p for p in module.parameters()}.values()
    numels = [int(getattr(p, "ds_numel", p.numel())) for p in unique if p.requires_grad]
    frozen = [int(getattr(p, "ds_numel", p.numel())) for p in unique if not p.requires_grad]
    num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in unique)
    del unique
    unit = depth_unit(run)
    can = num_blocks is not None and unit is not None and num_blocks > 5 * unit
    if extrapolate is None:
        extrapolate = can and num_blocks > 8 * unit  # type: ignore[operator]
    elif extrapolate and not can:
        raise ValueError(
            f"Passed `extrapolate=True`, but the model has {num_blocks or 'no'} repeated blocks and the run's "
            "techniques need " + ("a depth-linear checkpointing policy ('all', 'every_n', 'selective')"
                                  if unit is None else f"more than {5 * unit} of them") + "; use extrapolate=False."
        )
    found: list[Any] = [[], []]
    kw = {"steps": steps, "target": target, "counts": counts, "stand_ins": stand_ins, "found": found}
    values = None
    traced_steps: list[dict[str, Any]] = []
    if extrapolate:
        # NOTE: from 3 blocks: with 2, a prefetch of 2 restores (activation offload) spans the whole model
        depths = (3 * unit, 4 * unit, 5 * unit)  # type: ignore[operator]
        traces = [_trace(build(d), run, data_kwargs, windows=True, **kw) for d in depths]
        va, vb, vc = (values_of(t, windows=True) for t in traces)
        by_event, miss = event_values(*(events(t) for t in traces), depths, num_blocks)  # type: ignore[arg-type]
        if miss is None:
            miss = disagreement(line(va, vb, depths[0], depths[1], depths[2]), vc)
        if miss is None:
            at_depth = line(vb, vc, depths[1], depths[2], num_blocks)  # type: ignore[arg-type]
            values = phases_of({**at_depth, **by_event})
            notes.append(f"traced {depths[0]}, {depths[1]} and {depths[2]} of {num_blocks} blocks; the third depth "
                         f"confirmed the line (within {AGREEMENT:.2%}): extrapolated per part of each phase (before, "
                         "in and after the blocks), role and category")
        else:
            notes.append(f"extrapolation refused (depth {depths[2]} misses the line by {miss[1]:+,} B at {miss[0]}): "
                         "traced every block")
    if values is None:
        traced_steps = _trace(build(None), run, data_kwargs, **kw)
        values = values_of(traced_steps)
        if not extrapolate:
            notes.append(f"traced all {num_blocks or 'the'} blocks")
    if dropped:
        notes.append(f"LayerDrop turned off ({', '.join(sorted(dropped))}): the prediction is of a step that skips no "
                     "layer, the largest")
    if stand_ins:
        notes.append("data-dependent reads of fake values answered with stand-ins: "
                     + ", ".join(f"{k} ({n}x)" for k, n in sorted(stand_ins.items())))
    notes.extend(found[0])
    phases = {}
    for phase in PHASES:
        bd = MemoryBreakdown()
        for role in ROLES:
            for cat, nbytes in non_negative([values[(phase, role, c)] for c in CATEGORIES]).items():
                bd.add(role, cat, nbytes)  # type: ignore[arg-type]
        phases[phase] = bd
    # NOTE: LayerDrop's draws size the step as a data-dependent op does: the prediction is their upper bound, stated
    # (a skipped layer's parameters get no gradient, and AdamW no state for them until they do: HuBERT 6 % lower)
    bounds = found[1] + ([{"op": "LayerDrop", "where": ", ".join(sorted(dropped)), "calls": 1,
                           "assumption": "no layer skipped (the largest step)"}] if dropped else [])
    estimate = MemoryEstimate(phases=phases, method="dry_run", target=target, notes=notes, num_params=num_params,
                              run=run.describe(), steps=traced_steps, bounds=bounds)
    zero = run.zero()
    if zero is not None:
        zero_states(estimate, zero, precision=run.precision, gathered_params=_largest_block_params(module),
                    numels=numels, frozen=frozen)
    if target == "cuda":
        estimate.corrections = cuda_corrections(counts, estimate, run, numels, extrapolate and not traced_steps)
    estimate.wall_s = time.perf_counter() - t0
    return estimate


def _largest_block_params(module: Any) -> int | None:
    """Parameters of the largest repeated block or embedding (what ZeRO-3 offload gathers at once)."""
    found = find_blocks(module)
    sizes = [sum(p.numel() for p in found[2][0].parameters())] if found else []
    sizes += [e.weight.numel() for e in module.modules() if isinstance(e, torch.nn.Embedding)]
    return max(sizes) if sizes else None


@contextlib.contextmanager
def _forked_rng() -> Iterator[None]:
    """The global random generators (torch's CPU and CUDA ones, Python's, NumPy's) put back on exit.

    NOTE: a dry run executes the module's forward; a draw whose value it reads (Hugging Face's LayerDrop:
    `torch.rand([]) < p`) advances them, and training after a prediction (``lowmem_auto``) would see other numbers.
    """
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


__all__ = ["DryRunUnsupportedError", "dry_run", "find_blocks"]
