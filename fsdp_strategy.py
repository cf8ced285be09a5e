"""FSDP2 + DTensor tensor parallelism: a 2-D ("dp", "tp") device mesh, Megatron-style TP inside each
decoder layer, FSDP2 sharding (and gradient averaging) over "dp".

Only the parts that differ between strategies are here: the mesh, the TP plan, the FSDP wrapping, the
precision policy in FSDP2's terms, clipping across the two meshes the parameters end up on, gathering DTensor
shards back to full size under Hugging Face names, and checkpoints through torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from parity.errors import ConfigError
from parity.training.loss_scaler import LossScaler
from parity.training.memory import GATHERED, GRADS, PARAMS, StateLedger
from parity.training.precision import DTYPES, POLICIES, OptimizerStep, PolicyRequest, cast_parameters, policy_of
from parity.training.strategy import Option, Strategy, build_optimizer, clip_coefficient, squared_norm_fp64, step_optimizer

MIXED_PRECISION = ("autocast", "policy")  # the flag's values from before the precision axis (precision_request)
OFFLOAD = ("none", "cpu")
# Per decoder layer: the projections that read the replicated residual stream are split by output
# columns, the ones that write back to it by input rows (so each block needs one all-reduce).
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
# Modules whose outputs stay local shards along the last dim: the colwise ones, and the MLP's activation
# (applied to gate_proj's shard before up_proj's shard multiplies it).
SHARDED_OUTPUTS = COLWISE + ("mlp.act_fn",)
TP_PLANS = ("default", "sequence_parallel")
SCALER_FILE = "loss_scaler.pt"  # fp16: the loss scaler's state (rank 0's)
DCP_DIR = "dcp"  # the checkpoint's torch.distributed.checkpoint folder: a shard file per rank, rank 0's .metadata


def apply_tp(model, tp_mesh: DeviceMesh) -> None:
    """Tensor-parallelise each decoder layer; leave embedding, lm_head and norms replicated over tp.

    ColwiseParallel shards q/k/v and gate/up weights (and the q/k/v biases) by rows and returns the
    output as a *local* tensor, sharded along its last dim. HF Qwen2 attention reshapes with
    view(..., -1, head_dim), so each rank simply sees heads/tp query heads and kv_heads/tp KV heads
    — the GQA ratio is unchanged and contiguous head blocks keep each query head with its KV head
    (tp_size divides the KV-head count, checked before launch); no attention code is patched.
    RowwiseParallel o/down take that local shard and all-reduce their partial sums into a replicated
    output, so the residual stream, RMSNorms and logits are the same full tensors on every TP rank.

    The tied embedding / lm_head is not split: a vocab-parallel pair would need a manual re-tie
    (parallelize_module gives each module its own new Parameter) and a vocab-parallel loss, while a
    replicated one keeps the tie as one Parameter and computes exactly DDP's logits.
    """
    plan = {**{name: ColwiseParallel() for name in COLWISE}, **{name: RowwiseParallel() for name in ROWWISE}}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


def apply_sequence_parallel(model, tp_mesh: DeviceMesh, norm_style=SequenceParallel) -> None:
    """--tp_plan sequence_parallel: the default plan, plus the residual stream and the RMSNorms sharded over the
    sequence between the TP regions (torchtitan's plan, on Hugging Face's modules).

    Layer 0 takes the replicated embedding output and keeps its own sequence chunk (Shard(1), no
    communication); each RMSNorm (SequenceParallel) normalises the chunk it holds; attention and the MLP
    all-gather the sequence before their colwise projections (PrepareModuleInput); o_proj and down_proj
    reduce-scatter their partial sums back onto sequence chunks (Shard(1) outputs) instead of all-reducing
    them. The residual stream between layers is a DTensor sharded over the sequence; the final norm runs on
    chunks too, and lm_head gathers the sequence back: the logits are DDP's full ones, the tied embedding
    stays replicated as in the default plan. Same collectives' volume as the default plan's all-reduces;
    the activations between the regions take 1/tp_size of the memory.

    The RMSNorm weights are replicated over tp but each rank's chunk gives only its part of their gradient:
    a Partial DTensor that must be summed over tp before the gradient norm and clipping (FSDP2 does it when
    it reduce-scatters over dp; clip_sharded_gradients asserts no gradient is still Partial). A norm taken
    of the local parts, or weights kept as plain tensors, is the classic bug of this plan: the copy
    parity.calibration.bugs:FSDPSequenceParallelNormsUnreduced.
    """
    layer_plan = {
        "input_layernorm": norm_style(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True),
        **{name: ColwiseParallel() for name in COLWISE},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": norm_style(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for i, layer in enumerate(model.model.layers):
        plan = dict(layer_plan)
        if i == 0:  # the embedding's full output → this rank's sequence chunk
            plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                          use_local_output=False)
        parallelize_module(layer, tp_mesh, plan)
    parallelize_module(model.model, tp_mesh, {"norm": norm_style()})
    parallelize_module(model, tp_mesh, {"lm_head": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)})


TP_APPLY = {"default": apply_tp, "sequence_parallel": apply_sequence_parallel}


def apply_ac(model) -> None:
    """Activation checkpointing per decoder layer with torch's composable checkpoint: like fully_shard it adds
    hooks to the module instead of wrapping it, so the modules keep their Hugging Face names; after TP (the
    recomputed forward is the sharded one), before FSDP (torchtitan's order)."""
    from torch.distributed._composable import checkpoint

    for layer in model.model.layers:
        checkpoint(layer)


def apply_compile(model) -> None:
    """torch.compile each decoder layer in place (the module keeps its name; FSDP2's hooks stay outside the
    compiled forward), after TP and activation checkpointing, before FSDP (torchtitan's order)."""
    for layer in model.model.layers:
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
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy)


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
    if policy.master_copy:
        return MixedPrecisionPolicy(param_dtype=DTYPES[policy.params], reduce_dtype=DTYPES[cfg.reduce_dtype])
    if cfg.reduce_dtype != policy.params:
        return MixedPrecisionPolicy(param_dtype=DTYPES[policy.params], reduce_dtype=DTYPES[cfg.reduce_dtype])
    return MixedPrecisionPolicy()


def global_norm(tensors: list[DTensor]) -> float:
    """The L2 norm of DTensors taken together (the gradients, or the parameters), whatever mesh and
    placements each one has.

    torch's clip_grad_norm_ stacks per-tensor norms, which DTensor refuses across meshes ("All operands
    in aten.stack.default must have the same mesh"): TP'd tensors live on ("dp", "tp"), the others on
    "dp". So each rank sums the squares of its local shards in float64 (the shared helper), and the sums
    are added across exactly the mesh dims a tensor is sharded over — a Partial placement there — and
    not across the ones it is replicated over, so a tensor replicated over tp is counted once.
    Tensors with the same mesh and sharded dims share one reduction; with --offload cpu the shards are in
    host memory and each sum goes to the mesh's device for it.
    """
    local_sums = defaultdict(float)
    for g in tensors:
        assert not any(p.is_partial() for p in g.placements), f"unreduced gradient: {g.placements}"
        key = (g.device_mesh, tuple(Replicate() if p.is_replicate() else Partial() for p in g.placements))
        local_sums[key] = local_sums[key] + squared_norm_fp64(g.to_local())
    return math.sqrt(sum(float(DTensor.from_local(total.to(mesh.device_type), mesh, placements).full_tensor())
                         for (mesh, placements), total in local_sums.items()))


@torch.no_grad()
def clip_sharded_gradients(params, cfg) -> float:
    """Clip DTensor gradients by their global norm (torch's formula, --max_grad_norm); return that norm.
    Scaling each rank's local shards scales the whole tensors: no communication."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = global_norm(grads)
    coef = clip_coefficient(norm, cfg)
    if coef < 1.0:
        torch._foreach_mul_([g.to_local() for g in grads], coef)
    return norm


class FSDPStrategy(Strategy):
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
    precisions = tuple(POLICIES)

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
        if settings.activation_checkpointing and settings.compile:
            raise ConfigError("--activation_checkpointing with --compile: torch's composable checkpoint finds the compiled "
                              "layers' recomputed tensors changed (torch.utils.checkpoint.CheckpointError, pytorch#166926): "
                              "use one of the two")
        if settings.options["tp_plan"] == "sequence_parallel":
            if settings.tp_size < 2:
                raise ConfigError(f"--tp_plan sequence_parallel shards the sequence over the TP ranks but --tp_size is "
                                  f"{settings.tp_size}: use --tp_size 2 or more")
            if settings.seq_length % settings.tp_size:
                raise ConfigError(f"--tp_plan sequence_parallel splits the sequence into --tp_size {settings.tp_size} "
                                  f"chunks: --seq_length {settings.seq_length} must be a multiple of it")

    def setup(self, model) -> None:
        # Every full_tensor() of a 2-D DTensor logs that it runs one collective per mesh dim; expected here.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.dp_size, self.ctx.tp_size), mesh_dim_names=("dp", "tp"))
        # The data slice is chosen by ctx.dp_rank, so the mesh must place ranks as WorkerContext does.
        assert (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) == (self.ctx.dp_rank, self.ctx.tp_rank)
        model.to(self.ctx.device)
        if not policy_of(self.cfg).master_copy:  # bf16_pure: the parameters themselves in bf16 (fp32, bf16: fp32)
            cast_parameters(model, self.cfg)
        if self.ctx.tp_size > 1:  # with tp_size 1 this is pure FSDP2 on the 1-D "dp" sub-mesh
            self.apply_tp_plan(model, mesh["tp"])
        if self.cfg.activation_checkpointing:
            apply_ac(model)
        if self.cfg.compile:
            apply_compile(model)
        apply_fsdp(model, mesh["dp"], mixed_precision_policy(self.cfg), offload_policy(self.cfg))
        self.tp_mesh = mesh["tp"]
        self.model = model
        self.optimizer = build_optimizer(model.parameters(), self.cfg)
        self.scaler = LossScaler(**self.cfg.loss_scaling) if policy_of(self.cfg).loss_scaling else None

    def apply_tp_plan(self, model, tp_mesh: DeviceMesh) -> None:
        """--tp_plan's TP over the "tp" mesh (a test copy with a bug in its plan overrides this)."""
        TP_APPLY[self.cfg.options["tp_plan"]](model, tp_mesh)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def accumulating(self, last: bool):
        """FSDP2's own way: gradients are reduce-scattered only in the last micro-batch's backward; before it
        they accumulate unsharded (set_requires_gradient_sync)."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def local_piece(self, param):
        """A DTensor parameter's local shard (its dp × tp piece), sharing its storage."""
        return param.to_local()

    def optimizer_step(self, lr: float):
        """Clip across the meshes and step; under fp16 first the harness's loss scaler (DeepSpeed's rules): an overflow
        on any rank skips the step, else the gradient shards are unscaled."""
        scale = self.loss_scale
        if self.scaler is not None:
            shards = [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]
            if self.scaler.unscale_or_skip(shards, self.ctx.device):
                self.optimizer.zero_grad(set_to_none=True)
                return OptimizerStep(float("inf"), skipped=True, loss_scale=scale)
        norm = clip_sharded_gradients(self.model.parameters(), self.cfg)
        step_optimizer(self.optimizer, lr)
        return OptimizerStep(norm, loss_scale=scale if self.scaler else None)

    def parameter_norm(self) -> float:
        return global_norm(list(self.model.parameters()))

    def model_state_bytes(self) -> dict:
        """Each parameter's local shard (its dp × tp piece: the optimizer's parameters), its gradient's, and
        Adam's state of it. In forward and backward FSDP2 registers a group's all-gathered parameters on the
        modules in place of the shards: copies, counted as gathered_params; a gradient they accumulate before
        FSDP2 reduce-scatters it is this rank's gradient, counted as one."""
        ledger = StateLedger(self.ctx.device)
        shards = [p for group in self.optimizer.param_groups for p in group["params"]]
        ledger.add_all(PARAMS, shards)
        ledger.add_all(GRADS, (p.grad for p in shards))
        ledger.add_optimizer_state(self.optimizer)
        registered = list(self.model.parameters())  # the shards again, or a group's gathered parameters
        ledger.add_all(GATHERED, registered)
        ledger.add_all(GRADS, (p.grad for p in registered))
        return ledger.result()

    @property
    def hf_model(self):
        return self.model  # fully_shard and parallelize_module change modules in place: HF names hold

    def full_module_output(self, module_name: str, output: torch.Tensor) -> torch.Tensor:
        """Colwise outputs (and their gradients) are local shards along the last dim: gathered over tp."""
        if isinstance(output, DTensor):
            return output.full_tensor()
        if self.ctx.tp_size > 1 and module_name.startswith("model.layers.") and module_name.endswith(SHARDED_OUTPUTS):
            return DTensor.from_local(output.detach(), self.tp_mesh, [Shard(output.dim() - 1)]).full_tensor()
        return output

    def full_parameters(self) -> dict[str, torch.Tensor]:
        self.model.reshard()  # a forward without backward (the final evaluation) leaves the root unsharded
        return {n: self._full(p) for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: self._full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}

    def _full(self, t: DTensor) -> torch.Tensor:
        """Gathered on the device the mesh communicates on (offloaded shards are in host memory)."""
        return t.detach().to(self.ctx.device).full_tensor().float().cpu().clone()

    def save_state(self, directory: str) -> None:
        """torch.distributed.checkpoint: each rank writes its own shards (__<rank>_0.distcp), rank 0 the
        .metadata that maps them to the full tensors."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(directory, DCP_DIR))
        if self.scaler is not None and self.ctx.rank == 0:  # every rank's scaler is the same
            torch.save(self.scaler.state_dict(), os.path.join(directory, SCALER_FILE))

    def load_state(self, directory: str) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)  # the shapes to load into
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(torch.load(os.path.join(directory, SCALER_FILE), weights_only=True))
