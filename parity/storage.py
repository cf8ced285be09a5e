"""Where outputs are written: atomically, so a reader (or a crash) never sees half a weights file, half a
JSON record or half a figure; and the check, before any worker runs, that a directory can be written."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile

from parity.errors import ConfigError


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary path beside `path`; on success it is fsynced and renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_safe(data):
    """`data` with every non-finite float spelled as a string ("NaN", "Infinity", "-Infinity"): JSON has no
    such numbers, and Python's own NaN token makes a file other readers reject."""
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else "Infinity" if data > 0 else "-Infinity"
    if isinstance(data, dict):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    return data


def write_json_atomic(path: str, data) -> None:
    write_text_atomic(path, json.dumps(json_safe(data), indent=1, allow_nan=False) + "\n")


def check_writable_dir(flag: str, path: str) -> None:
    """Prove, before any worker runs, that `path` is a directory that exists or can be made, and that a file
    can be written where it would be made — without creating anything (bad input must leave no trace)."""
    if "://" in path:  # remote storage (s3://, gs://): Ray Train checks it itself
        return
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    problem = None
    if not os.path.isdir(existing):
        problem = f"{existing} is a file" if existing != os.path.abspath(path) else "it is a file"
    else:
        try:
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".write_test_"):
                pass
        except OSError as exc:
            problem = f"{exc.strerror} in {existing}"
    if problem:
        raise ConfigError(f"{flag} {path} is not a writable directory ({problem}): choose a directory you can "
                          f"write to")
