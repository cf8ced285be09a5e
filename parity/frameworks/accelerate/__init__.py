"""accelerate: a loop of your own under it keeps its ParityRecorder lines (docs/own_trainer/accelerate.md#accelerate), which
read its prepared model and AcceleratedOptimizer as they are (parity/views/table.py) and its state's view of
the world (parity/recording/world.py); Hugging Face's Trainer runs on it too. This room declares the releases
recorded and the precision its Accelerator trains in (precision.py); it records nothing by itself."""

from parity.frameworks import Framework


def _precision(model):
    from parity.frameworks.accelerate.precision import policy_of

    return policy_of(model)


FRAMEWORK = Framework("accelerate", records=None, module="accelerate", oldest="1.12.0", precision=_precision)
