"""vLLM, the sampler of RL runs at scale: an engine on the sampler seam (sampler.py; parity/frameworks/sampling.py) —
make_rollouts.py --sampler vllm samples a rollout file's completions with it, each token's log-prob as vLLM reports it,
and TRL's room reads the sampler side of its colocated engine through it (docs/sampler.md). It records no training
run by itself."""

from parity.frameworks import Framework


def _sampler():
    from parity.frameworks.vllm.sampler import ENGINE

    return ENGINE


FRAMEWORK = Framework("vllm", records=None, module="vllm", oldest="0.27.0", sampler=_sampler)
