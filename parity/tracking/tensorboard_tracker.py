"""--report_to tensorboard: each run a TensorBoard run, written by torch.utils.tensorboard.SummaryWriter (PyTorch's
writer, which needs the `tensorboard` package).

Where: <loss_output_dir>/tensorboard/<experiment_name>/<start time>/, so `tensorboard --logdir
<loss_output_dir>/tensorboard` overlays the runs one comparison compares, and a run trained again (a rerun that
replaces the old one) is a new TensorBoard run beside it. With --loss_output_dir a URI the event files are written on
rank 0's node and uploaded there (pyarrow, as the records) every --log_interval steps and at the end.

A resumed run writes with purge_step at the checkpoint's step: TensorBoard's readers drop what the attempt before
the restart wrote from that step on, so a step trained again appears once, with its new values. Scalars are float32
(TensorBoard's simple values); the config, the tags and the comparison's summary and report are text, the
comparison's figure an image.
"""

from __future__ import annotations

import io
import time
import uuid

from torch.utils.tensorboard import SummaryWriter

from parity import storage
from parity.tracking.tracker import Tracker, local_place, upload


def markdown_table(fields: dict) -> str:
    """TensorBoard's text tab renders markdown: one row per field."""
    return "\n".join(["| field | value |", "|---|---|", *(f"| {k} | `{v}` |" for k, v in fields.items())])


class TensorBoardTracker(Tracker):
    name = extra = "tensorboard"

    def start(self) -> None:
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        self._open(storage.join(self.run.loss_output_dir, "tensorboard", self.run.name, stamp), purge_step=None)
        self.writer.add_text("config", markdown_table(self.run.params), 0)
        self.writer.add_text("tags", markdown_table(self.run.tags), 0)

    def resume(self, state: dict, step: int) -> None:
        self._open(state["log_dir"], purge_step=step)
        self.writer.add_text("tags", markdown_table(self.run.tags), step)

    def log(self, steps) -> None:
        for s in steps:
            for key, value in s.metrics.items():
                self.writer.add_scalar(key, value, s.step, walltime=s.time)
        if any((s.step + 1) % self.run.log_interval == 0 for s in steps):  # on disk (uploaded) as often as the record
            self.flush()

    def flush(self) -> None:
        self.writer.flush()
        upload(self.local, self.remote)

    def where(self) -> str:
        return f"tensorboard: {self.state['log_dir']}"

    def finish(self, failed: bool = False) -> None:
        self.writer.close()
        upload(self.local, self.remote)

    @classmethod
    def add_comparison(cls, state: dict, run, summary: dict, files: list[str], figure_png) -> None:
        import numpy as np
        from PIL import Image

        local, remote = local_place(state["log_dir"])
        step = summary.get("comparison/num_steps", 1) - 1
        with SummaryWriter(local) as writer:
            writer.add_text("comparison/summary", markdown_table(summary), step)
            for path in files:
                if path.endswith(".md"):
                    with open(path) as f:
                        writer.add_text("comparison/report", f.read(), step)
            image = np.asarray(Image.open(io.BytesIO(figure_png())).convert("RGB"))
            writer.add_image("comparison/loss_curves", image, step, dataformats="HWC")
        upload(local, remote)

    def _open(self, log_dir: str, purge_step: int | None) -> None:
        self.state = {"log_dir": log_dir}
        self.local, self.remote = local_place(log_dir)
        self.writer = SummaryWriter(self.local, purge_step=purge_step)
