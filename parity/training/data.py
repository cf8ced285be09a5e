"""Deterministic global batches that do not depend on the parallel layout.

The global batch of step s (dp_size × batch_size samples) is a pure function of (seed, step, global
batch size); DP rank r takes rows [r·batch_size, (r+1)·batch_size). So DDP on 2 workers, DDP on 1 worker
with twice the batch, and a TP=2×DP=2 job all see the same samples, and every rank of a TP group reads
the same slice. A batch is input ids and labels (the ids again, −100 where a position is padding): with
padded samples (--dataset synthetic_padded) DP ranks and micro-batches hold different numbers of loss
tokens, and a step's loss is the mean over the global batch's loss tokens, never a mean of means.

--packing fills each row with whole documents of varying lengths, their position ids restarting at 0 at each
document's start and its first label −100 (the previous document's last token predicts nothing): the loss is over every
real token, and the model, fed the position ids with no mask and no cache, keeps the documents apart. --padding_free
feeds each micro-batch's samples as one row (Batch.flattened), the padding dropped: the same tokens, the same loss.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from parity.errors import ConfigError
from parity.objectives.micro_batch import Objective, generation_tokens
from parity.objectives.rollouts import read_rollouts
from parity.training.fed_rows import FED_CACHE, FED_MASK, FED_POSITIONS, length, stream_hash, units
from parity.training.loss import IGNORE_INDEX


class SyntheticMarkov:
    """A learnable synthetic language: a sparse random bigram chain over a subset of the vocabulary.

    Each of 256 active tokens has 4 successors with probabilities (0.55, 0.25, 0.15, 0.05), so a model
    first learns which tokens occur (loss falls from ln(vocab) towards ln(256)) and then the bigram table
    (towards the chain's entropy, about 1.1 nats). Sample i depends only on (seed, i).
    """

    SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.15, 0.05])

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int):
        rng = np.random.default_rng([seed, 0])
        self.alphabet = rng.choice(vocab_size, size=min(256, vocab_size), replace=False).astype(np.int64)
        n = len(self.alphabet)
        self.successors = rng.integers(0, n, size=(n, len(self.SUCCESSOR_PROBS))).tolist()
        self.seq_length, self.num_samples, self.seed = seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.walk(np.random.default_rng([self.seed, 1, i]), self.seq_length)

    def walk(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """`length` tokens of the chain, drawn from `rng`."""
        state = int(rng.integers(len(self.alphabet)))
        choices = rng.choice(len(self.SUCCESSOR_PROBS), size=length, p=self.SUCCESSOR_PROBS).tolist()
        path = []
        for c in choices:
            path.append(state)
            state = self.successors[state][c]
        return self.alphabet[path]

    def describe(self) -> str:
        return f"synthetic Markov text, {self.num_samples} samples"


class PaddedMarkov(SyntheticMarkov):
    """The synthetic language in samples of different lengths: sample i has between a quarter of seq_length and
    all of it (drawn from (seed, i)), right-padded with token 0 and labelled −100 on the padding. Causal
    attention never looks right, so the padding needs no mask; the loss ignores its labels."""

    PAD_ID, IGNORE = 0, IGNORE_INDEX

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids = super().__getitem__(i)
        length = int(np.random.default_rng([self.seed, 3, i]).integers(max(2, self.seq_length // 4),
                                                                        self.seq_length + 1))
        labels = ids.copy()
        ids[length:], labels[length:] = self.PAD_ID, self.IGNORE
        return ids, labels

    def describe(self) -> str:
        return f"synthetic Markov text, padded to variable lengths, {self.num_samples} samples"


class PackedMarkov(SyntheticMarkov):
    """--packing: row i holds documents of the synthetic language, each between an eighth and a half of seq_length
    long (at least 2), drawn one after another from (seed, i, k) until the row is full (the last one cut to fit): input
    ids, labels (the ids, −100 at each document's first position) and position ids (0 at each document's start). Every
    position is a real token; the loss counts each one that a token of its own document precedes."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, labels, positions = [], [], []
        shortest, longest = max(2, self.seq_length // 8), max(2, self.seq_length // 2)
        k = filled = 0
        while filled < self.seq_length:
            rng = np.random.default_rng([self.seed, 4, i, k])
            length = min(int(rng.integers(shortest, longest + 1)), self.seq_length - filled)
            document = self.walk(rng, length)
            ids.append(document)
            labels.append(np.concatenate([[IGNORE_INDEX], document[1:]]))
            positions.append(np.arange(length))
            filled, k = filled + length, k + 1
        return tuple(np.concatenate(column) for column in (ids, labels, positions))

    def describe(self) -> str:
        return f"synthetic Markov text, documents packed into full rows, {self.num_samples} rows"


class TokenWindows:
    """A token stream cut into consecutive, non-overlapping windows of seq_length tokens."""

    def __init__(self, tokens: np.ndarray, seq_length: int, name: str):
        self.tokens, self.seq_length, self.name = tokens, seq_length, name

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_length

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i * self.seq_length:(i + 1) * self.seq_length]

    def describe(self) -> str:
        return f"{self.name}: {len(self.tokens)} tokens, {len(self)} windows"


def check_source(dataset: str, packing: bool = False, padding_free: bool = False) -> None:
    """The cheap part of --dataset's checks, for `resolve`: a known source, an existing text file; --packing only of
    the synthetic documents, --padding_free of any source but a recorded run's."""
    if dataset.startswith(ROLLOUTS):
        return  # a rollout file's (--rollouts): checked with the run's objective (rollout_run)
    if padding_free and dataset.startswith(RECORDED):
        raise ConfigError("--padding_free with a recorded run's batches: a replay feeds each row as the run fed it; "
                          "drop --padding_free")
    if packing and dataset != "synthetic":
        why = ("its rows are padded samples, and packed rows hold no padding" if dataset == "synthetic_padded" else
               "it has no document boundaries to restart the position ids at")
        raise ConfigError(f"--packing with --dataset {dataset}: {why}; use --dataset synthetic (--packing packs its "
                          f"documents of varying lengths), or --padding_free to drop padding")
    if dataset.startswith("text:"):
        path = dataset[len("text:"):]
        if not os.path.isfile(path):
            raise ConfigError(f"--dataset {dataset}: no such file {path}: give the path of a UTF-8 text file")
    elif dataset.startswith(RECORDED):
        return  # a replay's (parity/replay/replay.py): its record and batches are checked there
    elif dataset not in ("synthetic", "synthetic_padded", "wikitext"):
        raise ConfigError(f"--dataset {dataset} is not known: use synthetic, synthetic_padded, wikitext or text:PATH")


def open_dataset(dataset: str, tokenizer: str, vocab_size: int, seq_length: int, num_samples: int, seed: int,
                 packing: bool = False):
    """The source named by --dataset (packed: --packing). Raises ConfigError for anything that cannot work."""
    check_source(dataset, packing)
    if packing:
        return PackedMarkov(vocab_size, seq_length, num_samples, seed)
    if dataset == "synthetic":
        return SyntheticMarkov(vocab_size, seq_length, num_samples, seed)
    if dataset == "synthetic_padded":
        return PaddedMarkov(vocab_size, seq_length, num_samples, seed)
    if dataset.startswith("text:"):
        path = dataset[len("text:"):]
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        name = os.path.basename(path)
    else:
        text, name = _wikitext(), "wikitext-2-raw-v1"
    tokens = tokenize(text, tokenizer)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ConfigError(f"tokenizer {tokenizer} produced token id {int(tokens.max())}, beyond the model's vocab "
                          f"({vocab_size}): use the model's own tokenizer")
    return TokenWindows(tokens, seq_length, name)


def tokenize(text: str, tokenizer: str) -> np.ndarray:
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    from parity.models.hub import hub_unreachable

    why = None if os.path.isdir(tokenizer) else hub_unreachable()
    try:
        if why:
            raise ConnectionError(why)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:
        raise ConfigError(f"tokenizer {tokenizer} could not be loaded ({why or type(exc).__name__}): pass "
                          f"--tokenizer bytes or a local tokenizer directory") from None
    return np.asarray(tok(text)["input_ids"], dtype=np.int64)


def _wikitext() -> str:
    from parity.models.hub import hub_unreachable

    why = hub_unreachable()
    try:
        if why:
            raise ConnectionError(why)
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="train")
    except Exception as exc:
        raise ConfigError(f"--dataset wikitext needs the Hugging Face hub ({why or type(exc).__name__}): use "
                          f"--dataset text:PATH with a local file") from None
    return "".join(rows["text"])


@dataclass(frozen=True)
class Batch:
    """Samples' input ids and their labels (the ids, −100 on padding), [samples, seq_length] each. `micro_rows`: where
    the rows do not split evenly (a recorded run's step, replayed: parity.training.data.RecordedBatches), the rows of
    each micro-batch of each DP rank, ((rank 0's), (rank 1's), ...); None: DP rank r holds rows [r·b, (r+1)·b) in
    --grad_accum_steps equal micro-batches. `attention_mask`: fed to the model where rows are left-padded (a recorded
    run's, as it fed them), and where a step is taken as a recorded run fed it (RecordedBatches.as_fed); None: no mask
    (right padding needs none for a causal model). `position_ids`: packed rows' (--packing) and flattened ones'
    (flattened), 0 at each document's start, fed with no mask (a 2-D mask would turn transformers' per-document masks
    off); None: 0, 1, ... along every row. `fed`: a recorded step whose rows came with position ids of their own
    (packed or padding-free), each row's fed_rows flags: each row is then a micro-batch of its own, cut to its length
    and fed as the run fed it — its position ids, its mask or none, a cache or none (fed_rows.py); `attention_mask`
    is then the saved one (ones where the run fed none), which says each row's length. `rollout`: a post-training
    step's rows as its objective reads them (parity.objectives.rollouts.RolloutRows: advantages, old and reference
    log-probs, the step's divisor …; labels are the completion tokens), sliced with the rows."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    micro_rows: tuple[tuple[int, ...], ...] | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    fed: torch.Tensor | None = None
    rollout: object | None = None

    @property
    def divisor(self) -> float:
        """What the step's micro-batch sums are divided by (Strategy.micro_batch_loss): the loss tokens, or a
        post-training objective's divisor of the whole step (parity/objectives/micro_batch.py), kept by every slice."""
        return self.loss_tokens if self.rollout is None else self.rollout.divisor

    @property
    def loss_tokens(self) -> int:
        """How many positions the loss counts: every label after the first of a sample that is not −100
        (position t predicts label t + 1)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def use_cache(self) -> bool:
        """Whether the model is fed these rows with a cache: only where a recorded run fed them so (FED_CACHE)."""
        return self.fed is not None and bool((self.fed & FED_CACHE).any())

    def rows(self, start: int, stop: int) -> "Batch":
        def part(t):
            return None if t is None else t[start:stop]
        return Batch(self.input_ids[start:stop], self.labels[start:stop], attention_mask=part(self.attention_mask),
                     position_ids=part(self.position_ids), fed=part(self.fed),
                     rollout=None if self.rollout is None else self.rollout.rows(start, stop))

    def split(self, parts: int) -> list["Batch"]:
        """`parts` micro-batches of equal size, in order — or, for one DP rank's slice of a step planned in
        `micro_rows`, its planned micro-batches; or, for fed rows, each row alone as the run fed it (fed_row)."""
        if self.fed is not None:
            return [self.fed_row(r) for r in range(len(self.input_ids)) if length(self.attention_mask[r])]
        sizes = self.micro_rows[0] if self.micro_rows is not None and len(self.micro_rows) == 1 else \
            [len(self.input_ids) // parts] * parts
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(start, start + size) for start, size in zip(starts, sizes)]

    def fed_row(self, r: int) -> "Batch":
        """Row `r` of fed rows as the run fed it: cut to its length, with its position ids and its mask only where it
        came with them, and its flags (use_cache)."""
        n, flag = length(self.attention_mask[r]), int(self.fed[r])
        row = (slice(r, r + 1), slice(0, n))
        return Batch(self.input_ids[row], self.labels[row], attention_mask=self.attention_mask[row] if flag & FED_MASK
                     else None, position_ids=self.position_ids[row] if flag & FED_POSITIONS else None,
                     fed=self.fed[r:r + 1])

    def real_lengths(self) -> list[int]:
        """Each row's length without its padding: up to its last position with a label (what follows is padding)."""
        real = self.labels != IGNORE_INDEX
        return [int(row.nonzero()[-1]) + 1 if row.any() else 0 for row in real]

    def flattened(self) -> "Batch":
        """--padding_free: the rows as one row — each row's real tokens (real_lengths: its padding dropped) after the
        previous row's, with its own position ids (0, 1, ... where the rows carry none) and its first label −100: the
        previous row's last token predicts nothing, as at the end of a row. The same loss tokens as the rows."""
        assert self.attention_mask is None, "a left-padded row is fed with its mask, never flattened"
        ids, labels, positions = [], [], []
        for r, n in enumerate(self.real_lengths()):
            ids.append(self.input_ids[r, :n])
            labels.append(torch.cat([torch.full_like(self.labels[r, :1], IGNORE_INDEX), self.labels[r, 1:n]])[:n])
            positions.append(self.position_ids[r, :n] if self.position_ids is not None else
                             torch.arange(n, device=self.input_ids.device))
        return Batch(*(torch.cat(column)[None] for column in (ids, labels)), position_ids=torch.cat(positions)[None])

    def to(self, device) -> "Batch":
        def moved(t):
            return None if t is None else t.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), self.micro_rows, moved(self.attention_mask),
                     moved(self.position_ids), moved(self.fed), moved(self.rollout))


class GlobalBatches:
    """Step → global batch. Epoch e visits the samples in a permutation seeded by (seed, e)."""

    def __init__(self, dataset, global_batch_size: int, seed: int):
        self.dataset, self.global_batch_size, self.seed = dataset, global_batch_size, seed
        self.steps_per_epoch = len(dataset) // global_batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the dataset ({dataset.describe()}) holds fewer samples than one global batch "
                              f"({global_batch_size}): use more data, a shorter --seq_length or a smaller batch")
        self._order: tuple[int, np.ndarray] | None = None

    def __call__(self, step: int) -> Batch:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, 2, epoch]).permutation(len(self.dataset)))
        rows = self._order[1][k * self.global_batch_size:(k + 1) * self.global_batch_size]
        samples = [self.dataset[int(i)] for i in rows]
        columns = [s if isinstance(s, tuple) else (s, s) for s in samples]  # a full window is its own labels
        ids, labels, *positions = (torch.from_numpy(np.stack(column).astype(np.int64)) for column in zip(*columns))
        return Batch(ids, labels, position_ids=positions[0] if positions else None)  # packed rows: their positions


def training_data(cfg) -> GlobalBatches:
    """A run's step → global batch, built once on the driver (a text source is read and tokenized there)
    and shipped to the workers with the run. ConfigError if the source cannot work or holds fewer samples
    than one global batch: raised before any worker starts. A rollout file's (--rollouts): RolloutBatches."""
    if cfg.dataset.startswith(ROLLOUTS):
        rollouts = read_rollouts(cfg.dataset[len(ROLLOUTS):])
        return RolloutBatches(rollouts.path, cfg.objective, rollouts.steps, f"rollouts {rollouts.path}: "
                              f"{rollouts.describe}")
    dataset = open_dataset(cfg.dataset, cfg.tokenizer, cfg.model_config["vocab_size"], cfg.seq_length,
                           cfg.num_samples, cfg.seed, cfg.packing)
    return GlobalBatches(dataset, cfg.global_batch_size, cfg.seed)


RECORDED = "recorded:"  # --dataset of a replay: recorded:<the record's batch folder>


def recorded_batch_path(folder: str, step: int) -> str:
    """Where a recorded run's global batch of `step` is saved (parity/recording/recorder.py writes it): input ids,
    labels and attention mask, [rows, length] each, in safetensors; where a row came with position ids of its own, also
    the position ids and each row's flags (`fed`: fed_rows.py)."""
    from parity import storage

    return storage.join(folder, f"step_{step:06d}.safetensors")


class _Described:
    def __init__(self, text: str):
        self.text = text

    def describe(self) -> str:
        return self.text


class RecordedBatches:
    """Step → the global batch a recorded run trained on (parity/recording/recorder.py saved each one in
    `folder`), its rows in the harness's order (the run's DP rank 0's rows, then rank 1's ..., each row as fed),
    split over the replay's `workers` by row_plan in micro-batches of at most `most_rows` rows — or, a step whose rows
    came with position ids of their own, each row alone as the run fed it, the rows cut at document boundaries where
    the workers need (fed_rows.units) — what a replay trains on. Read on the worker when the step comes. `states`: the
    run's states the recorder saved at its checkpoints, which the replay (not a noise reference) checks after its
    training (recorded_states.RecordedStates, check_recorded)."""

    def __init__(self, folder: str, steps: int, description: str, workers: int = 1, most_rows: int = 1,
                 states=None):
        self.folder, self.steps_per_epoch = folder, steps
        self.workers, self.most_rows, self.states = workers, most_rows, states
        self.dataset = _Described(description)

    def __call__(self, step: int) -> Batch:
        fed = self.as_fed(step)
        ids, mask = fed.input_ids, fed.attention_mask
        if fed.fed is not None:
            *table, flags = units(ids, fed.labels, mask, fed.position_ids, fed.fed, self.workers, f"step {step}")
            each = len(flags) // self.workers
            return Batch(table[0], table[1], ((1,) * each,) * self.workers, table[2], table[3], flags)
        return Batch(ids, fed.labels, row_plan(len(ids), self.workers, self.most_rows),
                     mask if left_padded(mask) else None)

    def as_fed(self, step: int) -> Batch:
        """The global batch of `step` as the run fed it, its attention mask whatever its padding, in one piece: what
        the teacher-forced check's reference step computes on, as the run computed (in bf16 an attention with a mask
        rounds otherwise than one without: ~the policy's whole rounding); fed rows with their position ids and flags."""
        from safetensors.torch import load

        from parity import storage

        tensors = load(storage.read_bytes(recorded_batch_path(self.folder, step)))
        return Batch(tensors["input_ids"].long(), tensors["labels"].long(), None, tensors["attention_mask"].long(),
                     tensors.get("position_ids"), tensors.get("fed"))


def left_padded(mask: torch.Tensor) -> bool:
    """Whether a row begins with padding: the model must then be fed the mask, as the run fed it (its real tokens sit
    at shifted positions, and its last padding position predicts the first real token)."""
    return bool(((mask[:, 0] == 0) & (mask.sum(1) > 0)).any())


def dp_slice(global_batch: Batch, dp_rank: int, batch_size: int) -> Batch:
    """DP rank `dp_rank`'s rows of a global batch: [r·batch_size, (r+1)·batch_size), or those its plan gives it."""
    plan = global_batch.micro_rows
    if plan is None:
        return global_batch.rows(dp_rank * batch_size, (dp_rank + 1) * batch_size)
    start = sum(map(sum, plan[:dp_rank]))
    mine = global_batch.rows(start, start + sum(plan[dp_rank]))
    return Batch(mine.input_ids, mine.labels, (plan[dp_rank],), mine.attention_mask, mine.position_ids, mine.fed,
                 mine.rollout)


def row_plan(rows: int, workers: int, most_rows: int) -> tuple[tuple[int, ...], ...]:
    """How a step's `rows` split over `workers` DP ranks: as evenly as they go (the first ranks one row more), each
    rank's rows in the same number of micro-batches (DDP reduces on the last one alike everywhere) of at most
    `most_rows` rows where the fewest rows a rank holds allow — the largest micro-batch the recorded run fed, so
    that the replay needs no more memory a micro-batch than the run did. A rank with fewer rows weighs by its loss
    tokens (Strategy.micro_batch_loss): the loss is the step's global token mean whatever the split."""
    per_rank = [rows // workers + (k < rows % workers) for k in range(workers)]
    parts = min(-(-per_rank[0] // most_rows), per_rank[-1])
    return tuple(tuple(n // parts + (i < n % parts) for i in range(parts)) for n in per_rank)


def batch_hash(global_batch: Batch) -> str:
    """A short fingerprint of a global batch: equal hashes mean the runs saw the same tokens, labels and position ids.
    A batch without padding hashes as its ids alone, one without position ids as its ids and labels (records of full
    windows and of padded samples keep their hashes); fed rows as one stream (fed_rows.stream_hash: cut or not)."""
    if global_batch.fed is not None:
        b = global_batch
        return stream_hash(b.input_ids, b.labels, b.attention_mask, b.position_ids, b.fed)
    data = global_batch.input_ids.numpy().astype("<i8").tobytes()
    if not torch.equal(global_batch.labels, global_batch.input_ids):
        data += global_batch.labels.numpy().astype("<i8").tobytes()
    if global_batch.position_ids is not None:
        data += b"position_ids" + global_batch.position_ids.numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


ROLLOUTS = "rollouts:"  # --dataset of a run on a rollout file (--rollouts): rollouts:<its path>


class RolloutBatches:
    """Step → the global batch of a rollout file's step (parity/objectives/rollouts.py) for the run's `objective` (a
    RunConfig's field): its rows (labels the completion tokens the objective counts, −100 elsewhere; the mask where
    rows are left-padded) and their RolloutRows with the step's divisor, computed here from the whole step once, so
    every rank and slice divides by the same (parity/objectives/micro_batch.py). Each worker reads the file once."""

    def __init__(self, path: str, objective: dict | None, steps: int, description: str):
        self.path, self.objective, self.steps_per_epoch = path, objective, steps
        self.dataset = _Described(description)
        self._file = self._generations = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_generations": None}  # shipped to the workers without the file

    def __call__(self, step: int) -> Batch:
        import dataclasses

        if self._file is None:
            self._file = read_rollouts(self.path)
        rollouts, step = self._file, step % self._file.steps
        ids, rows = rollouts.step(step)
        objective = Objective(self.objective)
        truncated_out = bool(objective.settings.get("mask_truncated_completions"))
        labels = ids.masked_fill(rows.counted(truncated_out) == 0, IGNORE_INDEX)
        if rollouts.family == "grpo":  # (normalizer="generation"'s divisor; a seeded bug's at any normalizer)
            if self._generations is None:
                self._generations = generation_tokens(rollouts, truncated_out)
            rows = dataclasses.replace(rows, generation_tokens=self._generations[int(rows.generation[0])])
        rows = dataclasses.replace(rows, divisor=objective.step_divisor(labels, rows))
        mask = rollouts.attention_mask(step)
        return Batch(ids, labels, attention_mask=mask if left_padded(mask) else None, rollout=rows)


class RecordedRollouts(RolloutBatches):
    """A recorded run's rollout file (parity/recording/recorded_objective.py wrote it) as its replay reads it:
    RolloutBatches, with the states its recorder saved for the teacher-forced check (as RecordedBatches carries them)
    and each step as the run fed it, its attention mask whatever its padding (`as_fed`: the check's reference step)."""

    def __init__(self, path: str, objective: dict | None, steps: int, description: str, states=None):
        super().__init__(path, objective, steps, description)
        self.states = states

    def as_fed(self, step: int) -> Batch:
        import dataclasses

        batch = self(step)
        return dataclasses.replace(batch, attention_mask=self._file.attention_mask(step % self._file.steps))
