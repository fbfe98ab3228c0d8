"""The figure blocks of the technique pages (one function per ``<!-- figures:NAME -->`` block); ``BLOCKS`` names all.

Each function reads ``benchmarks/results/*.json`` through :class:`Results` and returns markdown: a table, the
sentences that quote its figures, and its source line (label, file, date, command). Nothing here is a figure.
"""

from __future__ import annotations

from benchmarks._figure_common import (
    Block,
    Results,
    block,
    dry_run,
    gib,
    human,
    is_dry_run,
    mib,
    note,
    one,
    parse_bytes,
    rows,
    source,
    table,
    where,
    x,
)
from benchmarks._figure_predict import PREDICT_BLOCKS


@block("offload")
def offload_device(r: Results) -> str:
    d = r["offload"]
    names = ["plain fp32 AdamW (auto, 32-true)", "lowmem_offload bf16-true", "lowmem_offload 32-true"]
    dev = [one(d, table="device bytes/param", variant=n) for n in names]
    step = [one(d, table="step time", variant=n) for n in names]
    vs = ["1.00", f"{x(step[1]['x_plain_same_precision'])} (vs plain bf16-true)",
          f"{x(step[2]['x_plain_same_precision'])} (vs plain fp32)"]
    a = d["args"]
    body = table(
        ["", "plain fp32 AdamW", "lowmem_offload bf16-true", "lowmem_offload 32-true"],
        [
            ["device model state at the device peak (weights + grads + optimizer state)",
             *[f"{v['model_state_B/param']:.2f} B/param" for v in dev]],
            ["device peak incl. activations (MemoryTracker)", *[v["device_peak"] for v in dev]],
            ["host peak (masters, fp32 grads, AdamW state)", *[v["host_peak"] for v in dev]],
            ["training-step time vs plain Lightning at the same precision", *vs],
        ],
    )
    setup = (f"GPT-2 architecture, {a['layers']} layers x {a['width']}, {dev[0]['params'] / 1e6:.2f}M parameters, "
             f"seq {a['seq']}, batch {a['batch']}; \"device\" = the tensors kept in the compute role (no GPU).")
    return f"{setup}\n\n{body}\n\n{source(d, where(d))}"


@block("host_wall")
def host_wall(r: Results) -> str:
    d = r["host_wall"]
    cats = ("weights", "gradients", "optimizer_state", "activations", "other")
    body = table(
        ["recipe", "device peak", "host peak", "host B/param", *(c.replace("_", " ") for c in cats),
         "within 12 GiB device, 64 GiB host"],
        [[v["recipe"], v["peak_device"], v["peak_host"], f"{v['host_B_per_param']:.2f}",
          *(f"{v[f'host_{c}_B_per_param']:.2f}" for c in cats), "yes" if v["fits_goal"] else "no"]
         for v in rows(d, part="estimate")],
    )
    a = d["rows"][0]
    setup = (f"{a['model']} ({a['num_params'] / 1e9:.2f}B parameters) full fine-tune, bf16-true, AdamW, batch "
             f"{a['batch'].replace('x', ' x ')}, ActivationCheckpointing('all') + ActivationOffload(boundaries_only=True) "
             "+ ChunkedLMLoss; host bytes/param by category at the host peak.")
    return f"{setup}\n\n{body}\n\n{source(d, dry_run(d))}"


@block("host_wall")
def host_wall_disk(r: Results) -> str:
    d = r["host_wall"]
    cats = ("weights", "gradients", "optimizer_state", "activations", "other")
    disk = rows(d, part="estimate_disk")
    body = table(
        ["model", "optimizer", "device peak", "host peak", "disk", "host B/param",
         *(c.replace("_", " ") for c in cats), "goal", "within"],
        [[v["model"], "8-bit AdamW" if v["low_bit"] else "AdamW", v["peak_device"],
          v["peak_host"], v["peak_disk"], f"{v['host_B_per_param']:.2f}",
          *(f"{v[f'host_{c}_B_per_param']:.2f}" for c in cats), v["goal"], "yes" if v["fits_goal"] else "no"]
         for v in disk],
    )
    setup = ("`OffloadStrategy(offload_params=True, optimizer_in_backward=True, disk=...)`, bf16-true, batch "
             f"{disk[0]['batch'].replace('x', ' x ')}, the callbacks above; host bytes/param by category at the host "
             "peak (other: the tier's pages in flight, its `disk_buffer`, and the pinned staging ring of the gradients "
             "and of the streamed weights' fetches).")
    return f"{setup}\n\n{body}\n\n{source(d, dry_run(d))}"


@block("disk_tier")
def disk_tier(r: Results) -> str:
    d = r["disk_tier"]
    t, disk = d["tier"], d["rows"][1]
    seq = t["sequential"]
    body = table(
        ["run", "host state (masters + AdamW)", "memory cap", "peak RSS", "cgroup peak", "s/step",
         "final masters equal"],
        [[v["run"], gib(v["host_state"]) if v["host_state"] is not None else "-",
          gib(v["cap"]) if v["cap"] else "none", gib(v["peak_rss"]),
          gib(v["cgroup_peak"]) if v["cgroup_peak"] else "-", f"{v['s_per_step']:.1f}",
          "-" if v["identical"] is None else ("yes (torch.equal)" if v["identical"] else "NO")] for v in d["rows"]],
    )
    io = (f"The tier: {gib(t['bytes_on_disk'])} on disk, at most {mib(t['peak_bytes_in_ram'])} of it in RAM (budget "
          f"{t['budget']}); {human(t['tier_rw_Bps'])}/s while its threads read and wrote, "
          f"**{t['ratio_to_sequential']:.2f}** of the same disk's sequential read+write measured in the same process "
          f"({human(seq['rw_Bps'])}/s; reads {t['read_ratio']:.2f}, writes {t['write_ratio']:.2f} of sequential); "
          f"**{t['hidden_fraction']:.2f}** of the tier's I/O time hidden behind compute.")
    setup = (f"{disk['params'] / 1e6:.0f}M-parameter LLaMA-style model, bf16-true, AdamW with the step in backward, "
             "each run in a new process; the capped one in a memory cgroup (page cache and mapped files count).")
    return f"{setup}\n\n{body}\n\n{io}\n\n{source(d, where(d))}"


@block("offload")
def offload_host_optimizer(r: Results) -> str:
    d = r["offload"]
    opt = rows(d, table="host optimizer")
    opt = [o for o in opt if o["optimizer"].startswith("ours")] + sorted(
        (o for o in opt if not o["optimizer"].startswith("ours")), key=lambda o: -o["Mparams/s"])
    bw = d["bandwidth_bytes_per_s"]
    params = opt[0]["params"]
    load = ", ".join(f"{v[0]:.2f}" for v in d.get("loadavg_before_after", []))
    work, cache = d["optimizer_working_set_bytes"], d["last_level_cache_bytes"]
    intro = (f"Host AdamW step on {params / 1e6:.0f}M fp32 parameters (parameters, gradients and AdamW state "
             f"{gib(work)}, {work / cache:.0f}x the {human(cache)} last-level cache, so the step streams from DRAM), "
             "interleaved in "
             f"one run (load average before / after: {load}). The bound is the bandwidth of an in-place `a += b` over "
             f"256 MB buffers in the same rounds ({bw / 1e9:.1f} GB/s, i.e. {bw / 28 / 1e6:.0f} Mparams/s at 28 B/param; "
             f"a `copy_` reads lower, {d['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, since write-allocate moves a "
             "transfer it does not count):")
    body = table(["optimizer", "Mparams/s", "x DeepSpeedCPUAdam", "fraction of bandwidth bound"],
                 [[o["optimizer"], f"{o['Mparams/s']:.0f}", f"{o['x_DeepSpeedCPUAdam']:.2f}",
                   f"{o['fraction_of_bandwidth_bound']:.2f}"] for o in opt])
    return (f"{intro}\n\n{body}\n\n(\"ours\" and \"torch AdamW fused\" run the same kernel; their gap is run-to-run "
            "noise. Under load the absolute rates fall and DeepSpeedCPUAdam falls further: read the ratios of one run.)"
            f"\n\n{source(d, where(d))}")


@block("transfer")
def offload_pinned_staging(r: Results) -> str:
    d = r["transfer"]
    body = table(["model", "staging layout", "gradients (bf16)", "pinned memory reserved", "overhead"],
                 [[p["model"], p["layout"], p["payload"], p["reserved"], f"+{p['overhead_pct']:.1f} %"]
                  for p in d["pinned"]])
    steps = table(["gradient copies", "host ms per step on the autograd thread", "ms in the fold after backward",
                   "bit-identical"],
                  [[s["policy"], f"{s['autograd_thread_ms_per_step']:.2f}", f"{s['drain_ms_per_step']:.1f}",
                    "yes" if s["bit_identical"] else "no"] for s in d["rows"]])
    return (f"Pinned staging reserved by torch's pinned allocator (power-of-two rounding), per-parameter buffers "
            f"(before) against the flat 64 MiB buckets:\n\n{body}\n\nHost work inside backward's gradient hooks, "
            f"before and after the copies were queued and folded after backward ({note(d, 'GPT-2 architecture')})"
            f":\n\n{steps}\n\n{source(d, where(d))}")


@block("param_stream")
def param_stream_estimates(r: Results) -> str:
    d = r["param_stream"]
    est = rows(d, part="estimate")
    label = dry_run(d) if is_dry_run(est) else where(d)
    keys = list(dict.fromkeys((e["model"], e["batch"], e["chunked_loss"]) for e in est))
    out = []
    for model, batch, chunked in keys:
        by = {e["strategy"]: e for e in est if (e["model"], e["batch"], e["chunked_loss"]) == (model, batch, chunked)}
        res, par = by.get("lowmem_offload"), by.get("lowmem_offload_params")
        out.append([f"{model}, {batch.replace('x', ' x ')}, {'chunked loss' if chunked else 'no chunked loss'}",
                    res and res["peak_device"], par and f"**{par['peak_device']}**",
                    res and res["peak_host"], par and par["peak_host"]])
    body = table(["model, batch", "lowmem_offload device", "lowmem_offload_params device",
                  "lowmem_offload host", "lowmem_offload_params host"], out)
    return (f"Predicted by `estimate_memory` (the dry run of this code), bf16, `ActivationCheckpointing(\"all\")` + "
            "`ActivationOffload(boundaries_only=True)` (+ `ChunkedLMLoss(chunk_tokens=1024)` where marked), prefetch 1; "
            f"host peaks with fp32 AdamW (`LowBitOptimizer` and `optimizer_in_backward` cut them as under "
            f"`lowmem_offload`):\n\n{body}\n\n{source(d, label)}")


@block("param_stream")
def param_stream_step(r: Results) -> str:
    d = r["param_stream"]
    out = []
    for part in ("cpu step", "gpu step"):
        for s in rows(d, part=part):
            out.append([part.split()[0].upper(), s["model"], s["batch"].replace("x", " x "), s["strategy"],
                        f"{s['step_s']:.3f}", s.get("step_cpu_s") and f"{s['step_cpu_s']:.3f}",
                        x(s.get("cpu_vs_resident") or s["vs_resident"])])
    gpu = "" if rows(d, part="gpu step") else (
        " No GPU step time yet: `make gpu-check STAGE=2` times prefetch 0, 1, 2 against resident weights on "
        "GPT-2-XL at 4 x 1024 with the allocator's peaks.")
    return ("Step time, bf16, one torch thread on the CPU (every fetch a real host copy, nothing overlapped; process "
            f"CPU time is the figure to read on a shared machine).{gpu}\n\n"
            + table(["device", "model", "batch", "strategy", "step (s, wall)", "step (s, CPU)",
                     "vs lowmem_offload"], out)
            + f"\n\n{source(d, where(d))}")


@block("activation_checkpointing")
def activation_checkpointing(r: Results) -> str:
    d = r["activation_checkpointing"]
    c = d["config"]
    body = table(["policy", "activations kept for backward", "x less", "step peak minus weights/grads/optimizer",
                  "x less", "step time"],
                 [[p["policy"].replace("every_n(2)", "every_n (2)"), p["act_fwd"], f"{p['act_fwd_x_less']:.3g}",
                   p["act_peak"], f"{p['act_peak_x_less']:.3g}", x(p["time_x"])] for p in d["rows"]])
    all_ = one(d, policy="all")
    return (f"GPT-2 architecture, {c['layers']} layers, n_embd {c['width']}, seq {c['seq']}, batch {c['batch']}, "
            "dropout 0.1, fp32, AdamW; memory from `MemoryTracker`; time: the minimum of "
            f"{c['rounds']} interleaved rounds as a ratio to \"none\". On the CPU, \"all\" costs more than the ~1.33x of "
            f"one extra forward ({x(all_['time_x'])} here): a GPU figure is still to be taken.\n\n{body}\n\n"
            f"{source(d, where(d))}")


@block("activation_offload")
def activation_offload(r: Results) -> str:
    d = r["activation_offload"]
    names = {"offload": "offload", "checkpointing": "checkpointing (policy all)",
             "offload+ckpt(boundaries_only)": "offload + ckpt (boundaries_only)"}
    body = table(["variant", "activations kept in compute role (fwd peak)", "device peak of the step",
                  "host activations", "step time vs none"],
                 [[names.get(v["variant"], v["variant"]), v["act_fwd_device_h"], v["peak_device_h"],
                   v["host_act_peak_h"], f"{v['time_vs_none']:.2f}"] for v in d["rows"]])
    both = one(d, variant="offload+ckpt(boundaries_only)")
    target = d["target_bytes"]
    met = "met" if both["act_fwd_device"] <= target else "NOT met"
    work = both["act_peak_device"]
    setup = note(d, "model:").removeprefix("model: ")
    return (f"{setup[0].upper()}{setup[1:]} `MemoryTracker` counts device-role bytes.\n\n{body}\n\n"
            f"One block saves {mib(d['one_block_bytes'], 2)} and one boundary is "
            f"{mib(d['boundary_bytes'], 2)}. The target is boundaries_only at or below one block plus one boundary "
            f"({mib(target, 2)}); it is {met}: {mib(both['act_fwd_device'], 2)} at the forward peak. The backward "
            f"working set is {mib(work, 2)} = {work / target:.2f}x that: the recompute of one block plus backward "
            "gradient temporaries. On the CPU copies are memcpy, so the times show bookkeeping, not PCIe, cost.\n\n"
            + source(d, where(d)))


@block("accumulation")
def accumulation(r: Results) -> str:
    d = r["accumulation"]
    m = d["model_config"]
    body = table(["budget", "micro-batch chosen", "accumulation", "peak at choice", "next micro-batch", "its peak",
                  "step time vs fastest"],
                 [[a["budget"], a["micro_batch"], a["accumulation"], a["peak_at_choice"], a["next_micro_batch"],
                   a["peak_at_next"], x(a["step_time_vs_fastest"])] for a in d["rows"]])
    return (f"The demo GPT-2 ({m['n_layer']} layers, {m['n_embd']} wide, sequence {d['seq_len']}, AdamW, token-mean "
            f"loss), effective batch {d['effective_batch_size']}; `MemoryTracker` device-role peaks of a full training "
            f"step:\n\n{body}\n\n{source(d, where(d))}")


@block("oom_recovery")
def oom_recovery(r: Results) -> str:
    d = r["oom_recovery"]
    failed = [v for v in d["rows"] if v["lost_s"] is not None]
    body = table(["the first micro-batch fails at", "time lost (s)", "fraction of a step (at the smaller size)"],
                 [[v["variant"], f"{v['lost_s']:.3f}", f"{v['lost_fraction_of_step']:.2f}"] for v in failed])
    gc_ms = failed[0]["of_which_gc_s"] * 1e3
    return (f"Demo GPT-2, sequence {d['seq_len']}, effective batch {d['effective_batch_size']} from micro-batches of "
            f"{d['micro_batch']}, the first failing and split in two; fastest of {failed[0]['steps_timed']} interleaved "
            f"steps each. The time lost is the failed micro-batch's own work; the release itself (`gc.collect(1)`) "
            f"takes {gc_ms:.2f} ms.\n\n{body}\n\n{source(d, where(d))}")


@block("low_bit_optimizer")
def low_bit_optimizer(r: Results) -> str:
    d = r["low_bit_optimizer"]
    m = d["model"]
    names = {"8-bit AdamW": "`LowBitOptimizer` (8-bit AdamW)",
             "in-backward fp32 AdamW": "`OptimizerInBackward` (fp32 AdamW)", "in-backward 8-bit AdamW": "both"}
    body = table(["variant", "optimizer state", "step peak", "peak vs fp32", "step time vs fp32"],
                 [[names.get(v["variant"], v["variant"]), f"{v['opt_B/param']:.3f} B/param", v["peak"],
                   f"{v['peak_vs_fp32']:.2f}", f"{v['step_vs_fp32']:.2f}"] for v in d["rows"]])
    off = {o["variant"]: o for o in d["offload"]}
    xl = d["gpt2_xl"]
    return (f"GPT-2 architecture, {m['layers']} layers x {m['width']} wide ({m['n_params'] / 1e6:.2f}M parameters), "
            f"batch {m['batch']} x {m['seq']}, fp32; peaks from `MemoryTracker`; step-time ratios from interleaved fits "
            f"(the CPU's bitsandbytes kernels, not GPU figures).\n\n{body}\n\n"
            f"- Under `lowmem_offload` (bf16-true), host fp32 masters + optimizer state: "
            f"**{off['lowmem_offload fp32 AdamW']['host_opt_B/param']:.2f} -> "
            f"{off['lowmem_offload 8-bit AdamW']['host_opt_B/param']:.2f} B/param**.\n"
            f"- GPT-2-XL ({xl['params'] / 1e9:.3f}B parameters, the measured per-tensor layout applied to its shapes): "
            f"8-bit state is {xl['B_per_param']:.3f} B/param, {xl['adam8bit_state_bytes'] / 1e9:.2f} GB instead of "
            f"{xl['fp32_adam_state_bytes'] / 1e9:.2f} GB, saving **{xl['saved_bytes'] / 1e9:.2f} GB "
            f"({gib(xl['saved_bytes'])})**; the founding [article](https://www.52hwl.com/43530.html) says ~8.5 GB.\n\n"
            + source(d, where(d)))


@block("lean_optimizer")
def lean_optimizer(r: Results) -> str:
    d = r["lean_optimizer"]
    body = table(["variant", "method", "device peak", "vs AdamW", "optimizer state", "gradients", "fits 24 GiB"],
                 [[v["variant"], v["method"], v["peak"], f"{v['vs_adamw']:.2f}", v["state"], v["gradients"],
                   "yes" if v["fits_24GB"] else "no"] for v in d["rows"]])
    return ("LLaMA-7B full fine-tune, bf16 weights, batch 1 x 512, `ActivationCheckpointing(\"all\")`, no offload: "
            "the predicted CUDA device peak (**dry run**: the real `Trainer.fit` and the packages' optimizers on fake "
            "tensors, target CUDA; no GPU measurement yet). Layer-wise: `OptimizerInBackward` as well (no full set "
            "of gradients).\n\n" + body + "\n\n" + source(d, dry_run(d)))


@block("chunked_lm_loss")
def chunked_lm_loss(r: Results) -> str:
    d = r["chunked_lm_loss"]
    loss = rows(d, part="loss")
    own = next(v for v in loss if v["chunk_tokens"] is None)
    chunks = [v for v in loss if v["chunk_tokens"] and "recompute=False" not in v["variant"]]
    head = ["", "model's own loss", *[f"`ChunkedLMLoss({v['chunk_tokens']})`" for v in chunks]]
    mem = ["the loss's own memory (fake tensors, `MemoryTracker`)", f"{own['loss_transient_MiB']:.1f} MiB",
           *[f"{v['loss_transient_MiB']:.1f} MiB" for v in chunks]]
    dry = rows(d, part="dry_run")

    def peaks(prefix: str) -> list[str]:
        base = one(d, part="dry_run", variant=prefix)
        by = {v["chunk_tokens"]: v for v in dry if v["variant"] == f"{prefix} + ChunkedLMLoss"}
        return [f"{base['device_peak_GiB']:.2f} GiB",
                *[f"{by[c['chunk_tokens']]['device_peak_GiB']:.2f} GiB" if c["chunk_tokens"] in by else ""
                  for c in chunks]]

    body = table(head, [mem, ["device peak, dry run, offload + ckpt(all)", *peaks("offload + ckpt(all)")],
                        ["device peak, dry run, offload + ckpt(all) + act. offload",
                         *peaks("offload + ckpt(all) + act. offload")]])
    per_token = chunks[0]["one_chunk_fp32_logits_MiB"] * 1024 / chunks[0]["chunk_tokens"]
    setup = note(d, "loss:").removeprefix("loss: ").split(";")[0]
    return (f"The loss's own memory: {setup}; the dry runs: `lowmem_offload` recipes as on the estimate page."
            f"\n\n{body}\n\n"
            "The loss's own memory is what its forward and backward allocate beyond their inputs, the hidden states' "
            f"gradient and the head's weight and weight gradient; one chunk of fp32 logits is `chunk_tokens` x "
            f"{per_token:.0f} KiB here. Once the logits are gone the peak binds elsewhere (the checkpointed blocks' "
            f"backward), so the chunk sizes give the same device peak.\n\n"
            f"{source(d, f'{where(d)} (fake tensors) and {dry_run(d)}')}")


@block("chunked_lm_loss")
def chunked_lm_loss_time(r: Results) -> str:
    d = r["chunked_lm_loss"]
    out = []
    for v in rows(d, part="cpu_time"):
        variant, shape = v["variant"].split("; ", 1)
        out.append([shape, variant, f"{v['step_cpu_s']:.3f}", x(v["vs_model_loss"])])
    return ("Step time (forward + backward + SGD, fp32, process CPU time on one thread, interleaved rounds):\n\n"
            + table(["model", "loss", "step (s, CPU)", "vs the model's own loss"], out)
            + f"\n\n{source(d, where(d))}")


@block("zero")
def zero(r: Results) -> str:
    d = r["zero"]
    base = one(d, variant="lowmem_offload")
    def spread(values: list[float], fmt: str) -> str:
        return f" ({min(values):{fmt}}-{max(values):{fmt}} per round)" if len(values) > 1 else ""

    out = []
    for v in d["rows"]:
        steps = [run["step_s"] for run in v.get("runs", [])]
        ratios = [run["step_s"] / b["step_s"] for run, b in zip(v.get("runs", []), base.get("runs", []))]
        out.append([f"`{v['variant']}`", v["optimizer"], f"{v['step_s']:.2f}{spread(steps, '.2f')}",
                    x(v["step_vs_offload"]) + (spread(ratios, ".2f") if v is not base else ""),
                    v["peak_rss_growth"], x(v["growth_vs_offload"])])
    body = table(["variant", "optimizer", "step (s)", "vs offload", "peak RSS growth", "vs offload"], out)
    z2, z3 = one(d, variant="lowmem_zero2_offload"), one(d, variant="lowmem_zero3_offload")
    extra = z2["peak_rss_growth_bytes"] - base["peak_rss_growth_bytes"]
    return (f"{note(d, 'GPT-2 architecture')}\n\n{body}\n\nOn one process ZeRO has nothing to shard and adds DeepSpeed's "
            f"16-bit gradient buffers and reduce buckets (+{mib(extra, 0)} = {extra / base['params']:.1f} B/param "
            f"here) and bucket copies; ZeRO-3 adds per-layer gather/release hooks in forward and backward "
            f"(+{z3['step_s'] - base['step_s']:.2f} s/step here). Peak RSS growth: VmHWM after the model is built "
            f"minus the RSS then, `MALLOC_MMAP_THRESHOLD_=65536`.\n\n{source(d, where(d))}")


@block("memory_report_overhead")
def memory_report_overhead(r: Results) -> str:
    d = r["memory_report_overhead"]
    names = {("Trainer.fit", "unsampled"): "MemoryReport, unsampled step (Trainer.fit)",
             ("Trainer.fit", "sampled"): "MemoryReport, sampled step (Trainer.fit)",
             ("plain loop", "no-op dispatch mode"): "no-op TorchDispatchMode (the floor of any such tracker)",
             ("plain loop", "MemoryTracker"): "MemoryTracker, plain loop",
             ("plain loop, wide", "MemoryTracker"): "MemoryTracker, plain loop, 3x wider and longer",
             ("plain loop (torch)", "torch MemTracker"): "torch `MemTracker`, plain loop"}
    out = []
    for v in d["rows"]:
        name = names.get((v["part"], v["variant"]))
        if name:
            us, end = v.get("cpu_overhead_us_per_aten_op"), v.get("end_of_fit_s")
            out.append([name, x(v["cpu_ratio_vs_none"]), us and f"~{us:.0f} us",
                        end and f"end of fit (table, JSON, PNG): {end:.2f} s", v.get("peak")])
    ours = one(d, part="plain loop", variant="MemoryTracker")["cpu_overhead_us_per_aten_op"]
    theirs = one(d, part="plain loop (torch)", variant="torch MemTracker")["cpu_overhead_us_per_aten_op"]
    body = table(["", "step CPU time vs no tracking", "overhead per aten op", "note", "peak"], out)
    setup = note(d, "GPT-2").split(";")[0]
    return (f"{setup}; interleaved runs, one intra-op thread, process CPU time. torch's `MemTracker` costs "
            f"{theirs / ours:.1f}x our overhead per op and finds the same peak, to the byte.\n\n{body}\n\n"
            + source(d, where(d)))


@block("demo")
def demo(r: Results) -> str:
    d = r["demo"]
    body = table(["variant", "optimizer steps/s", "peak RSS (whole process)", "final train loss"],
                 [[v["variant"], f"{v['optimizer steps/s']:.3f}", v["peak RSS"], f"{v['final train loss']:.2f}"]
                  for v in d["rows"]])
    return (f"{body}\n\nPeak RSS is the whole process (interpreter, libraries, data), on the CPU the host role too: the "
            f"demo's device-role saving is in `MemoryReport`'s table.\n\n{source(d, where(d))}")


@block("conformance")
def conformance(r: Results) -> str:
    d = r["conformance"]
    cb = d["lightning_callbacks"]
    counts, dry = d["counts"], d["dry_run_counts"]
    total, dry_total = sum(counts.values()), sum(dry.values())
    codes = d.get("codes", [])
    earlier = [c for c in codes if not c["current"]]
    provenance = (f"{d['cells_at_current_code']} of {total + dry_total} cells ran at the final code (fingerprint "
                  f"`{d['fingerprint']}`)" if codes else f"every cell ran at code fingerprint `{d['fingerprint']}`")
    if earlier:
        provenance += "; " + "; ".join(f"{c['cells']} carry the earlier fingerprint `{c['fingerprint']}` (commit "
                                       f"{', '.join(c['commits'])}), not re-run since" for c in earlier)
    if d.get("cells_never_run"):
        provenance += f"; {d['cells_never_run']} never ran"
    hf = sum("hf" in m["tags"] and "peft" not in m["tags"] for m in d["modules"])
    own_kinds = sorted({m["kind"] for m in d["modules"] if not ("hf" in m["tags"] and "peft" not in m["tags"])})
    corpus = (f"{len(d['modules'])} modules: {hf} transformers model families (architectures) and "
              f"{len(d['modules']) - hf} hand-written modules of {len(own_kinds)} kinds ({', '.join(own_kinds)}), "
              f"{hf + len(own_kinds)} families and kinds in all, x {len(d['flags'])} flags "
              f"(strategies at each precision, callbacks, the README's recipes, the ZeRO presets), and Lightning's "
              f"{len(cb['callbacks'])} own callbacks on {len(cb['hosts'])} hosts ({', '.join(cb['hosts'])}): "
              f"{total} training cells, each judged against plain Lightning, and {dry_total} dry-run predictions.")
    body = table(["exact", "close", "refused", "differs", "crash", "n/a"],
                 [[counts[v] for v in ("exact", "close", "refused", "differs", "crash", "n/a")]])
    dry_body = table(["dry run: within 1 %", "stated upper bound", "off", "refused", "n/a", "crash"],
                     [[dry.get(v, 0) for v in ("ok", "bound", "off", "refused", "n/a", "crash")]])
    return (f"{corpus}\n\n{body}\n\n{dry_body}\n\n{provenance}. What each verdict allows: "
            f"`tests/conformance/compare.py`; every cell: `benchmarks/results/conformance.md`.\n\n{source(d, where(d))}")



@block("adapters", "adapters_step_time")
def adapters(r: Results) -> str:
    d, t = r["adapters"], r["adapters_step_time"]
    body = table(
        ["model", "run", "strategy", "device peak", "host peak", "device weights", "device grads + optimizer state",
         "figure"],
        [[v["model"], v["run"], v["strategy"], gib(v["peak_device"]), gib(v["peak_host"]), gib(v["device_weights"]),
          gib(v["device_gradients"] + v["device_optimizer_state"]), v["figure"]] for v in d["rows"]],
    )
    steps = table(["model", "run", "median step", "vs full fine-tune", "steps timed"],
                  [[v["model"], v["run"], f"{v['median_step_s'] * 1e3:.0f} ms", f"{v['vs_full']:.2f}",
                    v["steps_timed"]] for v in t["rows"]])
    return (f"Batch 1 x 2048, bf16-true, `ActivationCheckpointing(\"all\")`, AdamW; LoRA r=16, alpha 32, "
            f"all-linear; the 70B recipe rows add `ActivationOffload()` and `ChunkedLMLoss(chunk_tokens=128)`.\n\n"
            f"{body}\n\n{source(d, '**dry run** (CUDA target), the 4-bit base included')}\n\n"
            f"CPU step time, side by side on the same small LLaMA (fp32, batch 2 x 128):\n\n{steps}\n\n"
            f"{source(t, where(t))}")


BLOCKS: dict[str, Block] = {
    name: fn for name, fn in globals().items()
    if callable(fn) and hasattr(fn, "sources") and fn.__module__ == __name__
} | PREDICT_BLOCKS

__all__ = ["BLOCKS", "Results", "parse_bytes"]
