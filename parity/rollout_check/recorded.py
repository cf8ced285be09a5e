"""The sampler verdict of a recorded run (docs/sampler.md#trls-grpotrainer-with-vllm): where the record's rollout file
holds the sampler's side (TRL's GRPOTrainer sampling with vLLM), verify_trainer.py judges it as check_rollouts.py
judges a file — each row rescored by the trainer's model at the weights that sampled it — with the weights the record
holds: step 0's initial weights, and a later step's from the weights the recorder kept at each sync of the sampler, or
from a state it saved for the teacher-forced check (the state after N updates is the weights step N sampled with;
parity/recording/states.py). Rows of a step whose weights the record does not hold (past the recorder's cap) are left
out, and the verdict says which. Where the engine ran in the recorded process, the recorder also compared its
forward with the trainer's model layer by layer at step 0 (parity/frameworks/vllm/layers.py): that goes with it."""

from __future__ import annotations

import json
from dataclasses import replace

from parity import storage

VERDICT_FILE = "sampler_verdict.json"  # beside the records
LAYERS_FILE = "sampler_layers.json"  # in the recorder's folder: where an in-process engine first parted (layers.py)


def judge_recorded(record_file: str) -> dict | None:
    """The sampler verdict of the run recorded in `record_file` (sampler.judge's, with the sampler's `settings`,
    `judged_steps` and `left_out_steps`), or None where its rollout file has no sampler side or no row's weights are
    held."""
    import torch

    from parity.models.model import build_model, hold_full_parameters, load_init_weights, model_config_from_dict
    from parity.objectives.rollouts import read_rollouts
    from parity.rollout_check import sampler
    from parity.training.record import load_record
    from parity.training.recorded_states import INDEX, read_state

    config = load_record(record_file)["config"]
    folder = storage.parent(storage.absolute(record_file))
    if not config.get("rollouts"):
        return None
    rollouts = read_rollouts(storage.join(folder, config["rollouts"]))
    if not rollouts.sampler:
        return None
    index = storage.join(storage.parent(storage.join(folder, config["rollouts"])), INDEX)
    saved = json.loads(storage.read_bytes(index)) if storage.exists(index) else {}
    states = {**{u: {**w, "step_count": 0} for u, w in saved.get("sampler_weights", {}).items()},
              **saved.get("states", {})}  # a state's parameters where both hold a step's
    steps = sorted(set(rollouts.tensors["sampler_weights_step"].tolist()))
    model_config = model_config_from_dict(config["model_config"])
    models = {}
    for step in steps:
        if step == 0:
            models[0] = build_model(model_config, 0).eval()
            load_init_weights(models[0], storage.join(folder, config["init_weights_path"]))
        elif str(step) in states:
            entry = states[str(step)]
            models[step] = build_model(model_config, 0).eval()
            hold_full_parameters(models[step], read_state(storage.join(folder, entry["file"]),
                                                          entry["step_count"]).params)
    if not models:
        return None
    rows = torch.isin(rollouts.tensors["sampler_weights_step"], torch.tensor(sorted(models)))
    kept = replace(rollouts, tensors={k: v[rows] if v.dim() and len(v) == len(rows) and k != "step_rows" else v
                                      for k, v in rollouts.tensors.items()})
    result = sampler.judge(kept, models, rollouts.sampler)
    layers = storage.join(storage.parent(storage.join(folder, config["rollouts"])), LAYERS_FILE)
    if storage.exists(layers):
        result["layers"] = json.loads(storage.read_bytes(layers))
    return {**result, "settings": rollouts.sampler, "judged_steps": sorted(models),
            "left_out_steps": [s for s in steps if s not in models]}


__all__ = ["LAYERS_FILE", "VERDICT_FILE", "judge_recorded"]
