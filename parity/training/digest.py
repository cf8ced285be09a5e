"""The digest of a tensor's exact bits, for the checks that tensors stay the same: the replica check (copies on several
ranks, parity/training/replicas.py) and the frozen check (frozen tensors since set-up, parity/training/frozen.py).

The digest reads exact bits. A tensor's bytes are read as signed integer words (16-bit words of a 2-byte dtype,
32-bit ones otherwise), w_0 … w_{n-1}; its digest is (n, S, W) with S = Σ w_i, an exact integer, and
W = Σ (i + 1)·w_i modulo the prime P = 2^31 − 1. A change of one word moves S; a swap of two words, or two changes
that S does not see, move W by (p − q)·d mod P, not 0 for positions closer than P unless the words differ by a
multiple of P (bit patterns such as −0.0 against a NaN). It is computed exactly, in any
order, which is what makes it comparable across ranks: the words are copied into a float64 buffer in rows of
ROW words, and each row's Σ w_j (|·| < 2^42) and Σ (j + 1)·w_j (|·| < 2^51) are sums of integers below 2^53 —
exact in float64 whatever the order a kernel adds them in (a CPU's vector lanes, a GPU's tree); the rows are
then combined in int64 modulo P. A float checksum of the values would not do: one element a few ulps off
vanishes into the rounding of a sum of many.
"""

from __future__ import annotations

import torch

MODULUS = 2**31 - 1  # the digest's prime: products of two residues stay below 2^62
ROW = 1024  # words per row: Σ (j + 1)·w_j over a row stays below 2^51, exact in float64
PASS_ROWS = 1024  # rows per pass over the buffer: 8 MiB of float64, however large the tensors


def words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat tensor of signed integer words: the data itself (a view) where contiguous."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if size == 2:
        return flat.view(torch.int16)
    if size % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.uint8).to(torch.int16)  # 1-byte types: one word per byte


class _BufferPlan:
    """How one list of tensors (their word counts, on one device) goes through the buffer: each tensor in pieces
    of at most PASS_ROWS rows, each piece starting on a row, the pieces packed into passes of at most PASS_ROWS
    rows; and per row the tensor it belongs to and where in that tensor it starts (modulo P)."""

    def __init__(self, counts: tuple[int, ...], device: torch.device):
        self.passes = []  # per pass: (rows, [(tensor, offset, length, first word in the buffer)])
        row_tensor, row_start = [], []
        pieces, used = [], 0
        for k, n in enumerate(counts):
            for offset in range(0, n, PASS_ROWS * ROW):
                length = min(PASS_ROWS * ROW, n - offset)
                rows = -(-length // ROW)
                if used + rows > PASS_ROWS:
                    self.passes.append((used, pieces))
                    pieces, used = [], 0
                pieces.append((k, offset, length, used * ROW))
                row_tensor += [k] * rows
                row_start += [(offset + ROW * r) % MODULUS for r in range(rows)]
                used += rows
        if pieces:
            self.passes.append((used, pieces))
        self.rows = len(row_tensor)
        self.buffer_rows = max((rows for rows, _ in self.passes), default=0)
        self.row_tensor = torch.tensor(row_tensor, dtype=torch.int64, device=device)
        self.row_start = torch.tensor(row_start, dtype=torch.int64, device=device)


class Digester:
    """Digests of lists of tensors, computed where each tensor is (an offloaded shard on the CPU), returned on one
    device. A check digests the same tensors every step, so what it prepares is kept: each list's buffer plan, each
    device's buffer, and the views of the last tensors seen (their copies into the buffer), keyed by where those
    tensors' data is — the views hold their storage, so a tensor replaced since then is met at another address."""

    def __init__(self):
        self._plans: dict[tuple, _BufferPlan] = {}
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._views: dict[torch.device, tuple] = {}  # device → (the tensors' addresses, the passes' views)

    def __call__(self, tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """[len(tensors), 3] int64 on `device`: each tensor's (words, S, W); (−1, −1, −1) for None."""
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if t is not None:
                by_device.setdefault(t.device, []).append(i)
        if list(by_device) == [device] and len(by_device[device]) == len(tensors):
            return self._digest([tensors[i] for i in by_device[device]], device)
        out = torch.full((len(tensors), 3), -1, dtype=torch.int64, device=device)
        for where, indexes in by_device.items():
            out[torch.tensor(indexes, device=device)] = self._digest([tensors[i] for i in indexes], where).to(device)
        return out

    def _digest(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """[n, 3]: (words, S, W) of each tensor, all on `device`."""
        addresses = tuple((t.data_ptr(), t.numel()) for t in tensors)
        cached = self._views.get(device)
        if cached is None or cached[0] != addresses:
            flat = [words(t) for t in tensors]
            counts = tuple(f.numel() for f in flat)
            plan = self._plans.get((device, counts))
            if plan is None:
                plan = self._plans[(device, counts)] = _BufferPlan(counts, device)
            buffer = self._buffer(device, plan.buffer_rows)
            passes = [(rows, [buffer[at + length:at + -(-length // ROW) * ROW] for _, _, length, at in pieces
                              if length % ROW],
                       [buffer[at:at + length] for _, _, length, at in pieces],
                       [flat[k][offset:offset + length] for k, offset, length, _ in pieces])
                      for rows, pieces in plan.passes]
            counts = torch.tensor(counts, dtype=torch.int64, device=device)
            cached = self._views[device] = (addresses if all(t.is_contiguous() for t in tensors) else None,
                                            plan, passes, counts)
        _, plan, passes, counts = cached
        buffer = self._buffers[device]
        row_sums = torch.empty(plan.rows, dtype=torch.float64, device=device)
        row_weighted = torch.empty_like(row_sums)
        done = 0
        for rows, pads, destinations, sources in passes:
            if pads:
                torch._foreach_zero_(pads)
            torch._foreach_copy_(destinations, sources)
            block = buffer[:rows * ROW].view(rows, ROW)
            torch.sum(block, 1, out=row_sums[done:done + rows])
            torch.mv(block, self._weights[device], out=row_weighted[done:done + rows])
            done += rows
        s_row = row_sums.to(torch.int64)  # exact: |Σ| < 2^42 a row, < 2^63 a tensor of fewer than 2^32 words
        w_row = (plan.row_start * s_row.remainder(MODULUS)
                 + row_weighted.to(torch.int64).remainder_(MODULUS)).remainder_(MODULUS)
        sw = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
        sw.index_add_(0, plan.row_tensor, torch.stack([s_row, w_row], 1))
        sw[:, 1].remainder_(MODULUS)
        return torch.cat([counts[:, None], sw], 1)

    def _buffer(self, device: torch.device, rows: int) -> torch.Tensor:
        if device not in self._buffers or self._buffers[device].numel() < rows * ROW:
            self._buffers[device] = torch.empty(rows * ROW, dtype=torch.float64, device=device)
            self._weights[device] = torch.arange(1, ROW + 1, dtype=torch.float64, device=device)
        return self._buffers[device]
