"""The ``lowmem`` subcommands: what ``lowmem --help`` lists, and the modules that run the extra ones.

Imports nothing, so ``lowmem --help`` answers without importing Lightning or torch.
"""

# extra subcommands: name -> (module, function taking argv and returning an exit code)
TOOLS = {
    "estimate": ("lightning_lowmem.cli.estimate", "main"),
    "plan": ("lightning_lowmem.cli.plan", "main"),
    "consolidate": ("lightning_lowmem.cli.consolidate", "consolidate_main"),
    "build-ops": ("lightning_lowmem.cli.build_ops", "main"),
}
# every subcommand, for `lowmem --help` (answered without importing Lightning or torch)
SUBCOMMANDS = {
    "fit": "train: `lowmem fit --config run.yaml` (LightningCLI; `lowmem fit --help` lists every option)",
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
