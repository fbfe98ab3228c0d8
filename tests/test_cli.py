import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_lowmem.cli import LowMemCLI, check_strategy_name, main

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
        {"class_path": "lightning_lowmem.strategies.offload.OffloadStrategy"},
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
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", _config(tmp_path, max_stepz=3)])
    assert exc.value.code != 0
    assert "max_stepz" in capsys.readouterr().err


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
        capture_output=True, text=True,
    )
    assert out.returncode == 2 and "lowmem: error: Passed `trainer.strategy='nope'`" in out.stderr


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
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No module named" not in out.stderr
    safe = subprocess.run([sys.executable, "-P", str(runner), "fit", "--config", "config.yaml"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert safe.returncode == 2 and "my_module" in safe.stderr  # python -P: the user asked for no such entry
