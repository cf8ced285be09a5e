"""What every command does with failures: bad input is one `error: …` line on stderr and exit 2; a run that
failed on a worker is one line naming what failed, and exit 1; an error of the harness's own code (a bug of the
harness, never a verdict on the user's run) is one line naming where its traceback went, and exit 70 (HARNESS_ERROR)."""

from __future__ import annotations

import argparse
import atexit
import math
import os
import sys
import tempfile
import threading
import time
import traceback

from parity.errors import HARNESS_ERROR, ConfigError, NotComparable, TrainingFailed, first_line


def run_command(action, what: str, trace_dir: str | None = None) -> int:
    """Run `action` (returning an exit code) and turn the harness's own exceptions into their exit codes: any other
    exception is the harness's fault, exit HARNESS_ERROR, its traceback written into `trace_dir` (a local folder; the
    system's temporary folder where none is given or it cannot be written)."""
    try:
        return action()
    except ConfigError as exc:
        report_error(exc)
        return 2
    except TrainingFailed as exc:
        print(f"error: {what} failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the one place an unforeseen error of the harness is turned into its code
        path = write_traceback(trace_dir)
        print(f"error: the harness failed in {what} ({type(exc).__name__}: {first_line(exc)}): a bug of the harness, "
              f"not a verdict on your run; its traceback: {path} (exit {HARNESS_ERROR}; please report it)",
              file=sys.stderr)
        return HARNESS_ERROR


def write_traceback(folder: str | None) -> str:
    """The exception being handled, written whole into `folder` (or the temporary folder); the file's path, or where
    it could not be written, a word saying so."""
    text = traceback.format_exc()
    name = f"harness_error_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}.txt"
    for where in (folder, tempfile.gettempdir()):
        if not where or "://" in where:  # a remote store's folder: the temporary one instead
            continue
        try:
            os.makedirs(where, exist_ok=True)
            path = os.path.join(where, name)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
            return path
        except OSError:
            continue
    return "not written (no writable folder)"


def exit_now(code: int | None):
    """Leave the process with `code` as the interpreter would — its other threads joined, its exit handlers run
    (Ray's, the trackers', logging's), its streams flushed — without tearing down every module it imported: after a
    job that imported torch, DeepSpeed, transformers and Ray that teardown alone took 2.1 s on 2 cores (0.8 s after a
    bare Ray Train fit), and it writes nothing (docs/tolerances.md#what-calibrating-by-default-costs)."""
    if code is None:
        code = 0
    threading._shutdown()  # what the interpreter does first at exit: thread pools told to stop, other threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def report_error(exc: ConfigError) -> None:
    """Bad input on stderr: one line, or one per mismatch for runs that are not comparable."""
    lines = [f"not comparable: {m}" for m in exc.mismatches] if isinstance(exc, NotComparable) else [str(exc)]
    for line in lines:
        print(f"error: {line}", file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error: …` line and exit 2, like every other bad input (--help
    still prints the whole usage); --help keeps the script's docstring as written and shows the defaults."""

    def __init__(self, description: str = "", **kwargs):
        super().__init__(description=description, formatter_class=HelpFormatter, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def non_negative_float(text: str) -> float:
    """argparse type of a tolerance: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (got {text})") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def error_line(exc: BaseException) -> str:
    """An exception as one report line: its type and the last line of its message (a step of a check that failed)."""
    text = (str(exc).strip().splitlines() or [""])[-1]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
