"""transformers' own distributed training ("transformers"): the path a Hugging Face user takes with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=..., ep_size=...))` — transformers'
device mesh, the model's own tensor-parallel plan (`base_model_tp_plan`), a mixture of experts' expert-parallel plan
(`base_model_ep_plan`: transformers' all-to-all dispatch, experts FSDP2-sharded over the ranks holding the same
ones), its FSDP2 plan for data parallelism — with the
harness's shared AdamW, schedule, clipping and loss. It verifies what Hugging Face users run: new code in
transformers 5, never patched here. When a clean run FAILs, the layer check names the module (docs/model_families.md).

Only what differs from the other DTensor strategy (fsdp_strategy.py, the harness's own plans) is here; the numbered
comments match docs/model_families.md.

[1] The shared initial weights, as loaded on every rank, are written once per machine as a Hugging Face model
    folder (config.json + model.safetensors) in a temporary directory, which from_pretrained then reads as a user's
    checkpoint: each rank loads only its shard (transformers' DtensorShardOperation).
[2] transformers' mesh is (pp, dp_replicate, fsdp, tp): rank = fsdp_rank × tp_size + tp_rank, the harness's layout
    (TP groups are consecutive ranks), checked.
[3] The model's parameters are DTensors (TP on "tp", FSDP2 on "fsdp" when dp_size > 1) or, without FSDP, plain
    tensors where the TP plan leaves a module whole: norms, clipping, full tensors and checkpoints are the DTensor
    strategies' (parity/training/dtensor_strategy.py).
[4] The layer check gathers the outputs transformers' plan leaves local: a colwise projection's (its slice of the
    last dim), the MLP activation's on a colwise gate, a per-head norm's (its heads), a packed projection's.
[5] LoRA (--lora_r), as a Hugging Face user adds it: from_pretrained loads the base (the folder holds it under stock
    names), then peft's get_peft_model adds the adapters to the TP'd model and places them by transformers' plan
    (peft.tuners.lora.model.add_lora_tp_hooks_dtensor): a colwise projection's lora_B colwise, its lora_A whole —
    what the harness's own plan does (plans.adapter_rules). Each rank's adapters then take the run's initial values.
    With expert parallelism at --dp_size 1 (tp × ep) the attention's adapters are placed alike.
    Refused, each in one line: a rowwise projection as a target at --tp_size > 1 (peft 0.21.2 builds its lora_A
    rowwise with the local in_features, which transformers 5.23's RowwiseParallel reads as the full width: the
    first forward fails), a target sharded in another style (peft places none), and FSDP2 (--dp_size > 1):
    from_pretrained applies it before peft adds the adapters, which it then neither shards nor reduces over dp —
    transformers' own FSDP code says PEFT is still to do (transformers/distributed/fsdp.py) — measured: their copies
    part at step 0. And --lora_modules_to_save naming a module the plan shards at --tp_size > 1: peft saves a module
    by deep-copying it, and on rank 1 the vocab-sharded embedding from_pretrained loads (transformers 5.23) holds a
    local tensor whose storage cannot be copied ("invalid python storage"); a module the plan leaves whole (a norm)
    is saved as on one process.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid

import torch
import torch.distributed as dist

from parity.errors import ConfigError, LibraryMissing
from parity.models.adapters import adapter_names, adapter_state, add_adapters, assign_adapters, base_state_dict
from parity.training.dtensor_strategy import DTensorStrategy
from parity.models.families import family_of
from parity.training.strategy import build_optimizer, trainable

LOCAL_STYLES = {"colwise": 1, "packed_colwise": 2}  # TP styles whose output each rank holds its slice of (parts)
PARTIAL_GRAD_STYLE = "replicated_with_grad_allreduce"  # a replicated norm on local heads: its output is local too


class TransformersStrategy(DTensorStrategy):
    name = "transformers"
    zero_stage = 3  # with dp_size > 1, FSDP2 divides parameters, gradients and optimizer state over dp
    takes_adapters = True  # LoRA at --dp_size 1: peft places the adapters beside transformers' colwise projections [5]
    expert_parallel = True  # a mixture of experts' own base_model_ep_plan, transformers' all-to-all dispatch

    @classmethod
    def validate(cls, settings, model_config) -> None:
        try:
            import accelerate  # noqa: F401  (from_pretrained with a device map needs it)
            from transformers import DistributedConfig  # noqa: F401  (transformers' own distributed training)
        except ImportError as exc:
            raise LibraryMissing(cls.name, exc) from None
        from parity.models.model import meta_model

        model = meta_model(model_config)
        family = family_of(model_config)
        for size, plan, what in ((settings.tp_size, model.tp_plan, "tensor-parallel plan (base_model_tp_plan)"),
                                 (settings.dp_size, model.fsdp_plan, "FSDP plan (base_model_fsdp_plan)")):
            if size > 1 and not plan:
                raise ConfigError(f"transformers has no {what} for a '{family.model_type}' model: use --tp_size 1 "
                                  f"and --dp_size 1 there, or train_fsdp.py")
        try:
            distributed_config(settings)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"transformers' DistributedConfig refuses --tp_size {settings.tp_size} × --dp_size "
                              f"{settings.dp_size} × --ep_size {settings.ep_size}: {exc}") from None
        if settings.lora:
            check_adapter_layout(settings, model.tp_plan)
        if settings.compile:
            raise ConfigError("--compile is not supported by the transformers strategy (transformers applies its TP "
                              "by replacing module forwards, which it does not compile): drop it")

    def setup(self, model) -> None:
        from transformers import AutoModelForCausalLM

        self.family = family_of(model.config)
        folder = self._hf_folder(model)  # [1]
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=distributed_config(self.cfg),
                dtype=torch.float32, attn_implementation=model.config._attn_implementation)
        finally:
            dist.barrier()
            if folder.startswith(tempfile.gettempdir()) and self._writes_folder:
                shutil.rmtree(folder, ignore_errors=True)
        if self.cfg.lora is not None:
            self.place_adapters(adapter_state(model))
        del model
        mesh = self.model._device_mesh
        if mesh is None:  # TP 1 × DP 1: transformers makes no mesh and leaves the model where it loaded, on the CPU
            self.model.to(self.ctx.device)
        if mesh is not None:  # [2]
            assert (mesh["fsdp"].get_local_rank(), mesh["tp"].get_local_rank()) == (self.ctx.dp_rank, self.ctx.tp_rank)
            self.mesh, self.tp_mesh = mesh, mesh["tp"]
        if self.cfg.activation_checkpointing:  # the model's own, as a Hugging Face user enables it
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.optimizer = build_optimizer(trainable(self.model.parameters()), self.cfg)
        self.local_outputs = self._local_outputs()

    def place_adapters(self, initial: dict[str, torch.Tensor]) -> None:
        """[5] peft's adapters on the loaded model, placed by transformers' TP plan, with the run's `initial` values (the
        given model's: peft's own draw on each rank is another)."""
        self.model = add_adapters(self.model, self.cfg.lora)
        assign_adapters(self.model, initial)

    def _hf_folder(self, model) -> str:
        """[1] One Hugging Face model folder per machine with the loaded weights: the first rank of each host writes it,
        every rank reads it. The folder's name is rank 0's, so all ranks agree on it."""
        name = [f"parity-transformers-{uuid.uuid4().hex}" if self.ctx.rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        hosts = [None] * self.ctx.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        self._writes_folder = hosts.index(hosts[self.ctx.rank]) == self.ctx.rank
        folder = os.path.join(tempfile.gettempdir(), name[0])
        if self._writes_folder:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
            staging = folder + ".partial"
            # the base alone, under stock names (LoRA's adapters are added to the loaded model: [5])
            base = base_state_dict(model.state_dict(), adapter_names(model)) if self.cfg.lora is not None else None
            model.save_pretrained(staging, safe_serialization=True, state_dict=base)
            os.replace(staging, folder)
        dist.barrier()
        return folder

    def _local_outputs(self) -> dict[str, tuple[int, int]]:
        """[4] {module name with `*` for layer numbers: (the dim its output is sharded on, its parts)} from the model's
        resolved TP plan."""
        plan = self.model.tp_plan if self.ctx.tp_size > 1 else {}
        local = {name: (-1, LOCAL_STYLES[style]) for name, style in plan.items() if style in LOCAL_STYLES}
        stack = self.family.stack + ".*."
        for norm, heads_dim in self.family.head_norms.items():
            if plan.get(stack + norm) == PARTIAL_GRAD_STYLE:
                local[stack + norm] = (heads_dim, 1)
        gate = next((p.name for p in self.family.mlp_in), None)
        if gate and stack + gate in local:
            local[stack + self.family.mlp_act] = (-1, 1)  # the activation of the gate's slice
        return local

    def local_output(self, module_name: str) -> tuple[int, int] | None:
        from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

        return self.local_outputs.get(replace_layer_number_by_wildcard(module_name))


def check_adapter_layout(settings, tp_plan: dict[str, str]) -> None:
    """[5] LoRA's layouts: ConfigError, one line, where the adapters would not train as DDP's do."""
    if settings.dp_size > 1:
        raise ConfigError(f"LoRA under transformers' FSDP2 (--dp_size {settings.dp_size}): from_pretrained shards the "
                          f"model before peft can add the adapters, which FSDP2 then neither shards nor reduces over dp "
                          f"(their copies part at step 0): use --dp_size 1 (transformers' TP), or train_fsdp.py")
    if settings.tp_size == 1:
        return
    sharded = sorted({name.rsplit(".", 1)[-1] for name in tp_plan} & set(settings.lora.get("modules_to_save", [])))
    if sharded:
        raise ConfigError(f"--lora_modules_to_save {','.join(sharded)} at --tp_size {settings.tp_size}: transformers' "
                          f"TP plan shards it, and peft saves a module by deep-copying it, which fails on the shards "
                          f"from_pretrained loads (\"invalid python storage\" on rank 1's embedding): save modules the "
                          f"plan leaves whole (the norms), or use train_fsdp.py")
    odd = sorted((name.rsplit(".", 1)[-1], style) for name, style in tp_plan.items()
                 if name.rsplit(".", 1)[-1] in settings.lora["targets"] and style != "colwise")
    if odd:
        target, style = odd[0]
        why = ("peft builds its lora_A with the local in_features, which transformers' RowwiseParallel reads as the "
               "full width (the first forward fails)" if style == "rowwise" else
               f"peft places adapters beside colwise and rowwise projections only, not '{style}' ones")
        raise ConfigError(f"--lora_targets {target} at --tp_size {settings.tp_size}: transformers' TP plan shards it "
                          f"{style}, and {why}: leave it out of --lora_targets (colwise targets: "
                          f"{', '.join(colwise_targets(tp_plan))}), or use train_fsdp.py")


def colwise_targets(tp_plan: dict[str, str]) -> list[str]:
    """The linear layers transformers' plan shards colwise, by their last name part (what --lora_targets takes)."""
    return sorted({name.rsplit(".", 1)[-1] for name, style in tp_plan.items()
                   if style == "colwise" and name.rsplit(".", 1)[-1] != "lm_head"})


def distributed_config(settings):
    """transformers' DistributedConfig of the run's layout (`settings`: a RunConfig, or the flags before launch): TP,
    FSDP2 over dp, and the model's own expert parallelism at --ep_size."""
    from transformers import DistributedConfig

    return DistributedConfig(tp_size=settings.tp_size, fsdp_size=settings.dp_size, ep_size=settings.ep_size)
