"""The DeepSpeed strategy's helpers: engine config, guards, AutoTP partition, gathers (class: autotp_strategy.py)."""
