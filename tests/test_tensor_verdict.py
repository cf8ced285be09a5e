"""The tensor verdict (parity/comparing/tensor_verdict.py, docs/tensors.md): every tensor's gradient norm and parameter
norm after the step against DDP's, at every step, each within a bound of its own.

Real runs (qwen2-tiny, fp32, the shared parity setting: 12 steps at lr 1e-4): clean FSDP2 + TP and transformers' TP
PASS every tensor; a seeded bug — FSDP2 + TP with one norm weight's gradient doubled after backward, a copy of the
strategy here, in a local gloo group — keeps the loss within 1e-5 of DDP's and FAILs the tensor verdict at step 0,
naming the tensor. Hand-made records (test_compare's writers) check the arithmetic: the floor, the calibrated bounds,
the point named (the furthest outside at the first step outside), what is not comparable, a record without series, the heatmap's matrix and page.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import PARITY, TINY, copy_record, max_rel_diff, series
from fsdp_strategy import FSDPStrategy
from parity.commands.compare_curves import compare_and_report
from parity.comparing import tensor_verdict
from parity.comparing.curves import compare, load_references, load_runs
from parity.comparing.tolerances import ADAM_SIGN_FLIP, NOISE_K, TENSOR_FLOOR, TENSORS
from test_compare import DDP_GRAD, DDP_LOSS, LR, NORM_WEIGHT, TENSOR_SHARES, run_cli, write_record

DOUBLED = NORM_WEIGHT  # layers.0.input_layernorm: 64 elements, ~5e-3 of qwen2-tiny's gradient norm
K_BIAS = "model.layers.0.self_attn.k_proj.bias"  # 1e-4 of the hand-made records' gradient: below the floor


class FSDPNormGradientDoubled(FSDPStrategy):
    """One norm weight's gradient doubled after backward, before the norms, the clipping and the step: a bug confined
    to one tensor (the loss barely moves: AdamW divides a tensor's constant scale away)."""

    def forward_backward(self, batch, global_tokens):
        local_sum = super().forward_backward(batch, global_tokens)
        with torch.no_grad():
            grad = dict(self.model.named_parameters())[DOUBLED].grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(2)
        return local_sum


@pytest.fixture(scope="module")
def bug_run(tiny_weights, tmp_path_factory) -> dict:
    """The seeded bug at the shared runs' setting (TP=2 × DP=1, the global batch of DDP's DP=2 × 2), in a local group."""
    from parity.driver.local_group import plan, run_group

    root = tmp_path_factory.mktemp("tensor_bug")
    (record,) = run_group([plan("fsdp", {**TINY, **PARITY, "init_weights_path": tiny_weights, "loss_output_dir": root,
                                         "storage_path": root / "ray", "checkpoint_interval": 0, "num_workers": 2,
                                         "tp_size": 2, "batch_size": 4, "precision": "fp32",
                                         "strategy_class": FSDPNormGradientDoubled})])
    return record


def verdict(folder, capsys) -> tuple[int, dict, str, str]:
    """plot_loss_curves.py's comparison of `folder`: (exit code, curve_comparison.json, stdout, curve_report.md)."""
    code = compare_and_report(str(folder), str(folder / "curves.png"))
    out = capsys.readouterr().out
    return code, json.loads((folder / "curve_comparison.json").read_text()), out, (folder / "curve_report.md").read_text()


# --- real runs ------------------------------------------------------------------------------------------

def test_clean_fp32_strategies_pass_every_tensor(shared_runs, tmp_path, capsys):
    """FSDP2 + TP=2 × DP=2 and transformers' TP=2 against DDP: each of qwen2-tiny's 26 tensors within the fixed fp32
    bounds at every step, far inside them (measured: 0.016 of the gradient's bound, a v_proj bias; 0.010 of the
    update's, a k_proj bias), and not bit-identical."""
    for name in ("ddp_tp1_dp2", "fsdp_tp2_dp2", "transformers_tp2_dp1"):
        copy_record(shared_runs[name], tmp_path)
    code, saved, out, _ = verdict(tmp_path, capsys)
    assert code == 0, out
    for name in ("fsdp", "transformers"):
        found = saved["against_baseline"][name]["tensors"]
        assert (found["taken"], found["first_outside"], found["calibrated"], found["tensors"], found["steps"]) == (
            True, None, False, 26, 12)
        assert found["source"] == "the fixed fp32 table; uncalibrated: no noise reference"
        for phase, p in found["largest"].items():
            assert 0 < p["ratio"] < 0.1, (name, phase, p)
            assert p["bound"] >= TENSORS["fp32"][phase] and p["ratio"] == pytest.approx(p["deviation"] / p["bound"])
        assert len(found["matrix"]["ratio"]) == 26 and len(found["matrix"]["columns"]) == 12
        assert max(max(row) for row in found["matrix"]["ratio"]) == pytest.approx(
            max(p["ratio"] for p in found["largest"].values()), rel=1e-2)
        assert f"tensor verdict: PASS: 26 tensors' gradient and parameter norms within their bounds at each of 12 " \
               f"steps (largest deviation ÷ bound: gradient {found['largest']['gradient']['ratio']:.2g}" in out


def test_a_norm_weights_doubled_gradient_fails_at_step_0_naming_it(shared_runs, bug_run, tmp_path, capsys):
    """The loss within 1e-5 of DDP's at every step, the global grad norm inside its 1e-4 (a few times the 1e-5 it once
    had, no tensor named); the tensor verdict FAILs at step 0 on that norm weight's gradient, read exactly doubled
    (deviation 1.0, 1e3 × its bound), with the layer check of that step offered."""
    copy_record(shared_runs["ddp_tp1_dp2"], tmp_path)
    copy_record(bug_run, tmp_path)
    code, saved, out, md = verdict(tmp_path, capsys)
    assert code == 1
    assert max_rel_diff(series(bug_run, "loss"), series(shared_runs["ddp_tp1_dp2"], "loss")) < 1e-5
    against = saved["against_baseline"]["fsdp"]
    found = against["tensors"]
    f = found["first_outside"]
    assert (f["step"], f["tensor"], f["phase"]) == (0, DOUBLED, "gradient")
    assert f["value"] == pytest.approx(2 * f["reference"], rel=1e-6) and f["deviation"] == pytest.approx(1.0, rel=1e-5)
    assert (f["bound"], f["ratio"]) == (1e-3, pytest.approx(1e3, rel=1e-5))
    assert found["largest"]["gradient"]["tensor"] == DOUBLED and found["largest"]["update"]["ratio"] < 0.1
    # the curves' grad norm sees the tensor's share only: inside its bound, beyond the 1e-5 it had before the spikes
    assert 1e-5 < against["max_rel_diff"]["grad_norm"] < 1e-4 and against["first_outside"]["step"] == 0
    line = (f"tensor verdict: FAIL at step 0: {DOUBLED}, phase gradient: its gradient norm {f['value']:.6e} vs DDP "
            f"{f['reference']:.6e}, deviation {f['deviation']:.3e} > bound 1.000e-03 ({f['ratio']:.3g} × its bound; "
            f"uncalibrated)")
    details = out.split("FSDP (TP=2, DP=1): FAIL\n", 1)[1].splitlines()
    tensor_line = details.index(f"  {line}")  # before any layer check line, which comes next, once
    assert details[tensor_line + 1] == f"    {found['localise']}" and out.count("replay step 0 layer by layer") == 1
    assert found["localise"] == f"replay step 0 layer by layer from DDP's checkpoint: {found['replay_command']}"
    assert "--step 0" in found["replay_command"] and "FSDPNormGradientDoubled" in found["replay_command"]
    assert f"| FSDP (TP=2, DP=1) | FAIL | step 0, {DOUBLED}, gradient: {f['value']:.6e} vs {f['reference']:.6e}, " \
           f"deviation {f['deviation']:.3e} > 1.000e-03 |" in md
    assert f"Localise FSDP (TP=2, DP=1)'s step 0 layer by layer:\n\n```bash\n{found['replay_command']}\n```" in md


def test_the_tensor_verdict_and_the_teacher_forced_check_agree_at_their_shared_steps(shared_runs, bug_run, tmp_path,
                                                                                      capsys):
    """At every step both judge — 0 and each --checkpoint_interval — the tensor verdict has a point outside exactly
    where the teacher-forced check FAILs: nowhere for clean FSDP2 + TP and transformers' TP, at step 0 for the doubled
    norm weight (the check sees it in AdamW's moments, the verdict in the tensor's gradient)."""
    clean, bug = tmp_path / "clean", tmp_path / "bug"
    for folder, records in ((clean, ("fsdp_tp2_dp2", "transformers_tp2_dp1")), (bug, ())):
        folder.mkdir()
        for name in ("ddp_tp1_dp2", *records):
            copy_record(shared_runs[name], folder)
    copy_record(bug_run, bug)
    shared = {}
    for folder, names in ((clean, ("fsdp", "transformers")), (bug, ("fsdp",))):
        saved = verdict(folder, capsys)[1]
        for name in names:
            checks = saved["runs"][name]["teacher_forced"]["checks"]
            ratios = saved["against_baseline"][name]["tensors"]["matrix"]["ratio"]  # one column a step (12 steps)
            shared[(folder.name, name)] = {c["step"]: (not c["ok"], max(row[c["step"]] for row in ratios) > 1)
                                           for c in checks}
    assert all(check == tensors for found in shared.values() for check, tensors in found.values()), shared
    assert [s for s, (failed, _) in shared[("bug", "fsdp")].items() if failed] == [0]
    assert all(not failed for key in (("clean", "fsdp"), ("clean", "transformers"))
               for failed, _ in shared[key].values()) and all(0 in found for found in shared.values())


# --- hand-made records ------------------------------------------------------------------------------------

EMBED = "model.embed_tokens.weight"


def test_the_point_named_is_the_furthest_outside_at_the_first_step_outside(tmp_path, capsys):
    """Identical curves; at step 2 of FSDP's series the norm weight's gradient 2 % off (20 × its 1e-3 bound), the k_proj
    bias's 10 % (against the floor: 10 ×) and the embedding's parameter norm 1 % (64 × the update's bound, ADAM_SIGN_FLIP
    × lr over its norm), at step 3 the norm weight's gradient doubled (1e3 ×), at step 1 nothing: the point named is
    step 2's furthest outside, the embedding's update — not the first in step, phase and model order, nor the largest
    of the run — a FAIL (exit 1) the curves alone PASS (the doubled norm weight moves the grad norm by its share)."""
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, tensors={2: {EMBED: (1.0, 1.01), K_BIAS: 1.1, NORM_WEIGHT: 1.02},
                                                                3: {NORM_WEIGHT: 2.0}})
    code, out, _ = run_cli(capsys, tmp_path)
    (r,) = compare(load_runs(str(tmp_path))).results
    assert code == 1 and r.verdict.max_rel_diff == {"loss": 0.0, "grad_norm": pytest.approx(3.75e-5, rel=1e-3),
                                                    "param_norm": 0.0}
    f = r.tensors.first
    update_bound = ADAM_SIGN_FLIP * LR / (TENSOR_SHARES[EMBED] * 20.0)  # the records' parameter norm: 20
    assert (f.step, f.tensor, f.phase, f.value / f.reference) == (2, EMBED, "update", pytest.approx(1.01))
    assert (f.deviation, f.bound) == (pytest.approx(1e-2, rel=1e-9), pytest.approx(update_bound, rel=1e-9))
    assert r.verdict.first_outside == tensor_verdict.Outside(
        quantity="update", rel_diff=f.deviation, tolerance=f.bound, step=2, module=EMBED, value=f.value,
        reference=f.reference, test="tensors")
    assert r.tensors.largest["gradient"].tensor == NORM_WEIGHT and r.tensors.largest["gradient"].step == 3
    assert "  first step outside: step 2: model.embed_tokens.weight, phase update, outside its bound " \
           "(the tensor verdict above), whatever the curves say\n" in out
    assert re.search(r"^  tensor verdict: FAIL at step 2: .*\n    replay step 2 layer by layer .*\n  first step "
                     r"outside: step 2: model", out, re.M) and out.count("replay step 2") == 1


def test_a_tensor_far_below_the_global_norm_is_read_against_the_floor(tmp_path):
    """The k_proj bias (1e-4 of the step's global gradient norm) 10 % off at step 3: read against TENSOR_FLOOR (1e-3)
    × the global norm, 1e-2, not against itself (1e-1) — still 10 × the fp32 bound, which a bias's real rounding
    (measured ≤ 1.4e-6 read so) is not."""
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, tensors={3: {K_BIAS: 1.1}})
    (r,) = compare(load_runs(str(tmp_path))).results
    f = r.tensors.first
    global_norm = DDP_GRAD[3] * math.sqrt(sum(x * x for x in TENSOR_SHARES.values()))
    assert (f.step, f.tensor, f.phase) == (3, K_BIAS, "gradient")
    assert f.deviation == pytest.approx(DDP_GRAD[3] * 1e-4 * 1e-1 / (TENSOR_FLOOR["gradient"] * global_norm), rel=1e-9)
    assert f.deviation == pytest.approx(1e-2, rel=1e-4) and f.bound == TENSORS["fp32"]["gradient"]
    assert tensor_verdict.deviation(1.001e-4, 1e-4, 1e-3) == pytest.approx(1e-4)  # the floor binds
    assert tensor_verdict.deviation(2.0, 1.0, 1e-3) == 1.0 and tensor_verdict.deviation(0.0, 0.0, 0.0) == 0.0


def test_calibrated_per_tensor_on_the_references_series(tmp_path, capsys):
    """A noise reference whose norm weight's gradient is 1e-4 off at every step: that tensor's gradient bound is NOISE_K
    × 1e-4, every other tensor's the fixed fp32 table's 1e-3 (a floor under NOISE_K × the fp32 envelope floor, 1e-8:
    fp32 twins miss the AdamW lottery); a run 1.5e-3 off there PASSes (0.75 of it), 3e-3 off FAILs (1.5 ×)."""
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    write_record(tmp_path, "ddp", [x * (1 + 1e-7) for x in DDP_LOSS], DDP_GRAD, config={"tp_size": 1, "dp_size": 1},
                 noise_reference=True, tensors={s: {NORM_WEIGHT: 1 + 1e-4} for s in range(5)})
    for off, word in ((1.5e-3, "PASS"), (3e-3, "FAIL")):
        write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, tensors={s: {NORM_WEIGHT: 1 + off} for s in range(5)})
        (r,) = compare(load_runs(str(tmp_path)), references=load_references(str(tmp_path))).results
        found = r.tensors.to_dict()
        assert (r.verdict.word, found["calibrated"]) == (word, True)
        assert found["source"] == f"calibrated: {NOISE_K} × the noise of noise_reference_ddp_tp1_dp1_fp32.json, " \
                                  f"per tensor, never below the fixed fp32 table"
        p = found["first_outside"] or found["largest"]["gradient"]
        assert (p["tensor"], p["bound"]) == (NORM_WEIGHT, pytest.approx(NOISE_K * 1e-4, rel=1e-6))
        assert p["ratio"] == pytest.approx(off / (NOISE_K * 1e-4), rel=1e-5)
    assert "calibrated)" in run_cli(capsys, tmp_path)[1]


def test_the_gradient_of_a_step_an_fp16_overflow_skipped_is_not_judged(tmp_path):
    """fp16, step 2 skipped on an overflow in both runs (its gradient norms infinite): its gradients are not judged, as
    the curves' grad norm is not; its parameters, which did not move, are — the heatmap's cell there is the update's."""
    inf = float("inf")
    skipped = {2: {"skipped": True, "loss_scale": 65536.0}}
    for name in ("ddp", "fsdp"):
        write_record(tmp_path, name, DDP_LOSS, [2.0, 1.5, inf, 0.5, 0.25], precision="fp16", step_fields=skipped)
    (r,) = compare(load_runs(str(tmp_path))).results
    assert r.verdict.word == "PASS" and r.tensors.first is None
    matrix = r.tensors.to_dict()["matrix"]
    assert [cell[:2] for cell in matrix["at"][0]] == [[0, 0], [1, 0], [2, 1], [3, 0], [4, 0]]  # step 2: the update
    assert r.tensors.to_dict()["source"] == "the fixed bf16 table; uncalibrated: no noise reference"


def test_a_record_without_series_says_why_in_one_line_and_the_verdict_stands(tmp_path, capsys):
    """DeepSpeed's record holds no series (its strategy hands over no pieces), FSDP's series folder was not copied: one
    line each, and the curves' verdicts (the hand example's: DeepSpeed PASS, FSDP FAIL at step 2 on the loss) and the
    exit code are what they were."""
    import shutil

    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    why = "deepspeed does not hand over its tensors' pieces (Strategy.tensor_names)"
    write_record(tmp_path, "deepspeed", DDP_LOSS, DDP_GRAD, tensors_why=why)
    write_record(tmp_path, "fsdp", [10.0, 8.0, 6.5, 5.0, 3.75], [2.0, 1.5, 1.25, 0.5, 0.25])
    shutil.rmtree(tmp_path / "loss_fsdp.tensors")
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1
    assert out.count("  tensor verdict not taken: loss_deepspeed.json holds no tensor series: deepspeed does not hand "
                     "over its tensors' pieces (Strategy.tensor_names)\n") == 1
    assert out.count("  tensor verdict not taken: loss_fsdp.json's tensor series (loss_fsdp.tensors) is not beside it: "
                     "copy that folder with the record\n") == 1
    assert "DeepSpeed (TP=2, DP=2): PASS\n" in out and \
        "first step outside: step 2: loss 6.500000 vs DDP 6.000000, relative diff 8.333e-02 > 1.000e-05\n" in out
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"]
    assert saved["deepspeed"]["tensors"] == {"taken": False, "why": f"loss_deepspeed.json holds no tensor series: {why}"}
    assert "| DeepSpeed (TP=2, DP=2) | not taken | loss_deepspeed.json holds no tensor series: " in \
        (tmp_path / "out" / "curve_report.md").read_text()


@pytest.mark.parametrize("case", ["other tensors", "clipped against pre-clip"])
def test_series_that_cannot_be_held_against_the_baselines_are_not_comparable(tmp_path, capsys, case):
    write_record(tmp_path, "ddp", DDP_LOSS, DDP_GRAD)
    path = write_record(tmp_path, "fsdp", DDP_LOSS, DDP_GRAD, gradient="clipped" if case != "other tensors" else "pre_clip")
    if case == "other tensors":  # a strategy that names a tensor otherwise
        data = json.loads(open(path).read())
        data["tensors"]["names"][3] = "model.layers.0.self_attn.k_proj.bias_unsharded"
        open(path, "w").write(json.dumps(data))
    code, out, err = run_cli(capsys, tmp_path)
    assert (code, out) == (2, "")
    assert err == {"other tensors": "error: not comparable: ddp and fsdp record different tensors in their series (only "
                                    "ddp's: model.layers.0.self_attn.k_proj.bias; only fsdp's: "
                                    "model.layers.0.self_attn.k_proj.bias_unsharded): both hold the model's trainable "
                                    "parameters under their Hugging Face names\n",
                   "clipped against pre-clip": "error: not comparable: ddp's tensor series holds pre-clip gradients and "
                                               "fsdp's clipped ones: they differ by the clip coefficient wherever a step "
                                               "clips; a recorded run whose series holds the clipped gradients is "
                                               "compared with a replay whose series holds them clipped too\n"}[case]


def test_a_recorded_runs_clipped_series_against_its_replays_localises_with_dump_step(tmp_path, capsys):
    """A recorded run whose series holds the clipped gradients (its framework clips before the recorder sees them),
    against its replay's clipped series: its norm weight's gradient doubled from step 1 FAILs there, and the report
    offers the recorder's dump_step=1 and the replay's dump (parity/recording/dump.py)."""
    from test_recorded_report import recorded_config, replay_config, write

    write(tmp_path, "my_run", recorded_config("my_run"), gradient="clipped",
          tensors={s: {NORM_WEIGHT: 2.0} for s in range(1, 5)})
    write(tmp_path, "ddp", replay_config("my_run"), gradient="clipped")
    code, saved, out, md = verdict(tmp_path, capsys)
    found = saved["against_baseline"]["my_run"]["tensors"]
    assert code == 1 and (found["first_outside"]["step"], found["first_outside"]["tensor"]) == (1, NORM_WEIGHT)
    assert found["gradient"] == "clipped" and found["replay_command"] is None
    words = ("localise step 1: rerun your script with the recorder's dump_step=1 (ParityRecorder or "
             "ParityCallback(..., dump_step=1)) into a fresh folder D, then python train_ddp.py --replay_record "
             "D/loss_my_run.json --dump_step 1 --loss_output_dir D, then python compare_dumps.py --input_dir D: it "
             "names the first divergent module")
    assert found["localise"] == words and out.count(f"    {words}\n") == 1 and words in md  # after the tensor line


def test_the_heatmap_bins_many_steps_and_keeps_the_page_small(tmp_path, capsys):
    """1000 steps × 30 tensors: 40 columns of 25 steps, each cell its bin's largest deviation ÷ bound and where; the
    one tensor doubled at step 517 is the first outside, framed in its bin's cell; the page stays under 600 kB."""
    import test_compare

    names = {f"model.layers.{i // 10}.mlp.block_{i % 10}.weight": 0.1 + 0.01 * i for i in range(30)}
    doubled = "model.layers.1.mlp.block_3.weight"
    steps = 1000
    losses, grads = [10 - i * 1e-3 for i in range(steps)], [1.0 + 1e-4 * i for i in range(steps)]
    shares, test_compare.TENSOR_SHARES = test_compare.TENSOR_SHARES, names
    try:
        write_record(tmp_path, "ddp", losses, grads)
        write_record(tmp_path, "fsdp", losses, grads, tensors={517: {doubled: 2.0}})
    finally:
        test_compare.TENSOR_SHARES = shares
    code, out, _ = run_cli(capsys, tmp_path)
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"]["fsdp"]["tensors"]
    m = saved["matrix"]
    assert code == 1 and len(m["columns"]) == 40 and m["columns"][20] == [500, 524] and m["columns"][-1] == [975, 999]
    row = m["tensors"].index(doubled)
    assert m["ratio"][row][20] == pytest.approx(1e3) and m["at"][row][20][:2] == [517, 0]
    assert m["at"][row][20][2] == pytest.approx(2 * m["at"][row][20][3], rel=1e-5)
    assert sum(r is not None and r > 1 for line in m["ratio"] for r in line) == 1
    html = (tmp_path / "out" / "report.html").read_text()
    svg = html[html.index('<svg class="tensor-map"'):]
    svg = svg[:svg.index("</svg>")]
    assert svg.count('width="1" height="1" class="tc') == 30 * 40 and svg.count('class="tco"') == 2  # (the legend's)
    assert f'<rect x="20" y="{row}" width="1" height="1" class="tco"><title>{doubled}, step 517 (of 500–524), ' \
           f'gradient: FSDP ' in svg
    assert f"✗ first outside: step 517, {doubled} (gradient)</text>" in svg
    assert len(html.encode()) < 600 * 1024, len(html.encode())


def test_a_resume_between_record_writes_keeps_every_steps_series(tmp_path):
    """A checkpoint is taken before its step's record write (the loop's order), so the series' steps buffered since the
    last write must be in a chunk by then (the observer flushes them at a checkpoint step): resumed from the checkpoint
    of step 4 after a worker died at step 6 — the main job's --log_interval 4 --checkpoint_interval 4 — the record
    holds every step's series once, the resumed steps' own."""
    from conftest import free_port, gloo_rank
    from parity.training.observer import StepObserver
    from parity.training.record import LossRecord
    from parity.training.tensor_series import load_series

    path = str(tmp_path / "loss_ddp.json")

    def observer() -> StepObserver:
        return StepObserver(LossRecord(path, "ddp", {"loop": "by hand"}), device=torch.device("cpu"),
                            tensor_names=["w", "b"], parameter_norm=lambda: 1.0)

    def step(obs: StepObserver, k: int, run: int, checkpoint: bool = False) -> None:
        obs.observe_step(k, loss=1.0, dp_rank_losses=[1.0], grad_norm=1.0, lr=1e-3, batch_hash=f"{k:016x}", tokens=8,
                         step_time_s=0.0, checkpoint=checkpoint, tensor_grad_norms=[float(k), float(run)],
                         tensor_param_norms=[1.0, 1.0])

    with gloo_rank(0, 1, free_port()):
        first = observer()
        for k in range(4):
            step(first, k, run=0, checkpoint=k == 3)
        progress = json.loads(json.dumps(first.record.progress()))  # what the checkpoint of step 4 keeps
        first.write()
        for k in (4, 5):  # the worker dies before the next write
            step(first, k, run=0)
        resumed = observer()
        resumed.record.resume(progress, "step_000004", [])
        for k in range(4, 8):
            step(resumed, k, run=1)
        resumed.write()
    assert progress["tensor_chunks"] == ["chunk_0000000.json"]
    found = load_series(path, json.loads(open(path).read()))
    assert found.grad_norm == [[float(k), float(k >= 4)] for k in range(8)]
