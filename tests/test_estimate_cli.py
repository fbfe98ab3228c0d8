"""``lowmem estimate``: the table of technique combinations, JSON output, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from lightning_lowmem import cli
from lightning_lowmem.memory.estimate import main

pytestmark = pytest.mark.filterwarnings("ignore:.*self.log.*")

TINY = ["--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--set", "vocab_size=258"]


def test_table_with_budget_and_json(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    argv = ["estimate", *TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "12 GiB", "--target", "cpu",
            "--only", "baseline", "--only", "bf16-true + ckpt(all)", "--json", str(out)]
    assert cli.main(argv) == 0  # through the `lowmem` entry point
    text = capsys.readouterr().out
    assert "budget 12 GiB = 12,884,901,888 B" in text
    assert "fp32 AdamW (baseline)" in text and "bf16-true + ckpt(all)" in text
    assert "yes" in text  # a tiny model fits
    rows = json.loads(out.read_text())
    assert [r["combination"] for r in rows][0] == "fp32 AdamW (baseline)"
    assert all(r["method"] == "dry_run" and r["peak_device"] > 0 for r in rows)
    assert rows[0]["peak_device"] > rows[1]["peak_device"]


def test_budget_decides_fits(capsys):
    main([*TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "1e3", "--target", "cpu", "--only", "baseline"])
    assert "no " in capsys.readouterr().out


def test_analytic_flag_and_cuda_corrections_line(capsys):
    main([*TINY, "--batch-size", "2", "--seq-len", "32", "--analytic", "--only", "baseline"])
    text = capsys.readouterr().out
    assert "analytic" in text and "uncalibrated" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "12 G"], "ambiguous"),
        (["--budget", "lots"], "does not parse"),
        (["--set", "n_layer"], "KEY=VALUE"),
    ],
)
def test_bad_input_exits_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--batch-size", "2", "--seq-len", "32", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_model_and_bad_sizes(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--model", "gpt9", "--batch-size", "2", "--seq-len", "8"])
    assert "shipped shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "nope.json"), "--batch-size", "2", "--seq-len", "8"])
    assert "no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*TINY, "--batch-size", "0", "--seq-len", "8"])
    assert "--batch-size 0" in capsys.readouterr().err
