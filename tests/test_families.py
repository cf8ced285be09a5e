"""Model families: every tiny preset under every strategy against DDP, each family's pitfall seeded and caught, and
transformers' own distributed training verified — the harness doing its job on the model a user brings.

fp32 (one local gloo group per world size): each family's DDP (DP 2 × 2) against FSDP2 + TP, transformers' own TP +
FSDP2 and DeepSpeed AutoTP (TP 2 × DP 2), and the pipeline (2 stages × DP 2), all on padded samples in 2 micro-batches
(--grad_accum_steps 2; the pipeline's 2 micro-batches), at 1e-5 on loss, grad norm and parameter norm at every step
and on the final parameters; a multimodal checkpoint's folder (Gemma 3 4B's config at tiny widths) trains its language
model under DDP and FSDP2 + TP at the same bound, and GPT-2 and OLMoE, whose stacks are read off their modules (no
pipeline plan), under DDP and FSDP2 at DP 2. Where a clean run of a library's own code FAILs — transformers'
per-head q/k norms under gradient accumulation — the test asserts the FAIL, and the layer check names the module. The
four seeded pitfalls FAIL at their step, and the layer check names their module.

bf16: each family's FSDP2 + TP and transformers runs against DDP's bf16 run with its three noise references (the
calibrated verdict), at a seed outside the calibration study, on this CPU's default kernels; on AVX2's path OLMo2 and
Qwen3 only (AVX2_FAMILIES: the closest to their bound there, and the two q/k norm paths — full-width over TP, per
head), qwen2-tiny's in tests/test_calibration.py. The other four families' AVX2 runs, measured once
(docs/model_families.md: 2.3 × noise at most, against OLMo2's 7.1), are not in the suite.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import (FP32_RTOL, assert_replicas_held, final_parameters, max_abs_param_diff, max_rel_diff,
                      multimodal_gemma3, series)
from parity.calibration.bugs import FAMILY_BUGS
from parity.commands.compare_curves import main as plot_loss_curves
from parity.commands.layer_check import main as run_verification
from parity.comparing.tolerances import NOISE_K, final_parameters_atol_fp32
from parity.driver.local_group import plan, run_group, same_kernels
from parity.models.presets import MOE_PRESETS, TINY_PRESETS
from parity.training.record import load_record, run_record_path

FAMILIES = [name for name in TINY_PRESETS if name != "qwen2-tiny" and name not in MOE_PRESETS]  # qwen2-tiny: every
# other test module; the mixtures of experts: tests/test_moe.py
FP32 = {"seq_length": 64, "debug_steps": 6, "learning_rate": 3e-4, "log_interval": 6, "checkpoint_interval": 0,
        "precision": "fp32", "dataset": "synthetic_padded", "batch_size": 2}
DDP = {"num_workers": 2, "grad_accum_steps": 2}
TP2_DP2 = {"num_workers": 4, "tp_size": 2, "grad_accum_steps": 2}
STRATEGIES = {"fsdp": TP2_DP2, "transformers": TP2_DP2, "deepspeed": TP2_DP2,
              "pipeline": {"num_workers": 4, "pp_size": 2, "dp_size": 2, "microbatches": 2}}
# A clean run of transformers' own code that FAILs: its per-head q/k norms ("replicated_with_grad_allreduce") all-reduce
# the gradient accumulated so far after every micro-batch's backward, so under --grad_accum_steps 2 the first
# micro-batch's part is summed over TP twice (docs/model_families.md).
LIBRARY_FAILS = {("qwen3-tiny", "transformers"), ("gemma3-tiny", "transformers")}
# Each pitfall's first FAIL step (fp32 verdict) and the layer check's first divergence (module, phase)
BUG_FAILS = {"qwen3-tiny": (1, "self_attn.k_norm.weight", "parameter gradient"),
             "olmo2-tiny": (0, "self_attn.q_norm", "forward output"),
             "phi3-tiny": (0, "mlp.gate_up_proj", "forward output"),
             "gemma3-tiny": (1, "model.embed_tokens", "forward output")}
# A Gemma 3 4B-style image-text folder (--model_name of a multimodal checkpoint): its language model, cut to 2 layers,
# under DDP and FSDP2 + TP
MULTIMODAL = "gemma3-multimodal"
# Classes whose transformers code ships no pipeline plan, their decoder stack read off their modules: GPT-2 (learned
# positions, LayerNorm, Conv1D) and OLMoE (a mixture of experts, its load-balancing loss), no TP plan the harness can
# use for GPT-2: DDP against FSDP2 at DP 2
READ_OFF_MODULES = {
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 2048, "n_positions": 128},
    "olmoe": {"model_type": "olmoe", "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 2048, "num_experts": 4, "num_experts_per_tok": 2,
              "num_hidden_layers": 2, "output_router_logits": True}}
DP2 = {"num_workers": 2, "grad_accum_steps": 2}
SEED_BF16 = 65  # outside the calibration study's seeds (42–61) and test_calibration's (64)
BF16 = {"seq_length": 64, "debug_steps": 12, "learning_rate": 1e-3, "warmup_steps": 3, "max_grad_norm": 0.8,
        "log_interval": 12, "checkpoint_interval": 0, "seed": SEED_BF16}
BF16_RUNS = {  # file → (strategy, layout): DDP's bf16 baseline, its three references, the two runs judged
    "loss_ddp.json": ("ddp", {"precision": "bf16", "num_workers": 2, "batch_size": 2}),
    "noise_reference_ddp_tp1_dp1_bf16.json": ("ddp", {"precision": "bf16", "num_workers": 1, "batch_size": 4,
                                                      "noise_reference": True}),
    "noise_reference_ddp_tp1_dp4_bf16.json": ("ddp", {"precision": "bf16", "num_workers": 4, "batch_size": 1,
                                                      "noise_reference": True}),
    "noise_reference_ddp_tp1_dp2_fp32.json": ("ddp", {"precision": "fp32", "num_workers": 2, "batch_size": 2,
                                                      "noise_reference": True}),
    "loss_fsdp.json": ("fsdp", {"precision": "bf16", "num_workers": 4, "tp_size": 2, "batch_size": 2}),
    "loss_transformers.json": ("transformers", {"precision": "bf16", "num_workers": 4, "tp_size": 2, "batch_size": 2}),
}
KERNELS = ("default", "avx2")
# The families run on AVX2's path too: OLMo2 moves farthest there (FSDP2 + TP 7.1 × noise), its full-width q/k norm a
# sum over TP; Qwen3's per-head norms take transformers' replicated_with_grad_allreduce path (2.2 / 2.3 × noise).
AVX2_FAMILIES = ("olmo2-tiny", "qwen3-tiny")
BF16_CASES = [(family, kernel) for kernel in KERNELS for family in FAMILIES
              if kernel == "default" or family in AVX2_FAMILIES]


def family_weights(root, family: str, seed: int = 42, folder=None) -> str:
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    path = str(root / f"{family}_{seed}.pt")
    save_init_weights(build_model(resolve_model_config(str(folder or family), 2 if folder else None), seed), path)
    return path


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    """{(family, run): (its record's path, its record)}: every family's DDP, its four strategies, its seeded pitfall."""
    root = tmp_path_factory.mktemp("families_fp32")
    planned = {}
    for family in FAMILIES:
        weights = family_weights(root, family)
        runs = {"ddp": ("ddp", DDP), **{s: (s, layout) for s, layout in STRATEGIES.items()}}
        if family in FAMILY_BUGS:
            runs["bug"] = ("fsdp", {**TP2_DP2, "strategy_class": FAMILY_BUGS[family]})
        for name, (strategy, layout) in runs.items():
            folder = root / family / name
            planned[family, name] = plan(strategy, {**FP32, "model_name": family, "init_weights_path": weights,
                                                    "loss_output_dir": folder, "storage_path": root / "ray",
                                                    "experiment_name": f"{family}_{name}", **layout})
    multimodal_gemma3(root / MULTIMODAL)  # an image-text checkpoint's folder: its language model trained
    for family, config in READ_OFF_MODULES.items():  # classes without a pipeline plan: their stack read off modules
        (root / family).mkdir()
        (root / family / "config.json").write_text(json.dumps(config))
    for family, fsdp in ((MULTIMODAL, TP2_DP2), *((f, DP2) for f in READ_OFF_MODULES)):
        weights = family_weights(root, family, folder=root / family)
        for name, layout in (("ddp", DDP), ("fsdp", fsdp)):
            planned[family, name] = plan(name, {**FP32, "model_name": str(root / family), "num_layers": 2,
                                                "init_weights_path": weights, "loss_output_dir": root / family / name,
                                                "storage_path": root / "ray", "experiment_name": f"{family}_{name}",
                                                **layout})
    for world in (2, 4):
        run_group([run for run in planned.values() if run[0].num_workers == world])
    return {key: (run_record_path(cfg), load_record(run_record_path(cfg))) for key, (cfg, _) in planned.items()}


@pytest.mark.parametrize("family,strategy", [(f, s) for f in FAMILIES for s in STRATEGIES if (f, s) not in LIBRARY_FAILS]
                         + [(f, "fsdp") for f in (MULTIMODAL, *READ_OFF_MODULES)])
def test_every_family_trains_as_ddp_under_every_strategy_in_fp32(fp32_runs, family, strategy):
    _, base = fp32_runs[family, "ddp"]
    _, run = fp32_runs[family, strategy]
    assert run["config"]["model_config"]["model_type"] == base["config"]["model_config"]["model_type"]
    assert run["config"]["fingerprint"]["model_type"] == base["config"]["model_config"]["model_type"]
    assert series(run, "batch_hash") == series(base, "batch_hash") and series(run, "tokens") == series(base, "tokens")
    assert len(set(series(base, "tokens"))) > 1  # padded: the steps hold different numbers of loss tokens
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(base, key)) < FP32_RTOL, key
    bound = final_parameters_atol_fp32(series(base, "lr"))
    assert max_abs_param_diff(final_parameters(run), final_parameters(base)) < bound
    assert_replicas_held(base)
    assert_replicas_held(run)


def verdict(folder, capsys) -> tuple[int, dict, str]:
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "curves.png")])
    out = capsys.readouterr().out
    return code, json.loads((folder / "curve_comparison.json").read_text()), out


def beside_ddp(fp32_runs, family: str, name: str, tmp_path):
    """A folder with the family's DDP record and the run `name`'s."""
    for key in ("ddp", name):
        shutil.copy(fp32_runs[family, key][0], tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", sorted(FAMILY_BUGS))
def test_each_family_pitfall_fails_the_fp32_verdict_at_its_step(fp32_runs, tmp_path, capsys, family):
    code, result, out = verdict(beside_ddp(fp32_runs, family, "bug", tmp_path), capsys)
    against = result["against_baseline"]["fsdp"]
    first = against["first_outside"]  # the curves' step, or earlier where the teacher-forced check caught it first
    assert (code, against["verdict"]) == (1, "FAIL"), out
    assert first["step"] == BUG_FAILS[family][0] or (first["test"] == "teacher_forced"
                                                     and first["step"] < BUG_FAILS[family][0]), out
    assert f"strategy_class: None vs parity.calibration.bugs:{FAMILY_BUGS[family].__name__}" in out
    parted = against["replicas_parted"]
    if family == "qwen3-tiny":  # the norm weights' copies on the two TP ranks part at once
        assert parted["step"] == 0 and parted["name"].endswith(("q_norm.weight", "k_norm.weight")), parted
    else:  # the other pitfalls change what every rank computes alike: no copies part
        assert parted is None, parted


@pytest.mark.parametrize("family", sorted(f for f, _ in LIBRARY_FAILS))
def test_transformers_per_head_norms_fail_under_gradient_accumulation(fp32_runs, tmp_path, capsys, family):
    """transformers 5.23's replicated_with_grad_allreduce under --grad_accum_steps 2: FAIL at step 0 — kept as a test
    asserting the FAIL (transformers is not patched), and the layer check names the norm. The global grad norm moves by
    5.6e-5 on qwen3-tiny (inside its fp32 bound of 1e-4: docs/tensors_measured.md), 2.3e-4 on gemma3-tiny; the
    teacher-forced check FAILs at step 0 on a k_norm's exp_avg_sq (1.19 and 1.97 relative): the first point outside."""
    code, result, out = verdict(beside_ddp(fp32_runs, family, "transformers", tmp_path), capsys)
    against = result["against_baseline"]["transformers"]
    assert (code, against["verdict"]) == (1, "FAIL"), out
    assert (against["first_outside"]["step"], against["first_outside"]["quantity"]) == (0, "teacher_forced")
    assert re.search(r"teacher-forced check FAILS at step 0: exp_avg(_sq)?/model\.layers\.\d\.self_attn\.[qk]_norm\.weight "
                     r"relative diff", out), out


def layer_check(folder, family: str, *flags) -> tuple[int, dict]:
    code = run_verification(["--output_dir", str(folder), "--launcher", "local", "--device", "cpu", "--model_name",
                             family, "--seq_length", "64", "--tp_size", "2", *flags])
    return code, json.loads((folder / "layer_comparison.json").read_text())


def first_divergence(comparison: dict, run: str) -> tuple[str, str]:
    pair = next(p for p in comparison["pairs"] if (p["run"], p["reference"]) == (run, "ddp"))
    return pair["first_outside"]["module"], pair["first_outside"]["quantity"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_check_passes_every_tensor_of_every_family(tmp_path, family):
    code, comparison = layer_check(tmp_path, family, "--strategy", "ddp", "deepspeed", "fsdp", "transformers")
    assert code == 0
    assert {(p["run"], p["reference"]) for p in comparison["pairs"]} >= {
        ("deepspeed", "ddp"), ("fsdp", "ddp"), ("transformers", "ddp")}
    assert all(p["verdict"] == "PASS" and p["max_rel"] < 1e-5 for p in comparison["pairs"])


@pytest.mark.parametrize("family", sorted(FAMILY_BUGS))
def test_the_layer_check_names_each_pitfalls_module(tmp_path, family):
    code, comparison = layer_check(tmp_path, family, "--strategy", "ddp", "--strategy_class",
                                   f"parity.calibration.bugs:{FAMILY_BUGS[family].__name__}")
    module, phase = first_divergence(comparison, "fsdp")
    _, where, what = BUG_FAILS[family]
    assert code == 1 and module.endswith(where) and phase.startswith(what), (module, phase)


def test_the_layer_check_names_transformers_head_norm_gradients(tmp_path):
    """Under --grad_accum_steps 2 the layer check names the per-head norms' parameter gradient; the same step with one
    micro-batch PASSes (test_the_layer_check_passes_every_tensor_of_every_family[qwen3-tiny], transformers against DDP
    among its pairs): the accumulation is the cause."""
    code, comparison = layer_check(tmp_path / "two", "qwen3-tiny", "--strategy", "ddp", "transformers",
                                   "--grad_accum_steps", "2")
    module, phase = first_divergence(comparison, "transformers")
    assert code == 1 and module.split(".")[-2] in ("q_norm", "k_norm") and phase == "parameter gradient"


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory):
    """Per kernel path, per family of BF16_CASES, a folder with DDP's bf16 baseline, its three references, FSDP2 + TP's
    and transformers' bf16 runs (one local group per world size and kernel path; where AVX2's path takes this CPU's
    default kernels, its folders are links to the default path's)."""
    root = tmp_path_factory.mktemp("families_bf16")
    weights = {family: family_weights(root, family, SEED_BF16) for family in FAMILIES}
    alike = {kernel: next(k for k in KERNELS if same_kernels(k, kernel)) for kernel in KERNELS}
    for kernel in sorted(set(alike.values()), key=KERNELS.index):
        groups: dict[int, list] = {}
        for family in FAMILIES if kernel == "default" else AVX2_FAMILIES:
            for strategy, layout in BF16_RUNS.values():
                run = plan(strategy, {**BF16, "model_name": family, "init_weights_path": weights[family],
                                      "loss_output_dir": root / kernel / family, "storage_path": root / "ray", **layout})
                groups.setdefault(run[0].num_workers, []).append(run)
        for world in sorted(groups):
            run_group(groups[world], kernel)
    for kernel, ran in alike.items():
        if ran != kernel:
            (root / kernel).symlink_to(root / ran)
    return root


@pytest.mark.parametrize("family,kernel", BF16_CASES)
def test_every_family_passes_the_calibrated_bf16_verdict(bf16_folders, capsys, family, kernel):
    code, result, out = verdict(bf16_folders / kernel / family, capsys)
    assert code == 0, out
    assert result["noise_references"] == sorted(f for f in BF16_RUNS if f.startswith("noise_reference"))
    for strategy in ("fsdp", "transformers"):
        against = result["against_baseline"][strategy]
        assert against["calibrated"] and against["verdict"] == "PASS"
        assert 0 < max(against["noise_ratio"].values()) < NOISE_K


# --- transformers' strategy: checkpoints, on the strategy itself -----------------------------------------------

def _transformers_round_trip_rank(rank: int, world: int, port: int, cfg_dict: dict, batches, directory: str) -> None:
    """transformers' TP 2 × FSDP 2 on a tied family: two steps; the tie kept (one parameter, under the embedding's
    name); save; a third step; a fresh strategy loads the checkpoint and takes the third step again, to the same
    bits and the same full parameters."""
    from conftest import assert_checkpoint_resumes_bitwise, gloo_rank, train_step_at
    from parity.training.loop import start_worker

    with gloo_rank(rank, world, port):
        s = start_worker({"cfg": cfg_dict}).strategy
        model = s.hf_model
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for k in range(2):
            train_step_at(s, batches, k)
        params = assert_checkpoint_resumes_bitwise(s, cfg_dict, batches, directory, 2)
        assert "lm_head.weight" not in params  # the tied weight once, as a stock model names it


def test_transformers_strategy_checkpoint_round_trip(tmp_path):
    import os

    from conftest import free_port
    from parity.driver.local_group import start_processes

    weights = family_weights(tmp_path, "qwen3-tiny")
    cfg, batches = plan("transformers", {**FP32, "dataset": "synthetic", "model_name": "qwen3-tiny", **TP2_DP2,
                                         "grad_accum_steps": 1, "init_weights_path": weights,
                                         "loss_output_dir": tmp_path, "storage_path": tmp_path / "ray"})
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    start_processes(_transformers_round_trip_rank, (4, free_port(), cfg.to_dict(), batches, str(directory)), 4)
    assert sorted(os.listdir(directory / "dcp")) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
