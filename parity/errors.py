"""Every exception the harness raises on purpose. The commands turn each into one line on stderr:
exit 2 for what the user can fix before anything runs, exit 1 for a run that failed or a verdict of FAIL; any other
exception is the harness's own fault: exit HARNESS_ERROR (parity/commands/common.py)."""

HARNESS_ERROR = 70
"""The exit code of an error inside the harness (sysexits' EX_SOFTWARE): never 1 (FAIL) nor 2 (bad input)."""


class ConfigError(Exception):
    """A problem with what the user asked for; the message names the problem and the fix."""


class NotComparable(ConfigError):
    """Runs that differ in more than the strategy; each entry of `mismatches` names both runs."""

    def __init__(self, mismatches: list[str]):
        super().__init__("; ".join(mismatches))
        self.mismatches = mismatches


class RecordError(ConfigError):
    """A loss record that cannot be used; the message names the file and what is wrong."""


class TrainingFailed(Exception):
    """A worker raised during training; the message is the worker's own error line."""


class RunStopped(TrainingFailed):
    """A failure every rank of a run meets at the same point — a checkpoint that cannot be written, read or
    used, a record that cannot be written, a loss that is not finite. The workers stop together and return
    it instead of raising, because Ray Train retries whatever a worker raises and this would only fail again."""


class LibraryMissing(ConfigError):
    """A strategy whose library cannot be imported (raised by the registry, or by a strategy's `validate`
    when it imports its library only there, as DeepSpeed does)."""

    def __init__(self, strategy: str, exc: ImportError):
        super().__init__(f"strategy {strategy} cannot be used: {exc} (install the pinned set with "
                         f"pip install -r requirements.txt)")
        self.strategy, self.exc = strategy, exc

    def __reduce__(self):  # a worker's error crosses to the driver pickled: rebuilt from what made it, not its line
        return type(self), (self.strategy, self.exc)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message as one line: its first, cut at `limit` characters."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What a rank's error says when another rank failed first (it lost its peer): never the cause to report."""
