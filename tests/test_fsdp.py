"""FSDP2 + DTensor TP against DDP: fp32 parity in every layout, clipping across meshes, the two bf16 modes, the HF
checkpoint, bad input; and module outputs gathered to full size.

Every parity run uses **PARITY and global batch 4, so DDP's DP=2 × batch 2 run is the baseline of
TP=2×DP=2 × batch 2, TP=2×DP=1 × batch 4 and TP=1×DP=2 × batch 2 alike. The runs are conftest's shared ones:
FSDP's TP=2×DP=2 fp32 run and DDP's baseline through Ray Train, the other layouts, DDP clipped at 0.05 and the
bf16 runs in local gloo groups.
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import (CLIP, FP32_RTOL, REPO, TP_LAYOUT_ERRORS, assert_bf16_parity, assert_fp32_parity,
                      checkpoint_loss, free_port, series, to_argv, tp2_strategy, tp_flags)
from parity.errors import ConfigError
from parity.driver.config import resolve
from parity.driver.local_group import start_processes


@pytest.fixture(scope="module")
def tp2_dp2(fsdp_tp2_dp2):
    return fsdp_tp2_dp2


@pytest.fixture(scope="module")
def tp1_dp2(shared_runs):
    return shared_runs["fsdp_tp1_dp2"]


@pytest.fixture(scope="module")
def tp2_dp1_clipped(shared_runs):
    """TP=2×DP=1: gradients on two meshes, (dp=1, tp=2) and (dp=1,), all clipped at every step (at CLIP)."""
    return shared_runs["fsdp_tp2_dp1_clip"]


@pytest.fixture(scope="module")
def ddp_clipped(shared_runs):
    return shared_runs["ddp_clip"]


@pytest.fixture(scope="module")
def bf16_runs(shared_runs):
    """TP=2×DP=2 in both bf16 modes."""
    return {mode: shared_runs[f"fsdp_bf16_{mode}"] for mode in ("autocast", "policy")}


def test_tp2_dp2_fp32_matches_ddp(tp2_dp2, ddp_baseline):
    assert_fp32_parity(tp2_dp2, ddp_baseline)
    cfg = tp2_dp2["config"]
    assert (cfg["world_size"], cfg["tp_size"], cfg["dp_size"], cfg["backend"]) == (4, 2, 2, "gloo")
    # Each DP rank trains on DDP's rank's slice: the per-rank losses match too, not only their mean.
    for ours, theirs in zip(tp2_dp2["steps"], ddp_baseline["steps"]):
        assert ours["dp_rank_losses"] == pytest.approx(theirs["dp_rank_losses"], rel=FP32_RTOL)


def test_tp1_dp2_pure_fsdp_fp32_matches_ddp(tp1_dp2, ddp_baseline):
    assert_fp32_parity(tp1_dp2, ddp_baseline)


def test_tp2_dp1_clipped_across_meshes_matches_ddp(tp2_dp1_clipped, ddp_clipped):
    """Every step clips, and the run matches DDP clipped the same way. Clipping barely moves the loss
    under Adam (a constant scale cancels in m/√v) but moves the final parameters by far more than their
    tolerance (docs/tolerances.md), so the parameter check is what would catch a missed clip."""
    assert all(norm > CLIP for norm in series(tp2_dp1_clipped, "grad_norm"))
    assert tp2_dp1_clipped["config"]["max_grad_norm"] == ddp_clipped["config"]["max_grad_norm"] == CLIP
    assert_fp32_parity(tp2_dp1_clipped, ddp_clipped)


@pytest.mark.parametrize("mode,precision", [("autocast", "bf16"), ("policy", "bf16_params")])
def test_bf16_matches_ddp_in_its_policy(bf16_runs, shared_runs, ddp_baseline, mode, precision):
    """--mixed_precision autocast is the bf16 policy, policy is bf16_params reducing in fp32: each against DDP in the
    same policy."""
    run = bf16_runs[mode]
    assert (run["config"]["precision"], run["config"]["reduce_dtype"]) == (precision, "fp32")
    assert run["config"]["options"] == {"mixed_precision": mode, "offload": "none", "param_dtype": None,
                                        "tp_plan": "default"}
    baseline = shared_runs["ddp_bf16" if mode == "autocast" else "ddp_bf16_params_fp32_reduce"]
    assert (baseline["config"]["precision"], baseline["config"]["reduce_dtype"]) == (precision, "fp32")
    assert_bf16_parity(run, baseline, ddp_baseline)


def test_hf_checkpoint_reproduces_the_final_loss(tp2_dp2):
    assert checkpoint_loss(tp2_dp2) == pytest.approx(tp2_dp2["final"]["eval_loss_last_batch"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Module outputs at full size: two gloo processes (TP=2×DP=1) without Ray, against a stock model
# ---------------------------------------------------------------------------------------------------

# Local shards: a colwise module with a bias, a colwise MLP input, the activation on the other one; already
# full: a rowwise output and a replicated norm.
HOOKED = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.act_fn",
          "model.layers.0.mlp.down_proj", "model.norm")


def record_outputs(model, to_full):
    """Each HOOKED module's output and output gradient, through `to_full(name, tensor)`."""
    recorded = {}

    def hook(name):
        def on_forward(module, args, output):
            recorded[name] = to_full(name, output.detach()).clone()
            output.register_hook(lambda grad: recorded.__setitem__(f"{name}.grad", to_full(name, grad).clone()))
        return on_forward

    for name in HOOKED:
        model.get_submodule(name).register_forward_hook(hook(name))
    return recorded


def forward_backward(model, batch):
    from conftest import mean_loss

    logits = model(input_ids=batch).logits
    mean_loss(logits, batch).backward()


def _tp_worker(rank, port, weights, batch, out_dir):
    with tp2_strategy("fsdp", rank, port, weights, {"mixed_precision": "autocast"}) as strategy:
        recorded = record_outputs(strategy.hf_model, strategy.full_module_output)
        forward_backward(strategy.hf_model, batch)
        torch.save({"outputs": recorded, "grads": strategy.full_gradients()}, os.path.join(out_dir, f"{rank}.pt"))


def test_full_module_outputs_and_gradients_match_a_stock_model(tiny_weights, tmp_path):
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    batch = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    start_processes(_tp_worker, (free_port(), tiny_weights, batch, str(tmp_path)), 2)

    reference = build_model(resolve_model_config("qwen2-tiny"), seed=0)
    load_init_weights(reference, tiny_weights)
    expected = record_outputs(reference, lambda name, t: t)
    forward_backward(reference, batch)
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert sorted(expected) == sorted(HOOKED + tuple(f"{n}.grad" for n in HOOKED))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["outputs"].keys() == expected.keys()
        for name, tensor in expected.items():  # shapes equal: a colwise shard was gathered, nothing else was
            torch.testing.assert_close(got["outputs"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        assert got["grads"].keys() == expected_grads.keys()  # HF names, tied lm_head once
        for name, grad in expected_grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _sequence_parallel_checkpoint_worker(rank, port, weights, directory):
    """Sequence parallelism at TP=2: three steps, save, a fourth step; a fresh strategy loads the checkpoint (the
    norms' (dp, tp) Replicate placements of this plan included) and takes the fourth step again, to the same bits."""
    import torch.distributed as dist

    from parity.training.data import Batch
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    generator = torch.Generator().manual_seed(1)
    batches = [Batch(ids, ids) for ids in (torch.randint(0, 2048, (4, 64), generator=generator) for _ in range(4))]
    with tp2_strategy("fsdp", rank, port, weights, {"tp_plan": "sequence_parallel"}) as strategy:
        def step(s, k):
            return s.train_step(batches[k], batches[k].loss_tokens, 1e-4)

        for k in range(3):
            step(strategy, k)
        strategy.save_state(directory)
        dist.barrier()
        first, params = step(strategy, 3), strategy.full_parameters()
        fresh = type(strategy)(strategy.cfg, strategy.ctx)
        model = build_model(resolve_model_config("qwen2-tiny"), seed=0)
        load_init_weights(model, weights)
        fresh.setup(model)
        fresh.load_state(directory)
        again = step(fresh, 3)
        assert (again.loss, again.grad_norm, again.param_norm) == (first.loss, first.grad_norm, first.param_norm)
        params_again = fresh.full_parameters()
        assert params.keys() == params_again.keys() and all(torch.equal(params[n], params_again[n]) for n in params)
        norm = dict(fresh.hf_model.named_parameters())["model.layers.0.input_layernorm.weight"]
        assert [p.is_replicate() for p in norm.placements] == [False, True]  # FSDP over dp, replicated over tp


def test_sequence_parallel_checkpoint_resumes_to_the_same_bits(tiny_weights, tmp_path):
    start_processes(_sequence_parallel_checkpoint_worker, (free_port(), tiny_weights, str(tmp_path)), 2)
    assert (tmp_path / "dcp" / ".metadata").exists()


# ---------------------------------------------------------------------------------------------------
# Bad input: one line before any worker starts
# ---------------------------------------------------------------------------------------------------

BAD = TP_LAYOUT_ERRORS + [
    ({"mixed_precision": "policy", "precision": "fp32"},
     r"--mixed_precision policy asks for the bf16_params policy \(.*\) but --precision is fp32: pass --precision "
     r"bf16_params"),
    ({"mixed_precision": "autocast", "param_dtype": "bf16"},
     r"--mixed_precision autocast with --param_dtype bf16: the two name different policies"),
    ({"mixed_precision": "autocast", "precision": "bf16_params"},
     r"--mixed_precision autocast is the bf16 policy \(autocast over fp32 parameters\) but --precision is bf16_params: "
     r"drop --mixed_precision"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m[:40] for _, m in BAD])
def test_resolve_rejects(tmp_path, tiny_weights, over, message):
    with pytest.raises(ConfigError, match=message):
        resolve("fsdp", tp_flags(tmp_path, tiny_weights, **over))


def test_good_input_resolves(tmp_path, tiny_weights):
    """--mixed_precision policy, from before the policies: bf16_params reducing in fp32, as it always did (alone, or
    refining --autocast / --precision bf16); --reduce_dtype bf16 with it still reduces in bf16."""
    cfg = resolve("fsdp", tp_flags(tmp_path, tiny_weights, mixed_precision="policy", autocast=True))
    assert (cfg.tp_size, cfg.dp_size, cfg.precision, cfg.reduce_dtype, cfg.grad_accum_dtype, cfg.options) == (
        2, 2, "bf16_params", "fp32", "fp32", {"mixed_precision": "policy", "offload": "none", "param_dtype": None,
                                              "tp_plan": "default"})
    assert cfg.experiment_name == "fsdp_tp2_dp2"
    alone = resolve("fsdp", tp_flags(tmp_path, tiny_weights, mixed_precision="policy", reduce_dtype="bf16"))
    assert (alone.precision, alone.reduce_dtype) == ("bf16_params", "bf16")
    default = resolve("fsdp", tp_flags(tmp_path, tiny_weights))
    assert default.options == {"mixed_precision": None, "offload": "none", "param_dtype": None, "tp_plan": "default"}
    assert (default.precision, default.reduce_dtype) == ("fp32", "fp32")


def test_script_prints_one_line_and_exits_2(tmp_path, tiny_weights):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train_fsdp.py"),
                           *to_argv(tp_flags(tmp_path, tiny_weights, mixed_precision="policy", precision="fp32"))],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": ""},
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --mixed_precision policy asks for the bf16_params policy (bf16 parameters and gradients, fp32 master "
        "weights and Adam state) but --precision is fp32: pass --precision bf16_params (or drop --precision), or change "
        "the setting"]
