"""Your own accelerate loop (docs/own_trainer/accelerate.md#accelerate): examples/accelerate_loop.py — Accelerator, prepare,
accumulate, accelerator.backward, clip_grad_norm_, transformers' get_scheduler, written as transformers'
run_clm_no_trainer.py is — recorded with accelerate's prepared model and AcceleratedOptimizer as they are, replayed
under the harness's DDP, judged. The model's own per-micro-batch `.loss` (run_clm_no_trainer.py's) seeded into a copy
FAILs at step 0; a process that trains alone while its launcher started two (accelerate's DistributedType.NO: on CPU
without cpu=True) is refused in one line naming the cause and the fix, and nothing is written; a recorder that fails
while writing its start leaves no folder.

One gloo group of two ranks records the four jobs one after another (the variables torchrun sets: accelerate takes
the group that is up), one local group of two replays the two records (module-scoped)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import REPO, free_port, gloo_rank, kernel_setting, max_rel_diff, series, tensor_norms_off
from test_own_trainer import _copy, _record, _record_rank, _replay, first_fail

EXAMPLE = os.path.join(REPO, "examples", "accelerate_loop.py")
NAME = "accelerate_loop"
STEPS = 6
CLEAN_LOSS = "loss = summed * world * accum / tokens"
ACCELERATOR = ("num_steps=accum, sync_with_dataloader=False), cpu=not torch.cuda.is_available(),\n"
               "        mixed_precision=\"bf16\" if args.bf16 else \"fp16\" if args.fp16 else \"no\")")
COPIES = {
    # run_clm_no_trainer.py's loss: the model's own per-micro-batch mean, a mean of means on padded data
    "mean_of_means": [(CLEAN_LOSS, "loss = outputs.loss")],
    # accelerate's default sync_with_dataloader: fetching the last step's micro-batches ahead ends the dataloader, and
    # accelerate syncs and steps at each of them
    "stepped_twice": [("accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(\n"
                       "        " + ACCELERATOR, "accelerator = Accelerator(gradient_accumulation_steps=accum, "
                                                 "cpu=not torch.cuda.is_available(), "
                                                 "mixed_precision=\"bf16\" if args.bf16 else \"no\")")],
    # a plain Accelerator() on CPU, in a fresh accelerate state as a user's process has it: DistributedType.NO, one
    # process, in each of the two the launcher started; it writes what it trained as, to show it ran to its end
    "alone": [(ACCELERATOR, "num_steps=accum, sync_with_dataloader=False))"),
              ("    accelerator = Accelerator(", "    from accelerate.state import AcceleratorState\n\n"
                                                "    AcceleratorState._reset_state(reset_partial_state=True)\n"
                                                "    accelerator = Accelerator("),
              ("    return rec.close()", "    with open(f'{args.output_dir}/trained.txt', 'w') as f:\n"
                                        "        f.write(f'{accelerator.distributed_type} '\n"
                                        "                f'{accelerator.num_processes}')\n"
                                        "    return rec.close()")],
}
# accelerate's state made again with mixed_precision="bf16" (a process's state is made once; these run after others)
BF16_STATE = ("    accelerator = Accelerator(", "    from accelerate.state import AcceleratorState\n\n"
                                              "    AcceleratorState._reset_state()\n"
                                              "    accelerator = Accelerator(")
TOLD = "max_grad_norm=args.max_grad_norm,  # its precision: the Accelerator's mixed_precision"
COPIES.update({
    "left_out": [BF16_STATE],  # the example as it is: no precision told, --bf16
    "told_fp32": [BF16_STATE, (TOLD, 'max_grad_norm=args.max_grad_norm, precision="fp32",')],
})
TOLD_LINE = (f"parity recorder [{NAME}]: precision 'fp32' told, but accelerate trains the model in 'bf16': pass "
             "precision='bf16', or leave it out: recording nothing")
ALONE_LINE = (f"parity recorder [{NAME}]: the launcher started 2 processes (WORLD_SIZE=2) but this one trains alone "
              "(accelerate's DistributedType.NO, num_processes 1: on CPU accelerate forms a process group only with "
              "cpu=True): pass Accelerator(cpu=True) or set ACCELERATE_USE_CPU=1: recording nothing")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The clean example (6 steps, 2 rows a micro-batch, 2 micro-batches a step, 2 ranks) and the mean-of-means copy
    (3 steps) recorded and replayed at 2 workers; the lone copy last (it resets accelerate's state), rank 0's lines
    kept. {name: its folder}."""
    from parity.driver.local_group import launch_local, start_processes

    root = tmp_path_factory.mktemp("own_trainer_accelerate")
    folders = {name: root / name for name in ("clean", *COPIES, "fp16_on_cpu")}
    for folder in folders.values():
        folder.mkdir()
    copies = {name: _copy(root, EXAMPLE, name, edits) for name, edits in COPIES.items()}
    jobs = [(EXAMPLE, ["--output_dir", str(folders["clean"]), "--steps", str(STEPS)]),
            (copies["mean_of_means"], ["--output_dir", str(folders["mean_of_means"]), "--steps", "3"]),
            (copies["stepped_twice"], ["--output_dir", str(folders["stepped_twice"]), "--steps", "2"]),
            (copies["left_out"], ["--output_dir", str(folders["left_out"]), "--steps", "2", "--bf16"]),
            (copies["left_out"], ["--output_dir", str(folders["fp16_on_cpu"]), "--steps", "2", "--fp16"]),
            (copies["told_fp32"], ["--output_dir", str(folders["told_fp32"]), "--steps", "2", "--bf16"],
             str(folders["told_fp32"] / "stderr.txt")),
            (copies["alone"], ["--output_dir", str(folders["alone"]), "--steps", "2"],
             str(folders["alone"] / "stderr.txt"))]
    with kernel_setting():  # the records and replays under the perturbed kernels (conftest.PERTURBED)
        start_processes(_record_rank, (2, free_port(), jobs), 2)
        planned = [_replay(folders, root, name, NAME, 2) for name in ("clean", "mean_of_means")]
        launch_local([cfg for cfg, _ in planned], [{"batches": batches} for _, batches in planned])
    return folders


def test_accelerate_loop_replays_to_the_record_and_passes(runs, tmp_path):
    """accelerate's prepared DDP model and AcceleratedOptimizer taken as they are (the hook on the torch optimizer
    inside, which accelerate steps once a step: at the micro-batch where sync_gradients is set); the record and its
    DDP replay: the same batches, tokens and lr at every step, loss, pre-clip grad norm and parameter norm within
    1e-5 (measured ~1e-8), no rows fed twice (accelerate shards the shuffled loader), PASS (exit 0)."""
    from parity.commands.compare_curves import compare_and_report

    recorded, replay = _record(runs["clean"], NAME), _record(runs["clean"], "ddp")
    config = recorded["config"]
    assert config["stopped"] is None and config["not_replayable"] is None
    assert recorded["steps"][0]["micro_batches"] == [[2, 2], [2, 2]] and config["grad_norm_source"] == "recorder"
    assert config["optimizer"]["type"] == "AdamW" and replay["config"]["optimizer"] == config["optimizer"]
    assert len(replay["steps"]) == len(recorded["steps"]) == STEPS
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    assert len(set(series(recorded, "tokens"))) > 1  # padded: the steps hold different numbers of loss tokens
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    assert max(abs(s["logged_loss"] - s["loss"]) / s["loss"] for s in recorded["steps"]) < 1e-5
    assert all(s["rows_check"]["duplicates"] == 0 for s in recorded["steps"])
    for record in (recorded, replay):  # every tensor's pre-clip norms (before_step) add up to the step's
        assert max(tensor_norms_off(record, runs["clean"])) < 1e-12
    assert compare_and_report(str(runs["clean"]), str(tmp_path / "curves.png")) == 0


def test_mean_of_micro_batch_means_fails_at_step_0(runs):
    """run_clm_no_trainer.py's loss (the model's `.loss`, each micro-batch's own token mean) under accumulation and
    DDP: the same loss at step 0 (same weights, same data), another gradient — FAIL at step 0 on the grad norm."""
    recorded, replay = _record(runs["mean_of_means"], NAME), _record(runs["mean_of_means"], "ddp")
    assert abs(recorded["steps"][0]["loss"] - replay["steps"][0]["loss"]) <= 1e-6 * replay["steps"][0]["loss"]
    assert first_fail(runs["mean_of_means"], 0, "grad_norm").rel_diff > 1e-3


def test_an_optimizer_that_stepped_twice_in_a_step_stops_the_record_there(runs):
    """AcceleratedOptimizer.step() runs at every micro-batch and steps the torch optimizer only where accelerate syncs:
    the recorder's hook on it fires once a step. Where accelerate syncs at every micro-batch of a step (the last one,
    its dataloader ended by fetching ahead), the torch optimizer steps twice in that step: the record stops there,
    saying so (the replay would step once), and holds the step before it."""
    recorded = _record(runs["stepped_twice"], NAME)
    assert recorded["config"]["stopped"] == {"step": 1, "why": (
        "the optimizer stepped 2 times in step 1 (after_step() goes after each optimizer step): the replay steps it "
        "once a recorded step")}
    assert len(recorded["steps"]) == 1


def test_the_accelerators_mixed_precision_is_the_records_unless_told_another(runs):
    """Accelerator(mixed_precision="bf16") and a recorder told no precision: the record's policy is bf16 (autocast
    over fp32 weights), as the replay must train — told none, a bf16 run was replayed in fp32 and FAILed at 64 × its
    bound (docs/false_alarms.md). mixed_precision="fp16" on a CPU, which accelerate trains in fp32 (no autocast, no
    scaler): fp32. Told "fp32" against bf16: refused in one line naming both and the fix, nothing written."""
    recorded = _record(runs["left_out"], NAME)
    assert recorded["config"]["precision"] == "bf16" and len(recorded["steps"]) == 2
    on_cpu = _record(runs["fp16_on_cpu"], NAME)
    assert (on_cpu["config"]["precision"], len(on_cpu["steps"]), on_cpu["config"]["loss_scaling"]) == ("fp32", 2, None)
    lines = [line for line in (runs["told_fp32"] / "stderr.txt").read_text().splitlines()
             if line.startswith("parity recorder")]
    assert lines == [TOLD_LINE]
    assert sorted(p.name for p in runs["told_fp32"].iterdir()) == ["stderr.txt"]


def test_a_process_that_trains_alone_is_refused_in_one_line(runs):
    """WORLD_SIZE=2 from the launcher, a plain Accelerator() on CPU: accelerate keeps DistributedType.NO and one
    process. One line names that and the fix; nothing is written; the training ran to its end, alone."""
    folder = runs["alone"]
    lines = [line for line in (folder / "stderr.txt").read_text().splitlines() if line.startswith("parity recorder")]
    assert lines == [ALONE_LINE]
    assert sorted(p.name for p in folder.iterdir()) == ["stderr.txt", "trained.txt"]
    assert (folder / "trained.txt").read_text() == "DistributedType.NO 1"


def test_no_group_under_a_launcher_of_two_is_refused_in_one_line(tmp_path, monkeypatch):
    """torchrun's variables say 2 processes and no process group is up (no accelerate here): one line naming
    torch.distributed, nothing written."""
    from parity.recording.recorder import ParityRecorder

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delitem(sys.modules, "accelerate", raising=False)  # an earlier test's Accelerator state, if any
    lines = []
    model = torch.nn.Linear(2, 2)
    rec = ParityRecorder(str(tmp_path), name="alone", model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         log=lines.append)
    assert not rec.enabled and lines == [
        "parity recorder [alone]: the launcher started 2 processes (WORLD_SIZE=2) but this one trains alone (torch.distributed "
        "is not initialised in it): call init_process_group(backend) in every process, without rank and world_size: "
        "it takes the launcher's variables: recording nothing"]
    assert not any(tmp_path.iterdir())


def test_a_start_that_fails_while_writing_leaves_no_folder(tmp_path, monkeypatch):
    """The initial weights' write fails after config.json is written: one line, and the recorded folder is gone."""
    import parity.recording.recorder as recorder

    def failing(*args, **kwargs):
        raise OSError("disk full")

    from parity.models.model import build_model, resolve_model_config

    monkeypatch.setattr(recorder, "save_initial_weights", failing)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = build_model(resolve_model_config("qwen2-tiny"), 0)
    lines = []
    with gloo_rank(0, 1, free_port()):
        rec = recorder.ParityRecorder(str(tmp_path), name="failing", model=model,
                                      optimizer=torch.optim.AdamW(model.parameters()), log=lines.append)
    assert not rec.enabled
    assert lines == ["parity recorder [failing]: could not start (OSError: disk full): recording nothing"]
    assert not any(tmp_path.iterdir())
