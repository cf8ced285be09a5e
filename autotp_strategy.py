"""The DeepSpeed strategy ("deepspeed"): AutoTP shards the model over TP groups, ZeRO the optimizer state
(and, by stage, gradients and parameters) over DP. The file keeps the design card's name.

Only what differs from DDP is here; the numbered comments match docs/deepspeed.md. Its helpers live beside it in
parity/strategies/autotp/: the engine config (engine_config.py) and a user's --deepspeed_config (user_config.py), the
release and AutoEP guards (guards.py), the AutoTP partition config (partition.py), the TP and EP gathers (gathers.py)
and DeepSpeed's import (library.py).

[1] DeepSpeed is imported on the worker once the device is known, because the import picks its
    accelerator; the driver imports it only in validate(), on the CPU one, to fail before launch.
[2] The engine config: AutoTP of --tp_size, ZeRO --zero_stage, the shared AdamW as the client
    optimizer, --max_grad_norm as DeepSpeed's own clipping, and the precision policy in DeepSpeed's own keys — which
    a user's --deepspeed_config may set instead (its bf16 / fp16 section decides the run's policy).
[3] DeepSpeed builds its TP and DP groups itself; they must be the harness's layout (consecutive ranks
    form a TP group), or the data slices and the gathers would pair the wrong ranks.
[4] AutoTP makes the tied embedding and lm_head vocab-parallel, so the logits are this rank's vocab
    shard; they are gathered (exactly) so the shared loss sees the full vocabulary.
[5] Full tensors: ZeRO partitions gathered over DP by DeepSpeed's safe_get_full_* helpers, TP shards by
    each AutoTP layer's own gather_params.
[6] Checkpoints: the engine's own save_checkpoint / load_checkpoint (every rank its model and ZeRO files).
[7] Replicas: what ranks hold alike — whole parameters, TP shards over DP, master fragments and moments of the
    parameters AutoTP leaves whole — for the loop's check that they stay alike.
[8] --ep_size > 1: DeepSpeed's AutoEP (expert_parallel in the engine config) replaces each sparse block by its own
    layer — its router (router.gate), the experts unfused and EP-sharded (w1 gate, w3 up, w2 down: [E / ep, ...]),
    the shared experts kept — inside initialize, so the shared AdamW is handed over as a callable DeepSpeed calls on
    the replaced parameters, in the MoE parameter groups ZeRO requires (the same hyperparameters in every group).
    Full tensors come back under the stock model's names and layout (gate_up_proj = [w1; w3], gathered over EP).
[9] Every tensor's norms (parity/training/tensor_norms.py): each rank's pieces read where DeepSpeed holds them — the
    gradients inside engine.step(), where it takes the norm it clips by (norm_point.py: ZeRO-1/2's fragments of the
    averaged gradients, ZeRO-3's partitions: zero_state.local_gradient), the master weights after it (_local_master) — under the stock names
    (AutoEP's w1 and w3 both under gate_up_proj, their squares summed), each piece counted on one of the ranks that
    hold it alike (zero_state.zero_pieces). DeepSpeed's own pre-clip norm is rounded to fp32: the squares add up to it
    at fp32's precision (~1e-7), to the float64 norm of its own ZeRO-0 path exactly.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from parity.deepspeed_import import import_deepspeed
from parity.deepspeed_precision import config_policy
from parity.errors import ConfigError, LibraryMissing
from parity.models.families import family_of
from parity.models.model import parameter_names
from parity.precision import POLICIES, PolicyRequest, policy_of
from parity.strategies.autotp.engine_config import engine_config
from parity.strategies.autotp.gathers import column_parallel_outputs, gather_last_dim, stock_name, stock_names
from parity.strategies.autotp.guards import check_autoep, check_release_runs
from parity.strategies.autotp.library import forget_other_tp_layout
from parity.strategies.autotp.partition import autotp_partition_config
from parity.strategies.autotp.user_config import given_config, read_user_config, user_config
from parity.training.memory import GATHERED, GRADS, MASTER, OFFLOAD, OFFLOAD_BUFFERS, PARAMS, StateLedger
from parity.training.optimizer import OptimizerStep
from parity.training.replicas import Replica
from parity.views.norm_point import norm_dtype, watch_norm
from parity.views.zero_state import (autotp_groups, full_masters, full_moments, full_tensors, local_gradient,
                                    local_master, module_norm, unfused_masters, zero_pieces, zero_replicas)
from parity.training.strategy import Option, Piece, Strategy, build_named_optimizer, build_optimizer, set_lr

ZERO_STAGES = (0, 1, 2, 3)
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's default for zero_optimization.reduce_bucket_size
CHECKPOINT_TAG = "deepspeed"  # the engine's checkpoint folder inside a checkpoint


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    takes_adapters = True  # LoRA at --tp_size 1 (validate): ZeRO partitions the frozen base, steps the adapters
    replays_records = True  # at ZeRO-3: train_deepspeed.py --replay_record (replay_choice.py)
    expert_parallel = True  # DeepSpeed's AutoEP, where 0.19.8 runs the family (check_autoep)
    layer_check_refuses_ep = ("DeepSpeed's AutoEP replaces the sparse block by its own modules (its router, unfused "
                              "experts), which have no stock module to compare with: judge it by its loss curves "
                              "(plot_loss_curves.py), or leave deepspeed out")
    options = (
        Option("zero_stage", 1, type=int, choices=ZERO_STAGES,
               help="ZeRO stage: 0 none (DeepSpeed's data parallelism: gradients all-reduced), 1 shards the optimizer "
                    "state over DP, 2 also the gradients, 3 also the parameters"),
        Option("bf16_master_weights", False,
               help="kept from before --precision had its policies: the bf16_pure policy (--precision bf16_pure: "
                    "DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states, seed 001's setting)"),
        Option("offload_optimizer", "none", choices=OFFLOAD,
               help="cpu: ZeRO-Offload — the fp32 master partition, its gradients and Adam's state in host memory, "
                    "the optimizer step on the CPU (with the same torch AdamW)"),
        Option("offload_param", "none", choices=OFFLOAD,
               help="cpu: ZeRO-3's parameter partitions in host memory between uses (--zero_stage 3 only)"),
        Option("deepspeed_config", None, type=str,
               help="your own DeepSpeed config (a JSON file): its keys are kept (ZeRO settings, data types, communication "
                    "dtype, bucket sizes ...) under the keys the run's flags decide — micro-batch and accumulation, "
                    "clipping (--max_grad_norm), --zero_stage, --tp_size — which must agree with them "
                    "(docs/deepspeed.md); its bf16 / fp16 section, communication_data_type, data_types and loss-scale "
                    "keys decide the run's precision policy; a key it omits gets the harness's DDP-equivalent value"),
        Option("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_SIZE,
               help="elements of gradient ZeRO reduces at once (zero_optimization.reduce_bucket_size; default "
                    "DeepSpeed's, 5e8). ZeRO-2 and ZeRO-3 free the gradients outside their partition each time a "
                    "bucket fills, so during backward they hold less than ZeRO-1 only for a model larger than this"),
    )

    # every policy but a loss-scaled autocast (fp16_autocast, torch's AMP recipe): DeepSpeed's torch_autocast section
    # scales an fp16 loss only without ZeRO, by a GradScaler of its own the harness does not follow; and bf16_base: the
    # engine casts every parameter to its one dtype
    precisions = tuple(name for name, policy in POLICIES.items()
                       if not (policy.autocast and policy.loss_scaling or policy.frozen_apart))

    @classmethod
    def precision_request(cls, options: dict):
        """The policy a user's --deepspeed_config asks for (its bf16, fp16 or torch_autocast section and refinements:
        config_policy), or --bf16_master_weights's (bf16_pure)."""
        request = None
        if options["deepspeed_config"] is not None:
            path, user = user_config(options["deepspeed_config"])
            request = config_policy(user, f"--deepspeed_config {path}")
        if options["bf16_master_weights"]:
            if request is not None and request.precision not in (None, "bf16_pure"):
                raise ConfigError(f"--bf16_master_weights (bf16_pure) contradicts {request.source} "
                                  f"({request.precision}): drop one of them")
            request = request or PolicyRequest("--bf16_master_weights", "bf16_pure")
        return request

    @classmethod
    def validate(cls, settings, model_config) -> None:
        stage = settings.options["zero_stage"]
        policy = POLICIES[settings.precision]
        if settings.options["offload_param"] != "none" and stage != 3:
            raise ConfigError(f"--offload_param {settings.options['offload_param']} needs --zero_stage 3 (stages 1 "
                              f"and 2 do not partition parameters, and DeepSpeed ignores the setting there): pass "
                              f"--zero_stage 3, or use --offload_optimizer cpu")
        if policy.name == "bf16_pure" and settings.options["offload_optimizer"] != "none":
            raise ConfigError("the bf16_pure policy with --offload_optimizer cpu: DeepSpeed keeps bf16 master weights "
                              "in host memory only with its DeepSpeedCPUAdam, not the shared torch AdamW: drop one "
                              "of the two")
        if policy.name == "bf16" and settings.reduce_dtype != "fp32":
            raise ConfigError("--reduce_dtype bf16 in the bf16 (autocast) policy: DeepSpeed's torch_autocast reduces "
                              "only its lower_precision_safe_modules' gradients in bf16, not all of them: use "
                              "--precision bf16_params for a bf16 reduction")
        if stage == 0 and policy.master_copy and settings.grad_accum_dtype != policy.params:
            raise ConfigError(f"--zero_stage 0 with micro-batches accumulated in {settings.grad_accum_dtype}: DeepSpeed "
                              f"accumulates in the parameters' {policy.params} without ZeRO (it refuses the mix at "
                              f"initialize): use --zero_stage 1, or --grad_accum_dtype {policy.params}")
        if settings.options["reduce_bucket_size"] < 1:
            raise ConfigError(f"--reduce_bucket_size must be a positive number of elements (got "
                              f"{settings.options['reduce_bucket_size']}): DeepSpeed's default is "
                              f"{DEEPSPEED_REDUCE_BUCKET_SIZE}")
        if settings.options["deepspeed_config"] is not None:
            settings.options["deepspeed_config"] = read_user_config(settings.options["deepspeed_config"], settings)
        try:  # fail here, before any worker, if DeepSpeed cannot be imported; the driver computes nothing
            deepspeed = import_deepspeed(torch.device("cpu"))
        except ImportError as exc:
            raise LibraryMissing(cls.name, exc) from None
        if policy.name == "fp16" and settings.device == "cpu" and not deepspeed.accelerator.get_accelerator() \
                .is_fp16_supported():
            raise ConfigError("DeepSpeed's fp16 mode on CPU workers: DeepSpeed refuses it at initialize on a CPU without "
                              "fp16 kernels (AVX512-FP16 or AMX-FP16: \"Type fp16 is not supported on your device\"), as "
                              "this one: run fp16 on GPUs (--device cuda), or --precision bf16_params here")
        check_release_runs(deepspeed.__version__, settings)
        # AutoTP (0.19.8, partition_config: the HF plan converted, or the harness's) takes a module with a 2-D `weight`
        # for a linear layer and never looks inside it: peft's LoRA layer has its base's weight, so a spec naming the
        # projection replaces the LoRA layer whole by a sharded base (adapters gone), and no spec reaches base_layer
        if settings.lora and (settings.tp_size > 1 or settings.ep_size > 1):
            raise ConfigError(f"LoRA under DeepSpeed's AutoTP or AutoEP (--tp_size {settings.tp_size}, --ep_size "
                              f"{settings.ep_size}): AutoTP replaces each projection peft wrapped by a sharded copy of "
                              f"its base, adapters dropped, and AutoEP replaces the experts: use --tp_size 1 --ep_size 1 "
                              f"(ZeRO over dp), or train_fsdp.py / train_transformers.py")
        if settings.tp_size > 1:
            autotp_partition_config(model_config, given_config(settings.options))  # raises for a family it cannot shard
        if settings.ep_size > 1:
            check_autoep(model_config, settings.tp_size)
            if policy.master_copy:
                raise ConfigError(f"DeepSpeed's AutoEP (--ep_size {settings.ep_size}) with --precision {settings.precision}: "
                                  f"the harness drives AutoEP in the fp32 and bf16 policies only (its experts' master "
                                  f"partitions are not read back yet): use --precision bf16, or train_fsdp.py")

    # --- worker side ------------------------------------------------------------------------------
    def setup(self, model) -> None:
        deepspeed = import_deepspeed(self.ctx.device)  # [1]
        if self.cfg.activation_checkpointing:  # the Hugging Face model's own, as DeepSpeed's HF integration uses
            model.activation_checkpointing_enable()
        forget_other_tp_layout(self.cfg.tp_size)
        if self.cfg.ep_size > 1:  # [8] AutoEP replaces parameters inside initialize: the optimizer is built after
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self._moe_optimizer,
                                                   model_parameters=list(model.parameters()), config=engine_config(self.cfg))
        else:
            # AutoTP keeps the Parameter objects; LoRA's frozen base is no optimizer's (ZeRO partitions it still)
            optimizer = build_named_optimizer(model, self.cfg)
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(self.cfg))  # [2]
        self.model = self.engine
        check_rank_layout(self.engine, self.ctx)  # [3]
        if self.cfg.compile:
            self.engine.compile()  # DeepSpeed's own: the engine's whole module
        self.family = family_of(model.config)
        self.column_shards = column_parallel_outputs(self.engine.module, self.family)
        self.autoep = {name: layer for name, layer in self.engine.module.named_modules()
                       if getattr(layer, "_is_autoep_layer", False)}
        self.reads_at_clip = watch_norm(self.engine, self._at_norm)  # [9]
        self.clip_norm_dtype = norm_dtype(self.engine)
        self._own_norm = None

    def _moe_optimizer(self, params):
        """[8] The shared AdamW over the parameters AutoEP left, in DeepSpeed's MoE parameter groups."""
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return build_optimizer(split_params_into_different_moe_groups_for_optimizer(
            {"params": list(params), "name": "parity"}), self.cfg)

    def router_module(self, name: str) -> str:
        """[8] An AutoEP layer's router is its own module (`router`), where the stock block has `gate`."""
        block = name.rsplit(".", 1)[0]
        return f"{block}.router" if block in self.autoep else name
    @property
    def zero_stage(self) -> int:
        return self.cfg.options["zero_stage"]

    @property
    def hf_model(self):
        return self.engine.module

    def local_piece(self, param):
        """ZeRO-3's partition of `param` on this rank (the module's parameter is an empty placeholder between uses);
        the parameter itself under ZeRO 0–2 (AutoTP's shard, where it shards)."""
        return getattr(param, "ds_tensor", param)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As Strategy.forward, through the engine (which broadcasts its inputs over the TP group and checks them):
        no cache, packed rows' position ids and no mask."""
        positions = {} if position_ids is None else {"position_ids": position_ids}
        logits = self.engine(input_ids=input_ids, use_cache=False, **positions).logits
        return gather_last_dim(self.column_shards, "lm_head", logits)  # [4]

    def accumulating(self, last: bool):
        """The engine told whether this micro-batch ends the step (its accumulation boundary, where it reduces and
        steps), instead of counting micro-steps against gradient_accumulation_steps: a replay's steps hold as many
        micro-batches as the recorded run's did, which may differ from step to step."""
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """The engine's backward, without its own 1/gradient_accumulation_steps (the shared loss is already the
        global batch's token mean); after a micro-batch that is not the last, engine.step() only counts it
        (DeepSpeed reduces and steps at its accumulation boundary, the last micro-batch: accumulating)."""
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last:
            self.engine.step()

    @property
    def current_loss_scale(self) -> float:
        """fp16: the engine's own loss scale (it scales the loss inside backward), else 1."""
        scaled = policy_of(self.cfg).loss_scaling
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0)) if scaled else 1.0

    def optimizer_step(self, lr: float) -> OptimizerStep:
        """DeepSpeed clips (gradient_clipping) and steps; its pre-clip global norm (ZeRO's
        get_grad_norm_direct) sums per-tensor float64 norms, each TP shard once and each replicated tensor
        once, and rounds the total to fp32. Where DeepSpeed reports none (ZeRO-0 over the plain client optimizer:
        fp32, bf16 autocast) the norm is the harness's own, taken where DeepSpeed clips (_at_norm) as the parameter
        norm is (each TP shard summed over its group, each replicated tensor once). fp16: DeepSpeed's own loss scaler
        skips an overflowing step (was_step_applied)."""
        scale = self.current_loss_scale
        self._own_norm = None
        if self.zero_stage == 0 and not self.reads_at_clip:  # its fp16 optimizers: before the step (norm_point.py)
            self._own_norm = self._module_norm(lambda p: p.grad) / scale
        set_lr(self.engine.optimizer, lr)
        self.engine.step()
        reported = self.engine.get_global_grad_norm()
        norm = float(reported) if reported is not None else self._own_norm
        if policy_of(self.cfg).loss_scaling:
            return OptimizerStep(norm, skipped=not self.engine.was_step_applied(), loss_scale=scale)
        return OptimizerStep(norm)

    def _at_norm(self) -> None:
        """[9] Where engine.step() takes the norm it clips by (norm_point.py): the gradients to the tensor record, as
        its clip reads them (at its loss scale); at ZeRO-0, whose client optimizer reports no norm, the harness's own
        taken of them there."""
        scale = self.current_loss_scale
        self.record_gradients(scale)
        if self.zero_stage == 0:
            self._own_norm = self._module_norm(lambda p: p.grad) / scale

    def parameter_norm(self) -> float:
        """Over the master weights the optimizer updated (_local_master): each TP shard (DeepSpeed marks them
        tensor_model_parallel) summed over the TP group, each replicated tensor once, DP partitions summed over the DP
        group. Float64, as the grad norm."""
        return self._module_norm(self._local_master, partitioned=self.zero_stage > 0 and self._masters_apart())

    def tensor_names(self) -> list[str]:
        """[9] The trainable parameters under the stock model's names, each once, in its order."""
        return self._stock_names

    def gradient_pieces(self) -> list[Piece]:
        """[9] Each gradient's piece where DeepSpeed holds it at its norm (zero_state.local_gradient): ZeRO-1/2's
        fragments and ZeRO-3's partitions, each rank its own; ZeRO-0's whole gradient on DP rank 0."""
        return zero_pieces(self.engine, self._stock_named, lambda p: local_gradient(p, self.zero_stage),
                           partitioned=self.zero_stage > 0, tp_rank=self.ctx.tp_rank)

    def parameter_pieces(self) -> list[Piece]:
        """[9] Each master weight's piece as parameter_norm reads it (_local_master)."""
        return zero_pieces(self.engine, self._stock_named, self._local_master,
                           partitioned=self.zero_stage == 3 or self.zero_stage > 0 and self._masters_apart(),
                           tp_rank=self.ctx.tp_rank)

    @functools.cached_property
    def _stock_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """[9] (stock name, parameter) of the engine's module's trainable parameters (AutoEP's renamed: w1 and w3 both
        gate_up_proj, gathers.stock_name), found once: the engine keeps its parameter objects."""
        return [(stock_name(n, self.autoep), p) for n, p in self.engine.module.named_parameters() if p.requires_grad]

    @functools.cached_property
    def _stock_names(self) -> list[str]:
        # the stock model's order (AutoEP moved its modules); with LoRA's adapters (no AutoEP) the module's own
        names = (parameter_names(self.engine.module.config) if self.cfg.lora is None
                 else [n for n, _ in self.engine.module.named_parameters()])
        order = {n: i for i, n in enumerate(names)}
        return sorted(dict.fromkeys(name for name, _ in self._stock_named), key=order.__getitem__)

    def _masters_apart(self) -> bool:
        """Whether the optimizer steps copies of the parameters (a policy's fp32 masters) rather than the module's."""
        return policy_of(self.cfg).master_copy

    def _local_master(self, p) -> torch.Tensor | None:
        """This rank's part of the master weight of parameter p (zero_state.local_master)."""
        apart = self._masters_apart()
        return local_master(p, self.zero_stage, apart, self._unfused_masters if apart and self.zero_stage == 0 else None)

    @functools.cached_property
    def _unfused_masters(self) -> dict[int, torch.Tensor]:
        """ZeRO-0's fp32 master copies, by their parameter's id (zero_state.unfused_masters)."""
        return unfused_masters(self.engine)

    def _module_norm(self, local_of, partitioned: bool = False) -> float:
        """The L2 norm, in float64, of `local_of(p)` (this rank's piece of a tensor of parameter p) over the module's
        parameters: TP shards summed over the TP group, replicated tensors once, and — `partitioned` (ZeRO-3, or the
        fp32 masters of ZeRO-1/2) — DP partitions summed over the DP group (zero_state.py)."""
        return module_norm(self.engine, local_of, zero_stage=self.zero_stage, partitioned=partitioned,
                           device=self.ctx.device, tp_size=self.ctx.tp_size, autoep=self.autoep)

    def replicas(self) -> list[Replica]:
        """What ranks hold alike under AutoTP + ZeRO ([7], zero_state.py): whole parameters on every rank, TP shards
        on the ranks of their tp_rank, master fragments and moments of whole parameters on their TP group."""
        ctx = self.ctx
        return zero_replicas(self.engine, self.zero_stage, everyone=tuple(range(ctx.world_size)),
                             same_shard=tuple(ctx.layout.dp_group(ctx.rank)),
                             same_partition=tuple(ctx.layout.tp_group(ctx.rank)), tp_size=ctx.tp_size)

    def model_state_bytes(self) -> dict:
        """Where ZeRO keeps the model states (DeepSpeed 0.19.8; docs/benchmark.md has what each stage holds):
        the working parameters (stages 1/2: views of the flat buffers bit16_groups_flat, whole on every rank;
        stage 3: each parameter's ds_tensor partition), the master partition the optimizer updates (fp32 even
        at fp32: a copy of the parameters' partition), the gradients and Adam's state. A gradient waiting in a
        reduce bucket during backward is a gradient: counted by its own bytes (the bucket, reduce_bucket_size
        elements whatever it holds, is a communication buffer). Copies made to compute or communicate are
        counted beside the model states: the full parameters ZeRO-3 gathers (gathered_params) and
        ZeRO-Offload's staging buffers."""
        ledger = StateLedger(self.ctx.device)
        opt, params = self.engine.optimizer, list(self.engine.module.parameters())
        if self.zero_stage == 3:
            ledger.count_by_view(bucket.buffer for bucket in opt.ipg_buckets.values())
            ledger.add_all(PARAMS, (p.ds_tensor for p in params))
            ledger.add_all(GATHERED, params)  # a parameter gathered now (empty otherwise)
            ledger.add_all(MASTER, opt.fp32_partitioned_groups_flat)
            ledger.add_all(GRADS, (t.grad for t in opt.fp32_partitioned_groups_flat))
            ledger.add(GRADS, getattr(opt, "grad_partitions_flat_buffer", None))
        elif hasattr(opt, "fp32_groups_gradients_flat"):  # the BF16 optimizer (ZeRO-1, bf16, fp32 accumulation)
            ledger.add_all(PARAMS, opt.bf16_groups_flat)
            ledger.add_all(PARAMS, (p for p in params if not p.requires_grad))  # LoRA's base: in no flat group
            ledger.add_all(MASTER, opt.fp32_groups_flat_partition)
            ledger.add_all(GRADS, opt.fp32_groups_gradients_flat)  # the fp32 accumulation buffers, whole
        elif hasattr(opt, "fp32_groups"):  # ZeRO-0 over bf16 / fp16 parameters (FP16_UnfusedOptimizer)
            ledger.add_all(PARAMS, params)
            ledger.add_all(MASTER, (m for group in opt.fp32_groups for m in group))
            ledger.add_all(GRADS, (m.grad for group in opt.fp32_groups for m in group))
        elif not hasattr(opt, "optimizer"):  # ZeRO-0 in fp32 or autocast: the client AdamW itself
            ledger.add_all(PARAMS, params)
            ledger.add_all(GRADS, (p.grad for p in params))
            ledger.add_optimizer_state(opt)
            return ledger.result()
        else:
            ledger.count_by_view(buffer for bucket in opt.ipg_buckets.values() for buffer in bucket.buffer)
            ledger.add_all(PARAMS, opt.bit16_groups_flat)
            ledger.add_all(PARAMS, (p for p in params if not p.requires_grad))  # LoRA's base: in no flat group
            ledger.add_all(MASTER, opt.single_partition_of_fp32_groups)
            ledger.add_all(GRADS, (t.grad for t in opt.single_partition_of_fp32_groups))
            ledger.add(GRADS, getattr(opt, "grads_in_partition", None))  # the partition's, once reduced
            ledger.add_all(GRADS, (g for group in (opt.averaged_gradients or {}).values() for g in group or ()))
            ledger.add_all(OFFLOAD_BUFFERS, getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", ()))
            ledger.add(OFFLOAD_BUFFERS, getattr(opt, "temp_grad_buffer_for_cpu_offload", None))
        ledger.add_all(GRADS, (p.grad for p in params))  # before or waiting for their reduction
        ledger.add_optimizer_state(opt.optimizer)
        return ledger.result()

    def full_module_output(self, module_name: str, output: torch.Tensor) -> torch.Tensor:
        """Column-parallel layers (q/k/v/gate/up, the vocab-parallel lm_head) and the MLP activation, which acts on
        gate's shard, give this rank's slice of the last dim; a per-head norm (Qwen3's, Gemma3's q/k norms) its
        heads' slice of the heads dim; everything else is full."""
        with torch.no_grad():
            heads_dim = next((dim for norm, dim in self.family.head_norms.items()
                              if module_name.endswith("." + norm)), None)
            if heads_dim is not None and self.ctx.tp_size > 1:
                import torch.distributed as dist
                from deepspeed.utils import groups

                pieces = [torch.empty_like(output) for _ in range(self.ctx.tp_size)]
                dist.all_gather(pieces, output.contiguous(), group=groups.get_tensor_model_parallel_group())
                return torch.cat(pieces, heads_dim)
            return gather_last_dim(self.column_shards, module_name, output)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master weights, what the optimizer updates (zero_state.full_masters), then over TP and EP."""
        return full_masters(self.engine, self.zero_stage, self._full_tensors, self._local_master)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return self._full_tensors(safe_get_full_grad)

    def full_buffers(self) -> dict[str, torch.Tensor]:
        from parity.models.model import persistent_buffers

        return stock_names(persistent_buffers(self.engine.module), self.autoep, self.ctx.device, experts=False)

    def _full_tensors(self, read) -> dict[str, torch.Tensor]:  # [5], [8]
        """{stock name: full fp32 CPU tensor}: `read` gives this rank's TP shard of a parameter's tensor (gathered over
        DP), the owning AutoTP layer gathers it over TP, AutoEP's experts over EP (gathers.py). Collective."""
        return stock_names(full_tensors(self.engine.module, read), self.autoep, self.ctx.device)

    def save_state(self, directory: str) -> None:  # [6]
        self.engine.save_checkpoint(directory, tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, directory: str) -> None:
        path, _ = self.engine.load_checkpoint(directory, tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:  # DeepSpeed returns None, not an error, when the tag folder is missing
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in {directory}")

    def full_optimizer_state(self):
        """AdamW's moments gathered as full_parameters gathers the master weights (zero_state.full_moments), then over
        TP by each AutoTP layer, AutoEP's experts over EP. Collective."""
        if self.autoep:  # AutoEP's experts keep their moments outside the fragments DeepSpeed's reader knows
            return None  # ("exp_avg not found in optimizer state fragment"): the check compares the grad norm only
        return full_moments(self.engine, self.zero_stage, self._full_tensors, self._local_master)

    def set_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """AdamW's state exists once the engine has stepped: one step with zero gradients at lr 0 creates it
        without moving a weight (AdamW's update and its decoupled weight decay are both × lr). Then each
        moment is cut to this rank's TP shard by the owning AutoTP layer's own partitioning, and DeepSpeed's
        safe_set_full_optimizer_state puts that shard into the ZeRO partitions."""
        from deepspeed.module_inject.layers import TensorParallel_Layer
        from deepspeed.utils import safe_set_full_optimizer_state

        from parity.training.strategy import loss_sum

        ids = torch.zeros((1, 2), dtype=torch.long, device=self.ctx.device)
        with self.autocast():
            logits = self.forward(ids)
        self.backward(loss_sum(logits, ids) * 0.0)
        set_lr(self.engine.optimizer, 0.0)
        self.engine.step()
        seen = set()
        for module_name, module in self.engine.module.named_modules():
            named = [(n, p) for n, p in module.named_parameters(recurse=False)
                     if id(p) not in seen and p.requires_grad]  # LoRA's frozen base has no moments
            seen.update(id(p) for _, p in named)
            for key in ("exp_avg", "exp_avg_sq"):
                full = [moments[f"{module_name}.{n}" if module_name else n][key].clone() for n, _ in named]
                if named and isinstance(module, TensorParallel_Layer):
                    module._tp_partition(full)  # in the layer's own order: weight, then bias
                for (_, p), value in zip(named, full):
                    safe_set_full_optimizer_state(p, value.to(self.ctx.device), key)
        for state in self.engine.optimizer.optimizer.state.values():
            state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step


def check_rank_layout(engine, ctx) -> None:
    """DeepSpeed's TP group must be ranks [dp_rank·tp, (dp_rank+1)·tp) and the group ZeRO averages the
    gradients over the ranks with this tp_rank: the loop feeds every rank of a TP group the same DP slice
    by that rule."""
    tp_ranks, dp_ranks = map(list, autotp_groups(engine, ctx.rank))
    want_tp, want_dp = ctx.layout.tp_group(ctx.rank), ctx.layout.dp_group(ctx.rank)  # the run's (parity/layout.py)
    if (tp_ranks, dp_ranks) != (want_tp, want_dp):
        raise RuntimeError(f"rank {ctx.rank}: DeepSpeed's TP group {tp_ranks} / DP group {dp_ranks} are not the "
                           f"harness's {want_tp} / {want_dp} (rank = dp_rank × tp_size + tp_rank)")
