"""Your own trainer (docs/own_trainer.md): examples/plain_loop.py — a hand-written torch DDP loop over gloo, padded data
read in epochs that end in a partial accumulation window and a smaller micro-batch, gradient accumulation — and
examples/hf_trainer.py (Trainer, recorded by ParityCallback; dynamic padding, a partial last window, a smaller last
batch at one process) recorded by parity's recorder, replayed under the harness's DDP (the local launcher: Ray adds
nothing to the arithmetic) at any worker count the rows allow, judged by the verdict. A 1-rank record of micro-batches
of one row replays at 1, 2 and 4 workers, from a relative recording folder and from a copy of it; a record past its
batch cap stops there and its steps before the cap are judged.
Seeded bugs in copies of the examples FAIL at a named step, and the dumps of a step name the first divergent module;
Trainer in bf16 PASSes the calibrated verdict and a seeded bug FAILs it; so does the plain loop under torch's AMP recipe
(fp16 autocast, GradScaler) and its clip before unscaling; Trainer's DeepSpeed path is refused in one line; Trainer at 2 ranks and at 1 rank with twice the accumulation agree; bad input is one line and exit 2.

One group of two ranks records every job one after another, one group of one rank the 1-rank runs, and one local
group per world size (2, 1, 4) replays them all, then one more replays the two dumped steps (module-scoped): the
file's time is seven group start-ups and a few dozen tiny steps."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil

import pytest
import torch

from conftest import (REPO, assert_same_tensors_at_step_0, free_port, gloo_rank, max_rel_diff, module_from,
                      multimodal_gemma3, series, tensor_norms_off, tensor_series)
from parity.errors import ConfigError

EXAMPLE = os.path.join(REPO, "examples", "plain_loop.py")
HF_EXAMPLE = os.path.join(REPO, "examples", "hf_trainer.py")
HF = "hf_trainer"  # the Trainer example, recorded by ParityCallback
NAME = "plain_loop"
CLEAN_LOSS = "loss = summed * world / global_tokens  # DDP averages over ranks: the global token mean"
MINE = "mine = order[rank::world]"
CLIP_LINE = "        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)"
EDITED, EDITED_STEP = "model.layers.1.post_attention_layernorm.weight", 3
SAMPLES = "18"  # 9 a rank: windows of 2 + 2 micro-batches of 2 rows, then 1 of 1 row — steps 2 and 5 partial
# The seeded bugs, each one line of the example changed in a copy.
COPIES = {
    "clean": [],
    # each rank's mean over its own tokens, averaged by DDP: a mean of per-rank means on padded data
    "rank_mean": [(CLEAN_LOSS, "loss = summed / local")],
    # accumulation that averages per-micro-batch means (transformers <= 4.45)
    "micro_mean": [(CLEAN_LOSS, "loss = summed / (labels[:, 1:] != -100).sum() / args.grad_accum_steps")],
    # rank r fed rank r-1's rows (rank 0 its own): two ranks train on the same samples
    "neighbour": [(MINE, "mine = order[max(rank - 1, 0)::world]")],
    # the epoch's partial last window divided by the full accumulation count, not by what it holds
    "partial_window": [(CLEAN_LOSS, "loss = summed * world / global_tokens * len(window) / args.grad_accum_steps")],
    # at one step a norm weight's gradient doubled after the recorder read the gradients, before the clip and the step
    "edited_after_read": [(CLIP_LINE, f"        if step == {EDITED_STEP}:\n"
                                      f"            model.get_parameter('{EDITED}').grad.mul_(2)\n{CLIP_LINE}")],
}
SCHEDULER = "    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))"
ONE_CYCLE = "    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)"
COPIES["one_cycle"] = [(SCHEDULER, ONE_CYCLE)]  # clean: OneCycleLR cycles AdamW's β1 (cycle_momentum=True)
# clean: clip_grad_value_ at 0.001 in place of the norm clip, the recorder told (clip_value); the seeded bug: its record
# told 0.002, replayed clamping there
COPIES["clip_value"] = [(CLIP_LINE, "        torch.nn.utils.clip_grad_value_(ddp.parameters(), 0.001)"),
                        ("max_grad_norm=args.max_grad_norm, framework=", "clip_value=0.001, framework=")]
OTHER_VALUE = "other_clip_value"
BETAS_DROPPED = "betas_dropped"  # the seeded bug: the one_cycle record without its betas, replayed at one β1
PARTIAL_STEP = 2
TRAINER_LINE = "    trainer = Trainer(model=model, args=training, train_dataset=data,"
CALLBACKS = "callbacks=[ParityCallback("
ARGS_END = "disable_tqdm=True, bf16=args.bf16, dataloader_drop_last=args.drop_last)"
DEEPSPEED = ("{'train_micro_batch_size_per_gpu': 'auto', 'gradient_accumulation_steps': 'auto', "
             "'zero_optimization': {'stage': 1}, 'gradient_clipping': 'auto'}")  # DeepSpeed's train_batch_size its own
DEEPSPEED_PURE = DEEPSPEED.replace("'stage': 1}", "'stage': 2}, 'bf16': {'enabled': 'auto', "
                                   "'bf16_master_weights_and_grads': True, 'bf16_optimizer_states': True}")
DEEPSPEED_AUTOCAST = DEEPSPEED.replace("'stage': 1}", "'stage': 2}, 'torch_autocast': {'enabled': True}")
DEEPSPEED_ZERO0 = DEEPSPEED.replace("'stage': 1}", "'stage': 0}, 'bf16': {'enabled': 'auto'}")
NUM_ITEMS_BUG = """    class Buggy(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs)

    trainer = Buggy(model=model, args=training, train_dataset=data,"""
# The seeded bugs and the DeepSpeed path in copies of examples/hf_trainer.py.
HF_COPIES = {
    # a compute_loss override that drops num_items_in_batch: each micro-batch's own token mean, not divided by the
    # accumulation (Trainer divides only where num_items_in_batch is missing from its own call)
    "hf_num_items": [(TRAINER_LINE, NUM_ITEMS_BUG)],
    # the scheduler stepped again at the end of every update: twice per update
    "hf_twice": [(CALLBACKS, "callbacks=[Twice(), ParityCallback("),
                 ("def train(args) -> None:", """from transformers import TrainerCallback


class Twice(TrainerCallback):
    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        lr_scheduler.step()


def train(args) -> None:""")],
    # Trainer's DeepSpeed path on CPU: ZeRO-1 through TrainingArguments(deepspeed=...); and with the seeded
    # compute_loss above in it
    "hf_deepspeed": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED})")],
    "hf_deepspeed_num_items": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED})"),
                               (TRAINER_LINE, NUM_ITEMS_BUG)],
    # DeepSpeed's own precision modes, read from the engine's config: bf16 master weights and Adam state (bf16_pure),
    # clean and with the compute_loss bug; torch_autocast over fp32 weights (bf16), its Linear gradients reduced in bf16
    "hf_ds_pure": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED_PURE})")],
    "hf_ds_pure_num_items": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED_PURE})"), (TRAINER_LINE, NUM_ITEMS_BUG)],
    "hf_ds_autocast": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED_AUTOCAST})")],
    # ZeRO-0: over Trainer's own AdamW in fp32 (DeepSpeed keeps no norm: the recorder's, taken where it clips); with
    # --bf16 through DeepSpeed's FP16_UnfusedOptimizer, which takes its norm inside its step (read at the step's entry)
    "hf_ds_zero0": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED_ZERO0})")],
    # the same without use_cpu=True (the reported case), in a fresh accelerate state as a user's process has it
    "hf_deepspeed_world": [(ARGS_END, ARGS_END[:-1] + f", deepspeed={DEEPSPEED})"),
                           ('use_cpu=args.device == "cpu", ', ""),
                           ("    world = int(", "    from accelerate.state import AcceleratorState\n\n"
                                              "    AcceleratorState._reset_state(reset_partial_state=True)\n"
                                              "    world = int(")],
}
STEPS = 6
INTERVAL = 2  # the recorder's states around steps 0, 2 and 4: the replay's teacher-forced check of each
BF16_STEPS = 4
HF_DUMP_STEP = 2  # the clean Trainer run dumps step 2 (a replayed step past the first), the seeded bug step 0
CAPPED = "capped"  # the clean loop recorded with a batch cap that 3 steps pass
BF16 = "bf16"  # Trainer in bf16: the clean run (hf_trainer) and the compute_loss bug (hf_bug) in one folder
HF_SHAPES = ["--rows", "10", "--dynamic_padding"]  # 5 rows a rank: every other window holds one micro-batch
HF_CLIPPED = "hf_clipped"  # Trainer at 1 rank clipping at 0.5: every step clips (norms ~1.2)
TOLD_FP32 = "told_fp32"  # the plain loop's forward under autocast(bfloat16), its recorder told "fp32"
DS_PURE, DS_AUTOCAST = "ds_pure", "ds_autocast"  # Trainer's DeepSpeed path in bf16_pure (clean, hf_bug) and autocast
AS_PARAMS = "ds_pure_as_params"  # the clean bf16_pure record replayed as bf16_params: what the recorder read before
# torch's AMP recipe (--fp16: autocast(float16), GradScaler), its scale starting at 2^22 (the first steps overflow) and
# growing after 2 good steps (into an overflow again); and the recipe's classic bug in a copy, recorded beside it
AMP = "amp"
AMP_FLAGS = ["--fp16", "--steps", "8", "--init_scale", str(2 ** 22), "--growth_interval", "2"]
CLIP_FIRST = [("        scaler.unscale_(optimizer)\n        rec.before_step()\n" + CLIP_LINE + "\n",
               CLIP_LINE + "  # the scaled gradients\n        scaler.unscale_(optimizer)\n        rec.before_step()\n")]


def _record_rank(rank: int, world: int, port: int, jobs: list, cwd: str | None = None) -> None:
    """Every job (a copy of an example, its arguments) one after another on this rank of one gloo group (the
    variables torchrun sets, for accelerate: it takes the group that is up), in `cwd` where given (relative
    output folders)."""
    if cwd:
        os.chdir(cwd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")  # else accelerate sets torch's threads to the cores ÷ the ranks: 2 at 1 rank
    with gloo_rank(rank, world, port):
        for i, (path, argv, *stderr) in enumerate(jobs):
            module = module_from(path, f"example_copy_{i}")
            if stderr and rank == 0:  # the job's lines, for a test to read
                with open(stderr[0], "w") as f, contextlib.redirect_stderr(f):
                    module.train(module.parse_args(argv))
            else:
                module.train(module.parse_args(argv))


def _copy(root, source: str, name: str, edits) -> str:
    text = open(source).read()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = root / f"{name}.py"
    path.write_text(text)
    return str(path)


def _replay(folders, root, name, record, workers, **given):
    from parity.driver.local_group import CLUSTER
    from parity.replay.replay import plan_replay

    values = {"num_workers": workers, "device": "cpu", "loss_output_dir": str(folders[name]),
              "storage_path": str(root / "checkpoints"), "experiment_name": f"replay_{name}_{workers}_{len(given)}",
              **given}
    return plan_replay(str(folders[name] / f"loss_{record}.json"), values, cluster=CLUSTER)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Recorded at 2 ranks in one gloo group (4 rows a rank in 2 micro-batches, padded), one job after another: each
    copy of the plain loop, the capped loop, the Trainer example clean (dumping step 2) and its seeded bugs (the
    compute_loss one dumping step 0), the Trainer's DeepSpeed path, and Trainer in bf16 (clean and the compute_loss
    bug, one folder); at 1 rank in another: the plain loop, and Trainer with twice the accumulation. Replayed in one
    local group per world size: at the records' layouts, and for the bf16 folder its noise references (1 and 4
    workers, and fp32 at 2); then the two dumped steps replayed by the layer check's worker. {name: its folder}."""
    from parity.driver.local_group import launch_local, start_processes
    from parity.recording.dump import dump_payload, finish_dump
    from parity.layer_check.layer_step import layer_steps_worker

    root = tmp_path_factory.mktemp("own_trainer")
    jobs, folders = [], {}
    for name, edits in COPIES.items():
        folders[name] = root / name
        jobs.append((_copy(root, EXAMPLE, name, edits), ["--output_dir", str(folders[name]), "--name", NAME,
                                                         "--steps", str(STEPS), "--samples", SAMPLES,
                                                         "--checkpoint_interval", str(INTERVAL)]))
    folders[CAPPED] = root / CAPPED
    jobs.append((EXAMPLE, ["--output_dir", str(folders[CAPPED]), "--name", NAME, "--steps", "4",
                           "--max_batch_bytes", "15000"]))  # 6144 bytes a step: steps 0 and 1 saved
    folders[AMP] = root / AMP
    jobs += [(EXAMPLE, ["--output_dir", str(folders[AMP]), *AMP_FLAGS]),
             (_copy(root, EXAMPLE, "clip_first", CLIP_FIRST), ["--output_dir", str(folders[AMP]), "--name",
                                                                "clip_first", *AMP_FLAGS])]
    for name in (BF16, HF, *HF_COPIES, "plain_1rank", "plain_copy", "hf_1rank", "hf_small", HF_CLIPPED, "internal",
                 TOLD_FP32, "hf_fp16_cpu"):
        folders[name] = root / name
    jobs.append((HF_EXAMPLE, ["--output_dir", str(folders[HF]), "--steps", str(STEPS),
                              "--dump_step", str(HF_DUMP_STEP), "--checkpoint_interval", str(INTERVAL)]))
    hf_copies = {name: _copy(root, HF_EXAMPLE, name, edits) for name, edits in HF_COPIES.items()}
    for name in ("hf_num_items", "hf_twice"):  # 3 steps: they FAIL at step 0 and 1
        jobs.append((hf_copies[name], ["--output_dir", str(folders[name]), "--steps", "3",
                                       *(["--dump_step", "0"] if name == "hf_num_items" else [])]))
    jobs.append((HF_EXAMPLE, ["--output_dir", str(folders[BF16]), "--steps", str(BF16_STEPS), "--bf16", *HF_SHAPES]))
    jobs.append((hf_copies["hf_num_items"], ["--output_dir", str(folders[BF16]), "--steps", str(BF16_STEPS), "--bf16",
                                             *HF_SHAPES, "--name", "hf_bug"]))
    for folder, name, copy, flags, steps in ((DS_PURE, HF, "hf_ds_pure", ["--bf16"], BF16_STEPS),
                                             (DS_PURE, "hf_bug", "hf_ds_pure_num_items", ["--bf16"], BF16_STEPS),
                                             (DS_AUTOCAST, HF, "hf_ds_autocast", [], BF16_STEPS),
                                             ("hf_ds_zero0", HF, "hf_ds_zero0", [], 3),
                                             ("hf_ds_zero0_bf16", HF, "hf_ds_zero0", ["--bf16"], 2)):
        folders[folder] = root / folder
        jobs.append((hf_copies[copy], ["--output_dir", str(folders[folder]), "--name", name, "--steps", str(steps),
                                       *flags]))
    for name in ("hf_deepspeed", "hf_deepspeed_num_items", "hf_deepspeed_world"):  # last: it resets accelerate's state
        folders[name].mkdir()
        jobs.append((hf_copies[name], ["--output_dir", str(folders[name]), "--steps", "1" if "world" in name else "3"],
                     str(folders[name] / "stderr.txt")))
    start_processes(_record_rank, (2, free_port(), jobs), 2)
    one = [(EXAMPLE, ["--output_dir", "plain_1rank", "--name", NAME, "--steps", str(STEPS),  # relative to the cwd
                      "--batch_size", "4", "--grad_accum_steps", "4"]),  # 4 micro-batches of one row
           (HF_EXAMPLE, ["--output_dir", str(folders["hf_1rank"]), "--name", "hf_1rank", "--steps", str(STEPS),
                         "--grad_accum_steps", "4"]),
           (HF_EXAMPLE, ["--output_dir", str(folders["hf_small"]), "--steps", "4", "--rows", "5",
                         "--dynamic_padding"]),  # windows of 2 + 2 rows, then of 1 (drop_last off)
           (HF_EXAMPLE, ["--output_dir", str(folders[HF_CLIPPED]), "--steps", "3", "--max_grad_norm", "0.5"]),
           (HF_EXAMPLE, ["--output_dir", str(folders["hf_fp16_cpu"]), "--steps", "2", "--fp16"]),
           (_copy(root, EXAMPLE, TOLD_FP32, [('precision="bf16" if args.bf16 else "fp16_autocast" if args.fp16 else "fp32"',
                                                  'precision="fp32"')]),
            ["--output_dir", str(folders[TOLD_FP32]), "--name", NAME, "--steps", "2", "--bf16"],
            str(root / "told_fp32_stderr.txt"))]
    start_processes(_record_rank, (1, free_port(), one, str(root)), 1)
    shutil.copytree(folders["plain_1rank"], folders["plain_copy"])  # a copied record folder replays too

    folders[AS_PARAMS] = root / AS_PARAMS
    folders[AS_PARAMS].mkdir()
    shutil.copytree(folders[DS_PURE] / f"recorded_{HF}", folders[AS_PARAMS] / f"recorded_{HF}")
    shutil.copytree(folders[DS_PURE] / f"loss_{HF}.tensors", folders[AS_PARAMS] / f"loss_{HF}.tensors")
    record = json.loads((folders[DS_PURE] / f"loss_{HF}.json").read_text())
    record["config"].update(precision="bf16_params", reduce_dtype="bf16", grad_accum_dtype="bf16")
    (folders[AS_PARAMS] / f"loss_{HF}.json").write_text(json.dumps(record))
    folders[BETAS_DROPPED] = root / BETAS_DROPPED
    shutil.copytree(folders["one_cycle"], folders[BETAS_DROPPED])
    record = _record(folders[BETAS_DROPPED])
    for step in record["steps"]:
        step.pop("betas", None)
    (folders[BETAS_DROPPED] / f"loss_{NAME}.json").write_text(json.dumps(record))
    folders[OTHER_VALUE] = root / OTHER_VALUE
    shutil.copytree(folders["clip_value"], folders[OTHER_VALUE])
    record = _record(folders[OTHER_VALUE])
    record["config"]["clip_value"] = 0.002
    (folders[OTHER_VALUE] / f"loss_{NAME}.json").write_text(json.dumps(record))
    two = [_replay(folders, root, name, NAME, 2) for name in (*COPIES, BETAS_DROPPED, OTHER_VALUE)]
    calibrated = (DS_PURE, DS_AUTOCAST, AS_PARAMS)  # each replayed at 2 workers, 1 and 4, and where fp32 masters
    two += [_replay(folders, root, name, HF, 2) for name in calibrated]  # measure the noise, in fp32
    two += [_replay(folders, root, name, HF, 2, noise_reference=True, precision="fp32") for name in calibrated[1:]]
    two += [_replay(folders, root, name, HF, 2) for name in (HF, "hf_num_items", "hf_twice", BF16, "hf_deepspeed",
                                                             "hf_deepspeed_num_items", "hf_ds_zero0")]
    two += [_replay(folders, root, BF16, HF, 2, noise_reference=True, precision="fp32"),
            _replay(folders, root, "plain_1rank", NAME, 2, noise_reference=True),
            _replay(folders, root, "plain_copy", NAME, 2), _replay(folders, root, CAPPED, NAME, 2),
            _replay(folders, root, AMP, NAME, 2), _replay(folders, root, AMP, NAME, 2, noise_reference=True,
                                                          precision="fp32")]
    groups = [two, [_replay(folders, root, "plain_1rank", NAME, 1), _replay(folders, root, "hf_1rank", "hf_1rank", 1),
                    _replay(folders, root, BF16, HF, 1, noise_reference=True),
                    _replay(folders, root, "hf_small", HF, 1), _replay(folders, root, HF_CLIPPED, HF, 1),
                    _replay(folders, root, AMP, NAME, 1, noise_reference=True),
                    *(_replay(folders, root, name, HF, 1, noise_reference=True) for name in calibrated)],
              [_replay(folders, root, BF16, HF, 4, noise_reference=True),
               *(_replay(folders, root, name, HF, 4, noise_reference=True) for name in calibrated),
               _replay(folders, root, "plain_1rank", NAME, 4, noise_reference=True)]]
    for planned in groups:
        launch_local([cfg for cfg, _ in planned], [{"batches": batches} for _, batches in planned])
    dumps = [(_replay(folders, root, HF, HF, 2), HF_DUMP_STEP), (_replay(folders, root, "hf_num_items", HF, 2), 0)]
    launch_local([cfg for (cfg, _), _ in dumps], [dump_payload(cfg, batches, k) for (cfg, batches), k in dumps],
                 worker=layer_steps_worker)
    for (cfg, batches), k in dumps:
        finish_dump(cfg, batches, k)
    folders["internal"].mkdir()
    for source, name in ((folders[HF], HF), (folders["hf_1rank"], "hf_1rank")):  # Trainer at 2 ranks and at 1
        shutil.copy(source / f"loss_{name}.json", folders["internal"] / f"loss_{name}.json")
    return folders


def _record(folder, name=NAME) -> dict:
    return json.loads((folder / f"loss_{name}.json").read_text())


def _compare(folder):
    from parity.comparing.curves import compare, load_runs

    return compare(load_runs(str(folder)))


def state_checks(folder, name=NAME) -> dict:
    """The teacher-forced checks the replay took from the run's saved states, as the verdict judges them (attached to
    the loaded record: parity/comparing/recorded_checks.py)."""
    from parity.comparing import teacher_forced
    from parity.comparing.curves import load_runs

    (run,) = [r for r in load_runs(str(folder)) if r.name == name]
    return teacher_forced.summary(run.record)


def assert_checks_pass(folder, name, steps: list[int]) -> float:
    """Every state the recorder saved (around `steps`) passes its check, each tensor of AdamW's state compared from the
    second step on; returns the largest difference ÷ bound."""
    found = state_checks(folder, name)
    assert [c["step"] for c in found["checks"]] == steps and found["first_fail_step"] is None, found
    assert found["interval"] == INTERVAL and all(c["note"] is None for c in found["checks"])
    return max(c["ratio"] for c in found["checks"])


LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}  # the examples' --lora


def assert_lora_replays(folder, name, saved: tuple = ()) -> dict:
    """A LoRA run's record (an example's --lora: peft's adapters on q_proj and v_proj, r 8, on the frozen qwen2-tiny;
    with --lora_save the `saved` modules trained whole beside them) and its DDP replay: the record's adapters settings
    are the harness's and its replay's; its initial weights are a stock model's under their own names (peft's
    base_layer and original_module folded back) with the 8 adapters and each saved module's trained copy (a tied
    embedding's once) in their file beside them, as a harness LoRA run keeps them; its optimizer's groups and tensor
    series name what trains alone; the replay
    equals it within 1e-5 relative (loss, grad norm, parameter norm over the adapters) at every step on the same
    batches and lr; no replica parted and no frozen tensor moved in either; PASS. Returns the largest differences."""
    from safetensors.torch import load_file

    from parity.models.adapters import adapters_path
    from parity.models.model import check_init_weights, resolve_model_config

    recorded, replay = _record(folder, name), _record(folder, "ddp")
    config = recorded["config"]
    assert config["lora"] == replay["config"]["lora"] == ({**LORA, "modules_to_save": list(saved)} if saved else LORA)
    weights = str(folder / config["init_weights_path"])
    check_init_weights(weights, resolve_model_config(str(folder / config["model_name"])))  # a stock model's file
    adapters = sorted(load_file(adapters_path(weights)))
    copies = [n.split(".modules_to_save.")[0].rsplit(".", 1)[-1] for n in adapters if ".modules_to_save." in n]
    assert copies == list(saved), adapters
    assert len(adapters) == 8 + len(copies) and all(n.split(".")[-3] in ("lora_A", "lora_B") for n in adapters
                                                    if ".modules_to_save." not in n), adapters
    assert sorted(p for g in config["optimizer"]["groups"] for p in g["params"]) == adapters
    assert sorted(tensor_series(recorded, folder).names) == adapters
    assert config["init_weights_sha256"] == replay["config"]["init_weights_sha256"]  # the base's + the adapters'
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    off = {key: max_rel_diff(series(replay, key), series(recorded, key)) for key in ("loss", "grad_norm", "param_norm")}
    assert max(off.values()) < 1e-5, off
    for record in (recorded, replay):
        assert [s["replicas"]["parted"] for s in record["steps"] if "replicas" in s] in ([0] * len(record["steps"]), [])
    assert _compare(folder).word == "PASS"
    return off


def test_clean_loop_replays_to_the_record_and_passes(runs, tmp_path):
    """The clean loop's record and its DDP replay: the same batches, tokens and lr at every step, loss, pre-clip grad
    norm and parameter norm within 1e-5 relative at every step (measured ~1e-8), replicas bit-identical in both, and
    plot_loss_curves.py's verdict PASS (exit 0)."""
    from parity.commands.compare_curves import compare_and_report

    recorded, replay = _record(runs["clean"]), _record(runs["clean"], "ddp")
    assert recorded["config"]["source"] == "recorder" and recorded["complete"]
    assert recorded["config"]["grad_accum_steps"] == 2 and recorded["config"]["dp_size"] == 2
    assert [s["micro_batches"] for s in recorded["steps"]] == [[[2, 2], [2, 2]]] * 2 + [[[1], [1]]] + \
        [[[2, 2], [2, 2]]] * 2 + [[[1], [1]]]  # the epoch's partial window: one micro-batch of one row a rank
    assert series(recorded, "rows") == [8, 8, 2, 8, 8, 2] and recorded["config"]["stopped"] is None
    assert recorded["config"]["grad_norm_source"] == "recorder"
    groups = recorded["config"]["optimizer"]["groups"]
    assert recorded["config"]["optimizer"]["type"] == "AdamW" and [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert replay["config"]["optimizer"] == recorded["config"]["optimizer"]
    assert len(replay["steps"]) == len(recorded["steps"]) == STEPS
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    assert len(set(series(recorded, "tokens"))) > 1  # padded: the steps hold different numbers of loss tokens
    assert series(recorded, "lr")[0] < series(recorded, "lr")[-1]  # the warm-up, replayed as recorded
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    assert max(abs(s["logged_loss"] - s["loss"]) / s["loss"] for s in recorded["steps"]) < 1e-5
    for record in (recorded, replay):
        assert record["replicas"]["groups"] == 78
        assert [s["replicas"]["parted"] for s in record["steps"]] == [0] * STEPS
        # every tensor, before the loop's clipping (before_step): the squares add up to the step's norms
        assert tensor_series(record, runs["clean"]).grad == "pre_clip"
        assert max(tensor_norms_off(record, runs["clean"])) < 1e-12
    assert_same_tensors_at_step_0(replay, recorded, runs["clean"], runs["clean"])
    assert all(s["rows_check"]["duplicates"] == 0 for s in recorded["steps"])
    assert compare_and_report(str(runs["clean"]), str(tmp_path / "curves.png")) == 0
    print(f"clean fp32 loop: its saved states' checks, largest {assert_checks_pass(runs['clean'], NAME, [0, 2, 4]):.3f} "
          f"of the bound")


def test_a_one_cycle_loop_replays_its_cycled_betas_and_passes_and_at_one_beta1_fails(runs):
    """OneCycleLR as torch's docs write it (cycle_momentum: AdamW's β1 from 0.95 down and back): every step after the
    first keeps the betas it applied, the replay applies them (RunConfig.betas_schedule), its reference steps too — loss,
    grad norm and parameter norm within 1e-5 at every step, each saved state's check PASSes, PASS. The seeded bug: the
    same record without its betas, replayed at the first step's β1 throughout (what the replay did before 2026-11-30,
    when this loop was called FAIL), FAILs; its first outside is step 1's parameter norm (Adam's first update does not
    depend on β1, its second does)."""
    folder = runs["one_cycle"]
    recorded, replay = _record(folder), _record(folder, "ddp")
    assert recorded["config"]["optimizer"]["groups"][0]["betas"] == [0.95, 0.999] and recorded["config"]["stopped"] is None
    beta1s = [s["betas"][0][0] if "betas" in s else None for s in recorded["steps"]]  # the first and last: 0.95
    assert beta1s[0] is beta1s[-1] is None and all(0.85 <= b < 0.95 for b in beta1s[1:-1]), beta1s
    assert len(set(beta1s[1:-1])) == STEPS - 2 and all(s["betas"][0] == s["betas"][1] for s in recorded["steps"][1:-1])
    assert replay["config"]["betas_schedule"] == [s.get("betas", [[0.95, 0.999]] * 2) for s in recorded["steps"]]
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    off = {key: max_rel_diff(series(replay, key), series(recorded, key)) for key in ("loss", "grad_norm", "param_norm")}
    assert max(off.values()) < 1e-5, off
    assert _compare(folder).word == "PASS"
    ratio = assert_checks_pass(folder, NAME, [0, 2, 4])
    dropped = _record(runs[BETAS_DROPPED], "ddp")
    assert "betas_schedule" not in dropped["config"]
    outside = first_fail(runs[BETAS_DROPPED], 1, "param_norm")
    print(f"one_cycle: replay within {off}, states' checks {ratio:.3f} of the bound; at one β1 step 1's parameter "
          f"norm {outside.rel_diff:.2e} off")


def test_a_loop_clipping_by_value_replays_clamped_and_passes_and_at_another_value_fails(runs, tmp_path):
    """clip_grad_value_ at 0.001 in place of the norm clip, the recorder told (ParityRecorder(clip_value=0.001)): the
    record's clip_value, the replay clamping each gradient element as torch's does — loss, grad norm and parameter norm
    within 1e-5 at every step, each saved state's check PASSes (its reference steps clamp too), PASS. The seeded bug:
    the same record told 0.002, replayed clamping there, FAILs at step 0: the run's state after it is not its
    reference step's (its moments), and the parameter norm parts from step 1. Untold, such a loop FAILs step 0 ahead of any tolerance (the applied gradients are not the
    ones read: docs/own_trainer/plain_loop.md)."""
    folder = runs["clip_value"]
    recorded, replay = _record(folder), _record(folder, "ddp")
    assert (recorded["config"]["clip_value"], recorded["config"]["max_grad_norm"]) == (0.001, 0.0)
    assert replay["config"]["clip_value"] == 0.001 and recorded["config"]["stopped"] is None
    off = {key: max_rel_diff(series(replay, key), series(recorded, key)) for key in ("loss", "grad_norm", "param_norm")}
    assert max(off.values()) < 1e-5, off
    assert _compare(folder).word == "PASS"
    ratio = assert_checks_pass(folder, NAME, [0, 2, 4])
    outside = first_fail(runs[OTHER_VALUE], 0, "teacher_forced")  # the state after step 0 is not its reference's
    moved = max_rel_diff(series(_record(runs[OTHER_VALUE], "ddp"), "param_norm"), series(recorded, "param_norm"))
    assert moved > 1e-5, moved  # the curves part too, from step 1 (Adam's first update is the gradient's sign)
    from parity.driver.local_group import CLUSTER
    from parity.replay.replay import plan_replay
    from parity.replay.replay_choice import REPLAYS

    with pytest.raises(ConfigError) as refused:  # DeepSpeed's engine clips by norm in its step: one line, on the driver
        plan_replay(str(folder / f"loss_{NAME}.json"), {"num_workers": 2, "device": "cpu", "loss_output_dir":
                    str(tmp_path), "storage_path": str(tmp_path / "ck")}, cluster=CLUSTER, strategy="deepspeed",
                    flags=REPLAYS["zero3"][1])
    assert str(refused.value) == (
        f"--replay_record loss_{NAME}.json: the run clips by value (clip_value 0.001), which the deepspeed replay's step "
        f"does not (it clips by norm in a step of its own): replay it under DDP or FSDP2 (--replay_strategy ddp or fsdp)")
    print(f"clip_value: replay within {off}, states' checks {ratio:.3f} of the bound; clamped at 0.002: step 0's "
          f"{outside.module} {outside.rel_diff:.2e} off, the parameter norm up to {moved:.2e}")


@pytest.mark.parametrize("bug", ["rank_mean", "micro_mean"])
def test_seeded_loss_bug_fails_at_its_first_step(runs, bug):
    """A per-rank mean loss under DDP, and accumulation averaging micro-batch means: the same data and weights at step
    0, so the same loss, but another gradient — FAIL at step 0 on the pre-clip grad norm."""
    recorded, replay = _record(runs[bug]), _record(runs[bug], "ddp")
    assert abs(recorded["steps"][0]["loss"] - replay["steps"][0]["loss"]) <= 1e-6 * replay["steps"][0]["loss"]
    outside = first_fail(runs[bug], 0, "grad_norm")
    assert outside.rel_diff > 1e-3


def test_a_partial_window_divided_by_the_full_accumulation_fails_at_that_step(runs):
    """The epoch's last window holds one micro-batch, the copy divides it by the full accumulation count (2): its
    gradient is halved there and only there — every full window PASSes, step 2 FAILs on the grad norm at half the
    replay's."""
    outside = first_fail(runs["partial_window"], PARTIAL_STEP, "grad_norm")
    assert abs(outside.value / outside.reference - 0.5) < 1e-3
    found = state_checks(runs["partial_window"])  # the check from the run's own state sees it there too, and only there
    assert [c["ok"] for c in found["checks"]] == [True, False, True] and found["first_fail_step"] == PARTIAL_STEP


def first_fail(folder, step: int, quantity: str):
    """The folder's one run against its replay FAILs, first at `step` on `quantity`: the verdict's Outside."""
    comparison = _compare(folder)
    (result,) = comparison.results
    assert comparison.word == "FAIL"
    outside = result.verdict.first_outside
    assert (outside.step, outside.quantity) == (step, quantity), outside
    return outside


def test_gradients_edited_between_the_recorders_read_and_the_step_fail_at_that_step(runs):
    """A loop that doubles a norm weight's gradient after before_step() read the gradients and before it clips and
    steps (issue 58): at the optimizer's step the recorder finds that tensor applied at 2 × the clip coefficient × what
    it read, which FAILs the run at that step ahead of any tolerance, naming the tensor."""
    from parity.comparing.curve_report import verdict_details

    record = _record(runs["edited_after_read"])
    entry = record["steps"][EDITED_STEP]["clip_read"]
    assert entry["tensor"] == EDITED and entry["applied"] == pytest.approx(2 * entry["coef"] * entry["read"], rel=1e-6)
    assert not any("clip_read" in s for k, s in enumerate(record["steps"]) if k != EDITED_STEP)
    outside = first_fail(runs["edited_after_read"], EDITED_STEP, "grad_norm")
    assert (outside.test, outside.module) == ("clip_read", EDITED)
    comparison = _compare(runs["edited_after_read"])
    assert any(f"step {EDITED_STEP}: the gradients the optimizer applied are not the gradients the tensor record read "
               f"({EDITED}: " in line and "something changed it after before_step() read it — a clip by value the "
                                           "recorder was not told of (ParityRecorder(clip_value=...)), or a bug" in line
               for line in verdict_details(comparison, comparison.results[0]))


def test_neighbour_rows_fail_the_duplicate_rows_check(runs):
    """Rank 1 fed rank 0's rows: the replay trains on what was fed, so the curves agree — the rows check FAILs the run
    at step 0, ahead of any tolerance."""
    from parity.comparing.curve_report import verdict_details

    recorded = _record(runs["neighbour"])
    assert recorded["steps"][0]["rows_check"] == {"duplicates": 4, "pairs": [[0, 1, 4]]}
    comparison = _compare(runs["neighbour"])
    (result,) = comparison.results
    assert comparison.word == "FAIL"
    assert all(x < 1e-5 for x in result.verdict.max_rel_diff.values())
    outside = result.verdict.first_outside
    assert (outside.step, outside.quantity) == (0, "duplicate_rows")
    assert any("ranks 0 and 1 fed the same rows (4 duplicated)" in line for line in verdict_details(comparison, result))


def _train_ddp(argv, capsys) -> tuple[int, list[str]]:
    from parity.commands.train import main

    code = main("ddp", argv=argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _edited_record(runs, tmp_path, edit) -> str:
    """A copy of the clean record elsewhere, naming the clean record's files where they are, edited."""
    data = _record(runs["clean"])
    config = data["config"]
    config["model_name"], config["init_weights_path"], config["batches"]["folder"] = (
        str(runs["clean"] / named) for named in (config["model_name"], config["init_weights_path"],
                                                  config["batches"]["folder"]))
    edit(data)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"loss_{NAME}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    """Each refused before any worker starts (nothing written under --loss_output_dir): a record without its batches,
    one whose batches passed the cap, initial weights of another model, flags the record supplies, an optimizer the
    replay cannot build or a flag of one it builds (amsgrad), an fp16 run whose loss scaler was not recorded, a model
    transformers has no causal LM of, workers
    that do not divide the rows, a harness run's record, a step to dump that the record
    lacks, --dump_step without a record."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    record = str(runs["clean"] / f"loss_{NAME}.json")
    out = ["--loss_output_dir", str(tmp_path / "out"), "--storage_path", str(tmp_path / "ck")]
    empty = tmp_path / "no_batches"
    empty.mkdir()

    def without_batches(data):
        data["config"]["batches"]["folder"] = str(empty)  # an absolute folder: named as it is

    def sgd(data):
        data["config"]["optimizer"]["type"] = "SGD"

    def amsgrad(data):  # what the recorder writes of a torch AdamW(amsgrad=True)
        data["config"]["optimizer"]["groups"][1]["flags"] = {"amsgrad": True}

    def fp16(data):  # an fp16 run whose recorder kept no loss scale (a loop's own GradScaler, Lightning's 16-mixed)
        data["config"]["precision"] = "fp16"

    encoder_decoder = tmp_path / "t5_model"  # a recorded model folder whose config no causal LM of transformers takes
    encoder_decoder.mkdir()
    (encoder_decoder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 2,
                                                             "num_heads": 4, "vocab_size": 2048}))

    def t5(data):
        data["config"]["model_name"] = str(encoder_decoder)

    other = str(tmp_path / "other_model.safetensors")  # the same preset with one decoder layer
    save_init_weights(build_model(resolve_model_config("qwen2-tiny", num_layers=1), 0), other)

    def other_weights(data):
        data["config"]["init_weights_path"] = other

    cases = [
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "c", other_weights)],
         f"error: --replay_record loss_{NAME}.json: its initial weights {other} are not the recorded model's (has 1 "
         f"layers, run asks for 2): record the run again"),
        ([*out, "--replay_record", record, "--dump_step", str(STEPS)],
         f"error: --dump_step {STEPS} is not a step of loss_{NAME}.json (0 to {STEPS - 1})"),
        ([*out, "--dump_step", "0"], "error: --dump_step needs --replay_record"),
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "a", without_batches)],
         f"error: --replay_record loss_{NAME}.json: step 0's batch {empty}/step_000000.safetensors is missing: "
         f"copy the record's whole folder (recorded_*/ beside it) or record again"),
        ([*out, "--replay_record", record, "--learning_rate", "1e-4"],
         "error: --learning_rate contradicts --replay_record: the record supplies the model, weights, data, "
         "optimizer, lr, micro-batches, precision and steps; beside it give only --num_workers, --device, the output "
         "and checkpoint flags and --noise_reference"),
        ([*out, "--replay_record", record, "--grad_accum_steps", "1"], "error: --grad_accum_steps contradicts"),
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "b", sgd)],
         f"error: --replay_record loss_{NAME}.json: the recorded optimizer is SGD: the replay builds AdamW and Adam "
         f"only"),
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "d", amsgrad)],
         f"error: --replay_record loss_{NAME}.json: the recorded AdamW's group 1 sets amsgrad: the replay builds AdamW "
         f"without it"),
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "e", fp16)],
         f"error: --replay_record loss_{NAME}.json: an fp16 run is replayed where its recorder records its loss scaler "
         f"(each step's scale and whether it was skipped: megatron-core's, GradScaler's), and this one's does not: "
         f"record it again with this release's recorder, or in bf16 or fp32"),
        ([*out, "--replay_record", _edited_record(runs, tmp_path / "f", t5)],
         f"error: --replay_record loss_{NAME}.json: the recorded model cannot be built by the harness: a 't5' model is "
         f"an encoder-decoder: the harness trains decoder-only causal language models"),
        ([*out, "--replay_record", record, "--num_workers", "3"],
         f"error: --num_workers 3: step {PARTIAL_STEP} of loss_{NAME}.json holds 2 rows, fewer than 3 workers: use at "
         f"most 2 workers"),
        ([*out, "--replay_record", str(runs["clean"] / "loss_ddp.json")],
         "error: --replay_record loss_ddp.json: not a record of parity's recorder (a harness run's record is compared "
         "with plot_loss_curves.py, not replayed)"),
    ]
    for argv, expected in cases:
        code, lines = _train_ddp(argv, capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), (argv, lines)
    assert not (tmp_path / "out").exists()


def test_a_mask_with_holes_is_refused(runs, tmp_path, capsys):
    """A row masked in two runs of ones (packed documents masked apart): the replay feeds right or left padding only,
    so a replay of it would train another function: refused in one line, before any worker."""
    from safetensors.torch import load, save

    batches = tmp_path / "batches"
    shutil.copytree(runs["clean"] / _record(runs["clean"])["config"]["batches"]["folder"], batches)
    step0 = batches / "step_000000.safetensors"
    tensors = load(step0.read_bytes())
    tensors["attention_mask"][0, 1] = 0
    tensors["labels"][0, 1] = -100
    step0.write_bytes(save(tensors))

    def moved(data):
        data["config"]["batches"]["folder"] = str(batches)

    argv = ["--replay_record", _edited_record(runs, tmp_path, moved), "--loss_output_dir", str(tmp_path / "out"),
            "--storage_path", str(tmp_path / "ck")]
    code, lines = _train_ddp(argv, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: --replay_record loss_{NAME}.json: step 0, row 0: the attention mask has holes (more "
                        f"than one run of ones): the replay feeds right or left padding only"), lines


def test_a_strategy_name_is_refused_in_one_line(tmp_path):
    """loss_ddp.json is the harness's own run: a recorder named so records nothing, says so once, and the user's
    training goes on."""
    from parity.recording.recorder import ParityRecorder

    lines = []
    rec = ParityRecorder(str(tmp_path), name="ddp", model=torch.nn.Linear(2, 2), optimizer=None, log=lines.append)
    assert not rec.enabled and lines == [
        "parity recorder [ddp]: name 'ddp' is a strategy of the harness (ddp, deepspeed, fsdp, pipeline, transformers): its "
        "record would be taken for the harness's own run; choose another: recording nothing"]
    rec.micro_batch(None, None, None)
    rec.before_step()
    rec.after_step()
    assert rec.close() is None and not list(tmp_path.iterdir())


def test_hf_trainer_replays_to_the_record_and_passes(runs):
    """Trainer (transformers 5.23) at 2 ranks, accumulation on padded data, recorded by ParityCallback: Trainer did
    not clip (norms ~1.2, max_grad_norm 10), so the pre-clip norm is the recorder's own float64 one at the optimizer
    step (the record says so); the replay equals the record's loss, grad norm and parameter norm within 1e-5 (measured
    ~1e-8); replicas held; PASS. Trainer's own logged loss is the global token mean too (average_tokens_across_devices),
    and its fp32 grad norm within 3e-5 of the float64 one. Every tensor's series holds the gradients its optimizer step
    applies, after its clipping (coefficient 1 here), and the replay's the same kind."""
    recorded, replay = _record(runs[HF], HF), _record(runs[HF], "ddp")
    assert recorded["config"]["framework"] == "transformers.Trainer"
    assert recorded["config"]["grad_norm_source"] == "recorder"
    assert {s["grad_norm_source"] for s in recorded["steps"]} == {"recorder"}
    assert [s["micro_batches"] for s in recorded["steps"]] == [[[2, 2], [2, 2]]] * STEPS
    assert [g["weight_decay"] for g in recorded["config"]["optimizer"]["groups"]] == [0.01, 0.0]
    assert series(recorded, "lr")[0] == 0.0 and len(set(series(recorded, "lr"))) > 2  # Trainer's warm-up and decay
    assert series(recorded, "declared_lr") == series(recorded, "lr")  # the schedule Trainer's settings declare
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key
    assert max_rel_diff(series(recorded, "logged_loss"), series(recorded, "loss")) < 1e-6
    assert max_rel_diff(series(recorded, "logged_grad_norm"), series(recorded, "grad_norm")) < 3e-5
    for record in (recorded, replay):
        assert [s["replicas"]["parted"] for s in record["steps"]] == [0] * STEPS
        # every tensor's gradient as Trainer's optimizer step sees it, after its clipping — which did not clip
        found = tensor_series(record, runs[HF])
        assert (found.grad, found.clip_coef) == ("clipped", [1.0] * STEPS)
        assert max(tensor_norms_off(record, runs[HF])) < 1e-12
    assert replay["config"]["tensor_grad"] == "clipped"
    assert_same_tensors_at_step_0(replay, recorded, runs[HF], runs[HF])
    assert _compare(runs[HF]).word == "PASS"
    print(f"Trainer fp32: its saved states' checks, largest {assert_checks_pass(runs[HF], HF, [0, 2, 4]):.3f} of the "
          f"bound")


def test_a_clipping_trainers_series_holds_the_clipped_gradients_as_its_replays_does(runs):
    """Trainer at 1 rank clipping at 0.5 (every step: norms ~1.2): its callbacks see the gradients only after its
    clipping, so every tensor's series holds the clipped gradients with each step's coefficient — torch's formula on
    the step's recorded pre-clip norm, Trainer's own fp32 one where it clipped; the replay records the same kind
    (RunConfig.tensor_grad: its pre-clip norms × its coefficient). The coefficients and each tensor's clipped norm at
    step 0 agree within that fp32 norm's rounding (3e-5, as Trainer's logged norm does); the squares ÷ the coefficient
    add up to the recorded grad norm within it too, and to the replay's own exactly."""
    folder = runs[HF_CLIPPED]
    recorded, replay = _record(folder, HF), _record(folder, "ddp")
    ours, theirs = tensor_series(recorded, folder), tensor_series(replay, folder)
    assert ours.grad == theirs.grad == replay["config"]["tensor_grad"] == "clipped"
    assert series(recorded, "grad_norm_source") == ["framework"] * 3 and max(ours.clip_coef) < 0.6
    assert max_rel_diff(theirs.clip_coef, ours.clip_coef) < 3e-5
    assert max_rel_diff(theirs.grad_norm[0], ours.grad_norm[0]) < 3e-5
    grad, param = tensor_norms_off(recorded, folder)
    assert grad < 3e-5 and param < 1e-12
    assert max(tensor_norms_off(replay, folder)) < 1e-12


def test_a_single_process_loop_without_a_group_is_recorded_in_a_group_of_its_own(tmp_path, monkeypatch):
    """A single-device script that never calls init_process_group (the common one-GPU loop): the recorder starts a
    gloo group of one for its collectives and ends it at close(), so the script's process is as it was after; its record
    holds every step. A recorder that records nothing (a name it refuses) ends the group at once. Under a launcher that
    started several processes (WORLD_SIZE 2) a process without a group is told to call init_process_group."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from parity.models.model import build_model, resolve_model_config
    from parity.recording.recorder import ParityRecorder
    from parity.training.record import load_record

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    model = build_model(resolve_model_config("qwen2-tiny"), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines = []
    rec = ParityRecorder(str(tmp_path / "out"), name="single", model=model, optimizer=optimizer, max_grad_norm=1.0,
                         log=lines.append)
    assert rec.enabled and dist.is_initialized() and dist.get_world_size() == 1
    for step in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        rec.micro_batch(ids, ids, logits)
        rec.before_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        rec.after_step()
    path = rec.close()
    assert not dist.is_initialized() and len(load_record(path)["steps"]) == 3, lines
    refused_lines = []
    refused = ParityRecorder(str(tmp_path / "refused"), name="ddp", model=model, optimizer=optimizer,
                             log=refused_lines.append)
    assert not refused.enabled and not dist.is_initialized() and refused_lines[0].startswith(
        "parity recorder [ddp]: name 'ddp' is a strategy of the harness")
    monkeypatch.setenv("WORLD_SIZE", "2")
    told = []
    assert not ParityRecorder(str(tmp_path / "told"), name="two", model=model, optimizer=optimizer,
                              log=told.append).enabled and not dist.is_initialized()
    assert told == ["parity recorder [two]: the launcher started 2 processes (WORLD_SIZE=2) but this one trains alone "
                    "(torch.distributed is not initialised in it): call init_process_group(backend) in every process, "
                    "without rank and world_size: it takes the launcher's variables: recording nothing"]


@pytest.mark.parametrize("failure, why", [
    ("no micro-batch", "rank 0: no micro-batch: call micro_batch() for each one the step fed"),
    ("no token", "the step's global batch has no token in its loss (every label is -100 on every rank): look at the "
                 "data's labels — a prompt as long as max_length leaves none")])
def test_a_recorder_failure_never_stops_the_training(tmp_path, failure, why):
    """A step fed without its micro-batches, or whose every label is masked (a degenerate tokenizer's data, measured on
    TRL's sft.py: it trained on loss 0; the recorder's token mean divided by zero): the recorder says so in one line, its
    record stops there (holding the steps before it, complete), and the user's loop goes on (one rank, a group of one in
    this process)."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lines = []
        rec = ParityRecorder(str(tmp_path / "out"), name="mine", model=model, optimizer=optimizer, log=lines.append)
        assert rec.enabled
        ids = torch.randint(0, 4, (2, 8))
        for step in range(3):
            logits = model(torch.nn.functional.one_hot(ids, 4).float())
            logits.sum().backward()
            if step != 1:
                rec.micro_batch(ids, ids, logits)
            elif failure == "no token":
                rec.micro_batch(ids, torch.full_like(ids, -100), logits)
            rec.before_step()
            optimizer.step()
            optimizer.zero_grad()
            rec.after_step()
        assert not rec.enabled and rec.step == 1 and optimizer.state[model.weight]["step"] == 3
        assert lines[-1] == (f"parity recorder [mine]: step 1 could not be recorded ({why}): the record stops at step 1; "
                             f"step 0 is replayed and judged; the training goes on"), lines
        path = rec.close()
        record = json.loads(open(path).read())
        assert record["complete"] and len(record["steps"]) == 1 and record["config"]["stopped"]["step"] == 1
    finally:
        dist.destroy_process_group()


MOVED_DECAY = ("at step 1 the optimizer's group 0 applies weight_decay 0.05, not 0.01 as at step 0: the replay applies "
               "one value at every step")
RATIOS = ("at step 1 the groups' lrs are not in their recorded ratios (the replay applies each group its recorded scale "
          "of the first's)")


@pytest.mark.parametrize("schedule", ["one_cycle", "one_cycle_fixed_momentum", "lambdas_apart", "decay_moved"])
def test_a_schedule_that_moves_betas_is_recorded_and_one_that_moves_what_the_replay_keeps_stops_it(tmp_path, schedule):
    """torch's OneCycleLR cycles AdamW's β1 by default (cycle_momentum): each step whose betas are not the described
    ones keeps them in its record entry (the replay follows them: test_a_one_cycle_loop_...), every step recorded;
    with cycle_momentum=False no step keeps any. Per-group lambdas that part the groups' lrs, or a loop that sets
    another weight decay, stop the record where they move, in one line. One rank, a group of one in this process."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
                                      lr=1e-3, betas=(0.9, 0.999))
        scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda k: 1 / (k + 1), lambda k: 1.0])
                     if schedule == "lambdas_apart" else
                     torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=10,
                                                         cycle_momentum=schedule == "one_cycle"))
        lines = []
        rec = ParityRecorder(str(tmp_path / "out"), name="mine", model=model, optimizer=optimizer, log=lines.append)
        ids, beta1s = torch.randint(0, 4, (2, 8)), []
        for step in range(3):
            logits = model(torch.nn.functional.one_hot(ids, 4).float())
            logits.sum().backward()
            rec.micro_batch(ids, ids, logits)
            rec.before_step()
            beta1s.append(optimizer.param_groups[0]["betas"][0])
            optimizer.step()
            scheduler.step()
            if schedule == "decay_moved":
                optimizer.param_groups[0]["weight_decay"] = 0.05
            optimizer.zero_grad()
            rec.after_step()
        stops = {"lambdas_apart": RATIOS, "decay_moved": MOVED_DECAY}.get(schedule)
        assert (beta1s[0], beta1s[2] < beta1s[1] < beta1s[0]) == ((0.95, True) if schedule == "one_cycle" else
                                                                  (0.9, False)), beta1s
        record = json.loads(open(rec.close()).read())
        assert optimizer.state[model.weight]["step"] == 3 and record["complete"]
        if stops is None:
            assert len(record["steps"]) == 3 and record["config"]["stopped"] is None, lines
            assert not [line for line in lines if "the record stops" in line], lines
            kept = [s.get("betas") for s in record["steps"]]
            assert kept == ([None] + [[[b, 0.999]] * 2 for b in beta1s[1:]] if schedule == "one_cycle" else
                            [None] * 3), kept
            return
        assert lines[-1] == (f"parity recorder [mine]: {stops}: the record stops at step 1; step 0 is replayed and "
                             f"judged; the training goes on"), lines
        assert len(record["steps"]) == 1 and record["config"]["stopped"] == {"step": 1, "why": stops}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["both_ways", "value_moved"])
def test_a_loop_that_clips_both_ways_or_at_another_value_stops_the_record_in_one_line(tmp_path, case):
    """The replay clips every step one way at one value: a recorder told to clip by norm and by value stops the record
    at step 0, one whose clip value changes at step 1 (clips_by_value, as Lightning's manual clip_gradients declares
    it) stops it there. One rank, a group of one in this process."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lines = []
        rec = ParityRecorder(str(tmp_path / "out"), name="mine", model=model, optimizer=optimizer, log=lines.append,
                             max_grad_norm=1.0 if case == "both_ways" else 0.0, clip_value=0.5)
        ids = torch.randint(0, 4, (2, 8))
        for step in range(2):
            logits = model(torch.nn.functional.one_hot(ids, 4).float())
            logits.sum().backward()
            rec.micro_batch(ids, ids, logits)
            rec.clips_by_value(0.5 if step == 0 else 0.25)
            rec.before_step()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5 if step == 0 else 0.25)
            optimizer.step()
            optimizer.zero_grad()
            rec.after_step()
        record = json.loads(open(rec.close()).read())
        stop = 0 if case == "both_ways" else 1
        why = ("the loop clips by norm and by value (max_grad_norm 1, clip_value 0.5): the replay clips one way"
               if case == "both_ways" else "the loop clips by value at 0.25 at step 1, at 0.5 before (0: no clip): the "
                                           "replay clips every step at one clip_value")
        assert record["config"]["stopped"] == {"step": stop, "why": f"step {stop} could not be recorded (rank 0: {why})"}
        assert len(record["steps"]) == stop, lines
        assert record["config"].get("clip_value") == (None if case == "both_ways" else 0.5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hook, precision, line", [
    ("allreduce_hook", None, None),  # DDP's own reduction, as a hook: recorded, reduced in fp32
    ("fp16_compress_hook", None, "DDP's fp16_compress_hook reduces the gradients in fp16, which the fp32 policy (fp32 "
                                 "everything) does not: the replay reduces it in fp32; record the run without it"),
    ("fp16_compress_hook", "bf16", "DDP's fp16_compress_hook reduces the gradients in fp16, which the bf16 policy "
                                   "(torch.autocast(bfloat16) over fp32 parameters, gradients, master weights and Adam "
                                   "state) does not: the replay reduces it in fp32 or bf16; record the run without it"),
    ("noop", None, "DDP's communication hook 'noop' reduces the gradients in a way the replay cannot (it reduces as "
                   "DDP does, or in fp16 or bf16 as torch's fp16_compress_hook and bf16_compress_hook do): record the "
                   "run without it")])
def test_a_ddp_communication_hook_is_its_reduce_dtype_or_one_line(tmp_path, hook, precision, line):
    """DDP's communication hook averages the gradients as the run's policy reduces them: torch's allreduce_hook is
    DDP's own reduction (recorded, reduce_dtype fp32); fp16_compress_hook reduces in fp16, which neither the fp32 nor
    the bf16 policy does — an fp32 DDP loop with it, recorded, was called FAIL at step 0 (the teacher-forced check,
    9.5 × its bound: `parity verify -- torchrun …`, 2026-12-01) — so the recorder refuses it in one line, as it does a
    hook of the loop's own; bf16_compress_hook (NCCL only) is the bf16 policy's bf16 reduction, replayed so.
    One rank, a group of one in this process."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from parity.models.model import build_model, resolve_model_config
    from parity.recording.recorder import ParityRecorder

    def noop(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(build_model(resolve_model_config("qwen2-tiny", 1), 0))
        model.register_comm_hook(None, noop if hook == "noop" else getattr(default_hooks, hook))
        lines = []
        rec = ParityRecorder(str(tmp_path / "out"), name="mine", model=model, precision=precision,
                             optimizer=torch.optim.AdamW(model.parameters()), log=lines.append)
        if line is None:
            assert rec.enabled and rec.record.data["config"]["reduce_dtype"] == "fp32", lines
        else:
            assert not rec.enabled and lines == [f"parity recorder [mine]: {line}: recording nothing"], lines
        rec.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["norm_untold", "norm_other", "norm_later", "loss_scale", "one_tensor_halved",
                                  "all_halved", "bf16_clipped", "bf16_norm_other", "value_untold", "bf16_value_untold"])
def test_a_clip_or_a_loss_scale_it_was_not_told_of_stops_the_record_at_its_step(tmp_path, case):
    """The optimizer applied every gradient × one coefficient other than the declared clip's: a clip by norm the recorder
    was not told of (or told another max_grad_norm) stops the record at the first step it clips, naming the value to
    pass; a GradScaler's scale still in the gradients before_step() read (called before unscale_) names the scale. A
    single tensor changed is no such coefficient, nor every gradient halved (0.5 × the norm is no max_grad_norm a loop
    sets): their step's clip_read entry FAILs the verdict, as before. With bf16
    weights (bf16_pure), torch's clip takes its coefficient in bf16 (1.6e-3 off the formula at step 0 here, which the
    fp32 bound of 1e-4 FAILed): told its max_grad_norm, every step holds (CLIP_COEFFICIENT's bf16 bound); told 0.5, the
    record stops. Told no clip, a clip by value (clip_grad_value_ at 0.01: every element in [-0.01, 0.01]) stops it
    too, naming clip_value — in bf16 too, where 0.01 is 0.0100098 (it was called FAIL: "a clip by value the recorder
    was not told of, or a bug"). One rank, a group of one in this process."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        bf16 = case.startswith("bf16")
        dtype = torch.bfloat16 if bf16 else torch.float32
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 4)).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        lines = []
        told = {"norm_other": 0.5, "bf16_clipped": 1.0, "bf16_norm_other": 0.5}.get(case, 0.0)
        rec = ParityRecorder(str(tmp_path / "out"), name="mine", model=model, optimizer=optimizer, log=lines.append,
                             max_grad_norm=told, precision="bf16_pure" if bf16 else "fp32")
        ids = torch.randint(0, 4, (2, 8))
        for step in range(3):
            loss = model(torch.nn.functional.one_hot(ids, 64).to(dtype)).float().sum()
            (scaler.scale(loss) if case == "loss_scale" else loss).backward()
            rec.micro_batch(ids, ids, loss.detach().expand(2, 8, 4))
            rec.before_step()
            if ("norm" in case or case == "bf16_clipped") and (step or case != "norm_later"):  # norm_later: from 1 on
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if case.endswith("value_untold"):
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            if case == "one_tensor_halved":
                model[0].weight.grad.mul_(0.5)
            if case == "all_halved":
                for p in model.parameters():
                    p.grad.mul_(0.5)
            if case == "loss_scale":
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            rec.after_step()
        record = json.loads(open(rec.close()).read())
        if case == "bf16_clipped":
            assert record["config"]["stopped"] is None and len(record["steps"]) == 3, lines
            assert not any("clip_read" in s for s in record["steps"])
            return
        if case == "one_tensor_halved":
            assert record["config"]["stopped"] is None and len(record["steps"]) == 3
            entry = record["steps"][0]["clip_read"]
            assert (entry["tensor"], entry["gap"]) == ("0.weight", pytest.approx(0.5)) and "uniform" not in entry
            return
        if case == "all_halved":
            assert record["config"]["stopped"] is None and len(record["steps"]) == 3
            assert record["steps"][0]["clip_read"]["uniform"] == pytest.approx(0.5, rel=1e-9)
            return
        stop = 1 if case == "norm_later" else 0
        clip = ("the optimizer applied every gradient × 0\\.0\\d+, as a clip by norm at 1 would, and the recorder was "
                "told {}: pass ParityRecorder\\(max_grad_norm=1\\) — or, where the loop does not clip there, something "
                "scaled every gradient after before_step\\(\\) read it")
        value = re.escape("the optimizer applied every gradient element clipped into [-0.01, 0.01], as clip_grad_value_ "
                          "at 0.01 would, and the recorder was told no clip: pass ParityRecorder(clip_value=0.01)")
        why = {"norm_untold": clip.format("no clip"), "norm_later": clip.format("no clip"),
               "value_untold": value, "bf16_value_untold": value,
               "norm_other": clip.format("max_grad_norm 0.5"), "bf16_norm_other": clip.format("max_grad_norm 0.5"),
               "loss_scale": re.escape("the gradients read at before_step() were 65536 × the ones the optimizer "
                                       "applied (a loss scale, GradScaler's: call before_step() after "
                                       "scaler.unscale_(optimizer))")}[case]
        stopped = record["config"]["stopped"]
        assert stopped["step"] == stop and re.fullmatch(why, stopped["why"]), lines
        judged = "no step is" if stop == 0 else "step 0 is"
        assert lines[-1] == (f"parity recorder [mine]: {stopped['why']}: the record stops at step {stop}; {judged} "
                             f"replayed and judged; the training goes on"), lines
    finally:
        dist.destroy_process_group()


def _only(comparison):
    (result,) = comparison.results
    return result


@pytest.mark.parametrize("bug, step, quantity", [("hf_num_items", 0, "grad_norm"), ("hf_twice", 1, "lr")])
def test_seeded_trainer_bug_fails_at_its_step(runs, bug, step, quantity):
    """Copies of examples/hf_trainer.py, replayed. A compute_loss that drops num_items_in_batch: each micro-batch's
    own mean, not divided by the accumulation — the same loss at step 0, a gradient ~2× (measured 2.38 vs 1.18):
    FAIL at step 0 on the grad norm, and the verdict says how to localise it. A scheduler stepped twice per update:
    the replay applies the recorded lr, so the curves agree (within 1e-5), and the lr Trainer's own settings declare
    FAILs it at step 1 (0.001 applied, 0.0005 declared), ahead of any tolerance."""
    from parity.comparing.curve_report import verdict_details

    outside = first_fail(runs[bug], step, quantity)
    comparison = _compare(runs[bug])
    result = _only(comparison)
    details = verdict_details(comparison, result)
    if bug == "hf_twice":
        assert all(x < 1e-5 for x in result.verdict.max_rel_diff.values())
        assert (outside.value, outside.reference) == (1e-3, 5e-4)
        assert any("the lr applied, 0.001, is not the one the framework's own settings declare (0.0005)" in line
                   for line in details)
    else:
        assert 1.5 < outside.value / outside.reference < 2.5  # ~2: the sum of the 2 micro-batches' means
        assert any(re.match(r"tensor verdict: FAIL at step 0: model\.\S+, phase gradient: .* \(\S+ × its bound", line)
                   for line in details)  # every tensor's gradient ~2×: the furthest outside is named
        assert any(line.strip().startswith("localise step 0: rerun your script with the recorder's dump_step=0") and
                   f"--replay_record D/loss_{HF}.json --dump_step 0" in line for line in details)


def test_compare_dumps_names_the_first_divergent_module(runs):
    """The localisation: the Trainer run dumped one step (ParityCallback(dump_step=K)), the replay dumped the same
    step (the layer check's worker after K replayed steps), compare_dumps.py compares them tensor by tensor.
    The compute_loss bug at step 0: every forward output agrees (same weights, same rows), and the first divergence
    is the backward's first tensor, lm_head's output gradient (×2: the loss's scale). The clean run at step 2: every
    module output, output gradient and parameter gradient within 1e-5 (the user's masked attention against the
    harness's unmasked one: last bits); the parameters after AdamW's update too, but for the k_proj biases, whose
    noise-level gradients AdamW turns into update differences (measured 1.3e-4 relative: parity/comparing/layers.py
    SCALE_FLOOR's case)."""
    from parity.comparing.layer_report import console_summary
    from parity.comparing.layers import compare_all, load_dumps

    dumps = load_dumps(str(runs["hf_num_items"]))  # what compare_dumps.py reads and compares (no heatmap here)
    (bug,) = compare_all(dumps)
    assert (bug.a, bug.b) == (HF, "ddp")
    first = bug.verdict.first_outside
    assert (first.module, first.quantity) == ("lm_head", "backward (output gradient)"), first
    assert max(r.rel for r in bug.rows if r.kind == "output") < 1e-5
    assert "lm_head" in console_summary(dumps, [bug])
    (clean,) = compare_all(load_dumps(str(runs[HF])))
    assert max(r.rel for r in clean.rows if r.kind != "param") < 1e-5
    over = {r.name for r in clean.rows if r.rel > 1e-5}
    assert over <= {f"model.layers.{i}.self_attn.k_proj.bias" for i in range(2)}, over


def test_bf16_trainer_calibrated_verdict(runs):
    """Trainer in bf16 (autocast on CPU), 4 steps: the replay at the record's layout is the baseline; the replays with
    --noise_reference at 1 and 4 workers and in fp32 give the noise. The clean run PASSes within 1× the noise
    (measured deviation ÷ noise 0.8: loss 0.8, grad norm 0.04, param norm 0.3); the compute_loss bug, recorded on the
    same data from the same weights, FAILs at step 0 on the grad norm under the same calibration (measured 669×)."""
    comparison = compare_in(runs[BF16])
    assert comparison.baseline.name == "ddp" and comparison.baseline.precision == "bf16"
    assert len(comparison.references) == 3
    results = {r.run.name: r for r in comparison.results}
    clean, bug = results[HF], results["hf_bug"]
    assert clean.bounds.calibrated and clean.verdict.passed and max(clean.noise_ratios.values()) < 1.5
    assert not bug.verdict.passed and max(bug.noise_ratios.values()) > 100
    outside = bug.verdict.first_outside
    assert (outside.step, outside.quantity) == (0, "grad_norm")


def compare_in(folder):
    from parity.comparing.curves import compare, load_references, load_runs

    return compare(load_runs(str(folder)), references=load_references(str(folder)))


def test_one_rank_runs_replay_and_pass(runs):
    """At 1 rank (a group of one), replayed at 1 worker: the plain loop in 4 micro-batches of one row, Trainer in 4
    accumulation steps, Trainer with drop_last off on 5 rows (a smaller last batch: steps of 4, 1, 4, 1 rows) — loss,
    grad norm and parameter norm within 1e-5 at every step; PASS."""
    for folder, name in ((runs["plain_1rank"], NAME), (runs["hf_1rank"], "hf_1rank"), (runs["hf_small"], HF)):
        recorded, replay = _record(folder, name), _record(folder, "ddp")
        assert recorded["config"]["dp_size"] == 1
        for key in ("loss", "grad_norm", "param_norm"):
            assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, (name, key)
        assert _compare(folder).word == "PASS", name
    assert _record(runs["hf_1rank"], "hf_1rank")["steps"][0]["micro_batches"] == [[2, 2, 2, 2]]
    assert series(_record(runs["hf_small"], HF), "rows") == [4, 1, 4, 1]


def test_a_one_rank_record_replays_at_1_2_and_4_workers_from_a_relative_and_a_copied_folder(runs):
    """The plain loop at 1 rank, 4 micro-batches of one row a step, recorded with a relative --output_dir: its
    record names its files relative to itself (a moved or copied folder replays) and its 4 rows a step split over 1,
    2 or 4 workers (the replay's micro-batches hold one row, as the run's). Replayed from the test's own cwd at 1
    worker (the baseline), 2 and 4 (noise references: the verdict is calibrated), and from a copy of the folder at 2:
    every replay within 1e-5 of the record; PASS, calibrated."""
    recorded = _record(runs["plain_1rank"])
    config = recorded["config"]
    assert (config["model_name"], config["init_weights_path"], config["batches"]["folder"]) == (
        "recorded_plain_loop", "recorded_plain_loop/init_weights.safetensors", "recorded_plain_loop/batches")
    assert recorded["steps"][0]["micro_batches"] == [[1, 1, 1, 1]]
    replays = [_record(runs["plain_1rank"], "ddp"), _record(runs["plain_copy"], "ddp"),
               *(json.loads(p.read_text()) for p in sorted(runs["plain_1rank"].glob("noise_reference_*.json")))]
    assert sorted(r["config"]["num_workers"] for r in replays) == [1, 2, 2, 4]
    for replay in replays:
        for key in ("loss", "grad_norm", "param_norm"):
            assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, (replay["config"]["num_workers"], key)
        assert series(replay, "batch_hash") == series(recorded, "batch_hash")
    comparison = compare_in(runs["plain_1rank"])
    assert comparison.word == "PASS" and _only(comparison).bounds.calibrated
    assert _compare(runs["plain_copy"]).word == "PASS"


def test_a_record_past_its_batch_cap_stops_there_and_its_steps_before_are_judged(runs):
    """The batch cap passed at step 2 (6144 bytes a step, cap 15000): the record stops there in one line — it holds
    steps 0 and 1, and says where and why — the replay trains those two, and they PASS."""
    recorded, replay = _record(runs[CAPPED]), _record(runs[CAPPED], "ddp")
    assert recorded["complete"] and len(recorded["steps"]) == len(replay["steps"]) == 2
    assert recorded["config"]["stopped"] == {
        "step": 2, "why": "the batches passed max_batch_bytes (15000 bytes) at step 2: no more are saved"}
    assert _compare(runs[CAPPED]).word == "PASS"


def test_a_loop_under_torchs_amp_recipe_is_recorded_followed_and_passes(runs):
    """torch's AMP recipe (examples/plain_loop.py --fp16: autocast(float16) over fp32 weights, torch.amp.GradScaler,
    which the loop passes nowhere: the recorder finds it). The record says fp16_autocast and GradScaler's settings; the
    first two steps overflow (skipped, their gradients not finite), the scale halving each time, and it grows after 2
    good steps; the replay skipped exactly those steps at those scales, its own gradients overflowing where the
    record's did; no lr is declared at a skipped step; PASS calibrated within the noise (measured under
    `parity verify`: deviation ÷ noise 0.6, margin 33×)."""
    folder = runs[AMP]
    record, replay = _record(folder), _record(folder, "ddp")
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
    result = {r.run.name: r for r in compare_in(folder).results}[NAME]
    assert result.bounds.calibrated and result.verdict.passed and max(result.noise_ratios.values()) < 1, result


def test_a_clip_before_unscaling_fails_at_its_first_applied_step(runs):
    """clip_grad_norm_ before scaler.unscale_, as torch's AMP docs warn not to: the clip takes the scaled gradients to
    the max norm, the unscaling takes them to 1/scale of it — AdamW hides most of it in the loss. The verdict FAILs at
    the first step the run applied, on the pre-clip norm the recorder read after the unscaling (measured 1e-6 against
    the replay's 1.2)."""
    bug = _record(runs[AMP], "clip_first")
    first_applied = next(s["step"] for s in bug["steps"] if not s["skipped"])
    result = {r.run.name: r for r in compare_in(runs[AMP]).results}["clip_first"]
    outside = result.verdict.first_outside
    assert not result.verdict.passed and outside.step == first_applied, outside
    assert outside.quantity == "grad_norm" and outside.value < 1e-3 * outside.reference, outside


def test_a_scale_off_gradscalers_rules_fails_ahead_of_any_tolerance(runs, tmp_path):
    """The clean AMP record with one applied step's scale doubled: FAIL at that step on the scaler's rules (test
    loss_scaler), naming GradScaler's."""
    copy = tmp_path / "moved"
    shutil.copytree(runs[AMP], copy, ignore=shutil.ignore_patterns("loss_clip_first*", "recorded_clip_first"))
    record = _record(copy)
    step = next(s["step"] for s in record["steps"] if not s["skipped"])
    record["steps"][step]["loss_scale"] *= 2
    (copy / f"loss_{NAME}.json").write_text(json.dumps(record))
    outside = compare_in(copy).results[0].verdict.first_outside
    assert (outside.step, outside.quantity, outside.test) == (step, "loss_scale", "loss_scaler"), outside
    assert outside.value == 2 * outside.reference


def test_a_forward_under_another_autocast_than_told_stops_the_record_at_step_0(runs):
    """The plain loop's forward under torch.autocast(bfloat16), its recorder told "fp32" (the replay would train
    without autocast and FAIL at many times its bound): the first training forward's autocast, read inside the model,
    ends the record at step 0 in one line naming the precision to pass; nothing is replayed. Trainer's bf16 and every
    fp32 run of this module, told as they train, record every step."""
    recorded = _record(runs[TOLD_FP32])
    assert recorded["steps"] == [] and recorded["config"]["stopped"] == {"step": 0, "why": (
        "step 0 could not be recorded (rank 0: the forward ran under torch.autocast(bf16), but the recorder was told "
        "precision='fp32': pass precision='bf16')")}
    assert len(_record(runs[BF16], HF)["steps"]) == BF16_STEPS and _record(runs[BF16], HF)["config"]["precision"] == "bf16"
    lines = (runs[TOLD_FP32].parent / "told_fp32_stderr.txt").read_text().splitlines()
    assert not any("were not seen" in line for line in lines), lines  # the stopped step says why itself, alone


def test_trainers_fp16_on_a_cpu_is_recorded_as_the_fp32_it_trains(runs):
    """TrainingArguments(fp16=True, use_cpu=True): accelerate trains it in fp32 on a CPU (no autocast, no GradScaler),
    and the record says fp32, every step recorded — it said fp16 before 2026-12-01, and its replay was refused."""
    recorded = _record(runs["hf_fp16_cpu"], HF)
    assert (recorded["config"]["precision"], recorded["config"]["loss_scaling"], len(recorded["steps"])) == (
        "fp32", None, 2)


def test_each_autocast_against_each_policy_told():
    """The first forward's autocast against the policy told, where the policy keeps fp32 parameters: bf16 autocast
    under "bf16", fp16 autocast under "fp16_autocast" (torch's AMP recipe) and none under "fp32" are as told; the others
    end the record naming the precision to pass; low-precision-parameter policies are not read."""
    from parity.recording.precision_seen import mismatch

    assert mismatch("bf16", True, torch.bfloat16) is None and mismatch("fp32", False, torch.bfloat16) is None
    assert mismatch("fp16_autocast", True, torch.float16) is None
    assert mismatch("bf16_params", True, torch.bfloat16) is None and mismatch("fp16", True, torch.float16) is None
    assert mismatch("bf16", False, torch.bfloat16) == (
        "the forward ran without autocast, but the recorder was told precision='bf16': pass precision='fp32'")
    assert mismatch("fp32", True, torch.float16) == (
        "the forward ran under torch.autocast(fp16), but the recorder was told precision='fp32': pass "
        "precision='fp16_autocast'")
    assert mismatch("fp16_autocast", True, torch.bfloat16) == (
        "the forward ran under torch.autocast(bf16), but the recorder was told precision='fp16_autocast': pass "
        "precision='bf16'")


def test_a_bf16_bases_autocast_is_read_at_the_first_forward(tmp_path):
    """peft's LoRA by its defaults over a model loaded in bf16 (fp32 adapters), told no precision, is recorded
    bf16_base, read from the parameters; the first training forward reads the autocast: none keeps it, bfloat16's
    (Trainer's bf16=True over it: the adapters' products in bf16 too) makes it bf16_base_autocast, and float16's ends
    the record in one line (one rank, a group of one in this process)."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from parity import ParityRecorder, build_model, resolve_model_config

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    seen = []
    try:
        for i, autocast in enumerate((None, torch.bfloat16, torch.float16)):
            model = build_model(resolve_model_config("qwen2-tiny"), 0).to(torch.bfloat16)
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
            trained = [p for p in model.parameters() if p.requires_grad]
            rec = ParityRecorder(str(tmp_path / f"out{i}"), name="mine", model=model,
                                 optimizer=torch.optim.AdamW(trained), log=lambda line: None)
            assert (rec.record.data["config"]["precision"], {p.dtype for p in trained}) == ("bf16_base",
                                                                                          {torch.float32})
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                model(input_ids=torch.arange(8).view(1, 8))
            seen.append((rec.record.data["config"]["precision"], rec.broken))
            rec.close()
    finally:
        dist.destroy_process_group()
    assert seen == [("bf16_base", None), ("bf16_base_autocast", None),
                    ("bf16_base", "the forward ran under torch.autocast(fp16), but the recorder was told "
                                  "precision='bf16_base': the harness replays a frozen bf16 base under fp32 adapters "
                                  "without autocast or under torch.autocast(bfloat16) only")], seen


def test_trainer_two_ranks_against_one_rank_twice_the_accumulation(runs):
    """A framework-internal comparison in the same folder and verdict: Trainer at 2 ranks × 2 accumulation steps (the
    baseline) against 1 rank × 4. The same rows each step in another order (other batch hashes, equal order-free
    rows hashes), the same loss, grad norm and parameter norm within 1e-5: PASS."""
    from parity.comparing.curves import compare, load_runs

    two, one = _record(runs["internal"], HF), _record(runs["internal"], "hf_1rank")
    assert series(two, "batch_hash") != series(one, "batch_hash")
    assert series(two, "rows_hash") == series(one, "rows_hash")
    comparison = compare(load_runs(str(runs["internal"])), baseline=HF)
    assert comparison.word == "PASS"
    assert max(_only(comparison).verdict.max_rel_diff.values()) < 1e-5


def _recorder_lines(folder) -> list[str]:
    return [line for line in (folder / "stderr.txt").read_text().splitlines() if line.startswith("parity recorder")]


def test_trainer_deepspeed_path_is_recorded_and_a_bug_in_it_fails(runs):
    """Trainer's DeepSpeed path on CPU (ZeRO-1 through TrainingArguments(deepspeed=...), two ranks, 3 steps): its
    engine, which steps inside backward, is read by the recorder's ZeRO view as a DeepSpeed loop of one's own (its
    gradients where engine.step() takes its norm, the norm DeepSpeed's own): the replay equals the record within 1e-5
    and the verdict PASSes; the compute_loss that drops num_items_in_batch, seeded into it, FAILs at step 0 on the grad
    norm. Refused before 2026-11-29. Without use_cpu=True (the reported finding) each rank's Trainer sees world_size 1
    and process_index 0 — accelerate's state found no backend and kept one process while DeepSpeed started the 2-rank
    group — so every rank feeds the same rows: refused in one line naming that and its cause, nothing recorded, and
    the user's training ran to its end."""
    recorded = _record(runs["hf_deepspeed"], HF)
    config = recorded["config"]
    assert (config["sharding"]["kind"], config["grad_norm_source"], len(recorded["steps"])) == \
        ("deepspeed zero1", "framework", 3)
    assert _recorder_lines(runs["hf_deepspeed"])[0].startswith(
        f"parity recorder [{HF}]: recording {HF} (transformers.Trainer, deepspeed zero1, 2 ranks)")
    comparison = _compare(runs["hf_deepspeed"])
    assert comparison.word == "PASS" and max(_only(comparison).verdict.max_rel_diff.values()) < 1e-5
    (result,) = _compare(runs["hf_deepspeed_num_items"]).results
    outside = result.verdict.first_outside
    assert (outside.step, outside.quantity) == (0, "grad_norm") and outside.rel_diff > 0.1, outside
    assert _recorder_lines(runs["hf_deepspeed_world"]) == [
        f"parity recorder [{HF}]: Trainer sees world_size 1 and process_index 0, the process group 2 ranks (this one "
        f"rank 0): every rank would feed the same rows and the loss be normalised for another world than the one "
        f"training (accelerate without use_cpu=True on a machine without GPUs: DeepSpeed starts the group, "
        f"accelerate's state finds no backend and keeps one process): pass use_cpu=True: recording nothing"]
    assert not (runs["hf_deepspeed_world"] / f"loss_{HF}.json").exists()
    assert (runs["hf_deepspeed_world"] / "trainer").is_dir()  # Trainer's own output folder: it trained


def test_deepspeeds_own_precision_modes_are_read_from_its_config_and_judged(runs):
    """Trainer's DeepSpeed path (ZeRO-2, 2 ranks, 4 steps) in the modes its config names, read from the engine's config
    as a strategy run's --deepspeed_config is read (parity/deepspeed_precision.py), each judged by the calibrated
    verdict (replays at 2, 1 and 4 workers and in fp32). bf16 master weights and Adam state
    (bf16_master_weights_and_grads + bf16_optimizer_states) is recorded as bf16_pure and PASSes; the same record read as
    bf16_params, as the callback read every bf16 engine before 2026-11-29, FAILs — a correct run called FAIL (a norm
    weight's update, bf16 masters lose updates below their half ulp); the compute_loss bug in bf16_pure FAILs at step 0
    on the grad norm. torch_autocast over fp32 weights, which the recorder was told was fp32 (refused at step 0), is
    recorded as bf16 — DeepSpeed reduces its Linear gradients in bf16, the replay every gradient in fp32 — and PASSes."""
    pure, autocast = _record(runs[DS_PURE], HF)["config"], _record(runs[DS_AUTOCAST], HF)["config"]
    assert [(c["precision"], c["reduce_dtype"], c["grad_accum_dtype"], c["sharding"]["kind"]) for c in (pure, autocast)] \
        == [("bf16_pure", "bf16", "bf16", "deepspeed zero2"), ("bf16", "fp32", "fp32", "deepspeed zero2")]
    for folder, references in ((DS_PURE, 2), (DS_AUTOCAST, 3)):  # bf16_pure's fp32 twin measures no noise
        comparison = compare_in(runs[folder])
        clean = {r.run.name: r for r in comparison.results}[HF]
        assert len(comparison.references) == references and clean.bounds.calibrated and clean.verdict.passed, folder
        assert len(_record(runs[folder], HF)["steps"]) == BF16_STEPS
    (bug,) = [r for r in compare_in(runs[DS_PURE]).results if r.run.name == "hf_bug"]
    assert (bug.verdict.first_outside.step, bug.verdict.first_outside.quantity) == (0, "grad_norm")
    (misread,) = compare_in(runs[AS_PARAMS]).results
    assert misread.bounds.calibrated and not misread.verdict.passed


def test_trainers_deepspeed_path_at_zero0_is_read_where_deepspeed_takes_its_norm(runs):
    """Trainer's DeepSpeed path at ZeRO-0 (2 ranks), whose engine steps inside backward: in fp32, over Trainer's own
    AdamW, DeepSpeed keeps no norm — the recorder's, taken where the engine clips, float64 — and the replay is within
    1e-5 (PASS); in bf16 DeepSpeed's FP16_UnfusedOptimizer takes its norm inside its step, where every tensor's
    gradient is now read (its norms were NaN: no before_step() comes in Trainer's path). The bf16 run's verdict is the
    DeepSpeed bug tests/test_own_trainer_sharded.py asserts."""
    recorded = _record(runs["hf_ds_zero0"], HF)
    assert (recorded["config"]["sharding"]["kind"], recorded["config"]["grad_norm_source"]) == ("deepspeed zero0",
                                                                                              "recorder")
    comparison = _compare(runs["hf_ds_zero0"])
    assert comparison.word == "PASS" and max(_only(comparison).verdict.max_rel_diff.values()) < 1e-5
    grad, param = tensor_norms_off(recorded, runs["hf_ds_zero0"])
    assert grad < 1e-12 and param < 1e-12, (grad, param)
    bf16 = _record(runs["hf_ds_zero0_bf16"], HF)
    assert (bf16["config"]["precision"], len(bf16["steps"])) == ("bf16_params", 2)
    norms = tensor_series(bf16, runs["hf_ds_zero0_bf16"]).grad_norm
    assert all(value == value and value > 0 for step in norms for value in step), norms


def test_a_trainer_logging_at_its_default_interval_is_recorded_as_one_logging_every_step(tmp_path, monkeypatch):
    """Trainer logs its loss and pre-clip grad norm every logging_steps (500 by default): the callback takes both at
    every step (step_taps.py), so a run at the default interval, and one at 3, record what a run at 1 logs — its own
    log_history, bit for bit — and the same steps. One process, no launcher (the recorder's group of one); the taps
    leave the Trainer as they found it. Before, any interval but 1 was refused."""
    from transformers import Trainer, TrainingArguments

    from parity.frameworks.transformers.callback import ParityCallback
    from parity.models.model import build_model, resolve_model_config
    from parity.training.record import load_record

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    rows = [{"input_ids": torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(i)).tolist()}
            for i in range(16)]
    for row in rows:
        row["labels"] = row["input_ids"]
    records, histories = {}, {}
    for interval in (1, 3, 500):
        args = TrainingArguments(output_dir=str(tmp_path / f"run{interval}"), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, max_grad_norm=0.5,
                                 report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                                 logging_steps=interval)
        trainer = Trainer(model=build_model(resolve_model_config("qwen2-tiny"), 0), args=args, train_dataset=rows,
                          callbacks=[ParityCallback(str(tmp_path / f"rec{interval}"), name="logged")])
        trainer.train()
        assert not {"training_step", "_get_grad_norm"} & set(vars(trainer))  # the taps removed
        records[interval] = load_record(str(tmp_path / f"rec{interval}" / "loss_logged.json"))["steps"]
        histories[interval] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    assert len(histories[1]) == 4 and len(histories[3]) == 1 and not histories[500]
    assert [(s["logged_loss"], s["logged_grad_norm"]) for s in records[1]] == histories[1]
    timed = {"step_time_s", "peak_memory_bytes", "harness_s"}
    measured = {k: [{key: v for key, v in s.items() if key not in timed} for s in steps] for k, steps in records.items()}
    assert measured[3] == measured[1] and measured[500] == measured[1]
    assert [s["grad_norm_source"] for s in records[1]].count("framework") >= 1  # clipped at 0.5: Trainer's norm


@pytest.mark.parametrize("setting, why", [
    ({"neftune_noise_alpha": 5.0}, "NEFTune (neftune_noise_alpha=5.0): the run adds random noise to the input "
                                   "embeddings at each training forward, which the replay cannot draw: verify the "
                                   "setup without it"),
    ({"label_smoothing_factor": 0.1}, "label smoothing (label_smoothing_factor=0.1): the run trains a smoothed "
                                      "cross-entropy, the replay the token mean of the plain one: verify the setup "
                                      "with label_smoothing_factor=0"),
    ({"optim": "sgd"}, "the optimizer is SGD: the replay builds AdamW and Adam only"),
    ({"optim": "adafactor"}, "the optimizer is Adafactor: the replay builds AdamW and Adam only")])
def test_what_a_trainers_replay_cannot_draw_or_build_is_refused_before_it_records(tmp_path, capsys, monkeypatch,
                                                                                 setting, why):
    """Trainer settings the replay cannot follow, one line each before the first step, nothing written, the training
    going on: NEFTune's noise (a clean run was called FAIL at step 0, its embedding's gradient 700 × its bound), label
    smoothing (its forward has no labels: the record stopped at step 0 naming them), and an optimizer the replay does
    not build — SGD (recorded, then refused by the replay) and Adafactor (the recorder failed to start on its eps
    pair: 'recorded nothing')."""
    from transformers import Trainer, TrainingArguments

    from parity.frameworks.transformers.callback import ParityCallback
    from parity.models.model import build_model, resolve_model_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    rows = [{"input_ids": list(range(i, i + 16)), "labels": list(range(i, i + 16))} for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **setting)
    trainer = Trainer(model=build_model(resolve_model_config("qwen2-tiny"), 0), args=args, train_dataset=rows,
                      callbacks=[ParityCallback(str(tmp_path / "rec"), name="refused")])
    trainer.train()
    assert trainer.state.global_step == 1 and not (tmp_path / "rec").exists()
    assert capsys.readouterr().err.splitlines() == [f"parity recorder [refused]: {why}: recording nothing"]


def test_a_model_without_a_language_model_head_is_refused_before_it_records(tmp_path, capsys, monkeypatch):
    """A sequence classifier — what TRL's RewardTrainer trains — under Trainer: one line before the first step, nothing
    written, the training going on (before 2026-11-30 it recorded, then stopped at step 0 on 'a training forward without
    input_ids and labels')."""
    from transformers import Qwen2ForSequenceClassification, Trainer, TrainingArguments

    from parity.frameworks.transformers.callback import ParityCallback
    from parity.models.model import resolve_model_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = resolve_model_config("qwen2-tiny")
    config.num_labels, config.pad_token_id = 1, 0
    rows = [{"input_ids": list(range(i, i + 16)), "labels": [0.5]} for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=Qwen2ForSequenceClassification(config), args=args, train_dataset=rows,
                      callbacks=[ParityCallback(str(tmp_path / "rec"), name="classifier")])
    trainer.train()
    assert trainer.state.global_step == 1 and not (tmp_path / "rec").exists()
    assert capsys.readouterr().err.splitlines() == [
        "parity recorder [classifier]: Qwen2ForSequenceClassification has no language-model head: the replay trains a "
        "causal LM's objective (a sequence classifier's, a reward model's, is not one): recording nothing"]


def _world_before_the_group(rank: int, world: int, port: int, out: str, result: str, settings: dict) -> None:
    """TrainingArguments(`settings`) on each rank of a launcher's group, and trainer_refusal's line on them. Without
    use_cpu, as TRL's own sft.py under torchrun on CPU without --use_cpu: they settle their world — accelerate's state
    brings the launcher's group up and yet keeps one process (transformers warns that parallel_mode is not
    distributed)."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from parity.frameworks.transformers.callback import trainer_refusal

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = TrainingArguments(output_dir=out, report_to=[], **settings)
    args.world_size  # noqa: B018 (its devices set up, as Trainer's first use does)
    assert dist.is_initialized() and dist.get_world_size() == world
    try:
        refusal = trainer_refusal(args, None)  # (the world's line comes first)
        if rank == 0:
            with open(result, "w") as f:
                json.dump([args.world_size, args.process_index, refusal], f)
    finally:
        dist.destroy_process_group()


def test_a_trainer_that_sees_one_process_of_several_is_refused_naming_use_cpu(tmp_path):
    """Trainer's DDP path on a machine without GPUs, without use_cpu=True: its arguments see world_size 1 (accelerate
    formed no group) while the launcher's 2 ranks form one — every rank would train alone on the same rows (TRL's own
    sft.py under torchrun without --use_cpu, found as a new user). Refused in one line that names the fix."""
    from parity.driver.local_group import start_processes

    result = tmp_path / "refusal.json"
    start_processes(_world_before_the_group, (2, free_port(), str(tmp_path / "trainer"), str(result), {}), 2)
    assert json.loads(result.read_text()) == [1, 0, (
        "Trainer sees world_size 1 and process_index 0, the process group 2 ranks (this one rank 0): every rank would "
        "feed the same rows and the loss be normalised for another world than the one training (accelerate without "
        "use_cpu=True on a machine without GPUs keeps one process while the launcher started several): pass "
        "use_cpu=True to TrainingArguments (--use_cpu where the script parses them)")]


def test_a_trainer_averaging_each_ranks_own_token_mean_is_refused_over_two_ranks(tmp_path):
    """average_tokens_across_devices=False (transformers' default is True) at 2 ranks: each rank's loss its own tokens'
    mean, their gradients averaged — another objective than the replay's token mean over every rank (a clean run of a
    Trainer script written as transformers' docs write one was called FAIL at step 0: grad norm 3.2e-4 relative, the
    tensor verdict 4.1 × a norm's bound, "differs from the baseline in: nothing recorded"). Refused in one line."""
    from parity.driver.local_group import start_processes

    result = tmp_path / "refusal.json"
    settings = {"use_cpu": True, "average_tokens_across_devices": False}
    start_processes(_world_before_the_group, (2, free_port(), str(tmp_path / "trainer"), str(result), settings), 2)
    assert json.loads(result.read_text()) == [2, 0, (
        "average_tokens_across_devices=False: each rank's loss is the mean over its own tokens (their gradients then "
        "averaged over the ranks), the replay's the mean over every rank's tokens — another objective wherever the "
        "ranks' token counts differ: verify the setup with average_tokens_across_devices=True (transformers' default)")]


def linear_step(model, optimizer, rec, ids) -> None:
    """One recorded step of a torch.nn.Linear(4, 4) on one-hot `ids` (their own labels)."""
    logits = model(torch.nn.functional.one_hot(ids, 4).float())
    logits.sum().backward()
    rec.micro_batch(ids, ids, logits)
    rec.before_step()
    optimizer.step()
    optimizer.zero_grad()
    rec.after_step()


def test_a_multimodal_model_trained_on_text_is_recorded_as_its_language_model_and_passes(tmp_path, capsys,
                                                                                          monkeypatch):
    """An image-text model (Gemma 3 4B's class, Gemma3ForConditionalGeneration) trained on text, in a single-process
    loop: the recorder reads its language model (language_model.py: Gemma3ForCausalLM's names over the run's own
    modules), leaving the vision tower and projector out of the record and the optimizer's groups, and the DDP replay
    PASSes it (before: refused, and a record made earlier crashed the replay, exit 70). A step whose forward feeds the
    vision tower stops the record there in one line; a record of the whole model made before is refused by the replay."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    from parity.commands.compare_curves import main as compare
    from parity.driver.local_group import launch_local
    from parity.recording.recorder import ParityRecorder
    from parity.replay.replay import _check_model
    from parity.training.record import load_record

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    multimodal_gemma3(tmp_path / "gemma3")
    config = AutoConfig.from_pretrained(tmp_path / "gemma3")

    def run(folder, steps, images_at=None):
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        rec = ParityRecorder(str(folder), name="gemma", model=model, optimizer=optimizer, max_grad_norm=1.0,
                             log=lambda _: None)
        for step in range(steps):
            ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(step))
            out = model(input_ids=ids, labels=ids)
            if step == images_at:  # what a batch with images runs (here beside the text, to stop the record)
                model.model.vision_tower(pixel_values=torch.zeros(1, 3, 28, 28))
            out.loss.backward()
            rec.micro_batch(ids, ids, out.logits)
            rec.before_step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            rec.after_step()
        return load_record(rec.close())

    record = run(tmp_path / "rec", 3)
    assert record["config"]["model_config"]["model_type"] == "gemma3_text" and len(record["steps"]) == 3
    assert [g["params"][0] for g in record["config"]["optimizer"]["groups"]] == ["model.embed_tokens.weight"]
    assert not any("vision" in name or "projector" in name
                   for g in record["config"]["optimizer"]["groups"] for name in g["params"])
    launch_local(*zip(*[(cfg, {"batches": batches}) for cfg, batches in [
        _replay({"mm": tmp_path / "rec"}, tmp_path, "mm", "gemma", 1)]]))  # the DDP replay, in a local group
    assert compare(["--input_dir", str(tmp_path / "rec"), "--output", str(tmp_path / "c.png")]) == 0
    assert "gemma (TP=1, DP=1): PASS" in capsys.readouterr().out
    stopped = run(tmp_path / "images", 3, images_at=1)
    assert len(stopped["steps"]) == 1 and stopped["config"]["stopped"]["why"] == (
        "step 1 could not be recorded (rank 0: the run fed its model.vision_tower (a multimodal model's other input): "
        "the replay feeds text to its language model alone)"), stopped["config"]["stopped"]
    with pytest.raises(ConfigError) as refused:
        _check_model(str(tmp_path / "loss_old.json"), str(tmp_path / "gemma3"))
    assert str(refused.value).startswith("--replay_record loss_old.json: a multimodal 'gemma3' model")


def test_a_model_that_is_not_hugging_faces_is_refused_at_replay(tmp_path, capsys):
    """A plain torch module recorded (one rank, a group of one in this process): the recorder marks the record (no
    config to build the model from: hugging_face_model false, not replayable) and the replay refuses it in one line."""
    import torch.distributed as dist

    from parity.recording.recorder import ParityRecorder

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rec = ParityRecorder(str(tmp_path / "rec"), name="mine", model=model, optimizer=optimizer, log=lambda _: None)
        linear_step(model, optimizer, rec, torch.randint(0, 4, (2, 8)))
        path = rec.close()
    finally:
        dist.destroy_process_group()
    config = json.loads(open(path).read())["config"]
    assert config["hugging_face_model"] is False and config["not_replayable"] == "the model (Linear) is not a " \
        "Hugging Face model"
    code, lines = _train_ddp(["--replay_record", path, "--loss_output_dir", str(tmp_path / "out"),
                              "--storage_path", str(tmp_path / "ck")], capsys)
    assert code == 2 and lines == ["error: --replay_record loss_mine.json: the recorded model is not a Hugging Face "
                                   "model (no config to build it from): the harness trains Hugging Face causal LMs "
                                   "only"], lines
