"""Your own packed and padding-free runs, recorded and replayed as they ran (docs/own_trainer/techniques.md#packed-and-padding-
free-rows): TRL's SFTTrainer with packing=True (trl 1.16's default 'bfd' strategy: each micro-batch padding-free, one
row whose position ids restart at each text, no attention mask, use_cache=False) training LoRA adapters (peft_config)
and Trainer with transformers'
DataCollatorWithFlattening (the same kind of rows; use_cache=False from TrainingArguments), each at 2 ranks in fp32,
recorded with every row's position ids and what came with them, replayed under the harness's DDP as fed and judged;
the Trainer record also at 1 worker (both ranks' rows on one) and at 4 (its one row a rank and step cut at document
boundaries). A Trainer run whose documents attended to each other (TrainingArguments(use_cache=True): transformers
then masks the whole row causally) is replayed with its cache and PASSes too, its loss off the clean run's. Bad input:
an attention implementation the replay cannot run here, workers the documents do not go round, a record whose batches
lack the position ids its run fed — one line, exit 2, before any worker. verify_trainer.py --calibrate's noise
reference for each record: a worker count whose micro-batches or sums differ from the replay's (3 workers for the
Trainer record, whose replay at 1 is the 2 workers' bit for bit).

Processes are shared: one gloo group of two ranks records the three runs one after another, and one local group per
world size (2, 1, 4) replays them."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import REPO, free_port, kernel_setting, max_rel_diff, series
from test_own_trainer import _copy, _record_rank, _replay, _train_ddp

TRL = os.path.join(REPO, "examples", "trl_sft.py")
HF = os.path.join(REPO, "examples", "hf_trainer.py")
STEPS = 4
CACHE = [("disable_tqdm=True, bf16=args.bf16,", "disable_tqdm=True, bf16=args.bf16, use_cache=True,")]
# folder → (example, record name, arguments); "hf_cache" is a copy of the Trainer example with TrainingArguments'
# use_cache=True
JOBS = {
    "trl": (TRL, "trl_sft", ["--packing", "--lora", "--seq_length", "64"]),  # TRL's LoRA fine-tune, packed
    "hf": (HF, "hf_trainer", ["--padding_free", "--grad_accum_steps", "1"]),
    "hf_cache": (None, "hf_trainer", ["--padding_free", "--grad_accum_steps", "1"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{folder name: its folder}, each with its record and its replay at 2 workers (loss_ddp.json); the Trainer
    folder also with its replay at 4 workers (a noise reference), and a copy of it ("hf_1") with its replay at 1."""
    from parity.driver.local_group import launch_local, start_processes

    root = tmp_path_factory.mktemp("own_trainer_packing")
    folders = {name: root / name for name in JOBS}
    cached = _copy(root, HF, "hf_cache", CACHE)
    for folder in folders.values():
        folder.mkdir()
    jobs = [(example or cached, ["--output_dir", str(folders[name]), "--name", record, "--steps", str(STEPS), *extra],
             str(folders[name] / "stderr.txt")) for name, (example, record, extra) in JOBS.items()]
    with kernel_setting():  # the records and replays under the perturbed kernels (conftest.PERTURBED)
        start_processes(_record_rank, (2, free_port(), jobs), 2)
        folders["hf_1"] = root / "hf_1"
        shutil.copytree(folders["hf"], folders["hf_1"])
        groups = [[_replay(folders, root, name, JOBS[name][1], 2) for name in JOBS],
                  [_replay(folders, root, "hf_1", "hf_trainer", 1)],
                  [_replay(folders, root, "hf", "hf_trainer", 4, noise_reference=True)]]
        for planned in groups:
            launch_local([cfg for cfg, _ in planned], [{"batches": batches} for _, batches in planned])
    return folders


def _record(folder, name: str) -> dict:
    return json.loads((folder / f"loss_{name}.json").read_text())


def _saved_step(folder, record: dict, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / record["config"]["batches"]["folder"] / f"step_{step:06d}.safetensors"))


def _compare(folder):
    from parity.comparing.curves import compare, load_references, load_runs

    return compare(load_runs(str(folder)), references=load_references(str(folder)))


def _assert_replays(recorded: dict, replay: dict) -> None:
    """The replay trained on the recorded rows (batch hashes, loss tokens and lr equal at every step) to the recorded
    loss, pre-clip grad norm and parameter norm within 1e-5 relative."""
    for key in ("batch_hash", "tokens", "lr"):
        assert series(replay, key) == series(recorded, key), key
    for key in ("loss", "grad_norm", "param_norm"):
        assert max_rel_diff(series(replay, key), series(recorded, key)) < 1e-5, key


@pytest.mark.parametrize("name", ["trl", "hf"])
def test_a_packed_run_is_recorded_with_its_position_ids_and_replays_as_it_ran(runs, name):
    """TRL packed (bfd) with LoRA and Trainer flattened, 2 ranks: every micro-batch one row of several documents, its
    position ids restarting at each and its first label −100 there, fed with no mask and no cache — so recorded (each
    row's flags: position ids only) with the run's attention implementation (sdpa); replayed at 2 workers to within 1e-5
    of the record at every step (measured ≤ 7e-8), the teacher-forced check from the run's step-0 state within its
    bounds; PASS. TRL's record trains what peft adapted alone: its config holds the adapters, its replay the same."""
    from parity.comparing.curves import load_runs
    from parity.comparing import teacher_forced
    from parity.training.fed_rows import FED_POSITIONS

    record_name = JOBS[name][1]
    recorded, replay = _record(runs[name], record_name), _record(runs[name], "ddp")
    config = recorded["config"]
    assert config["attn_implementation"] == "sdpa" and config["batches"]["position_ids_from"] == 0
    assert all(n == 1 for s in recorded["steps"] for rank in s["micro_batches"] for n in rank)  # one row a micro-batch
    saved = _saved_step(runs[name], recorded, 0)
    assert saved["fed"].tolist() == [FED_POSITIONS] * len(saved["fed"])
    restarts = (saved["position_ids"][:, 1:] == 0) & (saved["attention_mask"][:, 1:] == 1)
    assert restarts.sum(1).min() >= 1  # every row holds two documents or more
    assert (saved["labels"][:, 1:][restarts] == -100).all()
    _assert_replays(recorded, replay)
    if name == "trl":
        assert recorded["config"]["lora"]["targets"] and replay["config"]["lora"] == recorded["config"]["lora"]
    (run,) = [r for r in load_runs(str(runs[name])) if r.name == record_name]
    checks = teacher_forced.summary(run.record)
    assert [c["step"] for c in checks["checks"]] == [0] and checks["first_fail_step"] is None
    assert _compare(runs[name]).word == "PASS"
    said = [line for line in (runs[name] / "stderr.txt").read_text().splitlines() if "position ids" in line]
    assert said == [f"parity recorder [{record_name}]: step 0 fed position ids of its own (packed or padding-free "
                    f"rows): each row is recorded with them, its mask or none and its cache, and replayed as it was "
                    f"fed"]


def test_a_padding_free_record_replays_at_1_2_and_4_workers(runs):
    """The Trainer record (2 ranks, one row a step each) replayed at 2 workers, at 1 (both rows on one rank, each its
    own micro-batch: bit for bit the 2 workers' replay, whose DDP average of the two rows' gradients rounds as their
    sum) and at 4 (each row cut at a document boundary: a position id restart whose label is −100): every replay within
    1e-5 of the record (measured ≤ 1e-7), the batch hashes equal (taken over the rows' tokens in order, cut or not);
    PASS, calibrated by the 4 workers' replay."""
    from parity.replay.replay import plan_replay
    from parity.driver.local_group import CLUSTER

    recorded = _record(runs["hf"], "hf_trainer")
    (four,) = (json.loads(p.read_text()) for p in runs["hf"].glob("noise_reference_*.json"))
    replays = [_record(runs["hf"], "ddp"), _record(runs["hf_1"], "ddp"), four]
    assert [r["config"]["num_workers"] for r in replays] == [2, 1, 4]
    for replay in replays:
        _assert_replays(recorded, replay)
    for key in ("loss", "grad_norm", "param_norm"):
        assert series(replays[1], key) == series(replays[0], key), key
    _, batches = plan_replay(str(runs["hf"] / "loss_hf_trainer.json"), {"num_workers": 4}, cluster=CLUSTER)
    cut, whole = batches(0), batches.as_fed(0)
    assert (len(whole.input_ids), len(cut.input_ids)) == (2, 4) and cut.micro_rows == ((1,),) * 4
    assert cut.loss_tokens == whole.loss_tokens and (cut.position_ids[:, 0] == 0).all()
    comparison = _compare(runs["hf"])
    assert comparison.word == "PASS" and comparison.results[0].bounds.calibrated
    assert _compare(runs["hf_1"]).word == "PASS"


def test_calibrate_picks_a_worker_count_that_changes_the_arithmetic(runs, tmp_path, capsys):
    """verify_trainer.py --calibrate's noise reference (plan_replays) on these records, without processes: the Trainer
    record's replay at 1 worker feeds the same rows alone and sums them as the 2 workers' DDP does (gradient_sums equal
    at every step: the fixture's replays at 1 and 2 workers are bit for bit one), so it is passed over for 3 workers,
    each row cut once (3 pieces a step: sums unlike the 2 workers' at every step, as the 4 workers' are, whose loss is
    4.8e-8 off theirs); TRL's record (2 rows a rank) keeps 1 worker, fewer first: its 4 rows summed in one order, not
    two ranks' pairs; the record fed with a cache, whose rows cannot be cut, gets none, in one line."""
    from parity.commands.verify_trainer import gradient_sums, plan_replays
    from parity.driver.local_group import CLUSTER
    from parity.replay.replay import plan_replay

    record = str(runs["hf"] / "loss_hf_trainer.json")
    planned = plan_replays(record, str(tmp_path), None, True)
    assert [(cfg.num_workers, cfg.noise_reference, cfg.noise_kernels) for cfg, _ in planned] == [
        (2, False, None), (3, True, None), (2, True, "other_kernels")]
    cut = planned[1][1](0)
    assert len(cut.input_ids) == 3 and cut.micro_rows == ((1,),) * 3
    sums = {w: list(gradient_sums(*plan_replay(record, {"num_workers": w}, cluster=CLUSTER))) for w in (1, 2, 4)}
    assert [a == b for a, b in zip(sums[1], sums[2])] == [True] * STEPS
    assert [a == b for a, b in zip(sums[4], sums[2])] == [False] * STEPS
    assert series(_record(runs["hf_1"], "ddp"), "loss") == series(_record(runs["hf"], "ddp"), "loss")
    (four,) = (json.loads(p.read_text()) for p in runs["hf"].glob("noise_reference_*.json"))
    assert 0 < max_rel_diff(series(four, "loss"), series(_record(runs["hf"], "ddp"), "loss")) < 1e-5
    planned = plan_replays(str(runs["trl"] / "loss_trl_sft.json"), str(tmp_path), None, True)
    assert [cfg.num_workers for cfg, _ in planned] == [2, 1, 2]
    capsys.readouterr()
    planned = plan_replays(str(runs["hf_cache"] / "loss_hf_trainer.json"), str(tmp_path), None, True)
    assert [(cfg.num_workers, cfg.noise_kernels) for cfg, _ in planned] == [(2, None), (2, "other_kernels")]
    assert capsys.readouterr().err.splitlines() == [(
        "verify_trainer: no other worker count splits loss_hf_trainer.json's 2 rows into other micro-batches or sums: "
        "no noise reference at another layout")]


def test_a_run_whose_documents_attended_to_each_other_replays_with_its_cache(runs):
    """Trainer with TrainingArguments(use_cache=True) on the same flattened rows: transformers builds a cache, and
    with it one causal mask over the whole row — each sample attends to the samples before it. The record says so
    (each row's flags: position ids and a cache) and its recorder says so in one line; the replay feeds the cache and
    equals the run within 1e-5 (PASS; measured ≤ 3e-8). At step 0 its loss is 6.0e-4 off the clean run's and its grad
    norm 4.8e-3 (random weights attend almost evenly): fed otherwise, the replay would have trained another model, 60
    and 480 × the fp32 bound away."""
    from parity.training.fed_rows import FED_CACHE, FED_POSITIONS

    recorded, clean = _record(runs["hf_cache"], "hf_trainer"), _record(runs["hf"], "hf_trainer")
    said = [line for line in (runs["hf_cache"] / "stderr.txt").read_text().splitlines() if "position ids" in line]
    assert said == ["parity recorder [hf_trainer]: step 0 fed position ids of its own (packed or padding-free rows): "
                    "each row is recorded with them, its mask or none and its cache, and replayed as it was fed; some "
                    "came with an attention mask or a cache, under which transformers masks the whole row causally: "
                    "their documents attended to each other (pass use_cache=False and no attention_mask to keep them "
                    "apart)"]
    assert _saved_step(runs["hf_cache"], recorded, 0)["fed"].tolist() == [FED_POSITIONS | FED_CACHE] * 2
    assert series(recorded, "batch_hash") != series(clean, "batch_hash")  # the flags are part of what was fed
    assert series(recorded, "tokens") == series(clean, "tokens")
    for key, off in (("loss", 1e-4), ("grad_norm", 1e-3)):
        assert max_rel_diff(series(recorded, key)[:1], series(clean, key)[:1]) > off, key
    _assert_replays(recorded, _record(runs["hf_cache"], "ddp"))
    assert _compare(runs["hf_cache"]).word == "PASS"


def _edited(runs, tmp_path, edit) -> str:
    """A copy of the Trainer record elsewhere, naming its files where they are, edited."""
    data = _record(runs["hf"], "hf_trainer")
    config = data["config"]
    config["model_name"], config["init_weights_path"], config["batches"]["folder"] = (
        str(runs["hf"] / named) for named in (config["model_name"], config["init_weights_path"],
                                               config["batches"]["folder"]))
    tmp_path.mkdir(parents=True)
    edit(data, tmp_path)
    path = tmp_path / "loss_hf_trainer.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    """Refused before any worker starts (nothing written under --loss_output_dir): a run that computed attention with
    flash_attention_2 (the replay runs on CPU), more workers than the documents go round, and a record whose batch
    lacks the position ids its run fed (a recorder from before they were kept)."""
    from safetensors.torch import load_file, save_file

    def flash(data, _):
        data["config"]["attn_implementation"] = "flash_attention_2"

    def without_positions(data, folder):
        batches = folder / "batches"
        batches.mkdir()
        for step in range(STEPS):
            saved = load_file(os.path.join(data["config"]["batches"]["folder"], f"step_{step:06d}.safetensors"))
            save_file({k: saved[k] for k in ("input_ids", "labels", "attention_mask")},
                      str(batches / f"step_{step:06d}.safetensors"))
        data["config"]["batches"]["folder"] = str(batches)

    out = ["--loss_output_dir", str(tmp_path / "out"), "--storage_path", str(tmp_path / "ck")]
    documents = [int(((s["position_ids"] == 0) & (s["attention_mask"] == 1)).sum())
                 for s in (_saved_step(runs["hf"], _record(runs["hf"], "hf_trainer"), k) for k in range(STEPS))]
    most = min(documents)  # each document alone: the most pieces the fewest documents a step holds go into
    fewest = documents.index(most)
    cases = [
        (_edited(runs, tmp_path / "a", flash), [],
         "error: --replay_record loss_hf_trainer.json: the run computed attention with flash_attention_2, which the "
         "replay cannot run here (it needs a CUDA device, and the replay runs on cpu): replay it where it runs, or "
         "record the run with attn_implementation='sdpa'"),
        (str(runs["hf"] / "loss_hf_trainer.json"), ["--num_workers", str(most + 1)],
         f"error: --replay_record loss_hf_trainer.json: --num_workers {most + 1}: step {fewest}: its 2 rows cannot be "
         f"cut at document boundaries into a multiple of {most + 1} (at most {most} pieces): use "),
        (_edited(runs, tmp_path / "b", without_positions), [],
         "error: --replay_record loss_hf_trainer.json: step 0 fed position ids of its own, which its batch does not "
         "hold (recorded before the recorder kept them): record the run again"),
    ]
    for record, extra, expected in cases:
        code, lines = _train_ddp([*out, "--replay_record", record, *extra], capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), lines
    assert not (tmp_path / "out").exists()


def test_cut_points_and_the_stream_hash():
    """Without processes: a row is cut only where a document starts (its position id restarts) with label −100, and
    only where the model kept its documents apart (position ids, no mask, no cache); its pieces hash as the row, hold
    its loss tokens and feed each document with its own position ids; where the documents do not go round, the line
    names the worker counts that do."""
    from parity.training.data import Batch, batch_hash
    from parity.training.fed_rows import FED_CACHE, FED_MASK, FED_POSITIONS, cut_points, units

    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 4, 2, 7], [11, 12, 13, 0, 0, 0, 0, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 0, 0, 0, 0, 0, 0]])
    labels = ids.clone()
    labels[0, [0, 4]] = -100  # the third document's first label is a real one: no cut there
    labels[1, 0], labels[1, 3:] = -100, -100
    mask = torch.tensor([[1] * 9, [1, 1, 1] + [0] * 6])
    fed = torch.tensor([FED_POSITIONS, FED_POSITIONS])
    assert cut_points(labels[0], positions[0], FED_POSITIONS, 9) == [4]
    assert cut_points(labels[0], positions[0], FED_POSITIONS | FED_MASK, 9) == []
    assert cut_points(labels[0], positions[0], FED_POSITIONS | FED_CACHE, 9) == []
    whole = Batch(ids, labels, None, mask, positions, fed)
    table = units(ids, labels, mask, positions, fed, 3, "step 0")
    pieces = Batch(table[0], table[1], None, *table[2:])
    assert pieces.input_ids.tolist() == [[5, 6, 7, 8, 0], [9, 3, 4, 2, 7], [11, 12, 13, 0, 0]]
    assert batch_hash(pieces) == batch_hash(whole) and pieces.loss_tokens == whole.loss_tokens
    fed_rows = pieces.split(1)
    assert [m.input_ids.shape[1] for m in fed_rows] == [4, 5, 3] and all(m.attention_mask is None for m in fed_rows)
    assert fed_rows[1].position_ids.tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(ValueError) as refused:
        units(ids, labels, mask, positions, fed, 4, "step 0")
    assert str(refused.value) == ("step 0: its 2 rows cannot be cut at document boundaries into a multiple of 4 (at "
                                  "most 3 pieces): use 1, 2, 3 workers")


def test_the_cache_flag_follows_activation_checkpointing_without_a_warning_a_step(tmp_path):
    """In a gloo group of one: a row fed with the model config's use_cache is recorded with its cache, except where
    the model checkpoints its activations in training (transformers turns the cache off there). transformers 5.23 reads
    that as is_activation_checkpointing; its old name, is_gradient_checkpointing, warns at every read — one
    FutureWarning a micro-batch in the user's log — so the recorder's view reads the new one, once a step (it walks
    every module): within a step a change is not seen, after step_done() it is."""
    import warnings

    import torch.distributed as dist

    from parity.models.model import build_model, resolve_model_config
    from parity.recording.rows import taken
    from parity.training.fed_rows import FED_CACHE
    from parity.views.data_parallel import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = build_model(resolve_model_config("qwen2-tiny", None), 0)
        view = DataParallel(model, torch.optim.AdamW(model.parameters()))
        ids = torch.tensor([[5, 6, 7, 8]])
        for checkpointed, training, cached in ((False, True, True), (True, True, False), (True, False, True)):
            model.train(training)
            if checkpointed:
                model.gradient_checkpointing_enable()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                row = taken(ids, ids, None, None, None, view)
            assert bool(row.flags & FED_CACHE) == cached, (checkpointed, training)
            assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []
            model.gradient_checkpointing_disable()  # within the step: still read as it was
            assert bool(taken(ids, ids, None, None, None, view).flags & FED_CACHE) == cached
            view.step_done()
            assert bool(taken(ids, ids, None, None, None, view).flags & FED_CACHE)  # the next step reads it again
            view.step_done()
    finally:
        dist.destroy_process_group()


def test_a_steps_rows_and_loss_sum_leave_their_device_in_one_copy_as_fed():
    """Without processes: a micro-batch's ids, labels, mask and its own position ids are taken as int64 copies of
    their own (a loop that refills its input buffer in place before the step ends changes nothing recorded), left on
    their device; at the step's end rows.on_host takes every row and the float64 loss sum off it in one copy (on a GPU,
    one wait a step). Here on the CPU with every tensor made to leave (the path a GPU's take): each row and the sum
    arrive as they were, bit for bit, in their shapes, and alias nothing of the loop's."""
    from parity.recording.rows import on_host, taken
    from parity.training.fed_rows import FED_POSITIONS

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
    labels = torch.tensor([[-100, 6, 7, 8], [-100, -100, 11, 12]])
    mask, positions = torch.ones(2, 4, dtype=torch.bool), torch.tensor([[0, 1, 0, 1]])
    first = taken(ids, labels, mask, None, False, None)
    second = taken(ids[:1, :3], labels[:1, :3], None, positions[:, :3], False, None)
    ids.fill_(0), labels.fill_(0), mask.fill_(False), positions.fill_(7)  # the loop's buffers, refilled
    assert [first.ids.dtype, first.mask.dtype] == [torch.int64, torch.int64] and second.flags & FED_POSITIONS
    loss = torch.tensor(7.25, dtype=torch.float64) + 1e-15
    moved, summed = on_host([first, second], loss, leaving=lambda t: True)
    assert summed == float(loss) and isinstance(summed, float)
    assert moved[0].ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert moved[0].labels[1].tolist() == [-100, -100, 11, 12]
    assert moved[0].mask.tolist() == [[1] * 4] * 2 and moved[1].ids.tolist() == [[5, 6, 7]]
    assert moved[1].mask.tolist() == [[1, 1, 1]] and moved[1].positions.tolist() == [[0, 1, 0]]
    held = {t.untyped_storage().data_ptr() for m in (first, second) for t in m[:4] if t is not None}
    assert not held & {t.untyped_storage().data_ptr() for m in moved for t in m[:4] if t is not None}
    assert on_host([first], 3.5) == ([first], 3.5)  # nothing on a device: as it was
