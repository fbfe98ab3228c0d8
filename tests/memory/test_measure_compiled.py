"""MemoryTracker around a ``torch.compile``-d function: the compiled code runs as it does untracked.

A ``TorchDispatchMode`` that does not ignore compile internals makes dynamo skip every frame while it is on the stack,
so a compiled submodule would run eagerly (other kernels, other rounding) in MemoryReport's sampled steps only. The
tracker's mode ignores them: dynamo compiles and runs the compiled artifact, whose allocations the tracker still sees.
"""

from __future__ import annotations

import torch

from lightning_lowmem.measure.tracker import MemoryTracker


def test_a_compiled_function_is_compiled_and_its_output_counted_under_the_tracker():
    compiled: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    fn = torch.compile(lambda x: (x.sin() * 2).cos() + 1, backend=backend, dynamic=False)
    x = torch.randn(32, 64)
    torch.compiler.reset()
    try:
        tracker = MemoryTracker(module=None)
        with tracker:
            tracker.track(x)
            with tracker.phase("forward"):
                out = fn(x)
        assert compiled, "dynamo skipped the compiled frame under the tracker (it ran eagerly)"
        assert torch.equal(out, fn(x))
        assert tracker.peak_bytes >= x.nbytes + out.nbytes  # the compiled code's output is counted
    finally:
        torch.compiler.reset()
