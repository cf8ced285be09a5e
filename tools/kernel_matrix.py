#!/usr/bin/env python
"""The clean matrix (docs/tolerances.md#the-clean-matrix): every capability's clean run, as a user types it, under
several kernel settings, and its margin — the largest deviation ÷ bound over every check of every run
(curve_comparison.json's bound_ratios) — in one table. A correct run must PASS under each with margin ≤ 0.5.

    python tools/kernel_matrix.py --output_dir OUT                       # every capability × every setting
    python tools/kernel_matrix.py --output_dir OUT --only trainer,dpo --settings default,avx2
    python tools/kernel_matrix.py --output_dir OUT --device cuda --jobs 6   # on a GPU, one rank (docs/gpu.md)

The settings (parity/calibration/kernel_settings.py) move the kernels a CPU kind or a GPU would. Each cell runs in its
own folder OUT/<capability>/<setting>; OUT/matrix.md and OUT/matrix.json hold the table (and each cell's recorder share
of a step); a cell already done (its comparison there) is read, not run again. `--device cuda`: each example on the GPU
at one rank (the 2-rank rows at two, sharing it over gloo: PARITY_SHARE_ONE_GPU=1, set for every cell so that the
replay's noise reference at another worker count runs too), the CUDA settings; the main job (Ray) and torchtitan's
rows are CPU's. `--jobs N` runs N cells at once, every capability at one setting before the next setting.
`--code DIR` runs another checkout's commands (its verify_trainer.py, examples and main job, DIR first on PYTHONPATH):
the same matrix before a change; where its comparisons hold no bound_ratios, its records are judged again here. Runs
for minutes per cell on 2 cores; no test runs it whole."""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

from parity.attaching.launch import SHARE_ONE_GPU
from parity.calibration.kernel_settings import BY_DEVICE, environment as with_setting  # (the project is installed)
from parity.comparing.margins import worst
from parity.storage import write_json_atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# each example's flags that put it on the GPU (accelerate_loop.py takes one wherever torch sees one)
ON_CUDA = {"hf_trainer.py": ["--device", "cuda"], "trl_sft.py": ["--device", "cuda"],
           "trl_posttrain.py": ["--device", "cuda"], "plain_loop.py": ["--device", "cuda"],
           "lightning_lm.py": ["--accelerator", "gpu"], "accelerate_loop.py": []}


def example_flags(example: str, device: str, nproc: int | None) -> list[str]:
    """--nproc (2 on CPU, 1 on a GPU unless `nproc`) and the example's device flags."""
    return ["--nproc", str(nproc or (2 if device == "cpu" else 1)), *(ON_CUDA[example] if device == "cuda" else [])]


def verify(example: str, *flags: str, nproc: int | None = None):
    """A capability run through verify_trainer.py: `python examples/<example> --output_dir OWN --nproc N FLAGS`."""
    def command(code: str, out: str, device: str, more=()) -> list[str]:
        script = os.path.join(code, "examples", example)
        return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"),
                "--", sys.executable, script, "--output_dir", os.path.join(out, "own"),
                *example_flags(example, device, nproc), *flags, *more]
    return command


def resumed(code: str, out: str, device: str, more=()) -> list[str]:
    """examples/plain_loop.py stopped after step 3's checkpoint and resumed from it, both in one command verified (`more`:
    flags of both)."""
    own, script = os.path.join(out, "own"), os.path.join(code, "examples", "plain_loop.py")
    flags = " ".join([*example_flags("plain_loop.py", device, None), *more])
    both = (f"{sys.executable} {script} --output_dir {own} {flags} --save_at 3 && "
            f"{sys.executable} {script} --output_dir {own} {flags} --resume_from {own}/checkpoint-3")
    return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"), "--",
            "bash", "-c", both]


def main_job(*flags: str):
    def command(code: str, out: str, device: str, more=()) -> list[str]:
        return [sys.executable, "-m", "parity.commands.main_job", "--output_dir", os.path.join(out, "job"), *flags,
                *more]
    return command


def titan(*overrides: str):
    """torchtitan's llama3 debug job through torchrun on CPU (tests/titan_site's changes on PYTHONPATH)."""
    def command(code: str, out: str, device: str, more=()) -> list[str]:
        assets = os.path.join(out, "assets")
        spec = importlib.util.spec_from_file_location("titan_assets", os.path.join(code, "examples", "titan_assets.py"))
        assets_module = importlib.util.module_from_spec(spec)  # the examples folder's module, loaded by its path
        spec.loader.exec_module(assets_module)
        make_assets = assets_module.make_assets

        tokenizer, data = make_assets(assets)
        return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"),
                "--", "torchrun", "--standalone", "--nproc_per_node", "2", "-m", "torchtitan.train", "--module",
                "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", tokenizer, "--dataloader.dataset_path",
                data, "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
                "--training.mixed_precision_param", "float32", "--dump_folder", os.path.join(out, "dump"),
                "--validator.no-enable", "--checkpoint.no-enable", *overrides, *more]
    return command


CAPABILITIES = {  # name: (the command's maker, the folder its comparison lands in)
    "main_fp32": (main_job(), "job/loss_curves"),
    "main_bf16": (main_job("--precision", "bf16"), "job/loss_curves"),
    "trainer": (verify("hf_trainer.py"), "verify"),
    "trainer_bf16": (verify("hf_trainer.py", "--bf16"), "verify"),  # Trainer's bf16 autocast, SDPA attention
    "trainer_bf16_2ranks": (verify("hf_trainer.py", "--bf16", nproc=2), "verify"),
    "trl_sft": (verify("trl_sft.py"), "verify"),
    "grpo": (verify("trl_posttrain.py", "--loss_type", "dapo", "--beta", "0.04"), "verify"),
    "grpo_fp32": (verify("trl_posttrain.py", "--loss_type", "dapo", "--beta", "0.04", "--fp32"), "verify"),
    "dpo": (verify("trl_posttrain.py", "--trainer", "dpo", "--fp32"), "verify"),
    "lightning": (verify("lightning_lm.py"), "verify"),
    "accelerate": (verify("accelerate_loop.py"), "verify"),
    "own_loop": (verify("plain_loop.py"), "verify"),
    "titan_fsdp": (titan(), "verify"),
    "titan_tp": (titan("--parallelism.tensor_parallel_degree", "2"), "verify"),
    "lora": (verify("hf_trainer.py", "--lora"), "verify"),
    "packed": (verify("hf_trainer.py", "--padding_free"), "verify"),
    "resume": (resumed, "verify"),
}
CPU_ONLY = ("main_fp32", "main_bf16", "titan_fsdp", "titan_tp")  # Ray's main job; torchtitan through a CPU launcher


def environment(code: str, setting: str, device: str) -> dict[str, str]:
    """This process's environment under `setting` (of `device`'s), `code` and torchtitan's CPU changes
    (tests/titan_site) first on PYTHONPATH; on a GPU every rank on it (the testing switch: the 2-rank rows and the replay's references)."""
    path = [code, os.path.join(REPO, "tests", "titan_site"), *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))]
    shared = {SHARE_ONE_GPU: "1"} if device == "cuda" else {}
    return {**with_setting(setting, dict(os.environ), device), **shared, "PYTHONPATH": os.pathsep.join(path)}


def margins(folder: str, comparison: dict) -> dict[str, tuple[str, float]]:
    """{run: (its worst check, deviation ÷ bound)} of the comparison in `folder`: its curve_comparison.json's bound_ratios
    or — written by an older harness, without them — its records judged again here (the same bounds: an older
    record's teacher-forced checks hold no noise, its quantities no ties) and measured by parity.comparing.margins."""
    ratios = {name: against.get("bound_ratios") for name, against in comparison["against_baseline"].items()}
    if not all(ratios.values()):
        from parity.comparing.curves import compare, load_references, load_runs
        from parity.comparing.margins import bound_ratios

        again = compare(load_runs(folder), comparison["baseline"], references=load_references(folder),
                        allow_incomplete=True)
        ratios = {r.run.name: bound_ratios(again, r) for r in again.results}
    return {name: worst(found) for name, found in ratios.items()}


def run_cell(capability: str, setting: str, out: str, code: str, device: str = "cpu",
             timeout: float | None = None, make=None, cell: str | None = None, env: dict | None = None,
             folder: str | None = None) -> dict:
    """One cell: its command run (unless its comparison is there; stopped after `timeout` s), its verdict, exit code,
    margin, seconds, the recorder's share of the recorded run's steps, and each run's margin ("runs": {run: (check,
    ratio)}). `make` (a command maker), `folder` (where its comparison lands), `cell` (its folder: OUT/<capability>/
    <setting>) and `env` (variables beside the setting's) where the cell is not the matrix's own (tools/false_alarms.py)."""
    make, folder = make or CAPABILITIES[capability][0], folder or CAPABILITIES[capability][1]
    cell = cell or os.path.join(out, capability, setting)
    report = os.path.join(cell, folder, "curve_comparison.json")
    seconds, code_ = None, None
    if not os.path.exists(report):
        os.makedirs(cell, exist_ok=True)
        t0 = time.perf_counter()
        with open(os.path.join(cell, "output.log"), "w") as log:
            try:
                code_ = subprocess.run(make(code, cell, device), env={**environment(code, setting, device), **(env or {})},
                                       cwd=code, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code_ = "timeout"
        seconds = time.perf_counter() - t0
        write_json_atomic(os.path.join(cell, "seconds.json"), {"seconds": seconds})
    elif os.path.exists(os.path.join(cell, "seconds.json")):  # a cell run before: the seconds it ran then
        seconds = json.load(open(os.path.join(cell, "seconds.json")))["seconds"]
    if not os.path.exists(report):
        return {"verdict": "no comparison", "exit": code_, "seconds": seconds, "margin": None, "check": None}
    comparison = json.load(open(report))
    runs = margins(os.path.dirname(report), comparison)
    worst = max(runs.values(), key=lambda cv: cv[1], default=("none", 0.0))
    return {"verdict": comparison["verdict"], "exit": code_, "seconds": seconds, "margin": worst[1], "check": worst[0],
            "recorder": recorder_share(os.path.dirname(report)),
            "runs": {name: {"check": c, "margin": m, "verdict": comparison["against_baseline"][name]["verdict"]}
                     for name, (c, m) in runs.items()}}


def recorder_share(folder: str) -> dict | None:
    """The recorder's cost in the recorded run whose record is in `folder` (benchmark.py --recorder's figures)."""
    from parity.commands.recorder_cost import recorded_share
    from parity.training.record import load_record

    for path in sorted(set(glob.glob(os.path.join(folder, "loss_*.json"))) - {os.path.join(folder, "loss_ddp.json")}):
        found = recorded_share(load_record(path)["steps"])
        if found:
            return found
    return None


def table(cells: dict, settings: list[str]) -> str:
    lines = ["| capability | " + " | ".join(settings) + " |", "|---|" + "---:|" * len(settings)]
    for capability, row in cells.items():
        def cell(c):
            if c is None or c["margin"] is None:
                return c and c["verdict"] or "—"
            mark = "" if c["verdict"] == "PASS" else f" {c['verdict']}"
            return f"{c['margin']:.3f}{mark} ({c['check']})"
        lines.append(f"| {capability} | " + " | ".join(cell(row.get(s)) for s in settings) + " |")
    lines += ["", "| capability | the recorder's share of a step (" + settings[0] + ") |", "|---|---:|"]
    for capability, row in cells.items():
        share = (row.get(settings[0]) or {}).get("recorder")
        lines.append(f"| {capability} | " + (f"{share['share_of_mean_step']:.1%} of {1e3 * share['mean_step_s']:.1f} ms"
                                              if share else "—") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default="cpu", choices=tuple(BY_DEVICE), help="cpu, or cuda: one rank on the GPU")
    p.add_argument("--only", default=None, help="capabilities, comma-separated (default: every one the device runs)")
    p.add_argument("--settings", default=None, help="kernel settings, comma-separated (default: the device's all)")
    p.add_argument("--jobs", type=int, default=1, help="cells at once")
    p.add_argument("--cell_timeout", type=float, default=None, help="seconds a cell may run")
    p.add_argument("--code", default=REPO, help="the checkout whose commands run (default: this one)")
    args = p.parse_args(argv)
    known = BY_DEVICE[args.device]
    runs_here = [c for c in CAPABILITIES if args.device == "cpu" or c not in CPU_ONLY]
    capabilities = args.only.split(",") if args.only else runs_here
    settings = args.settings.split(",") if args.settings else list(known)
    unknown = [c for c in capabilities if c not in runs_here] + [s for s in settings if s not in known]
    if unknown:
        print(f"error: unknown {unknown[0]} on {args.device}: capabilities {', '.join(runs_here)}; settings "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    cells = {c: {} for c in capabilities}
    lock = threading.Lock()

    def one(capability: str, setting: str) -> None:
        found = run_cell(capability, setting, out, args.code, args.device, args.cell_timeout)
        with lock:
            cells[capability][setting] = found
            print(f"{capability} {setting}: {found}", flush=True)
            with open(os.path.join(out, "matrix.md"), "w") as f:
                f.write(table(cells, settings) + "\n")
            with open(os.path.join(out, "matrix.json"), "w") as f:
                json.dump({"device": args.device, "cells": cells}, f, indent=1)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:  # every capability at a setting, then on
        for done in [pool.submit(one, c, s) for s in settings for c in capabilities]:
            done.result()
    print(table(cells, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
