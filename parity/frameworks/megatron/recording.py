"""A megatron-core training loop recorded without a line of the job changed (docs/megatron.md#what-is-recorded): under
verify_trainer.py (sitehook/sitecustomize.py calls `install` where its variables are set), when megatron-core's
modules are first imported,

- `get_megatron_optimizer` is wrapped to note each MegatronOptimizer it builds and the model chunks it steps;
- `get_forward_backward_func` is wrapped so that the function it returns — the one every Megatron loop calls once a
  step, whichever schedule — starts the recording at its first training call (the model as the job built it, before
  any step: the initial weights), then hands each micro-batch over as the job's `forward_step_func` feeds it;
- `torch.distributed.destroy_process_group` completes the record first (at exit otherwise).

Each micro-batch: the GPTModel's calls give the rows (the first pipeline stage's input ids, and the labels the last
stage takes the per-token losses of: Megatron's labels are already the next tokens), the job's loss function its loss
mask — the tensor of the rows' shape it is a `functools.partial` of, as Megatron-LM's `partial(loss_func, loss_mask)`
— and its loss, which must be the masked token mean of the model's per-token losses (or, with
calculate_per_token_loss, their masked sum and token count) that the record's rows give. A row as the replay feeds
it: the input ids and one more token (the last label), labels −100 then the targets, −100 where the mask is 0.

The optimizer's `prepare_grads` (its first act in `step()`: the FP32 optimizer points each parameter's `grad` at the
DP-reduced `main_grad`; in fp16 it also unscales them and looks for an overflow) ends by reading the gradients before
the clip (`before_step`); its `step()` ends with the step's record, Megatron's own grad norm kept beside the
recorder's — in fp16 with the step's loss scale and whether the scaler skipped it (`loss_scaling` below).

Each chunk's GPTModel forward is wrapped rather than hooked (Megatron-FSDP calls it directly): the ids from the chunk
that embeds (the first virtual stage of the first pipeline stage), the labels from the one that takes the losses. A
mixture of experts' routers are read by hooks during the training calls (moe.py): the step's router losses and
expert loads join its record entry.

Refused in one line on every rank, and the job stops with exit status 2 before it trains: what frameworks/megatron/
config.py and view.py refuse, a loop that calls the forward-backward function before building its optimizer.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import math

from parity.attaching import attach
from parity.attaching.import_hook import when_imported
from parity.frameworks import guarded, release_refusal, stop_record

OPTIMIZERS: list = []  # (MegatronOptimizer, model chunks) as get_megatron_optimizer built them


def install() -> None:
    when_imported("megatron.core.optimizer", _wrap_optimizer_builder)
    for name in ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel"):
        when_imported(name, _wrap_schedule_getter)


def _wrap_optimizer_builder(module) -> None:
    build = module.get_megatron_optimizer
    if getattr(build, "_parity", False):
        return

    @functools.wraps(build)
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = build(config, model_chunks, *args, **kwargs)
        OPTIMIZERS.append((optimizer, list(model_chunks)))
        return optimizer

    get_megatron_optimizer._parity = True
    module.get_megatron_optimizer = get_megatron_optimizer


def _wrap_schedule_getter(module) -> None:
    get = module.get_forward_backward_func
    if getattr(get, "_parity", False):
        return

    @functools.wraps(get)
    def get_forward_backward_func(*args, **kwargs):
        return _recorded(get(*args, **kwargs))

    get_forward_backward_func._parity = True
    module.get_forward_backward_func = get_forward_backward_func


RECORDINGS: dict[int, "MegatronRecording"] = {}  # by the id of the model's first chunk


def _recorded(forward_backward):
    @functools.wraps(forward_backward)
    def recorded(*args, **kwargs):
        bound = inspect.signature(forward_backward).bind(*args, **kwargs)
        arguments = bound.arguments
        if arguments.get("forward_only", False):
            return forward_backward(*args, **kwargs)
        model = arguments["model"]
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if id(chunks[0]) not in RECORDINGS:
            RECORDINGS[id(chunks[0])] = _started(model)
        recording = RECORDINGS[id(chunks[0])]
        if recording is None:  # not recorded (said once): the job's own call
            return forward_backward(*args, **kwargs)
        arguments["forward_step_func"] = recording.forward_step(arguments["forward_step_func"])
        recording.taking(True)
        try:
            losses = forward_backward(*bound.args, **bound.kwargs)
        finally:
            recording.taking(False)
        recording.after_forward_backward()
        return losses

    return recorded


def _started(model) -> "MegatronRecording | None":
    """The model's recording, or None where this megatron-core release is outside the range recorded or the room
    fails on it (one line: the job trains on unrecorded)."""
    why = release_refusal()
    if why:
        stop_record(_started, why)
        return None
    try:
        return MegatronRecording(model)
    except Exception as exc:
        from parity.errors import first_line

        stop_record(_started, f"megatron-core: {type(exc).__name__}: {first_line(exc)}")
        return None


class MegatronRecording:
    """One megatron-core model's recording (the module docstring): checked at its first training step (a refusal
    stops the job, exit 2), the recorder started there."""

    def __init__(self, model):
        import importlib.metadata as md

        import torch.distributed as dist

        from parity.frameworks.megatron.config import MegatronRefused, hf_config
        from parity.frameworks.megatron.view import MegatronView, gpt_models
        from parity.frameworks.megatron.moe import RouterStatistics
        from parity.models.model import meta_model
        from parity.recording.recorder import ParityRecorder
        from parity.recording.world import exchange_device

        chunks = model if isinstance(model, (list, tuple)) else [model]
        found = [opt for opt, stepped in OPTIMIZERS if any(c is chunks[0] for c in stepped)]
        try:
            if not found:
                raise MegatronRefused("no MegatronOptimizer of get_megatron_optimizer steps this model: build the "
                                      "optimizer before the first forward-backward call")
            self.modules = gpt_models(model)  # one a virtual pipeline stage
            self.module = self.modules[0]
            config = self.module.config
            # a recorded row is one token longer than the job's (its last label): within the replay's positions
            hf = meta_model(hf_config(config, self.module.vocab_size, self.module.max_sequence_length + 1,
                                      getattr(self.module, "rotary_base", 10000.0),
                                      self.module.share_embeddings_and_output_weights,
                                      self.module.position_embedding_type))
            self.view = MegatronView(self.modules, found[-1], hf, config, exchange_device())
        except MegatronRefused as exc:
            attach.stop_command(f"megatron-core: {exc}")
        self.optimizer = found[-1]
        folder, name = attach.variables()
        settings = self.optimizer.config  # bf16 / fp16: Float16Module's parameters, the optimizer's fp32 masters
        half = "bf16" if settings.bf16 else "fp16" if settings.fp16 else None
        self.recorder = ParityRecorder(folder, name=name, model=self.view, optimizer=self.view.optimizer,
                                       max_grad_norm=float(settings.clip_grad),
                                       precision={"bf16": "bf16_params", "fp16": "fp16"}.get(half, "fp32"),
                                       framework="megatron-core",
                                       framework_versions={"megatron-core": md.version("megatron-core")})
        if self.recorder.enabled and half:  # main_grad accumulates the micro-batches and is reduced in its dtype
            reduce = "fp32" if getattr(chunks[0], "ddp_config", None) is None or \
                chunks[0].ddp_config.grad_reduce_in_fp32 else half
            self.recorder.record.data["config"].update(reduce_dtype=reduce, grad_accum_dtype=reduce)
        if self.recorder.enabled and half == "fp16":  # its scaler's settings; each step's scale and skip (below)
            self.recorder.record.data["config"]["loss_scaling"] = loss_scaling(settings)
        self.routers = RouterStatistics(self.modules, config, self.view) if config.num_moe_experts else None
        self.labels = None  # the last GPTModel call's labels
        self.ids: list = []  # this step's GPTModel calls' input ids, in order (the first stage's: the rows')
        self.taken: list = []  # this step's (labels, mask, summed loss), one a loss function's call (the last stage's)
        self.logged: float | None = None  # the step's loss as Megatron takes it (after_forward_backward)
        self.losses: list[float] = []  # this step's micro-batches' losses as the job's loss function returned them
        for chunk in self.modules:
            self._take_rows(chunk)
        self._patch_optimizer()
        dist_destroy = dist.destroy_process_group

        def destroy_process_group(group=None):
            if group is None or group is dist.group.WORLD:  # the job's end (a subgroup's destruction is not)
                self.close()
            return dist_destroy(group)

        dist.destroy_process_group = destroy_process_group
        atexit.register(self.close)

    def taking(self, on: bool) -> None:
        """Whether the routers' statistics are taken: during a training call of the forward-backward function."""
        if self.routers is not None:
            self.routers.taking = on

    def _take_rows(self, chunk) -> None:
        """`chunk`'s forward wrapped (not hooked: Megatron-FSDP calls the GPTModel's forward itself) to take the rows:
        the input ids of the chunk that embeds them (the first virtual stage of the first pipeline stage), the labels
        of the one that takes the losses (the last of the last)."""
        forward = chunk.forward

        @functools.wraps(forward)
        def forward_taking_rows(*args, **kwargs):
            self._rows(chunk, forward, args, kwargs)
            return forward(*args, **kwargs)

        chunk.forward = forward_taking_rows

    @guarded
    def _rows(self, chunk, forward, args, kwargs) -> None:
        bound = inspect.signature(forward).bind(*args, **kwargs).arguments
        if chunk.pre_process:
            self.ids.append(bound.get("input_ids"))
        if chunk.post_process:
            self.labels = bound.get("labels")

    def forward_step(self, forward_step_func):
        """The job's forward step, its loss function wrapped to hand the micro-batch over."""

        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            output, loss_func = forward_step_func(*args, **kwargs)
            return output, self._loss(loss_func, output)

        return forward_step

    def _loss(self, loss_func, output):
        @functools.wraps(loss_func)
        def loss(*args, **kwargs):
            result = loss_func(*args, **kwargs)
            self._micro_batch(loss_func, output, result)
            return result

        return loss

    @guarded
    def _micro_batch(self, loss_func, output, result) -> None:
        """One loss function's call: its micro-batch's labels, mask and summed loss, checked against what it returned;
        handed over with the rows' ids once the step's forward-backward is done (after_forward_backward)."""
        import torch

        labels, rec = self.labels, self.recorder
        if labels is None:
            rec.broken = "the GPTModel was called without labels: the recorder takes its per-token losses"
            return
        with torch.no_grad():
            given = [a for a in getattr(loss_func, "args", ()) + tuple(getattr(loss_func, "keywords", {}).values())
                     if isinstance(a, torch.Tensor) and a.numel() == labels.numel()]
            mask = given[0].reshape(labels.shape).bool() if given else torch.ones_like(labels, dtype=torch.bool)
            summed = float((output.detach().double().reshape(labels.shape) * mask).sum())
            tokens = int(mask.sum())
            loss = float(result[0].detach().double())
            expected = summed / max(tokens, 1) if len(result) == 2 else summed
            if abs(loss - expected) > 1e-5 * max(abs(expected), 1.0):
                rec.broken = (f"the job's loss function returned {loss:.6g} where the masked token mean of GPTModel's "
                              f"per-token losses is {expected:.6g}: a loss the recorder cannot replay")
                return
            self.losses.append(loss if len(result) == 2 else summed / max(tokens, 1))
            self.taken.append((labels.detach().clone(), mask, summed))

    @guarded
    def after_forward_backward(self) -> None:
        """The step's micro-batches handed over — each row the first pipeline stage's input ids and one more token
        (the last label), labels −100 then the targets, −100 where the mask is 0 — and the step's loss as Megatron's
        per-micro-batch mean averaged over DP (the logged loss the record keeps), every rank told it."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from parity.recording.rows import next_token_rows

        ids, self.ids = self.ids, []
        if ps.get_pipeline_model_parallel_world_size() > 1:  # the first stage's ids, to every stage
            group = ps.get_pipeline_model_parallel_group()
            sent = [ids if ps.is_pipeline_first_stage() else None]
            dist.broadcast_object_list(sent, src=dist.get_process_group_ranks(group)[0], group=group)
            ids = sent[0]
        for (labels, mask, summed), fed in zip(self.taken, ids):
            row_ids, row_labels = next_token_rows(fed, labels, mask)
            self.recorder.micro_batch(row_ids, row_labels, None, attention_mask=torch.ones_like(row_ids),
                                      use_cache=False, summed_loss=summed)
        self.taken = []
        feeds = self.view.feeds
        mean = torch.tensor([sum(self.losses) * feeds, len(self.losses) * feeds], dtype=torch.float64,
                            device=self.view.device)
        dist.all_reduce(mean)
        self.logged = float(mean[0] / mean[1]) if mean[1] else None
        self.losses = []
        if self.routers is not None:  # a mixture of experts: the step's router losses and expert loads
            self.recorder.step_extras = self.routers.step()
            self.recorder.broken = self.recorder.broken or self.routers.broken

    def _patch_optimizer(self) -> None:
        """prepare_grads ends by reading the gradients (unscaled, in fp16: where megatron-core looked for an overflow);
        step() ends with the step's record — in fp16 with the scale the step's gradients were computed with (read
        before the step: prepare_grads updates it) and whether megatron-core skipped the step (its success flag)."""
        optimizer, rec = self.optimizer, self.recorder
        prepare, step = optimizer.prepare_grads, optimizer.step
        fp16 = bool(optimizer.config.fp16)

        def prepare_grads(*args, **kwargs):
            found_inf = prepare(*args, **kwargs)
            rec.before_step()
            return found_inf

        def step_(*args, **kwargs):
            scale = self._loss_scale() if fp16 else None
            out = step(*args, **kwargs)
            self._after_step(out, scale)
            return out

        optimizer.prepare_grads, optimizer.step = prepare_grads, step_

    @guarded
    def _loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())

    @guarded
    def _after_step(self, out, scale: float | None) -> None:
        """The step's record; in fp16 (`scale`: the one its gradients were computed with) whether megatron-core's
        scaler skipped it (step()'s success flag)."""
        norm = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if scale is not None:
            self.recorder.step_extras.update(skipped=not (out[0] if isinstance(out, tuple) else True), loss_scale=scale)
        self.recorder.after_step(logged_loss=self.logged, logged_grad_norm=None if norm is None else float(norm))

    @guarded
    def close(self) -> None:
        import torch.distributed as dist

        if self.recorder.enabled and dist.is_initialized():
            self.recorder.close()


def loss_scaling(settings) -> dict:
    """megatron-core's loss scaler (its OptimizerConfig `settings`) in the record's loss_scaling (the harness's keys,
    parity.precision.LossScaling's): a static `loss_scale`, or DynamicGradScaler's initial scale (as a power of 2),
    growth interval, hysteresis and minimum — and `rules`: megatron-core's, which the verdict judges each step's scale
    by (parity/comparing/loss_scales.py): doubled after `loss_scale_window` good steps in a row, halved at each
    overflow once `hysteresis` of them have come since the last growth, never below the minimum (no stop there)."""
    power = math.log2(settings.initial_loss_scale)
    return {"loss_scale": float(settings.loss_scale or 0.0), "initial_scale_power": int(power) if power.is_integer()
            else power, "loss_scale_window": int(settings.loss_scale_window), "hysteresis": int(settings.hysteresis),
            "consecutive_hysteresis": False, "min_loss_scale": float(settings.min_loss_scale), "rules": "megatron-core"}


__all__ = ["MegatronRecording", "install", "loss_scaling"]
