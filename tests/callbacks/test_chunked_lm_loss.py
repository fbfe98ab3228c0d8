"""ChunkedLMLoss and chunked_causal_lm_loss: loss and gradients against the model's own ``labels=`` loss, memory."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem.callbacks.chunked_lm_loss import chunked_ce as _chunked_ce
from lightning_lowmem.callbacks.chunked_lm_loss.callback import (
    ChunkedLMLoss,
    chunked_causal_lm_loss,
    chunked_causal_lm_loss_sum,
    is_chunked,
)
from lightning_lowmem.demo.module import build_causal_lm
from lightning_lowmem.measure.tracker import MemoryTracker
from tests.helpers.models import random_batch, tiny_gpt2, tiny_llama

# Gradient tolerance in fp32: |chunked - model's own| <= GRAD_TOL * max|model's own| for every parameter. The two
# sum the same products in a different order (per chunk, then across chunks); observed <= 1.1e-6.
GRAD_TOL = 1e-5
BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def _padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right padding in row 1 (masked and ignored), an ignored prompt in row 0."""
    batch = random_batch(2, 32, seed=seed)
    batch["attention_mask"][1, -6:] = 0
    batch["labels"][1, -6:] = -100
    batch["labels"][0, :5] = -100
    return batch


def _assert_grads_close(model: torch.nn.Module, reference: torch.nn.Module, tol: float = GRAD_TOL) -> None:
    checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        scale = q.grad.abs().max().clamp(min=1e-12)
        assert (p.grad - q.grad).abs().max() <= tol * scale, name
        checked += 1
    assert checked > 0


def _reference_loss(hidden, weight, labels, bias=None, scale=None, softcap=None, reduction="mean"):
    logits = F.linear(hidden, weight, bias).to(torch.promote_types(hidden.dtype, torch.float32))
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits[..., :-1, :].flatten(0, -2), labels[..., 1:].flatten(), reduction=reduction)


# --- the function -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_function_matches_cross_entropy_in_float64(chunk, recompute):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9), generator=g)
    labels[0, 3] = labels[1, 0] = -100
    kw = {"scale": 0.7, "softcap": 2.5}
    ref = _reference_loss(hidden, weight, labels, bias, **kw)
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
    loss = chunked_causal_lm_loss(hidden, weight, labels, head_bias=bias, chunk_tokens=chunk,
                                  logit_scale=kw["scale"], logit_softcap=kw["softcap"], recompute=recompute)
    grads = torch.autograd.grad(loss * 0.3, (hidden, weight, bias))
    ref_grads = [g * 0.3 for g in ref_grads]  # a non-unit incoming gradient, as under accumulation
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gradients_in_forward_allow_one_backward_only():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, torch.randn(5, 3), torch.tensor([[1, 2, 3, 4]]), recompute=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*recompute=True"):
        loss.backward()


def test_function_passes_gradcheck():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 6, 0, 3]])

    def f(h, w, b):
        return chunked_causal_lm_loss(h, w, labels, head_bias=b, chunk_tokens=2, reduction="sum", logit_softcap=3.0)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_sum_and_count_are_token_exact():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 10, 8, generator=g)
    weight = torch.randn(13, 8, generator=g)
    labels = torch.randint(0, 13, (3, 10), generator=g)
    labels[2, 4:] = -100
    loss_sum, count = chunked_causal_lm_loss_sum(hidden, weight, labels, chunk_tokens=4)
    assert count.item() == (labels[:, 1:] != -100).sum().item() == 3 * 9 - 6
    torch.testing.assert_close(loss_sum, _reference_loss(hidden, weight, labels, reduction="sum"), rtol=1e-6, atol=0)
    mean = chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(mean, loss_sum / count, rtol=1e-7, atol=0)


def test_no_labelled_token_gives_zero_loss_and_zero_gradients():
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    labels = torch.full((1, 5), -100)
    loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=2)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_shift_false_takes_aligned_labels():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 6, 4, generator=g), torch.randn(9, 4, generator=g)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    aligned = F.pad(labels, (0, 1), value=-100)[..., 1:]
    torch.testing.assert_close(chunked_causal_lm_loss(hidden, weight, aligned, shift=False, chunk_tokens=3),
                               chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=5), rtol=1e-6, atol=0)


def test_half_precision_matches_upcast_reference():
    """bf16 hidden and head, as under ``precision="bf16-true"``: logits in bf16, softmax in fp32 (as Hugging Face)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 16, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(50, 32, generator=g) / 4).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (2, 16), generator=g)
    ref = _reference_loss(hidden, weight, labels)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=8)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32 and grads[0].dtype == grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)  # same bf16 logits, same fp32 softmax
    for got, want in zip(grads, ref_grads):
        # NOTE: bf16 gradients: one rounding per chunk of the weight's gradient (accumulated in bf16) vs one in all
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_autocast_matches_the_models_own_loss():
    """``precision="bf16-mixed"``: fp32 weights, the head's matmul in bf16 under autocast, as ``nn.Linear`` there."""
    torch.manual_seed(0)
    model = tiny_llama().train()
    reference = copy.deepcopy(model)
    batch = _padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(**batch).loss
    ref.backward()
    ChunkedLMLoss(chunk_tokens=9, backend="chunked").apply(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    assert loss.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.float32
    # NOTE: same bf16 inputs; the chunk's matmul may block differently from the full one (bf16 rounding of a logit)
    assert abs(loss.item() / ref.item() - 1) <= 1e-3
    _assert_grads_close(model, reference, tol=3e-2)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError, match=r"chunk_tokens=0.*backend='fast'"):
        chunked_causal_lm_loss(torch.randn(1, 3, 4), torch.randn(5, 4), torch.zeros(1, 3, dtype=torch.long),
                               chunk_tokens=0, backend="fast")
    with pytest.raises(ValueError, match=r"`head_weight` of shape \(5, 3\); expected \[vocab_size, 4\]"):
        chunked_causal_lm_loss(torch.randn(1, 3, 4), torch.randn(5, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`labels` of shape \(1, 2\); expected \(1, 3\)"):
        chunked_causal_lm_loss(torch.randn(1, 3, 4), torch.randn(5, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='none'"):
        chunked_causal_lm_loss(torch.randn(1, 3, 4), torch.randn(5, 4), torch.zeros(1, 3, dtype=torch.long),
                               reduction="none")
    with pytest.raises(TypeError, match=r"ChunkedLMLoss: passed `chunk_tokens=True`.*`backend=None`"):
        ChunkedLMLoss(chunk_tokens=True, backend=None)  # type: ignore[arg-type]


# --- backends -------------------------------------------------------------------------------------------------------
def test_auto_backend_is_ours_on_cpu(monkeypatch):
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: True)  # even with the kernels installed
    assert _chunked_ce.resolve_backend("auto", torch.device("cpu")) == "chunked"
    assert _chunked_ce.resolve_backend("auto", torch.device("cuda", 0)) == "liger"
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: name == "cut_cross_entropy")
    assert _chunked_ce.resolve_backend("auto", torch.device("cuda", 0)) == "cce"
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: False)
    assert _chunked_ce.resolve_backend("auto", torch.device("cuda", 0)) == "chunked"


def test_auto_backend_on_cpu_runs_our_autograd_function():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, torch.randn(5, 3), torch.tensor([[1, 2, 3, 4]]), backend="auto",
                                  reduction="sum")
    assert type(loss.grad_fn).__name__ == "_ChunkedLinearCrossEntropyBackward"


@pytest.mark.parametrize(("backend", "package"), [("liger", "liger_kernel"), ("cce", "cut_cross_entropy")])
def test_forcing_a_kernel_without_its_package_names_the_extra(backend, package):
    if _chunked_ce.package_available(package):
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ModuleNotFoundError, match=rf"`{package}`.*pip install 'lightning-lowmem\[kernels\]'"):
        ChunkedLMLoss(backend=backend)


def test_forcing_a_kernel_on_cpu_tensors_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"backend='liger'.*CUDA only.*backend='chunked'"):
        chunked_causal_lm_loss(torch.randn(1, 3, 4), torch.randn(5, 4), torch.zeros(1, 3, dtype=torch.long),
                               backend="liger")


def test_kernel_backend_receives_sum_reduction_and_folded_scale(monkeypatch):
    """The call into Liger: rows, head weight, aligned targets, ``reduction='sum'``, the scale folded into the rows.

    NOTE: no CUDA here, so the device check is bypassed and a stand-in module records the call; the kernels' own
    numerics are theirs. This checks what we hand them.
    """
    calls = {}

    def fused(h, w, t, **kwargs):
        calls.update(kwargs, h=h, w=w, t=t)
        return F.cross_entropy(F.linear(h, w, kwargs.get("bias")).float(), t, ignore_index=kwargs["ignore_index"],
                               reduction=kwargs["reduction"])

    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    fake = types.ModuleType("liger_kernel.transformers.functional")
    fake.liger_fused_linear_cross_entropy = fused  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", fake)
    monkeypatch.setattr(_chunked_ce, "_on_cuda", lambda t: True)
    hidden, weight = torch.randn(2, 5, 4), torch.randn(7, 4)
    labels = torch.tensor([[1, 2, 3, -100, 5], [6, 0, 1, 2, 3]])
    loss_sum, count = chunked_causal_lm_loss_sum(hidden, weight, labels, logit_scale=0.5, backend="liger")
    assert calls["reduction"] == "sum" and calls["ignore_index"] == -100 and "softcap" not in calls
    torch.testing.assert_close(calls["h"], hidden.reshape(-1, 4) * 0.5)
    assert calls["t"].tolist() == [2, 3, -100, 5, -100, 0, 1, 2, 3, -100]
    assert count.item() == 7
    torch.testing.assert_close(loss_sum, _reference_loss(hidden, weight, labels, scale=0.5, reduction="sum"))


# --- the callback on Hugging Face models ----------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
@pytest.mark.parametrize(("chunk", "recompute"), [(7, True), (4096, True), (7, False)])
def test_callback_matches_the_models_own_loss(model_type, chunk, recompute):
    torch.manual_seed(0)
    model = BUILDERS[model_type]().train()
    reference = copy.deepcopy(model)
    batch = _padded_batch()
    ref_out = reference(**batch)
    ref_out.loss.backward()
    callback = ChunkedLMLoss(chunk_tokens=chunk, backend="chunked", recompute=recompute)
    assert callback.apply(model) == [type(model).__name__] and is_chunked(model)
    out = model(**batch)
    out.loss.backward()
    assert out.logits is None
    assert abs(out.loss.item() / ref_out.loss.item() - 1) <= 1e-6
    assert out.num_tokens.item() == (batch["labels"][:, 1:] != -100).sum().item()
    torch.testing.assert_close(out.loss_sum, out.loss * out.num_tokens, rtol=1e-6, atol=0)
    _assert_grads_close(model, reference)
    if model_type == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: one gradient, both uses


def test_callback_leaves_eval_and_unlabelled_calls_untouched():
    torch.manual_seed(0)
    model = tiny_gpt2().train()
    reference = copy.deepcopy(model)
    ChunkedLMLoss(backend="chunked").apply(model)
    batch = _padded_batch()
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert torch.equal(model(**no_labels).logits, reference(**no_labels).logits)
    model.eval(), reference.eval()
    out, ref = model(**batch), reference(**batch)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)


def test_callback_honours_num_items_in_batch_shift_labels_and_tuples():
    torch.manual_seed(0)
    model = tiny_llama().train()
    reference = copy.deepcopy(model)
    ChunkedLMLoss(chunk_tokens=9, backend="chunked").apply(model)
    batch = _padded_batch()
    n = torch.tensor(100)
    torch.testing.assert_close(model(**batch, num_items_in_batch=n).loss,
                               reference(**batch, num_items_in_batch=n).loss, rtol=1e-6, atol=0)
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    plain = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(model(**plain, shift_labels=shifted, labels=batch["labels"]).loss,
                               reference(**batch).loss, rtol=1e-6, atol=0)
    as_tuple = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], return_dict=False)
    torch.testing.assert_close(as_tuple[0], reference(**batch).loss, rtol=1e-6, atol=0)


_BASE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize(("model_type", "config"), [
    ("gemma2", {**_BASE, "head_dim": 16, "final_logit_softcapping": 3.0}),
    ("cohere", {**_BASE, "logit_scale": 0.5}),
    ("granite", {**_BASE, "logits_scaling": 4.0}),
    ("mistral", _BASE),
    ("gpt_neox", {k: v for k, v in _BASE.items() if k != "num_key_value_heads"}),
])
def test_callback_reproduces_logit_post_processing(model_type, config):
    torch.manual_seed(0)
    model = build_causal_lm(model_type, config).train()
    reference = copy.deepcopy(model)
    batch = _padded_batch()
    ref = reference(**batch).loss
    ref.backward()
    ChunkedLMLoss(chunk_tokens=11, backend="chunked").apply(model)
    loss = model(**batch).loss
    loss.backward()
    assert abs(loss.item() / ref.item() - 1) <= 1e-6
    _assert_grads_close(model, reference)


def test_unknown_logit_post_processing_is_refused():
    from transformers import GPT2LMHeadModel

    class Doubled(GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out["logits"] = out.logits * 2
            return out

    model = Doubled(tiny_gpt2().config).train()
    ChunkedLMLoss(backend="chunked").apply(model)
    with pytest.raises(ValueError, match="cannot reproduce `Doubled`'s logits"):
        model(**_padded_batch())


def test_no_causal_lm_and_quantized_heads_are_refused():
    with pytest.raises(ValueError, match="found no Hugging Face causal LM in `Linear`"):
        ChunkedLMLoss().apply(torch.nn.Linear(2, 2))

    class Int8Linear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    model = tiny_gpt2()
    model.lm_head = Int8Linear(64, model.config.vocab_size, bias=False)
    with pytest.raises(ValueError, match="`Int8Linear`.*plain `nn.Linear`"):
        ChunkedLMLoss().apply(model)


def test_remove_and_deepcopy():
    model = tiny_gpt2().train()
    callback = ChunkedLMLoss(backend="chunked")
    callback.apply(model)
    clone = copy.deepcopy(model)
    assert is_chunked(clone)
    out = clone(**_padded_batch())  # the copy's hooks chunk the copy's loss
    assert out.logits is None and out.num_tokens > 0
    out.loss.backward()
    assert clone.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    callback.remove()
    assert not is_chunked(model) and is_chunked(clone)
    assert model(**_padded_batch()).logits is not None


# --- memory -----------------------------------------------------------------------------------------------------------
def _transient(tracker: MemoryTracker, *inputs: torch.Tensor) -> int:
    """Highest live bytes of the loss beyond its inputs and the gradients it returns for them.

    Activations + other at the peak of each phase (the weight and, re-tagged once autograd hands it over, the
    weight's gradient are their own categories; in each phase they are constant or only grow, so the phase's peak is
    where the loss's own bytes are highest), less the inputs (tracked as `other`) and one gradient per input that
    requires one (`other`, made in backward).
    """
    highest = max(p.by_category["activations"] + p.by_category["other"] for p in tracker.peaks.values())
    interface = sum(t.numel() * t.element_size() * (2 if t.requires_grad else 1) for t in inputs)
    return highest - interface


def _loss_transient_bytes(chunk: int | None, n: int = 512, hidden_size: int = 32, vocab: int = 2000,
                          recompute: bool = True) -> tuple[int, int]:
    """The loss's transient bytes (forward + backward), and the bytes of one row of fp32 logits."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, n, hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n), generator=g)
    tracker = MemoryTracker(module=head)
    with tracker:
        tracker.track([hidden, labels])
        with tracker.phase("forward"):
            if chunk is None:
                loss = _reference_loss(hidden, head.weight, labels)
            else:
                loss = chunked_causal_lm_loss(hidden, head.weight, labels, chunk_tokens=chunk, recompute=recompute)
        with tracker.phase("backward"):
            loss.backward()
    return _transient(tracker, hidden, labels), vocab * 4


@pytest.mark.parametrize(("chunk", "recompute"), [(32, True), (128, True), (32, False)])
def test_peak_is_at_most_two_chunks_of_logits_plus_their_gradient(chunk, recompute):
    transient, row_bytes = _loss_transient_bytes(chunk, recompute=recompute)
    logits_chunk = chunk * row_bytes  # one chunk of fp32 logits
    assert transient <= 3 * logits_chunk  # two chunks' logits + their gradient
    full, _ = _loss_transient_bytes(None)
    assert full >= 2 * 512 * row_bytes  # the unchunked loss keeps [tokens, vocab] logits and their log-softmax
    assert transient < full / 3


def test_gpt2_xl_loss_under_64_mib_on_fake_tensors():
    """GPT-2-XL's head at batch 4 x 1024 in bf16 on fake tensors: the loss's own memory at chunk_tokens=128."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        head = torch.nn.Linear(1600, 50257, bias=False, dtype=torch.bfloat16)
        hidden = torch.empty(4, 1024, 1600, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(4, 1024, dtype=torch.long)
        tracker = MemoryTracker(module=head)
        with tracker:
            tracker.track([hidden, labels])
            with tracker.phase("forward"):
                loss = chunked_causal_lm_loss(hidden, head.weight, labels, chunk_tokens=128)
            with tracker.phase("backward"):
                loss.backward()
    assert _transient(tracker, hidden, labels) <= 64 * 2**20


# --- Cut Cross-Entropy's limits: no bias, float16/bfloat16 only ----------------------------------------------------
def _stand_in_cce(monkeypatch, calls: dict) -> None:
    """A stand-in ``cut_cross_entropy`` recording the call (no CUDA here; the kernel's own numerics are its own)."""

    def linear_cross_entropy(e, c, targets, *, ignore_index, reduction, softcap=None, filter_eps="high"):
        calls.update(e=e, c=c, filter_eps=filter_eps)
        return F.cross_entropy(F.linear(e, c).float(), targets, ignore_index=ignore_index, reduction=reduction)

    fake = types.ModuleType("cut_cross_entropy")
    fake.linear_cross_entropy = linear_cross_entropy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", fake)
    monkeypatch.setattr(_chunked_ce, "_on_cuda", lambda t: True)


def test_auto_skips_cut_cross_entropy_for_a_biased_or_fp32_head(monkeypatch):
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: name == "cut_cross_entropy")
    cuda = torch.device("cuda", 0)
    assert _chunked_ce.resolve_backend("auto", cuda, bias=False, dtype=torch.bfloat16) == "cce"
    assert _chunked_ce.resolve_backend("auto", cuda, bias=True, dtype=torch.bfloat16) == "chunked"
    assert _chunked_ce.resolve_backend("auto", cuda, bias=False, dtype=torch.float32) == "chunked"
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: True)
    assert _chunked_ce.resolve_backend("auto", cuda, bias=True, dtype=torch.float32) == "liger"  # Liger takes both


def test_auto_with_a_biased_fp32_head_runs_ours_where_cut_cross_entropy_would_fail(monkeypatch):
    calls: dict = {}
    _stand_in_cce(monkeypatch, calls)
    monkeypatch.setattr(_chunked_ce, "package_available", lambda name: name == "cut_cross_entropy")
    rows, weight, bias, targets = torch.randn(6, 4), torch.randn(7, 4), torch.randn(7), torch.randint(0, 7, (6,))
    loss = _chunked_ce.linear_cross_entropy_sum(rows, weight, targets, bias=bias, backend="auto")
    assert not calls  # our chunked function, not the kernel
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(rows, weight, bias), targets, reduction="sum"))


def test_forced_cut_cross_entropy_refuses_a_bias_and_fp32_naming_both(monkeypatch):
    _stand_in_cce(monkeypatch, {})
    rows, weight, targets = torch.randn(6, 4), torch.randn(7, 4), torch.randint(0, 7, (6,))
    with pytest.raises(ValueError, match=r"backend='cce'.*has a bias.*takes none.*float32.*bfloat16.*backend='auto'"):
        _chunked_ce.linear_cross_entropy_sum(rows, weight, targets, bias=torch.randn(7), backend="cce")


def test_cut_cross_entropy_runs_with_its_gradient_filter_off(monkeypatch):
    """CCE's default ``filter_eps`` drops small gradient entries (other gradients than cross-entropy's): we pass None."""
    calls: dict = {}
    _stand_in_cce(monkeypatch, calls)
    rows, weight = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(7, 4, dtype=torch.bfloat16)
    _chunked_ce.linear_cross_entropy_sum(rows, weight, torch.randint(0, 7, (6,)), backend="cce")
    assert calls["filter_eps"] is None and calls["e"].dtype == torch.bfloat16


def test_forced_cut_cross_entropy_refuses_a_biased_head_at_apply(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", types.ModuleType("cut_cross_entropy"))
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8))
    model.lm_head = torch.nn.Linear(8, 11, bias=True)
    with pytest.raises(ValueError, match=r"LM head has a bias and backend='cce' was passed.*backend='auto'"):
        ChunkedLMLoss(backend="cce").apply(model)
