"""gpu_check's posttrain step (docs/posttrain.md): a GRPO-family update (dapo, β 0.1, truncated completions masked)
trained from a rollout file make_rollouts.py writes, under DDP DP=2 and FSDP2 + TP at TP=2 × DP=2, in fp32 (the
harness's verdict) and in bf16 against DDP's noise references (the calibrated verdict) — the runs of
tests/test_posttrain.py, on the device's kernels. On a GPU every rank sits on cuda:0 over gloo (the testing switch)."""

from __future__ import annotations

import os

from parity.commands.gpu_check.runs import judge_folder, run_values, shared_gpu, train, write_weights

DAPO = {"objective": "dapo", "objective_args": ["beta=0.1", "mask_truncated_completions=true"]}
RUN = {"model_name": "qwen2-tiny", "learning_rate": 1e-4, "log_interval": 5, "replica_check_interval": 2}
DP2 = {"num_workers": 2, "dp_size": 2, "batch_size": 4, "grad_accum_steps": 2}
TP2_DP2 = {"num_workers": 4, "tp_size": 2, "dp_size": 2, "batch_size": 4, "grad_accum_steps": 2}
# name → (strategy, the comparison's folder, flags): what each verdict judges
RUNS = {
    "ddp": ("ddp", "fp32", {**DP2, "precision": "fp32"}),
    "fsdp": ("fsdp", "fp32", {**TP2_DP2, "precision": "fp32"}),
    "ddp_bf16": ("ddp", "bf16", {**DP2, "precision": "bf16"}),
    "ddp_bf16_reference": ("ddp", "bf16", {**DP2, "precision": "bf16", "grad_accum_steps": 1,
                                           "noise_reference": True}),
    "ddp_bf16_reference_dp4": ("ddp", "bf16", {"num_workers": 4, "dp_size": 4, "batch_size": 2, "grad_accum_steps": 2,
                                               "precision": "bf16", "noise_reference": True}),
    "fsdp_bf16": ("fsdp", "bf16", {**TP2_DP2, "precision": "bf16", "mixed_precision": "autocast"}),
}
# 3 steps of 4 prompts × 2 completions, one generation over the 3; completions stop at 1 id in 16 (lengths vary)
ROLLOUTS = ["--family", "grpo", "--steps", "3", "--prompts_per_step", "4", "--num_generations", "2",
            "--steps_per_generation", "3", "--reference_seed", "7", "--stop_token_ids", "0:2048:16"]


def step_posttrain(folder: str, device: str, sizes: dict) -> dict:
    """The rollout file, every run of RUNS trained, each precision's folder judged: {"comparisons": [...], "failures"}."""
    from parity.commands.make_rollouts import main as make_rollouts
    from parity.driver.local_group import SHARE_ONE_GPU, plan

    weights = write_weights({"model_name": "qwen2-tiny", "num_layers": None}, 42, os.path.join(folder, "init.pt"))
    rollouts = os.path.join(folder, "grpo.safetensors")
    if make_rollouts([*ROLLOUTS, "--init_weights_path", weights, "--output", rollouts]) != 0:
        return {"failures": ["make_rollouts.py failed (see the log)"]}
    with shared_gpu(device, SHARE_ONE_GPU):  # planned under it too: without it a run's workers need a GPU each
        planned = [plan(strategy, run_values(os.path.join(folder, where), name, device,
                                          {**RUN, **DAPO, **flags, "rollouts": rollouts, "debug_steps": 2}, weights))
                   for name, (strategy, where, flags) in RUNS.items()]
        failed = train(planned)
    failures = [f"{name}: {line}" for name, line in failed.items()]
    results = []
    for precision in ("fp32", "bf16"):
        entry, failure = judge_folder(os.path.join(folder, precision),
                                      {"precision": precision, "seed": 42, "layout": "tp2dp2"})
        results.append(entry)
        failures += [failure] if failure else []
    return {"config": {**RUN, **DAPO, "rollouts": ROLLOUTS}, "comparisons": results, "failures": failures}
