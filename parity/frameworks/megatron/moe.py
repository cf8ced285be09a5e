"""What a megatron-core mixture of experts adds to its recording (docs/megatron.md#mixture-of-experts):

- `ExpertGroups` — where an expert's parameters live: each EP rank holds experts ep_rank × E/EP … of every MoE layer
  (`local_experts.i`, renumbered in the whole model by view.py), each split over the expert-TP group (ETP, its own
  degree: `expert_tensor_parallel_size`) and held alike by the expert-data-parallel ranks (EDP), whose gradients
  megatron-core's DistributedDataParallel reduces over EDP (scaled by 1/DP, as the dense ones), and whose distributed
  optimizer shards them over EDP.
- `chained` — megatron-core builds one optimizer for the dense parameters and one for the experts' (a
  ChainedOptimizer of two, alike in their config): the recorder follows both as one torch optimizer.
- `RouterStatistics` — each router's logits and routing map as it routes a training micro-batch, read by hooks
  (nothing it computes changes), and at the step's end the values the replay's routing records under megatron-core's
  router losses (parity/training/routing.py): the load-balancing loss and the z loss without their coefficients,
  each micro-batch's summed over the sparse layers and averaged over the global batch's micro-batches, and each
  layer's expert loads over the global batch. Under sequence parallelism each TP rank routes its part of the
  micro-batch's tokens: the counts, probability sums and token counts are summed over TP before the loss is taken.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_expert(p: torch.Tensor) -> bool:
    """A routed expert's parameter: megatron-core marks them `allreduce = False` (reduced over EDP, not DP)."""
    return getattr(p, "allreduce", True) is False


class ExpertGroups:
    """The EP, ETP and EDP groups of this rank (parallel_state's), and each expert parameter's global expert index."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.etp, self.etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        self.edp_group = ps.get_expert_data_parallel_group()
        self.edp_ranks = tuple(sorted(dist.get_process_group_ranks(self.edp_group)))

    def gathered(self, mine: dict) -> dict:
        """`mine` with every EP rank's expert parts of it (keys NAME[e]: names.part_of) beside this rank's. A
        collective over the EP group."""
        from parity.frameworks.megatron.names import part_of

        if self.ep == 1:
            return mine
        parts = [None] * self.ep
        dist.all_gather_object(parts, {k: v for k, v in mine.items() if part_of(k)[1] is not None},
                               group=self.ep_group)
        return {**mine, **{k: v for part in parts for k, v in part.items()}}


def global_expert(module, layer: int, local: int) -> int:
    """The expert that local expert `local` of this stage's decoder layer `layer` is in the whole model."""
    return module.decoder.layers[layer].mlp.local_expert_indices[local]


def chained(optimizers: list):
    """The torch optimizers of a ChainedOptimizer's parts as one, for the recorder: their groups in order, their state,
    a step pre-hook before the first one's step and a post-hook after the last one's. An instance of the first's class
    (torch.optim.AdamW: what the record describes) that never ran its __init__."""
    if len(optimizers) == 1:
        return optimizers[0]
    kind = type(optimizers[0])

    class Chained(kind):
        def __init__(self):  # noqa: the parts hold the state: nothing of Optimizer.__init__
            self.parts = optimizers

        @property
        def param_groups(self):
            return [g for o in self.parts for g in o.param_groups]

        @property
        def state(self):  # a plain dict: a part's defaultdict would answer for another's parameters
            return {p: state for o in self.parts for p, state in o.state.items()}

        def register_step_pre_hook(self, hook):
            return self.parts[0].register_step_pre_hook(lambda _, args, kwargs: hook(self, args, kwargs))

        def register_step_post_hook(self, hook):
            return self.parts[-1].register_step_post_hook(lambda _, args, kwargs: hook(self, args, kwargs))

    Chained.__name__ = Chained.__qualname__ = kind.__name__
    return Chained()


class RouterStatistics:
    """Hooks on the routers of a GPTModel's MoE layers (the module docstring): while `taking`, each training router
    call's per-micro-batch sums, in call order per layer (a layer routes a step's micro-batches in order)."""

    def __init__(self, modules: list, config, view):
        self.view, self.config = view, config
        self.num_experts, self.top_k = config.num_moe_experts, config.moe_router_topk
        self.num_layers = config.num_layers  # every layer sparse (config.py refuses others)
        self.taking, self.broken = False, None
        self.calls: dict[int, list[torch.Tensor]] = {}  # global layer → [[counts E, probability sums E, tokens, lse²]]
        for layer in (layer for chunk in modules for layer in chunk.decoder.layers):
            router = layer.mlp.router
            router.register_forward_hook(self._hook(layer.layer_number - 1, router), with_kwargs=True)

    def _hook(self, index: int, router):
        gating = router.gating
        seen = []

        def gate(input):  # the router's logits, as its routing takes them
            logits = gating(input)
            seen.append(logits.detach())
            return logits

        router.gating = gate

        def hook(module, args, kwargs, output):
            logits = seen.pop() if seen else None
            if not self.taking or not module.training or torch._C._current_graph_task_id() != -1:
                return  # evaluation, or a recomputation inside the backward
            if (args[1:] and args[1] is not None) or kwargs.get("padding_mask") is not None:
                self.broken = "a MoE router's padding mask: not recorded yet (the replay routes every token)"
                return
            taken = logits.double().reshape(-1, self.num_experts)
            routing_map = output[1].reshape(-1, self.num_experts)
            row = torch.cat([routing_map.double().sum(0), torch.softmax(taken, -1).sum(0),
                             torch.tensor([taken.shape[0], torch.logsumexp(taken, -1).square().sum()],
                                          dtype=torch.float64, device=taken.device)])
            self.calls.setdefault(index, []).append(row)

        return hook

    def step(self) -> dict:
        """The step's routing record ({"aux_loss", "z_loss", "expert_loads"}: the module docstring), the calls
        cleared. Collective: every rank calls it once a step."""
        from megatron.core import parallel_state as ps

        calls, self.calls = self.calls, {}
        micro = max((len(c) for c in calls.values()), default=0)
        dims = 2 * self.num_experts + 2
        sums = torch.zeros(micro, self.num_layers, dims, dtype=torch.float64, device=self.view.device)
        for layer, rows in calls.items():
            sums[:len(rows), layer] = torch.stack(rows).to(sums.device)
        dist.all_reduce(sums, group=self.view.tp_group)  # SP: each TP rank routed its part of the tokens
        e = self.num_experts
        tokens = sums[..., 2 * e].clamp(min=1)
        aux = e / (self.top_k * tokens ** 2) * (sums[..., :e] * sums[..., e:2 * e]).sum(-1)
        z = sums[..., 2 * e + 1] / tokens
        first = float(ps.get_tensor_model_parallel_rank() == 0)  # one TP rank of each DP rank and stage counts
        values = torch.cat([torch.stack([aux.sum(), z.sum()]) / max(micro, 1), sums[..., :e].sum(0).reshape(-1)])
        values *= first
        dist.all_reduce(values)  # over the DP ranks and the pipeline's stages (each its own layers)
        aux_value, z_value = (values[:2] / self.view.dp_size).tolist()
        loads = values[2:].reshape(self.num_layers, e).round().long().tolist()
        config = self.config
        return {"aux_loss": aux_value if config.moe_aux_loss_coeff and
                config.moe_router_load_balancing_type == "aux_loss" else None,
                **({"z_loss": z_value} if config.moe_z_loss_coeff else {}), "expert_loads": loads}


__all__ = ["ExpertGroups", "RouterStatistics", "chained", "global_expert", "is_expert"]
