"""torchtitan config functions for the tests (`--module titan_configs --config NAME`: torchtitan imports any module
that holds them): the llama3 debug model as torchtitan ships it but for what each test needs changed."""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3.config_registry import llama3_debugmodel


def llama3_debugmodel_without_adapter():
    """The debug model with no state-dict adapter: nothing maps its tensors onto a transformers model's."""
    config = llama3_debugmodel()
    config.model_spec = dataclasses.replace(config.model_spec, state_dict_adapter=None)
    return config
