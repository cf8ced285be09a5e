"""The recorded run's description: the record's `config` (docs/own_trainer.md#what-the-record-holds) as the
recorder starts — the loop's model, optimizer, precision and view of its process group (parity/views/), the batches'
folder, the framework and the fingerprint — in the fields and order the harness's own records hold them."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from parity.attaching import layer_cut
from parity.fingerprint import fingerprint
from parity.models.model import config_summary, file_sha256
from parity.training.observer import device_name
from parity.training.record import RECORDER_SOURCE as SOURCE


def describe_run(rec, *, here: str, config, optimizer, framework: str, framework_versions: dict,
                 policy: dict, max_grad_norm: float, max_batch_bytes: int) -> dict:
    """The record's config for recorder `rec` (its name, view, model, optimizer's description, objective and device
    set): `here` the recorded folder's name, `config` the model's (None: not a Hugging Face model), `optimizer` the
    torch optimizer that steps, `policy` the precision policy's fields (precision_seen.told)."""
    hf = config is not None
    group0 = optimizer.param_groups[0]
    betas = group0.get("betas", (0.0, 0.0))
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    framework_part = {"name": framework, "versions": framework_versions,
                      "script": os.path.basename(script) if script else None,
                      "script_sha256": file_sha256(script) if script and os.path.isfile(script) else None}
    return {
        "source": SOURCE, "framework": framework, "strategy": rec.name, "strategy_path": None,
        "model_name": here, "model_type": getattr(config, "model_type", None),
        "hugging_face_model": hf, "attn_implementation": getattr(config, "_attn_implementation", None),
        "tp_size": rec.view.tp_size, "pp_size": 1, "ep_size": 1,
        "dp_size": rec.view.dp_size, "sharding": rec.view.describe(),
        "num_workers": rec.world, "world_size": rec.world, "batch_size": None, "global_batch_size": None,
        "grad_accum_steps": None, "seq_length": None, **policy, "total_steps": None, "init_weights_sha256": None,
        "init_weights_path": f"{here}/init_weights.safetensors" if hf else None,
        "model_config": config_summary(config) if hf else {}, "lora": rec.view.lora,  # a PEFT model's adapters
        "layer_cut": layer_cut.recorded(rec.model),  # verify_trainer.py --num_layers: {"num_layers", "of"}
        "learning_rate": float(group0.get("initial_lr", group0.get("lr", 0.0))),
        "max_grad_norm": float(max_grad_norm), "weight_decay": float(group0.get("weight_decay", 0.0)),
        "adam_beta1": float(betas[0]), "adam_beta2": float(betas[1]), "adam_epsilon": float(group0.get("eps", 0.0)),
        "optimizer": rec.optimizer_description, "grad_norm_source": None, "loss_source": "recorder",
        "batches": {"folder": f"{here}/batches", "max_bytes": max_batch_bytes, "saved_steps": 0,
                    "most_rows": 0, "position_ids_from": None},
        "not_replayable": None if hf else f"the model ({type(rec.model).__name__}) is not a Hugging Face model",
        "stopped": None, "resumed_at": [], "rollouts": None,
        **(rec.objective_rows.describe_record() if rec.objective_rows else {"objective": None}),
        "device_type": rec.trains_on.type, "device_name": device_name(rec.trains_on), "backend": dist.get_backend(),
        "fingerprint": {**fingerprint(type(rec), rec.trains_on, getattr(config, "model_type", None)),
                        "framework": framework_part},
    }


__all__ = ["describe_run"]
