"""megatron-core's room (docs/megatron.md): its GPTModel read under Hugging Face names — the transformers config
built from its TransformerConfig (config.py) and its full tensors, gathered over tensor parallelism, renamed and split
as Llama's and Qwen2's (names.py). Its jobs are not yet recorded by verify_trainer.py: nothing here attaches to a
command (records None), and a megatron-core loop runs as it would without the harness."""

from __future__ import annotations

from parity.frameworks import Framework

FRAMEWORK = Framework(name="megatron", records=None)
