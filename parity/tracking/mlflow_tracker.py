"""--report_to mlflow: each run an MLflow run, through MLflow's client (mlflow.MlflowClient).

Where: the tracking server or database MLFLOW_TRACKING_URI names (a server for several nodes, jobs or users);
without it a sqlite database beside the records, <loss_output_dir>/mlflow.db, with the artifacts in
<loss_output_dir>/mlflow_artifacts (MLflow's file store is deprecated). The experiment is MLFLOW_EXPERIMENT_ID's or
MLFLOW_EXPERIMENT_NAME's, else the records' folder: the runs one comparison compares are one experiment.

Every step is logged with its own step number and the time it was recorded, in one log_batch every --log_interval
steps (when the record is written: a database transaction per step cost ~6 ms of CPU, ~1.5 ms a step in tens);
the steps a restarted worker group trains again are skipped where the run already has them (get_metric_history),
so each step is in it once, as the attempt that first trained it logged it.
"""

from __future__ import annotations

import logging
import os
import time
from urllib.parse import urlsplit, urlunsplit

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from parity import storage
from parity.errors import ConfigError
from parity.tracking.tracker import Tracker

BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's limits on one log_batch
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # tracking URIs that are a database MLflow opens itself
KEY_STEP = "loss"  # every step has it: the steps a run holds are those of its loss


def tracking_uri(loss_output_dir: str) -> str:
    """MLFLOW_TRACKING_URI, or the sqlite database beside the records (a local folder's)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(loss_output_dir, 'mlflow.db')}"


class MLflowTracker(Tracker):
    name = extra = "mlflow"

    @classmethod
    def check(cls, loss_output_dir: str, spread: bool) -> None:
        if not os.environ.get("MLFLOW_TRACKING_URI") and storage.local_path(loss_output_dir) is None:
            raise ConfigError(f"--report_to mlflow: --loss_output_dir {loss_output_dir} is not a local folder, where "
                              f"MLflow's default sqlite database goes: set MLFLOW_TRACKING_URI to your tracking server "
                              f"(or to a database every node reaches)")
        uri = tracking_uri(loss_output_dir)
        if urlsplit(uri).scheme.split("+")[0] in DATABASES:
            import alembic  # noqa: F401  MLflow's database store needs them (mlflow-skinny leaves them out)
            import sqlalchemy  # noqa: F401
        path = _sqlite_path(uri)
        if spread and path and not storage.visible_to_every_node(path):
            raise ConfigError(f"--report_to mlflow: the database {path} is on this node, and rank 0 may run on "
                              f"another: set MLFLOW_TRACKING_URI to a server, or to a database on a mount every node "
                              f"shares (or name its folder in PARITY_SHARED_PATHS)")

    def start(self) -> None:
        uri = tracking_uri(self.run.loss_output_dir)
        self.client = _client(uri)
        experiment = self._experiment(uri)
        self.run_id = self.client.create_run(experiment, run_name=self.run.name).info.run_id
        self.state = {"tracking_uri": _without_credentials(uri), "experiment_id": experiment, "run_id": self.run_id}
        self._batches(params=[Param(k, v) for k, v in self.run.params.items()],
                      tags=[RunTag(k, v) for k, v in self.run.tags.items()])
        self.logged, self.buffer = set(), []

    def resume(self, state: dict, step: int) -> None:
        self.client = _client(os.environ.get("MLFLOW_TRACKING_URI") or state["tracking_uri"])
        self.state, self.run_id = dict(state), state["run_id"]
        self.client.update_run(self.run_id, status="RUNNING")
        self._batches(tags=[RunTag(k, v) for k, v in self.run.tags.items()])  # its parameters are logged already
        self.logged, self.buffer = {m.step for m in self.client.get_metric_history(self.run_id, KEY_STEP)}, []

    def log(self, steps) -> None:
        # A step trained again after a restart is left as the run has it: MLflow keeps every point logged.
        self.buffer += [Metric(k, v, int(s.time * 1000), s.step) for s in steps if s.step not in self.logged
                        for k, v in s.metrics.items()]
        if any((s.step + 1) % self.run.log_interval == 0 for s in steps):  # as often as the record is written
            self.flush()

    def flush(self) -> None:
        items, self.buffer = self.buffer, []
        for i in range(0, len(items), BATCH["metrics"]):
            self.client.log_batch(self.run_id, metrics=items[i:i + BATCH["metrics"]])

    def where(self) -> str:
        return (f"mlflow: run {self.run_id} in experiment {self.state['experiment_id']} at "
                f"{self.state['tracking_uri']}")

    def finish(self, failed: bool = False) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    @classmethod
    def add_comparison(cls, state: dict, run, summary: dict, files: list[str], figure_png) -> None:
        client = _client(os.environ.get("MLFLOW_TRACKING_URI") or state["tracking_uri"])
        now = int(time.time() * 1000)
        numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        client.log_batch(state["run_id"], metrics=[Metric(k, float(v), now, 0) for k, v in numbers.items()],
                         tags=[RunTag(k, str(v)) for k, v in summary.items() if k not in numbers])
        for path in files:
            client.log_artifact(state["run_id"], path, artifact_path="comparison")

    def _experiment(self, uri: str) -> str:
        """MLFLOW_EXPERIMENT_ID, or the experiment MLFLOW_EXPERIMENT_NAME or the records' folder names, made when
        new (with its artifacts beside the records unless a server keeps them); another run may make it first."""
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.run.group
        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name, artifact_location=self._artifact_location(uri))
            except MlflowException:
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        return found.experiment_id

    def _artifact_location(self, uri: str) -> str | None:
        """Beside the records when MLflow opens a database itself (its default, ./mlruns, would be the worker's
        working directory); a server's own default otherwise."""
        if urlsplit(uri).scheme.split("+")[0] not in DATABASES:
            return None
        return storage.join(self.run.loss_output_dir, "mlflow_artifacts").split("?", 1)[0]

    def _batches(self, params=(), tags=()) -> None:
        for kind, items in (("params", list(params)), ("tags", list(tags))):
            for i in range(0, len(items), BATCH[kind]):
                self.client.log_batch(self.run_id, **{kind: items[i:i + BATCH[kind]]})


def _client(uri: str) -> MlflowClient:
    """A client of `uri`. MLflow's and alembic's INFO lines (a new database's tables) stay off the terminal."""
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def _sqlite_path(uri: str) -> str | None:
    return uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None


def _without_credentials(uri: str) -> str:
    """What the record keeps of the tracking URI: never a user or password written into it."""
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])) if "@" in parts.netloc else uri
