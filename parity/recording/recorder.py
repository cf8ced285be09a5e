"""A recorder for a training loop of your own: it writes the harness's loss record (`loss_<name>.json`) of a run the
harness never trained, so that the run can be replayed under the harness's DDP (parity/replay/replay.py) and
judged by plot_loss_curves.py (docs/own_trainer.md, whose "What the record holds" lists every field).

It is one more loop feeding the per-step observer (parity/training/observer.py). What it adds is what a foreign loop
does not hand over by itself: the loss from the model's outputs (the global token mean, float64), the pre-clip norm
(or the framework's own: `grad_norm_source`), the parameter norm, every tensor's norms (recorded_tensors.py), the lr
applied, the global batch in the harness's order, its hash and the rows check, the optimizer whole, the initial
weights and every step's batch as it came (up to `max_batch_bytes`), and the full state around its checkpoints for its
replay's teacher-forced check (states.py, up to `max_state_bytes`): files named relative to the record's folder.

A step that cannot be recorded or replayed stops the record there, in one line: it holds the steps before it
(`config.stopped`), which are replayed and judged; so does a first step whose logged loss is not the causal-LM token
mean the recorder measured (recorded_objective.py). The process group is read by its view (parity/views/: plain/DDP,
FSDP2 ± DTensor TP, FSDP1, DeepSpeed ZeRO 0–3), each with the harness's own gather and norm code; a step's rows, sums
and health travel in one all_gather (rows.py), rank 0 alone hashes, checks and saves the batch, on a thread of its
own. A recorder failure never stops the user's training.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from parity import storage
from parity.errors import ConfigError, first_line
from parity.attaching import layer_cut
from parity.recording import grad_scaler, precision_seen, resume, states
from parity.recording.batch_taking import BatchTaking
from parity.recording.clipping import DeclaredClipping
from parity.recording.description import describe_run
from parity.recording.group import own_group, release
from parity.attaching.attach import attached, refused
from parity.recording.optimizer_description import (GroupReadings, applied, departure, describe_optimizer, moved_betas,
                                                     unreplayable)
from parity.recording.recorded_objective import ROLLOUT_FILE, RecordedObjective, causal_lm_refusal, named_objective
from parity.recording.recorded_tensors import AT_OPTIMIZER, BEFORE_STEP, PRE_CLIP, Hooks, RecordedTensors
from parity.recording.rows import BatchWriter, MicroBatch, RowExchange, on_host, taken
from parity.recording.world import exchange_device, first_process, launched_processes, trains_alone
from parity.models.families import hf_config
from parity.models.model import config_as_built
from parity.precision import POLICIES
from parity.registry import KNOWN
from parity.objectives.causal_lm import IGNORE_INDEX, measured_loss_sum
from parity.training.observer import StepObserver
from parity.training.record import RECORDER_SOURCE as SOURCE, LossRecord, record_path
from parity.training.tensor_series import kept_chunks
from parity.views.adapters import save_initial_weights
from parity.views.base import ViewRefused, trained_device
from parity.views.language_model import watch_towers
from parity.views.table import view_of

DEFAULT_MAX_BATCH_BYTES = 1 << 30  # 1 GiB of saved global batches (int64 ids, labels and mask: 24 bytes a token)
REPLICA_MOMENTS_EVERY = 10  # the replica check reads AdamW's moments every 10th step, the parameters at every step
STOPPED = "the record stopped"  # what rank 0 hands the other ranks in the step's exchange after its record stopped


def recorded_folder(output_dir: str, name: str) -> str:
    """Where a recorder keeps the initial weights, the model's config.json and the batches of run `name`."""
    return storage.join(output_dir, f"recorded_{name}")


def unwrap(model):
    """The user's module inside DDP (`.module`) or torch.compile (`._orig_mod`): the one whose names are Hugging
    Face's."""
    while True:
        inner = next((m for m in (getattr(model, "module", None), getattr(model, "_orig_mod", None))
                      if isinstance(m, torch.nn.Module)), None)
        if inner is None:
            return model
        model = inner


class ParityRecorder(BatchTaking, DeclaredClipping):
    """Records a training run of your own loop, on every rank of its process group (docs/own_trainer.md):

        rec = ParityRecorder(output_dir, name="my_run", model=model, optimizer=optimizer, max_grad_norm=1.0)
        for step ...:
            for micro-batch ...:
                logits = model(input_ids=ids, attention_mask=mask).logits
                ... loss.backward()
                rec.micro_batch(ids, labels, logits, attention_mask=mask)
            rec.before_step()               # after backward, before clipping: the pre-clip norm
            clip_grad_norm_(...); optimizer.step(); scheduler.step(); optimizer.zero_grad()
            rec.after_step(logged_loss=...)  # the step's entry; every `log_interval` steps the file
            if checkpointing: save_your_checkpoint(); rec.save()   # the record holds the steps up to it
        rec.close()                          # the record complete

    Made before the first optimizer step (it saves the initial weights then) and after the process group is up
    (torch.distributed initialised: one rank is a group of one). `model` may be wrapped (DDP, torch.compile,
    accelerate's prepare: its model and AcceleratedOptimizer as they are), sharded by FSDP2's fully_shard (with or
    without DTensor TP), or a DeepSpeed engine (then `optimizer=engine.optimizer`, before_step before the boundary's
    engine.step() and after_step after it: parity/views/zero.py);
    `max_grad_norm` is what the loop clips the global norm to (0: it does not clip), `clip_value` each element's
    magnitude (clip_grad_value_; None: it does not: clipping.py); `precision` the harness's name of what the loop
    computes in (fp32, bf16 for autocast over fp32 weights ...; left out: a DeepSpeed engine's config or accelerate's
    mixed_precision, else fp32; a forward under another autocast than told ends the record in one line:
    precision_seen.py); `max_batch_bytes` caps the batches saved (default
    DEFAULT_MAX_BATCH_BYTES); `framework` names the loop (shown in the fingerprint, not compared); `log` takes rank
    0's lines (default: stderr); `scheduler`, the loop's lr scheduler, records each step's `declared_lr`
    (resume.DeclaredSchedule.copy_of: the verdict FAILs a step whose lr is not the one its schedule declares);
    `checkpoint_interval` (default 50; 0: step 0 alone; None: none) and `max_state_bytes` (default 32 GiB): the full
    state saved around a step for its replay's teacher-forced check (states.py); `tensor_grad`: every tensor's
    gradient read at before_step (PRE_CLIP) or, after the framework's clipping, at the optimizer's step (CLIPPED).

    A run resumed from its own checkpoint after k updates passes `start_step=k`: the recorder continues the record of
    its first run (loss_<name>.json in `output_dir`) — its steps 0…k−1 kept, k appended to config.resumed_at, the
    initial weights not saved again, the steps and batches going on from k — or refuses in one line where that record
    cannot be continued (fewer than k steps, batches missing, another optimizer or model). `save()` at each of the
    loop's checkpoints writes the record so that it holds every step up to the checkpoint."""

    def __init__(self, output_dir: str, *, name: str, model, optimizer, max_grad_norm: float = 0.0,
                 precision: str | None = None, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, log_interval: int = 10,
                 framework: str = "plain PyTorch", framework_versions: dict | None = None,
                 log: Callable[[str], Any] | None = None, dump_step: int | None = None, scheduler=None,
                 start_step: int = 0, checkpoint_interval: int | None = states.DEFAULT_CHECKPOINT_INTERVAL,
                 max_state_bytes: int = states.DEFAULT_MAX_STATE_BYTES, tensor_grad: str = PRE_CLIP,
                 objective: str | dict | None = None, objective_args: dict | None = None,
                 objective_declared: dict | None = None, clip_value: float | None = None):
        output_dir, name = attached(output_dir, name)  # verify_trainer.py's folder and name, where it runs the loop
        self.enabled, self.name, self.dump = False, name, None
        # one process without a group (a single-device script): a gloo group of one for the recorder's collectives,
        # ended at close() — or here, where the recorder records nothing (group.py)
        self._own_group = dist.is_available() and own_group(launched_processes())
        self._print = log or (lambda line: print(line, file=sys.stderr, flush=True))
        from parity.frameworks import release_refusal  # a framework's release older than its room's oldest
        policy, mismatch = precision_seen.told(precision, model)  # None: the engine's or framework's, else fp32
        precision = policy["precision"]
        refusal = release_refusal() or mismatch or self._refusal(name, precision, start_step) or \
            states.refusal(checkpoint_interval, max_state_bytes)
        try:  # a post-training objective's rows and sums (recorded_objective.py); None: the causal-LM token mean
            self.objective_rows = named_objective(objective, objective_args, objective_declared)
        except ConfigError as exc:
            refusal = refusal or str(exc)
        if refusal:
            if first_process():
                self._print(f"parity recorder [{name}]: {refusal}: recording nothing")
                refused(refusal)
            self._release_group()
            return
        try:
            self._start(output_dir, model, optimizer, max_grad_norm, policy, max_batch_bytes, log_interval,
                        framework, framework_versions or {}, scheduler, start_step, tensor_grad)
            self.states = states.StateSaver(self, checkpoint_interval, max_state_bytes, start_step)  # for the check
            if dump_step is not None:  # step K in full, for compare_dumps.py (parity/recording/dump.py)
                from parity.recording.dump import StepDump

                self.dump = StepDump(self, dump_step)
            self.enabled = True
            self.clips_by_value(clip_value or 0.0)  # clip_grad_value_'s (clipping.py)
        except (ViewRefused, layer_cut.NotCut) as exc:  # a group, wrapper or depth it cannot take: every rank finds it
            if first_process():
                self._print(f"parity recorder [{name}]: {exc}: recording nothing")
                refused(str(exc))
        except resume.ResumeRefused as exc:  # a record the resumed run cannot continue (_continue)
            self._line(f"{exc}: recording nothing; the training goes on")
        except Exception as exc:  # never the user's training
            self._discard()
            self._print(f"parity recorder [{name}]: could not start ({type(exc).__name__}: {first_line(exc)}): "
                        f"recording nothing")
        if not self.enabled:
            self._release_group()

    def _release_group(self) -> None:
        """The group of one started for this recorder ended, the loop's own held to the process's exit (group.py)."""
        release(self._own_group)
        self._own_group = False

    def _not_as_told(self, line: str) -> None:
        self.broken = self.broken or line

    def _discard(self) -> None:
        """After a failed start: the hook off, the recorded folder gone if this start wrote into it: none half-written."""
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        if getattr(self, "_wrote", False):
            storage.delete_dir(self.folder)

    @staticmethod
    def _refusal(name: str, precision: str, start_step) -> str | None:
        if not isinstance(name, str) or not name.isidentifier():
            return f"name {name!r} is not an identifier (it names loss_<name>.json)"
        if name in KNOWN:
            return (f"name {name!r} is a strategy of the harness ({', '.join(KNOWN)}): its record would be taken for "
                    f"the harness's own run; choose another")
        alone = trains_alone()  # the launcher started several processes and this one trains alone (world.py)
        if alone:
            return alone
        if not dist.is_available():  # (initialised: by the loop, or for one process here: own_group)
            return "torch.distributed is not available in this torch build: the recorder's exchange is a collective"
        if precision not in POLICIES:
            return f"precision {precision!r} is not one of the harness's policies ({', '.join(POLICIES)})"
        if not isinstance(start_step, int) or start_step < 0:
            return f"start_step {start_step!r} is not a step (the updates done before this run: 0, or k > 0 resumed)"
        return None

    # --- set-up -------------------------------------------------------------------------------------
    def _start(self, output_dir, model, optimizer, max_grad_norm, policy, max_batch_bytes, log_interval,
               framework, framework_versions, scheduler, start_step, tensor_grad) -> None:
        precision = policy["precision"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = exchange_device()
        self.view = view_of(model, optimizer, self.device, unwrap)  # plain/DDP, FSDP2, FSDP1, ZeRO (parity/views/)
        self.model, self.optimizer = self.view.model, self.view.optimizer
        self.trains_on = trained_device(self.model, self.device)  # the record's device (the replay's)
        optimizer = self.optimizer  # the torch optimizer that steps (ZeRO's wraps the user's client one)
        self.folder = recorded_folder(output_dir, self.name)  # written here; named in the record relative to it
        here = f"recorded_{self.name}"
        self.max_batch_bytes, self.saved_bytes, self.log_interval = max_batch_bytes, 0, log_interval
        self.names = self.view.names()  # Hugging Face names (FSDP1's cleaned of its wrappers)
        self.optimizer_description = describe_optimizer(self.view, self.names)
        if why := unreplayable(self.optimizer_description):  # SGD, Adafactor, AdamW(amsgrad=True) ...: before step 0
            raise ViewRefused(why)
        self.stop: tuple[int, str] | None = None  # (step, why): the record ends before that step
        config = hf_config(self.model)  # None: not a Hugging Face model
        if config is not None and getattr(self.model, "get_output_embeddings", lambda: True)() is None:  # no LM head
            raise ViewRefused(f"{type(self.model).__name__} has no language-model head: the replay trains a causal LM's "
                              f"objective (a sequence classifier's, a reward model's, is not one)")
        fresh = config is not None and not start_step  # a resumed run's model is past its initial state: not saved
        state = self.view.full_state_dict() if fresh else None  # full tensors where sharded: every rank (collective)
        self.exchange = RowExchange()
        description = describe_run(self, here=here, config=config, optimizer=optimizer, framework=framework,
                                   framework_versions=framework_versions, policy=policy,
                                   max_grad_norm=max_grad_norm, max_batch_bytes=max_batch_bytes)
        self.record = LossRecord(record_path(output_dir, self.name), self.name, description)
        if start_step:
            self._continue(start_step)
        self.writer = BatchWriter() if self.rank == 0 else None
        self.declared = (resume.DeclaredSchedule.copy_of(scheduler, start_step, self._line) if scheduler is not None
                         else None)
        self.tensors = RecordedTensors(self.view, self.device, tensor_grad, float(max_grad_norm), self._line,
                                       precision)
        self.observer = StepObserver(self.record, device=self.device, replicas=self.view, replica_check_interval=1,
                                     replica_moments_every=REPLICA_MOMENTS_EVERY,
                                     log=self._line, **self.tensors.observer_arguments())
        self.step, self.grad_norm_source = start_step, None
        self._reset_step()
        self._applied = GroupReadings(optimizer)  # what the optimizer's groups applied, read as it stepped
        self._first_applied: tuple[int, list[dict]] | None = None  # the first such reading's step and groups
        self._optimizer_steps = 0  # the hook's firings since the last after_step
        self.norm_at_optimizer_step: float | None = None  # an adapter sets it to nan to have the pre-hook measure it
        self._hook = Hooks(self.tensors.watch(optimizer, self._before_optimizer_step),  # and its step post-hook
                           *watch_towers(self.view.towers, self._not_as_told))  # a multimodal model's images fed
        self._autocast = precision_seen.watch(self.view, self.record.data["config"], self._not_as_told)  # its autocast
        self._scaler = grad_scaler.reading(self.record, optimizer, precision, self.view)  # torch's GradScaler
        if self.rank == 0 and fresh:  # the first write: all that could refuse or fail has passed
            self._wrote = True
            storage.write_bytes_atomic(storage.join(self.folder, "config.json"),
                                       config_as_built(self.model).to_json_string().encode())
            self.record.data["config"]["init_weights_sha256"] = save_initial_weights(  # LoRA's adapters beside
                self.view, storage.join(self.folder, "init_weights.safetensors"), state)
        self._last = time.perf_counter()
        self._line(f"recording {self.name} ({framework}, {self.view.kind}, {self.world} rank"
                   f"{'s' if self.world > 1 else ''}) into "
                   f"{self.record.path}{f', continued at step {start_step}' if start_step else ''}")

    # --- a resumed run ----------------------------------------------------------------------------------
    def _continue(self, k: int) -> None:
        """A run resumed after k updates continues its first run's record: rank 0 reads and checks it (_kept) and
        takes its steps 0…k−1 and its description; every rank learns the answer (resume.ResumeRefused on every rank where
        the record cannot be continued). The description is the first run's — its initial weights, model, optimizer
        — with k appended to resumed_at."""
        why, kept = None, None
        if self.rank == 0:
            try:
                kept = resume.kept(self.record.path, self.folder, self.record.data["config"], k)
                lost = self.objective_rows and self.objective_rows.restore(storage.join(self.folder, ROLLOUT_FILE), k)
                if lost:
                    raise resume.ResumeRefused(f"cannot continue {storage.name(self.record.path)} at step {k}: {lost}")
            except resume.ResumeRefused as exc:
                why = str(exc)
        answer = [why]
        dist.broadcast_object_list(answer, src=0, device=self.device)
        if answer[0]:
            raise resume.ResumeRefused(answer[0])
        if kept is not None:
            config, steps, self.saved_bytes, chunks = kept  # with the tensor series' chunks before k (the observer's)
            self.record.data.update(config=config, steps=steps, tensors={"chunks": kept_chunks(chunks, k)})

    def _reset_step(self) -> None:
        self.micro: list[MicroBatch] = []
        # the step's loss sum in float64 and its rows: on their device until the step's end (rows.on_host)
        self.loss_sum, self.recorder_s = 0.0, 0.0
        self.grad_norm, self.broken = None, None  # float | None, str | None
        self.step_extras: dict = {}  # what a framework's recorder adds to the step's entry (megatron-core's routing)
        self.view.step_done()  # its walks of the module: once a step

    # --- per micro-batch, per step --------------------------------------------------------------------
    def micro_batch(self, input_ids, labels, logits, attention_mask=None, *, log_probs=None,
                    position_ids=None, use_cache=None, summed_loss=None) -> None:
        """One micro-batch this rank fed the model: its input ids and labels ([rows, length]; labels as Hugging Face
        takes them: the ids, −100 where no loss is taken), the model's logits on it, the attention mask if any (right
        or left padding), the position ids if the loop passed its own (packed rows), `use_cache` as passed (None: the
        model config's). Any rows, any length, from step to step and rank to rank. A model that returns no logits (TRL's
        fused LM head) gives `log_probs` instead: each position's log-probability of its next token, zero where no loss
        is taken ([rows, length − 1]); one that never forms the full logits (torchtitan's chunked loss), `summed_loss`."""
        if not self.enabled or self.broken:
            return
        if self.objective_rows is not None:
            self.broken = (f"micro_batch() in a record of {self.objective_rows.config['name']}: hand each micro-batch "
                           f"over with objective_batch()")
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if summed_loss is not None or log_probs is not None:
                    summed = float(summed_loss) if log_probs is None else -log_probs.detach().double().sum()
                else:
                    logits = self.view.logits(logits.detach())  # a DTensor's in full
                    summed = measured_loss_sum(logits, labels.to(logits.device)).double()
            self.micro.append(taken(input_ids, labels, attention_mask, position_ids, use_cache, self.view))
            self.loss_sum += summed
        except Exception as exc:
            self.broken = f"micro_batch: {type(exc).__name__}: {first_line(exc)}"
        self.recorder_s += time.perf_counter() - t0

    def objective_batch(self, input_ids, logits=None, *, completion_mask, attention_mask=None, log_probs=None,
                        entropies=None, **rows) -> None:
        """One micro-batch of a post-training objective's run (ParityRecorder(objective=...)): its ids [rows, L], the
        model's logits on it (or its log-probs of each next token and their entropies, [rows, L − 1], from a fused LM
        head), the attention mask as fed, and its rows in the rollout file's schema (docs/posttrain.md): completion_mask
        [rows, L]; truncated, group, generation [rows]; GRPO's advantages [rows], old_logps (or old_seq_logps [rows])
        and ref_logps [rows, L] — the log-prob of the token at each position — where the objective uses them; DPO's
        ref_logps (or ref_seq_logps [rows]), its rows in pairs (2k chosen, 2k + 1 rejected)."""
        if not self.enabled or self.broken:
            return
        t0 = time.perf_counter()
        try:
            if self.objective_rows is None:
                raise ValueError("this recorder records the causal-LM token mean: name the objective, "
                                 "ParityRecorder(objective=...)")
            labels, words = self.objective_rows.micro(input_ids, self.view.logits(logits.detach()) if logits
                                                      is not None else None, completion_mask=completion_mask,
                                                      attention_mask=attention_mask, log_probs=log_probs,
                                                      entropies_=entropies, **rows)
            self.micro.append(taken(input_ids, labels, attention_mask, None, False, self.view)._replace(rollout=words))
        except Exception as exc:
            self.broken = f"objective_batch: {type(exc).__name__}: {first_line(exc)}"
        self.recorder_s += time.perf_counter() - t0

    def before_step(self, grad_norm: float | None = None, source: str = "framework") -> None:
        """After the step's backward, before clipping: the pre-clip global gradient norm, measured here in float64 from
        the gradients (under DDP every rank holds the reduced ones) — or `grad_norm`, the framework's own value (an
        adapter that measured it itself says `source="recorder"`)."""
        if not self.enabled or self.broken:
            return
        t0 = time.perf_counter()
        try:
            if self.dump is not None and grad_norm is None:
                self.dump.take_grads()
            self.tensors.read(BEFORE_STEP)  # every tensor's gradient, before the loop's clipping (recorded_tensors.py)
            self.step_extras.update(self._scaler.read() if self._scaler else {})  # its scale and skip (grad_scaler.py)
            if grad_norm is not None:
                self.grad_norm, self.grad_norm_source = float(grad_norm), source
            elif self.view.grad_norm_visible:  # full gradients, float64 (collective where they are sharded)
                self.grad_norm = self.view.grad_norm(self.tensors.squares if self.tensors.read_at == BEFORE_STEP
                                                     else None)
                self.grad_norm_source = "recorder"
        except Exception as exc:
            self.broken = f"before_step: {type(exc).__name__}: {first_line(exc)}"
        self.recorder_s += time.perf_counter() - t0

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step pre-hook: the lr, betas, eps and weight decay of every group as the step applies them;
        for an adapter that asks (`norm_at_optimizer_step`), the float64 norm of the gradients the step applies (after
        any clipping). Its time is the recorder's (recorder_before), not the step's."""
        t0 = time.perf_counter()
        self._applied.take(optimizer.param_groups)
        self.tensors.read(AT_OPTIMIZER)  # where the framework clipped before any hook of the recorder's
        self._optimizer_steps += 1
        if self.dump is not None:
            self.dump.take_grads()
        if self.norm_at_optimizer_step is not None:
            try:
                self.norm_at_optimizer_step = self.view.grad_norm()
            except Exception:
                self.norm_at_optimizer_step = math.nan
        self.recorder_s += time.perf_counter() - t0

    def after_step(self, lr: float | None = None, logged_loss: float | None = None,
                   grad_norm: float | None = None, logged_grad_norm: float | None = None) -> None:
        """After the optimizer's step (every rank; a collective): the step's record entry. `lr`: the lr applied (by
        default what the optimizer's first group applied); `logged_loss`: the framework's own loss of the step, kept
        beside the measured one; `grad_norm`: the framework's pre-clip norm where before_step was not called;
        `logged_grad_norm`: the framework's own norm, kept beside the recorded one."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        step_time = t0 - self._last - self.recorder_s
        try:
            self._record_step(lr, logged_loss, grad_norm, step_time, t0, logged_grad_norm)
            if self.dump is not None:
                self.dump.after_step(self.step - 1, self.micro)
        except Exception as exc:  # the exchange fails on every rank alike: the record ends at this step
            self._end(f"{type(exc).__name__}: {first_line(exc)}" if not isinstance(exc, RuntimeError)
                      else first_line(exc))
        if self.enabled:
            self.states.take(self.step)  # the state after this step, where a check wants it
        self._reset_step()
        self._last = time.perf_counter()

    def _record_step(self, lr, logged_loss, grad_norm, step_time, t0, logged_grad_norm=None) -> None:
        if grad_norm is not None and self.grad_norm is None:
            self.grad_norm, self.grad_norm_source = float(grad_norm), "framework"
        if self.grad_norm is None and not self.view.grad_norm_visible:  # DeepSpeed's own, of the step it took
            self.grad_norm, self.grad_norm_source = self.view.framework_grad_norm(), self.view.norm_source
        if not self.broken and self.grad_norm is None:
            self.broken = "no pre-clip grad norm: call before_step() before clipping, or give after_step(grad_norm=)"
        if not self.broken and not self.micro and self.view.feeds:  # a rank that hands no rows over may feed none
            self.broken = "no micro-batch: call micro_batch() for each one the step fed"
        if self.stop is not None:  # rank 0 stopped the record at an earlier step: every rank ends it now
            self.broken = STOPPED
        self.micro, loss_sum = on_host(self.micro, self.loss_sum)  # the step's rows and loss sum off the device
        tokens = sum(int((m.labels[:, 1:] != IGNORE_INDEX).sum()) for m in self.micro)
        # riding the step's exchange: every tensor's squares and, where the check is due, the replica digests
        q0 = time.perf_counter()
        squares = self.tensors.local(self.step, quiet=self.broken is not None)  # a broken step says why itself
        d0 = time.perf_counter()
        digests = self.observer.replica_digests(self.step)
        riders = torch.cat([squares.cpu().view(torch.int64), *([] if digests is None else [digests.reshape(-1).cpu()])])
        normed = time.perf_counter()
        # the step's exchange (rows.py): every rank's health, loss sum and tokens to all, the rows to rank 0 alone
        got = self.exchange(self.broken, loss_sum, tokens, self.micro, feeds=self.view.feeds,
                            dp_rank=self.view.dp_rank, dp_size=self.view.dp_size, device=self.device, extra=riders)
        exchanged = time.perf_counter()
        summed = got.extra[:, :len(squares)].contiguous().view(torch.float64).sum(0)  # over the ranks, in rank order
        table = None if digests is None else got.extra[:, len(squares):].reshape(-1, 3)
        self._check_optimizer_steps()
        read = self._applied.groups()  # None: the step pre-hook did not fire
        groups = read or applied(self.optimizer.param_groups)
        lr = float(lr) if lr is not None else groups[0]["lr"]
        first = self._first_applied if read is not None else None  # one source: the step pre-hook's
        if why := departure(self.optimizer_description, groups, first, self.step):
            self._stop_at(self.step, why)
        if self._first_applied is None and read is not None:
            self._first_applied = (self.step, read)
        n = len(self.tensors.names)
        param_norm = math.sqrt(float(summed[n:2 * n].sum()))  # the full trainable parameters, float64
        sums, counts = got.rank_loss_sums, got.rank_tokens
        tokens = sum(counts)
        extras, saving, hash_ = {"grad_norm_source": self.grad_norm_source, **self.step_extras}, 0.0, ""
        measured = {"rank_loss_sums": sums, "rank_tokens": counts, "tokens": tokens}  # the causal-LM token mean's
        if self.rank == 0:  # rank 0 alone: what fails here must not leave the other ranks in a collective
            ranks, micro = len(got.per_dp_rank), max(len(m) for m in got.per_dp_rank)  # the step's split
            refusal = causal_lm_refusal(logged_loss, sums, counts, (ranks, micro, ranks * micro)) if not self.step \
                and self.objective_rows is None else None  # a logged loss not the causal-LM token mean, nor scaled
            if refusal:
                self._stop_at(0, refusal)
            measured = self._objective_step(got, measured)
            s0 = time.perf_counter()
            hash_ = self._take_batch(got, extras)
            saving = time.perf_counter() - s0
        config = self.record.data["config"]
        if config["grad_norm_source"] not in (None, self.grad_norm_source):
            config["grad_norm_source"] = "mixed"
        elif config["grad_norm_source"] is None:
            config["grad_norm_source"] = self.grad_norm_source
        if logged_loss is not None:
            extras["logged_loss"] = float(logged_loss)
        if logged_grad_norm is not None:
            extras["logged_grad_norm"] = float(logged_grad_norm)
        if self.declared is not None:  # what the schedule declares for this update (once a step, every rank)
            extras["declared_lr"] = self.declared.lr(lr, skipped=bool(self.step_extras.get("skipped")))
        if (betas := moved_betas(self.optimizer_description, read)) is not None:  # the pre-hook's reading
            extras["betas"] = betas
        harness_s = {"recorder_before": self.recorder_s, "exchange": exchanged - normed, "batch": saving,
                     "tensor_norms": d0 - q0, "replica_check": normed - d0}  # the check's comparison adds to it
        norms = self.tensors.norms(summed, self.grad_norm)
        if self.rank == 0 and (why := self.undeclared_scale(norms.get("clip_read"), self.grad_norm)):
            self._stop_at(self.step, why)
        self.observer.observe_step(self.step, **measured, grad_norm=self.grad_norm, param_norm=param_norm, lr=lr,
                                   batch_hash=hash_, step_time_s=step_time, harness_s=harness_s, replica_table=table,
                                   **norms, **extras)
        rows_check = extras.get("rows_check")
        if rows_check and rows_check["duplicates"]:
            first = rows_check["pairs"][0]
            self._line(f"step {self.step}: ranks {first[0]} and {first[1]} fed {first[2]} identical row"
                       f"{'s' if first[2] > 1 else ''}: the verdict will FAIL")
        if self.stop is not None and self.rank == 0:
            self._apply_stop()
        self.step += 1
        if self.step % self.log_interval == 0:
            harness_s["record_write"] = self.observer.write()
        harness_s["after_step"] = time.perf_counter() - t0  # all of the recorder's at the step's end, the above in it

    def _check_optimizer_steps(self) -> None:
        """One optimizer step per recorded step (the step hook's firings, where the view's torch optimizer steps once
        an update), none where a framework's fp16 scaler skipped it (step_extras' `skipped`), as the replay takes them.
        Else the loop trained another run than the one recorded: the record stops at that step."""
        steps, self._optimizer_steps = self._optimizer_steps, 0
        if steps == 1 - bool(self.step_extras.get("skipped")) or not self.view.steps_once_an_update:
            return
        why = (f"did not step in step {self.step} (a skipped step, or after_step() after a micro-batch that only "
               f"accumulated)" if steps == 0 else f"stepped {steps} times in step {self.step}" + (
                   ", which its loss scaler skipped" if self.step_extras.get("skipped") else
                   " (after_step() goes after each optimizer step)"))
        self._stop_at(self.step, f"the optimizer {why}: the replay steps it once a recorded step")

    # --- where the record stops -------------------------------------------------------------------------
    def _stop_at(self, step: int, why: str) -> None:
        """Rank 0: the record ends before `step` (the earliest step asked), `why` in one line. The steps before it are
        replayed and judged; the training goes on, and every rank stops recording at the next step's exchange."""
        if self.stop is None or step < self.stop[0]:
            self.stop = (step, why)
            judged = "no step is" if step == 0 else "step 0 is" if step == 1 else f"steps 0…{step - 1} are"
            self._line(f"{why}: the record stops at step {step}; {judged} replayed and judged; the training goes on")

    def _settle(self, finished: list[tuple[int, str | None]]) -> None:
        """Rank 0, where the record is written: the batches the writer finished counted (_harvest), then the record cut
        at its stop if it has one."""
        self._harvest(finished)
        if self.stop is not None:
            self._apply_stop()

    def _apply_stop(self) -> None:
        step, why = self.stop
        data = self.record.data
        del data["steps"][step:]
        data["config"]["stopped"] = {"step": step, "why": why}

    def _end(self, why: str) -> None:
        """Every rank, where the step's exchange failed (a rank broken, or rank 0's record stopped): rank 0 completes
        the record at its stop (this step if none came before), without a collective; no rank records more."""
        self.enabled = False
        self._hook.remove()
        if self.rank != 0:
            return
        if self.stop is None:
            self._stop_at(self.step, f"step {self.step} could not be recorded ({why})")
        try:
            self._settle(self.writer.close())
            self.states.close()
            self.record.data["config"]["total_steps"] = len(self.record.steps)
            self._objective_file()
            self.record.finish(steps=len(self.record.steps), source=SOURCE)
        except Exception as exc:
            self._line(f"failed ({type(exc).__name__}: {first_line(exc)}): the record {self.record.path} is not "
                       f"complete")

    # --- the end ----------------------------------------------------------------------------------
    def save(self) -> None:
        """At each of the loop's checkpoints, after its last step's after_step (every rank; a collective): the record
        written now, every step so far in it and their batches on disk, so that a run killed after the checkpoint
        resumes from it (start_step) without a gap."""
        if not self.enabled:
            return
        try:
            if self.writer is not None:
                self._settle(self.writer.flush())
                self._objective_file(final=False)
            self.observer.write()
            self.states.save()
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {first_line(exc)}")

    def close(self) -> str | None:
        """The record complete (every rank; a collective). Returns its path on rank 0 (None if nothing recorded)."""
        if not self.enabled:
            self._release_group()
            return self.record.path if getattr(self, "stop", None) and self.rank == 0 else None
        try:
            self._hook.remove()
            if self.writer is not None:  # rank 0
                self._settle(self.writer.close())
                self._objective_file()
            self.states.close()
            self.record.data["config"]["total_steps"] = len(self.record.steps)
            self.observer.finish(lambda: {"steps": len(self.record.steps), "source": SOURCE})
            self._line(f"recorded {len(self.record.steps)} steps: {self.record.path}")
            return self.record.path if self.rank == 0 else None
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {first_line(exc)}")
            return None
        finally:
            self.enabled = False
            self._release_group()

    def _disable(self, why: str) -> None:
        self.enabled = False
        self._line(f"failed ({why}): recording nothing more; the training goes on")
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        if getattr(self, "writer", None) is not None:
            self.writer.close()
        if getattr(self, "states", None) is not None:
            self.states.close(keep=False)

    def _line(self, text: str) -> None:
        if getattr(self, "rank", 0) == 0:
            self._print(f"parity recorder [{self.name}]: {text}")


__all__ = ["DEFAULT_MAX_BATCH_BYTES", "ParityRecorder", "recorded_folder", "unwrap"]
