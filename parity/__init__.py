"""The parity harness: the same model, weights and batches under DDP, DeepSpeed AutoTP + ZeRO, FSDP2 + DTensor TP,
pipelines and transformers' own TP and EP — and your own trainer's run replayed under DDP — trained and compared.

What a user's script imports comes from here (docs/own_trainer.md), and stays here whatever the rooms behind it do:

    from parity import ParityRecorder                 # a loop of your own (recording/recorder.py)
    from parity import ParityCallback                 # transformers' Trainer and TRL (frameworks/transformers)
    from parity import ParityLightningCallback        # Lightning (frameworks/lightning)
    from parity import read_rollouts, write_rollouts  # the rollout file (objectives/rollouts.py)

and what the examples use to start and build: `launch`, `backend`, `rank_device`, `held_port`,
`agent_store_environment` (attaching/launch.py), `build_model`, `resolve_model_config` (models/model.py),
`import_deepspeed`, and the harness's TP plan and clip for a sharded loop: `tensor_parallel`, `clip_sharded_gradients`. Each is imported when first asked for: `import parity` imports no framework. A strategy of your
own implements parity.training.strategy's API (docs/custom_strategy.md). The names of earlier releases
(parity.integrations.*) still import, saying once where they went (parity/integrations/__init__.py).

The house, from the lowest floor up (docs/architecture.md; a module imports only from lower floors):

    errors storage console run_config layout precision registry fingerprint gc_thresholds    the lowest floor
    models/       the model axis: built-in presets, the family seam, building and loading models
    training/     the worker: the strategy API (strategy.py), optimizer, loss, precision runtime, the loop, the
                  loss record, the per-step observer, replicas, checkpoints, the teacher-forced check
    attaching/    how verify_trainer.py attaches to a command: variables, import hooks, the layer cut, launchers
    layer_check/  the layer check's worker side
    strategies/   each strategy's helpers, in a package named after its module (autotp_strategy.py: autotp/)
    driver/       flags resolved into one RunConfig, Ray Train's launch, local process groups
    objectives/   what a step's gradient is the gradient of (GRPO family, DPO) and the rollout file
    comparing/ calibration/ tracking/ rollout_check/   the verdict, reports, the seeded bugs, trackers, RL inputs
    recording/    your own trainer's recorder and the layouts it reads a sharded model through
    replay/       a record replayed under the harness's DDP (or FSDP2, ZeRO-3)
    frameworks/   one room per framework (Trainer, Lightning, TRL, torchtitan, vLLM, megatron-core)
    commands/     what each top-level script runs;   cli.py  the `parity` console command

The strategy classes are the top-level *_strategy.py modules (ddp_strategy.py, autotp_strategy.py, fsdp_strategy.py,
pipeline_strategy.py, transformers_strategy.py): the files a reader opens to see what differs from DDP.
"""

import importlib

PUBLIC = {  # name → the module it lives in (the rooms behind it may move; this table follows them)
    "ParityRecorder": "parity.recording.recorder",
    "ParityCallback": "parity.frameworks.transformers.callback",
    "ParityLightningCallback": ("parity.frameworks.lightning.callback", "ParityCallback"),
    "read_rollouts": "parity.objectives.rollouts",
    "write_rollouts": "parity.objectives.rollouts",
    "RolloutFile": "parity.objectives.rollouts",
    "launch": "parity.attaching.launch",
    "backend": "parity.attaching.launch",
    "rank_device": "parity.attaching.launch",
    "held_port": "parity.attaching.launch",
    "agent_store_environment": "parity.attaching.launch",
    "build_model": "parity.models.model",
    "resolve_model_config": "parity.models.model",
    "import_deepspeed": "parity.deepspeed_import",
    "tensor_parallel": "parity.strategies.fsdp.plans",
    "clip_sharded_gradients": "parity.training.dtensor_strategy",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    """A public name, imported from its module when first asked for (PEP 562)."""
    if name not in PUBLIC:
        raise AttributeError(f"module 'parity' has no attribute {name!r}")
    module, attribute = PUBLIC[name] if isinstance(PUBLIC[name], tuple) else (PUBLIC[name], name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(PUBLIC))
