"""TRL's trainers: recorded through Trainer's callback (parity.frameworks.transformers); here, their objectives read
from their arguments (objectives.py)."""

from parity.frameworks import Framework

FRAMEWORK = Framework("trl", "TRL's trainers", "trl", "0.29.0")
