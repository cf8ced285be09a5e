"""TRL's trainers: recorded through Trainer's callback, which asks the registry what a trainer built on Trainer trains
(`trains`); here, their objectives read from their arguments and the feeds of their micro-batches (objectives.py),
the sampler side of TRL's colocated vLLM read through the sampler seam (parity/frameworks/sampling.py)."""

from parity.frameworks import Framework


def _trains(trainer, optimizer):
    from parity.frameworks.trl.objectives import trained

    return trained(trainer, optimizer)


FRAMEWORK = Framework("trl", "TRL's trainers", "trl", "0.29.0", trains=_trains)
