"""Precision policies as users configure them (parity/precision.py, docs/precision.md): each strategy against
DDP in its own policy — bf16_params (DeepSpeed's bf16 mode at ZeRO 0, 1, 2, asked for by a DeepSpeed config alone;
FSDP2's MixedPrecisionPolicy + TP), fp16 with the harness's loss scaler (DDP, FSDP2), micro-batches accumulated in fp32
(DeepSpeed's BF16 optimizer) — calibrated on DDP's references in the policy; a clean FAIL of DeepSpeed's own ZeRO-0
and its cause; the seeded bugs of the policies' machinery, each FAILing at its step; a comparison across policies
reported as a policy difference; DeepSpeed's fp16 refused on this CPU; the DeepSpeed 0.18 release users run.

A seed no study tuned on (73), qwen2-tiny, 12 steps of 64 tokens at lr 1e-3 with 2 warm-up steps, every step clipped
at 0.8, global batch 4; the runs are the shared loop in local gloo groups, one per world size.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import CPU_HAS_FP16, REPO, assert_replicas_held, installed_beside, seeded_weights, tensor_norms_off
from parity.calibration.bugs import (DDPGradientsNotZeroed, DDPLastMicroBatchUnreduced, DDPLossScaleKeptForClipping,
                                     DDPOverflowApplied, DDPScaleUpdatedBeforeUnscaling)
from parity.commands.compare_curves import main as plot_loss_curves
from parity.comparing import teacher_forced
from parity.comparing.tolerances import NOISE_K
from parity.errors import ConfigError
from parity.driver.local_group import plan, same_kernels, start_processes
from policy_runs import train_folders

SEED = 73
SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 12, "learning_rate": 1e-3, "warmup_steps": 2,
           "max_grad_norm": 0.8, "log_interval": 12, "checkpoint_interval": 0, "seed": SEED}
DP2, DP1, DP4 = ({"num_workers": 2, "batch_size": 2}, {"num_workers": 1, "batch_size": 4},
                 {"num_workers": 4, "batch_size": 1})
TP2_DP2 = {"num_workers": 4, "tp_size": 2, "batch_size": 2}
BF16_PARAMS = {"precision": "bf16_params"}
ACCUMULATION = {"precision": "bf16_params", "grad_accum_steps": 2, "grad_accum_dtype": "fp32"}
# fp16 with DeepSpeed's scaler rules, its window shortened to 2 good steps: the scale doubles until gradients overflow
# (step 7 here), so the run skips and halves within 12 steps.
FP16 = {"precision": "fp16", "loss_scale_window": 2}
# fp16's folder checks every step (the teacher-forced check, docs/teacher_forced.md): the scale grows at steps 2, 4, 6,
# an overflow skips steps after, and every kind of step is checked against a reference step from the run's own state.
FP16_CHECKED = {**FP16, "checkpoint_interval": 1}
DEEPSPEED_BF16 = {"bf16": {"enabled": True}}  # a user's DeepSpeed config: it alone picks bf16_params
AMP = {"precision": "fp16_autocast", "loss_scale_window": 2}  # torch's AMP recipe, with the harness's scaler as FP16's

# folder → {record file: (strategy, flags)}: the baseline and references of a folder, then the runs it judges. A
# record listed under several folders is trained once (its first folder) and copied.
BASELINE = {"loss_ddp.json": ("ddp", {**DP2, **BF16_PARAMS}),
            "noise_reference_ddp_tp1_dp1_bf16_params.json": ("ddp", {**DP1, **BF16_PARAMS, "noise_reference": True}),
            "noise_reference_ddp_tp1_dp4_bf16_params.json": ("ddp", {**DP4, **BF16_PARAMS, "noise_reference": True}),
            "noise_reference_ddp_tp1_dp2_fp32.json": ("ddp", {**DP2, "precision": "fp32", "noise_reference": True})}
FOLDERS = {
    "zero0": {**BASELINE, "loss_deepspeed.json": ("deepspeed", {**TP2_DP2, **BF16_PARAMS, "zero_stage": 0})},
    "zero1": {**BASELINE, "loss_deepspeed.json": ("deepspeed", {**TP2_DP2, "zero_stage": 1,
                                                                "deepspeed_config": DEEPSPEED_BF16}),
              "loss_fsdp.json": ("fsdp", {**TP2_DP2, **BF16_PARAMS})},
    "zero2": {**BASELINE, "loss_deepspeed.json": ("deepspeed", {**TP2_DP2, **BF16_PARAMS, "zero_stage": 2})},
    "gradients_not_zeroed": {**BASELINE, "loss_ddp_gradients_not_zeroed.json": (
        "ddp", {**DP2, **BF16_PARAMS, "strategy_class": DDPGradientsNotZeroed})},
    "accumulation": {"loss_ddp.json": ("ddp", {**DP2, **ACCUMULATION}),
                     "noise_reference_ddp_tp1_dp1_bf16_params.json": ("ddp", {**DP1, **ACCUMULATION,
                                                                               "noise_reference": True}),
                     "noise_reference_ddp_tp1_dp2_fp32.json": BASELINE["noise_reference_ddp_tp1_dp2_fp32.json"],
                     "loss_deepspeed.json": ("deepspeed", {**DP2, **ACCUMULATION, "zero_stage": 1}),
                     "loss_ddp_last_micro_batch_unreduced.json": ("ddp", {**DP2, **ACCUMULATION,
                                                                          "strategy_class": DDPLastMicroBatchUnreduced})},
    "fp16": {"loss_ddp.json": ("ddp", {**DP2, **FP16_CHECKED}),
             "noise_reference_ddp_tp1_dp2_fp32.json": BASELINE["noise_reference_ddp_tp1_dp2_fp32.json"],
             "loss_fsdp.json": ("fsdp", {**TP2_DP2, **FP16_CHECKED}),
             "loss_ddp_loss_scale_kept_for_clipping.json": ("ddp", {**DP2, **FP16_CHECKED,
                                                                   "strategy_class": DDPLossScaleKeptForClipping}),
             "loss_ddp_scale_updated_before_unscaling.json": ("ddp", {**DP2, **FP16_CHECKED,
                                                                     "strategy_class": DDPScaleUpdatedBeforeUnscaling}),
             # DeepSpeed's own fp16 mode runs on CPU workers only where the CPU has fp16 kernels
             **({"loss_deepspeed.json": ("deepspeed", {**TP2_DP2, **FP16_CHECKED, "zero_stage": 1})} if CPU_HAS_FP16
                else {})},
    "autocast": {"loss_ddp.json": ("ddp", {**DP2, "precision": "bf16"})},
    "fp16_autocast": {"loss_ddp.json": ("ddp", {**DP2, **AMP}),
                      "noise_reference_ddp_tp1_dp2_fp32.json": BASELINE["noise_reference_ddp_tp1_dp2_fp32.json"],
                      "loss_fsdp.json": ("fsdp", {**TP2_DP2, **AMP}),
                      "loss_ddp_loss_scale_kept_for_clipping.json": ("ddp", {
                          **DP2, **AMP, "strategy_class": DDPLossScaleKeptForClipping})},
    # last: its NaN loss stops the rest of its group (its record keeps the steps before)
    "overflow_applied": {"loss_ddp_overflow_applied.json": ("ddp", {**DP2, **FP16,
                                                                    "strategy_class": DDPOverflowApplied})},
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return seeded_weights(tmp_path_factory, SEED)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, weights):
    """Every folder of FOLDERS with its records (tests/policy_runs.py: each run trained once, in one local gloo group
    per world size, and copied into the other folders that list it); and zero1's again on AVX2's generic kernel path,
    unless this CPU computes bf16 products with the same kernels on both (zero1_avx2 is then a link to zero1)."""
    root = tmp_path_factory.mktemp("precision")
    train_folders(root, FOLDERS, SETTING, weights)
    if same_kernels("default", "avx2"):
        (root / "zero1_avx2").symlink_to(root / "zero1")
    else:
        train_folders(root, {"zero1_avx2": FOLDERS["zero1"]}, SETTING, weights, kernel="avx2")
    return root


def verdict(folder, capsys, *extra) -> tuple[int, dict, str]:
    """plot_loss_curves.py on the folder, as a user runs it: (exit code, curve_comparison.json, stdout + stderr)."""
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "curves.png"), *extra])
    captured = capsys.readouterr()
    return code, json.loads((folder / "curve_comparison.json").read_text()), captured.out + captured.err


def records(folder) -> dict:
    return {name: json.loads((folder / name).read_text()) for name in os.listdir(folder) if name.endswith(".json")
            and not name.startswith("curve_")}


# --- bf16_params --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("folder,runs", [("zero1", ("deepspeed", "fsdp")), ("zero1_avx2", ("deepspeed", "fsdp")),
                                         ("zero2", ("deepspeed",))])
def test_bf16_params_deepspeed_and_fsdp_pass_against_ddp_in_the_policy(folders, capsys, folder, runs):
    """DeepSpeed's bf16 mode (ZeRO-1 asked for by a DeepSpeed config alone, ZeRO-2 by --precision) and FSDP2's
    MixedPrecisionPolicy + TP train as DDP in bf16_params — on this CPU's bf16 kernels and on AVX2's generic path:
    calibrated on DDP's twins and fp32 twin in the policy, with the policy's own distance from fp32 reported beside the
    verdict."""
    code, result, out = verdict(folders / folder, capsys)
    assert code == 0, out
    for name in runs:
        against = result["against_baseline"][name]
        assert (against["verdict"], against["calibrated"]) == ("PASS", True)
        assert 0 < max(against["noise_ratio"].values()) < NOISE_K
        assert all(0 < r < 10 for r in against["fp32_distance_ratio"].values()), against["fp32_distance_ratio"]
        assert result["runs"][name]["policy"] == {"precision": "bf16_params", "reduce_dtype": "bf16",
                                                  "grad_accum_dtype": "bf16", "loss_scaling": None}
    distance = result["policy_fp32_distance"]  # bf16 parameters move DDP from fp32 by more than rounding's 1e-6
    assert all(1e-5 < distance[q] < 5e-2 for q in ("loss", "param_norm")), distance
    assert "Precision policy of every run: bf16_params (bf16 parameters and gradients, fp32 master weights and Adam " \
           "state; reduced over DP in bf16)." in out and "The policy itself (bf16_params) moves DDP" in out
    engine = records(folders / folder)["loss_deepspeed.json"]["config"]
    assert engine["precision"] == "bf16_params" and engine["options"]["zero_stage"] == int(folder[4])
    ddp = records(folders / folder)["loss_ddp.json"]  # its fp32 masters are replicas as its bf16 parameters are
    assert_replicas_held(ddp, 4 * 26)
    assert ddp["replicas"]["by_what"] == {"parameter": 26, "master": 26, "exp_avg": 26, "exp_avg_sq": 26}


def test_deepspeed_zero0_bf16_fails_in_its_optimizer(folders, capsys):
    """DeepSpeed 0.19.8's own ZeRO-0 with bf16 parameters (its FP16_UnfusedOptimizer over the torch AdamW): FAIL at step
    0 on the grad norm, first by the tensor record's invariant — the norm it clips by is TP rank 0's shards' only, well
    below the squares of every tensor's gradient (read after backward: its optimizer takes the norm inline). The layer
    check of step 0 PASSes (outputs and gradients agree: docs/deepspeed.md), so the cause is the optimizer — two of
    them, asserted by test_deepspeed_zero0_bf16_causes."""
    code, result, out = verdict(folders / "zero0", capsys)
    against = result["against_baseline"]["deepspeed"]
    first = against["first_outside"]
    assert (code, against["verdict"]) == (1, "FAIL"), out
    assert (first["step"], first["quantity"], first["test"]) == (0, "grad_norm", "clip_read")
    assert first["reference"] < 0.8 * first["value"]  # clipped by this rank's TP shards' norm only
    assert against["tensors"]["read_at"] == "after_backward" and "its gradients read after backward" in out


def _zero0_worker(rank, port, weights, out):
    import torch

    from conftest import tp2_strategy
    from parity.training.strategy import loss_sum, squared_norm_fp64

    with tp2_strategy("deepspeed", rank, port, weights, {"zero_stage": 0, "precision": "bf16_params"}) as strategy:
        adam = strategy.engine.optimizer.optimizer
        steps = sorted({float(s["step"]) for s in adam.state.values()})
        ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
        strategy.backward(loss_sum(strategy.forward(ids), ids) / 126)
        local = float(sum(squared_norm_fp64(p.grad) for p in strategy.engine.module.parameters()
                          if p.grad is not None)) ** 0.5
        full = sum(float(g.float().square().sum()) for g in strategy.full_gradients().values()) ** 0.5
        strategy.engine.step()
        torch.save({"adam_steps": steps, "reported": float(strategy.engine.get_global_grad_norm()), "local": local,
                    "full": full}, os.path.join(out, f"{rank}.pt"))


def test_deepspeed_zero0_bf16_causes(tiny_weights, tmp_path):
    """Why ZeRO-0 in bf16 FAILs (two processes, TP=2): DeepSpeed's FP16_UnfusedOptimizer steps the torch AdamW once
    with zero gradients at initialize, to create its state, so every step's bias correction is the next one's (Adam's
    first update is 0.74 × DDP's); and it hands get_weight_norm the gradient tensors, not the parameters, whose
    tensor_model_parallel mark decides what counts: unmarked, every gradient counts as replicated — whole on TP rank 0,
    skipped on the others — so the norm (and the clipping) is TP rank 0's local gradients', the other ranks' shards
    missing."""
    import torch

    from conftest import free_port

    start_processes(_zero0_worker, (free_port(), tiny_weights, str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    assert [r["adam_steps"] for r in ranks] == [[1.0], [1.0]]  # DDP's AdamW: no state (step 0) before its first step
    reported = ranks[0]["reported"]
    assert ranks[1]["reported"] == pytest.approx(reported, rel=1e-6)
    assert reported == pytest.approx(ranks[0]["local"], rel=1e-3) and reported < 0.95 * ranks[0]["full"]


# How close each clean record's every-tensor squares come to its own step norms: float64 sums of the same squares (the
# harness's norms: DDP's and FSDP2's, DeepSpeed's ZeRO-0 norm the harness takes), DeepSpeed's ZeRO-1/2 norm rounded to
# fp32, and its BF16 optimizer's (ZeRO-1, fp32 accumulation), which takes each tensor's norm in fp32 (DeepSpeed's
# get_global_norm_of_tensors: .float().norm()): measured 1.1e-5 on qwen2-tiny.
TENSOR_NORMS_OFF = {"exact": 1e-12, "fp32 total": 1e-7, "fp32 per tensor": 5e-5}


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != "overflow_applied"])
def test_every_policys_tensors_add_up_to_its_own_norms(folders, folder):
    """In every policy — the gradient as reduced, an fp16 loss scale taken out (its skipped steps left out), a bf16
    model's fp32 masters as the parameters, micro-batches accumulated in fp32 — each clean record's tensors' squares
    add up to the step's grad norm and parameter norm (TENSOR_NORMS_OFF); but to DeepSpeed's ZeRO-0 bf16 norm, which
    misses the other TP rank's shards (measured: the squares' total 1.48 × it)."""
    found = records(folders / folder)
    for name, (strategy, flags) in FOLDERS[folder].items():
        if flags.get("strategy_class"):
            continue  # a seeded bug's copy
        record = found[name]
        stage = flags.get("zero_stage", 1)
        kind = ("exact" if strategy != "deepspeed" or stage in (0, 3) else
                "fp32 per tensor" if flags.get("grad_accum_dtype") == "fp32" else "fp32 total")
        grad, param = tensor_norms_off(record, folders / folder)
        assert param < TENSOR_NORMS_OFF["exact"], (name, param)
        if strategy == "deepspeed" and stage == 0:  # its own norm is TP rank 0's shards' (test_deepspeed_zero0_bf16_causes)
            assert grad > 0.2, (name, grad)  # the series holds every shard: the squares' total is well above it
        else:
            assert grad < TENSOR_NORMS_OFF[kind], (name, grad)


def test_a_config_alone_picks_the_policy_and_the_record_says_it(folders):
    """A DeepSpeed config with bf16 enabled and no --precision: the run is bf16_params; its config keeps the file."""
    config = records(folders / "zero1")["loss_deepspeed.json"]["config"]
    assert (config["precision"], config["reduce_dtype"], config["grad_accum_dtype"]) == ("bf16_params", "bf16", "bf16")
    assert config["options"]["deepspeed_config"]["config"] == DEEPSPEED_BF16


# --- micro-batches accumulated in fp32 ------------------------------------------------------------------------------

def test_fp32_accumulation_deepspeed_bf16_optimizer_passes_and_the_unreduced_last_micro_batch_fails(folders, capsys):
    """--grad_accum_steps 2 --grad_accum_dtype fp32: DeepSpeed's ZeRO-1 takes its BF16 optimizer (the path of #7985,
    fixed in 0.19) and trains as DDP, which adds each reduced micro-batch into its fp32 master gradients; the copy whose
    last micro-batch is added unreduced (#7985's bug) FAILs at step 0 on the grad norm."""
    code, result, out = verdict(folders / "accumulation", capsys)
    deepspeed = result["against_baseline"]["deepspeed"]
    assert (deepspeed["verdict"], deepspeed["calibrated"]) == ("PASS", True), out
    bug = result["against_baseline"]["ddp_last_micro_batch_unreduced"]
    assert (code, bug["verdict"], bug["first_outside"]["step"], bug["first_outside"]["quantity"]) == (
        1, "FAIL", 0, "grad_norm"), out
    assert result["runs"]["deepspeed"]["policy"]["grad_accum_dtype"] == "fp32"


# --- fp16 -----------------------------------------------------------------------------------------------------------

def test_fp16_fsdp_with_the_harness_scaler_passes_against_ddp(folders, capsys):
    """The harness's loss scaler (DeepSpeed's rules) in DDP and in FSDP2 + TP: the same steps skipped on overflows, the
    same scale at every step — growth after 2 good steps, hysteresis, halving — and FSDP PASSes."""
    ddp, fsdp = (records(folders / "fp16")[name] for name in ("loss_ddp.json", "loss_fsdp.json"))
    skipped = [s["skipped"] for s in ddp["steps"]]
    assert skipped == [s["skipped"] for s in fsdp["steps"]] and sum(skipped) >= 2
    scales = [s["loss_scale"] for s in ddp["steps"]]
    assert scales == [s["loss_scale"] for s in fsdp["steps"]] and scales[0] == 2 ** 16
    assert max(scales) >= 2 ** 18 and any(b < a for a, b in zip(scales, scales[1:]))  # grew, then halved
    first = skipped.index(True)
    assert scales[first + 1] == scales[first]  # hysteresis 2: the first overflow skips without halving
    code, result, out = verdict(folders / "fp16", capsys)
    against = result["against_baseline"]["fsdp"]
    assert (against["verdict"], against["calibrated"]) == ("PASS", True), out


def test_fp16_loss_scale_kept_for_clipping_fails(folders, capsys):
    """The loss scale removed after clipping instead of before: every step clipped by the scale too much. The norm it
    clips by is the scaled gradients', the one it records the unscaled: the tensor record, read where it takes its norm,
    holds the scaled ones — its invariant FAILs the run at step 0, ahead of the curves (which see it by step 4)."""
    code, result, out = verdict(folders / "fp16", capsys)
    bug = result["against_baseline"]["ddp_loss_scale_kept_for_clipping"]
    first = bug["first_outside"]
    assert (code, bug["verdict"]) == (1, "FAIL"), out
    assert (first["step"], first["test"]) == (0, "clip_read") and first["value"] > 100 * first["reference"], bug


def test_fp16_autocast_fsdp_passes_against_ddp_and_a_clip_before_unscaling_fails(folders, capsys):
    """torch's AMP recipe (fp16_autocast: autocast(float16) over fp32 parameters, the loss scaled): DDP and FSDP2 + TP
    skip the same overflowing steps at the same scales and FSDP PASSes, calibrated; the scale removed after clipping —
    clip_grad_norm_ before scaler.unscale_, as torch's AMP docs warn — FAILs at step 0 on the norm it clipped by."""
    ddp, fsdp = (records(folders / "fp16_autocast")[name] for name in ("loss_ddp.json", "loss_fsdp.json"))
    assert ddp["config"]["precision"] == "fp16_autocast" and ddp["config"]["loss_scaling"]["loss_scale_window"] == 2
    skipped, scales = [s["skipped"] for s in ddp["steps"]], [s["loss_scale"] for s in ddp["steps"]]
    assert skipped == [s["skipped"] for s in fsdp["steps"]] and scales == [s["loss_scale"] for s in fsdp["steps"]]
    assert scales[0] == 2 ** 16 and max(scales) >= 2 ** 18, scales
    code, result, out = verdict(folders / "fp16_autocast", capsys)
    against = result["against_baseline"]["fsdp"]
    assert (against["verdict"], against["calibrated"]) == ("PASS", True), out
    bug = result["against_baseline"]["ddp_loss_scale_kept_for_clipping"]
    first = bug["first_outside"]
    assert (code, bug["verdict"]) == (1, "FAIL"), out
    assert (first["step"], first["test"]) == (0, "clip_read") and first["value"] > 100 * first["reference"], bug


def growth_steps(record) -> list[int]:
    """The steps at whose end the loss scale grew (the next step's is larger), the last step's unknown."""
    scales = [s["loss_scale"] for s in record["steps"]]
    return [k for k, (a, b) in enumerate(zip(scales, scales[1:])) if b > a]


def checks_of(record) -> dict[int, dict]:
    return {c["step"]: c for c in teacher_forced.summary(record)["checks"]}


def test_fp16_checks_pass_on_clean_runs_and_fail_where_the_scale_grew_before_unscaling(folders, capsys):
    """The teacher-forced check in fp16, at every step: DDP and FSDP2 + TP with the harness's scaler pass each one —
    growth steps, an overflow's skipped steps (noted, nothing to compare) and the steps after; the scale updated before
    the gradients are unscaled (DDPScaleUpdatedBeforeUnscaling) FAILs exactly at the steps where the scale grew (its
    gradients halved there), and nowhere else. On a CPU with fp16 kernels, DeepSpeed 0.19.8's own fp16 mode at ZeRO-1
    FAILs the same way: its stage_1_and_2.py updates the scale, then unscales by the updated one (a released bug, named
    in DeepSpeed PR #8588's discussion) — kept here as a FAIL."""
    runs = records(folders / "fp16")
    for name in ("loss_ddp.json", "loss_fsdp.json"):
        checks = checks_of(runs[name])
        assert sorted(checks) == list(range(SETTING["debug_steps"])), name
        assert all(c["ok"] for c in checks.values()), (name, checks)
        compared = [c for c in checks.values() if c["note"] is None]
        assert len(compared) >= 8 and max(c["ratio"] for c in compared) < 1, (name, checks)
        assert {growth_steps(runs[name])[0], 4} <= {c["step"] for c in compared}
        assert all("overflow" in c["note"] for c in checks.values() if c["note"] is not None)
    buggy = {"loss_ddp_scale_updated_before_unscaling.json": "ddp_scale_updated_before_unscaling",
             **({"loss_deepspeed.json": "deepspeed"} if CPU_HAS_FP16 else {})}
    code, result, out = verdict(folders / "fp16", capsys)
    for file, name in buggy.items():
        checks, grown = checks_of(runs[file]), growth_steps(runs[file])
        assert grown[:3] == [2, 4, 6], (name, grown)
        last = SETTING["debug_steps"] - 1  # whether the scale grows at its end the record does not say
        failed = sorted(step for step, c in checks.items() if not c["ok"] and step < last)
        assert failed == grown, (name, failed, grown)
        assert min(checks[k]["ratio"] for k in failed) > 10, (name, checks)  # DeepSpeed's on an AVX512-FP16 Xeon: 19.4
        first = result["against_baseline"][name]["first_outside"]
        assert result["against_baseline"][name]["verdict"] == "FAIL" and first["step"] <= 2, (name, first)
        print(f"{name}: fails the check at the growth steps {failed}, by {min(checks[k]['ratio'] for k in failed):.0f}–"
              f"{max(checks[k]['ratio'] for k in failed):.0f} × its bound")


def test_fp16_an_overflow_step_applied_fails_at_it(folders, capsys, tmp_path):
    """An overflowing step applied instead of skipped: the weights go NaN, the run stops at the next step (its record
    keeps the steps before), and the verdict FAILs at the overflow step: the baseline skipped it."""
    shutil.copy(folders / "fp16" / "loss_ddp.json", tmp_path)
    shutil.copy(folders / "overflow_applied" / "loss_ddp_overflow_applied.json", tmp_path)
    first = [s["skipped"] for s in records(folders / "fp16")["loss_ddp.json"]["steps"]].index(True)
    code, result, out = verdict(tmp_path, capsys, "--allow_incomplete")
    bug = result["against_baseline"]["ddp_overflow_applied"]
    assert (code, bug["verdict"], bug["first_outside"]["step"], bug["first_outside"]["quantity"]) == (
        1, "FAIL", first, "skipped"), out
    assert f"first step outside: step {first}: ddp_overflow_applied applied it and DDP skipped it" in out


def test_deepspeed_fp16_is_refused_before_training_on_this_cpu(tmp_path, weights):
    """DeepSpeed refuses its fp16 mode at initialize on a CPU without fp16 kernels: the harness says so first."""
    if CPU_HAS_FP16:
        pytest.skip("this CPU has fp16 kernels: DeepSpeed runs fp16 here")
    with pytest.raises(ConfigError, match=r"^DeepSpeed's fp16 mode on CPU workers: DeepSpeed refuses it at initialize "
                                          r"on a CPU without fp16 kernels .*\"Type fp16 is not supported on your device"):
        plan("deepspeed", {**SETTING, **TP2_DP2, **FP16, "init_weights_path": weights, "loss_output_dir": tmp_path,
                           "storage_path": tmp_path})


# --- the baseline in the same policy ---------------------------------------------------------------------------------

def test_a_comparison_across_policies_is_a_policy_difference(folders, capsys, tmp_path):
    """The same DeepSpeed run (its config's bf16 mode) against DDP in the autocast policy: not judged as a strategy, but
    reported as a policy difference, both policies named, with what to run instead."""
    shutil.copy(folders / "autocast" / "loss_ddp.json", tmp_path)
    shutil.copy(folders / "zero1" / "loss_deepspeed.json", tmp_path)
    code, result, out = verdict(tmp_path, capsys)
    against = result["against_baseline"]["deepspeed"]
    assert (code, result["verdict"], against["verdict"]) == (1, "POLICY DIFFERENCE", "POLICY DIFFERENCE")
    assert against["policy_difference"] == ["precision: bf16 vs bf16_params", "reduce_dtype: fp32 vs bf16",
                                            "grad_accum_dtype: fp32 vs bf16"] and against["first_outside"] is None
    assert "DDP ran bf16 (torch.autocast(bfloat16) over fp32 parameters" in out
    assert "DeepSpeed ran bf16_params (bf16 parameters and gradients, fp32 master weights and Adam state" in out
    assert "A precision-policy difference, not a difference of the strategy" in out
    assert "train_ddp.py --precision bf16_params" in out


def test_the_main_job_runs_the_baseline_and_its_references_in_the_strategies_policy(tmp_path, tiny_weights):
    """PRECISION=bf16_params with a DeepSpeed config, and the config alone: every run of the job — DDP, its twins, the
    strategies — in bf16_params, the fp32 twin in fp32; a config that contradicts PRECISION is one line."""
    from parity.commands.main_job import build_parser, run_plan
    from parity.driver.cluster import Cluster

    config = tmp_path / "my.json"
    config.write_text(json.dumps(DEEPSPEED_BF16))
    for precision in ("bf16_params", "auto"):
        args = build_parser().parse_args(["--precision", precision, "--strategies", "ddp deepspeed",
                                          "--extra_args", f"--deepspeed_config {config}", "--device", "cpu"])
        plan_ = run_plan(args, str(tmp_path / precision), Cluster(cpus=2, gpus=0))
        policies = [(s, v.get("noise_reference", False), v["precision"]) for s, v in plan_]
        assert policies == [("ddp", False, "bf16_params"), ("ddp", True, "bf16_params"), ("ddp", True, "bf16_params"),
                            ("ddp", True, "fp32"), ("deepspeed", False, "bf16_params")], policies
    args = build_parser().parse_args(["--precision", "fp32", "--strategies", "ddp deepspeed",
                                      "--extra_args", f"--deepspeed_config {config}", "--device", "cpu"])
    with pytest.raises(ConfigError, match=rf"^--deepspeed_config {config} asks for the bf16_params policy .* but "
                                          r"--precision is fp32: pass --precision bf16_params"):
        run_plan(args, str(tmp_path / "fp32"), Cluster(cpus=2, gpus=0))


# --- gradients not zeroed -------------------------------------------------------------------------------------------

def test_gradients_not_zeroed_between_steps_fails_at_step_1(folders, capsys):
    """The low-precision gradients kept after the step (#7837's second bug): step 1's gradient holds step 0's too."""
    code, result, out = verdict(folders / "gradients_not_zeroed", capsys)
    bug = result["against_baseline"]["ddp_gradients_not_zeroed"]
    assert (code, bug["verdict"], bug["first_outside"]["step"], bug["first_outside"]["quantity"]) == (
        1, "FAIL", 1, "grad_norm"), out


# --- DeepSpeed 0.18 ----------------------------------------------------------------------------------------------------

RELEASE = "0.18.9"


@pytest.fixture(scope="session")
def deepspeed_018():
    """DeepSpeed 0.18.9 beside the pinned set (conftest.installed_beside): ~75 s the first time on this machine (pip
    builds its wheel), nothing after."""
    return installed_beside(f"deepspeed-{RELEASE}", "--no-build-isolation", f"deepspeed=={RELEASE}")


# Under DeepSpeed 0.18.9: AutoTP at TP=2 in fp32 (ZeRO-0: its ZeRO-1 cannot run on torch 2.13) against DDP, and ZeRO-1
# + bf16 + fp32 accumulation (its BF16 optimizer) against DDP in that policy; the paths it cannot run, refused.
RELEASE_FOLDERS = {
    "autotp": {"loss_ddp.json": ("ddp", {**DP2, "precision": "fp32"}),
               "loss_deepspeed.json": ("deepspeed", {**TP2_DP2, "precision": "fp32", "zero_stage": 0})},
    "accumulation": {name: FOLDERS["accumulation"][name] for name in (
        "loss_ddp.json", "noise_reference_ddp_tp1_dp1_bf16_params.json", "noise_reference_ddp_tp1_dp2_fp32.json",
        "loss_deepspeed.json")},
}


@pytest.fixture(scope="module")
def release_runs(deepspeed_018, tmp_path_factory, weights):
    """tests/policy_runs.py as a script under DeepSpeed 0.18.9 (its folder first on PYTHONPATH: the whole job in that
    environment, so that every record's fingerprint names it)."""
    out = tmp_path_factory.mktemp("deepspeed_018")
    flags = ["--model_name", "qwen2-tiny", "--seq_length", "64", "--init_weights_path", weights, "--loss_output_dir",
             str(out / "refused"), "--storage_path", str(out / "refused"), "--device", "cpu", "--debug_steps", "1"]
    spec = {"root": str(out), "setting": SETTING, "weights": weights, "folders": RELEASE_FOLDERS,
            "refused": {"zero1": ["deepspeed", [*flags, "--num_workers", "2", "--precision", "fp32"]],
                        "autotp_zero3": ["deepspeed", [*flags, "--num_workers", "4", "--tp_size", "2", "--zero_stage",
                                                       "3", "--precision", "fp32"]]}}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (deepspeed_018, REPO, os.environ.get("PYTHONPATH"))
                                                       if p)}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "policy_runs.py"), str(out / "spec.json")],
                          env=env, capture_output=True, text=True, timeout=900, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_deepspeed_018_is_driven_and_its_bf16_optimizer_bug_fails(release_runs, capsys):
    """DeepSpeed 0.18.9, as users run it: AutoTP at TP=2 (ZeRO-0, fp32) at fp32 parity with DDP (the harness gathers
    its column-parallel outputs itself: 0.18's LinearLayer has no is_tp_parallel); its ZeRO-1 + bf16 + fp32 accumulation
    (the BF16 optimizer) FAILs at step 0 on the grad norm — deepspeedai/DeepSpeed#7985, the last micro-batch never
    averaged over DP — where 0.19.8 PASSes (test_fp32_accumulation_...)."""
    code, result, out = verdict(release_runs / "autotp", capsys)
    assert code == 0 and result["against_baseline"]["deepspeed"]["verdict"] == "PASS", out
    assert {r["versions"]["deepspeed"] for r in result["fingerprints"].values()} == {RELEASE}
    code, result, out = verdict(release_runs / "accumulation", capsys)
    against = result["against_baseline"]["deepspeed"]
    assert (code, against["verdict"], against["first_outside"]["step"], against["first_outside"]["quantity"]) == (
        1, "FAIL", 0, "grad_norm"), out


def test_deepspeed_018_paths_it_cannot_run_are_one_line_before_training(release_runs):
    """ZeRO-1 in fp32 fails inside 0.18.9's own step on torch 2.13, and AutoTP with ZeRO-3 is refused at its
    initialize: each is one line, exit 2, before any worker."""
    refused = json.loads((release_runs / "refused.json").read_text())
    assert refused["zero1"]["code"] == 2 and refused["zero1"]["stderr"] == (
        "error: DeepSpeed 0.18.9 cannot run ZeRO stages 1 and 2 through its ZeRO optimizer on torch 2.13.0+cpu: its "
        "step all-gathers the updated partitions into split views, which torch 2.13 refuses (\"Output 0 of Split is a "
        "view and is being modified inplace\"): use DeepSpeed 0.19, or --zero_stage 0 or 3\n")
    assert refused["autotp_zero3"]["code"] == 2 and refused["autotp_zero3"]["stderr"].startswith(
        "error: DeepSpeed 0.18.9 cannot run AutoTP with ZeRO-3")
    assert all(r["stderr"].count("\n") == 1 for r in refused.values())
