"""The inputs of an RL update, judged (docs/sampler.md): the sampler's log-probs against the trainer's rescoring at the
same weights (sampler.py), and the advantages against the estimator the run names (advantages.py). A rollout file
from any framework carries what both need (parity/objectives/rollouts.py)."""
