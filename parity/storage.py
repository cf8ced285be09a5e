"""Where outputs are written and read: local paths and the URIs Ray Train accepts (s3://, gs://, abfs://,
hdfs://, file://), through the filesystem pyarrow gives for them — the same one Ray Train opens for
`RunConfig(storage_path=...)` (its get_fs_and_path is `pyarrow.fs.FileSystem.from_uri`).

Every write is whole or absent: the data is serialized to bytes first, then on a local filesystem written
to a temporary file beside the target, fsynced and renamed over it; on an object store written to a
temporary key and moved (copied server-side) onto the target, because an object store publishes
whatever an upload stream holds when it closes, even after an error. A directory cannot appear at once
on an object store, so its files are written first and the marker COMPLETE_MARKER last.

Locations stay strings (the RunConfig and the records hold them). A URI is joined on its path, before
its query string (`s3://b/run?endpoint_override=…` + `loss_ddp.json` → `s3://b/run/loss_ddp.json?…`).
Written files and folders get the user's umask, like any file the user's programs make.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import posixpath
import shutil
import tempfile
import uuid
from urllib.parse import urlsplit, urlunsplit

from parity.errors import ConfigError

COMPLETE_MARKER = "_COMPLETE"  # written last into a finished directory (the final checkpoint)
# Mounts every node of an Anyscale cluster shares (docs/anyscale.md); PARITY_SHARED_PATHS adds others.
SHARED_MOUNTS = ("/mnt/cluster_storage", "/mnt/user_storage", "/mnt/shared_storage")
URI_SCHEMES_HINT = "s3://, gs://, abfs://, hdfs:// or file://"


def is_uri(location: str) -> bool:
    return "://" in location


def absolute(location: str) -> str:
    """A local path made absolute (Ray workers do not run in the driver's directory); a URI unchanged."""
    return location if is_uri(location) else os.path.abspath(os.path.expanduser(location))


def join(location: str, *names: str) -> str:
    """`location`/names..., on the path part of a URI (its query string stays at the end)."""
    if not is_uri(location):
        return os.path.join(location, *names)
    parts = urlsplit(location)
    return urlunsplit(parts._replace(path=posixpath.join(parts.path or "/", *names)))


def parent(location: str) -> str:
    if not is_uri(location):
        return os.path.dirname(location)
    parts = urlsplit(location)
    return urlunsplit(parts._replace(path=posixpath.dirname(parts.path.rstrip("/"))))


def name(location: str) -> str:
    """The last component (a file name), without a URI's query string."""
    return posixpath.basename((urlsplit(location).path if is_uri(location) else location).rstrip("/"))


def filesystem(location: str):
    """(pyarrow filesystem, path on it), as Ray Train resolves a storage_path. ConfigError when pyarrow
    cannot open the location (unknown scheme, a store it cannot reach). A plain path is the local filesystem's
    without asking pyarrow to parse it (what from_uri gives for it, in a hundredth of its time: each recorded step's
    batch is written through here, from a thread that shares the loop's interpreter lock)."""
    import pyarrow.fs

    if not is_uri(location):
        return pyarrow.fs.LocalFileSystem(), absolute(location)
    try:
        return pyarrow.fs.FileSystem.from_uri(absolute(location))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{location} cannot be opened ({reason(exc)}): use a local path or a URI that "
                          f"Ray Train accepts ({URI_SCHEMES_HINT})") from None


def local_path(location: str) -> str | None:
    """The path on this machine's own filesystem (a plain path, file://), or None for a remote store."""
    if not is_uri(location):
        return absolute(location)
    if urlsplit(location).scheme != "file":  # decided without opening it (an s3:// URI may ask for its region)
        return None
    return filesystem(location)[1]


def visible_to_every_node(location: str) -> bool:
    """True for a remote store, a known shared mount (SHARED_MOUNTS) and the folders the user declares
    shared in PARITY_SHARED_PATHS (os.pathsep-separated); False for any other local path."""
    path = local_path(location)
    if path is None:
        return True
    declared = [p for p in os.environ.get("PARITY_SHARED_PATHS", "").split(os.pathsep) if p]
    return any(path == root or path.startswith(root.rstrip("/") + "/")
               for root in (*SHARED_MOUNTS, *map(absolute, declared)))


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------

def read_bytes(location: str) -> bytes:
    """The whole file. FileNotFoundError when it does not exist, OSError when it cannot be read."""
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def read_text(location: str) -> str:
    return read_bytes(location).decode("utf-8")


def exists(location: str) -> bool:
    import pyarrow.fs

    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


def size(location: str) -> int | None:
    """The file's size in bytes, or None where there is no file."""
    import pyarrow.fs

    fs, path = filesystem(location)
    info = fs.get_file_info(path)
    return info.size if info.type == pyarrow.fs.FileType.File else None


def is_dir(location: str) -> bool:
    import pyarrow.fs

    fs, path = filesystem(location)
    return fs.get_file_info(path).type == pyarrow.fs.FileType.Directory


def list_files(directory: str, pattern: str) -> list[str]:
    """The files directly in `directory` whose names match the glob `pattern`, sorted, as locations."""
    return _list(directory, pattern, "File")


def list_dirs(directory: str, pattern: str) -> list[str]:
    """The folders directly in `directory` whose names match the glob `pattern`, sorted, as locations."""
    return _list(directory, pattern, "Directory")


def _list(directory: str, pattern: str, kind: str) -> list[str]:
    import pyarrow.fs

    fs, path = filesystem(directory)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    names = sorted(i.base_name for i in infos
                   if i.type == getattr(pyarrow.fs.FileType, kind) and fnmatch.fnmatchcase(i.base_name, pattern))
    return [join(directory, n) for n in names]


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------

def write_bytes_atomic(location: str, data: bytes) -> None:
    """Write `data` at `location` whole (see the module's docstring), creating its folder."""
    import pyarrow.fs

    fs, path = filesystem(location)
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
        return
    tmp = _temporary_sibling(path)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    try:
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.delete_file(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str):
    """A local file written by a library that wants a path (safetensors' save_file of the layer check's
    dumps, too large to hold twice in memory): yield a temporary path beside `path`; on success it is
    fsynced and renamed over `path`, on failure removed."""
    path = absolute(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _temporary_sibling(path)
    # os.open with 0o666 lets the umask decide the mode (mkstemp would make every file 0600).
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text_atomic(location: str, text: str) -> None:
    write_bytes_atomic(location, text.encode("utf-8"))


NON_FINITE = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "inf": math.inf, "-Infinity": -math.inf,
              "-inf": -math.inf}  # how the JSON files spell them (json_safe's, the layer check's)


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


def finite_restored(data):
    """json_safe's inverse: `data` read back from JSON with each non-finite float's spelling a float again."""
    if isinstance(data, str):
        return NON_FINITE.get(data, data)
    if isinstance(data, dict):
        return {k: finite_restored(v) for k, v in data.items()}
    if isinstance(data, list):
        return [finite_restored(v) for v in data]
    return data


def write_json_atomic(location: str, data) -> None:
    write_text_atomic(location, json.dumps(json_safe(data), indent=1, allow_nan=False) + "\n")


def delete_file(location: str) -> None:
    fs, path = filesystem(location)
    fs.delete_file(path)


def delete_dir(location: str) -> None:
    """A folder and everything under it; nothing when there is none."""
    import pyarrow.fs

    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pyarrow.fs.FileType.Directory:
        fs.delete_dir(path)


@contextlib.contextmanager
def directory_writer(location: str):
    """Yield an empty local folder to fill; on success it becomes `location`, whole, with COMPLETE_MARKER
    in it. Local: the folder is a sibling of `location` renamed over it. Object store: a local scratch
    folder whose files are uploaded (each atomically) after the old folder's, with the marker last."""
    import pyarrow.fs

    fs, path = filesystem(location)
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        staging = _temporary_sibling(path)
        os.mkdir(staging, 0o777)  # the umask decides the mode (mkdtemp would make it 0700)
        try:
            yield staging
            with open(os.path.join(staging, COMPLETE_MARKER), "wb"):
                pass
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.replace(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return
    with tempfile.TemporaryDirectory(prefix="parity_upload_") as staging:
        yield staging
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(posixpath.join(path, COMPLETE_MARKER))  # the old folder is incomplete from here on
        fs.delete_dir_contents(path, missing_dir_ok=True)
        for root, _, files in os.walk(staging):
            for file in sorted(files):
                relative = os.path.relpath(os.path.join(root, file), staging)
                with open(os.path.join(root, file), "rb") as f:
                    write_bytes_atomic(join(location, *relative.split(os.sep)), f.read())
        write_bytes_atomic(join(location, COMPLETE_MARKER), b"")


def _temporary_sibling(path: str) -> str:
    """A fresh name beside `path`, hidden, that no reader's pattern (loss_*.json) matches."""
    return posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")


# ---------------------------------------------------------------------------------------------------
# The check before any worker runs
# ---------------------------------------------------------------------------------------------------

def check_writable_dir(flag: str, location: str) -> None:
    """Prove, before any worker runs, that a file can be written in `location` and deleted again, on the
    location's own filesystem (a URI too) — without leaving anything behind: bad input must leave no trace,
    so a local folder that does not exist yet is not made; the nearest folder that does exist is probed."""
    try:
        fs, path = filesystem(location)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {exc}") from None
    local = local_path(location)
    if local is not None:
        existing = local
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            problem = f"{existing} is a file" if existing != local else "it is a file"
            raise ConfigError(f"{flag} {location} is not a writable directory ({problem}): choose a directory you "
                              f"can write to")
        path = existing
    probe = posixpath.join(path, f".write_test_{uuid.uuid4().hex[:12]}")
    try:
        if local is None:  # an object store has no folders to make; creating one leaves nothing behind
            fs.create_dir(path, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"")
        fs.delete_file(probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {location} is not a writable directory ({reason(exc)}): choose a "
                          f"directory{' or a store' if is_uri(location) else ''} you can write to") from None


def reason(exc: BaseException) -> str:
    """An exception's own words on one line: the errno's text for a system error, else its first line."""
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
