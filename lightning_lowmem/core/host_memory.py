"""How much host RAM this process may still allocate, and the refusal when a strategy needs more.

The least of the machine's available RAM, the cgroup v1/v2 limits of the process and its ancestors (reclaimable
page cache counted as free) and ``ulimit -v``/``-d`` (docs/reliability.md). Used by the offload strategies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lightning_lowmem.core.units import fmt_bytes

_UNLIMITED = 1 << 60  # cgroup v1 writes 0x7FFFFFFFFFFFF000 for "no limit"


class HostMemoryError(MemoryError):
    """Host RAM, not device memory: a strategy refused to start, or a host buffer could not be allocated. Not a
    ``RuntimeError``, so nothing that catches a device OOM (``torch.OutOfMemoryError``) takes it for one."""


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process may still allocate (``available``) and which limit decided it (``limited_by``)."""

    available: int
    limited_by: str
    limits: dict[str, int] = field(default_factory=dict)  # every limit found: description -> bytes left


def _read_int(path: Path) -> int | None:
    try:
        value = int(path.read_text().strip())  # NOTE: v2 writes "max" for "no limit"
    except (OSError, ValueError):
        return None
    return None if value >= _UNLIMITED else value


def _stat_value(path: Path, *keys: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(maxsplit=1) for line in lines if " " in line)
    try:
        return int(next((values[key] for key in keys if key in values), 0))
    except ValueError:
        return 0


def cgroup_limits(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> dict[str, int]:
    """Bytes left under each cgroup memory limit of this process: ``{"cgroup v2 memory.max of /sys/...": bytes}``."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    base = Path(root)
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2 (unified)
            version, mount, limit_file, used_file, inactive = "v2", base, "memory.max", "memory.current", ("inactive_file",)
        elif "memory" in controllers.split(","):  # cgroup v1
            version, mount = "v1", base / "memory" if (base / "memory").is_dir() else base
            limit_file, used_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            inactive = ("total_inactive_file", "inactive_file")
        else:
            continue
        parts = [p for p in relative.strip("/").split("/") if p]
        for rel in ("/".join(parts[:i]) for i in range(len(parts), -1, -1)):  # the cgroup, then its ancestors
            d = mount / rel if rel else mount
            limit = _read_int(d / limit_file)
            if limit is None:
                continue
            used = (_read_int(d / used_file) or 0) - _stat_value(d / "memory.stat", *inactive)
            out[f"cgroup {version} limit ({d / limit_file} = {fmt_bytes(limit)})"] = max(0, limit - max(0, used))
    return out


def rlimit_limits() -> dict[str, int]:
    """Bytes left under ``RLIMIT_AS`` (``ulimit -v``) and ``RLIMIT_DATA`` (``ulimit -d``) for this process."""
    try:
        import resource  # NOTE: guarded: POSIX only
    except ImportError:
        return {}
    out: dict[str, int] = {}
    info = psutil.Process().memory_info()
    for name, flag, used, shell in (
        ("RLIMIT_AS", "v", info.vms, "address space"),
        ("RLIMIT_DATA", "d", getattr(info, "data", 0), "data segment"),
    ):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY and soft > 0:
            out[f"{name} (`ulimit -{flag}` = {fmt_bytes(soft)} of {shell}, {fmt_bytes(used)} in use)"] = max(0, soft - used)
    return out


def available_host_memory() -> HostMemory:
    """The least of: the machine's available RAM, each cgroup memory limit's headroom, each rlimit's headroom."""
    limits = {"the machine's available RAM": int(psutil.virtual_memory().available)}
    limits.update(cgroup_limits())
    limits.update(rlimit_limits())
    limited_by = min(limits, key=limits.__getitem__)
    return HostMemory(available=limits[limited_by], limited_by=limited_by, limits=limits)


def check_host_memory(need: Mapping[str, int], *, who: str, fixes: Sequence[str]) -> HostMemory:
    """Raise :class:`HostMemoryError` naming the parts of ``need`` (``{"fp32 masters": bytes, ...}``), the limit and
    ``fixes`` when their sum is more than :func:`available_host_memory`."""
    total = sum(need.values())
    host = available_host_memory()
    if total > host.available:
        parts = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in need.items() if n)
        raise HostMemoryError(
            f"{who} needs {fmt_bytes(total)} of host RAM ({parts}), but this process may allocate only "
            f"{fmt_bytes(host.available)}, limited by {host.limited_by}. Fix: " + "; or ".join(fixes) + "."
        )
    return host


def pinned_bytes(nbytes: int, *, cuda: bool = True) -> int:
    """Host bytes a page-locked buffer of ``nbytes`` takes (NOTE: torch's ``CachingHostAllocator`` rounds every
    request up to a power of two: 5 GiB pinned takes 8 GiB). Nothing is pinned on the CPU (``cuda=False``)."""
    if not cuda or nbytes <= 0:
        return max(0, nbytes)
    return 1 << (int(nbytes) - 1).bit_length()


class PinnedHostCache:
    """The host RAM a set of host buffers holds from the OS, as torch's allocators hold it.

    On CUDA a freed pinned block stays in the allocator's cache for its size class, so :attr:`reserved` is, per size
    class, the most blocks alive at once and never shrinks; without pinning it follows the live bytes. NOTE: the
    allocator's cache is shared per process; this counts the blocks of one owner.
    """

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self.live = 0
        self.reserved = 0
        self._cached: dict[int, int] = {}  # size class -> freed blocks waiting in the allocator's cache

    def cost(self, nbytes: int) -> int:
        """New host RAM a buffer of ``nbytes`` would take now (0 where a cached block serves it)."""
        size = pinned_bytes(nbytes, cuda=self.cuda)
        return 0 if self.cuda and self._cached.get(size, 0) > 0 else size

    def take(self, nbytes: int) -> None:
        size = pinned_bytes(nbytes, cuda=self.cuda)
        self.live += size
        if self.cuda and self._cached.get(size, 0) > 0:
            self._cached[size] -= 1
        else:
            self.reserved += size

    def give(self, nbytes: int) -> None:
        size = pinned_bytes(nbytes, cuda=self.cuda)
        self.live -= size
        if self.cuda:
            self._cached[size] = self._cached.get(size, 0) + 1
        else:
            self.reserved -= size


#: glibc's ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (malloc.h)
_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(nbytes: int = 2**20) -> bool:
    """Make glibc ``malloc`` serve every block of ``nbytes`` or more with its own ``mmap`` (given back on ``free``);
    False where the C library is not glibc.

    NOTE: [freed copies stay] by default glibc raises that threshold to the largest block freed so far (up to 32 MiB),
    after which freed master-sized blocks stay in its heap: a disk tier's transient copies (each master on its way
    to its file, each first optimizer state) kept 518 MiB of a 222M-parameter LLaMA in RAM. Hazard: process-wide and
    for the rest of the process (glibc has no way back to the dynamic threshold); large allocations then cost a
    ``mmap`` and their page faults each time.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))
