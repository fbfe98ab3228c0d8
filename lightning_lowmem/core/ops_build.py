"""DeepSpeed's C++ ops on the CPU: stale build locks found before they hang a run, and ``lowmem build-ops``.

An interrupted build of ``cpu_adam`` or ``deepspeed_shm_comm`` leaves a ``lock`` in ``TORCH_EXTENSIONS_DIR/<op>/``
that every later run waits on forever. :func:`stale_locks` finds those nobody holds open and beside which nothing
changed for :data:`QUIET_S` seconds; ``ZeroStrategy`` refuses to start on one, ``lowmem build-ops`` removes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_lowmem.core.optional import require

#: seconds without a change in a build directory (and no local holder) after which its lock is stale
QUIET_S = 300.0
#: ``lowmem build-ops`` builds these by default: the offload optimizers and the CPU collectives
DEFAULT_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


class StaleBuildLockError(RuntimeError):
    """A torch-extension build lock that no build is behind: DeepSpeed would wait on it forever."""


@dataclass(frozen=True)
class BuildLock:
    path: Path
    holders: tuple[int, ...]  # PIDs on this machine with the lock open
    quiet_s: float  # seconds since anything in its build directory changed
    known_holders: bool  # False where /proc cannot be read (not Linux)

    @property
    def stale(self) -> bool:
        return not self.holders and self.quiet_s >= QUIET_S

    def describe(self) -> str:
        who = (
            f"held by process {', '.join(map(str, self.holders))}" if self.holders
            else "held by no process on this machine" if self.known_holders else "its holder unknown (no /proc)"
        )
        return f"{self.path} ({who}; nothing in {self.path.parent.name}/ changed for {self.quiet_s / 60:.0f} min)"


def extensions_root() -> Path:
    """Where ``torch.utils.cpp_extension`` builds: ``TORCH_EXTENSIONS_DIR`` or torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root  # NOTE: import cost (setuptools): only when asked

    return Path(get_default_build_root())


def _holders(paths: set[str]) -> dict[str, list[int]] | None:
    """PIDs holding each of ``paths`` open, from ``/proc/*/fd``; None where ``/proc`` is not available."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    found: dict[str, list[int]] = {p: [] for p in paths}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(os.path.join(entry.path, "fd"))
        except OSError:
            continue  # NOTE: another user's process: its builds use its own extensions directory
        with fds:
            for fd in fds:
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target in found:
                    found[target].append(int(entry.name))
    return found


def build_locks(root: str | os.PathLike | None = None) -> list[BuildLock]:
    """Every ``lock`` file of a torch extension build under ``root`` (default :func:`extensions_root`)."""
    base = Path(root) if root is not None else extensions_root()
    if not base.is_dir():
        return []
    files = sorted({*base.glob("*/lock"), *base.glob("*/*/lock")})
    if not files:
        return []
    held = _holders({str(f.resolve()) for f in files})
    now = time.time()
    locks = []
    for f in files:
        try:
            changed = max(p.stat().st_mtime for p in f.parent.iterdir())
        except (OSError, ValueError):
            continue  # the build finished (and removed it) meanwhile
        holders = tuple(held.get(str(f.resolve()), [])) if held is not None else ()
        locks.append(BuildLock(f, holders, max(0.0, now - changed), held is not None))
    return locks


def stale_locks(root: str | os.PathLike | None = None) -> list[BuildLock]:
    """The build locks no process is behind (see the module docstring)."""
    return [lock for lock in build_locks(root) if lock.stale]


def stale_lock_message(locks: Sequence[BuildLock], who: str) -> str:
    names = "; ".join(lock.describe() for lock in locks)
    paths = " ".join(str(lock.path) for lock in locks)
    return (
        f"{who} would wait forever: DeepSpeed builds its C++ ops under a lock file, and {names} was left by an "
        f"interrupted build (Ctrl-C, a kill, a time limit). Remove it (`rm {paths}`) and build the ops once ahead "
        "of time with `lowmem build-ops` (it removes stale locks itself), or point TORCH_EXTENSIONS_DIR to another "
        "directory."
    )


def build_ops(names: Sequence[str] = DEFAULT_OPS, *, remove_stale: bool = True) -> list[str]:
    """Remove stale locks (if asked), then build and load each DeepSpeed op builder in ``names``; lines to print."""
    require("deepspeed", "`lowmem build-ops`")
    from deepspeed.accelerator import get_accelerator

    lines = []
    for lock in stale_locks():
        if not remove_stale:
            raise StaleBuildLockError(stale_lock_message([lock], "`lowmem build-ops`"))
        lock.path.unlink(missing_ok=True)
        lines.append(f"removed the stale lock {lock.describe()}")
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            lines.append(f"{name}: not used by DeepSpeed's {get_accelerator().device_name()} accelerator; skipped")
            continue
        if not builder.is_compatible(verbose=False):
            lines.append(f"{builder.absolute_name()}: not buildable on this machine; skipped")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        lines.append(f"{builder.absolute_name()}: ready ({time.perf_counter() - start:.1f} s) in {extensions_root()}")
    return lines
