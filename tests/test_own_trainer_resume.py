"""A recorded run stopped at a checkpoint and resumed from it (docs/own_trainer.md, "Resume"): the hand-written loop
(examples/plain_loop.py --save_at / --resume_from), Trainer (examples/hf_trainer.py --save_at /
--resume_from_checkpoint) and TRL's GRPOTrainer (examples/trl_posttrain.py, its rollouts continued) continue one record
from the resumed step and PASS against its replay; a resume that drops
the Adam moments, or the whole optimizer state, FAILs at the resumed step; a plain loop's scheduler stepped twice per
update FAILs on its declared schedule; a record that cannot be continued is refused in one line.

One gloo group of two ranks records every job one after another (each run stopped at step 3 of 6, then resumed from
its checkpoint), one local group of two replays every record; the refusals run in this process (a group of one)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import REPO, free_port, kernel_setting, max_rel_diff, series
from test_own_trainer import _compare, _copy, _record, _record_rank, _replay, first_fail, linear_step

PLAIN = os.path.join(REPO, "examples", "plain_loop.py")
HF = os.path.join(REPO, "examples", "hf_trainer.py")
TRL = os.path.join(REPO, "examples", "trl_posttrain.py")
NAMES = {PLAIN: "plain_loop", HF: "hf_trainer", TRL: "trl_posttrain"}
# GRPO (grpo's row means) at 2 ranks × GA 2, a generation over two optimizer steps: stopped after step 3, inside one
GRPO = ["--fp32", "--loss_type", "grpo", "--beta", "0.04", "--steps_per_generation", "4"]
STEPS, AT = 6, 3  # stopped after step 3's checkpoint, resumed there
RESTORE = '    optimizer.load_state_dict(state["optimizer"])\n'
# Copies of the plain loop, each one line changed
COPIES = {
    # the optimizer restored but for its state: AdamW's moments (and step count) start again at the resume
    "no_moments": [(RESTORE, '    optimizer.load_state_dict({**state["optimizer"], "state": {}})\n')],
    # the optimizer not restored at all: no moments, and its lr the fresh scheduler's first (warm-up 1/3)
    "no_optimizer": [(RESTORE, "")],
    # the scheduler stepped twice per update (run without a stop)
    "twice": [("        scheduler.step()\n", "        scheduler.step()\n        scheduler.step()\n")],
}
RESUMED = {"plain": PLAIN, "hf": HF, "grpo": TRL, "no_moments": None, "no_optimizer": None}  # None: a plain loop copy


def _stopped_and_resumed(example: str, folder) -> list[tuple]:
    """The two jobs of a run stopped at step AT after its checkpoint and resumed from it (rank 0's lines of the
    resumed one kept in its folder)."""
    out = ["--output_dir", str(folder), "--steps", str(STEPS), *(GRPO if example == TRL else [])]
    checkpoint, resume = ((f"trainer/checkpoint-{AT}", "--resume_from_checkpoint") if example in (HF, TRL)
                          else (f"checkpoint-{AT}", "--resume_from"))
    return [(example, [*out, "--save_at", str(AT)]),
            (example, [*out, resume, str(folder / checkpoint)], str(folder / "resumed.txt"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: its folder}, each with its record and its replay at 2 workers (loss_ddp.json)."""
    from parity.driver.local_group import launch_local, start_processes

    root = tmp_path_factory.mktemp("own_trainer_resume")
    folders = {name: root / name for name in (*RESUMED, "twice")}
    for folder in folders.values():
        folder.mkdir()
    copies = {name: _copy(root, PLAIN, name, edits) for name, edits in COPIES.items()}
    jobs = [job for name, example in RESUMED.items()
            for job in _stopped_and_resumed(example or copies[name], folders[name])]
    jobs.append((copies["twice"], ["--output_dir", str(folders["twice"]), "--steps", str(AT)]))
    with kernel_setting():  # the records and replays under the perturbed kernels (conftest.PERTURBED)
        start_processes(_record_rank, (2, free_port(), jobs), 2)
        replays = [_replay(folders, root, name, NAMES.get(RESUMED.get(name), "plain_loop"), 2) for name in folders]
        launch_local([cfg for cfg, _ in replays], [{"batches": batches} for _, batches in replays])
    return folders


@pytest.mark.parametrize("case", ["plain", "hf"])
def test_a_resumed_run_continues_its_record_and_passes(runs, case, tmp_path):
    """Stopped after step 3's checkpoint and resumed from it: one record of 6 steps (resumed_at [3], the batches
    saved on at step 3), the lr its schedule declares at every step (the declared schedule moved on to step 3 at the
    resume), and the replay — from the initial weights the first run saved, at step 0 — equal to it within 1e-5 on
    loss, grad norm and parameter norm: PASS (exit 0)."""
    from parity.commands.compare_curves import compare_and_report

    name = NAMES[RESUMED[case]]
    recorded, replay = _record(runs[case], name), _record(runs[case], "ddp")
    config = recorded["config"]
    assert recorded["complete"] and config["resumed_at"] == [AT] and config["stopped"] is None
    assert [s["step"] for s in recorded["steps"]] == list(range(STEPS))
    assert config["batches"]["saved_steps"] == STEPS == config["total_steps"]
    assert series(recorded, "declared_lr") == series(recorded, "lr")
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    lines = (runs[case] / "resumed.txt").read_text().splitlines()
    assert f"parity recorder [{name}]: recorded {STEPS} steps: {runs[case] / f'loss_{name}.json'}" in lines
    assert any(line.endswith(f", continued at step {AT}") for line in lines), lines
    assert compare_and_report(str(runs[case]), str(tmp_path / "curves.png")) == 0


def test_a_resumed_grpo_run_continues_its_rollouts_and_passes(runs, tmp_path):
    """TRL's GRPOTrainer stopped after step 3's checkpoint — inside a generation batch of steps 2 and 3 — and resumed:
    one record of 6 steps whose rollout file holds every step, the first run's 3 read back from its own file; TRL
    generates again at the resume (its buffers are not in its checkpoint), so the resumed rows are generation batches
    of their own, numbered on. Its replay equals it within 1e-5 (the loss on the advantages' scale): PASS. Before
    2026-11-30 such a resume was refused (`a resumed run of grpo is not recorded`)."""
    from parity.commands.compare_curves import compare_and_report
    from parity.objectives.rollouts import read_rollouts

    folder = runs["grpo"]
    recorded, replay = _record(folder, "trl_posttrain"), _record(folder, "ddp")
    config = recorded["config"]
    assert recorded["complete"] and config["resumed_at"] == [AT] and config["objective"]["name"] == "grpo"
    rollouts = read_rollouts(str(folder / config["rollouts"]))
    assert rollouts.steps == STEPS
    assert [int(rollouts.step(s)[1].generation[0]) for s in range(STEPS)] == [0, 0, 1, 2, 2, 3]
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    for key in ("grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    scale = [s["objective"]["advantage_scale"] for s in replay["steps"]]
    assert max(abs(a - b) / max(abs(b), c) for a, b, c in zip(series(recorded, "loss"), series(replay, "loss"),
                                                               scale)) < 1e-5
    assert compare_and_report(str(folder), str(tmp_path / "curves.png")) == 0


def test_a_resume_that_drops_the_moments_fails_at_the_resumed_step(runs):
    """The optimizer restored without its state: AdamW starts its moments and bias correction again at step 3. The
    same weights and rows at step 3 (loss and grad norm equal the replay's), another update: FAIL at step 3 on the
    parameter norm; steps 0–2 within 1e-5."""
    recorded, replay = _record(runs["no_moments"], "plain_loop"), _record(runs["no_moments"], "ddp")
    outside = first_fail(runs["no_moments"], AT, "param_norm")
    assert outside.rel_diff > 1e-4
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(series(replay, key)[:AT + 1], series(recorded, key)[:AT + 1]) < 1e-5, key
    assert max_rel_diff(series(replay, "param_norm")[:AT], series(recorded, "param_norm")[:AT]) < 1e-5


def test_a_resume_that_loses_the_optimizer_fails_on_the_schedule(runs):
    """The optimizer not restored: its lr is the fresh scheduler's first (the warm-up's 1/3 of 1e-3) while the restored
    scheduler declares 1e-3 for step 3: FAIL at step 3 on the lr, the parameter norm outside there too (no moments)."""
    recorded, replay = _record(runs["no_optimizer"], "plain_loop"), _record(runs["no_optimizer"], "ddp")
    outside = first_fail(runs["no_optimizer"], AT, "lr")
    assert (outside.value, outside.reference) == pytest.approx((1e-3 / 3, 1e-3), rel=1e-12)
    assert max_rel_diff(series(replay, "param_norm")[AT:AT + 1], series(recorded, "param_norm")[AT:AT + 1]) > 1e-5


def test_a_scheduler_stepped_twice_fails_on_the_declared_schedule(runs):
    """A plain loop whose scheduler steps twice per update: the replay applies the recorded lr, so the curves agree
    within 1e-5, and the declared schedule (the recorder's copy of the loop's scheduler, stepped once per update)
    FAILs it at step 1: 1e-3 applied (the warm-up's step 2), 6.7e-4 declared."""
    outside = first_fail(runs["twice"], 1, "lr")
    assert (outside.value, outside.reference) == pytest.approx((1e-3, 2e-3 / 3), rel=1e-12)
    (result,) = _compare(runs["twice"]).results
    assert all(x < 1e-5 for x in result.verdict.max_rel_diff.values())


def test_a_record_that_cannot_be_continued_is_refused_in_one_line(tmp_path):
    """A run recorded for 2 steps, then resumed (a group of one in this process): at step 3 (the record holds fewer
    steps), into a folder without the record, with another optimizer setting, and with a batch gone — each one line,
    nothing recorded (the record's file unchanged), and the loop trains on."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        out, ids = tmp_path / "out", torch.randint(0, 4, (2, 8))
        rec = ParityRecorder(str(out), name="mine", model=model, optimizer=optimizer, log=lambda _: None)
        for _ in range(2):
            linear_step(model, optimizer, rec, ids)
        record = out / "loss_mine.json"
        assert rec.close() == str(record)
        written = record.read_bytes()
        batch = out / "recorded_mine" / "batches" / "step_000001.safetensors"
        other = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        cases = [(3, out, optimizer, "it holds 2 steps"),
                 (2, tmp_path / "elsewhere", optimizer,
                  f"there is none in {tmp_path / 'elsewhere'} (the first run was not recorded there)"),
                 (2, out, other, "this run's optimizer.groups[0].weight_decay is 0.1, the record's 0.01: it continues "
                                 "another run"),
                 (2, out, optimizer, f"its batch of step 1 is missing from {out / 'recorded_mine' / 'batches'}")]
        for k, folder, opt, why in cases:
            if why.startswith("its batch"):
                batch.unlink()
            lines = []
            rec = ParityRecorder(str(folder), name="mine", model=model, optimizer=opt, start_step=k, log=lines.append)
            assert not rec.enabled and lines == [f"parity recorder [mine]: cannot continue loss_mine.json at step {k}: "
                                                 f"{why}: recording nothing; the training goes on"], lines
            steps = int(opt.state[model.weight].get("step", 0))
            linear_step(model, opt, rec, ids)
            assert opt.state[model.weight]["step"] == steps + 1 and rec.close() is None
            assert record.read_bytes() == written
    finally:
        dist.destroy_process_group()
