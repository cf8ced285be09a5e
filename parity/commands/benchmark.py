"""benchmark.py: a matrix of strategies trained for N steps at one global batch through the same Ray launch,
in one Ray session and one worker group; then per row step time, its ratio to DDP's, tokens/s, model-state
bytes per rank against the ZeRO bound, peak memory and the final loss against DDP's (parity.comparing.
benchmark_report writes benchmark.json, benchmark.md and benchmark.png)."""

from __future__ import annotations

import argparse
import os
import time
from typing import NamedTuple

from parity import console, storage
from parity.commands.common import OneLineParser, run_command
from parity.errors import ConfigError, TrainingFailed
from parity import registry
from parity.layout import given_pp_size
from parity.driver.cluster import ray_for_this_command
from parity.driver.config import DEVICES, PRECISIONS


class Row(NamedTuple):
    label: str
    strategy: str  # a registry row's name, or your class's name (its path in options["strategy_class"])
    tp: int | None  # the row's TP size; None: 2 where its class shards tensors, else 1
    options: dict
    ep_size: int = 1

    @property
    def path(self) -> str:
        """The row's strategy class, "module:Class"."""
        return self.options.get("strategy_class") or registry.row(self.strategy).path

    @property
    def tp_size(self) -> int:
        return self.tp if self.tp is not None else 2 if registry.load(self.path).tensor_parallel else 1

    def strategy_options(self) -> tuple[type, dict]:
        """The row's strategy class and its options, defaults filled in."""
        cls = registry.load(self.path)
        return cls, cls.with_default_options(self.options)

    @property
    def replica_ranks(self) -> int:
        """The ranks one model replica spans: tp_size × the strategy's pipeline ranks."""
        return self.tp_size * given_pp_size(registry.load(self.path), self.options)


# The rows that set a strategy's layout or options (ZeRO stages, offload, TP, SP, pipeline schedules); a registered
# strategy without one gets its plain row below (its registry label, at TP 2 where it shards tensors).
VARIANTS = {
    "ddp": Row("DDP", "ddp", 1, {}),
    "zero1": Row("ZeRO-1", "deepspeed", 1, {"zero_stage": 1}),
    "zero2": Row("ZeRO-2", "deepspeed", 1, {"zero_stage": 2}),
    "zero3": Row("ZeRO-3", "deepspeed", 1, {"zero_stage": 3}),
    "zero2_offload": Row("ZeRO-2 + offload", "deepspeed", 1, {"zero_stage": 2, "offload_optimizer": "cpu"}),
    "autotp_zero1": Row("AutoTP tp2 + ZeRO-1", "deepspeed", 2, {"zero_stage": 1}),
    "fsdp": Row("FSDP2", "fsdp", 1, {}),
    "fsdp_tp": Row("FSDP2 + TP tp2", "fsdp", 2, {}),
    "fsdp_offload": Row("FSDP2 + offload", "fsdp", 1, {"offload": "cpu"}),
    "fsdp_tp_sp": Row("FSDP2 + TP tp2 + SP", "fsdp", 2, {"tp_plan": "sequence_parallel"}),
    "pp_gpipe": Row("Pipeline pp2 GPipe", "pipeline", 1, {"pp_size": 2, "pp_schedule": "gpipe"}),
    "pp_1f1b": Row("Pipeline pp2 1F1B", "pipeline", 1, {"pp_size": 2, "pp_schedule": "1f1b"}),
    "pp_interleaved": Row("Pipeline pp2 interleaved 1F1B", "pipeline", 1,
                          {"pp_size": 2, "pp_schedule": "interleaved_1f1b"}),
    "transformers_tp": Row("transformers TP tp2 + FSDP2", "transformers", 2, {}),
}
ROWS = {**VARIANTS, **{r.name: Row(r.label, r.name, None, {}) for r in registry.ROWS
                       if r.name not in {v.strategy for v in VARIANTS.values()}}}
# A mixture of experts' rows besides (docs/moe.md): experts over EP groups of 2, FSDP2 over the ranks holding the same.
EP_ROWS = {
    "fsdp_ep": Row("FSDP2 + EP ep2", "fsdp", 1, {}, 2),
    "fsdp_tp_ep": Row("FSDP2 + TP tp2 + EP ep2", "fsdp", 2, {}, 2),
    "transformers_ep": Row("transformers EP ep2 + FSDP2", "transformers", 1, {}, 2),
}
WEIGHTS = os.path.join("shared_weights", "init_weights.pt")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = OneLineParser(description)
    p.add_argument("--output_dir", required=True, help="benchmark.json, benchmark.md, benchmark.png, rows/<row>/")
    p.add_argument("--verbose", action="store_true",
                   help="Ray's, DeepSpeed's and torch's output on the terminal, not in OUTPUT_DIR/benchmark.log")
    p.add_argument("--strategy_class", default=None, metavar="MODULE:CLASS",
                   help="one more row: your own Strategy subclass (named by its class's name)")
    p.add_argument("--rows", default=None,
                   help=f"comma-separated rows, ddp among them (the reference); default: every row the world size "
                        f"can run, of {','.join(ROWS)}")
    p.add_argument("--model_name", default=None, help="default: Qwen/Qwen2.5-0.5B on GPUs, qwen2-tiny on CPU")
    p.add_argument("--num_layers", type=int, default=None,
                   help="default: 2; with --dry_run the model's own")
    p.add_argument("--num_workers", type=int, default=2, help="every row's world size (TP rows: tp 2 × dp N/2)")
    p.add_argument("--batch_size", type=int, default=2,
                   help="samples per worker; the global batch, num_workers × batch_size, is every row's")
    p.add_argument("--seq_length", type=int, default=None, help="default: 1024 on GPUs, 256 on CPU")
    p.add_argument("--debug_steps", type=int, default=20, help="training steps of each row")
    p.add_argument("--untimed_steps", type=int, default=3, help="the first steps, left out of the timing (warm-up)")
    p.add_argument("--learning_rate", type=float, default=None, help="default: 1e-5 on GPUs, the preset's on CPU")
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lora_r", type=int, default=None,
                   help="every row trains LoRA adapters of rank R on the frozen base (docs/finetune.md): the rows of "
                        "strategies that cannot are passed over; compare its memory with a run without")
    p.add_argument("--lora_targets", default=None, help="the adapters' linear layers (default: peft's for the family)")
    p.add_argument("--lora_modules_to_save", default=None,
                   help="modules trained whole beside the adapters (peft's modules_to_save): embed_tokens,norm,...")
    p.add_argument("--reduce_bucket_size", type=int, default=None,
                   help="the DeepSpeed rows' --reduce_bucket_size (default: DeepSpeed's, 5e8 elements: ZeRO-2 and "
                        "ZeRO-3 then hold every gradient until the end of backward, as ZeRO-1, for any model "
                        "smaller than that)")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="one GPU's peak bf16 TFLOP/s for MFU (default: looked up by the GPU's name)")
    p.add_argument("--dry_run", action="store_true",
                   help="train nothing: per row the model-state bytes per rank the ZeRO bound allows, from the model's "
                        "config and shapes alone (a meta model: any size, e.g. Qwen/Qwen3-30B-A3B), and for a mixture "
                        "of experts the experts one layer gathers to compute (÷ ep_size); writes benchmark_dry.json")
    p.add_argument("--recorder", action="store_true",
                   help="instead of the strategies: the recorder's own cost per recorder layout (DDP, FSDP2, FSDP1, "
                        "ZeRO-1/2/3, Trainer, Lightning: --rows picks), each its example recording itself at these "
                        "sizes; writes recorder.json and recorder.md (docs/benchmark.md#the-recorders-cost)")
    return p


def row_misfit(row: Row, num_workers: int, num_layers: int) -> str | None:
    """Why the row cannot run at this world size and layer count, in words; None when it can."""
    cls, options = row.strategy_options()
    if num_workers % row.ep_size:
        return f"runs at ep_size {row.ep_size}, which does not divide --num_workers {num_workers}: leave it out"
    pp = given_pp_size(cls, row.options)
    if num_workers % row.replica_ranks:
        what = f"tp_size {row.tp_size}" if pp == 1 else f"pp_size {pp}"
        return (f"runs at {what}, which does not divide --num_workers {num_workers}: use an even --num_workers or "
                f"leave it out")
    stages = cls.layer_stages(options, pp)
    if num_layers % stages:
        return (f"splits the layers into {stages} stages, which do not divide --num_layers {num_layers}: use "
                f"--num_layers {num_layers - num_layers % stages or stages} or leave it out")
    return None


def pick_rows(spec: str | None, num_workers: int, num_layers: int, rows: dict[str, Row] = ROWS) -> list[str]:
    """The rows to run, DDP first; by default every row this world size and layer count can run."""
    if spec is None:
        return [name for name, row in rows.items() if row_misfit(row, num_workers, num_layers) is None]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in rows:
            raise ConfigError(f"--rows: unknown row '{name}': use {','.join(rows)}")
        misfit = row_misfit(rows[name], num_workers, num_layers)
        if misfit:
            raise ConfigError(f"--rows: {name} {misfit}")
    if "ddp" not in names:
        raise ConfigError("--rows must include ddp: the step-time ratio and the loss difference are against DDP's run")
    return ["ddp"] + [n for n in dict.fromkeys(names) if n != "ddp"]


def all_rows(args, model_config=None) -> dict[str, Row]:
    """The rows — a mixture of experts' EP rows too — with --strategy_class's as one more (named by the class, at TP 2
    if it shards tensors)."""
    from parity.models.families import family_of

    rows = {**ROWS, **(EP_ROWS if model_config is not None and family_of(model_config).moe else {})}
    if not args.strategy_class:
        return rows
    name = registry.load(args.strategy_class).name
    return {**rows, name: Row(name, name, None, {"strategy_class": args.strategy_class})}


def runnable(names: list[str], cfgs: dict, explicit: bool) -> list[str]:
    """The rows whose run resolved; by default (no --rows) the others are passed over with their one line — a
    mixture of experts refused by AutoTP, a pipeline or sequence parallelism — and with --rows the first refusal is
    the command's error."""
    kept = []
    for name in names:
        outcome = cfgs[name]
        if isinstance(outcome, ConfigError):
            if explicit or name == "ddp":
                raise outcome
            print(f"benchmark: row {name} passed over: {outcome}", flush=True)
        else:
            kept.append(name)
    return kept


def run_values(args, name: str, out: str, on_gpu: bool, rows: dict[str, Row] = ROWS) -> dict:
    """The train_*.py flags of one row: the same global batch at every layout."""
    row = rows[name]
    steps = args.debug_steps
    return {
        "model_name": args.model_name or ("Qwen/Qwen2.5-0.5B" if on_gpu else "qwen2-tiny"),
        "num_layers": args.num_layers, "seq_length": args.seq_length or (1024 if on_gpu else 256),
        "num_workers": args.num_workers, "tp_size": row.tp_size, "batch_size": args.batch_size * row.replica_ranks,
        "debug_steps": steps, "log_interval": max(1, steps // 4),
        # a checkpoint mid-run: its teacher-forced check, from a state with AdamW's moments, is the one the cost is of
        "checkpoint_interval": max(1, steps // 2),
        "learning_rate": args.learning_rate or (1e-5 if on_gpu else None), "precision": args.precision,
        "device": args.device, "seed": args.seed, "init_weights_path": os.path.join(out, WEIGHTS),
        "loss_output_dir": os.path.join(out, "rows", name), "storage_path": os.path.join(out, "ray"),
        "experiment_name": f"benchmark_{name}", "ep_size": row.ep_size, **row.options,
        "lora_r": args.lora_r, "lora_targets": args.lora_targets, "lora_modules_to_save": args.lora_modules_to_save,
        **registry.flags_for(row.strategy, {} if args.reduce_bucket_size is None else
                    {"reduce_bucket_size": args.reduce_bucket_size}),
    }


def run_benchmark(args) -> int:
    import ray

    from parity.comparing import benchmark_report as report
    from parity.comparing.figures import save_figure
    from parity.storage import check_writable_dir, write_json_atomic, write_text_atomic
    from parity.driver.cluster import ensure_ray, probe_cluster
    from parity.training.data import training_data
    from parity.driver.launch import launch_runs
    from parity.models.adapters import write_initial_adapters
    from parity.models.model import build_model, model_config_from_dict, resolve_model_config, save_init_weights
    from parity.training.record import load_record, run_record_path

    out = os.path.abspath(args.output_dir)
    check_writable_dir("--output_dir", out)
    if not 0 <= args.untimed_steps < args.debug_steps:
        raise ConfigError(f"--untimed_steps {args.untimed_steps} must be at least 0 and below --debug_steps "
                          f"{args.debug_steps}: at least one step must be timed")
    started_ray = not ray.is_initialized()
    cluster = probe_cluster()
    on_gpu = args.device == "cuda" or (args.device == "auto" and cluster.gpus >= args.num_workers)
    rows = all_rows(args, resolve_model_config(run_values(args, "ddp", out, on_gpu)["model_name"], args.num_layers))
    names = pick_rows(args.rows, args.num_workers, args.num_layers, rows)
    resolved = {n: resolved_or_refused(rows[n].strategy, run_values(args, n, out, on_gpu, rows), cluster)
                for n in names}
    names = runnable(names, resolved, explicit=args.rows is not None)
    cfgs = [resolved[n] for n in names]
    first = cfgs[0]
    save_init_weights(build_model(model_config_from_dict(first.model_config), first.seed), first.init_weights_path)
    if first.lora is not None:
        write_initial_adapters(first.init_weights_path, model_config_from_dict(first.model_config), first.lora,
                               first.seed)
    titles = [f"{rows[n].label}: {cfg.strategy} tp={cfg.tp_size} dp={cfg.dp_size} batch {cfg.batch_size} {cfg.options}"
              for n, cfg in zip(names, cfgs)]
    print(f"benchmark: {len(names)} rows ({', '.join(names)}) on {args.num_workers} "
          f"{'GPU' if first.use_cuda else 'CPU'} workers, {first.model_name}, {first.precision}, global batch "
          f"{first.global_batch_size} × {first.seq_length}, {args.debug_steps} steps; outputs in {out}", flush=True)
    t0 = time.perf_counter()
    with console.terminal(storage.join(out, "benchmark.log"), args.verbose) as log, console.pointing_to(log), \
            ray_for_this_command():
        try:
            ensure_ray()
            launch_runs(cfgs, [{"batches": training_data(cfg)} for cfg in cfgs], checkpoints=False, titles=titles)
        except TrainingFailed as exc:
            raise TrainingFailed(f"{exc} (the rows finished so far have their records under {out}/rows)") from None
        finally:
            if started_ray:
                ray.shutdown()
    print(f"all rows done in {time.perf_counter() - t0:.0f} s", flush=True)

    summaries = [report.summarize_row(n, rows[n].label, load_record(run_record_path(cfg)), run_record_path(cfg),
                                      args.untimed_steps) for n, cfg in zip(names, cfgs)]
    ddp_record = load_record(run_record_path(first))
    on_cuda = first.use_cuda
    peak, source = report.peak_flops(ddp_record["config"]["device_name"], args.peak_tflops) if on_cuda else (None, "")
    flops = report.model_flops_per_token(first.model_config, first.seq_length)
    report.add_ratios(summaries, flops, peak, first.num_workers)
    summary = {
        "model_name": first.model_name, "num_layers": first.model_config["num_hidden_layers"],
        "num_params": ddp_record["final"]["model_state"]["num_params"], "device": first.device,
        "device_name": ddp_record["config"]["device_name"], "precision": first.precision,
        "world_size": first.num_workers, "global_batch_size": first.global_batch_size, "seq_length": first.seq_length,
        "lora": first.lora,
        "steps": args.debug_steps, "untimed_steps": args.untimed_steps, "model_state_measured_at": report.MEASURED_AT,
        "flops_per_token": flops, "peak_flops": peak, "peak_flops_source": source,
        "memory_note": ("torch.cuda.max_memory_allocated of rank 0 during the row (reset at its start)" if on_cuda else
                        "rank 0's process peak RSS during the row, dominated by the imports (~400 MiB), not the model"),
        "rows": summaries,
    }
    write_json_atomic(os.path.join(out, "benchmark.json"), summary)
    table = report.markdown(summary)
    write_text_atomic(os.path.join(out, "benchmark.md"), table)
    save_figure(report.figure(summary), os.path.join(out, "benchmark.png"))
    print(table, flush=True)
    print(f"wrote {out}/benchmark.json, benchmark.md, benchmark.png", flush=True)
    return 0


def resolved_or_refused(strategy: str, values: dict, cluster):
    """A row's RunConfig, or the ConfigError that refuses it."""
    from parity.driver.config import resolve

    try:
        return resolve(strategy, values, cluster=cluster, weights_written_before_launch=True)
    except ConfigError as exc:
        return exc


def dry_run(args) -> int:
    """--dry_run: every row's model-state bound per rank from the config and the shapes alone (docs/benchmark.md)."""
    from parity.comparing.benchmark_report import dry_markdown, dry_rows
    from parity.storage import check_writable_dir, write_json_atomic
    from parity.driver.cluster import Cluster

    from parity.models.model import resolve_model_config

    out = os.path.abspath(args.output_dir)
    check_writable_dir("--output_dir", out)
    on_gpu = args.device != "cpu"
    if args.num_layers is None:
        args.num_layers = resolve_model_config(run_values(args, "ddp", out, on_gpu)["model_name"]).num_hidden_layers
    cluster = Cluster(cpus=float(args.num_workers), gpus=args.num_workers if on_gpu else 0)
    first = resolved_or_refused("ddp", run_values(args, "ddp", out, on_gpu), cluster)
    if isinstance(first, ConfigError):
        raise first
    from parity.models.model import model_config_from_dict

    config = model_config_from_dict(first.model_config)
    rows = all_rows(args, config)
    names = pick_rows(args.rows, args.num_workers, args.num_layers, rows)
    resolved = {n: resolved_or_refused(rows[n].strategy, run_values(args, n, out, on_gpu, rows), cluster)
                for n in names}
    names = runnable(names, resolved, explicit=args.rows is not None)
    summary = {"model_name": first.model_name, "world_size": args.num_workers, "device": first.device,
               "precision": first.precision, "rows": dry_rows(config, [(n, rows[n].label, resolved[n]) for n in names])}
    write_json_atomic(os.path.join(out, "benchmark_dry.json"), summary)
    print(dry_markdown(summary), flush=True)
    print(f"wrote {out}/benchmark_dry.json (nothing trained)", flush=True)
    return 0


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    if args.num_layers is None and not args.dry_run:
        args.num_layers = 2
    if args.recorder:
        from parity.commands import recorder_cost

        return run_command(lambda: recorder_cost.run(args), "the benchmark")
    return run_command(lambda: dry_run(args) if args.dry_run else run_benchmark(args), "the benchmark")
