"""lowmem_zero* starts or says why it cannot: no silent wait forever at "initializing deepspeed distributed".

Each run is a plain ``python train.py`` in a fresh process group, killed at the timeout (the old behaviour: it
never ends). Causes: a stale DeepSpeed op-build lock (an interrupted compile) in ``TORCH_EXTENSIONS_DIR``, a stray
``LOCAL_RANK`` (Lightning then starts no processes); ``lowmem build-ops`` builds the ops ahead of time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lightning_lowmem.core import ops_build as _ops_build
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.deepspeed, RunIf(deepspeed=True)]
ROOT = Path(__file__).resolve().parents[2]
_DIST = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
TRAIN = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, lightning as L
import lightning_lowmem
from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import GPT2_TINY, random_batch

if __name__ == "__main__":
    full = random_batch(4, 16, seed=1)
    loader = torch.utils.data.DataLoader([{k: v[i] for k, v in full.items()} for i in range(4)], batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=int(sys.argv[2]), strategy=sys.argv[1], max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(CausalLMModule(config=dict(GPT2_TINY)), loader)
    print("DONE", trainer.global_rank, flush=True)
"""


def _plant_stale_lock(root: Path, op: str) -> Path:
    """The ``lock`` an interrupted build leaves: no process holds it, nothing beside it changed for an hour."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    (lock.parent / "build.ninja").write_text("# an interrupted build\n")
    lock.touch()
    old = time.time() - 3600
    for p in lock.parent.iterdir():
        os.utime(p, (old, old))
    return lock


def _run(tmp_path: Path, args: list[str], env: dict[str, str], timeout: float, until: str | None = None):
    """Run ``train.py args`` in its own process group; kill the group at ``timeout`` or once ``until`` is printed."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    base = {k: v for k, v in os.environ.items() if k not in _DIST}
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path, env={**base, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline, timed_out = time.monotonic() + timeout, False
    while proc.poll() is None and not (until is not None and until in "".join(lines)):
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # NOTE: the group we started: the script and the ranks it launched
        proc.wait()
    reader.join(timeout=10)
    return proc.returncode, "".join(lines), timed_out


@pytest.mark.integration
@pytest.mark.parametrize(("devices", "op"), [(1, "cpu_adam"), (2, "deepspeed_shm_comm")])
def test_a_stale_build_lock_is_refused_instead_of_waited_on(tmp_path, devices, op):
    """1 process, a lock left by an interrupted `cpu_adam` build; 2 processes, one of the CPU collectives' op
    (built at "initializing deepspeed distributed", where the wait used to be silent and endless)."""
    ext = tmp_path / "torch_extensions"
    lock = _plant_stale_lock(ext, op)
    if op == "cpu_adam":
        _plant_stale_lock(ext, "deepspeed_shm_comm")  # else this fresh directory would first compile that op
    code, out, timed_out = _run(tmp_path, ["lowmem_zero2_offload", str(devices)], {"TORCH_EXTENSIONS_DIR": str(ext)}, 240)
    assert not timed_out, out[-3000:]
    assert code != 0 and "StaleBuildLockError" in out and str(lock) in out, out[-3000:]
    assert "held by no process on this machine" in out and "lowmem build-ops" in out
    assert lock.exists()  # named, not removed behind the user's back


@pytest.mark.integration
def test_a_stray_local_rank_is_refused_instead_of_waiting_for_peers(tmp_path):
    """LOCAL_RANK alone makes Lightning start no processes; rank 0 used to wait forever for rank 1."""
    code, out, timed_out = _run(tmp_path, ["lowmem_zero2_offload", "2"], {"LOCAL_RANK": "0"}, 240)
    assert not timed_out, out[-3000:]
    assert code != 0 and "LaunchError" in out and "`LOCAL_RANK=0` is set in the environment" in out, out[-3000:]
    assert "env -u LOCAL_RANK python train.py" in out and "torchrun --nproc-per-node 2 train.py" in out


@pytest.mark.integration
def test_a_long_wait_at_start_up_says_what_it_waits_for(tmp_path):
    """A launcher's environment for 2 processes, but only rank 0 runs: it waits (rightly), and says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "LOWMEM_WAIT_NOTICE_S": "3"}
    _, out, timed_out = _run(tmp_path, ["lowmem_zero2", "2"], env, 240, until="so far")
    assert not timed_out, out[-3000:]
    assert f"lowmem: DeepSpeed's distributed start-up (rank 0 of 2, meeting at 127.0.0.1:{port}; a launcher is " in out


def test_stale_locks_are_told_from_builds_in_progress(tmp_path):
    stale = _plant_stale_lock(tmp_path, "cpu_adam")
    recent = tmp_path / "cpu_lion" / "lock"
    recent.parent.mkdir()
    recent.touch()  # no holder, but its directory changed just now (a build on another machine?)
    held = _plant_stale_lock(tmp_path, "deepspeed_shm_comm")
    fd = os.open(held, os.O_RDONLY)  # a build in progress keeps the descriptor it created the lock with
    try:
        locks = {lock.path: lock for lock in _ops_build.build_locks(tmp_path)}
        assert set(locks) == {stale, recent, held}
        assert locks[held].holders == (os.getpid(),) and not locks[held].stale
        assert not locks[recent].stale and locks[stale].stale
        assert [lock.path for lock in _ops_build.stale_locks(tmp_path)] == [stale]
    finally:
        os.close(fd)


def test_build_ops_keeping_stale_locks_names_them(tmp_path, monkeypatch, capsys):
    from lightning_lowmem.cli import main

    lock = _plant_stale_lock(tmp_path, "cpu_adam")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert main(["build-ops", "--keep-stale-locks"]) == 2
    err = capsys.readouterr().err
    assert "lowmem: error: `lowmem build-ops` would wait forever" in err and str(lock) in err and lock.exists()


@pytest.mark.slow
@pytest.mark.integration
@RunIf(sweep=True)  # NOTE: a real op build; `make test` checks the lock logic without one (the tests above)
def test_build_ops_removes_a_stale_lock_and_builds(tmp_path):
    """The install step: a stale lock is removed, the op built into TORCH_EXTENSIONS_DIR (~100 s on 2 cores)."""
    lock = _plant_stale_lock(tmp_path, "deepspeed_shm_comm")
    env = {**{k: v for k, v in os.environ.items() if k not in _DIST}, "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "lightning_lowmem.cli", "build-ops", "--op", "ShareMemCommBuilder"],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"removed the stale lock {lock}" in out.stdout and "deepspeed_shm_comm_op: ready" in out.stdout
    assert not lock.exists() and list(lock.parent.glob("*.so"))
