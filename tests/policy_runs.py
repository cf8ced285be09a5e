"""tests/test_precision.py's runs: folders of records trained in local gloo groups, each run once (copied into the other
folders that list it) — in the test process, or, as a script, in an environment of its own: there DeepSpeed 0.18.9's
folder is first on PYTHONPATH, so that the whole job (DDP's baseline too) runs under that release and every record's
fingerprint names it.

    python tests/policy_runs.py SPEC.json   # {"root", "setting", "weights", "folders", "refused"}

"refused": {case: [strategy, argv]}: the entry script's main in this process, its exit code and stderr written to
<root>/refused.json (a release that cannot run a path must say so in one line before any worker)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys


def train_folders(root, folders: dict, setting: dict, weights: str, kernel: str = "default") -> None:
    """Train every folder's records — {folder: {record file: (strategy, flags)}} — into root/<folder>/: each distinct
    run once, one local group per world size under the CPU kernel path `kernel` (local_group.KERNEL_PATHS), copied into
    the other folders that list it. A flag "deepspeed_config" given as a dict is written to a file first. A run that stops
    every rank (a NaN loss) ends its group: list it last."""
    from parity.driver.local_group import plan, run_group
    from parity.training.tensor_series import folder_of

    root = str(root)
    key = lambda name, run: (name, json.dumps(run, sort_keys=True, default=str))  # noqa: E731
    trained, groups = {}, {}
    for folder, records in folders.items():
        for name, (strategy, flags) in records.items():
            if key(name, (strategy, flags)) in trained:
                continue
            trained[key(name, (strategy, flags))] = os.path.join(root, folder, name)
            flags = dict(flags)
            if isinstance(flags.get("deepspeed_config"), dict):
                path = os.path.join(root, f"{folder}_deepspeed_config.json")
                with open(path, "w") as f:
                    json.dump(flags["deepspeed_config"], f)
                flags["deepspeed_config"] = path
            run = plan(strategy, {**setting, **flags, "init_weights_path": weights,
                                  "loss_output_dir": os.path.join(root, folder),
                                  "storage_path": os.path.join(root, "ray", folder),
                                  "experiment_name": f"{folder}_{name}"})
            groups.setdefault(run[0].num_workers, []).append(run)
    for _, runs in sorted(groups.items()):
        try:
            run_group(runs, kernel)
        except Exception as exc:  # a run whose loss went NaN stops its group, the record of its steps written
            if "loss is nan" not in str(exc):
                raise
    for folder, records in folders.items():
        for name, run in records.items():
            source = trained[key(name, run)]
            if source != os.path.join(root, folder, name):
                shutil.copy(source, os.path.join(root, folder, name))
                if os.path.isdir(folder_of(source)):  # the record's every-tensor series beside it, copied with it
                    shutil.copytree(folder_of(source), folder_of(os.path.join(root, folder, name)))


def refused(cases: dict) -> dict:
    """{case: {"code", "stderr"}} of each train_<strategy>.py main with its argv, run in this process."""
    from parity.commands.train import main

    out = {}
    for case, (strategy, argv) in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(strategy, argv=argv)
        out[case] = {"code": code, "stderr": err.getvalue()}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    train_folders(spec["root"], spec["folders"], spec["setting"], spec["weights"])
    with open(os.path.join(spec["root"], "refused.json"), "w") as f:
        json.dump(refused(spec.get("refused", {})), f)
