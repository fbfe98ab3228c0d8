"""The LM head's cross-entropy over chunks of tokens (never more than one chunk's logits alive): ours (any device),
or Liger Kernel's / Apple's Cut Cross-Entropy (Triton, CUDA only; the ``kernels`` extra)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from typing_extensions import override

from lightning_lowmem.core.optional import package_available, require

Backend = Literal["auto", "chunked", "liger", "cce"]
BACKENDS = ("auto", "chunked", "liger", "cce")
#: backend -> (import name, what to import from it)
_KERNELS = {"liger": ("liger_kernel", "liger_kernel.transformers.functional"), "cce": ("cut_cross_entropy", "cut_cross_entropy")}


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on, else the inputs' (as ``nn.Linear``)."""
    device_type = hidden.device.type
    if device_type in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, compute: torch.dtype, acc: torch.dtype,
                  scale: float | None, softcap: float | None) -> torch.Tensor:
    """One chunk's logits in the accumulation dtype (fp32, or fp64 for a fp64 model), post-processed."""
    h = h.to(compute)
    z = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    # NOTE: the half-precision matmul output is freed when `z` is rebound to its fp32 copy: 1.5 chunks at the peak
    z = z.to(acc)
    if scale is not None:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


class _Gradients:
    """The gradients of hidden, weight and bias, accumulated chunk by chunk from each chunk's logit gradients."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w: torch.Tensor,
                 needs: tuple[bool, bool, bool], compute: torch.dtype, acc: torch.dtype) -> None:
        self.hidden, self.weight, self.bias, self.w, self.compute = hidden, weight, bias, w, compute
        self.need_h, self.need_w, self.need_b = needs
        self.h = torch.empty_like(hidden) if self.need_h else None
        self.wt: torch.Tensor | None = None
        self.b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if self.need_b else None

    def add(self, s: int, e: int, p: torch.Tensor) -> None:
        """``p``: d loss / d logits of rows ``s:e`` in the accumulation dtype (consumed)."""
        if self.b is not None:
            self.b += p.sum(dim=0)
        g = p.to(self.compute)
        del p
        if self.h is not None:
            if self.h.dtype == self.compute:
                torch.mm(g, self.w, out=self.h[s:e])
            else:
                self.h[s:e].copy_(g @ self.w)
        if self.need_w:
            h = self.hidden[s:e].to(self.compute)
            if self.wt is None:
                self.wt = g.t() @ h
            else:
                self.wt.addmm_(g.t(), h)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        wt = self.wt
        if self.need_w and wt is None:  # no rows at all
            wt = torch.zeros_like(self.weight)
        return (self.h, None if wt is None else wt.to(self.weight.dtype),
                None if self.b is None else self.b.to(self.bias.dtype))


def _logit_grad_(p: torch.Tensor, safe: torch.Tensor, coef: torch.Tensor, dcap: torch.Tensor | None) -> torch.Tensor:
    """Softmax ``p`` of a chunk -> d loss / d logits, in place: ``coef * (p - onehot) * softcap'``."""
    p.scatter_add_(1, safe[:, None], p.new_full((p.size(0), 1), -1.0))
    p.mul_(coef[:, None])
    if dcap is not None:
        p.mul_(dcap)
    return p


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropies of ``hidden @ W^T`` over chunks of rows; logits recomputed per chunk in backward.

    Saved: ``hidden``, ``weight``, ``bias`` (references), the targets and each row's log-sum-exp. The weight's
    gradient accumulates over chunks in the compute dtype (NOTE: an fp32 accumulator would be V x H fp32, more than
    the chunking saves). ``recompute=False`` (Liger's schedule): the gradients are computed in forward and held until
    backward scales them by the incoming scalar: no second head matmul.
    """

    @staticmethod
    @override
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int, chunk: int, compute: torch.dtype,
                scale: float | None, softcap: float | None, recompute: bool) -> torch.Tensor:
        acc = torch.promote_types(compute, torch.float32)
        n = hidden.size(0)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        early = not recompute and any(ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            b = None if bias is None else bias.to(compute)
            lse = torch.empty(n, dtype=acc, device=hidden.device)
            total = torch.zeros((), dtype=acc, device=hidden.device)
            grads = _Gradients(hidden, weight, bias, w, ctx.needs_input_grad[:3], compute, acc) if early else None
            coef = valid.to(acc) * (1.0 if scale is None else scale)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _chunk_logits(hidden[s:e], w, b, compute, acc, scale, softcap)
                target_logit = z.gather(1, safe[s:e, None]).squeeze(1)
                dcap = (z / softcap).square_().neg_().add_(1) if early and softcap is not None else None
                # NOTE: log-sum-exp in place on the chunk (torch.logsumexp would allocate two more chunk-sized temporaries)
                m = z.amax(dim=1, keepdim=True)
                sumexp = z.sub_(m).exp_().sum(dim=1)
                chunk_lse = sumexp.log().add_(m.squeeze(1))
                if grads is not None:
                    grads.add(s, e, _logit_grad_(z.div_(sumexp[:, None]), safe[s:e], coef[s:e], dcap))
                del z, dcap
                lse[s:e] = chunk_lse
                total += torch.where(valid[s:e], chunk_lse - target_logit, 0).sum()
        ctx.early = grads.result() if grads is not None else None
        if grads is None:
            ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.settings = (chunk, compute, acc, scale, softcap, recompute)
        return total

    @staticmethod
    @override
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        chunk, compute, acc, scale, softcap, recompute = ctx.settings
        none = (None,) * 7
        if not recompute:
            if ctx.early is None:
                raise RuntimeError(
                    "chunked_causal_lm_loss(recompute=False) computed its gradients in forward and handed them to the "
                    "first backward; a second backward through the same loss (retain_graph) needs recompute=True."
                )
            early, ctx.early = ctx.early, None
            # NOTE: in place: these buffers are the gradients handed to autograd (no second weight-sized copy)
            return (*(None if g is None else g.mul_(grad_out.to(acc)) for g in early), *none)
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        n = hidden.size(0)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            b = None if bias is None else bias.to(compute)
            grads = _Gradients(hidden, weight, bias, w, ctx.needs_input_grad[:3], compute, acc)
            # d loss / d logit_ij = g * valid_i * (softmax_ij - onehot_ij) * scale * softcap'(.)
            coef = valid.to(acc) * grad_out.to(acc) * (1.0 if scale is None else scale)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _chunk_logits(hidden[s:e], w, b, compute, acc, scale, softcap)
                dcap = None if softcap is None else (z / softcap).square_().neg_().add_(1)
                p = z.sub_(lse[s:e, None]).exp_()
                grads.add(s, e, _logit_grad_(p, safe[s:e], coef[s:e], dcap))
                del z, p, dcap
            return (*grads.result(), *none)


def resolve_backend(backend: str, device: torch.device, *, bias: bool = False,
                    dtype: torch.dtype | None = None) -> str:
    """``"auto"``: Liger, else Cut Cross-Entropy, where installed, on CUDA and able to take the head; else ours."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        for name, (package, _) in _KERNELS.items():
            if package_available(package) and not (name == "cce" and cce_limits(bias, dtype)):
                return name
    return "chunked"


def cce_limits(bias: bool, dtype: torch.dtype | None) -> list[str]:
    """What Cut Cross-Entropy (25.1) cannot do for this head: its ``linear_cross_entropy`` takes no bias, and its
    backward kernel asserts float16/bfloat16 embeddings and classifier (an fp32 head fails inside backward)."""
    limits = []
    if bias:
        limits.append("the LM head has a bias (Cut Cross-Entropy's linear_cross_entropy takes none)")
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        limits.append(f"the head computes in {dtype} (Cut Cross-Entropy runs only in float16/bfloat16: use a "
                      "'bf16-mixed' or '16-mixed' precision)")
    return limits


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def require_kernel(backend: str, feature: str) -> Any:
    """Import the backend's package, or raise ``ModuleNotFoundError`` naming the ``kernels`` extra."""
    package, module = _KERNELS[backend]
    require(package, feature)
    return require(module, feature)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             bias: torch.Tensor | None = None, ignore_index: int = -100, chunk_tokens: int = 1024,
                             scale: float | None = None, softcap: float | None = None,
                             backend: str = "chunked", recompute: bool = True) -> torch.Tensor:
    """Sum over rows of ``CE(softcap(scale * (hidden @ weight^T + bias)), targets)``, rows ``[N, H]``, targets ``[N]``
    (ours sums in fp32, fp64 for fp64; the kernels return their own dtype)."""
    dtype = compute_dtype(hidden, weight)
    name = resolve_backend(backend, hidden.device, bias=bias is not None, dtype=dtype)
    if name == "chunked":
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, chunk_tokens,
                                                dtype, scale, softcap, recompute)
    if not _on_cuda(hidden):
        raise ValueError(
            f"Passed `backend={backend!r}` with tensors on `{hidden.device}`; the {name} kernels are Triton (CUDA "
            "only). Use backend='auto' (ours off CUDA) or backend='chunked'."
        )
    if name == "cce" and (limits := cce_limits(bias is not None, dtype)):
        raise ValueError(f"Passed `backend='cce'`, but {'; and '.join(limits)}. Use backend='auto' (Liger or ours "
                         "where Cut Cross-Entropy cannot run), 'liger' or 'chunked'.")
    kernels = require_kernel(name, f"ChunkedLMLoss(backend={name!r})")
    # NOTE: neither kernel takes a logit scale; scale * (h @ W^T) == (scale * h) @ W^T, and the bias is scaled too
    h = hidden.to(dtype) if scale is None else hidden.to(dtype) * scale
    w = weight.to(dtype)
    b = None if bias is None else (bias.to(dtype) if scale is None else bias.to(dtype) * scale)
    kwargs: dict[str, Any] = {"ignore_index": ignore_index, "reduction": "sum"}
    if softcap is not None:
        kwargs["softcap"] = softcap
    if b is not None:
        kwargs["bias"] = b
    if name == "liger":
        out = kernels.liger_fused_linear_cross_entropy(h.contiguous(), w, targets.contiguous(), **kwargs)
    else:
        # NOTE: Cut Cross-Entropy's default `filter_eps` drops small softmax entries' gradients; None: exact
        out = kernels.linear_cross_entropy(h, w, targets, filter_eps=None, **kwargs)
    return out[0] if isinstance(out, tuple) else out
