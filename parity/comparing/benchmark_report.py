"""The benchmark's table: one row per strategy, read from the loss records its runs wrote, against DDP's run
of the same invocation; written as benchmark.json, benchmark.md and a two-panel bar chart.

What each number is (and is not) is docs/benchmark.md; the keys are ROW_KEYS.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

from parity.models.families import kv_heads
from parity.registry import pp_size_of
from parity.training.memory import BOUND_CATEGORIES, model_state_total

MIB = 2 ** 20
MEASURED_AT = "peak"  # the sample of the measured step where the rank held the most model-state bytes

ROW_KEYS = (
    "row", "label", "strategy", "options", "tp_size", "pp_size", "dp_size", "batch_size", "steps", "timed_steps",
    "median_step_time_s", "step_time_ratio_to_ddp", "tokens_per_s", "mfu",
    "model_state_bytes", "model_state_total_bytes", "model_state_peak_at", "peak_all_bytes",
    "model_state_bytes_per_rank", "offloaded_bytes",
    "zero_stage", "zero_bound_bytes", "zero_bound_total_bytes", "peak_memory_bytes", "memory_metric",
    "final_loss", "final_loss_rel_diff_from_ddp", "loss_record", "harness_s_per_step", "harness_share",
    "tensor_norms_share", "teacher_forced_s_per_check", "teacher_forced_share",
)

# Peak dense bf16 FLOP/s of the accelerators MFU knows by name (the first name contained in the device's).
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12))


def peak_flops(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s of one device, where that number comes from)."""
    if override_tflops:
        return override_tflops * 1e12, "--peak_tflops"
    for name, flops in PEAK_BF16_FLOPS:
        if name in device_name:
            return flops, f"dense bf16 peak of the {name}"
    return None, f"unknown for '{device_name}': pass --peak_tflops"


def model_flops_per_token(model_config: dict, seq_length: int) -> float:
    """Training FLOPs per token, PaLM's estimate: 6 × the matmul parameters (the projections and the lm_head;
    embedding lookups, norms and biases do no matmul) + 12 × layers × hidden × sequence (attention scores and
    their weighted sum, forward and backward, without the causal halving)."""
    h, ff, layers = model_config["hidden_size"], model_config["intermediate_size"], model_config["num_hidden_layers"]
    kv = h // model_config["num_attention_heads"] * kv_heads(SimpleNamespace(**model_config))  # the record's config
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ff
    return 6 * (layers * per_layer + model_config["vocab_size"] * h) + 12 * layers * h * seq_length


def summarize_row(row: str, label: str, record: dict, path: str, untimed_steps: int) -> dict:
    """One row from its run's loss record (DDP-relative fields are filled by add_ratios)."""
    cfg, steps, state = record["config"], record["steps"], record["final"]["model_state"]
    timed = steps[untimed_steps:]
    median = statistics.median(s["step_time_s"] for s in timed)
    harness = harness_cost(timed)
    per_rank = state["per_rank"]
    totals = [model_state_total(r["bytes"]) for r in per_rank[MEASURED_AT]]
    fullest = totals.index(max(totals))
    return {
        "row": row, "label": label, "strategy": record["strategy"], "options": cfg["options"],
        "tp_size": cfg["tp_size"], "pp_size": pp_size_of(cfg), "dp_size": cfg["dp_size"], "batch_size": cfg["batch_size"],
        "steps": len(steps), "timed_steps": len(timed), "median_step_time_s": median,
        "step_time_ratio_to_ddp": None,
        "tokens_per_s": cfg["dp_size"] * cfg["batch_size"] * cfg["seq_length"] / median,  # processed, padding too
        "mfu": None,
        "model_state_bytes": per_rank[MEASURED_AT][fullest]["bytes"], "model_state_total_bytes": totals[fullest],
        "model_state_peak_at": [peak_point(r) for r in per_rank[MEASURED_AT]],
        "peak_all_bytes": max(sum(r["bytes"].values()) for r in per_rank["peak_all"]),
        "model_state_bytes_per_rank": {point: [r["bytes"] for r in ranks] for point, ranks in per_rank.items()},
        "offloaded_bytes": max(r["offloaded_bytes"] for r in per_rank[MEASURED_AT]),
        "zero_stage": state["zero_stage"], "zero_bound_bytes": state["zero_bound_bytes"],
        "zero_bound_total_bytes": sum(state["zero_bound_bytes"].values()),
        "peak_memory_bytes": max(s["peak_memory_bytes"] for s in steps), "memory_metric": cfg["memory_metric"],
        "final_loss": steps[-1]["loss"], "final_loss_rel_diff_from_ddp": None, "loss_record": path,
        "harness_s_per_step": harness, "harness_share": sum(harness.values()) / (median - sum(
            harness.get(k, 0.0) for k in IN_STEP)),
        "tensor_norms_share": harness["tensor_norms"] / median if "tensor_norms" in harness else None,
        **teacher_forced_cost(steps, median),
    }


def teacher_forced_cost(steps: list[dict], median_step_s: float) -> dict:
    """The teacher-forced check's seconds per check (the median over the row's checks from a state with AdamW's moments,
    every check after step 0 — step 0's has none to gather, set and compare, and costs less —, step 0's where it
    alone ran: every rank's two state gathers and rank 0's reference steps) and its share of the training time at the
    default --checkpoint_interval (one check per interval steps); None where the check did not run."""
    from parity.driver.config import DEFAULTS

    checks = {s["step"]: s["teacher_forced"]["seconds"] for s in steps if "teacher_forced" in s}
    if not checks:
        return {"teacher_forced_s_per_check": None, "teacher_forced_share": None}
    per_check = statistics.median([t for step, t in checks.items() if step > 0] or checks.values())
    return {"teacher_forced_s_per_check": per_check,
            "teacher_forced_share": per_check / (DEFAULTS["checkpoint_interval"] * median_step_s)}


# the harness's parts inside the timed step (step_time_s holds them): Strategy.train_step times them
IN_STEP = ("loss_gather", "param_norm", "tensor_norms")


def harness_cost(steps: list[dict]) -> dict[str, float]:
    """The harness's own seconds per step, by what: the loss gather, the parameter norm, every tensor's norms (their
    local sums of squares and the one all-reduce), the replica check, the record's entry and its write — the median over the steps of a part done at every step, the mean over all steps of one done
    at some (the record's write at log intervals, a thinned replica check). The fp64 grad norm is inside each
    strategy's clipping (docs/benchmark.md measures it apart)."""
    parts = sorted({k for s in steps for k in s.get("harness_s", {})})
    spent = {k: [s.get("harness_s", {}).get(k) for s in steps] for k in parts}
    return {k: statistics.median(v) if None not in v else sum(x or 0.0 for x in v) / len(v) for k, v in spent.items()}


def peak_point(peak: dict) -> str:
    """Where a peak was: "after_backward", or "during_backward, <the parameter whose gradient had just arrived>"."""
    return f"{peak['point']}, {peak['parameter']}" if peak["parameter"] else peak["point"]


def add_ratios(rows: list[dict], flops_per_token: float | None, peak: float | None, world_size: int) -> None:
    """Step-time ratio and final-loss difference against the DDP row; MFU on GPU (tokens/s per device)."""
    ddp = next(r for r in rows if r["row"] == "ddp")
    for r in rows:
        r["step_time_ratio_to_ddp"] = r["median_step_time_s"] / ddp["median_step_time_s"]
        r["final_loss_rel_diff_from_ddp"] = abs(r["final_loss"] - ddp["final_loss"]) / abs(ddp["final_loss"])
        if flops_per_token and peak:
            r["mfu"] = flops_per_token * r["tokens_per_s"] / (peak * world_size)


def markdown(summary: dict) -> str:
    s = summary
    mfu = s["device"] == "cuda"
    lines = [
        f"# Benchmark: {s['model_name']} ({s['num_layers']} layers, Ψ = {s['num_params']:,} parameters), "
        f"{s['world_size']} {s['device']} workers, {s['precision']}"
        + (f", LoRA r {s['lora']['r']} on {','.join(s['lora']['targets'])} (the base frozen)" if s.get("lora") else ""),
        "",
        f"Global batch {s['global_batch_size']} × {s['seq_length']} tokens, {s['steps']} steps, the first "
        f"{s['untimed_steps']} left out of the timing. Model states (params, grads, optimizer states, master "
        f"copies), counted from the tensors each rank holds as each gradient arrives in backward, after backward "
        f"and after the step of the last step: the rank holding the most, at its peak, and where the ranks' peaks "
        f"were; the bound is the ZeRO paper's params + grads + optimizer states for the row's stage. \"With "
        f"copies\": the most any rank held counting the copies made to compute or communicate too (DDP's reducer "
        f"buckets, gathered parameters, offload staging). Peak memory: {s['memory_note']}.",
        "",
        "| row | step time (s) | × DDP | tokens/s |" + (" MFU |" if mfu else "") + " model states / rank (MiB) | "
        "peak at | by category (MiB) | ZeRO bound (MiB) | with copies (MiB) | peak memory (MiB) | "
        "final loss − DDP (rel.) | harness / bare step | every tensor's norms / step | teacher-forced check / training |",
        "|---|---:|---:|---:|" + ("---:|" if mfu else "") + "---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        categories = ", ".join(f"{k} {v / MIB:.2f}" for k, v in r["model_state_bytes"].items())
        lines.append(
            f"| {r['label']} | {r['median_step_time_s']:.4f} | {r['step_time_ratio_to_ddp']:.2f} | "
            f"{r['tokens_per_s']:,.0f} |" + (f" {_percent(r['mfu'])} |" if mfu else "")
            + f" {r['model_state_total_bytes'] / MIB:.2f} | {' / '.join(dict.fromkeys(r['model_state_peak_at']))} | "
            f"{categories} | {r['zero_bound_total_bytes'] / MIB:.2f} | {r['peak_all_bytes'] / MIB:.2f} | "
            f"{r['peak_memory_bytes'] / MIB:.0f} | {r['final_loss_rel_diff_from_ddp']:.1e} | "
            f"{_percent(r['harness_share'])} | {_percent(r['tensor_norms_share'])} | "
            f"{_percent(r['teacher_forced_share'])} |")
    if mfu:
        lines += ["", f"MFU = {s['flops_per_token']:.3e} model FLOPs/token × tokens/s ÷ ({s['world_size']} × "
                      f"{_tflops(s['peak_flops'])}; {s['peak_flops_source']})."]
    return "\n".join(lines) + "\n"


def figure(summary: dict):
    """Two panels: median step time per row; MiB per rank at the peak of the step stacked by category, with the
    ZeRO bound."""
    from matplotlib.figure import Figure

    rows = summary["rows"]
    labels = [r["label"] for r in rows]
    fig = Figure(figsize=(max(9.0, 1.4 * len(rows)), 8), layout="constrained")
    fig.suptitle(f"{summary['model_name']}, {summary['world_size']} {summary['device']} workers, "
                 f"{summary['precision']}")
    ax_time, ax_mem = fig.subplots(2, 1, sharex=True)
    ax_time.bar(labels, [r["median_step_time_s"] for r in rows], color="C0")
    ax_time.set(title="Median step time", ylabel="seconds")
    bottom = [0.0] * len(rows)
    categories = list(dict.fromkeys(k for r in rows for k in r["model_state_bytes"]))
    for i, category in enumerate(categories):
        heights = [r["model_state_bytes"].get(category, 0) / MIB for r in rows]
        ax_mem.bar(labels, heights, bottom=bottom, color=f"C{i}", label=category)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_mem.scatter(labels, [r["zero_bound_total_bytes"] / MIB for r in rows], marker="_", s=600, color="black",
                   zorder=3, label="ZeRO bound (" + ", ".join(BOUND_CATEGORIES) + ")")
    ax_mem.set(title="Per rank at the peak of the step (the fullest rank; copies included)", ylabel="MiB")
    ax_mem.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax_mem.tick_params(axis="x", labelrotation=30)
    for tick in ax_mem.get_xticklabels():
        tick.set_horizontalalignment("right")
    for ax in (ax_time, ax_mem):
        ax.grid(axis="y", alpha=0.3)
    return fig


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _tflops(x: float | None) -> str:
    return "unknown peak" if x is None else f"{x / 1e12:.0f} TFLOP/s"


# --- the dry form (benchmark.py --dry_run): bounds from the config and shapes, nothing trained ----------------------

def dry_rows(model_config, rows: list[tuple[str, str, object]]) -> list[dict]:
    """Per row (name, label, its RunConfig): the model-state bytes per rank the ZeRO bound allows, from a meta model
    of the config (each parameter once), and for a mixture of experts the bytes of one sparse layer's experts a rank
    gathers to compute them: all of them without EP, ÷ ep_size with it, ÷ tp_size where TP splits each expert (FSDP2
    unshards one group at a time)."""
    from parity.registry import load
    from parity.models.families import family_of
    from parity.training.memory import BYTES_PER_PARAM, zero_bound
    from parity.models.model import meta_model

    model, family = meta_model(model_config), family_of(model_config)
    params = dict(model.named_parameters())
    psi = sum(p.numel() for p in params.values())
    layers = sum(p.numel() for n, p in params.items() if n.startswith(family.stack + "."))
    experts = sum(p.numel() for n, p in params.items() if family.moe and f".{family.moe.experts}." in n)
    per_layer = experts / len(family.moe.layers) if family.moe else 0
    out = []
    for name, label, cfg in rows:
        cls = load(cfg.strategy_path)
        stage = cfg.options.get("zero_stage", cls.zero_stage)
        precision = "bf16_master_weights" if cfg.options.get("bf16_master_weights") else "fp32"
        pp = cfg.pp_size
        replica = (layers / pp + psi - layers) if pp > 1 else psi / cfg.tp_size
        bound = zero_bound(stage, replica, cfg.dp_size, precision)
        split = cfg.ep_size if cfg.ep_size > 1 else (cfg.tp_size if cls.tensor_parallel else 1)
        out.append({"row": name, "label": label, "strategy": cfg.strategy, "tp_size": cfg.tp_size, "pp_size": pp,
                    "dp_size": cfg.dp_size, "ep_size": cfg.ep_size, "num_params": psi, "expert_params": experts,
                    "zero_stage": stage, "zero_bound_bytes": bound, "zero_bound_total_bytes": sum(bound.values()),
                    "experts_gathered_per_layer_bytes": per_layer * BYTES_PER_PARAM[precision][0] / split})
    return out


def dry_markdown(summary: dict) -> str:
    rows = summary["rows"]
    out = [f"Dry run: {summary['model_name']} on {summary['world_size']} {summary['device']} workers, "
           f"{rows[0]['num_params'] / 1e9:.2f} B parameters ({rows[0]['expert_params'] / 1e9:.2f} B in experts); "
           f"nothing trained", "",
           "| row | TP | PP | DP | EP | ZeRO bound per rank (GiB) | experts one layer gathers (GiB) |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['label']} | {r['tp_size']} | {r['pp_size']} | {r['dp_size']} | {r['ep_size']} | "
            f"{r['zero_bound_total_bytes'] / 2 ** 30:.2f} | {r['experts_gathered_per_layer_bytes'] / 2 ** 30:.3f} |"
            for r in rows]
    return "\n".join(out) + "\n"

