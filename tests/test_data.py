"""The global batch of a step is a pure function of (seed, step) and does not depend on the layout."""

import math

import numpy as np
import pytest
import torch

from parity.training.data import GlobalBatches, SyntheticMarkov, batch_hash, dp_slice, open_dataset
from parity.errors import ConfigError


def synthetic(seq_length=32, num_samples=64, seed=0):
    return SyntheticMarkov(vocab_size=2048, seq_length=seq_length, num_samples=num_samples, seed=seed)


def test_same_seed_same_batches_and_hashes():
    a, b = GlobalBatches(synthetic(), 4, seed=0), GlobalBatches(synthetic(), 4, seed=0)
    for step in (0, 1, 15, 16, 40):  # 16 steps per epoch: crosses two epoch boundaries
        assert torch.equal(a(step).input_ids, b(step).input_ids)
        assert batch_hash(a(step)) == batch_hash(b(step))
    assert batch_hash(a(0)) != batch_hash(a(1))
    assert batch_hash(a(0)) != batch_hash(GlobalBatches(synthetic(seed=1), 4, seed=1)(0))


def test_global_batch_is_independent_of_dp_layout():
    """DDP 1×4, DDP 2×2 and TP2×DP2 all read the same global batch; the DP slices tile it exactly."""
    batches = GlobalBatches(synthetic(), global_batch_size=4, seed=0)
    g = batches(3)
    assert g.input_ids.shape == (4, 32) and g.input_ids.dtype == torch.int64
    assert torch.equal(g.labels, g.input_ids) and g.loss_tokens == 4 * 31  # full windows: every next token counts
    two_ranks = torch.cat([dp_slice(g, r, batch_size=2).input_ids for r in range(2)])
    four_ranks = torch.cat([dp_slice(g, r, batch_size=1).input_ids for r in range(4)])
    assert torch.equal(two_ranks, g.input_ids) and torch.equal(four_ranks, g.input_ids)
    assert torch.equal(dp_slice(g, 0, 4).input_ids, g.input_ids)


def test_epochs_visit_every_sample_once_in_a_new_order():
    ds = synthetic(num_samples=8)
    batches = GlobalBatches(ds, 2, seed=0)
    assert batches.steps_per_epoch == 4
    epoch0 = torch.cat([batches(s).input_ids for s in range(4)])
    epoch1 = torch.cat([batches(s).input_ids for s in range(4, 8)])
    rows = {tuple(ds[i]) for i in range(8)}
    assert {tuple(r.tolist()) for r in epoch0} == rows == {tuple(r.tolist()) for r in epoch1}
    assert not torch.equal(epoch0, epoch1)


def test_synthetic_text_is_learnable_not_uniform():
    """Tokens come from 256 of 2048 ids and each has 4 successors: far below ln(vocab) in entropy."""
    ds = synthetic(seq_length=512, num_samples=4)
    tokens = np.concatenate([ds[i] for i in range(4)])
    assert len(np.unique(tokens)) <= 256
    successors = {}
    for i in range(4):
        for a, b in zip(ds[i][:-1], ds[i][1:]):
            successors.setdefault(int(a), set()).add(int(b))
    assert max(len(s) for s in successors.values()) <= 4
    probs = SyntheticMarkov.SUCCESSOR_PROBS
    assert -(probs * np.log(probs)).sum() < 1.2 < math.log(2048)


def test_text_file_source_with_byte_tokenizer(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld " * 200, encoding="utf-8")
    ds = open_dataset(f"text:{path}", "bytes", vocab_size=2048, seq_length=16, num_samples=0, seed=0)
    raw = path.read_bytes()
    assert len(ds) == len(raw) // 16
    assert bytes(ds[2].astype(np.uint8)) == raw[32:48]
    batches = GlobalBatches(ds, 4, seed=0)
    assert batches(0).input_ids.shape == (4, 16) and batches.steps_per_epoch == len(raw) // 16 // 4


def test_padded_samples_differ_in_loss_tokens_per_rank_and_micro_batch():
    """synthetic_padded: samples of different lengths, right-padded with token 0 and labelled -100 there, so DP
    ranks and micro-batches hold different numbers of loss tokens; the batch counts only real next tokens."""
    ds = open_dataset("synthetic_padded", "bytes", vocab_size=2048, seq_length=32, num_samples=64, seed=0)
    g = GlobalBatches(ds, 8, seed=0)(0)
    lengths = (g.labels != -100).sum(1)
    assert 8 <= int(lengths.min()) < int(lengths.max()) <= 32
    for row, n in zip(g.input_ids, lengths):
        assert (row[n:] == 0).all()
    assert g.loss_tokens == int((lengths - 1).sum())
    halves = [dp_slice(g, r, 4).loss_tokens for r in range(2)]
    quarters = [m.loss_tokens for m in dp_slice(g, 0, 4).split(2)]
    assert sum(halves) == g.loss_tokens and halves[0] != halves[1] and sum(quarters) == halves[0]
    assert batch_hash(g) != batch_hash(GlobalBatches(synthetic(seq_length=32, num_samples=64), 8, seed=0)(0))


def test_text_source_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no such file .*missing.txt"):
        open_dataset(f"text:{tmp_path}/missing.txt", "bytes", 2048, 16, 0, 0)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    ds = open_dataset(f"text:{short}", "bytes", 2048, 16, 0, 0)
    with pytest.raises(ConfigError, match=r"fewer samples than one global batch \(4\)"):
        GlobalBatches(ds, 4, seed=0)
    with pytest.raises(ConfigError, match=r"beyond the model's vocab \(100\)"):
        open_dataset(f"text:{short}", "bytes", 100, 2, 0, 0)
    with pytest.raises(ConfigError, match=r"--dataset nope is not known: use synthetic, synthetic_padded, wikitext"):
        open_dataset("nope", "bytes", 2048, 16, 0, 0)
