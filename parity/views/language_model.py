"""An image-text model trained on text, read as its language model: what the replay builds of it.

Gemma 3 4B–27B (`Gemma3ForConditionalGeneration`) and the like hold a language model, a vision tower and a projector.
A run that feeds them text trains the language model alone: the towers take no part in the forward, get no gradient,
and AdamW never steps them. The recorder reads such a model through an alias — the language model's own causal-LM
class (`Gemma3ForCausalLM`), built on the meta device, its decoder and head replaced by the run's own modules — so its
names, norms, initial weights and config are the language model's (`model.layers.0…`), the parameters and modules the
run's very own (hooks on them fire in the run's forward). The towers' parameters are left out of the optimizer's
groups, and a forward of a tower during training (images fed) stops the record at that step in one line: the replay
feeds text.
"""

from __future__ import annotations

import torch

from parity.models.families import causal_lm_class, hf_config, language_model
from parity.views.base import ViewRefused


class AliasRefused(ViewRefused):
    """The multimodal model's language model cannot be read as its causal-LM class (one line)."""


def text_alias(model) -> tuple[torch.nn.Module, list[tuple[str, torch.nn.Module]]]:
    """(the language model's causal LM sharing `model`'s decoder and head, [(name, tower module)] of what lies outside
    them) for a multimodal Hugging Face model; (`model`, []) for any other module."""
    config = hf_config(model)
    if config is None:
        return model, []
    text = language_model(config)
    if text is config:
        return model, []
    cls = causal_lm_class(text)
    with torch.device("meta"):
        alias = cls(text)
    expected = {n: tuple(p.shape) for n, p in alias.named_parameters()}
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if type(decoder) is not type(alias.get_decoder()) or head is None:
        raise AliasRefused(f"a multimodal '{config.model_type}' model whose language model is not {cls.__name__}'s "
                           f"decoder and head: the replay builds {cls.__name__}")
    setattr(alias, alias.base_model_prefix, decoder)
    alias.set_output_embeddings(head)
    got = {n: tuple(p.shape) for n, p in alias.named_parameters()}
    if got != expected or any(t.is_meta for t in (*alias.parameters(), *alias.buffers())):
        raise AliasRefused(f"a multimodal '{config.model_type}' model whose language model's tensors are not "
                           f"{cls.__name__}'s: the replay builds {cls.__name__}")
    alias.train(model.training)
    return alias, _outside(model, {id(p) for p in alias.parameters()})


def _outside(module, held: set[int], prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """The highest modules under `module` holding parameters, none of them `held` (the towers)."""
    found = []
    for name, child in module.named_children():
        inside = [id(p) in held for p in child.parameters()]
        if inside and not any(inside):
            found.append((prefix + name, child))
        elif inside and not all(inside):
            found += _outside(child, held, f"{prefix}{name}.")
    return found


def watch_towers(towers: list[tuple[str, torch.nn.Module]], on_fed) -> list:
    """Forward pre-hooks on the towers (their handles): a training forward of one calls `on_fed(line)` once (the record
    stops there) and removes them."""
    handles: list = []

    def fed(name):
        def hook(module, args):
            if module.training and torch.is_grad_enabled() and handles:
                for handle in handles:
                    handle.remove()
                handles.clear()
                on_fed(f"the run fed its {name} (a multimodal model's other input): the replay feeds text to its "
                       f"language model alone")
        return hook

    handles += [module.register_forward_pre_hook(fed(name)) for name, module in towers]
    return handles

