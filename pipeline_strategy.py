"""Pipeline parallelism on torch.distributed.pipelining: the decoder layers split into stages over --pp_size ranks,
run by a GPipe, 1F1B or interleaved 1F1B schedule in --microbatches micro-batches, data parallelism over --dp_size
pipelines (num_workers = pp_size × dp_size; rank = dp_rank × pp_size + pp_rank, a pipeline's ranks consecutive:
the run's layout, parity/layout.py, whose rank groups it builds its process groups from).

Stages: --num_layers split evenly, in order, over pp_size stages (gpipe, 1f1b) or 2 × pp_size (interleaved_1f1b:
stage s on pipeline rank s mod pp_size, so each rank holds two). The first stage holds the embedding before its
layers, the last its layers, then the final norm and lm_head (the model family's names: parity.models.families).
Each stage runs the stock model's own forward with the layers of other stages passed through (stage_view), so what
it computes around its layers — position ids, each layer type's mask and rotary table, an embedding scale, logit
soft-capping — is the stock model's for any family, under the run's autocast (fp32, or bf16 as DDP:
ddp_strategy.py), and the hidden states a stage sends are the stock model's, in the dtype they are computed in (fp32
under autocast, the parameters' dtype in bf16_params, bf16_pure and fp16). Every precision policy as DDP carries it:
the shared PolicyOptimizer (fp32 masters, fp16's loss scaler, docs/precision.md), the DP all-reduce in the policy's
reduce dtype.

Tied embedding: a tied model (Qwen2, Qwen3, Gemma3) ties lm_head to embed_tokens, and the two ends of a pipeline sit
on different ranks. The first stage keeps embed_tokens.weight, the last gets lm_head.weight as a copy of it (equal at
the start); after backward the two gradients are summed over a two-rank group of the first and the last stage's
ranks, so each copy holds the tied weight's whole gradient and AdamW gives both the same update: one weight, kept in
two places. Norms count it once (the first stage's copy); the full parameters name it once, as model.embed_tokens.weight.
The ties are read off the model (a parameter reached under two names: parity.models.model.tied_aliases), so a saved
module's tied pair (--lora_modules_to_save embed_tokens: peft's frozen original and trained copy, each tied to
lm_head's) is kept in two places alike.

Data parallelism over the pipelines: DDP-style — every DP rank of a stage holds that stage's full parameters and
the shared AdamW over them, and after the schedule's backward its gradients are all-reduced (one flat buffer per
rank) over the stage's DP group and divided by dp_size. Not FSDP2: its reduce-scatter per micro-batch (or its
no-sync bookkeeping under a schedule that calls backward per chunk) would be a second moving part beside the
pipeline's, and sharded gradients would make the tied-weight sum, the norms across stages and the full tensors
collectives over two meshes; a plain all-reduce is DDP's arithmetic (sum of each rank's gradient ÷ dp_size), so
the only differences left from the baseline are the micro-batches' partial sums.

Loss and gradient scale: the schedule's loss_fn is the shared micro-batch sum (Strategy.micro_batch_sum: the token-loss
sum, or the run's objective's, parity/objectives) × dp_size / the step's divisor (the global batch's loss tokens, or
the objective's), with scale_grads=False: summed over micro-batches and averaged over DP, the gradients are those of
the step's loss, as DDP's. Clipping
is by the global norm (squared norms in float64, summed over the pipeline's ranks, the tied weight once), with the
shared clip_coefficient, then the shared AdamW steps each rank's parameters.

LoRA (--lora_r: parity/models/adapters.py): peft's adapters sit inside the decoder layers, so each stage holds its
layers' adapters and trains those alone; the frozen base is split into the stages with them, the tied embedding's
copy on the last stage frozen too (nothing to sum, unless the embedding is saved whole: its trained copy's two
gradients are summed). The optimizer, the norms and each tensor's pieces take the trained
parameters; the full parameters every tensor, the base included (the final model, the teacher-forced check).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parity.errors import ConfigError
from parity.models.families import family_of
from parity.models.model import tied_aliases
from parity.precision import DTYPES, POLICIES, policy_of
from parity.training.data import Batch
from parity.training.memory import StateLedger
from parity.training.policy_optimizer import PolicyOptimizer
from parity.training.replicas import Replica, held
from parity.training.strategy import (IGNORE_INDEX, ModuleRecords, Option, Piece, Strategy,
                                      squared_norm_fp64)
from parity.strategies.pipeline.stages import (SCHEDULES, STAGES_PER_RANK, StageModule, microbatches_fit,
                                               microbatches_requirement, rank_tree, stage_count, stage_view,
                                               state_file)



class PipelineStrategy(Strategy):
    name = "pipeline"
    tensor_parallel = False
    pipeline_parallel = True  # --pp_size, a layout flag (parity/layout.py): the run's cfg.pp_size, ctx.pp_size
    takes_adapters = True  # LoRA: each stage steps its layers' adapters (module docstring)
    reads_at_clip = True  # its PolicyOptimizer's step hands the gradients to the tensor record where it takes the norm
    clips_as_torch = True  # its PolicyOptimizer's step
    follows_loss_scales = True  # its PolicyOptimizer's scaler (scaler_of)
    precisions = tuple(name for name, policy in POLICIES.items() if not policy.frozen_apart)  # sends one dtype
    options = (
        Option("pp_schedule", "1f1b", choices=tuple(SCHEDULES),
               help="the torch.distributed.pipelining schedule: gpipe, 1f1b, or interleaved_1f1b (two stages per "
                    "rank: 2 × pp_size stages)"),
        Option("microbatches", None, type=int,
               help="micro-batches each DP rank's batch is split into, --pp_size when not given; --batch_size must be "
                    "a multiple of it"),
    )

    @classmethod
    def layer_stages(cls, options: dict, pp_size: int) -> int:
        return stage_count(options["pp_schedule"], pp_size)

    @classmethod
    def validate(cls, settings, model_config) -> None:
        super().validate(settings, model_config)
        o, p = settings.options, settings.pp_size  # the layout's degrees are checked already (parity.layout)
        if family_of(model_config).moe:
            raise ConfigError(f"the pipeline does not train a mixture of experts ('{model_config.model_type}'): its "
                              f"load-balancing loss is one product of statistics of every stage's routers over the "
                              f"global batch (docs/moe.md), and a stage sees only its own: use train_fsdp.py or "
                              f"train_ddp.py")
        family = family_of(model_config)
        if not family.pipeline_plan:
            raise ConfigError(f"the pipeline cannot split a '{model_config.model_type}' model: transformers ships no "
                              f"pipeline plan for {family.causal_lm} (base_model_pp_plan), which lays out the stages' "
                              f"inputs and outputs: use train_ddp.py or train_fsdp.py")
        outside = family.outside
        if outside:
            raise ConfigError(f"the pipeline cannot split a '{model_config.model_type}' model: its "
                              f"{', '.join(outside[:3])}{' …' if len(outside) > 3 else ''} lie outside the embedding, "
                              f"the decoder stack and the final modules its stages run: use train_ddp.py or "
                              f"train_fsdp.py")
        stages, layers = stage_count(o["pp_schedule"], p), model_config.num_hidden_layers
        if layers % stages:
            fit = layers - layers % stages or stages
            raise ConfigError(f"the model's {layers} layers do not divide into the {stages} stages of --pp_schedule "
                              f"{o['pp_schedule']} at --pp_size {p}: use --num_layers {fit} (a multiple of {stages}) "
                              f"or fewer stages")
        if o["microbatches"] is None:
            o["microbatches"] = p
        m = o["microbatches"]
        if m < 1:
            raise ConfigError(f"--microbatches must be a positive integer (got {m})")
        if not microbatches_fit(o["pp_schedule"], p, m):
            raise ConfigError(f"--microbatches {m} does not fit --pp_schedule {o['pp_schedule']} at --pp_size {p}, "
                              f"which needs {microbatches_requirement(o['pp_schedule'], p, m)}")
        if settings.batch_size % m:
            raise ConfigError(f"--batch_size {settings.batch_size} is not a multiple of --microbatches {m}: each "
                              f"micro-batch is batch_size / microbatches samples; use --batch_size "
                              f"{settings.batch_size - settings.batch_size % m or m} or another --microbatches")
        if settings.grad_accum_steps != 1:
            raise ConfigError(f"--grad_accum_steps {settings.grad_accum_steps}: the pipeline accumulates over its "
                              f"micro-batches: use --microbatches (and --grad_accum_steps 1)")
        if settings.grad_accum_dtype != POLICIES[settings.precision].params:
            raise ConfigError(f"--grad_accum_dtype {settings.grad_accum_dtype}: the pipeline's schedule accumulates its "
                              f"micro-batches in the gradients' {POLICIES[settings.precision].params}: drop the flag")
        for flag in ("activation_checkpointing", "compile"):
            if getattr(settings, flag):
                raise ConfigError(f"--{flag} is not supported by the pipeline strategy: drop it")

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self, model) -> None:
        o, ctx, layout = self.cfg.options, self.ctx, self.ctx.layout
        assert ctx.tp_size == 1, layout  # validate refuses --tp_size
        self.P = P = ctx.pp_size
        self.pp_ranks = layout.pp_group(ctx.rank)  # this pipeline's ranks, by pipeline rank
        # Every rank creates every group, in one order (new_group is collective over the world): each pipeline, each
        # DP group (a stage's ranks), and each pipeline's two ends (the tied weight's copies).
        pipelines, stage_ranks = layout.pp_groups(), layout.dp_groups()
        pp_groups = [dist.new_group(ranks) for ranks in pipelines]
        dp_groups = [dist.new_group(ranks) for ranks in stage_ranks]
        tie_groups = [dist.new_group([ranks[0], ranks[-1]]) for ranks in pipelines]
        mine = pipelines.index(self.pp_ranks)
        self.pp_group, self.tie_group = pp_groups[mine], tie_groups[mine]
        self.dp_group = dp_groups[stage_ranks.index(layout.dp_group(ctx.rank))]

        config, family = model.config, family_of(model.config)
        self.family = family
        self.hidden_size = config.hidden_size
        # the tied weights: {lm_head's name: the embedding's} (stock: lm_head.weight; with --lora_modules_to_save
        # peft's frozen original and trained copy, each tied), read off the model before the last stage unties them
        self.ties = tied_aliases(model)
        n = stage_count(o["pp_schedule"], P)
        per_stage = config.num_hidden_layers // n
        self.num_stages, self.per_stage = n, per_stage
        self.my_stages = [s for s in range(n) if s % P == ctx.pp_rank]
        self.has_first, self.has_last = 0 in self.my_stages, n - 1 in self.my_stages
        model.to(ctx.device)
        layers = model.get_submodule(family.stack)
        self.layer_params = sum(p.numel() for p in layers.parameters())
        # the whole model's names in its own order (a tied lm_head once), LoRA's adapters among them, and what trains
        self.full_names = [n for n, _ in model.named_parameters()]
        self.trained_names = [n for n, p in model.named_parameters() if p.requires_grad]
        # the tied weights that train (LoRA freezes the base: nothing to sum but a trained copy of it)
        self.trained_ties = [(alias, source) for alias, source in sorted(self.ties.items())
                             if model.get_parameter(source).requires_grad]
        if self.has_last:  # this rank's own copy of each tied weight (stage 0's rank keeps the embedding's)
            for alias, source in self.ties.items():
                owner, _, leaf = alias.rpartition(".")
                shared = model.get_parameter(source)
                setattr(model.get_submodule(owner), leaf,
                        nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad))
        # The rank's modules under Hugging Face names (hf_model), and each stage's view of the stock model.
        owned = ([family.embedding] if self.has_first else []) + (list(family.final) if self.has_last else [])
        self.model = rank_tree(model, family, owned, [i for s in self.my_stages
                                                      for i in range(s * per_stage, (s + 1) * per_stage)])
        self.stage_modules = {s: StageModule(stage_view(model, family, range(s * per_stage, (s + 1) * per_stage),
                                                        last=s == n - 1), s == 0, s == n - 1, self.autocast)
                              for s in self.my_stages}
        # the parameters in the policy's dtype
        self.policy_optimizer = PolicyOptimizer(self.model.parameters(), self.cfg)
        self.optimizer = self.policy_optimizer.optimizer
        from torch.distributed import pipelining

        self.stages = [pipelining.PipelineStage(self.stage_modules[s], s, n, ctx.device,
                                                **self._stage_examples(s, config), group=self.pp_group)
                       for s in self.my_stages]
        schedule = getattr(pipelining, SCHEDULES[o["pp_schedule"]])
        self.schedule = schedule(self.stages if STAGES_PER_RANK[o["pp_schedule"]] > 1 else self.stages[0],
                                 n_microbatches=o["microbatches"], loss_fn=self._micro_batch_loss, scale_grads=False)
        self._loss_scale, self._sums = 1.0, []

    def _stage_examples(self, stage: int, config) -> dict[str, torch.Tensor | None]:
        """A micro-batch's input and output of `stage`, and their gradients (shape and dtype): given to PipelineStage,
        they spare torch's metadata inference — a forward and backward of the first micro-batch inside the first
        step, which would run every module once more than the step does (and the layer check records every module
        call). Token ids in, hidden states between stages in the parameters' dtype (fp32 under autocast: the residual
        stream stays fp32), logits out in the compute dtype. Static metadata must say which inputs get a gradient
        (torch sends back none for one that does not require it)."""
        rows, seq = self.cfg.batch_size // self.cfg.options["microbatches"], self.cfg.seq_length
        if self.cfg.padding_free:  # one row of the micro-batch's length (micro_batches)
            rows, seq = 1, rows * seq
        device = self.ctx.device
        hidden = torch.empty(rows, seq, config.hidden_size, device=device, dtype=self.hidden_dtype)
        last = stage == self.num_stages - 1
        logits_dtype = policy_of(self.cfg).compute_dtype()
        received = hidden.detach().requires_grad_()  # received hidden states need a gradient, sent back
        return {"input_args": torch.zeros(rows, seq, dtype=torch.long, device=device) if stage == 0 else received,
                "output_args": torch.empty(rows, seq, config.vocab_size, dtype=logits_dtype, device=device) if last
                else hidden,
                "output_grads": None if last else hidden, "input_grads": None if stage == 0 else hidden}

    def _counted(self):
        """(name, parameter) of this rank, each weight once: the tied lm_head copy is the embedding's."""
        return [(n, p) for n, p in self.model.named_parameters() if n not in self.ties]

    def _trained(self):
        """_counted's parameters that train: all of them, or LoRA's adapters (what the norms and pieces cover)."""
        return [(n, p) for n, p in self._counted() if p.requires_grad]

    @property
    def hf_model(self):
        return self.model

    # --- the train step ---------------------------------------------------------------------------
    @property
    def hidden_dtype(self) -> torch.dtype:
        """The hidden states' dtype between stages: the parameters' (fp32 under autocast: the residual stream stays
        fp32)."""
        return DTYPES[policy_of(self.cfg).params]

    def _micro_batch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: the micro-batch's sum (Strategy.micro_batch_sum: its token-loss sum, or the run's
        objective's over its rollout rows) × dp_size / the step's divisor (× fp16's loss scale). The schedule calls it
        for the micro-batches in order, whose labels it is handed (checked)."""
        micro = self._fed[len(self._sums)]
        assert torch.equal(labels, micro.labels), "the schedule's micro-batches came out of order"
        summed = self.micro_batch_sum(logits, micro, self._divisor, self.ctx.dp_size * len(self._fed))
        self._sums.append(summed.detach())
        return summed * self._loss_scale * self.loss_scale

    def micro_batches(self, batch) -> list:
        """--microbatches parts of `batch` (the schedule's split); under --padding_free each flattened into one row and
        filled up to the micro-batch's rows × seq_length with a document of token 0 labelled −100 (no loss, and no
        token of another document attends to it): the schedule's stages exchange tensors of one shape."""
        parts = batch.split(self.cfg.options["microbatches"])
        if not self.cfg.padding_free:
            return parts
        fed = []
        for micro in parts:
            flat, length = micro.flattened(), micro.input_ids.numel()
            fill = length - flat.input_ids.shape[1]
            padded = [torch.cat([t, torch.full((1, fill), value, dtype=t.dtype, device=t.device)], 1)
                      for t, value in ((flat.input_ids, 0), (flat.labels, IGNORE_INDEX))]
            positions = torch.cat([flat.position_ids, torch.arange(fill, device=flat.position_ids.device)[None]], 1)
            fed.append(Batch(*padded, position_ids=positions))
        return fed

    def forward_backward(self, batch, global_tokens: int) -> torch.Tensor:
        """The schedule's forward and backward over the micro-batches of this DP rank's `batch`, then the tied-weight
        sum and the DP all-reduce: every rank holds the global batch's gradients of its parameters. Returns this
        pipeline's token-loss sum (float64) on its last stage's rank, 0 on the others. Position ids (packed or
        flattened rows) go to every stage's rank, which the schedule splits as it splits the ids."""
        fed = self.micro_batches(batch.to(self.ctx.device))
        self._loss_scale, self._sums = self.ctx.dp_size / global_tokens, []
        self._fed, self._divisor, self.objective_stats = fed, global_tokens, None
        self.schedule.step(*((torch.cat([m.input_ids for m in fed]),) if self.has_first else ()),
                           target=torch.cat([m.labels for m in fed]) if self.has_last else None,
                           losses=[] if self.has_last else None, return_outputs=False, **self.stage_kwargs(fed))
        self.reduce_gradients()
        local_sum = self._zero()
        if self.has_last:
            assert len(self._sums) == self.cfg.options["microbatches"], len(self._sums)
            local_sum = sum(s.double() for s in self._sums)
        return local_sum

    def stage_kwargs(self, fed: list) -> dict:
        """What this rank gives the schedule for every stage it holds besides the first stage's ids: the micro-batches'
        position ids where they carry them (packed or flattened rows), which every stage needs — its layers' rotary
        angles and transformers' per-document mask are computed from them in each stage's own forward."""
        return {} if fed[0].position_ids is None else {"position_ids": torch.cat([m.position_ids for m in fed])}

    def reduce_gradients(self) -> None:
        """After the schedule's backward: the tied weight's two gradients summed (each rank's embedding and lm_head
        parts, as one tied Parameter accumulates them in DDP), then every gradient averaged over the stage's DP
        group. Both copies of the tied weight then hold the same gradient."""
        self.sum_tied_gradients()
        if self.ctx.dp_size > 1:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = _flatten_dense_tensors(grads).to(DTYPES[self.cfg.reduce_dtype])  # the policy's reduce dtype
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.ctx.dp_size)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

    def sum_tied_gradients(self) -> None:
        for alias, source in self.trained_ties:  # in one order on both ends
            if self.has_first:
                dist.all_reduce(self.model.get_parameter(source).grad, group=self.tie_group)
            if self.has_last:
                dist.all_reduce(self.model.get_parameter(alias).grad, group=self.tie_group)

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.ctx.device)

    def _pipeline_sum(self, value: torch.Tensor) -> float:
        """A float64 sum over this pipeline's ranks (every DP replica holds the same values)."""
        total = value.detach().to(self.ctx.device, torch.float64).reshape(())
        dist.all_reduce(total, group=self.pp_group)
        return float(total)

    @torch.no_grad()
    def optimizer_step(self, lr: float):
        """The shared PolicyOptimizer's step, clipped by the pipeline's global norm: squared norms summed over its
        ranks, the tied weight once."""
        norm_of = lambda grads: math.sqrt(self._pipeline_sum(sum((squared_norm_fp64(g) for g in grads),  # noqa: E731
                                                                 self._zero())))
        return self.policy_optimizer.step(lr, norm_of, counted=[p for _, p in self._trained()],
                                          before_norm=self.record_gradients)

    def tensor_names(self) -> list[str]:
        """The whole model's trainable names on every rank, in its order (the tied lm_head once, as the embedding;
        LoRA's adapters alone where the base is frozen): a rank holds the pieces of its stages only."""
        return self.trained_names

    def gradient_pieces(self) -> list[Piece]:
        """This rank's stages' gradients, reduced over the stage's DP group and the tied weight's two copies summed (the
        first stage's copy only: _trained), counted on the stage's first DP rank."""
        return self._pieces(self.policy_optimizer.gradient_of)

    def parameter_pieces(self) -> list[Piece]:
        return self._pieces(self.policy_optimizer.master_of)

    def _pieces(self, tensor_of) -> list[Piece]:
        counted = self.ctx.dp_rank == 0  # every DP rank of a stage holds its tensors alike
        return [Piece(n, tensor_of(p), counted) for n, p in self._trained()]

    def parameter_norm(self) -> float:
        local = sum((squared_norm_fp64(self.policy_optimizer.master_of(p)) for _, p in self._trained()), self._zero())
        return math.sqrt(self._pipeline_sum(local))

    def backward(self, loss, last: bool = True) -> None:
        raise NotImplementedError("the pipeline's schedule runs forward and backward together: use forward_backward")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The full-vocabulary logits of this DP rank's slice on every rank of its pipeline (the final evaluation):
        the stages run in order, each sending its hidden states to the next, and the last stage's rank broadcasts
        the logits over the pipeline — as many as a DDP rank computes for the same slice. Every stage takes the
        position ids (packed rows')."""
        h = input_ids.to(self.ctx.device)
        hidden = (h.shape[0], h.shape[1], self.hidden_size)
        me = self.ctx.pp_rank
        for s in self.my_stages:
            if s > 0 and (s - 1) % self.P != me:
                h = torch.empty(hidden, dtype=self.hidden_dtype, device=self.ctx.device)
                dist.recv(h, src=self.pp_ranks[(s - 1) % self.P])
            h = self.stage_modules[s](h, position_ids)
            if s < self.num_stages - 1 and (s + 1) % self.P != me:
                dist.send(h.to(self.hidden_dtype).contiguous(), dst=self.pp_ranks[(s + 1) % self.P])
        last = self.pp_ranks[(self.num_stages - 1) % self.P]
        meta = [(tuple(h.shape), h.dtype) if self.has_last else None]
        dist.broadcast_object_list(meta, src=last, group=self.pp_group)
        logits = h.contiguous() if self.has_last else torch.empty(meta[0][0], dtype=meta[0][1], device=self.ctx.device)
        dist.broadcast(logits, src=last, group=self.pp_group)
        return logits

    def dp_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each DP rank's row, read from its pipeline's last rank (where the loss is computed)."""
        return [rows[ranks[(self.num_stages - 1) % self.P]] for ranks in self.ctx.layout.pp_groups()]

    # --- full tensors -----------------------------------------------------------------------------
    def _share(self, mine: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each pipeline rank's `mine` (tensors by key), as fp32 CPU tensors, on every rank of the pipeline: each rank
        in turn broadcasts its keys and shapes, then its tensors as one flat buffer. Collective over the pipeline."""
        shared = []
        for r in range(self.P):
            me = r == self.ctx.pp_rank
            meta = [[(k, tuple(t.shape)) for k, t in mine.items()] if me else None]
            dist.broadcast_object_list(meta, src=self.pp_ranks[r], group=self.pp_group)
            sizes = [math.prod(shape) for _, shape in meta[0]]
            if me:
                flat = torch.cat([t.detach().float().reshape(-1) for t in mine.values()]) if mine else \
                    torch.empty(0, device=self.ctx.device)
            else:
                flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.ctx.device)
            dist.broadcast(flat, src=self.pp_ranks[r], group=self.pp_group)
            shared.append({k: piece.view(shape).cpu().clone() for (k, shape), piece in zip(meta[0], flat.split(sizes))})
        return shared

    def _gather_full(self, local: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Full fp32 CPU tensors under Hugging Face names on every rank, in a stock model's order. Names whose tensor
        is None on its rank are left out."""
        out = {k: t for part in self._share({n: t for n, t in local.items() if t is not None}) for k, t in part.items()}
        return {n: out[n] for n in self.full_names if n in out}

    def stage_of(self, module_name: str) -> int:
        """The stage that runs a module (by its Hugging Face name)."""
        stack = self.family.stack + "."
        if module_name.startswith(stack):
            return int(module_name[len(stack):].split(".")[0]) // self.per_stage
        return 0 if module_name.startswith(self.family.embedding) else self.num_stages - 1

    def full_module_records(self, records: ModuleRecords) -> ModuleRecords:
        """Every stage's module records on every rank: outputs in stage order (forward), output gradients in reverse
        stage order (backward), each stage's in the order its rank recorded them."""
        kinds = {"output": records.outputs, "output_grad": records.output_grads}
        parts = self._share({f"{kind}/{name}": t for kind, store in kinds.items() for name, t in store.items()})
        keyed = [(key.split("/", 1), t) for part in parts for key, t in part.items()]

        def ordered(kind: str, sign: int) -> dict[str, torch.Tensor]:
            mine = [(name, t) for (k, name), t in keyed if k == kind]
            return dict(sorted(mine, key=lambda item: sign * self.stage_of(item[0])))  # stable: each rank's order kept
        return ModuleRecords(ordered("output", 1), ordered("output_grad", -1))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._gather_full({n: self.policy_optimizer.master_of(p) for n, p in self._counted()})

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._gather_full({n: p.grad for n, p in self._counted()})

    def replica_params(self, num_params: int) -> float:
        """The layers ÷ pp_size, plus what no pipeline splits: a rank at either end holds the tied embedding (the
        last its copy) and the final norm besides its layers."""
        return self.layer_params / self.P + (num_params - self.layer_params)

    def replicas(self) -> list[Replica]:
        """Each stage's parameters and their moments on every DP rank of the stage (its DP all-reduce makes them from
        one value), and the tied weight's two copies — the embedding's on the first stage, lm_head's on the last — as
        one replica of both ranks of every pipeline, under the embedding's name (the sum of their gradients makes them
        from one)."""
        last = (self.num_stages - 1) % self.P
        ends = tuple(sorted({ranks[r] for ranks in self.ctx.layout.pp_groups() for r in (0, last)}))
        stage = tuple(self.ctx.layout.dp_group(self.ctx.rank))
        found = []
        for name, p in self.model.named_parameters():
            tied = name in self.ties or name in self.ties.values()
            ranks, name = (ends, self.ties.get(name, name)) if tied else (stage, name)
            if len(ranks) > 1:
                found += held(name, ranks, p, self.optimizer, self.policy_optimizer.master_of(p))
        return found

    def model_state_bytes(self) -> dict:
        """This rank's stages: their parameters (the last stage's copy of the tied weight included), gradients and
        Adam's state of them."""
        ledger = StateLedger(self.ctx.device)
        self.policy_optimizer.count_state(ledger, list(self.model.parameters()))
        return ledger.result()

    def full_optimizer_state(self):
        """Every stage's AdamW moments under HF names (the tied lm_head's copy left out, as full_parameters does),
        gathered from every rank as objects: each rank holds its stages' whole tensors. Collective."""
        mine, count = {}, 0
        for name, p in self.model.named_parameters():
            state = self.optimizer.state.get(self.policy_optimizer.master_of(p))
            if state and name not in self.ties:
                mine[name] = {k: state[k].detach().float().cpu().clone() for k in ("exp_avg", "exp_avg_sq")}
                count = int(state["step"])
        gathered = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (mine, count))
        return {name: m for part, _ in gathered for name, m in part.items()}, max(c for _, c in gathered)

    def set_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """AdamW's state of another run, {HF name: moments}, for this rank's parameters (the tied lm_head copy gets
        the embedding's)."""
        self.policy_optimizer.set_moments(
            [(p, moments[self.ties.get(name, name)])
             for name, p in self.model.named_parameters() if p.requires_grad], step)

    # --- checkpoints ------------------------------------------------------------------------------
    def save_state(self, directory: str) -> None:
        """Each pipeline rank of DP rank 0 writes its stages' model and optimizer state to a file of its own."""
        if self.ctx.dp_rank == 0:
            torch.save({"model": self.model.state_dict(), **self.policy_optimizer.state_dict()},
                       os.path.join(directory, state_file(self.ctx.pp_rank)))

    def load_state(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, state_file(self.ctx.pp_rank)), map_location=self.ctx.device,
                           weights_only=True)
        self.model.load_state_dict(state["model"])
        self.policy_optimizer.load_state_dict(state)
