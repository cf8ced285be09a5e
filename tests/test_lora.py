"""LoRA adapters on a frozen base (--lora_r, parity/models/adapters.py) under every strategy that takes them, at fp32
parity with DDP's LoRA run; a calibrated bf16 PASS; the classic bugs of adapters seeded and caught at step 0; the final
model loaded by peft and, merged, by stock transformers.

qwen2-tiny, seq 64, 3 steps at lr 1e-3, adapters of rank 4 (alpha 8) on q_proj, v_proj (colwise under TP), o_proj and
down_proj (rowwise): every run is the shared loop in one local gloo group per world size (tests/policy_runs.py), each
judged run in a folder of its own beside its DDP baseline, as plot_loss_curves.py reads it.
"""

import json
import os

import pytest
import torch

from conftest import FP32_RTOL, assert_replicas_held, max_rel_diff, series
from parity.calibration.bugs import FSDPWeightDecayAdded
from parity.calibration.lora_bugs import DDPAdaptersUnreduced, FSDPAdapterScaleRankStabilised, FSDPBaseDecayed
from parity.commands.compare_curves import main as plot_loss_curves
from policy_runs import train_folders

TARGETS = "q_proj,v_proj,o_proj,down_proj"
LORA = {"lora_r": 4, "lora_targets": TARGETS}
SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": 3, "learning_rate": 1e-3, "log_interval": 3,
           "checkpoint_interval": 0, "precision": "fp32", "batch_size": 4, **LORA}
DP2 = {"num_workers": 2}
TP2 = {"num_workers": 2, "tp_size": 2, "batch_size": 8}
PACKING = {"packing": True}
BF16 = {"precision": "bf16"}
BASE = {"loss_ddp.json": ("ddp", DP2)}
BASE_PACKING = {"loss_ddp.json": ("ddp", {**DP2, **PACKING})}
BASE_BF16 = {"loss_ddp.json": ("ddp", {**DP2, **BF16}),
             "noise_reference_ddp_tp1_dp1_bf16.json": ("ddp", {"num_workers": 1, "batch_size": 8, **BF16,
                                                               "noise_reference": True}),
             "noise_reference_ddp_tp1_dp2_fp32.json": ("ddp", {**DP2, "noise_reference": True})}
CLEAN = {  # folder → (its baseline, the judged record's file, strategy, flags)
    "fsdp_tp2": (BASE, "loss_fsdp.json", "fsdp", TP2),
    "zero1": (BASE, "loss_deepspeed.json", "deepspeed", {**DP2, "zero_stage": 1}),
    "zero3": (BASE, "loss_deepspeed.json", "deepspeed", {**DP2, "zero_stage": 3}),
    "packing_fsdp_tp2": (BASE_PACKING, "loss_fsdp.json", "fsdp", {**TP2, **PACKING, "grad_accum_steps": 2}),
    "packing_zero2": (BASE_PACKING, "loss_deepspeed.json", "deepspeed", {**DP2, **PACKING, "zero_stage": 2}),
}
BUGS = {
    "bug_adapters_unreduced": (BASE, "loss_ddp_adapters_unreduced.json", "ddp",
                               {**DP2, "strategy_class": DDPAdaptersUnreduced}),
    "bug_base_decayed": (BASE, "loss_fsdp.json", "fsdp", {**DP2, "strategy_class": FSDPBaseDecayed}),
    "bug_adapters_weight_decay": (BASE, "loss_fsdp.json", "fsdp", {**DP2, "strategy_class": FSDPWeightDecayAdded,
                                                                   "checkpoint_interval": 2}),
    "bf16_bug_adapter_scale": (BASE_BF16, "loss_fsdp.json", "fsdp",
                               {**TP2, **BF16, "strategy_class": FSDPAdapterScaleRankStabilised}),
}
BF16_CLEAN = {"bf16_fsdp_tp2": (BASE_BF16, "loss_fsdp.json", "fsdp", {**TP2, **BF16})}
FOLDERS = {folder: {**base, name: (strategy, flags)}
           for folder, (base, name, strategy, flags) in {**CLEAN, **BUGS, **BF16_CLEAN}.items()}


@pytest.fixture(scope="module")
def weights(tiny_weights, tmp_path_factory):
    """The shared base and, beside it, the adapters' initial weights (what train_ddp.py --save_init_weights writes)."""
    import shutil

    from parity.models.adapters import lora_settings, write_initial_adapters
    from parity.models.model import resolve_model_config

    path = str(tmp_path_factory.mktemp("lora_weights") / "init_weights.pt")
    shutil.copy(tiny_weights, path)
    config = resolve_model_config("qwen2-tiny")
    write_initial_adapters(path, config, lora_settings(4, None, 0.0, TARGETS, config), seed=42)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("lora")
    train_folders(root, FOLDERS, SETTING, weights)
    return root


def record(root, folder: str, name: str) -> dict:
    return json.loads((root / folder / name).read_text())


def verdict(root, folder: str, capsys) -> tuple[int, dict, str]:
    """plot_loss_curves.py on the folder, as a user runs it: (exit code, the judged run's summary, its output)."""
    code = plot_loss_curves(["--input_dir", str(root / folder), "--output", str(root / folder / "curves.png")])
    out = capsys.readouterr()
    (summary,) = json.loads((root / folder / "curve_comparison.json").read_text())["against_baseline"].values()
    return code, summary, out.out + out.err


@pytest.mark.parametrize("folder", list(CLEAN))
def test_each_strategy_trains_the_adapters_as_ddp_does_in_fp32(root, folder, capsys):
    """Every step's loss, pre-clip grad norm (the adapters') and parameter norm (the adapters') within 1e-5 of DDP's
    (measured ≤ 1e-7), the replicas held, the frozen base unmoved, the teacher-forced check at step 0 within 1e-5, and
    plot_loss_curves.py's PASS."""
    base, name, _, _ = CLEAN[folder]
    run, ddp = record(root, folder, name), record(root, folder, "loss_ddp.json")
    assert series(run, "batch_hash") == series(ddp, "batch_hash")
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(ddp, key)) < FP32_RTOL, key
    assert_replicas_held(run)
    checked = run["steps"][0]["teacher_forced"]["tensors"]
    assert max(checked.values()) < FP32_RTOL, max(checked.items(), key=lambda kv: kv[1])
    assert run["config"]["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": sorted(TARGETS.split(","))}
    code, summary, out = verdict(root, folder, capsys)
    assert (code, summary["verdict"]) == (0, "PASS"), out


def test_only_the_adapters_train_and_the_norms_are_theirs(root, weights):
    """The final model: every base tensor bit-identical to the init weights, every adapter moved (lora_B from 0); the
    record's last parameter norm is the adapters' norm, and its every-tensor series lists the adapters only."""
    from safetensors.torch import load_file

    from conftest import tensor_series
    from parity.models.model import read_init_weights

    ddp = record(root, "fsdp_tp2", "loss_ddp.json")
    final = ddp["final"]["checkpoint_dir"]
    adapters = load_file(f"{final}/adapter/adapter_model.safetensors")
    assert len(adapters) == 2 * 2 * 4 and all(".lora_" in name for name in adapters)  # 2 layers × 4 targets × A, B
    assert all(float(t.abs().max()) > 0 for name, t in adapters.items() if "lora_B" in name)
    norm = float(torch.sqrt(sum(t.double().square().sum() for t in adapters.values())))
    assert abs(norm - ddp["steps"][-1]["param_norm"]) / norm < 1e-6
    names = tensor_series(ddp, root / "fsdp_tp2").names
    assert len(names) == 16 and all(".lora_" in n and n.endswith(".default.weight") for n in names), names
    base, _, _ = read_init_weights(weights)
    merged = load_file(f"{final}/model.safetensors")
    unchanged = [n for n in base if "q_proj" not in n and "v_proj" not in n and "o_proj" not in n and "down_proj" not in n]
    assert all(torch.equal(merged[n], base[n]) for n in unchanged if n in merged)


def test_the_final_model_loads_in_peft_and_merged_in_transformers(root, weights):
    """`adapter/` is peft's layout: PeftModel.from_pretrained onto the base (the init-weights file's model) gives the
    logits of the merged model, which stock transformers loads from the folder itself; both reproduce the run's loss on
    its last batch (the record's eval_loss_last_batch)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parity.driver.local_group import plan
    from parity.models.model import build_model, load_init_weights, resolve_model_config
    from parity.training.loss import loss_sum

    ddp = record(root, "zero1", "loss_ddp.json")
    final = ddp["final"]["checkpoint_dir"]
    base = build_model(resolve_model_config("qwen2-tiny"), 0)
    load_init_weights(base, weights)
    peft_model = PeftModel.from_pretrained(base, f"{final}/adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    _, batches = plan("ddp", {**SETTING, **DP2, "init_weights_path": weights, "loss_output_dir": root / "x",
                              "storage_path": root / "x"})
    batch = batches(ddp["final"]["eval_batch_step"])
    with torch.no_grad():
        a = peft_model(input_ids=batch.input_ids, use_cache=False).logits
        b = merged(input_ids=batch.input_ids, use_cache=False).logits
    assert float((a - b).abs().max()) < 1e-4
    loss = float(loss_sum(b, batch.labels)) / batch.loss_tokens
    assert abs(loss - ddp["final"]["eval_loss_last_batch"]) < 1e-5


@pytest.mark.parametrize("folder,lines", [
    ("bug_adapters_unreduced", [r"replicas part at step 0: model\.layers\.1\.\S+\.lora_[AB]\.default\.weight differs "
                                r"between rank 0 and rank 1 .*: its ranks no longer hold one model — FAIL before any",
                                r"tensor verdict: FAIL at step 0: model\.layers\.1\.\S+\.lora_[AB]\.default\.weight, "
                                r"phase gradient"]),
    ("bug_base_decayed", [r"a frozen tensor moved at step 0: model\.embed_tokens\.weight changed on ranks 0, 1 since "
                          r"set-up \(19 more tensors moved or parted\): it trained what it froze — FAIL before any"]),
    ("bug_adapters_weight_decay", [r"first step outside: step \d: param norm"]),
    ("bf16_bug_adapter_scale", [r"teacher-forced check FAILS at step 0: grad_norm relative diff 9\.99\de-01",
                                r"tensor verdict: FAIL at step 0: model\.layers\.\S+"
                                r"\.lora_B\.default\.weight, phase gradient: .*calibrated\)"]),
])
def test_the_seeded_lora_bugs_fail_at_their_step(root, folder, lines, capsys):
    """Adapters no reduction syncs part on the DP ranks at step 0 (the replica check names one, the tensor verdict its
    gradient); a decay walking every parameter moves the frozen base at step 0 (the frozen check names it: 20 tensors,
    the embedding first); adapters decayed (0.01) where DDP's are not FAIL on the parameter norm, which parts by lr ×
    0.01 = 1e-5 a step (3.0e-5 at step 2: 3 × the fp32 bound; the teacher-forced check's step 2 reads 0.61 of its
    bound, the tensor verdict 0.014 of its update bound: both are sized for AdamW's sign flips); adapters scaled by
    alpha / √r FAIL calibrated bf16 at step 0 on the grad norm (lora_B's gradient × √r = 2)."""
    import re

    code, summary, out = verdict(root, folder, capsys)
    assert (code, summary["verdict"]) == (1, "FAIL"), out
    for line in lines:
        assert re.search(line, out), (line, out)
    if folder == "bug_adapters_weight_decay":
        run, ddp = record(root, folder, "loss_fsdp.json"), record(root, folder, "loss_ddp.json")
        assert abs(run["steps"][2]["param_norm"] / ddp["steps"][2]["param_norm"] - 1) > 2.5 * FP32_RTOL


def test_a_bf16_lora_run_passes_calibrated(root, capsys):
    """FSDP2 + TP2 with adapters in bf16 (autocast) against DDP's, its bounds calibrated on DDP's references: PASS."""
    code, summary, out = verdict(root, "bf16_fsdp_tp2", capsys)
    assert (code, summary["verdict"]) == (0, "PASS"), out
    assert summary.get("calibrated") or "calibrated" in out, out


def test_the_layer_check_compares_the_adapters_under_tp(tmp_path, capsys):
    """run_verification.py --lora_r (local processes): FSDP2 + TP2's step against DDP's, module by module — the adapters'
    modules (dropout, lora_A, lora_B) and the wrapped projections' base layers gathered where TP leaves pieces (a rowwise
    projection's input shard, a colwise one's output columns) — and every adapter's gradient, with the tied embedding
    and the layers' input norms saved whole beside them (--lora_modules_to_save: their trained copies' outputs and
    gradients): PASS (measured 4.6e-7)."""
    from parity.commands.layer_check import main as run_verification

    code = run_verification(["--launcher", "local", "--strategy", "ddp", "fsdp", "--tp_size", "2", "--dp_size", "1",
                             "--lora_r", "4", "--lora_targets", TARGETS, "--seq_length", "64",
                             "--lora_modules_to_save", "embed_tokens,input_layernorm",
                             "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    (pair,) = json.loads((tmp_path / "layer_comparison.json").read_text())["pairs"]
    assert (code, pair["verdict"]) == (0, "PASS"), out
    assert max(pair["max_rel_diff"].values()) < FP32_RTOL
    keys = {row["key"] for row in pair["rows"]}
    for layer in range(2):
        for module in ("self_attn.o_proj.lora_dropout.default", "self_attn.o_proj.lora_A.default",
                       "self_attn.q_proj.lora_B.default", "self_attn.q_proj.base_layer", "mlp.down_proj.lora_A.default"):
            assert f"output/model.layers.{layer}.{module}" in keys
        assert f"grad/model.layers.{layer}.self_attn.v_proj.lora_B.default.weight" in keys
        assert f"output/model.layers.{layer}.input_layernorm.modules_to_save.default" in keys
    # the saved tied embedding: its trained copy's output at both ends and its one gradient
    assert {"output/model.embed_tokens.modules_to_save.default", "output/lm_head.modules_to_save.default",
            "grad/model.embed_tokens.modules_to_save.default.weight"} <= keys


@pytest.fixture(scope="module")
def checkpointed(shared_runs):
    """A LoRA run as a user trains it, through Ray Train (in the session's shared worker group: conftest's RAY_RUNS):
    DDP at DP 2 saving its own initial weights (the base and the adapters beside it), packed rows, the input norms saved
    whole beside the adapters, 4 steps with a checkpoint at steps 2 and 4. Returns (its record, its run folder)."""
    run = shared_runs["lora_ddp_packed"]
    config = run["config"]
    assert (config["lora"]["r"], config["lora"]["targets"], config["packing"], len(run["steps"]),
            config["checkpoint_interval"], config["global_batch_size"]) == (4, sorted(TARGETS.split(",")), True, 4, 2, 8)
    return run, os.path.join(config["storage_path"], config["experiment_name"])


def test_the_layer_check_replays_a_lora_runs_step(checkpointed, tmp_path, capsys):
    """run_verification.py --replay of the LoRA run's step 3 (local processes): the folder gets the checkpoint of step 2
    as its weights — the base under stock names, the adapters and the saved norms' copies in the adapters' file beside
    it, AdamW's moments theirs — and DDP, FSDP2 and ZeRO (DeepSpeed at TP 1) each load it in their own form, train
    step 2 and record step 3: DDP's is the run's own step 3 (loss and grad norm), the three agree module by module
    (measured: bit-identical at DP 2). Step 1 starts from the run's initial weights and adapters (no checkpoint before
    it) and is the run's step 1 too. --lora_r with --replay is one line: the run's adapters are the replay's."""
    from safetensors.torch import load_file

    from parity.commands.layer_check import main as run_verification
    from parity.models.adapters import adapters_path

    run, folder = checkpointed
    common = ["--launcher", "local", "--device", "cpu", "--replay", folder]
    out = tmp_path / "step_3"
    code = run_verification([*common, "--step", "3", "--strategy", "ddp", "fsdp", "deepspeed", "--tp_size", "1",
                             "--dp_size", "2", "--output_dir", str(out)])
    printed = capsys.readouterr().out
    pairs = json.loads((out / "layer_comparison.json").read_text())["pairs"]
    assert code == 0 and len(pairs) == 3 and {p["verdict"] for p in pairs} == {"PASS"}, printed
    assert max(v for p in pairs for v in p["max_rel_diff"].values()) < FP32_RTOL
    keys = {row["key"] for row in pairs[0]["rows"]}
    assert {"grad/model.layers.1.self_attn.q_proj.lora_A.default.weight",
            "param/model.layers.0.input_layernorm.modules_to_save.default.weight",
            "output/model.layers.1.mlp.down_proj.base_layer"} <= keys
    for step, where in ((3, out), (1, tmp_path / "step_1")):
        if step == 1:
            assert run_verification([*common, "--step", "1", "--strategy", "ddp", "--output_dir", str(where)]) == 0
        meta = json.loads((where / "dump_ddp.json").read_text())
        assert meta["replay"]["checkpoint"] == (f"{folder}/step_000002" if step == 3 else None)
        assert meta["loss"] == pytest.approx(run["steps"][step]["loss"], rel=1e-6)
        assert meta["grad_norm"] == pytest.approx(run["steps"][step]["grad_norm"], rel=1e-6)
    adapters = load_file(adapters_path(str(out / "init_weights.safetensors")))
    initial = load_file(adapters_path(run["config"]["init_weights_path"]))
    assert sorted(adapters) == sorted(initial) and len(adapters) == 2 * 4 * 2 + 2
    assert all(float((adapters[n] - initial[n]).abs().max()) > 0 for n in adapters)  # step 2's, not the initial ones
    assert not any(".lora_" in n or "base_layer" in n for n in load_file(out / "init_weights.safetensors"))
    refused = run_verification([*common, "--step", "3", "--lora_r", "4", "--output_dir", str(tmp_path / "x")])
    assert refused == 2 and "error: --lora_r comes from the run in a replay: drop it" in capsys.readouterr().err
