"""The parity harness: the same model, weights and batches under five strategies — DDP, DeepSpeed AutoTP + ZeRO,
FSDP2 + DTensor TP, pipelines, and transformers' own TP and EP — trained under Ray Train and compared.

A run is placed on three axes: the layout (strategy; dp/tp/pp/ep), the model (family) and the precision policy.
From the lowest floor up (a module imports only from lower floors):

    errors storage console run_config layout precision registry fingerprint
                  the lowest floor: exceptions raised on purpose, local paths and URIs written atomically, the
                  terminal, the resolved RunConfig, the layout, the precision policies' table, the strategies'
                  table (each row's class loaded by import path), what a run ran (shared and strategy code)
    models/       the model axis: built-in presets, the family seam, building and loading models
    training/     the worker: the strategy API (strategy.py), optimizer, loss, precision runtime, the loop, the
                  loss record, replicas, checkpoints
    strategies/   each strategy's helpers, in a package named after its module (autotp_strategy.py: autotp/)
    layer_check/  the layer check's worker side: one step recorded module by module, its inputs, the replay
    driver/       flags resolved into one RunConfig, Ray Train's launch, the cluster, local process groups
    comparing/    one vocabulary for loss curves and single-step layer dumps: tolerances, verdicts, reports
    tracking/     experiment trackers (--report_to)
    calibration/  the seeded-bug catalogue and the study that calibrates the bf16 verdict
    commands/     what each top-level script runs

The strategy classes are the top-level *_strategy.py modules (ddp_strategy.py, autotp_strategy.py, fsdp_strategy.py,
pipeline_strategy.py, transformers_strategy.py): the files a reader opens to see what differs from DDP.
"""
