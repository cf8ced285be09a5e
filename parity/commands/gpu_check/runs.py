"""What the GPU check's steps share (gpu_check/check.py, gpu_check/posttrain.py): the runs' flags and initial weights,
training planned runs in local groups (a failed group's unfinished runs again one by one), the one-GPU testing switch
around a block, and the harness's comparison of a folder of records."""

from __future__ import annotations

import contextlib
import json
import os

from parity.commands.common import error_line

TP_STRATEGY = "fsdp"  # FSDP2 + DTensor TP: the TP strategy that runs without DeepSpeed


def run_values(folder: str, name: str, device: str, values: dict, weights: str) -> dict:
    """One run's flags: `values` on `device`, recorded into `folder` as `name` from `weights`, no checkpoints."""
    steps = values["debug_steps"]
    return {**values, "device": device, "loss_output_dir": folder, "storage_path": os.path.join(folder, "runs"),
            "init_weights_path": weights, "experiment_name": name, "log_interval": steps, "checkpoint_interval": 0}


def write_weights(values: dict, seed: int, path: str) -> str:
    """The shared initial weights, written here (not by DDP's run): each run of a step then stands alone. With LoRA's
    flags among `values`, the adapters' initial weights beside them (what --save_init_weights writes)."""
    from parity.models.adapters import lora_settings, write_initial_adapters
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        config = resolve_model_config(values["model_name"], values["num_layers"])
        save_init_weights(build_model(config, seed), path)
        if values.get("lora_r"):
            write_initial_adapters(path, config, lora_settings(values["lora_r"], None, 0.0, values["lora_targets"],
                                                               config), seed)
    return path


def train(runs: list[tuple]) -> dict[str, str]:
    """Train planned runs ((cfg, batches), each run afresh) in local groups, one per world size, DDP's DP=2 first; the
    runs a failed group did not finish train again one by one, so that a failure costs only its own run. Returns the
    error line of each run that failed, by experiment name."""
    from parity.driver.local_group import run_group
    from parity.training.record import load_record, run_record_path

    def complete(cfg) -> bool:
        return os.path.exists(run_record_path(cfg)) and load_record(run_record_path(cfg)).get("complete", False)

    by_world: dict[int, list] = {}
    for cfg, batches in runs:
        if os.path.exists(run_record_path(cfg)):
            os.remove(run_record_path(cfg))  # a record of an earlier check in this folder
        by_world.setdefault(cfg.num_workers, []).append((cfg, batches))
    failed = {}
    for world in sorted(by_world, key=lambda w: (w != 2, w)):
        try:
            run_group(by_world[world])
        except Exception:
            for cfg, batches in by_world[world]:
                if complete(cfg):
                    continue
                try:
                    run_group([(cfg, batches)])
                except Exception as exc:
                    failed[cfg.experiment_name] = error_line(exc)
    return failed


def judge_folder(target: str, where: dict) -> tuple[dict, str | None]:
    """The harness's comparison of the records in `target` (plot_loss_curves.py's; its block goes to the log): the
    entry (`where`, its exit code, verdict, max relative differences and deviation ÷ noise of the TP strategy's run) and
    the failure's line, or None."""
    from parity.commands.compare_curves import compare_and_report

    entry = {**where, "folder": target}
    named = f"{where['precision']} seed {where['seed']} {where['layout']}"
    try:
        code = compare_and_report(target, os.path.join(target, "loss_curves.png"))
        with open(os.path.join(target, "curve_comparison.json")) as f:
            c = json.load(f)
        against = c["against_baseline"][TP_STRATEGY]
        entry.update(exit_code=code, verdict=c["verdict"], calibrated=against["calibrated"],
                     max_rel_diff=against["max_rel_diff"], noise_ratio=against["noise_ratio"],
                     noise_references=c["noise_references"])
        return entry, None if code == 0 else f"{named}: {c['verdict']} (exit {code})"
    except (Exception, SystemExit) as exc:
        entry.update(exit_code=2, error=error_line(exc))
        return entry, f"{named}: {error_line(exc)}"


@contextlib.contextmanager
def shared_gpu(device: str, variable: str):
    """The testing switch on for the block on a GPU (every rank of a group on cuda:0, over gloo)."""
    before = os.environ.get(variable)
    if device == "cuda":
        os.environ[variable] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
