#!/usr/bin/env python
"""The false-alarm campaign (issue 81; docs/false_alarms.md): every capability's clean run — as a user types it —
over seeds (weights and data), fp32 and the capability's low precision, the default kernels and a perturbed setting,
a short run and one of 100 steps where the capability trains that long; per capability the clean verdicts run, their
FAILs and refusals (the goal of both: 0) and the margin's median, 99th percentile and worst (each verdict's margin:
its largest deviation ÷ bound over every check, curve_comparison.json's bound_ratios).

    python tools/false_alarms.py --output_dir OUT --jobs 2                 # the campaign; writes OUT/false_alarms.md
    python tools/false_alarms.py --output_dir OUT --only trainer,own_loop --seeds 11 --plan slice
    python tools/false_alarms.py --output_dir OUT --device cuda --plan cuda --jobs 4   # a GPU's slice (docs/gpu.md)
    python tools/false_alarms.py --output_dir OUT --dry_run                # the cells and their commands, nothing run

Each cell is a command of tools/kernel_matrix.py's (the same makers, more flags), run in OUT/<capability>/<cell>; a
cell whose comparison is there is read, not run again, so a campaign cut short goes on where it stopped. The plan
(`--plan`): `full` — per capability each seed in fp32 and its low precision, short, default kernels; the first two
seeds also under the perturbed setting; the first seed also long (100 steps); `slice` — one cell per capability, the
low precision, short, default kernels (the suite's); `cuda` — the CUDA slice (issue 84): ON_CUDA's capabilities in
bf16 at every seed under the default cuBLAS, TF32 and the deterministic cuBLAS settings, megatron-core's Qwen2 job
also fp32 and 100 steps. Breadth first: every capability's
first cell before any one's second. `--write_docs PATH` writes the page there (the campaign's own command, its wall
time and the machine's load, measured here, at its head)."""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import hashlib
import json
import os
import statistics
import sys
import threading
import time


def _kernel_matrix():
    """tools/kernel_matrix.py, loaded by its path: the matrix's commands and cells, one maker per capability."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kernel_matrix", os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


km = _kernel_matrix()

SHORT, LONG = "short", "long"
FP32, LOW = "fp32", "low"
PERTURBED = "compatible_1thread"  # the perturbed kernel setting (tests/conftest.py's PERTURBED)
CUDA_PERTURBED = "cublas_deterministic"
LONG_STEPS = 100


def titan_flags(seed: int, low: bool, steps: int | None) -> list[str]:
    return ["--debug.seed", str(seed), *(["--training.mixed_precision_param", "bfloat16"] if low else []),
            *(["--training.steps", str(steps)] if steps else [])]


def example_flags(seed: int, low: bool, steps: int | None, low_flags=("--bf16",), fp32_flags=()) -> list[str]:
    return ["--seed", str(seed), *(low_flags if low else fp32_flags), *(["--steps", str(steps)] if steps else [])]


def megatron(*flags: str, ranks: int = 2):
    """tests/megatron_train_job.py through tests/megatron_cpu.py under torchrun (docs/megatron.md), verified."""
    def command(code: str, out: str, device: str, more=()) -> list[str]:
        launcher = [] if device == "cuda" else [os.path.join(code, "tests", "megatron_cpu.py")]
        return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"),
                "--", "torchrun", "--nproc_per_node", str(1 if device == "cuda" else ranks), "--standalone", *launcher,
                os.path.join(code, "tests", "megatron_train_job.py"), *flags,
                *(["--device", "cuda"] if device == "cuda" else []), *more]
    return command


def megatron_flags(seed: int, low: bool, steps: int | None) -> list[str]:
    return ["--seed", str(seed), *(["--bf16"] if low else []), "--steps", str(steps or 4)]


def main_flags(seed: int, low: bool, steps: int | None) -> list[str]:
    return ["--extra_args", f"--seed {seed}", "--precision", "bf16" if low else "fp32", "--debug_steps",
            str(steps or 12)]


def vllm_site() -> str:
    """requirements-vllm.txt's folder beside the pinned set, named by the file's content as tests/test_sampler.py's
    vllm_site installs it (the test installs it; here it is read)."""
    with open(os.path.join(km.REPO, "requirements-vllm.txt"), "rb") as f:
        name = f"vllm-{hashlib.sha256(f.read()).hexdigest()[:12]}"
    return os.path.join(os.environ.get("PARITY_RELEASES_DIR", os.path.expanduser("~/.cache/parity/releases")), name)


def grpo_vllm(code: str, out: str, device: str, more=()) -> list[str]:
    """TRL's GRPOTrainer sampling with vLLM colocated, through tests/trl_vllm_cpu.py on a CPU (docs/sampler.md)."""
    launcher = [] if device == "cuda" else [os.path.join(code, "tests", "trl_vllm_cpu.py")]
    return [sys.executable, os.path.join(code, "verify_trainer.py"), "--output_dir", os.path.join(out, "verify"), "--",
            sys.executable, *launcher, os.path.join(code, "examples", "trl_posttrain.py"), "--output_dir",
            os.path.join(out, "own"), "--use_vllm", "--vllm_importance_sampling_correction", "--model_name",
            "qwen3-tiny", *km.example_flags("trl_posttrain.py", device, 1), *more]


_ex = km.verify  # an example under verify_trainer.py
# name: (the command's maker, its comparison's folder, flags(seed, low, steps), whether it trains LONG_STEPS)
CAMPAIGN = {
    "main_job": (km.main_job("--strategies", "ddp deepspeed fsdp transformers"), "job/loss_curves", main_flags, True),
    "trainer": (_ex("hf_trainer.py"), "verify", example_flags, True),
    "trl_sft": (_ex("trl_sft.py"), "verify", example_flags, True),
    "grpo": (_ex("trl_posttrain.py", "--loss_type", "dapo", "--beta", "0.04"), "verify",
             lambda s, low, n: example_flags(s, low, n, (), ("--fp32",)), True),
    "grpo_vllm": (grpo_vllm, "verify", lambda s, low, n: example_flags(s, low, n, (), ("--fp32",)), False),
    "dpo": (_ex("trl_posttrain.py", "--trainer", "dpo"), "verify",
            lambda s, low, n: example_flags(s, low, n, (), ("--fp32",)), True),
    "lightning": (_ex("lightning_lm.py"), "verify", example_flags, True),
    "lightning_manual": (_ex("lightning_lm.py", "--manual"), "verify", example_flags, True),
    "accelerate": (_ex("accelerate_loop.py"), "verify", example_flags, True),
    "own_loop": (_ex("plain_loop.py"), "verify", example_flags, True),
    "titan_fsdp": (km.titan(), "verify", titan_flags, True),
    "titan_tp": (km.titan("--parallelism.tensor_parallel_degree", "2"), "verify", titan_flags, True),
    "megatron_tp": (megatron("--tp", "2", "--family", "qwen2"), "verify", megatron_flags, True),
    "megatron_pp": (megatron("--pp", "2"), "verify", megatron_flags, True),
    "megatron_dp_distopt": (megatron("--distributed_optimizer"), "verify", megatron_flags, True),
    "megatron_qwen2": (megatron("--family", "qwen2"), "verify", megatron_flags, True),  # the CUDA case's job
    "lora": (_ex("hf_trainer.py", "--lora"), "verify", example_flags, True),
    "packing": (_ex("trl_sft.py", "--packing"), "verify", example_flags, True),
    "resume": (km.resumed, "verify", example_flags, False),  # plain_loop stopped at step 3: its own steps
    # torch's AMP recipe (autocast fp16 + GradScaler), and FSDP2's mixed precision: bf16 parameters, and fp16 ones with
    # torch's ShardedGradScaler (the recorder reads their policy from fully_shard)
    "own_loop_fp16": (_ex("plain_loop.py"), "verify", lambda s, low, n: example_flags(s, low, n, ("--fp16",)), True),
    "fsdp2_bf16": (_ex("sharded_loop.py", "--shard", "fsdp2"), "verify",
                   lambda s, low, n: example_flags(s, low, n, ("--mixed_precision", "bf16")), True),
    "fsdp2_fp16": (_ex("sharded_loop.py", "--shard", "fsdp2"), "verify",
                   lambda s, low, n: example_flags(s, low, n, ("--mixed_precision", "fp16")), True),
    # peft's LoRA over a model loaded in bf16 (fp32 adapters over the bf16 base): the "fp32" cells bf16_base, the low
    # ones Trainer's bf16=True over it, bf16_base_autocast
    "lora_bf16_base": (_ex("hf_trainer.py", "--lora", "--model_dtype", "bf16"), "verify", example_flags, True),
}
# the CUDA slice's (issue 84): megatron-core's Qwen2 bf16 job once called FAIL on CUDA, its Llama bf16 job with the
# distributed optimizer, Trainer, TRL's GRPO and DPO, the own loop, LoRA, TRL's SFT
ON_CUDA = ("megatron_qwen2", "megatron_dp_distopt", "trainer", "grpo", "dpo", "own_loop", "lora", "trl_sft",
           "lora_bf16_base")
CUDA_ORDER = ("default", "tf32", CUDA_PERTURBED)  # TF32 moved every fp32 record on the H100, the deterministic one none
VARIABLES = {"grpo_vllm": {FP32: {"PARITY_VLLM_DTYPE": "float32"}, LOW: {}}}


def cells(plan: str, capabilities: list[str], seeds: list[int], device: str) -> list[dict]:
    """The plan's cells, breadth first: {capability, seed, precision, setting, steps}."""
    default = "default"
    perturbed = CUDA_PERTURBED if device == "cuda" else PERTURBED
    rows: list[list[dict]] = []
    for name in capabilities:
        mine = []
        if plan == "slice":
            mine.append(dict(seed=seeds[0], precision=LOW, setting=default, steps=SHORT))
        elif plan == "cuda":  # the first seed under every setting, then the other seeds setting by setting
            first = [dict(seed=seeds[0], precision=LOW, setting=s, steps=SHORT) for s in CUDA_ORDER]
            rest = [dict(seed=seed, precision=LOW, setting=s, steps=SHORT) for s in CUDA_ORDER for seed in seeds[1:]]
            if name == "megatron_qwen2":  # its 100 steps, and fp32
                first[1:1] = [dict(seed=seeds[0], precision=LOW, setting=default, steps=LONG),
                              dict(seed=seeds[0], precision=FP32, setting=default, steps=SHORT)]
                rest[:0] = [dict(seed=seeds[0], precision=FP32, setting=s, steps=SHORT) for s in CUDA_ORDER[1:]]
            mine += first + rest
        else:
            for seed in seeds:
                mine += [dict(seed=seed, precision=p, setting=default, steps=SHORT) for p in (FP32, LOW)]
            for seed in seeds[:2]:
                mine += [dict(seed=seed, precision=p, setting=perturbed, steps=SHORT) for p in (FP32, LOW)]
            if CAMPAIGN[name][3]:
                mine += [dict(seed=seeds[0], precision=p, setting=default, steps=LONG) for p in (FP32, LOW)]
        rows.append([{"capability": name, **c} for c in mine])
    return [row[i] for i in range(max(map(len, rows), default=0)) for row in rows if i < len(row)]


def cell_name(c: dict) -> str:
    return f"s{c['seed']}_{c['precision']}_{c['setting']}_{c['steps']}"


def command_of(c: dict, device: str):
    """The cell's command maker: the capability's, its flags for the cell appended; and its variables."""
    make, _, flags, _ = CAMPAIGN[c["capability"]]
    megatron_12 = c["capability"] == "megatron_qwen2" or (device == "cuda" and c["capability"].startswith("megatron"))
    steps = LONG_STEPS if c["steps"] == LONG else (12 if megatron_12 else None)  # the CUDA FAIL's 12 steps
    more = flags(c["seed"], c["precision"] == LOW, steps)
    variables = VARIABLES.get(c["capability"], {}).get(c["precision"], {})
    return (lambda code, out, dev: make(code, out, dev, more)), variables


def run(c: dict, out: str, code: str, device: str, timeout: float | None) -> dict:
    make, variables = command_of(c, device)
    env = dict(variables)
    if c["capability"] == "grpo_vllm":
        env["PYTHONPATH"] = os.pathsep.join([vllm_site(), km.environment(code, c["setting"], device)["PYTHONPATH"]])
    found = km.run_cell(c["capability"], c["setting"], out, code, device, timeout, make,
                        os.path.join(out, c["capability"], cell_name(c)), env, CAMPAIGN[c["capability"]][1])
    found["refused"] = found["verdict"] == "no comparison" or found.get("exit") == 2
    return {**c, **found}


def ran(c: dict, out: str, code: str, device: str) -> dict | None:
    """A cell run before, read from its folder (None if it never ran): what run() returns, nothing run again."""
    cell = os.path.join(out, c["capability"], cell_name(c))
    if not os.path.exists(os.path.join(cell, "seconds.json")):
        return None
    if os.path.exists(os.path.join(cell, CAMPAIGN[c["capability"]][1], "curve_comparison.json")):
        return run(c, out, code, device, None)  # its comparison is there: read, not run
    with open(os.path.join(cell, "seconds.json")) as f:
        seconds = json.load(f)["seconds"]
    return {**c, "verdict": "no comparison", "exit": None, "seconds": seconds, "margin": None, "check": None,
            "refused": True}


def summary(results: list[dict], capabilities: list[str]) -> list[dict]:
    """Per capability: cells, verdicts (a cell's runs judged), FAILs, refusals, the margins' median, 99th percentile
    and worst (with where), the seconds its cells ran."""
    rows = []
    for name in capabilities:
        mine = [r for r in results if r["capability"] == name]
        verdicts = [(r, run, v) for r in mine for run, v in (r.get("runs") or {}).items()]
        margins = sorted(v["margin"] for _, _, v in verdicts)
        worst = max(verdicts, key=lambda x: x[2]["margin"], default=None)
        rows.append({"capability": name, "cells": len(mine), "verdicts": len(verdicts),
                     "fails": sum(v["verdict"] != "PASS" for _, _, v in verdicts),
                     "refusals": sum(r["refused"] for r in mine),
                     "median": statistics.median(margins) if margins else None,
                     "p99": margins[min(len(margins) - 1, round(0.99 * (len(margins) - 1)))] if margins else None,
                     "worst": worst and worst[2]["margin"],
                     "worst_at": worst and f"{cell_name(worst[0])} {worst[1]}: {worst[2]['check']}",
                     "seconds": sum(r.get("seconds") or 0.0 for r in mine)})
    return rows


def page(rows: list[dict], results: list[dict], command: str, wall: float | None, load: str, device: str,
         note: str = "") -> str:
    """The campaign's page; `wall` None where the cells ran in parts (--page_only): their seconds summed instead."""
    total = sum(r["verdicts"] for r in rows)
    took = f"wall time {wall / 60:.1f} min" if wall is not None else \
        f"the cells' seconds summed {sum(r.get('seconds') or 0.0 for r in results) / 60:.1f} min"
    lines = [f"Reproduce: `{command}` ({device}){note}; {took}; {load}.", "",
             f"**{total} clean verdicts, {sum(r['fails'] for r in rows)} FAIL, {sum(r['refusals'] for r in rows)} "
             f"refused.**", "",
             "| capability | cells | verdicts | FAILs | refusals | margin median | 99th percentile | worst (where: cell, run, "
             "check) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['capability']} | {r['cells']} | {r['verdicts']} | {r['fails']} | {r['refusals']} | "
                     f"{fmt(r['median'])} | {fmt(r['p99'])} | {fmt(r['worst'])} ({r['worst_at'] or '—'}) |")
    odd = [r for r in results if r["refused"] or any(v["verdict"] != "PASS" for v in (r.get("runs") or {}).values())]
    if odd:
        lines += ["", "Cells not PASSed (their folder's output.log says why):", ""]
        lines += [f"- {r['capability']} {cell_name(r)}: {r['verdict']}, exit {r['exit']}" for r in odd]
    return "\n".join(lines) + "\n"


def machine_load() -> str:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return f"the machine's load average at the end {one} / {five} / {fifteen} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--plan", default="full", choices=("full", "slice", "cuda"))
    p.add_argument("--only", default=None, help="capabilities, comma-separated (default: every one the plan runs)")
    p.add_argument("--seeds", default="1-5", help="seeds: a range (1-5) or a list (1,7)")
    p.add_argument("--cells", default=None, help="only the plan's cells whose name matches (fnmatch: '*_long')")
    p.add_argument("--jobs", type=int, default=1, help="cells at once")
    p.add_argument("--cell_timeout", type=float, default=None, help="seconds a cell may run")
    p.add_argument("--code", default=km.REPO, help="the checkout whose commands run (default: this one)")
    p.add_argument("--write_docs", default=None, help="also write the page here (docs/false_alarms.md)")
    p.add_argument("--dry_run", action="store_true", help="print the cells' commands; run nothing")
    p.add_argument("--page_only", action="store_true",
                   help="write the page from the plan's cells run in OUTPUT_DIR so far, run nothing (a campaign cut "
                        "short, or run in parts with --cells)")
    args = p.parse_args(argv)
    capabilities = args.only.split(",") if args.only else list(ON_CUDA if args.device == "cuda" else CAMPAIGN)
    unknown = [c for c in capabilities if c not in CAMPAIGN]
    if unknown or (args.plan == "cuda") != (args.device == "cuda"):
        print(f"error: {'unknown capability ' + unknown[0] if unknown else '--plan cuda goes with --device cuda'}"
              f" (capabilities: {', '.join(CAMPAIGN)})", file=sys.stderr)
        return 2
    first, _, last = args.seeds.partition("-")
    seeds = list(range(int(first), int(last) + 1)) if last else [int(s) for s in args.seeds.split(",")]
    todo = [c for c in cells(args.plan, capabilities, seeds, args.device)
            if args.cells is None or fnmatch.fnmatch(cell_name(c), args.cells)]
    out = os.path.abspath(args.output_dir)
    if args.dry_run:
        for c in todo:
            make, variables = command_of(c, args.device)
            print(f"{c['capability']} {cell_name(c)} [{c['setting']}{' ' + str(variables) if variables else ''}]: "
                  + " ".join(make(args.code, os.path.join(out, c["capability"], cell_name(c)), args.device)))
        print(f"{len(todo)} cells")
        return 0
    if args.page_only:
        results = [r for r in (ran(c, out, args.code, args.device) for c in todo) if r]
        text = page(summary(results, capabilities), results, "python tools/false_alarms.py --output_dir OUT", None,
                    machine_load(), args.device, f"; {len(results)} of its {len(todo)} cells run so far")
        return write_page(text, out, args.write_docs)
    os.makedirs(out, exist_ok=True)
    results, lock, t0 = [], threading.Lock(), time.time()
    command = "python tools/false_alarms.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def one(c: dict) -> None:
        found = run(c, out, args.code, args.device, args.cell_timeout)
        with lock:
            results.append(found)
            print(f"{c['capability']} {cell_name(c)}: {found['verdict']} margin {found['margin']} "
                  f"({found['check']}) {found['seconds'] and round(found['seconds'])} s", flush=True)
            km.write_json_atomic(os.path.join(out, "campaign.json"),
                                 {"device": args.device, "command": command, "cells": results})

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for done in [pool.submit(one, c) for c in todo]:
            done.result()
    text = page(summary(results, capabilities), results, command, time.time() - t0, machine_load(), args.device)
    return write_page(text, out, args.write_docs)


def write_page(text: str, out: str, docs: str | None) -> int:
    for path in filter(None, [os.path.join(out, "false_alarms.md"), docs]):
        with open(path, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
