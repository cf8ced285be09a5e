"""DeepSpeed AutoTP + ZeRO against DDP: fp32 parity in every layout and ZeRO stage, bf16, the HF checkpoint;
module outputs and gradients gathered to full size; the engine config; bad input.

Every parity run uses **PARITY and global batch 4, so DDP's DP=2 × batch 2 run is the baseline of
TP=2×DP=2 × batch 2, TP=2×DP=1 × batch 4 and TP=1×DP=2 × batch 2 alike. The runs are conftest's shared ones:
DeepSpeed's TP=2×DP=2 fp32 run and DDP's baseline through Ray Train, the other layouts, stages and bf16 in
local gloo groups. At the default --max_grad_norm 1.0
every step of these runs clips (pre-clip norms 1.01–1.17), so the parameter checks cover DeepSpeed's
clipping too.
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import (FP32_RTOL, REPO, TINY, TP_LAYOUT_ERRORS, assert_bf16_parity, assert_fp32_parity,
                      checkpoint_loss, free_port, series, to_argv, tp2_strategy, tp_flags)
from parity.errors import ConfigError
from parity.driver.config import resolve
from parity.driver.local_group import start_processes


@pytest.fixture(scope="module")
def runs(shared_runs):
    """The fp32 layouts and ZeRO stages (conftest's shared runs: TP=2 × DP=2 × ZeRO-1 through Ray Train, the others
    in local gloo groups)."""
    return {name: shared_runs[f"deepspeed_{name}"] for name in ("tp2_dp2", "tp2_dp1", "tp1_dp2", "tp2_dp2_zero2",
                                                               "tp2_dp2_zero3")}


@pytest.fixture(scope="module")
def bf16_run(shared_runs):
    return shared_runs["deepspeed_bf16"]


@pytest.mark.parametrize("name", ["tp2_dp2", "tp2_dp1", "tp1_dp2", "tp2_dp2_zero2", "tp2_dp2_zero3"])
def test_fp32_matches_ddp(runs, ddp_baseline, name):
    run = runs[name]
    assert_fp32_parity(run, ddp_baseline)
    assert all(norm > run["config"]["max_grad_norm"] for norm in series(run, "grad_norm"))  # every step clipped
    if run["config"]["dp_size"] == ddp_baseline["config"]["dp_size"]:
        # Each DP rank trains on DDP's rank's slice: the per-rank losses match too, not only their mean.
        for ours, theirs in zip(run["steps"], ddp_baseline["steps"]):
            assert ours["dp_rank_losses"] == pytest.approx(theirs["dp_rank_losses"], rel=FP32_RTOL)


def test_record_describes_the_run(runs):
    cfg = runs["tp2_dp2"]["config"]
    assert runs["tp2_dp2"]["strategy"] == "deepspeed" and runs["tp2_dp2"]["complete"] is True
    assert (cfg["world_size"], cfg["tp_size"], cfg["dp_size"], cfg["backend"]) == (4, 2, 2, "gloo")
    assert cfg["options"] == {"zero_stage": 1, "bf16_master_weights": False, "offload_optimizer": "none",
                              "offload_param": "none", "reduce_bucket_size": 500_000_000, "deepspeed_config": None}
    assert runs["tp2_dp2_zero3"]["config"]["options"]["zero_stage"] == 3
    helpers = sorted(os.path.relpath(os.path.join(d, f), REPO).replace(os.sep, "/")  # its helper package, by place
                     for d, _, files in os.walk(os.path.join(REPO, "parity", "strategies", "autotp"))
                     for f in files if f.endswith(".py"))
    assert helpers and cfg["fingerprint"]["strategy_code"]["files"] == ["autotp_strategy.py", *helpers]


def test_bf16_matches_ddp_bf16(bf16_run, ddp_baseline_bf16, ddp_baseline):
    assert (bf16_run["config"]["precision"], bf16_run["config"]["options"]["bf16_master_weights"]) == ("bf16", False)
    assert_bf16_parity(bf16_run, ddp_baseline_bf16, ddp_baseline)


def test_hf_checkpoint_reproduces_the_final_loss(runs):
    run = runs["tp2_dp2"]
    assert checkpoint_loss(run) == pytest.approx(run["final"]["eval_loss_last_batch"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Full size for the layer verification: two gloo processes (TP=2×DP=1) without Ray, against a stock model
# ---------------------------------------------------------------------------------------------------

def record_step(model, batch, forward, backward, to_full):
    """What parity.verify records of one forward/backward: every module's output and output gradient
    (its ModuleRecorder), through `to_full(name, tensor)`."""
    from conftest import mean_loss
    from parity.layer_check.layer_step import ModuleRecorder

    recorder = ModuleRecorder(model)
    backward(mean_loss(forward(batch), batch))
    records = recorder.remove()
    return {f"{kind}/{name}": to_full(name, t) for kind, store in (("output", records.outputs),
                                                                    ("output_grad", records.output_grads))
            for name, t in store.items()}


def _tp_worker(rank, port, weights, batch, out_dir):
    with tp2_strategy("deepspeed", rank, port, weights, {"zero_stage": 1, "bf16_master_weights": False}) as strategy:
        params = strategy.full_parameters()
        recorded = record_step(strategy.hf_model, batch, strategy.forward, strategy.backward,
                               strategy.full_module_output)
        torch.save({"recorded": recorded, "grads": strategy.full_gradients(), "params": params},
                   os.path.join(out_dir, f"{rank}.pt"))


def test_full_outputs_gradients_and_parameters_match_a_stock_model(tiny_weights, tmp_path):
    """Column-parallel outputs (q/k/v/gate/up, act_fn, the vocab-parallel lm_head) come back gathered,
    every other output as it is; gradients and parameters at full size under a stock model's names."""
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    batch = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    start_processes(_tp_worker, (free_port(), tiny_weights, batch, str(tmp_path)), 2)

    reference = build_model(resolve_model_config("qwen2-tiny"), seed=0)
    load_init_weights(reference, tiny_weights)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected = record_step(reference, batch, lambda ids: reference(input_ids=ids).logits, torch.Tensor.backward,
                           lambda name, t: t)
    assert "output/lm_head" in expected and "output_grad/model.layers.1.mlp.act_fn" in expected
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["recorded"].keys() == expected.keys()
        for name, tensor in expected.items():  # shapes equal: a column shard was gathered, nothing else was
            torch.testing.assert_close(got["recorded"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        assert got["grads"].keys() == initial.keys()  # HF names, the tied lm_head once
        for name, param in reference.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
            assert torch.equal(got["params"][name], initial[name]), name  # TP shards and ZeRO partitions reassembled


# ---------------------------------------------------------------------------------------------------
# The engine config: the precision policy and DDP's settings, as DeepSpeed is told them
# ---------------------------------------------------------------------------------------------------

def test_engine_config_carries_ddps_settings_and_the_precision_policy(tmp_path, tiny_weights):
    from parity.strategies.autotp.engine_config import engine_config

    fp32 = engine_config(resolve("deepspeed", tp_flags(tmp_path, tiny_weights, precision="fp32", max_grad_norm=0.5)))
    assert fp32 == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
                    "zero_optimization": {"stage": 1, "reduce_bucket_size": 500_000_000}, "wall_clock_breakdown": False,
                    "tensor_parallel": {"autotp_size": 2}}
    bf16 = engine_config(resolve("deepspeed", tp_flags(tmp_path, tiny_weights, autocast=True, zero_stage=2)))
    assert bf16["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert "bf16" not in bf16 and bf16["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 500_000_000}
    master = engine_config(resolve("deepspeed", tp_flags(tmp_path, tiny_weights, precision="bf16",
                                                      bf16_master_weights=True)))
    assert master["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert "torch_autocast" not in master
    pure_zero = engine_config(resolve("deepspeed", tp_flags(tmp_path, tiny_weights, num_workers=2, tp_size=1)))
    assert "tensor_parallel" not in pure_zero and "zero_force_ds_cpu_optimizer" not in pure_zero
    offload = engine_config(resolve("deepspeed", tp_flags(tmp_path, tiny_weights, zero_stage=3, offload_optimizer="cpu",
                                                       offload_param="cpu", device="cpu")))
    assert offload["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 500_000_000,
                                            "stage3_param_persistence_threshold": 0,
                                            "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                            "offload_param": {"device": "cpu", "pin_memory": False}}
    assert offload["zero_force_ds_cpu_optimizer"] is False  # keeps the client torch AdamW


# ---------------------------------------------------------------------------------------------------
# Bad input: one line before any worker starts
# ---------------------------------------------------------------------------------------------------

BAD = TP_LAYOUT_ERRORS + [
    ({"bf16_master_weights": True, "precision": "fp32"},
     r"--bf16_master_weights asks for the bf16_pure policy \(bf16 parameters, gradients, master weights and Adam "
     r"state\) but --precision is fp32: pass --precision bf16_pure"),
    ({"bf16_master_weights": True, "precision": "bf16_params"},
     r"--bf16_master_weights asks for the bf16_pure policy .* but --precision is bf16_params"),
    ({"bf16_master_weights": True, "precision": "bf16", "offload_optimizer": "cpu"},
     r"the bf16_pure policy with --offload_optimizer cpu: DeepSpeed keeps bf16 master weights in host memory only "
     r"with its DeepSpeedCPUAdam, not the shared torch AdamW: drop one of the two"),
    ({"precision": "bf16", "reduce_dtype": "bf16"},
     r"--reduce_dtype bf16 in the bf16 \(autocast\) policy: DeepSpeed's torch_autocast reduces only its "
     r"lower_precision_safe_modules' gradients in bf16"),
    ({"offload_param": "cpu"}, r"--offload_param cpu needs --zero_stage 3 .* pass --zero_stage 3, or use "
                               r"--offload_optimizer cpu"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m[:40] for _, m in BAD])
def test_resolve_rejects(tmp_path, tiny_weights, over, message):
    with pytest.raises(ConfigError, match=message):
        resolve("deepspeed", tp_flags(tmp_path, tiny_weights, **over))


def test_good_input_resolves(tmp_path, tiny_weights):
    """--bf16_master_weights, from before the policies, names bf16_pure, one of the bf16 policies: with --autocast (bf16)
    it is that policy; alone too."""
    cfg = resolve("deepspeed", tp_flags(tmp_path, tiny_weights, zero_stage=3, bf16_master_weights=True, autocast=True))
    assert (cfg.tp_size, cfg.dp_size, cfg.precision, cfg.reduce_dtype) == (2, 2, "bf16_pure", "bf16")
    assert resolve("deepspeed", tp_flags(tmp_path, tiny_weights, bf16_master_weights=True)).precision == "bf16_pure"
    zero0 = resolve("deepspeed", tp_flags(tmp_path, tiny_weights, zero_stage=0, precision="fp32"))
    assert zero0.options["zero_stage"] == 0  # runs: the harness takes the pre-clip norm where DeepSpeed reports none
    assert cfg.options == {"zero_stage": 3, "bf16_master_weights": True, "offload_optimizer": "none",
                           "offload_param": "none", "reduce_bucket_size": 500_000_000, "deepspeed_config": None}
    assert cfg.experiment_name == "deepspeed_tp2_dp2"
    default = resolve("deepspeed", tp_flags(tmp_path, tiny_weights))
    assert default.options == {"zero_stage": 1, "bf16_master_weights": False, "offload_optimizer": "none",
                               "offload_param": "none", "reduce_bucket_size": 500_000_000, "deepspeed_config": None}


def test_script_prints_one_line_and_exits_2(tmp_path, tiny_weights):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train_deepspeed.py"),
                           *to_argv(tp_flags(tmp_path, tiny_weights, offload_param="cpu"))],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": ""},
                          timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: --offload_param cpu needs --zero_stage 3")
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "loss" / "loss_deepspeed.json").exists()


def _linear_after_zero3(payload: dict) -> None:
    """The training loop's worker over a ZeRO-3 run, then which torch.nn.functional.linear the process holds."""
    from parity.training.loop import train_group_worker

    original = torch.nn.functional.linear
    train_group_worker(payload)
    cfg = payload["runs"][0]["cfg"]
    with open(os.path.join(cfg["loss_output_dir"], "linear.txt"), "w") as f:
        f.write(f"{torch.nn.functional.linear is original} {torch.nn.functional.linear.__name__}")


def test_a_zero3_run_leaves_torchs_linear_as_it_was_for_the_next_run_in_its_group(tmp_path, tiny_weights):
    """DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear by its memory-efficient linear for the life of the
    process; the next run of a worker group (the benchmark's FSDP2 after ZeRO-3, a layer check's) would compute with
    it. The loop restores torch's own after each run (loop.torch_functions_kept)."""
    from parity.driver.local_group import launch_local, plan

    cfg, batches = plan("deepspeed", {**TINY, "debug_steps": 1, "num_workers": 1, "batch_size": 2, "zero_stage": 3,
                                      "init_weights_path": tiny_weights, "loss_output_dir": tmp_path,
                                      "storage_path": tmp_path / "ray", "checkpoint_interval": 0})
    launch_local([cfg], [{"batches": batches}], worker=_linear_after_zero3)
    assert (tmp_path / "linear.txt").read_text() == "True linear"  # (without: "False zero3_linear_wrap")


def test_deepspeed_is_imported_without_the_mlflow_its_autotuner_would_import():
    """DeepSpeed's autotuner imports mlflow where it is installed (1.8 s of DeepSpeed's 2.3 s import here, in the
    driver and in every DeepSpeed worker), to log tuning training never runs: import_deepspeed leaves it out, and a
    tracker that imports mlflow afterwards gets it whole."""
    code = ("import sys, torch\n"
            "from parity.deepspeed_import import import_deepspeed\n"
            "deepspeed = import_deepspeed(torch.device('cpu'))\n"
            "from deepspeed.autotuning import autotuner\n"
            "print('mlflow' in sys.modules, autotuner.has_mlflow)\n"
            "import mlflow\n"
            "print(callable(mlflow.start_run))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True"]
