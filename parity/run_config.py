"""The resolved run: one frozen RunConfig, made by the driver's `resolve` (parity/driver/config.py) and read by every
worker, record and comparison. It sits below both, so that a worker needs nothing of the driver."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from parity.layout import Layout


# RunConfig fields that do not change what is trained: a run may resume with other values of these (a checkpoint's
# identity leaves them out: parity/training/checkpoints.py; the trackers log them as tags: parity/tracking/tracker.py).
# The model is compared by its summary, not by the whole Hugging Face config (which names the library version).
NOT_IDENTITY = ("log_interval", "replica_check_interval", "loss_output_dir", "storage_path", "experiment_name",
                "final_checkpoint_dir", "init_weights_path", "save_init_weights", "cpus_per_worker",
                "checkpoint_interval", "keep_checkpoints", "max_failures", "model_config", "resume", "verbose",
                "report_to", "no_teacher_forced")


REPLAY_ONLY = ("optimizer", "lr_schedule", "tensor_grad")  # RunConfig fields only a replay of a recorded run sets
# The recorded run's config fields its replay copies into its own config as they are (parity/replay/replay.py's
# plan_replay): what may explain a FAIL of the run against its replay (parity/comparing/recorded.py). The replay also
# reads where the record's files are (model_name, init_weights_path, batches: named relative to the record, compared
# through the weights' sha256 and the model's config) and its dp_size (the default worker count, which --num_workers
# changes by design). tests/test_recorded_report.py holds these equal to the fields plan_replay's code reads.
REPLAY_TAKES = ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "precision", "reduce_dtype",
                "grad_accum_dtype", "loss_scaling", "optimizer")
REPLAY_LOCATES = ("model_name", "init_weights_path", "batches", "dp_size")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on, resolved: no 'auto', no missing default. The loss record stores it."""

    strategy: str
    strategy_class: str | None  # "module:Class" of a strategy outside the registry; None: the registry's for `strategy`
    strategy_path: str  # "module:Class" of the run's class, always set: strategy_class, or the registry row's
    model_name: str
    num_layers: int | None
    num_workers: int
    tp_size: int
    dp_size: int
    pp_size: int  # pipeline ranks per model replica, each holding its stages; 1: no pipeline stages
    ep_size: int  # experts sharded over ep_size consecutive ranks; 1: every expert on every rank
    device: str  # cpu | cuda
    precision: str  # the precision policy: fp32 | bf16 | bf16_params | bf16_pure | fp16 (parity.precision)
    reduce_dtype: str  # the dtype gradients are reduced over DP in: fp32 | bf16 | fp16
    grad_accum_dtype: str  # the dtype micro-batch gradients accumulate in
    loss_scaling: dict | None  # fp16's loss scaler (DeepSpeed's fp16 keys); None in the other policies
    cpus_per_worker: float
    batch_size: int
    seq_length: int
    grad_accum_steps: int
    activation_checkpointing: bool
    compile: bool
    num_epochs: int
    debug_steps: int | None
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    warmup_steps: int
    max_grad_norm: float
    seed: int
    dataset: str
    num_samples: int
    tokenizer: str
    log_interval: int
    replica_check_interval: int
    loss_output_dir: str
    report_to: tuple[str, ...]  # the experiment trackers (parity/tracking); not part of the run's identity
    storage_path: str
    experiment_name: str
    init_weights_path: str
    save_init_weights: bool
    final_checkpoint_dir: str
    noise_reference: bool
    checkpoint_interval: int
    keep_checkpoints: int
    resume: bool
    max_failures: int
    verbose: bool
    options: dict[str, Any]  # the strategy's Options, by name (read-only by convention)
    model_config: dict[str, Any]  # the resolved Hugging Face config (num_layers applied): workers rebuild it
    # A replay of a recorded run (parity/replay/replay.py) only; None in every other run, and then left out of
    # to_dict (a harness run's record and checkpoints are as they were):
    optimizer: dict | None = None  # the recorded optimizer, {"type", "groups": [{"params": names, "lr_scale", ...}]}
    lr_schedule: tuple | None = None  # the lr applied at each step, as recorded (parity.training.optimizer.lr_at)
    betas_schedule: tuple | None = None  # each group's betas at each step, where a scheduler moved them (lr_at)
    clip_value: float | None = None  # a record's clip by value (clip_grad_value_), in place of max_grad_norm's
    # which gradient every tensor's series holds, as the record's does (tensor_norms.PRE_CLIP or CLIPPED: a framework
    # whose hooks come after its clipping records the clipped gradients; Strategy.train_step records its own alike)
    tensor_grad: str | None = None
    # A replay of an fp16 record only (its fp32 twin too): each step's (loss scale, skipped) of the record's loss scaler,
    # which it follows (parity.training.loss_scaler.FollowedScaler); None elsewhere (left out of to_dict)
    loss_scales: tuple | None = None
    no_teacher_forced: bool = False  # --no_teacher_forced: no teacher-forced check (parity/training/teacher_forced.py)
    packing: bool = False  # --packing: documents packed into full rows, position ids restarting (parity/training/data.py)
    padding_free: bool = False  # --padding_free: each micro-batch's samples fed as one row (data.Batch.flattened)
    # --lora_*: LoRA adapters on a frozen base, {"r", "alpha", "dropout", "targets"[, "modules_to_save"]}
    # (parity/models/adapters.py); None:
    # every parameter trains (and the field is left out of to_dict: a full fine-tune's record is as it was)
    lora: dict | None = None
    # --objective (parity/objectives): {"name", "settings"} of a post-training objective, trained on --rollouts; None:
    # the causal-LM token mean (and the field is left out of to_dict: such a run's record is as it was)
    objective: dict | None = None
    # A noise reference at the baseline's own layout whose processes started under another CPU kernel path (the name of
    # parity.driver.local_group.KERNEL_PATHS' entry: other matmul kernels, the noise a CPU kind or GPU changes); None
    # elsewhere (left out of to_dict)
    noise_kernels: str | None = None
    # A noise reference trained in another arithmetic: each micro-batch's loss × this factor before backward, its
    # gradients ÷ it before the step (parity.training.teacher_forced.PERTURB): every bf16 rounding of backward moves, as
    # TP's partial sums or another kernel move them; None elsewhere (left out of to_dict)
    perturb: float | None = None
    # A noise reference that clips its gradients as torch.nn.utils.clip_grad_norm_ computes it ("torch": fp32 norms, an
    # fp32 coefficient), where the harness clips by a float64 norm: the arithmetic of every framework's loop, which the
    # other references, clipping alike, never draw (PolicyOptimizer.step); None elsewhere (left out of to_dict)
    clip_arithmetic: str | None = None

    @property
    def layout(self) -> Layout:
        """The run's layout (parity.layout): its degrees, each rank's place and groups, made from these fields."""
        return Layout(self.num_workers, self.dp_size, self.tp_size, self.pp_size, self.ep_size)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def use_cuda(self) -> bool:
        return self.device == "cuda"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in (*REPLAY_ONLY, "betas_schedule", "clip_value", "lora", "objective", "noise_kernels", "perturb",
                    "clip_arithmetic", "loss_scales"):
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        return cls(**data)
