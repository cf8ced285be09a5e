"""Your own setup against DDP: gradient accumulation on padded data, activation checkpointing, torch.compile,
your own DeepSpeed config and your own strategy class — each at fp32 parity with DDP at one micro-batch, and
the classic bug of each seeded in a copy and FAILed by plot_loss_curves.py.

The runs are the shared loop in local gloo groups (parity.driver.local_group), one group per world size:
resolved, fed and recorded as Ray runs are; Ray adds nothing here (test_custom_strategy runs a user's class
through Ray end to end). Setting: qwen2-tiny, seq 64, 6 steps, lr 1e-4, padded samples (synthetic_padded:
every DP rank and micro-batch holds another number of loss tokens), global batch 8 = DP 2 × 4.
"""

import json
import shutil

import pytest

from conftest import FP32_RTOL, assert_replicas_held, max_rel_diff, series
from parity.calibration.bugs import FSDPMicroBatchMeans, FSDPRankMeans, FSDPSequenceParallelNormsUnreduced
from parity.commands.compare_curves import main as plot_loss_curves
from parity.driver.local_group import plan, run_group

SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 6, "learning_rate": 1e-4, "log_interval": 6,
           "checkpoint_interval": 0, "precision": "fp32", "dataset": "synthetic_padded", "batch_size": 4}
DP2 = {"num_workers": 2}
TP2_DP2 = {"num_workers": 4, "tp_size": 2}
SP = {"tp_plan": "sequence_parallel"}
# name → (strategy, flags): every strategy at N = 2 and 4, with activation checkpointing, with compile.
RUNS = {
    "ddp_n2": ("ddp", {**DP2, "grad_accum_steps": 2}),
    "ddp_n4": ("ddp", {**DP2, "grad_accum_steps": 4}),
    "deepspeed_n2": ("deepspeed", {**TP2_DP2, "grad_accum_steps": 2}),
    "deepspeed_n4_zero2": ("deepspeed", {**DP2, "grad_accum_steps": 4, "zero_stage": 2}),
    "fsdp_n2": ("fsdp", {**TP2_DP2, "grad_accum_steps": 2}),
    "fsdp_n4": ("fsdp", {**DP2, "grad_accum_steps": 4}),
    "ddp_ac": ("ddp", {**DP2, "activation_checkpointing": True, "grad_accum_steps": 2}),
    "deepspeed_ac": ("deepspeed", {**TP2_DP2, "activation_checkpointing": True}),
    "fsdp_ac": ("fsdp", {**TP2_DP2, "activation_checkpointing": True}),
    "ddp_compile": ("ddp", {**DP2, "compile": True}),
    "fsdp_compile": ("fsdp", {**TP2_DP2, "compile": True}),
    # sequence parallelism (FSDP's --tp_plan sequence_parallel), with accumulation, and at DP 1 with checkpointing
    "fsdp_sp_n2": ("fsdp", {**TP2_DP2, **SP, "grad_accum_steps": 2}),
    "fsdp_sp_tp2_dp1_ac": ("fsdp", {"num_workers": 2, "tp_size": 2, "batch_size": 8, **SP, "activation_checkpointing": True}),
    # the classic bugs of padded data under accumulation, in FSDP copies
    "bug_micro_batch_means": ("fsdp", {**DP2, "grad_accum_steps": 2, "strategy_class": FSDPMicroBatchMeans}),
    "bug_rank_means": ("fsdp", {**DP2, "strategy_class": FSDPRankMeans}),
    # sequence parallelism's classic bug: the RMSNorm weights' gradients never summed over TP
    "bug_sp_norms_unreduced": ("fsdp", {**TP2_DP2, **SP, "strategy_class": FSDPSequenceParallelNormsUnreduced}),
    # users' own DeepSpeed configs (USER_CONFIGS, written as files by the fixture)
    "deepspeed_user_config": ("deepspeed", {**TP2_DP2, "deepspeed_config": "deepspeed_user_config"}),
    "bug_deepspeed_bf16_communication": ("deepspeed", {**TP2_DP2, "deepspeed_config": "bug_deepspeed_bf16_communication"}),
}


# Users' own DeepSpeed configs: one that keeps DDP's numerics (and omits every key the flags decide), one that
# reduces gradients in bf16 in an fp32 run — a setting that differs from DDP, which a FAIL must name.
USER_CONFIGS = {"deepspeed_user_config": {"zero_optimization": {"overlap_comm": False, "allgather_bucket_size": 50000000},
                                          "wall_clock_breakdown": False},
                "bug_deepspeed_bf16_communication": {"communication_data_type": "bf16"}}


@pytest.fixture(scope="module")
def runs(tiny_weights, tmp_path_factory):
    """{name: (its folder, its record)}, the DDP baseline (DP 2, one micro-batch) as "ddp"."""
    root = tmp_path_factory.mktemp("techniques")
    planned = {"ddp": plan("ddp", {**SETTING, **DP2, "init_weights_path": tiny_weights, "loss_output_dir": root / "ddp",
                                   "storage_path": root / "ray"})}
    for name, config in USER_CONFIGS.items():
        (root / f"{name}.json").write_text(json.dumps(config))
    for name, (strategy, flags) in RUNS.items():
        if "deepspeed_config" in flags:
            flags = {**flags, "deepspeed_config": str(root / f"{flags['deepspeed_config']}.json")}
        planned[name] = plan(strategy, {**SETTING, **flags, "init_weights_path": tiny_weights,
                                        "loss_output_dir": root / name, "storage_path": root / "ray",
                                        "experiment_name": name})
    for world in (2, 4):
        run_group([run for run in planned.values() if run[0].num_workers == world])
    from parity.training.record import load_record, run_record_path

    return {name: (root / name, load_record(run_record_path(cfg))) for name, (cfg, _) in planned.items()}


def test_padded_data_gives_ranks_and_micro_batches_different_token_counts(runs):
    """The record's tokens count the loss tokens; the DP ranks' slices hold different numbers of them, and the
    step's loss is the token mean over the global batch, not the mean of the ranks' means."""
    _, base = runs["ddp"]
    tokens = series(base, "tokens")
    assert len(set(tokens)) > 1 and all(0 < t < 8 * 63 for t in tokens)
    step = base["steps"][0]
    a, b = step["dp_rank_losses"]
    assert a != b and step["loss"] != pytest.approx((a + b) / 2, rel=1e-9)
    assert min(a, b) < step["loss"] < max(a, b)


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("bug_")])
def test_each_technique_matches_ddp_at_one_micro_batch_in_fp32(runs, name):
    _, base = runs["ddp"]
    _, run = runs[name]
    assert series(run, "batch_hash") == series(base, "batch_hash") and series(run, "tokens") == series(base, "tokens")
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(base, key)) < FP32_RTOL, key
    cfg = run["config"]
    assert (cfg["grad_accum_steps"], cfg["activation_checkpointing"], cfg["compile"]) == (
        RUNS[name][1].get("grad_accum_steps", 1), "_ac" in name, "_compile" in name)
    assert cfg["options"].get("tp_plan") == RUNS[name][1].get("tp_plan", "default" if name.startswith("fsdp") else None)
    assert_replicas_held(run)  # every technique keeps the copies of what several ranks hold bit-identical


@pytest.mark.parametrize("name,step,quantity", [("bug_micro_batch_means", 0, "grad_norm"), ("bug_rank_means", 0, "grad_norm"),
                                                ("bug_sp_norms_unreduced", 0, "teacher_forced")])
def test_each_techniques_classic_bug_fails_at_its_step(runs, tmp_path, capsys, name, step, quantity):
    """The loss as a mean of per-micro-batch means (transformers < 4.46 under gradient accumulation) or of
    per-rank means: on padded data the tokens of a short micro-batch or rank weigh more. Sequence-parallel
    RMSNorm weights whose gradients are not summed over TP: each rank's norms learn from its sequence chunk only.
    plot_loss_curves.py FAILs each at the first step (the loss recorded is the true token mean: only the gradient is
    off): the means on the grad norm; the unreduced norms move it by 3.2e-5 only, inside its fp32 bound of 1e-4, and
    FAIL at step 0 on the teacher-forced check (model.norm's exp_avg_sq, 0.73 relative) and the tensor verdict (a
    post-attention norm's gradient, 315 × its bound), besides their replicas parting."""
    folder, _ = runs[name]
    for record in ("loss_fsdp.json",):
        shutil.copy(folder / record, tmp_path)
    shutil.copy(runs["ddp"][0] / "loss_ddp.json", tmp_path)
    code = plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"]["fsdp"]
    assert (code, summary["verdict"]) == (1, "FAIL"), out
    assert (summary["first_outside"]["step"], summary["first_outside"]["quantity"]) == (step, quantity)
    assert f"strategy_class: None vs parity.calibration.bugs:{RUNS[name][1]['strategy_class'].__name__}" in out


def test_sequence_parallel_norms_unreduced_part_the_tp_ranks_replicas_at_step_0(runs, tmp_path, capsys):
    """Each TP rank's norms learn from its own chunk: the replica check names a norm weight whose copies differ
    between the TP ranks from step 0, by a whole Adam step (2 × lr: they moved apart), ahead of the curves."""
    folder, record = runs["bug_sp_norms_unreduced"]
    first = record["steps"][0]["replicas"]
    assert first["checked"] == 36 and first["parted"] >= 10  # the embedding's shard and the 5 norms', and moments:
    named = first["tensors"][0]  # most copies part (each TP rank clips by another norm), the norms by most
    assert named["name"].endswith("layernorm.weight") or named["name"] == "model.norm.weight"
    assert named["what"] == "parameter" and named["ranks"] in ([[0], [1]], [[2], [3]])  # a TP group's two ranks
    assert named["max_abs_diff"] == pytest.approx(2e-4, rel=1e-3)
    shutil.copy(folder / "loss_fsdp.json", tmp_path)
    shutil.copy(runs["ddp"][0] / "loss_ddp.json", tmp_path)
    assert plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")]) == 1
    summary = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"]["fsdp"]
    assert (summary["replicas_parted"]["step"], summary["replicas_parted"]["name"]) == (0, named["name"])
    tp0, tp1 = (r for (r,) in named["ranks"])
    assert f"replicas part at step 0: {named['name']} differs between rank {tp0} and rank {tp1}" in capsys.readouterr().out


def test_a_user_deepspeed_config_is_kept_under_the_flags_and_recorded(runs):
    """Its keys reach the engine; the keys the run's flags decide, which it omits, get the harness's values (the
    clipping --max_grad_norm asks, never DeepSpeed's default), and the record holds the file's content."""
    from parity.strategies.autotp.engine_config import engine_config
    from parity.run_config import RunConfig

    _, record = runs["deepspeed_user_config"]
    cfg = RunConfig.from_dict({k: record["config"][k] for k in RunConfig.__dataclass_fields__
                               if k in record["config"]})  # a replay's fields (optimizer, lr_schedule) are left out
    engine = engine_config(cfg)
    assert engine["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 500_000_000, "overlap_comm": False,
                                           "allgather_bucket_size": 50_000_000}
    assert (engine["gradient_clipping"], engine["train_micro_batch_size_per_gpu"], engine["tensor_parallel"]) == (
        1.0, 4, {"autotp_size": 2})
    assert record["config"]["options"]["deepspeed_config"]["config"] == USER_CONFIGS["deepspeed_user_config"]


def test_a_user_deepspeed_config_that_changes_the_numerics_fails_and_is_named(runs, tmp_path, capsys):
    """Gradients communicated in bf16 in an fp32 run: FAIL at step 0 on the grad norm, the config's key named
    beside it."""
    folder, _ = runs["bug_deepspeed_bf16_communication"]
    shutil.copy(folder / "loss_deepspeed.json", tmp_path)
    shutil.copy(runs["ddp"][0] / "loss_ddp.json", tmp_path)
    code = plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"]["deepspeed"]
    assert (code, summary["verdict"], summary["first_outside"]["step"]) == (1, "FAIL", 0), out
    assert "options.deepspeed_config.config.communication_data_type: – vs bf16" in out


def test_a_user_deepspeed_config_that_contradicts_a_flag_is_refused(tiny_weights, tmp_path):
    """DeepSpeed 0.19.3 made gradient_clipping 1.0 the default (#8068): a config that says 1.0 while the run says
    --max_grad_norm 0 is one line, before anything runs — as is every key the flags decide."""
    from parity.errors import ConfigError

    cases = [({"gradient_clipping": 1.0}, {"max_grad_norm": 0},
              "gradient_clipping 1.0 contradicts --max_grad_norm (0.0 for this run)"),
             ({"train_micro_batch_size_per_gpu": 2}, {}, "train_micro_batch_size_per_gpu 2 contradicts --batch_size / "
                                                        "--grad_accum_steps (4 for this run)"),
             ({"zero_optimization": {"stage": 3}}, {}, "zero_optimization.stage 3 contradicts --zero_stage (1 for this "
                                                     "run)"),
             ({"optimizer": {"type": "Adam"}}, {}, "sets \"optimizer\": the run's comes from the shared torch AdamW"),
             ({"bf16": {"enabled": True}}, {}, "asks for the bf16_params policy (bf16 parameters and gradients, fp32 "
                                              "master weights and Adam state) but --precision is fp32: pass --precision "
                                              "bf16_params")]
    for config, flags, message in cases:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        with pytest.raises(ConfigError) as raised:
            plan("deepspeed", {**SETTING, **TP2_DP2, "init_weights_path": tiny_weights, "loss_output_dir": tmp_path,
                               "storage_path": tmp_path, "deepspeed_config": str(path), **flags})
        assert str(raised.value).startswith(f"--deepspeed_config {path}") and message in str(raised.value)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        plan("deepspeed", {**SETTING, **TP2_DP2, "init_weights_path": tiny_weights, "loss_output_dir": tmp_path,
                           "storage_path": tmp_path, "deepspeed_config": str(path)})
