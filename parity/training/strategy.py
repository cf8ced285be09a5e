"""The small interface a strategy module implements, and the one train step built on it.

A strategy only wraps the model, runs backward, steps the optimizer (returning the global pre-clip
gradient norm) and knows how to gather its shards to full size. Everything else — loss function,
autocast, loss reduction across ranks — is here, once, so it cannot differ between strategies.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parity.errors import ConfigError
from parity.layout import Layout
from parity.objectives.micro_batch import Objective
from parity.precision import policy_of
from parity.training.loss import IGNORE_INDEX, loss_sum
from parity.training.optimizer import (OptimizerStep, build_named_optimizer, build_optimizer, clip_coefficient,
                                       clip_local_gradients, full_moments, local_norm, lr_at, set_lr, squared_norm_fp64,
                                       step_optimizer, trainable)
from parity.training.option import Option
from parity.training.replicas import Replica, whole_model
from parity.training.routing import Routing
from parity.training.tensor_norms import CLIPPED, Piece, local_squares, norms_of, rank0_pieces
from parity.training.update_noise import GRID
from parity.training.view import ShardedView

# The documented strategy API (docs/custom_strategy.md): what a strategy module imports from here, wherever it is
# defined — the optimizer primitives (optimizer.py), the loss (loss.py), a strategy's own flag (option.py).
__all__ = ["IGNORE_INDEX", "ModuleRecords", "Option", "OptimizerStep", "Piece", "StepStats", "Strategy", "WorkerContext",
           "build_named_optimizer", "build_optimizer", "clip_coefficient", "clip_local_gradients", "gradient_arrivals",
           "local_norm", "loss_sum", "lr_at", "set_lr", "squared_norm_fp64", "step_optimizer", "trainable"]


@dataclass(frozen=True)
class WorkerContext:
    """Where this process sits: its rank and device, in the run's layout (parity.layout.Layout, `cfg.layout`), which
    gives the degrees and this rank's place: rank = (dp_rank × pp_size + pp_rank) × tp_size + tp_rank (TP groups are
    consecutive ranks, and so are the pp_size ranks of one pipeline; pp_size 1 without one)."""

    rank: int
    device: torch.device
    layout: Layout

    world_size = property(lambda self: self.layout.world_size)
    tp_size = property(lambda self: self.layout.tp_size)
    dp_size = property(lambda self: self.layout.dp_size)
    pp_size = property(lambda self: self.layout.pp_size)
    ep_size = property(lambda self: self.layout.ep_size)
    tp_rank = property(lambda self: self.layout.coords(self.rank).tp)
    pp_rank = property(lambda self: self.layout.coords(self.rank).pp)
    dp_rank = property(lambda self: self.layout.coords(self.rank).dp)

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


@dataclass
class StepStats:
    loss: float  # mean token loss over the whole global batch, equal on all ranks
    dp_rank_losses: list[float]  # each DP rank's mean loss over its slice's loss tokens
    grad_norm: float  # global L2 norm of the gradients before clipping
    param_norm: float  # global L2 norm of the parameters after the step
    harness_s: dict  # the harness's own measurements in this step, by what: seconds (docs/benchmark.md)
    skipped: bool = False  # fp16: the step was skipped on an overflow (the parameters did not move)
    loss_scale: float | None = None  # fp16: the loss scale the step's gradients were computed with
    overflowed: bool | None = None  # a replay following an fp16 record: its gradients overflowed at the record's scale
    routing: dict | None = None  # a mixture of experts: {"aux_loss", "expert_loads"} of the global batch (routing.py)
    # each trainable tensor's pre-clip gradient norm (× clip_coef where cfg.tensor_grad is CLIPPED) and parameter norm
    # after the step, in tensor_names() order (None where the strategy does not hand over its pieces): tensor_norms.py
    tensor_grad_norms: list[float] | None = None
    tensor_param_norms: list[float] | None = None
    clip_coef: float | None = None  # where the run's series holds the clipped gradients (cfg.tensor_grad): its factor
    update_noise: list[list[float]] | None = None  # per tensor, its update_noise.tensor_tables row (the baseline's)
    # a post-training objective's quantities of the step (KL, clipped fraction, mean ratio …: Objective.quantities)
    objective: dict | None = None


@dataclass
class ModuleRecords:
    """The layer check's module tensors of one step on one rank: each module's output and its gradient for this
    rank's batch slice, by Hugging Face module name; `outputs` in forward order, `output_grads` in the order
    backward produced them."""
    outputs: dict[str, torch.Tensor]
    output_grads: dict[str, torch.Tensor]


@contextlib.contextmanager
def gradient_arrivals(model, observe: Callable[..., None]):
    """Call observe("during_backward", name) each time a parameter's gradient has been accumulated, for the
    duration of the block. A post-accumulate-grad hook runs after autograd writes `.grad` and after the hooks
    the strategy registered earlier on the same parameter (ZeRO-1/2/3 bucket and reduce from theirs; FSDP2
    runs the hooks of its sharded parameters once their gradient is reduce-scattered), and before the
    post-backward callbacks DeepSpeed reduces the remaining buckets in: it sees what a rank holds in the
    middle of backward, which the counts after backward cannot."""
    handles = [p.register_post_accumulate_grad_hook(lambda _, name=name: observe("during_backward", name))
               for name, p in model.named_parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Strategy(Routing, ShardedView):
    """Base class of every strategy: the top-level *_strategy.py modules' classes (directly, or through the DTensor
    base, parity/training/dtensor_strategy.py) and a user's own. Subclasses set `name` (the registry's) and
    `options`, and implement the abstract parts. A strategy is one view of a sharded model (parity/training/view.py):
    its names, norm, full tensors, pieces and replicas are read as a recorder's views are."""

    name = "base"
    options: tuple = ()  # the strategy's own flags (Option above), in RunConfig.options
    tensor_parallel = True  # whether it shards tensors over --tp_size (DDP and a hand-written DP do not)
    expert_parallel = False  # whether it shards a mixture of experts' experts over --ep_size
    # whether it splits the decoder layers into stages over --pp_size ranks (a layout flag only such a strategy takes,
    # parity.layout.DEFAULT_PP_SIZE when not given; `cfg.pp_size`, `ctx.pp_size`: 1 for any other)
    pipeline_parallel = False
    # whether it trains LoRA adapters on a frozen base (--lora_r: parity/models/adapters.py): its optimizer, norms and
    # pieces take the trainable parameters only, and frozen ones stay as loaded (validate refuses its layouts that
    # cannot: a TP plan that does not know the adapters' modules)
    takes_adapters = False
    replays_records = False  # whether train_<name>.py takes --replay_record: the loop a recorded run is replayed under
    # whether it trains a perturbed noise reference (RunConfig.perturb): each micro-batch's loss × the factor before
    # backward, its gradients ÷ it before the step; resolve refuses the factor to a strategy that does not
    takes_perturb = False
    # whether its step clips as torch.nn.utils.clip_grad_norm_ computes it (fp32 norms, an fp32 coefficient) for a run of
    # RunConfig.clip_arithmetic "torch" — verify_trainer's noise reference under other kernels, drawing a framework
    # loop's clip —, where it clips by a float64 norm otherwise; plan_replays asks it, and says so where it cannot. Such
    # a step clips through optimizer.clip_gradients, which also clamps a replay's clip_value (clip_grad_value_):
    # plan_replay refuses a record clipped by value to a strategy that does not
    clips_as_torch = False
    # whether its step follows a recorded fp16 run's loss scaler (RunConfig.loss_scales: each step's scale and skip,
    # loss_scaler.FollowedScaler) where a replay asks it to; plan_replay refuses an fp16 record to a strategy that does
    # not (DeepSpeed's engine decides its scales and skips itself)
    follows_loss_scales = False
    layer_check_refuses_ep = None  # why the layer check cannot compare its modules at --ep_size > 1, where it cannot
    zero_stage = 0  # the ZeRO stage whose memory bound applies (parity.training.memory.zero_bound)
    # The precision policies it carries out (parity.precision). fp32 and bf16 (autocast) need nothing of a strategy but
    # this class's autocast(); the others need the parameters, gradients, reduction and optimizer of the policy —
    # PolicyOptimizer for plain tensors — and a strategy declares them when it does that.
    precisions: tuple = ("fp32", "bf16")
    # The PolicyOptimizer (parity.training.policy_optimizer) that steps its plain-tensor parameters under the run's
    # policy, where the strategy builds one in setup (DDP, the pipeline, your own): loss_scale and replicas read it.
    policy_optimizer = None
    # Where it hands its gradients to the tensor record (tensor_norms.py, docs/tensors.md#reading-point): True where its
    # optimizer_step calls record_gradients() where it computes the norm it clips by — after its own reduction and
    # unscaling, before clipping —, so that whatever its step does to a gradient before then is judged; False (a
    # strategy that does not): they are read after backward, before optimizer_step, and its record says so.
    reads_at_clip = False
    clip_norm_dtype = "float64"  # what the norm it clips by is accumulated in ("fp32": a library's): the invariant's bound
    # whether its series also holds its optimizer's own noise (parity/training/update_noise.py), from its
    # PolicyOptimizer: the baseline's (DDP), which every comparison's update bounds read; never a noise reference's
    records_update_noise = False

    def __init__(self, cfg, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.model = None  # the wrapped model whose forward returns HF outputs with .logits
        self.step_routing: dict | None = None  # the last forward_backward's routing record (a mixture of experts)
        self.step_expert_ids: list[torch.Tensor] = []  # and per sparse layer, the experts each token of the rank went to
        self._reading = False  # whether this step's gradients are still to be handed to the tensor record (train_step)
        self._grad_squares: torch.Tensor | None = None  # and once handed: this rank's squares of them
        self.objective = Objective(getattr(cfg, "objective", None))  # the run's objective (parity/objectives)
        self.objective_stats: torch.Tensor | None = None  # its statistics summed over this rank's micro-batches

    # --- driver side ------------------------------------------------------------------------------
    @classmethod
    def with_default_options(cls, options: dict) -> dict:
        """`options` (flag name → value, some of this strategy's own flags) with the others at their defaults."""
        return {**{o.name: o.default for o in cls.options}, **options}

    @classmethod
    def layer_stages(cls, options: dict, pp_size: int) -> int:
        """The pieces the decoder layers are split into (--num_layers must be a multiple) at `pp_size` pipeline ranks:
        a pipeline's stages, 1 for a strategy without them."""
        return 1

    @classmethod
    def precision_request(cls, options: dict):
        """The precision policy this strategy's own settings ask for (a parity.precision.PolicyRequest), or
        None: `resolve` merges it with --precision and the policy flags, or refuses a contradiction in one line."""
        return None

    @classmethod
    def validate(cls, settings, model_config) -> None:
        """Raise ConfigError for input this strategy cannot run; called by `resolve` before any worker
        starts, with the flags as attributes (`settings.options`, `settings.precision`, ...). It may replace an
        option's value by what the workers need (a file's content, read here). A subclass calls it too."""
        if not cls.tensor_parallel and settings.tp_size != 1:
            raise ConfigError(f"{cls.name} does not shard tensors: --tp_size must be 1 (got {settings.tp_size})")

    # --- worker side ------------------------------------------------------------------------------
    def setup(self, model) -> None:
        """Wrap `model` (fp32, CPU, shared initial weights loaded) and build the optimizer."""
        raise NotImplementedError

    @property
    def hf_model(self):
        """The Hugging Face module tree inside the wrapper, named as in a stock model (for hooks)."""
        raise NotImplementedError

    def local_piece(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` this rank holds, as a plain tensor that aliases its storage."""
        return param

    def full_module_output(self, module_name: str, output: torch.Tensor) -> torch.Tensor:
        """A module's output (or output gradient) on this rank, at the full size a stock model produces
        for this rank's batch slice: TP shards gathered. The identity where nothing is sharded."""
        return output

    def full_module_records(self, records: ModuleRecords) -> ModuleRecords:
        """Every module's recorded tensors at full size for this rank's batch slice (full_module_output), the whole
        model's modules on every rank, in one order on every rank. Collective. A strategy whose ranks hold
        different modules (pipeline stages) gathers them here."""
        return ModuleRecords(*({name: self.full_module_output(name, t) for name, t in store.items()}
                               for store in (records.outputs, records.output_grads)))

    @property
    def state_precision(self) -> str:
        """What its model states take per parameter (memory.BYTES_PER_PARAM): the run's policy."""
        return self.cfg.precision

    @property
    def loss_scale(self) -> float:
        """What every micro-batch's loss is multiplied by before backward: fp16's loss scale where the strategy scales
        the loss itself (its PolicyOptimizer's, `self.policy_optimizer`, or scaler's), else 1 (DeepSpeed's engine scales
        its own)."""
        return self.policy_optimizer.loss_scale if self.policy_optimizer is not None else 1.0

    @property
    def current_loss_scale(self) -> float:
        """The loss scale the next step's gradients are computed with: fp16's, whoever applies it (the harness's scaler
        through loss_scale, or a library's own — DeepSpeed's engine), else 1. The teacher-forced check's reference
        step computes its gradients at it."""
        return self.loss_scale

    def autocast(self):
        """The compute-precision context of the forward pass: torch.autocast in its dtype in an autocast policy (bf16,
        fp16_autocast)."""
        policy = policy_of(self.cfg)
        if policy.autocast:
            return torch.autocast(device_type=self.ctx.device.type, dtype=policy.compute_dtype())
        return contextlib.nullcontext()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> torch.Tensor:
        """Full-vocabulary logits of this rank's slice. Without a KV cache: Hugging Face builds one in every
        forward unless told not to (config.use_cache), which a training step never reads; under --compile each
        decoder layer was compiled again for the cache's state — and with a cache, or a 2-D mask, transformers does
        not mask packed documents apart. `attention_mask`: a replayed run's left-padded rows (the data's own batches
        carry none). `position_ids`: packed or flattened rows' (--packing, --padding_free), 0 at each document's start:
        fed as they are, with no mask, so that each document attends to itself only. A strategy that overrides forward
        is handed each only where the batch carries it (logits_of), and feeds it to the model as given. `use_cache`: a
        replayed run's rows that it fed with a cache (data.Batch.use_cache), whose documents then attend to each
        other as they did in the run."""
        inputs = {"attention_mask": attention_mask, "position_ids": position_ids}
        return self.model(input_ids=input_ids, use_cache=use_cache,
                          **{k: v for k, v in inputs.items() if v is not None}).logits

    def logits_of(self, batch) -> torch.Tensor:
        """forward on a data.Batch: its ids, and its mask, position ids and cache where it carries them."""
        inputs = {"attention_mask": batch.attention_mask, "position_ids": batch.position_ids,
                  "use_cache": batch.use_cache or None}
        return self.forward(batch.input_ids, **{k: v for k, v in inputs.items() if v is not None})

    def micro_batches(self, batch) -> list:
        """The micro-batches forward_backward feeds, in order: this rank's slice `batch` in --grad_accum_steps parts,
        each flattened into one row under --padding_free (data.Batch.flattened). A strategy that splits otherwise (the
        pipeline's schedule) overrides it; the layer check reads each module's calls by it."""
        parts = batch.split(self.cfg.grad_accum_steps)
        return [micro.flattened() for micro in parts] if self.cfg.padding_free else parts

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Backward of one micro-batch's loss (`last`: the step's last micro-batch)."""
        loss.backward()

    def optimizer_step(self, lr: float) -> float | OptimizerStep:
        """Clip to --max_grad_norm, step with `lr`, zero the gradients; return the pre-clip global norm (of the unscaled
        gradients), or an OptimizerStep that also says whether an fp16 overflow skipped the step."""
        raise NotImplementedError

    def parameter_norm(self) -> float:
        """The global L2 norm of the parameters (the master weights the optimizer updates), each element
        once, accumulated in float64: a third curve beside loss and grad norm, because optimizer bugs
        (weight decay, a scaled lr) move it steadily while bf16 rounding barely does. Collective."""
        raise NotImplementedError

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size on the CPU in fp32, under Hugging Face names (a stock model's
        `named_parameters()`, so a tied lm_head appears once, as model.embed_tokens.weight). Collective:
        all ranks call it; every rank gets the tensors."""
        raise NotImplementedError

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Like full_parameters, for the gradients after backward (before clipping and the step)."""
        raise NotImplementedError

    # --- every tensor's norms (parity/training/tensor_norms.py) -----------------------------------------------
    def tensor_names(self) -> list[str] | None:
        """The trainable parameters' Hugging Face names, in one order on every rank (the whole model's, also on a rank
        that holds part of it), whose gradient and parameter norms the record holds at every step; None where this
        strategy does not hand over its pieces (the record then says so). Here for a strategy whose every rank holds
        the whole model (no tensor parallelism, no pipeline stages: DDP, a hand-written data parallelism)."""
        if self.tensor_parallel or self.ctx.pp_size > 1:
            return None
        return [n for n, p in self.hf_model.named_parameters() if p.requires_grad]

    def gradient_pieces(self) -> list[Piece]:
        """This rank's piece of each trainable tensor's gradient as it stands now — where record_gradients() is called,
        the gradients the norm it clips by is taken of; else after backward (reduced over DP, before the step; fp16:
        still at the loss scale, which the caller takes out) —, as tensor_norms.Piece by Hugging Face name. Local: no
        collective. Here: the whole gradients (where the PolicyOptimizer holds them in fp32 masters, those), rank 0's
        counted."""
        policy = self.policy_optimizer
        return rank0_pieces((n, policy.gradient_of(p) if policy is not None else p.grad)
                            for n, p in self.hf_model.named_parameters() if p.requires_grad)

    def parameter_pieces(self) -> list[Piece]:
        """Like gradient_pieces, for the parameters after the step: the master weights the optimizer updates (what
        parameter_norm measures). Here: the whole parameters (their PolicyOptimizer masters), rank 0's counted."""
        policy = self.policy_optimizer
        return rank0_pieces((n, policy.master_of(p) if policy is not None else p)
                            for n, p in self.hf_model.named_parameters() if p.requires_grad)

    def replicas(self) -> list[Replica] | None:
        """Every tensor this rank holds that other ranks must hold bit for bit too — parameters as held (a shard, a
        flat fragment), and the optimizer state of each — with the ranks that hold it (`Replica`, in
        parity.training.replicas; its helpers `whole_model`, `held`, `moments`, `mesh_replica_ranks`). The loop digests
        them after every step (--replica_check_interval) and the verdict FAILs a run whose copies part. A rank
        declares the same list at every call from set-up on, a tensor not there yet as None (Adam's moments before
        the first step), and each rank of a replica declares it alike (name, what, piece, ranks); a tensor only this
        rank holds (ranks of one) is passed over. Local: no collective.

        Here, for a strategy whose every rank holds the whole model (no tensor parallelism, no pipeline stages: DDP,
        a hand-written data parallelism): every parameter and its AdamW moments (`self.optimizer`, a torch
        optimizer, when there is one), on every rank. A strategy that shards or splits the model declares its own;
        one that does not returns None: nothing is checked, and the record and the report say so."""
        if self.tensor_parallel or self.ctx.pp_size > 1:
            return None
        policy = self.policy_optimizer  # where there is one, its masters are held as the parameters
        return whole_model(self.hf_model, getattr(self, "optimizer", None), tuple(range(self.ctx.world_size)),
                           policy.master_of if policy is not None else None)

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, this rank's piece: local_piece) of every frozen parameter (LoRA's base), which must stay
        bit for bit as set up (parity/training/frozen.py); [] where every parameter trains. Local: no collective."""
        return [(n, self.local_piece(p)) for n, p in self.hf_model.named_parameters() if not p.requires_grad]

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a stock model's state dict holds (DeepSeek-V3's routing bias), under its names, on the CPU in
        fp32: no strategy shards a buffer. Collective where names must be translated (DeepSpeed's AutoEP)."""
        from parity.models.model import persistent_buffers

        return persistent_buffers(self.hf_model)

    def replica_params(self, num_params: int) -> float:
        """The parameters one rank of a model replica holds, for the ZeRO bound (memory.zero_bound): the model's
        `num_params` ÷ tp_size — perfect TP sharding, a lower bound where tensors stay replicated."""
        return num_params / self.ctx.tp_size

    def model_state_bytes(self) -> dict:
        """The model states this rank holds now: {"bytes": {category: bytes}, "offloaded_bytes": n}, counted
        from its tensors by a parity.training.memory.StateLedger (each storage once). Local: no collective."""
        raise NotImplementedError

    # --- checkpoints ------------------------------------------------------------------------------
    def save_state(self, directory: str) -> None:
        """Write the model and optimizer state into `directory`, this rank's part in the strategy's own
        (sharded) form, under file names no other rank uses: every rank writes into a directory of its own
        and Ray Train merges them into one checkpoint. Collective."""
        raise NotImplementedError

    def load_state(self, directory: str) -> None:
        """Load what save_state wrote (all ranks' files, merged in `directory`) into the set-up model and
        optimizer, so training continues as if it had never stopped. Collective."""
        raise NotImplementedError

    def set_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Give the optimizer AdamW's state of another run — {HF name: {"exp_avg", "exp_avg_sq"}} as full
        tensors, and its step count — in this strategy's own (sharded) form: the layer check's replay starts
        every strategy from the baseline's state. Here for torch optimizers over the wrapped model's
        parameters, through torch's full-state-dict loader (which shards DTensor states as the parameters
        are); DeepSpeed, whose optimizer is its own, overrides it. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        (group,) = self.optimizer.param_groups  # build_optimizer makes one group
        hyper = {k: v for k, v in group.items() if k != "params"}
        state = {name: {"step": torch.tensor(float(step)), **m} for name, m in moments.items()}
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": [
            {**hyper, "params": list(moments)}]}, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], int] | None:
        """AdamW's state as full fp32 CPU tensors under Hugging Face names — ({name: {"exp_avg", "exp_avg_sq"}}, its
        step count), ({}, 0) before the first step — on every rank, or None where this strategy cannot export it (the
        teacher-forced check then compares the grad norm only: parity/training/teacher_forced.py). The inverse of
        set_optimizer_state. Here for a torch optimizer (`self.optimizer`) over the HF module's parameters (or their
        PolicyOptimizer masters), whole or DTensor shards (optimizer.full_moments: gathered, in one order on every
        rank); a moment whose shape is not its full parameter's (a piece of a strategy's own) makes it None on every rank
        alike. Collective."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or self.ctx.pp_size > 1 or not hasattr(optimizer, "state"):
            return None
        policy = self.policy_optimizer
        return full_moments(self.hf_model.named_parameters(), optimizer, self.ctx.device,
                            policy.master_of if policy is not None else None)

    def accumulating(self, last: bool):
        """The context of one micro-batch's forward and backward under --grad_accum_steps: gradients are
        synchronised over DP only in the last (`last`), in the strategy's own way (DDP's no_sync, FSDP2's
        gradient-sync switch; DeepSpeed's engine counts its micro-steps itself). One micro-batch: nothing."""
        return contextlib.nullcontext()

    def forward_backward(self, batch, global_tokens: int) -> torch.Tensor:
        """Forward and backward of this rank's slice `batch` (a data.Batch) as --grad_accum_steps micro-batches,
        leaving the gradients of the global batch's token mean reduced over DP — plus, for a mixture of experts with
        a load-balancing loss, coef × that loss over the global batch (parity.training.routing) — and the step's
        routing in `step_routing`; returns this rank's token-loss sum (float64). A strategy whose forward and backward
        are one schedule (the pipeline) overrides this."""
        micro_batches = self.micro_batches(batch.to(self.ctx.device))
        routes = self.step_routes(micro_batches)  # a mixture of experts' routing (parity.training.routing)
        local_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self.objective_stats = None
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self.accumulating(last):
                with self.autocast(), routes.recording() as calls:
                    logits = self.logits_of(micro)
                summed = self.micro_batch_sum(logits, micro, global_tokens, self.ctx.dp_size * len(micro_batches))
                loss = routes.add(calls, micro, self.micro_batch_loss(summed, micro, batch, global_tokens))
                self.backward(loss * self.loss_scale, last)
            local_sum += summed.detach().double()
        routes.finish()
        return local_sum

    def train_step(self, batch, global_tokens: int, lr: float, observe: Callable[..., None] | None = None) -> StepStats:
        """One step on this rank's slice `batch` of a global batch with `global_tokens` loss tokens: forward_backward,
        then clipping and the optimizer. Each rank's loss is its token-loss sum × dp_size / global_tokens, so the
        gradients the strategy averages over DP are those of the global batch's token mean. `observe` (the loop's
        model-state probe) is called during backward as each parameter's gradient arrives ("during_backward", its
        name), then with "after_backward" (gradients reduced, before clipping and the step) and "after_step"."""
        watching = gradient_arrivals(self.hf_model, observe) if observe else contextlib.nullcontext()
        observe = observe or (lambda point: None)
        with watching:  # on the parameters as they are between steps (FSDP2's root unshards in forward)
            local_sum = self.forward_backward(batch, global_tokens)
        observe("after_backward")
        if not hasattr(self, "_tensor_names"):  # fixed for the run (tensor_names' contract): asked once
            self._tensor_names = self.tensor_names()
            self._measures_update_noise = (self._tensor_names is not None and self.records_update_noise and
                                           self.policy_optimizer is not None and not self.cfg.noise_reference)
            if self._measures_update_noise:  # each tensor's on the rank that counts it (the others' rows are 0)
                self.policy_optimizer.measure_update_noise(p.tensor for p in self.parameter_pieces()
                                                           if p.counted and p.tensor is not None)
        names, done = self._tensor_names, None
        while done is None or done.again:  # again: a replay of an fp16 record, at half the scale (FollowedScaler)
            local_sum = local_sum if done is None else self.forward_backward(batch, global_tokens)
            self._grad_squares, self._tensors_s, self._reading = None, 0.0, names is not None and self.reads_at_clip
            if names is not None and not self.reads_at_clip:  # read here: after backward, before the step (unscaled)
                self._read_gradients(self.current_loss_scale)
            done = OptimizerStep.of(self.optimizer_step(lr))
        self._reading = False
        observe("after_step")
        t0 = time.perf_counter()
        squares = None
        if names is not None:  # and the parameters after the step: both ride the loss gather (gather_step)
            grad_squares = self._grad_squares
            if grad_squares is None:  # an fp16 overflow skipped the step before its clip: an infinite norm, as its own
                if not done.skipped:
                    raise RuntimeError(f"{type(self).__name__} declares reads_at_clip but its optimizer_step did not "
                                       f"call self.record_gradients() where it takes the norm it clips by (a "
                                       f"PolicyOptimizer's: step(lr, norm_of, before_norm=self.record_gradients)): "
                                       f"call it there, or set reads_at_clip = False (docs/custom_strategy.md)")
                grad_squares = torch.full((len(names),), math.inf, dtype=torch.float64, device=self.ctx.device)
            squares = torch.cat([grad_squares, local_squares(self.parameter_pieces(), names, self.ctx.device),
                                 *self._update_noise_rows(names)])
        tensors_s = self._tensors_s + time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = self.objective_stats
        if stats is None and self.objective.stats_size:  # a rank that computed no loss (a pipeline's earlier stage)
            stats = torch.zeros(self.objective.stats_size, dtype=torch.float64, device=self.ctx.device)
        sums, counts, summed, stats = self.gather_step(local_sum, batch.loss_tokens, squares, stats)
        gather_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        param_norm = self.parameter_norm()
        param_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        grads = params = coef = None
        noise = None
        if summed is not None:
            if self._measures_update_noise:  # the rows after the norms: len(names) × GRID
                summed, noise = summed[:2 * len(names)], summed[2 * len(names):].view(len(names), -1).tolist()
            grads, params = norms_of(summed)
            if self.cfg.tensor_grad == CLIPPED:  # a replay of a record of clipped gradients: the same, to rounding
                coef = clip_coefficient(done.norm, self.cfg)
                grads = [g * coef for g in grads]
        tensors_s += time.perf_counter() - t0
        return StepStats(loss=sum(sums) / global_tokens, dp_rank_losses=[s / max(c, 1) for s, c in zip(sums, counts)],
                         grad_norm=done.norm, param_norm=param_norm,
                         harness_s={"loss_gather": gather_s, "param_norm": param_s, "tensor_norms": tensors_s},
                         skipped=done.skipped, loss_scale=done.loss_scale, overflowed=done.overflowed,
                         routing=self.step_routing, tensor_grad_norms=grads, tensor_param_norms=params, clip_coef=coef,
                         update_noise=noise, objective=self.objective.quantities(stats))

    def micro_batch_sum(self, logits: torch.Tensor, micro, divisor: float, micro_batches: int) -> torch.Tensor:
        """What micro-batch `micro` contributes to its step's loss × the step's divisor `divisor` (the global batch's
        loss tokens, or its objective's divisor: data.Batch.divisor), from its `logits`: the token-loss sum, or the run's
        objective's sum over the micro-batch's rollout rows (parity/objectives/micro_batch.py, the one place a
        micro-batch's loss is defined). `micro_batches`: the step's micro-batches over all DP ranks (a term of each
        micro-batch's own is its mean ÷ that many). The objective's statistics add up in `objective_stats`."""
        summed, stats = self.objective.micro_sum(logits, micro.input_ids, micro.labels, micro.rollout, divisor,
                                                 micro_batches)
        if stats is not None:
            self.objective_stats = stats if self.objective_stats is None else self.objective_stats + stats
        return summed

    def _update_noise_rows(self, names: list[str]) -> list[torch.Tensor]:
        """This rank's table of the optimizer's own noise (update_noise.tensor_tables) of each tensor it counts, flat
        in `names` order (zeros for the others, and for every tensor of a step without one: an fp16 overflow's), where
        the run measures it; else nothing."""
        if not self._measures_update_noise:
            return []
        tables = self.policy_optimizer.update_noise or {}
        rows = torch.zeros(len(names), len(GRID), dtype=torch.float64, device=self.ctx.device)
        found = {piece.name: tables[id(piece.tensor)] for piece in self.parameter_pieces()  # names: each once
                 if piece.counted and piece.tensor is not None and id(piece.tensor) in tables}
        if found:  # every row added to its zeros at once: two operations, not two a tensor (a GPU's launches)
            none = rows.new_zeros(len(GRID))
            rows += torch.stack([found[n].to(rows) if n in found else none for n in names])
        return [rows.flatten()]

    def record_gradients(self, loss_scale: float = 1.0) -> None:
        """Hand the gradients to the tensor record, here: a strategy that `reads_at_clip` calls it in optimizer_step
        where it computes the norm it clips by — after its reduction and unscaling, before clipping — once a step
        (`loss_scale`: what the gradients are still multiplied by there, DeepSpeed's inside its step). The record's
        tensors' squares then add up to that norm, which the verdict checks at every step (docs/tensors.md). Local."""
        if self._reading:
            self._reading = False
            self._read_gradients(loss_scale)

    def _read_gradients(self, loss_scale: float) -> None:
        t0 = time.perf_counter()
        self._grad_squares = local_squares(self.gradient_pieces(), self._tensor_names, self.ctx.device, loss_scale)
        self._tensors_s += time.perf_counter() - t0

    def micro_batch_loss(self, summed: torch.Tensor, micro, batch, global_tokens: int) -> torch.Tensor:
        """What a micro-batch backpropagates: its sum (micro_batch_sum) × dp_size / the step's divisor (the global
        batch's loss tokens, or its objective's), so that the strategy's average over DP ranks of the sum over
        micro-batches is the gradient of the step's loss, whatever each rank and micro-batch holds (`micro` of this
        rank's `batch`)."""
        return summed * (self.ctx.dp_size / global_tokens)

    def gather_dp_sums(self, local_sum: torch.Tensor, local_tokens: int) -> tuple[list[float], list[int]]:
        """Each DP rank's loss sum and loss tokens. Collective."""
        sums, counts, _, _ = self.gather_step(local_sum, local_tokens)
        return sums, counts

    def gather_step(self, local_sum: torch.Tensor, local_tokens: int, squares: torch.Tensor | None = None,
                    stats: torch.Tensor | None = None
                    ) -> tuple[list[float], list[int], torch.Tensor | None, torch.Tensor | None]:
        """Each DP rank's loss sum and loss tokens; `squares` (this rank's float64 sums of squares of its tensors'
        pieces, the same length on every rank) summed over every rank; and `stats` (an objective's statistics of this
        rank's micro-batches) summed over the DP ranks — in one all_gather: every tensor's sums ride the loss gather
        rather than a collective of their own (on CPU ranks a collective costs milliseconds, more than the sums:
        docs/benchmark.md). Collective."""
        row = torch.stack([local_sum.double(), torch.tensor(float(local_tokens), dtype=torch.float64,
                                                            device=local_sum.device)])
        size = 0 if stats is None else len(stats)
        parts = [row] + [t.to(row.device, torch.float64) for t in (stats, squares) if t is not None]
        rows = self.gather_world(torch.cat(parts))
        pairs = self.dp_rows(rows)
        summed = None if squares is None else torch.stack(rows)[:, 2 + size:].sum(0)
        stats_sum = None if stats is None else torch.stack(pairs)[:, 2:2 + size].sum(0)
        return [float(p[0]) for p in pairs], [int(p[1]) for p in pairs], summed, stats_sum

    def gather_dp(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each DP rank's `t` (same shape everywhere). Collective: every rank calls it."""
        return self.dp_rows(self.gather_world(t))

    def gather_world(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape everywhere), in rank order. Collective."""
        gathered = [torch.empty_like(t) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, t.contiguous())
        return gathered

    def dp_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each DP rank's of every rank's `rows`, read from the first rank of its TP group: the ranks of a TP group
        hold the same full-size values."""
        return [rows[self.ctx.layout.rank(d, 0, 0)] for d in range(self.ctx.dp_size)]
