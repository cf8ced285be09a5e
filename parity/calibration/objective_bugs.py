"""Seeded bugs of post-training objectives, each a real bug of a public tracker (docs/posttrain.md#seeded-bugs): what the
verdict must FAIL, at its step, on a GRPO- or DPO-family run.

Each bug is a function with the reference's shape — what a micro-batch contributes to the step's loss × the step's
divisor (parity.objectives.micro_batch.Objective.micro_sum) — so that a hand-written loop backpropagates its result ×
dp_size ÷ divisor exactly where it would the reference's, and the harness's DDP copy below puts it in
Strategy.micro_batch_sum. `OBJECTIVE_BUGS`: name → (function, the family it is seeded in: grpo or dpo); `DDPObjectiveBug` runs one under DDP (--strategy_class parity.calibration.objective_bugs:DDPObjectiveBug
--objective_bug NAME). A bug's function takes (objective, logits, micro, divisor, micro_batches, where): `micro` a data.Batch of
the micro-batch (ids, labels, its RolloutRows), `where` a `BugContext` (what a trainer knows about its rank and step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_strategy import DDPStrategy
from parity.objectives.micro_batch import Objective
from parity.training.option import Option


@dataclass(frozen=True)
class BugContext:
    """What a trainer knows where the bug sits: its DP degree and micro-batches per rank, its rank's rows (a
    RolloutRows), and the step's completion tokens counting truncated rows (what a normaliser that forgot the mask
    counts)."""

    dp_size: int
    micro_per_rank: int
    rank_rows: object
    step_tokens_unmasked: float


def _sum(objective: Objective, logits, micro, divisor, micro_batches, rows=None, settings=None) -> torch.Tensor:
    """The reference's micro-batch sum, with other rows or settings where a bug changes them."""
    if settings is not None:
        objective = Objective({"name": objective.name, "settings": {**objective.settings, **settings}})
    return objective.micro_sum(logits, micro.input_ids, micro.labels, rows or micro.rollout, divisor, micro_batches)[0]


def divided_by_accumulation_again(objective, logits, micro, divisor, micro_batches, where):
    """ms-swift #10117: a loss already normalised over the accumulation window (dapo's global tokens) divided by the
    accumulation steps once more: gradients 1/GA of the definition's."""
    return _sum(objective, logits, micro, divisor, micro_batches) / where.micro_per_rank


def per_rank_token_normaliser(objective, logits, micro, divisor, micro_batches, where):
    """Each rank divides by its own completion tokens, then DP averages (SkyRL #794, verl #4710): a rank of few tokens
    weighs as much as one of many, where the definition divides the step's sum by the step's tokens."""
    rank_tokens = max(float(where.rank_rows.counted(objective.settings.get("mask_truncated_completions"))[:, 1:].sum()),
                      1.0)
    return _sum(objective, logits, micro, divisor, micro_batches) * divisor / (rank_tokens * where.dp_size)


def generation_normaliser_at_other_split(objective, logits, micro, divisor, micro_batches, where):
    """TRL #6024: the step divides by its generation batch's tokens ÷ the steps it spans, where the definition divides
    by the step's own: off wherever a generation batch's steps hold different numbers of tokens."""
    return _sum(objective, logits, micro, divisor, micro_batches) * divisor / micro.rollout.generation_tokens


def truncated_counted(objective, logits, micro, divisor, micro_batches, where):
    """TRL #6439: mask_truncated_completions drops the truncated completions from the loss, and the token count still
    holds them."""
    return _sum(objective, logits, micro, divisor, micro_batches) * divisor / where.step_tokens_unmasked


def beta_twice(objective, logits, micro, divisor, micro_batches, where):
    """The KL coefficient applied twice: the k3 term weighs β² where the definition says β."""
    return _sum(objective, logits, micro, divisor, micro_batches, settings={"beta": objective.settings["beta"] ** 2})


def dpo_reference_from_policy(objective, logits, micro, divisor, micro_batches, where):
    """DPO's reference log-probabilities taken from the policy (detached) instead of the reference model: the implicit
    rewards are 0 at every step, and the loss is the policy's own pairs' logistic at 0."""
    from parity.objectives.causal_lm import token_log_probs

    with torch.no_grad():
        policy = token_log_probs(logits, micro.input_ids)[0]
    own = torch.cat([torch.zeros_like(policy[:, :1]), policy], 1)
    rows = dataclasses.replace(micro.rollout, ref_logps=own, ref_seq_logps=None)
    return _sum(objective, logits, micro, divisor, micro_batches, rows=rows)


def advantages_per_rank(objective, logits, micro, divisor, micro_batches, where):
    """The advantages normalised over each rank's rows instead of each prompt group's: (r − the rank's mean) ÷ the
    rank's standard deviation (a trainer that standardises the rewards after the split)."""
    rewards = where.rank_rows.rewards.float()
    mean, spread = rewards.mean(), rewards.std()
    rows = dataclasses.replace(micro.rollout, advantages=(micro.rollout.rewards.float() - mean) / (spread + 1e-4))
    return _sum(objective, logits, micro, divisor, micro_batches, rows=rows)


# name → (function, the family it is seeded in). The GRPO family's show under dapo with beta > 0 and
# mask_truncated_completions=true (truncated_counted at the first step holding a truncated completion; the
# generation normaliser where a generation batch spans steps of different token counts; advantages_per_rank where a
# rank's rows are not one prompt group's).
OBJECTIVE_BUGS = {
    "divided_by_accumulation_again": (divided_by_accumulation_again, "grpo"),
    "per_rank_token_normaliser": (per_rank_token_normaliser, "grpo"),
    "generation_normaliser_at_other_split": (generation_normaliser_at_other_split, "grpo"),
    "truncated_counted": (truncated_counted, "grpo"),
    "beta_twice": (beta_twice, "grpo"),
    "advantages_per_rank": (advantages_per_rank, "grpo"),
    "dpo_reference_from_policy": (dpo_reference_from_policy, "dpo"),
}


class DDPObjectiveBug(DDPStrategy):
    """DDP with one of OBJECTIVE_BUGS in its micro-batch loss, chosen by its own flag --objective_bug NAME (recorded in
    the config's options: the verdict's first suspect), under a name of its own beside the DDP baseline."""

    name = "ddp_objective_bug"
    options = (Option("objective_bug", "divided_by_accumulation_again", "the seeded bug (OBJECTIVE_BUGS)",
                      choices=tuple(OBJECTIVE_BUGS)),)

    def forward_backward(self, batch, global_tokens):
        self._rank_rows = batch.rollout
        counted = batch.rollout.completion_mask[:, 1:].sum().to(torch.float64)
        dist.all_reduce(counted)  # the step's completion tokens, truncated rows counted
        self._unmasked = float(counted)
        return super().forward_backward(batch, global_tokens)

    def micro_batch_sum(self, logits, micro, divisor, micro_batches):
        where = BugContext(self.ctx.dp_size, micro_batches // self.ctx.dp_size, self._rank_rows, self._unmasked)
        bug = OBJECTIVE_BUGS[self.cfg.options["objective_bug"]][0]
        buggy = bug(self.objective, logits, micro, divisor, micro_batches, where)
        super().micro_batch_sum(logits, micro, divisor, micro_batches)  # the step's statistics, as the reference's
        return buggy
