"""The DeepSpeed strategy ("deepspeed"): AutoTP shards the model over TP groups, ZeRO the optimizer state
(and, by stage, gradients and parameters) over DP. The file keeps the design card's name.

Only what differs from DDP is here; the numbered comments match docs/deepspeed.md.

[1] DeepSpeed is imported on the worker once the device is known, because the import picks its
    accelerator; the driver imports it only in validate(), on the CPU one, to fail before launch.
[2] The engine config: AutoTP of --tp_size, ZeRO --zero_stage, the shared AdamW as the client
    optimizer, --max_grad_norm as DeepSpeed's own clipping, and the precision policy.
[3] DeepSpeed builds its TP and DP groups itself; they must be the harness's layout (consecutive ranks
    form a TP group), or the data slices and the gathers would pair the wrong ranks.
[4] AutoTP makes the tied embedding and lm_head vocab-parallel, so the logits are this rank's vocab
    shard; they are gathered (exactly) so the shared loss sees the full vocabulary.
[5] Full tensors: ZeRO partitions gathered over DP by DeepSpeed's safe_get_full_* helpers, TP shards by
    each AutoTP layer's own gather_params.
[6] Checkpoints: the engine's own save_checkpoint / load_checkpoint (every rank its model and ZeRO files).
[7] --ep_size > 1: DeepSpeed's AutoEP (expert_parallel in the engine config) replaces each sparse block by its own
    layer — its router (router.gate), the experts unfused and EP-sharded (w1 gate, w3 up, w2 down: [E / ep, ...]),
    the shared experts kept — inside initialize, so the shared AdamW is handed over as a callable DeepSpeed calls on
    the replaced parameters, in the MoE parameter groups ZeRO requires (the same hyperparameters in every group).
    Full tensors come back under the stock model's names and layout (gate_up_proj = [w1; w3], gathered over EP).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import warnings

import torch

from parity.errors import ConfigError, LibraryMissing
from parity.training.families import family_of
from parity.training.memory import GATHERED, GRADS, MASTER, OFFLOAD_BUFFERS, PARAMS, StateLedger
from parity.training.strategy import Option, Strategy, build_optimizer, set_lr, squared_norm_fp64

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu")
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's default for zero_optimization.reduce_bucket_size
CHECKPOINT_TAG = "deepspeed"  # the engine's checkpoint folder inside a checkpoint


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    expert_parallel = True  # DeepSpeed's AutoEP, where 0.19.8 runs the family (check_autoep)
    options = (
        Option("zero_stage", 1, type=int, choices=ZERO_STAGES,
               help="ZeRO stage: 1 shards the optimizer state over DP, 2 also the gradients, 3 also the "
                    "parameters (0 is rejected: DeepSpeed reports no gradient norm there)"),
        Option("bf16_master_weights", False,
               help="DeepSpeed's bf16 mode with bf16 master weights, gradients and Adam moments "
                    "(bf16_master_weights_and_grads + bf16_optimizer_states, seed 001's setting) instead of "
                    "autocast over fp32 master weights like DDP; needs --precision bf16"),
        Option("offload_optimizer", "none", choices=OFFLOAD,
               help="cpu: ZeRO-Offload — the fp32 master partition, its gradients and Adam's state in host memory, "
                    "the optimizer step on the CPU (with the same torch AdamW)"),
        Option("offload_param", "none", choices=OFFLOAD,
               help="cpu: ZeRO-3's parameter partitions in host memory between uses (--zero_stage 3 only)"),
        Option("deepspeed_config", None, type=str,
               help="your own DeepSpeed config (a JSON file): its keys are kept (ZeRO settings, data types, communication "
                    "dtype, bucket sizes ...) under the keys the run's flags decide — micro-batch and accumulation, "
                    "clipping (--max_grad_norm), --zero_stage, --tp_size, precision — which must agree with them "
                    "(docs/deepspeed.md); a key it omits gets the harness's DDP-equivalent value, not DeepSpeed's default"),
        Option("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_SIZE,
               help="elements of gradient ZeRO reduces at once (zero_optimization.reduce_bucket_size; default "
                    "DeepSpeed's, 5e8). ZeRO-2 and ZeRO-3 free the gradients outside their partition each time a "
                    "bucket fills, so during backward they hold less than ZeRO-1 only for a model larger than this"),
    )

    @classmethod
    def validate(cls, settings, model_config) -> None:
        stage = settings.options["zero_stage"]
        if stage == 0:
            raise ConfigError("--zero_stage 0: DeepSpeed runs without ZeRO there and reports no pre-clip gradient norm "
                              "(get_global_grad_norm() is None), which the record needs; use --zero_stage 1 (the "
                              "default: the same numerics, the optimizer state sharded over DP), 2 or 3")
        if settings.options["offload_param"] != "none" and stage != 3:
            raise ConfigError(f"--offload_param {settings.options['offload_param']} needs --zero_stage 3 (stages 1 "
                              f"and 2 do not partition parameters, and DeepSpeed ignores the setting there): pass "
                              f"--zero_stage 3, or use --offload_optimizer cpu")
        if settings.options["bf16_master_weights"] and settings.options["offload_optimizer"] != "none":
            raise ConfigError("--bf16_master_weights with --offload_optimizer cpu: DeepSpeed keeps bf16 master weights "
                              "in host memory only with its DeepSpeedCPUAdam, not the shared torch AdamW: drop one "
                              "of the two")
        if settings.options["reduce_bucket_size"] < 1:
            raise ConfigError(f"--reduce_bucket_size must be a positive number of elements (got "
                              f"{settings.options['reduce_bucket_size']}): DeepSpeed's default is "
                              f"{DEEPSPEED_REDUCE_BUCKET_SIZE}")
        if settings.options["bf16_master_weights"] and settings.precision != "bf16":
            raise ConfigError(f"--bf16_master_weights is a bf16 setting but --precision is {settings.precision}: "
                              f"pass --precision bf16 with it, or drop it")
        if settings.options["deepspeed_config"] is not None:
            settings.options["deepspeed_config"] = read_user_config(settings.options["deepspeed_config"], settings)
        try:  # fail here, before any worker, if DeepSpeed cannot be imported; the driver computes nothing
            import_deepspeed(torch.device("cpu"))
        except ImportError as exc:
            raise LibraryMissing(cls.name, exc) from None
        if settings.tp_size > 1:
            autotp_partition_config(model_config, user_config(settings.options))  # raises for a family it cannot shard
        if settings.ep_size > 1:
            check_autoep(model_config, settings.tp_size)

    # --- worker side ------------------------------------------------------------------------------
    def setup(self, model) -> None:
        deepspeed = import_deepspeed(self.ctx.device)  # [1]
        if self.cfg.activation_checkpointing:  # the Hugging Face model's own, as DeepSpeed's HF integration uses
            model.activation_checkpointing_enable()
        forget_other_tp_layout(self.cfg.tp_size)
        if self.cfg.ep_size > 1:  # [7] AutoEP replaces parameters inside initialize: the optimizer is built after
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
        """[7] The shared AdamW over the parameters AutoEP left, in DeepSpeed's MoE parameter groups."""
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return build_optimizer(split_params_into_different_moe_groups_for_optimizer(
            {"params": list(params), "name": "parity"}), self.cfg)

    def router_module(self, name: str) -> str:
        """[7] An AutoEP layer's router is its own module (`router`), where the stock block has `gate`."""
        block = name.rsplit(".", 1)[0]
        return f"{block}.router" if block in self.autoep else name
    @property
    def zero_stage(self) -> int:
        return self.cfg.options["zero_stage"]

    @property
    def state_precision(self) -> str:
        return "bf16_master_weights" if self.cfg.options["bf16_master_weights"] else "fp32"

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

    def optimizer_step(self, lr: float) -> float:
        """DeepSpeed clips (gradient_clipping) and steps; its pre-clip global norm (ZeRO's
        get_grad_norm_direct) sums per-tensor float64 norms, each TP shard once and each replicated tensor
        once, and rounds the total to fp32."""
        set_lr(self.engine.optimizer, lr)
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def parameter_norm(self) -> float:
        """Over the module's parameters as the engine left them after the step (ZeRO-1/2 copy the updated
        master partitions back; ZeRO-3 keeps each parameter as DP partitions of its fp32 master): each TP
        shard (DeepSpeed marks them tensor_model_parallel) summed over the TP group, each replicated tensor
        once, ZeRO-3 partitions summed over the DP group. Float64, as the grad norm."""
        import torch.distributed as dist
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.utils import groups, safe_get_local_fp32_param

        from deepspeed.moe.utils import is_moe_param

        zero3 = self.cfg.options["zero_stage"] == 3
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # [TP-sharded, replicated]
        experts = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)  # AutoEP's: this rank's experts
        for p in self.engine.module.parameters():
            local = safe_get_local_fp32_param(p) if zero3 else p
            if is_moe_param(p):
                experts += squared_norm_fp64(local)
            else:
                sums[0 if is_model_parallel_parameter(p) else 1] += squared_norm_fp64(local)
        if zero3:
            dist.all_reduce(sums, group=self.engine.optimizer.dp_process_group)
        if self.autoep:  # [7] each rank of an EP group holds other experts
            dist.all_reduce(experts, group=next(iter(self.autoep.values())).ep_group)
            sums[1] += experts[0]
        if self.ctx.tp_size > 1:
            sharded = sums[:1].clone()
            dist.all_reduce(sharded, group=groups.get_tensor_model_parallel_group())
            sums[0] = sharded[0]
        return math.sqrt(float(sums.sum()))

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
        from deepspeed.utils import safe_get_full_fp32_param

        return self._stock_names(self._full_tensors(safe_get_full_fp32_param))  # the master weights, what the optimizer updates

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return self._stock_names(self._full_tensors(safe_get_full_grad))

    def full_buffers(self) -> dict[str, torch.Tensor]:
        from parity.training.model import persistent_buffers

        return self._stock_names(persistent_buffers(self.engine.module), experts=False)

    def _stock_names(self, full: dict[str, torch.Tensor], experts: bool = True) -> dict[str, torch.Tensor]:
        """[7] AutoEP's tensors under the stock model's names and layout: its router's (router.gate.weight, the routing
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
        from deepspeed.module_inject.layers import GatherFromTensorParallelRegion

        group, parts = self.column_shards[module_name]
        per_rank = [sum(widths) for widths in zip(*parts)]
        full = GatherFromTensorParallelRegion.apply(group, t, per_rank)
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
    ("--precision / --bf16_master_weights", ("bf16", "enabled"),
     lambda s: s.precision == "bf16" and s.options["bf16_master_weights"]),
    ("--precision", ("torch_autocast", "enabled"),
     lambda s: s.precision == "bf16" and not s.options["bf16_master_weights"]),
)
# Keys a user config may not hold at all: the harness's shared AdamW, lr schedule and global batch are the
# comparison's, and fp16 is no precision of the harness.
REFUSED_KEYS = {"optimizer": "the shared torch AdamW", "scheduler": "the shared warm-up schedule (--warmup_steps)",
                "train_batch_size": "--batch_size × DP (DeepSpeed counts TP ranks into it)", "fp16": "--precision"}


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


def read_user_config(path: str, settings) -> dict:
    """--deepspeed_config: the JSON file read on the driver (the workers get its content with the run, so the file
    need not exist where they run), checked against the run's flags. {"file", "config"}; ConfigError for a file
    that cannot be read or a key that contradicts a flag."""
    import json

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


def user_config(options: dict) -> dict:
    """The user's --deepspeed_config content (empty without one)."""
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
                          f"transformers {_transformers_version()}: its router-logits adapter calls transformers' "
                          f"output-capture registry as get(key, default), which this transformers' does not take "
                          f"(a TypeError inside deepspeed.initialize): use train_fsdp.py or train_transformers.py for "
                          f"expert parallelism")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def autotp_partition_config(model_config, user: dict) -> dict | None:
    """How AutoTP shards the model: None where DeepSpeed's own path does it — the user's
    tensor_parallel.partition_config, or the model's Hugging Face TP plan, which DeepSpeed converts when it knows every
    style in it (Llama, Qwen2/3, Gemma3, Mistral) — else a partition_config written from the family seam
    (parity.training.families), where DeepSpeed supports the shapes. ConfigError naming DeepSpeed's limit otherwise.

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

    from parity.training.model import meta_model

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
    user = (cfg.options.get("deepspeed_config") or {}).get("config", {})
    return _merged(_harness_config(cfg), user)


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
    if cfg.ep_size > 1:  # [7]
        config["expert_parallel"] = {"enabled": True, "autoep_size": cfg.ep_size}
    if cfg.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": cfg.tp_size}
        from parity.training.model import model_config_from_dict

        partition = autotp_partition_config(model_config_from_dict(cfg.model_config), user_config(cfg.options))
        if partition is not None:
            config["tensor_parallel"]["partition_config"] = partition
    if cfg.precision == "bf16" and cfg.options["bf16_master_weights"]:
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    elif cfg.precision == "bf16":
        # DDP's policy: bf16 compute under torch.autocast, fp32 parameters, gradients, master weights and Adam
        # state. Needed although the shared train step already enters autocast: without this section the
        # engine switches an outer autocast off inside its forward. The empty list keeps every gradient
        # reduction in fp32 (by default DeepSpeed would reduce the gradients of nn.Linear layers in bf16).
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return config


def check_rank_layout(engine, ctx) -> None:
    """DeepSpeed's TP group must be ranks [dp_rank·tp, (dp_rank+1)·tp) and the group ZeRO averages the
    gradients over the ranks with this tp_rank: the loop feeds every rank of a TP group the same DP slice
    by that rule."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    tp_ranks = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()) if ctx.tp_size > 1 else [ctx.rank]
    dp_ranks = dist.get_process_group_ranks(engine.optimizer.dp_process_group)
    want_tp = [ctx.dp_rank * ctx.tp_size + t for t in range(ctx.tp_size)]
    want_dp = [d * ctx.tp_size + ctx.tp_rank for d in range(ctx.dp_size)]
    if (tp_ranks, dp_ranks) != (want_tp, want_dp):
        raise RuntimeError(f"rank {ctx.rank}: DeepSpeed's TP group {tp_ranks} / DP group {dp_ranks} are not the "
                           f"harness's {want_tp} / {want_dp} (rank = dp_rank × tp_size + tp_rank)")


def column_parallel_outputs(hf_model, family) -> dict[str, tuple]:
    """{module name: (TP group, the per-rank widths of each part of its output)} for every module whose output is this
    rank's slice of the last dim: AutoTP's column-parallel layers that do not gather their output themselves (a
    sub-parameter layer, a fused gate_up, holds a slice of each part), and each MLP's activation, which acts on the
    slice of the gate part (the family's mlp_act)."""
    from deepspeed.module_inject.layers import LinearLayer, SubParamLinearLayer

    shards = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, SubParamLinearLayer) and module.is_tp_parallel:
            shards[name] = (module.mp_group, [list(w) for w in module._subparam_shard_widths])
        elif isinstance(module, LinearLayer) and module.is_tp_parallel and not module.gather_output:
            shards[name] = (module.mp_group, [list(module._partition_sizes)])
    if family.mlp_in:
        gate = "." + family.mlp_in[0].name
        for name in [n for n in shards if n.endswith(gate)]:
            group, parts = shards[name]
            shards[name.removesuffix(gate) + "." + family.mlp_act] = (group, parts[:1])
    return shards
