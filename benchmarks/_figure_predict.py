"""The figure blocks of the estimate, planner, GPU-checks and benchmarks pages, and the README's headline figures."""

from __future__ import annotations

from benchmarks._figure_common import (
    Block,
    Results,
    block,
    dry_run,
    gib,
    is_dry_run,
    note,
    one,
    parse_bytes,
    rows,
    source,
    table,
    where,
    x,
)
from benchmarks.gpu import report as gpu_report


@block("estimate")
def estimate_accuracy(r: Results) -> str:
    d = r["estimate"]
    combos = list(dict.fromkeys(v["combination"] for v in d["rows"]))
    models = list(dict.fromkeys((v["model"], v["params"]) for v in d["rows"]))
    out = []
    for model, params in models:
        cells = []
        for combo in combos:
            v = one(d, model=model, combination=combo)
            cell = f"{v['predicted_MiB']:,.1f} / {v['measured_MiB']:,.1f} ({v['dry_run_error_%']:+.3f} %)"
            if v["measured_host_MiB"]:
                cell += f"; host {v['predicted_host_MiB']:,.1f} / {v['measured_host_MiB']:,.1f}"
            cells.append(cell)
        out.append([f"{model} ({params / 1e6:.1f} M)", *cells])
    worst = max(v["worst_category_error_%"] for v in d["rows"])
    return (f"Predicted (dry run) / measured (`Trainer.fit`, 2 steps, `MemoryReport`) device peak in MiB, the run built "
            f"from the same description, batch 2 x seq 128:\n\n{table(['model (params)', *combos], out)}\n\n"
            f"Worst error of any category in any phase: {worst:.3f} % of the phase total.\n\n"
            f"{source(d, f'{dry_run(d)} against {where(d)} measured')}")


@block("estimate_foreign")
def estimate_foreign(r: Results) -> str:
    d = r["estimate_foreign"]
    out = []
    for v in d["rows"]:
        unc = v["uncorrected_error_%"]
        unc = f"{unc:+.0f} %" if isinstance(unc, (int, float)) else str(unc)
        out.append([v["module"], v["run"], f"{v['predicted_MiB']:.2f} / {v['measured_MiB']:.2f}",
                    f"{v['error_%']:+.3f} %", f"{v['predicted_host_MiB']:.2f} / {v['measured_host_MiB']:.2f}", unc])
    body = table(["module", "run", "device MiB, predicted / measured", "error", "host MiB, predicted / measured",
                  "with torch's fake kernels as shipped"], out)
    return f"{body}\n\n{source(d, f'{dry_run(d)} against {where(d)} measured')}"


def _xl(r: Results, batch: int, combo: str) -> dict:
    return one(r["estimate_gpt2xl"], batch=batch, combination=combo)


@block("estimate_gpt2xl")
def estimate_gpt2xl(r: Results) -> str:
    d = r["estimate_gpt2xl"]
    out = []
    for v in d["rows"]:
        yes = {True: "yes", False: "no"}
        out.append([v["batch"], v["combination"], gib(v["device_peak"]), gib(v["host_peak"]), v["binds"],
                    yes[v["fits_12GB_card"]], yes[v["fits_6GB_card"]],
                    f"{v['device_vs_full_%']:+.4f} % / {v['host_vs_full_%']:+.4f} %",
                    f"{v['wall_s']:.1f} s / {v['full_trace_wall_s']:.1f} s"])
    body = table(["batch", "combination", "device peak", "host peak", "binds", "12 GiB card", "6 GiB card",
                  "default vs full 48-block trace", "time (default / full)"], out)
    walls = [v["wall_s"] for v in d["rows"]]
    full = [v["full_trace_wall_s"] for v in d["rows"]]
    exact = all(v["device_vs_full_%"] == 0 and v["host_vs_full_%"] == 0 for v in d["rows"])
    agree = "equals" if exact else "is within the stated % of"
    zero = [v["combination"] for v in d["rows"] if "zero" in v["method"]]
    return (f"GPT-2-XL (1.56 B), seq 1024: the default estimate (3, 4 and 5 blocks traced, extrapolated) beside a full "
            f"48-block trace of the same run.\n\n{body}\n\nEvery row of the default estimate {agree} the full trace; the "
            f"default took {min(walls):.1f}-{max(walls):.1f} s per combination on the shared 2-core machine, the full "
            f"trace {min(full):.1f}-{max(full):.1f} s. The {', '.join(dict.fromkeys(zero))} rows are traced on one "
            "device with DeepSpeed's partitioned model states in closed form, and carry full activations.\n\n"
            + source(d, dry_run(d) if is_dry_run(d["rows"]) else where(d)))


@block("estimate_gpt2xl")
def estimate_founding(r: Results) -> str:
    d = r["estimate_gpt2xl"]
    eight = _xl(r, 4, "offload + ckpt(all) + 8-bit AdamW")
    base = _xl(r, 4, "offload + ckpt(all)")
    act = _xl(r, 4, "offload + ckpt(all) + act. offload")
    chunk = _xl(r, 4, "offload + ckpt(all) + act. offload + chunked loss")
    fits = "fits the 12 GB card with room" if eight["fits_12GB_card"] else "does NOT fit the 12 GB card"
    return (f"The founding figures ([the GPT-2-XL article](https://www.52hwl.com/43530.html)): its GPT-2-XL recipe on a "
            f"12 GB RTX 3060 (checkpointing + half weights on the GPU / fp32 on the CPU + accumulation with micro-batch 4 "
            f"+ 8-bit Adam) is `offload + ckpt(all) + 8-bit AdamW` at batch 4: {gib(eight['device_peak'])} of device "
            f"memory, so it {fits} (and the 8-bit state brings the host side from {gib(base['host_peak'])} to "
            f"{gib(eight['host_peak'])}). Colossal-AI's \"1.5 B on a 6 GB RTX 2060\" corresponds to `offload + ckpt(all) "
            f"+ act. offload` ({gib(act['device_peak'])} at batch 4) and, with `ChunkedLMLoss`, "
            f"{gib(chunk['device_peak'])}.\n\n{source(d, dry_run(d))}")


def _plan_cell(v: dict) -> str:
    if v["chosen"] == "none fits":
        least = v["why"].split("smallest device peak of any recipe is ")[-1].split(" (")[0]
        host = None
        if "It would fit with" in v["why"]:
            host = v["why"].split("It would fit with ")[-1].split(" of host")[0]
        return f"none: the least is {least}" + (f", with {host} of host memory" if host else "")
    return f"{v['chosen']}: {v['device_peak']} (host {v['host_peak']})"


@block("plan")
def plan_choices(r: Results) -> str:
    d = r["plan"]
    budgets = list(dict.fromkeys((v["budget_GiB"], v["hardware"]) for v in d["rows"]))
    models = list(dict.fromkeys((v["model"], v["batch x seq"]) for v in d["rows"]))
    out = [[f"{m}, {b}", *[_plan_cell(one(d, model=m, budget_GiB=g, hardware=h)) for g, h in budgets]]
           for m, b in models]
    head = ["model, batch x seq", *[f"{g} GiB ({h} rates)" for g, h in budgets]]
    return (f"The recipe chosen (dry runs for a CUDA target, host budget 256 GiB, step times priced with the named "
            f"card's datasheet rates):\n\n{table(head, out)}\n\n{source(d, dry_run(d))}")


@block("plan_gpt2-xl")
def plan_time(r: Results) -> str:
    d = r["plan_gpt2-xl"]
    body = table(["device budget", "hardware profile", "precision", "chosen", "device peak", "dry runs",
                  "planning time"],
                 [[f"{v['budget_GiB']} GiB", v["hardware"], v["run"]["precision"], v["chosen"], v["device_peak"],
                   v["traces"], f"{v['wall_s']:.1f} s"] for v in d["rows"]])
    s12, s6, s2 = (one(d, budget_GiB=g) for g in (12, 6, 2))
    return (f"GPT-2-XL at 4 x 1024, the four budgets planned in one session (one cache of dry runs):\n\n{body}\n\n"
            f"The founding figures, planned: GPT-2-XL fine-tuning on a 12 GB card gets `{s12['chosen']}` at "
            f"{s12['device_peak']}; \"1.5 B on a 6 GB RTX 2060\" (Colossal-AI Gemini's claim) fits with "
            f"`{s6['chosen']}` at {s6['device_peak']}, and even 2 GiB works ({s2['device_peak']}, `{s2['chosen']}`)."
            f"\n\n{source(d, f'{dry_run(d)}; planning time on the {where(d)}')}")


@block("plan_cost")
def plan_cost(r: Results) -> str:
    d = r["plan_cost"]
    body = table(["recipe", "measured step (s)", "measured vs fp32", "predicted vs fp32", "predicted / measured"],
                 [[v["recipe"], f"{v['measured_step_s']:.3f}", f"{v['measured_vs_fp32']:.2f}",
                   f"{v['predicted_vs_fp32']:.2f}", f"{v['ratio_error']:.2f}"] for v in d["rows"]])
    worst = min(d["rows"], key=lambda v: v["ratio_error"])
    return (f"The cost model against step times measured side by side on this CPU (the CPU measured as its own "
            f"profile with `measure_host()`): Spearman rank correlation {d['spearman']:.3f} over {len(d['rows'])} "
            f"recipes; the worst ratio is {worst['ratio_error']:.2f}x ({worst['recipe']}).\n\n{body}\n\n"
            + source(d, where(d)))


@block("offload", "param_stream", "estimate_gpt2xl", "low_bit_optimizer", "activation_checkpointing", "estimate")
def headline(r: Results) -> str:
    off = r["offload"]
    state = {v["variant"]: v["model_state_B/param"] for v in rows(off, table="device bytes/param")}
    opt = one(off, table="host optimizer", optimizer="ours (lowmem_offload host AdamW)")
    ps = r["param_stream"]
    stream = one(ps, part="estimate", model="gpt2-xl", strategy="lowmem_offload_params", chunked_loss=True)
    xl = _xl(r, 4, "offload + ckpt(all) + 8-bit AdamW")
    low = r["low_bit_optimizer"]
    eight = one(low, variant="8-bit AdamW")
    ac = r["activation_checkpointing"]
    all_ = one(ac, policy="all")
    est = r["estimate"]
    worst = max(abs(v["dry_run_error_%"]) for v in est["rows"])
    models, combos = len({v["model"] for v in est["rows"]}), len({v["combination"] for v in est["rows"]})
    plain, ours = state["plain fp32 AdamW (auto, 32-true)"], state["lowmem_offload bf16-true"]
    frac = opt["fraction_of_bandwidth_bound"]
    out = [
        ["`lowmem_offload` bf16: device model state (weights + grads + optimizer)",
         f"**{ours:.2f} B/param** vs {plain:.1f} for plain fp32 AdamW", where(off), "offload"],
        [f"host AdamW step of `lowmem_offload` ({opt['params'] / 1e6:.0f}M params)",
         f"{x(opt['x_DeepSpeedCPUAdam'])} DeepSpeedCPUAdam, {frac:.2f} of the memory-bandwidth bound", where(off),
         "offload"],
        ["GPT-2-XL 4 x 1024, `lowmem_offload` + ckpt(all) + 8-bit AdamW (the 12 GB recipe)",
         f"device {gib(xl['device_peak'])}, host {gib(xl['host_peak'])}", dry_run(r["estimate_gpt2xl"]),
         "estimate_gpt2xl"],
        ["GPT-2-XL 4 x 1024, `lowmem_offload_params` + chunked loss",
         f"device **{stream['peak_device']}**, host {stream['peak_host']}", dry_run(ps), "param_stream"],
        ["8-bit AdamW state (`LowBitOptimizer`)", f"**{eight['opt_B/param']:.2f} B/param** vs 8.00", where(low),
         "low_bit_optimizer"],
        [f"`ActivationCheckpointing(\"all\")`, {ac['config']['layers']}-layer GPT-2",
         f"activations {all_['act_fwd_x_less']:.0f}x less, step {x(all_['time_x'])}", where(ac),
         "activation_checkpointing"],
        [f"dry run vs measured `Trainer.fit` ({models} models, {combos} recipes each)",
         f"worst peak error {worst:.3f} %", f"{dry_run(est)} against {where(est)} measured", "estimate"],
    ]
    gpu = r.gpu_stages()
    out += gpu_report.headline_rows(gpu)  # NOTE: the GPU figures (benchmarks/results/gpu/), beside what they replace
    gpu_line = ("**GPU**: no GPU figure exists yet; every figure above is a CPU measurement or a dry run. "
                "`make gpu-check STAGE=1` on the GPU machine (an H200; a task has 15 minutes of device time) measures "
                "the headline ones (see the GPU checks page)." if not gpu else
                "**GPU**: " + "; ".join(f"stage {g['stage']} on {g['machine'].get('device')} ({g['date'][:10]})"
                                        for g in gpu) + "; each figure beside its dry run and the CPU figure it "
                "replaces in `benchmarks/results/gpu/summary.md` (see the GPU checks page).")
    return (table(["figure", "value", "label", "from `benchmarks/results/`"],
                  [[a, b, c, f"`{n}.json`"] for a, b, c, n in out]) + f"\n\n{gpu_line}")


@block()
def gpu_results(r: Results) -> str:
    stages = r.gpu_stages()
    if not stages:
        return ("No GPU results yet: `benchmarks/results/gpu/` holds no `stageN.json`. Every figure in these pages is "
                "labelled **CPU** or **dry run** until the stages run on a GPU.")
    out = []
    for g in stages:
        m = g["machine"]
        counts: dict[str, int] = {}
        for e in g["entries"]:
            counts[e["status"]] = counts.get(e["status"], 0) + 1
        out.append([g["stage"], m.get("device"), g["date"][:10], f"torch {m.get('torch')}, CUDA {m.get('torch_cuda')}",
                    ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
                    f"`benchmarks/results/gpu/stage{g['stage']}.md`"])
    figs = gpu_report.figures(stages)
    return ("**GPU** results:\n\n" + table(["stage", "device", "date", "software", "entries", "details"], out)
            + ("\n\nEach figure beside the dry run's prediction and the CPU figure it replaces:\n\n"
               + gpu_report.figures_table(figs) if figs else ""))


@block()
def results_index(r: Results) -> str:
    out = []
    for path in sorted(r.folder.glob("*.json")):
        d = r[path.stem]
        text = " ".join([d.get("title", ""), *map(str, d.get("notes", []))]).lower()
        if is_dry_run(d.get("rows", [])):
            label = dry_run(d)
        elif "dry run" in text or "dry-run" in text:
            label = f"{where(d)} and **dry run**"
        else:
            label = where(d)
        out.append([f"`{path.stem}`", d.get("title", ""), label, d["date"][:10], f"`{d['command']}`"])
    return table(["results", "what", "label", "date", "command"], out)


PREDICT_BLOCKS: dict[str, Block] = {
    name: fn for name, fn in globals().items()
    if callable(fn) and hasattr(fn, "sources") and fn.__module__ == __name__
}

__all__ = ["PREDICT_BLOCKS", "note", "parse_bytes"]
