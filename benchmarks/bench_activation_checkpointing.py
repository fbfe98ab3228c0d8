"""ActivationCheckpointing: activation bytes (measured by category) and step time, each policy vs none.

12-layer GPT-2-architecture model at sequence 512 (width and batch chosen to keep one CPU process small).
Memory comes from ``MemoryTracker`` (one step per policy): ``act_fwd`` is the ``activations`` category at
the forward peak (what is kept for backward), ``act_peak`` the step's device peak minus weights, gradients
and optimizer state (so it includes the recompute transients of checkpointing, counted as ``other``).
Step times (forward + backward + AdamW) are interleaved, policy after policy, and reported as ratios.

Run: ``python benchmarks/run.py activation_checkpointing [--layers 12 --seq 512 --width 256 --batch 2 --rounds 3]``
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import add_gpt2_args, build_gpt2, fmt_bytes, interleaved, lm_step, write_results
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.measure.tracker import MemoryTracker


def main() -> None:
    parser = argparse.ArgumentParser()
    add_gpt2_args(parser, rounds=7)
    args = parser.parse_args()
    base, ids = build_gpt2(args)

    policies: dict[str, dict] = {
        "none": {},
        "all": {"policy": "all"},
        "every_n(2)": {"policy": "every_n", "n": 2},
        "sqrt": {"policy": "sqrt"},
        "selective": {"policy": "selective"},
    }
    models, optimizers = {}, {}
    for name, kwargs in policies.items():
        model = copy.deepcopy(base)
        if kwargs:
            ActivationCheckpointing(**kwargs)._apply(model)
        models[name] = model
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(name: str, tracker: MemoryTracker | None = None) -> None:
        lm_step(models[name], optimizers[name], ids, tracker)

    memory = {}
    for name in policies:
        step(name)  # optimizer state exists, as in training
        tracker = MemoryTracker(module=models[name], optimizers=[optimizers[name]])
        tracker.track(ids)
        with tracker:
            step(name, tracker)
        peak = tracker.peak_breakdown().device
        act_peak = tracker.peak_bytes - peak["weights"] - peak["gradients"] - peak["optimizer_state"]
        memory[name] = {
            "act_fwd": tracker.peaks["forward"].by_category["activations"],
            "act_peak": act_peak,
            "peak": tracker.peak_bytes,
            "report": tracker.report(),
        }

    times = interleaved({name: (lambda n=name: step(n)) for name in policies}, rounds=args.rounds, warmup=1)

    L = args.layers
    none, full = memory["none"], memory["all"]
    block_worth = (none["act_fwd"] - full["act_fwd"]) / L  # activations one un-checkpointed block adds
    # NOTE: the machine is shared with other jobs; their noise only ever adds time, so the minimum over the
    # interleaved rounds is the figure for the targets (medians are reported beside it).
    t_none, t_all = times["none"]["min_s"], times["all"]["min_s"]
    rows = []
    for name in policies:
        m, t = memory[name], times[name]["min_s"]
        rows.append(
            {
                "policy": name,
                "act_fwd": fmt_bytes(m["act_fwd"]),
                "act_fwd_x_less": none["act_fwd"] / m["act_fwd"],
                "act_peak": fmt_bytes(m["act_peak"]),
                "act_peak_x_less": none["act_peak"] / m["act_peak"],
                "blocks_worth_at_peak": m["act_peak"] / block_worth,
                "step_s_min": t,
                "time_x": t / t_none,
                "time_x_median": times[name]["median_s"] / times["none"]["median_s"],
                "act_fwd_bytes": m["act_fwd"],
                "act_peak_bytes": m["act_peak"],
                "peak_bytes": m["peak"],
                "times": times[name],
                "tracker": m["report"],
            }
        )
    sel = memory["selective"]
    saving_share = (none["act_fwd"] - sel["act_fwd"]) / (none["act_fwd"] - full["act_fwd"])
    extra_share = (times["selective"]["min_s"] - t_none) / max(t_all - t_none, 1e-9)
    sqrt_worth = memory["sqrt"]["act_peak"] / block_worth
    targets = {
        "all_act_fwd_x_less (>= 4)": none["act_fwd"] / full["act_fwd"],
        "all_act_peak_x_less (>= 4)": none["act_peak"] / full["act_peak"],
        "sqrt_blocks_worth_at_peak (about 2*sqrt(L) = %.1f)" % (2 * math.sqrt(L)): sqrt_worth,
        "selective_share_of_all_saving (>= 0.5)": saving_share,
        "selective_share_of_all_extra_time (< 0.5)": extra_share,
        "all_time_x (<= 1.4)": t_all / t_none,
    }
    notes = [
        (f"GPT-2 architecture, {L} layers, n_embd {args.width}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
        "dropout 0.1 (GPT-2 default), fp32, AdamW; byte vocabulary (258)."),
        ("act_fwd: `activations` category at the forward peak (saved for backward). act_peak: step peak minus weights, "
        "gradients and optimizer state, i.e. activations plus temporaries, recompute transients included."),
        f"one block's worth = (act_fwd[none] - act_fwd[all]) / L = {fmt_bytes(block_worth)}.",
        (f"step times: {args.rounds} interleaved rounds after 1 warm-up; time_x = min over rounds / min of none "
        "(shared machine: noise only adds time), time_x_median the same with medians."),
        *[f"target {k}: {v:.3g}" for k, v in targets.items()],
    ]
    columns = ["policy", "act_fwd", "act_fwd_x_less", "act_peak", "act_peak_x_less", "blocks_worth_at_peak", "step_s_min", "time_x", "time_x_median"]
    write_results(
        "activation_checkpointing",
        rows,
        columns,
        title="ActivationCheckpointing: activation memory and step time per policy (GPT-2 architecture)",
        notes=notes,
        extra={"targets": targets, "config": vars(args)},
    )


if __name__ == "__main__":
    main()
