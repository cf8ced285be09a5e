"""The DeepSpeed strategy ("deepspeed"): AutoTP shards the model over TP groups, ZeRO the optimizer state
(and, by stage, gradients and parameters) over DP. The file keeps the design card's name.

Only what differs from DDP is here; the numbered comments match docs/deepspeed.md.

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
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys
import warnings

import torch

from parity.errors import ConfigError, LibraryMissing
from parity.models.families import family_of, transformers_version
from parity.training.memory import GATHERED, GRADS, MASTER, OFFLOAD_BUFFERS, PARAMS, StateLedger
from parity.training.precision import POLICIES, OptimizerStep, PolicyRequest, policy_of
from parity.training.replicas import MOMENTS, Replica
from parity.training.strategy import Option, Strategy, build_optimizer, set_lr, squared_norm_fp64

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu")
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's default for zero_optimization.reduce_bucket_size
CHECKPOINT_TAG = "deepspeed"  # the engine's checkpoint folder inside a checkpoint


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
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

    precisions = tuple(POLICIES)

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
            optimizer = build_optimizer(model.parameters(), self.cfg)  # AutoTP keeps the Parameter objects
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(self.cfg))  # [2]
        self.model = self.engine
        check_rank_layout(self.engine, self.ctx)  # [3]
        if self.cfg.compile:
            self.engine.compile()  # DeepSpeed's own: the engine's whole module
        self.family = family_of(model.config)
        self.column_shards = column_parallel_outputs(self.engine.module, self.family)
        self.autoep = {name: layer for name, layer in self.engine.module.named_modules()
                       if getattr(layer, "_is_autoep_layer", False)}

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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.engine(input_ids=input_ids, use_cache=False).logits  # as Strategy.forward
        return self._gather_last_dim("lm_head", logits)  # [4]

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """The engine's backward, without its own 1/gradient_accumulation_steps (the shared loss is already the
        global batch's token mean); after a micro-batch that is not the last, engine.step() only counts it
        (DeepSpeed reduces and steps at its accumulation boundary, the last micro-batch)."""
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last:
            self.engine.step()

    def optimizer_step(self, lr: float) -> OptimizerStep:
        """DeepSpeed clips (gradient_clipping) and steps; its pre-clip global norm (ZeRO's
        get_grad_norm_direct) sums per-tensor float64 norms, each TP shard once and each replicated tensor
        once, and rounds the total to fp32. Where DeepSpeed reports none (ZeRO-0 over the plain client optimizer:
        fp32, bf16 autocast) the norm is the harness's own, taken before the step as the parameter norm is (each TP
        shard summed over its group, each replicated tensor once). fp16: DeepSpeed's own loss scaler skips an
        overflowing step (was_step_applied)."""
        scale = getattr(self.engine.optimizer, "loss_scale", None) if policy_of(self.cfg).loss_scaling else None
        own = self._module_norm(lambda p: p.grad) / (scale or 1.0) if self.zero_stage == 0 else None
        set_lr(self.engine.optimizer, lr)
        self.engine.step()
        reported = self.engine.get_global_grad_norm()
        norm = float(reported) if reported is not None else own
        if scale is not None:
            return OptimizerStep(norm, skipped=not self.engine.was_step_applied(), loss_scale=float(scale))
        return OptimizerStep(norm)

    def parameter_norm(self) -> float:
        """Over the master weights the optimizer updated (_local_master): each TP shard (DeepSpeed marks them
        tensor_model_parallel) summed over the TP group, each replicated tensor once, DP partitions summed over the DP
        group. Float64, as the grad norm."""
        return self._module_norm(self._local_master, partitioned=self.zero_stage > 0 and self._masters_apart())

    def _masters_apart(self) -> bool:
        """Whether the optimizer steps copies of the parameters (a policy's fp32 masters) rather than the module's."""
        return policy_of(self.cfg).master_copy

    def _local_master(self, p) -> torch.Tensor | None:
        """This rank's part of the master weight of parameter p: ZeRO-3's DP partition of it; ZeRO-1/2's (and the BF16
        optimizer's) fragment of a policy's fp32 master in this rank's partition (_hp_mapping); ZeRO-0's fp32 copy
        (FP16_UnfusedOptimizer's fp32_groups) — or the parameter itself where it is the master (fp32, autocast,
        bf16_pure at stages 0–2: ZeRO copies the updated partitions back)."""
        from deepspeed.utils import safe_get_local_fp32_param

        if self.zero_stage == 3:
            return safe_get_local_fp32_param(p)
        if not self._masters_apart():
            return p
        if self.zero_stage == 0:
            return self._unfused_masters[id(p)]
        mapping = getattr(p, "_hp_mapping", None)  # None: no fragment of it in this rank's partition
        return mapping.get_hp_fragment() if mapping is not None else None

    @functools.cached_property
    def _unfused_masters(self) -> dict[int, torch.Tensor]:
        """ZeRO-0's fp32 master copies, by their parameter's id (DeepSpeed's FP16_UnfusedOptimizer keeps them in
        fp32_groups, parallel to the parameters' fp16_groups, and loads a checkpoint into them in place): found
        once, read for every parameter at every step."""
        opt = self.engine.optimizer
        return {id(p): m for lp, hp in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(lp, hp)}

    def _module_norm(self, local_of, partitioned: bool = False) -> float:
        """The L2 norm, in float64, of `local_of(p)` (this rank's piece of a tensor of parameter p) over the module's
        parameters: TP shards summed over the TP group, replicated tensors once, and — `partitioned` (ZeRO-3, or the
        fp32 masters of ZeRO-1/2) — DP partitions summed over the DP group."""
        import torch.distributed as dist
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.utils import groups

        from deepspeed.moe.utils import is_moe_param

        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # [TP-sharded, replicated]
        experts = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)  # AutoEP's: this rank's experts
        for p in self.engine.module.parameters():
            local = local_of(p)
            if local is None:
                continue
            if is_moe_param(p):
                experts += squared_norm_fp64(local)
            else:
                sums[0 if is_model_parallel_parameter(p) else 1] += squared_norm_fp64(local)
        if partitioned or self.zero_stage == 3:
            dist.all_reduce(sums, group=self.engine.seq_data_parallel_group)
        if self.autoep:  # [8] each rank of an EP group holds other experts
            dist.all_reduce(experts, group=next(iter(self.autoep.values())).ep_group)
            sums[1] += experts[0]
        if self.ctx.tp_size > 1:
            sharded = sums[:1].clone()
            dist.all_reduce(sharded, group=groups.get_tensor_model_parallel_group())
            sums[0] = sharded[0]
        return math.sqrt(float(sums.sum()))

    def replicas(self) -> list[Replica]:
        """What ranks hold alike under AutoTP + ZeRO (DeepSpeed 0.19.8), each with its ranks ([7]):
        - stages 1/2: the module's parameters, whole on every rank (ZeRO all-gathers them from the master partitions
          after each step) — a TP shard on the ranks of its tp_rank, a parameter AutoTP leaves whole (norms, a
          row-parallel layer's bias) on every rank; and the master fragment (fp32; bf16 with --bf16_master_weights)
          and moments of such a whole parameter, on the TP group of their DP partition: the flat partitions of the
          ranks of a TP group hold the same parameters at the same offsets (the piece names the fragment's elements);
        - stage 3: a whole parameter's ZeRO-3 partition, master partition and moments, on the TP group of
          their DP partition (TP shards and their partitions are on no two ranks alike)."""
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.utils import safe_get_local_fp32_param

        ctx = self.ctx
        everyone = tuple(range(ctx.world_size))
        same_shard = tuple(d * ctx.tp_size + ctx.tp_rank for d in range(ctx.dp_size))
        same_partition = tuple(ctx.dp_rank * ctx.tp_size + t for t in range(ctx.tp_size))
        found = []
        for name, p in self.engine.module.named_parameters():
            whole = not is_model_parallel_parameter(p)
            if self.zero_stage == 3:
                if whole and ctx.tp_size > 1:
                    found += [Replica(name, same_partition, p.ds_tensor, "ZeRO-3 partition"),
                              Replica(name, same_partition, safe_get_local_fp32_param(p), "master"),
                              *(Replica(name, same_partition, _zero3_moment(p, key), key) for key in MOMENTS)]
                continue
            ranks = everyone if whole else same_shard
            if len(ranks) > 1:
                found.append(Replica(name, ranks, p))
            fragment = getattr(p, "_hp_mapping", None)
            if whole and ctx.tp_size > 1 and fragment is not None:
                start = fragment.lp_fragment_address.start
                piece = f"[{start}:{start + fragment.lp_fragment_address.numel}]"
                states = fragment.optim_fragment or {}
                found += [Replica(name, same_partition, fragment.hp_fragment, "master", piece),
                          *(Replica(name, same_partition, states.get(key), key, piece) for key in MOMENTS)]
        return found

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
            return self._gather_last_dim(module_name, output)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master weights, what the optimizer updates: gathered over DP by DeepSpeed (safe_get_full_fp32_param),
        or ZeRO-0's whole ones."""
        from deepspeed.utils import safe_get_full_fp32_param

        if self.zero_stage == 0:
            return self._stock_names(self._full_tensors(self._local_master))
        return self._stock_names(self._full_tensors(safe_get_full_fp32_param))  # the master weights, what it updates

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return self._stock_names(self._full_tensors(safe_get_full_grad))

    def full_buffers(self) -> dict[str, torch.Tensor]:
        from parity.models.model import persistent_buffers

        return self._stock_names(persistent_buffers(self.engine.module), experts=False)

    def _stock_names(self, full: dict[str, torch.Tensor], experts: bool = True) -> dict[str, torch.Tensor]:
        """[8] AutoEP's tensors under the stock model's names and layout: its router's (router.gate.weight, the routing
        bias) as the block's gate's, its experts gathered over the EP group and fused back (gate_up_proj = [w1; w3] on
        dim 1, down_proj = w2). Collective (the gathers), in one order on every rank."""
        import torch.distributed as dist

        for block, layer in self.autoep.items():
            for key in [k for k in full if k.startswith(f"{block}.router.")]:
                full[f"{block}.gate." + key.split(".router.", 1)[1].removeprefix("gate.")] = full.pop(key)
            if not experts:
                continue
            whole = {}
            for w in ("w1", "w2", "w3"):
                mine = full.pop(f"{block}.experts.{w}")
                pieces = [torch.empty_like(mine) for _ in range(layer.ep_size)]
                dist.all_gather(pieces, mine.to(self.ctx.device).contiguous(), group=layer.ep_group)
                whole[w] = torch.cat(pieces).cpu()
            full[f"{block}.experts.gate_up_proj"] = torch.cat([whole["w1"], whole["w3"]], dim=1)
            full[f"{block}.experts.down_proj"] = whole["w2"]
        return full

    def save_state(self, directory: str) -> None:  # [6]
        self.engine.save_checkpoint(directory, tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, directory: str) -> None:
        path, _ = self.engine.load_checkpoint(directory, tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:  # DeepSpeed returns None, not an error, when the tag folder is missing
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in {directory}")

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
            named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in named)
            for key in ("exp_avg", "exp_avg_sq"):
                full = [moments[f"{module_name}.{n}" if module_name else n][key].clone() for n, _ in named]
                if named and isinstance(module, TensorParallel_Layer):
                    module._tp_partition(full)  # in the layer's own order: weight, then bias
                for (_, p), value in zip(named, full):
                    safe_set_full_optimizer_state(p, value.to(self.ctx.device), key)
        for state in self.engine.optimizer.optimizer.state.values():
            state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step

    # --- gathers ----------------------------------------------------------------------------------
    def _gather_last_dim(self, module_name: str, t: torch.Tensor) -> torch.Tensor:
        """Concatenate the TP shards of a column-parallel output along the last dim — part by part for a layer whose
        output packs several parts (each rank holds a slice of each). The backward takes this rank's slice of the
        gradient (not the sum over ranks that torch.distributed.nn's all_gather returns): every TP rank computes
        the same loss from the gathered tensor."""
        if module_name not in self.column_shards:
            return t
        group, parts = self.column_shards[module_name]
        per_rank = [sum(widths) for widths in zip(*parts)]
        full = GatherLastDim.apply(group, t, per_rank)
        if len(parts) == 1:
            return full
        pieces = [piece.split([widths[r] for widths in parts], -1) for r, piece in enumerate(full.split(per_rank, -1))]
        return torch.cat([pieces[r][j] for j in range(len(parts)) for r in range(len(per_rank))], -1)

    def _full_tensors(self, read) -> dict[str, torch.Tensor]:  # [5]
        """{HF name: full fp32 CPU tensor} for each parameter once (a tied weight under its first name, as
        named_parameters() gives it). `read` gathers the ZeRO partitions over DP and returns this rank's TP
        shard; the owning AutoTP layer then gathers that along its own split dim (a row-parallel bias is
        replicated and stays as it is). Collective: the same calls in the same order on every rank."""
        from deepspeed.module_inject.layers import TensorParallel_Layer

        full, seen = {}, set()
        for module_name, module in self.engine.module.named_modules():
            named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in named)
            tensors = [read(p).detach().clone() for _, p in named]
            if named and isinstance(module, TensorParallel_Layer):
                module.gather_params(tensors)  # in the layer's own order: weight, then bias
            for (name, _), t in zip(named, tensors):
                full[f"{module_name}.{name}" if module_name else name] = t.float().cpu()
        return full


def _zero3_moment(param, key: str) -> torch.Tensor | None:
    """A ZeRO-3 parameter's partition of an AdamW moment; None before the optimizer's first step made it."""
    from deepspeed.utils import safe_get_local_optimizer_state

    try:
        return safe_get_local_optimizer_state(param, key)
    except KeyError:
        return None


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for this process's device, quietly, without its CPU shared-memory comm op.

    DS_ACCELERATOR is set before the import because the import picks the accelerator for good: a CPU
    worker on a GPU machine (--device cpu) must not get the CUDA one.

    The shm op: creating DeepSpeed's comm backend JIT-compiles `deepspeed_shm_comm` with g++ on the CPU
    accelerator (190 s with an empty extension cache, and a "built successfully" print per rank) although
    only inference_all_reduce uses it, never training. The backend builds it only when DeepSpeed's own
    op-compatibility table says it can (`deepspeed.ops.__compatible_ops__`, the dict it also marks False on
    non-Linux platforms, probed once and kept), so that entry is set False here. DS_BUILD_SHM_COMM only
    affects `pip install`-time pre-building, and replacing comm.torch.build_shm_op would patch code.
    """
    wanted = "cuda" if device.type == "cuda" else "cpu"
    os.environ["DS_ACCELERATOR"] = wanted
    if "deepspeed" in sys.modules:  # imported before the device was known: its accelerator may be wrong
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != wanted:
            raise RuntimeError(f"deepspeed was imported with the {get_accelerator().device_name()} accelerator "
                               f"before the {wanted} worker set DS_ACCELERATOR")
    import deepspeed
    import deepspeed.ops

    deepspeed.utils.logger.setLevel(logging.ERROR)
    # ZeRO's collectives and the logits gather call torch's all_gather_into_tensor/reduce_scatter_tensor,
    # which torch 2.13 marks deprecated: one FutureWarning per rank and call site, nothing to act on here.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


# The keys the run's flags decide: a user's --deepspeed_config must agree with them. (flag, path, value from the
# run's settings); `settings` has the flags as attributes and the strategy's options in .options.
OWNED_KEYS = (
    ("--batch_size / --grad_accum_steps", ("train_micro_batch_size_per_gpu",),
     lambda s: s.batch_size // s.grad_accum_steps),
    ("--grad_accum_steps", ("gradient_accumulation_steps",), lambda s: s.grad_accum_steps),
    ("--max_grad_norm", ("gradient_clipping",), lambda s: s.max_grad_norm),
    ("--zero_stage", ("zero_optimization", "stage"), lambda s: s.options["zero_stage"]),
    ("--tp_size", ("tensor_parallel", "autotp_size"), lambda s: s.tp_size),
)
# Keys a user config may not hold at all: the harness's shared AdamW, lr schedule and global batch are the
# comparison's.
REFUSED_KEYS = {"optimizer": "the shared torch AdamW", "scheduler": "the shared warm-up schedule (--warmup_steps)",
                "train_batch_size": "--batch_size × DP (DeepSpeed counts TP ranks into it)"}
# DeepSpeed's dtype names (communication_data_type, data_types.grad_accum_dtype) → the harness's.
DS_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
             "float16": "fp16", "half": "fp16"}
FP16_SCALER_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                    "min_loss_scale")


def config_policy(user: dict, source: str) -> PolicyRequest | None:
    """The precision policy a DeepSpeed config asks for, with its refinements as DeepSpeed reads them: `bf16` (or
    `bfloat16`) enabled is bf16_params — bf16_pure with bf16_master_weights_and_grads and bf16_optimizer_states —,
    `fp16` enabled is fp16 with its loss-scale keys, `torch_autocast` enabled is bf16; `communication_data_type` is
    the reduce dtype (DeepSpeed's default: the mode's own dtype), `data_types.grad_accum_dtype` the accumulation dtype
    (default: the parameters' dtype). None when it enables none of them (the run's --precision decides)."""
    bf16 = user.get("bf16", user.get("bfloat16")) or {}
    fp16, autocast = user.get("fp16") or {}, user.get("torch_autocast") or {}
    enabled = [name for name, section in (("bf16", bf16), ("fp16", fp16), ("torch_autocast", autocast))
               if section.get("enabled")]
    if len(enabled) > 1:
        raise ConfigError(f"{source} enables both {enabled[0]} and {enabled[1]}: DeepSpeed runs one precision mode: "
                          f"keep one of the sections enabled")
    if not enabled:
        return None
    reduce = _ds_dtype(user.get("communication_data_type"), "communication_data_type", source)
    accum = _ds_dtype((user.get("data_types") or {}).get("grad_accum_dtype"), "data_types.grad_accum_dtype", source)
    if enabled == ["torch_autocast"]:
        if str(autocast.get("dtype", "bfloat16")).replace("torch.", "") not in ("bfloat16", "bf16"):
            raise ConfigError(f"{source}: torch_autocast.dtype {autocast['dtype']}: the harness's autocast policy is "
                              f"bf16 (--precision bf16); fp16 is --precision fp16 (DeepSpeed's fp16 section)")
        return PolicyRequest(source, "bf16", reduce_dtype=reduce, grad_accum_dtype=accum)
    if enabled == ["fp16"]:
        scaling = {k: fp16[k] for k in FP16_SCALER_KEYS if k in fp16}
        return PolicyRequest(source, "fp16", reduce_dtype=reduce or "fp16", grad_accum_dtype=accum or "fp16",
                             loss_scaling=scaling, refines_bf16=False)
    master, states = bf16.get("bf16_master_weights_and_grads"), bf16.get("bf16_optimizer_states")
    if bool(master) != bool(states):
        raise ConfigError(f"{source}: bf16_master_weights_and_grads {json_text(master)} with bf16_optimizer_states "
                          f"{json_text(states)}: the harness's policies keep both in bf16 (bf16_pure) or both in fp32 "
                          f"(bf16_params): set both the same")
    return PolicyRequest(source, "bf16_pure" if master else "bf16_params", reduce_dtype=reduce or "bf16",
                         grad_accum_dtype=accum or "bf16")


def json_text(value) -> str:
    import json

    return json.dumps(value)


def _ds_dtype(value, key: str, source: str) -> str | None:
    if value is None:
        return None
    name = DS_DTYPES.get(str(value).replace("torch.", "").lower())
    if name is None:
        raise ConfigError(f"{source}: {key} {json_text(value)} is not a dtype DeepSpeed takes: use fp32, bf16 or fp16")
    return name


# Paths a DeepSpeed release cannot run on the installed torch, found by running them (docs/deepspeed.md): (releases
# as (first, last) versions, torch at least, the path in words, whether a run takes it, what to do instead). Checked
# before any worker starts, so that the run says so in one line instead of failing inside DeepSpeed's own step.
# Measured on torch 2.13: ZeRO-1 runs on 0.18.5 and 0.18.6 and fails on 0.18.7 and 0.18.9; 0.18.5–0.18.9 assert
# against AutoTP with ZeRO-3 at initialize.
RELEASES_THAT_CANNOT = (
    (("0.18.7", "0.18.99"), "2.13", "ZeRO stages 1 and 2 through its ZeRO optimizer",
     lambda s: s.options["zero_stage"] in (1, 2) and not (
         s.options["zero_stage"] == 1 and POLICIES[s.precision].master_copy and s.grad_accum_dtype == "fp32"
         and s.precision == "bf16_params"),
     "its step all-gathers the updated partitions into split views, which torch 2.13 refuses (\"Output 0 of Split is a "
     "view and is being modified inplace\"): use DeepSpeed 0.19, or --zero_stage 0 or 3"),
    (("0.18.0", "0.18.99"), "0", "AutoTP with ZeRO-3", lambda s: s.tp_size > 1 and s.options["zero_stage"] == 3,
     "it refuses the pair at initialize (\"the compatibility between 'autotp' and 'zero_stage = 3' has not been "
     "validated\"): use DeepSpeed 0.19, --zero_stage 0 with --tp_size 2, or ZeRO-3 at --tp_size 1"),
)


def check_release_runs(version: str, settings) -> None:
    """ConfigError in one line when the installed DeepSpeed release cannot run this run's path on this torch."""
    from packaging.version import Version

    installed, torch_version = Version(version), Version(torch.__version__.split("+")[0])
    for (first, last), torch_min, path, takes, instead in RELEASES_THAT_CANNOT:
        if Version(first) <= installed <= Version(last) and torch_version >= Version(torch_min) and takes(settings):
            raise ConfigError(f"DeepSpeed {version} cannot run {path} on torch {torch.__version__}: {instead}")


def forget_other_tp_layout(tp_size: int) -> None:
    """DeepSpeed keeps its TP and DP groups process-global (deepspeed.utils.groups) once an AutoTP engine made
    them, and every later engine in the process reuses them: a run after one of another TP size in the same
    worker process (runs sharing a worker group, e.g. ZeRO at TP=1 after AutoTP at TP=2) would get the old
    layout's groups, or fail on them. Forget them when the layout differs; the same layout keeps them."""
    from deepspeed.utils import groups

    cached = groups._TENSOR_MODEL_PARALLEL_GROUP
    if cached is not None and torch.distributed.get_world_size(cached) != tp_size:
        groups.mpu = None
        groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None


def user_config(option) -> tuple[str, dict]:
    """(path, content) of --deepspeed_config: a path to read (on the driver), or what read_user_config made of one
    (a recorded run's options: {"file", "config"}). ConfigError for a file that cannot be read."""
    import json

    if isinstance(option, dict):
        return option["file"], option["config"]
    path = option
    try:
        with open(path) as f:
            user = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--deepspeed_config {path} cannot be read ({exc.strerror}): give the path of a JSON "
                          f"file") from None
    except ValueError as exc:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON ({exc}): fix the file") from None
    if not isinstance(user, dict):
        raise ConfigError(f"--deepspeed_config {path} holds a {type(user).__name__}, not a JSON object of "
                          f"DeepSpeed's settings")
    return path, user


def read_user_config(option, settings) -> dict:
    """--deepspeed_config: the JSON file read on the driver (the workers get its content with the run, so the file
    need not exist where they run), checked against the run's flags. {"file", "config"}; ConfigError for a file
    that cannot be read or a key that contradicts a flag. (Its precision keys decided the run's policy already:
    config_policy.)"""
    import json

    path, user = user_config(option)
    for key, why in REFUSED_KEYS.items():
        if key in user:
            raise ConfigError(f"--deepspeed_config {path} sets \"{key}\": the run's comes from {why}: drop the key")
    for flag, path_keys, value in OWNED_KEYS:
        node = user
        for key in path_keys:
            node = node.get(key, _ABSENT) if isinstance(node, dict) else _ABSENT
        want = value(settings)
        if node is not _ABSENT and node != want and not (path_keys == ("tensor_parallel", "autotp_size") and
                                                        want == 1 and node in (0, 1)):
            raise ConfigError(f"--deepspeed_config {path}: {'.'.join(path_keys)} {json.dumps(node)} contradicts "
                              f"{flag} ({json.dumps(want)} for this run): set it with the flag (for the baseline too), "
                              f"or drop the key")
    return {"file": os.path.abspath(path), "config": user}


_ABSENT = object()


def _merged(base: dict, user: dict) -> dict:
    """`base` with `user`'s values over it, section by section."""
    out = dict(base)
    for key, value in user.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def given_config(options: dict) -> dict:
    """The user's --deepspeed_config content, as validate read it (empty without one)."""
    return (options.get("deepspeed_config") or {}).get("config", {})


def check_autoep(model_config, tp_size: int) -> None:
    """ConfigError, before any worker, where DeepSpeed's AutoEP cannot train the family here: at --tp_size > 1 (AutoTP
    refuses the experts' plan), a family it has no preset for, and one whose preset retargets transformers' router-
    logit recorders — qwen3_moe, mixtral — where DeepSpeed 0.19.8 calls transformers' output-capture registry as
    get(key, default) and transformers 5.23's takes the key alone: initialize fails with a TypeError (measured)."""
    import inspect

    from deepspeed.module_inject.auto_ep_presets.base import TransformersTopLevelRouterLogitsAdapter
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset, get_preset_adapter, preset_name_for_hf_model_type
    from transformers.utils import output_capturing

    model_type = model_config.model_type
    if tp_size > 1:
        raise ConfigError(f"DeepSpeed's AutoEP runs at --tp_size 1 here (AutoTP refuses a '{model_type}' model's expert "
                          f"plan): drop --tp_size, or use train_fsdp.py / train_transformers.py for TP with EP")
    preset = preset_name_for_hf_model_type(model_type)
    if preset is None:
        raise ConfigError(f"DeepSpeed {_deepspeed_version()}'s AutoEP has no preset for a '{model_type}' model: use "
                          f"--ep_size 1, or train_fsdp.py / train_transformers.py for expert parallelism")
    adapter = get_preset_adapter(get_preset(preset).preset_adapter or preset)
    takes_default = len(inspect.signature(output_capturing._CAN_RECORD_REGISTRY.get).parameters) > 1
    if isinstance(adapter, TransformersTopLevelRouterLogitsAdapter) and not takes_default:
        raise ConfigError(f"DeepSpeed {_deepspeed_version()}'s AutoEP cannot convert a '{model_type}' model under "
                          f"transformers {transformers_version()}: its router-logits adapter calls transformers' "
                          f"output-capture registry as get(key, default), which this transformers' does not take "
                          f"(a TypeError inside deepspeed.initialize): use train_fsdp.py or train_transformers.py for "
                          f"expert parallelism")




def autotp_partition_config(model_config, user: dict) -> dict | None:
    """How AutoTP shards the model: None where DeepSpeed's own path does it — the user's
    tensor_parallel.partition_config, or the model's Hugging Face TP plan, which DeepSpeed converts when it knows every
    style in it (Llama, Qwen2/3, Gemma3, Mistral) — else a partition_config written from the family seam
    (parity.models.families), where DeepSpeed supports the shapes. ConfigError naming DeepSpeed's limit otherwise.

    The written config (OLMo2, Phi3, whose plans use rowwise_split_input, a style DeepSpeed 0.19.8 refuses): OLMo2's
    q, k, v column-parallel with gathered outputs, because its q/k norms span all heads, and then o_proj replicated
    (DeepSpeed's row-parallel layer takes a split input only); Phi3's attention replicated whole. Phi3 slices its
    fused qkv output at offsets of the attention module's num_key_value_heads, which AutoTP divides by tp_size
    whenever a weight under the module is sharded, gathered output or not (update_mp_params: "Number of heads in key
    and value must divide the number of heads in query"); and DeepSpeed 0.19.8 refuses gather_output with a
    part-by-part shape ("AutoTP gather_output does not yet support shaped sub-parameter layers"). The MLP's gate and
    up (or a fused gate_up, part by part: shape (2, -1)) column-parallel, down_proj row-parallel; an untied lm_head
    column-parallel with a gathered output, as the Hugging Face plan has it."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    from parity.models.model import meta_model

    if (user.get("tensor_parallel") or {}).get("partition_config"):
        return None
    family = family_of(model_config)
    if family.moe:
        raise ConfigError(f"DeepSpeed AutoTP cannot shard a '{family.model_type}' model: DeepSpeed "
                          f"{_deepspeed_version()} refuses its experts' plan (moe_tp_experts) and shards no fused 3-D "
                          f"expert weight: use --tp_size 1 (ZeRO), or train_fsdp.py / train_transformers.py")
    try:
        TPPlanConverter.convert(_get_hf_tp_plan(meta_model(model_config)))
        return None
    except ValueError as exc:
        refused = str(exc).split(":", 1)[-1].split(".", 1)[0].strip()
    if family.why_no_tp:
        raise ConfigError(f"DeepSpeed AutoTP cannot shard a '{family.model_type}' model: its Hugging Face TP plan has "
                          f"styles DeepSpeed {_deepspeed_version()} refuses ({refused}) and the harness cannot describe "
                          f"its layers ({family.why_no_tp}): use --tp_size 1, or train_fsdp.py")

    def spec(name: str, kind: str, **extra) -> dict:
        return {"patterns": [rf".*\.{re.escape(name)}\.weight$"], "partition_type": kind, **extra}

    fused = any(p.fused for p in family.attention_in)
    gathered = bool(family.width_norms)
    specs = [spec(p.name, "skip" if fused else "column", gather_output=gathered) for p in family.attention_in]
    specs.append(spec(family.attention_out, "skip" if fused or gathered else "row"))
    specs += [spec(norm, "skip", grad_allreduce=True) for norm in family.head_norms]
    specs += [spec(p.name, "column", **({"shape": [len(p.parts), -1], "partition_dim": 0} if p.fused else {}))
              for p in family.mlp_in]
    specs.append(spec(family.mlp_out, "row"))
    if not family.tied:
        specs.append({"patterns": [rf"^{re.escape(family.final[-1])}\.weight$"], "partition_type": "column",
                      "gather_output": True})
    return {"use_default_specs": False, "layer_specs": specs}


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def engine_config(cfg) -> dict:
    """The DeepSpeed config: nothing in it may make the training differ from DDP's (docs/deepspeed.md) — but what
    the user's own --deepspeed_config sets, over the harness's DDP-equivalent values (the keys the run's flags
    decide agree with them: read_user_config).

    No train_batch_size: DeepSpeed counts TP ranks as DP ranks in that product (micro × accumulation ×
    world size) and rejects the true global batch; the gradient averaging itself uses the real DP group.
    """
    return _merged(_harness_config(cfg), given_config(cfg.options))


def _harness_config(cfg) -> dict:
    zero = {"stage": cfg.options["zero_stage"], "reduce_bucket_size": cfg.options["reduce_bucket_size"]}
    if zero["stage"] == 3:
        # Every parameter partitioned, as the paper's stage 3: DeepSpeed by default keeps parameters under 1e5
        # elements whole on every rank (for qwen2-tiny, all but the embedding). Numerics are the same either way.
        zero["stage3_param_persistence_threshold"] = 0
    for part in ("optimizer", "param"):
        if cfg.options[f"offload_{part}"] != "none":
            zero[f"offload_{part}"] = {"device": cfg.options[f"offload_{part}"], "pin_memory": cfg.use_cuda}
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size // cfg.grad_accum_steps,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.max_grad_norm,  # 0 = off, as --max_grad_norm; same formula as torch's
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }
    if cfg.options["offload_optimizer"] != "none":
        # Keep the client torch AdamW (the shared optimizer): by default DeepSpeed refuses a client optimizer
        # with ZeRO-Offload and wants DeepSpeedCPUAdam, a JIT-built op (2 minutes of g++ per host) whose
        # arithmetic differs from torch's AdamW (5e-6 of a parameter after a few steps at lr 1e-3).
        config["zero_force_ds_cpu_optimizer"] = False
    if cfg.ep_size > 1:  # [8]
        config["expert_parallel"] = {"enabled": True, "autoep_size": cfg.ep_size}
    if cfg.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": cfg.tp_size}
        from parity.models.model import model_config_from_dict

        partition = autotp_partition_config(model_config_from_dict(cfg.model_config), given_config(cfg.options))
        if partition is not None:
            config["tensor_parallel"]["partition_config"] = partition
    return {**config, **policy_config(cfg)}


def policy_config(cfg) -> dict:
    """The run's precision policy in DeepSpeed's keys (what a user's config that asks for it holds: config_policy).

    bf16: DDP's recipe — bf16 compute under torch.autocast, fp32 parameters, gradients, master weights and Adam state.
    The section is needed although the shared train step already enters autocast: without it the engine switches an
    outer autocast off inside its forward. The empty list keeps every gradient reduction in fp32 (by default DeepSpeed
    would reduce the gradients of nn.Linear layers in bf16). bf16_params: DeepSpeed's bf16 mode (bf16 parameters and
    gradients, fp32 master partitions and Adam state), bf16_pure the same with bf16 masters and states, fp16 its fp16
    mode with the run's loss scaler. A reduce or accumulation dtype other than the parameters' is
    communication_data_type / data_types.grad_accum_dtype."""
    policy = policy_of(cfg)
    if policy.name == "fp32":
        return {}
    if policy.name == "bf16":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
    if policy.name == "fp16":
        config = {"fp16": {"enabled": True, **cfg.loss_scaling}}
    else:
        pure = policy.name == "bf16_pure"
        config = {"bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                               if pure else {})}}
    if cfg.reduce_dtype != policy.params:
        config["communication_data_type"] = cfg.reduce_dtype
    if cfg.grad_accum_dtype != policy.params:
        config["data_types"] = {"grad_accum_dtype": cfg.grad_accum_dtype}
    return config


def check_rank_layout(engine, ctx) -> None:
    """DeepSpeed's TP group must be ranks [dp_rank·tp, (dp_rank+1)·tp) and the group ZeRO averages the
    gradients over the ranks with this tp_rank: the loop feeds every rank of a TP group the same DP slice
    by that rule."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    tp_ranks = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()) if ctx.tp_size > 1 else [ctx.rank]
    dp_ranks = dist.get_process_group_ranks(engine.seq_data_parallel_group)
    want_tp = [ctx.dp_rank * ctx.tp_size + t for t in range(ctx.tp_size)]
    want_dp = [d * ctx.tp_size + ctx.tp_rank for d in range(ctx.dp_size)]
    if (tp_ranks, dp_ranks) != (want_tp, want_dp):
        raise RuntimeError(f"rank {ctx.rank}: DeepSpeed's TP group {tp_ranks} / DP group {dp_ranks} are not the "
                           f"harness's {want_tp} / {want_dp} (rank = dp_rank × tp_size + tp_rank)")


def column_parallel_outputs(hf_model, family) -> dict[str, tuple]:
    """{module name: (TP group, the per-rank widths of each part of its output)} for every module whose output is this
    rank's slice of the last dim: AutoTP's column-parallel layers that do not gather their output themselves (a
    sub-parameter layer, a fused gate_up, holds a slice of each part), and each MLP's activation, which acts on the
    slice of the gate part (the family's mlp_act). DeepSpeed 0.18's LinearLayer has neither is_tp_parallel,
    gather_output nor _partition_sizes: every one is column-parallel, never gathers, and splits its outputs evenly
    (torch.chunk) over the TP group; 0.18 has no sub-parameter layers."""
    from deepspeed.module_inject import layers

    shards = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, getattr(layers, "SubParamLinearLayer", ())) and module.is_tp_parallel:
            shards[name] = (module.mp_group, [list(w) for w in module._subparam_shard_widths])
        elif isinstance(module, layers.LinearLayer) and getattr(module, "mp_group", None) is not None and \
                getattr(module, "is_tp_parallel", True) and not getattr(module, "gather_output", False):
            even = [module.weight.shape[0]] * module.tp_world_size
            shards[name] = (module.mp_group, [list(getattr(module, "_partition_sizes", even))])
    if family.mlp_in:
        gate = "." + family.mlp_in[0].name
        for name in [n for n in shards if n.endswith(gate)]:
            group, parts = shards[name]
            shards[name.removesuffix(gate) + "." + family.mlp_act] = (group, parts[:1])
    return shards


class GatherLastDim(torch.autograd.Function):
    """The TP shards of a column-parallel output concatenated along the last dim (exactly: a copy), on every rank of
    the TP group; the backward takes this rank's slice of the gradient — not the sum over ranks that
    torch.distributed.nn's all_gather returns (every TP rank computes the same loss from the gathered tensor, so the
    sum would multiply the gradient by tp_size). DeepSpeed 0.19's GatherFromTensorParallelRegion does the same; 0.18
    has none."""

    @staticmethod
    def forward(ctx, group, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        ctx.sizes, ctx.rank = sizes, dist.get_rank(group)
        pieces = [torch.empty((*t.shape[:-1], width), dtype=t.dtype, device=t.device) for width in sizes]
        dist.all_gather(pieces, t.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.split(ctx.sizes, dim=-1)[ctx.rank].contiguous(), None
