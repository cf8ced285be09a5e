"""What the installed DeepSpeed cannot run here, refused in one line before any worker starts instead of failing inside
DeepSpeed's own step: a release's paths that break on the installed torch (measured, docs/deepspeed.md), and the
families or layouts its AutoEP cannot train. Apart from the strategy because they are the driver's checks (validate),
each a table or a rule that follows DeepSpeed's releases rather than the strategy's design.
"""

from __future__ import annotations

import torch

from parity.errors import ConfigError
from parity.models.families import transformers_version
from parity.precision import POLICIES
from parity.strategies.autotp.library import deepspeed_version


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
        raise ConfigError(f"DeepSpeed {deepspeed_version()}'s AutoEP has no preset for a '{model_type}' model: use "
                          f"--ep_size 1, or train_fsdp.py / train_transformers.py for expert parallelism")
    adapter = get_preset_adapter(get_preset(preset).preset_adapter or preset)
    takes_default = len(inspect.signature(output_capturing._CAN_RECORD_REGISTRY.get).parameters) > 1
    if isinstance(adapter, TransformersTopLevelRouterLogitsAdapter) and not takes_default:
        raise ConfigError(f"DeepSpeed {deepspeed_version()}'s AutoEP cannot convert a '{model_type}' model under "
                          f"transformers {transformers_version()}: its router-logits adapter calls transformers' "
                          f"output-capture registry as get(key, default), which this transformers' does not take "
                          f"(a TypeError inside deepspeed.initialize): use train_fsdp.py or train_transformers.py for "
                          f"expert parallelism")
