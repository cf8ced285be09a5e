"""Runs in every Ray worker process of a local cluster (runtime_env worker_process_setup_hook)."""

import logging


def quiet_logs() -> None:
    # Without Ray's dashboard the state API is absent, and Ray Train's placement-group cleaner warns
    # about that once a second for the whole run; the cleaner still works (it falls back to retrying).
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
