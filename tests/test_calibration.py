"""The calibrated verdict: in bf16 the bounds are NOISE_K × the noise the baseline's twins measure, so correct
strategies PASS at every seed and real bugs, seeded in test copies of the FSDP strategy, FAIL at a named step.

The runs are the shared loop in local gloo groups (tests/local_group.py): resolved, fed and recorded as Ray
runs are, many per group, because Ray adds nothing to what is tested here. The comparison is the user's:
plot_loss_curves.py's main on the folder. Setting (the measurements in docs/tolerances.md): qwen2-tiny, seq
128, 40 steps, lr 1e-3 with 5 warm-up steps, clipping at 0.8, global batch 4; DeepSpeed and FSDP at TP=2 × DP=2
against DDP at DP=2; the twins are DDP at DP=1 × 4 and DP=4 × 1.
"""

import json
import shutil

import pytest

from local_group import plan, run_group
from parity.commands.compare_curves import main as plot_loss_curves
from seeded_bugs import AdamBeta2Off, ClippingSkipped, GradientsSummedOverDP, LearningRateOff, WeightDecayAdded

SETTING = {"model_name": "qwen2-tiny", "seq_length": 128, "debug_steps": 40, "learning_rate": 1e-3,
           "warmup_steps": 5, "max_grad_norm": 0.8, "log_interval": 40}
SEEDS = (42, 43, 44)
BUG_SEED = 42
# Each seeded bug in bf16: where the calibrated verdict first FAILs it (measured; the runs are deterministic).
BUGS_BF16 = [(ClippingSkipped, 5, "param_norm", "step"), (WeightDecayAdded, 4, "param_norm", "step"),
             (LearningRateOff, 3, "loss", "step"), (GradientsSummedOverDP, 0, "grad_norm", "step"),
             (AdamBeta2Off, 10, "param_norm", "step")]
BUGS = [bug for bug, *_ in BUGS_BF16]
# The same bugs in fp32, judged by the fixed fp32 table (no twins): the step and curve of the first FAIL.
BUGS_FP32 = [(ClippingSkipped, 2, "grad_norm"), (WeightDecayAdded, 2, "grad_norm"), (LearningRateOff, 1, "loss"),
             (GradientsSummedOverDP, 0, "grad_norm"), (AdamBeta2Off, 3, "grad_norm")]
TWINS = ((1, 4), (4, 1))  # (dp, batch): DDP's global batch of 4 at two other layouts


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_weights_by_seed):
    """Every run of this module, in three local gloo groups (world 1, 2 and 4). Returns {name: folder}: per
    seed a folder with DDP, its twins, DeepSpeed and FSDP; per bug a folder with DDP, the twins and the
    buggy FSDP (bf16) and, without twins, the buggy FSDP in fp32."""
    root = tmp_path_factory.mktemp("calibration")
    groups: dict[int, list] = {1: [], 2: [], 4: []}

    def add(folder, strategy, weights_seed, strategy_cls=None, **values):
        values = {**SETTING, "seed": weights_seed, "init_weights_path": tiny_weights_by_seed(weights_seed),
                  "loss_output_dir": root / folder, "storage_path": root / folder / "ray", **values}
        run = plan(strategy, values, strategy_cls)
        groups[run[0].num_workers].append(run)

    for seed in SEEDS:
        folder = f"seed{seed}"
        add(folder, "ddp", seed, precision="bf16", num_workers=2, batch_size=2)
        for dp, batch in TWINS:
            add(folder, "ddp", seed, precision="bf16", num_workers=dp, batch_size=batch, noise_reference=True)
        add(folder, "deepspeed", seed, precision="bf16", num_workers=4, tp_size=2, batch_size=2)
        add(folder, "fsdp", seed, precision="bf16", num_workers=4, tp_size=2, batch_size=2)
    add("fp32_baseline", "ddp", BUG_SEED, precision="fp32", num_workers=2, batch_size=2)
    for bug in BUGS:
        for precision in ("bf16", "fp32"):
            add(f"{bug.__name__}_{precision}", "fsdp", BUG_SEED, bug, precision=precision, num_workers=4, tp_size=2,
                batch_size=2)
    for world in (1, 2, 4):
        run_group(groups[world])

    for bug in BUGS:  # each bug beside the baseline it is judged against
        for name in (["loss_ddp.json"] + [f"noise_reference_ddp_tp1_dp{dp}.json" for dp, _ in TWINS]):
            shutil.copy(root / f"seed{BUG_SEED}" / name, root / f"{bug.__name__}_bf16")
        shutil.copy(root / "fp32_baseline" / "loss_ddp.json", root / f"{bug.__name__}_fp32")
    return root


@pytest.fixture(scope="module")
def tiny_weights_by_seed(tmp_path_factory):
    from parity.training.model import build_model, resolve_model_config, save_init_weights

    root, made = tmp_path_factory.mktemp("weights_by_seed"), {}

    def weights(seed: int) -> str:
        if seed not in made:
            made[seed] = str(root / f"init_{seed}.pt")
            save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed), made[seed])
        return made[seed]
    return weights


def verdict(folder, capsys) -> tuple[int, dict, str]:
    """plot_loss_curves.py on the folder, as a user runs it: (exit code, curve_comparison.json, stdout)."""
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "curves.png")])
    out = capsys.readouterr().out
    return code, json.loads((folder / "curve_comparison.json").read_text()), out


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_strategies_pass_the_calibrated_verdict(folders, capsys, seed):
    code, result, out = verdict(folders / f"seed{seed}", capsys)
    assert code == 0, out
    assert result["noise_references"] == ["noise_reference_ddp_tp1_dp1.json", "noise_reference_ddp_tp1_dp4.json"]
    for strategy in ("deepspeed", "fsdp"):
        against = result["against_baseline"][strategy]
        assert against["calibrated"] and against["verdict"] == "PASS"
        worst = max(against["noise_ratio"].values())
        assert 0 < worst < 20 and against["margin"] == pytest.approx(20 / worst)
    assert "Bounds calibrated on noise_reference_ddp_tp1_dp1.json, noise_reference_ddp_tp1_dp4.json" in out


@pytest.mark.parametrize("bug,step,quantity,test", BUGS_BF16, ids=[b.__name__ for b, *_ in BUGS_BF16])
def test_seeded_bug_fails_the_calibrated_verdict_in_bf16(folders, capsys, bug, step, quantity, test):
    code, result, out = verdict(folders / f"{bug.__name__}_bf16", capsys)
    against = result["against_baseline"]["fsdp"]
    assert (code, against["verdict"], against["calibrated"]) == (1, "FAIL", True)
    first = against["first_outside"]
    assert (first["step"], first["quantity"], first["test"]) == (step, quantity, test)
    assert max(against["noise_ratio"].values()) > 20
    # the first suspects are on screen: the run's own options against DDP's
    assert "differs from the baseline in: options.mixed_precision: – vs autocast" in out


@pytest.mark.parametrize("bug,step,quantity", BUGS_FP32, ids=[b.__name__ for b, *_ in BUGS_FP32])
def test_seeded_bug_fails_the_fixed_fp32_verdict(folders, capsys, bug, step, quantity):
    """Without twins the fp32 table judges, as before calibration existed: every bug FAILs within 4 steps."""
    code, result, out = verdict(folders / f"{bug.__name__}_fp32", capsys)
    against = result["against_baseline"]["fsdp"]
    assert (code, against["verdict"], against["calibrated"]) == (1, "FAIL", False)
    assert (against["first_outside"]["step"], against["first_outside"]["quantity"]) == (step, quantity)
    assert "Bounds UNCALIBRATED: no noise reference in the folder" in out


def test_without_twins_the_bf16_verdict_says_it_is_uncalibrated_and_misses_the_weight_decay(folders, capsys, tmp_path):
    """Why the twins run: the fixed bf16 table passes a weight decay nobody asked for."""
    for name in ("loss_ddp.json", "loss_fsdp.json"):
        shutil.copy(folders / "WeightDecayAdded_bf16" / name, tmp_path)
    code, result, out = verdict(tmp_path, capsys)
    assert (code, result["against_baseline"]["fsdp"]["calibrated"]) == (0, False)
    assert "Bounds UNCALIBRATED" in out and "uncalibrated: no noise reference" in out


def test_a_twin_of_another_precision_or_identical_to_the_baseline_is_refused(folders, tmp_path, capsys):
    folder = folders / f"seed{BUG_SEED}"
    for name in ("loss_ddp.json", "loss_fsdp.json"):
        shutil.copy(folder / name, tmp_path)
    shutil.copy(folder / "loss_ddp.json", tmp_path / "noise_reference_ddp_tp1_dp2.json")
    assert plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == ("error: noise_reference_ddp_tp1_dp2.json is identical to the baseline: a noise "
                                       "reference must run at another layout (e.g. --num_workers 1 --batch_size 4)\n")
    shutil.copy(folders / "fp32_baseline" / "loss_ddp.json", tmp_path / "noise_reference_ddp_tp1_dp2.json")
    assert plot_loss_curves(["--input_dir", str(tmp_path), "--output", str(tmp_path / "c.png")]) == 2
    assert "noise_reference_ddp_tp1_dp2.json is fp32 but the baseline is bf16" in capsys.readouterr().err
