"""Single-step layer verification on full tensors: every module output, output gradient, parameter
gradient and updated parameter of DeepSpeed and FSDP within 1e-5 relative of DDP — sharded layers
included, which is the regression test against seed 001 comparing a shard's norm with a full tensor's —
and a fault planted in one TP shard found as the first divergence, at exactly that module.

The checks run with --launcher local (the same recorded step in gloo processes of this machine): what they test
is the step's arithmetic, to which Ray adds nothing; the layer check through Ray Train, and its dumps equal to the
local ones bit for bit, is tests/test_custom_strategy.py's."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, to_argv
from parity.commands.layer_check import main as layer_check

FP32 = {"precision": "fp32", "device": "cpu", "seq_length": 64, "tp_size": 2, "launcher": "local"}
SHARDED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.act_fn")


def verify(out, **flags) -> int:
    return layer_check(to_argv({"output_dir": out, **FP32, **flags}))


def comparison(out) -> dict:
    with open(os.path.join(out, "layer_comparison.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tp2_dp1(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("verify_tp"))
    return out, verify(out, dp_size=1)


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("verify_tp_dp2"))
    return out, verify(out, dp_size=2)


def assert_full_tensor_parity(out: str, dp_size: int) -> None:
    result = comparison(out)
    pairs = {(p["run"], p["reference"]): p for p in result["pairs"]}
    assert set(pairs) == {("deepspeed", "ddp"), ("fsdp", "ddp"), ("fsdp", "deepspeed")}
    for pair in pairs.values():
        assert pair["verdict"] == "PASS" and pair["first_outside"] is None
        worst = max(pair["rows"], key=lambda r: r["rel"])
        assert worst["rel"] < 1e-5, f"{pair['run']} vs {pair['reference']}: {worst['key']} {worst['rel']:.3e}"
        kinds = {r["kind"] for r in pair["rows"]}
        assert kinds == {"output", "output_grad", "grad", "param"}
        assert len(pair["rows"]) == len(pairs[("deepspeed", "ddp")]["rows"])
    # Sharded layers are compared at full size: their outputs have the stock model's width.
    from safetensors import safe_open

    for strategy in ("ddp", "deepspeed", "fsdp"):
        with safe_open(os.path.join(out, f"dump_{strategy}.safetensors"), "pt") as f:
            for layer in SHARDED:
                width = 32 if layer.endswith(("k_proj", "v_proj")) else 64 if "self_attn" in layer else 256
                assert tuple(f.get_slice(f"output/model.layers.0.{layer}").get_shape()) == (2 * dp_size, 64, width)
                if layer != "mlp.act_fn":
                    assert f.get_slice(f"grad/model.layers.0.{layer}.weight").get_shape()[0] == width
            assert tuple(f.get_slice("output/lm_head").get_shape()) == (2 * dp_size, 64, 2048)
    runs = result["runs"]
    for strategy in ("deepspeed", "fsdp"):
        assert len(runs[strategy]["dp_rank_losses"]) == dp_size
        for got, want in zip(runs[strategy]["dp_rank_losses"], runs["ddp"]["dp_rank_losses"]):
            assert got == pytest.approx(want, rel=1e-5)


def test_tp2_dp1_every_tensor_matches_ddp(tp2_dp1):
    out, code = tp2_dp1
    assert code == 0
    assert_full_tensor_parity(out, dp_size=1)
    text = open(os.path.join(out, "layer_report.md")).read()
    assert "## Layer output norms" in text and "## Parameter gradient norms" in text and "layer_heatmap.png" in text
    assert open(os.path.join(out, "layer_heatmap.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_tp2_dp2_every_tensor_matches_ddp_per_dp_rank(tp2_dp2):
    out, code = tp2_dp2
    assert code == 0
    assert_full_tensor_parity(out, dp_size=2)
    losses = comparison(out)["runs"]["ddp"]["dp_rank_losses"]
    assert losses[0] != losses[1]  # the DP ranks really see different samples


def test_fault_in_one_tp_shard_is_the_first_divergence(tp2_dp1, tmp_path):
    """Perturb TP rank 0's rows of one up_proj weight in the FSDP run only: the verifier must FAIL that
    pair and name exactly that module's forward output as the first divergence."""
    src, _ = tp2_dp1
    out = str(tmp_path / "fault")
    os.makedirs(out)
    for name in ("init_weights.safetensors", "inputs.safetensors", "dump_ddp.safetensors", "dump_ddp.json"):
        shutil.copy(os.path.join(src, name), out)
    code = verify(out, dp_size=1, strategy="fsdp", perturb="fsdp:model.layers.1.mlp.up_proj.weight")
    assert code == 1
    (pair,) = comparison(out)["pairs"]
    assert (pair["run"], pair["reference"], pair["verdict"]) == ("fsdp", "ddp", "FAIL")
    assert pair["first_outside"]["module"] == "model.layers.1.mlp.up_proj"
    assert pair["first_outside"]["quantity"] == "forward output"
    rows = {r["key"]: r["rel"] for r in pair["rows"]}
    assert rows["output/model.layers.1.mlp.gate_proj"] < 1e-5 and rows["output/model.layers.1.mlp.up_proj"] > 1e-4


@pytest.fixture(scope="module")
def pipeline_and_sequence_parallel(tp2_dp1, tmp_path_factory):
    """The pipeline (2 stages, 1F1B, 2 micro-batches of one sample) and FSDP + TP=2 with sequence parallelism,
    recorded one after the other into a copy of the DDP step's folder."""
    src, _ = tp2_dp1
    out = str(tmp_path_factory.mktemp("verify_pp_sp"))
    for name in ("init_weights.safetensors", "inputs.safetensors", "dump_ddp.safetensors", "dump_ddp.json"):
        shutil.copy(os.path.join(src, name), out)
    codes = (verify(out, dp_size=1, strategy="fsdp", tp_plan="sequence_parallel"),
             verify(out, dp_size=1, strategy="pipeline"))
    return out, codes


def test_pipeline_stages_and_sequence_parallel_match_ddp_tensor_for_tensor(pipeline_and_sequence_parallel):
    """Every module output and output gradient of both pipeline stages (gathered from their ranks, the micro-batches
    concatenated), every parameter gradient (the tied embedding's summed over its two copies) and updated parameter
    within 1e-5 of DDP's; the same for FSDP's sequence-parallel plan, whose residual stream and norms are sequence
    shards (gathered to full size); forward order in stage order, backward order reversed."""
    out, codes = pipeline_and_sequence_parallel
    assert codes == (0, 0)
    result = comparison(out)
    pairs = {(p["run"], p["reference"]): p for p in result["pairs"]}
    assert set(pairs) == {("fsdp", "ddp"), ("pipeline", "ddp"), ("pipeline", "fsdp")}
    keys = {pair: {r["key"] for r in p["rows"]} for pair, p in pairs.items()}
    assert keys[("pipeline", "ddp")] == keys[("fsdp", "ddp")]
    assert {r["kind"] for r in pairs[("pipeline", "ddp")]["rows"]} == {"output", "output_grad", "grad", "param"}
    for pair in pairs.values():
        worst = max(pair["rows"], key=lambda r: r["rel"])
        assert (pair["verdict"], pair["first_outside"]) == ("PASS", None)
        assert worst["rel"] < 1e-5, f"{pair['run']} vs {pair['reference']}: {worst['key']} {worst['rel']:.3e}"
    meta = json.load(open(os.path.join(out, "dump_pipeline.json")))
    assert meta["pp_size"] == 2 and meta["options"]["microbatches"] == 2 and "pp_size" not in meta["options"]
    assert meta["forward_order"][0] == "model.embed_tokens" and meta["forward_order"][-1] == "lm_head"
    assert meta["forward_order"].index("model.layers.0") < meta["forward_order"].index("model.layers.1")
    assert meta["backward_order"].index("model.layers.1") < meta["backward_order"].index("model.layers.0")
    assert json.load(open(os.path.join(out, "dump_fsdp.json")))["options"]["tp_plan"] == "sequence_parallel"


# --- bf16: tolerances calibrated per tensor on DDP's step in fp32 ---------------------------------------

BF16 = {"precision": "bf16", "seq_length": 128}


@pytest.fixture(scope="module")
def tp2_dp1_bf16(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("verify_tp_bf16"))
    return out, verify(out, dp_size=1, **BF16)


def test_bf16_clean_runs_pass_the_calibrated_layer_check(tp2_dp1_bf16):
    out, code = tp2_dp1_bf16
    assert code == 0
    assert os.path.exists(os.path.join(out, "noise_reference_ddp.safetensors"))  # run by the check itself in bf16
    pairs = comparison(out)["pairs"]
    assert len(pairs) == 3
    for pair in pairs:
        assert (pair["verdict"], pair["calibrated"]) == ("PASS", True)
        assert pair["tolerance_source"].startswith("calibrated: 5 × each tensor's bf16 rounding")
        assert max(r["rel"] / r["tolerance"] for r in pair["rows"]) < 1
        assert max(r["rel"] for r in pair["rows"]) > 1e-3  # they really differ: bf16 rounding, not fp32


def test_bf16_fault_in_one_tp_shard_is_named_as_in_fp32(tp2_dp1_bf16, tmp_path):
    """The shard fault the fp32 test plants FAILs in bf16 too, at the same module and phase."""
    src, _ = tp2_dp1_bf16
    for name in ("init_weights.safetensors", "inputs.safetensors", "dump_ddp.safetensors", "dump_ddp.json",
                 "noise_reference_ddp.safetensors", "noise_reference_ddp.json"):
        shutil.copy(os.path.join(src, name), tmp_path)
    code = verify(str(tmp_path), dp_size=1, strategy="fsdp", perturb="fsdp:model.layers.1.mlp.up_proj.weight", **BF16)
    assert code == 1
    (pair,) = comparison(str(tmp_path))["pairs"]
    assert (pair["run"], pair["reference"], pair["verdict"], pair["calibrated"]) == ("fsdp", "ddp", "FAIL", True)
    assert pair["first_outside"]["module"] == "model.layers.1.mlp.up_proj"
    assert pair["first_outside"]["quantity"] == "forward output"


# --- bad input: one line, exit 2, no Ray -----------------------------------------------------------

def run_script(script, *args, env=None):
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_folder_with_weights_but_no_inputs(tmp_path):
    (tmp_path / "init_weights.safetensors").write_bytes(b"x")
    proc = run_script("run_verification.py", "--output_dir", str(tmp_path), "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} has init_weights.safetensors but no inputs.safetensors: a layer-check folder needs "
        f"both; use a fresh --output_dir (or delete init_weights.safetensors)"]


def test_dumps_from_different_inputs_are_refused(tp2_dp1, tmp_path):
    src, _ = tp2_dp1
    for strategy in ("ddp", "fsdp"):
        for ext in (".json", ".safetensors"):
            shutil.copy(os.path.join(src, f"dump_{strategy}{ext}"), tmp_path)
    meta = json.loads((tmp_path / "dump_fsdp.json").read_text())
    meta["inputs_sha256"] = "0" * 64
    (tmp_path / "dump_fsdp.json").write_text(json.dumps(meta))
    proc = run_script("compare_dumps.py", "--input_dir", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: dumps from different inputs: ddp and fsdp differ in inputs_sha256; "
                                   "rerun both with the same --output_dir")


def test_strategy_that_is_not_installed(tmp_path):
    """A deepspeed that cannot be imported (shadowed here the way a missing install fails) is one line."""
    (tmp_path / "deepspeed.py").write_text("raise ImportError(\"No module named 'deepspeed'\")\n")
    proc = run_script("run_verification.py", "--output_dir", str(tmp_path / "v"), "--strategy", "deepspeed",
                      "--device", "cpu", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: strategy deepspeed cannot be used: No module named 'deepspeed' "
                                   "(install the pinned set with pip install -r requirements.txt)")
    assert not (tmp_path / "v" / "init_weights.safetensors").exists()
