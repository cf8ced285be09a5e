"""A recorded step's rows: what each rank hands over (its DP rank's micro-batches, its loss sum and tokens, its health),
how they reach rank 0, and what rank 0 makes of them — the global batch in the harness's order, the check that no two
DP ranks fed the same rows — and the background writer that saves each step's batch off the training's path.

Each micro-batch is kept as the loop fed it (`taken`): its ids, labels and mask (ones where it fed none), its position
ids where it fed its own (packed or padding-free rows) and what came with them (fed_rows flags: transformers keeps
packed documents apart only under position ids with no mask and no cache, so the replay feeds each as it came).

The exchange is one tensor collective a step (after the first): an all_gather, per rank, of a six-number header
(every rank learns every rank's health, loss sum and loss tokens) and its packed rows (int64 words: the micro-batches'
shapes and flags, then their ids, labels, masks and position ids where fed) padded to a capacity that grows to the
longest rows seen. Rows longer than
the capacity (the first step's; any past FUSED_WORDS) go to rank 0 alone in a gather. Rank 0 alone unpacks, hashes,
checks and saves the batch. Where ranks share a DP rank (FSDP2's TP ranks
feed the same rows) only one of them hands over rows and sums (the view's `feeds`).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from queue import Queue
from typing import NamedTuple

import torch
import torch.distributed as dist

from parity.training.data import Batch
from parity.training.fed_rows import FED_CACHE, FED_MASK, FED_POSITIONS, flags_of
from parity.training.loss import IGNORE_INDEX

PAD_ID = 0  # what a shorter micro-batch's rows are right-padded with to the step's longest (labels −100, mask 0)
HEADER = ("broken", "loss_sum", "tokens", "feeds", "dp_rank", "words")  # int64 each (the sum: its float64 bits)
FUSED_WORDS = 1 << 20  # rows up to 8 MiB a rank travel with the header (one all_gather); longer ones to rank 0 alone


class MicroBatch(NamedTuple):
    """One micro-batch as a rank fed it: int64 CPU ids, labels and mask (ones where it fed none) [rows, length], its
    position ids where it fed its own (else None), its fed_rows flags (what came with its rows) and, for a run of a
    post-training objective, its rollout rows and partial sums as int64 words (recorded_objective.encode)."""

    ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor | None
    flags: int
    rollout: torch.Tensor | None = None


def taken(input_ids, labels, attention_mask, position_ids, use_cache, view) -> MicroBatch:
    """What the loop fed the model, as the replay must feed it: position ids that are not the model's own (0, 1, …
    along every row) and whether a mask came with them; `use_cache` as transformers resolves it (5.23's
    merge_with_config_defaults: the call's, else the model config's; off under gradient checkpointing in training:
    `view.checkpointing()`, the recorder's view's reading of its model, once a step).
    The ids, labels, mask and position ids are int64 copies of their own, left on their device: on_host takes the
    step's off it at its end, in one copy (on a GPU, one wait a step, not three a micro-batch)."""
    fed = [t.detach() for t in (input_ids, labels, attention_mask) if t is not None]
    if len({(t.shape, t.device) for t in fed}) == 1:  # one stack: a copy, on the device
        ids, lab, *mask = torch.stack([t.to(torch.int64) for t in fed]).unbind()
    else:
        ids, lab, *mask = (t.to("cpu", torch.int64, copy=True) for t in fed)
    mask = mask[0] if mask else torch.ones_like(ids)
    positions = None
    if position_ids is not None and not default_positions(position_ids, ids.shape[1]):
        positions = position_ids.detach().to(ids.device, torch.int64).expand(ids.shape).clone(
            memory_format=torch.contiguous_format)
    if use_cache is None:
        use_cache = getattr(getattr(view.model, "config", None), "use_cache", False)
    cache = bool(use_cache) and not (getattr(view.model, "training", False) and view.checkpointing())
    return MicroBatch(ids, lab, mask, positions, flags_of(positions is not None, attention_mask is not None, cache))


def on_host(micro: list[MicroBatch], loss_sum, leaving=lambda t: t.device.type != "cpu"
            ) -> tuple[list[MicroBatch], float]:
    """The step's micro-batches with their rows on the CPU, and its loss sum (float64: a tensor, or a float) as a
    float; what is `leaving` its device (on a GPU's: every row and the sum) taken off it in one copy where it is all on
    one device (one wait a step)."""
    moving = [t for m in micro for t in (m.ids, m.labels, m.mask, m.positions) if t is not None and leaving(t)]
    loss = loss_sum.reshape(1).view(torch.int64) if torch.is_tensor(loss_sum) and leaving(loss_sum) else None
    moving += [loss] if loss is not None else []  # the sum's float64 bits ride the copy
    if not moving:
        return micro, float(loss_sum)
    if len({t.device for t in moving}) == 1:
        words = torch.cat([t.reshape(-1) for t in moving]).cpu().split([t.numel() for t in moving])
        host = {id(t): w.view(t.shape) for t, w in zip(moving, words)}
    else:
        host = {id(t): t.cpu() for t in moving}
    fields = ("ids", "labels", "mask", "positions")
    moved = [m._replace(**{k: host.get(id(t), t) for k, t in zip(fields, (m.ids, m.labels, m.mask, m.positions))})
             for m in micro]
    return moved, float(host[id(loss)].view(torch.float64)) if loss is not None else float(loss_sum)


def next_token_rows(ids: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a framework whose labels are already the next tokens (targets[t] is position t's: torchtitan's,
    megatron-core's) as Hugging Face's convention feeds them (labels[t + 1] is position t's target): the input ids and
    one more token — the last target, which no position reads — and labels −100 then the targets, −100 too where
    `mask` (a loss mask of the targets' shape) is 0."""
    labels = targets if mask is None else torch.where(mask.bool(), targets, torch.full_like(targets, IGNORE_INDEX))
    return torch.cat([ids, targets[:, -1:]], 1), torch.cat([torch.full_like(targets[:, :1], IGNORE_INDEX), labels], 1)


def positions_line(step: int, flags: torch.Tensor) -> str:
    """The recorder's line at the first step whose rows came with position ids of their own. Where some came with a
    mask or a cache too, transformers masked the whole row causally and its documents attended to each other: the
    replay feeds them so, as the run did, so the verdict cannot tell — the line says it."""
    line = (f"step {step} fed position ids of its own (packed or padding-free rows): each row is recorded with them, "
            f"its mask or none and its cache, and replayed as it was fed")
    if any(f & FED_POSITIONS and f & (FED_MASK | FED_CACHE) for f in flags.tolist()):
        line += ("; some came with an attention mask or a cache, under which transformers masks the whole row "
                 "causally: their documents attended to each other (pass use_cache=False and no attention_mask to "
                 "keep them apart)")
    return line


@dataclass
class Exchanged:
    """What the step's exchange gave this rank: every DP rank's loss sum and loss tokens (in DP rank order, every
    rank), and on rank 0 every DP rank's micro-batches [MicroBatch, ...]."""

    rank_loss_sums: list[float]
    rank_tokens: list[int]
    per_dp_rank: list[list[MicroBatch]] | None = field(default=None)
    extra: torch.Tensor | None = field(default=None)  # [world, words]: each rank's `extra` words, in rank order


def pack(micro: list[MicroBatch]) -> torch.Tensor:
    """Micro-batches as one int64 tensor: their count, each one's shape, flags and rollout words, then each one's ids,
    labels, mask, position ids (where it fed its own) and rollout words (a post-training objective's)."""
    heads = [d for m in micro for d in (*m.ids.shape, m.flags, 0 if m.rollout is None else m.rollout.numel())]
    return torch.cat([torch.tensor([len(micro), *heads], dtype=torch.int64),
                      *(t.reshape(-1) for m in micro for t in (m.ids, m.labels, m.mask, m.positions, m.rollout)
                        if t is not None)])


def unpack(words: torch.Tensor) -> list[MicroBatch]:
    n = int(words[0])
    heads = words[1:1 + 4 * n].tolist()
    at, out = 1 + 4 * n, []
    for rows, length, flags, extra in zip(heads[0::4], heads[1::4], heads[2::4], heads[3::4]):
        size, parts = rows * length, 4 if flags & FED_POSITIONS else 3
        tensors = [words[at + k * size:at + (k + 1) * size].view(rows, length) for k in range(parts)]
        at += parts * size
        out.append(MicroBatch(*tensors[:3], tensors[3] if parts == 4 else None, flags,
                              words[at:at + extra] if extra else None))
        at += extra
    return out


class RowExchange:
    """The step's exchange, one per recorder: its capacity (the rows' words that travel with the header) grows to the
    longest rows seen, up to FUSED_WORDS, so that from the second step on it is one all_gather."""

    def __init__(self):
        self.capacity = 0

    def __call__(self, broken: str | None, loss_sum: float, tokens: int, micro: list, *, feeds: bool, dp_rank: int,
                 dp_size: int, device: torch.device, extra: torch.Tensor | None = None) -> Exchanged:
        """Every rank; collective. `extra`: int64 words every rank sends, as many on each (what rides the exchange:
        the recorder's tensor sums and replica digests), handed back gathered. Raises RuntimeError("rank r: why") on
        every rank where any rank is broken (the text on rank 0), where the DP ranks are not each fed by one rank, or
        where the step has no token in its loss."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if broken:
            payload = torch.tensor(list(broken.encode()[:400]), dtype=torch.int64)
        elif feeds:
            payload = pack(micro)
        else:
            payload = torch.zeros(0, dtype=torch.int64)
        n, cap = payload.numel(), self.capacity
        extra = torch.zeros(0, dtype=torch.int64) if extra is None else extra.reshape(-1).cpu()
        head = len(HEADER) + extra.numel()
        sent = torch.zeros(head + cap, dtype=torch.int64)
        sent[:len(HEADER)] = torch.tensor([int(bool(broken)), 0, int(tokens), int(feeds), int(dp_rank), n])
        sent[1:2] = torch.tensor([float(loss_sum)], dtype=torch.float64).view(torch.int64)  # the sum's bits, exact
        sent[len(HEADER):head] = extra
        sent[head:head + min(n, cap)] = payload[:cap]
        sent = sent.to(device)
        table = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(table, sent)
        table = torch.stack(table).cpu()
        extras, table = table[:, len(HEADER):head], torch.cat([table[:, :len(HEADER)], table[:, head:]], 1)
        lengths = table[:, HEADER.index("words")].tolist()
        longest = max(lengths)
        if longest <= cap:
            payloads = [table[r, len(HEADER):len(HEADER) + lengths[r]] for r in range(world)]
        else:  # longer rows than the capacity: gathered to rank 0 apart, this once
            if longest <= FUSED_WORDS:
                self.capacity = 1 << (longest - 1).bit_length()
            padded = torch.zeros(longest, dtype=torch.int64, device=device)
            padded[:n] = payload.to(device)
            gathered = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
            dist.gather(padded, gathered, dst=0)
            payloads = [g[:lengths[r]].cpu() for r, g in enumerate(gathered)] if rank == 0 else None
        down = [r for r in range(world) if table[r, 0]]
        if down:
            why = bytes(payloads[down[0]].tolist()).decode(errors="replace") if payloads is not None else "broken"
            raise RuntimeError(f"rank {down[0]}: {why}")
        feeders = sorted((int(table[r, 4]), r) for r in range(world) if table[r, 3])
        if [d for d, _ in feeders] != list(range(dp_size)):
            raise RuntimeError(f"the DP ranks fed ({[d for d, _ in feeders]}) are not each of 0…{dp_size - 1} once")
        sums, tokens = table[:, 1].contiguous().view(torch.float64).tolist(), [int(table[r, 2]) for _, r in feeders]
        if not sum(tokens):  # the step's loss is 0/0: nothing to hold a replay's against
            raise RuntimeError("the step's global batch has no token in its loss (every label is -100 on every rank): "
                               "look at the data's labels — a prompt as long as max_length leaves none")
        return Exchanged([sums[r] for _, r in feeders], tokens,
                         [unpack(payloads[r]) for _, r in feeders] if rank == 0 else None, extras)


def global_batch(per_rank: list[list[MicroBatch]]) -> tuple[Batch, torch.Tensor, list[list[int]]]:
    """The step's global batch in the harness's order — DP rank 0's micro-batches in order, then DP rank 1's ... —
    every row as it was fed (right or left padded) and padded on the right to the step's longest (ids PAD_ID, labels
    −100, mask 0, position ids 0: nothing the loss or a causal model's earlier positions see), with the attention mask
    and the rows of each micro-batch per DP rank. Where a row came with position ids of its own, the batch carries every
    row's (the model's own where a row fed none) and flags (data.Batch.fed): the replay feeds each row as it came.
    ValueError, one line, for rows the replay cannot feed (padding_problem)."""
    length = max(m.ids.shape[1] for micro in per_rank for m in micro)
    fed = any(m.positions is not None for micro in per_rank for m in micro)
    columns: dict[str, list[torch.Tensor]] = {"ids": [], "labels": [], "mask": [], "positions": []}
    for rank, micro in enumerate(per_rank):
        for k, m in enumerate(micro):
            problem = padding_problem(m.mask, m.labels, f"DP rank {rank}'s micro-batch {k}")
            if problem:
                raise ValueError(problem)
            positions = m.positions if m.positions is not None else torch.arange(m.ids.shape[1]).expand(m.ids.shape)
            for key, t, fill in (("ids", m.ids, PAD_ID), ("labels", m.labels, IGNORE_INDEX), ("mask", m.mask, 0),
                                 ("positions", positions, 0)):
                columns[key].append(torch.nn.functional.pad(t, (0, length - t.shape[1]), value=fill))
    ids, labels, mask, positions = (torch.cat(columns[k]) for k in ("ids", "labels", "mask", "positions"))
    structure = [[m.ids.shape[0] for m in micro] for micro in per_rank]
    if not fed:
        return Batch(ids, labels), mask, structure
    flags = torch.tensor([m.flags for micro in per_rank for m in micro for _ in range(m.ids.shape[0])])
    return Batch(ids, labels, None, mask, positions, flags), mask, structure


def padding_problem(mask: torch.Tensor, labels: torch.Tensor, where: str) -> str | None:
    """Why rows with this attention mask cannot be replayed (None: each row's ones are one run — right padding
    1…1 0…0, left padding 0…0 1…1, or both — and no label sits where the mask is 0). A mask with holes (packed
    documents masked apart) is another model input than the replay feeds."""
    mask, labels = mask.numpy(force=True), labels.numpy(force=True)  # numpy: a tenth of torch's dispatch
    starts = (mask[:, 1:] > mask[:, :-1]).sum(1) + (mask[:, 0] > 0)  # where a run of ones begins
    holes = (starts > 1).nonzero()[0]
    if len(holes):
        return (f"{where}, row {int(holes[0])}: the attention mask has holes (more than one run of ones): "
                f"the replay feeds right or left padding only")
    if not (labels[mask == 0] == IGNORE_INDEX).all():
        return f"{where}: labels on padding (where the attention mask is 0): set them to -100"
    return None


def row_digests(per_rank: list[list[tuple]]) -> list[list[str]]:
    """Per rank, each row's sha256 over its ids and labels where its mask is 1, in the order the rank fed them."""
    digests = []
    for micro in per_rank:
        mine = []
        for ids, labels, mask, *_ in micro:  # in numpy: a row's few ops cost a tenth of torch's dispatch
            ids, labels, real = ids.numpy(), labels.numpy(), mask.numpy() != 0  # right or left padding alike
            for row in range(ids.shape[0]):
                mine.append(hashlib.sha256(ids[row][real[row]].tobytes() + labels[row][real[row]].tobytes()).hexdigest())
        digests.append(mine)
    return digests


def rows_hash(digests: list[list[str]]) -> str:
    """The step's rows whatever their order or layout, from their row_digests: sha256 over the sorted digests. Two
    recordings of one script at other layouts (2 ranks, or 1 rank with twice the accumulation) feed the same rows in
    another order: equal here, other batch hashes (parity.comparing.curves accepts that between two recorded runs)."""
    return hashlib.sha256("".join(sorted(d for rank in digests for d in rank)).encode()).hexdigest()


def duplicate_rows(digests: list[list[str]]) -> dict:
    """Whether two DP ranks fed the same rows in the step, from their row_digests: {"duplicates": rows of a rank
    another rank also fed, "pairs": [[rank, other rank, rows], ...]}."""
    digests = [set(rank) for rank in digests]
    pairs = [[r, s, len(digests[r] & digests[s])] for r in range(len(digests)) for s in range(r + 1, len(digests))
             if digests[r] & digests[s]]
    return {"duplicates": sum(p[2] for p in pairs), "pairs": pairs}


class BatchWriter:
    """Rank 0's writer of the saved batches, on a thread of its own: each step's batch is encoded (safetensors) and
    written atomically while the training goes on; `finished()` says which steps are on disk and which failed (in
    step order); `flush()` waits for those submitted (a checkpoint's), `close()` for the rest and ends the thread."""

    def __init__(self):
        self._queue: Queue = Queue()
        self._done: list[tuple[int, str | None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="parity-batch-writer", daemon=True)
        self._thread.start()

    def submit(self, step: int, path: str, tensors: dict[str, torch.Tensor]) -> None:
        self._queue.put((step, path, tensors))

    def _run(self) -> None:
        from safetensors.torch import save

        from parity import storage

        while True:
            job = self._queue.get()
            if job is None:
                return
            step, path, tensors = job
            try:
                storage.write_bytes_atomic(path, save({k: v.contiguous() for k, v in tensors.items()}))
                outcome = None
            except Exception as exc:  # said by the recorder, on its thread
                outcome = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            with self._lock:
                self._done.append((step, outcome))
            self._queue.task_done()

    def finished(self) -> list[tuple[int, str | None]]:
        """(step, None if written else why not) of every batch finished since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def flush(self) -> list[tuple[int, str | None]]:
        self._queue.join()
        return self.finished()

    def close(self) -> list[tuple[int, str | None]]:
        self._queue.put(None)
        self._thread.join()
        return self.finished()


__all__ = ["BatchWriter", "Exchanged", "MicroBatch", "PAD_ID", "duplicate_rows", "RowExchange", "global_batch", "pack",
           "padding_problem", "positions_line", "row_digests", "rows_hash", "taken", "unpack"]


def default_positions(position_ids, length: int) -> bool:
    """Whether position ids are what the model makes by itself (0, 1, … on every row): then they change nothing."""
    return bool((position_ids.detach().cpu() == torch.arange(length)).all())
