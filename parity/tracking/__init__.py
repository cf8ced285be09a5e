"""Experiment trackers (--report_to): trackers (which run, on the driver and rank 0), tracker (their interface),
and one module per tracker, each through its own library: wandb_tracker, mlflow_tracker, tensorboard_tracker."""
