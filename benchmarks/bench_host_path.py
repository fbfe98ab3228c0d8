"""``lowmem_offload`` host path: the serial host step against ``host_pass="overlap"`` and ``"delayed"`` and the step in
backward on the autograd thread against the host worker, side by side (CPU).

A GPT-2-architecture ``CausalLMModule`` of about ``--layers`` x 7.1M parameters (14 x 768 wide: ~100M) trains on a
tiny batch through ``Trainer.fit``, fits interleaved round after round:

- plain Lightning at the same precision (``strategy="auto"``), the reference step time;
- ``lowmem_offload`` with ``host_pass="serial"`` and ``"overlap"`` (each bucket uploaded into its compute weights as
  it steps during backward; and, for comparison, with that upload left to the step as before), without clipping, with a norm clip that does
  not trigger (``gradient_clip_val=1e9``: the clip and the non-finite guard still read every gradient) and with a
  value clip of 1e9 (the clamp reads and writes every gradient; a smaller value costs the same);
- both again at ``16-mixed`` (fp16 loss scaling: the unscale reads and writes every gradient); the steps the scaler
  skips for an overflow at its first scales are counted, not timed as the pass's;
- both again at ``bf16-true`` on the CUDA transfer logic, run on the CPU by the deferred stand-in (``DeferredOps``,
  copies done as they are queued): gradients come through staging slots, and the upload rounds each master into its
  slot, then copies the slot into the compute weight; the overlap rounds each bucket into the slots as it steps;
- ``optimizer_in_backward`` on the stand-in with the step in the gradient hook (the autograd thread) and on the host
  worker, and on the plain CPU path (in the hook);
- ``host_pass="delayed"`` (the step on a worker during the next window's forward and backward: one step stale, so
  timed, not compared), at ``32-true`` and on the stand-in.

Per step: **host work after backward** (from the end of autograd's backward, when the strategy's drain starts, to
the return of the strategy's ``optimizer_step``, the upload of the new weights included) and the step time. The
**fused AdamW kernel alone** (``torch.optim.AdamW(fused=True).step()`` over tensors of the model's shapes, state
built) is timed in the same rounds: the host work is reported as a fraction of it. **Bytes touched per parameter**
are counted from the passes the code makes (fp32 unless said): fold = read the staged gradient + write the buffer
(or add: read both), guard/clip norms = read the gradient, AdamW = read p, g, m, v + write p, m, v, the pass's copy
= read + write p, m, v, upload = read the master + write the compute weight, value clip = torch's two in-place
clamps (serial: read + write twice) or the pass's clamped copy (read + write once).

Run from the repository root: ``python benchmarks/run.py host_path`` (``--layers 14 --width 768 --seq 32 --batch 1
--rounds 3 --steps 6``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import add_int_args, bench_trainer, lm_batches, upload_at_step, write_results
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload.host_pass import HostPass
from lightning_lowmem.strategies.offload.host_pass_copies import KeptCopies
from lightning_lowmem.strategies.offload.host_worker import HostWorker
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

PRECISION = "32-true"
FP16 = "16-mixed"
INLINE = "inline"  # NOTE: not a strategy argument: the bench runs optimizer_in_backward's step on the autograd thread
AT_STEP = "upload_at_step"  # NOTE: not a strategy argument: the overlap's buckets upload at the step (no uploader)
NO_COPIES = "no_copies"  # NOTE: not a strategy argument: the overlap keeps no copies to restore from (not exact)
STAND_IN = "bf16-true"  # NOTE: only the stand-in variants: the compute dtype of the staging slots, as on a GPU
VARIANTS = {  # name: (strategy kwargs or None for plain Lightning, gradient_clip_val, gradient_clip_algorithm, precision)
    "plain Lightning (auto)": (None, None, None, PRECISION),
    "serial": ({"host_pass": "serial"}, None, None, PRECISION),
    "overlap": ({"host_pass": "overlap"}, None, None, PRECISION),
    "overlap, upload at the step": ({"host_pass": "overlap", AT_STEP: True}, None, None, PRECISION),
    # NOTE: a diagnostic, not a mode: what exactness costs here (the copies of p, m, v a restore needs; no restore
    # happens without a clip or a NaN, and one would raise)
    "overlap without its copies (diagnostic, not exact)": ({"host_pass": "overlap", NO_COPIES: True}, None, None,
                                                           PRECISION),
    "serial, clip 1e9": ({"host_pass": "serial"}, 1e9, "norm", PRECISION),
    "overlap, clip 1e9": ({"host_pass": "overlap"}, 1e9, "norm", PRECISION),
    "serial, value clip 1e9": ({"host_pass": "serial"}, 1e9, "value", PRECISION),
    "overlap, value clip 1e9": ({"host_pass": "overlap"}, 1e9, "value", PRECISION),
    "serial, fp16": ({"host_pass": "serial"}, None, None, FP16),
    "overlap, fp16": ({"host_pass": "overlap"}, None, None, FP16),
    "serial, CUDA logic (stand-in)": ({"host_pass": "serial"}, None, None, STAND_IN),
    "overlap, CUDA logic (stand-in)": ({"host_pass": "overlap"}, None, None, STAND_IN),
    "overlap, upload at the step, CUDA logic (stand-in)": ({"host_pass": "overlap", AT_STEP: True}, None, None,
                                                           STAND_IN),
    # NOTE: offload_params (every block streamed from its host copy): the upload of a streamed weight is the rounding
    # of its master into its host copy (here fp32 into fp32), which the next forward's fetch reads
    "serial, offload_params": ({"host_pass": "serial", "offload_params": True}, None, None, PRECISION),
    "overlap, offload_params": ({"host_pass": "overlap", "offload_params": True}, None, None, PRECISION),
    "overlap, offload_params, upload at the step": ({"host_pass": "overlap", "offload_params": True, AT_STEP: True},
                                                    None, None, PRECISION),
    # NOTE: optimizer_in_backward steps each master on a host worker on the CUDA path (in the hook on the plain CPU
    # path); "autograd thread" runs it in the hook there too (HostWorker.submit made inline for that variant alone)
    "in backward (CPU path: in the hook)": ({"optimizer_in_backward": True}, None, None, PRECISION),
    "in backward, autograd thread, CUDA logic (stand-in)": ({"optimizer_in_backward": True, INLINE: True}, None, None,
                                                            STAND_IN),
    "in backward, host worker, CUDA logic (stand-in)": ({"optimizer_in_backward": True}, None, None, STAND_IN),
    # NOTE: the delayed update changes what is trained (one step stale): timed, not compared
    "delayed": ({"host_pass": "delayed"}, None, None, PRECISION),
    "delayed, CUDA logic (stand-in)": ({"host_pass": "delayed"}, None, None, STAND_IN),
}


def _module(args) -> CausalLMModule:
    torch.manual_seed(0)
    config = {"n_layer": args.layers, "n_embd": args.width, "n_head": 4, "n_positions": args.seq,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return CausalLMModule(model_type="gpt2", config=config, learning_rate=1e-4)


def fit(args, kwargs, clip, algorithm, precision) -> dict:
    module = _module(args)
    kwargs = dict(kwargs) if kwargs is not None else None
    inline = kwargs is not None and kwargs.pop(INLINE, False)
    at_step = kwargs is not None and kwargs.pop(AT_STEP, False)
    no_copies = kwargs is not None and kwargs.pop(NO_COPIES, False)
    strategy = OffloadStrategy(**kwargs) if kwargs is not None else "auto"
    if inline:
        strategy._in_backward = InlineWorker("inline", 0)
    after: list[float] = []
    phases: dict[str, list[float]] = {"tail_start": [], "tail_end": [], "final_s": [], "backlog_s": [], "check_s": [],
                                      "upload_s": []}
    if kwargs is not None:
        drain, step, upload = strategy.drain_transfers, strategy.optimizer_step, strategy._weights_to_device
        mark: list[float | None] = [None]

        def timed_drain():
            # NOTE: the first drain of a step: autograd's backward has just returned (the precision plugin drains,
            # and the overlapped pass's last bucket is waited for in it); the strategy's post_backward drains again
            if mark[0] is None:
                mark[0] = time.perf_counter()
            drain()

        def timed_step(*a, **kw):
            out = step(*a, **kw)
            after.append(time.perf_counter() - mark[0])
            if phases["tail_start"]:  # NOTE: the pass's work left when backward returned, then its final buckets' check
                start, end = phases["tail_start"].pop(), phases["tail_end"].pop()
                phases["backlog_s"].append(start - mark[0])
                phases["check_s"].append(end - start)
            mark[0] = None
            return out

        def timed_upload(*a, **kw):
            t0 = time.perf_counter()
            upload(*a, **kw)
            phases["upload_s"].append(time.perf_counter() - t0)

        # NOTE: before setup binds them
        strategy.drain_transfers, strategy.optimizer_step, strategy._weights_to_device = timed_drain, timed_step, timed_upload
    # NOTE: no callback times the steps: a hook after backward would make the overlap serial, and one that may read
    # the gradients after the step (on_train_batch_end) makes it unscale and clamp them at the step (`settle`). The
    # step period is timed from one `training_step` call to the next instead.
    trainer = bench_trainer(strategy=strategy, precision=precision, max_steps=args.steps, limit_val_batches=0,
                            callbacks=[], gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    starts: list[float] = []
    training_step = trainer.strategy.training_step

    def timed_training_step(*a, **kw):
        starts.append(time.perf_counter())
        return training_step(*a, **kw)

    trainer.strategy.training_step = timed_training_step
    data = torch.utils.data.DataLoader(lm_batches(args.steps, (args.batch, args.seq)), batch_size=None)
    stand_in = cpu_stand_in(lambda: DeferredOps("eager")) if precision == STAND_IN else nullcontext()
    with counting_stood(phases) as (stood, last), stand_in, upload_at_step(HostPass, at_step), without_copies(no_copies):
        trainer.fit(module, data)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    overflows = scaler.overflows if scaler is not None else 0  # NOTE: skipped serially and by the pass alike
    if kwargs is not None and kwargs.get("host_pass") == "overlap" and stood[0] < args.steps - overflows:
        raise RuntimeError("host_pass='overlap' did not take the pass's step at every step: the variant would time "
                           "the serial step")
    if overflows > 2:
        raise RuntimeError(f"{overflows} fp16 overflows in {args.steps} steps: the timed steps (from the third) would "
                           "include skipped ones; raise --steps")
    n = sum(p.numel() for p in module.parameters())
    shapes = [tuple(p.shape) for p in module.parameters()]
    del trainer, module, strategy, data
    gc.collect()  # NOTE: a 100M-parameter fit holds GBs; the next fit must not start beside it
    periods = [b - a for a, b in itertools.pairwise(starts)]
    return {"step_s": statistics.median(periods[1:]), "after_s": statistics.median(after[2:]) if after else None,
            "params": n, "shapes": shapes, "overflows": overflows, "last_bucket": last[-1] if last else 0,
            **{k: statistics.median(phases[k][2:]) if phases[k][2:] else None for k in ("backlog_s", "check_s", "final_s", "upload_s")}}


@contextmanager
def without_copies(on: bool) -> Iterator[None]:
    """The overlapped pass without the copies it restores from (a diagnostic of their cost: a restore raises)."""
    keep, put_back = KeptCopies.keep, KeptCopies.put_back

    def no_restore(*args):
        raise RuntimeError("the diagnostic variant without copies restored: its figure would not be the overlap's")

    if on:
        KeptCopies.keep, KeptCopies.put_back = lambda *args: None, no_restore
    try:
        yield
    finally:
        KeptCopies.keep, KeptCopies.put_back = keep, put_back


class InlineWorker(HostWorker):
    """optimizer_in_backward's step where it ran before the host worker: in the gradient hook, on the autograd thread."""

    def submit(self, fn, *args, nbytes=0):
        fn(*args)


@contextmanager
def counting_stood(phases: dict[str, list[float]]) -> Iterator[tuple[list[int], list[int]]]:
    """``([n], sizes)``: the steps that took the overlapped pass's result (``HostPass.stands`` said so) inside the
    block, and the parameters in the final buckets of each (checked before they step: no copy kept); ``phases`` gets
    when each tail (the check of the final buckets) starts and ends, and how long their step takes."""
    from lightning_lowmem.strategies.offload.host_pass import HostPass

    count, last, stands, tail, step_final = [0], [], HostPass.stands, HostPass._tail, HostPass._step_final

    def timed_tail(self):
        phases["tail_start"].append(time.perf_counter())
        tail(self)
        phases["tail_end"].append(time.perf_counter())

    def timed_step_final(self):
        t0 = time.perf_counter()
        step_final(self)
        phases["final_s"].append(time.perf_counter() - t0)

    def counted(self):
        last.append(sum(self.masters.p_host[i].numel() for bucket in self._final for i in bucket))
        out = stands(self)
        count[0] += bool(out)
        return out

    HostPass.stands, HostPass._tail, HostPass._step_final = counted, timed_tail, timed_step_final  # type: ignore[method-assign]
    try:
        yield count, last
    finally:
        HostPass.stands, HostPass._tail, HostPass._step_final = stands, tail, step_final  # type: ignore[method-assign]


def kernel_s(shapes, repeat: int = 3) -> float:
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt, params
    return statistics.median(times)


def bytes_per_param(variant: str, last: float) -> tuple[float, float] | None:
    """(bytes touched per parameter per step, of which after backward) by the passes the code makes (fp32 compute;
    None for the stand-in's bf16); ``last``: the fraction of the parameters in the overlapped pass's final buckets."""
    if "stand-in" in variant or "offload_params" in variant or variant.startswith(("in backward", "delayed")):
        return None
    fold, norms, adamw, upload = 8, 4, 28, 8
    keep = 0 if "without its copies" in variant else 24
    value, clip, fp16 = "value clip" in variant, "clip" in variant, "fp16" in variant
    if variant.startswith("serial"):
        # NOTE: the guard reads every gradient; a norm clip adds the norm read and the multiply by 1.0 (read + write),
        # a value clip torch's clamp_min_ and clamp_max_ (read + write each)
        # NOTE: under fp16 the unscale (read + write) replaces the guard's read
        total = fold + (8 if fp16 else norms) + (16 if value else norms + 8 if clip else 0) + adamw + upload
        return total, total - fold
    # NOTE: the pass's working copy (read + write), then under fp16 the unscale of the copy in place (read + write);
    # each bucket but the final ones uploads during backward (unless "upload at the step")
    work = fold + (16 if fp16 else 8 + norms if value else norms) + adamw
    after = last * work + upload if "upload at the step" in variant else last * (work + upload)
    return work + (1 - last) * keep + upload, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_int_args(parser, layers=14, width=768, seq=32, batch=1, rounds=3, steps=6)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("error", message=".*runs the step serially.*")  # NOTE: an overlap that is not one
    load_before = os.getloadavg()
    got: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    kernels: list[float] = []
    shapes = None
    for _ in range(args.rounds):
        for name, (kwargs, clip, algorithm, precision) in VARIANTS.items():
            got[name].append(fit(args, kwargs, clip, algorithm, precision))
            shapes = got[name][-1]["shapes"]
        kernels.append(kernel_s(shapes))
    kernel = statistics.median(kernels)
    load = (load_before, os.getloadavg())
    params = got["serial"][0]["params"]
    plain = statistics.median(r["step_s"] for r in got["plain Lightning (auto)"])
    rows = []
    for name in VARIANTS:
        step = statistics.median(r["step_s"] for r in got[name])
        after = [r["after_s"] for r in got[name] if r["after_s"] is not None]
        row = {"variant": name, "step_ms": 1e3 * step, "x_plain": step / plain}
        if after:
            a = statistics.median(after)
            last = statistics.median(r["last_bucket"] for r in got[name]) / params
            row.update({"host_after_backward_ms": 1e3 * a, "x_kernel": a / kernel, "last_bucket": last})
            touched = bytes_per_param(name, last)
            if touched is not None:
                row.update({"bytes_touched/param": touched[0], "bytes_after_backward/param": touched[1]})
            for k in ("backlog_s", "check_s", "final_s", "upload_s"):
                got_k = [r[k] for r in got[name] if r.get(k) is not None]
                if got_k:
                    row[k.replace("_s", "_ms")] = 1e3 * statistics.median(got_k)
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    notes = [
        (f"CPU, {params / 1e6:.1f}M parameters, precision {PRECISION}, batch {args.batch} x {args.seq}; fused AdamW kernel "
        f"alone over the same shapes: {1e3 * kernel:.1f} ms (median of {args.rounds} rounds)."),
        ("host_after_backward: from the return of autograd's backward to the return of the strategy's optimizer_step "
        "(fold left, guard, clip, step, upload); x_kernel: its fraction of the fused kernel alone. Of it, for the "
        "overlap: backlog (the worker's speculative buckets still queued when backward returned: it shares the 2 "
        "cores with backward here, where on a GPU backward leaves them free), check (the final buckets' fold, norms "
        "and working copies) and final (their step, at the step); upload: the new weights into the compute weights at "
        "the step (the overlap: its final buckets only, the others went as each stepped during backward; 'upload at "
        "the step': all of them); the rest is Lightning's own work."),
        (f"upload during backward vs at the step (the overlap, same run): host after backward "
         f"{by['overlap']['x_kernel']:.2f}x vs {by['overlap, upload at the step']['x_kernel']:.2f}x the kernel "
         f"({by['overlap']['host_after_backward_ms']:.1f} vs {by['overlap, upload at the step']['host_after_backward_ms']:.1f} ms), "
         f"step time {by['overlap']['x_plain']:.2f}x vs {by['overlap, upload at the step']['x_plain']:.2f}x plain; "
         f"CUDA logic (stand-in): {by['overlap, CUDA logic (stand-in)']['x_kernel']:.2f}x vs "
         f"{by['overlap, upload at the step, CUDA logic (stand-in)']['x_kernel']:.2f}x the kernel, step "
         f"{by['overlap, CUDA logic (stand-in)']['step_ms']:.1f} vs "
         f"{by['overlap, upload at the step, CUDA logic (stand-in)']['step_ms']:.1f} ms. Here the upload is a cast "
         "in the same RAM on the worker, sharing the 2 cores with backward; on a GPU it is DMA on the side stream."),
        (f"overlap / serial, no clip: host after backward {by['overlap']['x_kernel']:.2f}x vs {by['serial']['x_kernel']:.2f}x "
        f"the kernel; step time {by['overlap']['x_plain']:.2f}x vs {by['serial']['x_plain']:.2f}x plain. Without the "
        "upload at the step (on this CPU path the cast into the compute weights, in the same RAM; on a GPU a DMA "
        "copy on a side stream): "
        + ", ".join(f"{name} {(by[name]['host_after_backward_ms'] - by[name]['upload_ms']):.1f} ms = "
                    f"{(by[name]['host_after_backward_ms'] - by[name]['upload_ms']) / (1e3 * kernel):.2f}x the kernel"
                    for name in ("overlap", "serial")) + "."),
        (f"overlap / serial, value clip: host after backward {by['overlap, value clip 1e9']['x_kernel']:.2f}x vs "
         f"{by['serial, value clip 1e9']['x_kernel']:.2f}x the kernel."),
        (f"overlap / serial, fp16 ({FP16}, x_plain against plain {PRECISION}): host after backward "
         f"{by['overlap, fp16']['x_kernel']:.2f}x vs {by['serial, fp16']['x_kernel']:.2f}x the kernel; fp16 overflows "
         f"skipped: {', '.join(str(r['overflows']) for r in got['overlap, fp16'])} (overlap, per round)."),
        (f"CUDA transfer logic on the CPU (deferred stand-in, {STAND_IN}, x_plain against plain {PRECISION}): host after "
         f"backward overlap {by['overlap, CUDA logic (stand-in)']['x_kernel']:.2f}x vs serial "
         f"{by['serial, CUDA logic (stand-in)']['x_kernel']:.2f}x the kernel; upload "
         f"{by['overlap, CUDA logic (stand-in)']['upload_ms']:.1f} vs {by['serial, CUDA logic (stand-in)']['upload_ms']:.1f} "
         "ms: the overlap's upload only copies the slots its buckets rounded into during backward (on a GPU those copies "
         "are DMA on a side stream, not host work). The backlog is large here as under fp16: a half-precision backward "
         "is fast and shares the 2 cores with the worker."),
        ("optimizer_in_backward (each master steps alone as its gradient lands, no gradient buffers), CUDA transfer "
         f"logic on the stand-in ({STAND_IN}): step time on the autograd thread vs on the host worker "
         f"{by['in backward, autograd thread, CUDA logic (stand-in)']['step_ms']:.1f} vs "
         f"{by['in backward, host worker, CUDA logic (stand-in)']['step_ms']:.1f} ms, host after backward "
         f"{by['in backward, autograd thread, CUDA logic (stand-in)']['host_after_backward_ms']:.1f} vs "
         f"{by['in backward, host worker, CUDA logic (stand-in)']['host_after_backward_ms']:.1f} ms. On the autograd "
         "thread the steps lengthen backward itself; on the worker they overlap it and what is left after backward is "
         "the worker's backlog and the upload (the worker also rounds each stepped master into its staging slot, so "
         "the upload only copies). Here backward and the worker share the 2 cores; on a GPU the autograd thread only "
         "queues kernels, and a step there delays the queueing of the next ones. On the plain CPU path the step stays "
         f"in the hook: {by['in backward (CPU path: in the hook)']['step_ms']:.1f} ms ({PRECISION})."),
        (f"offload_params (every block streamed from its host copy, {PRECISION}): host after backward overlap "
         f"{by['overlap, offload_params']['x_kernel']:.2f}x vs {by['overlap, offload_params, upload at the step']['x_kernel']:.2f}x "
         f"with the upload at the step vs serial {by['serial, offload_params']['x_kernel']:.2f}x the kernel; step time "
         f"{by['overlap, offload_params']['x_plain']:.2f}x vs {by['overlap, offload_params, upload at the step']['x_plain']:.2f}x "
         f"vs {by['serial, offload_params']['x_plain']:.2f}x plain (resident). A streamed weight's upload rounds its "
         "master into its host copy, which the next forward's fetch reads: during backward the worker does it for each "
         "bucket as it steps; at the step it waits for the stream's fetches first (no bytes_touched: the fetches add "
         "their crossings)."),
        (f"delayed (host_pass='delayed', one step stale: changes what is trained): step time "
         f"{by['delayed']['step_ms']:.1f} ms = {by['delayed']['x_plain']:.2f}x plain vs serial "
         f"{by['serial']['x_plain']:.2f}x; host after backward {by['delayed']['x_kernel']:.2f}x the kernel (the fold, "
         "the wait for the last window's step if the worker is behind, and the upload; the guard, the clip and the "
         "optimizer kernel run on the worker during the next window's forward and backward). CUDA logic (stand-in): "
         f"{by['delayed, CUDA logic (stand-in)']['step_ms']:.1f} ms, host after backward "
         f"{by['delayed, CUDA logic (stand-in)']['x_kernel']:.2f}x the kernel."),
        (f"what exactness costs here: the overlap keeps a copy of p, m, v before each speculative bucket (24 B/param, "
         f"to restore from when a clip triggers or a gradient is not finite); without them (a diagnostic, not exact) "
         f"its step time is {by['overlap without its copies (diagnostic, not exact)']['x_plain']:.2f}x plain against "
         f"{by['overlap']['x_plain']:.2f}x with them and {by['serial']['x_plain']:.2f}x serial: on these 2 cores, which "
         "backward already keeps busy, every byte the worker moves lengthens the step; on a GPU machine the host is "
         "idle during backward."),
        ("bytes_touched: counted from the passes the code makes; the overlap adds the copy of p, m, v it restores from "
        "(24 B) but moves everything except its final buckets (their upload included) before the end of backward. last_bucket: "
        "the fraction of the parameters in the pass's final buckets, checked before they step (no copy), after "
        "backward (buckets of 32 MiB shrink to half of what the last backward still handed over, down to 2 MiB, as backward "
        "ends: here part of the first block and the embeddings, whose gradients land last; this model's byte-level "
        "vocabulary is 258, its tied embedding 0.2M values, where a real GPT-2's 38.6M would fill a final bucket alone)."),
        ("The machine is shared (2 cores): the worker thread competes with backward for them; figures are ratios "
        "measured side by side, interleaved round after round. Load average (1, 5, 15 min) before / after: "
        + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in load) + "."),
    ]
    write_results("host_path", rows, ["variant", "step_ms", "x_plain", "host_after_backward_ms", "x_kernel",
                                      "backlog_ms", "check_ms", "final_ms", "upload_ms", "last_bucket", "bytes_touched/param",
                                      "bytes_after_backward/param"],
                  title="lowmem_offload host path: serial vs overlapped host pass (CPU)", notes=notes,
                  extra={"args": vars(args), "kernel_s": kernel, "kernel_rounds_s": kernels,
                         "raw": {k: [{kk: vv for kk, vv in r.items() if kk != "shapes"} for r in v] for k, v in got.items()}})


if __name__ == "__main__":
    main()
