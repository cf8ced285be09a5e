"""verify_trainer.py --num_layers N: the user's unchanged command trains their model cut to its first N decoder layers,
at its real widths, vocabulary, heads, tied ends and parallel plans (docs/own_trainer/replay.md#your-model-at-its-real-widths).

Every transformers model is built through PreTrainedModel.__init__, which a model's own __init__ calls before it builds
a layer: from_pretrained, from_config, a class called on a config, TRL's builders (a model name given to its trainers
or its CLI), a LightningModule's configure_model. Under the variable (PARITY_NUM_LAYERS, set by attach.environment in
every process of the command: sitehook/sitecustomize.py calls `install`), that __init__ first cuts the config it is
given in place (parity.models.families.cut_in_place: the language model's config, its per-layer lists with it), so the
stack is built N deep; from_pretrained then finds no parameter for a layer beyond N, and leaves its tensors in the
checkpoint unread (transformers' loader materialises only the keys the model has; their load report is silenced here,
one line says what was cut). The recorder writes `layer_cut` into the record (`recorded`) and the replay, built from
the recorded config, is the same cut model. A model the hook did not cut is refused by the recorder in one line
(NotCut); before the command runs, verify_trainer.py refuses a command whose code builds its model in no way the hook
reaches (model_builders.py).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

from parity.attaching.import_hook import when_imported
from parity.models.families import cut_in_place, hf_config, text_config

NUM_LAYERS = "PARITY_NUM_LAYERS"  # the depth verify_trainer.py --num_layers asks for
MODULE = "transformers.modeling_utils"

_cut: dict[int, tuple] = {}  # id(a language model's config cut here) → (a weak reference to it, the layers it had)


def _layers_before_cut(text) -> int | None:
    """The layers the config `text` had where this process cut it, else None (an id outlives its object: a config
    made later may have a cut one's id, which the weak reference tells apart)."""
    found = _cut.get(id(text))
    return found[1] if found is not None and found[0]() is text else None


class NotCut(Exception):
    """--num_layers was asked for and the model the recorder was given is not cut: one line, nothing recorded."""


def requested() -> int | None:
    """The depth --num_layers asks for in this process (None: no cut)."""
    value = os.environ.get(NUM_LAYERS)
    return int(value) if value else None


def install() -> None:
    """Cut every transformers model built in this process, from the moment transformers' modeling_utils is imported."""
    if requested():
        when_imported(MODULE, lambda module: _wrap(module.PreTrainedModel))


def _wrap(model_class) -> None:
    init = model_class.__init__

    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        n = requested()
        text = text_config(config)
        had = cut_in_place(config, n)
        if had is not None:
            _cut[id(text)] = (weakref.ref(text), had)
            _say(f"parity: --num_layers {n}: {type(self).__name__} built with its first {n} of {had} decoder layers "
                 f"(the rest's weights are not loaded)")
        init(self, config, *args, **kwargs)
        if (had := _layers_before_cut(text)) is not None:  # the checkpoint's layers beyond n: not loaded, nor reported
            beyond = "|".join(str(i) for i in range(n, had))
            ignored = set(type(self)._keys_to_ignore_on_load_unexpected or ())
            self._keys_to_ignore_on_load_unexpected = ignored | {rf"(^|\.)layers\.({beyond})\."}

    model_class.__init__ = __init__


def _say(line: str) -> None:
    """Once a process, from its first rank (or where no launcher numbered the ranks)."""
    if os.environ.get("RANK", "0") == "0" and not getattr(_say, "said", False):
        _say.said = True
        print(line, file=sys.stderr, flush=True)


def recorded(model) -> dict | None:
    """The record's `layer_cut`: {"num_layers": N, "of": the decoder layers the model had} where the hook cut it; None
    without --num_layers, or where the model was no deeper than N (nothing to cut). NotCut where --num_layers was asked
    and `model` (the user's module, unwrapped) is deeper than N: it was built where the hook could not cut it."""
    n = requested()
    if n is None:
        return None
    config = hf_config(model)
    if config is None:
        raise NotCut(f"--num_layers {n}: the model ({type(model).__name__}) is not a transformers model: the hook cuts "
                     f"those only; cut it in your code, or leave --num_layers out")
    text = text_config(config)
    if (had := _layers_before_cut(text)) is not None:
        return {"num_layers": n, "of": had}
    depth = getattr(text, "num_hidden_layers", None)
    if isinstance(depth, int) and depth > n:
        raise NotCut(f"--num_layers {n}: the model ({type(model).__name__}) has {depth} decoder layers: it was built "
                     f"where the hook could not cut it (a config transformers builds no causal LM from, or a model "
                     f"unpickled whole); build it with from_pretrained, from_config or its class, or leave "
                     f"--num_layers out")
    return None


__all__ = ["NUM_LAYERS", "NotCut", "install", "recorded", "requested"]
