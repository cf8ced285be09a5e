"""Checkpoints, resume and replay through real Ray Train jobs on CPU.

- A worker killed once at a known step and the run resumed on the uninterrupted run's curve, in each strategy of the
  main job: tests/test_main_script.py.
- The layer check replays a step of the DDP baseline from its checkpoint (or from before it): DDP reproduces
  the baseline's step, DeepSpeed and FSDP match it tensor by tensor, and a fault planted at that step in
  FSDP is named.
- Faults, each with its line: a damaged checkpoint (passed over for the one before it, in the resume after a storage
  that refused a checkpoint; or none intact), a checkpoint of another configuration, strategy or initial weights, a
  storage that refuses a checkpoint and a loss record that cannot be written, mid-run.

The runs are the session's (**PARITY: 12 steps, a checkpoint every 4, the last two kept: steps 8 and 12),
copied where a test damages them.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

import fault_hooks
import step_metrics
from conftest import FP32_RTOL, PARITY, REPO, assert_same_curve, series, to_argv
from parity.commands.layer_check import main as layer_check
from parity.commands.train import main as train_main
from parity.comparing.tolerances import RESUMED_FP32
from parity.training.checkpoints import damage
from parity.training.record import load_record
from parity.training.tensor_series import load_series
from tracker_readers import as_float32, tensorboard, tensorboard_series

DDP = {"model_name": "qwen2-tiny", "seq_length": 64, "num_workers": 2, "batch_size": 2, "precision": "fp32", **PARITY}
AFTER_A_FAILED_WRITE = ("the run stopped; its previous checkpoint and the loss record up to it are kept: make room "
                        "(or make it writable) and run the same command again with --resume to continue")


def run_folder(record) -> str:
    return os.path.join(record["config"]["storage_path"], record["config"]["experiment_name"])


def copy_run(record, tmp_path) -> str:
    """The run's folder (its checkpoints, and Ray Train's list of them) copied to tmp_path/ray/<name>."""
    destination = str(tmp_path / "ray" / record["config"]["experiment_name"])
    shutil.copytree(run_folder(record), destination)
    return destination


def rewrite_meta(checkpoint: str, edit) -> dict:
    """The checkpoint's meta as `edit` returns it, with rank 0's manifest vouching for it again (a checkpoint
    written so by other code, not a damaged one); returns the meta as it was."""
    from parity.training.checkpoints import META_FILE, manifest_name
    from parity.models.model import file_sha256

    meta_path, manifest_path = os.path.join(checkpoint, META_FILE), os.path.join(checkpoint, manifest_name(0))
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump(edit(meta), f)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][META_FILE] = [os.path.getsize(meta_path), file_sha256(meta_path)]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return meta


def ddp_argv(tmp_path, weights, **over) -> list[str]:
    return to_argv({**DDP, "init_weights_path": weights, "loss_output_dir": tmp_path / "loss",
                    "storage_path": tmp_path / "ray", **over})


def stderr_errors(text: str) -> list[str]:
    """The `error:` lines (Ray's workers print to the driver's stderr too)."""
    return [line for line in text.splitlines() if line.startswith("error:")]


# --- replaying a step layer by layer -----------------------------------------------------------------

def replay(out, record, step: int, **flags) -> int:
    """The layer check's replay of `record`'s step, in gloo processes of this machine (what is tested is the step
    the checkpoint restores, to which Ray adds nothing)."""
    return layer_check(to_argv({"output_dir": out, "replay": run_folder(record), "step": step, "device": "cpu",
                                "launcher": "local", **flags}))


def dump_meta(out, strategy: str) -> dict:
    with open(os.path.join(out, f"dump_{strategy}.json")) as f:
        return json.load(f)


def assert_replays_the_baseline(meta: dict, baseline: dict, step: int) -> None:
    """DDP, started from the baseline's own state, computes the baseline's step again."""
    recorded = baseline["steps"][step]
    assert meta["loss"] == pytest.approx(recorded["loss"], rel=RESUMED_FP32)
    assert meta["dp_rank_losses"] == pytest.approx(recorded["dp_rank_losses"], rel=RESUMED_FP32)
    assert meta["grad_norm"] == pytest.approx(recorded["grad_norm"], rel=RESUMED_FP32)


@pytest.fixture(scope="module")
def replay_step_8(ddp_baseline, tmp_path_factory):
    """Step 8 of the DDP baseline replayed under every strategy from its checkpoint of step 8: the baseline's
    weights and AdamW state, each strategy in its own sharded form."""
    out = str(tmp_path_factory.mktemp("replay_step_8"))
    return out, replay(out, ddp_baseline, 8)


def test_a_replayed_step_is_the_baselines_step_under_every_strategy(replay_step_8, ddp_baseline):
    out, code = replay_step_8
    assert code == 0
    start = {"run": run_folder(ddp_baseline), "checkpoint": os.path.join(run_folder(ddp_baseline), "step_000008"),
             "from_step": 8, "step": 8}
    metas = {s: dump_meta(out, s) for s in ("ddp", "deepspeed", "fsdp")}
    assert all(meta["replay"] == start for meta in metas.values())
    assert (metas["deepspeed"]["tp_size"], metas["deepspeed"]["dp_size"], metas["ddp"]["dp_size"]) == (2, 2, 2)
    assert_replays_the_baseline(metas["ddp"], ddp_baseline, 8)
    with open(os.path.join(out, "layer_comparison.json")) as f:
        pairs = json.load(f)["pairs"]
    assert len(pairs) == 3
    for pair in pairs:  # every tensor, the updated parameters (AdamW's moments at work) included
        assert pair["verdict"] == "PASS" and max(r["rel"] for r in pair["rows"]) < FP32_RTOL
        assert {r["kind"] for r in pair["rows"]} == {"output", "output_grad", "grad", "param"}


@pytest.mark.parametrize("step,start", [(10, 8), (3, 0)])
def test_a_step_after_the_checkpoint_is_reached_by_training_to_it(ddp_baseline, tmp_path, step, start):
    """Step 10 from the checkpoint of step 8, and step 3 from the initial weights (no checkpoint at or before
    it is kept): DDP trains the steps between and records the baseline's step."""
    assert replay(tmp_path, ddp_baseline, step, strategy="ddp") == 0
    meta = dump_meta(tmp_path, "ddp")
    checkpoint = os.path.join(run_folder(ddp_baseline), "step_000008") if start else None
    assert meta["replay"] == {"run": run_folder(ddp_baseline), "checkpoint": checkpoint, "from_step": start,
                              "step": step}
    assert_replays_the_baseline(meta, ddp_baseline, step)


def test_a_fault_at_the_replayed_step_is_named(replay_step_8, ddp_baseline, tmp_path):
    """1e-3 added to TP rank 0's shard of one weight in FSDP's replay, at step 8: the check names the module."""
    src, _ = replay_step_8
    for name in ("init_weights.safetensors", "inputs.safetensors", "optimizer_state.safetensors", "replay.json",
                 "dump_ddp.safetensors", "dump_ddp.json"):
        shutil.copy(os.path.join(src, name), tmp_path)
    code = replay(tmp_path, ddp_baseline, 8, strategy="fsdp", perturb="fsdp:model.layers.1.mlp.up_proj.weight")
    assert code == 1
    with open(tmp_path / "layer_comparison.json") as f:
        (pair,) = json.load(f)["pairs"]
    assert (pair["run"], pair["reference"], pair["verdict"]) == ("fsdp", "ddp", "FAIL")
    assert (pair["first_outside"]["module"], pair["first_outside"]["quantity"]) == ("model.layers.1.mlp.up_proj",
                                                                                     "forward output")


def test_a_replay_that_cannot_be_started_is_one_line(ddp_baseline, fsdp_tp2_dp2, tmp_path, capsys):
    ddp, fsdp = run_folder(ddp_baseline), run_folder(fsdp_tp2_dp2)
    cases = [
        ({"step": 3}, "--step is the step of a replay: add --replay RUN_DIR (the baseline's run folder)"),
        ({"replay": ddp}, "--replay needs --step: the step to record (the loss-curve verdict names it)"),
        ({"replay": ddp, "step": 3, "seq_length": 128}, "--seq_length comes from the run in a replay: drop it"),
        ({"replay": str(tmp_path), "step": 3}, f"--replay {tmp_path}: no checkpoint of a training run there (a run "
         f"folder is <storage_path>/<experiment_name>): train the baseline with --checkpoint_interval"),
        ({"replay": fsdp, "step": 3}, f"--replay {fsdp} holds fsdp checkpoints: a replay starts from the DDP "
                                      f"baseline's"),
        ({"replay": ddp, "step": 12}, f"--step 12 is not a step of {ddp} (0 to 11)"),
        ({"replay": "s3://bucket/runs/ddp", "step": 3}, "--replay s3://bucket/runs/ddp: a replay reads the run's "
         "checkpoints from a folder of this machine: copy the run folder here (or use a shared mount) and pass its path"),
        ({"replay": ddp, "step": 3, "dp_size": 3}, "--dp_size 3 × --batch_size 1 is not the run's global batch (4): "
                                                   "a replay keeps it"),
    ]
    for flags, line in cases:
        assert layer_check(to_argv({"output_dir": tmp_path / "out", "device": "cpu", **flags})) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "out" / "init_weights.safetensors").exists()


# --- faults ------------------------------------------------------------------------------------------

def test_no_intact_checkpoint_stops_with_one_line(ddp_baseline, tiny_weights, tmp_path, capsys):
    folder = copy_run(ddp_baseline, tmp_path)
    for step in sorted(n for n in os.listdir(folder) if n.startswith("step_")):  # every one the group kept
        with open(os.path.join(folder, step, "model_optimizer.pt"), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0xFF]))
    assert train_main("ddp", argv=ddp_argv(tmp_path, tiny_weights, resume=True)) == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {folder} holds no intact checkpoint to continue ({folder}/step_000012: model_optimizer.pt "
        f"does not match the sha256 in its manifest): drop --resume to start the run afresh\n")
    assert not (tmp_path / "loss").exists()


def test_a_checkpoint_of_another_run_is_refused(ddp_baseline, tiny_weights, tmp_path, capsys):
    """--resume over another learning rate, another strategy under the same run name, other code, or a finished
    run: one line before Ray starts a worker. Other initial weights are found by the workers, which hash the
    file: one line, and no retry."""
    folder = copy_run(ddp_baseline, tmp_path)
    assert train_main("ddp", argv=ddp_argv(tmp_path, tiny_weights, learning_rate=2e-4, resume=True)) == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {folder}/step_000012 is a checkpoint of another run (learning_rate 0.0001 there, 0.0002 "
        f"here): use the run's own flags, or drop --resume to start this one afresh\n")
    assert train_main("fsdp", argv=ddp_argv(tmp_path, tiny_weights, experiment_name="ddp_tp1_dp2", resume=True)) == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {folder}/step_000012 is a checkpoint of another run (options {{}} there, "
        f"{{'mixed_precision': None, 'offload': 'none', 'param_dtype': None, 'tp_plan': 'default'}} here; strategy "
        f"'ddp' there, 'fsdp' here): use the run's own flags, or drop --resume "
        f"to start this one afresh\n")
    assert train_main("ddp", argv=ddp_argv(tmp_path, tiny_weights, resume=True)) == 2
    assert capsys.readouterr().err == (f"error: --resume: {folder} holds a finished run (12 of 12 steps): nothing to "
                                       f"continue; drop --resume to train it again\n")

    state = os.path.join(folder, "step_000012", "model_optimizer.pt")  # damaged: the newest intact one is step 8's,
    os.truncate(state, os.path.getsize(state) // 2)  # an unfinished run's
    meta = rewrite_meta(os.path.join(folder, "step_000008"), lambda m: m)
    ours = meta["fingerprint"]["shared_code_sha256"]
    rewrite_meta(os.path.join(folder, "step_000008"),
                 lambda m: {**m, "fingerprint": {**m["fingerprint"], "shared_code_sha256": "e" * 64}})
    assert train_main("ddp", argv=ddp_argv(tmp_path, tiny_weights, resume=True)) == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {folder}/step_000008 was written by other code (shared code eeeeeeeeeeee vs {ours[:12]}): "
        f"drop --resume to train afresh with this code\n")
    rewrite_meta(os.path.join(folder, "step_000008"), lambda m: meta)

    from parity.models.model import build_model, resolve_model_config, save_init_weights

    other = str(tmp_path / "other_weights.pt")
    sha = save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed=7), other)
    assert train_main("ddp", argv=ddp_argv(tmp_path, other, resume=True)) == 1
    (line,) = stderr_errors(capsys.readouterr().err)
    assert line.endswith(
        f"checkpoint {folder}/step_000008 was written by another run (initial weights sha256 "
        f"{ddp_baseline['config']['init_weights_sha256'][:12]}… there, {sha[:12]}… here): run again without --resume "
        f"to start afresh")


def test_a_changed_strategy_over_a_finished_run_trains_again_on_a_quiet_terminal(ddp_baseline, tiny_weights, tmp_path):
    """The same command after the strategy changed (a test copy of ddp_strategy.py on PYTHONPATH that steps at
    twice the learning rate), over the folder of the finished baseline run: the run folder is replaced, in one
    line, the record holds the new numbers and the new code's fingerprint. The terminal holds the harness's
    lines only; Ray's, DeepSpeed's and torch's are in the run's log file."""
    copy_run(ddp_baseline, tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "ddp_strategy.py").write_text(fault_hooks.DOUBLE_LR.format(path=os.path.join(REPO, "ddp_strategy.py")))
    proc = train_with_fault(tmp_path, str(hooks), *ddp_argv(tmp_path, tiny_weights, debug_steps=6, log_interval=2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = str(tmp_path / "ray" / "ddp_tp1_dp2")
    log = tmp_path / "loss" / "logs" / "ddp_tp1_dp2.log"
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines[0] == f"[ddp] replaced {folder}: it held a finished run (12 steps); this run starts afresh"
    assert len(lines) == 8 and lines[1].startswith("[ddp] training 6 steps"), lines
    assert [line.split(" (")[0] for line in lines[2:5]] == ["[ddp] step 2/6", "[ddp] step 4/6", "[ddp] step 6/6"]
    assert lines[-2] == f"[ddp] Ray's, DeepSpeed's and torch's output: {log} (--verbose shows it on the terminal)"
    assert all(line.startswith("[ddp] ") for line in lines)  # none of Ray's: they are in the log
    text = log.read_text()
    assert "(RayTrainWorker pid=" in text and "Started a local Ray instance" in text
    record = load_record(str(tmp_path / "loss" / "loss_ddp.json"))
    assert record["resumes"] == [] and len(record["steps"]) == 6
    assert series(record, "loss")[0] == ddp_baseline["steps"][0]["loss"]  # the same start ...
    assert abs(series(record, "loss")[2] / ddp_baseline["steps"][2]["loss"] - 1) > 1e-4  # ... and the new steps
    assert record["config"]["fingerprint"]["strategy_code"] != ddp_baseline["config"]["fingerprint"]["strategy_code"]


def train_with_fault(tmp_path, hooks: str, *flags: str) -> subprocess.CompletedProcess:
    """train_ddp.py's run (python -m, so the test copy on PYTHONPATH comes before the repository's module) on
    its own Ray cluster, with a test copy of ddp_strategy.py on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (hooks, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "parity.commands.train", "ddp", *flags], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=1200)


def train_faulty(monkeypatch, hooks: str, module: str, *flags: str) -> int:
    """train_ddp.py's run in this process, on the session's Ray cluster, with a faulty copy of ddp_strategy.py as
    the user's own strategy class (`module`.DDPStrategy in `hooks`, which Ray Train ships to the workers): what is
    tested is the harness's handling of the fault, for which a Ray cluster of the command's own adds nothing."""
    monkeypatch.syspath_prepend(hooks)
    return train_main("ddp", argv=[*flags, "--strategy_class", f"{module}:DDPStrategy"])


def test_a_death_without_retries_left_names_the_dead_rank(ray_cluster, tiny_weights, tmp_path, monkeypatch, capsys):
    """--max_failures 0: the run fails, and its line is rank 1's death, not rank 0's lost connection to it."""
    hooks = fault_hooks.kill_once(tmp_path / "hooks", "ddp", step=6, module="ddp_killed_without_retries")
    code = train_faulty(monkeypatch, hooks, "ddp_killed_without_retries",
                        *ddp_argv(tmp_path, tiny_weights, max_failures=0))
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    (line,) = stderr_errors(err)
    assert line.startswith("error: training failed: rank 1: The actor is dead because its worker process has died.")


def test_the_failed_line_is_the_rank_whose_own_error_it_was():
    """What the ranks of a failed group met, as Ray Train hands it over: whether rank 0 lost its connection to the
    dead rank before Ray tore the group down is a race (the run above cannot assert it), so the choice among the
    errors is asserted here on Ray's own exception types: the dead rank's error, not its peers' lost connections
    nor the health check that noticed, whatever the ranks' order."""
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from parity.driver.launch import _root_cause

    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:5001")
    noticed = WorkerHealthCheckFailedError("Worker health check failed.", ActorDiedError())
    died = ActorDiedError()
    for failures, expected in [({0: lost, 1: died}, f"rank 1: {died}"),
                               ({0: lost, 1: noticed, 2: died}, f"rank 2: {died}"),
                               ({0: noticed, 1: lost}, "rank 0: The actor died unexpectedly before finishing this task."),
                               ({0: lost, 1: lost}, f"rank 0: {lost}"),
                               ({1: ValueError("loss is nan"), 0: lost}, "rank 1: loss is nan")]:
        assert _root_cause(WorkerGroupError("errors", failures)) == expected, failures


def test_a_storage_that_refuses_a_checkpoint_stops_the_run_and_a_damaged_one_is_passed_over(
        ray_cluster, ddp_baseline, tiny_weights, tmp_path, monkeypatch, capsys):
    """From the checkpoint of step 12 on, no file may grow beyond 1 MB: Ray Train's copy of the 7.5 MB state into the
    storage fails. One line; the partial copy removed, the checkpoints of steps 4 and 8 and the record up to step 8
    kept. Then half of step 8's state cut off: the same command with --resume passes it over for the one before it
    (step 4), says so in its record, reports its checkpoints (with their steps' metrics: Ray Train's report frequency)
    to a logger callback, names the new checkpoint of step 8 beside the damaged one, and ends on the uninterrupted
    curve. It resumes with a tracker the run had not (--report_to is not part of a run's identity): a new TensorBoard
    run, with the checkpoint's steps and the new ones, each once."""
    import ray.cloudpickle

    module = "ddp_storage_refusing"  # above the checkpoint's own ~70 kB parity_checkpoint.json, below its state
    hooks = fault_hooks.file_size_limit(tmp_path / "hooks", "ddp", "save_state", call=2, before=False, limit=1 << 20,
                                        module=module)
    code = train_faulty(monkeypatch, hooks, module, *ddp_argv(tmp_path, tiny_weights))
    err = capsys.readouterr().err
    folder = str(tmp_path / "ray" / "ddp_tp1_dp2")
    assert code == 1, err[-3000:]
    assert stderr_errors(err) == [
        f"error: training failed: cannot write the checkpoint of step 12 to {folder}/step_000012 (File too large): "
        f"{AFTER_A_FAILED_WRITE}"]
    assert not os.path.exists(os.path.join(folder, "step_000012"))
    assert all(damage(os.path.join(folder, f"step_00000{k}"), 2, [0, 1]) is None for k in (4, 8))
    kept = load_record(str(tmp_path / "loss" / "loss_ddp.json"))
    assert (len(kept["steps"]), kept["complete"]) == (8, False)

    # step 8's checkpoint damaged; the same command with --resume (the same code: the fault struck once)
    state = os.path.join(folder, "step_000008", "model_optimizer.pt")
    size = os.path.getsize(state)
    os.truncate(state, size // 2)
    monkeypatch.setenv("RAY_TRAIN_CALLBACKS", "step_metrics.StepMetrics")
    monkeypatch.setenv(step_metrics.PATH_ENV, str(tmp_path / "reports.jsonl"))
    ray.cloudpickle.register_pickle_by_value(step_metrics)  # Ray Train's controller runs it; it cannot import tests/
    code = train_faulty(monkeypatch, hooks, module, *ddp_argv(tmp_path, tiny_weights, resume=True,
                                                              report_to="tensorboard"))
    assert code == 0, capsys.readouterr().err[-3000:]
    record = load_record(str(tmp_path / "loss" / "loss_ddp.json"))
    assert record["resumes"] == [{"checkpoint": os.path.join(folder, "step_000004"), "step": 4, "skipped": [
        f"{os.path.join(folder, 'step_000008')}: model_optimizer.pt has {size // 2} bytes, its manifest says {size}"]}]
    assert_same_curve(record, ddp_baseline)
    assert tensorboard_series(tensorboard(record), "loss") == list(zip(range(12), as_float32(series(record, "loss"))))
    assert series(record, "step_time_s")[:4] == series(kept, "step_time_s")[:4]  # kept by the checkpoint
    with open(tmp_path / "reports.jsonl") as f:
        reports = [json.loads(line) for line in f]
    assert [r["metrics"]["step"] for r in reports] == [7, 11]
    assert [r["metrics"]["loss"] for r in reports] == [series(record, "loss")[k] for k in (7, 11)]
    assert [r["metrics"]["lr"] for r in reports] == [1e-4] * 2
    assert [r["checkpoint"] for r in reports] == [os.path.join(folder, "step_000008.1"),
                                                  os.path.join(folder, "step_000012")]
    assert damage(os.path.join(folder, "step_000012"), 2, [0, 1]) is None


def test_a_loss_record_that_cannot_be_written_stops_the_run(ray_cluster, tiny_weights, tmp_path, monkeypatch, capsys):
    """After step 4 (its checkpoint written, the record rewritten every 2 steps) files may not grow beyond 4 kB:
    the record of step 6 cannot be written. One line; the record of step 4 kept, nothing half-written."""
    module = "ddp_record_unwritable"
    hooks = fault_hooks.file_size_limit(tmp_path / "hooks", "ddp", "train_step", call=5, before=True, limit=4096,
                                        module=module)
    code = train_faulty(monkeypatch, hooks, module, *ddp_argv(tmp_path, tiny_weights, log_interval=2))
    err = capsys.readouterr().err
    record_path = tmp_path / "loss" / "loss_ddp.json"
    assert code == 1, err[-3000:]
    assert stderr_errors(err) == [
        f"error: training failed: cannot write the loss record {record_path} (File too large): {AFTER_A_FAILED_WRITE}"]
    kept = load_record(str(record_path))
    assert (len(kept["steps"]), kept["complete"]) == (4, False)
    # the record, its every-tensor series (whose chunks are written before the record that lists them) and the log
    assert sorted(os.listdir(tmp_path / "loss")) == ["logs", "loss_ddp.json", "loss_ddp.tensors"]
    assert len(load_series(str(record_path), kept).grad_norm) == 4  # the kept record's 4 steps, each chunk whole
    assert damage(str(tmp_path / "ray" / "ddp_tp1_dp2" / "step_000004"), 2, [0, 1]) is None
