"""The small interface a strategy module implements, and the one train step built on it.

A strategy only wraps the model, runs backward, steps the optimizer (returning the global pre-clip
gradient norm) and knows how to gather its shards to full size. Everything else — loss function,
autocast, loss reduction across ranks — is here, once, so it cannot differ between strategies.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parity.errors import ConfigError
from parity.training import routing
from parity.training.precision import OptimizerStep, policy_of
from parity.training.replicas import Replica, whole_model


@dataclass(frozen=True)
class Option:
    """A flag only one strategy has (--zero_stage, --mixed_precision): declared by the strategy module in
    its `options`, stored in `RunConfig.options`. Defined here, with the interface
    the strategies implement, so that a strategy module imports nothing above it (no import cycle)."""

    name: str
    default: Any
    help: str
    type: Callable | None = None
    choices: tuple | None = None

    def add_to(self, group, given_only: bool = False) -> None:
        """Add --<name>. `given_only`: no default, so only a flag the user gave appears in the result."""
        kwargs: dict[str, Any] = {"help": self.help, "default": argparse.SUPPRESS if given_only else self.default}
        if isinstance(self.default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=self.type or type(self.default), choices=self.choices)
        group.add_argument(f"--{self.name}", **kwargs)


@dataclass
class WorkerContext:
    """Where this process sits: rank = (dp_rank × pp_size + pp_rank) × tp_size + tp_rank (TP groups are
    consecutive ranks, and so are the pp_size ranks of one pipeline: 1 without one, set by Strategy.__init__)."""

    rank: int
    world_size: int
    tp_size: int
    dp_size: int
    device: torch.device
    pp_size: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.pp_size)

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
    routing: dict | None = None  # a mixture of experts: {"aux_loss", "expert_loads"} of the global batch (routing.py)


@dataclass
class ModuleRecords:
    """The layer check's module tensors of one step on one rank: each module's output and its gradient for this
    rank's batch slice, by Hugging Face module name; `outputs` in forward order, `output_grads` in the order
    backward produced them."""
    outputs: dict[str, torch.Tensor]
    output_grads: dict[str, torch.Tensor]


IGNORE_INDEX = -100  # a label the loss skips (padding)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of next-token cross-entropies in fp32 (logits are upcast, whatever the compute dtype) over the
    positions with a label: position t predicts labels[t + 1], and a label of −100 (padding) counts nothing.
    A step's loss is the sum over the global batch ÷ its loss tokens (data.Batch.loss_tokens): the mean over
    tokens, whatever each rank or micro-batch holds, never a mean of their means."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def build_optimizer(params, cfg) -> torch.optim.AdamW:
    """The one optimizer every strategy uses (DeepSpeed is handed this same client optimizer)."""
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def step_optimizer(optimizer, lr: float) -> None:
    """Step a torch optimizer at `lr` and drop the gradients (after the strategy has clipped them)."""
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over --warmup_steps, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    return cfg.learning_rate


def squared_norm_fp64(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares accumulated in float64.

    The pre-clip norm is compared across strategies at 1e-5, and an fp32 norm over a large gradient
    (the 2048×64 tied embedding already) is itself only good to ~1e-5; in float64 the only difference
    left is which partial sums each strategy forms, far below that.
    """
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64).square()  # no float64 copy: ~1.6× faster


def clip_coefficient(total_norm: float, cfg) -> float:
    """torch's clip_grad_norm_ formula: max_norm / (norm + 1e-6), at most 1; --max_grad_norm 0 = off."""
    if cfg.max_grad_norm <= 0:
        return 1.0
    return min(1.0, cfg.max_grad_norm / (total_norm + 1e-6))


def local_norm(tensors) -> float:
    """The L2 norm of plain (unsharded) tensors taken together, accumulated in float64."""
    return math.sqrt(float(sum(squared_norm_fp64(t) for t in tensors)))


def clip_local_gradients(params, cfg) -> float:
    """Clip gradients that are plain (unsharded) tensors by their global norm; return that norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = local_norm(grads)
    coef = clip_coefficient(norm, cfg)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm


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


class Strategy:
    """Base class of the three strategy modules. Subclasses set `name` (the registry's) and `options`, and
    implement the abstract parts."""

    name = "base"
    options: tuple = ()  # the strategy's own flags (Option above), in RunConfig.options
    tensor_parallel = True  # whether it shards tensors over --tp_size (DDP and a hand-written DP do not)
    expert_parallel = False  # whether it shards a mixture of experts' experts over --ep_size
    layer_check_refuses_ep = None  # why the layer check cannot compare its modules at --ep_size > 1, where it cannot
    zero_stage = 0  # the ZeRO stage whose memory bound applies (parity.training.memory.zero_bound)
    # The precision policies it carries out (parity.training.precision). fp32 and bf16 (autocast) need nothing of a
    # strategy but this class's autocast(); the others need the parameters, gradients, reduction and optimizer of the
    # policy — PolicyOptimizer for plain tensors — and a strategy declares them when it does that.
    precisions: tuple = ("fp32", "bf16")

    def __init__(self, cfg, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        ctx.pp_size = self.pp_size(cfg.options)  # before the loop slices this rank's data by ctx.dp_rank
        self.model = None  # the wrapped model whose forward returns HF outputs with .logits
        self.step_routing: dict | None = None  # the last forward_backward's routing record (a mixture of experts)
        self.step_expert_ids: list[torch.Tensor] = []  # and per sparse layer, the experts each token of the rank went to

    # --- driver side ------------------------------------------------------------------------------
    @classmethod
    def pp_size(cls, options: dict) -> int:
        """The pipeline ranks one model replica spans, each holding its stages: num_workers = pp_size × tp_size ×
        dp_size (`resolve` defaults --dp_size to num_workers / (pp_size × tp_size); the strategy's `validate`
        checks the layout). 1 for a strategy without pipeline stages."""
        return 1

    @classmethod
    def with_default_options(cls, options: dict) -> dict:
        """`options` (flag name → value, some of this strategy's own flags) with the others at their defaults."""
        return {**{o.name: o.default for o in cls.options}, **options}

    @classmethod
    def layer_stages(cls, options: dict) -> int:
        """The pieces the decoder layers are split into (--num_layers must be a multiple): a pipeline's stages, 1
        for a strategy without them."""
        return 1

    @classmethod
    def precision_request(cls, options: dict):
        """The precision policy this strategy's own settings ask for (a parity.training.precision.PolicyRequest), or
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
        the loss itself (its PolicyOptimizer's, `self.precision`, or scaler's), else 1 (DeepSpeed's engine scales its
        own)."""
        precision = getattr(self, "precision", None)
        return precision.loss_scale if precision else 1.0

    def autocast(self):
        """The compute-precision context of the forward pass: torch.autocast(bfloat16) in the bf16 policy."""
        if policy_of(self.cfg).autocast:
            return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of this rank's slice. Without a KV cache: Hugging Face builds one in every
        forward unless told not to (config.use_cache), which a training step never reads; under --compile each
        decoder layer was compiled again for the cache's state."""
        return self.model(input_ids=input_ids, use_cache=False).logits

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
        precision = getattr(self, "precision", None)  # a PolicyOptimizer, whose masters are held as the parameters
        return whole_model(self.hf_model, getattr(self, "optimizer", None), tuple(range(self.ctx.world_size)),
                           precision.master_of if precision else None)

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
        micro_batches = batch.to(self.ctx.device).split(self.cfg.grad_accum_steps)
        tap = self.router_tap()
        moe = tap.moe if tap else None
        aux = bool(moe and moe.aux_loss_coef)
        counted, totals = (self.count_routes(micro_batches, tap) if aux and len(micro_batches) > 1 else (None, None))
        local_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        counts = prob_sums = None
        chosen = []
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self.accumulating(last):
                with self.autocast(), (tap.recording() if tap else contextlib.nullcontext()) as calls:
                    logits = self.forward(micro.input_ids)
                summed = loss_sum(logits, micro.labels)
                loss = self.micro_batch_loss(summed, micro, batch, global_tokens)
                if tap:
                    chosen.append([ids.detach() for _, ids in calls])
                    mask = routing.real_tokens(micro.labels)
                    mine = routing.expert_counts(calls, mask, moe.num_experts)
                    counts = mine if counts is None else counts + mine
                    if aux:
                        sums = routing.probability_sums(calls, mask)
                        prob_sums = sums.detach() if prob_sums is None else prob_sums + sums.detach()
                        totals = totals if totals is not None else self.batch_routing_totals(mine)
                        loss = loss + self.micro_batch_aux(sums, totals, moe)
                self.backward(loss * self.loss_scale, last)
            local_sum += summed.detach().double()
        if tap:
            if counted is not None and not torch.equal(counted, counts):
                raise RuntimeError("the counting forward routed differently from the training forward: the step's "
                                   "load-balancing statistics would not be its own")
            self.step_routing = self.routing_record(counts, prob_sums, totals, moe)
            self.step_expert_ids = [torch.cat(layer) for layer in zip(*chosen)]
        return local_sum

    def router_tap(self):
        """Hooks on the routers of a mixture of experts (made at the first step); None for a dense model."""
        if not hasattr(self, "_router_tap"):
            from parity.models.families import family_of

            family = family_of(self.hf_model.config)
            self._router_tap = routing.RouterTap(self.hf_model, family, self.router_module) if family.moe else None
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
        gradients over the micro-batches, which the load-balancing loss of each one needs (routing.py)."""
        counts = 0
        for micro in micro_batches:
            with self.autocast(), tap.recording() as calls:
                self.forward(micro.input_ids)
            counts = counts + routing.expert_counts(calls, routing.real_tokens(micro.labels), tap.moe.num_experts)
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
        return self.ctx.dp_size * moe.aux_loss_coef * routing.aux_loss_term(prob_sums, totals, moe.top_k)

    def routing_record(self, counts, prob_sums, totals, moe) -> dict:
        """The step's routing over the global batch: the load-balancing loss (without its coefficient; None where the
        family has none in its loss) and each sparse layer's expert loads (real tokens routed to each expert, top-k
        assignments). Collective."""
        totals = totals if totals is not None else self.batch_routing_totals(counts)
        aux = (float(routing.aux_loss_term(self.batch_routing_totals(prob_sums), totals, moe.top_k))
               if prob_sums is not None else None)
        return {"aux_loss": aux, "expert_loads": [[int(n) for n in row] for row in totals.tolist()]}

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
        done = OptimizerStep.of(self.optimizer_step(lr))
        observe("after_step")
        t0 = time.perf_counter()
        sums, counts = self.gather_dp_sums(local_sum, batch.loss_tokens)
        gather_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        param_norm = self.parameter_norm()
        return StepStats(loss=sum(sums) / global_tokens, dp_rank_losses=[s / max(c, 1) for s, c in zip(sums, counts)],
                         grad_norm=done.norm, param_norm=param_norm,
                         harness_s={"loss_gather": gather_s, "param_norm": time.perf_counter() - t0},
                         skipped=done.skipped, loss_scale=done.loss_scale, routing=self.step_routing)

    def micro_batch_loss(self, summed: torch.Tensor, micro, batch, global_tokens: int) -> torch.Tensor:
        """What a micro-batch backpropagates: its token-loss sum × dp_size / the global batch's loss tokens, so that
        the strategy's average over DP ranks of the sum over micro-batches is the gradient of the global token
        mean, whatever each rank and micro-batch holds (`micro` of this rank's `batch`)."""
        return summed * (self.ctx.dp_size / global_tokens)

    def gather_dp_sums(self, local_sum: torch.Tensor, local_tokens: int) -> tuple[list[float], list[int]]:
        """Each DP rank's loss sum and loss tokens. Collective."""
        pairs = self.gather_dp(torch.stack([local_sum.double(),
                                            torch.tensor(float(local_tokens), dtype=torch.float64,
                                                         device=local_sum.device)]))
        return [float(p[0]) for p in pairs], [int(p[1]) for p in pairs]

    def gather_dp(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each DP rank's `t` (same shape everywhere), read from the first rank of its TP group: the
        ranks of a TP group hold the same full-size values. Collective: every rank calls it."""
        gathered = [torch.empty_like(t) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, t.contiguous())
        return [gathered[d * self.ctx.tp_size] for d in range(self.ctx.dp_size)]
