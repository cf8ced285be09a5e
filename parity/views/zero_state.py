"""What ZeRO's ranks hold, read the way the DeepSpeed strategy reads it: the float64 norm over each rank's pieces of the
module's tensors (TP shards summed over their TP group, DP partitions over the DP group, AutoEP's experts over the EP
group), each tensor's pieces with the rank that counts each (local_gradient, zero_pieces: every tensor's norms,
parity/training/tensor_norms.py), the replicas (the tensors several ranks hold alike) and the full tensors through each
AutoTP layer's own gather_params (full_tensors). Here, below the strategy, because a recorder of a user's own
DeepSpeed loop (the ZeRO view, zero.py) reads an engine it did not build with the same code.
"""

from __future__ import annotations

import math

import torch

from parity.training.optimizer import squared_norm_fp64
from parity.training.optimizer import ADAMW_MOMENTS
from parity.training.replicas import Replica
from parity.training.tensor_norms import Piece


def module_norm(engine, local_of, *, zero_stage: int, partitioned: bool, device: torch.device, tp_size: int,
                autoep: dict | None = None) -> float:
    """The L2 norm, in float64, of `local_of(p)` (this rank's piece of a tensor of parameter p; None: none here) over
    the engine's module's trainable parameters: TP shards summed over the TP group, replicated tensors once, and — `partitioned`
    (ZeRO-3, or the fp32 masters of ZeRO-1/2) — DP partitions summed over the DP group; AutoEP's experts (`autoep`:
    {block name: its layer}) over their EP group. Collective."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [TP-sharded, replicated]
    experts = torch.zeros(1, dtype=torch.float64, device=device)  # AutoEP's: this rank's experts
    expert_dp_group = None  # the ranks holding the same experts, over which ZeRO partitions them
    for p in engine.module.parameters():
        if is_moe_param(p):
            expert_dp_group = groups._get_expert_data_parallel_group(p.group_name)
        local = local_of(p) if p.requires_grad else None  # LoRA's frozen base: what the optimizer updates only
        if local is None:
            continue
        if is_moe_param(p):
            experts += squared_norm_fp64(local)
        else:
            sums[0 if is_model_parallel_parameter(p) else 1] += squared_norm_fp64(local)
    if partitioned or zero_stage == 3:
        dist.all_reduce(sums, group=engine.seq_data_parallel_group)
    if autoep:  # each rank of an EP group holds other experts
        if partitioned or zero_stage == 3:  # and their partitions are over the ranks holding the same experts
            dist.all_reduce(experts, group=expert_dp_group)
        dist.all_reduce(experts, group=next(iter(autoep.values())).ep_group)
        sums[1] += experts[0]
    if tp_size > 1:
        sharded = sums[:1].clone()
        dist.all_reduce(sharded, group=groups.get_tensor_model_parallel_group())
        sums[0] = sharded[0]
    return math.sqrt(float(sums.sum()))


def local_master(p, zero_stage: int, masters_apart: bool, unfused_masters: dict | None = None):
    """This rank's part of the master weight of parameter p: ZeRO-3's DP partition of it; ZeRO-1/2's (and the BF16
    optimizer's) fragment of a policy's fp32 master in this rank's partition (_hp_mapping); ZeRO-0's fp32 copy
    (FP16_UnfusedOptimizer's fp32_groups: `unfused_masters`, by parameter id) — or the parameter itself where it is
    the master (`masters_apart` False: fp32, autocast, bf16_pure at stages 0–2: ZeRO copies the updated partitions
    back). None where this rank holds no part of it."""
    from deepspeed.utils import safe_get_local_fp32_param

    if zero_stage == 3:
        return safe_get_local_fp32_param(p)
    if not masters_apart:
        return p
    if zero_stage == 0:
        return unfused_masters[id(p)]
    mapping = getattr(p, "_hp_mapping", None)  # None: no fragment of it in this rank's partition
    return mapping.get_hp_fragment() if mapping is not None else None


def unfused_masters(engine) -> dict[int, torch.Tensor]:
    """ZeRO-0's fp32 master copies of a bf16 or fp16 engine, by their parameter's id (DeepSpeed's FP16_UnfusedOptimizer
    keeps them in fp32_groups, parallel to the parameters' fp16_groups, and loads a checkpoint into them in place):
    found once, read for every parameter at every step (local_master's `unfused_masters`)."""
    opt = engine.optimizer
    return {id(p): m for lp, hp in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(lp, hp)}


def local_gradient(p, zero_stage: int):
    """This rank's part of parameter p's gradient as DeepSpeed holds it after the step's backward and before
    engine.step(), which clips it and frees it: ZeRO-3's partition of it (safe_get_local_grad, fp32); ZeRO-1/2's (and
    the BF16 optimizer's) fragment in this rank's partition, where DeepSpeed's own safe_get_full_grad reads it (the
    averaged gradients, ZeRO-Offload's fp32 gradient partition, or the BF16 optimizer's whole fp32 accumulation buffer,
    of which the fragment's elements); ZeRO-0's whole reduced gradient. The same dtype and loss scale as DeepSpeed's
    own norm reads. None where this rank holds no part of it."""
    from deepspeed.utils import safe_get_local_grad

    if zero_stage == 3:
        return safe_get_local_grad(p)
    if zero_stage == 0:
        return p.grad
    mapping = getattr(p, "_hp_mapping", None)  # None: no fragment of it in this rank's partition
    if mapping is None:
        return None
    whole = getattr(p, "_hp_grad", None)  # the BF16 optimizer's fp32 accumulation of the whole gradient
    fragment = (whole if whole is not None else mapping.get_lp_grad_fragment(p._index_in_param_group)).flatten()
    address = mapping.lp_fragment_address
    return fragment.narrow(0, address.start, address.numel) if fragment.numel() == p.numel() else fragment


def autotp_groups(engine, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this rank's TP group, its DP group) as DeepSpeed made them: AutoTP's tensor-parallel group (this rank alone
    where AutoTP is off: autotp_size 0 or 1) and the group ZeRO averages and partitions over."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    tp = tuple(dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())) \
        if engine.autotp_size() > 1 else (rank,)
    return tp, tuple(dist.get_process_group_ranks(engine.seq_data_parallel_group))


def zero_pieces(engine, named, local_of, *, partitioned: bool, tp_rank: int) -> list[Piece]:
    """tensor_norms.Piece of each (name, parameter) in `named`: `local_of(p)`, this rank's piece of a tensor of p (None:
    none here), counted on one rank of those that hold it alike — a tensor AutoTP leaves whole on TP rank 0 only (as
    DeepSpeed's own norm counts it), and a whole tensor (not `partitioned` over DP, as ZeRO-1/2's gradient fragments,
    ZeRO-3's partitions and ZeRO-1/2's master fragments are) on the first rank of the DP group that holds it (AutoEP's
    experts: their expert-data-parallel group)."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    def dp_group(p):
        if hasattr(p, "_dp_group"):  # ZeRO-1/2's partitioned groups (the experts' own)
            return p._dp_group
        return groups._get_expert_data_parallel_group(p.group_name) if is_moe_param(p) else \
            engine.seq_data_parallel_group

    pieces = []
    for name, p in named:
        t = local_of(p)
        counted = t is not None and (is_model_parallel_parameter(p) or tp_rank == 0) and (
            partitioned or dist.get_rank(dp_group(p)) == 0)
        pieces.append(Piece(name, t, counted))
    return pieces


def full_fragments(params, keys) -> dict[int, dict]:
    """ZeRO-1/2's flat fragments — the fp32 master (key None) and each optimizer state in `keys` — of every parameter of
    `params`, gathered to its full size over its DP group, in one all_reduce per DP group: what DeepSpeed's
    safe_get_full_fp32_param and safe_get_full_optimizer_state return for one tensor each (a zero buffer of its
    size, this rank's fragment at its offset, an all_reduce over the DP group: exact, every element comes from one
    rank), for all of them at once. One collective per tensor cost a run with ZeRO-1 about 200 of them for each state
    the teacher-forced check gathers. {id(parameter): {key: its full tensor}}, views of the buffer. Collective."""
    import torch.distributed as dist

    groups: dict[int, tuple] = {}
    for p in params:  # in one order on every rank: each rank of a DP group reduces its buffers in the same order
        if hasattr(p, "_hp_mapping"):
            groups.setdefault(id(p._dp_group), (p._dp_group, []))[1].append(p)
    full = {}
    for group, members in groups.values():
        total = sum(p.numel() for p in members)
        buffer = torch.zeros(len(keys) * total, dtype=torch.float32, device=members[0].device)
        offset = 0
        for p in members:
            mapping = p._hp_mapping  # None: no fragment of it in this rank's partition
            for k, key in enumerate(keys):
                if mapping is not None:
                    address = mapping.lp_fragment_address
                    buffer.narrow(0, k * total + offset + address.start, address.numel).copy_(
                        mapping.get_hp_fragment(key).data.flatten())
            offset += p.numel()
        dist.all_reduce(buffer, group=group)
        offset = 0
        for p in members:
            full[id(p)] = {key: buffer.narrow(0, k * total + offset, p.numel()).view(p.shape)
                           for k, key in enumerate(keys)}
            offset += p.numel()
    return full


def full_masters(engine, zero_stage: int, gather, local_of) -> dict[str, torch.Tensor]:
    """The master weights, what the optimizer updates, as full fp32 CPU tensors by name: ZeRO-1/2's fragments gathered
    over DP in one collective (full_fragments), ZeRO-3's partitions by DeepSpeed (safe_get_full_fp32_param), ZeRO-0's
    whole ones (`local_of`: local_master's reading of the engine's policy). `gather(read)`: {name: full tensor} of
    `read(p)` — this rank's shard of each parameter's tensor — over the layers a strategy shards (TP, EP) or as they are
    (gathers.full_tensors). The DeepSpeed strategy and the recorder of a user's engine read them so. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    if zero_stage == 0:
        return gather(or_frozen(local_of, zero_stage))
    if zero_stage == 3:
        return gather(or_frozen(safe_get_full_fp32_param, zero_stage))
    fragments = full_fragments(list(engine.module.parameters()), (None,))
    return gather(or_frozen(lambda p: fragments[id(p)][None], zero_stage))


def or_frozen(read, zero_stage: int):
    """`read` for a trainable parameter; a frozen one (LoRA's base), which has no master and no optimizer state, read
    as the module holds it: whole under ZeRO 0–2, its ZeRO-3 partitions gathered (GatheredParameters, a collective of
    the DP group: every rank reads the same parameters in one order)."""
    def reading(p):
        if p.requires_grad:
            return read(p)
        if zero_stage < 3:
            return p.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
    return reading


def trained_only(read):
    """`read` for a trainable parameter, None for a frozen one (gathers.full_tensors leaves it out): the optimizer's
    state of the parameters it steps."""
    return lambda p: read(p) if p.requires_grad else None


def full_moments(engine, zero_stage: int, gather, local_of) -> tuple[dict, int]:
    """AdamW's moments gathered as full_masters gathers the master weights — ({name: {"exp_avg", "exp_avg_sq"}}, the
    optimizer's step count), ({}, 0) before its first step: ZeRO-1/2's fragments in one collective (full_fragments),
    ZeRO-3's by DeepSpeed's safe_get_full_optimizer_state, ZeRO-0's optimizer's own state of each master. Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    counts = {int(v["step"]) for v in inner.state.values() if "step" in v}
    if not counts:  # before the first step (ZeRO-3 holds empty entries then)
        return {}, 0
    link_moments(engine.optimizer)
    # DeepSpeed's FusedAdam counts a group's steps on its last parameter's state (it hands the kernel that count; the
    # others keep 0): its count is the largest, where every torch optimizer's are one
    (count,) = {max(counts)} if type(inner).__name__ == "FusedAdam" else counts
    if zero_stage in (1, 2):
        fragments = full_fragments([p for p in engine.module.parameters() if p.requires_grad], ADAMW_MOMENTS)
        by_key = {key: gather(trained_only(lambda p, key=key: fragments[id(p)][key])) for key in ADAMW_MOMENTS}
    elif zero_stage == 0:
        by_key = {key: gather(trained_only(lambda p, key=key: inner.state[local_of(p)][key])) for key in ADAMW_MOMENTS}
    else:
        by_key = {key: gather(trained_only(lambda p, key=key: safe_get_full_optimizer_state(p, key)))
                  for key in ADAMW_MOMENTS}
    names = by_key[ADAMW_MOMENTS[0]]
    return {name: {key: by_key[key][name] for key in ADAMW_MOMENTS} for name in names}, count


def link_moments(zero_optimizer) -> None:
    """Each parameter's fragment linked to AdamW's state with DeepSpeed's own linkage, every parameter group's.
    DeepSpeed links them once, at its first step, and after load_checkpoint at its next one; ZeRO-1/2 (0.19.8) do it
    inside the step of the first group (`_optimizer_step(group_no)`), before AdamW has made the later groups' state, so
    that a loop with several groups (no weight decay on biases and norms) finds no moments in theirs ("exp_avg not found
    in optimizer state fragment"). Relinked here, now that every state exists; the BF16 optimizer, which steps its
    groups at once, links them itself."""
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    groups = getattr(zero_optimizer, "bit16_groups", None)
    partitions = getattr(zero_optimizer, "single_partition_of_fp32_groups", None)
    if groups is None or partitions is None:
        link = getattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()
        return
    for params, partition in zip(groups, partitions):
        lazy_init_hp_params_optimizer_state(params, partition, zero_optimizer.optimizer.state)


def zero_replicas(engine, zero_stage: int, *, everyone: tuple[int, ...], same_shard: tuple[int, ...],
                  same_partition: tuple[int, ...], tp_size: int) -> list[Replica]:
    """What ranks hold alike under AutoTP + ZeRO (DeepSpeed 0.19.8), each with its ranks: `everyone` (the world),
    `same_shard` (the ranks of this rank's tp_rank: its DP group), `same_partition` (this rank's TP group):
    - stages 1/2: the module's parameters, whole on every rank (ZeRO all-gathers them from the master partitions
      after each step) — a TP shard on the ranks of its tp_rank, a parameter AutoTP leaves whole (norms, a
      row-parallel layer's bias) on every rank; and the master fragment (fp32; bf16 with --bf16_master_weights)
      and moments of such a whole parameter, on the TP group of their DP partition: the flat partitions of the
      ranks of a TP group hold the same parameters at the same offsets (the piece names the fragment's elements);
    - stage 3: a whole parameter's ZeRO-3 partition, master partition and moments, on the TP group of
      their DP partition (TP shards and their partitions are on no two ranks alike; at TP 1 nothing)."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import safe_get_local_fp32_param

    found = []
    for name, p in engine.module.named_parameters():
        whole = not is_model_parallel_parameter(p)
        if zero_stage == 3:
            if whole and tp_size > 1:
                found += [Replica(name, same_partition, p.ds_tensor, "ZeRO-3 partition"),
                          Replica(name, same_partition, safe_get_local_fp32_param(p), "master"),
                          *(Replica(name, same_partition, zero3_moment(p, key), key) for key in ADAMW_MOMENTS)]
            continue
        ranks = everyone if whole else same_shard
        if len(ranks) > 1:
            found.append(Replica(name, ranks, p))
        fragment = getattr(p, "_hp_mapping", None)
        if whole and tp_size > 1 and fragment is not None:
            start = fragment.lp_fragment_address.start
            piece = f"[{start}:{start + fragment.lp_fragment_address.numel}]"
            states = fragment.optim_fragment or {}
            found += [Replica(name, same_partition, fragment.hp_fragment, "master", piece),
                      *(Replica(name, same_partition, states.get(key), key, piece) for key in ADAMW_MOMENTS)]
    return found


def zero3_moment(param, key: str) -> torch.Tensor | None:
    """A ZeRO-3 parameter's partition of an AdamW moment; None before the optimizer's first step made it."""
    from deepspeed.utils import safe_get_local_optimizer_state

    try:
        return safe_get_local_optimizer_state(param, key)
    except KeyError:
        return None


def full_tensors(hf_model, read) -> dict[str, torch.Tensor]:
    """{HF name: full fp32 CPU tensor} for each parameter once (a tied weight under its first name, as
    named_parameters() gives it) that `read` reads (it returns None for one it has nothing of). `read` gathers the
    ZeRO partitions over DP and returns this rank's TP shard; the owning AutoTP layer then gathers that along its own split dim (a row-parallel bias is
    replicated and stays as it is). Collective: the same calls in the same order on every rank."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    full, seen = {}, set()
    for module_name, module in hf_model.named_modules():
        named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in named)
        read_as = [(n, read(p)) for n, p in named]  # None: nothing of it to read (a frozen tensor's moments)
        named = [(n, p) for (n, p), (_, t) in zip(named, read_as) if t is not None]
        tensors = [t.detach().clone() for _, t in read_as if t is not None]
        if named and isinstance(module, TensorParallel_Layer):
            module.gather_params(tensors)  # in the layer's own order: weight, then bias
        for (name, _), t in zip(named, tensors):
            full[f"{module_name}.{name}" if module_name else name] = t.float().cpu()
    return full
