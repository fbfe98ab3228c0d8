"""The ``lowmem`` subcommands: what ``lowmem --help`` lists, and the modules that run the extra ones (no imports)."""

# extra subcommands: name -> (module, function taking argv and returning an exit code)
TOOLS = {
    "estimate": ("lightning_lowmem.cli.estimate", "main"),
    "plan": ("lightning_lowmem.cli.plan", "main"),
    "consolidate": ("lightning_lowmem.cli.consolidate", "consolidate_main"),
    "build-ops": ("lightning_lowmem.cli.build_ops", "main"),
}
# every subcommand, for `lowmem --help` (answered without importing Lightning or torch)
SUBCOMMANDS = {
    "fit": "train: `lowmem fit --config run.yaml` (LightningCLI; `--help`: the main options, `--help-all`: every one)",
    "validate": "run the validation loop of a config",
    "test": "run the test loop of a config",
    "predict": "run the predict loop of a config",
    "estimate": "predicted device and host peaks of a run (`--config run.yaml`) or of the suite's combinations "
                "(`--model gpt2-xl --batch-size 4 --seq-len 1024`), from a dry run on fake tensors",
    "plan": "the fastest recipe that fits a device (and host) budget: `--config run.yaml --device-memory 12GB "
            "--write plan.yaml`, then `lowmem fit --config plan.yaml`",
    "consolidate": "a DeepSpeed ZeRO checkpoint directory -> one plain fp32 state dict",
    "build-ops": "compile DeepSpeed's CPU ops (cpu_adam, shm collectives) ahead of time, removing stale build locks",
}
# the loops LightningCLI runs (`lowmem fit --help` answers them without importing Lightning)
LOOPS = ("fit", "validate", "test", "predict")
# the suite's callbacks, for `lowmem fit --help` (tests/test_cli.py checks that every public one is here)
CALLBACKS = {
    "ActivationCheckpointing": "recompute blocks' activations in backward instead of keeping them (policy: all, "
                               "every_n, sqrt, selective)",
    "ActivationOffload": "keep saved activations in host memory between forward and backward",
    "AccumulationScheduler": "an effective batch from micro-batches (exact loss normalisation; micro_batch_size: "
                             "auto searches the largest that fits)",
    "LowBitOptimizer": "8-bit AdamW state (bitsandbytes; the [bnb] extra)",
    "LeanOptimizer": "GaLore, APOLLO(-Mini), Adam-mini or torchao 4-/8-bit AdamW for the module's AdamW (the "
                     "[galore], [apollo], [adam-mini], [torchao] extras)",
    "OptimizerInBackward": "step each parameter as its gradient is ready (no full set of gradients)",
    "ChunkedLMLoss": "a causal-LM loss without the full logits tensor (chunks of tokens)",
    "MemoryReport": "measured peak memory by phase and category, beside the prediction and plain fp32",
    "Adapters": "LoRA/DoRA adapters on a frozen base, optionally 4-/8-bit (PEFT and bitsandbytes; the [peft] extra)",
}
