"""What plot_loss_curves.py reports of a recorded run (your own trainer: parity/recording/recorder.py) against its
replay (train_ddp.py --replay_record) or against another recorded run of the same script, on hand-made records (no
training): a bit-exact replay, the config fields a FAIL lists, the fingerprint line, a record that stopped early, a
run that resumed from its checkpoint."""

from __future__ import annotations

import json
from html import escape

import pytest

from parity.commands.compare_curves import compare_and_report, main
from parity.training.record import LossRecord, record_path
from test_compare import write_series

SHA = "5" * 64
EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # the sha256 of nothing
SCRIPT_SHA = "c" * 64
MODEL = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 2048,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
OPTIMIZER = {"type": "AdamW", "groups": [
    {"params": ["model.embed_tokens.weight"], "lr_scale": 1.0, "weight_decay": 0.01, "betas": [0.9, 0.999],
     "eps": 1e-8},
    {"params": ["model.norm.weight"], "lr_scale": 1.0, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}]}
LRS = [1e-4, 2e-4, 3e-4, 3e-4, 3e-4]
LOSSES = [10.0, 8.0, 6.0, 5.0, 4.0]
SHARED = {"shared_code_sha256": "a" * 64, "versions": {"python": "3.11.7", "torch": "2.13.0"}, "device": "a test CPU",
          "model_type": "qwen2"}
FRAMEWORK = {"name": "lightning", "versions": {"lightning": "2.6.6", "transformers": "5.23.0"}, "script": "train_lm.py",
             "script_sha256": SCRIPT_SHA}
BATCHES = "/runs/recorded_{name}/batches"


def recorded_config(name: str, **changes) -> dict:
    """A recorder's config, shaped as examples/plain_loop.py's record (2 ranks, 2 micro-batches of 2 rows each)."""
    return {"source": "recorder", "framework": "lightning", "strategy": name, "strategy_path": None,
            "model_name": f"/runs/recorded_{name}", "model_type": "qwen2", "hugging_face_model": True, "tp_size": 1,
            "pp_size": 1, "ep_size": 1, "dp_size": 2, "sharding": {"kind": "data parallel", "zero_stage": 0},
            "num_workers": 2, "world_size": 2, "batch_size": 4, "global_batch_size": 8, "grad_accum_steps": 2,
            "seq_length": 32, "precision": "fp32", "reduce_dtype": "fp32", "grad_accum_dtype": "fp32",
            "loss_scaling": None, "total_steps": len(LOSSES), "init_weights_sha256": SHA,
            "init_weights_path": f"/runs/recorded_{name}/init_weights.safetensors", "model_config": dict(MODEL),
            "learning_rate": 3e-4, "max_grad_norm": 1.0, "weight_decay": 0.01, "adam_beta1": 0.9,
            "adam_beta2": 0.999, "adam_epsilon": 1e-8, "optimizer": OPTIMIZER, "grad_norm_source": "recorder",
            "loss_source": "recorder", "batches": {"folder": BATCHES.format(name=name), "max_bytes": 1 << 30,
                                                   "saved_steps": len(LOSSES), "replayable": True,
                                                   "not_replayable": None, "micro_batches": [[2, 2], [2, 2]]},
            "device_type": "cpu", "device_name": "x86_64", "backend": "nccl",
            "fingerprint": {**SHARED, "strategy_code": {"sha256": EMPTY_SHA, "files": []}, "framework": FRAMEWORK},
            **changes}


def replay_config(of: str, **changes) -> dict:
    """train_ddp.py --replay_record's config of the record `of`: what the replay takes from it, and the harness's own
    fields beside (seed, dataset, schedule, places ...), shaped as a real replay's."""
    recorded = recorded_config(of)
    taken = {k: recorded[k] for k in ("model_name", "precision", "reduce_dtype", "grad_accum_dtype", "loss_scaling",
                                      "init_weights_sha256", "init_weights_path", "model_config", "max_grad_norm",
                                      "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optimizer",
                                      "total_steps", "device_type", "device_name")}
    return {**taken, "strategy": "ddp", "strategy_class": None, "strategy_path": "ddp_strategy:DDPStrategy",
            "num_layers": None, "num_workers": 2, "tp_size": 1, "dp_size": 2, "pp_size": 1, "ep_size": 1,
            "device": "cpu", "cpus_per_worker": 1.0, "batch_size": 4, "seq_length": 32, "grad_accum_steps": 2,
            "activation_checkpointing": False, "compile": False, "num_epochs": 1, "debug_steps": len(LOSSES),
            "learning_rate": max(LRS), "warmup_steps": 0, "seed": 42, "dataset": "recorded:" + BATCHES.format(name=of),
            "num_samples": 10000, "tokenizer": f"/runs/recorded_{of}", "log_interval": 10,
            "replica_check_interval": 1, "loss_output_dir": "/runs", "report_to": [], "storage_path": "/runs/ck",
            "experiment_name": "ddp_tp1_dp2", "save_init_weights": False, "final_checkpoint_dir": "/runs/ck/final",
            "noise_reference": False, "checkpoint_interval": 0, "keep_checkpoints": 2, "resume": False,
            "max_failures": 1, "verbose": False, "options": {}, "lr_schedule": LRS, "tensor_grad": "pre_clip",
            "no_teacher_forced": False,
            "world_size": 2, "global_batch_size": 8, "worker_nodes": ["n0", "n0"], "steps_per_epoch": len(LOSSES),
            "dataset_description": f"the global batches of loss_{of}.json", "backend": "gloo",
            "memory_metric": "process_max_rss_since_run_start",
            "fingerprint": {**SHARED, "strategy_code": {"sha256": "b" * 64, "files": ["ddp_strategy.py"]}}, **changes}


def write(folder, name: str, config: dict, losses=LOSSES, step_fields=None, path=None, complete=True,
          tensors=None, gradient=None) -> str:
    """A record written by the harness's own writers: the given losses, every other curve flat, step i's rows hashed
    `i` (recorded runs carry the order-free rows_hash too); `step_fields` maps step → fields to override; `complete`
    False leaves it unfinished. Its tensor series (test_compare.write_series): a replay's pre-clip ones; a recorded
    run's none, as the recorder's record says today, unless `gradient` names which (`tensors`: step → {tensor: factor}
    on its gradient norms)."""
    record = LossRecord(path or record_path(str(folder), name), name, config)
    record.declare_replicas({"declared": True, "interval": 1, "groups": 78})
    recorded = config.get("source") == "recorder"
    for step, loss in enumerate(losses):
        fields = {"step": step, "loss": loss, "dp_rank_losses": [loss, loss], "grad_norm": 2.0, "param_norm": 20.0,
                  "lr": LRS[step], "tokens": 512, "batch_hash": f"{step:016x}", "step_time_s": 0.01,
                  "peak_memory_bytes": 1 << 20, "replicas": {"checked": 78, "parted": 0},
                  **({"rows_hash": f"rows{step}"} if recorded else {})}
        record.append(**{**fields, **(step_fields or {}).get(step, {})})
    if gradient or not recorded:
        write_series(record, tensors, gradient=gradient or "pre_clip")
    else:
        write_series(record, why="the recorder hands over no tensor's pieces")
    if complete:
        record.finish(eval_loss_last_batch=losses[-1], eval_batch_step=len(losses) - 1, checkpoint_dir="/nowhere")
    else:
        record.write()
    return record.path


def report(folder, capsys, baseline: str = "ddp") -> tuple[int, str, str, str]:
    """(exit code, terminal output, curve_report.md, report.html) of plot_loss_curves.py on `folder`."""
    code = compare_and_report(str(folder), str(folder / "out" / "curves.png"), baseline)
    out = capsys.readouterr().out
    return code, out, (folder / "out" / "curve_report.md").read_text(), (folder / "out" / "report.html").read_text()


def line_of(text: str, start: str) -> str:
    """The first line of `text` that starts with `start` once stripped."""
    return next(line for line in text.splitlines() if line.strip().startswith(start))


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_bit_exact_replay_passes_with_its_margin_exact(tmp_path, capsys, calibrated):
    """The recorded run equals its replay bit for bit: PASS, exit 0, no division by its deviation of 0; the margin reads
    exact in the terminal, curve_report.md and report.html, calibrated (deviation ÷ noise 0.0) or not (max relative
    diff 0)."""
    write(tmp_path, "my_run", recorded_config("my_run"))
    write(tmp_path, "ddp", replay_config("my_run"))
    if calibrated:
        write(tmp_path, "ddp", replay_config("my_run", noise_reference=True, num_workers=1, dp_size=1, batch_size=8),
              [10.0, 8.001, 6.0, 5.0, 4.0], path=str(tmp_path / "noise_reference_ddp_tp1_dp1_fp32.json"))
    code, out, md, html = report(tmp_path, capsys)
    assert code == 0
    details = line_of(out, "deviation ÷ noise" if calibrated else "rtol")
    assert "margin: exact (bit-identical)" in details
    assert "max relative diff loss 0.000e+00, grad norm 0.000e+00, param norm 0.000e+00" in details
    assert ("deviation ÷ noise 0.0 " in details) == calibrated
    assert "margin: exact (bit-identical)" in line_of(md, "| my_run")
    assert "margin: exact (bit-identical)" in html
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"]["my_run"]
    assert saved["bit_identical"] is True and saved["margin"] is None


def test_the_verdict_names_the_bound_that_held_and_reads_the_margin_against_it(tmp_path, capsys):
    """Calibrated in fp32, a curve's bound is the larger of 20 × its noise and the fixed table's (a floor:
    CALIBRATION_FLOORED). The line says which held where each curve came closest to it, and reads the margin against
    that: a grad norm 19.6 × its noise used 0.0047 of the table's 1e-4 (issue 80: it read "tolerance 20 × noise,
    margin 1.0×"); a loss 2 × its noise, 0.1 of 20 × noise, is the curve closest to its bound: margin 10×. The page,
    curve_report.md and curve_comparison.json say the same."""
    steps = range(len(LOSSES))
    write(tmp_path, "my_run", recorded_config("my_run"), [x * (1 + 2e-6) for x in LOSSES],
          {s: {"grad_norm": 2.0 * (1 + 4.7e-7)} for s in steps})
    write(tmp_path, "ddp", replay_config("my_run"))
    write(tmp_path, "ddp", replay_config("my_run", noise_reference=True, num_workers=1, dp_size=1, batch_size=8),
          [x * (1 + 1e-6) for x in LOSSES], {s: {"grad_norm": 2.0 * (1 + 2.4e-8)} for s in steps},
          path=str(tmp_path / "noise_reference_ddp_tp1_dp1_fp32.json"))
    code, out, md, html = report(tmp_path, capsys)
    assert code == 0, out
    details = line_of(out, "deviation ÷ noise").strip()
    assert details.startswith("deviation ÷ noise 19.6 (loss 2.0, grad norm 19.6, param norm 0.0); the bounds that held: "
                              "loss 0.1 of 20 × noise, grad norm 0.0047 of the fp32 table's floor 0.0001, param norm 0 "
                              "of the fp32 table's floor 1e-05; margin 10.0× (loss); "), details
    assert ("Bounds calibrated on noise_reference_ddp_tp1_dp1_fp32.json: 20 × the noise between them and the baseline at "
            "each step, never below the fixed fp32 table (a floor), no drift test") in out
    assert "| 19.6; margin 10.0× (loss) |" in line_of(md, "| my_run")
    assert escape("grad norm 19.6 × noise: 0.0047 of the fp32 table's floor 0.0001") in html
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"]["my_run"]
    held = saved["bounds_held"]
    assert held["grad_norm"]["held"] == "the fp32 table's floor 0.0001" and held["grad_norm"]["bound"] == 1e-4
    assert held["grad_norm"]["ratio"] == pytest.approx(4.7e-3, rel=1e-3) and held["loss"]["held"] == "20 × noise"
    assert saved["margin"] == pytest.approx(10.0, rel=1e-3) and max(saved["noise_ratio"].values()) > 19
    # uncalibrated, the one bound is the table's: its margin is read against it
    (tmp_path / "noise_reference_ddp_tp1_dp1_fp32.json").unlink()
    code, out, _, _ = report(tmp_path, capsys)
    assert line_of(out, "rtol").endswith("; margin 5.0× (loss)"), out


def test_a_replays_differences_are_what_it_takes_from_the_record(tmp_path, capsys):
    """A recorded run FAILs against its replay at step 2: 'differs from the baseline in:' lists none of the fields in
    which every recorded run differs from its replay by design (its files' paths among them: the record names them
    relative to itself, the replay where they are now), in the terminal, the JSON, the md and the page. Each field
    the replay copies (REPLAY_TAKES) is a comparability field besides: one that differed would make the two not
    comparable, ahead of any verdict."""
    write(tmp_path, "my_run", recorded_config("my_run"), [10.0, 8.0, 6.5, 5.0, 4.0])
    write(tmp_path, "ddp", replay_config("my_run", model_name="/elsewhere/recorded_my_run"))
    code, out, md, html = report(tmp_path, capsys)
    assert code == 1
    moved = "nothing recorded"
    line = line_of(out, "differs from the baseline in:")
    assert line.strip() == f"differs from the baseline in: {moved}"
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"]["my_run"]
    assert saved["config_differences"] == []
    for by_design in ("backend", "seed", "num_samples", "dataset", "strategy_path", "lr_schedule", "framework",
                      "sharding", "batches", "learning_rate", "source", "debug_steps"):
        assert f"{by_design}:" not in line and f"`{by_design}:" not in md and f">{by_design}<" not in html, by_design
    assert "model_name" not in line and "model_name" not in md


def test_replay_takes_is_what_plan_replay_reads():
    """REPLAY_TAKES, the one place that says which of a record's config fields a replay copies, is what plan_replay
    copies; the other fields its code reads are REPLAY_LOCATES': a field plan_replay starts (or stops) reading fails
    here until it is listed."""
    import ast
    import inspect

    from parity.replay import replay
    from parity.run_config import REPLAY_LOCATES

    tree = ast.parse(inspect.getsource(replay.plan_replay))
    read = {node.slice.value for node in ast.walk(tree) if isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name) and node.value.id == "config" and isinstance(node.slice, ast.Constant)}
    assert read == set(REPLAY_LOCATES) | {"optimizer"}  # the optimizer is checked before it is taken
    assert "REPLAY_TAKES" in inspect.getsource(replay.plan_replay)  # the rest it copies through that list


def test_a_recorded_runs_fingerprint_names_its_framework_and_script(tmp_path, capsys):
    """A recorded run has no strategy code (its strategy_code is the sha256 of nothing): its fingerprint line names the
    framework, its versions and the user's script with its sha256 instead, in the terminal, the md and the page."""
    write(tmp_path, "my_run", recorded_config("my_run"))
    write(tmp_path, "ddp", replay_config("my_run"))
    _, out, md, html = report(tmp_path, capsys)
    own = "framework lightning (lightning 2.6.6, transformers 5.23.0), script train_lm.py cccccccccccc"
    assert line_of(out, "loss_my_run.json:").strip() == (f"loss_my_run.json: qwen2; shared code aaaaaaaaaaaa, {own}; python "
                                                         f"3.11.7, torch 2.13.0; a test CPU")
    assert "strategy code bbbbbbbbbbbb (ddp_strategy.py)" in line_of(out, "loss_ddp.json:")
    assert EMPTY_SHA[:12] not in out and EMPTY_SHA[:12] not in md and EMPTY_SHA[:12] not in html
    assert f"| {own} |" in line_of(md, "| loss_my_run.json")
    for field, shown in (("framework.name", "lightning"), ("framework.versions.lightning", "2.6.6"),
                         ("framework.script", "train_lm.py"), ("framework.script_sha256", "cccccccccccc…")):
        row = next(r for r in html.split("<tr>") if f'<th scope="row">{field}</th>' in r)
        assert f"≠ {shown}</span>" in row, field


def test_a_record_that_stopped_early_says_where_and_why(tmp_path, capsys):
    """The recorder stopped at step 3 (config.stopped) and the replay trained steps 0–2: PASS over those 3 steps, exit 0,
    the verdict's lines, the md and the page say where and why — no 'incomplete' warning, even when the recorder left
    its record unfinished."""
    why = "step 3's batch could not be saved (No space left on device)"
    write(tmp_path, "my_run", recorded_config("my_run", stopped={"step": 3, "why": why}), LOSSES[:3], complete=False)
    write(tmp_path, "ddp", replay_config("my_run", debug_steps=3, total_steps=3, lr_schedule=LRS[:3]), LOSSES[:3])
    code = compare_and_report(str(tmp_path), str(tmp_path / "out" / "curves.png"))
    out, err = capsys.readouterr()
    assert code == 0 and "incomplete" not in out + err
    said = f"recorded up to step 3: {why}; steps 0…2 judged"
    verdict = out.split("my_run (TP=1, DP=2): PASS\n", 1)[1].splitlines()
    assert verdict[0] == f"  {said}"
    assert "3 steps compared" in (tmp_path / "out" / "curve_report.md").read_text()
    assert f"my_run (TP=1, DP=2): {said}" in (tmp_path / "out" / "curve_report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    assert escape(f"my_run (TP=1, DP=2): {said}.") in html.split('id="verdict"', 1)[1].split("</p>", 1)[0]
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())
    assert saved["runs"]["my_run"]["stopped"] == {"step": 3, "why": why} and saved["num_steps"] == 3


# Steps 3 and 4 of a run that resumed at step 3 and fed other rows from there (e.g. its sampler restarted its epoch).
OTHER_ROWS = {step: {"batch_hash": f"other{step}", "rows_hash": f"other_rows{step}", "tokens": 480} for step in (3, 4)}


@pytest.mark.parametrize("baseline", ["uninterrupted", "resumed"])
def test_rows_that_part_where_a_run_resumed_fail_there(tmp_path, capsys, baseline):
    """Two recorded runs of one script, one resumed from its checkpoint at step 3: the same rows before, others from
    step 3 on — FAIL at step 3 on resumed_rows (exit 1), in the terminal, the md and the page, whichever is the
    baseline."""
    write(tmp_path, "uninterrupted", recorded_config("uninterrupted"))
    write(tmp_path, "resumed", recorded_config("resumed", resumed_at=[3]), [10.0, 8.0, 6.0, 5.2, 4.4], OTHER_ROWS)
    code, out, md, html = report(tmp_path, capsys, baseline)
    assert code == 1
    other = "resumed" if baseline == "uninterrupted" else "uninterrupted"
    saved = json.loads((tmp_path / "out" / "curve_comparison.json").read_text())["against_baseline"][other]
    assert saved["first_outside"] == {"quantity": "resumed_rows", "rel_diff": 1.0, "tolerance": 0.0, "step": 3,
                                      "value": float(other == "resumed"), "reference": float(baseline == "resumed"),
                                      "test": "resumed_rows"}
    resumed, ran_on = ("this run", "the baseline") if other == "resumed" else ("the baseline", "this run")
    words = (f"{resumed} resumed from its checkpoint at step 3 and feeds other rows than {ran_on}, which ran on "
             f"uninterrupted, from step 3 on: its resume skipped or repeated data")
    assert line_of(out, "first step outside:").strip() == f"first step outside: step 3: {words}"
    assert "localise step" not in out  # a dump of step 3 would not show skipped data
    assert f"| {other} (TP=1, DP=2) | FAIL |" in md and "| step 3, resumed_rows (resumed_rows): " in md
    assert f"first step outside: step 3, {escape(words)}" in html.split('id="verdict"', 1)[1].split("</p>", 1)[0]


@pytest.mark.parametrize("case", ["never resumed", "another script", "both resumed there"])
def test_other_rows_without_a_resume_there_stay_not_comparable(tmp_path, capsys, case):
    """The same two runs' rows parting at step 3 where that is no resume's finding — neither resumed there, the runs are
    of different scripts, or both resumed there — are not comparable, as any two runs that see different batches: exit
    2, naming the step."""
    other_script = {"fingerprint": {**recorded_config("resumed")["fingerprint"],
                                    "framework": {**FRAMEWORK, "script_sha256": "d" * 64}}}
    config = {"never resumed": {}, "another script": {"resumed_at": [3], **other_script},
              "both resumed there": {"resumed_at": [3]}}[case]
    write(tmp_path, "uninterrupted", recorded_config("uninterrupted", **({"resumed_at": [3]}
                                                                          if case == "both resumed there" else {})))
    write(tmp_path, "resumed", recorded_config("resumed", **config), [10.0, 8.0, 6.0, 5.2, 4.4], OTHER_ROWS)
    code = main(["--input_dir", str(tmp_path), "--output", str(tmp_path / "out" / "curves.png"),
                 "--baseline", "uninterrupted"])
    err = capsys.readouterr().err
    assert code == 2
    assert "uninterrupted and resumed see different batches from step 3 (batch_hash 0000000000000003 vs other3)" in err
    assert "train on different tokens per step from step 3" in err


def test_a_fail_at_the_step_a_run_resumed_says_so(tmp_path, capsys):
    """A recorded run that resumed at step 2 against its replay (the same batches) FAILs at step 2 on the loss: its
    details, the md and the page add that the run resumed from its checkpoint there."""
    write(tmp_path, "my_run", recorded_config("my_run", resumed_at=[2]), [10.0, 8.0, 6.5, 5.0, 4.0])
    write(tmp_path, "ddp", replay_config("my_run"))
    code, out, md, html = report(tmp_path, capsys)
    assert code == 1
    details = out.split("my_run (TP=1, DP=2): FAIL\n", 1)[1].splitlines()
    outside = details.index(line_of(out, "first step outside: step 2: loss"))
    assert details[outside + 1] == "  the run resumed from its checkpoint at step 2"
    assert "my_run (TP=1, DP=2): the run resumed from its checkpoint at step 2." in md
    assert "<p>the run resumed from its checkpoint at step 2.</p>" in html
