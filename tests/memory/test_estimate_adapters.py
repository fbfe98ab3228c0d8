"""An adapter run in the dry run, ``estimate_memory`` and ``lowmem estimate``: the ``Adapters`` callback's own code runs
on the fake model; the prediction equals ``MemoryReport``'s measurement of the same run on the CPU; bad adapter
flags are refused before anything is traced, every one named, as given."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_lowmem import ActivationCheckpointing, Adapters, estimate_memory
from lightning_lowmem.cli.estimate import main
from lightning_lowmem.predict.run_spec import RunSpec
from tests.helpers.models import LLAMA_TINY, random_batch, tiny_lm_module
from tests.helpers.runif import RunIf
from tests.memory.test_dry_run import _assert_predicted_equals_measured, _measure

pytestmark = [RunIf(peft=True), pytest.mark.filterwarnings("ignore:.*self.log.*")]

#: a LLaMA shape (``nn.Linear`` layers, as bitsandbytes and PEFT's all-linear need) from a config, nothing downloaded
SHAPE = {"model_type": "llama", **LLAMA_TINY, "num_hidden_layers": 2, "vocab_size": 258}
TINY = ["--model", "llama", *(a for k, v in SHAPE.items() if k != "model_type" for a in ("--set", f"{k}={v}"))]

RUNS = {
    "lora fp32": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4),
    "dora fp32": lambda: RunSpec.from_flags(adapters="dora", adapter_r=4),
    "lora offload + ckpt": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4, precision="bf16-true",
                                                      offload=True, checkpointing="all"),
    # NOTE: the frozen base streamed without masters: the views of the masters show its host copies
    "lora offload_params + ckpt": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4, precision="bf16-true",
                                                             offload=True, offload_params=True, checkpointing="all"),
    "qlora nf4 fp32": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4, quantize_base="nf4"),
    "qlora nf4 offload + ckpt": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4, quantize_base="nf4",
                                                           precision="bf16-true", offload=True, checkpointing="all"),
    "qlora nf4 streamed + ckpt": lambda: RunSpec.from_flags(adapters="lora", adapter_r=4, quantize_base="nf4",
                                                            precision="bf16-true", offload=True, offload_params=True,
                                                            checkpointing="all"),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(RUNS))
def test_adapter_run_prediction_equals_measurement(name, tmp_path):
    """The estimate shorthands build the run a user gives the Trainer; MemoryReport predicts it (the dry run of the
    callback's own code) and measures it: they agree within the dry run's usual 1 %."""
    spec = RUNS[name]()
    first = spec.callbacks[0]
    assert isinstance(first, Adapters) and first.r == 4
    torch.manual_seed(0)
    module = tiny_lm_module("llama", config={"num_hidden_layers": 2})
    report = _measure(spec, module, random_batch(2, 32), tmp_path)
    _assert_predicted_equals_measured(report)
    trained = [p for p in module.parameters() if p.requires_grad]
    assert trained and sum(p.numel() for p in trained) < sum(p.numel() for p in module.parameters()) / 5


def test_shorthands_are_the_callback():
    """``adapters=``/``adapter_r=`` predict exactly what ``callbacks=[Adapters(...)]`` does; gradients and optimizer
    state are the adapters' alone, the frozen base counts as weights."""
    by_flags = estimate_memory(SHAPE, 2, 32, target="cpu", adapters="lora", adapter_r=4, checkpointing="all")
    by_callback = estimate_memory(SHAPE, 2, 32, target="cpu",
                                  callbacks=[Adapters("lora", r=4), ActivationCheckpointing("all")])
    full = estimate_memory(SHAPE, 2, 32, target="cpu", checkpointing="all")
    for phase, bd in by_flags.phases.items():
        assert bd.device == by_callback.phases[phase].device, phase
    opt, full_opt = by_flags.phases["optimizer"].device, full.phases["optimizer"].device
    assert opt["weights"] > full_opt["weights"]  # the base plus the adapters
    assert opt["gradients"] < full_opt["gradients"] / 5 and opt["optimizer_state"] < full_opt["optimizer_state"] / 5


def test_shorthand_problems_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"`adapter_r=4`, `quantize_base='nf4'` without `adapters`"):
        estimate_memory(SHAPE, 2, 32, adapter_r=4, quantize_base="nf4")
    with pytest.raises(ValueError, match=r"`method='analytic'` with `Adapters\(kind='lora'.*closed form does not model"):
        estimate_memory(SHAPE, 2, 32, adapters="lora", method="analytic")
    with pytest.raises(ValueError, match=r"Adapters: passed `r=0`"):
        estimate_memory(SHAPE, 2, 32, adapters="lora", adapter_r=0)


def test_cli_rows_break_the_device_peak_down_by_category(capsys):
    assert main([*TINY, "--batch-size", "2", "--seq-len", "32", "--target", "cpu", "--only", "baseline",
                 "--adapters", "lora", "--adapter-r", "4"]) == 0
    out = capsys.readouterr().out
    assert "adapters lora r=4" in out
    header = next(line for line in out.splitlines() if line.startswith("combination"))
    for column in ("weights", "gradients", "optimizer_state", "activations"):
        assert column in header
    row = next(line for line in out.splitlines() if line.startswith("fp32 AdamW (baseline)"))
    assert "dry_run" in row and "MiB" in row


@RunIf(bitsandbytes=True)
def test_cli_quantized_base_row_is_a_dry_run_with_the_packed_base(tmp_path):
    """A 4-bit base is traced like any other (bitsandbytes' own layers on fake tensors): its row is a dry run whose
    weights are smaller than the same LoRA run's on the unquantized base."""
    import json

    def weights(*quant: str) -> int:
        out = tmp_path / "rows.json"
        assert main([*TINY, "--batch-size", "2", "--seq-len", "32", "--target", "cpu", "--only", "baseline",
                     "--adapters", "lora", *quant, "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())
        assert row["method"] == "dry_run", row
        return row["phases"]["optimizer"]["device"]["weights"]

    assert weights("--quantize-base", "nf4") < weights()


def _error(argv, capsys) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cli_bad_adapter_flags_are_reported_together(capsys):
    err = _error([*TINY, "--batch-size", "2", "--seq-len", "32", "--adapters", "lorax", "--adapter-r", "0",
                  "--quantize-base", "nf3", "--analytic"], capsys)
    for message in ("Passed `--adapters lorax`; expected one of lora, dora", "Passed `--adapter-r 0`; expected",
                    "Passed `--quantize-base nf3`; expected one of nf4, fp4, int8",
                    "with `--analytic`: the closed form does not model adapters"):
        assert message in err, message
    err = _error([*TINY, "--batch-size", "2", "--seq-len", "32", "--quantize-base", "nf4", "--adapter-r", "8"], capsys)
    assert "Passed `--adapter-r 8` and `--quantize-base nf4` without `--adapters`; add `--adapters lora`" in err
    err = _error(["--config", "run.yaml", "--adapters", "lora"], capsys)
    assert "are for --model; with --config add `class_path: Adapters`" in err


def test_cli_missing_extra_names_the_pip_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)
    err = _error([*TINY, "--batch-size", "2", "--seq-len", "32", "--adapters", "dora"], capsys)
    assert "`--adapters dora` needs the `peft` package" in err and "pip install 'lightning-lowmem[peft]'" in err
