"""The FSDP2 strategy's helpers: its TP, sequence and expert plans, expert parallelism (class: fsdp_strategy.py)."""
