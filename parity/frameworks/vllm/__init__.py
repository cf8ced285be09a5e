"""vLLM, the sampler of RL runs at scale: make_rollouts.py --sampler vllm samples a rollout file's completions with it
(sampler.py), each token's log-prob as vLLM reports it (docs/sampler.md). It records no training run by itself."""

from parity.frameworks import Framework

FRAMEWORK = Framework("vllm", records=None, module="vllm", oldest="0.27.0")
