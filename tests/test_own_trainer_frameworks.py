"""Your own trainer under Lightning and TRL (docs/own_trainer.md): examples/lightning_lm.py (Lightning's ParityCallback)
and examples/trl_sft.py (TRL's SFTTrainer, recorded by Trainer's ParityCallback, which it inherits), each at 2 ranks
and at 1 with accumulation on padded data, recorded, replayed under the harness's DDP (the local launcher: Ray adds
nothing to the arithmetic), judged by the verdict; Lightning's ModelParallelStrategy (FSDP2 over its data-parallel
dim, on CPU); a seeded bug in a copy of the Lightning example FAILs at a named step; one Ray Train run of both
frameworks with Ray's own integrations, recorded and replayed; and LoRA (peft's adapters on the frozen model) under
Lightning, TRL (SFTTrainer's peft_config) and Hugging Face's Trainer (examples/hf_trainer.py), each PASSing its replay.

Processes are shared: one gloo group of two ranks records every 2-rank job one after another, one group of one the
1-rank jobs, one Ray Train run (two workers) both frameworks in sequence, and one local group of two replays every
record (a 1-rank record is replayed at 2 workers: the global token mean does not depend on the layout)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import REPO, assert_same_tensors_at_step_0, free_port, max_rel_diff, series, tensor_norms_off, tensor_series
from test_own_trainer import HF_EXAMPLE, _copy, _record_rank, _replay, assert_lora_replays

LIGHTNING = os.path.join(REPO, "examples", "lightning_lm.py")
TRL = os.path.join(REPO, "examples", "trl_sft.py")
NAMES = {"lightning": "lightning_lm", "trl": "trl_sft"}
STEPS = 6
CLEAN_LOSS = "loss = summed * self.world * self.args.grad_accum_steps / batch[\"step_tokens\"]"
# The seeded bug: the Hugging Face model's own loss, each micro-batch's token mean — what a Lightning module usually
# returns; Lightning then averages it over the accumulation window and DDP over the ranks: a mean of means.
BUG = [(CLEAN_LOSS, "loss = out.loss")]
PARTIAL = ["--micro_batches", "11"]  # an epoch of 5 full windows and one of a single micro-batch: step 5
# Manual optimization's seeded fault: a DDP communication hook that leaves rank 1's gradients of step 0 its own (the
# all-reduce still runs on every rank, so the ranks stay in step) — one rank's first gradients left unreduced.
MANUAL_STEP = "        def manual_step(self, loss, batch_idx):\n"
MANUAL_BUG = [(MANUAL_STEP, """        def on_train_start(self):
            import torch.distributed as dist

            def hook(state, bucket):
                local = bucket.buffer().clone()
                future = dist.all_reduce(bucket.buffer().div_(self.world), async_op=True).get_future()
                own = self.global_step == 0 and self.global_rank == 1
                return future.then(lambda done: local if own else done.value()[0])

            self.trainer.strategy.model.register_comm_hook(None, hook)

""" + MANUAL_STEP)]
# A clip by hand under manual optimization: what the recorder cannot read (it reads self.clip_gradients' clip)
HAND_CLIP = [('self.clip_gradients(opt, gradient_clip_val=self.args.max_grad_norm, gradient_clip_algorithm="norm")',
              "torch.nn.utils.clip_grad_norm_(self.parameters(), self.args.max_grad_norm)")]
# folder → (example, record name, ranks, extra arguments); "ray_*" are recorded by the Ray Train run
# TRL first in each group: Lightning's environment deletes WORLD_SIZE at its teardown, which accelerate reads
CLIP = "gradient_clip_val=None if args.strategy == \"fsdp\" or not automatic else args.max_grad_norm,"
BY_VALUE = [(CLIP, CLIP + " gradient_clip_algorithm=\"value\",")]
JOBS = {
    "trl": (TRL, "trl_sft", 2, []),
    "trl_lora": (TRL, "trl_sft", 2, ["--lora"]),
    "hf_lora": (HF_EXAMPLE, "hf_trainer", 2, ["--lora"]),  # Trainer reads WORLD_SIZE too: before Lightning
    "lightning_lora": (LIGHTNING, "lightning_lm", 2, ["--lora"]),
    "lightning": (LIGHTNING, "lightning_lm", 2, PARTIAL),
    "lightning_bug": (None, "lightning_lm", 2, []),
    "lightning_mp": (LIGHTNING, "lightning_lm", 2, ["--strategy", "model_parallel"]),
    # manual optimization under DDP's static_graph, one manual_backward a step: its first iteration reduces after
    # on_after_backward (Lightning's post_backward); clipping at 1.0 itself, and not clipping
    "lightning_manual": (LIGHTNING, "lightning_lm", 2, ["--manual", "--static_graph", "--grad_accum_steps", "1"]),
    "lightning_manual_unclipped": (LIGHTNING, "lightning_lm", 2, ["--manual", "--static_graph", "--grad_accum_steps",
                                                                  "1", "--max_grad_norm", "0"]),
    "lightning_manual_bug": (None, "lightning_lm", 2, ["--manual", "--static_graph"]),  # accumulating 2
    "lightning_hand_clip": (None, "lightning_lm", 2, ["--manual"]),  # refused: nothing replayed
    # Trainer(gradient_clip_algorithm="value"): clip_grad_value_ at 0.001, recorded and replayed as it is
    "lightning_value": (None, "lightning_lm", 2, ["--max_grad_norm", "0.001"]),
    "trl_1": (TRL, "trl_sft", 1, []),
    "lightning_1": (LIGHTNING, "lightning_lm", 1, []),
    "ray_trl": (TRL, "trl_sft", 2, []),
    "ray_lightning": (LIGHTNING, "lightning_lm", 2, PARTIAL),
}
CLEAN = ["lightning", "lightning_mp", "lightning_manual", "trl", "lightning_1", "trl_1", "ray_lightning", "ray_trl"]


def _ray_loop(config: dict) -> None:
    """A Ray Train worker: each example's own training function with Ray's integrations (ray=True), one after
    another."""
    import importlib.util

    import torch

    torch.set_num_threads(1)
    for i, (path, argv) in enumerate(config["jobs"]):
        spec = importlib.util.spec_from_file_location(f"ray_example_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.train(module.parse_args(argv), ray=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_cluster):
    """{folder name: its folder}, each with the record and its replay (loss_ddp.json)."""
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from parity.driver.local_group import launch_local, start_processes

    root = tmp_path_factory.mktemp("own_trainer_frameworks")
    folders = {name: root / name for name in JOBS}
    bugs = {"lightning_bug": _copy(root, LIGHTNING, "lightning_bug", BUG),
            "lightning_manual_bug": _copy(root, LIGHTNING, "lightning_manual_bug", MANUAL_BUG),
            "lightning_hand_clip": _copy(root, LIGHTNING, "lightning_hand_clip", HAND_CLIP),
            "lightning_value": _copy(root, LIGHTNING, "lightning_value", BY_VALUE)}
    jobs = {1: [], 2: [], "ray": []}
    for name, (example, record, ranks, extra) in JOBS.items():
        argv = ["--output_dir", str(folders[name]), "--name", record, "--steps", str(STEPS), *extra]
        jobs["ray" if name.startswith("ray_") else ranks].append((example or bugs[name], argv))
    for ranks in (2, 1):
        start_processes(_record_rank, (ranks, free_port(), jobs[ranks]), ranks)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    TorchTrainer(_ray_loop, train_loop_config={"jobs": jobs["ray"]},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=RunConfig(storage_path=str(root / "ray"), name="frameworks"),
                 torch_config=TorchConfig(backend="gloo")).fit()
    planned = [_replay(folders, root, name, JOBS[name][1], 2) for name in JOBS if name != "lightning_hand_clip"]
    launch_local([cfg for cfg, _ in planned], [{"batches": batches} for _, batches in planned])
    return folders


def _record(folder, name: str) -> dict:
    return json.loads((folder / f"loss_{name}.json").read_text())


def _compare(folder):
    from parity.comparing.curves import compare, load_runs

    return compare(load_runs(str(folder)))


@pytest.mark.parametrize("name", CLEAN)
def test_clean_run_replays_to_the_record_and_passes(runs, name):
    """Lightning (DDP, ModelParallel, 1 rank, Ray Train) and TRL (2 ranks, 1 rank, Ray Train): the replay trains on
    the recorded rows with the recorded lr and equals the record's loss, pre-clip grad norm and parameter norm within
    1e-5 relative at every step (measured ≤ 5e-8); replicas held in both (every tensor several ranks hold, bit for
    bit, after every step); no rank fed another's rows; PASS."""
    example, record_name, ranks, _ = JOBS[name]
    recorded, replay = _record(runs[name], record_name), _record(runs[name], "ddp")
    config = recorded["config"]
    assert recorded["complete"] and config["source"] == "recorder" and len(recorded["steps"]) == STEPS
    accumulated = [2] if name == "lightning_manual" else [2, 2]  # 2 rows a micro-batch, 2 micro-batches, padded
    assert recorded["steps"][0]["micro_batches"] == [accumulated] * ranks
    assert len(set(series(recorded, "tokens"))) > 1
    framework = config["fingerprint"]["framework"]
    if example == LIGHTNING:
        assert framework["name"] == "lightning.Trainer" and framework["versions"]["lightning"] == "2.6.6"
        assert config["grad_norm_source"] == "recorder" and config["max_grad_norm"] == 1.0
        # the norm is measured before Lightning's clipping at 1.0: some steps above it
        assert max(series(recorded, "grad_norm")) > 1.0
        assert max_rel_diff(series(recorded, "logged_loss"), series(recorded, "loss")) < 1e-6
    else:
        assert framework["versions"]["trl"] == "1.16.0" and config["grad_norm_source"] == "recorder"
    assert config["sharding"]["kind"] == ("fsdp2" if name == "lightning_mp" else "data parallel")
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    held_twice = ranks > 1 and name != "lightning_mp"  # one rank, or FSDP2 at TP 1: no tensor on two ranks
    assert recorded["replicas"]["groups"] == (78 if held_twice else 0)  # 26 parameters and their 2 Adam moments
    for record, twice in ((recorded, held_twice), (replay, True)):  # the replay at 2 workers holds every tensor twice
        assert [s["replicas"]["parted"] for s in record["steps"] if "replicas" in s] == ([0] * STEPS if twice else [])
    assert all(s["rows_check"]["duplicates"] == 0 for s in recorded["steps"])
    # every tensor: Lightning's before its clipping, TRL's (Trainer's callbacks) after it, which did not clip here
    # (max_grad_norm 10) — the replay records the same kind; the squares add up to the step's norms
    kind = "pre_clip" if example == LIGHTNING else "clipped"
    for record in (recorded, replay):
        found = tensor_series(record, runs[name])
        assert found.grad == kind and found.clip_coef == ([None] if example == LIGHTNING else [1.0]) * STEPS
        assert max(tensor_norms_off(record, runs[name])) < 1e-12
    assert_same_tensors_at_step_0(replay, recorded, runs[name], runs[name])
    assert _compare(runs[name]).word == "PASS"


@pytest.mark.parametrize("name", ["lightning_lora", "trl_lora", "hf_lora"])
def test_lora_run_replays_to_the_record_and_passes(runs, name):
    """peft's LoRA adapters on the frozen model under Lightning (a PeftModel in the module, its optimizer over every
    parameter), TRL (SFTTrainer's peft_config: TRL makes the PeftModel) and Trainer (a PeftModel handed to it): each
    recorded as the harness's LoRA run (assert_lora_replays: the adapters' settings, the base under stock names and the
    adapters beside it, groups and series over the adapters alone) and PASSing its replay, which builds the same PEFT
    model, within 1e-5 at every step; the replica check over the PEFT model's 34 parameters and the adapters' 8 pairs
    of moments holds in both."""
    off = assert_lora_replays(runs[name], JOBS[name][1])
    recorded = _record(runs[name], JOBS[name][1])
    assert recorded["replicas"]["groups"] == 50 and len(recorded["steps"]) == STEPS
    print(f"{name}: {off}")


def test_lightnings_clip_by_value_is_recorded_and_replayed_as_it_is(runs):
    """Trainer(gradient_clip_val=0.001, gradient_clip_algorithm="value"): the record's clip_value, no max_grad_norm;
    the replay clamps each gradient element as clip_grad_value_ does — loss, pre-clip grad norm and parameter norm
    within 1e-5 at every step, PASS (refused in one line before 2026-11-30)."""
    recorded, replay = _record(runs["lightning_value"], "lightning_lm"), _record(runs["lightning_value"], "ddp")
    assert (recorded["config"]["clip_value"], recorded["config"]["max_grad_norm"]) == (0.001, 0.0)
    assert (replay["config"]["clip_value"], replay["config"]["max_grad_norm"]) == (0.001, 0.0)
    assert len(recorded["steps"]) == STEPS and recorded["config"]["stopped"] is None
    off = {key: max_rel_diff(series(replay, key), series(recorded, key)) for key in ("loss", "grad_norm", "param_norm")}
    assert max(off.values()) < 1e-5, off
    assert _compare(runs["lightning_value"]).word == "PASS"


def test_lightning_mean_of_micro_batch_means_fails_at_step_0(runs):
    """The Hugging Face model's own per-micro-batch loss returned to Lightning under accumulation and DDP on padded
    data: the same loss at step 0 (same weights, same rows, measured by the recorder), another gradient — FAIL at step
    0 on the pre-clip grad norm. Lightning's own logged loss (the mean of means) is off the measured one."""
    recorded, replay = _record(runs["lightning_bug"], "lightning_lm"), _record(runs["lightning_bug"], "ddp")
    assert abs(recorded["steps"][0]["loss"] - replay["steps"][0]["loss"]) <= 1e-6 * replay["steps"][0]["loss"]
    assert max_rel_diff(series(recorded, "logged_loss"), series(recorded, "loss")) > 1e-4
    comparison = _compare(runs["lightning_bug"])
    (result,) = comparison.results
    assert comparison.word == "FAIL"
    outside = result.verdict.first_outside
    assert (outside.step, outside.quantity) == (0, "grad_norm"), outside
    assert outside.rel_diff > 1e-3


def test_lightnings_manual_optimization_is_recorded_where_the_module_steps(runs):
    """A LightningModule with automatic_optimization = False — its own manual_backward per micro-batch, clip_gradients
    at the window's last and opt.step() — under DDP with static_graph=True, one manual_backward a step (DDP's first
    iteration reduces the gradients after on_after_backward, in Lightning's post_backward: the gradients read once
    manual_backward returned), clipping at 1.0 (in CLEAN above) and not clipping: the pre-clip gradients are read where
    the module clips (else at its optimizer step), its clip is the record's max_grad_norm, and both PASS their replays
    within 1e-5. The seeded fault — rank 1's gradients of step 0 left its own by a DDP communication hook, static_graph,
    2 micro-batches a step — FAILs at step 0; a clip by hand (torch's clip_grad_norm_ in the training_step) is refused:
    the record ends before its first step, saying so."""
    for name, clip in (("lightning_manual", 1.0), ("lightning_manual_unclipped", 0.0)):
        recorded, replay = _record(runs[name], "lightning_lm"), _record(runs[name], "ddp")
        assert recorded["complete"] and len(recorded["steps"]) == STEPS, name
        assert recorded["config"]["max_grad_norm"] == clip and recorded["config"]["grad_norm_source"] == "recorder"
        assert recorded["config"]["stopped"] is None
        assert recorded["steps"][0]["micro_batches"] == [[2]] * 2
        for key in ("loss", "grad_norm", "param_norm"):
            assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, (name, key)
        assert max_rel_diff(series(recorded, "logged_loss"), series(recorded, "loss")) < 1e-6
        assert _compare(runs[name]).word == "PASS", name
    assert max(series(_record(runs["lightning_manual"], "lightning_lm"), "grad_norm")) > 1.0  # it clipped
    recorded = _record(runs["lightning_manual_bug"], "lightning_lm")
    assert recorded["steps"][0]["micro_batches"] == [[2, 2]] * 2
    assert recorded["steps"][0]["replicas"]["parted"] > 0  # rank 1's replica is another model from step 0 on
    comparison = _compare(runs["lightning_manual_bug"])
    assert comparison.word == "FAIL"
    (result,) = comparison.results
    outside = result.verdict.first_outside  # rank 1's own gradients in the recorded norm: 4.3e-2 off (measured)
    assert (outside.step, outside.quantity) == (0, "grad_norm") and outside.rel_diff > 1e-3, outside
    recorded = _record(runs["lightning_hand_clip"], "lightning_lm")  # clipped by hand: the record says why, no step
    assert recorded["steps"] == [] and "not by self.clip_gradients" in recorded["config"]["stopped"]["why"]


@pytest.mark.parametrize("framework", ["lightning", "trl"])
def test_ray_train_records_what_the_local_group_records(runs, framework):
    """The same training function under Ray Train (TorchTrainer with Ray's own integrations: RayDDPStrategy,
    RayLightningEnvironment and prepare_trainer for Lightning; prepare_trainer and RayTrainReportCallback for TRL)
    records the local group's run bit for bit: same rows, lr, loss, grad norm and parameter norm at every step (and
    its replay PASSes: test_clean_run_replays_to_the_record_and_passes[ray_*])."""
    name = NAMES[framework]
    local, ray = _record(runs[framework], name), _record(runs[f"ray_{framework}"], name)
    for key in ("batch_hash", "lr", "loss", "grad_norm", "param_norm"):
        assert series(ray, key) == series(local, key), key


def test_lightnings_partial_last_window_is_divided_by_the_full_accumulation(runs):
    """The finding for Lightning 2.6.6: at the epoch's last window, which holds one micro-batch of the two
    accumulate_grad_batches asks for, Lightning still divides the returned loss by 2 (the full count) and steps. The
    example returns its token sum × world × accumulation ÷ the window's own tokens, so it trains the window's token
    mean: the record (step 5: one micro-batch of 2 rows a rank) PASSes its replay within 1e-5 (measured 1.6e-7 on the
    grad norm). Had Lightning divided by the window's own count, the gradient would double there and FAIL; a module
    returning the model's own mean (the usual one) halves it there, on top of its mean of means."""
    recorded, replay = _record(runs["lightning"], "lightning_lm"), _record(runs["lightning"], "ddp")
    assert recorded["steps"][5]["micro_batches"] == [[2], [2]]
    assert [s["micro_batches"] for s in recorded["steps"][:5]] == [[[2, 2], [2, 2]]] * 5
    assert max_rel_diff(series(replay, "grad_norm"), series(recorded, "grad_norm")) < 1e-5
    assert _compare(runs["lightning"]).word == "PASS"


def test_what_lightnings_recorder_cannot_follow_is_refused_in_one_line():
    """Without processes, on Lightning Trainers as the callback reads them when the fit starts: two optimizers (a GAN's
    manual optimization), a precision the replay has no policy for (bf16-true: bf16 weights without fp32 masters);
    the same Trainer with one optimizer, 32-true or bf16-mixed and clipping by norm or by value is recorded
    (docs/refusals.md)."""
    import lightning.pytorch as pl
    import torch

    from parity.frameworks.lightning.callback import ParityCallback

    def refusal(optimizers=1, **settings):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, **settings)
        trainer.strategy.optimizers = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
                                       for _ in range(optimizers)]
        return ParityCallback._refusal(trainer, None)

    assert [refusal(), refusal(precision="bf16-mixed", gradient_clip_val=1.0),
            refusal(gradient_clip_val=1.0, gradient_clip_algorithm="norm")] == [None, None, None]
    assert refusal(optimizers=2) == "2 optimizers: the recorder follows one"
    assert refusal(precision="bf16-true") == "precision 'bf16-true': the harness replays 16-mixed, 32, 32-true, bf16-mixed"
    assert refusal(gradient_clip_val=0.5, gradient_clip_algorithm="value") is None  # replayed since 2026-11-30
