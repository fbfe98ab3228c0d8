"""Hardware profiles: the rates the planner's cost model prices a step with (docs/planner.md).

Shipped profiles carry the vendor's figures with their source; ``measure_host()`` measures this machine. A YAML
file overrides a profile (``base: rtx3060-12gb`` then the fields to change, e.g. ``link_gbps: 12``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one device and its host. Bandwidths in GB/s (1e9 B/s), rates in TFLOP/s (dense)."""

    name: str
    #: device memory in bytes (the default budget of ``lowmem plan`` and ``lowmem_auto``)
    memory_bytes: int
    #: dense matmul rate in fp32 and in 16-bit (tensor cores, fp32 accumulation)
    fp32_tflops: float
    half_tflops: float
    #: whether the device computes in bfloat16 (pre-Ampere NVIDIA cards do not: 16-bit means fp16 there)
    bf16: bool
    #: device memory bandwidth
    device_gbps: float
    #: host <-> device link, per direction, pinned memory (PCIe 3.0 x16 ~ 12, 4.0 ~ 25, 5.0 ~ 50 in practice)
    link_gbps: float
    #: host memory bandwidth available to the CPU optimizer step (read + write)
    host_gbps: float
    #: fraction of the matmul rate a transformer step reaches (model FLOPs utilisation)
    efficiency: float = 0.45
    #: bytes/s of the device-resident optimizer step (GB/s); None: the device bandwidth (fused/foreach kernels)
    device_optimizer_gbps: float | None = None
    #: whether host-link copies overlap compute (a GPU's copy engines and side streams); False where the same
    #: processor computes and copies (the CPU as the device)
    overlap: bool = True
    #: fixed cost of one micro-batch (kernel launches, Python): seconds per repeated block
    launch_s_per_block: float = 2e-4
    #: bytes/s the disk tier (``OffloadStrategy(disk=...)``) reads and writes its directory at, reads and writes
    #: together (GB/s). Default 3: a PCIe 4.0 NVMe SSD (datasheets: ~7 read, ~5 write sequentially; a mix of buffered
    #: reads and ``fdatasync``'d writes reaches less); a SATA SSD is ~0.5. Not measured by ``measure_host``
    disk_gbps: float = 3.0
    source: str = ""

    def override(self, **changes: Any) -> HardwareProfile:
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ValueError(f"Passed the hardware field(s) {unknown}; a profile has: {', '.join(sorted(fields))}.")
        return dataclasses.replace(self, **changes)


GiB = 2**30
# NOTE: vendor datasheet figures (dense, no sparsity); link and host figures are typical measured values of the
# platform named, not the card's. Each is an input to a ranking, not a promise of speed.
PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("rtx2060-6gb", 6 * GiB, 6.45, 25.8, False, 336, 12, 20,
                        source="NVIDIA Turing whitepaper (RTX 2060: 6.45 TFLOPS fp32, 51.6 fp16 tensor with fp16 "
                               "accumulate, half with fp32); PCIe 3.0 x16; dual-channel DDR4"),
        HardwareProfile("rtx3060-12gb", 12 * GiB, 12.7, 25.4, True, 360, 24, 25,
                        source="NVIDIA Ampere GA10x whitepaper (RTX 3060: 12.7 TFLOPS fp32, 25.4 dense fp16/bf16 "
                               "tensor with fp32 accumulate); PCIe 4.0 x16; dual-channel DDR4-3200"),
        HardwareProfile("rtx4090-24gb", 24 * GiB, 82.6, 165.2, True, 1008, 24, 40,
                        source="NVIDIA Ada Lovelace whitepaper (RTX 4090: 82.6 TFLOPS fp32, 165.2 dense fp16/bf16 "
                               "tensor with fp32 accumulate); PCIe 4.0 x16; dual-channel DDR5"),
        HardwareProfile("a100-40gb", 40 * GiB, 19.5, 312, True, 1555, 24, 80,
                        source="NVIDIA A100 datasheet (19.5 TFLOPS fp32, 312 bf16 tensor, 1555 GB/s); PCIe 4.0 "
                               "x16 host link; server DDR4"),
        HardwareProfile("a100-80gb", 80 * GiB, 19.5, 312, True, 2039, 24, 80,
                        source="NVIDIA A100 80GB datasheet (19.5 TFLOPS fp32, 312 bf16, 2039 GB/s); PCIe 4.0 x16"),
        HardwareProfile("h100-80gb", 80 * GiB, 67, 989, True, 3350, 50, 150,
                        source="NVIDIA H100 SXM datasheet (67 TFLOPS fp32, 989 dense bf16, 3.35 TB/s); PCIe 5.0 "
                               "x16; server DDR5"),
    )
}


# NOTE: on a forked torch generator: the matrices and the block's init draw from it, and `lowmem_auto` measures
# before `configure_model` and the first batch (an unforked draw shifted every weight and dropout mask after it)
@torch.random.fork_rng(devices=[])
def measure_host(seconds: float = 0.5) -> HardwareProfile:
    """This machine's CPU as the device: matmul rates (fp32; bf16 from a block's speed-up), copy bandwidth (the "link"), the
    optimizer steps' rates (fused AdamW for the host step, torch's default for a plain run), the per-block cost of a
    micro-batch, and its RAM. Takes about ``7 * seconds``."""
    import psutil

    def calls_per_s(fn: Any) -> float:
        """How often ``fn`` runs in a second (after one warm-up call), timed for ``seconds``."""
        fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        return n / (time.perf_counter() - t0)

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    fp32 = 2 * 512**3 * calls_per_s(lambda: a @ b) / 1e12
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * calls_per_s(lambda: dst.copy_(src)) / GB  # read + write

    def adamw_gbps(**kwargs: Any) -> float:
        """AdamW's step over 4M fp32 parameters, as 28 B/param read and written per second."""
        params = [torch.zeros(2**20, requires_grad=True) for _ in range(4)]
        for p in params:
            p.grad = torch.zeros_like(p)
        return 28 * 4 * 2**20 * calls_per_s(torch.optim.AdamW(params, **kwargs).step) / GB

    def block_s(width: int, tokens: int, dtype: torch.dtype = torch.float32) -> float:
        """Forward + backward of one GPT-2 block of ``width`` on ``tokens`` tokens, in ``dtype``."""
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        block = GPT2Block(GPT2Config(n_embd=width, n_head=4)).to(dtype)
        x = torch.randn(1, tokens, width, dtype=dtype, requires_grad=True)
        return 1 / calls_per_s(lambda: block(x)[0].sum().backward())

    # NOTE: a bare matmul overstates what 16-bit gains in a whole block on a CPU (its other ops are not faster):
    # the 16-bit rate is the fp32 rate times the measured speed-up of a real block
    half = fp32 * block_s(256, 256) / block_s(256, 256, torch.bfloat16)
    return HardwareProfile(
        "measured-host", int(psutil.virtual_memory().total), fp32, half, True, copy_gbps,
        copy_gbps / 2, adamw_gbps(fused=True), efficiency=1.0, launch_s_per_block=block_s(64, 8),
        device_optimizer_gbps=adamw_gbps(), overlap=False,
        source=f"measured on this machine ({torch.get_num_threads()} threads): 512x512 fp32 matmuls, a GPT-2 block's "
               "fp32 vs bf16 time, 64 MiB copies, "
               "AdamW steps (fused: the host optimizer of lowmem_offload; default: a plain run's optimizer), a tiny "
               "GPT-2 block's forward + backward (the per-block cost of a micro-batch); copies do not overlap compute",
    )


@functools.lru_cache(maxsize=1)
def _measured_once() -> HardwareProfile:
    """This machine's profile, measured once per process (a plan on a CPU prices with it by default)."""
    return measure_host()


def load_profile(spec: str | dict[str, Any] | HardwareProfile | None) -> HardwareProfile | None:
    """A profile from a shipped name, ``"measure"``, a YAML file (``base:`` + overridden fields) or a dict."""
    if spec is None or isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, str):
        if spec == "measure":
            return _measured_once()
        if spec in PROFILES:
            return PROFILES[spec]
        path = Path(spec).expanduser()
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            raise ValueError(
                f"Passed `hardware={spec!r}`; expected a shipped profile ({', '.join(PROFILES)}), 'measure' (this "
                "machine), or a YAML file of profile fields (optionally `base: <profile>`)."
            )
        import yaml

        spec = yaml.safe_load(path.read_text()) or {}
        if not isinstance(spec, dict):
            raise ValueError(f"Passed the hardware file {path}; expected a mapping of profile fields.")  # noqa: TRY004
    fields = dict(spec)
    base_name = fields.pop("base", None)
    if base_name is not None:
        return load_profile(str(base_name)).override(**fields)  # type: ignore[union-attr]
    try:
        return HardwareProfile(**fields)
    except TypeError as err:
        raise ValueError(f"Passed the hardware fields {sorted(fields)}: {err}; give `base: <profile>` to "
                         "override a shipped profile, or every field.") from None


__all__ = ["PROFILES", "HardwareProfile", "load_profile", "measure_host"]
