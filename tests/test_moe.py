"""Mixture of experts and expert parallelism under the same verdict (docs/moe.md): every MoE preset's expert-parallel
runs against DDP — every expert on every rank — with the load-balancing loss defined once over the global batch, the
seeded bugs of expert parallelism caught at their step and named by the layer check, and a calibrated bf16 PASS.

One module fixture: every run in local gloo groups, one group per world size (fp32 and bf16 runs share them), on
padded samples in 2 micro-batches. fp32 at 1e-5 on the LM loss, the load-balancing loss, the grad norm and the
parameter norm at every step, the final parameters, and the expert loads equal at every step and layer.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import (FP32_RTOL, assert_same_tensors_at_step_0, final_parameters, max_abs_param_diff, max_rel_diff,
                      series, tensor_norms_off)
from test_families import family_weights, verdict
from parity.calibration import bugs
from parity.commands.layer_check import main as run_verification
from parity.comparing.tolerances import NOISE_K, final_parameters_atol_fp32
from parity.driver.local_group import plan, run_group
from parity.training.record import load_record, run_record_path

FP32 = {"seq_length": 32, "debug_steps": 3, "learning_rate": 3e-4, "log_interval": 3, "checkpoint_interval": 0,
        "precision": "fp32", "dataset": "synthetic_padded", "grad_accum_steps": 2}
DDP = {"num_workers": 2, "batch_size": 4}  # the global batch of 8 samples every setup shares
EP2 = {"num_workers": 4, "ep_size": 2, "batch_size": 2}  # DP 4, experts over EP groups of 2 (2 copies of each)
TP2_EP2 = {"num_workers": 4, "tp_size": 2, "ep_size": 2, "batch_size": 4}  # DP 2 × TP 2, an EP group = a TP group
TP2 = {"num_workers": 4, "tp_size": 2, "batch_size": 4}  # expert TP: each expert split over TP
SETUPS = {  # preset → {setup: (strategy, layout)}: TP only where the family's plan has attention rules
    "qwen3-moe-tiny": {"fsdp_ep2": ("fsdp", EP2), "fsdp_tp2_ep2": ("fsdp", TP2_EP2), "fsdp_tp2": ("fsdp", TP2),
                       "transformers_ep2": ("transformers", EP2)},
    "mixtral-tiny": {"fsdp_ep2": ("fsdp", EP2), "fsdp_tp2_ep2": ("fsdp", TP2_EP2),
                     "transformers_ep2": ("transformers", EP2), "transformers_tp2_ep2": ("transformers", TP2_EP2)},
    "deepseek-v3-tiny": {"fsdp_ep2": ("fsdp", EP2), "transformers_ep2": ("transformers", EP2),
                         "deepspeed_ep2": ("deepspeed", EP2)},  # DeepSpeed's AutoEP: the one family it runs here
}
BUG_PRESET = "qwen3-moe-tiny"
# Each seeded bug: its copy, the layout it shows in, its first FAIL step and curve, and the layer check's first
# divergence (module suffix, phase) at --dp_size 2 with the layout's TP and EP.
BUGS = {
    "router": (bugs.DDPRouterGradientsUnreduced, DDP, (0, "teacher_forced"),  # the check at step 0; the loss at step 1
               ("mlp.gate.weight", "parameter gradient")),
    "aux_per_rank": (bugs.FSDPAuxStatisticsPerRank, EP2, (0, "aux_loss"), ("mlp.gate", "backward (output gradient)")),
    "scaled_by_ep": (bugs.FSDPExpertGradientsScaledByEP, EP2, (0, "grad_norm"), ("mlp.experts.down_proj",
                                                                               "parameter gradient")),
    "gate_up_halves": (bugs.FSDPFusedExpertGateUpSplitInHalves, TP2, (0, "loss"), ("mlp.experts", "forward output")),
}
SEED_BF16 = 66  # outside the calibration study's seeds (42–61), test_calibration's (64) and test_families' (65)
BF16 = {"seq_length": 32, "debug_steps": 10, "learning_rate": 1e-3, "warmup_steps": 3, "max_grad_norm": 0.8,
        "log_interval": 10, "checkpoint_interval": 0, "seed": SEED_BF16, "precision": "bf16"}
BF16_PRESET = "mixtral-tiny"
BF16_RUNS = {  # file → (strategy, layout): DDP's bf16 baseline, its three references, FSDP2 + EP's bf16 run
    "loss_ddp.json": ("ddp", {"num_workers": 2, "batch_size": 2}),
    "noise_reference_ddp_tp1_dp1_bf16.json": ("ddp", {"num_workers": 1, "batch_size": 4, "noise_reference": True}),
    "noise_reference_ddp_tp1_dp4_bf16.json": ("ddp", {"num_workers": 4, "batch_size": 1, "noise_reference": True}),
    "noise_reference_ddp_tp1_dp2_fp32.json": ("ddp", {"num_workers": 2, "batch_size": 2, "precision": "fp32",
                                                      "noise_reference": True}),
    "loss_fsdp.json": ("fsdp", {"num_workers": 4, "batch_size": 1, "ep_size": 2}),
}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """{key: (record path, record)}: per preset DDP and its setups, the seeded bugs, and (key "bf16") the folder of
    DDP's bf16 baseline, its references and FSDP2 + EP's bf16 run."""
    root = tmp_path_factory.mktemp("moe")
    planned = {}

    def add(key, strategy, values, folder):
        planned[key] = plan(strategy, {"loss_output_dir": folder, "storage_path": root / "ray",
                                       "experiment_name": "_".join(map(str, key)), **values})

    for preset, setups in SETUPS.items():
        common = {**FP32, "model_name": preset, "init_weights_path": family_weights(root, preset)}
        for name, (strategy, layout) in {"ddp": ("ddp", DDP), **setups}.items():
            add((preset, name), strategy, {**common, **layout}, root / preset / name)
    common = {**FP32, "model_name": BUG_PRESET, "init_weights_path": str(root / f"{BUG_PRESET}_42.pt")}
    for name, (cls, layout, _, _) in BUGS.items():
        add(("bug", name), "ddp" if cls.__mro__[1].name == "ddp" else "fsdp",
            {**common, **layout, "strategy_class": cls}, root / "bugs" / name)
    weights = family_weights(root, BF16_PRESET, SEED_BF16)
    for file, (strategy, layout) in BF16_RUNS.items():
        add(("bf16", file), strategy, {**BF16, "model_name": BF16_PRESET, "init_weights_path": weights, **layout},
            root / "bf16")
    for world in (1, 2, 4):
        run_group([run for run in planned.values() if run[0].num_workers == world])
    found = {key: (run_record_path(cfg), load_record(run_record_path(cfg))) for key, (cfg, _) in planned.items()}
    return {**found, "bf16": root / "bf16"}


CASES = [(preset, setup) for preset, setups in SETUPS.items() for setup in setups]


@pytest.mark.parametrize("preset,setup", CASES)
def test_every_moe_preset_trains_as_ddp_under_expert_parallelism_in_fp32(moe_runs, preset, setup):
    _, base = moe_runs[preset, "ddp"]
    _, run = moe_runs[preset, setup]
    assert run["config"]["ep_size"] == SETUPS[preset][setup][1].get("ep_size", 1)
    assert series(run, "batch_hash") == series(base, "batch_hash") and series(run, "tokens") == series(base, "tokens")
    assert len(set(series(base, "tokens"))) > 1  # padded: the steps hold different numbers of loss tokens
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(run, key), series(base, key)) < FP32_RTOL, key
    aux = series(base, "aux_loss")
    if preset == "deepseek-v3-tiny":  # its loss has no load-balancing term (transformers defines none)
        assert aux == series(run, "aux_loss") == [None] * len(aux)
    else:
        assert max_rel_diff(series(run, "aux_loss"), aux) < FP32_RTOL and min(aux) > 1.0
    assert series(run, "expert_loads") == series(base, "expert_loads")  # every token to DDP's experts
    bound = final_parameters_atol_fp32(series(base, "lr"))
    assert max_abs_param_diff(final_parameters(run), final_parameters(base)) < bound
    # every tensor, the experts too (sharded over EP, or over TP; AutoEP's unfused w1/w3 as the stock gate_up_proj):
    # the squares add up to the step's norms — DeepSpeed's own at ZeRO-1 rounded to fp32 — and each is DDP's at step 0
    grad, param = tensor_norms_off(run)
    assert grad < (1e-7 if setup.startswith("deepspeed") else 1e-12) and param < 1e-12, (grad, param)
    assert max(tensor_norms_off(base)) < 1e-12
    assert_same_tensors_at_step_0(run, base)


def test_the_load_balancing_loss_is_transformers_own_on_one_batch():
    """On one rank's one batch the harness's definition is transformers' own load_balancing_loss_func with the
    attention mask (the harness takes it over the global batch instead)."""
    import torch

    from parity.training import routing
    from parity.training.data import PaddedMarkov
    from parity.models.families import family_of
    from parity.models.model import build_model, resolve_model_config

    for preset in ("qwen3-moe-tiny", "mixtral-tiny"):
        config = resolve_model_config(preset)
        model, moe = build_model(config, 0), family_of(config).moe
        samples = PaddedMarkov(config.vocab_size, 32, 8, 0)
        ids, labels = (torch.tensor(list(x)) for x in zip(*(samples[i] for i in range(3))))
        tap = routing.RouterTap(model, family_of(config))
        with tap.recording() as calls, torch.no_grad():
            out = model(input_ids=ids, attention_mask=(labels != -100).long(), output_router_logits=True)
        mask = routing.real_tokens(labels)
        counts = routing.expert_counts(calls, mask, moe.num_experts)
        assert counts.sum() == moe.top_k * len(moe.layers) * mask.sum()
        mine = routing.aux_loss_term(routing.probability_sums(calls, mask), counts, moe.top_k)
        assert abs(float(mine) / float(out.aux_loss) - 1) < 1e-6


@pytest.mark.parametrize("bug", BUGS)
def test_each_expert_parallel_bug_fails_the_fp32_verdict_at_its_step(moe_runs, tmp_path, capsys, bug):
    cls, _, (step, quantity), _ = BUGS[bug]
    for key in ((BUG_PRESET, "ddp"), ("bug", bug)):
        shutil.copy(moe_runs[key][0], tmp_path)
    code, result, out = verdict(tmp_path, capsys)
    (name, against), = result["against_baseline"].items()
    assert (code, against["verdict"]) == (1, "FAIL"), out
    assert (against["first_outside"]["step"], against["first_outside"]["quantity"]) == (step, quantity), out
    assert f"parity.calibration.bugs:{cls.__name__}" in out


def layer_check(folder, *flags) -> tuple[int, dict]:
    """The layer check's exit code and comparison; its ranks' output on the terminal (--verbose), so that a rank that
    dies (once in CI: SIGABRT, no line of its own) leaves what it printed in the test's report."""
    code = run_verification(["--output_dir", str(folder), "--launcher", "local", "--device", "cpu", "--model_name",
                             BUG_PRESET, "--seq_length", "32", "--dp_size", "2", "--grad_accum_steps", "2", "--verbose",
                             *flags])
    return code, json.loads((folder / "layer_comparison.json").read_text())


def pair(comparison: dict, run: str) -> dict:
    return next(p for p in comparison["pairs"] if (p["run"], p["reference"]) == (run, "ddp"))


def test_the_layer_check_passes_expert_parallelism_and_names_the_unreduced_router(tmp_path):
    """FSDP2 + EP and transformers' EP at DP 2 × EP 2: every tensor within 1e-5 — the experts' outputs and gradients,
    their full 3-D weights and gradients (all experts), the router logits — and each token routed to DDP's experts;
    the router bug's copy beside them, named by its module."""
    code, comparison = layer_check(tmp_path, "--tp_size", "1", "--ep_size", "2", "--strategy", "ddp", "fsdp",
                                   "transformers", "--strategy_class",
                                   f"parity.calibration.bugs:{bugs.DDPRouterGradientsUnreduced.__name__}")
    assert code == 1
    for run in ("fsdp", "transformers"):
        result = pair(comparison, run)
        assert result["verdict"] == "PASS" and result["max_rel"] < FP32_RTOL
        keys = {row["key"] for row in result["rows"]}
        assert {"output/model.layers.1.mlp.experts", "output_grad/model.layers.1.mlp.experts",
                "output/model.layers.1.mlp.gate", "grad/model.layers.1.mlp.experts.gate_up_proj"} <= keys
        for router in result["routing"]:
            assert router["loads"] == router["reference_loads"] and not router["flips"]
    first = pair(comparison, "ddp_router_unreduced")["first_outside"]
    assert first["module"].endswith(BUGS["router"][3][0]) and first["quantity"] == BUGS["router"][3][1]


@pytest.mark.parametrize("bug", [b for b in BUGS if b != "router"])
def test_the_layer_check_names_each_expert_parallel_bugs_module(tmp_path, bug):
    cls, layout, _, (where, phase) = BUGS[bug]
    code, comparison = layer_check(tmp_path, "--tp_size", str(layout.get("tp_size", 1)), "--ep_size",
                                   str(layout.get("ep_size", 1)), "--strategy", "ddp", "--strategy_class",
                                   f"parity.calibration.bugs:{cls.__name__}")
    first = pair(comparison, "fsdp")["first_outside"]
    assert code == 1 and first["module"].endswith(where) and first["quantity"] == phase, first


def test_fsdp_expert_parallelism_passes_the_calibrated_bf16_verdict(moe_runs, capsys):
    """bf16 at a seed outside the calibration study: FSDP2 + EP against DDP's bf16 run and its three references.
    Near-ties may route a token to another expert under another reduction order: the verdict reports how many (the
    flip count) and the curves' bounds decide."""
    code, result, out = verdict(moe_runs["bf16"], capsys)
    assert code == 0, out
    against = result["against_baseline"]["fsdp"]
    assert against["calibrated"] and against["verdict"] == "PASS"
    assert 0 < max(against["noise_ratio"].values()) < NOISE_K and "aux_loss" in against["noise_ratio"]
    flips = against["routing"]["assignments_moved"]
    assert ("expert loads: equal" in out) == (flips == 0), out
    print(f"bf16 FSDP2 + EP: deviation ÷ noise {max(against['noise_ratio'].values()):.2f}, {flips} token-expert "
          f"assignments differ from DDP's over {len(against['routing']['steps'])} steps")


@pytest.mark.parametrize("values,line", [
    ({"model_name": "qwen3-moe-tiny", "num_workers": 3, "ep_size": 3},
     "--ep_size 3 does not divide the model's 4 experts: use an --ep_size in [1, 2, 4]"),
    ({"model_name": "qwen3-tiny", "num_workers": 2, "ep_size": 2},
     "--ep_size 2: a 'qwen3' model has no experts that transformers' expert-parallel plan names (not a mixture of "
     "experts): use --ep_size 1"),
    ({"model_name": "qwen3-moe-tiny", "num_workers": 2, "ep_size": 4},
     "--ep_size 4 does not fit --dp_size 2 × --tp_size 1: expert groups are whole TP groups within the 2 ranks"),
    ({"model_name": "qwen3-moe-tiny", "num_workers": 2, "ep_size": 2, "strategy": "ddp"},
     "ddp does not shard experts (every expert on every rank): --ep_size must be 1 (got 2)"),
    ({"model_name": "mixtral-tiny", "num_workers": 2, "ep_size": 2, "strategy": "deepspeed"},
     "DeepSpeed 0.19.8's AutoEP cannot convert a 'mixtral' model under transformers 5.23.0: its router-logits adapter "
     "calls transformers' output-capture registry as get(key, default)"),
    ({"model_name": "qwen3-moe-tiny", "num_workers": 4, "pp_size": 2, "dp_size": 2, "strategy": "pipeline"},
     "the pipeline does not train a mixture of experts ('qwen3_moe'): its load-balancing loss is one product"),
    ({"model_name": "qwen3-moe-tiny", "num_workers": 2, "tp_size": 2, "tp_plan": "sequence_parallel"},
     "--tp_plan sequence_parallel does not shard a mixture of experts' sparse blocks over the sequence"),
])
def test_bad_expert_parallel_input_is_one_line(tmp_path, values, line):
    from parity.errors import ConfigError
    from parity.driver.config import resolve
    from parity.driver.local_group import CLUSTER

    values = dict(values)
    strategy = values.pop("strategy", "fsdp")
    with pytest.raises(ConfigError) as raised:
        resolve(strategy, {"device": "cpu", "save_init_weights": True, "init_weights_path": tmp_path / "w.pt",
                           "loss_output_dir": tmp_path, "storage_path": tmp_path, **values}, cluster=CLUSTER)
    assert line in str(raised.value) and "\n" not in str(raised.value)


def test_the_published_mixtures_of_experts_resolve_as_built_ins():
    """Qwen3-30B-A3B and Mixtral-8x7B without the hub: their sparse blocks as the seam reads them."""
    from parity.models.families import family_of
    from parity.models.model import meta_model, resolve_model_config

    for name, (experts, top_k, layers, expert_params) in {
            "Qwen/Qwen3-30B-A3B": (128, 8, 48, 48 * 128 * 3 * 2048 * 768),
            "mistralai/Mixtral-8x7B-v0.1": (8, 2, 32, 32 * 8 * 3 * 4096 * 14336)}.items():
        config = resolve_model_config(name)
        moe = family_of(config).moe
        assert (moe.num_experts, moe.top_k, len(moe.layers)) == (experts, top_k, layers)
        assert moe.expert_weights == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
        model = meta_model(config)
        assert sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) == expert_params


def test_the_main_job_takes_a_mixture_of_experts_and_ep_size(tmp_path):
    """run_verification_main.sh with MODEL_NAME=qwen3-moe-tiny EP_SIZE=2: the expert-parallel runs at EP 2, DDP (the
    baseline: every expert on every rank) at 1 — resolved, as the job resolves every run before the first starts."""
    from parity.commands.main_job import build_parser, run_plan
    from parity.driver.config import resolve
    from parity.driver.local_group import CLUSTER

    args = build_parser().parse_args(["--output_dir", str(tmp_path), "--model_name", "qwen3-moe-tiny", "--ep_size",
                                      "2", "--strategies", "ddp fsdp transformers", "--device", "cpu"])
    cfgs = [resolve(strategy, values, cluster=CLUSTER, weights_written_before_launch=True)
            for strategy, values in run_plan(args, str(tmp_path), CLUSTER)]
    assert [(c.strategy, c.tp_size, c.dp_size, c.ep_size, c.noise_reference) for c in cfgs] == [
        ("ddp", 1, 2, 1, False), ("ddp", 1, 1, 1, True), ("ddp", 1, 4, 1, True), ("fsdp", 2, 2, 2, False),
        ("transformers", 2, 2, 2, False)]  # DDP's twins: the job calibrates by default


def test_the_benchmarks_dry_form_bounds_a_published_mixture_of_experts(tmp_path, capsys):
    """benchmark.py --dry_run on Mixtral-8x7B, whole, on 8 GPUs it does not need: each row's ZeRO bound per rank from
    the shapes alone, and the experts one layer gathers, halved by EP 2."""
    from parity.commands.benchmark import main

    assert main(["--output_dir", str(tmp_path), "--model_name", "mistralai/Mixtral-8x7B-v0.1", "--num_workers", "8",
                 "--device", "cuda", "--rows", "ddp,fsdp,fsdp_ep", "--dry_run"]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "benchmark_dry.json").read_text())["rows"]}
    psi, experts = rows["ddp"]["num_params"], rows["ddp"]["expert_params"]
    assert (psi, experts) == (46_702_792_704, 32 * 8 * 3 * 4096 * 14336)
    assert rows["ddp"]["zero_bound_total_bytes"] == 16 * psi  # fp32 weights, gradients and Adam's two moments
    assert rows["fsdp"]["zero_bound_total_bytes"] == rows["fsdp_ep"]["zero_bound_total_bytes"] == 16 * psi / 8
    assert rows["fsdp"]["experts_gathered_per_layer_bytes"] == 4 * experts / 32
    assert rows["fsdp_ep"]["experts_gathered_per_layer_bytes"] == 4 * experts / 32 / 2
    assert "FSDP2 + EP ep2" in capsys.readouterr().out
