"""DDP through real Ray Train jobs: exact reruns, learning, the checkpoint; and layout independence at fp32 against
the same run at 1 × 4 in a local gloo group."""

import pytest
import torch

from conftest import checkpoint_loss, max_rel_diff, record_batches, series, stock_loss

STEPS = 50


@pytest.fixture(scope="module")
def ddp_runs(shared_runs):
    """DDP 2 × 2 and 2 × 2 again, 50 steps at the preset's lr, through Ray Train (conftest's RAY_RUNS), and 1 × 4 (its
    LOCAL_RUNS)."""
    return {name: shared_runs[f"ddp_{name}"] for name in ("two", "one", "rerun")}


def test_one_worker_batch4_equals_two_workers_batch2(ddp_runs):
    one, two = ddp_runs["one"], ddp_runs["two"]
    assert series(one, "batch_hash") == series(two, "batch_hash")
    assert series(one, "tokens") == series(two, "tokens") == [4 * 63] * STEPS  # full windows: 63 next tokens each
    assert one["config"]["init_weights_sha256"] == two["config"]["init_weights_sha256"]
    assert max_rel_diff(series(two, "loss"), series(one, "loss")) < 1e-5
    assert max_rel_diff(series(two, "grad_norm"), series(one, "grad_norm")) < 1e-5
    assert all(len(s["dp_rank_losses"]) == 2 for s in two["steps"])
    assert all(len(s["dp_rank_losses"]) == 1 for s in one["steps"])


def test_each_dp_rank_trains_on_its_rows_of_the_global_batch(ddp_runs, tiny_weights):
    """Step 0, before any update: DP rank r's loss is a stock model's loss on rows [2r, 2r+2) of that step's
    global batch, and the recorded loss is the stock model's loss on the whole batch."""
    from parity.training.data import batch_hash
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    model = build_model(resolve_model_config("qwen2-tiny"), seed=0).eval()
    load_init_weights(model, tiny_weights)
    two, one = ddp_runs["two"], ddp_runs["one"]
    batch = record_batches(two)(0)
    assert batch_hash(batch) == two["steps"][0]["batch_hash"]
    for rank in (0, 1):
        expected = stock_loss(model, batch.rows(2 * rank, 2 * rank + 2))
        assert two["steps"][0]["dp_rank_losses"][rank] == pytest.approx(expected, rel=1e-5)
    whole = stock_loss(model, batch)
    assert two["steps"][0]["loss"] == pytest.approx(whole, rel=1e-5)
    assert one["steps"][0]["dp_rank_losses"] == pytest.approx([whole], rel=1e-5)


def test_rerun_reproduces_losses_exactly(ddp_runs):
    assert series(ddp_runs["rerun"], "loss") == series(ddp_runs["two"], "loss")
    assert series(ddp_runs["rerun"], "grad_norm") == series(ddp_runs["two"], "grad_norm")


def test_tiny_model_learns_the_synthetic_text(ddp_runs):
    losses = series(ddp_runs["two"], "loss")
    assert losses[0] == pytest.approx(torch.log(torch.tensor(2048.0)).item(), abs=0.3)  # starts near ln(vocab)
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0  # and falls by a clear margin (more than 2 nats)


def test_record_schema_and_completion(ddp_runs):
    rec = ddp_runs["two"]
    assert rec["strategy"] == "ddp" and rec["complete"] is True and len(rec["steps"]) == STEPS
    cfg = rec["config"]
    assert (cfg["world_size"], cfg["tp_size"], cfg["dp_size"], cfg["precision"], cfg["backend"]) == (2, 1, 2, "fp32", "gloo")
    fp = cfg["fingerprint"]
    assert {"python", "torch", "transformers", "ray", "deepspeed"} <= set(fp["versions"])
    assert fp["strategy_code"]["files"] == ["ddp_strategy.py"] and len(fp["shared_code_sha256"]) == 64
    assert "bf16 matmuls:" in fp["device"]  # the CPU and its bf16 kernel path
    assert all(s["lr"] == 1e-3 and s["step_time_s"] > 0 and s["peak_memory_bytes"] > 0 for s in rec["steps"])


def test_hf_checkpoint_reproduces_the_final_loss(ddp_runs):
    rec = ddp_runs["two"]
    loss = checkpoint_loss(rec)
    assert loss == pytest.approx(rec["final"]["eval_loss_last_batch"], rel=1e-5)
    assert loss < rec["steps"][0]["loss"] - 2.0
