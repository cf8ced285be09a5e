"""Atomic writes: a reader (or a crash) never sees half a weights file or half a JSON record."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile


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
