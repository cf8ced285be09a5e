"""gpu_check's own_trainer step (issue 40's GPU paths, docs/own_trainer.md): the frameworks' paths that run only on
CUDA — Trainer with accelerate's FSDP2 plugin (accelerate picks FSDP only for GPU device types), Lightning's FSDP
strategy (refused on CPU) and its ModelParallel strategy (which runs on CPU too, and is tested there: this is its GPU
run) — each recorded by its example at world size 1, replayed under the harness's DDP on the GPU (the local launcher),
and judged by the verdict; the FSDP2 Trainer's record also under the sharded replays (FSDP2, fully sharded, no TP —
which shares FSDP2's code with the run — and ZeRO-3: parity/replay/replay_choice.py), each judging it; and a
torchtitan job as its users run it (`torchrun -m torchtitan.train --module llama3 --config llama3_debugmodel`: CUDA,
FlexAttention, no CPU launcher) under verify_trainer.py, fp32 and bf16 calibrated (docs/torchtitan.md), on the
assets examples/titan_assets.py makes.

On --device cpu the step is skipped in one line: the CPU paths are the test suite's (tests/test_own_trainer*.py), and
the dry run stays cheap."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

# (row, example under examples/, its flags for the GPU path, the replays that judge it: replay_choice.REPLAYS)
PATHS = (
    ("trainer_fsdp2", "trl_sft.py", ["--device", "cuda", "--fsdp2"], ("ddp", "fsdp", "zero3")),
    ("lightning_fsdp", "lightning_lm.py", ["--accelerator", "gpu", "--strategy", "fsdp"], ("ddp",)),
    ("lightning_model_parallel", "lightning_lm.py", ["--accelerator", "gpu", "--strategy", "model_parallel"], ("ddp",)),
    ("trl_grpo", "trl_posttrain.py", ["--trainer", "grpo", "--fp32"], ("ddp",)),  # TRL's GRPOTrainer (docs/posttrain.md)
)
TIMEOUT_S = 300  # one path's recording or job: a hung one costs its row, not the check's other rows
# (row, the job's own arguments beyond the debug config, verify_trainer.py's flags)
TITAN = (("torchtitan_fp32", ["--training.mixed_precision_param", "float32"], []),
         ("torchtitan_bf16", [], ["--calibrate"]))
SKIPPED = ("skipped on --device cpu: the own-trainer GPU paths (Trainer with accelerate's FSDP2 plugin, Lightning's "
           "FSDP and ModelParallel strategies, torchtitan as its users run it) need CUDA")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def step_own_trainer(folder: str, device: str, sizes: dict) -> dict:
    """Each path recorded at world size 1 on the GPU, replayed at 1 worker under each of its replays, judged: {"rows":
    {"path" or "path under replay": verdict, exit code, max relative differences}, "failures": [...]} — or {"skipped":
    line} on CPU."""
    if device != "cuda":
        return {"skipped": SKIPPED}
    from parity.replay.replay_choice import REPLAYS

    rows, failures = {}, []
    for name, example, flags, replays in PATHS:
        out = os.path.join(folder, name)
        try:
            record = _record(out, os.path.join(EXAMPLES, example), flags)
            for replay in replays:
                row = name if replay == "ddp" else f"{name} under {replay}"
                # a replay under the DeepSpeed strategy runs only where DeepSpeed is installed (the bundle leaves it out)
                if REPLAYS[replay][0] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                    rows[row] = {"skipped": "DeepSpeed is not installed here"}
                    continue
                rows[row] = _replay(out, record, replay)
                if rows[row]["verdict"] != "PASS":
                    failures.append(f"{row}: {rows[row]['verdict']}")
        except Exception as exc:  # the path's one line; the next path runs
            rows[name] = {"error": (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]}
            failures.append(f"{name}: {rows[name]['error']}")
    unusable = _titan_unusable()
    for name, extra, flags in TITAN:
        if unusable:
            rows[name] = {"skipped": unusable}
            continue
        try:
            rows[name] = _titan(os.path.join(folder, name), extra, flags)
            if rows[name]["verdict"] != "PASS":
                failures.append(f"{name}: {rows[name]['verdict']}")
        except Exception as exc:
            rows[name] = {"error": (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]}
            failures.append(f"{name}: {rows[name]['error']}")
    return {"rows": rows, "failures": failures}


def _titan_unusable() -> str | None:
    """Why torchtitan cannot run here (it does not import with this torch: 0.3.0 needs torch.distributed.fsdp's
    DataParallelMeshDims, which torch 2.11 has not), or None."""
    done = subprocess.run([sys.executable, "-c", "import torchtitan.train"], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return f"torchtitan.train does not import here: {lines[-1] if lines else f'exit {done.returncode}'}" \
        if done.returncode else None


def _titan(out: str, extra: list[str], flags: list[str]) -> dict:
    """The torchtitan debug job at world size 1 under verify_trainer.py: its verdict against the DDP replay."""
    import json

    spec = importlib.util.spec_from_file_location("titan_assets", os.path.join(EXAMPLES, "titan_assets.py"))
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    tokenizer, data = assets.make_assets(os.path.join(os.path.dirname(out), "titan_assets"))
    command = [sys.executable, os.path.join(os.path.dirname(EXAMPLES), "verify_trainer.py"), "--output_dir", out,
               *flags, "--", "torchrun", "--nproc_per_node", "1", "-m", "torchtitan.train", "--module", "llama3",
               "--config", "llama3_debugmodel", "--hf_assets_path", tokenizer, "--dataloader.dataset_path", data,
               "--training.steps", "4", "--dump_folder", os.path.join(out, "job"), "--checkpoint.no-enable",
               "--validator.no-enable", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    print(done.stdout + done.stderr, flush=True)  # into the check's log
    report = os.path.join(out, "curve_comparison.json")
    if not os.path.isfile(report):
        lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
        raise RuntimeError(f"torchtitan {' '.join(extra)}: exit {done.returncode}" + (f": {lines[-1]}" if lines else ""))
    against = json.load(open(report))["against_baseline"]["train"]
    return {"verdict": against["verdict"], "max_rel_diff": against["max_rel_diff"], "grad_norm_source": "recorder",
            "replay": "ddp", "exit": done.returncode}


def _record(out: str, script: str, flags: list[str]) -> str:
    """The example run at world size 1 with its recorder; its record's path."""
    if not os.path.isfile(script):
        raise RuntimeError(f"{script} is not here: the examples travel with the project")
    done = subprocess.run([sys.executable, script, "--output_dir", out, "--nproc", "1", *flags], capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    print(done.stdout + done.stderr, flush=True)  # into the check's log
    records = [r for r in glob.glob(os.path.join(out, "loss_*.json")) if not r.endswith("loss_ddp.json")]
    if done.returncode or not records:
        lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(flags)}: exit {done.returncode}"
                           + (f": {lines[-1]}" if lines else ""))
    return records[0]


def _replay(out: str, record: str, replay: str) -> dict:
    """`record` replayed at 1 worker under `replay` (replay_choice.REPLAYS) and judged against it."""
    from parity.commands.recorder_cost import recorded_share
    from parity.comparing.curves import compare, load_runs
    from parity.driver.local_group import launch_local, local_cluster
    from parity.replay.replay import plan_replay
    from parity.replay.replay_choice import REPLAYS
    from parity.training.record import load_record, run_record_path

    strategy, flags, _ = REPLAYS[replay]
    cfg, batches = plan_replay(record, {"num_workers": 1, "device": "cuda", "loss_output_dir": out,
                                        "storage_path": os.path.join(out, "checkpoints")},
                               cluster=local_cluster("cuda"), strategy=strategy, flags=flags)
    launch_local([cfg], [{"batches": batches}])
    comparison = compare(load_runs(out), baseline=strategy)
    recorded, replayed = load_record(record), load_record(run_record_path(cfg))
    name = recorded["strategy"]
    verdict = next(r.verdict.word for r in comparison.results if r.run.name == name)
    diffs = {k: max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for a, b in zip(recorded["steps"], replayed["steps"]))
             for k in ("loss", "grad_norm", "param_norm")}
    return {"verdict": verdict, "max_rel_diff": diffs, "steps": len(recorded["steps"]),
            "grad_norm_source": recorded["config"].get("grad_norm_source"), "record": record, "replay": replay,
            "recorder": recorded_share(recorded["steps"])}


def markdown(details: dict) -> list[str]:
    """The step's lines in gpu_check.md."""
    if "skipped" in details:
        return [details["skipped"] + "."]
    lines = ["World size 1, recorded by the example, replayed under DDP on the GPU (and where named, under the sharded "
             "replays).", "",
             "| path | verdict | loss | grad norm | param norm | grad norm from | recorder's share of a step |",
             "|---|---|---:|---:|---:|---|---:|"]
    for name, row in details.get("rows", {}).items():
        if "error" in row or "skipped" in row:
            what = f"error: {row['error']}" if "error" in row else f"skipped: {row['skipped']}"
            lines.append(f"| {name} | {what.replace('|', '/')} | | | | | |")
            continue
        share = row.get("recorder")
        share = f"{share['share_of_mean_step']:.1%} of {1e3 * share['mean_step_s']:.1f} ms" if share else "n/a"
        d = row["max_rel_diff"]
        lines.append(f"| {name} | {row['verdict']} | {d['loss']:.1e} | {d['grad_norm']:.1e} | {d['param_norm']:.1e} | "
                     f"{row['grad_norm_source']} | {share} |")
    return lines
