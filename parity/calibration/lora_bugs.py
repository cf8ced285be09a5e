"""Seeded bugs of LoRA fine-tuning (--lora_r) under the strategies that rebuild or split the model: copies that train
other adapters than DDP's while the record claims the same run (tests/test_lora_strategies.py). Importable by path as
parity.calibration.bugs' entries are, recording under the strategy's name (loss_transformers.json).
"""

from __future__ import annotations

from parity.models.adapters import add_adapters
from transformers_strategy import TransformersStrategy


class TransformersAdaptersRedrawn(TransformersStrategy):
    """The Hugging Face user's path taken literally: from_pretrained loads the base, get_peft_model adds the adapters —
    and they keep peft's own draw (lora_A Kaiming-uniform from this process's RNG, lora_B 0) instead of the run's
    initial values, which the model the strategy was handed holds. lora_B is 0 either way, so the loss of step 0 is the
    base's and equal to DDP's; but lora_B's gradient is lora_A's output times the error, so the grad norm is another
    from step 0, and so is every step after."""

    def place_adapters(self, initial) -> None:
        self.model = add_adapters(self.model, self.cfg.lora)
