"""The one verdict type, for loss curves (a run against the baseline, step by step) and layer dumps (a
run against a reference, tensor by tensor): PASS when every compared point is within its tolerance,
else FAIL at the first point outside, in the order things happened — or, for a run in another precision policy
than its baseline, POLICY DIFFERENCE: not judged (parity/comparing/curves.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from parity.training.replicas import parting_line


POLICY_DIFFERENCE = "POLICY DIFFERENCE"
# A run equal to its baseline bit for bit at every step: no deviation, so no ratio of its bound to it
EXACT_MARGIN = "margin: exact (bit-identical)"


def verdict_word(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


@dataclass(frozen=True)
class Outside:
    """The first compared point outside its tolerance: a step of a curve, or a tensor of a layer dump."""

    quantity: str  # curves: "loss" | "grad_norm"; layers: the phase ("forward output", ...)
    rel_diff: float
    tolerance: float
    step: int | None = None  # curves: the step
    module: str | None = None  # layers: the module (or parameter) name
    value: float | None = None  # curves: the run's value at that step ...
    reference: float | None = None  # ... and the reference's
    test: str | None = None  # curves: "step" (one step beyond its bound) or "drift" (a window's steady bias)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Parting:
    """The first check at which a run's replicas parted (parity.training.replicas): ranks that must hold the same
    tensor hold different bits — a failure of the run's integrity, ahead of any tolerance."""

    step: int
    found: dict = field(repr=False)  # the check's record entry: {"checked", "parted", "tensors": [...]}

    def line(self) -> str:
        return parting_line(self.step, self.found)

    @property
    def broken(self) -> str:
        """What the parting means for the run: its ranks hold two models, or (a frozen tensor moved) it trained what
        it froze."""
        return "it trained what it froze" if self.frozen else "its ranks no longer hold one model"

    @property
    def no_reference(self) -> str:
        """Why such a run is no baseline or noise reference, in words."""
        return ("a run that trained what it froze is no reference" if self.frozen
                else "a run whose own ranks no longer hold one model is no reference")

    @property
    def frozen(self) -> bool:
        return self.found["tensors"][0]["what"] == "frozen"

    def to_dict(self) -> dict:
        first = self.found["tensors"][0]
        return {"step": self.step, "parted": self.found["parted"], "checked": self.found["checked"], **first,
                "line": self.line()}


@dataclass(frozen=True)
class Verdict:
    """One run measured against its reference."""

    run: str  # strategy name
    reference: str
    tolerance_source: str  # where the tolerance came from: a precision, a flag
    max_rel_diff: dict[str, float]  # the worst relative difference per quantity
    first_outside: Outside | None  # the tolerances': the first point outside
    parting: Parting | None = None  # the integrity's: the first check that found the run's replicas parted
    policy_difference: tuple[str, ...] = ()  # curves: the policy fields in which the run differs (not judged then)

    @property
    def passed(self) -> bool:
        return self.first_outside is None and self.parting is None and not self.policy_difference

    @property
    def word(self) -> str:
        """FAIL when the replicas parted (integrity first), else a policy difference (not judged), else the verdict."""
        if self.parting is None and self.policy_difference:
            return POLICY_DIFFERENCE
        return verdict_word(self.passed)

    def to_dict(self) -> dict:
        return {"verdict": self.word, "run": self.run, "reference": self.reference,
                "tolerance_source": self.tolerance_source, "max_rel_diff": self.max_rel_diff,
                "first_outside": self.first_outside.to_dict() if self.first_outside else None,
                **({"policy_difference": list(self.policy_difference)} if self.policy_difference else {})}
