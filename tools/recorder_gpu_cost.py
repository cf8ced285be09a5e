#!/usr/bin/env python
"""The recorder's share of a step on a GPU, before and after a change, in one call (issue 84, item 4; docs/gpu.md):
each example recording itself at one rank on CUDA as users run it, under each tree named (`--code`: a checkout whose
parity/ and examples/ are used, e.g. the commit before the change, unpacked beside this one), one after the other so
that no two share the GPU; the share is the recorder's own timing in the record (benchmark.py --recorder's figure:
parity/commands/recorder_cost.py). `--profile` adds torch.profiler over plain_loop.py under each tree: per recorder
call, its CPU time, the CUDA kernels it launched, its host syncs and copies, and its costliest ops.

    python tools/recorder_gpu_cost.py --output_dir OUT --code before=.gpu_before --code after=. --profile
    python tools/recorder_gpu_cost.py --output_dir OUT --code now=. --size "0.5b=--model_name Qwen/Qwen2.5-0.5B --bf16"

`--size NAME=FLAGS` (repeatable) runs each example again with FLAGS added (a built-in model, its layers, sequence,
batch): the recorder's cost is a few milliseconds of host time a step, growing with the model's depth (the walks
of its modules) and barely with its width, so its share depends on the step's size.

Writes OUT/recorder_gpu.json and prints a table; --device cpu runs the same code on CPU (the dry run)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

EXAMPLES = {  # example: its flags on CUDA, at one rank, as tools/kernel_matrix.py's cells run it
    "plain_loop.py": ["--device", "cuda"], "hf_trainer.py": ["--device", "cuda"],
    "accelerate_loop.py": [], "lightning_lm.py": ["--accelerator", "gpu"]}
RECORDER_CALLS = ("micro_batch", "before_step", "_before_optimizer_step", "after_step")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def environment(code: str) -> dict:
    path = [os.path.abspath(code), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}


def share(code: str, example: str, out: str, steps: int, device: str, more: list[str] = ()) -> dict:
    """One example recording itself under `code`: the recorder's figures over its steps after the first."""
    from parity.commands.recorder_cost import recorded_share
    from parity.training.record import load_record

    flags = EXAMPLES[example] if device == "cuda" else []
    command = [sys.executable, os.path.join(code, "examples", example), "--output_dir", out, "--nproc", "1",
               "--steps", str(steps), *flags, *more]
    t0 = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=environment(code))
    records = sorted(f for f in os.listdir(out) if f.startswith("loss_") and f.endswith(".json")) \
        if os.path.isdir(out) else []
    if done.returncode or not records:
        lines = [x for x in done.stderr.splitlines() if x.strip()]
        return {"error": f"exit {done.returncode}: {lines[-1] if lines else 'no record'}"}
    found = recorded_share(load_record(os.path.join(out, records[0]))["steps"])
    return {**(found or {"error": "no timed step"}), "wall_s": round(time.time() - t0, 1)}


def profiled(out: str, steps: int, device: str) -> dict:
    """In this process (the tree on PYTHONPATH): plain_loop.py at one rank under torch.profiler, the recorder's four
    calls each a range; per call and step its CPU ms, kernels launched, host syncs, copies and costliest ops."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from parity.recording.recorder import ParityRecorder

    for name in RECORDER_CALLS:
        def wrapped(self, *a, _f=getattr(ParityRecorder, name), _n=name, **k):
            with record_function("recorder::" + _n):
                return _f(self, *a, **k)
        setattr(ParityRecorder, name, wrapped)
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plain_loop", os.path.join(os.environ["PARITY_CODE"], "examples", "plain_loop.py"))
    plain_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain_loop)

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    args = plain_loop.parse_args(["--output_dir", out, "--steps", str(steps),
                                  *(["--device", "cuda"] if device == "cuda" else [])])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        plain_loop.launch(args)
    events = list(prof.events())
    ranges = [e for e in events if e.name.startswith("recorder::") and str(e.device_type).endswith("CPU")]  # not
    # the same range's GPU annotation
    inner = collections.defaultdict(list)
    for r in ranges:  # the events on its thread inside each range
        s, t = r.time_range.start, r.time_range.end
        inner[r.name] += [e for e in events if e.thread == r.thread and e is not r
                          and s <= e.time_range.start and e.time_range.end <= t]
    table = {}
    for name in sorted({r.name for r in ranges}):
        calls = [r for r in ranges if r.name == name]
        per = max(1, steps)
        ops = collections.Counter()
        for e in inner[name]:
            if e.name.startswith("aten::"):
                ops[e.name] += e.self_cpu_time_total
        table[name] = {
            "calls_per_step": len(calls) / per,
            "cpu_ms_per_step": sum(r.cpu_time_total for r in calls) / 1e3 / per,
            "kernel_launches_per_step": sum(e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC") for e in inner[name])
            / per,
            "syncs_per_step": sum(e.name in SYNCS for e in inner[name]) / per,
            "copies_per_step": sum(e.name.startswith("cudaMemcpy") for e in inner[name]) / per,
            "aten_ops_per_step": sum(e.name.startswith("aten::") for e in inner[name]) / per,
            "top_ops_ms_per_step": {k: round(v / 1e3 / per, 3) for k, v in ops.most_common(6)}}
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--code", action="append", required=True, help="NAME=PATH: a tree whose parity/ and examples/ run")
    p.add_argument("--examples", default=",".join(EXAMPLES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--size", action="append", default=[], help="NAME=FLAGS: each example again with FLAGS added")
    p.add_argument("--_profile_into", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._profile_into:
        found = profiled(os.path.join(args.output_dir, "profiled"), args.steps, args.device)
        with open(args._profile_into, "w") as f:
            json.dump(found, f)
        return 0
    trees = dict(c.split("=", 1) for c in args.code)
    result = {"device": args.device, "steps": args.steps, "shares": {}, "profiles": {}}
    sizes = {"": [], **{n: f.split() for n, f in (x.split("=", 1) for x in args.size)}}
    for (size, more), example in ((s, e) for s in sizes.items() for e in args.examples.split(",")):
        for tree, code in trees.items():  # the trees side by side per example: the same machine state
            label = example + (f" {size}" if size else "")
            row = share(code, example, os.path.join(args.output_dir, tree, example[:-3] + (f"_{size}" if size else "")),
                        args.steps, args.device, more)
            result["shares"].setdefault(label, {})[tree] = row
            print(f"[recorder] {label} {tree}: " + (row["error"] if "error" in row else
                  f"{row['share_of_mean_step']:.1%} of a {1e3 * row['mean_step_s']:.1f} ms step "
                  f"({1e3 * row['mean_recorder_s']:.2f} ms)"), flush=True)
    for tree, code in trees.items() if args.profile else ():
        into = os.path.join(args.output_dir, f"profile_{tree}.json")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--output_dir",
                               os.path.join(args.output_dir, tree), "--code", f"{tree}={code}", "--steps",
                               str(args.steps), "--device", args.device, "--_profile_into", into],
                              capture_output=True, text=True, env={**environment(code), "PARITY_CODE": code})
        if done.returncode:
            result["profiles"][tree] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            with open(into) as f:
                result["profiles"][tree] = json.load(f)
        print(f"[profile] {tree}: " + json.dumps(result["profiles"][tree]), flush=True)
    with open(os.path.join(args.output_dir, "recorder_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
