"""``plan``: the fastest recipe of the suite that fits a device (and host) memory budget.

Every candidate (:func:`~lightning_lowmem.plan.recipes.candidates`) is priced by the cost model
(:func:`~lightning_lowmem.plan.cost.step_cost`, no tracing), then the candidates are taken fastest first and
each is predicted by the dry run (the real ``Trainer.fit`` on fake tensors) until one fits both budgets. Traces
are saved two ways:

* a base's floors (every technique on, the smallest micro-batch) are traced when its first candidate comes up: a
  base whose floors do not fit is out as a whole (bases slower than the chosen recipe are never traced), and the
  floors give the smallest memory any recipe needs when none fits;
* a candidate that saves no more than one already traced and too big (:meth:`Recipe.saves_at_least`) is taken
  to be too big as well, without a trace;
* a candidate whose techniques were traced at another micro-batch is scaled from that trace (model states kept,
  the rest scaled with the micro-batch) and not traced when that puts it over 110 % of the budget.

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

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_lowmem.core.optional import package_available
from lightning_lowmem.core.reproducible import fresh, init_arguments
from lightning_lowmem.core.units import fmt_size, parse_bytes
from lightning_lowmem.plan.cost import ModelShape, StepCost, step_cost
from lightning_lowmem.plan.hardware import PROFILES, HardwareProfile, load_profile
from lightning_lowmem.plan.output import trainer_arguments, write_yaml
from lightning_lowmem.plan.recipes import Recipe, candidates
from lightning_lowmem.predict.configs import causal_lm_factory, resolve_config
from lightning_lowmem.predict.depth import find_blocks
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.estimate import is_module, module_class
from lightning_lowmem.predict.result import MemoryEstimate
from lightning_lowmem.predict.run_config import load_run_config
from lightning_lowmem.predict.run_spec import RunSpec

Status = Literal["fits", "too big", "refused", "not traced"]


class NoRecipeFitsError(ValueError):
    """No recipe of the suite fits the budgets; the message says the smallest memory any recipe needs."""


@dataclass
class Row:
    """One candidate: its prediction (where traced), its predicted step time, and the verdict."""

    recipe: Recipe
    name: str
    cost: StepCost
    status: Status = "not traced"
    why: str = ""
    estimate: MemoryEstimate | None = None

    @property
    def peak_device(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_device

    @property
    def peak_host(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_host


@dataclass
class Plan:
    """The ranked candidates, the chosen one (the fastest that fits), and how to run it."""

    rows: list[Row]
    chosen: Row
    device_budget: int
    host_budget: int | None
    hardware: HardwareProfile
    batch_size: int | None
    half: str
    traces: int
    wall_s: float
    notes: list[str] = field(default_factory=list)
    #: what a written YAML takes from the planned source (``base_yaml``, or ``model`` and ``data``)
    yaml_parts: dict[str, Any] = field(default_factory=dict)
    #: the batch the data loader yields as given (a YAML's micro-batch), when it is not the effective batch
    loader_batch: int | None = None
    #: the YAML's own AccumulationScheduler arguments besides the batch sizes (kept in the plan's)
    scheduler: dict[str, Any] = field(default_factory=dict)

    @property
    def run(self) -> RunSpec:
        """The chosen run (fresh objects: give ``run.trainer_kwargs()`` to a Trainer)."""
        return self.chosen.recipe.run(self.batch_size, self.half, self.loader_batch, self.scheduler)

    def table(self) -> str:
        """The traced candidates (and the chosen one), fastest first; the rest counted by why they were not traced."""
        fastest = min(r.cost.total_s for r in self.rows)
        shown = [r for r in self.rows if r.estimate is not None or r.status == "refused"]
        body = [("*" if r is self.chosen else "", r.name, r.status, _size(r.peak_device), _size(r.peak_host),
                 f"{r.cost.total_s / fastest:.2f}x", r.why) for r in shown]
        header = ("", "recipe", "verdict", "device peak", "host peak", "step time", "why")
        widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(x, widths)).rstrip() for x in [header, *body]]
        pruned = sum(r.estimate is None and r.status == "too big" for r in self.rows)
        slower = sum(r.status == "not traced" for r in self.rows)
        lines.append(f"not traced: {pruned} candidates taken to be too big (saving no more than a traced one that is, "
                     f"or scaled from a trace at another micro-batch), {slower} slower than the chosen one (step time: "
                     "relative to the fastest candidate)")
        return "\n".join(lines)

    def trainer_arguments(self) -> str:
        """The chosen recipe as Python ``Trainer`` arguments."""
        return trainer_arguments(self.run)

    def write_yaml(self, path: str | Path, command: str = "") -> Path:
        """The chosen recipe as a YAML ``lowmem fit --config`` runs: the planned YAML with its techniques replaced,
        or (for a model shape) the demo causal-LM module and data at the planned batch and sequence length."""
        header = "\n".join([f"Written by `{command or 'lightning_lowmem.plan.plan'}`.", self.summary(),
                            f"Python: {self.trainer_arguments()}"])
        return write_yaml(path, self.run, header=header, **self.yaml_parts)

    def summary(self) -> str:
        r = self.chosen
        return (f"chosen: {r.name}: device peak {_size(r.peak_device)} of {fmt_size(self.device_budget)}, host peak "
                f"{_size(r.peak_host)}" + (f" of {fmt_size(self.host_budget)}" if self.host_budget else "")
                + f"; predicted step {r.cost.total_s:.3g} s on {self.hardware.name} (uncalibrated)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.name, "run": self.run.describe(), "device_budget": self.device_budget,
            "host_budget": self.host_budget, "hardware": self.hardware.name, "traces": self.traces,
            "wall_s": round(self.wall_s, 2), "notes": self.notes,
            "rows": [{"recipe": r.name, "status": r.status, "why": r.why, "peak_device": r.peak_device,
                      "peak_host": r.peak_host, **{k: round(v, 6) for k, v in r.cost.to_dict().items()}}
                     for r in self.rows if r.status != "not traced" or r is self.chosen],
        }


def _size(n: int | None) -> str:
    return "-" if n is None else fmt_size(n)


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
    target: Literal["cpu", "cuda"] = "cuda",
    cache: dict[Any, Any] | None = None,
) -> Plan:
    """Choose the fastest recipe whose predicted device peak fits ``device_memory`` (and host peak ``host_memory``).

    Args:
        model: a shipped shape name / config (the demo causal-LM step, with ``batch_size`` and ``seq_len``), a
            LightningModule or a callable building one (with ``data``, or its own dataloader), or a LightningCLI
            YAML path (its model and data; the YAML's own techniques are replaced by the plan's).
        batch_size: the effective batch (samples per optimizer step); default with a YAML: its
            ``AccumulationScheduler``'s effective batch, or the data's ``batch_size`` x ``accumulate_grad_batches``;
            with a module: the data's ``batch_size`` (the micro-batches the plan considers set it, as
            ``AccumulationScheduler`` does).
        device_memory: bytes or a size (``"12GB"``); default: the hardware profile's memory.
        host_memory: bytes or a size; default: no host check (the host peak is still reported).
        hardware: a profile name (see ``lightning_lowmem.plan.PROFILES``), ``"measure"``, a YAML path or a dict.
        pure_half: also consider half weights without fp32 masters (``bf16-true``: numerics change).
        fixed_callbacks: technique callbacks the run keeps whatever the plan (``lowmem_auto``: the user's own);
            every candidate is traced with them, and none adds a technique of the same kind.
        bases: consider only these bases (``lightning_lowmem.plan.recipes.BASES``: ``"fp32"``, ``"mixed"``, ``"half"``,
            ``"offload"``, ``"offload_obw"``, ``"offload_params"``, ``"zero2_offload"``, ``"zero3_offload"``); default:
            all but ``"half"``.
        cache: a dict reused across calls: dry runs keyed by model (a shape's config; a module and data object by
            identity), batch and recipe are not repeated.

    Raises:
        NoRecipeFitsError: no recipe fits; says the smallest device (and host) memory any recipe needs and what
            to change.
        ValueError: bad arguments (all named at once, with what is accepted); TypeError when one is of a wrong type.
    """
    t0 = time.perf_counter()
    problems: list[str] = []
    type_error = False
    profile = None
    try:
        profile = load_profile(hardware)
    except ValueError as err:
        problems.append(str(err))
    device_budget = host_budget = None
    for name, value in (("device_memory", device_memory), ("host_memory", host_memory)):
        if value is None:
            continue
        try:
            parsed = parse_bytes(value, f"`{name}`")
        except (TypeError, ValueError) as err:
            problems.append(str(err))
            type_error |= isinstance(err, TypeError)
            continue
        if name == "device_memory":
            device_budget = parsed
        else:
            host_budget = parsed
    if device_budget is None and device_memory is None:
        if profile is None:
            problems.append("Passed neither `device_memory` nor `hardware`; give the device's memory (e.g. "
                            f"device_memory='12GB') or a profile ({', '.join(PROFILES)}).")
        else:
            device_budget = profile.memory_bytes
    if target not in ("cpu", "cuda"):
        problems.append(f"Passed `target={target!r}`; expected 'cuda' or 'cpu'.")
    source = _Source.of(model, batch_size, seq_len, data, problems)
    if problems or source is None or device_budget is None:
        # NOTE: one exception for every problem at once; a TypeError when one of them is a wrong type
        raise (TypeError if type_error else ValueError)("\n- ".join(["the arguments do not describe a plan:", *problems]))
    if profile is None:
        profile = PROFILES["rtx3060-12gb"].override(name="default (rtx3060-12gb rates)", memory_bytes=device_budget)
    half = "bf16" if profile.bf16 else "16"
    cache = {} if cache is None else cache
    b = source.batch_size
    fixed = {type(c).__name__ for c in fixed_callbacks}
    # NOTE: a user's own AccumulationScheduler sets the loader's batch itself
    loader = None if "AccumulationScheduler" in fixed else source.loader_batch
    rows = [Row(r, r.name(half), step_cost(r, source.shape, b or 1, profile))
            for r in candidates(b or 1, pure_half=pure_half, deepspeed=package_available("deepspeed"),
                                chunked_loss=source.causal_lm and "ChunkedLMLoss" not in fixed,
                                micro=source.can_split and "AccumulationScheduler" not in fixed,
                                checkpointing="ActivationCheckpointing" not in fixed,
                                activation_offload="ActivationOffload" not in fixed,
                                eight_bit="LowBitOptimizer" not in fixed, bases=bases, half=half)]
    if fixed_callbacks:
        rows = [r for r in rows if r.recipe.base not in ("zero2_offload", "zero3_offload")] or rows
    rows.sort(key=lambda r: r.cost.total_s)
    traces = 0

    # (base, technique) -> why: a technique that refused this module under a base refuses it in every candidate of
    # the base (LowBitOptimizer refuses a module's SGD whatever else is on), so those are not traced again
    refusals: dict[tuple[str, str], str] = {}

    def judge(row: Row) -> None:
        nonlocal traces
        key = (source.key, b, target, row.recipe, half, tuple(sorted(fixed)))
        if key not in cache:
            traces += 1
            run = None
            try:
                run = row.recipe.run(b, half, loader, source.scheduler)
                run.callbacks += [fresh(c) for c in fixed_callbacks]
                cache[key] = source.estimate(run, target)
            except (ValueError, TypeError, ModuleNotFoundError, NotImplementedError) as err:
                cache[key] = (err, _refusing_technique(err, run))
        result = cache[key]
        if isinstance(result, tuple):
            err, technique = result
            row.status, row.why = "refused", " ".join(str(err).split())[:160]
            if technique is not None:
                refusals[(row.recipe.base, technique)] = f"`{technique}` refused this module (traced in `{row.name}`)"
            return
        row.estimate = result
        over = []
        if result.peak_device > device_budget:
            over.append(f"device {fmt_size(result.peak_device)} > {fmt_size(device_budget)} ({result.binding_phase})")
        if host_budget is not None and result.peak_host > host_budget:
            over.append(f"host {fmt_size(result.peak_host)} > {fmt_size(host_budget)}")
        row.status, row.why = ("too big", "; ".join(over)) if over else ("fits", f"binds in {result.binding_phase}")

    # a base's floors (the candidates that save the most: no other saves more) are traced when the first candidate of
    # the base comes up: a base whose floors are all too big is out whatever else is switched on (a refused floor,
    # techniques that do not compose, says nothing); bases slower than the chosen recipe are never traced
    floors = [r for r in rows if not any(o is not r and o.recipe.saves_at_least(r.recipe)
                                         and not r.recipe.saves_at_least(o.recipe) for o in rows)]
    too_big: list[Row] = []
    floored: set[str] = set()
    chosen = None
    for row in rows:
        if row.recipe.base not in floored:
            floored.add(row.recipe.base)
            for floor in (f for f in floors if f.recipe.base == row.recipe.base):
                judge(floor)
                if floor.status == "too big":
                    too_big.append(floor)
        if row.status == "not traced":
            refused = next((why for (base, technique), why in refusals.items()
                            if base == row.recipe.base and getattr(row.recipe, _TECHNIQUE_FIELDS[technique])), None)
            if refused is not None:
                row.status, row.why = "refused", refused
                continue
            beaten = next((t for t in too_big if t.recipe.saves_at_least(row.recipe)), None)
            if beaten is not None:
                row.status, row.why = "too big", f"saves no more than `{beaten.name}`, which is too big"
                continue
            scaled = _scaled_from_another_micro_batch(row, rows)
            if scaled is not None and scaled[0] > MICRO_MARGIN * device_budget:
                row.status, row.why = "too big", (f"{fmt_size(scaled[0])} predicted from the trace at micro-batch "
                                                  f"{scaled[1]} (activations scale with the micro-batch)")
                continue
            judge(row)
            if row.status == "too big":
                too_big.append(row)
        if row.status == "fits":
            chosen = row
            break
    if chosen is None:
        raise NoRecipeFitsError(_no_fit_message(floors, device_budget, host_budget, source))
    notes = [f"{traces} dry runs ({target} target), {len(rows)} candidates", *source.notes]
    return Plan(rows, chosen, device_budget, host_budget, profile, b, half, traces, time.perf_counter() - t0, notes,
                source.yaml_parts, loader, source.scheduler)


#: the technique callbacks a recipe switches on -> the recipe field that switches it on
_TECHNIQUE_FIELDS = {"ActivationCheckpointing": "checkpointing", "ActivationOffload": "activation_offload",
                     "ChunkedLMLoss": "chunked_loss", "LowBitOptimizer": "optimizer_8bit"}


def _refusing_technique(err: BaseException, run: RunSpec | None) -> str | None:
    """The technique of the run whose callback code raised ``err`` (the innermost such frame), if one did.

    NOTE: found by the raising frames' ``self`` being an instance of one of the run's technique callbacks (an object,
    not its message; the dry run traces copies of the callbacks, hence the class), so a refusal by the module, the
    strategy or the data is not taken for a technique's.
    """
    if run is None:
        return None
    ours = {type(c) for c in run.callbacks if type(c).__name__ in _TECHNIQUE_FIELDS}
    found = None
    tb = err.__traceback__
    while tb is not None:
        owner = type(tb.tb_frame.f_locals.get("self"))
        if owner in ours:
            found = owner.__name__
        tb = tb.tb_next
    return found


#: a candidate predicted this far over the budget from the trace of the same techniques at another micro-batch is
#: not traced (the prediction is exact where activations scale linearly; the margin absorbs what does not)
MICRO_MARGIN = 1.1


def _scaled_from_another_micro_batch(row: Row, rows: list[Row]) -> tuple[int, int] | None:
    """The device peak of ``row`` scaled from a traced row with the same techniques at another micro-batch: the
    model states (weights, gradients, optimizer state) kept, the rest (activations, temporaries) scaled."""
    from dataclasses import replace

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


def effective_batch(callbacks: Sequence[Any], loader_batch: Any, accumulate_grad_batches: int) -> int | None:
    """Samples per optimizer step of a run: its ``AccumulationScheduler``'s effective batch, else the loader's batch
    times ``accumulate_grad_batches`` (None when the loader does not say)."""
    scheduler = next((c for c in callbacks if type(c).__name__ == "AccumulationScheduler"), None)
    if scheduler is not None:
        return scheduler.effective_batch_size
    return loader_batch * accumulate_grad_batches if isinstance(loader_batch, int) else None


def _no_fit_message(floors: list[Row], device_budget: int, host_budget: int | None, source: _Source) -> str:
    traced = [r for r in floors if r.estimate is not None]
    if not traced:
        reasons = "; ".join(f"{r.name}: {r.why}" for r in floors)
        return f"No recipe could be predicted for this model: {reasons}"
    least = min(traced, key=lambda r: r.peak_device or 0)
    lines = [f"No recipe fits a device budget of {fmt_size(device_budget)}"
             + (f" and a host budget of {fmt_size(host_budget)}" if host_budget else "") + ".",
             (f"The smallest device peak of any recipe is {fmt_size(least.peak_device or 0)} ({least.name}, host peak "
             f"{fmt_size(least.peak_host or 0)}).")]
    if host_budget is not None:
        fit_device = [r for r in traced if (r.peak_device or 0) <= device_budget]
        if fit_device:
            need = min(fit_device, key=lambda r: r.peak_host or 0)
            lines.append(f"It would fit with {fmt_size(need.peak_host or 0)} of host memory ({need.name}).")
    what = "a smaller batch" + (" or sequence length" if source.shape.seq_len else "") if source.batch_size and \
        source.batch_size > 1 else "a shorter sequence" if source.shape.seq_len else "a smaller model"
    lines.append(f"To fit: a device with at least that memory, or {what} (activations scale with it).")
    return " ".join(lines)


class _Identity:
    """A cache key part that is equal only for the same object, and keeps it alive (its id cannot be reused)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@dataclass
class _Source:
    """What is planned for: a model shape, a module (with data) or a YAML, and how to dry-run a recipe on it."""

    key: Any
    shape: ModelShape
    batch_size: int | None
    causal_lm: bool
    can_split: bool
    module: Any
    data: Any
    tokens: dict[str, int]
    notes: list[str]
    yaml_parts: dict[str, Any] = field(default_factory=dict)
    loader_batch: int | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)

    def estimate(self, run: RunSpec, target: str) -> MemoryEstimate:
        return dry_run(self.module, self.data, run=run, target=target, **self.tokens)

    @classmethod
    def of(cls, model: Any, batch_size: int | None, seq_len: int | None, data: Any, problems: list[str]
           ) -> _Source | None:
        import torch

        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"Passed `{name}={value!r}`; expected a positive integer.")
        if isinstance(model, (str, Path)) and str(model).endswith((".yaml", ".yml")):
            try:
                module, data, run = load_run_config(model)
            except (ValueError, FileNotFoundError) as err:
                problems.append(str(err))
                return None
            scheduler = next((c for c in run.callbacks if type(c).__name__ == "AccumulationScheduler"), None)
            if batch_size is None:
                batch_size = effective_batch(run.callbacks, getattr(data, "batch_size", None),
                                             run.accumulate_grad_batches)
            source = cls._of_module(module, data, batch_size, seq_len, key=("yaml", str(Path(model).resolve())),
                                    problems=problems)
            if source is not None:
                source.yaml_parts = {"base_yaml": model}
                if scheduler is not None:  # its maths (loss normalisation) stays; the plan sets the batch sizes
                    source.scheduler = {k: v for k, v in init_arguments(scheduler).items()
                                        if k not in ("effective_batch_size", "micro_batch_size", "memory_budget")}
            return source
        if is_module(model) or module_class(model) is not None:
            module = model if is_module(model) else module_class(model)
            # NOTE: keyed by identity (the objects are kept alive by the key, so an id is never reused for another)
            return cls._of_module(module, data, batch_size, seq_len, key=("module", _Identity(model), _Identity(data)),
                                  problems=problems)

        try:
            config = resolve_config(model)
        except (ValueError, FileNotFoundError, TypeError) as err:
            problems.append(str(err))
            return None
        if batch_size is None or seq_len is None:
            problems.append(f"Passed the model shape {model!r} without `batch_size` and `seq_len`.")
            return None
        factory = causal_lm_factory(config)
        fields = factory.keywords
        yaml_parts = {
            "model": {"class_path": "lightning_lowmem.demo.module.CausalLMModule", "init_args": fields},
            "data": {"class_path": "lightning_lowmem.demo.data.StdlibTextDataModule",
                     "init_args": {"seq_len": seq_len, "batch_size": batch_size}},
        }
        with torch.device("meta"):
            num_params = sum(p.numel() for p in {id(p): p for p in factory().parameters()}.values())
        return cls(("shape", config.to_json_string()), ModelShape.of(num_params, config, seq_len), batch_size, True,
                   True, factory, None, {"batch_size": batch_size, "seq_len": seq_len}, [], yaml_parts)

    @classmethod
    def _of_module(cls, module: Any, data: Any, batch_size: int | None, seq_len: int | None, *, key: Any,
                   problems: list[str]) -> _Source | None:
        import torch

        is_factory = callable(module) and not isinstance(module, torch.nn.Module)
        with torch.device("meta"):
            probe = module() if is_factory else module
        import lightning as L

        # NOTE: an AccumulationScheduler sets the micro-batch through a `batch_size` attribute of the data module, or
        # of the module when it makes its own loader; a DataLoader given to `fit` keeps its batch
        if isinstance(data, L.LightningDataModule):
            holder = data if hasattr(data, "batch_size") else None
        else:
            holder = probe if data is None and hasattr(probe, "batch_size") else None
        data_batch = getattr(holder if holder is not None else data, "batch_size", None)
        if batch_size is None:
            batch_size = data_batch if isinstance(data_batch, int) else None
        notes = []
        if holder is None:
            notes.append("no `batch_size` attribute on the data module (or on the module making its own loader): "
                         "micro-batches not considered")
        config = getattr(getattr(probe, "model", probe), "config", None)
        found = find_blocks(probe)
        num_params = sum(p.numel() for p in {id(p): p for p in probe.parameters()}.values())
        causal_lm = config is not None and hasattr(getattr(probe, "model", None), "get_output_embeddings")
        shape = ModelShape.of(num_params, config, seq_len or getattr(data, "seq_len", None),
                              len(found[2]) if found else None)

        loader = data_batch if isinstance(data_batch, int) and data_batch != batch_size else None
        return cls(key, shape, batch_size, causal_lm, holder is not None and batch_size is not None, module, data, {},
                   notes, loader_batch=loader)


__all__ = ["NoRecipeFitsError", "Plan", "Row", "effective_batch", "plan"]
