"""The planner: what it chooses for GPT-2-XL and LLaMA shapes at 24/12/6/2 GB, how long planning takes, and how
its cost model ranks recipes against step times measured side by side on this CPU.

    python benchmarks/bench_plan.py planning     # -> results/plan.{json,md}
    python benchmarks/bench_plan.py cost         # -> results/plan_cost.{json,md}
    python benchmarks/bench_plan.py              # both
    python benchmarks/bench_plan.py planning gpt2-xl   # one shape -> results/plan_gpt2-xl.{json,md}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import bench_trainer, fmt_bytes, lm_sample, write_results

GiB = 2**30
#: (shape, batch, seq): the issue's shapes
MODELS = [("gpt2-xl", 4, 1024), ("llama-7b", 1, 2048), ("llama-13b", 1, 2048), ("llama-70b", 1, 2048)]
#: budget (GiB) -> the profile whose rates price the steps (a card of that size; 2 GiB: the 3060's rates)
BUDGETS = [(24, "rtx4090-24gb"), (12, "rtx3060-12gb"), (6, "rtx2060-6gb"), (2, "rtx3060-12gb")]
HOST = 256 * GiB  # a large workstation's host memory


def planning(only: list[str]) -> None:
    from lightning_lowmem.plan.search import NoRecipeFitsError, plan

    rows = []
    for shape, batch, seq in MODELS:
        if only and shape not in only:
            continue
        cache: dict[Any, Any] = {}  # NOTE: dry runs shared between the budgets of one shape, as in one session
        for budget, hardware in BUDGETS:
            t0 = time.perf_counter()
            try:
                # NOTE: 8-bit AdamW allowed after the module's own AdamW, as the founding recipes use it
                p = plan(shape, batch, seq, device_memory=budget * GiB, host_memory=HOST, hardware=hardware,
                         cache=cache, optimizers=("adamw", "adamw8bit"))
            except NoRecipeFitsError as err:
                rows.append({"model": shape, "batch x seq": f"{batch} x {seq}", "budget_GiB": budget,
                             "hardware": hardware, "chosen": "none fits", "why": str(err).split(". To fit")[0],
                             "wall_s": round(time.perf_counter() - t0, 1)})
                continue
            fastest = min(r.cost.total_s for r in p.rows)
            rows.append({
                "model": shape, "batch x seq": f"{batch} x {seq}", "budget_GiB": budget, "hardware": hardware,
                "chosen": p.chosen.name, "device_peak": fmt_bytes(p.chosen.peak_device),
                "host_peak": fmt_bytes(p.chosen.peak_host), "step_vs_fastest": round(p.chosen.cost.total_s / fastest, 2),
                "predicted_step_s": round(p.chosen.cost.total_s, 3), "traces": p.traces,
                "wall_s": round(time.perf_counter() - t0, 1), "run": p.run.describe(),
            })
            print(rows[-1], flush=True)
    write_results(
        "plan" if not only else "plan_" + "_".join(only), rows,
        ["model", "batch x seq", "budget_GiB", "hardware", "chosen", "device_peak", "host_peak", "step_vs_fastest",
         "predicted_step_s", "traces", "wall_s", "why"],
        title="lowmem plan: the recipe chosen per model and device budget (host budget 256 GiB, CUDA target)",
        notes=[
            ("Each plan: every candidate priced by the cost model, then dry runs (the real Trainer.fit on fake tensors, "
            "CUDA target) fastest first until one fits device and host; wall_s is the plan's wall time on this "
            "machine, with the dry runs of the earlier budgets of the same model reused (one cache per model)."),
            "step_vs_fastest: the chosen recipe's predicted step time over the fastest candidate's (which may not fit).",
            ("Optimizers allowed: the module's AdamW, then 8-bit AdamW (`optimizers=('adamw', 'adamw8bit')`): 8-bit "
             "AdamW is chosen only where no recipe with AdamW fits."),
            "Step times are predictions from the named profile's datasheet rates (uncalibrated: no GPU lent yet).",
            ("'none fits': the message names the smallest device peak of any recipe and, where the device would fit, the "
            "host memory that would be needed."),
        ],
    )


def cost(_: list[str]) -> None:
    import statistics

    import lightning as L
    import torch

    from lightning_lowmem.demo.module import CausalLMModule
    from lightning_lowmem.plan.cost import ModelShape, step_cost
    from lightning_lowmem.plan.hardware import measure_host
    from lightning_lowmem.plan.recipes import Recipe

    config = {"n_layer": 4, "n_embd": 256, "n_head": 8, "n_positions": 128, "vocab_size": 258}
    batch, seq, steps, rounds = 8, 128, 6, 2
    recipes = [Recipe("fp32", 8), Recipe("fp32", 8, "all"), Recipe("fp32", 2), Recipe("mixed", 8),
               Recipe("offload", 8), Recipe("offload", 8, "all"), Recipe("offload", 2, "all"),
               Recipe("offload", 8, "all", activation_offload=True)]

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 256, (batch * steps * 2, seq), generator=g)
            rows = [lm_sample(i) for i in ids]
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.fit_loop._should_accumulate():
                return
            self.stamps.append(time.perf_counter())

    def fit(recipe: Recipe) -> float:
        torch.manual_seed(0)
        module = CausalLMModule(model_type="gpt2", config=config)
        timer = StepTimes()
        kwargs = recipe.run(batch).trainer_kwargs()
        bench_trainer(max_steps=steps, **{**kwargs, "callbacks": [*kwargs["callbacks"], timer]}).fit(module, datamodule=Data())
        return statistics.median(b - a for a, b in zip(timer.stamps[1:], timer.stamps[2:]))  # steps 3..N

    profile = measure_host()
    with torch.device("meta"):
        n = sum(p.numel() for p in CausalLMModule(model_type="gpt2", config=config).parameters())
    shape = ModelShape(n, config["n_layer"], config["n_embd"], seq, config["vocab_size"])
    measured: dict[Recipe, list[float]] = {r: [] for r in recipes}
    for _ in range(rounds):  # NOTE: interleaved, so the machine's noise hits every recipe alike
        for r in recipes:
            measured[r].append(fit(r))
    ref = recipes[0]
    meas_ref = statistics.median(measured[ref])
    pred_ref = step_cost(ref, shape, batch, profile).total_s
    rows = []
    for r in recipes:
        m = statistics.median(measured[r]) / meas_ref
        p = step_cost(r, shape, batch, profile).total_s / pred_ref
        rows.append({"recipe": r.name(), "measured_step_s": round(statistics.median(measured[r]), 4),
                     "measured_vs_fp32": round(m, 3), "predicted_vs_fp32": round(p, 3), "ratio_error": round(p / m, 3)})

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rm, rp = ranks([r["measured_vs_fp32"] for r in rows]), ranks([r["predicted_vs_fp32"] for r in rows])
    k = len(rows)
    spearman = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rm, rp)) / (k * (k * k - 1))
    worst = max(rows, key=lambda r: abs(r["ratio_error"] - 1))
    write_results(
        "plan_cost", rows, ["recipe", "measured_step_s", "measured_vs_fp32", "predicted_vs_fp32", "ratio_error"],
        title="The planner's cost model vs step times measured side by side on this CPU (GPT-2 4 x 256, batch 8 x 128)",
        notes=[(f"Spearman rank correlation {spearman:.3f} over {k} recipes; worst ratio error {worst['ratio_error']:.3f}x "
               f"({worst['recipe']})."),
               (f"Profile: measure_host() = {profile.fp32_tflops:.3f} TFLOP/s fp32, {profile.half_tflops:.3f} bf16, "
               f"{profile.device_gbps:.1f} GB/s copies (the CPU is the device and the host; the 'link' is memcpy)."),
               f"Median of steps 3..{steps} per fit, median over {rounds} interleaved rounds; ratios to fp32 micro 8."],
        extra={"spearman": spearman, "worst_ratio_error": worst["ratio_error"], "profile": profile.__dict__},
    )


if __name__ == "__main__":
    parts = {"planning": planning, "cost": cost}
    chosen = [a for a in sys.argv[1:] if a in parts] or list(parts)
    models = [a for a in sys.argv[1:] if a not in parts]  # planning: only these shapes (e.g. gpt2-xl)
    for part in chosen:
        parts[part](models)
