"""--report_to wandb: each run a W&B run, through wandb's own API (wandb.init, run.log, run.summary, run.save).
wandb's own terminal lines are off (the harness's line says where the run is); its log is in the run's directory.

Online where W&B has credentials (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or `wandb login`'s entry in ~/.netrc
for WANDB_BASE_URL's host), else offline: the run is written to a local directory that `wandb sync DIR` uploads
later; WANDB_MODE decides when set. W&B's own variables set the rest (WANDB_PROJECT, default "parity";
WANDB_ENTITY; WANDB_RUN_GROUP, default the records' folder; WANDB_DIR, default the records' folder: runs land in
<loss_output_dir>/wandb/). With --loss_output_dir a URI and no WANDB_DIR, an offline run is written on rank 0's node
and its directory uploaded to <loss_output_dir>/wandb/ at the end.

A resumed run continues the W&B run of the same id (resume="allow"). Online, W&B tells it the run's last step and
the steps trained again below it are not logged again (W&B's history only moves forward); offline the resumed
process writes a second directory of the same run id, from the checkpoint's step on, and `wandb sync` uploads a
run's directories in the order they started.
"""

from __future__ import annotations

import netrc
import os
import shutil
from urllib.parse import urlsplit

import wandb

from parity.tracking.tracker import WANDB_GROUP_CHARS, Tracker, local_place, upload

TAG_CHARS = 64  # W&B's limit on a tag
PAGE, ARTIFACT_TYPE = "report.html", "parity-report"  # the comparison's page, attached as an Artifact of this type


def mode() -> str | None:
    """None where WANDB_MODE decides (wandb reads it); else online with credentials, offline without."""
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        found = netrc.netrc(os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return "online" if found else "offline"


def short_tags(run) -> list[str]:
    """W&B's tags are short words: the strategy, the precision and the fingerprint's parts ("shared_code:78f5…")."""
    fp = run.config.get("fingerprint", {})
    words = [run.config.get("strategy", ""), run.config.get("precision", ""),
             f"shared_code:{fp.get('shared_code_sha256', '')[:12]}",
             f"strategy_code:{fp.get('strategy_code', {}).get('sha256', '')[:12]}",
             *(f"{k}:{v}" for k, v in fp.get("versions", {}).items()), f"device:{fp.get('device', '')}"]
    return [w[:TAG_CHARS] for w in words if w]


class WandbTracker(Tracker):
    name = extra = "wandb"

    def start(self) -> None:
        self._init(id=None, resume=None)
        self.first = 0

    def resume(self, state: dict, step: int) -> None:
        self._init(id=state["id"], resume="allow", project=state["project"], location=state["dir"])
        self.first = self.wb.starting_step  # online: the run's next step; offline: 0

    def log(self, steps) -> None:
        for s in steps:
            if s.step >= self.first:
                self.wb.log(s.metrics, step=s.step)

    def where(self) -> str:
        run_dir = os.path.dirname(self.wb.dir.rstrip("/"))
        if self.wb.offline:
            uploaded = f" (uploaded to {self.remote} at the end)" if self.remote else ""
            return f"wandb: offline run {self.wb.id} in {run_dir}{uploaded}; `wandb sync {run_dir}` uploads it"
        return f"wandb: {self.wb.url}"

    def finish(self, failed: bool = False) -> None:
        self.wb.finish(exit_code=1 if failed else 0)
        wandb.teardown()  # finish may return before wandb's service has written the run's files: now they are whole
        upload(self.local, self.remote)

    @classmethod
    def add_comparison(cls, state: dict, run, summary: dict, files: list[str], figure_png) -> None:
        import io

        from PIL import Image

        tracker = cls(run)
        tracker._init(id=state["id"], resume="allow", project=state["project"], location=state["dir"])
        tracker.wb.summary.update({**summary, "comparison/loss_curves": wandb.Image(
            Image.open(io.BytesIO(figure_png())).convert("RGB"))})
        for path in files:  # copied in (a file saved from elsewhere would be a link to it)
            shutil.copy(path, os.path.join(tracker.wb.dir, os.path.basename(path)))
            tracker.wb.save(os.path.join(tracker.wb.dir, os.path.basename(path)), base_path=tracker.wb.dir,
                            policy="now")
        pages = [path for path in files if os.path.basename(path) == PAGE]
        if pages:  # the page as a versioned W&B Artifact too: it opens from the Artifacts tab and can be linked
            artifact = wandb.Artifact(f"parity-report-{tracker.wb.id}", type=ARTIFACT_TYPE,
                                      description="the comparison's self-contained report.html (docs/report.md)")
            artifact.add_file(pages[0], name=PAGE)
            tracker.wb.log_artifact(artifact)
        tracker.finish()

    def _init(self, id: str | None, resume: str | None, project: str | None = None, location: str | None = None):
        """wandb.init of this run (a new one, or the one `id` names), in WANDB_DIR, or `location`, or the records'
        folder (a URI's run written on this node and uploaded there at the end)."""
        location = location or os.environ.get("WANDB_DIR") or self.run.loss_output_dir
        self.local, self.remote = local_place(location)
        project = project or (None if os.environ.get("WANDB_PROJECT") else "parity")
        group = None if os.environ.get("WANDB_RUN_GROUP") else self.run.group[-WANDB_GROUP_CHARS:]
        self.wb = wandb.init(project=project, group=group, name=self.run.name, id=id, resume=resume, dir=self.local,
                             mode=mode(), tags=short_tags(self.run), settings=wandb.Settings(console="off", silent=True))
        self.wb.config.update(self.run.config, allow_val_change=True)  # a resume's own values (resume, nodes ...)
        self.state = {"id": self.wb.id, "project": self.wb.project, "dir": location}
