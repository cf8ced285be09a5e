"""megatron-core's GPTModel under Hugging Face names (issue 69, item 2; docs/megatron.md): megatron-core 0.16.1 (the
release pip finds for Python 3.11, 0.19.2 for 3.12: the test extras) trains one step at TP 2 over gloo through
tests/megatron_cpu.py, its parameters and gradients gathered and mapped (parity/frameworks/megatron/), and
transformers' Qwen2 model (Q/K/V biases; Llama's mapping is the recorded runs' below) loaded from them strictly trains
the same step: the loss equal within 1e-6, each gradient within 1e-5. The classic mapping bug — linear_fc1's gate and
up split as if trained at TP 1 — moves the loss 1e4 × beyond that. What does not map is refused in one line.

Then megatron-core loops recorded unchanged under verify_trainer.py (issue 69, items 1 and 3:
tests/megatron_train_job.py through megatron_cpu.py, its flags choosing the layout and a seeded fault): TP 2 × DP 2
with SP and the distributed optimizer, and PP 2, PASS against their DDP replays in fp32, DP 2 in bf16 calibrated under
two kernel paths; the gradients averaged over DP twice, AdamW's step counter advanced twice (in bf16), a micro-batch's
gradient scaled by the wrong count under virtual pipeline stages and the norms left out of SP's TP all-reduce FAIL at
their steps; a LayerNorm model is refused, exit 2.

Issue 82: mixtures of experts (Qwen2-MoE at EP 2, Mixtral at TP 2 x EP 2) PASS with megatron-core's router losses
replayed, an expert gradient not averaged over the EP ranks and a router aux loss counted twice FAIL at step 0;
Megatron-FSDP at DP 2 and PP 2 x VPP 2 PASS; fp16 with megatron-core's loss scaler PASSes, its skipped steps recorded
and followed by its replay, and a step applied on an overflow FAILs at its step (the scale's rules held to
megatron-core's own scaler)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import PERTURBED, REPO, kernel_setting, max_rel_diff, output_to, series, side_by_side

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """{"qwen2": the job's JSON}: at TP 2 (two ranks)."""
    root = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    procs = {family: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         os.path.join(TESTS, "megatron_cpu.py"), os.path.join(TESTS, "megatron_mapping_job.py"),
         str(root / f"{family}.json"), "2", family], env=env, cwd=root, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for family in ("qwen2",)}
    outputs = {family: (proc.wait(timeout=600), proc.stdout.read()) for family, proc in procs.items()}
    for family, (code, output) in outputs.items():
        assert code == 0, output[-4000:]
    return {family: json.loads((root / f"{family}.json").read_text()) for family in procs}


@pytest.mark.parametrize("family", ["qwen2"])
def test_a_tp2_megatron_step_is_transformers_step_under_hugging_face_names(mapped, family):
    found = mapped[family]
    assert found["model"] == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert abs(found["loss"] - found["hf_loss"]) / found["loss"] < 1e-6, found
    assert len(found["grads"]) == {"llama": 21, "qwen2": 27}[family]  # every transformers tensor, none left over
    assert max(found["grads"].values()) < 1e-5, found["grads"]
    assert abs(found["fc1_as_tp1_loss"] - found["loss"]) / found["loss"] > 1e-4, found
    print(f"{family}: loss {found['loss']:.7f} vs {found['hf_loss']:.7f}, gradients within "
          f"{max(found['grads'].values()):.1e}; fc1 split as at TP 1: {found['fc1_as_tp1_loss']:.7f}")


def test_what_does_not_map_is_refused_in_one_line(mapped):
    """What no transformers family the replay builds computes, each changed alone on the job's dense config (LayerNorm,
    linear biases, Q/K norms, another MLP, multi-token prediction, another position embedding, latent attention, fp8,
    zero-centred norms, interleaved RoPE, another head width) and on a MoE config that maps (Mixtral's): every router
    no family has, a shared expert without its gate, Q/K norms with biases, biases or unnormalised top-k without a family
    — then a parameter the mapping does not know, a model that is not a GPTModel, one model chunk given twice: one line
    each, naming it (docs/refusals.md). A refusal that stopped refusing would read `mapped: ...` here."""
    router = "megatron-core model: a MoE router with "
    mixtral = ("megatron-core model: MoE layers without Q/K norms or a shared expert map to Mixtral, whose attention has no "
               "biases and whose top-k weights are renormalised (moe_router_pre_softmax off)")
    assert mapped["qwen2"]["refusals"] == [
        "megatron-core model: normalization 'LayerNorm': Llama and Qwen2 use RMSNorm",
        "megatron-core model: biases on the linear layers (add_bias_linear): Llama and Qwen2 have none there",
        "megatron-core model: Q/K norms (qk_layernorm): not yet mapped",
        "megatron-core model: an MLP other than the gated SiLU one (gated_linear_unit with activation_func silu)",
        "megatron-core model: multi-token prediction (mtp_num_layers): not yet mapped",
        "megatron-core model: position_embedding_type 'learned_absolute': the transformers models the replay builds use "
        "RoPE",
        "megatron-core model: multi-head latent attention (DeepSeek-V3's: multi_latent_attention): not yet mapped",
        "megatron-core model: fp8 compute (fp8 'hybrid'): the replay has no fp8 reference to judge it against; record "
        "the job in bf16",
        "megatron-core model: zero-centred norm weights (layernorm_zero_centered_gamma): not yet mapped",
        "megatron-core model: interleaved RoPE (rotary_interleaved): transformers rotates halves",
        "megatron-core model: kv_channels 32 other than hidden_size ÷ heads",
        router + "moe_router_score_function 'sigmoid': the families mapped route by softmax",
        router + "the expert bias of aux-loss-free balancing (moe_router_enable_expert_bias): not yet mapped",
        router + "group-limited top-k (moe_router_num_groups): not yet mapped",
        router + "a scaled top-k (moe_router_topk_scaling_factor): not yet mapped",
        router + "token dropping (moe_expert_capacity_factor): the families mapped drop no token",
        router + "input jitter (moe_input_jitter_eps): a random router input the replay cannot draw alike",
        router + "moe_router_load_balancing_type 'seq_aux_loss': the replay trains megatron-core's micro-batch "
                 "aux_loss (or none)",
        router + "dense layers among the MoE ones (moe_layer_freq): not yet mapped",
        router + "its losses under calculate_per_token_loss (each micro-batch's weighted by its routed tokens over the "
                 "step's loss tokens): not yet replayed",
        router + "forced load balancing (moe_router_force_load_balancing): random routing",
        "megatron-core model: a shared expert without its sigmoid gate, or beside Q/K norms: Qwen2-MoE's shared expert "
        "is gated and its attention has no Q/K norms (DeepSeek-V3's ungated one comes with its latent attention: not "
        "yet mapped)",
        "megatron-core model: Q/K norms with Q/K/V biases: Qwen3-MoE has neither biases",
        mixtral,  # Q/K/V biases
        mixtral,  # the top-k weights not renormalised
        "megatron-core parameter decoder.layers.0.self_attention.linear_qkv.layer_norm_bias: the mapping to Hugging "
        "Face names does not know it",
        "the model is a Linear, not a GPTModel: only GPTModel maps onto a transformers model",
        "one model chunk given twice: each virtual pipeline stage is a chunk of its own"]


# fp16's scaler: from 2^19, doubled after each good step, halved at the second overflow since — the job's gradients
# (their largest element 0.06–0.12 at these steps) overflow at 2^20 and not at 2^19: steps 1 and 2 are skipped
FP16_SCALER = ["--initial_loss_scale", str(2.0 ** 19), "--loss_scale_window", "1", "--hysteresis", "2"]
TWO_STEPS = ["--steps", "2"]  # a seeded fault that shows by step 1: the steps after it add nothing asserted
RECORDED = {  # name: (ranks, the job's flags, the kernel setting it runs under: parity.calibration.kernel_settings)
    "tp2_dp2": (4, ["--tp", "2", "--sequence_parallel", "--distributed_optimizer"], None),
    "pp2": (2, ["--pp", "2"], None),
    "bf16": (2, ["--distributed_optimizer", "--bf16"], None),
    "bf16_avx2": (2, ["--distributed_optimizer", "--bf16"], "avx2"),
    "grad_over_dp_twice": (2, ["--distributed_optimizer", "--seed_bug", "grad_over_dp_twice", *TWO_STEPS], None),
    "adam_step_twice": (2, ["--tp", "2", "--family", "qwen2", "--bf16", "--seed_bug", "adam_step_twice"], None),
    "vpp": (2, ["--pp", "2", "--vpp", "2", "--layers", "4"], None),
    "micro_batch_scaled": (2, ["--pp", "2", "--vpp", "2", "--layers", "4", "--seed_bug", "micro_batch_scaled",
                               *TWO_STEPS], None),
    "sp_norm_untagged": (2, ["--tp", "2", "--sequence_parallel", "--seed_bug", "sp_norm_untagged", *TWO_STEPS], None),
    "layernorm": (1, ["--normalization", "LayerNorm"], None),
    "moe_ep2": (2, ["--family", "qwen2_moe", "--ep", "2", "--z_loss_coeff", "1e-3"], None),
    "moe_tp2_ep2": (4, ["--family", "mixtral", "--tp", "2", "--sequence_parallel", "--ep", "2"], None),
    "expert_grads_not_averaged": (2, ["--family", "mixtral", "--ep", "2", "--seed_bug", "expert_grads_not_averaged",
                                      *TWO_STEPS], None),
    "aux_loss_twice": (1, ["--family", "qwen3_moe", "--seed_bug", "aux_loss_twice", *TWO_STEPS], None),
    "megatron_fsdp": (2, ["--dp_wrapper", "megatron_fsdp"], None),
    "fp16": (1, ["--distributed_optimizer", "--fp16", *FP16_SCALER], None),
    "fp16_perturbed": (1, ["--fp16", *FP16_SCALER], PERTURBED),
    "fp16_step_on_overflow": (1, ["--fp16", *FP16_SCALER, "--seed_bug", "step_on_overflow", *TWO_STEPS], None),
}
# the perturbed setting's variables move no fp16 product on a CPU without fp16 kernels (ATen computes them, not MKL
# or oneDNN: the fp16 jobs trained bit for bit as under the default); ATen's AVX2 kernels do
ALSO = {"fp16_perturbed": {"ATEN_CPU_CAPABILITY": "avx2"}}
MARGIN = 0.5  # a clean run's largest deviation ÷ bound, each check (docs/tolerances.md#every-machine-the-clean-matrix)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{name: (verify_trainer.py's exit code, its output, its folder)}: tests/megatron_train_job.py under
    `verify_trainer.py -- torchrun … megatron_cpu.py megatron_train_job.py`, 4 steps of 2 micro-batches (2 where a
    seeded fault shows by step 1). The jobs under another kernel setting run as the command line, side by side
    (conftest.side_by_side), each in a process of its own, whose kernels it sets from the start; the others one after
    another through verify_trainer's main in this process (verified_here)."""
    from parity.calibration.kernel_settings import environment

    root = tmp_path_factory.mktemp("megatron_recorded")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}

    def argv(name):
        ranks, flags, _ = RECORDED[name]
        return ["--output_dir", name, "--", "torchrun", "--nproc_per_node", str(ranks), "--standalone",
                os.path.join(TESTS, "megatron_cpu.py"), os.path.join(TESTS, "megatron_train_job.py"), "--steps", "4",
                *flags]

    own = [name for name, (_, _, setting) in RECORDED.items() if setting or name in ALSO]
    runs = side_by_side({name: ([sys.executable, os.path.join(REPO, "verify_trainer.py"), *argv(name)],
                                {**environment(RECORDED[name][2] or "default", {**os.environ, **env}),
                                 **ALSO.get(name, {})},
                                RECORDED[name][0]) for name in own}, root)
    runs.update({name: verified_here(argv(name), env, root, root / f"{name}.out") for name in RECORDED
                 if name not in own})
    return {name: (*runs[name], root / name) for name in RECORDED}


def verified_here(argv: list[str], env: dict, cwd, output) -> tuple[int, str]:
    """(exit code, output) of `verify_trainer.py argv` run through its main in this process, in `cwd` with `env` added
    to this process's environment at the default kernels (as the jobs run side by side get theirs): the command, its
    replays and the verdict as the command line runs them, without a driver and a replay forkserver of their own to
    start (~7 of a 2-rank job's 20 CPU-seconds). Its output — the harness's lines and the job's — appended to the file
    `output`, then read."""
    from parity.commands.verify_trainer import main

    with kernel_setting("default"), pytest.MonkeyPatch.context() as mp, output_to(output):
        os.environ.update(env)  # kernel_setting restores the whole environment, and what the command set in it
        mp.chdir(cwd)
        code = main(argv)
    with open(output) as f:
        return code, f.read()


def _judged(folder) -> dict:
    return json.loads((folder / "curve_comparison.json").read_text())["against_baseline"]["megatron_cpu"]


def passed_within_margin(run) -> tuple[str, object]:
    """A clean recorded job (exit code, output, folder): exit 0, PASS with every check — curves, tensors, the
    teacher-forced checks (there are some) — under MARGIN of its bound. Its output and folder."""
    code, output, folder = run
    assert code == 0, output[-4000:]
    report = json.loads((folder / "curve_comparison.json").read_text())
    against = report["against_baseline"]["megatron_cpu"]
    assert against["verdict"] == "PASS" and max(against["bound_ratios"].values()) < MARGIN, against["bound_ratios"]
    checks = report["runs"]["megatron_cpu"]["teacher_forced"]["checks"]
    assert checks and all(c["ok"] and c["ratio"] < MARGIN for c in checks), checks
    return output, folder


def test_a_megatron_loop_at_tp2_dp2_is_recorded_unchanged_and_passes_against_its_ddp_replay(recorded):
    """megatron-core's DistributedDataParallel and distributed optimizer (AdamW, clipped), get_forward_backward_func's
    micro-batches and Megatron-LM's masked loss, recorded without a line changed at TP 2 × DP 2 with sequence
    parallelism under Hugging Face names: each DP rank's range of each TP shard is its piece, the moments summed over
    DP for the teacher-forced check.
    Its DDP replay trains the same model — loss and norms within 1e-6, every tensor's gradient and update within its
    bound, the replicas (the parameters on their DP ranks, the norms on all four) bit-identical."""
    code, output, folder = recorded["tp2_dp2"]
    assert code == 0, output[-4000:]
    result = _judged(folder)
    assert result["verdict"] == "PASS" and result["margin"] > 2, result
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    config = record["config"]
    assert (config["tp_size"], config["dp_size"], config["framework"], config["model_type"]) == (
        2, 2, "megatron-core", "llama")
    assert config["sharding"]["distributed_optimizer"] and config["sharding"]["sequence_parallel"]
    replay = json.loads((folder / "loss_ddp.json").read_text())
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(record, key), series(replay, key)) < 1e-6, key
    assert [s["logged_grad_norm"] for s in record["steps"]] == pytest.approx(series(record, "grad_norm"), rel=1e-5)
    assert "replicas: bit-identical at each of 4 checks" in output and "tensor verdict: PASS: 21 tensors" in output
    assert "teacher-forced check: within bounds" in output
    assert "megatron_cpu (TP=2, DP=2): PASS" in output and (folder / "report.html").exists()


def test_the_gradients_averaged_over_dp_twice_fail_at_step_0_naming_the_grad_norm(recorded):
    """Seeded in a DP 2 job with the distributed optimizer: each DP bucket's gradient scaling factor divided by DP once
    more (the gradients halved):
    the verdict FAILs at step 0, on the grad norm, the tensor verdict naming a tensor's gradient."""
    code, output, folder = recorded["grad_over_dp_twice"]
    assert code == 1, output[-4000:]
    first = _judged(folder)["first_outside"]
    assert (first["step"], first["quantity"]) == (0, "grad_norm") and first["rel_diff"] == pytest.approx(0.5, 1e-4)
    assert "tensor verdict: FAIL at step 0: " in output and "phase gradient" in output


def test_the_optimizers_step_counter_advanced_twice_fails_at_its_step(recorded):
    """Seeded in a bf16 Qwen2 job (Q/K/V biases) at TP 2 with the FP32-optimizer-of-bf16 (its fp32 masters' AdamW
    state): the step count advanced once more before each step from step 1 on (its bias correction another step's):
    the calibrated verdict FAILs at step 1 on a tensor's update, the parameter norm's curve beyond its bound too."""
    code, output, folder = recorded["adam_step_twice"]
    assert code == 1, output[-4000:]
    judged = _judged(folder)
    assert (judged["first_outside"]["step"], judged["first_outside"]["quantity"]) == (1, "update"), judged
    assert judged["bound_ratios"]["param_norm"] > 1, judged["bound_ratios"]
    config = json.loads((folder / "loss_megatron_cpu.json").read_text())["config"]
    assert (config["model_type"], config["precision"]) == ("qwen2", "bf16_params")


def test_a_two_stage_pipeline_passes_its_stages_layers_renumbered(recorded):
    """PP 2: each stage builds one decoder layer (numbered from 0 on its stage, megatron-core's layer_number the
    global one), the rows from the first stage's calls, the labels and the loss from the last's; the record holds the
    whole model under Hugging Face names and PASSes against its replay."""
    code, output, folder = recorded["pp2"]
    assert code == 0, output[-4000:]
    assert _judged(folder)["verdict"] == "PASS", _judged(folder)
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    assert record["config"]["sharding"]["mesh"] == {"tp": 1, "dp": 1, "pp": 2}
    replay = json.loads((folder / "loss_ddp.json").read_text())
    assert max_rel_diff(series(record, "loss"), series(replay, "loss")) < 1e-6
    assert "tensor verdict: PASS: 21 tensors" in output and "megatron_cpu (PP=2, DP=1): PASS" in output
    assert (folder / "report.html").exists()


def test_virtual_pipeline_stages_pass_each_chunk_read(recorded):
    """PP 2 × VPP 2 (the interleaved 1F1B schedule, four layers: each pipeline rank holds two model chunks, its
    layers numbered in the whole model): the rows from the first chunk of the first stage, the labels and losses from
    the last of the last; the record holds the whole model and PASSes against its replay."""
    code, output, folder = recorded["vpp"]
    assert code == 0, output[-4000:]
    assert _judged(folder)["verdict"] == "PASS" and _judged(folder)["margin"] > 2, _judged(folder)
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    assert record["config"]["sharding"]["mesh"] == {"tp": 1, "dp": 1, "pp": 2, "vpp": 2}
    replay = json.loads((folder / "loss_ddp.json").read_text())
    assert max_rel_diff(series(record, "loss"), series(replay, "loss")) < 1e-6
    assert "tensor verdict: PASS: 39 tensors" in output and "megatron_cpu (PP=2, VPP=2, DP=1): PASS" in output


def test_a_micro_batch_scaled_by_the_wrong_count_fails_at_step_0(recorded):
    """Seeded at PP 2 × VPP 2: the last chunk's second micro-batch's gradient scaled by 1 / (micro-batches − 1) where
    the schedule scales each by 1 / micro-batches (its reported loss unchanged): the verdict FAILs at step 0 on the grad
    norm, the tensor verdict naming a tensor's gradient."""
    code, output, folder = recorded["micro_batch_scaled"]
    assert code == 1, output[-4000:]
    first = _judged(folder)["first_outside"]
    assert (first["step"], first["quantity"]) == (0, "grad_norm") and first["rel_diff"] > 0.1, first
    assert "tensor verdict: FAIL at step 0: " in output and "phase gradient" in output


def test_a_model_the_mapping_does_not_know_is_refused_in_one_line(recorded):
    """A GPTModel with LayerNorm (no transformers model of Llama's or Qwen2's family has it): the job stops before it
    trains, exit 2, the line said once."""
    code, output, _ = recorded["layernorm"]
    assert code == 2, output[-4000:]
    line = ("error: megatron-core: megatron-core model: normalization 'LayerNorm': Llama and Qwen2 use RMSNorm: the "
            "job stopped before it trained: nothing replayed")
    assert output.count(line) == 1, output[-3000:]


@pytest.mark.parametrize("name", ["bf16", "bf16_avx2"])
def test_a_bf16_job_passes_calibrated_on_both_kernel_paths(recorded, name):
    """Megatron-LM's bf16 (Float16Module's bf16 parameters, the distributed optimizer's fp32 master shards, main_grad
    accumulated and reduced in fp32) at DP 2, recorded as bf16_params reduced in fp32 and judged on calibrated bounds,
    under oneDNN's default bf16 path and its AVX2 one: PASS, every curve, tensor and teacher-forced check within half
    its bound."""
    output, folder = passed_within_margin(recorded[name])
    config = json.loads((folder / "loss_megatron_cpu.json").read_text())["config"]
    assert (config["precision"], config["reduce_dtype"], config["grad_accum_dtype"]) == ("bf16_params", "fp32", "fp32")
    assert "tensor verdict: PASS: 21 tensors" in output


def test_a_norm_left_out_of_the_tp_all_reduce_under_sp_fails_at_step_0_naming_it(recorded):
    """Seeded at TP 2 with sequence parallelism: the norms' weights untagged (as a norm that does not set
    `sequence_parallel` leaves them), so finalize_model_grads does not sum their gradients over TP — each TP rank's
    norm steps on its half of the sequence: the verdict FAILs at step 0, the tensor verdict naming a norm's gradient
    and the replicas parting."""
    code, output, folder = recorded["sp_norm_untagged"]
    assert code == 1, output[-4000:]
    assert "tensor verdict: FAIL at step 0: model.norm.weight, phase gradient" in output, output[-3000:]
    assert "replicas part at step 0: model.norm.weight differs between rank 0 and rank 1" in output


def test_megatron_cores_router_losses_are_what_a_replay_of_its_moe_trains(mapped):
    """The replay's megatron-core router losses (parity/training/routing.py, a MoE seam's aux_loss_scope
    "megatron-core") are megatron-core's own functions — switch_load_balancing_loss_func over each layer's tokens with
    the counts of its routing map, z_loss_func — summed over the sparse layers, on a Mixtral's router calls (in the
    mapping job: tests/megatron_mapping_job.py's router_losses); each layer's load-balancing loss is transformers'
    load_balancing_loss_func of that layer ÷ top-k, and the mean over the layers is not transformers' loss pooled
    over them."""
    found = mapped["qwen2"]["router_losses"]
    assert found["seen"] == 2 * 16 and found["scope"] == ["megatron-core", 1e-3]
    for theirs, hf, _ in found["layers"]:
        assert theirs == pytest.approx(hf / found["top_k"], rel=1e-6)
    assert found["aux"] == pytest.approx(sum(layer[0] for layer in found["layers"]), rel=1e-6)
    assert found["z"] == pytest.approx(sum(layer[2] for layer in found["layers"]), rel=1e-6)
    mean = found["aux"] * found["top_k"] / len(found["layers"])
    assert abs(found["pooled"] / mean - 1) > 1e-4, found


def test_a_megatron_moe_at_ep2_passes_its_router_losses_replayed(recorded):
    """Qwen2-MoE (Q/K/V biases, a shared expert behind its sigmoid gate, top-2 of the softmax unnormalised) at EP 2
    with the alltoall dispatcher over gloo, the load-balancing and z losses on: the record holds every EP rank's
    experts stacked into transformers' fused weights, its router losses as megatron-core trained them (each micro-batch's,
    summed over the layers) and each layer's expert loads; its replay trains the same objective — loss, norms and
    both router losses within 1e-6, the expert loads equal, every tensor within its bound — and PASSes."""
    code, output, folder = recorded["moe_ep2"]
    assert code == 0, output[-4000:]
    result = _judged(folder)
    assert result["verdict"] == "PASS" and result["margin"] > 2, result
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    replay = json.loads((folder / "loss_ddp.json").read_text())
    config = record["config"]
    assert (config["model_type"], config["sharding"]["mesh"]) == ("qwen2_moe", {"tp": 1, "dp": 2, "pp": 1, "ep": 2,
                                                                                 "etp": 1})
    for key in ("loss", "grad_norm", "param_norm", "aux_loss", "z_loss"):
        assert max_rel_diff(series(record, key), series(replay, key)) < 1e-6, key
    assert [s["expert_loads"] for s in record["steps"]] == [s["expert_loads"] for s in replay["steps"]]
    assert all(sum(map(sum, s["expert_loads"])) == 2 * 8 * 16 * 2 for s in record["steps"])  # layers×rows×tokens×k
    assert "tensor verdict: PASS: 35 tensors" in output and "expert loads: equal to the baseline's" in output
    assert "megatron_cpu (TP=1, DP=2, EP=2): PASS" in output


def test_a_megatron_moe_at_tp2_ep2_passes_its_experts_split_over_expert_tp(recorded):
    """Mixtral at TP 2 × EP 2 with sequence parallelism (megatron-core's requirement under TP): each expert split over
    the expert-TP group (2, as TP) — its linear_fc1 rows laid out per expert-TP rank —, the routers seeing each TP
    rank's part of the tokens: the replay PASSes, the aux loss within 1e-6 and the replicas bit-identical."""
    code, output, folder = recorded["moe_tp2_ep2"]
    assert code == 0, output[-4000:]
    result = _judged(folder)
    assert result["verdict"] == "PASS" and result["margin"] > 2, result
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    assert record["config"]["sharding"]["mesh"] == {"tp": 2, "dp": 2, "pp": 1, "ep": 2, "etp": 2}
    replay = json.loads((folder / "loss_ddp.json").read_text())
    for key in ("loss", "grad_norm", "aux_loss"):
        assert max_rel_diff(series(record, key), series(replay, key)) < 1e-6, key
    assert "replicas: bit-identical at each of 4 checks" in output and "teacher-forced check: within bounds" in output
    assert "megatron_cpu (TP=2, DP=2, EP=2): PASS" in output


def test_expert_gradients_not_averaged_over_the_ep_ranks_fail_at_step_0_naming_an_expert(recorded):
    """Seeded at EP 2: the expert buckets' gradient scaling left at 1 (each expert's gradient, which the all-to-all
    gathered from both DP ranks' tokens, summed rather than averaged over DP): the verdict FAILs at step 0, the
    tensor verdict naming an expert weight's gradient."""
    code, output, folder = recorded["expert_grads_not_averaged"]
    assert code == 1, output[-4000:]
    assert _judged(folder)["first_outside"]["step"] == 0
    assert re.search(r"tensor verdict: FAIL at step 0: model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj, phase "
                     r"gradient", output), output[-3000:]


def test_a_router_aux_loss_counted_twice_fails_at_step_0(recorded):
    """Seeded in Qwen3-MoE (Q/K norms) on one rank: each router's load-balancing loss attached twice (its gradient
    doubled, the loss megatron-core reports unchanged): the verdict FAILs at step 0, the tensor verdict naming a
    router's gradient."""
    code, output, folder = recorded["aux_loss_twice"]
    assert code == 1, output[-4000:]
    assert _judged(folder)["first_outside"]["step"] == 0
    assert re.search(r"tensor verdict: FAIL at step 0: model\.layers\.\d\.mlp\.gate\.weight, phase gradient", output), \
        output[-3000:]


def test_megatron_fsdp_at_dp2_passes_its_ranges_read_and_its_moments_checked(recorded):
    """Megatron-FSDP (optim_grads_params: each parameter a DTensor holding this rank's range of its flat elements,
    Megatron-LM's `--use-megatron-fsdp`) at DP 2: each range is its piece, the full weights and AdamW's moments summed
    over DP for the teacher-forced check, which checks every tensor's two moments; the replay PASSes."""
    code, output, folder = recorded["megatron_fsdp"]
    assert code == 0, output[-4000:]
    result = _judged(folder)
    assert result["verdict"] == "PASS" and result["margin"] > 2, result
    sharding = json.loads((folder / "loss_megatron_cpu.json").read_text())["config"]["sharding"]
    assert sharding["megatron_fsdp"] and sharding["zero_stage"] == 3
    checked = json.loads((folder / "teacher_forced_megatron_cpu.json").read_text())["checks"][0]["tensors"]
    moments = {k: v for k, v in checked.items() if k.startswith(("exp_avg/", "exp_avg_sq/"))}
    assert len(moments) == 2 * 21 and max(moments.values()) < 1e-5, moments
    assert "teacher-forced check: within bounds at steps 0" in output and "tensor verdict: PASS: 21 tensors" in output


def test_megatron_cores_loss_scaler_follows_the_rules_the_verdict_judges_its_scales_by(mapped):
    """megatron-core's DynamicGradScaler (and ConstantGradScaler), driven over fixed overflow patterns in the mapping
    job's process — growth after 1 to 4 good steps, hysteresis 1 to 3, the minimum reached —, gives each step the scale
    parity/comparing/loss_scales.py's account of its rules gives."""
    found = mapped["qwen2"]["loss_scales"]
    assert len(found) == 15 and any(min(theirs) == 2.0 for _, _, theirs, _ in found)  # the minimum held
    for settings, skipped, theirs, ours in found:
        assert theirs == ours, (settings, skipped)


@pytest.mark.parametrize("name", ["fp16", "fp16_perturbed"])
def test_an_fp16_job_passes_its_skipped_steps_recorded_and_followed(recorded, name):
    """Megatron-LM's fp16 on one rank (Float16Module's fp16 parameters; the distributed optimizer's fp32 master shards
    under the default kernels, the FP16 optimizer's fp32 masters under the perturbed ones and ATen's AVX2 kernels),
    megatron-core's DynamicGradScaler from 2^19 growing after every good step, hysteresis 2: steps 1 and 2 overflow
    and megatron-core skips them. The record holds each step's scale and skip and the scaler's settings under its
    rules; its replay follows them — the same steps skipped, its own gradients overflowing at the record's scale where
    the record's did, no note — and PASSes, every check within half its bound (its fp32 twin skipping the same steps)."""
    output, folder = passed_within_margin(recorded[name])
    record = json.loads((folder / "loss_megatron_cpu.json").read_text())
    replay = json.loads((folder / "loss_ddp.json").read_text())
    config = record["config"]
    assert (config["precision"], config["reduce_dtype"], config["loss_scaling"]) == ("fp16", "fp32", {
        "loss_scale": 0.0, "initial_scale_power": 19, "loss_scale_window": 1, "hysteresis": 2,
        "consecutive_hysteresis": False, "min_loss_scale": 1.0, "rules": "megatron-core"})
    assert config["sharding"]["distributed_optimizer"] == (name == "fp16")
    assert [(s["skipped"], s["loss_scale"]) for s in record["steps"]] == [
        (False, 2.0 ** 19), (True, 2.0 ** 20), (True, 2.0 ** 20), (False, 2.0 ** 19)]
    assert [math.isfinite(float(s["grad_norm"])) for s in record["steps"]] == [True, False, False, True]  # "Infinity"
    assert [(s["skipped"], s["loss_scale"], s["overflowed"]) for s in replay["steps"]] == [
        (s["skipped"], s["loss_scale"], s["skipped"]) for s in record["steps"]]
    for key in ("loss", "param_norm"):
        assert max_rel_diff(series(record, key), series(replay, key)) < 1e-4, key
    assert "note: the replay's gradients" not in output and "tensor verdict: PASS: 21 tensors" in output


def test_a_scale_not_backed_off_after_its_overflows_fails_at_that_step(recorded):
    """The clean fp16 job's record, a copy of it in memory with its scale at step 3 left at 2^20 where megatron-core
    halves it after the second overflow in a row (hysteresis 2; its other entries, its replay and references as they
    were): the verdict FAILs it at step 3 on the loss scaler's rules, ahead of any tolerance."""
    from parity.comparing.curve_report import statistics_text
    from parity.comparing.curves import compare, load_references, load_runs

    folder = str(recorded["fp16"][2])
    runs = load_runs(folder)
    record = next(r for r in runs if r.name == "megatron_cpu")
    record.steps[3]["loss_scale"] = 2.0 ** 20
    comparison = compare(runs, references=load_references(folder))
    first = comparison.results[0].verdict.first_outside
    assert not comparison.passed and (first.step, first.quantity, first.test, first.value, first.reference) == (
        3, "loss_scale", "loss_scaler", 2.0 ** 20, 2.0 ** 19), first
    assert ("first step outside: step 3: the loss scale 1.04858e+06 is not the 524288 that megatron-core's scaler's "
            "rules give from its settings and the steps it skipped before") in statistics_text(comparison)


def test_a_step_taken_on_an_fp16_overflow_fails_at_that_step(recorded):
    """Seeded in the fp16 job (the FP16 optimizer, its fp32 masters, on one rank, 2 steps): megatron-core finds the
    overflow at step 1 and updates its scale, but the step is applied: the verdict FAILs at step 1, its loss scaler's
    skip judged from the record's own gradients (their norm not finite) ahead of any tolerance; the replay, which
    follows the record, says its own gradients overflowed at the record's scale where the record applied them."""
    code, output, folder = recorded["fp16_step_on_overflow"]
    assert code == 1, output[-4000:]
    first = _judged(folder)["first_outside"]
    assert (first["step"], first["quantity"], first["test"]) == (1, "skipped", "loss_scaler"), first
    assert ("first step outside: step 1: the step was applied, but its gradients held an inf or a NaN (pre-clip "
            "norm inf): a step taken on an fp16 overflow") in output, output[-3000:]
    assert "note: the replay's gradients overflowed in fp16 at megatron_cpu's loss scale at step 1, which" in output
