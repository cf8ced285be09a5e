#!/usr/bin/env python
"""The clean matrix (docs/tolerances.md#the-clean-matrix): every capability's clean run, as a user types it, under
several CPU kernel settings, and its margin — the largest deviation ÷ bound over every check of every run
(curve_comparison.json's bound_ratios) — in one table. A correct run must PASS under each with margin ≤ 0.5.

    python tools/kernel_matrix.py --output_dir OUT                       # every capability × every setting
    python tools/kernel_matrix.py --output_dir OUT --only trainer,dpo --settings default,avx2

The settings (parity/calibration/kernel_settings.py) move the kernels a CPU kind or a GPU would. Each cell runs in its own folder OUT/<capability>/<setting>;
OUT/matrix.md and OUT/matrix.json hold the table; a cell already done (its comparison there) is read, not run again.
`--code DIR` runs another checkout's commands (its verify_trainer.py, examples and main job, DIR first on PYTHONPATH):
the same matrix before a change; where its comparisons hold no bound_ratios, its records are judged again here. Runs for minutes per cell on 2 cores; no test runs it whole (tests/test_kernel_matrix.py runs one cell)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from parity.calibration.kernel_settings import SETTINGS, environment as with_setting  # (the project is installed)
from parity.comparing.margins import worst

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verify(example: str, *flags: str):
    """A capability run through verify_trainer.py: `python examples/<example> --output_dir OWN --nproc 2 FLAGS`."""
    def command(code: str, out: str) -> list[str]:
        script = os.path.join(code, "examples", example)
        return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"),
                "--", sys.executable, script, "--output_dir", os.path.join(out, "own"), "--nproc", "2", *flags]
    return command


def resumed(code: str, out: str) -> list[str]:
    """examples/plain_loop.py stopped after step 3's checkpoint and resumed from it, both in one command verified."""
    own, script = os.path.join(out, "own"), os.path.join(code, "examples", "plain_loop.py")
    both = (f"{sys.executable} {script} --output_dir {own} --nproc 2 --save_at 3 && "
            f"{sys.executable} {script} --output_dir {own} --nproc 2 --resume_from {own}/checkpoint-3")
    return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"), "--",
            "bash", "-c", both]


def main_job(*flags: str):
    def command(code: str, out: str) -> list[str]:
        return [sys.executable, "-m", "parity.commands.main_job", "--output_dir", os.path.join(out, "job"), *flags]
    return command


def titan(*overrides: str):
    """torchtitan's llama3 debug job through torchrun on CPU (tests/titan_site's changes on PYTHONPATH)."""
    def command(code: str, out: str) -> list[str]:
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
                "--validator.no-enable", "--checkpoint.no-enable", *overrides]
    return command


CAPABILITIES = {  # name: (the command's maker, the folder its comparison lands in)
    "main_fp32": (main_job(), "job/loss_curves"),
    "main_bf16": (main_job("--precision", "bf16"), "job/loss_curves"),
    "trainer": (verify("hf_trainer.py"), "verify"),
    "trl_sft": (verify("trl_sft.py"), "verify"),
    "grpo": (verify("trl_posttrain.py", "--loss_type", "dapo", "--beta", "0.04"), "verify"),
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


def environment(code: str, setting: str) -> dict[str, str]:
    """This process's environment under `setting`, `code` and torchtitan's CPU changes (tests/titan_site) first on
    PYTHONPATH."""
    path = [code, os.path.join(REPO, "tests", "titan_site"), *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))]
    return {**with_setting(setting, dict(os.environ)), "PYTHONPATH": os.pathsep.join(path)}


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


def run_cell(capability: str, setting: str, out: str, code: str) -> dict:
    """One cell: its command run (unless its comparison is there), its verdict, exit code, margin, seconds."""
    make, folder = CAPABILITIES[capability]
    cell = os.path.join(out, capability, setting)
    report = os.path.join(cell, folder, "curve_comparison.json")
    seconds, code_ = None, None
    if not os.path.exists(report):
        os.makedirs(cell, exist_ok=True)
        t0 = time.perf_counter()
        with open(os.path.join(cell, "output.log"), "w") as log:
            code_ = subprocess.run(make(code, cell), env=environment(code, setting), cwd=code, stdout=log,
                                   stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - t0
    if not os.path.exists(report):
        return {"verdict": "no comparison", "exit": code_, "seconds": seconds, "margin": None, "check": None}
    comparison = json.load(open(report))
    worst = max(margins(os.path.dirname(report), comparison).values(), key=lambda cv: cv[1], default=("none", 0.0))
    return {"verdict": comparison["verdict"], "exit": code_, "seconds": seconds, "margin": worst[1], "check": worst[0]}


def table(cells: dict, settings: list[str]) -> str:
    lines = ["| capability | " + " | ".join(settings) + " |", "|---|" + "---:|" * len(settings)]
    for capability, row in cells.items():
        def cell(c):
            if c is None or c["margin"] is None:
                return c and c["verdict"] or "—"
            mark = "" if c["verdict"] == "PASS" else f" {c['verdict']}"
            return f"{c['margin']:.3f}{mark} ({c['check']})"
        lines.append(f"| {capability} | " + " | ".join(cell(row.get(s)) for s in settings) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--only", default=",".join(CAPABILITIES), help="capabilities, comma-separated")
    p.add_argument("--settings", default=",".join(SETTINGS), help="kernel settings, comma-separated")
    p.add_argument("--code", default=REPO, help="the checkout whose commands run (default: this one)")
    args = p.parse_args(argv)
    capabilities, settings = args.only.split(","), args.settings.split(",")
    unknown = [c for c in capabilities if c not in CAPABILITIES] + [s for s in settings if s not in SETTINGS]
    if unknown:
        print(f"error: unknown {unknown[0]}: capabilities {', '.join(CAPABILITIES)}; settings {', '.join(SETTINGS)}",
              file=sys.stderr)
        return 2
    out = os.path.abspath(args.output_dir)
    cells = {}
    for capability in capabilities:
        for setting in settings:
            cells.setdefault(capability, {})[setting] = found = run_cell(capability, setting, out, args.code)
            print(f"{capability} {setting}: {found}", flush=True)
            text = table(cells, settings)
            with open(os.path.join(out, "matrix.md"), "w") as f:
                f.write(text + "\n")
            with open(os.path.join(out, "matrix.json"), "w") as f:
                json.dump(cells, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
