"""The conformance harness finds what it is there to find: a silent difference is ``differs``, an early refusal
``refused``, a failure mid-run ``crash``, and rounding alone ``close`` (never ``differs``).

Each test plants a known bug in an otherwise plain run (a callback that changes one gradient, a buffer, or raises) and
runs it through the harness's own ``run_cell``, as the sweep does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conformance import compare
from tests.conformance.cell import run_cell
from tests.conformance.corpus import MODULES
from tests.conformance.flags import Flag, Ref

pytestmark = pytest.mark.integration


class _ScaleGrad(Callback):
    """Doubles the gradient of one parameter before every step (a contribution counted twice)."""

    def __init__(self, name: str, factor: float = 2.0) -> None:
        self.name, self.factor = name, factor

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        dict(pl_module.named_parameters())[self.name].grad.mul_(self.factor)


class _BumpBatchNorm(Callback):
    """Counts one batch more in a BatchNorm's ``num_batches_tracked`` (a second forward in train mode)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        pl_module.backbone[0][1].num_batches_tracked += 1


class _Raise(Callback):
    def __init__(self, error: Exception, hook: str) -> None:
        self.error, self.hook = error, hook

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.hook == "setup":
            raise self.error

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.hook == "second_batch" and batch_idx == 1:
            raise self.error


def _flag(callback: Callback, **kwargs: Any) -> Flag:
    return Flag("planted", callbacks=lambda spec: [callback], **kwargs)


# NOTE: on an SGD module: Adam's update m / sqrt(v) is invariant to a gradient scaled the same way at every step
# (measured: a doubled gradient moves an AdamW module's weights by 2e-6 of their update), which is why the corpus
# holds SGD modules (cnn_bn, gru_lm, hf_resnet, hf_phi, hf_distilbert, ...) beside the Adam ones.
@pytest.mark.parametrize("kind", ["exact", "reorder"])
def test_a_doubled_gradient_contribution_differs(kind):
    row = run_cell(MODULES["cnn_bn"], _flag(_ScaleGrad("head.bias"), compare=kind, reason="planted"))
    assert row["verdict"] == "differs", row
    assert "head.bias" in row["detail"]


def test_a_gradient_one_percent_off_is_not_a_reordering():
    row = run_cell(MODULES["cnn_bn"], _flag(_ScaleGrad("head.weight", 1.01), compare="reorder", reason="planted"))
    assert row["verdict"] == "differs", row


def test_a_batchnorm_counted_twice_differs():
    row = run_cell(MODULES["cnn_bn"], _flag(_BumpBatchNorm(), compare="reorder", reason="planted"))
    assert row["verdict"] == "differs" and "num_batches_tracked" in row["detail"], row


class _NudgeBatchNorm(Callback):
    """Moves a BatchNorm running statistic by 2 % of its scale after every batch (the running std for the mean, the
    variance itself for the variance): far less than a second momentum update, far more than rounding."""

    def __init__(self, buffer: str) -> None:
        self.buffer = buffer

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        norm = pl_module.backbone[0][1]
        if self.buffer == "running_mean":
            norm.running_mean.add_(0.02 * norm.running_var.sqrt())
        else:
            norm.running_var.mul_(1.02)


@pytest.mark.parametrize("buffer", ["running_mean", "running_var"])
def test_a_running_statistic_two_percent_off_differs(buffer):
    """A running statistic is judged at the scale of what it averages, not its own update (``compare.py``): a 2 %
    change at that scale is no reordering."""
    row = run_cell(MODULES["cnn_bn"], _flag(_NudgeBatchNorm(buffer), compare="reorder", reason="planted"))
    assert row["verdict"] == "differs" and buffer in row["detail"], row


def test_a_lost_gradient_at_half_precision_differs():
    """bf16-true against plain bf16-true: the planted run is no further from fp32 anywhere but on that tensor."""
    row = run_cell(MODULES["mlp"], _flag(_ScaleGrad("net.4.weight", 0.0), precision="bf16-true",
                                         ref=Ref("bf16-true"), compare="precision", reason="planted"))
    assert row["verdict"] == "differs" and "net.4.weight" in row["detail"], row


def test_rounding_order_alone_is_close():
    """The registered `lowmem_offload` (torch's fused AdamW kernel) against the for-loop kernel of plain Lightning."""
    row = run_cell(MODULES["mlp"], Flag("fused", lambda: "lowmem_offload", compare="reorder", reason="fused kernel"))
    assert row["verdict"] == "close", row
    assert 0 < row["measured"] <= compare.REORDER_BOUND


def test_a_refusal_is_the_suites_own_error_before_the_first_step_anything_else_a_crash():
    from lightning_lowmem import LowBitOptimizer

    refused = run_cell(MODULES["cnn_bn"], _flag(LowBitOptimizer()))  # SGD: no 8-bit equivalent
    assert refused["verdict"] == "refused" and "no 8-bit equivalent" in refused["detail"], refused
    # raised elsewhere (here: this file), after training started, or of another kind: a crash
    for error, hook, when in [(ValueError("x"), "setup", "before the first step"),
                              (ValueError("late"), "second_batch", "after 1 training batch"),
                              (RuntimeError("boom"), "setup", "before the first step")]:
        crashed = run_cell(MODULES["mlp"], _flag(_Raise(error, hook)))
        assert crashed["verdict"] == "crash" and when in crashed["detail"], crashed


def test_a_gradient_that_cancels_gets_a_rounding_bound_of_its_own():
    """The bound grows as the gradient shrinks against the largest one; a zero gradient is finiteness only."""
    bound = compare.bounds({"big": 1.0, "small": 1e-4, "zero": 0.0})
    assert bound["param:big"] == compare.REORDER_BOUND and bound["param:small"] == pytest.approx(1e-2)
    want = {"param:big": torch.tensor([1.0, 2.0]), "param:small": torch.tensor([0.5]), "param:zero": torch.tensor([1.0])}
    initial = {k: torch.zeros_like(v) for k, v in want.items()}
    got = {"param:big": want["param:big"].clone(), "param:small": torch.tensor([0.504]), "param:zero": torch.tensor([2.0])}
    assert compare.compare(got, want, initial, "exact", bound=bound).verdict == "differs"
    verdict = compare.compare(got, want, initial, "reorder", "r", bound=bound)
    assert verdict.verdict == "close" and "finiteness only" in verdict.detail and "(zero)" in verdict.detail, verdict
    got["param:small"] = torch.tensor([0.51])  # 2e-2 of its update: beyond its 1e-2
    assert compare.compare(got, want, initial, "reorder", "r", bound=bound).verdict == "differs"
    got["param:small"], got["param:zero"] = torch.tensor([0.5]), torch.tensor([float("nan")])
    assert compare.compare(got, want, initial, "reorder", "r", bound=bound).verdict == "differs"


def test_every_module_of_the_corpus_builds():
    """Every module builds, and a transformers family's model holds the sizes its corpus entry gives (a config that
    kept a default, such as DistilBERT's 12 heads over a tiny ``dim``, fails every cell as ``n/a``)."""
    from tests.conformance.corpus import MODULES
    from tests.conformance.corpus_hf import FAMILIES

    for spec in MODULES.values():
        module = spec.build()
        module.configure_model()
        assert sum(p.numel() for p in module.parameters()) > 0, spec.name
    for family in FAMILIES:
        config = MODULES[family.name].build().model.config
        wrong = {k: (getattr(config, k, None), v) for k, v in family.config.items()
                 if not k.startswith("_") and getattr(config, k, None) != v}
        assert not wrong, f"{family.name}: (built, entry) {wrong}"


def test_rerun_failed_picks_the_cells_whose_latest_row_failed_and_the_report_names_their_code(tmp_path):
    """``--rerun-failed``: the latest row of a cell decides, at any fingerprint; a cell never run is re-run too. The
    report labels each cell with the code it ran at and counts them in its headline."""
    from tests.conformance.dryrun import CONFIGS
    from tests.conformance.report import _codes, _provenance, latest
    from tests.conformance.run import to_rerun
    from tests.conformance.worker import append

    store = tmp_path / "cells.jsonl"
    plain, recipe = (f"dry_run:{c}" for c in CONFIGS)
    for flag, verdict, fp in [(plain, "off", "old"), (plain, "ok", "new"), (recipe, "crash", "old")]:
        append(store, {"module": "mlp", "flag": flag, "verdict": verdict, "fingerprint": fp, "finished": "t"})
    append(store, {"session": "t", "seconds": 1.0, "fingerprint": "old", "commit": "abc123"})
    assert latest(store)[("mlp", plain)]["verdict"] == "ok"
    assert to_rerun(store, [("mlp", "dry_run", 2)], []) == {("mlp", recipe)}
    assert to_rerun(store, [("cnn_bn", "dry_run", 2)], []) == {("cnn_bn", plain), ("cnn_bn", recipe)}  # never ran
    assert to_rerun(store, [("mlp", "dry_run", 2)], [], "known") == set()  # no known_bugs.py entry explains it
    assert to_rerun(store, [("mlp", "dry_run", 2)], [], "unknown") == {("mlp", recipe)}
    rows = list(latest(store).values())
    codes = _codes(rows, [{"fingerprint": "old", "commit": "abc123"}], "new")
    text = _provenance({"codes": codes, "fingerprint": "new", "cells_at_current_code": 1, "cells_at_earlier_code": 1,
                        "cells_never_run": 3})
    assert text.startswith("1 of 2 cells ran at the current code (fingerprint `new`")
    assert "1 carry the earlier fingerprint `old` (commit abc123" in text and "3 cells of the corpus never ran" in text


def test_a_tensor_checked_for_finiteness_only_leaves_the_precision_bound_finite():
    """A tensor with an unbounded rounding bound (a numerically zero gradient) that both runs leave equal adds no
    allowance to the whole-model bound (it once added inf * 0 = nan, and every such cell read as infinitely far)."""
    initial = {"param:a": torch.tensor([0.0, 0.0]), "param:z": torch.tensor([1.0])}
    want = {"param:a": torch.tensor([1.0, 2.0]), "param:z": torch.tensor([1.0])}
    fp32 = {"param:a": torch.tensor([1.01, 2.01]), "param:z": torch.tensor([1.0])}
    got = {"param:a": torch.tensor([1.005, 2.0]), "param:z": torch.tensor([1.0])}
    bound = {"param:a": compare.REORDER_BOUND, "param:z": float("inf")}
    verdict = compare.compare(got, want, initial, "precision", "r", want_fp32=fp32, precision="bf16-true", bound=bound)
    assert verdict.verdict == "close", verdict


def test_the_precision_noise_is_the_larger_of_plain_and_its_nudged_twin():
    """Plain's own distance from the fp32 run is one sample of the precision's noise; its run from weights nudged by
    one ulp of that precision is a second: a technique as far as the second is within the precision (hf_bart's fc2
    bias under DeepSpeed's bf16: 3.9e-3, plain 3.2e-4, plain nudged 3.9e-3), one beyond both is not."""
    initial = {"param:b": torch.zeros(4)}
    fp32 = {"param:b": torch.tensor([1.0, 1.0, 1.0, 1.0])}
    want = {"param:b": torch.tensor([1.0, 1.0, 1.0, 1.001])}
    nudged = {"param:b": torch.tensor([1.0, 1.0, 1.0, 1.01])}
    got = {"param:b": torch.tensor([1.0, 1.0, 1.0, 0.99])}

    def verdict(**kw):
        return compare.compare(got, want, initial, "precision", "r", want_fp32=fp32, precision="bf16-true", **kw)

    assert verdict().verdict == "differs"
    assert verdict(want_nudged=nudged).verdict == "close"
    got["param:b"] = torch.tensor([1.0, 1.0, 1.0, 0.9])  # 10x the larger sample
    assert verdict(want_nudged=nudged).verdict == "differs"


def test_one_element_one_adam_step_either_way_is_within_half_precision_but_a_lost_step_is_not():
    """Under Adam a gradient within rounding of zero moves its element by a full ``lr`` either way: one element two
    steps apart (``2 lr``) is within the precision; every element of a 16-element tensor one step short is not."""
    lr = 2e-3
    # a weight whose precision noise dominates the whole model (the whole-model bound gets no per-element allowance)
    g = torch.Generator().manual_seed(0)
    noise = lambda: 4 * lr * torch.randn(256, generator=g)
    initial = {"param:b": torch.zeros(16), "param:w": torch.zeros(256)}
    fp32 = {"param:b": torch.full((16,), 3 * lr), "param:w": torch.full((256,), 3 * lr)}
    want = {"param:b": torch.full((16,), 3 * lr + 1e-5), "param:w": fp32["param:w"] + noise()}
    got = {"param:b": fp32["param:b"].clone(), "param:w": fp32["param:w"] + noise()}
    got["param:b"][5] -= 2 * lr

    def verdict():
        return compare.compare(got, want, initial, "precision", "r", want_fp32=fp32, precision="bf16-true",
                               adam_step=lr)

    assert verdict().verdict == "close"
    got["param:b"] = torch.full((16,), 2 * lr)  # a lost step on every element
    assert verdict().verdict == "differs"


def test_the_fused_reference_fuses_every_adam_a_module_returns():
    """The ``(fused)`` flags' plain reference fused only a lone Adam/AdamW: a module returning ``[sgd, adam, adamw],
    [scheduler]`` was judged against unfused Adams while the strategy fuses each (``manual_3_optimizers``: 1 update
    off on a bias). Every Adam/AdamW returned is fused now; the SGD keeps its kernel."""
    from tests.conformance.cell import _fused_optimizers

    module = MODULES["manual_3_optimizers"].build()
    _fused_optimizers(module)
    (sgd, adam, adamw), _ = module.configure_optimizers()
    assert [g.get("fused") for o in (adam, adamw) for g in o.param_groups] == [True, True]
    assert not any(g.get("fused") for g in sgd.param_groups)


@pytest.mark.slow
def test_the_dry_run_row_measures_the_batch_it_predicts():
    """``MemoryReport`` predicts a step on the run's first batch; ``lstm_packed``'s batches pack different numbers of
    tokens, so its third step peaked 1.5 % above the prediction (the row said ``off``) with no op missed: the
    prediction equals the measured peak of a step on the first batch. The row measures every step on that batch."""
    from tests.conformance.dryrun import check

    row = check(MODULES["lstm_packed"], "plain@32-true")
    assert row["verdict"] == "ok" and row["error_device"] == 0, row


def test_screen_tries_a_family_that_ran_out_of_the_heap_again_alone(monkeypatch):
    """One child's heap grows with the families screened before it: a family refused an allocation after others is
    screened again in a fresh child of its own before it is listed as left out; other reasons stand as they are."""
    from tests.conformance import screen

    over = f"left out: over the screen's {screen.MEMORY_LIMIT >> 30} GiB heap cap (RLIMIT_DATA) at the generic ..."
    first = {"a": "screened: trains (1 params)", "b": over, "c": "left out: ValueError: needs pixel_values",
             "d": "left out: RuntimeError: could not create a primitive (torch/nn/modules/conv.py:560)"}
    calls = []

    def children(todo):
        calls.append(list(todo))
        return first if len(todo) > 1 else {todo[0].split(":")[0]: "screened: trains (2 params)"}

    monkeypatch.setattr(screen, "_screen", children)
    got = screen.screen([(t, "causal_lm") for t in "abcd"])
    assert calls == [["a:causal_lm", "b:causal_lm", "c:causal_lm", "d:causal_lm"], ["b:causal_lm"], ["d:causal_lm"]]
    assert got == {**first, "b": "screened: trains (2 params)", "d": "screened: trains (2 params)"}
