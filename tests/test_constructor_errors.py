"""One kind of exception per kind of mistake, across every public constructor.

The rule: a value of the wrong type (a string where a number or a flag is expected, a number where a path is)
raises ``TypeError``; a value of the right type that is out of range, or not one of a fixed set of choices,
raises ``ValueError``. Either way the message repeats the argument as it was passed (``name=value``).
"""

from __future__ import annotations

import re

import pytest

import lightning_lowmem as ll
from tests.helpers.runif import RunIf

T, V = TypeError, ValueError
DS = [pytest.mark.deepspeed, RunIf(deepspeed=True)]

CASES = [
    # ActivationCheckpointing
    ("ActivationCheckpointing", {"policy": 3}, T, "policy=3"),
    ("ActivationCheckpointing", {"policy": "sqrtt"}, V, "policy='sqrtt'"),
    ("ActivationCheckpointing", {"policy": []}, V, "policy=[]"),
    ("ActivationCheckpointing", {"policy": ["GPT2Block", 3]}, T, "policy=['GPT2Block', 3]"),
    ("ActivationCheckpointing", {"policy": "every_n", "n": "2"}, T, "n='2'"),
    ("ActivationCheckpointing", {"policy": "every_n", "n": 0}, V, "n=0"),
    ("ActivationCheckpointing", {"policy": "budget", "budget": [1]}, T, "`budget` [1]"),
    ("ActivationCheckpointing", {"policy": "budget", "budget": "lots"}, V, "`budget` 'lots'"),
    ("ActivationCheckpointing", {"policy": "budget", "budget": -1}, V, "`budget` -1"),
    ("ActivationCheckpointing", {"blocks": 3}, T, "blocks=3"),
    # ActivationOffload
    ("ActivationOffload", {"min_bytes": "1"}, T, "min_bytes='1'"),
    ("ActivationOffload", {"min_bytes": -1}, V, "min_bytes=-1"),
    ("ActivationOffload", {"prefetch": 1.5}, T, "prefetch=1.5"),
    ("ActivationOffload", {"prefetch": -1}, V, "prefetch=-1"),
    ("ActivationOffload", {"pin_memory": "yes"}, T, "pin_memory='yes'"),
    ("ActivationOffload", {"boundaries_only": 1}, T, "boundaries_only=1"),
    # AccumulationScheduler
    ("AccumulationScheduler", {"effective_batch_size": "64"}, T, "effective_batch_size='64'"),
    ("AccumulationScheduler", {"effective_batch_size": 0}, V, "effective_batch_size=0"),
    ("AccumulationScheduler", {"micro_batch_size": 2.5}, T, "micro_batch_size=2.5"),
    ("AccumulationScheduler", {"micro_batch_size": 0}, V, "micro_batch_size=0"),
    ("AccumulationScheduler", {"micro_batch_size": "big"}, V, "micro_batch_size='big'"),
    ("AccumulationScheduler", {"schedule": [1]}, T, "schedule=[1]"),
    ("AccumulationScheduler", {"schedule": {1: "32"}}, T, "1: '32'"),
    ("AccumulationScheduler", {"schedule": {1: 0}}, V, "1: 0"),
    ("AccumulationScheduler", {"schedule_interval": "hour"}, V, "schedule_interval='hour'"),
    ("AccumulationScheduler", {"loss_normalization": "mean"}, V, "loss_normalization='mean'"),
    ("AccumulationScheduler", {"memory_budget": [1]}, T, "memory_budget=[1]"),
    ("AccumulationScheduler", {"memory_budget": "lots"}, V, "memory_budget`: Passed a memory size 'lots'"),
    ("AccumulationScheduler", {"memory_budget": 0}, V, "memory_budget=0"),
    ("AccumulationScheduler", {"batch_arg_name": 3}, T, "batch_arg_name=3"),
    ("AccumulationScheduler", {"on_oom": "retry"}, V, "on_oom='retry'"),
    # Adapters
    pytest.param("Adapters", {"kind": "ia3"}, V, "kind='ia3'", marks=RunIf(peft=True)),
    pytest.param("Adapters", {"r": "16"}, T, "r='16'", marks=RunIf(peft=True)),
    pytest.param("Adapters", {"r": 0}, V, "r=0", marks=RunIf(peft=True)),
    pytest.param("Adapters", {"dropout": 1.0}, V, "dropout=1.0", marks=RunIf(peft=True)),
    pytest.param("Adapters", {"target_modules": 3}, T, "target_modules=3", marks=RunIf(peft=True)),
    pytest.param("Adapters", {"quantize_base": "nf2"}, V, "quantize_base='nf2'", marks=RunIf(peft=True)),
    # LowBitOptimizer
    ("LowBitOptimizer", {"kind": "adam4bit"}, V, "kind='adam4bit'"),
    ("LowBitOptimizer", {"min_8bit_size": "4096"}, T, "min_8bit_size='4096'"),
    ("LowBitOptimizer", {"min_8bit_size": -1}, V, "min_8bit_size=-1"),
    ("LowBitOptimizer", {"stable_embedding": "x"}, T, "stable_embedding='x'"),
    # ChunkedLMLoss
    ("ChunkedLMLoss", {"chunk_tokens": "1024"}, T, "chunk_tokens='1024'"),
    ("ChunkedLMLoss", {"chunk_tokens": 0}, V, "chunk_tokens=0"),
    ("ChunkedLMLoss", {"backend": "fast"}, V, "backend='fast'"),
    ("ChunkedLMLoss", {"recompute": "yes"}, T, "recompute='yes'"),
    # MemoryReport and the recorder under it
    ("MemoryReport", {"every_n_steps": "10"}, T, "every_n_steps='10'"),
    ("MemoryReport", {"every_n_steps": 0}, V, "every_n_steps=0"),
    ("MemoryReport", {"phases": "yes"}, T, "phases='yes'"),
    ("MemoryReport", {"save_dir": 3}, T, "save_dir` of type int"),
    ("StepMemoryRecorder", {"every_n_steps": "10"}, T, "every_n_steps='10'"),
    ("StepMemoryRecorder", {"every_n_steps": 0}, V, "every_n_steps=0"),
    ("StepMemoryRecorder", {"timeline": "yes"}, T, "timeline='yes'"),
    # OffloadStrategy
    ("OffloadStrategy", {"optimizer_in_backward": "yes"}, T, "optimizer_in_backward='yes'"),
    ("OffloadStrategy", {"host_optimizer": "gpu"}, V, "host_optimizer='gpu'"),
    ("OffloadStrategy", {"nonfinite": "explode"}, V, "nonfinite='explode'"),
    ("OffloadStrategy", {"max_consecutive_skips": "3"}, T, "max_consecutive_skips='3'"),
    ("OffloadStrategy", {"max_consecutive_skips": 0}, V, "max_consecutive_skips=0"),
    ("OffloadStrategy", {"offload_params": "yes"}, V, "offload_params='yes'"),
    ("OffloadStrategy", {"prefetch": "1"}, T, "prefetch='1'"),
    ("OffloadStrategy", {"prefetch": -1}, V, "prefetch=-1"),
    ("OffloadStrategy", {"device_budget": [1]}, T, "device_budget=[1]"),
    ("OffloadStrategy", {"device_budget": "lots"}, V, "device_budget='lots'"),
    ("OffloadStrategy", {"load_weights": 3}, T, "load_weights=3"),
    # AutoStrategy
    ("AutoStrategy", {"device_budget": [1]}, T, "device_budget` [1]"),
    ("AutoStrategy", {"device_budget": "lots"}, V, "device_budget` 'lots'"),
    ("AutoStrategy", {"host_budget": -5}, V, "host_budget` -5"),
    ("AutoStrategy", {"hardware": 3}, T, "hardware=3"),
    ("AutoStrategy", {"hardware": "tpu-v9"}, V, "hardware='tpu-v9'"),
    ("AutoStrategy", {"pure_half": "x"}, T, "pure_half='x'"),
    # ZeroStrategy
    pytest.param("ZeroStrategy", {"stage": 4}, V, "stage=4", marks=DS),
    pytest.param("ZeroStrategy", {"offload_device": "disk"}, V, "offload_device='disk'", marks=DS),
    pytest.param("ZeroStrategy", {"check_host_memory": "x"}, T, "check_host_memory='x'", marks=DS),
    pytest.param("ZeroStrategy", {"gather_on_fit_end": "x"}, T, "gather_on_fit_end='x'", marks=DS),
    pytest.param("ZeroStrategy", {"offload_optimizer": "yes"}, T, "offload_optimizer='yes'", marks=DS),
]


def _id(case) -> str:  # type: ignore[no-untyped-def]
    values = case.values if hasattr(case, "values") else case
    name, kwargs, error = values[:3]
    return f"{name}-{error.__name__}-" + ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize(("name", "kwargs", "error", "echo"), CASES, ids=[_id(c) for c in CASES])
def test_wrong_type_is_a_type_error_and_bad_value_a_value_error(name, kwargs, error, echo):
    cls = getattr(ll, name)
    with pytest.raises(Exception) as info:  # the exact class is asserted below, with the message
        cls(**kwargs)
    assert type(info.value) is error, f"{name}(**{kwargs}) raised {type(info.value).__name__}: {info.value}"
    assert echo in str(info.value), str(info.value)
    assert name in str(info.value) or re.search(r"Passed", str(info.value)), str(info.value)


def test_a_wrong_type_and_a_bad_value_together_are_both_reported_as_a_type_error():
    """The type is the first thing to fix; the message still names every problem."""
    with pytest.raises(TypeError) as info:
        ll.AccumulationScheduler(effective_batch_size="64", on_oom="retry")
    assert "effective_batch_size='64'" in str(info.value) and "on_oom='retry'" in str(info.value)
    with pytest.raises(TypeError) as info:
        ll.LowBitOptimizer(kind="adam4bit", stable_embedding="x")
    assert "kind='adam4bit'" in str(info.value) and "stable_embedding='x'" in str(info.value)
