"""The seeded-bug catalogue: copies of the strategies, each with one real bug of a known class in it — what a
calibrated verdict must FAIL. Each changes the training while the record's numbers claim the correct run's
settings (the config holds --strategy_class, and nothing else differs). The calibration study runs every entry
over several seeds and kernel paths (docs/tolerances.md has the detection rates); the tests run them through
plot_loss_curves.py as a user would.

Every class is importable by its path (parity.calibration.bugs:Name), so it runs in Ray workers and local gloo
groups alike, and it records under its strategy's name (loss_fsdp.json, loss_deepspeed.json) so that it sits
beside the DDP baseline like the strategy it is a copy of — except the DDP copy, which has a name of its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from functools import partial as _partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput

# The strategies the entries copy. DeepSpeed itself stays unimported here: autotp_strategy imports it only once a
# worker knows its device (import_deepspeed), because DeepSpeed picks its accelerator when it is imported.
from autotp_strategy import DeepSpeedStrategy
from ddp_strategy import DDPStrategy
from fsdp_strategy import FSDPStrategy, apply_expert_fsdp, mixed_precision_policy, offload_policy
from pipeline_strategy import PipelineStrategy
from parity.layer_check.layer_step import perturb_local_shard
from parity.models.families import family_of
from parity.strategies.fsdp.expert_parallel import apply_etp
from parity.strategies.fsdp.plans import apply_moe, apply_sequence_parallel, tp_plan
from parity.training.data import Batch
from parity.training.dtensor_strategy import global_norm
from parity.training.optimizer import OptimizerStep, clip_coefficient, set_lr, step_optimizer
from parity.training.loss_scaler import LossScaler, any_nonfinite
from parity.training.policy_optimizer import PolicyOptimizer

WEIGHT_DECAY = 0.01  # torch.optim.AdamW's own default: what a run gets when the setting is lost on the way
LR_FACTOR = 1.05
ADAM_BETA2 = 0.99
FAULTY_SHARD = "model.layers.1.mlp.up_proj.weight"


# --- FSDP2 + DTensor TP -------------------------------------------------------------------------------

class FSDPClippingSkipped(FSDPStrategy):
    """The pre-clip norm is computed and recorded, the gradients are never scaled."""

    def optimizer_step(self, lr: float) -> float:
        with torch.no_grad():
            norm = global_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        step_optimizer(self.optimizer, lr)
        return norm


class FSDPWeightDecayAdded(FSDPStrategy):
    """AdamW gets weight_decay 0.01 (torch's default) while the config (and so the record) says 0."""

    def setup(self, model) -> None:
        super().setup(model)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = WEIGHT_DECAY


class FSDPLearningRateOff(FSDPStrategy):
    """Every step runs at 1.05 × the scheduled learning rate (the record holds the scheduled one)."""

    def optimizer_step(self, lr: float) -> float:
        return super().optimizer_step(lr * LR_FACTOR)


class FSDPGradientsSummedOverDP(FSDPStrategy):
    """Gradients summed over the DP ranks instead of averaged: dp_size × the mean, before the norm."""

    def optimizer_step(self, lr: float) -> float:
        with torch.no_grad():
            torch._foreach_mul_([p.grad.to_local() for p in self.model.parameters() if p.grad is not None],
                                float(self.ctx.dp_size))
        return super().optimizer_step(lr)


class FSDPAdamBeta2Off(FSDPStrategy):
    """AdamW runs with beta2 0.99 while the config says 0.999."""

    def setup(self, model) -> None:
        super().setup(model)
        for group in self.optimizer.param_groups:
            group["betas"] = (group["betas"][0], ADAM_BETA2)


class FSDPShardFault(FSDPStrategy):
    """One TP shard is wrong: TP rank 0's piece of layers.1.mlp.up_proj starts 1e-3 off the shared weights (a
    shard loaded from the wrong offset, a missed broadcast), on every DP replica alike."""

    def setup(self, model) -> None:
        super().setup(model)
        perturb_local_shard(self, FAULTY_SHARD)


class FSDPTPRanksFedDifferentSlices(FSDPStrategy):
    """The data is sharded by global rank instead of DP rank: TP rank t of DP group d trains on DP group
    (d + t) mod dp's slice, so the ranks of a TP group multiply shards of different samples."""

    def train_step(self, batch, global_tokens, lr, observe=None):
        other = (self.ctx.dp_rank + self.ctx.tp_rank) % self.ctx.dp_size
        ids, labels = (self._gathered(t)[self.ctx.layout.rank(other, 0, 0)] for t in (batch.input_ids, batch.labels))
        return super().train_step(Batch(ids, labels), global_tokens, lr, observe)

    def _gathered(self, tensor):
        slices = [torch.empty_like(tensor) for _ in range(self.ctx.world_size)]
        dist.all_gather(slices, tensor.contiguous())
        return slices


class FSDPMicroBatchMeans(FSDPStrategy):
    """Gradient accumulation that averages per-micro-batch means (Hugging Face's Trainer before transformers 4.46,
    #34191): each micro-batch backpropagates its own token mean ÷ the number of micro-batches, so on padded data
    a micro-batch of few tokens weighs as much as one of many."""

    def micro_batch_loss(self, summed, micro, batch, global_tokens):
        return summed / max(micro.loss_tokens, 1) / self.cfg.grad_accum_steps


class FSDPRankMeans(FSDPStrategy):
    """The loss of a step as a mean of per-rank means: each DP rank normalises by its own loss tokens before the
    DP average, so on padded data a rank of few tokens weighs as much as one of many."""

    def micro_batch_loss(self, summed, micro, batch, global_tokens):
        return summed / max(batch.loss_tokens, 1)


def local_chunk_norm() -> PrepareModuleInputOutput:
    """An RMSNorm run on this rank's sequence chunk as a plain module (Megatron-style sequence parallelism): its
    weight stays a plain tensor, whose gradient holds only this chunk's part."""
    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                                    output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)


class FSDPSequenceParallelNormsUnreduced(FSDPStrategy):
    """--tp_plan sequence_parallel with the RMSNorm weights' gradients never summed over TP: each TP rank's norms
    learn from its own sequence chunk only (Megatron's forgotten all-reduce of the sequence-parallel norm
    gradients; in DTensor terms, a Partial gradient treated as whole). The grad norm is too low from step 0 and
    the TP ranks' copies of the norm weights drift apart."""

    def tp_plan(self):
        return tp_plan(self.family, sequence_parallel=True, norm_style=local_chunk_norm)

    def apply_tp_plan(self, model, tp_mesh) -> None:
        apply_sequence_parallel(model, tp_mesh, self.plan, norm_style=local_chunk_norm)


# --- DeepSpeed AutoTP + ZeRO --------------------------------------------------------------------------

class DeepSpeedWeightDecayAdded(DeepSpeedStrategy):
    """The client AdamW gets weight_decay 0.01 (torch's default) while the config says 0."""

    def setup(self, model) -> None:
        super().setup(model)
        for group in self.engine.optimizer.param_groups:
            group["weight_decay"] = WEIGHT_DECAY


class DeepSpeedLearningRateOff(DeepSpeedStrategy):
    """Every step runs at 1.05 × the scheduled learning rate."""

    def optimizer_step(self, lr: float) -> float:
        return super().optimizer_step(lr * LR_FACTOR)


class DeepSpeedClippingSkipped(DeepSpeedStrategy):
    """ZeRO never clips (its clip_grad is 0) while --max_grad_norm asks for clipping: a DeepSpeed config whose
    gradient_clipping disagrees with the run's — the mirror of DeepSpeed 0.19.3's default of 1.0 (#8068)."""

    def setup(self, model) -> None:
        super().setup(model)
        self.engine.optimizer.clip_grad = 0.0


class DeepSpeedWarmupIgnored(DeepSpeedStrategy):
    """The learning-rate schedule is not applied: every step runs at the peak --learning_rate (an engine that
    keeps its own lr while the harness's warm-up is recorded)."""

    def optimizer_step(self, lr: float) -> float:
        return super().optimizer_step(self.cfg.learning_rate)


# --- DDP ----------------------------------------------------------------------------------------------

class DDPTiedEmbeddingUnreduced(DDPStrategy):
    """The tied embedding / lm_head is left out of DDP's gradient all-reduce: each DP rank steps it with its own
    slice's gradient, and the replicas part (the loss is gathered, so the record shows their mean)."""

    name = "ddp_tied_embedding_unreduced"

    def setup(self, model) -> None:
        tied = [name for name, p in model.named_parameters(remove_duplicate=False)
                if p is model.get_input_embeddings().weight]  # model.embed_tokens.weight and lm_head.weight
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, tied)
        super().setup(model)


@dataclass(frozen=True)
class SeededBug:
    """One catalogue entry: a bug class, the strategy it is seeded in and how to run it."""

    name: str  # how the study and the docs name it
    strategy: str  # the registry strategy the run is resolved as
    strategy_class: type | None  # the copy with the bug; None: the real strategy with `options`
    options: dict = field(default_factory=dict)  # strategy flags of the run (a policy that is not DDP's)
    precisions: tuple = ("bf16", "fp32")  # where the bug exists (a bf16 policy has no fp32 run)
    padded: bool = False  # a bug of unequal token counts: it shows on padded data with micro-batches

    @property
    def values(self) -> dict:
        """The run's flags beyond the shared setting."""
        padded = {"dataset": "synthetic_padded", "grad_accum_steps": 2} if self.padded else {}
        return {**self.options, **padded, **({"strategy_class": self.strategy_class} if self.strategy_class else {})}


CATALOGUE = (
    SeededBug("fsdp: clipping skipped", "fsdp", FSDPClippingSkipped),
    SeededBug("fsdp: weight decay 0.01", "fsdp", FSDPWeightDecayAdded),
    SeededBug("fsdp: lr x 1.05", "fsdp", FSDPLearningRateOff),
    SeededBug("fsdp: gradients summed over DP", "fsdp", FSDPGradientsSummedOverDP),
    SeededBug("fsdp: Adam beta2 0.99", "fsdp", FSDPAdamBeta2Off),
    SeededBug("fsdp: a TP shard 1e-3 off", "fsdp", FSDPShardFault),
    SeededBug("fsdp: TP ranks fed different slices", "fsdp", FSDPTPRanksFedDifferentSlices),
    SeededBug("fsdp: micro-batch means averaged", "fsdp", FSDPMicroBatchMeans, padded=True),
    SeededBug("fsdp: a mean of per-rank means", "fsdp", FSDPRankMeans, padded=True),
    SeededBug("deepspeed: weight decay 0.01", "deepspeed", DeepSpeedWeightDecayAdded),
    SeededBug("deepspeed: lr x 1.05", "deepspeed", DeepSpeedLearningRateOff),
    SeededBug("deepspeed: clipping skipped", "deepspeed", DeepSpeedClippingSkipped),
    SeededBug("deepspeed: warm-up ignored", "deepspeed", DeepSpeedWarmupIgnored),
    SeededBug("ddp: tied embedding gradient unreduced", "ddp", DDPTiedEmbeddingUnreduced),
)
"""(DeepSpeed with bf16 master weights, once an entry here, is another precision policy — bf16_pure — and is reported
as a policy difference against an autocast baseline, not judged: docs/precision.md.)"""


# --- Pipeline (torch.distributed.pipelining) ----------------------------------------------------------


class PipelineTiedGradientsNotSummed(PipelineStrategy):
    """The classic pipeline bug: the tied embedding / lm_head lives on the first and the last stage as two copies,
    and their gradients are never summed — the first stage steps its copy with the embedding's gradient only, the
    last with lm_head's only, and the two copies of one weight part from the first step. (Not in CATALOGUE: the
    calibration study runs its entries at TP layouts a pipeline does not have; tests/test_pipeline.py runs it.)"""

    def sum_tied_gradients(self) -> None:
        pass


class PipelinePositionsOnFirstStageOnly(PipelineStrategy):
    """Packed rows' position ids handed to the first stage only: the later stages' forwards make their own, 0, 1, ...
    along the whole row, so their layers rotate each document by its offset in the row and, with no restart to find,
    attend across the documents (transformers builds its per-document mask from the position ids). The first stage
    is right; the loss is off from the first step. (Not in CATALOGUE: the calibration study's runs are not packed;
    tests/test_packing.py runs it.)"""

    def stage_kwargs(self, fed: list) -> dict:
        return super().stage_kwargs(fed) if self.has_first else {}


# --- Model families: one pitfall per architecture (FSDP2 + TP copies; tests/test_families.py runs them) -------


class FSDPHeadNormGradientsUnreduced(FSDPStrategy):
    """Qwen3's (and Gemma3's) per-head q/k norms left as plain modules under TP: each TP rank normalises its own heads
    with the replicated weight, so each rank's gradient of the weight covers its heads only and is never summed over
    TP (Megatron's "replicated parameter with a partial gradient" forgotten). The TP ranks' copies of the norm
    weights part from the first step; the grad norm is too low."""

    def tp_plan(self):
        plan = super().tp_plan()
        return _replace(plan, layer={k: v for k, v in plan.layer.items() if k not in self.family.head_norms})


class FSDPWidthNormOnLocalShard(FSDPStrategy):
    """OLMo2's full-width q/k norms applied to the head-sharded projections as each rank's own module: the weight
    sharded with the heads, the mean of squares taken over this rank's slice of the width only (code that treats the
    norm as per rank). Every rank normalises its heads by the wrong statistic: the forward differs from step 0."""

    def apply_tp_plan(self, model, tp_mesh) -> None:
        super().apply_tp_plan(model, tp_mesh)
        for layer in model.get_submodule(self.family.stack):
            for norm in self.family.width_norms:
                module = layer.get_submodule(norm)
                eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

                def on_local_slice(x, w, eps=eps):
                    x32 = x.float()
                    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

                def forward(x, m=module, f=on_local_slice):
                    last = Shard(x.ndim - 1)
                    out = local_map(f, out_placements=[last], in_placements=([last], [Shard(0)]))(x, m.weight)
                    return out if isinstance(out, DTensor) else DTensor.from_local(out, x.device_mesh, [last])

                module.forward = forward


class FSDPFusedGateUpSplitInHalves(FSDPStrategy):
    """Phi3's fused gate_up_proj sharded as one block over TP (ColwiseParallel's Shard(0)) instead of part by part:
    with tp_size 2, rank 0 holds all of gate and rank 1 all of up, so the model's chunk(2) of each rank's local output
    pairs gate rows with gate rows (rank 0) and up rows with up rows (rank 1)."""

    def tp_plan(self):
        plan = super().tp_plan()
        fused = [p.name for p in self.family.mlp_in if p.fused]
        return _replace(plan, layer={**plan.layer, **{name: ColwiseParallel() for name in fused}})


class FSDPEmbeddingScaleInBF16(FSDPStrategy):
    """Gemma's embedding scale (√hidden, a buffer transformers multiplies the embedding by, cast to the weights' dtype)
    left in bf16 by a set-up that cast the model to bf16 and only its parameters back to fp32: √48 = 6.9282 becomes
    6.9375 and every embedding is 0.13 % too large in an fp32 run."""

    def setup(self, model) -> None:
        for module in model.modules():
            if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
                module.embed_scale = module.embed_scale.to(torch.bfloat16)
        super().setup(model)


FAMILY_BUGS = {  # the tiny preset each family pitfall shows on → its seeded copy
    "qwen3-tiny": FSDPHeadNormGradientsUnreduced,
    "olmo2-tiny": FSDPWidthNormOnLocalShard,
    "phi3-tiny": FSDPFusedGateUpSplitInHalves,
    "gemma3-tiny": FSDPEmbeddingScaleInBF16,
}


# --- Replicas that part (the loop's replica check names them; not in CATALOGUE: the calibration study measures the
# curves, and these are bugs the curves see late or never — tests/test_replicas.py runs them) -----------------------

SKIPPED_PARAMETER = "model.layers.1.self_attn.k_proj.bias"  # one the loss barely feels: softmax ignores a shift
SKIPPED_STEP = 2  # shared by all keys, so its gradient is ~1e-3 of the largest (docs/tolerances.md)


class DDPReplicaSkipsAnUpdate(DDPStrategy):
    """One DP rank's replica of one parameter skips one update: at step SKIPPED_STEP, DP rank 1 steps the optimizer
    without SKIPPED_PARAMETER's gradient (AdamW passes over a parameter without one: neither it nor its moments move),
    as a rank that took another code path (a parameter unused on that rank, a gradient dropped) would. The gradient was
    reduced and counted in the norm; only that rank's copy stays behind. The loss record sees it through rank 1's loss
    alone, and rank 0's norms not at all."""

    name = "ddp_replica_skips_an_update"

    def setup(self, model) -> None:
        super().setup(model)
        skipped = dict(self.model.module.named_parameters())[SKIPPED_PARAMETER]
        steps = itertools.count()

        def drop_gradient(optimizer, args, kwargs) -> None:
            if next(steps) == SKIPPED_STEP and self.ctx.dp_rank == 1:
                skipped.grad = None

        self.optimizer.register_step_pre_hook(drop_gradient)


class DeepSpeedClippedWithRankLocalNorm(DeepSpeedStrategy):
    """Clipping by a rank-local norm (the DeepSpeed #1801 class: BF16_Optimizer's TP-replicated layer norms of
    BLOOM-176B): ZeRO clips each rank's fp32 gradient partition by the norm of that partition alone, never summed over
    the DP and TP ranks, while the recorded pre-clip norm is still the global one. With clipping active every rank scales
    by its own factor, so the copies of a parameter AutoTP leaves whole (the RMSNorms) are stepped differently on the
    ranks of a TP group — and AdamW, nearly blind to a gradient's scale, hides it from the loss."""

    def setup(self, model) -> None:
        super().setup(model)
        zero = self.engine.optimizer
        clip = zero.unscale_and_clip_grads

        def clip_by_local_norm(grad_groups_flat, total_norm):
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grad_groups_flat]))
            return clip(grad_groups_flat, local.to(total_norm.device) if torch.is_tensor(total_norm) else float(local))

        zero.unscale_and_clip_grads = clip_by_local_norm


# --- Precision policies (parity/training/policy_optimizer.py): the master copy, the accumulation, fp16's scaler -------
# Copies of DDP, whose shared PolicyOptimizer is what a strategy of plain tensors uses; each bug is one real
# implementations had. tests/test_precision.py runs them against DDP in the same policy.


class DDPLastMicroBatchUnreduced(DDPStrategy):
    """Micro-batches accumulated in fp32 master gradients, the last one's gradient never averaged over DP: it is added
    to the accumulator after the reduction, so it counts with this rank's own gradient only (DeepSpeed 0.18.6–0.18.10's
    BF16 optimizer under ZeRO-1, deepspeedai/DeepSpeed#7985: allreduce_gradients ran before backward_epilogue)."""

    name = "ddp_last_micro_batch_unreduced"

    def accumulating(self, last: bool):
        return self.model.no_sync() if last else super().accumulating(last)


class KeptLowPrecisionGradients(PolicyOptimizer):
    """Drops the master gradients after a step but not the low-precision parameters' own: the next backward adds into
    them (DeepSpeed 0.17.6–0.18.5 with ZeRO-0, bf16 and a torch optimizer, deepspeedai/DeepSpeed#7837)."""

    def zero_grad(self) -> None:
        for m in self.masters or []:
            m.grad = None


class DDPGradientsNotZeroed(DDPStrategy):
    """Gradients not zeroed between steps: each step's gradient holds every earlier step's too."""

    name = "ddp_gradients_not_zeroed"
    policy_optimizer_class = KeptLowPrecisionGradients


class ClippedScaled(PolicyOptimizer):
    """fp16's loss scale removed after clipping instead of before (fp16, fp16_autocast): the clip coefficient is
    computed from the scaled gradients' norm (scale × the true norm), so every step clips by 1/scale too much — the
    recorded norm is the true one (unscaled by the scale, as the code meant). torch's AMP recipe written as its docs
    warn not to: clip_grad_norm_ before scaler.unscale_."""

    def step(self, lr, norm_of, counted=None, before_norm=None):
        scale = self.loss_scale
        for p, m in zip(self.params, self.master_parameters()):  # the parameters themselves in fp16_autocast
            m.grad = p.grad.float()
        grads = [m.grad for m in self.master_parameters()]
        if self.scaler.unscale_or_skip([g.clone() for g in grads], grads[0].device):
            self.zero_grad()
            return OptimizerStep(float("inf"), skipped=True, loss_scale=scale)
        if before_norm is not None:
            before_norm()  # the tensor record reads them where the norm is taken: still scaled
        scaled_norm = norm_of(grads)
        torch._foreach_mul_(grads, clip_coefficient(scaled_norm, self.cfg) / scale)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        for p, m in zip(self.params, self.master_parameters()):
            p.data.copy_(m)
        self.zero_grad()
        return OptimizerStep(scaled_norm / scale, loss_scale=scale)


class DDPLossScaleKeptForClipping(DDPStrategy):
    """fp16: the loss scale removed after clipping (ClippedScaled)."""

    name = "ddp_loss_scale_kept_for_clipping"
    policy_optimizer_class = ClippedScaled


class AppliedOverflow(PolicyOptimizer):
    """fp16: an overflowing step's scale is lowered, and the step applied anyway with its non-finite gradients: the
    weights become NaN, and the record says the step was applied."""

    def step(self, lr, norm_of, counted=None, before_norm=None):
        scaler, self.scaler = self.scaler, None  # step as if no scaler: unscaled by hand, never skipped
        scale = scaler.scale
        try:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(scale)
            done = super().step(lr, norm_of, counted, before_norm)
        finally:
            self.scaler = scaler
        grads_finite = all(bool(torch.isfinite(p).all()) for p in self.master_parameters())
        scaler.update(not grads_finite)
        return OptimizerStep(done.norm, loss_scale=scale)


class DDPOverflowApplied(DDPStrategy):
    """fp16: an overflow step applied instead of skipped (AppliedOverflow)."""

    name = "ddp_overflow_applied"
    policy_optimizer_class = AppliedOverflow


class ScaleUpdatedFirst(LossScaler):
    """fp16: the scale updated before the gradients are unscaled, so that on each step where it grows they are divided by
    the new, doubled scale — half the gradients, at every loss-scale change — while the recorded pre-clip norm is
    unscaled by the old one. DeepSpeed 0.19.8's ZeRO-1/2 step does this (stage_1_and_2.py: _update_scale, then
    unscale_and_clip_grads by self.loss_scale; tests/test_precision.py catches it there, on a CPU with fp16 kernels)."""

    def unscale_or_skip(self, grads, device) -> bool:
        overflow = any_nonfinite(grads, device, collective=self.collective)
        self.update(overflow)
        if not overflow:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        return overflow


class DDPScaleUpdatedBeforeUnscaling(DDPStrategy):
    """fp16: the loss scale updated before unscaling (ScaleUpdatedFirst): a late bug, at each scale growth."""

    name = "ddp_scale_updated_before_unscaling"

    def setup(self, model):
        super().setup(model)
        self.policy_optimizer.scaler = ScaleUpdatedFirst(**self.cfg.loss_scaling)


# --- Mixture of experts: the silent bugs of expert parallelism (tests/test_moe.py runs them) -----------------------


class DDPRouterGradientsUnreduced(DDPStrategy):
    """The routers are left out of DDP's gradient all-reduce (a module kept out of the reducer as "replicated"): each
    DP rank steps its router with its own slice's gradient, and the router weights part rank by rank — routing, and so
    the experts each rank trains, drift apart while the loss looks plausible."""

    name = "ddp_router_unreduced"

    def setup(self, model) -> None:
        family = family_of(model.config)
        routers = [f"{family.stack}.{i}.{family.moe.router}.{name}" for i in family.moe.layers
                   for name, _ in model.get_submodule(f"{family.stack}.{i}.{family.moe.router}").named_parameters()]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, routers)
        super().setup(model)


class FSDPAuxStatisticsPerRank(FSDPStrategy):
    """The load-balancing loss's statistics (each expert's token fraction and mean router probability) taken over each
    DP rank's own tokens instead of the global batch — transformers' own forward does this on the batch it is given:
    the loss becomes a mean of per-rank products, not the product of the batch's means."""

    def batch_routing_totals(self, local):
        return local.detach().double() * self.ctx.dp_size  # this rank's statistic stands for the whole batch's


class FSDPExpertGradientsScaledByEP(FSDPStrategy):
    """The experts' gradients averaged over the ranks holding the same experts (FSDP2's default) instead of summed ÷
    dp_size: every token reached one copy of its experts, so the average is ep_size ÷ tp_size × DDP's gradient."""

    def apply_expert_fsdp(self, model) -> None:
        apply_expert_fsdp(model, self.ep_mesh, self.ctx.dp_size, mixed_precision_policy(self.cfg),
                          offload_policy(self.cfg), divide_factor=self.ep_mesh["efsdp"].size())


class FSDPFusedExpertGateUpSplitInHalves(FSDPStrategy):
    """Under expert tensor parallelism (--ep_size 1, --tp_size 2) every expert's fused gate_up_proj [E, 2I, H] split
    over TP as one block (Shard(1)) instead of part by part: TP rank 0 holds all of every expert's gate and rank 1 all
    of its up, so the experts' own chunk(2) pairs gate rows with gate rows (rank 0) and up rows with up rows (rank 1)."""

    def apply_experts_plan(self, model, mesh) -> None:
        apply_moe(model, mesh, self.ep_mesh, mesh["tp"], etp=_partial(apply_etp, placement=lambda dim, parts: Shard(dim)))


MOE_BUGS = {  # the seeded bug → its strategy copy
    "router gradients not all-reduced over DP": DDPRouterGradientsUnreduced,
    "aux-loss statistics per rank": FSDPAuxStatisticsPerRank,
    "expert gradients scaled by EP": FSDPExpertGradientsScaledByEP,
    "fused gate_up split in two halves across ranks": FSDPFusedExpertGateUpSplitInHalves,
}
