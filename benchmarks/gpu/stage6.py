"""Stage 6: the chunked LM loss's backends on a GPU, plus the slots kept for later work.

``chunked_loss``: the LM loss alone at GPT-2-XL's head shapes, the model's own loss against
``chunked_causal_lm_loss`` with each backend (ours, Liger Kernel, Cut Cross-Entropy): forward + backward time, the
loss's own device peak, and the error of loss and gradients against an fp32 reference. Planned slots (listed in the
results, not run yet): the micro-batch search under a real out-of-memory, DeepSpeed ZeRO.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from benchmarks.gpu.registry import Context, Entry

BACKENDS = ("model's own loss", "chunked", "liger", "cce")
_KERNEL_PACKAGES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def chunked_loss(ctx: Context) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_lowmem import chunked_causal_lm_loss

    b, s, h, v = (2, 32, 64, 512) if ctx.rehearsal else (4, 1024, 1600, 50257)
    reps = 2 if ctx.rehearsal else 10
    dev = ctx.device
    torch.manual_seed(0)
    hidden = torch.randn(b, s, h, device=dev).to(torch.bfloat16).requires_grad_()
    weight = (0.02 * torch.randn(v, h, device=dev)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (b, s), device=dev)
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)

    def own() -> torch.Tensor:  # Hugging Face's loss: bf16 logits upcast to fp32, cross-entropy
        logits = hidden @ weight.t()
        return F.cross_entropy(logits.float().view(-1, v), targets, ignore_index=-100)

    def kernel(name: str) -> Any:
        return lambda: chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=1024, backend=name)

    ref_h, ref_w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = F.cross_entropy((ref_h @ ref_w.t()).view(-1, v), targets, ignore_index=-100)
    ref.backward()
    ref_grads = (ref_h.grad, ref_w.grad)
    del ref_h, ref_w
    rows = []
    for name in BACKENDS:
        fn = own if name == "model's own loss" else kernel(name)
        package = _KERNEL_PACKAGES.get(name)
        if package and (ctx.rehearsal or importlib.util.find_spec(package) is None):
            found = importlib.util.find_spec(package)
            rows.append({"backend": name, "status": f"not run: {'Triton kernels need CUDA' if ctx.rehearsal else 'not installed'}"
                         f" ({package} {'found at ' + str(found.origin) if found else 'not found'})"})
            continue
        try:
            rows.append({"backend": name, "status": "ok", **_time_and_check(fn, hidden, weight, ref, ref_grads, reps)})
        except Exception as err:  # noqa: BLE001 - one backend's failure is recorded, the others still run
            rows.append({"backend": name, "status": f"error: {type(err).__name__}: {str(err)[:300]}"})
    failed = any(r["status"].startswith("error") for r in rows)
    figures = [{"figure": f"LM loss at GPT-2-XL's head (batch {b}x{s}), {r['backend']}: forward + backward",
                "gpu": f"{r['ms']} ms, peak {r['peak_bytes']} B, loss error {r['loss_rel_err']:.2g}", "dry_run": None,
                "cpu": None} for r in rows if r["status"] == "ok"]
    return {"status": "failed" if failed else "ok", "rows": rows, "figures": figures, "notes": [(
        f"loss alone at batch {b}x{s}, hidden {h}, vocab {v}, bf16 hidden and head weight on {dev}; forward + backward "
        f"median of {reps} (CUDA events) after 2 warm-ups (Triton compiles there); peak_bytes: the allocator's peak "
        "during one forward + backward above what was allocated before it; errors: relative L2 error against an fp32 "
        "reference (fp32 logits).")]}


def _time_and_check(fn: Any, hidden: Any, weight: Any, ref: Any, ref_grads: Any, reps: int) -> dict[str, Any]:
    import time

    import torch

    def step() -> Any:
        hidden.grad = weight.grad = None
        loss = fn()
        loss.backward()
        return loss

    cuda = hidden.is_cuda
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    peak = None
    if cuda:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        loss = step()

    def rel(a: Any, b: Any) -> float:
        return float((a.float() - b).norm() / b.norm())

    return {"ms": round(sorted(times)[len(times) // 2], 3), "peak_bytes": peak,
            "loss_rel_err": float(abs(loss.float() - ref) / ref), "grad_hidden_rel_err": rel(hidden.grad, ref_grads[0]),
            "grad_weight_rel_err": rel(weight.grad, ref_grads[1])}


ENTRIES = [
    Entry("chunked_loss", 120, chunked_loss, "LM loss at GPT-2-XL's head: ours vs Liger vs CCE (time, peak, error)",
          fresh=True),
    Entry("micro_batch_search", 0, None, "AccumulationScheduler(micro_batch_size='auto') against a real CUDA OOM",
          planned="the search's CUDA path (allocator peaks, out-of-memory recovery) has no GPU figure yet"),
    Entry("deepspeed_zero", 0, None, "lowmem_zero* presets on the GPU",
          planned="DeepSpeed ships as an sdist whose ops compile with nvcc there: a later stage carries and builds it"),
]
