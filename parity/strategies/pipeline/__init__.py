"""pipeline_strategy.py's helpers (its stages)."""
