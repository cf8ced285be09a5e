"""torch's AMP recipe in a loop of your own (the fp16_autocast policy, docs/precision.md#fp16_autocast-torchs-amp-recipe):
the forward under torch.autocast(float16) over fp32 weights, the loss scaled by torch.amp.GradScaler —
examples/plain_loop.py --fp16, run by `verify_trainer.py` from another folder with relative paths, its scaler found by
the recorder (the loop passes it nowhere). Its init_scale 2^22 overflows the first steps and growth_interval 2 grows the
scale into an overflow again: the record holds GradScaler's scale and skip of each step, the replay follows them, and the calibrated
verdict PASSes; a copy that clips before scaler.unscale_ — the recipe's classic bug, which torch's AMP docs warn of —
recorded on the same data FAILs at its first applied step; the record's scale moved at one step FAILs on GradScaler's
rules, ahead of any tolerance. Beside them, the rules against torch's own GradScaler, and the declared lr across
skipped steps in both loops' conventions (torch's recipe steps its scheduler at a skipped step, Trainer does not)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import REPO
from test_own_trainer import EXAMPLE, _copy, compare_in

FLAGS = ["--nproc", "2", "--fp16", "--steps", "8", "--init_scale", str(2 ** 22), "--growth_interval", "2"]
CLIP_FIRST = [("        scaler.unscale_(optimizer)\n        rec.before_step()\n"
               "        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)\n",
               "        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)  # the scaled gradients\n"
               "        scaler.unscale_(optimizer)\n        rec.before_step()\n")]


@pytest.fixture(scope="module")
def amp(tmp_path_factory):
    """The clean loop verified (its command's output), then the seeded copy recorded into the same folder: (folder,
    verify's completed process)."""
    root = tmp_path_factory.mktemp("amp")
    done = subprocess.run([sys.executable, os.path.join(REPO, "verify_trainer.py"), "--output_dir", "out", "--",
                           sys.executable, EXAMPLE, "--output_dir", "out", *FLAGS],
                          cwd=root, capture_output=True, text=True, timeout=600)
    bug = subprocess.run([sys.executable, _copy(root, EXAMPLE, "clip_first", CLIP_FIRST), "--output_dir", "out",
                          "--name", "clip_first", *FLAGS], cwd=root, capture_output=True, text=True, timeout=600)
    assert bug.returncode == 0, bug.stderr[-3000:]
    return root / "out", done


def _record(folder, name: str) -> dict:
    return json.loads((folder / f"loss_{name}.json").read_text())


def test_a_loop_under_torchs_amp_recipe_is_recorded_followed_and_passes(amp):
    """The record says fp16_autocast and GradScaler's settings; the first two steps overflow (skipped, their gradients
    not finite), the scale halving each time, and it grows after 2 good steps into an overflow; the replay skipped exactly
    those steps at those scales, its own gradients overflowing where the record's did; no lr is declared at a skipped
    step; the verdict PASSes calibrated within the noise (measured: deviation ÷ noise 0.6, margin 33×)."""
    folder, done = amp
    assert done.returncode == 0 and "plain_loop (TP=1, DP=2): PASS" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    record, replay = _record(folder, "plain_loop"), _record(folder, "ddp")
    assert record["config"]["precision"] == replay["config"]["precision"] == "fp16_autocast"
    scaling = record["config"]["loss_scaling"]
    assert {k: scaling[k] for k in ("rules", "initial_scale_power", "loss_scale_window", "growth_factor",
                                    "backoff_factor")} == {"rules": "GradScaler", "initial_scale_power": 22,
                                                           "loss_scale_window": 2, "growth_factor": 2.0,
                                                           "backoff_factor": 0.5}
    skipped, scales = [s["skipped"] for s in record["steps"]], [s["loss_scale"] for s in record["steps"]]
    assert skipped[:2] == [True, True] and scales[:3] == [2.0 ** 22, 2.0 ** 21, 2.0 ** 20]  # measured: skipped at
    first = skipped.index(False)  # 2^22 and 2^21, applied 2 steps at 2^20, grown to 2^21 and skipped, then at 2^20
    assert max(scales[first:]) > scales[first] and sum(skipped) >= 3, (skipped, scales)
    assert all(not math.isfinite(float(s["grad_norm"])) for s in record["steps"] if s["skipped"])
    assert [s["skipped"] for s in replay["steps"]] == skipped and [s["loss_scale"] for s in replay["steps"]] == scales
    assert [s["overflowed"] for s in replay["steps"]] == skipped
    assert [s["declared_lr"] is None for s in record["steps"]] == skipped
    assert all(s["declared_lr"] == s["lr"] for s in record["steps"] if not s["skipped"])
    result = {r.run.name: r for r in compare_in(folder).results}["plain_loop"]
    assert result.bounds.calibrated and result.verdict.passed and max(result.noise_ratios.values()) < 1, result


def test_a_clip_before_unscaling_fails_at_its_first_applied_step(amp):
    """clip_grad_norm_ before scaler.unscale_: the clip takes the scaled gradients to the max norm, the unscaling then
    takes them to 1/scale of it — AdamW hides most of it in the loss. The verdict FAILs at the first step the run
    applied, on the pre-clip norm the recorder read after the unscaling (measured 1e-6 against the replay's 1.2)."""
    folder, _ = amp
    bug = _record(folder, "clip_first")
    first_applied = next(s["step"] for s in bug["steps"] if not s["skipped"])
    result = {r.run.name: r for r in compare_in(folder).results}["clip_first"]
    outside = result.verdict.first_outside
    assert not result.verdict.passed and outside.step == first_applied, outside
    assert outside.quantity == "grad_norm" and outside.value < 1e-3 * outside.reference, outside


def test_a_scale_off_gradscalers_rules_fails_ahead_of_any_tolerance(amp, tmp_path):
    """The clean record with one applied step's scale doubled: FAIL at that step on the scaler's rules (test
    loss_scaler), naming GradScaler's."""
    folder, _ = amp
    copy = tmp_path / "moved"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("loss_clip_first*", "recorded_clip_first"))
    record = _record(copy, "plain_loop")
    step = next(s["step"] for s in record["steps"] if not s["skipped"])
    record["steps"][step]["loss_scale"] *= 2
    (copy / "loss_plain_loop.json").write_text(json.dumps(record))
    outside = compare_in(copy).results[0].verdict.first_outside
    assert (outside.step, outside.quantity, outside.test) == (step, "loss_scale", "loss_scaler"), outside
    assert outside.value == 2 * outside.reference


def test_gradscalers_rules_are_torchs():
    """comparing/loss_scales.py's GradScaler rules give, from the recorded settings and the steps skipped, the scale
    torch's own GradScaler had at each step — driven here through overflows, growth and a non-default factor."""
    from parity.comparing.loss_scales import grad_scaler
    from parity.recording.grad_scaler import settings

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25,
                                  growth_interval=2)
    skipped = [True, False, False, False, True, True, False, False, False, False]
    scales = []
    for skip in skipped:
        optimizer.zero_grad()
        scaler.scale(param.sum() * (math.inf if skip else 1.0)).backward()
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
    assert grad_scaler(settings(scaler), skipped) == scales
    assert scales[:3] == [2.0 ** 10, 2.0 ** 8, 2.0 ** 8] and scales[3] == 2.0 ** 10  # backed off, grown after 2


@pytest.mark.parametrize("steps_at_skip,stepped_twice", [(True, False), (False, False), (True, True)])
def test_the_declared_lr_takes_either_loops_convention_at_skipped_steps(steps_at_skip, stepped_twice):
    """A schedule copied at the start (DeclaredSchedule), the loop's own scheduler stepped at each skipped step (torch's
    AMP recipe) or not (Trainer): the lr applied at every applied step is the declared one either way; a scheduler
    stepped twice an update still parts from it."""
    from parity.recording.resume import DeclaredSchedule

    warnings.simplefilter("ignore", UserWarning)  # the scheduler stepped without the optimizer: moot here
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    declared = DeclaredSchedule.copy_of(scheduler, 0, print)
    off = []
    for skip in [True, False, True, True, False, False]:
        applied = optimizer.param_groups[0]["lr"]
        lr = declared.lr(None if skip else applied, skipped=skip)
        off.append(lr is not None and lr != applied)
        if not skip or steps_at_skip:
            scheduler.step()
        if stepped_twice and not skip:
            scheduler.step()
    assert any(off) == stepped_twice, off
