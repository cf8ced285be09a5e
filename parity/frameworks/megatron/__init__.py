"""megatron-core's room (docs/megatron.md): a megatron-core loop recorded unchanged (recording.py) — its GPTModel read
under Hugging Face names through a view of the recorder's (view.py), the transformers config built from its
TransformerConfig (config.py), its full tensors gathered over tensor parallelism, renamed and split as Llama's and
Qwen2's (names.py)."""

from __future__ import annotations

from parity.frameworks import Framework


def _install() -> None:
    from parity.frameworks.megatron import recording

    recording.install()


FRAMEWORK = Framework(name="megatron", records="megatron-core's get_forward_backward_func loop", module="megatron.core",
                      oldest="0.15.0", install=_install)
