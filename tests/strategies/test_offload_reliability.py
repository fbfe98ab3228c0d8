"""lowmem_offload: nothing lost, nothing poisoned.

Host-RAM check (the optimizer actually configured, cgroup and rlimit limits), flag validation, the
non-finite gradient guard against a reference that skipped the bad batch (through ``Trainer.fit``),
orphan temp files, and clear errors for a bad ``ckpt_path``.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_lowmem  # noqa: F401
from lightning_lowmem.core import host_memory as _host_memory
from lightning_lowmem.core.optimizer_state import expected_state_bytes
from lightning_lowmem.predict.analytic import optimizer_state_bytes_per_param
from lightning_lowmem.strategies.offload.strategy import NonFiniteGradientError, OffloadStrategy
from tests.helpers.runif import SWEEP, RunIf


# --- flags -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"check_host_memory": "no"}, TypeError, r"`check_host_memory='no'`; expected True or False"),
        ({"check_host_memory": 1}, TypeError, r"`check_host_memory=1`; expected True or False"),
        ({"optimizer_in_backward": "yes"}, TypeError, r"`optimizer_in_backward='yes'`"),
        ({"max_consecutive_skips": True}, TypeError, r"`max_consecutive_skips=True`; expected an int >= 1"),
        ({"max_consecutive_skips": 0}, ValueError, r"`max_consecutive_skips=0`; expected an int >= 1"),
        ({"nonfinite": "maybe"}, ValueError, r"`nonfinite='maybe'`; expected one of 'skip', 'raise', 'ignore'"),
        ({"host_optimizer": "fast"}, ValueError, r"`host_optimizer='fast'`"),
    ],
)
def test_bad_flags(kwargs, error, match):
    with pytest.raises(error, match=match):
        OffloadStrategy(**kwargs)


def test_bad_flags_are_reported_together():
    with pytest.raises(TypeError) as exc:
        OffloadStrategy(check_host_memory="no", nonfinite="maybe", host_optimizer="fast")
    message = str(exc.value)
    assert "check_host_memory='no'" in message and "nonfinite='maybe'" in message and "host_optimizer='fast'" in message


# --- host RAM: the optimizer actually configured -----------------------------------------------------------
def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


def test_state_bytes_follow_the_configured_optimizer():
    shapes = [(300, 100), (100,)]  # 30000 and 100 elements
    n = 30_100
    assert expected_state_bytes(torch.optim.AdamW(_params(*shapes))) == 8 * n
    assert expected_state_bytes(torch.optim.Adam(_params(*shapes), amsgrad=True)) == 12 * n
    assert expected_state_bytes(torch.optim.SGD(_params(*shapes), lr=0.1)) == 0
    assert expected_state_bytes(torch.optim.SGD(_params(*shapes), lr=0.1, momentum=0.9)) == 4 * n
    assert expected_state_bytes(torch.optim.RMSprop(_params(*shapes), momentum=0.9, centered=True)) == 12 * n

    from lightning_lowmem import LowBitOptimizer  # its constructor needs no bitsandbytes

    # the 30000-element tensor in 8-bit (the analytic table's rule), the 100-element one in 32-bit
    expected = optimizer_state_bytes_per_param("adamw8bit", 4, 30_000) + 8 * 100
    assert expected_state_bytes(torch.optim.AdamW(_params(*shapes)), LowBitOptimizer(min_8bit_size=4096)) == expected
    # a threshold above both tensors: 32-bit state everywhere, AdamW's 8 B/param
    assert expected_state_bytes(torch.optim.AdamW(_params(*shapes)), LowBitOptimizer(min_8bit_size=30_001)) == 8 * n
    assert expected < 2.1 * n  # about a quarter of AdamW's 8 B/param

    # DeepSpeed's, which is no torch Adagrad: known by its type (its C++ op is not built here, hence the constructor)
    adagrad = pytest.importorskip("deepspeed.ops.adagrad").DeepSpeedCPUAdagrad

    class DeepSpeedCPUAdagrad(adagrad):
        def __init__(self, params):
            torch.optim.Optimizer.__init__(self, params, {})

    assert expected_state_bytes(DeepSpeedCPUAdagrad(_params(*shapes))) == 4 * n


@RunIf(bitsandbytes=True)
@pytest.mark.integration
def test_predicted_8bit_state_equals_what_bitsandbytes_allocates():
    """The check's figure for LowBitOptimizer against the state tensors bitsandbytes really creates."""
    from lightning_lowmem import LowBitOptimizer

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Linear(256, 2))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    model = Model()
    strategy = OffloadStrategy()
    predicted = strategy.host_bytes_needed(model, [model.configure_optimizers()], callbacks=[LowBitOptimizer()])
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-true", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[LowBitOptimizer()])
    trainer.fit(model)
    state = trainer.optimizers[0].state
    # NOTE: bitsandbytes' quantization maps (`qmap1`/`qmap2`, 256 fp32 values) are one tensor shared by every
    # parameter (2 KiB per optimizer), not per-parameter state
    qmaps = {v.data_ptr() for s in state.values() for k, v in s.items() if k.startswith("qmap")}
    assert len(qmaps) <= 2
    actual = sum(v.numel() * v.element_size() for s in state.values() for k, v in s.items()
                 if isinstance(v, torch.Tensor) and v.numel() > 1 and not k.startswith("qmap"))
    assert predicted["optimizer_state"] == actual
    plain = strategy.host_bytes_needed(model, [model.configure_optimizers()])
    assert predicted["optimizer_state"] < plain["optimizer_state"] / 3


def test_refusal_counts_8bit_state_and_does_not_recommend_what_is_already_used(monkeypatch):
    from lightning_lowmem import LowBitOptimizer

    class Adam(BoringModel):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    class Tiny:
        available = 100

    monkeypatch.setattr(_host_memory.psutil, "virtual_memory", lambda: Tiny())

    def refusal(callbacks):
        trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload", precision="bf16-true", max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks)
        with pytest.raises(_host_memory.HostMemoryError) as exc:
            trainer.fit(Adam())
        return str(exc.value)

    plain = refusal([])
    assert "optimizer state 528 B" in plain and "LowBitOptimizer" in plain  # 66 params x 8 B
    low_bit = refusal([LowBitOptimizer()])  # all 66 below min_8bit_size: 32-bit state, same bytes
    assert "optimizer state 528 B" in low_bit and "LowBitOptimizer" not in low_bit


# --- host RAM: what this process may use -------------------------------------------------------------------
def _fake_cgroup(tmp_path, files: dict[str, str], proc: str):
    for rel, text in files.items():
        path = tmp_path / "cg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")


def test_cgroup_v2_limit_of_the_process_and_its_ancestors(tmp_path):
    proc, root = _fake_cgroup(tmp_path, {
        "kubepods/memory.max": str(8 * 2**30),
        "kubepods/memory.current": str(7 * 2**30),
        "kubepods/memory.stat": f"anon 1\ninactive_file {2**30}\n",
        "kubepods/pod1/memory.max": "max",
        "kubepods/pod1/memory.current": str(6 * 2**30),
    }, "0::/kubepods/pod1\n")
    limits = _host_memory.cgroup_limits(proc, root)
    # 8 GiB limit - (7 GiB used - 1 GiB reclaimable page cache) = 2 GiB; the child's "max" is no limit
    assert list(limits.values()) == [2 * 2**30]
    assert "cgroup v2" in next(iter(limits)) and "kubepods/memory.max" in next(iter(limits))


def test_cgroup_v1_limit_and_unlimited_marker(tmp_path):
    proc, root = _fake_cgroup(tmp_path, {
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "memory/docker/abc/memory.limit_in_bytes": str(4 * 2**30),
        "memory/docker/abc/memory.usage_in_bytes": str(3 * 2**30),
        "memory/docker/abc/memory.stat": "cache 5\ntotal_inactive_file 0\n",
    }, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    limits = _host_memory.cgroup_limits(proc, root)
    assert list(limits.values()) == [2**30]
    assert "cgroup v1" in next(iter(limits))


def test_available_is_the_least_of_every_limit(monkeypatch):
    monkeypatch.setattr(_host_memory, "cgroup_limits", lambda: {"cgroup v2 limit (x)": 3 * 2**30})
    monkeypatch.setattr(_host_memory, "rlimit_limits", lambda: {"RLIMIT_AS (`ulimit -v` ...)": 5 * 2**30})
    host = _host_memory.available_host_memory()
    assert host.limited_by == "cgroup v2 limit (x)" and host.available == 3 * 2**30
    with pytest.raises(_host_memory.HostMemoryError, match=r"needs 4.00 GiB .*may allocate only 3.00 GiB, limited by cgroup"):
        _host_memory.check_host_memory({"masters": 4 * 2**30}, who="X", fixes=["less"])


def test_this_machine_reads_without_error():
    host = _host_memory.available_host_memory()
    assert 0 < host.available <= _host_memory.psutil.virtual_memory().total
    assert host.limits[host.limited_by] == host.available


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS semantics")
def test_ulimit_v_is_respected_before_allocating(tmp_path):
    """`ulimit -v` set 1 GiB above the current address space; the model needs ~1.9 GiB of host RAM."""
    script = textwrap.dedent("""
        import resource, psutil, torch, lightning as L
        import lightning_lowmem
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning_lowmem.core.host_memory import HostMemoryError

        class Big(BoringModel):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Sequential(*[torch.nn.Linear(5000, 5000) for _ in range(4)], torch.nn.Linear(5000, 2))
            def forward(self, x):
                return self.layer(torch.nn.functional.pad(x, (0, 5000 - 32)))
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())

        model = Big()  # 100M parameters: 400 MB fp32, allocated before the limit
        trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload", precision="bf16-true", max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)
        vms = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (vms + 2**30, resource.RLIM_INFINITY))
        try:
            trainer.fit(model)
        except HostMemoryError as err:
            print("REFUSED:", err)
        else:
            print("NOT REFUSED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), check=False)
    assert "REFUSED:" in out.stdout, out.stdout + out.stderr[-3000:]
    n = 4 * (5000 * 5000 + 5000) + 5000 * 2 + 2
    assert "limited by RLIMIT_AS (`ulimit -v`" in out.stdout, out.stdout
    assert f"optimizer state {8 * n / 2**20:.2f} MiB" in out.stdout, out.stdout


# --- the non-finite guard -----------------------------------------------------------------------------------
DIM, N_BATCHES = 8, 6


class Regression(L.LightningModule):
    """A small MLP; ``bad`` maps batch_idx -> "nan_input" | "inf_loss"."""

    def __init__(self, bad: dict[int, str] | None = None, optimizer: str = "adamw"):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.bad = bad or {}
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        kind = self.bad.get(batch_idx)
        if kind == "nan_input":
            x = x.clone()
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        return loss * float("inf") if kind == "inf_loss" else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data(skip: int | None = None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N_BATCHES * 4, DIM, generator=g), torch.randn(N_BATCHES * 4, 1, generator=g)
    batches = [(x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(N_BATCHES) if i != skip]
    return batches


def _fit(module, batches, precision="bf16-true", max_steps=None, **strategy_kwargs):
    strategy = OffloadStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision=precision, max_epochs=1,
                        max_steps=max_steps or -1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    return trainer, [w for w in caught if "non-finite" in str(w.message)]


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["nan_input", "inf_loss"])
def test_fp32_skip_equals_plain_pytorch_that_skipped_the_batch(kind):
    torch.manual_seed(0)
    module = Regression(bad={2: kind})
    reference = copy.deepcopy(module.net)
    trainer, warned = _fit(module, _data(), precision="32-true", host_optimizer="as_is")
    # plain PyTorch over the same batches, batch 2 left out
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, y in _data(skip=2):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for got, want in zip(module.net.parameters(), reference.parameters()):
        assert torch.equal(got, want)
    assert trainer.strategy.skipped_steps == 1
    assert trainer.callback_metrics["lowmem/skipped_steps"] == 1.0
    assert len(warned) == 1 and "skipped the optimizer step" in str(warned[0].message)


@pytest.mark.integration
def test_bf16_skip_keeps_masters_finite_and_equal_to_the_run_without_the_batch():
    torch.manual_seed(0)
    module = Regression(bad={1: "nan_input", 4: "inf_loss"})
    clean = copy.deepcopy(module)
    clean.bad = {}
    trainer, warned = _fit(module, _data())
    batches = [b for i, b in enumerate(_data()) if i not in (1, 4)]
    _fit(clean, batches)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    for got, want in zip(module.parameters(), clean.parameters()):
        assert torch.equal(got, want)
    assert trainer.strategy.skipped_steps == 2 and len(warned) == 1  # warned once


@pytest.mark.integration
def test_ignore_lets_the_nan_in_as_plain_lightning_does():
    torch.manual_seed(0)
    module = Regression(bad={1: "nan_input"})
    _fit(module, _data(), nonfinite="ignore")
    assert not all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.integration
def test_raise_names_the_parameter():
    with pytest.raises(NonFiniteGradientError, match=r"global step 2 in `net\.0\.weight`.*nonfinite='raise'"):
        _fit(Regression(bad={2: "nan_input"}), _data(), nonfinite="raise")


@pytest.mark.integration
def test_consecutive_skips_raise_after_the_limit():
    bad = {i: "nan_input" for i in range(1, N_BATCHES)}
    with pytest.raises(NonFiniteGradientError, match=r"3 optimizer steps in a row.*`net\.0\.weight`.*max_consecutive_skips=3"):
        _fit(Regression(bad=bad), _data(), max_consecutive_skips=3)


@pytest.mark.integration
def test_optimizer_in_backward_skips_a_nonfinite_loss_before_any_parameter_steps():
    torch.manual_seed(0)
    module = Regression(bad={2: "inf_loss"})
    clean = copy.deepcopy(module)
    clean.bad = {}
    trainer, warned = _fit(module, _data(), optimizer_in_backward=True)
    _fit(clean, _data(skip=2), optimizer_in_backward=True)
    for got, want in zip(module.parameters(), clean.parameters()):
        assert torch.equal(got, want)
    assert trainer.strategy.skipped_steps == 1 and len(warned) == 1


@pytest.mark.integration
def test_fp16_keeps_the_loss_scaler_path():
    module = Regression(bad={2: "inf_loss"})
    trainer, warned = _fit(module, _data(), precision="16-true")
    assert trainer.strategy.skipped_steps == 0 and not warned  # the scaler skipped it, not the guard
    assert trainer.precision_plugin.scaler.overflows >= 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


# --- checkpoints: orphans and bad files -------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.integration
def test_orphan_temp_file_of_a_killed_save_is_removed_at_the_next_save(tmp_path):
    orphan = tmp_path / f".last.ckpt.tmp-{_dead_pid()}"
    orphan.write_bytes(b"half a checkpoint")
    trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload", precision="bf16-true", max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)])
    trainer.fit(BoringModel())
    assert not orphan.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2


def _bad_file(tmp_path, kind):
    path = tmp_path / "bad.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        # NOTE: a pickle's first byte (0x80) as well: legacy-looking garbage must be refused too
        path.write_bytes(b"\x80" + os.urandom(4095))
    elif kind == "truncated":
        torch.save({"state_dict": BoringModel().state_dict()}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "deepspeed-dir":
        (path / "checkpoint").mkdir(parents=True)
        (path / "latest").write_text("checkpoint")
    return path


@pytest.mark.integration
@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("empty", r"is empty \(0 bytes\)"),
        ("random", r"is not a `torch\.save` file"),
        ("truncated", r"is truncated .*a `torch\.save` archive whose end is missing"),
        ("deepspeed-dir", r"is a DeepSpeed checkpoint directory.*lowmem consolidate"),
    ],
)
def test_bad_ckpt_path_names_the_file_and_the_fix(tmp_path, kind, match):
    path = _bad_file(tmp_path, kind)
    trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload", precision="bf16-true", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=match) as exc:
        trainer.fit(BoringModel(), ckpt_path=str(path))
    assert str(path) in str(exc.value)


def test_state_bytes_table_is_the_analytic_one():
    """The host-RAM check and the closed form read the one table of core/optimizer_state.py, not copies."""
    from lightning_lowmem.core import optimizer_state
    from lightning_lowmem.strategies.offload import strategy as _offload_strategy

    assert optimizer_state_bytes_per_param is optimizer_state.optimizer_state_bytes_per_param
    assert _offload_strategy.expected_state_bytes is optimizer_state.expected_state_bytes
    assert math.isclose(optimizer_state_bytes_per_param("adamw8bit", 4, 2**20) / 2**20, 2.03125)


@pytest.mark.slow
@pytest.mark.integration
def test_kills_during_offload_saves_lose_no_checkpoint(tmp_path):
    """SIGKILL halfway through writing ``last.ckpt``'s temp file, before its rename, and at random moments."""
    import signal

    from tests.strategies.test_zero_reliability import _run

    code, out = _run(tmp_path, 2, "none", resume=False, offload=True)
    assert code == 0 and "DONE step=2" in out, out[-3000:]
    step, kills, lost = 2, 0, 0
    phases = ["write_file", "before_replace", "random", *(["random"] if SWEEP else [])]  # NOTE: `make test-sweep`: 2
    for phase in phases:
        code, out = _run(tmp_path, step + 3, "random" if phase == "random" else f"{phase}@2", resume=True, offload=True)
        assert code == -signal.SIGKILL and f"START step={step}" in out, out[-3000:]
        kills += 1
        if phase != "random":
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")], phase
        try:
            survived = torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"]
        except Exception:  # noqa: BLE001  (any unreadable file counts as a lost checkpoint)
            lost += 1
            continue
        assert survived in ({step + 1} if phase != "random" else {step + 1, step + 2})
        step = survived
    assert kills == len(phases) and lost == 0
    code, out = _run(tmp_path, step + 2, "none", resume=True, offload=True)
    assert code == 0 and f"START step={step}" in out and f"DONE step={step + 2}" in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    print(f"\nlowmem_offload kill test: {kills} kills during saves, {lost} checkpoints lost")
