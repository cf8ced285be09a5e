"""The tensor verdict's seeded bugs (issue 52): one tensor wrong from a late step, named at that step.

The bugs start at LATE_ONSET, a step the teacher-forced check does not run at (it runs at step 0 alone here: no
--checkpoint_interval), so the tensor series is what sees them there. In bf16, calibrated on DDP's three references: a
norm's gradient summed over TP once more and one expert layer's gradient doubled under EP FAIL at that step on that
tensor, in its gradient, while the three curves alone PASS. A router's gradient doubled on one rank under EP and the
load-balancing loss's gradient dropped move the router's gradient by 0.4 and 0.08: below bf16's own noise on a router
(its top-k choices flip; NOISE_K × its envelope is about 0.6, docs/tensors_measured.md), so they are judged in fp32, on
DDP's two fp32 twins, the fixed fp32 table a floor under their bounds: named at their step; the router's bug leaves the
curves within their bounds (its 5e-6 on the global grad norm), the dropped aux loss's moves the global grad norm
(4e-4) but names no tensor. One mixture of experts (mixtral-tiny: norms, experts and routers in one model), one set of
weights, one local gloo group per world size; plot_loss_curves.py judges each folder as a user runs it.
"""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatch

import pytest

from test_families import family_weights
from parity.calibration.tensor_bugs import LATE_ONSET, TENSOR_BUGS
from parity.commands.compare_curves import main as plot_loss_curves
from parity.driver.local_group import plan, run_group
from parity.training.tensor_norms import GRADIENT

MODEL = "mixtral-tiny"
SEED = 67  # outside the calibration study's seeds (42–61) and the suite's others (64–66)
SETTING = {"model_name": MODEL, "seq_length": 32, "debug_steps": LATE_ONSET + 2, "learning_rate": 1e-3,
           "warmup_steps": 3, "max_grad_norm": 0.8, "log_interval": LATE_ONSET + 2, "checkpoint_interval": 0,
           "seed": SEED}
DDP = {"num_workers": 2, "batch_size": 2}
TWINS = {"tp1_dp1": {"num_workers": 1, "batch_size": 4}, "tp1_dp4": {"num_workers": 4, "batch_size": 1}}
EP2 = {"num_workers": 4, "batch_size": 1, "ep_size": 2}  # DP 4, each expert on 2 of them
# DP 2 × TP 2, an EP group = a TP group. Without the teacher-forced check: on this model a clean FSDP2 + TP run in bf16
# is 3 × its tolerance at step 0 (exp_avg_sq of the TP-replicated post-attention norms, 0.096 against 0.030) — measured
# before the bug starts, reported in docs/tensors_measured.md.
TP2_EP2 = {"num_workers": 4, "batch_size": 2, "tp_size": 2, "ep_size": 2, "no_teacher_forced": True}
CASES = {  # the seeded bug → (its layout, the precision it is judged in)
    "a norm's gradient summed over TP": (TP2_EP2, "bf16"),
    "an expert layer's gradient x 2 under EP": (EP2, "bf16"),
    "a router's gradient x 2 on one rank under EP": (EP2, "fp32"),
    "the aux loss's gradient dropped": (EP2, "fp32"),
}


def reference_files(precision: str) -> dict[str, dict]:
    """The noise references of DDP's baseline in `precision` (parity/commands/main_job.py's names): file → flags. In
    bf16 the twins and the fp32 twin; in fp32 the twins, in fp32."""
    files = {f"noise_reference_ddp_{layout}_{precision}.json": {**flags, "precision": precision}
             for layout, flags in TWINS.items()}
    if precision == "bf16":
        files["noise_reference_ddp_tp1_dp2_fp32.json"] = {**DDP, "precision": "fp32"}
    return files


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per bug a folder with DDP's baseline in the bug's precision, its references and the copy's record. DDP's fp32 run
    is both the bf16 baseline's fp32 twin and the fp32 baseline."""
    root = tmp_path_factory.mktemp("tensor_bugs")
    common = {**SETTING, "init_weights_path": family_weights(root, MODEL, SEED), "storage_path": root / "ray"}
    runs = [plan("ddp", {**common, **DDP, "precision": "bf16", "loss_output_dir": root / "bf16"})]
    runs += [plan("ddp", {**common, **flags, "noise_reference": True, "loss_output_dir": root / precision})
             for precision in ("bf16", "fp32") for flags in reference_files(precision).values()]
    for i, (bug, (layout, precision)) in enumerate(CASES.items()):
        runs.append(plan("fsdp", {**common, **layout, "precision": precision, "loss_output_dir": root / f"bug{i}",
                                  "strategy_class": TENSOR_BUGS[bug][0]}))
    for world in sorted({cfg.num_workers for cfg, _ in runs}):
        run_group([r for r in runs if r[0].num_workers == world])
    copy(root / "bf16" / "noise_reference_ddp_tp1_dp2_fp32.json", root / "fp32" / "loss_ddp.json")
    out = {}
    for i, (bug, (_, precision)) in enumerate(CASES.items()):
        for name in ["loss_ddp.json", *reference_files(precision)]:
            copy(root / precision / name, root / f"bug{i}" / name)
        out[bug] = (root / f"bug{i}", precision)
    return out


def copy(record, to) -> None:
    """A record with its tensor series, whose folder keeps the name the record gives it."""
    shutil.copy(record, to)
    series = json.loads(record.read_text())["tensors"]["folder"]
    shutil.copytree(record.parent / series, to.parent / series, dirs_exist_ok=True)


def judged(folder, capsys) -> dict:
    """plot_loss_curves.py on the folder, as a user runs it: the copy's entry against DDP (its curves, calibrated, and
    its tensor verdict), and the curves' own worst deviation ÷ bound over every step (the tensor verdict aside)."""
    code = plot_loss_curves(["--input_dir", str(folder), "--output", str(folder / "curves.png")])
    capsys.readouterr()
    comparison = json.loads((folder / "curve_comparison.json").read_text())
    against = comparison["against_baseline"]["fsdp"]
    assert code == 1 and against["verdict"] == "FAIL" and against["calibrated"] and against["tensors"]["calibrated"]
    mine, base = comparison["runs"]["fsdp"]["series"], comparison["runs"]["ddp"]["series"]
    against["curves_worst"] = max(abs(x - b) / abs(b) / bound for q, bounds in against["bounds"].items()
                                  for x, b, bound in zip(mine[q], base[q], bounds))
    return against


@pytest.mark.parametrize("bug", [b for b, (_, precision) in CASES.items() if precision == "bf16"])
def test_a_late_bug_in_one_tensor_fails_at_its_step_on_that_tensor_while_the_curves_pass_in_bf16(folders, capsys,
                                                                                                   bug):
    folder, _ = folders[bug]
    against = judged(folder, capsys)
    first = against["tensors"]["first_outside"]
    print(f"{bug}: step {first['step']}, {first['tensor']} ({first['phase']}) at {first['ratio']:.1f} × its bound; "
          f"the curves' worst {against['curves_worst']:.2f} of their bounds")
    assert (first["step"], first["tensor"], first["phase"]) == (LATE_ONSET, TENSOR_BUGS[bug][1], GRADIENT)
    assert first["ratio"] > 1 and against["first_outside"]["test"] == "tensors"
    assert against["curves_worst"] < 1, against


@pytest.mark.parametrize("bug", [b for b, (_, precision) in CASES.items() if precision == "fp32"])
def test_a_late_router_bug_is_named_at_its_step_in_fp32(folders, capsys, bug):
    """Below bf16's noise on a router, plain in fp32: the tensor verdict names the router at the bug's first step, the
    gradient phase, far outside; the curves see the router's doubled piece nowhere, the dropped aux loss's at most on
    the global grad norm."""
    folder, _ = folders[bug]
    against = judged(folder, capsys)
    first = against["tensors"]["first_outside"]
    print(f"{bug}: step {first['step']}, {first['tensor']} ({first['phase']}) at {first['ratio']:.1f} × its bound; "
          f"the curves' worst {against['curves_worst']:.2f} of their bounds")
    assert (first["step"], first["phase"]) == (LATE_ONSET, GRADIENT) and fnmatch(first["tensor"], TENSOR_BUGS[bug][1])
    assert first["ratio"] > 10 and against["first_outside"]["step"] == LATE_ONSET
    if bug.startswith("a router"):
        assert against["curves_worst"] < 1 and against["first_outside"]["test"] == "tensors", against
