"""benchmark.py --recorder: the recorder's own cost per recorder layout (docs/benchmark.md#the-recorders-cost).

Each layout is its example (examples/) as a user runs it, on --num_workers ranks under torchrun, at the benchmark's sizes
(qwen2-tiny, or --model_name's widths cut to --num_layers; --seq_length tokens, --batch_size rows a rank, one micro-batch
a step, fp32), recording itself. The recorder times itself in each step's record entry (`harness_s`): `recorder_before`,
what it did during the step (each micro-batch's loss from the logits, before_step's reads, the optimizer step
pre-hook's), and `after_step`, all it does at the step's end (the rows' exchange, the parameter norm, the batch saved,
every tensor's norms, the replica check, the entry and, every log_interval steps, the record's write). The share of a step is those seconds over the step's own
(`step_time_s`, the recorder's seconds taken out), over the steps after the first `--untimed_steps`: the mean seconds
over the mean step (what the recorder adds in all), and the median of each step's share.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

# layout → (its example under examples/, its flags)
LAYOUTS = {
    "DDP": ("plain_loop.py", []),
    "FSDP2": ("sharded_loop.py", ["--shard", "fsdp2"]),
    "FSDP1": ("sharded_loop.py", ["--shard", "fsdp1"]),
    "ZeRO-1": ("sharded_loop.py", ["--shard", "zero1"]),
    "ZeRO-2": ("sharded_loop.py", ["--shard", "zero2"]),
    "ZeRO-3": ("sharded_loop.py", ["--shard", "zero3"]),
    "Trainer": ("hf_trainer.py", []),
    "Lightning": ("lightning_lm.py", []),
}
PARTS = ("recorder_before", "exchange", "param_norm", "batch", "tensor_norms", "replica_check", "record",
         "record_write")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def measure(out: str, layouts: list[str], steps: int, untimed: int, seq_length: int, batch_size: int,
            workers: int, model: list[str] = ()) -> dict:
    """{layout: its figures (cost), or {"error": line}}: each layout's example run and recorded into out/<layout>."""
    from parity.training.record import load_record

    rows = {}
    for name in layouts:
        example, flags = LAYOUTS[name]
        folder = os.path.join(out, "recorder", name.replace("-", "").lower())
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
                   os.path.join(EXAMPLES, example), "--output_dir", folder, "--steps", str(steps), "--seq_length",
                   str(seq_length), "--grad_accum_steps", "1", "--batch_size", str(batch_size),
                   *model, *flags]  # torchrun's ranks; one micro-batch: --batch_size is a rank's rows in every example
        done = subprocess.run(command, capture_output=True, text=True)
        records = sorted(f for f in os.listdir(folder) if f.startswith("loss_") and f.endswith(".json")) \
            if os.path.isdir(folder) else []
        if done.returncode or not records:
            lines = [x for x in done.stderr.splitlines() if x.strip()]
            rows[name] = {"error": f"exit {done.returncode}: {lines[-1] if lines else 'no record'}"}
            continue
        rows[name] = cost(load_record(os.path.join(folder, records[0]))["steps"][untimed:])
        print(f"[recorder] {name}: {rows[name]['share_of_mean_step']:.1%} of a step", flush=True)
    return rows


def cost(steps: list[dict]) -> dict:
    """The recorder's figures over `steps` (record entries): the mean step, the mean recorder seconds and their share,
    the median of the steps' shares, and the mean seconds of each part."""
    spent = [s["harness_s"].get("recorder_before", 0.0) + s["harness_s"].get("after_step", 0.0) for s in steps]
    step = [s["step_time_s"] for s in steps]
    parts = {p: statistics.fmean(s["harness_s"].get(p, 0.0) for s in steps) for p in PARTS}
    return {"steps": len(steps), "mean_step_s": statistics.fmean(step), "mean_recorder_s": statistics.fmean(spent),
            "share_of_mean_step": statistics.fmean(spent) / statistics.fmean(step),
            "median_share": statistics.median(a / b for a, b in zip(spent, step)), "parts_s": parts}


def recorded_share(steps: list[dict]) -> dict | None:
    """`cost` over a recorded run's steps that hold the recorder's timings, its first step left out; None where none
    do."""
    timed = [s for s in steps[1:] if "harness_s" in s and s.get("step_time_s")]
    return cost(timed) if timed else None


def markdown(rows: dict) -> list[str]:
    """The table benchmark.py --recorder prints and writes (recorder.md)."""
    lines = ["| layout | step (ms) | recorder (ms) | share of the mean step | median share | " +
             " | ".join(PARTS) + " (ms) |", "|---|" + "---:|" * (4 + len(PARTS))]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | error: {row['error'].replace('|', '/')} |" + " |" * (3 + len(PARTS)))
            continue
        parts = " | ".join(f"{1e3 * row['parts_s'][p]:.2f}" for p in PARTS)
        lines.append(f"| {name} | {1e3 * row['mean_step_s']:.1f} | {1e3 * row['mean_recorder_s']:.2f} | "
                     f"{row['share_of_mean_step']:.1%} | {row['median_share']:.1%} | {parts} |")
    return lines


def run(args) -> int:
    """benchmark.py --recorder: every layout (or --rows' of them) measured; recorder.json and recorder.md written."""
    from parity.storage import check_writable_dir, write_json_atomic, write_text_atomic

    out = os.path.abspath(args.output_dir)
    check_writable_dir("--output_dir", out)
    layouts = args.rows.split(",") if args.rows else list(LAYOUTS)
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        from parity.errors import ConfigError

        raise ConfigError(f"--rows {unknown[0]}: with --recorder the rows are recorder layouts: {','.join(LAYOUTS)}")
    if args.model_name:  # a config the examples cannot build: one line before any of them starts
        from parity.models.model import resolve_model_config

        resolve_model_config(args.model_name, args.num_layers)
    model = [*(["--model_name", args.model_name] if args.model_name else []),
             *(["--model_layers", str(args.num_layers)] if args.num_layers else [])]  # the examples' own by default
    rows = measure(out, layouts, args.debug_steps, args.untimed_steps, args.seq_length or 256, args.batch_size,
                   args.num_workers, model)
    write_json_atomic(os.path.join(out, "recorder.json"), {
        "steps": args.debug_steps, "untimed_steps": args.untimed_steps, "seq_length": args.seq_length or 256,
        "batch_size": args.batch_size, "num_workers": args.num_workers, "model_name": args.model_name or "qwen2-tiny",
        "num_layers": args.num_layers, "layouts": rows})
    table = "\n".join(markdown(rows)) + "\n"
    write_text_atomic(os.path.join(out, "recorder.md"), table)
    print(table + f"wrote {out}/recorder.json, {out}/recorder.md", flush=True)
    return 0
