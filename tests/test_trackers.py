"""--report_to wandb mlflow tensorboard: every step, the config, the fingerprint and the comparison's verdict in the
trackers, read back with their own readers (tests/tracker_readers.py); a tracker that fails mid-run is one warning
line and the run goes on; a tracker whose library is missing is one line before anything starts.

Three runs in one local gloo group (Ray adds nothing to what a tracker logs), all in one records' folder: DDP, the
hand-written DP of docs/custom_strategy.md, and the same DP whose MLflow run is deleted while it trains; then their
comparison. A resume with a restarted worker group, in every tracker of the main job:
tests/test_main_script.py; a --resume with another tracker than the run had: tests/test_checkpoints.py.
"""

import contextlib
import io
import json
import os
import re
import sys

import pytest

from conftest import CUSTOM, TINY, output_to, to_argv
from parity.commands.compare_curves import compare_and_report
from parity.commands.train import main as train_main
from parity.training.record import load_record
from tracker_readers import (as_float32, mlflow_run, mlflow_series, tensorboard, tensorboard_series, tensorboard_text,
                             wandb_directories, wandb_run)

STEPS = 6
RUN = {**TINY, "debug_steps": STEPS, "log_interval": 2, "learning_rate": 1e-4, "num_workers": 2, "batch_size": 2,
       "precision": "fp32", "report_to": "wandb mlflow tensorboard"}
# The hand-written DP of docs/custom_strategy.md, whose user deletes its MLflow run while it trains (from MLflow's UI,
# or its client as here): rank 0, before step 3.
MLFLOW_RUN_DELETED = '''
from my_strategy import HandWrittenDP


class MLflowRunDeleted(HandWrittenDP):
    name = "mlflow_deleted"

    def train_step(self, *args, **kwargs):
        self.trained = getattr(self, "trained", 0) + 1
        if self.trained == 4 and self.ctx.rank == 0:
            from mlflow import MlflowClient

            client = MlflowClient({uri!r})
            for run in client.search_runs([e.experiment_id for e in client.search_experiments()],
                                          "attributes.run_name = 'mlflow_deleted_tp1_dp2'"):
                client.delete_run(run.info.run_id)
        return super().train_step(*args, **kwargs)
'''


@pytest.fixture(scope="module")
def tracked(tiny_weights, tmp_path_factory):
    """(records by strategy, the group's output, the comparison's exit code and output, the folder), W&B without
    credentials (offline)."""
    from parity.driver.local_group import plan, run_group

    root = tmp_path_factory.mktemp("trackers")
    loss = root / "loss"
    (root / "hooks").mkdir()
    (root / "hooks" / "mlflow_run_deleted.py").write_text(MLFLOW_RUN_DELETED.format(uri=f"sqlite:///{loss}/mlflow.db"))
    common = {**RUN, "init_weights_path": tiny_weights, "loss_output_dir": loss, "storage_path": root / "ray"}
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith(("WANDB_", "MLFLOW_"))]:
            mp.delenv(name)
        mp.setenv("NETRC", str(root / "no_netrc"))  # no `wandb login` either
        mp.setenv("WANDB_ERROR_REPORTING", "false")  # nothing leaves this machine (MLflow's telemetry is off in tests)
        mp.syspath_prepend(str(root / "hooks"))
        runs = [plan("ddp", {**common, "strategy_class": cls})
                for cls in (None, CUSTOM, "mlflow_run_deleted:MLflowRunDeleted")]
        with output_to(root / "group.log"):
            run_group(runs)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = compare_and_report(str(loss), str(loss / "loss_curves.png"))
    records = {name: load_record(str(loss / f"loss_{name}.json")) for name in ("ddp", "hand_written_dp", "mlflow_deleted")}
    return records, (root / "group.log").read_text(), code, printed.getvalue(), root


def test_mlflow_has_every_step_the_config_the_fingerprint_and_the_verdict(tracked):
    records, _, code, printed, root = tracked
    assert code == 0
    assert "trackers: the verdict, the figure and the reports added to 3 wandb runs, 2 mlflow runs, " \
           "3 tensorboard runs" in printed
    experiments = set()
    for name in ("ddp", "hand_written_dp"):
        record = records[name]
        steps = record["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS))
        for key in ("loss", "grad_norm", "param_norm", "lr", "tokens", "peak_memory_bytes"):  # exactly, once a step
            assert mlflow_series(record, key) == [(s["step"], s[key]) for s in steps], key
        assert mlflow_series(record, "dp_rank_losses/1") == [(s["step"], s["dp_rank_losses"][1]) for s in steps]
        client, run = mlflow_run(record)
        experiments.add(run.info.experiment_id)
        assert run.info.run_name == record["config"]["experiment_name"] and run.info.status == "FINISHED"
        params, tags, config = run.data.params, run.data.tags, record["config"]
        assert (params["model_name"], float(params["learning_rate"]), params["strategy"]) == ("qwen2-tiny", 1e-4, name)
        assert params["init_weights_sha256"] == config["init_weights_sha256"]
        assert params["model_config.hidden_size"] == str(config["model_config"]["hidden_size"])
        assert "resume" not in params and tags["resume"] == "False"  # a resume may change it: a tag
        assert tags["fingerprint.shared_code_sha256"] == config["fingerprint"]["shared_code_sha256"]
        assert tags["fingerprint.versions.torch"] == config["fingerprint"]["versions"]["torch"]
        assert tags["comparison/verdict"] == "PASS" and tags["comparison/baseline"] == "ddp"
        assert [a.path for a in client.list_artifacts(run.info.run_id, "comparison")] == [
            "comparison/curve_comparison.json", "comparison/curve_report.md", "comparison/loss_curves.png",
            "comparison/report.html"]
        assert tags["comparison/page"] == str(root / "loss" / "report.html")
    summary = json.loads((root / "loss" / "curve_comparison.json").read_text())["against_baseline"]["hand_written_dp"]
    _, run = mlflow_run(records["hand_written_dp"])
    assert (run.data.tags["comparison/role"], run.data.tags["comparison/run_verdict"]) == ("compared", "PASS")
    assert run.data.metrics["comparison/max_rel_diff/loss"] == summary["max_rel_diff"]["loss"]
    assert mlflow_run(records["ddp"])[1].data.tags["comparison/role"] == "baseline"
    assert len(experiments) == 1  # the records' folder: one experiment, its runs overlaid
    experiment = mlflow_run(records["ddp"])[0].get_experiment(experiments.pop())
    assert experiment.name == str(root / "loss")
    assert experiment.artifact_location == str(root / "loss" / "mlflow_artifacts")


def test_tensorboard_has_every_step_the_config_the_fingerprint_and_the_verdict(tracked):
    records, _, _, _, root = tracked
    for name in ("ddp", "hand_written_dp"):
        record = records[name]
        log_dir = record["trackers"]["tensorboard"]["log_dir"]
        assert os.path.dirname(log_dir) == str(root / "loss" / "tensorboard" / record["config"]["experiment_name"])
        events = tensorboard(record)
        steps = [s["step"] for s in record["steps"]]
        for key in ("loss", "grad_norm", "param_norm", "dp_rank_losses/0"):  # float32 scalars, once a step
            series = tensorboard_series(events, key)
            recorded = [s[key] for s in record["steps"]] if "/" not in key else [s["dp_rank_losses"][0]
                                                                                 for s in record["steps"]]
            assert [step for step, _ in series] == steps and [v for _, v in series] == as_float32(recorded), key
        ((_, config),) = tensorboard_text(events, "config")
        assert "| model_name | `qwen2-tiny` |" in config and "| learning_rate | `0.0001` |" in config
        ((_, tags),) = tensorboard_text(events, "tags")
        assert f"| fingerprint.shared_code_sha256 | `{record['config']['fingerprint']['shared_code_sha256']}` |" in tags
        ((step, summary),) = tensorboard_text(events, "comparison/summary")
        assert step == STEPS - 1 and "| comparison/verdict | `PASS` |" in summary
        assert f"| comparison/page | `{root / 'loss' / 'report.html'}` |" in summary  # the page's path: no files here
        ((_, report),) = tensorboard_text(events, "comparison/report")
        assert report == (root / "loss" / "curve_report.md").read_text()
        (image,) = events.Images("comparison/loss_curves")
        assert (image.width, image.height) == (1200, 1680)  # the figure, 10 × 14 inches at 120 dpi


def test_wandb_offline_has_every_step_the_config_the_fingerprint_and_the_verdict(tracked):
    records, log, _, _, root = tracked
    for name in ("ddp", "hand_written_dp"):
        record = records[name]
        run = wandb_run(record)
        assert run["directories"] == 2  # the training's and the comparison's, one run id: `wandb sync` uploads both
        assert (run["group"], run["name"]) == (str(root / "loss"), record["config"]["experiment_name"])
        assert run["config"]["fingerprint"] == record["config"]["fingerprint"]
        assert (run["config"]["learning_rate"], run["config"]["model_name"]) == (1e-4, "qwen2-tiny")
        assert sorted(run["history"]) == [s["step"] for s in record["steps"]]
        assert [run["history"][s["step"]]["loss"] for s in record["steps"]] == [s["loss"] for s in record["steps"]]
        assert run["summary"]["comparison/verdict"] == "PASS"
        assert run["summary"]["comparison/page"] == str(root / "loss" / "report.html")
        assert os.path.isfile(os.path.join(wandb_directories(record)[-1], "files", "report.html"))
        assert [(kind, paths) for kind, _, paths in run["artifacts"]] == [("parity-report", ["report.html"])]
        wandb_dir = wandb_directories(record)[0]
        assert f"[{record['strategy']}] wandb: offline run {record['trackers']['wandb']['id']} in {wandb_dir}" in log
    assert "wandb: " not in log.replace("] wandb: ", "")  # wandb's own lines stay in the run's log


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_run_goes_on(tracked):
    """The deleted MLflow run: one warning line in training, one in the comparison; every step in the record and in the
    other trackers, the verdict PASS."""
    records, log, code, printed, root = tracked
    record = records["mlflow_deleted"]
    assert record["complete"] and [s["step"] for s in record["steps"]] == list(range(STEPS))
    warnings = [line for line in log.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(r"\[mlflow_deleted\] warning: mlflow failed while logging step [0-3] \(MlflowException: .* "
                        r"must be in the 'active' state\. Current state is deleted\.\): it records nothing more of "
                        rf"this run; the loss record {re.escape(str(root / 'loss' / 'loss_mlflow_deleted.json'))} has "
                        r"every step", warnings[0])
    assert [v for _, v in tensorboard_series(tensorboard(record), "loss")] == as_float32(s["loss"] for s in record["steps"])
    assert sorted(wandb_run(record)["history"]) == list(range(STEPS))
    assert all(isinstance(s["harness_s"]["trackers"], float) for s in record["steps"])  # what handing over cost
    (warning,) = [line for line in printed.splitlines() if line.startswith("warning")]
    assert warning.startswith("warning: the comparison could not be added to mlflow_deleted (TP=1, DP=2)'s mlflow run "
                              "(MlflowException: ")
    assert code == 0 and "mlflow_deleted (TP=1, DP=2): PASS" in printed


def test_a_missing_tracker_library_is_one_line_before_anything_starts(tiny_weights, tmp_path, monkeypatch, capsys):
    """mlflow shadowed by a package on the path that cannot be imported (as a missing or broken install is): one line
    naming the extra, exit 2, nothing written."""
    stub = tmp_path / "stub" / "mlflow"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n")
    monkeypatch.syspath_prepend(str(stub.parent))
    for name in [n for n in sys.modules if n.split(".")[0] == "mlflow" or n == "parity.tracking.mlflow_tracker"]:
        monkeypatch.delitem(sys.modules, name)  # as in a process that has not imported it yet
    argv = to_argv({**RUN, "report_to": None, "init_weights_path": tiny_weights, "loss_output_dir": tmp_path / "loss",
                    "storage_path": tmp_path / "ray"})
    assert train_main("ddp", argv=[*argv, "--report_to", "tensorboard", "mlflow"]) == 2
    assert capsys.readouterr().err == ("error: --report_to mlflow: its library cannot be imported (No module named "
                                       "'mlflow'): pip install -e '.[mlflow]'\n")
    assert not (tmp_path / "loss").exists() and not (tmp_path / "ray").exists()


def test_trackers_that_cannot_work_are_one_line(tiny_weights, tmp_path, monkeypatch, capsys):
    """A word that names no tracker; MLflow's default database in an object store (no MLFLOW_TRACKING_URI)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    argv = to_argv({**RUN, "report_to": None, "init_weights_path": tiny_weights, "loss_output_dir": tmp_path / "loss"})
    assert train_main("ddp", argv=[*argv, "--report_to", "wandb", "comet"]) == 2
    assert capsys.readouterr().err == "error: --report_to comet: use wandb, mlflow, tensorboard (one or several) or none\n"
    store = "s3://bucket/loss?region=us-east-1"
    assert train_main("ddp", argv=[*argv, "--report_to", "mlflow", "--loss_output_dir", store]) == 2
    assert capsys.readouterr().err == (f"error: --report_to mlflow: --loss_output_dir {store} is not a local folder, where "
                                       f"MLflow's default sqlite database goes: set MLFLOW_TRACKING_URI to your tracking "
                                       f"server (or to a database every node reaches)\n")
    assert not (tmp_path / "loss").exists()
