"""Every tensor's series beside a loss record: `loss_<name>.tensors/`, one chunk file per record write.

The loss record (record.py) is rewritten whole every --log_interval steps; a series of every trainable tensor at every
step written into it would make each rewrite grow with the steps, and the run's writing with their square. So rank 0
buffers the steps' per-tensor norms and, at each record write, writes the steps since the last one as a new chunk
(`chunk_<first step>.json`, atomically, through parity.storage: a local folder or a URI) before the record, which
lists its chunks. The record's "tensors" entry:

    {"names": [Hugging Face names], "grad": "pre_clip" | "clipped", "read_at": where (tensor_norms.READ_AT),
     "norm_dtype": what the run's norm is accumulated in ("float64", "fp32"), "folder": "loss_<name>.tensors",
     "chunks": ["chunk_0000000.json", ...]}

or {"names": [], "why": "..."} where the run measured none. A chunk: {"first_step", "grad_norm": [[per name] per step],
"param_norm": [[...]], "clip_coef": [per step] (a "clipped" record's coefficient), or absent; "update_noise_carried": [[[per
noise level] per name] per step] (the baseline's optimizer noise, each step's whole variance: parity/training/update_noise.py;
"update_noise" in a record from before, each step's increment), or absent}. A run resumed at step k
keeps the chunks its checkpoint listed that start before k; the first chunk after the resume starts at k, and where
two chunks hold a step the later one's row is read. The folder is named relative to the record, so a moved or copied
folder of records reads as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from parity import storage
from parity.errors import RecordError
from parity.training.tensor_norms import AFTER_BACKWARD, AT_CLIP, CLIPPED, PRE_CLIP
from parity.training.update_noise import rounded

CARRIED = "update_noise_carried"  # a chunk's tables, each step's whole variance (tensor_tables)

KEY = "tensors"  # the record's entry
SUFFIX = ".tensors"


def folder_of(record_path: str) -> str:
    """The series' folder beside the record `record_path` (loss_ddp.json → loss_ddp.tensors)."""
    name = storage.name(record_path)  # a URI's query (an S3 endpoint) stays the URI's, after the path
    return storage.join(storage.parent(record_path), (name[:-len(".json")] if name.endswith(".json") else name) + SUFFIX)


class TensorSeriesWriter:
    """Rank 0's writer of one run's series, declared into its LossRecord `record` (`names`: the trainable tensors, or
    None with `why` where the run measures none; `grad`: which gradient, PRE_CLIP or CLIPPED; `read_at`: where it was
    read, a key of tensor_norms.READ_AT; `norm_dtype`: what the norm it is held to is accumulated in)."""

    def __init__(self, record, names: list[str] | None, grad: str = PRE_CLIP, why: str | None = None,
                 read_at: str = AT_CLIP, norm_dtype: str = "float64"):
        self.record, self.rows = record, []
        if names is None:
            record.data[KEY] = {"names": [], "why": why or "the strategy does not hand over its tensors' pieces"}
        else:
            record.data[KEY] = {"names": list(names), "grad": grad, "read_at": read_at, "norm_dtype": norm_dtype,
                                "folder": storage.name(folder_of(record.path)),
                                "chunks": list(record.data.get(KEY, {}).get("chunks", []))}  # a resumed record's kept

    @property
    def measured(self) -> bool:
        return bool(self.record.data[KEY]["names"])

    def append(self, step: int, grad_norms: list[float], param_norms: list[float],
               clip_coef: float | None = None, update_noise: list[list[float]] | None = None) -> None:
        if self.measured:
            self.rows.append((step, grad_norms, param_norms, clip_coef,
                              None if update_noise is None else [rounded(row) for row in update_noise]))

    def flush(self) -> None:
        """Write the steps buffered since the last flush as one chunk and list it in the record (before the record
        itself is written). Rank 0 only."""
        if not self.rows:
            return
        first = self.rows[0][0]
        chunk = {"first_step": first, "grad_norm": [r[1] for r in self.rows], "param_norm": [r[2] for r in self.rows]}
        if any(r[3] is not None for r in self.rows):
            chunk["clip_coef"] = [r[3] for r in self.rows]
        if all(r[4] is not None for r in self.rows):
            chunk[CARRIED] = [r[4] for r in self.rows]
        name = f"chunk_{first:07d}.json"
        storage.write_text_atomic(storage.join(folder_of(self.record.path), name),  # compact: it is numbers only
                                  json.dumps(storage.json_safe(chunk), separators=(",", ":"), allow_nan=False))
        entry = self.record.data[KEY]
        entry["chunks"] = [c for c in entry["chunks"] if c != name] + [name]
        self.rows = []


def kept_chunks(chunks: list[str], step: int) -> list[str]:
    """The chunks a record resumed at step `step` keeps: those that start before it (a later one is written again)."""
    return [c for c in chunks if _first_step(c) < step]


def _numbers(row: list) -> list[float]:
    """A chunk's row with its non-finite values (an fp16 overflow's gradient) read back as floats."""
    return [storage.NON_FINITE.get(x, x) if isinstance(x, str) else x for x in row]


def _first_step(chunk_name: str) -> int:
    return int(chunk_name[len("chunk_"):-len(".json")])


@dataclass(frozen=True)
class TensorSeries:
    """A run's per-tensor series, read back: `names`, `grad` (PRE_CLIP or CLIPPED), and per step (the record's steps,
    in order) each tensor's gradient norm and parameter norm, and the clip coefficient (a clipped record's, else None)."""

    names: list[str]
    grad: str
    grad_norm: list[list[float]]
    param_norm: list[list[float]]
    clip_coef: list[float | None]
    read_at: str = AT_CLIP  # where the gradients were read (tensor_norms.READ_AT)
    norm_dtype: str = "float64"  # what the run's pre-clip norm is accumulated in
    # per step, per tensor, its optimizer's noise table (update_noise.tensor_tables); None where a step has none
    update_noise: list[list[list[float]] | None] | None = None
    # whether each step's table is its whole variance (carried flips), not its increment (a record from before)
    update_noise_carried: bool = False

    def series(self, phase_key: str, name: str) -> list[float]:
        i = self.names.index(name)
        return [row[i] for row in getattr(self, phase_key)]


def load_series(record_path: str, data: dict) -> TensorSeries | None:
    """The series of the record at `record_path` (its loaded `data`), or None where the run measured none (its
    entry says why). RecordError names a chunk that is missing, unreadable or short of the record's steps."""
    entry, name = data.get(KEY), storage.name(record_path)
    if not isinstance(entry, dict) or not isinstance(entry.get("names"), list):
        raise RecordError(f"{name}: missing or invalid '{KEY}' (every tensor's series): not a record of this harness's "
                          f"schema")
    if not entry["names"]:
        return None
    if entry.get("grad") not in (PRE_CLIP, CLIPPED):
        raise RecordError(f"{name}: {KEY}.grad is {entry.get('grad')!r}, not {PRE_CLIP!r} or {CLIPPED!r}")
    folder = storage.join(storage.parent(record_path), entry["folder"])
    steps, width = len(data["steps"]), len(entry["names"])
    rows: dict[int, tuple] = {}
    carried = False
    for chunk_name in entry["chunks"]:
        where = storage.join(folder, chunk_name)
        try:
            chunk = json.loads(storage.read_text(where))
        except (OSError, ValueError) as exc:
            raise RecordError(f"{name}: its tensor series {entry['folder']}/{chunk_name} cannot be read "
                              f"({storage.reason(exc) if isinstance(exc, OSError) else 'not valid JSON'}): copy the "
                              f"record's {entry['folder']} folder with it, or rerun that run") from None
        clips = chunk.get("clip_coef") or [None] * len(chunk["grad_norm"])
        carried = carried or CARRIED in chunk
        noise = chunk.get(CARRIED) or chunk.get("update_noise") or [None] * len(chunk["grad_norm"])
        for i, (g, p, c, u) in enumerate(zip(chunk["grad_norm"], chunk["param_norm"], clips, noise)):
            if len(g) != width or len(p) != width or (u is not None and len(u) != width):
                raise RecordError(f"{name}: {entry['folder']}/{chunk_name} holds {len(g)} tensors at a step, the "
                                  f"record names {width}")
            rows[chunk["first_step"] + i] = (_numbers(g), _numbers(p), c, u and [_numbers(row) for row in u])
    missing = [s for s in range(steps) if s not in rows]
    if missing:
        raise RecordError(f"{name}: its tensor series lacks step {missing[0]} (of {steps}): the record's "
                          f"{entry['folder']} folder is incomplete; copy it with the record, or rerun that run")
    ordered = [rows[s] for s in range(steps)]
    noise = [r[3] for r in ordered]
    return TensorSeries(list(entry["names"]), entry["grad"], [r[0] for r in ordered], [r[1] for r in ordered],
                        [r[2] for r in ordered], entry.get("read_at", AFTER_BACKWARD),  # (before it was recorded)
                        entry.get("norm_dtype", "fp32"), noise if any(u is not None for u in noise) else None, carried)
