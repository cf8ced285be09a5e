"""Calibrating the bf16 verdict: the seeded-bug catalogue (bugs.py) and the study that measures how far correct
and buggy runs fall from the baseline over seeds and CPU kernel paths (study.py)."""
