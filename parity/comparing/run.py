"""One loss record as the comparison reads it (a `Run`, named by its strategy): its config, its steps, its precision
policy, and the integrity facts it carries itself — duplicate rows fed, an lr off its declared schedule, replicas
that parted. parity/comparing/curves.py judges runs; comparability.py checks two of them alike."""

from __future__ import annotations

from dataclasses import dataclass

from parity.comparing.noise import relative_diff
from parity.comparing.verdict import Outside, Parting
from parity.precision import POLICY_FIELDS
from parity.registry import run_label
from parity.training.record import is_recorded


@dataclass(frozen=True)
class Run:
    """One loss record, named by its strategy."""

    file: str
    record: dict

    @property
    def name(self) -> str:
        return self.record["strategy"]

    @property
    def config(self) -> dict:
        return self.record["config"]

    @property
    def steps(self) -> list[dict]:
        return self.record["steps"]

    @property
    def complete(self) -> bool:
        """Finished: closed by its run, or a recorded run's record that stopped early (it holds every step it will)."""
        return self.record["complete"] or self.stopped is not None

    @property
    def stopped(self) -> dict | None:
        """Where a recorded run's record stopped early, {"step", "why"} (recorded.stopped_words), or None."""
        return self.config.get("stopped")

    @property
    def recorded(self) -> bool:
        """A record of parity's recorder (your own trainer), not of the harness's loop."""
        return is_recorded(self.config)

    @property
    def precision(self) -> str:
        return self.config["precision"]

    @property
    def policy(self) -> dict:
        """The run's precision policy and its refinements (parity.precision.POLICY_FIELDS)."""
        return {k: self.config.get(k) for k in POLICY_FIELDS}

    def skipped(self, num_steps: int) -> list[bool]:
        """Per step: whether an fp16 overflow skipped it."""
        return [bool(step.get("skipped")) for step in self.steps[:num_steps]]

    @property
    def label(self) -> str:
        return run_label(self.name, self.config)

    @property
    def fingerprint(self) -> dict:
        return self.config["fingerprint"]

    @property
    def replica_checks(self) -> dict:
        """What the replica check did in this run: {"declared", "interval", "groups" (replica groups declared),
        "checks" (steps checked)}; declared False when its strategy declares none (or the record predates it)."""
        declared = self.record.get("replicas", {"declared": False})
        return {**declared, "checks": sum(1 for s in self.steps if "replicas" in s)}

    @property
    def duplicate_rows(self) -> Outside | None:
        """The first step at which two of this run's DP ranks fed the same rows (a recorded run's rows check,
        parity/recording/recorder.py), or None: an integrity failure, ahead of any tolerance."""
        for s in self.steps:
            found = s.get("rows_check") or {}
            if found.get("duplicates"):
                rank, other, rows = found["pairs"][0]
                return Outside(quantity="duplicate_rows", rel_diff=float(found["duplicates"]), tolerance=0.0,
                               step=s["step"], value=float(rank), reference=float(other), test="duplicate_rows")
        return None

    @property
    def lr_off_schedule(self) -> Outside | None:
        """The first step whose applied lr is not the one the framework's own settings declare (a recorded Trainer
        run's `declared_lr`: a scheduler stepped twice per update replays to the same curves), or None."""
        for s in self.steps:
            declared = s.get("declared_lr")
            if declared is not None and abs(s["lr"] - declared) > 1e-12 * max(abs(declared), abs(s["lr"])):
                return Outside(quantity="lr", rel_diff=relative_diff(s["lr"], declared), tolerance=0.0,
                               step=s["step"], value=s["lr"], reference=declared, test="lr_schedule")
        return None

    @property
    def parting(self) -> Parting | None:
        """The first check that found this run's replicas parted, over every recorded step (a parting is a fact of
        the run, even past the steps compared), or None."""
        return next((Parting(s["step"], s["replicas"]) for s in self.steps if s.get("replicas", {}).get("parted")),
                    None)
