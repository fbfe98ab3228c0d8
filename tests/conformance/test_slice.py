"""The fast slice of the conformance sweep, run by ``make test``: one module of every kind of the corpus with the
core flags, every other flag on the causal LM, the DeepSpeed presets and Lightning's own callbacks on one module each,
and the dry run of two modules (169 cells; ``pytest -m conformance tests/conformance`` measured 76 s wall, 81 s CPU,
on 2 quiet cores with a cold torch.compile cache, 32 s warm, and 9-14 min on a machine shared at load 10-15).
``make conformance``
(``python tests/conformance/run.py``) runs the whole corpus.

A cell passes with ``exact``, ``close`` (the comparison's stated bound, see ``compare.py``), ``refused`` (before the
first step, with a message) or ``n/a`` (plain Lightning cannot run it either). A ``differs``/``crash`` that is a known
bug (``known_bugs.py``) is an ``xfail`` (not strict: the fix turns it green); any other fails with the cell's detail.
"""

from __future__ import annotations

import pytest

from tests.conformance.companions import COMPANIONS
from tests.conformance.corpus import MODULES
from tests.conformance.flags import FLAGS
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.integration, pytest.mark.conformance]

# the module of each kind the slice runs: the cheapest that shows what the kind is about (here, not in corpus.py, so
# that choosing them does not change the sweep's code fingerprint)
SLICE_MODULES = {
    "causal_lm": "hf_llama", "seq2seq": "hf_t5", "encoder_cls": "hf_bert", "vision_cls": "hf_resnet",
    "audio_cls": "hf_wav2vec2", "cnn": "cnn_bn", "mlp": "mlp", "rnn": "lstm_packed", "peft": "peft_lora_llama",
    "frozen_backbone": "frozen_backbone", "configure_model": "configure_model", "compiled": "compiled_submodule",
    "outputs": "outputs_dataclass", "manual_opt": "manual_3_optimizers", "torchmetrics": "torchmetrics",
    "sync_dist": "sync_dist_logging", "clipping": "clipping_override",
}
# every slice module runs these; the other slice flags run on the causal LM, and EXTRA on the modules named
CORE = ("lowmem_offload@32-true", "lowmem_offload@bf16-mixed", "lowmem_offload@bf16-true", "ActivationCheckpointing(all)",
        "ActivationOffload(min_bytes=0)", "AccumulationScheduler(8/4)", "OptimizerInBackward", "MemoryReport")
OTHER_KINDS = ("causal_lm",)
EXTRA = {"lstm_packed": ("LowBitOptimizer(adamw8bit)",), "cnn_bn": ("LowBitOptimizer(adamw8bit)",)}
# torch.compile recompiles in every fit: the compiled module runs the flags that change what it compiles
COMPILED = ("lowmem_offload@32-true", "lowmem_offload@bf16-mixed", "ActivationCheckpointing(all)", "MemoryReport")
DEEPSPEED_MODULE, CALLBACK_MODULE = "hf_llama", "cnn_bn"
CALLBACK_FLAGS = ("lowmem_offload@32-true",)
DRY_RUN = ("hf_gpt2", "cnn_bn")


def _cells() -> list:
    out = []
    for kind, module in SLICE_MODULES.items():
        spec = MODULES[module]
        for flag in FLAGS:
            if flag.group != "torch" or not flag.slice or flag.applies(spec) is not None:
                continue
            if kind == "compiled":
                keep = flag.name in COMPILED
            else:
                keep = flag.name in CORE or kind in OTHER_KINDS or flag.name in EXTRA.get(module, ())
            if keep:
                out.append(pytest.param(module, flag, None, id=f"{module}|{flag.name}"))
    for flag in FLAGS:
        if flag.group == "deepspeed" and flag.slice and flag.applies(MODULES[DEEPSPEED_MODULE]) is None:
            out.append(pytest.param(DEEPSPEED_MODULE, flag, None, id=f"{DEEPSPEED_MODULE}|{flag.name}",
                                    marks=[pytest.mark.deepspeed, RunIf(deepspeed=True)]))
    for companion in COMPANIONS:
        for name in CALLBACK_FLAGS:
            flag = next(f for f in FLAGS if f.name == name)
            out.append(pytest.param(CALLBACK_MODULE, flag, companion, id=f"{CALLBACK_MODULE}|{name} + {companion.name}"))
    return out


def _judge(row: dict) -> None:
    from tests.conformance.known_bugs import classify

    if row["verdict"] in ("exact", "close", "refused", "n/a", "ok"):
        return
    known = classify(row)
    if known is not None:
        pytest.xfail(f"known: {known.what} ({known.where}): {row['detail'][:200]}")
    pytest.fail(f"{row['module']} | {row['flag']}: {row['verdict']}: {row['detail']}")


@pytest.mark.parametrize(("module", "flag", "companion"), _cells())
def test_cell(module, flag, companion):
    from tests.conformance.cell import run_cell

    _judge(run_cell(MODULES[module], flag, companion))


@pytest.mark.parametrize("module", DRY_RUN)
def test_dry_run_prediction(module):
    from tests.conformance.dryrun import CONFIGS, check

    for config in CONFIGS:
        _judge(check(MODULES[module], config))
