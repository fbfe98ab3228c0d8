"""The demo's compute precision, from a quick probe of this machine: bf16 where it is fast, fp32 where it is emulated.

    python -m lightning_lowmem.demo.probe     # prints bf16-true or 32-true (stdout), and why (stderr)

A CPU without native bf16 (no AVX-512 BF16 or AMX) emulates it: a bf16 matmul there runs about 10x slower than an
fp32 one, and the demo's bf16 training would take over an hour instead of minutes. ``make demo`` passes the probe's
answer as ``--trainer.precision``.
"""

from __future__ import annotations

import sys
import time

import torch

#: bf16 is used where its matmul takes at most this many times the fp32 one (native: about 0.1-1x; emulated: ~10x)
MAX_SLOWDOWN = 2.0


def _seconds(dtype: torch.dtype, budget: float = 0.2) -> float:
    """The fastest of repeated 256 x 512 x 512 matmuls in ``dtype`` (at least 3, for about ``budget`` seconds)."""
    a, b = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    a @ b  # NOTE: the first call pays the kernel's set-up
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < 3 or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        a @ b
        best, n = min(best, time.perf_counter() - t0), n + 1
    return best


def demo_precision() -> tuple[str, str]:
    """``("bf16-true" | "32-true", why)``: the demo's precision on this machine, with the measured times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: one thread: the kernels' speed, not how busy the other cores are
    try:
        fp32, bf16 = _seconds(torch.float32), _seconds(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    ratio = bf16 / fp32
    times = f"a bf16 matmul takes {ratio:.2f}x the fp32 one here ({bf16 * 1e3:.2f} vs {fp32 * 1e3:.2f} ms)"
    if ratio <= MAX_SLOWDOWN:
        return "bf16-true", f"{times}: native bf16, the demo trains in bf16-true"
    return "32-true", (f"{times}: this CPU emulates bf16 (no AVX-512 BF16 or AMX), so the demo trains in 32-true; "
                       "the memory report's GPU rows predict the bf16-true recipe on a GPU")


def main() -> int:
    precision, why = demo_precision()
    print(f"demo: {why}", file=sys.stderr, flush=True)
    print(precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
