"""A recorded run's packed and padding-free rows, fed to its replay as the run fed them (docs/own_trainer/techniques.md#packed-and-
padding-free-rows).

Why: transformers (5.23) keeps the documents of a packed row apart only where the row comes with its position ids, no
attention mask and no cache: it then finds the documents where the position ids restart and builds one causal mask per
document. With a cache, or a 2-D mask, the mask is causal over the whole row and each document attends to the ones
before it (measured: 0.37 to 0.67 apart). A replay that fed such rows otherwise than the run did would train another
model, so the recorder keeps, for every step in which a row came with position ids of its own, each row's position ids
and what came with it (FED_* flags: its position ids, its mask, a cache), and the replay feeds each row alone, cut to
its length, with exactly those — never several rows padded into one 2-D batch.

Rows go round the replay's workers whole where they can; where they cannot (fewer rows than workers, or a count the
workers do not divide: each rank must feed as many micro-batches, as DDP's buffer broadcasts and reductions go alike on
every rank), rows are cut at document boundaries (`cut_points`) into `units`. A step's hash is then taken over its rows'
tokens one after another (`stream_hash`): the same for the recorded rows and for the units they were cut into.

Here, on the training floor: the flags, the cuts and the hash. The recorder sets the flags (parity/recording/rows.py),
data.Batch carries them and data.RecordedBatches cuts.
"""

from __future__ import annotations

import hashlib

import torch

from parity.training.loss import IGNORE_INDEX

FED_POSITIONS, FED_MASK, FED_CACHE = 1, 2, 4  # a row came with position ids of its own / an attention mask / use_cache


def flags_of(positions: bool, mask: bool, cache: bool) -> int:
    """A row's flags: one int64 a row in the saved batch, and in the exchange's header of its micro-batch."""
    return FED_POSITIONS * positions + FED_MASK * mask + FED_CACHE * cache


def length(mask_row: torch.Tensor) -> int:
    """A row's length as fed: up to its mask's last one (the mask the run fed, ones where it fed none; the zeros after
    it are the padding the saved step was filled up with to its longest row, or the run's own right padding, which no
    earlier position sees and no loss counts)."""
    ones = mask_row.nonzero()
    return int(ones[-1]) + 1 if len(ones) else 0


def separable(flag: int) -> bool:
    """Whether a row's documents were kept apart: position ids of its own, no mask, no cache."""
    return flag & (FED_POSITIONS | FED_MASK | FED_CACHE) == FED_POSITIONS


def cut_points(labels_row: torch.Tensor, positions_row: torch.Tensor, flag: int, n: int) -> list[int]:
    """Where a row may be cut, in 1…n−1: a document's first position (its position id not its predecessor's + 1) whose
    label is −100 — no token before it predicts it, so the loss counts what it counted — in a row whose documents the
    model kept apart (`separable`). Cut there, each piece computes what it computed inside the row."""
    if not separable(flag) or n < 2:
        return []
    starts = (positions_row[1:n] != positions_row[:n - 1] + 1) & (labels_row[1:n] == IGNORE_INDEX)
    return [int(i) + 1 for i in starts.nonzero().flatten()]


def plan_units(lengths: list[int], cuts: list[list[int]], workers: int, where: str) -> list[tuple[int, int, int]]:
    """The replay's rows of a step for `workers` DP ranks, (row, start, stop) in order: the recorded rows (an empty one
    left out), the longest that can be cut cut at its document boundary nearest its middle, one cut at a time, until
    the count is a multiple of `workers` (each rank then feeds as many). ValueError, one line naming the worker counts
    that go, where the documents cannot be cut into that many."""
    units = [(r, 0, n) for r, n in enumerate(lengths) if n]
    rows, most = len(units), len(units) + sum(map(len, cuts))
    wanted = max(workers, -(-rows // workers) * workers)
    if wanted > most:
        fits = [str(w) for w in range(1, most + 1) if -(-rows // w) * w <= most]
        raise ValueError(f"{where}: its {rows} row{'s' if rows > 1 else ''} cannot be cut at document boundaries "
                         f"into a multiple of {workers} (at most {most} pieces): use {', '.join(fits[:8])}"
                         f"{' …' if len(fits) > 8 else ''} workers")
    for _ in range(wanted - rows):
        cuttable = [(stop - start, -i, i) for i, (r, start, stop) in enumerate(units)
                    if any(start < c < stop for c in cuts[r])]
        _, _, i = max(cuttable)
        r, start, stop = units[i]
        middle = min((c for c in cuts[r] if start < c < stop), key=lambda c: abs(2 * c - start - stop))
        units[i:i + 1] = [(r, start, middle), (r, middle, stop)]
    return units


def units(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, fed: torch.Tensor,
          workers: int, where: str) -> tuple[torch.Tensor, ...]:
    """A saved step's rows as the replay's rows for `workers` (plan_units): (ids, labels, mask, position ids, flags),
    right-padded to the longest (ids 0, labels −100, mask 0, position ids 0), each with its row's flags."""
    lengths = [length(m) for m in mask]
    cuts = [cut_points(labels[r], positions[r], int(fed[r]), n) for r, n in enumerate(lengths)]
    plan = plan_units(lengths, cuts, workers, where)
    longest = max(stop - start for _, start, stop in plan)
    out = []
    for source, fill in ((ids, 0), (labels, IGNORE_INDEX), (mask, 0), (positions, 0)):
        table = torch.full((len(plan), longest), fill, dtype=torch.int64)
        for u, (r, start, stop) in enumerate(plan):
            table[u, :stop - start] = source[r, start:stop]
        out.append(table)
    return (*out, torch.tensor([int(fed[r]) for r, _, _ in plan], dtype=torch.int64))


def stream_hash(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                fed: torch.Tensor) -> str:
    """A step of fed rows' fingerprint: its rows cut to their lengths, one after another — tokens, labels, position
    ids, mask and each token's row flags — so that rows cut into units hash as the rows."""
    parts: dict[str, list[torch.Tensor]] = {"ids": [], "labels": [], "position_ids": [], "mask": [], "fed": []}
    for r in range(len(ids)):
        n = length(mask[r])
        for key, t in (("ids", ids[r, :n]), ("labels", labels[r, :n]), ("position_ids", positions[r, :n]),
                       ("mask", mask[r, :n]), ("fed", fed[r].expand(n))):
            parts[key].append(t)
    data = b"fed rows"
    for key, pieces in parts.items():
        data += key.encode() + torch.cat(pieces).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


__all__ = ["FED_CACHE", "FED_MASK", "FED_POSITIONS", "cut_points", "flags_of", "length", "plan_units", "separable",
           "stream_hash", "units"]
