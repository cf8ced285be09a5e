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
"""

from __future__ import annotations

import contextlib

import torch

from parity.training.data import IGNORE_INDEX


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


def real_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The positions of a batch that are not padding, flattened as the routers see the tokens ([samples × seq])."""
    return (labels != IGNORE_INDEX).reshape(-1)


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


def flips(ids_a: torch.Tensor, ids_b: torch.Tensor, logits_b: torch.Tensor, top_k: int) -> list[dict]:
    """The tokens whose chosen experts differ between two runs' routers (the same tokens in the same order), each with
    the reference's gap between its k-th and (k+1)-th router logit: how near a tie the reference was."""
    a, b = ids_a.sort(-1).values, ids_b.sort(-1).values
    differ = (a != b).any(-1).nonzero().flatten().tolist()
    top = logits_b.float().topk(min(top_k + 1, logits_b.shape[-1]), dim=-1).values
    return [{"token": t, "experts": a[t].tolist(), "reference_experts": b[t].tolist(),
             "logit_gap": float(top[t, top_k - 1] - top[t, top_k]) if top.shape[-1] > top_k else 0.0}
            for t in differ]
