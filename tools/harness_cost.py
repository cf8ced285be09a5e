#!/usr/bin/env python
"""The harness's own cost (issue 66, docs/tolerances.md#what-calibrating-by-default-costs): the main job's wall, minus
its training (each run's setup and steps, from its main_job_times.json), minus a bare Ray Train fit of the same
environment — the interpreter, its imports, Ray started as the job starts it (parity.driver.cluster.ensure_ray), a
TorchTrainer of as many workers with the same CPUs each whose function forms the group and returns, Ray's shutdown.
What is left is what the harness adds: its driver's checks, its workers' imports beyond torch and Ray Train, the
references' hand-over, the comparison.

    python tools/harness_cost.py --output_dir OUT                    # the fp32 main job, calibrated, twice
    python tools/harness_cost.py --output_dir OUT --repeats 3 -- --uncalibrated

Each repeat runs the bare fit and the job one after the other (compare figures of one run of this tool, on a quiet
machine: a loaded one moves both). Minutes per repeat on 2 cores; no test runs it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BARE_FIT = """
import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

from parity.driver.cluster import ensure_ray


def formed():
    import torch.distributed as dist

    dist.barrier()


ensure_ray()
TorchTrainer(formed, scaling_config=ScalingConfig(num_workers={workers}, resources_per_worker={{"CPU": {cpus}}})).fit()
ray.shutdown()
"""


def timed(command: list[str], log: str) -> float:
    """The wall seconds of `command` (its output to `log`); exits naming the log when it fails."""
    began = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{' '.join(command[:4])} … exited {code}: see {log}")
    return time.perf_counter() - began


def job_figures(output_dir: str) -> tuple[float, int, float]:
    """(training seconds, workers, CPUs per worker) of the job whose outputs are in `output_dir`."""
    loss_dir = os.path.join(output_dir, "loss_curves")
    with open(os.path.join(loss_dir, "main_job_times.json")) as f:
        table = json.load(f)
    runs = [r for row in table["rows"] for r in row.get("runs", [])]
    configs = []
    for name in os.listdir(loss_dir):
        if name.endswith(".json") and name.startswith(("loss_", "noise_reference_")):
            with open(os.path.join(loss_dir, name)) as f:
                configs.append(json.load(f)["config"])
    group = max(configs, key=lambda c: c["num_workers"])  # the group's workers and resources: its largest run's
    return sum(r["setup_s"] + r["steps_s"] for r in runs), group["num_workers"], group["cpus_per_worker"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", required=True, help="the job's and the bare fit's logs and outputs")
    p.add_argument("--repeats", type=int, default=2, help="bare fit + job pairs, one after the other")
    p.add_argument("job_flags", nargs="*", help="after --: the main job's flags (its --output_dir is this tool's)")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        out = os.path.join(args.output_dir, f"job{repeat}")
        wall = timed([sys.executable, "-m", "parity.commands.main_job", "--output_dir", out, *args.job_flags],
                     os.path.join(args.output_dir, f"job{repeat}.log"))
        training, workers, cpus = job_figures(out)
        bare = timed([sys.executable, "-c", BARE_FIT.format(workers=workers, cpus=cpus)],
                     os.path.join(args.output_dir, f"bare{repeat}.log"))
        rows.append((wall, training, bare, wall - training - bare))
        print(f"repeat {repeat}: wall {wall:.1f} s, training {training:.1f} s, bare {workers}-worker fit {bare:.1f} s "
              f"-> the harness's own {rows[-1][3]:.1f} s", flush=True)
    own = [r[3] for r in rows]
    print(f"the harness's own cost: median {statistics.median(own):.1f} s over {len(own)} "
          f"(min {min(own):.1f}, max {max(own):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
