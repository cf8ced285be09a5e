"""Each definition's invariance class, measured (docs/posttrain.md#invariance): one step's gradient computed in one
process at every split of the step's rows into ranks × micro-batches — each micro-batch's Objective.micro_sum × ranks ÷
the step's divisor, averaged over the ranks as DDP does — against the whole step at once, on a rollout file the tiny
model wrote (tests/test_posttrain.py's), from weights moved off the generating ones so that ratios, clipping and the KL
term are at work. A definition its class calls invariant must stay within fp32 rounding at every split; one that
depends on the split must not. Then a generation batch spread over two optimizer steps instead of one: the step
normaliser's gradient stays, the generation normaliser's moves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity.objectives import RANKS_MICRO, invariance_of, resolve_objective
from parity.objectives.micro_batch import Objective
from parity.objectives.rollouts import read_rollouts

SPLITS = ((2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (2, 4))  # (ranks, micro-batches per rank) of 8 rows; against 1 × 1
PAIR_SPLITS = SPLITS[:-1]  # DPO's: a micro-batch holds whole pairs (8 micro-batches of 1 row would cut them)
DEFINITIONS = {  # label → (name, settings)
    "grpo": ("grpo", {"beta": "0.1"}),
    "bnpo": ("bnpo", {"beta": "0.1"}),
    "dr_grpo": ("dr_grpo", {"beta": "0.1", "max_completion_length": "16"}),
    "dapo": ("dapo", {"beta": "0.1", "epsilon_high": "0.28"}),
    "dapo, truncated masked": ("dapo", {"mask_truncated_completions": "true"}),
    "dapo, entropy bonus 0.5": ("dapo", {"entropy_coef": "0.5"}),
    "cispo": ("cispo", {"epsilon_high": "1.1"}),
    "sapo": ("sapo", {}),
    "luspo (GSPO sequence level)": ("luspo", {"importance_sampling_level": "sequence"}),
    "grpo, GSPO sequence level": ("grpo", {"importance_sampling_level": "sequence"}),
    "vespo": ("vespo", {}),
    "rloo": ("rloo", {}),
    "rloo, truncated masked": ("rloo", {"mask_truncated_completions": "true"}),
    "dpo sigmoid": ("dpo", {}),
    "dpo ipo": ("dpo", {"loss_type": "ipo"}),
    "dpo hinge + sigmoid_norm": ("dpo", {"loss_type": "hinge,sigmoid_norm"}),
    "dpo robust, f = js_divergence": ("dpo", {"loss_type": "robust", "label_smoothing": "0.1",
                                              "f_divergence_type": "js_divergence"}),
    "dpo sigmoid + sft": ("dpo", {"loss_type": "sigmoid,sft"}),
}
FP32_ROUNDING = 1e-5  # ‖g − g₁‖ / ‖g₁‖ of an invariant definition measured ≤ 3e-7 on this file


@pytest.fixture(scope="module")
def setting(posttrain_rollouts, tiny_weights):
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    model = build_model(resolve_model_config("qwen2-tiny"), 42)
    load_init_weights(model, tiny_weights)
    torch.manual_seed(3)
    with torch.no_grad():  # away from the generating weights: ratios off 1, some clipped
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std().clamp(min=1e-3))
    return model, {family: read_rollouts(path) for family, path in posttrain_rollouts.items()}


def step_rows(rollouts, step: int, objective: Objective, generation_tokens: float | None = None):
    ids, rows = rollouts.step(step)
    truncated_out = bool(objective.settings.get("mask_truncated_completions"))
    labels = ids.masked_fill(rows.counted(truncated_out) == 0, -100)
    rows = dataclasses.replace(rows, generation_tokens=generation_tokens)
    return ids, labels, dataclasses.replace(rows, divisor=objective.step_divisor(labels, rows))


def gradient(model, objective, ids, labels, rows, ranks: int, micro: int) -> torch.Tensor:
    """The step's gradient at `ranks` × `micro` micro-batches each: every micro-batch's sum × ranks ÷ the step's
    divisor backpropagated, the ranks' gradients averaged (DDP's all-reduce ÷ ranks)."""
    model.zero_grad()
    size = len(ids) // (ranks * micro)
    for k in range(ranks * micro):
        part = slice(k * size, (k + 1) * size)
        summed, _ = objective.micro_sum(model(input_ids=ids[part]).logits, ids[part], labels[part],
                                        rows.rows(part.start, part.stop), rows.divisor, ranks * micro)
        (summed * ranks / rows.divisor / ranks).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def measured_table(model, files) -> dict:
    """label → {(ranks, micro): ‖g − g₁ₓ₁‖ / ‖g₁ₓ₁‖} at step 0."""
    table = {}
    for label, (name, settings) in DEFINITIONS.items():
        objective = Objective(resolve_objective(name, settings))
        ids, labels, rows = step_rows(files["dpo" if name == "dpo" else "grpo"], 0, objective)
        whole = gradient(model, objective, ids, labels, rows, 1, 1)
        table[label] = {split: float((gradient(model, objective, ids, labels, rows, *split) - whole).norm()
                                     / whole.norm()) for split in (PAIR_SPLITS if name == "dpo" else SPLITS)}
    return table


def test_each_definition_is_as_invariant_as_its_class_says(setting):
    model, files = setting
    for label, row in measured_table(model, files).items():
        name, settings = DEFINITIONS[label]
        invariant = RANKS_MICRO in invariance_of(resolve_objective(name, settings)).splits
        if invariant:
            assert max(row.values()) < FP32_ROUNDING, (label, row)
        else:
            assert min(row.values()) > 1e-4, (label, row)  # every split of the split-dependent term moves it


@pytest.mark.parametrize("normalizer,moves", [("step", False), ("generation", True)])
def test_a_generation_batch_over_two_steps_moves_only_the_generation_normaliser(setting, normalizer, moves):
    """Step 0's gradient with its generation batch alone in the step, and spread over steps 0 and 1 (its normaliser
    then the two steps' mean tokens, under normalizer="generation")."""
    model, files = setting
    rollouts = files["grpo"]
    objective = Objective(resolve_objective("dapo", {"normalizer": normalizer}))
    tokens = [float(rollouts.step(s)[1].counted(False)[:, 1:].sum()) for s in (0, 1)]
    assert tokens[0] != tokens[1]  # the steps hold different numbers of tokens
    alone = gradient(model, objective, *step_rows(rollouts, 0, objective, tokens[0]), 1, 1)
    spread = gradient(model, objective, *step_rows(rollouts, 0, objective, sum(tokens) / 2), 1, 1)
    off = float((spread - alone).norm() / alone.norm())
    assert (off > 1e-3) if moves else (off == 0.0), off
    assert (invariance_of(objective.config).splits == (RANKS_MICRO,)) == moves
