"""The model axis: built-in presets, the family seam (what a model family decides), building and loading models."""
