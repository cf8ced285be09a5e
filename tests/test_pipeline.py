"""Pipeline parallelism (pipeline_strategy.py) against DDP in fp32: every schedule (GPipe, 1F1B, interleaved 1F1B) at
P=2 stages' ranks × D=2 and × D=1, the same loss, grad norm and parameter norm at every step and the same final
model; the classic pipeline bug (the tied embedding's two copies never summed) FAILed by plot_loss_curves.py; a
checkpoint round trip; bad input, one line each.

The runs are the shared loop in local gloo groups (parity.driver.local_group), one group per world size, as in
test_techniques.py. Setting: qwen2-tiny with 4 decoder layers (interleaved 1F1B at P=2 has 4 stages), seq 64,
12 steps, lr 1e-4, fp32 (and a bf16 autocast run against DDP's bf16 run, a run on padded samples against DDP's on
them); global batch 4 = DDP's DP 2 × 2.
"""

import json
import os
import shutil

import pytest

from conftest import (FP32_RTOL, assert_replicas_held, assert_same_tensors_at_step_0, final_parameters, free_port,
                      max_abs_param_diff, max_rel_diff, series, tensor_norms_off)
from parity.calibration.bugs import PipelineTiedGradientsNotSummed
from parity.commands.compare_curves import main as plot_loss_curves
from parity.comparing.tolerances import final_parameters_atol_fp32
from parity.errors import ConfigError
from parity.driver.local_group import plan, run_group, start_processes
from parity.training.record import load_record, run_record_path

SETTING = {"model_name": "qwen2-tiny", "num_layers": 4, "seq_length": 64, "debug_steps": 12, "learning_rate": 1e-4,
           "log_interval": 12, "checkpoint_interval": 0, "precision": "fp32"}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# name → flags: each schedule at P=2 × D=2 (batch 2 per pipeline, 2 micro-batches of 1) and P=2 × D=1 (batch 4, 4
# micro-batches of 1); the seeded bug at P=2 × D=1.
RUNS = {**{f"{s}_p2_d2": {"num_workers": 4, "batch_size": 2, "pp_schedule": s, "microbatches": 2} for s in SCHEDULES},
        **{f"{s}_p2_d1": {"num_workers": 2, "batch_size": 4, "pp_schedule": s, "microbatches": 4} for s in SCHEDULES},
        "bug_tied_gradients_not_summed": {"num_workers": 2, "batch_size": 4, "pp_schedule": "1f1b", "microbatches": 2,
                                          "strategy_class": PipelineTiedGradientsNotSummed},
        "bf16_1f1b_p2_d1": {"num_workers": 2, "batch_size": 4, "pp_schedule": "1f1b", "microbatches": 2,
                            "precision": "bf16"},
        # padded samples: every micro-batch holds another number of loss tokens
        "padded_interleaved_1f1b_p2_d1": {"num_workers": 2, "batch_size": 4, "pp_schedule": "interleaved_1f1b",
                                          "microbatches": 4, "dataset": "synthetic_padded"}}
FP32_RUNS = [n for n in RUNS if not n.startswith(("bug_", "bf16_"))]
# The DDP runs (DP 2 × batch 2) the pipeline runs are held to: by default "ddp"; a run named <prefix>_... with a
# baseline of its own, "ddp_<prefix>".
BASELINES = {"ddp": {}, "ddp_bf16": {"precision": "bf16"}, "ddp_padded": {"dataset": "synthetic_padded"}}


def baseline_of(name: str) -> str:
    prefix = f"ddp_{name.split('_')[0]}"
    return prefix if prefix in BASELINES else "ddp"


@pytest.fixture(scope="module")
def weights4(tmp_path_factory):
    """qwen2-tiny's initial weights at 4 decoder layers (what train_ddp.py --num_layers 4 would save)."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    path = str(tmp_path_factory.mktemp("weights4") / "init_weights.pt")
    save_init_weights(build_model(resolve_model_config("qwen2-tiny", 4), seed=42), path)
    return path


@pytest.fixture(scope="module")
def runs(weights4, tmp_path_factory):
    """{name: (its folder, its record)}, the DDP baselines (BASELINES) among them."""
    root = tmp_path_factory.mktemp("pipeline")
    planned = {name: plan("ddp", {**SETTING, "num_workers": 2, "batch_size": 2, "init_weights_path": weights4,
                                  "loss_output_dir": root / name, "storage_path": root / "ray", "experiment_name": name,
                                  **flags})
               for name, flags in BASELINES.items()}
    for name, flags in RUNS.items():
        planned[name] = plan("pipeline", {**SETTING, **flags, "init_weights_path": weights4,
                                          "loss_output_dir": root / name, "storage_path": root / "ray",
                                          "experiment_name": name})
    for world in (2, 4):
        run_group([run for run in planned.values() if run[0].num_workers == world])
    return {name: (root / name, load_record(run_record_path(cfg))) for name, (cfg, _) in planned.items()}


@pytest.mark.parametrize("name", FP32_RUNS)
def test_each_schedule_and_layout_matches_ddp_in_fp32(runs, name):
    _, base = runs[baseline_of(name)]
    _, run = runs[name]
    assert run["config"]["init_weights_sha256"] == base["config"]["init_weights_sha256"]
    for key in ("batch_hash", "tokens", "lr"):
        assert series(run, key) == series(base, key), key
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(base, key)) < FP32_RTOL, key
    assert [len(s["dp_rank_losses"]) for s in run["steps"]] == [run["config"]["dp_size"]] * 12
    # the tied weight's two copies and their moments alike on both ends of each pipeline; at D=2 each stage's
    # parameters and moments too on both pipelines (4 layers of 12 parameters, and the final norm)
    assert_replicas_held(run, 3 if run["config"]["dp_size"] == 1 else 3 + 3 * (4 * 12 + 1))
    bound = final_parameters_atol_fp32(series(base, "lr"))
    assert max_abs_param_diff(final_parameters(run), final_parameters(base)) < bound
    assert run["final"]["eval_loss_last_batch"] == pytest.approx(base["final"]["eval_loss_last_batch"], rel=FP32_RTOL)
    # every tensor: the whole model's on every stage's rank (the tied weight once, as the embedding), its squares adding
    # up to the step's norms (measured ≤ 2.7e-16), each as DDP's at step 0
    assert max(tensor_norms_off(run)) < 1e-12
    assert_same_tensors_at_step_0(run, base)
    cfg = run["config"]
    assert (cfg["strategy"], cfg["tp_size"], cfg["pp_size"], cfg["dp_size"], cfg["world_size"], cfg["options"]) == (
        "pipeline", 1, 2, RUNS[name]["num_workers"] // 2, RUNS[name]["num_workers"],
        {"pp_schedule": RUNS[name]["pp_schedule"], "microbatches": RUNS[name]["microbatches"]})


def test_bf16_autocast_matches_ddps_bf16_run(runs):
    """--precision bf16: autocast in each stage's forward, as DDP's; within the short-run bf16 tolerances of DDP's bf16
    run, and really computed in bf16 (its grad norms are off the fp32 baseline's by far more than fp32 layouts are)."""
    from parity.comparing.tolerances import SHORT_RUN_BF16

    _, base = runs["ddp_bf16"]
    _, run = runs["bf16_1f1b_p2_d1"]
    assert series(run, "batch_hash") == series(base, "batch_hash") and run["config"]["precision"] == "bf16"
    assert max_rel_diff(series(run, "loss"), series(base, "loss")) < SHORT_RUN_BF16.loss
    assert max_rel_diff(series(run, "grad_norm"), series(base, "grad_norm")) < SHORT_RUN_BF16.grad_norm
    assert max_rel_diff(series(run, "grad_norm"), series(runs["ddp"][1], "grad_norm")) > 10 * FP32_RTOL
    assert max(tensor_norms_off(run)) < 1e-12  # every tensor's norms, of the gradients as autocast made them


def test_dp_rank_losses_are_each_pipelines_own(runs):
    """At D=2 each pipeline's loss is its own slice's, as DDP's ranks' are."""
    _, base = runs["ddp"]
    _, run = runs["1f1b_p2_d2"]
    assert max_rel_diff([x for s in run["steps"] for x in s["dp_rank_losses"]],
                        [x for s in base["steps"] for x in s["dp_rank_losses"]]) < FP32_RTOL


def test_tied_gradients_not_summed_fails(runs, tmp_path, capsys):
    """Each copy of the tied weight stepped with its own half of the gradient: plot_loss_curves.py FAILs it, from the
    first step, on the grad norm (the embedding's gradient alone is counted where DDP's has both parts)."""
    folder, _ = runs["bug_tied_gradients_not_summed"]
    shutil.copy(folder / "loss_pipeline.json", tmp_path)
    shutil.copy(runs["ddp"][0] / "loss_ddp.json", tmp_path)
    code = plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"]["pipeline"]
    assert (code, summary["verdict"]) == (1, "FAIL"), out
    assert (summary["first_outside"]["step"], summary["first_outside"]["quantity"]) == (0, "grad_norm"), out
    assert "strategy_class: None vs parity.calibration.bugs:PipelineTiedGradientsNotSummed" in out
    # ... and the replica check at the same step, naming the two copies that parted and where they are
    parted = summary["replicas_parted"]
    assert (parted["step"], parted["name"], parted["what"], parted["ranks"], parted["parted"]) == (
        0, "model.embed_tokens.weight", "parameter", [[0], [1]], 3)  # the weight and its two moments
    assert parted["max_abs_diff"] > 0 and "replicas part at step 0: model.embed_tokens.weight differs between rank 0 " \
        "and rank 1" in out


def test_a_correct_pipeline_passes_plot_loss_curves(runs, tmp_path, capsys):
    shutil.copy(runs["interleaved_1f1b_p2_d2"][0] / "loss_pipeline.json", tmp_path)
    shutil.copy(runs["ddp"][0] / "loss_ddp.json", tmp_path)
    code = plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "curve_comparison.json").read_text())["against_baseline"]["pipeline"]
    assert (code, summary["verdict"]) == (0, "PASS"), out


# --- checkpoints and the tied copies, on the strategy itself ------------------------------------------

def _round_trip_rank(rank: int, world: int, port: int, cfg_dict: dict, batches, directory: str) -> None:
    """Interleaved 1F1B at P=2 × D=1: the full gradients of one forward and backward, a stock model's; three steps;
    the tied copies equal on the first and the last stage; save; a fourth step; a fresh strategy loads the checkpoint
    and takes the fourth step again, to the same bits."""
    import torch
    import torch.distributed as dist

    from conftest import assert_checkpoint_resumes_bitwise, gloo_rank, train_step_at
    from parity.training.data import dp_slice
    from parity.training.loop import start_worker
    from parity.models.model import build_model, load_init_weights, model_config_from_dict
    from parity.training.strategy import loss_sum

    with gloo_rank(rank, world, port):
        s = start_worker({"cfg": cfg_dict}).strategy
        # full_gradients after one forward and backward: a stock model's on the same global batch (D=1: all of it)
        b = batches(0)
        s.forward_backward(dp_slice(b, 0, s.cfg.batch_size), b.loss_tokens)
        grads = s.full_gradients()
        s.optimizer.zero_grad(set_to_none=True)
        stock = build_model(model_config_from_dict(s.cfg.model_config), seed=0)
        load_init_weights(stock, s.cfg.init_weights_path)
        (loss_sum(stock(input_ids=b.input_ids).logits, b.labels) / b.loss_tokens).backward()
        reference = dict(stock.named_parameters())
        assert list(grads) == list(reference)  # Hugging Face names and order, the tied weight once
        for n, g in grads.items():
            assert float((g - reference[n].grad).norm() / reference[n].grad.norm()) < 1e-5, n
        for k in range(3):
            train_step_at(s, batches, k)
        hf = dict(s.hf_model.named_parameters())
        embed = hf["model.embed_tokens.weight"].detach().clone() if rank == 0 else \
            torch.empty_like(hf["lm_head.weight"])
        dist.broadcast(embed, src=0)
        if rank == world - 1:
            assert torch.equal(hf["lm_head.weight"], embed), "the tied copies parted"
        assert ("lm_head.weight" in hf) == (rank == world - 1) and ("model.embed_tokens.weight" in hf) == (rank == 0)
        params = assert_checkpoint_resumes_bitwise(s, cfg_dict, batches, directory, 3)
        assert "lm_head.weight" not in params and len(params) == 4 * 12 + 2  # the tied weight once


def test_checkpoint_round_trip_and_tied_copies(weights4, tmp_path):
    cfg, batches = plan("pipeline", {**SETTING, "num_workers": 2, "batch_size": 4, "pp_schedule": "interleaved_1f1b",
                                     "microbatches": 2, "init_weights_path": weights4, "loss_output_dir": tmp_path,
                                     "storage_path": tmp_path / "ray"})
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    start_processes(_round_trip_rank, (2, free_port(), cfg.to_dict(), batches, str(directory)), 2)
    assert sorted(os.listdir(directory)) == ["pipeline_pp_rank0.pt", "pipeline_pp_rank1.pt"]


# --- bad input ------------------------------------------------------------------------------------

BAD = [
    ({"num_workers": 3}, "--num_workers 3 is not a multiple of --pp_size 2 (num_workers = pp_size × dp_size): use "
                         "--num_workers 2 or 4"),
    ({"num_workers": 4, "dp_size": 3}, "--pp_size 2 × --dp_size 3 ≠ --num_workers 4: pass --num_workers 6 or "
                                       "--dp_size 2"),
    ({"num_layers": 2, "pp_schedule": "interleaved_1f1b"},
     "the model's 2 layers do not divide into the 4 stages of --pp_schedule interleaved_1f1b at --pp_size 2: use "
     "--num_layers 4 (a multiple of 4) or fewer stages"),
    ({"num_layers": 3}, "the model's 3 layers do not divide into the 2 stages of --pp_schedule 1f1b at --pp_size 2: "
                        "use --num_layers 2 (a multiple of 2) or fewer stages"),
    ({"microbatches": 1}, "--microbatches 1 does not fit --pp_schedule 1f1b at --pp_size 2, which needs at least one "
                          "per stage: use --microbatches 2 or more"),
    ({"microbatches": 5, "batch_size": 10, "pp_schedule": "interleaved_1f1b"},
     "--microbatches 5 does not fit --pp_schedule interleaved_1f1b at --pp_size 2, which needs whole rounds of "
     "max(1, microbatches // pp_size): use --microbatches 4 or 6"),
    ({"batch_size": 3}, "--batch_size 3 is not a multiple of --microbatches 2: each micro-batch is batch_size / "
                        "microbatches samples; use --batch_size 2 or another --microbatches"),
    ({"pp_size": 1}, "--pp_size 1: a pipeline has at least 2 ranks: use --pp_size 2 or more (or train_ddp.py for "
                     "none)"),
    ({"num_workers": 4, "tp_size": 2}, "pipeline does not shard tensors: --tp_size must be 1 (got 2)"),
    ({"grad_accum_steps": 2}, "--grad_accum_steps 2: the pipeline accumulates over its micro-batches: use "
                              "--microbatches (and --grad_accum_steps 1)"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_input_is_one_line(weights4, tmp_path, flags, message):
    with pytest.raises(ConfigError) as raised:
        plan("pipeline", {**SETTING, "num_workers": 2, "batch_size": 2, "init_weights_path": weights4,
                          "loss_output_dir": tmp_path, "storage_path": tmp_path, **flags})
    assert str(raised.value) == message


def test_train_pipeline_refuses_bad_input_before_any_worker(weights4, tmp_path, capsys):
    """Through the entry script's own path: one `error:` line on stderr, exit 2, nothing started."""
    from parity.commands.train import main

    code = main("pipeline", argv=["--model_name", "qwen2-tiny", "--num_layers", "4", "--num_workers", "2",
                                  "--microbatches", "3", "--init_weights_path", weights4,
                                  "--loss_output_dir", str(tmp_path), "--storage_path", str(tmp_path)])
    err = capsys.readouterr().err
    assert (code, err) == (2, "error: --batch_size 2 is not a multiple of --microbatches 3: each micro-batch is "
                              "batch_size / microbatches samples; use --batch_size 3 or another --microbatches\n")
