"""accelerate: a loop of your own under it keeps its ParityRecorder lines (docs/own_trainer/accelerate.md#accelerate), which
read its prepared model and AcceleratedOptimizer as they are (parity/views/table.py) and its state's view of
the world (parity/recording/world.py); Hugging Face's Trainer runs on it too. This room declares the releases
recorded; it records nothing by itself."""

from parity.frameworks import Framework

FRAMEWORK = Framework("accelerate", records=None, module="accelerate", oldest="1.12.0")
