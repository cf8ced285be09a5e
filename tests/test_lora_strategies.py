"""LoRA (--lora_r) under the pipeline and transformers' own TP, at fp32 parity with DDP's LoRA run.

The pipeline splits the model with its adapters into stages (each stage steps its layers' adapters; the tied embedding
is frozen in both places); transformers' from_pretrained shards the base and peft places the adapters by its TP plan
(a colwise projection's lora_B colwise, a rowwise one's lora_A rowwise). Every run is the shared loop in one local gloo
group of 2 ranks: DDP at DP 2 the baseline; the pipeline at pp2 (1F1B with 2 micro-batches, GPipe with 4) and
transformers' TP at tp2 beside it, with the seeded bug of a transformers copy whose adapters keep peft's own draw; and
LoRA + packing where no other test packs (FSDP2 at DP 2, ZeRO-0, transformers' TP2), against DDP's packed run.
qwen2-tiny, adapters of rank 4 on the five projections transformers' plan shards colwise (q, k, v, gate, up: it refuses
rowwise ones at tp > 1), seq 64, 3 steps, lr 1e-4, global batch 8.
"""

import json
import shutil

import pytest

from conftest import FP32_RTOL, assert_lora_parity, lora_group
from parity.calibration.lora_bugs import TransformersAdaptersRedrawn

TARGETS = "q_proj,k_proj,v_proj,gate_proj,up_proj"  # the colwise ones: transformers refuses rowwise targets at tp > 1
SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 3, "learning_rate": 1e-4, "log_interval": 3,
           "checkpoint_interval": 0, "precision": "fp32", "batch_size": 4, "lora_r": 4, "lora_targets": TARGETS}
PP2 = {"num_workers": 2, "pp_size": 2, "batch_size": 8}
PACKED = {"packing": True}
RUNS = {  # name → (strategy, flags); "ddp" is the baseline
    "ddp": ("ddp", {"num_workers": 2}),
    "pipeline_1f1b": ("pipeline", PP2),
    "pipeline_gpipe": ("pipeline", {**PP2, "pp_schedule": "gpipe", "microbatches": 4}),
    "transformers_tp2": ("transformers", {"num_workers": 2, "tp_size": 2, "batch_size": 8}),
    "bug_transformers_redrawn": ("transformers", {"num_workers": 2, "tp_size": 2, "batch_size": 8,
                                                  "strategy_class": TransformersAdaptersRedrawn}),
    # LoRA + packing where no other test packs: each against DDP's packed run
    "ddp_packed": ("ddp", {"num_workers": 2, **PACKED}),
    "fsdp_dp2_packed": ("fsdp", {"num_workers": 2, **PACKED}),
    "zero0_packed": ("deepspeed", {"num_workers": 2, "zero_stage": 0, **PACKED}),
    "transformers_tp2_packed": ("transformers", {"num_workers": 2, "tp_size": 2, "batch_size": 8, **PACKED}),
}
CHECKED = [name for name in RUNS if name not in ("ddp", "ddp_packed") and not name.startswith("bug_")]


@pytest.fixture(scope="module")
def runs(tiny_weights, tmp_path_factory):
    """{name: (its folder, its record)}: the base is the shared tiny weights (copied: the adapters' file lies beside
    it), the adapters drawn once for the run's settings."""
    return lora_group(tmp_path_factory.mktemp("lora"), tiny_weights, SETTING, RUNS)


@pytest.mark.parametrize("name", CHECKED)
def test_each_strategy_trains_ddps_adapters_in_fp32(runs, name):
    """Against DDP's LoRA run (packed runs against DDP's packed one), at fp32 parity step by step, the replicas held,
    the teacher-forced step within 1e-5 (assert_lora_parity); the tensor series name the adapters alone."""
    ours, _ = assert_lora_parity(runs, name, "ddp_packed" if name.endswith("_packed") else "ddp")
    assert all(".lora_" in n for n in ours.names) and len(ours.names) == 2 * 5 * 2
    assert runs[name][1]["config"]["packing"] == name.endswith("_packed")


def compared(runs, names, folder, capsys) -> tuple[int, str, dict]:
    """plot_loss_curves.py over the records of the runs `names` (DDP's among them), as a user runs it on one folder:
    (its exit code, its output, the summary against the baseline)."""
    from parity.commands.compare_curves import main as plot_loss_curves

    for name in names:
        shutil.copy(next(runs[name][0].glob("loss_*.json")), folder)
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "c.png")])
    summary = json.loads((folder / "curve_comparison.json").read_text())["against_baseline"]
    return code, capsys.readouterr().out, summary


def test_all_strategies_pass_together_against_ddp(runs, tmp_path, capsys):
    """plot_loss_curves.py over DDP's LoRA record and the pipeline's and transformers' TP's: PASS, exit 0."""
    code, out, summary = compared(runs, ("ddp", "pipeline_1f1b", "transformers_tp2"), tmp_path, capsys)
    assert code == 0 and {s["verdict"] for s in summary.values()} == {"PASS"} and len(summary) == 2, out


def test_adapters_redrawn_by_peft_fail_at_step_0(runs, tmp_path, capsys):
    """The seeded bug: transformers' copy keeps peft's own draw of lora_A. Its loss at step 0 is the base's, DDP's to
    rounding (lora_B starts at 0 either way); its grad norm is another from step 0: plot_loss_curves.py FAILs it
    there and names the copy."""
    code, out, summary = compared(runs, ("ddp", "bug_transformers_redrawn"), tmp_path, capsys)
    found = summary["transformers"]
    assert (code, found["verdict"]) == (1, "FAIL"), out
    assert (found["first_outside"]["step"], found["first_outside"]["quantity"]) == (0, "grad_norm"), found
    assert "strategy_class: None vs parity.calibration.lora_bugs:TransformersAdaptersRedrawn" in out
    _, bug = runs["bug_transformers_redrawn"]
    _, base = runs["ddp"]
    assert abs(bug["steps"][0]["loss"] / base["steps"][0]["loss"] - 1) < FP32_RTOL
