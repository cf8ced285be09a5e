"""gpu_check.sh's command (docs/gpu.md): `python -m parity.commands.gpu_check` runs check.py's main; its steps'
modules beside it (collectives, own_trainer, posttrain, and the runs they share)."""
