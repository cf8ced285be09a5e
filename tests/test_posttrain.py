"""Post-training objectives under the harness's strategies (issue 59, docs/posttrain.md): rollout files written by
make_rollouts.py from the tiny model (real generation, a verifiable reward), then trained with --objective under every
strategy in local gloo groups and judged against DDP by plot_loss_curves.py as a user runs it — fp32 parity, one
calibrated bf16 PASS, the split-dependent bnpo at its own split, and the seeded bugs of
parity/calibration/objective_bugs.py, each FAILing at its step. The invariance table of each definition × each split
is measured in one process (test_objective_invariance.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import max_rel_diff, series
from parity.commands.compare_curves import main as plot_loss_curves

BUGS = "parity.calibration.objective_bugs"
# dapo with the KL term and truncated completions masked: every GRPO bug of the catalogue shows under it
DAPO = {"objective": "dapo", "objective_args": ["beta=0.1", "mask_truncated_completions=true"]}
RUN = {"model_name": "qwen2-tiny", "learning_rate": 1e-4, "checkpoint_interval": 0, "log_interval": 5, "debug_steps": 2,
       "replica_check_interval": 2}
DP2 = {"num_workers": 2, "batch_size": 4, "grad_accum_steps": 2}
TP2_DP2 = {"num_workers": 4, "tp_size": 2, "batch_size": 4, "grad_accum_steps": 2}
FP32, BF16 = {"precision": "fp32"}, {"precision": "bf16"}
SAMPLER_WEIGHTED = {"objective": "dapo", "objective_args": [
    "vllm_importance_sampling_correction=true", "vllm_importance_sampling_mode=sequence_truncate",
    "vllm_importance_sampling_clip_max=0.5"]}
# name → (strategy, rollouts, flags), in the order each world size's group runs them. ZeRO-3 last: DeepSpeed's ZeRO-3
# replaces torch.nn.functional.linear in its processes for good ("this will persist unless manually reset"), and a bf16
# run after it in the same group computed other roundings (the pipeline's step 1: 1.7103 against 1.7096 alone)
RUNS = {
    "ddp": ("ddp", "grpo", {**DAPO, **DP2, **FP32}),
    "fsdp": ("fsdp", "grpo", {**DAPO, **TP2_DP2, **FP32}),
    "pipeline": ("pipeline", "grpo", {**DAPO, "num_workers": 4, "pp_size": 2, "batch_size": 4, "microbatches": 2,
                                      **FP32}),
    "transformers": ("transformers", "grpo", {**DAPO, "num_workers": 2, "tp_size": 2, "batch_size": 8,
                                              "grad_accum_steps": 2, **FP32}),
    "ddp_bf16": ("ddp", "grpo", {**DAPO, **DP2, **BF16}),
    "ddp_bf16_reference": ("ddp", "grpo", {**DAPO, **DP2, **BF16, "grad_accum_steps": 1, "noise_reference": True}),
    "ddp_bf16_reference_dp4": ("ddp", "grpo", {**DAPO, **BF16, "num_workers": 4, "batch_size": 2,
                                               "noise_reference": True}),
    "fsdp_bf16": ("fsdp", "grpo", {**DAPO, **TP2_DP2, **BF16, "mixed_precision": "autocast"}),
    "ddp_bnpo": ("ddp", "grpo", {"objective": "bnpo", **DP2, **FP32}),
    "pipeline_bnpo": ("pipeline", "grpo", {"objective": "bnpo", "num_workers": 4, "pp_size": 2, "batch_size": 4,
                                           "microbatches": 2, **FP32}),
    "ddp_bnpo_reference": ("ddp", "grpo", {"objective": "bnpo", **DP2, **FP32, "grad_accum_steps": 1,
                                           "noise_reference": True}),
    "ddp_dpo": ("ddp", "dpo", {"objective": "dpo", **DP2, **FP32}),
    "ddp_dpo_swapped": ("ddp", "dpo_swapped", {"objective": "dpo", **DP2, **FP32}),  # chosen and rejected swapped
    # TRL's vLLM importance-sampling correction from the file's sampler side, capped at 0.5 so that it bites (the
    # sampler's log-probs lie within rounding of the trainer's: every weight ~1, clamped to 0.5), against the same
    # objective without it
    "ddp_sampler_weighted": ("ddp", "grpo", {**SAMPLER_WEIGHTED, **DP2, **FP32}),
    "fsdp_sampler_weighted": ("fsdp", "grpo", {**SAMPLER_WEIGHTED, **TP2_DP2, **FP32}),
    "ddp_unweighted": ("ddp", "grpo", {"objective": "dapo", **DP2, **FP32}),
    "zero1": ("deepspeed", "grpo", {**DAPO, **TP2_DP2, **FP32, "zero_stage": 1}),
    "zero3": ("deepspeed", "grpo", {**DAPO, **TP2_DP2, **FP32, "zero_stage": 3}),
}
SEEDED = {  # bug → (rollouts, the step it must FAIL at: the first, or the first whose rows hold a truncated completion)
    "divided_by_accumulation_again": ("grpo", 0),
    "per_rank_token_normaliser": ("grpo", 0),
    "generation_normaliser_at_other_split": ("grpo", 0),
    "truncated_counted": ("grpo", "truncated"),
    "beta_twice": ("grpo", 0),
    "advantages_per_rank": ("grpo", 0),
    "dpo_reference_from_policy": ("dpo", 0),
}
for _bug, (_kind, _) in SEEDED.items():
    _flags = {**DAPO} if _kind == "grpo" else {"objective": "dpo"}
    RUNS[f"bug_{_bug}"] = ("ddp", _kind, {**_flags, **DP2, **FP32, "strategy_class": f"{BUGS}:DDPObjectiveBug",
                                         "objective_bug": _bug})


@pytest.fixture(scope="module")
def runs(tiny_weights, posttrain_rollouts, tmp_path_factory) -> dict:
    """Every run of RUNS, by name: its loss record, and where it lies. One local gloo group per world size."""
    from parity.driver.local_group import plan, run_group

    root = tmp_path_factory.mktemp("posttrain")
    files = {**posttrain_rollouts, "dpo_swapped": _swapped_pairs(posttrain_rollouts["dpo"], root)}
    planned = {name: plan(strategy, {**RUN, **flags, "rollouts": files[kind], "init_weights_path": tiny_weights,
                                     "loss_output_dir": root / name, "storage_path": root / "ray",
                                     "experiment_name": name})
               for name, (strategy, kind, flags) in RUNS.items()}
    records = {}
    for world in (2, 4):
        names = [n for n in planned if planned[n][0].num_workers == world]
        records.update(zip(names, run_group([planned[n] for n in names])))
    return {"records": records, "root": root, "files": files}


def _swapped_pairs(path: str, root) -> str:
    """A copy of the DPO rollout file with each pair's chosen and rejected rows swapped (a collator's bug: every
    preference reversed, so every reward margin negated)."""
    from parity.objectives.rollouts import read_rollouts, write_rollouts

    f = read_rollouts(path)
    rows = len(f.tensors["input_ids"])
    order = [i ^ 1 for i in range(rows)]
    swapped = {k: v if k == "step_rows" else v[order] for k, v in f.tensors.items()}
    write_rollouts(str(root / "dpo_swapped.safetensors"), "dpo", swapped, "the DPO file, each pair swapped", {},
                   f.sampler)
    return str(root / "dpo_swapped.safetensors")


def judge(runs, folder, capsys, *names, flags=()):
    """plot_loss_curves.py on a folder of the named runs' records: (exit code, each run's verdict, the output)."""
    folder.mkdir()
    for name in names:
        for found in (runs["root"] / name).glob("*.json"):  # its loss_<strategy>.json, or noise_reference_*.json
            shutil.copy(found, folder)
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "c.png"), *flags])
    out = capsys.readouterr()
    verdicts = {} if code == 2 else json.loads((folder / "curve_comparison.json").read_text())["against_baseline"]
    return code, verdicts, out.out + out.err


@pytest.mark.parametrize("name", ["zero1", "zero3", "fsdp", "pipeline", "transformers"])
def test_every_strategy_trains_the_objective_at_fp32_parity_with_ddp(runs, name):
    """dapo with β 0.1 and truncated completions masked, on a rollout file: the loss, grad norm, parameter norm and the
    objective's per-step quantities (KL, mean ratio, clipped fraction) of each strategy within 1e-5 of DDP's."""
    run, base = runs["records"][name], runs["records"]["ddp"]
    assert run["config"]["objective"] == base["config"]["objective"]
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(base, key)) < 1e-5, key
    for quantity in ("kl", "ratio_mean", "entropy", "tokens", "clipped_fraction"):
        ours = [s["objective"][quantity] for s in run["steps"]]
        theirs = [s["objective"][quantity] for s in base["steps"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5 * max(1.0, *map(abs, theirs)), quantity
    assert base["steps"][0]["objective"]["kl"] > 0  # the reference is another model: the KL term is at work


def test_the_sampler_weight_is_trls_and_trains_at_fp32_parity(runs):
    """TRL's vLLM importance-sampling correction from the rollout file's sampler log-probs (sequence_truncate, capped at
    0.5: every weight ~1, clamped): the step-0 loss is half the unweighted one's (on-policy, β 0: the whole loss is the
    weighted policy term), and FSDP + TP trains it within 1e-5 of DDP. The weight itself, mode by mode, as TRL 1.16's
    _generate_and_score_completions computes it."""
    import torch

    from parity.objectives.grpo import sampler_weight

    weighted, fsdp, plain = (runs["records"][n] for n in ("ddp_sampler_weighted", "fsdp_sampler_weighted",
                                                          "ddp_unweighted"))
    assert abs(series(weighted, "loss")[0] - 0.5 * series(plain, "loss")[0]) <= 1e-6 * abs(series(plain, "loss")[0])
    assert series(plain, "loss")[0] != 0
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(fsdp, key), series(weighted, key)) < 1e-5, key
    old = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    sampled = torch.tensor([[0.0, -1.5, float("nan"), -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    s = {"vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 1.5}
    token = [0.0, 0.5, 0.0, -1.0]  # log-weights: 0 off the mask and where the sampler gave none
    expect = {"token_truncate": [min(1.5, math.exp(x)) for x in token],
              "token_mask": [0.0 if math.exp(x) > 1.5 else math.exp(x) for x in token],
              "sequence_truncate": [math.exp(-0.5)], "sequence_mask": [math.exp(-0.5)]}
    for mode, values in expect.items():
        got = sampler_weight({**s, "vllm_importance_sampling_mode": mode}, old, sampled, mask)
        assert torch.allclose(got, torch.tensor([values])), mode
    s["vllm_importance_sampling_clip_max"] = 0.5  # the sequence's weight exp(−0.5) ≈ 0.61: capped, or masked
    assert sampler_weight({**s, "vllm_importance_sampling_mode": "sequence_truncate"}, old, sampled, mask).item() == 0.5
    assert sampler_weight({**s, "vllm_importance_sampling_mode": "sequence_mask"}, old, sampled, mask).item() == 0.0


def test_the_verdict_passes_every_strategy_against_ddp(runs, tmp_path, capsys):
    code, verdicts, out = judge(runs, tmp_path / "fp32", capsys, "ddp", "zero1", "fsdp", "pipeline")
    assert code == 0, out
    assert {v["verdict"] for v in verdicts.values()} == {"PASS"}, out


def test_bf16_passes_calibrated_against_ddp(runs, tmp_path, capsys):
    code, verdicts, out = judge(runs, tmp_path / "bf16", capsys, "ddp_bf16", "ddp_bf16_reference",
                                "ddp_bf16_reference_dp4", "fsdp_bf16")
    (verdict,) = verdicts.values()
    assert (code, verdict["verdict"]) == (0, "PASS"), out
    assert verdict["calibrated"], out


def test_bnpo_is_judged_at_its_own_split_and_a_reference_at_another_is_refused(runs, tmp_path, capsys):
    """bnpo (each micro-batch's token mean) depends on the split: the pipeline PP2×DP2 at DDP's micro-batches of 2 rows
    PASSes and the report says so in one line; a noise reference at micro-batches of 4 rows is refused in one line."""
    code, verdicts, out = judge(runs, tmp_path / "bnpo", capsys, "ddp_bnpo", "pipeline_bnpo")
    assert code == 0 and {v["verdict"] for v in verdicts.values()} == {"PASS"}, out
    assert "bnpo depends on the split by definition" in out and "2 rows a micro-batch" in out, out
    code, _, out = judge(runs, tmp_path / "bnpo_ref", capsys, "ddp_bnpo", "pipeline_bnpo", "ddp_bnpo_reference")
    assert code == 2, out
    assert "bnpo depends on the split by definition" in out and "micro-batches of 2 rows" in out, out


@pytest.mark.parametrize("bug", list(SEEDED))
def test_a_seeded_objective_bug_fails_at_its_step(runs, tmp_path, capsys, bug):
    from parity.objectives.rollouts import read_rollouts

    kind, step = SEEDED[bug]
    if step == "truncated":
        rollouts = read_rollouts(runs["files"]["grpo"])
        step = next(s for s in range(rollouts.steps) if rollouts.step(s)[1].truncated.any())
    base = "ddp" if kind == "grpo" else "ddp_dpo"
    code, verdicts, out = judge(runs, tmp_path / bug, capsys, base, f"bug_{bug}")
    (verdict,) = verdicts.values()
    assert (code, verdict["verdict"]) == (1, "FAIL"), out
    assert verdict["first_outside"]["step"] == step, out


def test_a_discrete_quantity_without_ties_still_fails_by_one_decision(runs):
    """Ties widen a discrete quantity's bound only where there are some. DDP on the DPO file (its reference another
    model's, so no margin is near 0) against DDP on the same file with every pair's chosen and rejected swapped: each
    reward margin negated, no tie in either, and the accuracy FAILs at the first step it differs by more than one
    decision — step 1, 1 of 4 pairs against 3 of 4 (step 0 is 2 of 4 both ways). (The batches differ, so the verdict
    stops before the curves; the objective's check is asked on the two records' accuracies: the negated margin and
    rewards are outside from step 0.)"""
    from parity.comparing import objective
    from parity.comparing.curves import Run

    kept = ("pairs", "accuracy", "accuracy_ties")
    base, bug = (Run(str(runs["root"] / name), {**runs["records"][name], "steps": [
        {**s, "objective": {k: s["objective"][k] for k in kept}} for s in runs["records"][name]["steps"]]})
        for name in ("ddp_dpo", "ddp_dpo_swapped"))
    for run in (base, bug):
        assert [s["objective"]["accuracy_ties"] for s in run.steps] == [0, 0]
    assert [s["objective"]["accuracy"] for s in base.steps] == [0.5, 0.25]
    assert [s["objective"]["accuracy"] for s in bug.steps] == [0.5, 0.75]
    outside = objective.first_outside(base, bug, 2, [1e-5, 1e-5])
    assert (outside.quantity, outside.step, outside.value, outside.reference) == ("accuracy", 1, 0.75, 0.25)
    assert abs(outside.tolerance - (0.25 + 1e-5)) < 1e-12  # one decision of 4, plus the loss's bound: today's


def test_a_ratio_within_its_rounding_of_the_clip_bound_is_a_tie(tiny_weights, posttrain_rollouts):
    """grpo.micro_parts' statistics on real tensors: the policy's log-probs at the initial weights on step 0's rows,
    π_old the file's reference (another seed's model, so the ratios spread over 0.68–1.77). A clip bound at one
    token's ratio (A > 0) makes it a tie, whichever side of the bound it lies; the bound 20 × that token's rounding
    away (ties.py) leaves none; on-policy (π_old = π: each ratio exactly 1) there are none."""
    from dataclasses import replace

    import torch

    from parity.models.model import build_model, load_init_weights, resolve_model_config
    from parity.objectives import grpo, resolve_objective, ties
    from parity.objectives.causal_lm import token_log_probs
    from parity.objectives.rollouts import read_rollouts

    ids, rows = read_rollouts(posttrain_rollouts["grpo"]).step(0)
    rows = replace(rows, old_logps=rows.ref_logps)
    model = build_model(resolve_model_config("qwen2-tiny"), 42)
    load_init_weights(model, tiny_weights)
    with torch.no_grad():
        log_probs = token_log_probs(model(input_ids=ids).logits, ids)[0]
    old = rows.old_logps[:, 1:]
    ratio, noise = (log_probs - old).exp(), ties.FP32_LEVEL * (log_probs.abs() + old.abs() + 1)
    eligible = (rows.completion_mask[:, 1:] > 0) & (rows.advantages[:, None] > 0) & (ratio > 1)
    gaps = [min(abs(r / o - 1) for o in ratio[eligible].tolist() if o != r) for r in ratio[eligible].tolist()]
    r, n = ratio[eligible][gaps.index(max(gaps))].item(), noise[eligible][gaps.index(max(gaps))].item()
    assert max(gaps) > 40 * n  # (no other ratio near the moved bound)

    def found(epsilon_high, given=rows):
        s = resolve_objective("dapo", {"epsilon_high": epsilon_high})["settings"]
        stats = grpo.micro_parts("dapo", s, log_probs, torch.zeros_like(log_probs), given)[2]
        return grpo.quantities("dapo", s, stats.tolist())

    at, away = found(r - 1), found(r * (1 + 20 * n) - 1)
    assert (at["clipped_high_ties"], at["clipped_fraction_ties"], away["clipped_high_ties"]) == (1, 1, 0)
    assert at["clipped_low_ties"] == away["clipped_low_ties"] == 0  # (ε_low 0.2: no ratio within rounding of 0.8)
    assert round((at["clipped_high"] - away["clipped_high"]) * at["scored"]) in (0, 1)  # the tie, either side
    assert found(0.0, replace(rows, old_logps=None))["clipped_high_ties"] == 0


REFUSED = [  # (flags beyond a dapo run on the GRPO file, what the one line says)
    ({"objective": "ppo"}, "--objective ppo is not a known objective"),
    ({"objective_args": ["betta=0.1"]}, "--objective dapo has no setting betta"),
    ({"objective_args": ["off_policy_mask_threshold=0.5"]}, "cannot be computed by the reference"),
    ({"objective_args": ["vllm_importance_sampling_correction=true"], "rollouts": "no_sampler"},
     "has no sampler side"),
    ({"objective": "vespo", "objective_args": ["vllm_importance_sampling_correction=true"]},
     "vespo takes TRL's vLLM importance weight"),
    ({"objective": "dpo", "objective_args": ["loss_type=aot"]}, "loss_type aot sorts the log-ratios"),
    ({"objective": "dpo"}, "trains on dpo rollouts, and --rollouts"),
    ({"rollouts": None}, "--objective dapo trains on a rollout file: give --rollouts FILE"),
    ({"batch_size": 2}, "rows a step, the run's global batch is --batch_size 2"),
    ({"objective_args": ["beta=0.1"], "rollouts": "no_ref"}, "needs the reference's log-probs"),
    ({"packing": True}, "--packing with --rollouts"),
]


@pytest.mark.parametrize("flags,line", REFUSED, ids=[r[1][:30] for r in REFUSED])
def test_what_the_reference_cannot_compute_is_refused_in_one_line(tiny_weights, posttrain_rollouts, tmp_path, capsys,
                                                                  flags, line):
    """Before any worker starts: one line naming the problem, exit 2."""
    from conftest import to_argv
    from parity.commands.train import main as train
    from parity.objectives.rollouts import read_rollouts, write_rollouts

    if flags.get("rollouts") == "no_ref":  # the GRPO file without its reference log-probs
        f = read_rollouts(posttrain_rollouts["grpo"])
        tensors = {k: v for k, v in f.tensors.items() if k != "ref_logps"}
        flags["rollouts"] = str(tmp_path / "no_ref.safetensors")
        write_rollouts(flags["rollouts"], "grpo", tensors, "without ref_logps", {}, f.sampler)
    if flags.get("rollouts") == "no_sampler":  # the GRPO file without its sampler side
        from parity.objectives.rollouts import SAMPLER_TENSORS

        f = read_rollouts(posttrain_rollouts["grpo"])
        tensors = {k: v for k, v in f.tensors.items() if k not in SAMPLER_TENSORS}
        flags["rollouts"] = str(tmp_path / "no_sampler.safetensors")
        write_rollouts(flags["rollouts"], "grpo", tensors, "without its sampler side", {}, {})
    values = {**RUN, **DAPO, **DP2, "rollouts": posttrain_rollouts["grpo"], "init_weights_path": tiny_weights,
              "loss_output_dir": tmp_path, "storage_path": tmp_path, "objective_args": None, "device": "cpu", **flags}
    assert train("ddp", argv=to_argv({k: v for k, v in values.items() if k != "objective_args"})
                 + (["--objective_args", *values["objective_args"]] if values["objective_args"] else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
