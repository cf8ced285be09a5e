"""plot_loss_curves.py and parity/comparing/curves.py on hand-made loss records (no Ray): invariants before numbers,
statistics checked against values worked out by hand, tolerances, verdicts, the figure, bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from conftest import REPO
from parity.commands.compare_curves import main
from parity.comparing import tolerances
from parity.comparing.curves import compare, load_runs
from parity.comparing.figures import curve_figure
from parity.training.record import LossRecord, run_record_path
from parity.training.tensor_series import TensorSeriesWriter

SHA = "5" * 64
# What a run records of its code, libraries and device (parity/fingerprint.py), the same for every hand-made run.
FINGERPRINT = {"shared_code_sha256": "a" * 64, "strategy_code": {"sha256": "b" * 64, "files": ["x_strategy.py"]},
               "versions": {"python": "3.11.7", "torch": "2.13.0"}, "device": "a test CPU"}
MODEL = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 2048, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": True}
LR = 1e-3
TOKENS = 512
LAYOUT = {"ddp": (1, 2), "deepspeed": (2, 2), "fsdp": (2, 2)}
REPLICA_GROUPS = {"ddp": 78, "deepspeed": 62, "fsdp": 36}  # what qwen2-tiny's runs declare (tests/test_replicas.py)

# The hand-worked example: five steps, numbers exact in binary so the printed block is exact too.
DDP_LOSS = [10.0, 8.0, 6.0, 5.0, 4.0]
DDP_GRAD = [2.0, 1.5, 1.0, 0.5, 0.25]
FSDP_LOSS = [10.0, 8.0, 6.5, 5.0, 3.75]  # +0.5 at step 2, -0.25 at step 4
FSDP_GRAD = [2.0, 1.5, 1.25, 0.5, 0.25]  # +0.25 at step 2
# Every hand-made record's tensor series (parity/training/tensor_series.py): each tensor's gradient and parameter norm is
# this share of the step's global one — a norm weight's gradient (5e-3) above the verdict's floor, a k_proj bias's
# (1e-4) below it, as in qwen2-tiny.
TENSOR_SHARES = {"model.embed_tokens.weight": 0.8, "model.layers.0.self_attn.q_proj.weight": 0.6,
                 "model.layers.0.input_layernorm.weight": 0.005, "model.layers.0.self_attn.k_proj.bias": 1e-4}
TENSOR_SHARES["model.layers.0.self_attn.q_proj.weight"] = math.sqrt(0.36 - 0.005 ** 2 - 1e-4 ** 2)
# (each tensor's share of the step's grad norm: their squares add up to it, as a real run's — parity/comparing/clip_read.py)
NORM_WEIGHT = "model.layers.0.input_layernorm.weight"


def write_record(folder, strategy, losses, grad_norms=None, param_norms=None, *, precision="fp32", complete=True,
                 total_steps=None, config=None, step_fields=None, noise_reference=False, tensors=None,
                 tensors_why=None, gradient="pre_clip"):
    """A loss record written by the harness's own writers (parity/training/record.py, tensor_series.py), so the schema
    is the real one. `config` overrides config entries (a noise reference's layout: {"dp_size": 1}); `step_fields`
    maps step → fields to override in that step. Its tensor series (write_series): TENSOR_SHARES of each step's grad
    and parameter norms, `tensors` their factors by step and tensor (a bug confined to a tensor), of `gradient`
    ("pre_clip" or "clipped"); or none, where `tensors_why` says why."""
    tp, dp = (config or {}).get("tp_size", LAYOUT.get(strategy, (1, 2))[0]), (config or {}).get("dp_size", LAYOUT.get(strategy, (1, 2))[1])
    n = len(losses)
    cfg = {"strategy": strategy, "model_name": "qwen2-tiny", "num_workers": tp * dp, "tp_size": tp, "dp_size": dp,
           "seq_length": 128, "debug_steps": total_steps or n, "learning_rate": LR, "precision": precision,
           "device": "cpu", "max_grad_norm": 1.0, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
           "adam_epsilon": 1e-8, "world_size": tp * dp, "global_batch_size": 2 * dp, "total_steps": total_steps or n,
           "init_weights_sha256": SHA, "model_config": dict(MODEL), "loss_output_dir": str(folder),
           "noise_reference": noise_reference, "batch_size": 2, "options": {}, "storage_path": "/runs",
           "experiment_name": f"{strategy}_tp{tp}_dp{dp}", "fingerprint": FINGERPRINT, **(config or {})}
    record = LossRecord(run_record_path(SimpleNamespace(**cfg)), strategy, cfg)
    groups = REPLICA_GROUPS.get(strategy, 78)  # every step checked, every copy alike, unless step_fields say otherwise
    record.declare_replicas({"declared": True, "interval": 1, "groups": groups})
    for step, loss in enumerate(losses):
        fields = {"step": step, "loss": loss, "dp_rank_losses": [loss] * dp,
                  "grad_norm": (grad_norms or [1.0] * n)[step], "param_norm": (param_norms or [20.0] * n)[step],
                  "lr": LR, "tokens": TOKENS, "replicas": {"checked": groups, "parted": 0},
                  "batch_hash": f"{step:016x}", "step_time_s": 0.01, "peak_memory_bytes": 1 << 20}
        record.append(**{**fields, **(step_fields or {}).get(step, {})})
    write_series(record, tensors, tensors_why, gradient)
    if complete:
        record.finish(eval_loss_last_batch=losses[-1], eval_batch_step=n - 1, checkpoint_dir="/nowhere")
    else:
        record.write()
    return record.path


def write_series(record: LossRecord, tensors: dict | None = None, why: str | None = None,
                 gradient: str = "pre_clip") -> None:
    """The tensor series beside a hand-made `record` whose steps are all appended, by the harness's own writer: per step
    TENSOR_SHARES of its grad and parameter norms, `tensors` mapping step → {tensor: factor on its gradient norm, or
    (factor on its gradient norm, factor on its parameter norm)}; or none, where `why` says why."""
    series = TensorSeriesWriter(record, None if why else list(TENSOR_SHARES), gradient, why)
    for step in record.steps:
        factors = {name: f if isinstance(f, tuple) else (f, 1.0)
                   for name, f in (tensors or {}).get(step["step"], {}).items()}
        rows = [[step[key] * share * factors.get(name, (1.0, 1.0))[i] for name, share in TENSOR_SHARES.items()]
                for i, key in enumerate(("grad_norm", "param_norm"))]
        # the tensors' squares add up to the step's norm, as a real run's: a tensor's factor moves it by its share
        step["grad_norm"] = math.sqrt(sum(g * g for g in rows[0]))
        series.append(step["step"], *rows)
    series.flush()


def hand_example(folder):
    write_record(folder, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(folder, "deepspeed", DDP_LOSS, DDP_GRAD)
    write_record(folder, "fsdp", FSDP_LOSS, FSDP_GRAD)


def run_cli(capsys, folder, *extra, output="out/loss_curves.png"):
    """plot_loss_curves.py's main, in this process."""
    code = main(["--input_dir", str(folder), "--output", str(folder / output), *extra])
    out, err = capsys.readouterr()
    return code, out, err


HAND_BLOCK = """\
============================================================
LOSS CURVE STATISTICS
============================================================

DDP (TP=1, DP=2):
  Initial loss: 10.000000
  Final loss:   4.000000
  Min loss:     4.000000
  Mean loss:    6.600000

DeepSpeed (TP=2, DP=2):
  Initial loss: 10.000000
  Final loss:   4.000000
  Min loss:     4.000000
  Mean loss:    6.600000

FSDP (TP=2, DP=2):
  Initial loss: 10.000000
  Final loss:   3.750000
  Min loss:     3.750000
  Mean loss:    6.650000

------------------------------------------------------------
Differences from DDP baseline:

DeepSpeed (TP=2, DP=2):
  Max abs diff:  0.000000
  Mean abs diff: 0.000000
  Final diff:    0.000000

FSDP (TP=2, DP=2):
  Max abs diff:  0.500000
  Mean abs diff: 0.150000
  Final diff:    -0.250000

============================================================
GRAD NORM STATISTICS (before clipping)
============================================================

DDP (TP=1, DP=2):
  Initial grad norm: 2.000000
  Final grad norm:   0.250000
  Min grad norm:     0.250000
  Mean grad norm:    1.050000

DeepSpeed (TP=2, DP=2):
  Initial grad norm: 2.000000
  Final grad norm:   0.250000
  Min grad norm:     0.250000
  Mean grad norm:    1.050000

FSDP (TP=2, DP=2):
  Initial grad norm: 2.000000
  Final grad norm:   0.250000
  Min grad norm:     0.250000
  Mean grad norm:    1.100000

------------------------------------------------------------
Differences from DDP baseline:

DeepSpeed (TP=2, DP=2):
  Max abs diff:  0.000000
  Mean abs diff: 0.000000
  Final diff:    0.000000

FSDP (TP=2, DP=2):
  Max abs diff:  0.250000
  Mean abs diff: 0.050000
  Final diff:    0.000000

============================================================
PARAMETER NORM STATISTICS (after the step)
============================================================

DDP (TP=1, DP=2):
  Initial param norm: 20.000000
  Final param norm:   20.000000
  Min param norm:     20.000000
  Mean param norm:    20.000000

DeepSpeed (TP=2, DP=2):
  Initial param norm: 20.000000
  Final param norm:   20.000000
  Min param norm:     20.000000
  Mean param norm:    20.000000

FSDP (TP=2, DP=2):
  Initial param norm: 20.000000
  Final param norm:   20.000000
  Min param norm:     20.000000
  Mean param norm:    20.000000

------------------------------------------------------------
Differences from DDP baseline:

DeepSpeed (TP=2, DP=2):
  Max abs diff:  0.000000
  Mean abs diff: 0.000000
  Final diff:    0.000000

FSDP (TP=2, DP=2):
  Max abs diff:  0.000000
  Mean abs diff: 0.000000
  Final diff:    0.000000

============================================================
VERDICT (every step, each curve: |x - DDP| <= bound * |DDP|)
============================================================

Precision policy of every run: fp32 (fp32 everything; reduced over DP in fp32).
Bounds UNCALIBRATED: no noise reference in the folder, so the fixed table by precision applies \
(docs/tolerances.md); run the baseline again with --noise_reference at another layout to calibrate.
Baseline DDP (TP=1, DP=2): replicas: bit-identical at each of 5 checks (every step) of the 78 tensors held by \
several ranks each.

DeepSpeed (TP=2, DP=2): PASS
  rtol 1e-05 (loss), 0.0001 (grad norm), 1e-05 (param norm) from the fixed fp32 table (ddp fp32, deepspeed \
fp32); uncalibrated: no noise reference; max relative diff loss 0.000e+00, grad norm 0.000e+00, param norm \
0.000e+00; margin: exact (bit-identical)
  replicas: bit-identical at each of 5 checks (every step) of the 62 tensors held by several ranks each
  tensor verdict: PASS: 4 tensors' gradient and parameter norms within their bounds at each of 5 steps (bit-identical \
to DDP's; uncalibrated)
FSDP (TP=2, DP=2): FAIL
  rtol 1e-05 (loss), 0.0001 (grad norm), 1e-05 (param norm) from the fixed fp32 table (ddp fp32, fsdp fp32); \
uncalibrated: no noise reference; max relative diff loss 8.333e-02, grad norm 2.500e-01, param norm 0.000e+00; loss \
at 8.33e+03 × the bound that held
  replicas: bit-identical at each of 5 checks (every step) of the 36 tensors held by several ranks each
  tensor verdict: FAIL at step 2: model.embed_tokens.weight, phase gradient: its gradient norm 1.000000e+00 vs DDP \
8.000000e-01, deviation 2.500e-01 > bound 1.000e-03 (250 × its bound; uncalibrated)
    replay step 2 layer by layer from DDP's checkpoint: python run_verification.py --output_dir \
{folder}/replay_step_2 --replay /runs/ddp_tp1_dp2 --step 2 --strategy ddp fsdp --tp_size 2 --dp_size 2 \
--batch_size 2
  first step outside: step 2: loss 6.500000 vs DDP 6.000000, relative diff 8.333e-02 > 1.000e-05
  differs from the baseline in: nothing recorded

Fingerprints (shared code, strategy code or framework and script, libraries, device):
  loss_ddp.json: shared code aaaaaaaaaaaa, strategy code bbbbbbbbbbbb (x_strategy.py); python 3.11.7, torch 2.13.0; \
a test CPU
  loss_deepspeed.json: shared code aaaaaaaaaaaa, strategy code bbbbbbbbbbbb (x_strategy.py); python 3.11.7, torch \
2.13.0; a test CPU
  loss_fsdp.json: shared code aaaaaaaaaaaa, strategy code bbbbbbbbbbbb (x_strategy.py); python 3.11.7, torch 2.13.0; \
a test CPU
"""


# --- statistics ---------------------------------------------------------------------------------------

def test_statistics_of_the_hand_example(tmp_path):
    hand_example(tmp_path)
    c = compare(load_runs(str(tmp_path)))
    assert [r.name for r in c.runs] == ["ddp", "deepspeed", "fsdp"] and c.num_steps == 5
    fsdp_loss = c.curve_stats(c.runs[2], "loss")
    assert (fsdp_loss.initial, fsdp_loss.final, fsdp_loss.min) == (10.0, 3.75, 3.75)
    assert fsdp_loss.mean == pytest.approx(6.65, abs=1e-12)
    assert c.curve_stats(c.baseline, "grad_norm").mean == pytest.approx(1.05, abs=1e-12)
    deepspeed, fsdp = c.results
    assert fsdp.diffs["loss"].max_abs == 0.5 and fsdp.diffs["loss"].final == -0.25
    assert fsdp.diffs["loss"].mean_abs == pytest.approx(0.15, abs=1e-12)
    assert (fsdp.diffs["grad_norm"].max_abs, fsdp.diffs["grad_norm"].final) == (0.25, 0.0)
    assert fsdp.diffs["grad_norm"].mean_abs == pytest.approx(0.05, abs=1e-12)
    assert fsdp.verdict.max_rel_diff["loss"] == pytest.approx(0.5 / 6.0, rel=1e-12)
    assert (deepspeed.verdict.passed, deepspeed.verdict.max_rel_diff["loss"], fsdp.verdict.passed) == (True, 0.0, False)


def test_printed_block_and_outputs(tmp_path, capsys):
    hand_example(tmp_path)
    code, out, err = run_cli(capsys, tmp_path)
    assert (code, err) == (1, "")
    assert out == HAND_BLOCK.format(folder=tmp_path) + f"\nwrote {tmp_path}/out/loss_curves.png, {tmp_path}/out/curve_comparison.json, " \
                               f"{tmp_path}/out/curve_report.md, {tmp_path}/out/report.html\n"
    with open(tmp_path / "out" / "curve_comparison.json") as f:
        saved = json.load(f)
    assert (saved["baseline"], saved["num_steps"], saved["verdict"], saved["figure"]) == ("ddp", 5, "FAIL",
                                                                                          "loss_curves.png")
    assert saved["runs"]["fsdp"]["loss"] == {"initial": 10.0, "final": 3.75, "min": 3.75, "mean": 6.65}
    assert saved["runs"]["ddp"]["label"] == "DDP (TP=1, DP=2)"
    fsdp = saved["against_baseline"]["fsdp"]
    assert fsdp["verdict"] == "FAIL" and (fsdp["calibrated"], fsdp["noise_ratio"]) == (False, None)
    assert fsdp["tolerance_source"] == "the fixed fp32 table (ddp fp32, fsdp fp32); uncalibrated: no noise reference"
    assert fsdp["loss_diff"] == {"max_abs": 0.5, "mean_abs": 0.15, "final": -0.25}
    assert fsdp["first_outside"] == {"step": 2, "quantity": "loss", "value": 6.5, "reference": 6.0,
                                     "rel_diff": 0.5 / 6.0, "tolerance": 1e-5, "test": "step"}
    assert fsdp["max_rel_diff"]["grad_norm"] == 0.25
    assert saved["against_baseline"]["deepspeed"]["first_outside"] is None
    report = (tmp_path / "out" / "curve_report.md").read_text()
    assert "![Loss curves](loss_curves.png)" in report
    assert "| FSDP (TP=2, DP=2) | FAIL | uncalibrated | 8.333e-02 / 2.500e-01 / 0.000e+00 | " \
           "step 2, loss (step): 8.333e-02 > 1.000e-05 |" in report
    assert "| FSDP (TP=2, DP=2) | 10.000000 | 3.750000 | 3.750000 | 6.650000 |" in report
    assert "| FSDP (TP=2, DP=2) | 0.500000 | 0.150000 | -0.250000 |" in report
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".tmp")]  # atomic writes left nothing
    replay = saved["replay_commands"]["fsdp"]
    assert replay == (f"python run_verification.py --output_dir {tmp_path}/replay_step_2 --replay /runs/ddp_tp1_dp2 "
                      f"--step 2 --strategy ddp fsdp --tp_size 2 --dp_size 2 --batch_size 2")
    assert f"```bash\n{replay}\n```" in report


def test_the_replay_command_of_a_fail_is_one_the_layer_check_takes(tmp_path):
    """The printed command parses as run_verification.py's flags, the failing run's strategy options included."""
    import shlex

    from parity.commands.layer_check import build_parser
    from parity.comparing.curve_report import replay_command

    write_record(tmp_path, "ddp", DDP_LOSS)
    write_record(tmp_path, "deepspeed", FSDP_LOSS, config={"options": {"zero_stage": 3, "bf16_master_weights": False}})
    c = compare(load_runs(str(tmp_path)))
    argv = shlex.split(replay_command(c, c.results[0]))
    assert argv[:2] == ["python", "run_verification.py"]
    args = build_parser().parse_args(argv[2:])
    assert (args.replay, args.step, args.strategy, args.tp_size, args.dp_size, args.batch_size, args.zero_stage) == (
        "/runs/ddp_tp1_dp2", 2, ["ddp", "deepspeed"], 2, 2, 2, 3)
    assert not hasattr(args, "bf16_master_weights")


def test_command_line_script(tmp_path):
    """The script as a user runs it: exit codes and the printed block."""
    hand_example(tmp_path)
    args = [sys.executable, os.path.join(REPO, "plot_loss_curves.py"), "--input_dir", str(tmp_path),
            "--output", str(tmp_path / "curves.svg")]
    failing = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (failing.returncode, failing.stderr) == (1, "")
    assert failing.stdout.startswith(HAND_BLOCK.format(folder=tmp_path))
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD)
    passing = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert passing.returncode == 0
    assert "FSDP (TP=2, DP=2): PASS\n  rtol 1e-05 (loss), 0.0001 (grad norm), 1e-05 (param norm) from the fixed fp32 " \
           "table (ddp fp32, fsdp fp32); uncalibrated: no noise reference; max relative diff loss 0.000e+00, " \
           "grad norm 0.000e+00, param norm 0.000e+00; margin: exact (bit-identical)\n" in passing.stdout
    bad = subprocess.run(args[:2] + ["--input_dir", str(tmp_path / "none"), "--output", "x.png"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr == f"error: --input_dir {tmp_path}/none is not a directory\n"


# --- verdicts and tolerances --------------------------------------------------------------------------

def test_identical_curves_pass(tmp_path, capsys):
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD)
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 0
    assert "FSDP (TP=2, DP=2): PASS\n" in out


PARTED = {"checked": 36, "parted": 3, "tensors": [
    {"name": "model.norm.weight", "what": "parameter", "piece": "", "ranks": [[0, 2], [1, 3]], "max_abs_diff": 1.5e-7},
    {"name": "model.norm.weight", "what": "exp_avg", "piece": "", "ranks": [[0], [2], [1, 3]], "max_abs_diff": None}]}


def test_replicas_that_part_fail_ahead_of_the_curves_in_one_line(tmp_path, capsys):
    """Identical curves, and the run's check found copies parted from step 3: FAIL on integrity, the tensor, its ranks
    grouped by the bits they hold, the step, the max difference, how many parted; the curves' own answer beside it."""
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, step_fields={3: {"replicas": PARTED}, 4: {"replicas": PARTED}})
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1
    assert ("FSDP (TP=2, DP=2): FAIL\n"
            "  rtol 1e-05 (loss), 0.0001 (grad norm), 1e-05 (param norm) from the fixed fp32 table (ddp fp32, fsdp fp32); "
            "uncalibrated: no noise reference; max relative diff loss 0.000e+00, grad norm 0.000e+00, param norm 0.000e+00; "
            "margin: exact (bit-identical)\n"
            "  replicas part at step 3: model.norm.weight differs between ranks 0, 2 and ranks 1, 3 (max |difference| "
            "1.500e-07; 2 more tensors parted): its ranks no longer hold one model — FAIL before any tolerance\n"
            "  curves alone: within their bounds at every step\n"
            "  differs from the baseline in: nothing recorded\n") in out
    result = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())
    fsdp = result["against_baseline"]["fsdp"]
    assert (fsdp["verdict"], fsdp["first_outside"], result["verdict"]) == ("FAIL", None, "FAIL")
    assert {k: fsdp["replicas_parted"][k] for k in ("step", "name", "what", "ranks", "max_abs_diff", "parted")} == {
        "step": 3, "name": "model.norm.weight", "what": "parameter", "ranks": [[0, 2], [1, 3]], "max_abs_diff": 1.5e-7,
        "parted": 3}
    assert result["runs"]["fsdp"]["replica_checks"] == {"declared": True, "interval": 1, "groups": 36, "checks": 5}
    assert "| FSDP (TP=2, DP=2) | FAIL | uncalibrated; margin: exact (bit-identical) | 0.000e+00 / 0.000e+00 / 0.000e+00 " \
           "| replicas part at step 3: model.norm.weight |" in (tmp_path / "out" / "curve_report.md").read_text()
    # a moment first, held by three groups of ranks, one without a size in common: no difference to measure
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, step_fields={1: {"replicas": {**PARTED, "parted": 1,
                                                                                     "tensors": PARTED["tensors"][1:]}}})
    assert run_cli(capsys, tmp_path)[1].count("replicas part at step 1: model.norm.weight (exp_avg) differs between "
                                             "rank 0 and rank 2 and ranks 1, 3 (their sizes differ, or some do not hold "
                                             "it)") == 1


def test_a_noise_reference_whose_replicas_part_is_refused(tmp_path, capsys):
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "ddp", [x * (1 + 1e-7) for x in DDP_LOSS], DDP_GRAD, config={"tp_size": 1, "dp_size": 1},
                 noise_reference=True, step_fields={0: {"replicas": PARTED}})
    code, _, err = run_cli(capsys, tmp_path)
    assert code == 2
    assert err == ("error: not comparable: noise_reference_ddp_tp1_dp1_fp32.json (ddp, a noise reference): replicas "
                   "part at step 0: model.norm.weight differs between ranks 0, 2 and ranks 1, 3 (max |difference| "
                   "1.500e-07; 2 more tensors parted): a run whose own ranks no longer hold one model is no reference; "
                   "find why (docs/running.md#replicas) and run it again\n")


def test_first_step_outside_the_fp32_envelope(tmp_path, capsys):
    """Step 2 is off by 5e-6 relative (inside 1e-5), step 3 by 2e-5 (outside): step 3 is reported."""
    write_record(tmp_path, "ddp", DDP_LOSS)
    write_record(tmp_path, "fsdp", [10.0, 8.0, 6.00003, 5.0001, 4.0])
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1
    assert "  first step outside: step 3: loss 5.000100 vs DDP 5.000000, relative diff 2.000e-05 > " \
           "1.000e-05\n" in out


def test_a_gradient_scale_bug_fails_on_the_grad_norm(tmp_path, capsys):
    """AdamW hardly notices a doubled gradient, so the loss stays inside its envelope; the norm does not. A looser
    --grad_norm_tolerance lets the curve through, not the tensor verdict: every tensor's gradient doubled too."""
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, [2.0, 3.0, 2.0, 1.0, 0.5])
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1
    assert "first step outside: step 1: grad norm 3.000000 vs DDP 1.500000, relative diff 1.000e+00 > " \
           "1.000e-04\n" in out
    code, out, _ = run_cli(capsys, tmp_path, "--grad_norm_tolerance", "1.5")
    assert code == 1 and "uncalibrated: no noise reference; grad_norm --grad_norm_tolerance;" in out
    assert "  first step outside: step 1: model.embed_tokens.weight, phase gradient, outside its bound (the tensor " \
           "verdict above), whatever the curves say\n" in out
    assert "  tensor verdict: FAIL at step 1: model.embed_tokens.weight, phase gradient: its gradient norm " \
           "2.400000e+00 vs DDP 1.200000e+00, deviation 1.000e+00 > bound 1.000e-03 (1e+03 × its bound; " \
           "uncalibrated)\n" in out


@pytest.mark.parametrize("base_precision,run_precision,rel_diff,rtol,verdict", [
    ("fp32", "fp32", 1e-3, 1e-5, "FAIL"),  # fp32 pair: 1e-5
    ("fp32", "bf16", 1e-3, 3e-2, "POLICY DIFFERENCE"),  # another policy than the baseline's: not judged
    ("bf16", "fp32", 1e-3, 3e-2, "POLICY DIFFERENCE"),
    ("bf16", "bf16", 1e-3, 3e-2, "PASS"),
    ("bf16", "bf16", 5e-2, 3e-2, "FAIL"),
    ("bf16_params", "bf16_params", 1e-3, 3e-2, "PASS"),  # every low-precision policy has bf16's fixed row
    ("fp16", "fp16", 5e-2, 3e-2, "FAIL"),
])
def test_tolerance_from_precision(tmp_path, base_precision, run_precision, rel_diff, rtol, verdict):
    write_record(tmp_path, "ddp", DDP_LOSS, precision=base_precision)
    write_record(tmp_path, "fsdp", [x * (1 + rel_diff) for x in DDP_LOSS], precision=run_precision)
    (r,) = compare(load_runs(str(tmp_path))).results
    v = r.verdict
    bounds = r.bounds.per_step
    assert (bounds["loss"][0], bounds["grad_norm"][0], v.word) == (rtol, 1e-4 if rtol == 1e-5 else 1e-1, verdict)
    looser = "fp32" if base_precision == run_precision == "fp32" else "bf16"
    assert v.tolerance_source.startswith(f"the fixed {looser} table (ddp {base_precision}, fsdp {run_precision})")
    assert (v.first_outside.step if v.first_outside else None) == (0 if verdict == "FAIL" else None)
    assert v.policy_difference == ((f"precision: {base_precision} vs {run_precision}",)
                                   if base_precision != run_precision else ())


@pytest.mark.parametrize("factor", [65536.0 * 1.003, 3.0])
def test_a_recorded_grad_norm_a_power_of_two_over_the_replays_names_a_loss_scale(tmp_path, factor):
    """A recorded run whose step-0 grad norm is 2^16 × its replay's (to bf16 rounding): its FAIL's details name a loss
    scale left in the gradients the recorder read (GradScaler's, before_step() before unscale_); 3 × names none."""
    from parity.comparing.curve_report import verdict_details

    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "mine", DDP_LOSS, [g * factor for g in DDP_GRAD], config={"source": "recorder"})
    c = compare(load_runs(str(tmp_path)))
    (r,) = c.results
    assert r.verdict.word == "FAIL" and r.run.recorded
    hint = ("step 0's grad norm as read is 65536 × the replay's: the gradients before_step() read still held a loss "
            "scale (GradScaler's: call before_step() after scaler.unscale_(optimizer))")
    assert (hint in verdict_details(c, r)) == (factor > 3)


@pytest.mark.parametrize("precision", sorted(tolerances.CURVES))
@pytest.mark.parametrize("quantity", tolerances.QUANTITIES)
def test_the_tolerance_table_is_what_judges(tmp_path, precision, quantity):
    """Whatever the table says for a precision and a curve: half of it PASSes, twice it FAILs at step 1."""
    rtol = tolerances.CURVES[precision].of(quantity)
    for factor, word in ((0.5, "PASS"), (2.0, "FAIL")):
        folder = tmp_path / f"{factor}"
        folder.mkdir()
        write_record(folder, "ddp", DDP_LOSS, DDP_GRAD, precision=precision)
        moved = {"loss": list(DDP_LOSS), "grad_norm": list(DDP_GRAD), "param_norm": [20.0] * 5}
        moved[quantity][1] *= 1 + factor * rtol
        write_record(folder, "fsdp", moved["loss"], moved["grad_norm"], moved["param_norm"], precision=precision)
        (r,) = compare(load_runs(str(folder))).results
        assert r.verdict.word == word
        if word == "FAIL":
            assert (r.verdict.first_outside.step, r.verdict.first_outside.quantity) == (1, quantity)


def test_tolerance_override(tmp_path, capsys):
    write_record(tmp_path, "ddp", DDP_LOSS, precision="bf16")
    write_record(tmp_path, "fsdp", [x * 1.001 for x in DDP_LOSS], precision="bf16")
    assert run_cli(capsys, tmp_path)[0] == 0  # bf16: 1e-3 is inside 3e-2
    code, out, _ = run_cli(capsys, tmp_path, "--tolerance", "1e-4")
    assert code == 1
    assert "rtol 0.0001 (loss), 0.1 (grad norm), 0.01 (param norm) from the fixed bf16 table (ddp bf16, fsdp " \
           "bf16); uncalibrated: no noise reference; loss --tolerance;" in out
    assert "first step outside: step 0: loss 10.010000 vs DDP 10.000000, relative diff 1.000e-03 > 1.000e-04\n" in out
    code, out, _ = run_cli(capsys, tmp_path, "--tolerance", "2e-3")
    assert code == 0 and "max relative diff loss 1.000e-03, grad norm 0.000e+00, param norm 0.000e+00; margin 2.0× " \
        "(loss)\n" in out
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, tmp_path, "--tolerance", "-1")
    assert exc.value.code == 2
    assert "argument --tolerance: must be a finite number >= 0 (got -1)" in capsys.readouterr().err


def test_other_baseline(tmp_path, capsys):
    hand_example(tmp_path)
    code, out, _ = run_cli(capsys, tmp_path, "--baseline", "fsdp")
    assert code == 1
    assert "Differences from FSDP baseline:\n\nDDP (TP=1, DP=2):\n  Max abs diff:  0.500000\n" \
           "  Mean abs diff: 0.150000\n  Final diff:    0.250000\n" in out


def test_incomplete_runs_only_when_allowed(tmp_path, capsys):
    write_record(tmp_path, "ddp", DDP_LOSS)
    write_record(tmp_path, "fsdp", DDP_LOSS[:3], complete=False, total_steps=5)
    code, out, err = run_cli(capsys, tmp_path)
    assert (code, out) == (2, "")
    assert err == ("error: loss_fsdp.json is incomplete (3 of 5 steps: still running, or it stopped early): "
                   "pass --allow_incomplete to compare the steps done so far\n")
    code, out, err = run_cli(capsys, tmp_path, "--allow_incomplete")
    assert code == 0
    assert err == "warning: loss_fsdp.json is incomplete (3 of 5 steps): comparing the first 3 steps of every run\n"
    assert "DDP (TP=1, DP=2):\n  Initial loss: 10.000000\n  Final loss:   6.000000\n  Min loss:     6.000000\n" \
           "  Mean loss:    8.000000\n" in out


# --- not comparable -------------------------------------------------------------------------------------

NOT_COMPARABLE = [
    ({"step_fields": {3: {"batch_hash": "ffffffffffffffff"}}},
     "ddp and fsdp see different batches from step 3 (batch_hash 0000000000000003 vs ffffffffffffffff)"),
    ({"config": {"init_weights_sha256": "6" * 64}},
     "ddp and fsdp start from different initial weights (init_weights_sha256 555555555555… vs 666666666666…): "
     "train both from the same --init_weights_path"),
    ({"step_fields": {2: {"lr": 2e-3}, 3: {"lr": 2e-3}}},
     "ddp and fsdp use different learning rates from step 2 (lr 0.001 vs 0.002)"),
    ({"step_fields": {0: {"tokens": 1024}}},
     "ddp and fsdp train on different tokens per step from step 0 (tokens 512 vs 1024)"),
    ({"config": {"model_config": {**MODEL, "num_hidden_layers": 4}}},
     "ddp and fsdp train different models (num_hidden_layers: 2 vs 4)"),
    ({"config": {"max_grad_norm": 0.0}},
     "ddp and fsdp use different optimizer settings (max_grad_norm: 1.0 vs 0.0)"),
    ({"losses": DDP_LOSS[:4]}, "ddp has 5 steps, fsdp has 4: train both with the same --debug_steps"),
    ({"config": {"fingerprint": {**FINGERPRINT, "shared_code_sha256": "c" * 64}}},
     "loss_ddp.json and loss_fsdp.json ran other code (shared code aaaaaaaaaaaa vs cccccccccccc): rerun them with one "
     "harness and one set of libraries, or pass --allow_fingerprint_mismatch to compare them anyway"),
    ({"config": {"fingerprint": {**FINGERPRINT, "versions": {"python": "3.11.7", "torch": "2.14.1"}}}},
     "loss_ddp.json and loss_fsdp.json ran other code (torch 2.13.0 vs 2.14.1): rerun them with one harness and one "
     "set of libraries, or pass --allow_fingerprint_mismatch to compare them anyway"),
]


@pytest.mark.parametrize("change,message", NOT_COMPARABLE, ids=[m[:30] for _, m in NOT_COMPARABLE])
def test_not_comparable(tmp_path, capsys, change, message):
    write_record(tmp_path, "ddp", DDP_LOSS)
    change = dict(change)
    write_record(tmp_path, "fsdp", change.pop("losses", DDP_LOSS), **change)
    code, out, err = run_cli(capsys, tmp_path)
    assert (code, out) == (2, "")
    assert err == f"error: not comparable: {message}\n"
    assert not (tmp_path / "out" / "curve_comparison.json").exists()


def test_other_code_is_compared_only_when_asked(tmp_path, capsys):
    """Another strategy's code is what a comparison is for; other shared code is refused (above) unless the user
    asks, and then said on stderr, and every run's fingerprint is in the report."""
    write_record(tmp_path, "ddp", DDP_LOSS)
    write_record(tmp_path, "fsdp", DDP_LOSS, config={"fingerprint": {**FINGERPRINT, "shared_code_sha256": "c" * 64,
                                                                     "strategy_code": {"sha256": "d" * 64,
                                                                                       "files": ["fsdp_strategy.py"]}}})
    code, out, err = run_cli(capsys, tmp_path, "--allow_fingerprint_mismatch")
    assert code == 0
    assert err == ("warning: loss_ddp.json and loss_fsdp.json ran other code (shared code aaaaaaaaaaaa vs "
                   "cccccccccccc) (compared anyway: --allow_fingerprint_mismatch)\n")
    summary = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())
    assert summary["fingerprints"]["loss_fsdp.json"]["strategy_code"]["files"] == ["fsdp_strategy.py"]
    report = (tmp_path / "out" / "curve_report.md").read_text()
    assert "| loss_fsdp.json | `cccccccccccc` | strategy code dddddddddddd (fsdp_strategy.py) | python 3.11.7, torch " \
           "2.13.0 | a test CPU |" in report


def test_every_mismatch_is_reported(tmp_path, capsys):
    hand_example(tmp_path)
    write_record(tmp_path, "deepspeed", DDP_LOSS, config={"init_weights_sha256": "6" * 64})
    write_record(tmp_path, "fsdp", DDP_LOSS, step_fields={1: {"batch_hash": "ffffffffffffffff"}})
    code, _, err = run_cli(capsys, tmp_path)
    assert code == 2
    assert err.splitlines() == [
        "error: not comparable: ddp and deepspeed start from different initial weights (init_weights_sha256 "
        "555555555555… vs 666666666666…): train both from the same --init_weights_path",
        "error: not comparable: ddp and fsdp see different batches from step 1 (batch_hash 0000000000000001 vs "
        "ffffffffffffffff)"]


# --- bad input ------------------------------------------------------------------------------------------

def truncated(folder):
    write_record(folder, "ddp", DDP_LOSS)
    (folder / "loss_fsdp.json").write_text('{"schema_version": 1, "strategy": "fsdp", "steps": [{"step": 0, "lo')


def edited_fsdp(edit):
    """A setup: a ddp record, and an fsdp record that `edit(data)` changed after it was written."""
    def setup(folder):
        write_record(folder, "ddp", DDP_LOSS)
        path = write_record(folder, "fsdp", DDP_LOSS)
        with open(path) as f:
            data = json.load(f)
        edit(data)
        with open(path, "w") as f:
            json.dump(data, f)
    return setup


def two_fsdp_records(folder):
    write_record(folder, "ddp", DDP_LOSS)
    shutil.copy(write_record(folder, "fsdp", DDP_LOSS), folder / "loss_fsdp_old.json")


BAD_INPUT = [
    ("empty folder", lambda d: None, [], "error: no loss_*.json in {d}: run the train_*.py scripts with "
                                         "--loss_output_dir {d} first"),
    ("no baseline", lambda d: write_record(d, "fsdp", DDP_LOSS), [],
     "error: no baseline run 'ddp' in {d}: found fsdp; pass --baseline with one of them"),
    ("asked baseline missing", hand_example, ["--baseline", "megatron"],
     "error: no baseline run 'megatron' in {d}: found ddp, deepspeed, fsdp; pass --baseline with one of them"),
    ("only the baseline", lambda d: write_record(d, "ddp", DDP_LOSS), [],
     "error: only the baseline run (ddp) in {d}: nothing to compare it with"),
    ("truncated JSON", truncated, [],
     "error: loss_fsdp.json: not valid JSON (Unterminated string starting at: line 1, column 65); the file is "
     "malformed or truncated: rerun that strategy"),
    ("a step lacks a field", edited_fsdp(lambda data: data["steps"][1].pop("grad_norm")), [],
     "error: loss_fsdp.json: steps[1] lacks grad_norm"),
    ("config lacks a field", edited_fsdp(lambda data: data["config"].pop("init_weights_sha256")), [],
     "error: loss_fsdp.json: config lacks init_weights_sha256; not a loss record written by this harness"),
    ("no steps", edited_fsdp(lambda data: data["steps"].clear()), [],
     "error: loss_fsdp.json: has no steps; the run stopped before its first step: rerun it"),
    ("two records of one strategy", two_fsdp_records, [],
     "error: loss_fsdp.json and loss_fsdp_old.json are both fsdp runs: keep one of them in {d}"),
    ("precision without a tolerance", lambda d: (write_record(d, "ddp", DDP_LOSS, precision="fp8"),
                                                 write_record(d, "fsdp", DDP_LOSS, precision="fp8")), [],
     "error: loss_ddp.json: precision 'fp8' has no default tolerance (known: fp32, bf16, bf16_params, bf16_pure, "
     "fp16, fp16_autocast, bf16_base, bf16_base_autocast): pass --tolerance"),
]


@pytest.mark.parametrize("setup,extra,message", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input(tmp_path, capsys, setup, extra, message):
    setup(tmp_path)
    code, out, err = run_cli(capsys, tmp_path, *extra)
    assert (code, out) == (2, "")
    assert err == message.format(d=tmp_path) + "\n"


def test_unwritable_output_and_unknown_extension(tmp_path, capsys):
    hand_example(tmp_path)
    (tmp_path / "a_file").write_text("x")
    code, out, err = run_cli(capsys, tmp_path, output="a_file/curves.png")
    assert (code, out) == (2, "")
    assert err == (f"error: --output's directory {tmp_path}/a_file is not a writable directory (it is a file): "
                   f"choose a directory you can write to\n")
    code, out, err = run_cli(capsys, tmp_path, output="curves.jpg")
    assert (code, out) == (2, "")
    assert err == f"error: --output {tmp_path}/curves.jpg: unknown extension '.jpg': use .png, .svg, .pdf\n"


# --- the figure -----------------------------------------------------------------------------------------

def test_figure_panels(tmp_path):
    hand_example(tmp_path)
    fig = curve_figure(compare(load_runs(str(tmp_path))))
    loss, diff, grad, param = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "Loss", "Loss: relative difference from DDP", "Gradient norm (before clipping): relative difference from DDP",
        "Parameter norm (after the step): relative difference from DDP"]
    assert fig._suptitle.get_text() == "5 steps against DDP (TP=1, DP=2): FAIL (uncalibrated)"
    labels = ["DDP (TP=1, DP=2)", "DeepSpeed (TP=2, DP=2)", "FSDP (TP=2, DP=2)"]
    assert [line.get_label() for line in loss.get_lines()] == labels
    assert list(loss.get_lines()[2].get_ydata()) == FSDP_LOSS
    for ax in (diff, grad, param):
        assert [line.get_label() for line in ax.get_lines()] == labels[1:]
    assert list(diff.get_lines()[1].get_ydata()) == [0.0, 0.0, 0.5 / 6, 0.0, -0.25 / 4]
    assert list(grad.get_lines()[1].get_ydata()) == [0.0, 0.0, 0.25, 0.0, 0.0]
    band, failure = diff.collections  # the tolerance band, then the marker at FSDP's first failing step
    assert band.get_label() == "tolerance (bound)"
    assert band.get_paths()[0].get_extents().y1 == pytest.approx(1e-5)
    assert failure.get_label() == "FSDP: first outside (2, step)"
    assert failure.get_offsets().tolist() == [[2.0, 0.5 / 6]]
    assert (param.get_xlabel(), diff.get_ylabel()) == ("step", "(x − DDP) / |DDP|")


@pytest.mark.parametrize("name,check", [
    ("curves.png", lambda data: data[:8] == b"\x89PNG\r\n\x1a\n"),
    ("curves.svg", lambda data: ET.fromstring(data).tag == "{http://www.w3.org/2000/svg}svg"),
    ("curves.pdf", lambda data: data[:5] == b"%PDF-"),
])
def test_figure_formats(tmp_path, capsys, name, check):
    hand_example(tmp_path)
    assert run_cli(capsys, tmp_path, output=name)[0] == 1
    assert check((tmp_path / name).read_bytes())
    assert json.loads((tmp_path / "curve_comparison.json").read_text())["figure"] == name
