"""Weights and buffers after a run, and the verdict of a technique's run against plain Lightning's.

Three kinds of comparison, chosen per flag (``flags.py`` says which and why):

- ``exact``: the same maths at the same precision: every parameter and buffer ``torch.equal``.
- ``reorder``: the same maths at the same precision in another rounding order (a weighted sum rescaled, a chunked
  sum, a fused or vectorised optimizer kernel, DeepSpeed's flat buckets). ``close`` when every tensor's difference
  is at most its rounding bound times its scale (L2 norms, ``|T - R| <= b * scale``). Why each bound is what it is:

  * a parameter's scale is the update training made to it, ``|R - W0|``: two orders of the same fp32 maths differ by
    a few ulps per operation (``eps`` = 1.2e-7 relative), and an optimizer step turns a relative gradient error
    ``d`` into a relative update error of at most ``d`` (SGD: linear; Adam's ``m / sqrt(v)``: at most ``d``, less
    where the step is sign-like). ``REORDER_BOUND`` (1e-3) leaves a margin of ~1e3 over a few ulps per element for
    the three steps' compounding (a later step's gradient is taken at weights that already differ);
  * a gradient that is a SUM of terms that cancel: the sum's rounding error is ~``eps`` times its largest terms
    (``eps * sum |t|``), not its result, so relative to the tensor's own gradient it grows as
    ``CANCELLATION * max_t |g_t| / |g_t|`` (first-backward gradient norms of plain Lightning's run, the largest
    gradient of the model standing for the largest terms; ``CANCELLATION`` = 8 ``eps``). This is why, for example,
    ZeRO-3's reduction order on a key-projection bias under rotary embeddings (hf_qwen2: 1.02e-3 of its update,
    gradient 5.5e3 times smaller than the model's largest) is ``close`` at its own bound 5.5e-3 and not at 1e-3. A
    gradient that cancels to rounding noise (a conv bias before BatchNorm, a key bias under softmax without rotary
    embeddings) gets an unbounded ``b``: such a tensor is trained by noise, which Adam scales up to full steps, and
    is checked for finiteness only;
  * a BUFFER is not trained: its "update" is not the scale of its rounding. A BatchNorm running statistic is an
    average of the batch statistics of the layer's input ``x``; two runs whose weights differ by ``dW`` (within
    their bounds) see inputs differing by ``|dx| / |x| <~ sum over the layers below of |dW| / |W|``, and ``|dW| / |W|`` is the
    parameter's bound times ``|W - W0| / |W|``, well under 1 in three steps: so ``REORDER_BOUND`` holds for the
    running statistics too (raised only by the calibration below, not by an upstream parameter's own bound, which
    would let a statistic updated twice pass). The running mean's
    difference is at most ``b`` times the scale of ``x`` (its running standard deviation), and the running variance's
    (a mean of squares: ``|d var| / var <~ 2 |dx| / |x|``) at most ``2b`` times the variance itself: the scale of a
    running mean is the larger of its update and the running std, that of a running variance the larger of its update
    and twice its own norm (the update alone cancels: a variance near its initial 1 moves by ``momentum * (var - 1)``, a
    mean near 0 by noise). The running mean's rounding as a mean over the batch is ``eps`` times the std, far inside;
  * a module that amplifies rounding (deep BatchNorm nets over tiny batches: a one-ulp nudge of their initial
    weights moves some tensors by most of their update) gets ``SENSITIVITY`` times that measured amplification as
    its bound (:func:`calibrated`, from plain Lightning's own nudged run; ``SENSITIVITY`` = 10: a reordering rounds
    at every op of every step, the nudge once, at the start).

  A lost or doubled contribution moves a sizeable fraction of the update, a buffer updated twice moves by the
  momentum's share of the batch statistic: both stay far outside these bounds (``test_harness.py`` plants them).
- ``precision``: a half-precision technique against plain Lightning at that precision, where the two round at other
  places (fp32 master weights against half weights, DeepSpeed's bf16 against Lightning's bf16-true). Both are
  measured against the fp32 run of the same module (same optimizer, accumulation and callbacks): ``close`` when the
  technique's distance from it is at most ``PRECISION_FACTOR`` times plain Lightning's own at that precision over the
  whole model and ``PRECISION_FACTOR_TENSOR`` times for any one tensor (plus the reorder allowance): the technique may
  not be less exact than the precision the user chose already is. Plain Lightning's own distance is one sample of
  the precision's noise, and on a small tensor a lucky one: two bf16 runs that round at other places are two
  samples, and under Adam an element whose gradient is within half-precision noise of zero takes a full step either
  way. So the precision's own distance is taken as the larger of two samples: plain's run and plain's run from
  weights nudged by one ulp OF THAT PRECISION (one rounding decision flipped, :func:`cell.sensitivity`). Measured on
  hf_bart (``lowmem_zero2@bf16-mixed``, DeepSpeed's bf16 against bf16-true): ``encoder.layers.1.fc2.bias`` is 3.2e-4
  from the fp32 run in plain bf16-true, 3.9e-3 in plain bf16-true nudged by one bf16 ulp, 3.9e-3 under DeepSpeed:
  the 11x of the first sweep was plain's lucky sample, not DeepSpeed. ``PRECISION_FACTOR`` (2, whole model) and
  ``PRECISION_FACTOR_TENSOR`` (4, any tensor: a bias of 32 counts few elements) are margins over that estimate, not
  derived from a rounding model. Under Adam each tensor is also allowed ``2 * lr``: one element one step either way
  (Adam's update is ``lr * m / sqrt(v)``, a full ``lr`` whatever the gradient's size, so a gradient within rounding of
  zero moves its element by ``lr`` in the direction rounding picks: the smallest difference a half-precision run can
  make, which two samples need not show; measured: Marian's decoder LayerNorm bias under DeepSpeed's bf16 is 4.02e-3
  from the fp32 run, 2 lr = 4e-3, plain bf16-true 3.6e-4). A lost gradient or a missed update moves a tensor by its
  whole update (``lr * sqrt(n)`` per step, ``n`` its elements), beyond both for any tensor of more than a few elements.

Integer buffers (``num_batches_tracked``) must be equal in every kind; a non-finite value is ``differs``. Note that
Adam's update ``m / sqrt(v)`` does not see a gradient scaled the same way at every step: the corpus holds SGD modules
for that (``test_harness.py`` shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

REORDER_BOUND = 1e-3
PRECISION_FACTOR = 2.0  # the whole model (root of the summed squares)
PRECISION_FACTOR_TENSOR = 4.0  # any one tensor: small tensors (a bias of 8) fluctuate more
CANCELLATION = 1e-6  # fp32 rounding (eps 1.2e-7) of a gradient's largest terms, with a margin of 8
SENSITIVITY = 10.0  # a reordering rounds at every op of every step; the nudge once, at the start

State = dict[str, Tensor]


def capture(module: torch.nn.Module, params: dict[str, Tensor] | None = None) -> State:
    """Every parameter (fp32 copies; ``params`` overrides, e.g. DeepSpeed's gathered fp32 masters) and buffer."""
    state: State = {}
    for name, p in module.named_parameters():
        value = params[name] if params is not None and name in params else p.detach()
        state[f"param:{name}"] = value.float().clone() if value.is_floating_point() else value.clone()
    for name, b in module.named_buffers():
        state[f"buffer:{name}"] = b.detach().float().clone() if b.is_floating_point() else b.detach().clone()
    return state


@dataclass
class Verdict:
    verdict: str  # exact | close | differs
    detail: str
    measured: float | None = None


def _norm(t: Tensor) -> float:
    return float(t.double().norm())


def _structural(got: State, want: State) -> str | None:
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    if missing or extra:
        return f"state keys differ: missing {missing[:4]}, unexpected {extra[:4]}"
    for key, b in want.items():
        a = got[key]
        if a.shape != b.shape:
            return f"{key}: shape {tuple(a.shape)} vs plain {tuple(b.shape)}"
        if a.is_floating_point() and not bool(torch.isfinite(a).all()) and not torch.equal(a, b):
            # NOTE: a non-finite value plain Lightning holds too (an attention mask buffer of -inf) is no failure
            return f"{key}: non-finite values after training (plain: {'finite' if torch.isfinite(b).all() else 'not finite'})"
        if not a.is_floating_point() and not torch.equal(a, b):
            return f"{key}: {a.tolist() if a.numel() < 5 else '...'} vs plain {b.tolist() if b.numel() < 5 else '...'}"
    return None


def _worst(rows: list[tuple[float, str]]) -> tuple[float, str]:
    return max(rows, default=(0.0, "-"))


def bounds(grad_norms: dict[str, float]) -> dict[str, float]:
    """The reorder bound of each parameter (state key), from plain Lightning's first-backward gradient norms."""
    top = max(grad_norms.values(), default=0.0)
    return {f"param:{k}": max(REORDER_BOUND, CANCELLATION * top / v) if v > 0 else float("inf")
            for k, v in grad_norms.items()}


def calibrated(bound: dict[str, float], nudged: State, want: State, initial: State) -> dict[str, float]:
    """``bound`` raised to ``SENSITIVITY`` times what a one-ulp nudge of the initial weights moves each tensor (in
    plain Lightning's own run), for the tensors training moves: the module's own amplification of rounding."""
    out = dict(bound)
    for k in want:
        if k in nudged and want[k].is_floating_point() and (k not in initial or not torch.equal(want[k], initial[k])):
            own = _relative(nudged, want, initial, k)
            if own > 0:
                out[k] = max(out.get(k, REORDER_BOUND), SENSITIVITY * own)
    return out


def compare(got: State, want: State, initial: State, kind: str, reason: str = "", *,
            want_fp32: State | None = None, precision: str = "", bound: dict[str, float] | None = None,
            want_nudged: State | None = None, adam_step: float = 0.0) -> Verdict:
    """The verdict of ``got`` (technique) against ``want`` (plain Lightning), both trained from ``initial``;
    ``bound``: each parameter's reorder bound (:func:`bounds`; ``REORDER_BOUND`` for any other tensor);
    ``want_nudged``: plain Lightning at the same precision from weights nudged by one ulp of it (``precision``);
    ``adam_step``: the plain run's Adam learning rate (``precision``: one element's step either way, see above)."""
    bound = bound or {}
    problem = _structural(got, want)
    if problem:
        return Verdict("differs", problem)
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    if not unequal:
        return Verdict("exact", "every parameter and buffer torch.equal to plain Lightning")
    n = f"{len(unequal)}/{len(want)} tensors differ"
    if kind == "exact":
        worst, worst_key = _worst([(_relative(got, want, initial, k), k) for k in unequal])
        return Verdict("differs", f"expected bit-identical; {n}; worst {worst_key}: |diff|/|update| = {worst:.3g}", worst)
    noise = sorted(k for k in unequal if bound.get(k, REORDER_BOUND) >= 1.0)
    note = (f"; {len(noise)} tensor(s) checked for finiteness only (a numerically zero gradient, or moved by a one-ulp "
            "nudge of the initial weights about as much as by training) "
            f"({', '.join(k.split(':', 1)[1] for k in noise[:3])}{', ...' if len(noise) > 3 else ''})" if noise else "")
    rows = [(_relative(got, want, initial, k), bound.get(k, REORDER_BOUND), k) for k in unequal if k not in noise]
    ratio, rel, b, key = max(((r / b, r, b, k) for r, b, k in rows), default=(0.0, 0.0, REORDER_BOUND, "-"))
    if kind == "reorder":
        at = f"{key}: |diff|/|update| = {rel:.2g}, bound {b:.2g}"
        if ratio <= 1.0:
            return Verdict("close", f"worst {at}; {n}{note}; {reason}", rel)
        return Verdict("differs", f"beyond the rounding bound at {at}; {n}{note}", rel)
    if kind != "precision" or want_fp32 is None:
        raise ValueError(f"unknown comparison {kind!r} (or no fp32 run for 'precision')")
    return _precision(got, want, want_fp32, initial, bound, noise, precision, reason, f"{n}{note}", rel, want_nudged,
                      adam_step)


def _precision(got: State, want: State, want_fp32: State, initial: State, bound: dict[str, float], noise: list[str],
               precision: str, reason: str, n: str, worst: float, want_nudged: State | None = None,
               adam_step: float = 0.0) -> Verdict:
    rows, ours_total, bound_total = [], 0.0, 0.0
    for k in want:
        # NOTE: every tensor with an unbounded ``b``, not only the unequal ones (``noise``): an equal one would add an
        # infinite (or, untrained, nan) allowance and void the whole-model bound
        if (not want[k].is_floating_point() or k in noise or bound.get(k, REORDER_BOUND) >= 1.0
                or not bool(torch.isfinite(want[k]).all())):  # NOTE: non-finite: equal to plain (`_structural`)
            continue
        ours = _norm(got[k] - want_fp32[k])
        plains = _norm(want[k].float() - want_fp32[k])
        if want_nudged is not None and k in want_nudged:  # the larger of the precision's two samples of noise
            plains = max(plains, _norm(want_nudged[k].float() - want_fp32[k]))
        allowance = bound.get(k, REORDER_BOUND) * _norm(want_fp32[k] - initial[k].float()) if k in initial else 0.0
        ours_total += ours**2
        bound_total += (plains + allowance) ** 2
        limit = PRECISION_FACTOR_TENSOR * plains + allowance + 2 * adam_step  # NOTE: one element, Adam's step each way
        rows.append((ours / limit if limit > 0 else (0.0 if ours == 0 else float("inf")), k, ours, plains))
    ratio, key, ours, plains = max(rows, default=(0.0, "-", 0.0, 0.0))
    model = (ours_total / bound_total) ** 0.5 if bound_total > 0 else (0.0 if ours_total == 0 else float("inf"))
    measured = (f"whole model {model:.2f}x plain {precision}'s distance from the fp32 run (bound {PRECISION_FACTOR:g}x); "
                f"worst tensor {key}: |ours - fp32| = {ours:.3g}, |plain - fp32| = {plains:.3g} "
                f"({ratio:.2f} of its limit {PRECISION_FACTOR_TENSOR:g}x plain's"
                + (f" + one element's Adam step each way, 2 lr = {2 * adam_step:.2g})" if adam_step else ")"))
    if ratio <= 1.0 and model <= PRECISION_FACTOR:
        return Verdict("close", f"{measured}; vs plain {precision}: max |diff|/|update| {worst:.2g}; {n}; {reason}",
                       model)
    return Verdict("differs", f"further from the fp32 run than plain {precision}: {measured}; {n}", model)


def _relative(got: State, want: State, initial: State, k: str) -> float:
    """|got - want| / |want - initial|, infinite where training did not move the tensor but the runs differ; a
    BatchNorm running mean against the running standard deviation, a running variance against itself, where that is
    larger (the scale of a running statistic is the scale of what it averages: see the module's doc)."""
    update = _norm(want[k].float() - initial[k].float()) if k in initial else _norm(want[k])
    if k.endswith("running_mean") and k.replace("running_mean", "running_var") in want:
        update = max(update, _norm(want[k.replace("running_mean", "running_var")].float().clamp(min=0).sqrt()))
    elif k.endswith("running_var"):
        update = max(update, 2 * _norm(want[k]))  # NOTE: |d var| / var <~ 2 |dx| / |x|: twice the mean's allowance
    diff = _norm(got[k].float() - want[k].float())
    return diff / update if update > 0 else float("inf")


def compare_values(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """Observables a Lightning callback decides with (chosen LR, batch size, stopped epoch, logged LRs): equal or a
    message naming the first difference."""
    for key in sorted(want.keys() | got.keys()):
        if got.get(key) != want.get(key):
            return f"{key}: {got.get(key)!r} vs plain {want.get(key)!r}"
    return None
