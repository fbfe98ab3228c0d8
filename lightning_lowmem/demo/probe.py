"""The demo's precision and threads, from a quick probe of this machine (``make demo`` passes the answers).

    python -m lightning_lowmem.demo.probe     # prints e.g. "bf16-true 1" (stdout), and why (stderr)

bf16 where the CPU has it natively (emulated it is ~10x slower than fp32); torch's threads only where they speed the
demo's small matmuls up (on a busy machine they spin waiting for each other).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

#: bf16 is used where its matmul takes at most this many times the fp32 one (native: about 0.1-1x; emulated: ~10x)
MAX_SLOWDOWN = 2.0
#: all of torch's threads are used where they make the median matmul at least this much faster than one thread
MIN_SPEEDUP = 1.3


def _seconds(dtype: torch.dtype, pick: Any = min) -> float:
    """``pick`` (the fastest; or the median) of repeated 256 x 512 x 512 matmuls in ``dtype`` (5 or more, ~0.2 s)."""
    a, b = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    a @ b  # NOTE: the first call pays the kernel's set-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < 0.2:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return pick(times)


def demo_threads() -> tuple[int, str]:
    """``(threads, why)``: torch's threads where they make the median fp32 matmul ``MIN_SPEEDUP`` faster, else one."""
    many = torch.get_num_threads()
    if many == 1:
        return 1, "one thread (torch's)"
    torch.set_num_threads(1)
    try:
        one = _seconds(torch.float32, pick=statistics.median)
    finally:
        torch.set_num_threads(many)
    all_ = _seconds(torch.float32, pick=statistics.median)
    times = f"{many} threads take {all_ / one:.2f}x one thread's time per matmul here"
    if one / all_ >= MIN_SPEEDUP:
        return many, f"{times}: {many} threads"
    return 1, f"{times} (the cores are busy or few): one thread"


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
    (precision, why), (threads, how) = demo_precision(), demo_threads()
    print(f"demo: {why}; {how}", file=sys.stderr, flush=True)
    print(precision, threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
