"""The recorder's core (docs/own_trainer.md): ParityRecorder (recorder.py) for any training loop, built on the
per-step observer, and what it records — rows and batches, states, tensors through a layout (sharded.py), the world
it trains in. It knows layouts, never a framework's names (those live in parity/frameworks/)."""
