"""The layer check's shared inputs (driver side): the one global batch every strategy's recorded step slices,
written once per layer-check folder (step 0 of the run's data, or the step a replay records)."""

from __future__ import annotations

from parity.errors import ConfigError
from parity.storage import atomic_path
from parity.run_config import RunConfig

INPUTS_FILE = "inputs.safetensors"


def write_inputs(batches, seed: int, path: str, step: int = 0) -> None:
    """The global batch every run of the folder uses: a step (0, or the one a replay records) of the run's
    data, its input ids and labels (−100 on padding), and packed rows' position ids (--packing)."""
    from safetensors.torch import save_file

    batch = batches(step)
    positions = {} if batch.position_ids is None else {"position_ids": batch.position_ids}
    with atomic_path(path) as tmp:
        save_file({"input_ids": batch.input_ids, "labels": batch.labels, **positions}, tmp,
                  metadata={"dataset": batches.dataset.describe(), "seed": str(seed)})


def check_inputs(path: str, cfg: RunConfig) -> None:
    """The folder's inputs must be the global batch this run would slice: same size and length."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            max_id = int(f.get_tensor("input_ids").max()) if "input_ids" in shapes else -1
    except Exception as exc:
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}): delete the folder's inputs and "
                          f"weights to start afresh") from None
    want = (cfg.global_batch_size, cfg.seq_length)
    if shapes.get("input_ids") != want or shapes.get("labels") != want:
        raise ConfigError(f"{path} holds a global batch of {shapes.get('input_ids')}, this run needs {want} "
                          f"(batch_size {cfg.batch_size} × dp_size {cfg.dp_size}, seq_length {cfg.seq_length}): "
                          f"use the folder's settings or a fresh --output_dir")
    if ("position_ids" in shapes) != cfg.packing:
        held = "packed rows" if "position_ids" in shapes else "rows that are not packed"
        raise ConfigError(f"{path} holds {held}, this run {'packs' if cfg.packing else 'does not pack'} them: use the "
                          f"folder's --packing setting or a fresh --output_dir")
    vocab_size = cfg.model_config["vocab_size"]
    if max_id >= vocab_size:
        raise ConfigError(f"{path} holds token id {max_id}, beyond the model's vocab ({vocab_size}): "
                          f"use a fresh --output_dir for this model")
