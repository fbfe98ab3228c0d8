"""The disk tier under a hard memory cap (CPU, measured): ``OffloadStrategy(disk=...)`` against the same run in RAM.

A LLaMA-style model from a ``transformers`` config (built in bf16, random weights) trains ``--steps`` steps of 1 x
``--seq`` tokens with ``lowmem_offload`` (bf16-true, AdamW, the step in backward) twice, each in a new process:

- in RAM, uncapped: its host state (fp32 masters + AdamW moments, 12 B/param) is what the cap is set against;
- with the disk tier, in a memory cgroup whose hard limit is a third of that host state (cgroup v1
  ``memory.limit_in_bytes`` or v2 ``memory.max``: page cache and mapped files count too); before training, the
  same process measures the disk's sequential write and read bandwidth on the tier's directory (8 MiB ``pwritev`` +
  ``fdatasync``, then 8 MiB ``preadv`` after dropping the pages), so both figures come from the same run.

The final fp32 masters of the two runs are compared with ``torch.equal``. Run as root (cgroups):

    python benchmarks/bench_disk_tier.py [--layers 40 --hidden 1024 --steps 3 --disk-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = 8 * 2**20


def cgroup_create(limit: int) -> Path | None:
    """A memory cgroup limited to ``limit`` bytes (v2 or v1), or None where this machine allows none."""
    name = f"lowmem-bench-{os.getpid()}"
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        root, knob = Path("/sys/fs/cgroup"), "memory.max"
    elif Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        root, knob = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
    else:
        return None
    try:
        path = root / name
        path.mkdir()
        (path / knob).write_text(str(limit))
    except OSError:
        return None
    try:
        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # NOTE: v1: no swap past the cap either
    except OSError:
        pass
    return path


def cgroup_peak(path: Path) -> int | None:
    for knob in ("memory.peak", "memory.max_usage_in_bytes"):
        if (path / knob).exists():
            return int((path / knob).read_text())
    return None


def sequential_bandwidth(directory: str, nbytes: int) -> dict[str, float]:
    """Bytes/s of one sequential write (+ fdatasync) and read (pages dropped first) of ``nbytes`` in ``directory``."""
    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (CHUNK >> 20))
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.pwritev(fd, [buf], off)
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {"write_Bps": nbytes / write_s, "read_Bps": nbytes / read_s, "rw_Bps": 2 * nbytes / (write_s + read_s)}


def child(spec: dict) -> None:
    if spec.get("cgroup"):
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))  # NOTE: before anything is allocated
    out: dict = {}
    if spec.get("seq_bytes"):
        out["sequential"] = sequential_bandwidth(spec["disk"], spec["seq_bytes"])

    import warnings

    warnings.filterwarnings("ignore")
    import lightning as L
    import torch
    import transformers

    from benchmarks._harness import lm_batches
    from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

    torch.set_num_threads(spec["threads"])

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.LlamaConfig(**spec["config"])
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # NOTE: built in bf16: no fp32 copy of the model in RAM
            try:
                self.model = transformers.LlamaForCausalLM(config)
            finally:
                torch.set_default_dtype(default)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    times: list[float] = []
    seen: dict = {}
    peaks = {"RssAnon": 0, "RssFile": 0}
    import threading

    def sample() -> None:
        """Peaks of anonymous and file-backed RSS (VmHWM adds up both, the libraries' pages too), every 0.1 s;
        with LOWMEM_BENCH_TRACE=1 also printed every second (where the memory goes)."""
        n = 0
        while True:
            with open("/proc/self/status") as f:
                now = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in peaks}
            for k, v in now.items():
                peaks[k] = max(peaks[k], v)
            n += 1
            if os.environ.get("LOWMEM_BENCH_TRACE") and n % 10 == 0:
                tier = seen.get("strategy") and seen["strategy"]._tier
                held = f", tier {tier.bytes_in_ram >> 20} MiB held, {len(tier._writes)} writes queued" if tier else ""
                print(f"[trace] {time.strftime('%X')} {now} steps {len(times)}{held}", file=sys.stderr, flush=True)
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            times.append(time.perf_counter() - self.t)
            if spec.get("zero"):
                return
            seen["breakdown"] = trainer.strategy.memory_breakdown().to_dict()
            tier = trainer.strategy._tier
            if tier is not None:
                seen["tier"] = vars(tier.stats).copy()
                seen["bytes_on_disk"] = tier.bytes_on_disk

        def on_train_end(self, trainer, *args):
            if spec.get("zero"):
                return
            # NOTE: no copy: with the tier the masters are mapped files (a clone would put them all in RAM)
            torch.save({k: v.detach() for k, v in trainer.strategy.masters.items()}, spec["out"])

    if spec.get("zero"):  # NOTE: DeepSpeed ZeRO-Infinity: ZeRO-3, parameters and optimizer state swapped to NVMe
        from lightning_lowmem.strategies.zero import ZeroStrategy

        strategy: Any = ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True, offload_device="nvme",
                                     nvme_path=spec["disk"])
    else:
        kw = {"disk": spec["disk"], "disk_buffer": spec["budget"]} if spec["disk"] else {}
        strategy = seen["strategy"] = OffloadStrategy(optimizer_in_backward=True, check_host_memory=False, **kw)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-true", max_steps=spec["steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()])
    model = LM()
    out["params"] = sum(p.numel() for p in model.parameters())
    data = lm_batches(spec["steps"], (1, spec["seq"]), vocab=spec["config"]["vocab_size"])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    with open("/proc/self/status") as f:
        out["vm_hwm"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    seen.pop("strategy", None)
    out.update(step_seconds=times, peak_rss_anon=peaks["RssAnon"], peak_rss_file=peaks["RssFile"], **seen)
    Path(spec["result"]).write_text(json.dumps(out))


def _aio_builds() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # noqa: BLE001 (no deepspeed, or its probe failing: the same answer)
        return False


def run(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return {"failed": proc.returncode, "stderr": proc.stderr[-3000:]}
    return json.loads(Path(spec["result"]).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--cap-ratio", type=float, default=3.0, help="host state / memory cap")
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--no-zero-infinity", action="store_true", help="skip DeepSpeed's ZeRO-Infinity run")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from benchmarks._harness import fmt_bytes, write_results

    config = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 64,
              "vocab_size": args.vocab, "max_position_embeddings": args.seq, "tie_word_embeddings": False}
    work = Path(tempfile.mkdtemp(prefix="lowmem-bench-disk-", dir=args.disk_dir))
    base = {"config": config, "seq": args.seq, "steps": args.steps, "threads": args.threads, "budget": args.budget}
    ram = run({**base, "disk": None, "out": str(work / "ram.pt"), "result": str(work / "ram.json")})
    if "failed" in ram:
        raise SystemExit(f"the in-RAM run failed: {ram['stderr']}")
    host_state = ram["breakdown"]["host"]["optimizer_state"]
    cap = int(host_state / args.cap_ratio)
    cgroup = cgroup_create(cap)
    if cgroup is None:
        raise SystemExit("no memory cgroup could be made here (needs root and cgroup v1 or v2 with the memory "
                         "controller); the capped run needs one")
    try:
        disk = run({**base, "disk": str(work), "cgroup": str(cgroup), "seq_bytes": 2**30,
                    "out": str(work / "disk.pt"), "result": str(work / "disk.json")})
        peak = cgroup_peak(cgroup)
    finally:
        cgroup.rmdir()
    if "failed" in disk:
        raise SystemExit(f"the capped run failed (rc {disk['failed']}; 137: killed at the cap): {disk['stderr']}")
    import torch

    zero = None
    if not args.no_zero_infinity and _aio_builds():
        zero = run({**base, "disk": str(work), "zero": True, "out": str(work / "zero.pt"), "result": str(work / "zero.json")})
    a, b = torch.load(work / "ram.pt", mmap=True), torch.load(work / "disk.pt", mmap=True)
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    t = disk["tier"]
    seq = disk["sequential"]
    io_s = t["busy_seconds"]  # NOTE: reads and writes overlap: their union, not their sum
    tier_rw = (t["read_bytes"] + t["write_bytes"]) / io_s
    rows = [
        {"run": "in RAM, uncapped", "params": ram["params"], "host_state": host_state, "cap": None,
         "peak_rss": ram["vm_hwm"], "peak_rss_anon": ram["peak_rss_anon"], "cgroup_peak": None, "s_per_step": round(min(ram["step_seconds"][1:]), 2),
         "identical": None},
        {"run": "disk tier, capped", "params": disk["params"], "host_state": disk["breakdown"]["host"]["optimizer_state"],
         "cap": cap, "peak_rss": disk["vm_hwm"], "peak_rss_anon": disk["peak_rss_anon"], "cgroup_peak": peak, "s_per_step": round(min(disk["step_seconds"][1:]), 2),
         "identical": identical},
    ]
    if zero is not None and "failed" not in zero:
        rows.append({"run": "ZeRO-Infinity (lowmem_zero3_nvme), uncapped", "params": zero["params"], "host_state": None,
                     "cap": None, "peak_rss": zero["vm_hwm"], "peak_rss_anon": zero["peak_rss_anon"],
                     "cgroup_peak": None, "s_per_step": round(min(zero["step_seconds"][1:]), 2), "identical": None})
    tier = {"bytes_on_disk": disk["bytes_on_disk"], "budget": args.budget, **t, "tier_rw_Bps": tier_rw,
            "sequential": seq, "ratio_to_sequential": tier_rw / seq["rw_Bps"],
            "read_ratio": t["read_bytes"] / t["read_seconds"] / seq["read_Bps"],
            "write_ratio": t["write_bytes"] / t["write_seconds"] / seq["write_Bps"],
            "hidden_fraction": 1 - t["wait_seconds"] / io_s}
    print(json.dumps(tier, indent=2))
    write_results(
        "disk_tier", rows, ["run", "params", "host_state", "cap", "peak_rss", "peak_rss_anon", "cgroup_peak", "s_per_step", "identical"],
        title=(f"The disk tier under a hard memory cap (CPU, measured): LLaMA-style {ram['params'] / 1e6:.0f}M params, "
               f"bf16-true, AdamW, step in backward, 1 x {args.seq} tokens, {args.steps} steps"),
        notes=[
            (f"host state = the in-RAM run's fp32 masters + AdamW moments ({fmt_bytes(host_state)}); the capped run's "
             f"hard limit is 1/{args.cap_ratio:g} of it ({fmt_bytes(cap)}, a memory cgroup: anonymous memory, page "
             "cache and mapped files all count); peak_rss = the process's VmHWM (anonymous and file-backed pages, the shared "
             "libraries' too, which the cgroup does not count where another process loaded them first), peak_rss_anon = "
             "the highest anonymous RSS sampled every 0.1 s, cgroup_peak = the cgroup's peak usage (what the cap limits)"),
            (f"disk tier: {fmt_bytes(disk['bytes_on_disk'])} on disk, budget {args.budget}, at most "
             f"{fmt_bytes(t['peak_bytes_in_ram'])} of it counted in RAM; read {fmt_bytes(t['read_bytes'])} in "
             f"{t['read_seconds']:.1f} s, wrote {fmt_bytes(t['write_bytes'])} in {t['write_seconds']:.1f} s: "
             f"{fmt_bytes(tier_rw)}/s, {tier['ratio_to_sequential']:.2f} of the disk's sequential read+write "
             f"({fmt_bytes(seq['rw_Bps'])}/s: write {fmt_bytes(seq['write_Bps'])}/s, read {fmt_bytes(seq['read_Bps'])}/s, "
             f"1 GiB each, same process, before training); reads {tier['read_ratio']:.2f} and writes "
             f"{tier['write_ratio']:.2f} of sequential"),
            (f"hidden: {tier['hidden_fraction']:.2f} of the tier's I/O time overlapped compute (the training thread "
             f"waited {t['wait_seconds']:.1f} s of {io_s:.1f} s)"),
            ("ZeRO-Infinity: DeepSpeed ZeRO-3 with parameters and optimizer state swapped to NVMe through its async I/O "
             "op (libaio), DeepSpeedCPUAdam, the same model, data and tier directory, in a new process, uncapped (its "
             "pinned swap buffers alone are ~1.2 GiB at the preset's sizes); its masters are not compared (another "
             "optimizer kernel and a flat partition: the conformance sweep judges it)" if zero else
             "ZeRO-Infinity: not run (DeepSpeed's async I/O op does not build here: it needs libaio-dev)"),
            ("s_per_step: the fastest step after the first (the first creates the optimizer state); identical: every "
             "final fp32 master equal (torch.equal) to the in-RAM run's"),
        ],
        extra={"tier": tier, "ram": ram, "disk": disk, "zero_infinity": zero},
    )


if __name__ == "__main__":
    main()
