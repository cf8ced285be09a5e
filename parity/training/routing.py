"""The routing of a mixture-of-experts step, defined once for every strategy: what each router chose, the experts'
loads, and the load-balancing loss over the global batch (docs/moe.md).

Over the sparse layers L and the global batch's real tokens T (the positions that are not padding, of every DP rank
and every micro-batch), with E experts and the routers' top-k choices:

    f_e = #{(l, t) : e among layer l's top-k experts of token t} / (|L|·|T|)      (a count: no gradient)
    P_e = Σ_{l,t} softmax(router logits of layer l at token t)_e / (|L|·|T|)
    aux = E · Σ_e f_e · P_e          and the training loss is  lm_loss + coef · aux

— transformers' load_balancing_loss_func (Switch Transformer's loss, the layers pooled) with the attention mask of
the whole global batch, where transformers' own forward takes the batch it is given: one rank's micro-batch. It is a
product of two batch means, so it is not the mean of per-rank or per-micro-batch values. Its gradient, with f fixed,
is coef · E/(|L||T|)² · Σ_e F_e · Σ_{l,t} ∇p_{l,e}(t) (F_e: the global count): a sum over tokens once F is known, so
each rank backpropagates its tokens' part (× dp_size, as the LM loss: the strategies average gradients over DP).

F must be known before any backward. With one micro-batch the counts are summed over DP between the forward and the
backward (one all-gather of |L| × E numbers); with --grad_accum_steps N > 1 a forward without gradients over the
rank's N micro-batches counts them first: one more forward per step, no activations kept (docs/moe.md has its
measured cost). The counting forward must route exactly as the training forward: checked every step.

A record of megatron-core's MoE (parity/frameworks/megatron/: its MoE seam's aux_loss_scope "megatron-core") trains
megatron-core's router losses instead, each micro-batch's own: per sparse layer l over the micro-batch's tokens T (its
router saw every position of a recorded row but the last, which the recorder adds as the last label),

    aux_l = E / (k·|T|²) · Σ_e F_e · P_e      (F_e: the tokens whose top-k holds e; P_e: Σ_t softmax_e; k: top-k)
    z_l = mean_t logsumexp(router logits at t)²

and the step's loss adds (aux coef · Σ_l aux_l + z coef · Σ_l z_l) averaged over the global batch's micro-batches
(megatron-core scales each micro-batch's by 1 / micro-batches and averages over DP): a sum over micro-batches, so no
global statistic; the replay keeps the record's micro-batches (parity/replay/replay.py checks its split).
"""

from __future__ import annotations

import contextlib

import torch

from parity.training.loss import IGNORE_INDEX

MEGATRON_CORE = "megatron-core"  # a MoE seam's aux_loss_scope: megatron-core's router losses (module docstring)


class RouterTap:
    """Forward hooks on the sparse layers' routers (the family's seam names them): while `recording`, each router
    call's logits and chosen expert ids, in layer order. Outside it (backward's recomputation under activation
    checkpointing, the final evaluation) the hooks keep nothing."""

    def __init__(self, hf_model, family, module_of=lambda name: name):
        self.moe = family.moe
        self.names = [f"{family.stack}.{i}.{self.moe.router}" for i in self.moe.layers]  # the stock model's
        self.calls: list | None = None
        self.handles = [hf_model.get_submodule(module_of(name)).register_forward_hook(self._hook) for name in self.names]

    def _hook(self, module, args, output):
        if self.calls is not None:
            self.calls.append(router_output(output, self.moe.num_experts))

    @contextlib.contextmanager
    def recording(self):
        """The block's forwards record into the list it yields: [(logits, expert ids)] per router call."""
        self.calls = []
        try:
            yield self.calls
        finally:
            self.calls = None


def router_output(output, num_experts: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits [tokens, experts], expert ids [tokens, top_k]) of a router's output tuple: the first float tensor of
    [tokens, experts] (None where the router returns none: DeepSpeed's AutoEP router), and the first integer one."""
    tensors = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
    logits = next((t for t in tensors if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == num_experts), None)
    ids = next(t for t in tensors if not t.is_floating_point())
    return (None if logits is None else logits.reshape(-1, num_experts)), ids.reshape(-1, ids.shape[-1])


def real_tokens(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of a batch that are not padding, flattened as the routers see the tokens ([samples × seq]): a
    label that is not −100 — or, in packed and flattened rows (`position_ids`), a document's first token, whose label is
    −100 because the token before it is another document's (no padding is fed there)."""
    real = labels != IGNORE_INDEX
    return (real if position_ids is None else real | (position_ids == 0)).reshape(-1)


def expert_counts(calls, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, experts]: how many of the real tokens each router sent to each expert (float64, exact)."""
    rows = [torch.bincount(ids[mask].reshape(-1), minlength=num_experts) for _, ids in calls]
    return torch.stack(rows).double() if rows else torch.zeros(0, num_experts, dtype=torch.float64)


def probability_sums(calls, mask: torch.Tensor) -> torch.Tensor:
    """[layers, experts]: the router probabilities (softmax of the logits, in fp32) summed over the real tokens, with
    their gradient."""
    return torch.stack([torch.softmax(logits.float(), dim=-1)[mask].sum(0) for logits, _ in calls])


def aux_loss_term(prob_sums: torch.Tensor, total_counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """E · Σ_e f_e · P_e with the global counts `total_counts` [layers, experts] (f_e and the token count |T| come from
    them: each real token is counted top_k times per layer) and `prob_sums` [layers, experts] of the tokens this
    term covers: the whole batch's for the value, a rank's micro-batch for its share of the gradient."""
    num_layers, num_experts = total_counts.shape
    rows = float(total_counts.sum()) / top_k  # |L|·|T|
    f = total_counts.sum(0).to(prob_sums.dtype) / rows
    return num_experts * (f * prob_sums.sum(0) / rows).sum()


def seen_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The positions of a megatron-core record's rows its routers saw, flattened: every one but each row's last (the
    last label, which the recorder appends to the job's tokens)."""
    seen = torch.ones_like(input_ids, dtype=torch.bool)
    seen[:, -1] = False
    return seen.reshape(-1)


def layer_terms(calls, mask: torch.Tensor, moe) -> torch.Tensor:
    """[Σ_l aux_l, Σ_l z_l] of one micro-batch (the module docstring's end), with their gradient: over its tokens
    `mask`, each router call's logits and chosen experts."""
    aux = z = torch.zeros((), dtype=torch.float32, device=mask.device)
    for logits, ids in calls:
        taken = logits.float()[mask]
        tokens = taken.shape[0]
        counts = torch.bincount(ids[mask].reshape(-1), minlength=moe.num_experts).to(taken.dtype)
        probs = torch.softmax(taken, dim=-1).sum(0)
        aux = aux + moe.num_experts / (moe.top_k * tokens * tokens) * (counts * probs).sum()
        z = z + torch.logsumexp(taken, dim=-1).square().mean()
    return torch.stack([aux, z])


def flips(ids_a: torch.Tensor, ids_b: torch.Tensor, logits_b: torch.Tensor, top_k: int) -> list[dict]:
    """The tokens whose chosen experts differ between two runs' routers (the same tokens in the same order), each with
    the reference's gap between its k-th and (k+1)-th router logit: how near a tie the reference was."""
    a, b = ids_a.sort(-1).values, ids_b.sort(-1).values
    differ = (a != b).any(-1).nonzero().flatten().tolist()
    top = logits_b.float().topk(min(top_k + 1, logits_b.shape[-1]), dim=-1).values
    return [{"token": t, "experts": a[t].tolist(), "reference_experts": b[t].tolist(),
             "logit_gap": float(top[t, top_k - 1] - top[t, top_k]) if top.shape[-1] > top_k else 0.0}
            for t in differ]


class StepRoutes:
    """One step's routing as forward_backward meets it, micro-batch by micro-batch (a mixture of experts; for a dense
    model every call does nothing): the routers' record of each forward, this rank's expert counts and, with a
    load-balancing loss, each micro-batch's share of coef × that loss over the global batch (module docstring)."""

    def __init__(self, strategy, micro_batches):
        self.strategy, self.tap = strategy, strategy.router_tap()
        self.moe = self.tap.moe if self.tap else None
        self.per_micro = bool(self.moe and self.moe.aux_loss_scope == MEGATRON_CORE)  # the module docstring's end
        self.aux = bool(self.moe and self.moe.aux_loss_coef) and not self.per_micro
        self.micro_count, self.terms = len(micro_batches), None
        counting = self.aux and len(micro_batches) > 1
        self.counted, self.totals = strategy.count_routes(micro_batches, self.tap) if counting else (None, None)
        self.counts = self.prob_sums = None
        self.chosen = []

    def recording(self):
        """The context of a micro-batch's forward: yields the router calls it records (None for a dense model)."""
        return self.tap.recording() if self.tap else contextlib.nullcontext()

    def add(self, calls, micro, loss: torch.Tensor) -> torch.Tensor:
        """After a micro-batch's forward (`calls`, what `recording` yielded): its routing counted, and `loss` with its
        share of the load-balancing loss added where the family trains on one."""
        if not self.tap:
            return loss
        strategy, moe = self.strategy, self.moe
        self.chosen.append([ids.detach() for _, ids in calls])
        if self.per_micro:
            mask = seen_tokens(micro.input_ids)
            mine = expert_counts(calls, mask, moe.num_experts)
            self.counts = mine if self.counts is None else self.counts + mine
            terms = layer_terms(calls, mask, moe) / self.micro_count  # [aux, z] summed over the layers
            self.terms = terms.detach().double() + (0 if self.terms is None else self.terms)
            return loss + moe.aux_loss_coef * terms[0] + moe.z_loss_coef * terms[1]
        mask = real_tokens(micro.labels, micro.position_ids)
        mine = expert_counts(calls, mask, moe.num_experts)
        self.counts = mine if self.counts is None else self.counts + mine
        if self.aux:
            sums = probability_sums(calls, mask)
            self.prob_sums = sums.detach() if self.prob_sums is None else self.prob_sums + sums.detach()
            self.totals = self.totals if self.totals is not None else strategy.batch_routing_totals(mine)
            loss = loss + strategy.micro_batch_aux(sums, self.totals, moe)
        return loss

    def finish(self) -> None:
        """After the last micro-batch: the step's routing into the strategy's `step_routing` and `step_expert_ids`,
        once the counting forward is checked against the training forward. Collective (a mixture of experts)."""
        if not self.tap:
            return
        if self.counted is not None and not torch.equal(self.counted, self.counts):
            raise RuntimeError("the counting forward routed differently from the training forward: the step's "
                               "load-balancing statistics would not be its own")
        self.strategy.step_routing = (self.strategy.micro_routing_record(self.counts, self.terms, self.moe)
                                      if self.per_micro else
                                      self.strategy.routing_record(self.counts, self.prob_sums, self.totals, self.moe))
        self.strategy.step_expert_ids = [torch.cat(layer) for layer in zip(*self.chosen)]


class Routing:
    """The mixture-of-experts part of every strategy (parity.training.strategy.Strategy inherits it): the routers'
    hooks, the step's routing statistics over the global batch and the load-balancing loss's share of each
    micro-batch. A strategy overrides `router_module` where it replaced the sparse block; the rest it inherits (a
    seeded bug may override `batch_routing_totals`). Uses the strategy's hf_model, autocast, forward, gather_dp and
    ctx."""

    def step_routes(self, micro_batches) -> StepRoutes:
        """forward_backward's routing of one step over this rank's `micro_batches`."""
        return StepRoutes(self, micro_batches)

    def router_tap(self):
        """Hooks on the routers of a mixture of experts (made at the first step); None for a dense model."""
        if not hasattr(self, "_router_tap"):
            from parity.models.families import family_of

            family = family_of(self.hf_model.config)
            self._router_tap = RouterTap(self.hf_model, family, self.router_module) if family.moe else None
        return self._router_tap

    def router_module(self, name: str) -> str:
        """The module of `hf_model` that routes where the stock model's router `name` does (the same, unless the
        strategy replaced the sparse block: DeepSpeed's AutoEP)."""
        return name

    def router_names(self) -> list[str]:
        """The sparse layers' routers by Hugging Face name, in layer order (empty for a dense model)."""
        tap = self.router_tap()
        return tap.names if tap else []

    @torch.no_grad()
    def count_routes(self, micro_batches, tap) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's, the global batch's) expert counts [layers, experts] before any backward: a forward without
        gradients over the micro-batches, which the load-balancing loss of each one needs (module docstring)."""
        counts = 0
        for micro in micro_batches:
            with self.autocast(), tap.recording() as calls:
                self.logits_of(micro)
            counts = counts + expert_counts(calls, real_tokens(micro.labels, micro.position_ids), tap.moe.num_experts)
        return counts, self.batch_routing_totals(counts)

    def batch_routing_totals(self, local: torch.Tensor) -> torch.Tensor:
        """The global batch's total of a routing statistic of this rank's slice (expert counts, probability sums): the
        sum over DP ranks, each read from the first rank of its TP group (TP ranks route the same tokens).
        Collective."""
        return torch.stack(self.gather_dp(local.detach().double())).sum(0)

    def micro_batch_aux(self, prob_sums: torch.Tensor, totals: torch.Tensor, moe) -> torch.Tensor:
        """What a micro-batch backpropagates of coef × the load-balancing loss: its tokens' share (`prob_sums`) with
        the global counts `totals`, × dp_size as the LM loss, so that the average over DP is the global loss's
        gradient."""
        return self.ctx.dp_size * moe.aux_loss_coef * aux_loss_term(prob_sums, totals, moe.top_k)

    def micro_routing_record(self, counts, terms, moe) -> dict:
        """The step's routing under megatron-core's router losses: their values (each micro-batch's sum over the
        sparse layers, without coefficients, averaged over the global batch's micro-batches; None, or no z_loss,
        where the job trains without it) and the expert loads (routing_record's). Collective."""
        totals = self.batch_routing_totals(counts)
        aux, z = (self.batch_routing_totals(terms) / self.ctx.dp_size).tolist()
        return {"aux_loss": aux if moe.aux_loss_coef else None, **({"z_loss": z} if moe.z_loss_coef else {}),
                "expert_loads": [[int(n) for n in row] for row in totals.tolist()]}

    def routing_record(self, counts, prob_sums, totals, moe) -> dict:
        """The step's routing over the global batch: the load-balancing loss (without its coefficient; None where the
        family has none in its loss) and each sparse layer's expert loads (real tokens routed to each expert, top-k
        assignments). Collective."""
        totals = totals if totals is not None else self.batch_routing_totals(counts)
        aux = (float(aux_loss_term(self.batch_routing_totals(prob_sums), totals, moe.top_k))
               if prob_sums is not None else None)
        return {"aux_loss": aux, "expert_loads": [[int(n) for n in row] for row in totals.tolist()]}
