"""The recorder for Hugging Face's Trainer (and what inherits it): `Trainer(..., callbacks=[ParityCallback(output_dir,
name=...)])` (docs/own_trainer.md).

What a callback cannot see, it takes from the framework's own extension points:
- the loss: a forward hook on the model (registered with its kwargs) hands the recorder each training micro-batch's
  input ids, labels, attention mask, position ids and use_cache as passed (packed rows are replayed as they were
  fed: parity/training/fed_rows.py) and the model's logits; the recorder measures the global token mean itself;
- the pre-clip gradient norm: Trainer's callbacks run after its clipping (on_pre_optimizer_step comes after
  `_clip_grad_norm`). Where Trainer's own norm (its logs' `grad_norm`: what clip_grad_norm_ returned, in fp32, good to
  ~1e-5 relative over a large gradient) says it did not clip at the step (norm + 1e-6 <= max_grad_norm, or no
  clipping: the gradients are unchanged), the recorder's float64 norm of the gradients the optimizer step applies is
  the pre-clip norm (`grad_norm_source: recorder`); where it clipped, Trainer's value is recorded
  (`grad_norm_source: framework`). Trainer logs it at its logging steps only: the callback takes it, and the loss its
  log would show, at every step (step_taps.py), whatever `logging_steps` is;
- every tensor's gradient norms: read at the optimizer step, after Trainer's clipping, so the series holds the clipped
  gradients (`tensors.grad: clipped`) with each step's clip coefficient beside it (recorded_tensors.py); the replay
  records its own the same way (parity/replay/replay.py);
- the lr: the recorder's optimizer step pre-hook on the torch optimizer inside accelerate's wrapper. Beside it, each
  step's `declared_lr`: what Trainer's own settings schedule at that update (its scheduler, rebuilt from
  TrainingArguments on a scratch optimizer and stepped once per update). The replay applies the recorded lr, so a
  scheduler stepped twice per update would replay to the same curves: the verdict FAILs the first step whose lr is
  not the declared one instead (parity.comparing.run.Run.lr_off_schedule).

Its DeepSpeed path (`TrainingArguments(deepspeed=...)`): DeepSpeed clips and steps inside backward, so the recorder
is handed Trainer's engine (model_wrapped) and reads it as a DeepSpeed loop of one's own (views/zero.py): the gradients
where engine.step() takes its norm, the pre-clip norm DeepSpeed's own.

A run resumed with `trainer.train(resume_from_checkpoint=...)` continues its first run's record from the checkpoint's
step (state.global_step at on_train_begin: ParityRecorder's start_step), its declared schedule moved on to that step;
each checkpoint Trainer saves writes the record (on_save), so that it holds the steps up to the checkpoint.

One process without a process group (no launcher): the callback starts a gloo group of one for the recorder and ends
it after training, as Lightning's does (group.py).

TRL's GRPOTrainer, RLOOTrainer and DPOTrainer (found as the trainer whose training loop calls on_train_begin) are recorded with
their objective, each micro-batch as it consumed it: the registry's `objective_of` asks the rooms (TRL's: its
objective and the feed of its micro-batches; docs/posttrain.md); any other trainer as the causal-LM token mean, its
first step's logged loss held to it (recorded_objective.causal_lm_refusal).
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from parity.attaching import attach
from parity.fingerprint import installed_versions
from parity.frameworks import Refused, guarded, objective_of, release_refusal
from parity.frameworks.transformers.step_taps import StepTaps
from parity.recording.forward_hook import hand_over
from parity.recording.recorded_tensors import CLIPPED, PRE_CLIP
from parity.recording.recorder import DEFAULT_MAX_BATCH_BYTES, ParityRecorder, unwrap
from parity.recording.resume import DeclaredSchedule
from parity.recording.states import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_MAX_STATE_BYTES

PRECISIONS = (("bf16", "bf16"), ("fp16", "fp16_autocast"))  # TrainingArguments flag → the harness's policy (autocast)


class ParityCallback(TrainerCallback):
    """Records a Trainer's run for the harness: `output_dir` and `name` as ParityRecorder's, `max_batch_bytes` its
    cap on the saved batches, `dump_step` a step to record in full for compare_dumps.py (parity/recording/dump.py),
    `checkpoint_interval` and `max_state_bytes` where and how much of the run's state it saves for the teacher-forced
    check (parity/recording/states.py)."""

    def __init__(self, output_dir: str, *, name: str, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
                 dump_step: int | None = None, checkpoint_interval: int | None = DEFAULT_CHECKPOINT_INTERVAL,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES):
        self.output_dir, self.name, self.max_batch_bytes = output_dir, name, max_batch_bytes
        self.dump_step = dump_step
        self.state_saving = {"checkpoint_interval": checkpoint_interval, "max_state_bytes": max_state_bytes}
        self.recorder: ParityRecorder | None = None
        self._hook, self.taps, self.feed, self.engine = None, None, None, None

    @guarded
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = calling_trainer()  # TRL's GRPO and DPO trainers: their objective, as the registry finds it
        try:
            refusal = release_refusal() or trainer_refusal(args, trainer)  # an older release: none of its attributes read
            trained = objective_of(trainer, optimizer) if trainer is not None and not refusal else None
        except Refused as exc:
            refusal = str(exc)
        if refusal:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"parity recorder [{self.name}]: {refusal}: recording nothing", file=sys.stderr, flush=True)
                attach.refused(refusal)
            return
        # (no flag: the model's own — a model loaded in bf16 trains in bf16_pure — else fp32: precision_seen.told)
        precision = next((policy for flag, policy in PRECISIONS if getattr(args, flag, False)), None)
        if not getattr(getattr(trainer, "accelerator", None), "native_amp", True) and precision == "fp16_autocast":
            precision = "fp32"  # accelerate's fp16 on a CPU: no autocast, no scaler
        self.engine = deepspeed_engine(trainer)  # its DeepSpeed path: the engine, read by the recorder's ZeRO view
        clipping = args.max_grad_norm or 0.0
        if self.engine is not None:  # the engine's config says its policy (precision_seen.told), Trainer's flags
            precision = None  # filled its "auto" values
            model, optimizer, clipping = self.engine, self.engine.optimizer, self.engine.gradient_clipping()
        self.recorder = ParityRecorder(self.output_dir, name=self.name, model=model,
                                       optimizer=optimizer,  # accelerate's wrapper: the recorder takes it as it is
                                       max_grad_norm=clipping, precision=precision,
                                       max_batch_bytes=self.max_batch_bytes, framework="transformers.Trainer",
                                       framework_versions=installed_versions(("transformers", "accelerate", "trl")),
                                       dump_step=self.dump_step,
                                       start_step=state.global_step,  # > 0: resumed from a checkpoint
                                       # its callbacks come after its clipping; DeepSpeed's engine.step() is
                                       # read where it takes the norm it clips by (views/norm_point.py)
                                       tensor_grad=CLIPPED if self.engine is None else PRE_CLIP,
                                       objective=trained and trained.objective,
                                       objective_declared=trained and trained.declared,
                                       **self.state_saving)
        if not self.recorder.enabled:
            return
        self._hook = unwrap(model).register_forward_hook(self._forward, with_kwargs=True)
        self.taps = StepTaps(trainer)  # the step's loss and grad norm, which Trainer logs every logging_steps
        if trained is not None:
            self.feed = trained.feed(self.recorder)
        self.recorder.norm_at_optimizer_step = float("nan")  # measured by the recorder's optimizer step pre-hook
        self.recorder.declared = declared_schedule(args, state.max_steps, self.recorder.optimizer, state.global_step)

    @guarded
    def _forward(self, module, args, kwargs, output) -> None:
        """A training micro-batch's forward: its rows and the logits the model made of them (parity/recording/
        forward_hook.py; TRL's GRPO and DPO: its rows and what its trainer made of them, through the feed)."""
        if self.feed is not None and self.recorder is not None and self.recorder.enabled:
            self.feed.forward(module, args, kwargs, output, module.training and torch.is_grad_enabled())
        elif self.recorder is not None:
            hand_over(self.recorder, module, args, kwargs, output)

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self.taps is None:
            return
        logged_loss, theirs = self.taps.take()  # (every rank: a collective)
        if self.recorder is not None and self.recorder.enabled and self.engine is not None:
            # DeepSpeed's path: its engine clipped and stepped inside backward; the norm is its own (the ZeRO view's)
            self.recorder.after_step(logged_loss=logged_loss, logged_grad_norm=theirs)
        elif self.recorder is not None and self.recorder.enabled:
            own = self.recorder.norm_at_optimizer_step
            clipping = args.max_grad_norm or 0.0
            unclipped = theirs is None or clipping <= 0 or theirs + 1e-6 <= clipping  # torch's max / (norm + 1e-6) >= 1
            if own is not None and unclipped and own == own:  # (own == own: not NaN)
                self.recorder.before_step(grad_norm=own, source="recorder")
            else:
                self.recorder.before_step(grad_norm=theirs, source="framework")
            self.recorder.after_step(logged_loss=logged_loss, logged_grad_norm=theirs)
            self.recorder.norm_at_optimizer_step = float("nan")

    @guarded
    def on_save(self, args, state, control, **kwargs):
        """Trainer saved a checkpoint (after the step's on_log): the record holds the steps up to it."""
        if self.recorder is not None:
            self.recorder.save()

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.taps is not None:
            self.taps.remove()
            self.taps = None
        if self.feed is not None:
            self.feed.close()
        if self.recorder is not None:
            self.recorder.close()


def calling_trainer():
    """The transformers Trainer whose training loop calls the callback now (its `self` in a calling frame), or None."""
    frame = inspect.currentframe()
    while frame is not None:
        found = frame.f_locals.get("self")
        if isinstance(found, Trainer):
            return found
        frame = frame.f_back
    return None


def trainer_refusal(args, trainer) -> str | None:
    """Why this Trainer run cannot be recorded, in one line (None: it can).
    - Its DeepSpeed path (`TrainingArguments(deepspeed=...)`) where no DeepSpeedEngine is its model_wrapped (the
      engine is what the recorder reads: deepspeed_engine).
    - A Trainer whose own view of the world is not the process group's (`args.world_size`, `args.process_index`
      against torch.distributed's): its data sharding and loss normalisation would be another run's than the one the
      ranks train together. Measured with DeepSpeed on CPU without use_cpu=True (transformers 5.23.0, accelerate
      1.15.0, torchrun): accelerate's PartialState._prepare_backend sets a distributed type only for a device backend
      or, with cpu=True, MULTI_CPU; with neither it keeps one process (num_processes 1, process_index 0) while
      deepspeed.init_distributed has started the 2-rank group, then relabels itself DEEPSPEED. The same without
      DeepSpeed: TRL's own trl/scripts/sft.py under torchrun on CPU without --use_cpu (trl 1.16) trains as two
      one-process runs in a group of 2 (transformers warns that parallel_mode is not distributed). Refused, never
      recorded as if it were whole; on a machine without GPUs the line names use_cpu.
    - A callback no Trainer's train() called: the step's loss and grad norm are taken from that Trainer.
    - NEFTune: noise drawn into the embeddings' output at every training forward (a correct run that was called FAIL
      at step 0, its embedding's gradient 700 × its bound, before this line); label smoothing: another objective than
      the causal-LM token mean (its forward gets no labels, which the recorder would stop at step 0 on);
      average_tokens_across_devices=False over several ranks: each rank's token mean, their gradients averaged (a clean
      2-rank run was called FAIL at step 0, grad norm 3.2e-4 relative, "differs from the baseline in: nothing
      recorded"). At one rank it changes nothing and is recorded."""
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if (args.world_size, args.process_index) != (world, rank):
            why = (" (accelerate without use_cpu=True on a machine without GPUs: DeepSpeed starts the group, "
                   "accelerate's state finds no backend and keeps one process): pass use_cpu=True"
                   if getattr(args, "deepspeed", None) else
                   " (accelerate without use_cpu=True on a machine without GPUs keeps one process while the launcher "
                   "started several): pass use_cpu=True to TrainingArguments (--use_cpu where the script parses them)"
                   if not torch.cuda.is_available() else "")
            return (f"Trainer sees world_size {args.world_size} and process_index {args.process_index}, the process "
                    f"group {world} ranks (this one rank {rank}): every rank would feed the same rows and the loss be "
                    f"normalised for another world than the one training{why}")
        if world > 1 and getattr(args, "average_tokens_across_devices", True) is False:
            return ("average_tokens_across_devices=False: each rank's loss is the mean over its own tokens (their "
                    "gradients then averaged over the ranks), the replay's the mean over every rank's tokens — another "
                    "objective wherever the ranks' token counts differ: verify the setup with "
                    "average_tokens_across_devices=True (transformers' default)")
    if trainer is None:
        return "ParityCallback was called by no Trainer's train(): pass it to the Trainer (Trainer(callbacks=[...]))"
    if getattr(args, "neftune_noise_alpha", None):
        return (f"NEFTune (neftune_noise_alpha={args.neftune_noise_alpha}): the run adds random noise to the input "
                f"embeddings at each training forward, which the replay cannot draw: verify the setup without it")
    if getattr(args, "label_smoothing_factor", 0.0):
        return (f"label smoothing (label_smoothing_factor={args.label_smoothing_factor}): the run trains a smoothed "
                f"cross-entropy, the replay the token mean of the plain one: verify the setup with "
                f"label_smoothing_factor=0")
    if getattr(args, "deepspeed", None) and deepspeed_engine(trainer) is None:
        return (f"Trainer's DeepSpeed path without a DeepSpeed engine to read (its model_wrapped is a "
                f"{type(trainer.model_wrapped).__name__}): record the run under Trainer's DDP path (no deepspeed=)")
    return None


def deepspeed_engine(trainer):
    """The DeepSpeedEngine Trainer's DeepSpeed path trains through (accelerate's prepare made it its model_wrapped by
    on_train_begin), or None. DeepSpeed steps inside backward (accelerate's engine wrapper calls engine.step() there):
    the recorder reads it as a DeepSpeed loop of one's own (the ZeRO view: its gradients where engine.step() takes its
    norm, the norm DeepSpeed's own)."""
    engine = getattr(trainer, "model_wrapped", None)
    if sys.modules.get("deepspeed") is None or engine is None:
        return None
    from deepspeed import DeepSpeedEngine

    return engine if isinstance(engine, DeepSpeedEngine) else None


def declared_schedule(args, max_steps: int, optimizer, step: int = 0) -> DeclaredSchedule | None:
    """Trainer's lr schedule as its settings declare it (create_scheduler's get_scheduler call, on a scratch optimizer),
    moved on to `step` (the updates a resumed run did before); None where the run's optimizer did not start at
    args.learning_rate (an optimizer or scheduler of the user's: nothing declared) or the steps are unknown."""
    from transformers import get_scheduler

    first = optimizer.param_groups[0]
    if not max_steps or max_steps <= 0 or first.get("initial_lr", first["lr"]) != args.learning_rate:
        return None
    scratch = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    declared = DeclaredSchedule(get_scheduler(args.lr_scheduler_type, optimizer=scratch,
                                              num_warmup_steps=args.get_warmup_steps(max_steps),
                                              num_training_steps=max_steps,
                                              scheduler_specific_kwargs=args.lr_scheduler_kwargs))
    declared.advance(step)
    return declared
