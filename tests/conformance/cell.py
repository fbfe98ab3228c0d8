"""One cell of the sweep: a module trained with a flag (and maybe one of Lightning's callbacks) through a real
``Trainer.fit``, then judged against plain Lightning's run of the same module (``compare.py``).

The verdict is one of ``exact``, ``close``, ``refused`` (an error of a refusing kind raised by the suite or Lightning
before the first training batch ended), ``differs`` and ``crash`` (any other error, or an error after training
started); ``n/a`` when plain Lightning itself cannot run the cell (its message is kept). Plain runs are cached per
process (``REFERENCES``), so a worker trains each reference of a module once.
"""

from __future__ import annotations

import math
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy

from tests.conformance import compare
from tests.conformance.companions import Companion
from tests.conformance.corpus import ModuleSpec
from tests.conformance.flags import Flag, Ref

STEPS = 3
# NOTE: DryRunUnsupportedError (a RuntimeError) is the dry run's documented refusal: it names the op and the line
REFUSING = (ValueError, TypeError, NotImplementedError, MisconfigurationException, ModuleNotFoundError)
REFUSING_BY_NAME = ("DryRunUnsupportedError",)
_DELIBERATE = ("/lightning_lowmem/", "/lightning/")  # where a refusal is raised (not deep inside torch or a model)


@dataclass
class Outcome:
    state: compare.State | None = None
    global_step: int = 0
    observed: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    where: str = ""
    batches: int = 0
    grad_norms: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    adam_lr: float = 0.0  # the largest learning rate of the run's torch Adam/AdamW groups (0: no Adam)


class _Probe(Callback):
    """Counts finished training batches, keeps the first backward's gradient norms (plain runs: which parameters
    have a numerically zero gradient), and under DeepSpeed gathers the module's parameters at the end of training."""

    def __init__(self) -> None:
        self.batches = 0
        self.params: dict[str, torch.Tensor] | None = None
        self.grad_norms: dict[str, float] = {}

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if not self.grad_norms:
            self.grad_norms = {n: float(p.grad.double().norm()) for n, p in pl_module.named_parameters()
                               if p.grad is not None}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # NOTE: the module's own values, as the user gets them (a callback such as EMAWeightAveraging writes its
        # average there at on_train_end, before this last callback), gathered where ZeRO-3 partitioned them
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            import deepspeed

            params = list(pl_module.parameters())
            with deepspeed.zero.GatheredParameters(params):
                self.params = {n: p.detach().float().clone() for n, p in pl_module.named_parameters()}


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _bnb_optimizers(module: L.LightningModule) -> None:
    """Plain Lightning with bitsandbytes' AdamW8bit as the module's optimizer: ``configure_optimizers`` builds the
    module's own, then the same groups and hyper-parameters go to ``AdamW8bit`` (a user's one-line change)."""
    import bitsandbytes as bnb

    original = module.configure_optimizers

    def configure_optimizers() -> Any:
        optimizer = original()
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"no AdamW8bit equivalent of {type(optimizer).__name__}")  # noqa: TRY004  (as LowBitOptimizer)
        keep = ("params", "lr", "betas", "eps", "weight_decay")
        groups = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
        return bnb.optim.AdamW8bit(groups, min_8bit_size=4096)

    module.configure_optimizers = configure_optimizers


def _fused_optimizers(module: L.LightningModule) -> None:
    """Plain Lightning with torch's fused CPU kernel: ``fused=True`` (``foreach=False``) on the fp32 groups of the
    module's own Adam/AdamW (a user's one-argument change; a half-precision group keeps its kernel)."""
    original = module.configure_optimizers

    def configure_optimizers() -> Any:
        returned = original()
        # NOTE: every Adam/AdamW returned (alone, in lists and tuples, in `{"optimizer": ...}` dicts), as the
        # registered name fuses each of them; other optimizers keep their kernel
        for optimizer in _optimizers_in(returned):
            if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
                for group in optimizer.param_groups:
                    if all(p.dtype in (torch.float32, torch.float64) for p in group["params"]):
                        group.update(fused=True, foreach=False)
        return returned

    module.configure_optimizers = configure_optimizers


def _optimizers_in(value: Any) -> list[torch.optim.Optimizer]:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, dict):
        return _optimizers_in(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        return [o for v in value for o in _optimizers_in(v)]
    return []


def initial_state(spec: ModuleSpec) -> compare.State:
    """The weights and buffers a run starts from; also by ``state_dict`` key (``state:NAME``, tied weights under each
    of their names, as a checkpoint holds them)."""
    module = spec.build()
    L.seed_everything(1, verbose=False)
    module.configure_model()
    state = compare.capture(module)
    for k, v in module.state_dict().items():
        state[f"state:{k}"] = v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
    return state


def fit(spec: ModuleSpec, *, strategy: Any = None, precision: str = "32-true", callbacks: list[Any] = (),
        accumulate: int = 1, batches_per_step: int = 1, bnb: bool = False, fused: bool = False,
        companion: Companion | None = None,
        trainer_hook: Any = None) -> Outcome:
    """One ``Trainer.fit`` of a fresh ``spec`` module for ``STEPS`` optimizer steps (or the companion's schedule)."""
    started = time.perf_counter()
    out = Outcome()
    probe = _Probe()
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        root = Path(tmp)
        settings: dict[str, Any] = {"max_epochs": 1, "limit_train_batches": STEPS, "limit_val_batches": 0,
                                    "logger": False, "enable_checkpointing": False}
        extra_callbacks: list[Any] = []
        if companion is not None:
            settings.update(companion.trainer)
            extra_callbacks = companion.build(root)
        settings["limit_train_batches"] *= batches_per_step
        if settings["logger"] == "csv":
            from lightning.pytorch.loggers import CSVLogger

            settings["logger"] = CSVLogger(root)
        try:
            module = spec.build()
            if bnb:
                _bnb_optimizers(module)
            if fused:
                _fused_optimizers(module)
            trainer = L.Trainer(
                accelerator="cpu", devices=1, strategy=strategy if strategy is not None else "auto",
                precision=precision, callbacks=[*callbacks, *extra_callbacks, probe], accumulate_grad_batches=accumulate,
                num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                use_distributed_sampler=False, **settings)
            L.seed_everything(1, verbose=False)  # dropout masks
            trainer.fit(module)
            out.global_step = trainer.global_step
            out.state = compare.capture(module, probe.params)
            out.adam_lr = max((g["lr"] for o in trainer.optimizers if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))
                               for g in o.param_groups), default=0.0)
            if companion is not None:
                out.observed = companion.observe(trainer, module, root)
            if trainer_hook is not None:
                out.extra = trainer_hook(trainer)
        except Exception as err:  # noqa: BLE001 - every failure is a verdict
            out.error, out.where = err, _where(err)
        out.batches, out.grad_norms = probe.batches, probe.grad_norms
    out.seconds = time.perf_counter() - started
    return out


# --- plain references, cached per process ------------------------------------------------------------------------
REFERENCES: dict[tuple[str, str, str], Outcome] = {}
INITIAL: dict[str, compare.State] = {}


def reference(spec: ModuleSpec, ref: Ref, companion: Companion | None) -> Outcome:
    key = (spec.name, ref.key, companion.name if companion else "")
    if key not in REFERENCES:
        REFERENCES[key] = fit(spec, precision=ref.precision, accumulate=ref.accumulate, batches_per_step=ref.accumulate,
                              bnb=ref.bnb, fused=ref.fused, companion=companion)
    return REFERENCES[key]


_HALF = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def _nudged(spec: ModuleSpec, precision: str = "32-true") -> ModuleSpec:
    """``spec`` with every floating parameter moved by one ulp (towards +inf) after it is built: an ulp of the
    weights' dtype at ``precision`` (bf16 for bf16-true: an fp32 ulp would vanish in the cast), fp32 otherwise."""
    dtype = _HALF.get(precision, torch.float32)

    def build() -> L.LightningModule:
        module = spec.factory()
        with torch.no_grad():
            for p in module.parameters():
                if p.is_floating_point():
                    q = p.to(dtype)
                    p.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))).to(p.dtype))
        return module

    return ModuleSpec(spec.name, spec.kind, build, spec.tags)


def sensitivity(spec: ModuleSpec, ref: Ref, companion: Companion | None) -> Outcome:
    """Plain Lightning's run of ``ref`` from initial weights nudged by one ulp: how far rounding alone moves this
    module's training (cached like the references)."""
    key = (spec.name, ref.key + "+nudged", companion.name if companion else "")
    if key not in REFERENCES:
        REFERENCES[key] = fit(_nudged(spec, ref.precision), precision=ref.precision, accumulate=ref.accumulate,
                              batches_per_step=ref.accumulate, bnb=ref.bnb, fused=ref.fused, companion=companion)
    return REFERENCES[key]


def _message(err: BaseException, limit: int = 500) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _failure(out: Outcome) -> tuple[str, str]:
    err = out.error
    assert err is not None
    deliberate = any(part in out.where for part in _DELIBERATE)
    refusing = isinstance(err, REFUSING) or type(err).__name__ in REFUSING_BY_NAME
    if out.batches == 0 and refusing and deliberate:
        return "refused", _message(err)
    when = "before the first step" if out.batches == 0 else f"after {out.batches} training batch(es)"
    return "crash", f"{_message(err, 400)} (at {out.where}, {when})"


def run_cell(spec: ModuleSpec, flag: Flag, companion: Companion | None = None) -> dict[str, Any]:
    """The verdict of one cell, as the results record it."""
    started = time.perf_counter()
    name = flag.name + (f" + {companion.name}" if companion else "")
    row: dict[str, Any] = {"module": spec.name, "flag": name}
    from lightning_lowmem.plan.auto import AutoStrategy

    strategy = flag.strategy() if flag.strategy is not None else None
    hook = (lambda trainer: {"auto": _auto_plan_of(strategy)}) if isinstance(strategy, AutoStrategy) else None
    got = fit(spec, strategy=strategy, precision=flag.precision, callbacks=flag.callbacks(spec),
              batches_per_step=flag.batches_per_step, companion=companion, trainer_hook=hook)
    ref, kind, reason = flag.ref, flag.compare, flag.reason
    if got.error is not None:
        row["verdict"], row["detail"] = _failure(got)
        if row["verdict"] == "crash":  # the module may not run this way in plain Lightning either
            want = reference(spec, ref, companion) if kind != "auto" else Outcome()
            if want.error is not None:
                row.update(verdict="n/a", detail=f"plain Lightning ({ref.key}) fails too: {_message(want.error, 300)}; "
                                                 f"with the flag: {row['detail']}")
    else:
        if kind == "auto":
            plan = got.extra["auto"]
            ref = Ref(plan["precision"], bnb="LowBitOptimizer" in plan["callbacks"])
            kind = "precision" if plan["precision"] in ("bf16-true", "16-true") else "reorder"
            reason = f"lowmem_auto chose {plan['describe']}; judged as that recipe"
            row["auto_choice"] = plan["describe"]
        want = reference(spec, ref, companion)
        if want.error is not None:
            row.update(verdict="n/a", detail=f"the flag trains, plain Lightning ({ref.key}) fails: "
                                             f"{_message(want.error, 300)}")
        elif got.global_step != want.global_step:
            row.update(verdict="differs", detail=f"global_step {got.global_step} vs plain {want.global_step}")
        else:
            row.update(_judge(spec, got, want, kind, reason, ref, companion))
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def _auto_plan_of(strategy: Any) -> dict[str, Any]:
    run = strategy.plan.run
    return {"precision": run.precision, "callbacks": [type(c).__name__ for c in run.callbacks],
            "describe": run.describe()}


def _judge(spec: ModuleSpec, got: Outcome, want: Outcome, kind: str, reason: str, ref: Ref,
           companion: Companion | None) -> dict[str, Any]:
    if spec.name not in INITIAL:
        INITIAL[spec.name] = initial_state(spec)
    initial = dict(INITIAL[spec.name])
    got_state, want_state = dict(got.state or {}), dict(want.state or {})
    got_obs, want_obs = dict(got.observed), dict(want.observed)
    for obs, state in ((got_obs, got_state), (want_obs, want_state)):
        for k, v in obs.pop("ckpt_state", {}).items():  # the checkpoint's weights, judged like the module's
            state[f"ckpt:{k}"] = v
    for k in list(want_state):
        if k.startswith("ckpt:"):
            initial[k] = INITIAL[spec.name].get(f"state:{k[5:]}", want_state[k])
    want32 = None
    if kind == "precision":
        twin = reference(spec, ref.fp32(), companion)
        if twin.error is not None:
            return {"verdict": "n/a", "detail": f"plain Lightning ({ref.fp32().key}) fails: {_message(twin.error, 300)}"}
        want32 = dict(twin.state or {})
        for k, v in twin.observed.get("ckpt_state", {}).items():
            want32[f"ckpt:{k}"] = v
    # NOTE: plain's own distance from the fp32 run is one sample of the precision's noise; its twin from weights
    # nudged by one half-precision ulp is a second (compare.py: the precision comparison takes the larger)
    want_nudged = None
    if kind == "precision":
        nudge = sensitivity(spec, ref, companion)
        if nudge.error is None and nudge.state is not None:
            want_nudged = dict(nudge.state)
            want_nudged.update({f"ckpt:{k}": v for k, v in nudge.observed.get("ckpt_state", {}).items()})
    bound = compare.bounds(want.grad_norms)
    if kind == "reorder":  # NOTE: a module that amplifies rounding (BatchNorm over tiny batches) gets a looser bound
        nudge = sensitivity(spec, ref, companion)
        if nudge.error is None and nudge.state is not None:
            nudged = dict(nudge.state)
            nudged.update({f"ckpt:{k}": v for k, v in nudge.observed.get("ckpt_state", {}).items()})
            bound = compare.calibrated(bound, nudged, want_state, initial)
    verdict = compare.compare(got_state, want_state, initial, kind, reason, want_fp32=want32, precision=ref.precision,
                              bound=bound, want_nudged=want_nudged, adam_step=want.adam_lr)
    decided = compare.compare_values(got_obs, want_obs)
    if decided and verdict.verdict != "differs":
        return {"verdict": "differs", "detail": f"{companion.name if companion else ''} decided otherwise: {decided}; "
                                                f"weights: {verdict.verdict}"}
    row = {"verdict": verdict.verdict, "detail": verdict.detail}
    if verdict.measured is not None and not math.isinf(verdict.measured):
        row["measured"] = verdict.measured
    return row
