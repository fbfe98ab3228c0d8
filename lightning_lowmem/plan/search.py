"""``plan``: the fastest recipe of the suite that fits a device (and host) memory budget (docs/planner.md).

Candidates are priced by the cost model, then dry-run fastest first until one fits. A base's floors are traced
first (a base whose floors do not fit is out), and a candidate that saves no more than one too big, or whose trace
at another micro-batch scales over 110 % of the budget, is not traced.

Example (a tiny GPT-2 shape here, planned in seconds; ``"gpt2-xl"`` and the other shipped names take a minute):

    >>> from lightning_lowmem.plan import plan
    >>> p = plan({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}, batch_size=2, seq_len=32,
    ...          device_memory="12GB", host_memory="64GB", hardware="rtx3060-12gb")
    >>> print(p.table())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    recipe  verdict  device peak  host peak  step time  why
    *  ...  fits ...
    >>> trainer = L.Trainer(**p.run.trainer_kwargs(), max_steps=1000)
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from lightning_lowmem._internals import frames
from lightning_lowmem.core.optional import package_available
from lightning_lowmem.core.reproducible import fresh
from lightning_lowmem.core.units import fmt_size, parse_bytes
from lightning_lowmem.plan.cost import step_cost
from lightning_lowmem.plan.hardware import PROFILES, HardwareProfile, load_profile
from lightning_lowmem.plan.recipes import (
    DISK,
    FULL_FINE_TUNE,
    AdapterVariant,
    adapter_variants,
    candidates,
    disk_problems,
    optimizer_choices,
    technique_field,
)
from lightning_lowmem.plan.result import Plan, Row
from lightning_lowmem.plan.source import Source, effective_batch
from lightning_lowmem.predict.fake import DryRunUnsupportedError
from lightning_lowmem.predict.run_spec import RunSpec


class NoRecipeFitsError(ValueError):
    """No recipe of the suite fits the budgets; the message says the smallest memory any recipe needs."""


def plan(
    model: Any,
    batch_size: int | None = None,
    seq_len: int | None = None,
    *,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    hardware: str | dict[str, Any] | HardwareProfile | None = None,
    data: Any = None,
    pure_half: bool = False,
    fixed_callbacks: Sequence[Any] = (),
    bases: Sequence[str] | None = None,
    target: Literal["cpu", "cuda"] | None = None,
    cache: dict[Any, Any] | None = None,
    adapters: str | Sequence[str] = ("none",),
    quantize_base: str | Sequence[str] = ("none",),
    adapter_r: int = 16,
    optimizers: str | Sequence[str] = ("adamw",),
    progress: Callable[[str], None] | None = None,
    disk_dir: str | os.PathLike | None = None,
    disk_budget: int | str | None = None,
) -> Plan:
    """Choose the fastest recipe whose predicted device peak fits ``device_memory`` (and host peak ``host_memory``).

    Args:
        model: a shipped shape name / config (the demo causal-LM step, with ``batch_size`` and ``seq_len``), a
            LightningModule or a callable building one (with ``data``, or its own dataloader), or a LightningCLI
            YAML path (its model and data; the YAML's own techniques are replaced by the plan's).
        batch_size: the effective batch (samples per optimizer step); default: a YAML's effective batch, or the
            data's ``batch_size``.
        device_memory: bytes or a size (``"12GB"``); default: the hardware profile's memory.
        host_memory: bytes or a size; default: no host check (the host peak is still reported).
        hardware: a profile name (see ``lightning_lowmem.plan.PROFILES``), ``"measure"``, a YAML path or a dict;
            default: ``"measure"`` (this machine's rates) for a CPU target, the ``rtx3060-12gb`` rates for CUDA.
        pure_half: also consider half weights without fp32 masters (``bf16-true``: numerics change).
        fixed_callbacks: technique callbacks the run keeps whatever the plan (``lowmem_auto``: the user's own);
            every candidate is traced with them, and none adds a technique of the same kind.
        bases: consider only these bases (``lightning_lowmem.plan.recipes.BASES``); default: all but ``"half"``.
        target: the device predicted, as ``estimate_memory``'s: default a YAML's ``trainer.accelerator``, else
            ``"cuda"``; the plan's notes say which.
        cache: a dict reused across calls: dry runs keyed by model (a shape's config; a module and data object by
            identity), batch and recipe are not repeated.
        adapters, quantize_base, adapter_r: the trainings you allow, in order of preference (docs/planner.md):
            ``adapters`` of ``"none"`` (the full fine-tune, the default alone), ``"lora"``, ``"dora"``, each on each
            base of ``quantize_base`` (``"none"``, ``"nf4"``, ``"fp4"``, ``"int8"``) at rank ``adapter_r``; a training
            is planned only when none listed before it fits. A run's own ``Adapters`` callback is kept.
        optimizers: the optimizers you allow, in order of preference, as ``adapters`` are: ``"adamw"`` (the module's
            own, the default alone), ``"adamw8bit"`` (``LowBitOptimizer``) and ``LeanOptimizer`` kinds
            (``"galore"``, ``"apollo"``, ...); a kind whose package is missing is refused up front.
        progress: called with one line after each dry run (the candidate, its verdict, its time), as it comes.
        disk_dir: an existing directory on a local disk for the disk tier (``OffloadStrategy(disk=...)``: the fp32
            masters and optimizer state in files, stepped in backward): its bases are candidates, ranked after every
            other base (slower: they read and write the disk each step), so chosen only where nothing else fits. The
            dry run creates no file there. Without it, a refusal for the host budget says what the disk tier needs.
        disk_budget: with ``disk_dir``, bytes or a size (``"2TB"``) for the disk tier's predicted bytes
            (``MemoryEstimate.peak_disk``); default: not checked (the strategy checks the free space at setup).

    Raises:
        NoRecipeFitsError: no recipe fits; says the smallest device (and host) memory any recipe needs and what
            to change.
        ValueError: bad arguments (all named at once, with what is accepted); TypeError when one is of a wrong type.
    """
    t0 = time.perf_counter()
    budgets = Budgets.of(model, batch_size, seq_len, data, device_memory, host_memory, hardware, target,
                         (adapters, quantize_base, adapter_r, fixed_callbacks, optimizers), disk_dir, disk_budget)
    source, b = budgets.source, budgets.source.batch_size
    keep_deepspeed = not fixed_callbacks
    fixed_callbacks = [*fixed_callbacks, *source.fixed_callbacks]  # a YAML's own Adapters: its training stays
    fixed = frozenset(f for f in map(technique_field, fixed_callbacks) if f is not None)
    rows = candidate_rows(source, budgets.profile, budgets.half, fixed, pure_half=pure_half, bases=bases,
                          keep_deepspeed=keep_deepspeed, adapters=budgets.adapters, adapter_r=adapter_r,
                          optimizers=budgets.optimizers, disk_dir=budgets.disk_dir)
    # NOTE: a user's own AccumulationScheduler sets the loader's batch itself
    loader = None if "micro_batch_size" in fixed else source.loader_batch
    judge = Judge(source, budgets, fixed_callbacks, fixed, loader, budgets.target, {} if cache is None else cache,
                  progress)
    rows_floors = floors(rows)
    # NOTE: the trainings (adapter variant, optimizer) in the order listed: another training is a preference, not a
    # speed-up, so the next one is planned only when no recipe of the one before fits
    trainings = list(dict.fromkeys((r.recipe.adapters, r.recipe.quantize_base, r.recipe.optimizer) for r in rows))
    trainings.sort(key=lambda v: (budgets.adapters.index(v[:2]) if v[:2] in budgets.adapters else -1,
                                  budgets.optimizers.index(v[2]) if v[2] in budgets.optimizers else -1))
    chosen, names = None, []
    for training in trainings:
        own = [r for r in rows if (r.recipe.adapters, r.recipe.quantize_base, r.recipe.optimizer) == training]
        names.append(own[0].recipe.training_name)
        chosen = search(own, [f for f in rows_floors if any(f is r for r in own)], judge)
        if chosen is not None:
            break
    if chosen is None:
        hint = []
        if budgets.disk_dir is None and any(
                r.status == "too big" and (r.peak_device or 0) <= budgets.device for r in rows_floors):
            # NOTE: the host budget is what fails: the disk bases' floors, traced with a stand-in directory (the dry
            # run makes no file), say what the disk tier would need
            hint = floors(candidate_rows(source, budgets.profile, budgets.half, fixed, pure_half=False, bases=DISK,
                                         keep_deepspeed=False, adapters=budgets.adapters, adapter_r=adapter_r,
                                         optimizers=budgets.optimizers, disk_dir=tempfile.gettempdir()))
            for row in hint:
                judge(row)
        raise NoRecipeFitsError(_no_fit_message(rows_floors, budgets, source, hint))
    notes = [(f"{judge.traces} dry runs ({budgets.target} target, from {budgets.target_source}), {len(rows)} "
              "candidates"), *source.notes]
    kept = next((c for c in fixed_callbacks if technique_field(c) == "adapters"), None)
    if kept is not None:
        notes.append(f"training: the run's own `{kept!r}`")
    else:
        unplanned = [r.recipe.training_name for r in rows if r.recipe.training_name not in names]
        notes.append(f"trainings, in the order allowed: {', '.join(dict.fromkeys([*names, *unplanned]))}; chosen: "
                     f"{chosen.recipe.training_name}" + (f" (no recipe of {', '.join(names[:-1])} fits)"
                                                        if len(names) > 1 else ""))
    return Plan(rows, chosen, budgets.device, budgets.host, budgets.profile, b, budgets.half, judge.traces,
                time.perf_counter() - t0, notes, source.yaml_parts, loader, source.scheduler, budgets.disk)


@dataclass
class Budgets:
    """The checked arguments of :func:`plan`: the planned source, the hardware profile and the memory budgets."""

    source: Source
    profile: HardwareProfile
    device: int
    host: int | None
    #: the adapter variants the user allows (``(kind, quantized base)``, ``(None, None)``: the full fine-tune)
    adapters: tuple[AdapterVariant, ...] = (FULL_FINE_TUNE,)
    #: the optimizers the user allows, in order (None: the module's own; else ``"adamw8bit"`` or a lean one)
    optimizers: tuple[str | None, ...] = (None,)
    #: the device predicted, and why that one
    target: str = "cuda"
    target_source: str = "the default for a model without a Trainer"
    #: the disk tier's directory (the disk bases are candidates only with one) and the budget of its bytes
    disk_dir: str | None = None
    disk: int | None = None

    @property
    def half(self) -> str:
        """The half precision of the device: ``"bf16"`` where it has bf16, else ``"16"``."""
        return "bf16" if self.profile.bf16 else "16"

    @classmethod
    def of(cls, model: Any, batch_size: int | None, seq_len: int | None, data: Any, device_memory: int | str | None,
           host_memory: int | str | None, hardware: Any, target: str, trainings: tuple[Any, ...] = (("none",), ("none",),
                                                                                             16, (), ("adamw",)),
           disk_dir: Any = None, disk_budget: int | str | None = None) -> Budgets:
        """Check every argument, and raise one ``ValueError`` (``TypeError`` when one is of a wrong type) naming all
        the problems at once."""
        problems: list[str] = []
        type_error = False
        parsed: dict[str, int] = {}
        for name, value in (("device_memory", device_memory), ("host_memory", host_memory),
                            ("disk_budget", disk_budget)):
            try:
                if value is not None:
                    parsed[name] = parse_bytes(value, f"`{name}`")
            except (TypeError, ValueError) as err:
                problems.append(str(err))
                type_error |= isinstance(err, TypeError)
        device_budget, host_budget = parsed.get("device_memory"), parsed.get("host_memory")
        type_error |= disk_problems(disk_dir, disk_budget, problems)
        if target not in ("cpu", "cuda", None):
            problems.append(f"Passed `target={target!r}`; expected 'cuda' or 'cpu'.")
        source = Source.of(model, batch_size, seq_len, data, problems)
        why = "target=" if target is not None else "the default for a model without a Trainer"
        if target is None and source is not None and source.target is not None:
            target, why = source.target, source.target_source
        target = target or "cuda"
        profile = None
        try:
            # NOTE: a CPU run is priced at this machine's measured rates (a GPU's would rank its recipes wrongly)
            profile = load_profile("measure" if hardware is None and target == "cpu" else hardware)
        except ValueError as err:
            problems.append(str(err))
        if device_budget is None and device_memory is None:
            if profile is None:
                problems.append("Passed neither `device_memory` nor `hardware`; give the device's memory (e.g. "
                                f"device_memory='12GB') or a profile ({', '.join(PROFILES)}).")
            else:
                device_budget = profile.memory_bytes
        own = [*trainings[3], *(source.fixed_callbacks if source is not None else [])]
        variants, wrong_type = adapter_variants(*trainings[:3], own, problems)
        type_error |= wrong_type
        optimizers, wrong_type = optimizer_choices(trainings[4], own, problems)
        type_error |= wrong_type
        if problems or source is None or device_budget is None:
                raise (TypeError if type_error else ValueError)("\n- ".join(["the arguments do not describe a plan:",
                                                                         *problems]))
        if profile is None:
            profile = PROFILES["rtx3060-12gb"].override(name="default (rtx3060-12gb rates)", memory_bytes=device_budget)
        return cls(source, profile, device_budget, host_budget, variants, optimizers, target, why,
                   None if disk_dir is None else os.fspath(disk_dir), parsed.get("disk_budget"))


def candidate_rows(source: Source, profile: HardwareProfile, half: str, fixed: frozenset[str], *, pure_half: bool,
                   bases: Sequence[str] | None, keep_deepspeed: bool = True,
                   adapters: Sequence[AdapterVariant] = (FULL_FINE_TUNE,), adapter_r: int = 16,
                   optimizers: Sequence[str | None] = (None,), disk_dir: str | None = None) -> list[Row]:
    """Every candidate recipe for ``source``, priced by the cost model, fastest first, the disk bases (with
    ``disk_dir``) after all others. None switches on a technique of ``fixed`` (the user's own);
    ``keep_deepspeed=False`` leaves out the DeepSpeed bases, unless nothing else is left."""
    b = source.batch_size
    rows = [Row(r, r.name(half), step_cost(r, source.shape, b or 1, profile))
            for r in candidates(b or 1, pure_half=pure_half, deepspeed=package_available("deepspeed"),
                                chunked_loss=source.causal_lm and "chunked_loss" not in fixed,
                                micro=source.can_split and "micro_batch_size" not in fixed,
                                checkpointing="checkpointing" not in fixed,
                                activation_offload="activation_offload" not in fixed,
                                bases=bases, half=half,
                                adapters=(FULL_FINE_TUNE,) if "adapters" in fixed else adapters,
                                adapter_r=adapter_r,
                                # NOTE: the run's own optimizer swap (LeanOptimizer, LowBitOptimizer) stays
                                optimizers=(None,) if "optimizer" in fixed else optimizers, disk_dir=disk_dir)]
    if not keep_deepspeed:
        rows = [r for r in rows if r.recipe.base not in ("zero2_offload", "zero3_offload")] or rows
    # NOTE: the disk tier only where nothing in RAM fits: it is an in-backward base plus the disk's reads and writes
    rows.sort(key=lambda r: (r.recipe.base in DISK, r.cost.total_s))
    return rows


@dataclass
class Judge:
    """Dry-runs a candidate (once per cache key) and gives it its verdict against the budgets."""

    source: Source
    budgets: Budgets
    fixed_callbacks: Sequence[Any]
    fixed: frozenset[str]
    loader: int | None
    target: str
    cache: dict[Any, Any]
    #: called with one line after each dry run
    progress: Callable[[str], None] | None = None
    #: how many dry runs this judge ran (cache hits not counted)
    traces: int = 0
    #: (base, training, recipe field) -> why: a technique that refused this module under a base refuses it in every
    #: candidate of the base, so those are not traced again
    refusals: dict[tuple[str, str], str] = field(default_factory=dict)

    def __call__(self, row: Row) -> None:
        b, half = self.source.batch_size, self.budgets.half
        key = (self.source.key, b, self.target, row.recipe, half, tuple(sorted(self.fixed)))
        cache = self.cache
        traced = key not in cache
        if traced:
            self.traces += 1
            t0 = time.perf_counter()
            run = None
            try:
                run = row.recipe.run(b, half, self.loader, self.source.scheduler)
                run.callbacks += [fresh(c) for c in self.fixed_callbacks]
                cache[key] = self.source.estimate(run, self.target)
            except (ValueError, TypeError, ModuleNotFoundError, NotImplementedError) as err:
                cache[key] = (err, refusing_technique(err, run))
            except (DryRunUnsupportedError, RuntimeError) as err:
                # NOTE: not a refusal by a technique: it cannot be predicted, or cannot run on this machine (a real
                # CPU kernel refusing the precision); the candidate is dropped with its reason, the plan goes on
                cache[key] = (err, None)
        self._verdict(row, cache[key])
        if traced and self.progress is not None:
            self.progress(f"dry run {self.traces}: {row.name}: {row.status}"
                          + (f" ({row.why})" if row.why else "") + f", {time.perf_counter() - t0:.1f} s")

    def _verdict(self, row: Row, result: Any) -> None:
        if isinstance(result, tuple):
            err, technique = result
            cause = ("not predicted: " if isinstance(err, DryRunUnsupportedError)
                     else f"cannot run: {type(err).__name__}: " if isinstance(err, RuntimeError) else "")
            row.status, row.why = "refused", cause + " ".join(str(err).split())[:160]
            if technique is not None:
                self.refusals[(row.recipe.base, row.recipe.training, technique_field(technique))] = (
                    f"`{type(technique).__name__}` refused this module (traced in `{row.name}`)")
            return
        row.estimate = result
        over = []
        device_budget, host_budget = self.budgets.device, self.budgets.host
        if result.peak_device > device_budget:
            over.append(f"device {fmt_size(result.peak_device)} > {fmt_size(device_budget)} ({result.binding_phase})")
        if host_budget is not None and result.peak_host > host_budget:
            over.append(f"host {fmt_size(result.peak_host)} > {fmt_size(host_budget)}")
        if self.budgets.disk is not None and result.peak_disk > self.budgets.disk:
            over.append(f"disk {fmt_size(result.peak_disk)} > {fmt_size(self.budgets.disk)}")
        row.status, row.why = ("too big", "; ".join(over)) if over else ("fits", f"binds in {result.binding_phase}")

    def refused(self, row: Row) -> str | None:
        """Why a technique of ``row`` is known to refuse this module under ``row``'s base, or None."""
        return next((why for (base, variant, name), why in self.refusals.items()
                     if base == row.recipe.base and variant == row.recipe.training and getattr(row.recipe, name)),
                    None)


def floors(rows: list[Row]) -> list[Row]:
    """Each base's floors: the candidates that save the most (no other candidate saves more)."""
    return [r for r in rows if not any(o is not r and o.recipe.saves_at_least(r.recipe)
                                       and not r.recipe.saves_at_least(o.recipe) for o in rows)]


def search(rows: list[Row], rows_floors: list[Row], judge: Judge) -> Row | None:
    """The first of ``rows`` (fastest first) that fits, judging as few as it can; None when none fits. A base's
    floors are judged when its first candidate comes up: if all are too big (a refused one says nothing), so is it."""
    too_big: list[Row] = []
    floored: set[Any] = set()
    for row in rows:
        group = (row.recipe.base, row.recipe.training)  # NOTE: each training's floors are its own
        if group not in floored:
            floored.add(group)
            for floor in (f for f in rows_floors if (f.recipe.base, f.recipe.training) == group):
                refused = judge.refused(floor)  # NOTE: a technique that refused one floor refuses the others
                if refused is not None and floor.status == "not traced":
                    floor.status, floor.why = "refused", refused
                else:
                    judge(floor)
                if floor.status == "too big":
                    too_big.append(floor)
        if row.status == "not traced" and not _ruled_out(row, rows, too_big, judge):
            judge(row)
            if row.status == "too big":
                too_big.append(row)
        if row.status == "fits":
            return row
    return None


def _ruled_out(row: Row, rows: list[Row], too_big: list[Row], judge: Judge) -> bool:
    """Give ``row`` its verdict without a trace where one is known (True then): a technique of it refused this module
    under its base, it saves no more than a candidate too big, or its trace at another micro-batch scales over."""
    refused = judge.refused(row)
    if refused is not None:
        row.status, row.why = "refused", refused
        return True
    beaten = next((t for t in too_big if t.recipe.saves_at_least(row.recipe)), None)
    if beaten is not None:
        row.status, row.why = "too big", f"saves no more than `{beaten.name}`, which is too big"
        return True
    scaled = _scaled_from_another_micro_batch(row, rows)
    if scaled is not None and scaled[0] > MICRO_MARGIN * judge.budgets.device:
        row.status, row.why = "too big", (f"{fmt_size(scaled[0])} predicted from the trace at micro-batch "
                                          f"{scaled[1]} (activations scale with the micro-batch)")
        return True
    return False


def refusing_technique(err: BaseException, run: RunSpec | None) -> Any:
    """The technique callback of the run whose code raised ``err`` (the innermost such frame), if one did.

    NOTE: by the type of the raising frames' ``self`` (the dry run traces copies of the callbacks), never by the
    message; the accumulation scheduler's refusals are not counted (a micro-batch is a recipe of its own).
    """
    if run is None:
        return None
    ours = {type(c) for c in run.callbacks if technique_field(c) not in (None, "micro_batch_size")}
    return next((owner for owner in reversed(frames.raising_instances(err)) if type(owner) in ours), None)


#: a candidate predicted this far over the budget from the trace of the same techniques at another micro-batch is
#: not traced (the prediction is exact where activations scale linearly; the margin absorbs what does not)
MICRO_MARGIN = 1.1


def _scaled_from_another_micro_batch(row: Row, rows: list[Row]) -> tuple[int, int] | None:
    """The device peak of ``row`` scaled from a traced row with the same techniques at another micro-batch: the
    model states (weights, gradients, optimizer state) kept, the rest (activations, temporaries) scaled."""
    for other in rows:
        if other.estimate is None or replace(other.recipe, micro_batch_size=row.recipe.micro_batch_size) != row.recipe:
            continue
        est = other.estimate
        device = est.phases[est.binding_phase].device
        states = sum(device.get(c, 0) for c in ("weights", "gradients", "optimizer_state"))
        rest = est.peak_device - states
        return int(states + rest * row.recipe.micro_batch_size / other.recipe.micro_batch_size), \
            other.recipe.micro_batch_size
    return None


def _no_fit_message(floors: list[Row], budgets: Budgets, source: Source, disk_floors: Sequence[Row] = ()) -> str:
    """Why nothing fits: the least device peak, the host (and disk) it would need; ``disk_floors``: the disk bases'
    floors traced for a plan without ``disk_dir`` whose host budget is what fails."""
    traced = [r for r in floors if r.estimate is not None]
    if not traced:
        reasons = "; ".join(f"{r.name}: {r.why}" for r in floors)
        return f"No recipe could be predicted for this model: {reasons}"
    least = min(traced, key=lambda r: r.peak_device or 0)
    host, disk = budgets.host, budgets.disk
    lines = [f"No recipe fits a device budget of {fmt_size(budgets.device)}"
             + (f", a host budget of {fmt_size(host)}" if host else "")
             + (f", a disk budget of {fmt_size(disk)}" if disk else "") + ".",
             (f"The smallest device peak of any recipe is {fmt_size(least.peak_device or 0)} ({least.name}, host peak "
              f"{fmt_size(least.peak_host or 0)}{_disk_part(least)}).")]
    fit_device = [r for r in traced if (r.peak_device or 0) <= budgets.device]
    if host is not None and fit_device:
        need = min(fit_device, key=lambda r: r.peak_host or 0)
        if (need.peak_host or 0) > host:
            lines.append(f"It would fit with {fmt_size(need.peak_host or 0)} of host memory ({need.name}"
                         f"{_disk_part(need)}).")
    on_disk = [r for r in fit_device if r.recipe.base in DISK and (host is None or (r.peak_host or 0) <= host)]
    if disk is not None and on_disk:
        need = min(on_disk, key=lambda r: r.peak_disk or 0)
        lines.append(f"With the disk tier it fits the device and host ({need.name}: host peak "
                     f"{fmt_size(need.peak_host or 0)}) with {fmt_size(need.peak_disk or 0)} of disk.")
    if disk_floors:
        fits = [r for r in disk_floors if (r.peak_device or budgets.device + 1) <= budgets.device]
        need = min(fits, key=lambda r: r.peak_host or 0) if fits else None
        figures = ("" if need is None else f": {need.name} needs device {fmt_size(need.peak_device or 0)}, host "
                   f"{fmt_size(need.peak_host or 0)}, disk {fmt_size(need.peak_disk or 0)}")
        lines.append("The disk tier keeps the fp32 masters and optimizer state in files on a local disk" + figures
                     + "; give it a directory to plan with it: `--disk-dir DIR` (Python: `disk_dir=`).")
    what = "a smaller batch" + (" or sequence length" if source.shape.seq_len else "") if source.batch_size and \
        source.batch_size > 1 else "a shorter sequence" if source.shape.seq_len else "a smaller model"
    lines.append(f"To fit: a device with at least that memory, or {what} (activations scale with it).")
    return " ".join(lines)


def _disk_part(row: Row) -> str:
    return f", disk {fmt_size(row.peak_disk or 0)}" if row.recipe.base in DISK else ""


__all__ = ["Budgets", "Judge", "NoRecipeFitsError", "Plan", "Row", "candidate_rows", "effective_batch", "floors",
           "plan", "refusing_technique", "search"]
