"""The parity harness: the same model, weights and batches under DDP, DeepSpeed and FSDP, compared.

    training/   what every run shares: config, model, data, the loop, the launcher, the loss record
    comparing/  one vocabulary for loss curves and single-step layer dumps: tolerances, verdicts, reports
    commands/   what each top-level script runs
    registry    strategy name → class (the strategy modules are the top-level *_strategy.py files)
    storage     local paths and the URIs Ray Train accepts, written atomically
    errors      every exception the harness raises on purpose
"""
