"""Seeded bugs of LoRA fine-tuning (--lora_r, parity/models/adapters.py): copies of the strategies with the classic
bugs of adapters on a frozen base, each of which the harness must FAIL at its step (tests/test_lora.py). With
parity.calibration.bugs (whose style they follow: importable by path, recording under the strategy's name but for the
DDP copy), kept apart so that each module stays one subject.

- Adapters never gradient-synced: adapters added after the model was wrapped for DP (DDP built before peft injected
  them, or an FSDP wrapping that predates them) are no reduction's; each rank steps its own slice's gradient and the
  ranks train apart with no error. The replica check FAILs it at step 0.
- A frozen base that moves: a hand-written decoupled weight decay that walks `model.parameters()` instead of the
  optimizer's groups decays the frozen base too. The frozen check (parity/training/frozen.py) FAILs it at step 0.
- Adapters given weight decay where the baseline's have none: parity.calibration.bugs' FSDPWeightDecayAdded under
  --lora_r (its optimizer holds the adapters only); the teacher-forced check FAILs it at step 0 in fp32 (in bf16 a
  decay of lr × 0.01 a step hides in the rounding of a short run).
- The adapters' scale of rank-stabilised LoRA (alpha / √r, peft's use_rslora) where the run asked for alpha / r: the
  adapters' output, and so lora_B's gradient, off by √r — a setting frameworks default differently.
- Adapters that keep peft's own draw instead of the run's initial values (transformers' TP, which rebuilds the model
  through from_pretrained): the grad norm FAILs at step 0 (tests/test_lora_strategies.py).
- A saved tied embedding's two copies stepped apart (the pipeline's ends: --lora_modules_to_save embed_tokens): the
  replica check FAILs it at step 0 (tests/test_lora_saved_modules.py).
"""

from __future__ import annotations

import math

import torch

from ddp_strategy import DDPStrategy
from fsdp_strategy import FSDPStrategy
from pipeline_strategy import PipelineStrategy
from parity.models.adapters import adapter_names, add_adapters
from transformers_strategy import TransformersStrategy
from parity.training.dtensor_strategy import local

BASE_DECAY = 0.01  # the decoupled weight decay of the hand-written loop (torch.optim.AdamW's default value)


class DDPAdaptersUnreduced(DDPStrategy):
    """The adapters of every layer but the first are left out of DDP's gradient all-reduce, as when peft injects them
    after DDP wrapped the model (all of them: DDP then refuses a model with nothing to reduce, so the first layer's are
    kept): every rank steps them with its own slice's gradient, the loss (gathered) shows their mean."""

    name = "ddp_adapters_unreduced"

    def setup(self, model) -> None:
        late = [n for n in adapter_names(model) if not n.startswith("model.layers.0.")]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, late)
        super().setup(model)


class FSDPBaseDecayed(FSDPStrategy):
    """After each step, a hand-written decoupled weight decay multiplies every parameter of the model — the frozen
    base included — by 1 − lr × BASE_DECAY (each rank its shards)."""

    def optimizer_step(self, lr: float):
        done = super().optimizer_step(lr)
        with torch.no_grad():
            for p in self.model.parameters():
                local(p).mul_(1 - lr * BASE_DECAY)
        return done


class FSDPAdapterScaleRankStabilised(FSDPStrategy):
    """Every adapter scaled by alpha / √r (rank-stabilised LoRA) instead of the run's alpha / r."""

    def setup(self, model) -> None:
        for module in model.modules():
            if hasattr(module, "lora_A"):
                for adapter in module.scaling:
                    module.scaling[adapter] = module.lora_alpha[adapter] / math.sqrt(module.r[adapter])
        super().setup(model)


class TransformersAdaptersRedrawn(TransformersStrategy):
    """The Hugging Face user's path taken literally: from_pretrained loads the base, get_peft_model adds the adapters —
    and they keep peft's own draw (lora_A Kaiming-uniform from this process's RNG, lora_B 0) instead of the run's
    initial values, which the model the strategy was handed holds. lora_B is 0 either way, so the loss of step 0 is the
    base's and equal to DDP's; but lora_B's gradient is lora_A's output times the error, so the grad norm is another
    from step 0, and so is every step after."""

    def place_adapters(self, initial) -> None:
        self.model = add_adapters(self.model, self.cfg.lora)


class PipelineSavedTieUnsummed(PipelineStrategy):
    """--lora_modules_to_save embed_tokens on a tied model, its two ends on two ranks: the trained copy of the embedding
    on the first stage and lm_head's copy of it on the last each stepped with its own end's gradient — the tie's sum
    left out (a pipeline that sums only the stock tied weight, by its stock name). The two copies of one weight part
    at step 0."""

    def sum_tied_gradients(self) -> None:
        return None
