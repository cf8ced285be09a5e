"""Your own trainer, verified: a recorder for any training loop (recorder.py), built on the per-step observer
(parity/training/observer.py), and the replay of what it recorded under the harness's DDP (replay.py)
(docs/own_trainer.md)."""
