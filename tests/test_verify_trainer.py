"""verify_trainer.py (docs/own_trainer/one_command.md#one-command): copies of the examples with their callback lines removed (the
ParityCallback's construction and its import), run under verify_trainer.py as `python COPY --output_dir X --nproc 2`:
Trainer (through the real command line, calibrated by default), TRL's SFTTrainer and Lightning (calibrated) PASS with
their pages written — every command, its replays and the runs without the harness under the perturbed kernel setting
(conftest.PERTURBED: MKL's compatible fp32 path, oneDNN's AVX512_CORE, one thread);
a copy that trains twice in one process without a launcher, clean and then with a seeded bug, has both records judged
in one comparison and exits 1; what each framework logged equals, bit for bit, what the same copy logs without the
harness; bad input is one line and exit 2, before the command runs where that can be known; each room's oldest
release recorded (TRL 0.29.0's GRPOTrainer, Lightning 2.6.0), installed beside the pinned set, PASSes, and a release
below it (TRL 0.28.0, Lightning 2.5.6) is one line of the recorder's while the run trains to its end, exit 0.

Each copy writes what its framework logged (Trainer's log_history, the loss each Lightning training_step returned)
into its own folder: the same lines in the run with the harness and in the one without it. The runs without it share
one gloo group of two ranks (one after another, as tests/test_own_trainer_frameworks.py records); the in-process
verifications share this process's forkserver (started once: the replays' local groups fork from it). Measured: 56–60
s on 2 shared cores, nearly all of it the four commands' own processes importing torch and their framework (the
command line's Trainer run 17 s, TRL 15 s, Lightning calibrated 12 s, the twice-trained Trainer 11 s, the runs
without the harness 3 s).

Lightning finds the recorder through pyproject.toml's entry point, which the shared editable install may predate: the
runs here see it through a distribution's metadata made from pyproject.toml itself, first on the children's path
(importlib.metadata takes the first distribution of a name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO, free_port, installed_beside, kernel_setting
from test_own_trainer import _record_rank

EXAMPLES = {"hf": "hf_trainer.py", "trl": "trl_sft.py", "lightning": "lightning_lm.py",
            "trl_posttrain": "trl_posttrain.py"}
STEPS = 3
# Each room's oldest release recorded (its FRAMEWORK's `oldest`), and a release below it, installed beside the pinned
# set (conftest.installed_beside): {run: (framework, release, copy, its arguments)}. TRL's oldest runs the issue's
# GRPOTrainer (dapo, 2 ranks); below it TRL 0.28.0's SFTTrainer (its GRPOTrainer does not import against transformers
# 5.23.0); Lightning's below, 2.5.6 (docs/own_trainer/one_command.md#the-releases-recorded). Those below train one rank, one step.
BELOW = ["--nproc", "1", "--steps", "1"]
RELEASES = {"trl_oldest": ("trl", "0.29.0", "trl_posttrain", ["--loss_type", "dapo", "--fp32"]),
            "lightning_oldest": ("lightning", "2.6.0", "lightning", []),
            "trl_below": ("trl", "0.28.0", "trl", BELOW),
            "lightning_below": ("lightning", "2.5.6", "lightning", BELOW)}
WRITE_LOG = '''

def _write_log(args, rank, entries) -> None:
    """What the framework logged, written for tests/test_verify_trainer.py (json keeps every float's bits)."""
    import json

    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"log_{rank}.json"), "w") as f:
        json.dump(entries, f)
'''
HF_LOG = [("    trainer.train()\n", "    trainer.train()\n    _write_log(args, os.environ.get(\"RANK\", \"0\"), "
                                     "trainer.state.log_history)\n")]
HF_TRAIN = ("    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)\n", "    trainer.train()\n")
# the callback lines removed, what each framework logged written out
EDITS = {
    "hf": [("from parity import ParityCallback\n", ""),
           ("callbacks=[ParityCallback(args.output_dir, name=args.name, dump_step=args.dump_step,\n"
            "                                                checkpoint_interval=args.checkpoint_interval),\n"
            "                                 *([StopAt(args.save_at)] if args.save_at else [])])",
            "callbacks=[StopAt(args.save_at)] if args.save_at else [])"),
           ("by ParityCallback", "by parity's callback"), HF_TRAIN, *HF_LOG],
    "trl": [("from parity import ParityCallback\n", ""),
            (",\n                         callbacks=[ParityCallback(args.output_dir, name=args.name)])", ")"),
            ("Trainer's ParityCallback", "Trainer's callback"), *HF_LOG],
    "lightning": [("from parity import ParityLightningCallback\n", ""),
                  ("callbacks=[] if args.no_record else [ParityLightningCallback(args.output_dir, name=args.name)])",
                   "callbacks=[])"),
                  ("parity's ParityLightningCallback", "parity's callback"),
                  ("            return loss\n",
                   "            LOSSES.append(float(loss.detach()))\n            return loss\n"),
                  ("    trainer.fit(module_class()(model, args, world), data)\n",
                   "    trainer.fit(module_class()(model, args, world), data)\n    _write_log(args, rank, LOSSES)\n"),
                  ("def parse_args(", "LOSSES = []\n\n\ndef parse_args(")],
    "trl_posttrain": [("from parity import ParityCallback\n", ""),
                      (",\n                          callbacks=[ParityCallback(args.output_dir, name=args.name)])",
                       ")"),
                      (",\n                             callbacks=[ParityCallback(args.output_dir, name=args.name)])",
                       ")"), ("Trainer's ParityCallback", "Trainer's callback")],
}
# One process without a launcher (--nproc 0: no torchrun variables, no gloo backend asked for; the callback starts a
# group of one) training twice: clean, then with the seeded bug, a compute_loss override that drops num_items_in_batch
# (as tests/test_own_trainer.py's hf_num_items); the second Trainer's record is named hf_twice_2
TWICE = [("    launch(train, parse_args(argv))\n",
          "    args = parse_args(argv)\n    train(args) if args.nproc == 0 else launch(train, args)  # one process\n"),
         ("ddp_backend=backend(args.device), ", ""),
         ("    trainer.train()\n", """    trainer.train()

    class Buggy(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs)

    Buggy(model=build_model(resolve_model_config("qwen2-tiny"), args.seed), args=training, train_dataset=data).train()
""")]


def _copy(root, source: str, name: str, edits) -> str:
    text = open(os.path.join(REPO, "examples", source)).read()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    main = '\n\nif __name__ == "__main__":'
    text = text.replace(main, WRITE_LOG + main)
    assert "ParityCallback" not in text and "parity.frameworks.transformers.callback" not in text
    path = root / f"{name}.py"
    path.write_text(text)
    return str(path)


def _entry_points(root) -> str:
    """A folder with parity-harness's metadata as pyproject.toml declares it today (its entry points)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dist = root / f"parity_harness-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
        for group, entries in project["entry-points"].items()))
    return str(root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit code, the verification's folder, the copy's own folder, its stdout+stderr or None)}, and "plain":
    {framework: the folder of the copy's run without the harness}."""
    root = tmp_path_factory.mktemp("verify_trainer")
    copies = {k: _copy(root, EXAMPLES[k], f"{k}_copy", EDITS[k]) for k in EXAMPLES}
    copies["twice"] = _copy(root, EXAMPLES["hf"], "hf_twice", EDITS["hf"] + TWICE)
    with kernel_setting():  # every command, replay and run without the harness under the perturbed kernels
        return _runs(root, copies)


def _runs(root, copies: dict) -> dict:
    from parity.commands.verify_trainer import verify
    from parity.driver.local_group import start_processes

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([_entry_points(root / "metadata"), REPO, *filter(None, [saved])])
    results = {}
    try:
        # the real command line once: Trainer
        out, own = root / "hf", root / "hf_own"
        done = subprocess.run([sys.executable, os.path.join(REPO, "verify_trainer.py"), "--output_dir", str(out),
                               "--checkpoint_interval", "2", "--", sys.executable, copies["hf"], "--output_dir",
                               str(own), "--nproc", "2", "--steps", str(STEPS)], capture_output=True, text=True,
                              timeout=600)
        results["hf"] = (done.returncode, out, own, done.stdout + done.stderr)
        for name, calibrate, ranks in (("trl", False, "2"), ("lightning", True, "2"), ("twice", False, "0")):
            out, own = root / name, root / f"{name}_own"
            code = verify(str(out), [sys.executable, copies[name], "--output_dir", str(own), "--nproc", ranks,
                                     "--steps", str(STEPS)], calibrate=calibrate)
            results[name] = (code, out, own, None)
        results.update(_releases(root, copies, os.environ["PYTHONPATH"]))
    finally:
        os.environ["PYTHONPATH"] = saved or ""
    plain = {k: root / f"{k}_plain" for k in EXAMPLES}  # TRL first: Lightning's teardown deletes WORLD_SIZE
    jobs = [(copies[k], ["--output_dir", str(plain[k]), "--steps", str(STEPS)]) for k in ("hf", "trl", "lightning")]
    for folder in plain.values():
        folder.mkdir()
    start_processes(_record_rank, (2, free_port(), jobs), 2)
    results["plain"] = plain
    return results


def _releases(root, copies: dict, path: str) -> dict:
    """RELEASES' runs, each release first on the command's path: those below run as verify_trainer.py runs them (its
    variables set), one process each, beside the oldest ones, which run through verify_trainer.py (uncalibrated) one
    after another — (exit code, the records' folder, the copy's own folder, its stderr)."""
    from parity.attaching import attach
    from parity.commands.verify_trainer import verify

    results, below = {}, {}
    for name, (framework, release, copy, extra) in sorted(RELEASES.items(), key=lambda kv: kv[0].endswith("_oldest")):
        site = installed_beside(f"{framework}-{release}", f"{framework}=={release}")
        os.environ["PYTHONPATH"] = os.pathsep.join([site, path])
        out, own = root / name, root / f"{name}_own"
        command = [sys.executable, copies[copy], "--output_dir", str(own), "--nproc", "2", "--steps", str(STEPS),
                   *extra]
        if name.endswith("_oldest"):
            results[name] = (verify(str(out), command, calibrate=False), out, own, None)
        else:
            out.mkdir()
            err = open(root / f"{name}.stderr", "w")
            below[name] = (subprocess.Popen(command, env=attach.environment(str(out), f"{copy}_copy",
                                                                            dict(os.environ)),
                                            stdout=subprocess.DEVNULL, stderr=err), err, out, own)
    for name, (proc, err, out, own) in below.items():
        code = proc.wait(timeout=600)
        err.close()
        results[name] = (code, out, own, (root / f"{name}.stderr").read_text())
    return results


def _log(folder, rank: int = 0):
    return json.loads((folder / f"log_{rank}.json").read_text())


def _steps(log: list[dict]) -> list[dict]:
    """Trainer's per-step logs (its end-of-training summary, with the run's timing, left out)."""
    return [entry for entry in log if "grad_norm" in entry]


@pytest.mark.parametrize("name", ["hf", "trl", "lightning"])
def test_an_unchanged_script_passes(runs, name):
    """Trainer (the command line), TRL and Lightning (calibrated): exit 0, PASS, the page written beside the records;
    the records named after the scripts."""
    code, out, _, output = runs[name]
    assert code == 0, output
    comparison = json.loads((out / "curve_comparison.json").read_text())
    assert {k: r["verdict"] for k, r in comparison["against_baseline"].items()} == {f"{name}_copy": "PASS"}
    assert (out / "report.html").exists() and (out / "curve_report.md").exists()
    assert (out / f"loss_{name}_copy.json").exists()
    if name == "hf":
        assert "verify_trainer: " in output and "overhead" in output and "Traceback" not in output
        # --checkpoint_interval 2: the callback the copy never names saved its states around steps 0 and 2, checked
        index = json.loads((out / "recorded_hf_copy" / "states.json").read_text())
        assert index["interval"] == 2 and index["checks"] == [0, 2]
        checks = comparison["runs"]["hf_copy"]["teacher_forced"]["checks"]
        assert [(c["step"], c["ok"]) for c in checks] == [(0, True), (2, True)]
    if name == "lightning":  # the replay at 1 worker and under other kernels: the noise the bounds are calibrated on
        assert comparison["noise_references"] == ["noise_reference_ddp_tp1_dp1_fp32.json",
                                                  "noise_reference_ddp_tp1_dp2_fp32_other_kernels.json"]
        # a run shorter than the drift test's window is not said to have passed it
        assert f"no drift test: it needs 10 steps and {STEPS} were compared" in (out / "curve_report.md").read_text()


@pytest.mark.parametrize("name", ["hf", "trl", "lightning"])
def test_the_framework_logs_what_it_logs_without_the_harness(runs, name):
    """Every loss (and grad norm) the framework logged under verify_trainer.py equals, bit for bit, what the same copy
    logs without it; the record kept Trainer's own values as they were logged."""
    _, out, own, _ = runs[name]
    plain = runs["plain"][name]
    if name == "lightning":  # each rank's training_step losses
        for rank in (0, 1):
            assert _log(own, rank) == _log(plain, rank) and len(_log(own, rank)) == 2 * STEPS
        return
    logged, bare = _steps(_log(own)), _steps(_log(plain))
    assert logged == bare and len(logged) == STEPS
    record = json.loads((out / f"loss_{name}_copy.json").read_text())
    assert [s["logged_loss"] for s in record["steps"]] == [e["loss"] for e in logged]
    assert [s["logged_grad_norm"] for s in record["steps"]] == [e["grad_norm"] for e in logged]


@pytest.mark.parametrize("name", ["trl_oldest", "lightning_oldest"])
def test_the_oldest_release_recorded_passes(runs, name):
    """The oldest release each room declares it records, installed beside the pinned set: TRL 0.29.0's GRPOTrainer
    (dapo, 2 ranks: no eos_token_ids nor fused LM head there) and Lightning 2.6.0, each an unchanged script under
    verify_trainer.py: recorded with that release (the record's fingerprint), exit 0, PASS."""
    from parity.frameworks import registered

    framework, release, copy, _ = RELEASES[name]
    assert {f.name: f.oldest for f in registered()}[framework] == release
    code, out, _, _ = runs[name]
    assert code == 0
    comparison = json.loads((out / "curve_comparison.json").read_text())
    assert {k: r["verdict"] for k, r in comparison["against_baseline"].items()} == {f"{copy}_copy": "PASS"}
    record = json.loads((out / f"loss_{copy}_copy.json").read_text())
    assert record["config"]["fingerprint"]["framework"]["versions"][framework] == release
    assert record["config"]["stopped"] is None and len(record["steps"]) == STEPS


@pytest.mark.parametrize("name", ["trl_below", "lightning_below"])
def test_a_release_below_the_oldest_is_one_line_and_the_run_goes_on(runs, name):
    """A release older than the room's oldest (TRL 0.28.0's SFTTrainer, Lightning 2.5.6), run as verify_trainer.py
    runs the command: one line of the recorder's naming the release and the oldest recorded, no traceback, nothing
    recorded (the line left for verify_trainer.py), and the training goes to its end (one rank, one step: its own log
    of it) with the script's own exit status, 0."""
    from parity.frameworks import registered

    framework, release, copy, _ = RELEASES[name]
    code, out, own, stderr = runs[name]
    oldest = {f.name: f.oldest for f in registered()}[framework]
    lines = [x for x in stderr.splitlines() if x.startswith("parity recorder")]
    assert code == 0, stderr[-3000:]
    assert len(lines) == 1 and f"{framework} {release} is older than {oldest}" in lines[0], lines
    assert "Traceback" not in stderr
    assert f"is older than {oldest}" in (out / f"refused_{copy}_copy.txt").read_text()
    assert not list(out.glob("loss_*.json"))
    logged = _log(own) if framework == "lightning" else _steps(_log(own))
    assert len(logged) == (2 if framework == "lightning" else 1)  # its step's 2 micro-batches, or the step


def test_a_script_that_records_twice_is_judged_in_one_comparison(runs):
    """One process without a launcher trains a clean Trainer, then one whose compute_loss drops num_items_in_batch:
    two records (hf_twice, hf_twice_2) of one rank, one replay (of the first, at 1 worker), one comparison: the clean
    run PASSes, the bug FAILs at step 0 on the grad norm; exit 1."""
    code, out, _, _ = runs["twice"]
    comparison = json.loads((out / "curve_comparison.json").read_text())
    verdicts = comparison["against_baseline"]
    assert code == 1 and {k: v["verdict"] for k, v in verdicts.items()} == {"hf_twice": "PASS", "hf_twice_2": "FAIL"}
    assert json.loads((out / "loss_hf_twice.json").read_text())["config"]["world_size"] == 1
    outside = verdicts["hf_twice_2"]["first_outside"]
    assert (outside["step"], outside["quantity"]) == (0, "grad_norm"), outside


@pytest.mark.parametrize("argv, line", [
    (["--output_dir", "{tmp}/out", "--"], "error: no command: give your launch command after --"),
    (["--output_dir", "{tmp}/out"], "error: no command: give your launch command after --"),
    (["--output_dir", "{tmp}/file/out", "--", sys.executable, "-c", "pass"],
     "error: --output_dir {tmp}/file/out is not a writable directory"),
    (["--output_dir", "{tmp}/out", "--", "no-such-launcher", "x.py"], "error: no-such-launcher: no such command"),
    (["--output_dir", "{tmp}/out", "--num_workers", "0", "--", sys.executable, "-c", "pass"],
     "error: argument --num_workers: must be a whole number >= 1 (got 0)"),
    (["--output_dir", "{tmp}/out", "--checkpoint_interval", "-1", "--", sys.executable, "-c", "pass"],
     "error: argument --checkpoint_interval: must be a whole number >= 0 (got -1)"),
    (["--output_dir", "{tmp}/out", "--", sys.executable, "-c", "pass"],
     "error: the command ran but recorded nothing into {tmp}/out"),
    (["--output_dir", "{tmp}/stale", "--", sys.executable, "-c", "pass"],
     "error: --output_dir {tmp}/stale already holds records (loss_old.json)"),
    (["--output_dir", "{tmp}/out", "--", sys.executable, "-c", "import sys; sys.exit(3)"],
     "error: the command exited with status 3"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, line):
    """No command, an unwritable --output_dir, a launcher that is not there, a worker count below 1, a folder that
    already holds records: one line, exit 2, before the command runs; a command that recorded nothing: one line, exit
    2, after it; a command that failed: one line, its own exit status."""
    from parity.commands.verify_trainer import main

    (tmp_path / "file").write_text("")
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "loss_old.json").write_text("{}")
    try:
        code = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exc:  # argparse's own line
        code = exc.code
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == (3 if "status 3" in line else 2), err
    assert len(err) == 1 and err[0].startswith(line.format(tmp=tmp_path)), err


@pytest.mark.parametrize("command, name", [
    (["torchrun", "--nproc_per_node", "2", "path/to/train.py", "--lr", "1"], "train"),
    (["accelerate", "launch", "--num_processes", "2", "my-run.py"], "my_run"),
    (["trl", "sft", "--model_name_or_path", "m"], "trl_sft"),
    (["python", "-m", "pkg.finetune", "--x"], "finetune"),
    (["python", "ddp.py"], "ddp_run"),
    (["python", "2stage.py"], "run_2stage"),
])
def test_the_record_is_named_after_the_command(command, name):
    from parity.commands.verify_trainer import record_name

    assert record_name(command) == name


def test_sitecustomize_chains_to_the_users_and_imports_nothing_eagerly(tmp_path):
    """The sitecustomize verify_trainer.py puts first on the command's path runs the one it shadows; under the
    variables it imports parity's hook and neither transformers nor torch (the hooks wait for the frameworks' modules:
    torchtitan's and megatron-core's rooms imported torch, 0.9 CPU-s in every process of the command); without them it
    imports nothing of parity."""
    from parity.attaching import attach

    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    probe = ("import os, sys; print(os.environ.get('USER_SITE_RAN'), 'transformers' in sys.modules, "
             "'torch' in sys.modules, 'parity.frameworks.transformers.trainer_hook' in sys.modules)")
    under = attach.environment(str(tmp_path / "out"), "probe",
                               {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    bare = {k: v for k, v in under.items() if k not in (attach.RECORD_DIR, attach.RECORD_NAME)}
    for env, expected in ((under, "1 False False True"), (bare, "1 False False False")):
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert done.stdout.strip() == expected, done.stderr
    source = open(os.path.join(attach.SITE_FOLDER, "sitecustomize.py")).read()
    assert f'os.environ.get("{attach.RECORD_DIR}")' in source


def test_the_lightning_factory_returns_nothing_outside_verify_trainer(monkeypatch):
    from parity.attaching import attach
    from parity.frameworks.lightning.factory import callbacks

    monkeypatch.delenv(attach.RECORD_DIR, raising=False)
    assert callbacks() == []
