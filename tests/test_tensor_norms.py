"""Every trainable tensor's gradient and parameter norm at every step (parity/training/tensor_norms.py): each strategy
and each recorder layout hands over its pieces, each counted on one rank, so that each step's squares add up to the
step's own global norms — the pre-clip grad norm the strategy clips by and the parameter norm after its step.

The strategies are held to it in the runs the suite makes anyway: here the session's shared runs (DDP, a user's
hand-written DP, DeepSpeed AutoTP + ZeRO-1/2/3, FSDP2 ± TP, in fp32 and bf16), elsewhere each module's own
(test_pipeline, test_moe, test_precision; the recorders' layouts in test_own_trainer*). Here too what no run covers: a
recorded loop with a frozen parameter (left out of the series) and a step whose gradients the recorder did not see."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import LOCAL_RUNS, RAY_RUNS, tensor_norms_off, tensor_series

# DeepSpeed's own pre-clip norm at ZeRO-1/2 (get_grad_norm_direct) sums float64 squares, then rounds the total to fp32:
# the float64 squares add up to it within fp32's half-ulp, 6e-8 (measured 2.6e-8–6.6e-8). At ZeRO-3 it stays float64.
FP32_ROUNDED = 1e-7
EXACT = 1e-12  # float64 sums of the same squares in another order (measured ≤ 3e-16)
CLEAN_SHARED = [name for name, (_, flags) in {**RAY_RUNS, **LOCAL_RUNS}.items()
                if "parity.calibration.bugs" not in str(flags.get("strategy_class"))]


@pytest.mark.parametrize("name", CLEAN_SHARED)
def test_every_strategys_tensors_add_up_to_its_own_norms(shared_runs, name):
    """Each shared run's series names the model's 26 trainable tensors (the tied lm_head once) — a LoRA run's 18: its
    adapters on 4 modules of 2 layers and the 2 layers' input_layernorm it also trains — and, at every step, the
    squares of their gradient norms add up to the step's pre-clip grad norm — the strategy's own, or DeepSpeed's at
    ZeRO-1/2, rounded to fp32 — and those of their parameter norms to the step's parameter norm."""
    strategy, flags = {**RAY_RUNS, **LOCAL_RUNS}[name]
    record = shared_runs[name]
    found = tensor_series(record)
    lora = "lora_r" in flags
    assert len(found.names) == (18 if lora else 26) and found.grad == "pre_clip"
    assert found.clip_coef == [None] * len(record["steps"]) and "lm_head.weight" not in found.names
    assert ("model.embed_tokens.weight" in found.names) != lora
    assert not lora or all(".lora_" in n or "input_layernorm.modules_to_save." in n for n in found.names)
    grad, param = tensor_norms_off(record)
    rounded = strategy == "deepspeed" and flags.get("zero_stage", 1) in (1, 2)
    assert grad < (FP32_ROUNDED if rounded else EXACT) and param < EXACT, (grad, param)


def test_a_frozen_parameter_is_left_out_and_an_unseen_steps_gradients_are_nan(tmp_path):
    """A hand-written loop (one rank, a group of one in this process) that freezes one bias and clips at 0.1: the
    series holds the three trainable tensors, pre-clip, their gradients' squares adding up to the recorded grad norm
    and their parameters' to the parameter norm (which counts what trains, as the harness's strategies: the frozen
    bias is the frozen check's); a step that calls
    after_step(grad_norm=) without before_step() holds NaN gradient norms, its parameter norms measured, and one line
    says so."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        model[0].bias.requires_grad_(False)
        frozen = float(model[0].bias.detach().double().norm())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        lines = []
        rec = ParityRecorder(str(tmp_path / "out"), name="frozen", model=model, optimizer=optimizer, max_grad_norm=0.1,
                             log=lines.append)
        ids = torch.randint(0, 4, (2, 8))
        for step in range(3):
            logits = model(torch.nn.functional.one_hot(ids, 4).float())
            logits.square().sum().backward()
            rec.micro_batch(ids, ids, logits)
            if step != 1:
                rec.before_step()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
            optimizer.step()
            optimizer.zero_grad()
            rec.after_step(grad_norm=norm if step == 1 else None)
        path = rec.close()
    finally:
        dist.destroy_process_group()
    record = json.loads(open(path).read())
    found = tensor_series(record, tmp_path / "out")
    assert found.names == ["0.weight", "1.weight", "1.bias"] and found.grad == "pre_clip"
    assert min(s["grad_norm"] for s in record["steps"]) > 1.0  # every step clipped: the series is the pre-clip one
    for k in (0, 2):
        total = math.sqrt(sum(x * x for x in found.grad_norm[k]))
        assert abs(total / record["steps"][k]["grad_norm"] - 1) < EXACT
    assert all(math.isnan(x) for x in found.grad_norm[1])
    for k, step in enumerate(record["steps"]):
        total = math.sqrt(sum(x * x for x in found.param_norm[k]))
        assert abs(total / step["param_norm"] - 1) < EXACT
        assert abs(math.sqrt(total ** 2 + frozen ** 2) / step["param_norm"] - 1) > 1e-3  # the bias is no part of it
    assert sum("tensors' gradient norms are NaN" in line for line in lines) == 1
    assert ("parity recorder [frozen]: step 1: the gradients were not seen at before_step() before clipping: its "
            "tensors' gradient norms are NaN, and so are any later step's that are not seen either") in lines, lines


def test_a_large_cpu_tensors_squares_in_float64_summed_rows_are_its_float64_squares():
    """squared_norm_fp64 of a CPU tensor of ROWS_FROM elements or more: fp32 rows of ROW elements, summed in float64 (24×
    faster at Qwen2.5-0.5B's widths) — within 1e-7 of the float64 reduction over a tensor whose elements span six
    decades, with a tail shorter than a row (1e-6 in bf16, read into fp32 rows); fp32 squares that underflow, overflow or are NaN are taken in float64."""
    from parity.training.optimizer import ROW, ROWS_FROM, squared_norm_fp64, squares_fp64

    g = torch.Generator().manual_seed(0)
    t = torch.randn(ROWS_FROM + ROW // 3, generator=g) * torch.logspace(-3, 3, ROWS_FROM + ROW // 3)
    exact = float(torch.linalg.vector_norm(t, dtype=torch.float64).square())
    assert abs(float(squared_norm_fp64(t)) / exact - 1) < 1e-7
    assert abs(float(squared_norm_fp64(t.bfloat16())) / float(t.bfloat16().double().square().sum()) - 1) < 1e-6  # 1.3e-7
    tiny = torch.full((ROWS_FROM,), 1e-25, dtype=torch.float64).float()
    assert abs(float(squared_norm_fp64(tiny)) / float(tiny.double().square().sum()) - 1) < 1e-9  # fp32 rows: 0
    assert float(squared_norm_fp64(torch.full((ROWS_FROM,), 1e20))) == pytest.approx(ROWS_FROM * 1e40, rel=1e-6)
    assert math.isnan(float(squared_norm_fp64(torch.cat([t, torch.tensor([math.nan])]))))
    small = torch.randn(64, 64, generator=g)
    both = squares_fp64([small, t])
    assert float(both[0]) == float(torch.linalg.vector_norm(small, dtype=torch.float64).square())
    assert float(both[1]) == float(squared_norm_fp64(t))
