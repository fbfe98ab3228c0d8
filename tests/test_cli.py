import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_lowmem.cli import LowMemCLI, check_strategy_name, main
from tests.helpers.runif import RunIf

TINY = {
    "trainer": {
        "accelerator": "cpu", "max_steps": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
    },
    "model": {
        "class_path": "lightning_lowmem.demo.module.CausalLMModule",
        "init_args": {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}},
    },
    "data": {
        "class_path": "lightning_lowmem.demo.data.StdlibTextDataModule",
        "init_args": {"seq_len": 32, "batch_size": 2, "max_bytes": 20_000},
    },
}


def _config(tmp_path, **trainer):
    cfg = {**TINY, "trainer": {**TINY["trainer"], **trainer}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.integration
@pytest.mark.parametrize(
    "strategy",
    [
        "lowmem_offload",
        {"class_path": "lightning_lowmem.strategies.offload.strategy.OffloadStrategy"},
        {"class_path": "OffloadStrategy"},  # short name: works because the CLI imports the package
    ],
    ids=["registered-string", "class-path", "short-name"],
)
def test_strategy_forms_in_yaml(tmp_path, strategy):
    cli = LowMemCLI(args=["fit", "--config", _config(tmp_path, strategy=strategy)])
    assert type(cli.trainer.strategy).__name__ == "OffloadStrategy"
    assert cli.trainer.global_step == 1


def test_misspelled_strategy_one_clear_line(tmp_path, capsys):
    assert main(["fit", "--config", _config(tmp_path, strategy="lowmem_ofload")]) == 2
    err = capsys.readouterr().err
    assert "Passed `trainer.strategy='lowmem_ofload'`" in err and "Did you mean 'lowmem_offload'" in err
    assert "Traceback" not in err


def test_unknown_config_key_names_it(tmp_path, capsys):
    assert main(["fit", "--config", _config(tmp_path, max_stepz=3)]) == 2
    err = capsys.readouterr().err
    assert "max_stepz" in err
    _assert_one_line(err)


def test_bad_model_type_one_clear_line(tmp_path, capsys):
    path = _config(tmp_path)
    assert main(["fit", "--config", path, "--model.init_args.model_type=t5"]) == 2
    err = capsys.readouterr().err
    assert "Passed `model_type='t5'`" in err and "Traceback" not in err


def test_check_strategy_name_accepts_lightning_names():
    for name in ("auto", "ddp", "lowmem_offload", "LOWMEM_OFFLOAD", "deepspeed_stage_2"):
        check_strategy_name(name)


def test_console_script_exit_code(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_lowmem.cli", "fit", "--config", _config(tmp_path, strategy="nope")],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 2 and "lowmem: error: Passed `trainer.strategy='nope'`" in out.stderr


# --- bad input through `lowmem fit`: one `lowmem: error:` line, no usage text, no traceback ---------------------
def _assert_one_line(err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lowmem: error: ")]
    assert len(errors) == 1, err
    assert "usage:" not in err and "Traceback" not in err and "[--trainer" not in err, err


def _write(tmp_path, cfg, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _with_callbacks(*callbacks):
    return {**TINY, "trainer": {**TINY["trainer"], "callbacks": list(callbacks)}}


def test_misspelled_callback_class_path_did_you_mean(tmp_path, capsys):
    path = _write(tmp_path, _with_callbacks({"class_path": "ActivationCheckpointin"}))
    assert main(["fit", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "`trainer.callbacks[0].class_path='ActivationCheckpointin'`" in err
    assert "Did you mean 'ActivationCheckpointing'" in err
    _assert_one_line(err)


def test_wrong_callback_argument_value_without_usage_text(tmp_path, capsys):
    path = _write(tmp_path, _with_callbacks({"class_path": "ActivationCheckpointing", "init_args": {"policy": "bogus"}}))
    assert main(["fit", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "Passed `policy='bogus'` to `trainer.callbacks[0]` (ActivationCheckpointing); expected one of 'all'" in err
    _assert_one_line(err)


def test_wrong_callback_argument_type_and_name(tmp_path, capsys):
    path = _write(tmp_path, _with_callbacks({"class_path": "MemoryReport", "init_args": {"every_n_steps": "often"}}))
    assert main(["fit", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "Passed `every_n_steps='often'` to `trainer.callbacks[0]` (MemoryReport); expected an int" in err
    _assert_one_line(err)
    path = _write(tmp_path, _with_callbacks({"class_path": "ActivationCheckpointing", "init_args": {"polcy": "all"}}))
    assert main(["fit", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "`init_args.polcy`" in err and "Did you mean 'policy'?" in err
    _assert_one_line(err)


def test_callback_constructor_error_is_one_line(tmp_path, capsys):
    path = _write(tmp_path, _with_callbacks({"class_path": "AccumulationScheduler", "init_args": {"effective_batch_size": -3}}))
    assert main(["fit", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "effective_batch_size=-3" in err
    _assert_one_line(err)


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n"], ids=["empty", "blank", "comment"])
def test_empty_config_file(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"Passed `--config {path}`, which is empty" in err
    _assert_one_line(err)


def test_config_file_that_is_not_a_mapping(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert main(["fit", "--config", str(path)]) == 2
    assert "top level is a list" in capsys.readouterr().err


@pytest.mark.integration
def test_sequence_length_beyond_the_models_positions_at_setup(tmp_path, capsys):
    cfg = {**TINY, "data": {**TINY["data"], "init_args": {**TINY["data"]["init_args"], "seq_len": 64}}}
    assert main(["fit", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert "`StdlibTextDataModule(seq_len=64)`" in err and "at most 32 positions" in err and "IndexError" not in err
    _assert_one_line(err)


@pytest.mark.integration
def test_host_ram_refusal_is_one_line(tmp_path, capsys, monkeypatch):
    import psutil

    class Tiny:
        available = 1000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    assert main(["fit", "--config", _config(tmp_path, strategy="lowmem_offload")]) == 2
    err = capsys.readouterr().err
    assert "lowmem: error: `OffloadStrategy` (strategy='lowmem_offload') needs" in err
    assert "may allocate only 1000 B, limited by the machine's available RAM" in err
    _assert_one_line(err)


@pytest.mark.integration
@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 100, "truncated"], ids=["empty", "random-bytes", "truncated"])
def test_bad_ckpt_path_is_one_line_naming_the_file(tmp_path, capsys, content):
    import torch

    ckpt = tmp_path / "bad.ckpt"
    if content == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(1000)}}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:1500])
    else:
        ckpt.write_bytes(content)
    assert main(["fit", "--config", _config(tmp_path, strategy="lowmem_offload"), "--ckpt_path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert str(ckpt) in err and {b"": "is empty", "truncated": "is truncated"}.get(content, "is not a `torch.save` file") in err
    _assert_one_line(err)


@pytest.mark.integration
def test_deepspeed_directory_as_ckpt_path_of_lowmem_offload(tmp_path, capsys):
    ckpt = tmp_path / "last.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    assert main(["fit", "--config", _config(tmp_path, strategy="lowmem_offload"), "--ckpt_path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "is a DeepSpeed checkpoint directory" in err and f"lowmem consolidate {ckpt} model.ckpt" in err
    _assert_one_line(err)


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_consolidate_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "is not a DeepSpeed checkpoint directory: it has no `latest` file" in err
    _assert_one_line(err)
    ckpt = tmp_path / "zero.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    (ckpt / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert main(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_00_model_states.pt' is empty (0 bytes)" in err
    _assert_one_line(err)
    assert main(["consolidate", str(ckpt), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"Passed `out_file='{tmp_path}'`, which is a directory" in err
    _assert_one_line(err)
    assert not list(tmp_path.glob(".*tmp*")) and not (tmp_path / "out.pt").exists()

@pytest.mark.integration
def test_users_own_module_by_class_path_from_the_current_directory(tmp_path):
    """`lowmem fit --config` naming `my_module.MyModel` next to the YAML, with no PYTHONPATH set."""
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    project.mkdir()
    bin_dir.mkdir()
    (project / "my_module.py").write_text(
        "from tests.helpers.foreign import LitPlainTensor\n\n\nclass MyModel(LitPlainTensor):\n    pass\n"
    )
    cfg = {"trainer": {**TINY["trainer"], "strategy": "lowmem_offload"}, "model": {"class_path": "my_module.MyModel"}}
    (project / "config.yaml").write_text(yaml.safe_dump(cfg))
    # NOTE: run as a console script is: from a file outside the project, so sys.path[0] is not the project
    runner = bin_dir / "lowmem_runner.py"
    runner.write_text("import sys\nfrom lightning_lowmem.cli import main\nsys.exit(main())\n")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("PYTHONSAFEPATH", None)
    out = subprocess.run([sys.executable, str(runner), "fit", "--config", "config.yaml"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No module named" not in out.stderr
    safe = subprocess.run([sys.executable, "-P", str(runner), "fit", "--config", "config.yaml"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert safe.returncode == 2 and "my_module" in safe.stderr  # python -P: the user asked for no such entry


def test_a_file_in_the_current_directory_does_not_replace_a_library(tmp_path):
    """A `jsonargparse.py` in the folder `lowmem` runs in (a downloaded project) is not imported instead of the
    library: the current directory comes last on sys.path."""
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    project.mkdir()
    bin_dir.mkdir()
    marker = tmp_path / "IMPOSTOR_RAN"
    (project / "jsonargparse.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('impostor')\n")
    runner = bin_dir / "lowmem_runner.py"  # NOTE: as a console script runs: sys.path[0] is its own folder
    runner.write_text("import sys\nfrom lightning_lowmem.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("PYTHONSAFEPATH", None)
    # NOTE: --help-all, LightningCLI's full help, imports jsonargparse (the short --help imports nothing heavy)
    out = subprocess.run([sys.executable, str(runner), "fit", "--help-all"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert not marker.exists(), out.stderr[-2000:]
    assert out.returncode == 0 and "--trainer.max_steps" in out.stdout, out.stderr[-2000:]
    assert "--trainer.enable_model_summary" in out.stdout and "--help-all" not in out.stdout  # Lightning's own help


# --- `lowmem fit --help`: the suite's options first, answered without torch or Lightning ------------------------
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_loop_help_is_short_and_imports_neither_torch_nor_lightning(subcommand):
    code = (
        "import sys\nfrom lightning_lowmem.cli import main\n"
        f"code = main([{subcommand!r}, '--config', 'run.yaml', '--help'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'jsonargparse', 'transformers'})\n"
        "print('HEAVY', heavy, code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "HEAVY [] 0"
    text = out.stdout
    assert text.startswith(f"usage: lowmem {subcommand} --config run.yaml")
    for needed in ("--config", "--trainer.strategy", "lowmem_offload", "lowmem_zero3_offload", "ActivationCheckpointing",
                   "AccumulationScheduler", "MemoryReport", f"lowmem {subcommand} --help-all"):
        assert needed in text, needed
    assert len(text.splitlines()) < 60


def test_loop_help_lists_every_public_callback():
    import lightning_lowmem
    from lightning_lowmem.cli import CALLBACKS

    public = {name for name, module in lightning_lowmem._LAZY.items()
              if module.startswith(("lightning_lowmem.callbacks.", "lightning_lowmem.report.")) and name[0].isupper()}
    assert set(CALLBACKS) == public
