"""torchtitan's Trainer recorded without a line of the job changed (docs/torchtitan.md): under verify_trainer.py
(sitehook/sitecustomize.py calls `install` where its variables are set) `torchtitan.trainer.Trainer.__init__` is
wrapped, when that module is first imported, to end by attaching a `TitanRecording` to the trainer it built — for
every job `torchrun … -m torchtitan.train --module M --config C …` runs, whatever module and config. Nothing of
torchtitan's computation changes: the recording wraps three of the trainer's own methods on the instance and reads
around them.

- `forward_backward_step` (each micro-batch): the batch as this rank consumed it, before (its input ids, labels and
  positions: torchtitan's rows are already shifted, one target a position, documents' positions restarting at their
  boundaries) and the loss it returns after (this rank's summed loss ÷ the global batch's tokens: × those tokens, the
  summed loss); after the step's last one, the gradients before clipping (`before_step`: every tensor's norm and the
  float64 pre-clip norm, before train_step's clip_grad_norm_).
- `metrics_processor.log`: torchtitan's own global loss and grad norm, kept beside the recorded ones.
- `train_step`: the step's record after it (the optimizer's step pre-hook has read the lr; `after_step`, every rank),
  and the recorder started before the first one — after `train()` loaded the job's checkpoint, so the initial weights
  recorded are the ones the job trains from: its seed checkpoint's where it loaded one.

A torchtitan row as the replay feeds it (Hugging Face's convention: labels[t + 1] is position t's target): the input
ids and one more token — the last label, which no position of the row reads — with labels −100 then the row's
targets; the positions and the next one. A job whose attention keeps a packed row's documents apart (FlexAttention's
and varlen's block-causal masks) is recorded with its positions alone, which transformers keeps apart alike; one whose
attention is causal over the whole row (SDPA) with a mask as well, under which transformers is causal over the row.

Refused in one line on every rank, and the job stops with exit status 2 before it trains (what it cannot record it
would train for nothing), its line left for verify_trainer.py (attach.stop_command), which repeats it with exit status
2 whatever status the launcher reports: a model the recorder cannot map (frameworks/torchtitan/config.py, frameworks/torchtitan/view.py), pipeline
parallelism (several model parts: the recorder reads one module), context parallelism (each rank consumes a slice of
the rows), several optimizers, parameters not in fp32 (training.dtype). verify_trainer.py refuses the same before the
command runs where the command names torchtitan's --module and --config (`command_refusal`).
"""

from __future__ import annotations

import logging

from parity.attaching import attach
from parity.attaching.import_hook import after_init, when_imported
from parity.frameworks import guarded, release_refusal, stop_record

MODULE = "torchtitan.trainer"
PRECISIONS = {"float32": "fp32", "bfloat16": "bf16_params"}  # training.mixed_precision_param → the harness's policy
REDUCE = {"float32": "fp32", "bfloat16": "bf16"}


def install() -> None:
    """torchtitan's Trainer.__init__ ends by attaching a TitanRecording, once its module is imported (now, if it already
    is)."""
    after_init(MODULE, "Trainer", _attach)
    when_imported("torchtitan", _release)  # a release older than the Trainer hooked here (0.2's has none): said


def _release(module) -> None:
    why = release_refusal()
    if why:
        stop_record(_release, why)


def _attach(trainer) -> None:
    if release_refusal():  # (said at torchtitan's import)
        return
    try:
        if getattr(trainer, "_parity_recording", None) is None and not trainer.config.checkpoint.create_seed_checkpoint:
            trainer._parity_recording = TitanRecording(trainer)
    except Exception as exc:  # an attribute this release does not have: the job trains unrecorded
        from parity.errors import first_line

        stop_record(trainer, f"torchtitan: {type(exc).__name__}: {first_line(exc)}")


def config_refusal(config) -> str | None:
    """Why a job of this torchtitan config (its overrides applied) cannot be recorded, in one line (None: as far as
    the config tells, it can): what verify_trainer.py refuses before the command runs, and the job before it trains."""
    parallelism, training = config.parallelism, config.training
    if parallelism.pipeline_parallel_degree > 1:
        return (f"pipeline parallelism (pipeline_parallel_degree {parallelism.pipeline_parallel_degree}): each rank "
                f"holds model parts of its stages and the loss lives on the last; the recorder reads one whole module "
                f"a rank — record the job at pipeline_parallel_degree 1, the harness's own pipeline strategy checks "
                f"pipelines")
    if parallelism.context_parallel_degree > 1:
        return (f"context parallelism (context_parallel_degree {parallelism.context_parallel_degree}): each rank "
                f"consumes a slice of its rows' sequence, which the recorder does not reassemble; record the job at "
                f"context_parallel_degree 1")
    if training.dtype != "float32":
        return (f"training.dtype {training.dtype}: the parameters the optimizer steps are not fp32, which no "
                f"policy of the replay trains; train in float32 (with mixed_precision_param for the compute)")
    if training.mixed_precision_param not in PRECISIONS:
        return f"mixed_precision_param {training.mixed_precision_param}: the replay trains fp32 and bf16"
    return None


def refusal(trainer) -> str | None:
    """Why this job cannot be recorded, in one line (None: it can)."""
    why = config_refusal(trainer.config)
    if why is None and (len(trainer.model_parts) != 1 or len(trainer.optimizers.optimizers) != 1):
        return "several model parts or optimizers: the recorder follows one module stepped by one torch optimizer"
    return why


def command_refusal(command: list[str]) -> str | None:
    """For a torchtitan command (its arguments name --module and --config, torchtitan installed): why the job cannot
    be recorded, in one line, found before the command runs — verify_trainer.py's check: its config with the
    command's overrides (config_refusal), and the config's model, built on the meta device, mapped through its
    adapter onto the transformers model. None where it can, or the command is none of torchtitan's; where the
    overrides do not parse here, the config without them (the job says what is wrong with them, and its own hook
    checks again)."""
    import contextlib
    import importlib.util
    import io

    flags = {a.split("=", 1)[0] for a in titan_arguments(command)}
    if not {"--module", "--config"} <= flags or importlib.util.find_spec("torchtitan") is None:
        return None
    import torch
    from torchtitan.config import ConfigManager

    from parity.frameworks.torchtitan.config import TitanRefused, hf_config
    from parity.frameworks.torchtitan.view import Translation
    from parity.models.model import meta_model

    why, config = None, None
    logging.disable(logging.WARNING)  # torchtitan's own warnings while its config loads: the job prints them
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            config = ConfigManager().parse_args(titan_arguments(command))
        why = config_refusal(config)
    except (Exception, SystemExit):  # overrides this torchtitan does not take: the command says so itself
        try:
            config, _ = ConfigManager()._load_config(command)
        except Exception:  # not a config torchtitan loads
            return None
    finally:
        logging.disable(logging.NOTSET)
    spec = getattr(config, "model_spec", None)
    if spec is None:
        return None
    try:
        if why is None:
            hf = meta_model(hf_config(spec))
            with torch.device("meta"):
                module = spec.model.build()
            Translation(module, spec.state_dict_adapter(spec.model, None)).targets(hf)
    except TitanRefused as exc:
        why = str(exc)
    return None if why is None else f"torchtitan {spec.name} ({spec.flavor}): {why}"


def titan_arguments(command: list[str]) -> list[str]:
    """torchtitan's own arguments in a launch command: those after its entry point (`-m MODULE`, a script, or a
    console script), as the one parse of the command reads them (parity/attaching/command.py)."""
    from parity.attaching.command import parse

    return parse(command).arguments


class TitanRecording:
    """One torchtitan Trainer's recording (the module docstring): checked at the trainer's construction (a refusal
    stops the job, exit 2), the recorder made before its first train_step."""

    def __init__(self, trainer):
        from parity.frameworks.torchtitan.config import TitanRefused, hf_config
        from parity.frameworks.torchtitan.view import TitanView
        from parity.models.model import meta_model

        self.trainer, self.recorder, self.micro, self.logged = trainer, None, 0, {}
        spec = trainer.config.model_spec
        try:
            why = refusal(trainer)
            if why is None:
                model = meta_model(hf_config(spec))
                adapter = spec.state_dict_adapter(spec.model, trainer.config.hf_assets_path)
                self.view = TitanView(trainer, model, adapter, _device(trainer))
                self.view.check_held()
        except TitanRefused as exc:
            why = str(exc)
        if why is not None:
            attach.stop_command(f"torchtitan {spec.name} ({spec.flavor}): {why}")
        self.apart = _documents_apart(spec.model)
        self._patch()

    def _patch(self) -> None:
        trainer = self.trainer
        step, fwd_bwd, log = trainer.train_step, trainer.forward_backward_step, trainer.metrics_processor.log

        def train_step(*args, **kwargs):
            if self.recorder is None and not getattr(self, "_parity_stopped", False):
                self._start()
            out = step(*args, **kwargs)
            self._after_train_step()
            return out

        def forward_backward_step(*, input_dict, labels, global_valid_tokens):
            loss = fwd_bwd(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
            self._micro_batch(input_dict, labels, loss, global_valid_tokens)
            return loss

        def metrics_log(step_, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
            self.logged = {"loss": float(global_avg_loss), "norm": float(grad_norm)}
            return log(step_, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        trainer.train_step, trainer.forward_backward_step = train_step, forward_backward_step
        trainer.metrics_processor.log = metrics_log

    @guarded
    def _after_train_step(self) -> None:
        if self.recorder is None:
            return
        self.recorder.after_step(logged_loss=self.logged.get("loss"), logged_grad_norm=self.logged.get("norm"))
        self.logged = {}
        if self.trainer.step == self.trainer.config.training.steps:
            self.recorder.close()

    @guarded
    def _start(self) -> None:
        """The recorder, before the first step this process trains (after train() loaded any checkpoint)."""
        import importlib.metadata as md

        from parity.recording.recorder import ParityRecorder
        from parity.recording.states import DEFAULT_CHECKPOINT_INTERVAL

        trainer = self.trainer
        config = trainer.config
        training = config.training
        folder, name = attach.variables()
        schedulers = getattr(trainer.lr_schedulers, "schedulers", [])
        interval = config.checkpoint.interval if config.checkpoint.enable else DEFAULT_CHECKPOINT_INTERVAL
        self.recorder = ParityRecorder(folder, name=name, model=self.view, optimizer=self.view.optimizer,
                                       max_grad_norm=training.max_norm or 0.0,
                                       precision=PRECISIONS[training.mixed_precision_param], framework="torchtitan",
                                       framework_versions={"torchtitan": md.version("torchtitan")},
                                       scheduler=schedulers[0] if len(schedulers) == 1 else None,
                                       start_step=trainer.step - 1, checkpoint_interval=interval)
        if self.recorder.enabled:  # FSDP2 reduces, and accumulates, in torchtitan's mixed_precision_reduce
            reduce = REDUCE.get(training.mixed_precision_reduce)
            self.recorder.record.data["config"].update(reduce_dtype=reduce, grad_accum_dtype=reduce)

    @guarded
    def _micro_batch(self, input_dict, labels, loss, tokens) -> None:
        """One micro-batch's rows, as the replay feeds them (the module docstring), and its summed loss; after the
        step's last micro-batch, the gradients before clipping."""
        import torch
        from torch.distributed.tensor import DTensor

        from parity.recording.rows import next_token_rows

        rec = self.recorder
        ids, positions = input_dict["input"], input_dict.get("positions")
        with torch.no_grad():
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            summed = float(loss.detach().double() * float(tokens))
            row_ids, row_labels = next_token_rows(ids, labels)
            row_positions = None if positions is None else torch.cat([positions, positions[:, -1:] + 1], 1)
        rec.micro_batch(row_ids, row_labels, None, attention_mask=None if self.apart else torch.ones_like(row_ids),
                        position_ids=row_positions, use_cache=False, summed_loss=summed)
        self.micro += 1
        if self.micro == self.trainer.gradient_accumulation_steps:
            self.micro = 0
            rec.before_step()


def _documents_apart(model_config) -> bool:
    """Whether the job's attention keeps a packed row's documents apart: FlexAttention's and varlen's block-causal
    masks (torchtitan builds them from the positions); SDPA is causal over the whole row."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    layers = getattr(model_config, "layers", None) or []
    return bool(layers) and isinstance(layers[0].attention.inner_attention,
                                       (FlexAttention.Config, VarlenAttention.Config))


def _device(trainer) -> torch.device:
    """Where the job's collectives run: its device (torchtitan's), CPU under gloo."""
    import torch
    import torch.distributed as dist

    return trainer.device if dist.get_backend() != "gloo" else torch.device("cpu")


__all__ = ["TitanRecording", "command_refusal", "config_refusal", "install", "refusal", "titan_arguments"]
