"""The layer check's recorded step (worker side): one forward/backward/optimizer step, fully recorded.

Every rank runs the same step on its DP slice of one fixed global batch. Forward hooks record each
module's output, tensor hooks each output's gradient; after backward every parameter's gradient, after
the optimizer step every parameter; a mixture of experts' routers also the experts each token went to
(routing/<router>: the comparison counts the loads and finds the flips). All of it is gathered to full size (TP shards by the strategy's
`full_module_output` / `full_gradients` / `full_parameters`, DP slices concatenated along the batch) and
rank 0 writes it under Hugging Face names, so two strategies are compared tensor for tensor — never a
shard's norm against a full tensor's.
"""

from __future__ import annotations

import os

import torch

from parity.fingerprint import fingerprint
from parity.storage import atomic_path, write_json_atomic
from parity.run_config import RunConfig
from parity.layer_check.inputs import INPUTS_FILE
from parity.models.model import config_summary, file_sha256
from parity.layer_check.replay import advance
from parity.training.strategy import ModuleRecords

PERTURBATION = 1e-3  # added to one TP shard by --perturb_param: far above fp32 noise, far below the weights


def dump_paths(output_dir: str, cfg: RunConfig) -> tuple[str, str]:
    """dump_<strategy>.*, or noise_reference_<strategy>.* for a noise reference (the layer check's DDP step in
    fp32, against which bf16 tolerances are calibrated)."""
    stem = os.path.join(output_dir, f"{'noise_reference' if cfg.noise_reference else 'dump'}_{cfg.strategy}")
    return stem + ".safetensors", stem + ".json"


# ---------------------------------------------------------------------------------------------------
# The recorded step (worker side)
# ---------------------------------------------------------------------------------------------------

class ModuleRecorder:
    """Hooks on every submodule: its output (the first tensor of a tuple) and that output's gradient, over every
    call of the step — micro-batches (gradient accumulation, a pipeline's schedule) concatenated along the batch,
    in the order they ran (ascending in forward and in backward under every schedule the harness runs).

    The rotary table, which does not depend on the batch, and meta tensors (shapes without values) are left out; so
    are the submodules of a mixture of experts' experts modules (their activation runs on whichever rows reached this
    rank's experts, in an order of the strategy's making): the experts module's own output and gradient, one row per
    token, hold all of them.
    """

    def __init__(self, model: torch.nn.Module, place=None):
        from parity.models.families import family_of

        self.place = place  # (call index, tensor) → the tensor at the rows' positions (row_places), or None: as it is
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.output_grads: dict[str, list[torch.Tensor]] = {}
        family = family_of(model.config)
        inner = (f".{family.moe.experts}.",) if family.moe else ()
        self.handles = [m.register_forward_hook(self._forward_hook(name))
                        for name, m in model.named_modules() if name and not name.endswith("rotary_emb")
                        and not any(part in name for part in inner)]

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.is_meta:
                return
            self.outputs.setdefault(name, []).append(out.detach().clone())
            if out.requires_grad:
                out.register_hook(self._grad_hook(name))
        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            self.output_grads.setdefault(name, []).append(grad.detach().clone())
        return hook

    def remove(self) -> ModuleRecords:
        """Remove the hooks; the records, each module's calls (placed at their rows' positions) concatenated."""
        for h in self.handles:
            h.remove()
        if self.place is not None:
            for store in (self.outputs, self.output_grads):
                for name, calls in store.items():
                    store[name] = [self.place(i, t) for i, t in enumerate(calls)]
        return ModuleRecords(*({name: calls[0] if len(calls) == 1 else torch.cat(calls) for name, calls in store.items()}
                               for store in (self.outputs, self.output_grads)))


def row_places(batch, fed: list):
    """--padding_free: what puts a module's output of the i-th micro-batch `fed` (one flattened row, the pipeline's
    filled up) back at its rows' positions in `batch` (this rank's slice, in equal micro-batches of consecutive rows),
    zeros on the padding: [1, tokens, ...] as [rows, seq_length, ...], a router's [tokens, ...] as [rows × seq_length,
    ...] — the shapes of the rows fed as they are, whatever a strategy's micro-batches, so that every strategy's
    records compare position for position. None where the rows are fed as they are."""
    rows, seq = len(batch.input_ids) // len(fed), batch.input_ids.shape[1]
    if all(m.input_ids.shape == (rows, seq) for m in fed):
        return None
    lengths = batch.real_lengths()

    def place(i: int, t: torch.Tensor) -> torch.Tensor:
        fed_length = fed[i].input_ids.shape[1]
        per_token = t.dim() >= 2 and t.shape[:2] == (1, fed_length)
        tokens = t[0] if per_token else t
        if tokens.shape[0] != fed_length:
            return t
        placed = tokens.new_zeros(rows * seq, *tokens.shape[1:])
        start = 0
        for r, n in enumerate(lengths[i * rows:(i + 1) * rows]):
            placed[r * seq:r * seq + n] = tokens[start:start + n]
            start += n
        return placed.view(rows, seq, *tokens.shape[1:]) if per_token else placed
    return place


def perturb_local_shard(strategy, param_name: str) -> None:
    """Add PERTURBATION to this rank's piece of one parameter on TP rank 0 only: a fault in one TP shard
    (on every DP replica alike, so DP ranks stay consistent). Used to check the verifier finds it."""
    params = dict(strategy.hf_model.named_parameters())
    if param_name not in params:
        raise ValueError(f"--perturb_param {param_name}: no such parameter (e.g. model.layers.0.mlp.up_proj.weight)")
    if strategy.ctx.tp_rank == 0:
        p = params[param_name]
        with torch.no_grad():
            strategy.local_piece(p).add_(PERTURBATION)


def layer_steps_worker(payload: dict) -> None:
    """Ray Train worker: the recorded steps of payload["runs"], one after another in one worker group (a run of fewer
    workers on its first ranks: parity/training/sub_world.py)."""
    from parity.run_config import RunConfig
    from parity.training.loop import torch_functions_kept
    from parity.training.sub_world import ranks_for

    for run in payload["runs"]:
        with ranks_for(RunConfig.from_dict(run["cfg"]).num_workers) as part, torch_functions_kept():
            if part.trains:  # each strategy's step with torch's own functions (DeepSpeed's ZeRO-3 replaces one)
                layer_step_worker({"terminal": payload.get("terminal", False), **run})


def layer_step_worker(payload: dict) -> None:
    """One fully recorded step; rank 0 writes dump_<strategy>.{safetensors,json}."""
    from safetensors.torch import load_file, save_file

    from parity.training.loop import start_worker
    from parity.training.data import Batch, dp_slice
    from parity.training.optimizer import OptimizerStep
    from parity.training.strategy import lr_at

    w = start_worker(payload)
    cfg, ctx, log, strategy = w.cfg, w.ctx, w.log, w.strategy
    output_dir = payload["output_dir"]
    replay = payload.get("replay")
    step = advance(w, replay, output_dir) if replay else 0
    lr = lr_at(step, cfg)
    if payload.get("perturb_param"):
        perturb_local_shard(strategy, payload["perturb_param"])
        log(f"perturbed {payload['perturb_param']} by {PERTURBATION} on TP rank 0")

    inputs_path = os.path.join(output_dir, INPUTS_FILE)
    inputs = load_file(inputs_path)
    # a replay's step as its batches give it (a recorded step's rows split over the ranks, its mask), the same tokens
    # as the folder's inputs
    batches = replay["batches"] if replay else payload.get("batches")  # a replay's, or a rollout file's (rows and all)
    global_batch = batches(step) if batches else Batch(inputs["input_ids"], inputs["labels"],
                                                                 position_ids=inputs.get("position_ids"))
    mine = dp_slice(global_batch, ctx.dp_rank, cfg.batch_size).to(ctx.device)

    recorder = ModuleRecorder(strategy.hf_model, row_places(mine, strategy.micro_batches(mine)))
    local_sum = strategy.forward_backward(mine, global_batch.divisor)  # the train step's (one step)
    records = strategy.full_module_records(recorder.remove())
    grads = strategy.full_gradients()
    grad_norm = OptimizerStep.of(strategy.optimizer_step(lr)).norm
    params = strategy.full_parameters()
    sums, counts = strategy.gather_dp_sums(local_sum, mine.loss_tokens)
    dp_losses = [s / max(c, 1) for s, c in zip(sums, counts)]
    global_loss = sum(sums) / global_batch.divisor

    tensors = {}
    for kind, store in (("output", records.outputs), ("output_grad", records.output_grads)):
        for name, full in store.items():  # one order on every rank: the gathers are collective
            tensors[f"{kind}/{name}"] = torch.cat(strategy.gather_dp(full.float())).cpu()
    for name, ids in zip(strategy.router_names(), strategy.step_expert_ids):  # a mixture of experts' routing
        tensors[f"routing/{name}"] = torch.cat(strategy.gather_dp(ids)).cpu()
    tensors.update({f"grad/{k}": v for k, v in grads.items()})
    tensors.update({f"param/{k}": v for k, v in params.items()})

    if ctx.is_logging_rank:
        tensor_path, meta_path = dump_paths(output_dir, cfg)
        with atomic_path(tensor_path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        write_json_atomic(meta_path, {
            "strategy": cfg.strategy, "tp_size": cfg.tp_size, "dp_size": cfg.dp_size, "pp_size": cfg.pp_size,
            "ep_size": cfg.ep_size,
            "precision": cfg.precision, "options": cfg.options, "device_type": ctx.device.type,
            "model_config": config_summary(w.model_config),
            "init_weights_sha256": w.weights_sha, "inputs_sha256": file_sha256(inputs_path),
            "learning_rate": lr, "loss": global_loss,
            "replay": {k: v for k, v in replay.items() if k != "batches"} if replay else None,
            "dp_rank_losses": dp_losses, "grad_norm": grad_norm, "perturbed": payload.get("perturb_param"),
            "forward_order": list(records.outputs), "backward_order": list(records.output_grads),
            "fingerprint": fingerprint(type(strategy), ctx.device, w.model_config.model_type)})
        log(f"wrote {tensor_path}: {len(tensors)} tensors, loss {global_loss:.8f}")
