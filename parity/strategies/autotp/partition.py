"""How AutoTP shards a model family: DeepSpeed's own conversion of the Hugging Face TP plan where it accepts the plan's
styles, else a tensor_parallel.partition_config written from the family seam (parity.models.families), else a one-line
refusal naming DeepSpeed's limit. Apart from the strategy because both the driver (validate: refuse before launch) and
the engine config (the worker) ask it, and because its rules follow what each DeepSpeed release accepts.
"""

from __future__ import annotations

import re

from parity.errors import ConfigError
from parity.models.families import family_of
from parity.strategies.autotp.library import deepspeed_version


def autotp_partition_config(model_config, user: dict) -> dict | None:
    """How AutoTP shards the model: None where DeepSpeed's own path does it — the user's
    tensor_parallel.partition_config, or the model's Hugging Face TP plan, which DeepSpeed converts when it knows every
    style in it (Llama, Qwen2/3, Gemma3, Mistral) — else a partition_config written from the family seam
    (parity.models.families), where DeepSpeed supports the shapes. ConfigError naming DeepSpeed's limit otherwise.

    The written config (OLMo2, Phi3, whose plans use rowwise_split_input, a style DeepSpeed 0.19.8 refuses): OLMo2's
    q, k, v column-parallel with gathered outputs, because its q/k norms span all heads, and then o_proj replicated
    (DeepSpeed's row-parallel layer takes a split input only); Phi3's attention replicated whole. Phi3 slices its
    fused qkv output at offsets of the attention module's num_key_value_heads, which AutoTP divides by tp_size
    whenever a weight under the module is sharded, gathered output or not (update_mp_params: "Number of heads in key
    and value must divide the number of heads in query"); and DeepSpeed 0.19.8 refuses gather_output with a
    part-by-part shape ("AutoTP gather_output does not yet support shaped sub-parameter layers"). The MLP's gate and
    up (or a fused gate_up, part by part: shape (2, -1)) column-parallel, down_proj row-parallel; an untied lm_head
    column-parallel with a gathered output, as the Hugging Face plan has it."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    from parity.models.model import meta_model

    if (user.get("tensor_parallel") or {}).get("partition_config"):
        return None
    family = family_of(model_config)
    if family.moe:
        raise ConfigError(f"DeepSpeed AutoTP cannot shard a '{family.model_type}' model: DeepSpeed "
                          f"{deepspeed_version()} refuses its experts' plan (moe_tp_experts) and shards no fused 3-D "
                          f"expert weight: use --tp_size 1 (ZeRO), or train_fsdp.py / train_transformers.py")
    try:
        TPPlanConverter.convert(_get_hf_tp_plan(meta_model(model_config)))
        return None
    except ValueError as exc:
        refused = str(exc).split(":", 1)[-1].split(".", 1)[0].strip()
    if family.why_no_tp:
        raise ConfigError(f"DeepSpeed AutoTP cannot shard a '{family.model_type}' model: its Hugging Face TP plan has "
                          f"styles DeepSpeed {deepspeed_version()} refuses ({refused}) and the harness cannot describe "
                          f"its layers ({family.why_no_tp}): use --tp_size 1, or train_fsdp.py")

    def spec(name: str, kind: str, **extra) -> dict:
        return {"patterns": [rf".*\.{re.escape(name)}\.weight$"], "partition_type": kind, **extra}

    fused = any(p.fused for p in family.attention_in)
    gathered = bool(family.width_norms)
    specs = [spec(p.name, "skip" if fused else "column", gather_output=gathered) for p in family.attention_in]
    specs.append(spec(family.attention_out, "skip" if fused or gathered else "row"))
    specs += [spec(norm, "skip", grad_allreduce=True) for norm in family.head_norms]
    specs += [spec(p.name, "column", **({"shape": [len(p.parts), -1], "partition_dim": 0} if p.fused else {}))
              for p in family.mlp_in]
    specs.append(spec(family.mlp_out, "row"))
    if not family.tied:
        specs.append({"patterns": [rf"^{re.escape(family.final[-1])}\.weight$"], "partition_type": "column",
                      "gather_output": True})
    return {"use_default_specs": False, "layer_specs": specs}
