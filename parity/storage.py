"""Where outputs are written: atomically, so a reader (or a crash) never sees half a weights file, half a
JSON record or half a figure; and the check, before any worker runs, that a directory can be written."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from parity.errors import ConfigError


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary path beside `path`; on success it is fsynced and renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
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


def write_json_atomic(path: str, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def check_writable_dir(flag: str, path: str) -> None:
    """Create the directory if needed and prove a file can be written there, before any worker runs."""
    if "://" in path:  # remote storage (s3://, gs://): Ray Train checks it itself
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path} is not a writable directory ({exc.strerror}): "
                          f"choose a directory you can write to") from None
