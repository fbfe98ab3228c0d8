"""``lightning_lowmem.core.atomic``: atomic file and directory writes, orphans of dead processes, recovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_lowmem.core import atomic as _atomic


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _read(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "a.bin"
    _atomic.atomic_write(target, lambda f: f.write(b"one"))
    _atomic.atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.bin"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o027])
def test_atomic_write_honours_the_umask(tmp_path, umask):
    """As plain `open` (and Lightning's own writer) do: 0o644 under 022, 0o600 under 077, 0o640 under 027."""
    previous = os.umask(umask)
    try:
        _atomic.atomic_write(tmp_path / "a.bin", lambda f: f.write(b"x"))
        _atomic.atomic_write_text(tmp_path / "report.json", "{}")
    finally:
        os.umask(previous)
    for name in ("a.bin", "report.json"):
        assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(0o666 & ~umask)


def test_atomic_write_failing_midway_keeps_the_previous_file(tmp_path):
    target = tmp_path / "a.bin"
    target.write_bytes(b"previous")

    def boom(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        _atomic.atomic_write(target, boom)
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_orphans_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    (tmp_path / f".last.ckpt.tmp-{dead}").write_bytes(b"partial")
    _tree(tmp_path / f".zero.ckpt.tmp-{dead}", {"checkpoint/x.pt": b"partial"})
    (tmp_path / f".last.ckpt.tmp-{alive}").write_bytes(b"another process is writing")
    (tmp_path / "unrelated.tmp-1").write_bytes(b"not ours")
    removed = _atomic.clean_orphans(tmp_path / "last.ckpt")
    assert sorted(p.name for p in removed) == [f".last.ckpt.tmp-{dead}", f".zero.ckpt.tmp-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".last.ckpt.tmp-{alive}", "unrelated.tmp-1"]


def test_replace_dir_swaps_atomically_and_removes_the_previous(tmp_path):
    target = _tree(tmp_path / "last.ckpt", {"latest": b"checkpoint", "checkpoint/a.pt": b"old"})
    new = _tree(_atomic.temp_path(target), {"latest": b"checkpoint", "checkpoint/a.pt": b"new", "checkpoint/b.pt": b"B"})
    _atomic.replace_dir(new, target)
    assert _read(target) == {"latest": b"checkpoint", "checkpoint/a.pt": b"new", "checkpoint/b.pt": b"B"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_replace_dir_without_rename_exchange_uses_two_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    target = _tree(tmp_path / "last.ckpt", {"a.pt": b"old"})
    new = _tree(_atomic.temp_path(target), {"a.pt": b"new"})
    _atomic.replace_dir(new, target)
    assert _read(target) == {"a.pt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_exchange_is_used_where_the_kernel_has_it(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only")
    a, b = _tree(tmp_path / "a", {"x": b"A"}), _tree(tmp_path / "b", {"x": b"B"})
    assert _atomic._exchange(a, b) is True
    assert (a / "x").read_bytes() == b"B" and (b / "x").read_bytes() == b"A"


def test_a_kill_between_the_two_renames_is_recovered(tmp_path):
    """The fallback's window: the previous version only under `.NAME.old-PID`, the new one under `.NAME.tmp-PID`."""
    dead = _dead_pid()
    target = tmp_path / "last.ckpt"
    _tree(tmp_path / f".last.ckpt.old-{dead}", {"a.pt": b"previous, complete"})
    _tree(tmp_path / f".last.ckpt.tmp-{dead}", {"a.pt": b"new, maybe incomplete"})
    assert _atomic.recover(target) is True
    assert _read(target) == {"a.pt": b"previous, complete"}
    _atomic.clean_orphans(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_clean_orphans_keeps_the_name_in_use(tmp_path):
    dead = _dead_pid()
    keep = _tree(tmp_path / f".last.ckpt.tmp-{dead}", {"a": b"rank 0 of another machine is writing this"})
    assert _atomic.clean_orphans(tmp_path / "last.ckpt", keep=keep) == []
    assert keep.is_dir()


def test_pid_alive():
    assert _atomic.pid_alive(os.getpid()) and _atomic.pid_alive(os.getppid())
    assert not _atomic.pid_alive(_dead_pid())


# --- digests and a full disk -----------------------------------------------------------------------------------
def test_digest_is_the_zip_comment_and_finds_flipped_tensor_bytes(tmp_path):
    import zipfile

    import torch

    from lightning_lowmem.core import digest as _digest
    from tests.helpers.checkpoints import flip_tensor_bytes

    state = {"w": torch.randn(300, 300), "step": 3}
    path = tmp_path / "a.ckpt"
    recorded = _atomic.atomic_write(path, lambda f: torch.save(state, f), digest=True)
    assert recorded and _digest.recorded_digest(path) == recorded
    assert zipfile.ZipFile(path).comment == b"lowmem-sha256:" + recorded.encode()
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])  # still a plain torch.save file
    assert _digest.file_problem(path) is None
    flip_tensor_bytes(path)
    assert torch.load(path, weights_only=True)["step"] == 3  # torch itself does not notice
    assert "does not match the SHA-256 digest recorded in it" in _digest.file_problem(path)
    plain = tmp_path / "plain.ckpt"
    torch.save(state, plain)
    assert _digest.recorded_digest(plain) is None and _digest.file_problem(plain) is None  # no digest: nothing to check


def test_a_full_disk_is_named_and_the_temp_file_removed(tmp_path):
    """A real ENOSPC: the temp file is a link to /dev/full, whose writes the kernel refuses with ENOSPC."""
    import torch

    from lightning_lowmem.core.disk_full import DiskFullError

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous checkpoint")
    os.symlink("/dev/full", _atomic.temp_path(target))
    with pytest.raises(DiskFullError) as exc:
        _atomic.atomic_write(target, lambda f: torch.save({"w": torch.zeros(1 << 20)}, f), needed=4 << 20)
    message = str(exc.value)
    assert message.startswith("No space left on ") and f"while writing '{target}' (needed ~4.00 MiB, free " in message
    assert "unexpected pos" not in message and exc.value.errno == 28
    assert target.read_bytes() == b"previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
