"""A megatron-core job's model read under Hugging Face names (docs/megatron.md#what-is-recorded): the recorder's view
(parity/training/view.py's protocol, through parity/views/translated.py) over the job's own GPTModel and the torch optimizer inside
its MegatronOptimizer, at tensor (TP) × data (DP) × pipeline (PP) × expert (EP) parallelism.

- Each parameter tagged `tensor_model_parallel` is split along its `partition_dim` over the TP group: TP rank r holds
  the r-th chunk, the DP ranks of one TP rank hold it alike. Every other parameter (the norms) is held alike by every
  rank of its pipeline stage. Full tensors are gathered over TP and translated by names.py (renamed; QKV split per query group,
  linear_fc1 into gate and up); the per-step pieces are each rank's shard, split the same way by element index.
- The norms are float64 sums over each element once (a piece counted on the first rank that holds it), summed over
  the world: the pre-clip norm as megatron-core's own clip takes it (it leaves TP duplicates out alike).
- The gradients are the ones megatron-core's optimizer steps: its DistributedDataParallel accumulates into each
  parameter's `main_grad`, reduced over DP by `finalize_model_grads`, and the FP32 optimizer points `grad` at it in
  `prepare_grads` (frameworks/megatron/recording.py reads them there, before the clip).

- Under the distributed optimizer each DP rank steps a range of each TP shard's flat elements (its reduce-scattered
  gradient, its moments); those ranges are the pieces, the moments are summed over DP into whole TP shards, and the
  parameters, gathered whole by megatron-core after each step, are replicas on the DP ranks.

- In bf16 (megatron-core's Float16Module and `bf16=True`: the bf16_params policy) and in fp16 (`fp16=True`, its loss
  scaler: the fp16 policy) the optimizer steps fp32 masters of the 16-bit parameters: the weights read (the parameter
  norm, each tensor's, the full state) and the moments are the masters', a distributed optimizer's range of each in
  place of the 16-bit parameter's elements.

- Under pipeline parallelism each stage holds its own layers (renumbered in the whole model; with virtual pipeline
  stages each of its model chunks), the norms are held alike by the ranks of their stage, full tensors are gathered
  over the stages, and the last stage's first TP rank hands each DP rank's rows over. An embedding tied to the output
  layer across stages has a copy on the last stage (megatron-core all-reduces the two copies' gradients): a replica
  of the first stage's, counted there.

- Under Megatron-FSDP each parameter is a DTensor holding this rank's range of its flat elements, its gradient and
  moments alike: read as the distributed optimizer's ranges (`_placed`), the parameters themselves never whole.

- A mixture of experts (moe.py): each expert's parameters split over the expert-TP group and held alike by its
  expert-data-parallel ranks, every EP rank's experts stacked into the fused Hugging Face weights; megatron-core's
  dense and expert optimizers followed as one.

Refused in one line (MegatronRefused): context parallelism, fp16 with the experts' optimizer, 16-bit parameters
without the optimizer's fp32 masters, chained optimizers unlike megatron-core's dense and expert ones, Megatron-FSDP
with experts, in bf16 or fp16 or at TP > 1, megatron-core's torch-FSDP2 wrapper, a model other than a GPTModel.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from parity.frameworks.megatron.config import MegatronRefused
from parity.frameworks.megatron.moe import ExpertGroups, chained, global_expert, is_expert
from parity.frameworks.megatron.names import full_tensor, part_of, stacked, to_hf
from parity.views.base import View, torch_optimizer
from parity.views.translated import TranslatedView
from parity.training.optimizer import ADAMW_MOMENTS


def gpt_models(model) -> list:
    """The GPTModel inside each chunk of the job's model (a list of chunks — one a virtual pipeline stage —,
    DistributedDataParallel, Float16Module, Megatron-FSDP); MegatronRefused for anything else."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel

    found = []
    for inner in model if isinstance(model, (list, tuple)) else [model]:
        while not isinstance(inner, GPTModel) and hasattr(inner, "module"):
            if isinstance(inner, TorchFullyShardedDataParallel):
                raise MegatronRefused("megatron-core's torch-FSDP2 wrapper (TorchFullyShardedDataParallel): not "
                                      "recorded yet; record the job under DistributedDataParallel or Megatron-FSDP")
            inner = inner.module
        if not isinstance(inner, GPTModel):
            raise MegatronRefused(f"the model is a {type(inner).__name__}, not a GPTModel: only GPTModel maps onto a "
                                  f"transformers model")
        found.append(inner)
    if len({id(m) for m in found}) != len(found):
        raise MegatronRefused("one model chunk given twice: each virtual pipeline stage is a chunk of its own")
    return found


def refusal(optimizer) -> str | None:
    """What of the job's parallel layout or optimizer the recorder does not read yet, in one line (None: it does)."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size > 1:
        return f"context parallelism (context size {size}): not recorded yet; record the job without it"
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(type(o) is not type(inner[0]) or o.config != inner[0].config for o in inner):
        return (f"{len(inner)} chained optimizers of other kinds or configs: the recorder follows megatron-core's "
                f"dense and expert optimizers alike")
    config = inner[0].config
    if config.fp16 and len(inner) > 1:
        return ("fp16 with the experts' optimizer beside the dense one (a ChainedOptimizer: each of its loss scalers "
                "updates on its own overflows): not recorded yet; record the job in bf16 or fp32")
    if not (config.bf16 or config.fp16) and any(p.dtype != torch.float32 for g in inner[0].param_groups
                                                for p in g["params"]):
        return "parameters not in fp32 stepped without fp32 masters (OptimizerConfig bf16=False): not recorded"
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """A Megatron-FSDP DTensor's local range (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def global_name(module, name: str) -> str:
    """A parameter's name with its decoder layer numbered in the whole model (a pipeline stage numbers its own from
    0: megatron-core's layer_number is the global one, from 1), and its expert, where it is one (an EP rank numbers
    its local experts from 0); the last stage's copy of an embedding tied across stages under the embedding's."""
    name = name.removeprefix("module.")
    if name == "output_layer.weight" and module.share_embeddings_and_output_weights and not module.pre_process:
        return "embedding.word_embeddings.weight"  # the last stage's copy of an embedding tied across stages
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        if parts[3:6] == ["mlp", "experts", "local_experts"]:  # an EP rank's local expert: its number in the model
            parts[6] = str(global_expert(module, int(parts[2]), int(parts[6])))
        elif parts[3:5] == ["mlp", "experts"] and parts[-1].startswith("weight") and parts[-1][6:].isdigit():
            parts[-1] = f"weight{global_expert(module, int(parts[2]), int(parts[-1][6:]))}"  # TE's grouped experts
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def sharded_optimizer(optimizer) -> dict[int, tuple]:
    """The distributed optimizer's ranges: {id(model parameter): (the parameter, the shard its torch optimizer steps,
    start, end)}, the shard being elements start…end of the parameter's (TP-local) flat tensor — an fp32 parameter's
    own, a bf16 one's fp32 master — for each parameter this DP rank holds a range of."""
    found = {}
    for model_groups, shard_groups in ((optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
                                       (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups)):
        for models, shards in zip(model_groups, shard_groups):
            for model, shard in zip(models, shards):
                taken = optimizer._get_model_param_range_map(model)["param"]
                found[id(model)] = (model, shard, taken.start, taken.end)
    return found


def masters(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The bf16 optimizer's (Float16OptimizerWithFloat16Params) fp32 master of each bf16 parameter: [(model
    parameter, master)]; none for the FP32 optimizer, which steps the parameters themselves."""
    return [(model, master) for models, mains in zip(getattr(optimizer, "float16_groups", []),
                                                     getattr(optimizer, "fp32_from_float16_groups", []))
            for model, master in zip(models, mains)]


class MegatronView(TranslatedView):
    """`modules`: the job's GPTModel chunks (one a virtual pipeline stage); `optimizer`: its MegatronOptimizer;
    `hf_model`: the transformers model of the job's config (config.hf_config), on the meta device; `config`: the job's
    TransformerConfig."""

    kind = "megatron-core"
    refused = MegatronRefused
    whole = False  # sharded over TP: every rank takes part in the gathers
    scales_loss = True  # fp16's scaler is its optimizer's, recorded by its room (recording.py)

    def __init__(self, modules: list, optimizer, hf_model, config, device: torch.device):
        from megatron.core import parallel_state as ps

        why = refusal(optimizer)
        if why is not None:
            raise MegatronRefused(why)
        inner = getattr(optimizer, "chained_optimizers", [optimizer])  # the dense parameters' and the experts'
        View.__init__(self, hf_model, chained([torch_optimizer(o) for o in inner]))
        self.modules, self.config, self.device = modules, config, device
        self.experts = ExpertGroups()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank, self.tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp, self.pp_group = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()
        self.feeds = self.tp_rank == 0 and ps.is_pipeline_last_stage()  # one rank of a DP rank hands its rows over
        self._tp_ranks = dist.get_process_group_ranks(self.tp_group)
        self._dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
        stages = [None] * self.world
        dist.all_gather_object(stages, ps.get_pipeline_model_parallel_rank())
        self._stage_ranks = tuple(r for r, stage in enumerate(stages) if stage == stages[self.rank])
        self.native = [(global_name(chunk, n), p) for chunk in modules for n, p in chunk.named_parameters()]
        # tied across pipeline stages: the last stage's copy of the embedding (megatron-core all-reduces the two
        # copies' gradients over its embedding group), a replica of the first stage's, counted there
        self._copies = {id(c.output_layer.weight) for c in modules if c.share_embeddings_and_output_weights and
                        c.post_process and not c.pre_process}
        holds = bool(self._copies) or any(c.pre_process and c.share_embeddings_and_output_weights for c in modules)
        everyone = [None] * self.world
        dist.all_gather_object(everyone, (self.tp_rank, holds))
        self._tied_ranks = tuple(r for r, (tp, holds) in enumerate(everyone) if holds and tp == self.tp_rank)
        self.shards_of: dict[int, tuple] | None = None  # the distributed optimizer's: see sharded_optimizer
        self._master: dict[int, torch.Tensor] = {}  # the bf16 optimizer's fp32 masters: see masters
        ddp_config = getattr(inner[0], "ddp_config", None)
        self.fsdp = bool(ddp_config is not None and ddp_config.use_megatron_fsdp)  # Megatron-FSDP: see _placed
        if self.fsdp and (config.num_moe_experts or inner[0].config.bf16 or inner[0].config.fp16 or self.tp > 1):
            raise MegatronRefused("Megatron-FSDP with MoE layers, in bf16 or fp16 or at TP > 1 (its DTensors span the "
                                  "TP × DP mesh): not recorded yet; record it in fp32 at TP 1 without experts, or under "
                                  "megatron-core's DistributedDataParallel")
        if self.fsdp:  # each rank's range of every parameter's flat elements: the parameter itself is that range
            self.shards_of = {id(p): (p, p, p.megatron_fsdp_slice.start, p.megatron_fsdp_slice.stop)
                              for _, p in self.native}
            self._model_of = {id(p): p for _, p in self.native}
        elif inner[0].config.use_distributed_optimizer:
            self.shards_of = {k: v for o in inner for k, v in sharded_optimizer(o).items()}
            self._model_of = {id(shard): model for model, shard, _, _ in self.shards_of.values()}
        else:
            pairs = [pair for o in inner for pair in masters(o)]
            self._master = {id(model): master for model, master in pairs}
            self._model_of = {id(master): model for model, master in pairs}
        self.targets = self._targets()
        self.check_held()

    @property
    def tp_size(self) -> int:
        return self.tp

    def describe(self) -> dict:
        return {"kind": self.kind, "zero_stage": 3 if self.fsdp else 0 if self.shards_of is None else 1,
                "dp_size": self.dp_size, "megatron_fsdp": self.fsdp,
                "tp_size": self.tp, "mesh": {"tp": self.tp, "dp": self.dp_size, "pp": self.pp,
                                             **({"vpp": len(self.modules)} if len(self.modules) > 1 else {}),
                                             **({"ep": self.experts.ep, "etp": self.experts.etp}
                                                if self.config.num_moe_experts else {})},
                "distributed_optimizer": self.shards_of is not None,
                "sequence_parallel": bool(self.config.sequence_parallel)}

    def optimizer_kind(self) -> tuple[str, str | None]:
        """megatron-core steps TransformerEngine's FusedAdam where it is installed, else apex's, else torch's AdamW
        (megatron/core/optimizer): a fused one in adam_w_mode (else L2 decay: Adam) that keeps no masters or moments of
        its own in other dtypes (the precision-aware optimizer's) is torch's update in one kernel. Not yet run: no GPU
        image lent had either library (docs/megatron.md); the CPU jobs step torch's."""
        kind, optimizer = type(self.optimizer), self.optimizer
        library = kind.__module__.split(".")[0]
        own_dtypes = getattr(optimizer, "master_weights", False) or any(
            getattr(optimizer, f"{moment}_dtype", torch.float32) != torch.float32 for moment in ("exp_avg", "exp_avg_sq"))
        if (library, kind.__name__) in {("transformer_engine", "FusedAdam"), ("apex", "FusedAdam")} and \
                hasattr(optimizer, "adam_w_mode") and not own_dtypes:
            return ("AdamW" if optimizer.adam_w_mode else "Adam"), f"{library}'s FusedAdam"
        return super().optimizer_kind()

    # --- the sharding: TP along partition_dim, DP alike ---------------------------------------------------------
    @staticmethod
    def split(p: torch.Tensor) -> bool:
        return bool(getattr(p, "tensor_model_parallel", False))

    def split_over(self, p) -> tuple:
        """(group, size, rank) of the TP group `p` is split over: an expert's, its expert-TP group."""
        if is_expert(p):
            return self.experts.etp_group, self.experts.etp, self.experts.etp_rank
        return self.tp_group, self.tp, self.tp_rank

    def shards(self, p):
        return self.split_over(p)[1] if self.split(p) else 1

    def full_shape(self, p):
        shape = list(p.shape)
        if self.split(p):
            shape[p.partition_dim] *= self.shards(p)
        return tuple(shape)

    def holders(self, p):
        """Of a piece (a gradient's, a parameter's, a moment's): the DP ranks of this TP rank hold a TP shard alike and
        every rank a norm; under the distributed optimizer each DP rank holds its range of them, a norm's alike on the
        TP ranks of its DP rank."""
        if self.shards_of is not None:
            return (self.rank,) if self.split(p) else tuple(sorted(self._tp_ranks))
        return self.holders_whole(p)

    def holders_whole(self, p) -> tuple[int, ...]:
        """Of the parameter itself, whole at the step's end (the distributed optimizer gathers it over DP): a TP shard
        on the DP ranks of its TP rank (an embedding tied across pipeline stages: on theirs on both stages), an
        expert's on its expert-data-parallel ranks, a norm (and a router) on every rank of its pipeline stage."""
        if getattr(p, "shared_embedding", False):
            return self._tied_ranks
        if is_expert(p):
            return self.experts.edp_ranks
        return tuple(sorted(self._dp_ranks if self.split(p) else self._stage_ranks))

    @functools.cached_property
    def _counted_native(self) -> dict[str, bool]:
        """A piece counted on the first rank that holds it: the last stage's copy of a tied embedding never."""
        return {n: self.holders(p)[0] == self.rank and id(p) not in self._copies for n, p in self.native}

    def local_index(self, p, index):
        if not self.split(p):
            return self.piece_of(p, index)
        _, size, rank = self.split_over(p)
        return self.piece_of(p, index.chunk(size, dim=p.partition_dim)[rank])

    def piece_of(self, p, t):
        """The TP shard (`t` of it), or under the distributed optimizer this DP rank's range of it, flat (empty where
        it holds none)."""
        if self.shards_of is None:
            return t
        _, _, start, end = self.shards_of.get(id(p), (None, None, 0, 0))
        return t.reshape(-1)[start:end]

    def stepped(self, p):
        return self._model_of.get(id(p), p)

    def group_params(self) -> list[list]:
        """Each optimizer group's parameters as the transformers model's. A pipeline stage's groups hold its own
        layers' parameters, a DP rank's under the distributed optimizer those it has a range of: the groups are the
        union over the world (a collective, every rank at the recorder's start)."""
        if self.shards_of is None and self.pp == 1 and not self.config.num_moe_experts:  # experts: one tensor
            return super().group_params()
        native = {id(p): n for n, p in self.native}
        mine = [{h for p in map(self.stepped, g["params"]) if p.requires_grad
                 for h, _ in self.targets[native[id(p)]]} for g in self.optimizer.param_groups]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        return [[p for h, p in self.model.named_parameters() if any(h in groups[g] for groups in everyone)]
                for g in range(len(mine))]

    def native_names(self) -> list[str]:
        everyone = [None] * self.world
        dist.all_gather_object(everyone, [n for n, _ in self.native])
        return sorted({n for names in everyone for n in names})

    def tensor_names(self) -> list[str]:
        """Every tensor of the transformers model, in its order, on every rank (a stage holds pieces of its own)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _targets(self) -> dict[str, list[tuple[str, torch.Tensor | None]]]:
        """Each parameter's Hugging Face tensors, checked against the transformers model's names and shapes (those
        that no stage maps: a collective)."""
        hf = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        targets, seen, self.labels = {}, set(), {}
        for name, p in self.native:
            shape = self.full_shape(p)
            out = to_hf(name, torch.empty(shape, device="meta"), self.config, self.shards(p))  # names and shapes
            for key, t in out.items():
                h, expert = part_of(key)  # an expert's part of a fused 3-D weight: one row of it
                has = hf.get(h) if expert is None else hf.get(h, (0,))[1:] if expert < hf.get(h, (0,))[0] else None
                if has != tuple(t.shape):
                    raise MegatronRefused(f"megatron-core {name} maps to {key} of shape {tuple(t.shape)}, which "
                                          f"{type(self.model).__name__} has as {has}")
                seen.add(h)
            self.labels[name] = next(iter(out))  # how the replica check names it: an expert's part NAME[e]
            if len(out) == 1:
                targets[name] = [(part_of(next(iter(out)))[0], None)]
            else:  # split: where each of the parameter's elements lands
                index = torch.arange(p.numel() * self.shards(p), dtype=torch.int64).view(shape)
                targets[name] = [(h, t.reshape(-1))
                                 for h, t in to_hf(name, index, self.config, self.shards(p)).items()]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, seen)
        missing = [h for h in hf if not any(h in found for found in everyone)]
        if missing:
            raise MegatronRefused(f"{type(self.model).__name__}'s {missing[0]} is mapped from no parameter of the "
                                  f"job's GPTModel (tied embeddings, or a layer the mapping does not know)")
        return targets

    # --- norms and full tensors over the native module ----------------------------------------------------------
    def _norm(self, read) -> float:
        """Over every element once: each rank's pieces of the parameters it counts (their Hugging Face split only
        parts what is summed here), summed over the world."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.trainable():
            t = read(p)
            if t is not None and self._counted_native[name]:
                total += self.piece_of(p, t).detach().double().pow(2).sum().to(self.device)
        dist.all_reduce(total)
        return float(total.sqrt())

    def _grad(self, p):
        """The gradient the optimizer steps: the DP-reduced `main_grad` of megatron-core's DistributedDataParallel
        (the FP32 optimizer's `grad` is it; the distributed optimizer's shards are ranges of it), Megatron-FSDP's
        reduce-scattered range placed (_placed)."""
        if self.fsdp:
            return None if p.grad is None else self._placed(p, p.grad)
        return getattr(p, "main_grad", p.grad)

    def _placed(self, p, t: torch.Tensor) -> torch.Tensor:
        """Under Megatron-FSDP, `t` — the DTensor parameter `p`, its gradient or a moment: this rank's range of its
        flat elements (`megatron_fsdp_slice`) — as a tensor of `p`'s shape, the range in place and zeros elsewhere:
        what the distributed optimizer's path reads (piece_of takes the range back)."""
        _, _, start, end = self.shards_of[id(p)]
        whole = torch.zeros(p.numel(), dtype=t.dtype, device=self.device)
        whole[start:end] = local(t).detach().reshape(-1).to(self.device)
        return whole.view(p.shape)

    def gradient_pieces(self):
        return self._pieces(self._grad)

    def grad_norm(self, squares=None) -> float:
        return self._norm(self._grad)

    def parameter_norm(self) -> float:
        return self._norm(self._weights)

    def parameter_pieces(self):
        return self._pieces(self._weights)

    def _weights(self, p) -> torch.Tensor:
        """The weights the optimizer updates, of `p`'s shape: `p`, or its fp32 master where one is kept apart (under
        the distributed optimizer this rank's range of the master in place: the piece read is that range)."""
        if self.fsdp:
            return self._placed(p, p)
        if self.shards_of is None or p.dtype == torch.float32:
            return self._master.get(id(p), p).detach()
        held = self.shards_of.get(id(p))
        if held is None:
            return p.detach()
        weights = p.detach().float().reshape(-1).clone()
        weights[held[2]:held[3]] = held[1].detach()
        return weights.view(p.shape)

    def _full_weights(self, p) -> torch.Tensor:
        """`_weights` whole on every DP rank (the distributed optimizer's ranges of a master summed over DP): a
        collective there."""
        if self.fsdp:
            return self._summed_over_dp(p, local(p))
        if self.shards_of is None or p.dtype == torch.float32:
            return self._weights(p)
        held = self.shards_of.get(id(p))
        return self._summed_over_dp(p, None if held is None else held[1])

    def _summed_over_dp(self, p, ranged: torch.Tensor | None) -> torch.Tensor:
        """A tensor of `p`'s (TP-local) shape whole on every DP rank, from each DP rank's range of it under the
        distributed optimizer (`ranged`: this rank's, None where it holds none): each in place, zeros elsewhere, summed
        over DP in fp32. A collective."""
        from megatron.core import parallel_state as ps

        whole = torch.zeros(p.numel(), dtype=torch.float32, device=self.device)
        if ranged is not None:
            _, _, start, end = self.shards_of[id(p)]
            whole[start:end] = local(ranged).detach().float().reshape(-1).to(self.device)
        dist.all_reduce(whole, group=self.experts.edp_group if is_expert(p) else ps.get_data_parallel_group())
        return whole.view(p.shape)

    def _full(self, name: str, p: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
        group, size, _ = self.split_over(p)
        return to_hf(name, full_tensor(p, t.to(self.device), group).cpu(), self.config, size)

    def _stages(self, mine: dict) -> dict:
        """This stage's full tensors and every other stage's (gathered over the pipeline group), every EP rank's
        experts among them, each fused expert weight stacked whole."""
        mine = self.experts.gathered(mine)
        if self.pp > 1:
            parts = [None] * self.pp
            dist.all_gather_object(parts, mine, group=self.pp_group)
            mine = {k: v for part in parts for k, v in part.items()}
        return stacked(mine)

    def buffer_names(self) -> list[str]:
        """The transformers model's buffers (its RoPE frequencies …), not a tied parameter's second name."""
        named = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        return [n for n in super().buffer_names() if n not in named]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the transformers model's state dict, full: a tied one under each of its names (lm_head's
        too, as the harness's initial-weights file holds it)."""
        state = self._stages({h: t for n, p in self.native
                              for h, t in self._full(n, p, self._full_weights(p)).items()})
        first = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if first.setdefault(id(p), name) != name and first[id(p)] in state:
                state[name] = state[first[id(p)]]
        return state

    def _state(self, p) -> dict:
        """The optimizer's state of parameter `p` (of its shard, under the distributed optimizer: none where this DP
        rank holds no range of it)."""
        if self.shards_of is None:
            return self.optimizer.state.get(self._master.get(id(p), p), {})
        held = self.shards_of.get(id(p))
        return {} if held is None else self.optimizer.state.get(held[1], {})

    def full_optimizer_state(self):
        """AdamW's moments gathered over TP (the distributed optimizer's ranges summed over DP first: each rank's
        range in place, zeros elsewhere) and translated, and its step count; ({}, 0) before the first step. Every rank
        takes part in every gather."""
        counts = [int(s["step"]) for _, p in self.native for s in [self._state(p)] if "step" in s]
        count = torch.tensor(max(counts, default=0), dtype=torch.float64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # a DP rank that holds no range of any tensor knows no count
        if not int(count):
            return {}, 0
        out = {}
        for name, p in self.native:
            state = self._state(p)
            for key in ADAMW_MOMENTS:
                moment = state[key].float() if self.shards_of is None else self._summed_over_dp(p, state.get(key))
                for h, moved in self._full(name, p, moment).items():
                    out.setdefault(h, {})[key] = moved
        return self._stages(out), int(count)

    def replicated(self) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
        """(its first Hugging Face name — an expert's part NAME[e] —, parameter, the ranks that hold it alike) of each
        parameter several ranks hold."""
        return [(self.labels[n], p, ranks) for n, p in self.native for ranks in [self.holders(p)] if len(ranks) > 1]

    def replicas(self):
        from parity.training.replicas import Replica, held

        if self.shards_of is None:
            return [r for name, p, ranks in self.replicated()
                    for r in held(name, ranks, p, self.optimizer, self._master.get(id(p)))]
        found = []
        for name, p in self.native:  # each parameter whole; a norm's moments alike on the TP ranks of a DP rank
            first = self.labels[name]
            found.append(Replica(first, self.holders(p), local(p).detach()) if self.fsdp else  # a range: not gathered
                         Replica(first, self.holders_whole(p), p.detach()))
            if not self.split(p) and self.tp > 1 and id(p) in self.shards_of:
                state, (_, _, start, end) = self._state(p), self.shards_of[id(p)]
                found.extend(Replica(first, self.holders(p), None if state.get(key) is None else local(state[key]),
                                     key, f"[{start}:{end}]") for key in ADAMW_MOMENTS)
        return found


__all__ = ["MegatronView", "gpt_models", "refusal"]
