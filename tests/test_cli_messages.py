"""`lowmem` bad input: one line naming what was given and what to do (fit configs, subcommands, estimate, plan)."""

from __future__ import annotations

import pytest
import yaml

from lightning_lowmem.cli import main
from tests.test_cli import TINY


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("lowmem: error: ") and "Traceback" not in err and "usage:" not in err, err
    return lines[0]


def _exit(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse-based subcommands exit
        return int(exc.code or 0)


def test_negative_layer_count_in_the_model_config(tmp_path, capsys):
    cfg = {**TINY, "model": {**TINY["model"], "init_args": {"config": {**TINY["model"]["init_args"]["config"],
                                                                        "n_layer": -1}}}}
    assert main(["fit", "--config", _write(tmp_path, cfg)]) == 2
    line = _one_line_error(capsys)
    assert "Passed `config` with `n_layer: -1`: layer counts and sizes must be positive" in line
    assert "__len__()" not in line


def test_misspelled_precision_lists_the_choices_and_the_closest(tmp_path, capsys):
    cfg = {**TINY, "trainer": {**TINY["trainer"], "precision": "bf16-ture"}}
    assert main(["fit", "--config", _write(tmp_path, cfg)]) == 2
    line = _one_line_error(capsys)
    assert "trainer.precision: got 'bf16-ture'; expected one of" in line and "'bf16-mixed'" in line
    assert line.rstrip().endswith("Did you mean 'bf16-true'?") and "<class" not in line


def test_strategy_class_path_refusing_its_argument_says_why(tmp_path, capsys):
    strategy = {"class_path": "lightning_lowmem.strategies.offload.strategy.OffloadStrategy", "init_args": {"prefetch": -3}}
    cfg = {**TINY, "trainer": {**TINY["trainer"], "strategy": strategy}}
    assert main(["fit", "--config", _write(tmp_path, cfg)]) == 2
    line = _one_line_error(capsys)
    assert "trainer.strategy: OffloadStrategy: passed `prefetch=-3`; expected an int >= 0" in line
    assert "Namespace(" not in line and "Expected a <class 'str'>" not in line


@pytest.mark.parametrize(("given", "closest"), [("fitt", "fit"), ("estimat", "estimate"), ("bogus", None)])
def test_unknown_subcommand_lists_every_subcommand(capsys, given, closest):
    assert main([given, "--config", "x.yaml"]) == 2
    line = _one_line_error(capsys)
    assert f"Passed the subcommand {given!r}" in line
    assert "fit, validate, test, predict, estimate, plan, consolidate" in line
    assert (f"Did you mean `lowmem {closest}`?" in line) == (closest is not None)


def test_estimate_negative_budget_is_named(capsys):
    assert _exit(["estimate", "--model", "gpt2", "--batch-size", "2", "--seq-len", "64", "--budget", "-5GB"]) == 2
    err = capsys.readouterr().err
    assert "Passed `--budget -5GB`; a memory size must be positive, e.g. `--budget 12GB`" in err
    assert "expected one argument" not in err


def test_plan_reports_every_problem_at_once(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "plan.yaml"
    code = _exit(["plan", "--model", "gpt2", "--batch-size", "0", "--seq-len", "64", "--host-memory", "-2GB",
                  "--write", str(missing)])
    assert code == 2
    err = capsys.readouterr().err
    assert "Passed `--batch-size 0`; expected a positive integer" in err
    assert "give `--device-memory`" in err
    assert "Passed `--host-memory -2GB`; a memory size must be positive" in err
    assert f"the directory {str(missing.parent)!r} does not exist; create it (`mkdir -p {missing.parent}`)" in err
