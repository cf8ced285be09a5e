"""gpu_check.sh: the GPU check in one command, without Ray or DeepSpeed (docs/gpu.md). Each step is timed and recorded
as passed or failed with its error line; a step that fails does not stop the next. Writes gpu_check.md and
gpu_check.json under --output_dir (rewritten after every step, so a check cut short still leaves its report).

  collectives   gloo with the run's tensors (CUDA ones on a GPU): every collective the strategies use, on 2 local
                ranks; which work, which do not
  seed          the seed configuration at world size 1 (Qwen/Qwen2.5-0.5B, 2 layers, batch 2, seq 1024, 100 steps,
                lr 1e-5, bf16): DDP, FSDP2 and transformers' (the pipeline needs 2 ranks); tokens/s, peak
                memory, MFU against the device's bf16 peak (the benchmark's table), each record
  own_trainer   your own trainer's GPU paths (Trainer with accelerate's FSDP2 plugin, Lightning's FSDP and
                ModelParallel strategies, TRL's GRPOTrainer, torchtitan's debug job), each recorded and replayed at
                world size 1 (gpu_check/own_trainer.py), the FSDP2 Trainer's also under the sharded replays (FSDP2, ZeRO-3);
                skipped on --device cpu
  layer_check   one recorded step of DDP and FSDP2 (+ TP=2 on CPU; one rank on a GPU) in bf16 against DDP's fp32
                twin (the layer check)
  posttrain     a GRPO-family update (dapo) from a rollout file, DDP DP=2 against FSDP2 + TP=2 × DP=2, fp32 and the
                bf16 calibrated verdict (gpu_check/posttrain.py)
  lora          LoRA adapters (rank 8 on q, k, v and o) on the frozen base, the parity step's runs at its first seed:
                DDP DP=2's LoRA run against FSDP2 + TP's, fp32 and the bf16 calibrated verdict (docs/finetune.md)
  parity        several ranks on the one GPU over gloo (PARITY_SHARE_ONE_GPU=1, a switch for testing only): DDP
                DP=2 against FSDP2 + TP at TP=2 × DP=1 and TP=2 × DP=2 (qwen2-tiny, seq 256), in fp32 (the harness's
                verdict), and in bf16 at 3 seeds each judged against DDP's noise references (the baseline at two
                other layouts and in fp32, as the main job runs them): the false-alarm question asked of CUDA

--device cpu is the dry run: the same steps on CPU ranks, every size scaled down (a few steps, tiny sequences).
Exit 0: every step passed; 1: a step failed; 2: bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
import traceback

from parity.commands.common import OneLineParser, error_line, run_command
from parity.commands.gpu_check.collectives import step_collectives
from parity.commands.gpu_check.own_trainer import markdown as own_markdown, step_own_trainer
from parity.commands.gpu_check.posttrain import step_posttrain
from parity.commands.gpu_check.runs import TP_STRATEGY, judge_folder, run_values, shared_gpu, train, write_weights
from parity.console import redirected
from parity.errors import ConfigError

JSON_NAME, REPORT_NAME = "gpu_check.json", "gpu_check.md"
# Every strategy that runs at one rank without DeepSpeed (the pipeline needs 2 ranks at least: --pp_size 1 is refused)
WORLD_ONE = ("ddp", "fsdp", "transformers")
NOT_YET = ("Trainer's and Lightning's DeepSpeed paths (they need DeepSpeed, which the check does not carry), and the "
           "own-trainer paths at more than one rank.")

# Sizes by device: the same steps, only sizes differ (a CPU dry run takes seconds per step).
SIZES = {
    "cuda": {
        "seed": {"model_name": "Qwen/Qwen2.5-0.5B", "num_layers": 2, "batch_size": 2, "seq_length": 1024,
                 "debug_steps": 100, "learning_rate": 1e-5, "precision": "bf16"},
        "small": {"model_name": "qwen2-tiny", "num_layers": 2, "batch_size": 2, "seq_length": 256, "debug_steps": 100},
        "seeds": (1, 2, 3),
        # one rank: FSDP2 + TP over gloo with CUDA tensors crashed on the first H200 (docs/gpu.md)
        "layers": {"model_name": "qwen2-tiny", "num_layers": 2, "batch_size": 2, "seq_length": 256, "tp_size": 1},
        "numel": 1 << 20,  # elements per rank of each collective's tensor
    },
    "cpu": {
        "seed": {"model_name": "qwen2-tiny", "num_layers": 2, "batch_size": 2, "seq_length": 32, "debug_steps": 3,
                 "learning_rate": 1e-5, "precision": "bf16"},
        "small": {"model_name": "qwen2-tiny", "num_layers": 1, "batch_size": 2, "seq_length": 16, "debug_steps": 3},
        "seeds": (1,),
        "layers": {"model_name": "qwen2-tiny", "num_layers": 1, "batch_size": 2, "seq_length": 16, "tp_size": 2},
        "numel": 1024,
    },
}


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = OneLineParser(description, prog="gpu_check.sh")
    p.add_argument("--output_dir", required=True, help="where gpu_check.md, gpu_check.json and every record go")
    p.add_argument("--device", default="cuda",
                   help="cuda (the check) or cpu (the dry run: the same steps, scaled down)")
    p.add_argument("--steps", nargs="+", default=None, metavar="STEP",
                   help="only these steps (default: all): " + " ".join(STEP_NAMES))
    return p


# One rank's steps first (the GPU as users run it), then those of several ranks on the one GPU under the testing
# switch, the longest last: on the first H200 these crashed (FSDP2 over gloo with CUDA tensors) and their retries took
# the call's time before own_trainer ran (docs/gpu.md)
STEP_NAMES = ("collectives", "seed", "own_trainer", "layer_check", "posttrain", "lora", "parity")
# the lora step's adapters: every attention projection (FSDP2's TP plan places a colwise one's lora_B and a rowwise
# one's lora_A beside their projection: plans.adapter_rules)
LORA = {"lora_r": 8, "lora_targets": "q_proj,k_proj,v_proj,o_proj"}


def check(args) -> int:
    """Check the input, run every step, write the report; the exit code."""
    from parity import storage

    if args.device not in SIZES:
        raise ConfigError(f"--device {args.device}: use cuda (the check) or cpu (the dry run)")
    unknown = [s for s in (args.steps or ()) if s not in STEP_NAMES]
    if unknown:
        raise ConfigError(f"--steps {unknown[0]}: use any of {', '.join(STEP_NAMES)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no GPU here: use --device cpu for the dry run")
    out = storage.local_path(args.output_dir)
    if out is None:
        raise ConfigError(f"--output_dir {args.output_dir}: use a folder of this machine")
    out = os.path.abspath(out)
    storage.check_writable_dir("--output_dir", out)
    os.makedirs(out, exist_ok=True)
    report = Report(out, args.device)
    steps = {"collectives": step_collectives, "seed": step_seed, "parity": step_parity, "lora": step_lora,
             "layer_check": step_layer_check, "posttrain": step_posttrain, "own_trainer": step_own_trainer}
    started = time.perf_counter()
    with open(os.path.join(out, "gpu_check.log"), "a") as log:
        for name in args.steps or STEP_NAMES:
            print(f"== {name}", flush=True)
            report.run(name, steps[name], SIZES[args.device], log)
            entry = report.steps[-1]
            skipped = entry["details"].get("skipped")
            print(f"   {skipped}" if skipped else f"   {'passed' if entry['passed'] else 'FAILED'} in "
                  f"{entry['seconds']:.1f} s" + ("" if entry["passed"] else f": {entry['error']}"), flush=True)
    report.data["total_seconds"] = time.perf_counter() - started
    report.write()
    print(f"wrote {report.md_path} and {report.json_path} ({report.data['total_seconds']:.0f} s)")
    return 0 if all(s["passed"] for s in report.steps) else 1


class Report:
    """gpu_check.json and gpu_check.md: the environment, then one entry per step."""

    def __init__(self, out: str, device: str):
        self.out, self.device = out, device
        self.json_path, self.md_path = os.path.join(out, JSON_NAME), os.path.join(out, REPORT_NAME)
        self.steps: list[dict] = []
        self.data = {"device": device, "environment": environment(device), "output_dir": out, "steps": self.steps,
                     "not_yet": NOT_YET,
                     "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def run(self, name: str, fn, sizes: dict, log) -> None:
        t0 = time.perf_counter()
        entry = {"step": name, "passed": False, "seconds": 0.0, "error": None, "details": {}}
        self.steps.append(entry)
        try:
            with redirected(log):
                entry["details"] = fn(os.path.join(self.out, name), self.device, sizes)
            failures = entry["details"].pop("failures", [])
            entry["passed"] = not failures
            entry["error"] = "; ".join(failures) or None
        except Exception as exc:  # the step failed: its line, and the next step runs
            traceback.print_exc(file=log)
            entry["error"] = error_line(exc)
        entry["seconds"] = time.perf_counter() - t0
        self.write()

    def write(self) -> None:
        from parity.storage import write_json_atomic, write_text_atomic

        write_json_atomic(self.json_path, self.data)
        write_text_atomic(self.md_path, markdown(self.data))


def environment(device: str) -> dict:
    """What ran: the fingerprint's library versions (torch, CUDA, transformers …) and the device."""
    import torch

    from parity.fingerprint import device_description, library_versions

    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    return {"versions": library_versions(), "device": device_description(where),
            "gpus": torch.cuda.device_count() if device == "cuda" else 0}


# --- b. the seed configuration at world size 1 ------------------------------------------------------------------

def step_seed(folder: str, device: str, sizes: dict) -> dict:
    """DDP, then each strategy that runs at one rank without DeepSpeed, at world size 1, in one local group (NCCL on a
    GPU); per run tokens/s, peak memory and MFU from its record (the benchmark's row)."""
    from parity.comparing import benchmark_report as bench
    from parity.driver.local_group import plan
    from parity.registry import label
    from parity.training.record import load_record, run_record_path

    values = sizes["seed"]
    weights = write_weights(values, 42, os.path.join(folder, "init_weights.pt"))
    untimed = max(1, values["debug_steps"] // 10)
    one_rank = {**values, "num_workers": 1, "tp_size": 1, "dp_size": 1}
    planned = {s: plan(s, run_values(os.path.join(folder, s), f"seed_{s}", device, one_rank, weights)) for s in WORLD_ONE}
    failed = train(list(planned.values()))
    rows, failures = {}, []
    for strategy, (cfg, _) in planned.items():
        if cfg.experiment_name in failed:
            rows[strategy] = {"error": failed[cfg.experiment_name]}
            failures.append(f"{strategy}: {failed[cfg.experiment_name]}")
            continue
        record = load_record(run_record_path(cfg))
        row = bench.summarize_row(strategy, label(strategy), record, run_record_path(cfg), untimed)
        peak, source = bench.peak_flops(record["config"]["device_name"], None) if device == "cuda" else (None, "")
        flops = bench.model_flops_per_token(cfg.model_config, cfg.seq_length)
        row["mfu"] = flops * row["tokens_per_s"] / peak if peak else None  # add_ratios' formula, one rank
        row.update(backend=record["config"]["backend"], device_name=record["config"]["device_name"],
                   flops_per_token=flops, peak_flops=peak, peak_flops_source=source, untimed_steps=untimed)
        rows[strategy] = row
    return {"config": values, "rows": rows, "failures": failures}


# --- c. several ranks on the one GPU: fp32 parity, the bf16 calibrated verdict ------------------------------------

def _parity_runs(folder: str, device: str, small: dict, precision: str, seed: int, weights: str,
                 references: bool) -> tuple[list[tuple[str, str, dict]], dict[str, str]]:
    """(run id, strategy, flags) of one seed's runs, and the comparison folder of each TP layout: DDP DP=2 (and its
    references) train into the TP=2 × DP=1 folder and are copied to the others. `small`: the runs' flags (the sizes'
    "small", with LoRA's in the lora step)."""
    from parity.commands.main_job import twin_layouts

    batch, dp = small["batch_size"], 2
    folders = {f"tp2dp{d}": os.path.join(folder, f"tp2dp{d}") for d in (1, 2)}
    base = os.path.join(folder, "tp2dp1")
    flags = {**small, "precision": precision, "seed": seed}
    runs = [("ddp", "ddp", run_values(base, f"ddp_{precision}_s{seed}", device,
                                   {**flags, "num_workers": dp, "dp_size": dp}, weights))]
    if references:  # the main job's: the baseline at two other layouts and in fp32 at its own
        for twin_dp, twin_batch in twin_layouts(dp, batch, None):
            runs.append((f"twin_dp{twin_dp}", "ddp", run_values(base, f"ddp_twin_dp{twin_dp}_s{seed}", device, {
                **flags, "num_workers": twin_dp, "dp_size": twin_dp, "batch_size": twin_batch, "noise_reference": True},
                weights)))
        runs.append(("fp32_twin", "ddp", run_values(base, f"ddp_fp32_twin_s{seed}", device, {
            **flags, "precision": "fp32", "num_workers": dp, "dp_size": dp, "noise_reference": True}, weights)))
    for d in (1, 2):
        runs.append((f"tp2dp{d}", TP_STRATEGY, run_values(folders[f"tp2dp{d}"], f"fsdp_tp2dp{d}_{precision}_s{seed}",
                                                       device, {**flags, "num_workers": 2 * d, "tp_size": 2,
                                                                "dp_size": d, "batch_size": batch * dp // d}, weights)))
    return runs, folders


def step_parity(folder: str, device: str, sizes: dict) -> dict:
    """fp32 parity at the first seed and the bf16 calibrated verdict at every seed (judged)."""
    return judged(folder, device, sizes["small"], (("fp32", sizes["seeds"][:1], False),
                                                   ("bf16", sizes["seeds"], True)))


def step_lora(folder: str, device: str, sizes: dict) -> dict:
    """The parity step's runs with LoRA adapters (LORA) on the frozen base, at its first seed: fp32 parity and the bf16
    calibrated verdict (judged), the adapters' initial weights drawn beside each seed's weights."""
    seed = sizes["seeds"][:1]
    return {**judged(folder, device, {**sizes["small"], **LORA}, (("fp32", seed, False), ("bf16", seed, True))),
            "lora": LORA}


def judged(folder: str, device: str, flags: dict, plan_by_precision) -> dict:
    """The runs of each (precision, seeds, with DDP's noise references) in `plan_by_precision` with the run `flags`:
    every run planned, trained in one local group per world size (on a GPU every rank on it, over gloo: the testing
    switch), then each TP layout's folder judged by the harness's comparison (plot_loss_curves.py's: its exit code,
    verdict, max relative differences, deviation ÷ noise)."""
    from parity.driver.local_group import SHARE_ONE_GPU, plan

    planned, comparisons, failures = [], [], []
    with shared_gpu(device, SHARE_ONE_GPU):  # planned under it too: without it a run's workers need a GPU each
        for precision, seeds, references in plan_by_precision:
            for seed in seeds:
                seed_folder = os.path.join(folder, precision, f"seed_{seed}")
                weights = write_weights(flags, seed, os.path.join(folder, f"init_weights_seed_{seed}.pt"))
                runs, folders = _parity_runs(seed_folder, device, flags, precision, seed, weights, references)
                planned += [plan(strategy, values) for _, strategy, values in runs]
                comparisons.append((precision, seed, folders))
        failed = train(planned)
    failures += [f"{name}: {line}" for name, line in failed.items()]
    results = []
    for precision, seed, folders in comparisons:
        base = folders["tp2dp1"]
        for name, target in folders.items():
            if target != base:  # DDP's record and references, trained once, judged against each layout
                for f in os.listdir(base) if os.path.isdir(base) else []:
                    if f in ("loss_ddp.json", "loss_ddp.tensors") or f.startswith("noise_reference_"):
                        os.makedirs(target, exist_ok=True)  # a record's tensor series is a folder beside it
                        source = os.path.join(base, f)
                        if os.path.isdir(source):
                            shutil.copytree(source, os.path.join(target, f), dirs_exist_ok=True)
                        else:
                            shutil.copy(source, target)
            entry, failure = judge_folder(target, {"precision": precision, "seed": seed, "layout": name})
            failures += [failure] if failure else []
            results.append(entry)
    seeds = list(dict.fromkeys(seed for _, seeds, _ in plan_by_precision for seed in seeds))
    return {"seeds": seeds, "config": flags, "comparisons": results, "failures": failures}


# --- d. the layer check -----------------------------------------------------------------------------------------

def step_layer_check(folder: str, device: str, sizes: dict) -> dict:
    """run_verification.py through local groups: DDP and FSDP2 + TP (TP=2 on CPU, one rank on a GPU: FSDP2 fully
    sharded over its one rank) in bf16, with DDP's fp32 twin (the noise reference its tolerances are calibrated on)."""
    from parity.commands.layer_check import main as layer_check
    from parity.driver.local_group import SHARE_ONE_GPU

    s = sizes["layers"]
    argv = ["--output_dir", folder, "--launcher", "local", "--device", device, "--strategy", "ddp", TP_STRATEGY,
            "--tp_size", str(s["tp_size"]), "--precision", "bf16", "--noise_reference", "on",
            "--model_name", s["model_name"],
            "--num_layers", str(s["num_layers"]), "--batch_size", str(s["batch_size"]),
            "--seq_length", str(s["seq_length"])]
    with shared_gpu(device, SHARE_ONE_GPU):
        code = layer_check(argv)
    details = {"command": "python run_verification.py " + " ".join(argv), "exit_code": code}
    path = os.path.join(folder, "layer_comparison.json")
    if os.path.exists(path):
        with open(path) as f:
            pairs = json.load(f)["pairs"]
        details["pairs"] = [{k: p.get(k) for k in ("run", "reference", "verdict", "calibrated", "max_rel",
                                                   "bit_identical")} for p in pairs]
    details["failures"] = [] if code == 0 else [f"run_verification.py exit {code} (see {folder}/layer_check.log)"]
    return details


# --- the report -------------------------------------------------------------------------------------------------

def markdown(data: dict) -> str:
    env = data["environment"]
    lines = ["# GPU check", "", f"Device: **{env['device']}** ({data['device']}); started {data['started']}"
             + (f", {data['total_seconds']:.0f} s in all" if "total_seconds" in data else "") + ".", "",
             "Libraries: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", "",
             "| step | result | seconds | error |", "|---|---|---:|---|"]
    for s in data["steps"]:
        result = "skipped" if s["details"].get("skipped") else "passed" if s["passed"] else "**FAILED**"
        lines.append(f"| {s['step']} | {result} | {s['seconds']:.1f} | "
                     f"{(s['error'] or '').replace('|', '/')} |")
    for s in data["steps"]:
        d = s["details"]
        lines += ["", f"## {s['step']}", ""]
        if s["step"] == "collectives" and "results" in d:
            lines += [f"gloo, 2 ranks, tensors on {d['tensors_on']}.", "", "| collective | float32 | bfloat16 |",
                      "|---|---|---|"]
            for name, by in d["results"].items():
                cells = [("ok" if r["ok"] else f"fails: {r['error']}") for r in by.values()]
                lines.append(f"| {name} | " + " | ".join(cells + [""] * (2 - len(cells))) + " |")
        elif s["step"] == "seed" and "rows" in d:
            lines += ["| strategy | backend | tokens/s | MFU | peak memory (MiB) | metric | final loss | record |",
                      "|---|---|---:|---:|---:|---|---:|---|"]
            for name, r in d["rows"].items():
                if "error" in r:
                    lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
                    continue
                mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "n/a"
                lines.append(f"| {name} | {r['backend']} | {r['tokens_per_s']:,.0f} | {mfu} | "
                             f"{r['peak_memory_bytes'] / 2**20:,.0f} | {r['memory_metric']} | {r['final_loss']:.6f} | "
                             f"{os.path.relpath(r['loss_record'], data['output_dir'])} |")
        elif "comparisons" in d:
            lora = (f" LoRA adapters (rank {d['lora']['lora_r']} on {d['lora']['lora_targets']}) on the frozen base in "
                    f"every run." if d.get("lora") else "")
            lines += [f"DDP DP=2 against FSDP2 + TP (`layout`), several ranks on one device.{lora}", "",
                      "| precision | seed | layout | verdict | exit | calibrated | max rel diff (loss) "
                      "| deviation ÷ noise |",
                      "|---|---:|---|---|---:|---|---:|---:|"]
            for c in d["comparisons"]:
                where = f"| {c['precision']} | {c['seed']} | {c['layout']} |"
                if "error" in c:
                    lines.append(f"{where} error: {c['error']} | {c['exit_code']} | | | |")
                    continue
                ratio = max(c["noise_ratio"].values()) if c.get("noise_ratio") else None
                lines.append(f"{where} {c['verdict']} | {c['exit_code']} | {c['calibrated']} | "
                             f"{c['max_rel_diff'].get('loss', float('nan')):.2e} | "
                             f"{'n/a' if ratio is None else f'{ratio:.3f}'} |")
        elif s["step"] == "own_trainer":
            lines += own_markdown(d)
        elif s["step"] == "layer_check" and "exit_code" in d:
            lines += [f"`{d['command']}`: exit {d['exit_code']}.", ""]
            for p in d.get("pairs", []):
                lines.append(f"- {p['run']} vs {p['reference']}: {p['verdict']}, max rel {p['max_rel']}, "
                             f"calibrated {p['calibrated']}")
    lines += ["", "## Not in this check", "", data["not_yet"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    return run_command(lambda: check(args), "the GPU check")
