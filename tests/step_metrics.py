"""A Ray Train report callback as a user adds one without touching the harness (RAY_TRAIN_CALLBACKS=
step_metrics.StepMetrics: Ray Train builds it on the driver and calls it in its controller after every
report): it writes what it is handed to a JSON-lines file, so a test reads what a logger would have logged."""

from __future__ import annotations

import json
import os

from ray.train.v2._internal.execution.callback import ReportCallback

PATH_ENV = "STEP_METRICS_FILE"


class StepMetrics(ReportCallback):
    def __init__(self):
        self.path = os.environ[PATH_ENV]

    def after_report(self, training_report, metrics):
        checkpoint = training_report.checkpoint
        with open(self.path, "a") as f:
            f.write(json.dumps({"metrics": metrics[0], "checkpoint": checkpoint.path if checkpoint else None}) + "\n")
