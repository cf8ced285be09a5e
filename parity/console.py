"""The user's terminal, kept for the harness's own lines, while Ray, DeepSpeed and torch write to a log file.

A command that starts Ray wraps that part in `terminal(log_path, verbose)`: the process's stdout and stderr
(file descriptors 1 and 2, so C++ output too) go to the log file, and the harness's driver lines are written
to the terminal with `say`. Ray forwards every worker's output to the driver's stdout/stderr, prefixed with
the worker's actor and pid: all of it lands in the log, and a line a worker marked with MARK (`marked`) is
also shown on the terminal, unprefixed. That is how the rank-0 worker's progress, a resumed run and a
worker's failure reach the user while Ray's own lines do not. With `verbose` nothing is redirected: every
line reaches the terminal as Ray prints it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings

from parity import storage

MARK = "::parity:: "
"""Starts a worker line meant for the terminal (stripped there; kept in the log)."""

_terminal: "_Terminal | None" = None


def marked(line: str) -> str:
    """A worker's line for the user's terminal (under `terminal`, Ray forwards it to the driver)."""
    return MARK + line


def active() -> bool:
    """Whether a quiet terminal is up (workers then mark the lines meant for it)."""
    return _terminal is not None


def say(line: str, err: bool = False) -> None:
    """A line of the harness's own on the user's terminal (and in the log, when there is one)."""
    if _terminal is None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
    else:
        _terminal.write_line(line, err)


@contextlib.contextmanager
def pointing_to(log: str | None, prefix: str = ""):
    """The block's last line on the terminal names the log file (where Ray's, DeepSpeed's and torch's lines
    are), whether the block ends or fails."""
    failed = True
    try:
        yield
        failed = False
    finally:
        if log:
            say(f"{prefix}Ray's, DeepSpeed's and torch's output: {log} (--verbose shows it on the terminal)", err=failed)


@contextlib.contextmanager
def redirected(log):
    """Within the block, this process's output into the open file `log`: descriptors 1 and 2 (what its children and
    C++ write, a local group's ranks included) and Python's streams; both restored after it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        log.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


@contextlib.contextmanager
def terminal(log_location: str, verbose: bool = False):
    """Within the block, stdout/stderr (Python's and the file descriptors) go to the log file `log_location` (a
    local path, truncated; for a URI a local file first, copied there at the end); `say` and marked worker lines
    reach the terminal. Yields the log's location (None with `verbose`, or inside another such block)."""
    global _terminal
    if verbose or _terminal is not None:
        yield None
        return
    log_path = storage.local_path(log_location) or os.path.join(tempfile.mkdtemp(prefix="parity_log_"),
                                                                storage.name(log_location))
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log = open(log_path, "w", buffering=1, encoding="utf-8", errors="replace")
    saved_fds = os.dup(1), os.dup(2)
    term_out = io.TextIOWrapper(os.fdopen(os.dup(1), "wb", buffering=0), encoding="utf-8", write_through=True)
    term_err = io.TextIOWrapper(os.fdopen(os.dup(2), "wb", buffering=0), encoding="utf-8", write_through=True)
    saved_streams = sys.stdout, sys.stderr, warnings.showwarning
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    _terminal = _Terminal(log, term_out, term_err)
    sys.stdout, sys.stderr = _Filter(_terminal, err=False), _Filter(_terminal, err=True)
    warnings.showwarning = _terminal.warning
    try:
        yield log_location
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr, warnings.showwarning = saved_streams
        _terminal = None
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        term_out.close()
        term_err.close()
        log.close()
        if log_path != storage.local_path(log_location):
            with open(log_path, "rb") as f:
                storage.write_bytes_atomic(log_location, f.read())


class _Terminal:
    def __init__(self, log, out, err):
        self.log, self.out, self.err = log, out, err

    def write_line(self, line: str, err: bool) -> None:
        self.log.write(line + "\n")
        (self.err if err else self.out).write(line + "\n")

    def warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.log.write(warnings.formatwarning(message, category, filename, lineno, line))


class _Filter(io.TextIOBase):
    """sys.stdout/sys.stderr inside `terminal`: everything to the log, marked lines also to the terminal."""

    def __init__(self, term: _Terminal, err: bool):
        self.term, self.err, self.pending = term, err, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if MARK in line:
                self.term.write_line(line.split(MARK, 1)[1], self.err)
            else:
                self.term.log.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.write("\n")
        self.term.log.flush()
