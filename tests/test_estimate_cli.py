"""``lowmem estimate``: the table of technique combinations (--model), the run of a YAML (--config), JSON output,
and every problem with the arguments reported at once (exit 2) before anything is traced."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_lowmem import cli
from lightning_lowmem.cli.estimate import main
from lightning_lowmem.predict.estimate import COMBINATIONS

pytestmark = pytest.mark.filterwarnings("ignore:.*self.log.*", "ignore:.*LightningCLI's args parameter.*")

TINY = ["--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--set", "vocab_size=258"]

YAML = """
trainer:
  accelerator: cpu
  strategy: lowmem_offload
  precision: bf16-true
  logger: false
  callbacks:
    - class_path: ActivationCheckpointing
      init_args: {policy: all}
model:
  class_path: lightning_lowmem.demo.module.CausalLMModule
  init_args:
    config: {n_layer: 2, n_embd: 64, n_head: 2, n_positions: 64}
data:
  class_path: lightning_lowmem.demo.data.StdlibTextDataModule
  init_args: {seq_len: 32, batch_size: 2, max_bytes: 20000}
"""


def _error(argv, capsys) -> str:  # type: ignore[no-untyped-def]
    """Run ``main`` on arguments it must refuse; the one error message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("lowmem estimate: error:") == 1
    return err


def test_table_with_budget_and_json(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    argv = ["estimate", *TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "12 GiB", "--target", "cpu",
            "--only", "baseline", "--only", "bf16-true + ckpt(all)", "--json", str(out)]
    assert cli.main(argv) == 0  # through the `lowmem` entry point
    text = capsys.readouterr().out
    assert "budget 12 GiB = 12,884,901,888 B" in text
    assert "fp32 AdamW (baseline)" in text and "bf16-true + ckpt(all)" in text
    assert "yes" in text  # a tiny model fits
    assert "uncalibrated" not in text  # no CUDA corrections for a CPU target
    rows = json.loads(out.read_text())
    # --only matches by substring: "bf16-true + ckpt(all)" also names the 8-bit AdamW and opt-in-bwd rows
    names = [r["combination"] for r in rows]
    assert names[:2] == ["fp32 AdamW (baseline)", "bf16-true + ckpt(all)"]
    assert set(names) <= {n for n, _ in COMBINATIONS if n == "fp32 AdamW (baseline)" or "bf16-true + ckpt(all)" in n}
    assert all(r["method"] == "dry_run" and r["peak_device"] > 0 for r in rows)
    assert rows[0]["run"]["precision"] == "32-true" and rows[1]["run"]["precision"] == "bf16-true"
    assert rows[0]["peak_device"] > rows[1]["peak_device"]


def test_a_budgets_unit_is_stated_beside_the_tables(capsys):
    """Issue 48 item 6: `--budget 12GB` is 12e9 B (11.18 GiB), the table's sizes are GiB: both are printed, and what
    a GPU sold as "12 GB" holds."""
    assert main([*TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "12GB", "--target", "cpu",
                 "--only", "baseline"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "budget 12GB = 12,000,000,000 B = 11.18 GiB (GB = 10^9 B, GiB = 2^30 B" in lines[0]
    assert "a GPU sold as 12 GB holds 12 GiB: give it as 12GiB" in lines[0]
    assert "fits 12GB (11.18 GiB)" in lines[1]  # the table's header


def test_rows_the_closed_form_rules_out_are_not_traced(capsys):
    """Issue 48: a row whose model states alone exceed the budget in closed form is not traced (the README's table:
    fp32, bf16-mixed and bf16-true need 11.6 GiB and more of GPT-2 XL's states on a 12 GB budget)."""
    from lightning_lowmem.predict.estimate import estimate_memory

    shape = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 258}
    states = 16 * 152_832  # fp32 AdamW: 16 B per parameter
    est = estimate_memory(shape, 2, 32, target="cpu", skip_above=states // 2)
    assert est.method == "analytic" and est.fits(states // 2) is False
    assert est.fallback_reason.startswith("not traced: the model states alone need")
    # weights, optimizer state and gradients only: the optimizer in backward keeps no full gradient, streamed
    # weights are not all on the device: neither is ruled out by the states of another run
    assert estimate_memory(shape, 2, 32, target="cpu", skip_above=states // 2, precision="bf16-true",
                           optimizer_in_backward=True).method == "dry_run"
    assert estimate_memory(shape, 2, 32, target="cpu", skip_above=states // 2).method == "analytic"
    assert estimate_memory(shape, 2, 32, target="cpu", skip_above=10**9).method == "dry_run"
    assert main([*TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "100KB", "--target", "cpu",
                 "--only", "baseline"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fp32 AdamW (baseline)")]
    assert " no " in row and "analytic (not traced: the model states alone need" in row


def test_a_class_path_that_does_not_import_says_so(capsys, tmp_path, monkeypatch):
    """Issue 48 item 5: a misspelt class path (or the right one run from another folder) was taken for a model shape
    ("Passed `--batch-size None`"); the import failure is said, with what to do."""
    monkeypatch.chdir(tmp_path)
    err = _error(["--model", "my_modul.MyGPT"], capsys)
    assert ("Passed `--model my_modul.MyGPT`, a LightningModule class path, but importing `my_modul` failed "
            "(ModuleNotFoundError: No module named 'my_modul')") in err
    assert f"current directory ({tmp_path})" in err and "--batch-size" not in err
    err = _error(["--model", "tests.memory._modules.NoSuchModule"], capsys)
    assert "`tests.memory._modules.NoSuchModule` is nothing, not a LightningModule subclass" in err
    from lightning_lowmem.cli import main as lowmem

    with pytest.raises(SystemExit):
        lowmem(["plan", "--model", "my_modul.MyGPT", "--device-memory", "1GB"])
    assert "importing `my_modul` failed" in capsys.readouterr().err


def test_zero_rows_have_no_combination_the_run_refuses():
    # the real ActivationOffload refuses DeepSpeed, as ActivationCheckpointing(policy="sqrt") refuses ZeRO-3: the
    # table offers no combination the run would refuse
    zero = [kw for _, kw in COMBINATIONS if kw.get("zero_stage")]
    assert zero and not any(kw.get("checkpointing") == "sqrt" or kw.get("activation_offload") for kw in zero)


def test_budget_decides_fits(capsys):
    assert main([*TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "1e3", "--target", "cpu",
                 "--only", "baseline"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fp32 AdamW (baseline)")]
    assert len(rows) == 1 and " no " in rows[0]


def test_analytic_flag_and_cuda_corrections_line(capsys):
    main([*TINY, "--batch-size", "2", "--seq-len", "32", "--analytic", "--only", "baseline"])
    text = capsys.readouterr().out
    assert "analytic" in text and "uncalibrated" in text


def test_config_predicts_the_run_of_a_yaml(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(YAML)
    out = tmp_path / "estimate.json"
    # no --target: the YAML's `accelerator: cpu` is the target, said on the first line
    assert main(["--config", str(yaml), "--budget", "1GB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith(f"{yaml}: target cpu (from trainer.accelerator: cpu; `--target` overrides)")
    assert "uncalibrated" not in text  # no CUDA corrections for a CPU run
    assert "device peak" in text and "host peak" in text and "fits 1GB" in text
    for phase in ("forward", "backward", "optimizer"):
        assert any(line.startswith(phase) for line in text.splitlines()), phase
    [row] = json.loads(out.read_text())
    assert row["config"] == str(yaml) and row["method"] == "dry_run"
    assert row["run"]["precision"] == "bf16-true" and row["run"]["strategy"].startswith("OffloadStrategy(")
    assert row["peak_host"] > 0  # fp32 masters and AdamW state on the host
    assert row["target"] == "cpu" and row["target_source"] == "trainer.accelerator: cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run described on a machine without one")
def test_config_of_a_gpu_run_is_predicted_for_cuda_on_a_machine_without_one(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(YAML.replace("accelerator: cpu", "accelerator: gpu"))
    assert main(["--config", str(yaml)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith(f"{yaml}: target cuda (from trainer.accelerator: gpu;")
    assert "uncalibrated" in text  # the CUDA corrections line
    assert main(["--config", str(yaml), "--target", "cpu"]) == 0  # --target overrides the YAML
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{yaml}: target cpu (from --target;")


def test_config_refuses_the_model_flags(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(YAML)
    err = _error(["--config", str(yaml), "--batch-size", "2", "--set", "n_layer=2", "--only", "baseline"], capsys)
    assert "`--batch-size` is for --model" in err and "`--only` is for --model" in err
    assert "`--set` is for --model; with --config edit the YAML" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "12 G"], "ambiguous"),
        (["--budget", "lots"], "Passed `--budget` 'lots' that does not parse"),
        (["--budget=-5GB"], "Passed `--budget -5GB`; a memory size must be positive, e.g. `--budget 12GB`"),
        (["--budget", "0"], "it must be positive"),
        (["--set", "n_layer"], "KEY=VALUE"),
        (["--set", "n_layers=3"], "`n_layers` is not a field of GPT2Config (did you mean 'n_layer'"),
        (["--set", "n_head=two"], "`n_head='two'` has the wrong type"),
        (["--micro-batch-size", "3"], "it must divide `--batch-size 2`"),
        (["--world-size", "0"], "--world-size 0"),
        (["--only", "ZeRO-7"], "Passed `--only ZeRO-7`, which matches no combination; the names are: fp32 AdamW"),
        (["--json", "."], "which is a directory"),
        (["--json", "no/such/dir/out.json"], "does not exist"),
    ],
)
def test_bad_input_exits_with_a_clear_message(argv, message, capsys):
    assert message in _error([*TINY, "--batch-size", "2", "--seq-len", "32", *argv], capsys)


def test_every_problem_is_reported_at_once(tmp_path, capsys):
    err = _error(["--model", "gpt2", "--set", "n_embdd=64", "--batch-size", "2", "--seq-len", "32",
                  "--micro-batch-size", "3", "--only", "nothing", "--json", str(tmp_path), "--budget=-5GB"], capsys)
    for message in ("`--budget -5GB`; a memory size must be positive", "which is a directory", "`--micro-batch-size 3`", "`--only nothing`",
                    "did you mean 'n_embd'"):
        assert message in err, message
    err = _error(["--model", "gpt2", "--batch-size", "2", "--seq-len", "2048", "--budget", "-"], capsys)
    assert "`--seq-len 2048`, beyond the 1024 learned positions of 'gpt2'" in err and "`--budget` '-'" in err


def test_zero_layers_refused_before_anything_is_traced(capsys):
    err = _error([*TINY, "--set", "n_layer=0", "--batch-size", "2", "--seq-len", "32", "--target", "cpu",
                  "--only", "opt-in-bwd"], capsys)
    assert "has 0 layers" in err


def test_unknown_model_and_bad_sizes(capsys, tmp_path):
    assert "shipped shape" in _error(["--model", "gpt9", "--batch-size", "2", "--seq-len", "8"], capsys)
    err = _error(["--model", str(tmp_path / "nope.json"), "--batch-size", "2", "--seq-len", "8"], capsys)
    assert "no such config file" in err
    assert "--batch-size 0" in _error([*TINY, "--batch-size", "0", "--seq-len", "8"], capsys)
    err = _error([*TINY], capsys)  # a model shape needs both sizes
    assert "--batch-size None" in err and "--seq-len None" in err


# --- --model CLASS_PATH --data CLASS_PATH: a module without `train_dataloader`, fed by a LightningDataModule ----------
AUTOENCODER = ["--model", "tests.memory._modules.AutoEncoder", "--target", "cpu", "--only", "baseline"]


def test_model_class_with_a_data_module_and_its_init_args(tmp_path, capsys):
    from lightning_lowmem.predict.dry_run import dry_run
    from tests.memory._modules import AutoEncoder, Images

    peaks = {}
    for form in (["--data.init_args.batch_size", "4"], ["--data.init_args.batch_size=4"],
                 ["--data-args", '{"batch_size": 4}'], ["--data-args", '{"batch_size": 2}',
                                                         "--data.init_args.batch_size", "16"]):
        out = tmp_path / "e.json"
        assert main([*AUTOENCODER, "--data", "tests.memory._modules.Images", *form, "--json", str(out)]) == 0
        [row] = json.loads(out.read_text())
        peaks[" ".join(form)] = row["peak_device"]
    capsys.readouterr()
    four, sixteen = dry_run(AutoEncoder, Images(batch_size=4)), dry_run(AutoEncoder, Images(batch_size=16))
    assert sixteen.peak_device > four.peak_device  # the data's batch size reached the run
    assert list(peaks.values()) == [four.peak_device] * 3 + [sixteen.peak_device]  # --data.init_args wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "tests.memory._modules.Nope"], "Passed `--data tests.memory._modules.Nope`, which does not name"),
        (["--data", "no_such_package.Data"], "cannot import 'no_such_package'"),
        (["--data", "tests.memory._modules.AutoEncoder"], "does not name a LightningDataModule"),
        (["--data", "tests.memory._modules.Images", "--data.init_args.bogus", "1"], "Images() refused them"),
        (["--data", "tests.memory._modules.Images", "--data-args", "[4]"], "expected a JSON object"),
        (["--data.init_args.batch_size", "4"], "Passed `--data.init_args.batch_size` without `--data CLASS_PATH`"),
    ],
)
def test_data_arguments_refused_with_the_fix(argv, message, capsys):
    assert message in _error([*AUTOENCODER, *argv], capsys)


def test_data_needs_a_module_class(tmp_path, capsys):
    err = _error([*TINY, "--batch-size", "2", "--seq-len", "8", "--data", "tests.memory._modules.Images"], capsys)
    assert "`--data` feeds a LightningModule: pass its class path as --model" in err
    yaml = tmp_path / "run.yaml"
    yaml.write_text(YAML)
    err = _error(["--config", str(yaml), "--data", "tests.memory._modules.Images"], capsys)
    assert "`--data` is for --model; with --config the YAML's `data:` section names the data" in err
