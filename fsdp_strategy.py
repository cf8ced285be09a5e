"""FSDP2 + DTensor tensor parallelism: a 2-D ("dp", "tp") device mesh, Megatron-style TP inside each
decoder layer, FSDP2 sharding (and gradient averaging) over "dp".

Only the parts that differ between strategies are here: the mesh, the FSDP wrapping, the precision policy in FSDP2's
terms and gathering the plan's local module outputs back to full size; the TP plan of each model family and the
experts' plans are its helpers' (parity/strategies/fsdp/: plans.py, expert_parallel.py); what every DTensor strategy
shares (norms and clipping across meshes, fp16's loss scaler, full tensors, checkpoints through
torch.distributed.checkpoint) is parity/training/dtensor_strategy.py.
"""

from __future__ import annotations

import logging

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from parity.errors import ConfigError
from parity.models.families import family_of
from parity.precision import DTYPES, POLICIES, PolicyRequest, policy_of
from parity.strategies.fsdp.plans import (TPPlan, apply_moe, apply_sequence_parallel, apply_tp, local_output_of,
                                         tp_plan)
from parity.training.dtensor_strategy import DTensorStrategy
from parity.training.loss_scaler import scaler_of
from parity.training.memory import OFFLOAD
from parity.training.policy_optimizer import cast_parameters
from parity.training.strategy import Option, build_named_optimizer

MIXED_PRECISION = ("autocast", "policy")  # the flag's values from before the precision axis (precision_request)
TP_PLANS = ("default", "sequence_parallel")


def apply_ac(model) -> None:
    """Activation checkpointing per decoder layer with torch's composable checkpoint: like fully_shard it adds
    hooks to the module instead of wrapping it, so the modules keep their Hugging Face names; after TP (the
    recomputed forward is the sharded one), before FSDP (torchtitan's order)."""
    from torch.distributed._composable import checkpoint

    for layer in model.get_submodule(family_of(model.config).stack):
        checkpoint(layer)


def apply_compile(model) -> None:
    """torch.compile each decoder layer in place (the module keeps its name; FSDP2's hooks stay outside the
    compiled forward), after TP and activation checkpointing, before FSDP (torchtitan's order)."""
    for layer in model.get_submodule(family_of(model.config).stack):
        layer.compile()


def apply_fsdp(model, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy) -> None:
    """FSDP2 over "dp": one group per decoder layer, then the root.

    fully_shard is what synchronises gradients across DP ranks (TP alone leaves each DP replica
    training on its own slice): gradients are reduce-scattered with an average over dp, which is the
    global-batch mean because every DP rank has the same number of loss tokens. Per-layer groups let
    one layer's parameters be gathered while another computes. The root group takes what is left —
    the tied embedding / lm_head (one Parameter: tied weights must sit in one group) and the final
    norm. TP'd parameters become 2-D DTensors on the ("dp", "tp") mesh, the rest 1-D DTensors on "dp".
    """
    kwargs = {"mp_policy": mp_policy, "offload_policy": offload_policy, "shard_placement_fn": fsdp_shard_dim}
    for layer in model.get_submodule(family_of(model.config).stack):
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)


def apply_expert_fsdp(model, ep_mesh: DeviceMesh, dp_size: int, mp_policy, offload_policy,
                      divide_factor: float | None = None) -> None:
    """Under expert parallelism each experts module is its own FSDP2 group over "efsdp", the ranks holding the same
    experts (before the layers' groups, which then leave its parameters alone). Their gradients are summed over efsdp
    and divided by `divide_factor`, dp_size: each token reached one copy of its experts (expert_parallel.py). gloo has
    no PREMUL_SUM, with which FSDP2 divides by a factor other than the group's size: it sums and divides locally."""
    family = family_of(model.config)
    stack = model.get_submodule(family.stack)
    efsdp = ep_mesh["efsdp"]
    for i in family.moe.layers:
        experts = stack[i].get_submodule(family.moe.experts)
        fully_shard(experts, mesh=efsdp, mp_policy=mp_policy, offload_policy=offload_policy)
        experts.set_gradient_divide_factor(float(divide_factor or dp_size))
        if efsdp.size() > 1:  # one rank: no reduction, FSDP2 divides by the factor itself
            experts.set_force_sum_reduction_for_comms(True)


def fsdp_shard_dim(param) -> Shard | None:
    """The dim FSDP2 shards a parameter over dp: its default (dim 0), but dim 1 for a packed TP parameter (a
    _StridedShard of dim 0: PackedColwiseParallel). Sharded over dp on the same dim, FSDP2 (torch 2.13) records a
    layout that does not describe the rows it holds: training is right (FSDP2 gathers its own chunks back), but
    full_tensor() and torch.distributed.checkpoint put the rows in the wrong order — measured: Phi3's gate_up_proj
    came back with gate and up rows interleaved by TP rank, 0.13 off in the final checkpoint. On dim 1 the two
    shardings are independent."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def offload_policy(cfg) -> OffloadPolicy:
    """--offload cpu: FSDP2 keeps the parameter shards, their gradients and so Adam's state in host memory,
    copies each group's shards to the device to all-gather them, and the optimizer steps on the CPU.
    Pinned host memory (faster copies) needs CUDA: CPUOffloadPolicy's default pin_memory=True fails on a CPU
    worker ("Cannot access accelerator device when none is available")."""
    if cfg.options["offload"] == "cpu":
        return CPUOffloadPolicy(pin_memory=cfg.use_cuda)
    return OffloadPolicy()


def mixed_precision_policy(cfg) -> MixedPrecisionPolicy:
    """The run's precision policy in FSDP2's terms. bf16_params and fp16: the sharded parameters stay fp32 (they are the
    master weights the shared AdamW steps, with its state in fp32); FSDP2 casts them to bf16 / fp16 when it all-gathers
    them, the whole module computes in that dtype, and gradients are reduce-scattered in --reduce_dtype (the gradients'
    own by default) into fp32 shards — accumulating micro-batches in that reduce dtype. bf16_pure: no policy, the
    shards themselves are bf16 (setup casts them). fp32 and bf16 (autocast): fp32 parameters, and the reduction in
    --reduce_dtype."""
    policy = policy_of(cfg)
    if policy.master_copy or cfg.reduce_dtype != policy.params:
        return MixedPrecisionPolicy(param_dtype=DTYPES[policy.params], reduce_dtype=DTYPES[cfg.reduce_dtype])
    return MixedPrecisionPolicy()


class FSDPStrategy(DTensorStrategy):
    name = "fsdp"
    options = (
        Option("mixed_precision", None, type=str, choices=MIXED_PRECISION,
               help="kept from before --precision had its policies: policy = --precision bf16_params with fp32 "
                    "reduction (FSDP2's MixedPrecisionPolicy(bf16, fp32), what it meant), autocast = --precision bf16"),
        Option("param_dtype", None, type=str, choices=("fp32", "bf16"),
               help="kept from before --precision had its policies: bf16 = --mixed_precision policy"),
        Option("tp_plan", "default", choices=TP_PLANS,
               help="the TP plan: default (Megatron-style TP inside each decoder layer, the residual stream "
                    "replicated) or sequence_parallel (also the residual stream and the RMSNorms sharded over the "
                    "sequence between the TP regions, as torchtitan's plan); with --tp_size > 1"),
        Option("offload", "none", choices=OFFLOAD,
               help="cpu: FSDP2's CPUOffloadPolicy — parameter shards, gradients and optimizer state in host "
                    "memory, the optimizer step on the CPU"),
    )
    zero_stage = 3  # full sharding: parameters, gradients and optimizer state all divided over dp
    precisions = tuple(name for name, policy in POLICIES.items() if not policy.frozen_apart)  # casts all alike
    expert_parallel = True
    # LoRA: FSDP2 shards the frozen base with the rest and reduces only the adapters' gradients; the TP plan places each
    # adapter beside the projection it wraps (plans.adapter_rules)
    takes_adapters = True
    replays_records = True  # fully sharded, no TP: train_fsdp.py --replay_record (the sharded replay, replay_choice.py)
    clips_as_torch = True  # clip_sharded_gradients: torch's own over its DTensors, as an FSDP2 loop does (one mesh: no TP)
    follows_loss_scales = True  # its own scaler_of in setup

    @classmethod
    def precision_request(cls, options: dict):
        """--mixed_precision / --param_dtype, as they were before the policy axis: policy (or --param_dtype bf16) is
        bf16_params reducing in fp32 by default (FSDP2's MixedPrecisionPolicy(bf16, fp32)); autocast only said how bf16
        applies — the bf16 policy itself — and asks for nothing (validate refuses it beside another low precision)."""
        mode, param = options["mixed_precision"], options["param_dtype"]
        if mode == "autocast" and param == "bf16" or mode == "policy" and param == "fp32":
            raise ConfigError(f"--mixed_precision {mode} with --param_dtype {param}: the two name different policies: "
                              f"use --precision bf16_params (bf16 parameters) or --precision bf16 (autocast)")
        if mode == "policy" or param == "bf16":
            flag = "--mixed_precision policy" if mode == "policy" else "--param_dtype bf16"
            return PolicyRequest(flag, "bf16_params", reduce_dtype="fp32", soft=True)
        return None

    @classmethod
    def validate(cls, settings, model_config) -> None:
        policy = POLICIES[settings.precision]
        if settings.options["mixed_precision"] == "autocast" and policy.params != "fp32":
            raise ConfigError(f"--mixed_precision autocast is the bf16 policy (autocast over fp32 parameters) but "
                              f"--precision is {settings.precision}: drop --mixed_precision")
        if settings.grad_accum_steps > 1 and policy.master_copy and settings.grad_accum_dtype != settings.reduce_dtype:
            raise ConfigError(f"--grad_accum_dtype {settings.grad_accum_dtype} with --reduce_dtype "
                              f"{settings.reduce_dtype}: FSDP2 accumulates micro-batch gradients in the dtype it "
                              f"reduces them in: pass --grad_accum_dtype {settings.reduce_dtype}")
        family_of(model_config).check_tp(settings.tp_size, "FSDP2 + TP")
        if settings.lora and settings.options["tp_plan"] == "sequence_parallel":
            raise ConfigError("LoRA with --tp_plan sequence_parallel: a rowwise projection's output is left sharded over "
                              "the sequence, which its adapters' whole output cannot be added to: use --tp_plan default")
        if settings.activation_checkpointing and settings.compile:
            raise ConfigError("--activation_checkpointing with --compile: torch's composable checkpoint finds the compiled "
                              "layers' recomputed tensors changed (torch.utils.checkpoint.CheckpointError, pytorch#166926): "
                              "use one of the two")
        if settings.options["tp_plan"] == "sequence_parallel":
            if family_of(model_config).moe:
                raise ConfigError("--tp_plan sequence_parallel does not shard a mixture of experts' sparse blocks over "
                                  "the sequence: use --tp_plan default (the experts take the TP ranks' token slices)")
            if settings.tp_size < 2:
                raise ConfigError(f"--tp_plan sequence_parallel shards the sequence over the TP ranks but --tp_size is "
                                  f"{settings.tp_size}: use --tp_size 2 or more")
            if settings.seq_length % settings.tp_size:
                raise ConfigError(f"--tp_plan sequence_parallel splits the sequence into --tp_size {settings.tp_size} "
                                  f"chunks: --seq_length {settings.seq_length} must be a multiple of it")

    def setup(self, model) -> None:
        # Every full_tensor() of a 2-D DTensor logs that it runs one collective per mesh dim; expected here.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        mesh = init_device_mesh(self.ctx.device.type, self.ctx.layout.mesh_shape, mesh_dim_names=("dp", "tp"))
        # The data slice is chosen by ctx.dp_rank, so the mesh must place ranks as the layout does.
        assert (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) == (self.ctx.dp_rank, self.ctx.tp_rank)
        model.to(self.ctx.device)
        if not policy_of(self.cfg).master_copy:  # bf16_pure: the parameters themselves in bf16 (fp32, bf16: fp32)
            cast_parameters(model, self.cfg)
        self.family = family_of(model.config)
        self.plan = self.tp_plan()
        if self.ctx.tp_size > 1:  # with tp_size 1 this is pure FSDP2 on the 1-D "dp" sub-mesh
            self.apply_tp_plan(model, mesh["tp"])
        self.ep_mesh = self.expert_mesh()
        if self.family.moe and (self.ep_mesh is not None or self.ctx.tp_size > 1):
            self.apply_experts_plan(model, mesh)
        if self.cfg.activation_checkpointing:
            apply_ac(model)
        if self.cfg.compile:
            apply_compile(model)
        if self.ep_mesh is not None:
            self.apply_expert_fsdp(model)
        apply_fsdp(model, mesh["dp"], mixed_precision_policy(self.cfg), offload_policy(self.cfg))
        self.mesh, self.tp_mesh = mesh, mesh["tp"]
        self.model = model
        self.optimizer = build_named_optimizer(model, self.cfg)
        self.scaler = scaler_of(self.cfg) if policy_of(self.cfg).loss_scaling or self.cfg.loss_scales else None

    def expert_mesh(self) -> DeviceMesh | None:
        """With --ep_size E > 1: the ("efsdp", "ep") mesh over the same ranks, rank = efsdp_rank × E + ep_rank — an EP
        group is E consecutive ranks (whole TP groups: E is a multiple of tp_size), efsdp the ranks holding the same
        experts. None without EP."""
        if self.ctx.ep_size == 1:
            return None
        return init_device_mesh(self.ctx.device.type, self.ctx.layout.expert_mesh_shape, mesh_dim_names=("efsdp", "ep"))

    def apply_experts_plan(self, model, mesh: DeviceMesh) -> None:
        """The experts over "ep", or within each expert over "tp" (a test copy with a bug in it overrides this)."""
        apply_moe(model, mesh, self.ep_mesh, mesh["tp"])

    def apply_expert_fsdp(self, model) -> None:
        """The experts' FSDP2 groups over "efsdp" (a test copy with a bug in it overrides this)."""
        apply_expert_fsdp(model, self.ep_mesh, self.ctx.dp_size, mixed_precision_policy(self.cfg),
                          offload_policy(self.cfg))

    @property
    def sequence_parallel(self) -> bool:
        return self.cfg.options["tp_plan"] == "sequence_parallel"

    def tp_plan(self) -> TPPlan:
        """The model family's TP plan under --tp_plan (a test copy with a bug in its plan overrides this)."""
        return tp_plan(self.family, self.sequence_parallel)

    def apply_tp_plan(self, model, tp_mesh: DeviceMesh) -> None:
        """The plan's TP over the "tp" mesh."""
        (apply_sequence_parallel if self.sequence_parallel else apply_tp)(model, tp_mesh, self.plan)

    def local_output(self, module_name: str) -> tuple[int, int] | None:
        """The plan's local outputs: of the last dim (colwise projections, the activation on gate's shard), of the
        heads dim (per-head norms), or of every part of a packed output."""
        stack = self.family.stack + "."
        if self.ctx.tp_size == 1 or not module_name.startswith(stack):
            return None
        return local_output_of(self.plan, module_name[len(stack):].split(".", 1)[-1])
