"""A record replayed under the harness's trusted loop (replay.py): which loop fits a worker (replay_choice.py), and a
post-training record's rollouts as its data (objective_replay.py)."""
