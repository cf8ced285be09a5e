"""A torchtitan job's model read under Hugging Face names (docs/torchtitan.md#what-is-recorded): the recorder's view
(parity/training/view.py's protocol) over torchtitan's own module, its DTensors read with the harness's DTensor code (FullyShard's
norms, full tensors and replicas), every name and tensor translated the way the job's own checkpoint would write it
for Hugging Face — the module's state-dict post-hooks (the debug model's fused `qkv_linear.wqkv` split into wq, wk,
wv by FusedQKVLinear's hook; the activation-checkpoint wrapper's prefix dropped by its own), then the job's state-dict
adapter's `to_hf` (names, and Q/K permuted for transformers' RoPE).

The same translation serves every tensor of a parameter's shape: the parameter, its gradient and AdamW's moments are
moved alike (a split and a permutation move elements, never mix them). Full tensors (the initial weights, the states
at the checkpoint interval) are translated whole after `full_tensor()`; each step's per-tensor norms from each rank's
local shard alone: a parameter the translation keeps whole (one Hugging Face tensor of its size) hands over its shard;
one it splits (wqkv) hands each Hugging Face tensor the elements of its shard that land there, found once by
translating the parameter's element indices and sharding them as the parameter is sharded.

The translated tensors must be exactly the transformers model's (frameworks/torchtitan/config.py builds it on the meta device): a
parameter the adapter drops (to_hf silently skips keys it does not know), a name or shape the transformers model does
not have, or one of its tensors that nothing maps to is refused in one line (TitanRefused).
"""

from __future__ import annotations

import torch

from parity.frameworks.torchtitan.config import TitanRefused
from parity.training.dtensor_strategy import dtensor_replicas, full_tensor, global_norm
from parity.training.optimizer import full_moments
from parity.views.base import View
from parity.views.fully_shard import FullyShard
from parity.views.translated import TranslatedView

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # what wrappers add to a name


def clean(name: str) -> str:
    for part in WRAPPERS:
        name = name.replace(part, "")
    return name


def holders(p: torch.Tensor, world: int) -> tuple[int, ...]:
    """The ranks that hold the same local piece of parameter `p` as this one, ascending: along its mesh's dims where
    it is replicated (torchtitan's meshes are unflattened from the world's, so their dims are read on the parameter's
    own mesh, not on a root); a plain tensor, every rank. TitanRefused for a mesh that does not span the world."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return tuple(range(world))
    mesh = p.device_mesh
    if mesh.mesh.numel() != world:
        raise TitanRefused(f"a parameter lives on a mesh of {mesh.mesh.numel()} of the {world} ranks "
                           f"({mesh.mesh_dim_names}): the recorder reads meshes that span the world")
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if placement.is_replicate() else c for c, placement in zip(coordinate, p.placements))
    return tuple(sorted(int(r) for r in mesh.mesh[index].flatten()))


class Translation:
    """A torchtitan module's parameters → Hugging Face tensors: `to_hf(name, tensor)` translates one parameter's
    tensor (or a tensor of its shape) into {Hugging Face name: tensor}; `native` holds (clean name, parameter)."""

    def __init__(self, module: torch.nn.Module, adapter):
        self.adapter = adapter
        self.modules = list(module.named_modules())
        self.native = [(clean(n), p) for n, p in module.named_parameters()]  # a tied weight once
        self.raw = {clean(n): n for n, _ in module.named_parameters()}  # the names the module's hooks see

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """As module.state_dict() then adapter.to_hf() would write this one parameter (`name` as named_parameters
        names it, wrappers' parts included): every post-hook of the modules that hold it, innermost first, with the
        prefix each sees."""
        state = {name: tensor}
        for prefix, module in reversed(self.modules):
            if module._state_dict_hooks and (not prefix or name.startswith(prefix + ".")):
                for hook in list(module._state_dict_hooks.values()):
                    result = hook(module, state, f"{prefix}." if prefix else "", {})
                    if result is not None and not getattr(hook, "_from_public_api", False):
                        state = result
        return self.adapter.to_hf({clean(k): v for k, v in state.items()})

    def targets(self, hf_model) -> dict[str, list[tuple[str, torch.Tensor | None]]]:
        """Each parameter's Hugging Face tensors (name, and where it splits, the flat indices of the parameter each
        holds, in its order), checked against the transformers model `hf_model` (a meta one will do: names and
        shapes). TitanRefused, one line, where they are not exactly its tensors."""
        hf = dict(hf_model.named_parameters())
        targets, seen = {}, {}
        for name, p in self.native:
            out = self.to_hf(self.raw[name], torch.empty(p.shape, device="meta"))
            if not out:
                raise TitanRefused(f"the job's state-dict adapter ({type(self.adapter).__name__}) drops {name}: its "
                                   f"to_hf maps it to no Hugging Face tensor, so the replay could not train it")
            for h, t in out.items():
                if h not in hf:
                    raise TitanRefused(f"the job's state-dict adapter maps {name} to {h}, which "
                                       f"{type(hf_model).__name__} does not have")
                if tuple(t.shape) != tuple(hf[h].shape):
                    raise TitanRefused(f"the job's state-dict adapter maps {name} to {h} of shape {tuple(t.shape)}; "
                                       f"{type(hf_model).__name__}'s is {tuple(hf[h].shape)}")
                seen[h] = name
            if len(out) == 1 and next(iter(out.values())).numel() == p.numel():
                targets[name] = [(next(iter(out)), None)]
            else:  # the parameter's element indices, translated: where each of its elements lands
                index = self.to_hf(self.raw[name], torch.arange(p.numel(), dtype=torch.int64).view(p.shape))
                targets[name] = [(h, t.reshape(-1)) for h, t in index.items()]
        missing = [h for h in hf if h not in seen]
        if missing:
            raise TitanRefused(f"{type(hf_model).__name__}'s {missing[0]} is mapped from no parameter of the job "
                               f"({len(missing)} such tensor{'s' if len(missing) > 1 else ''}): the adapter does not "
                               f"describe this model")
        return targets


class TitanView(TranslatedView, FullyShard):
    """The recorder's view of a torchtitan Trainer's model (one model part, one torch optimizer): `hf_model` is the
    transformers model on the meta device (what the recorder reads for the config and the names), `adapter` the
    job's state-dict adapter, `trainer` the torchtitan Trainer (its parallel dims give the DP rank that feeds)."""

    kind = "torchtitan"
    refused = TitanRefused

    def __init__(self, trainer, hf_model, adapter, device: torch.device):
        module, optimizer = trainer.model_parts[0], trainer.optimizers.optimizers[0]
        View.__init__(self, hf_model, optimizer)
        self.module, self.device, self._replicated = module, device, None
        dims = trainer.parallel_dims
        batch = dims.get_mesh("batch") if dims.dp_enabled else None
        self.dp_rank, self.dp_size = (batch.get_local_rank(), batch.size()) if batch is not None else (0, 1)
        others = [d for d, on in (("tp", dims.tp_enabled), ("cp", dims.cp_enabled), ("pp", dims.pp_enabled)) if on]
        self.feeds = all(dims.get_mesh(d).get_local_rank() == 0 for d in others)  # one rank of each DP rank
        self.mesh_shape = {d: getattr(dims, d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        translation = Translation(module, adapter)
        self.to_hf, self.native, self.raw = translation.to_hf, translation.native, translation.raw
        self.targets = translation.targets(hf_model)

    def describe(self) -> dict:
        return {"kind": self.kind, "zero_stage": 3 if self.mesh_shape["dp_shard"] > 1 else 0, "dp_size": self.dp_size,
                "tp_size": self.mesh_shape["tp"], "mesh": self.mesh_shape}

    @property
    def tp_size(self) -> int:
        return self.mesh_shape["tp"]

    def holders(self, p):
        return holders(p, self.world)

    def local_index(self, p, index):
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(p, DTensor):
            return distribute_tensor(index, p.device_mesh, p.placements, src_data_rank=None).to_local()
        return index

    # --- norms and full tensors over the native module ----------------------------------------------------------
    def grad_norm(self, squares=None) -> float:
        return global_norm([p.grad for _, p in self.native if p.grad is not None])

    def parameter_norm(self) -> float:
        return global_norm([p.detach() for _, p in self.trainable()])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {h: t for n, p in self.native for h, t in self.to_hf(self.raw[n], full_tensor(p, self.device)).items()}

    def full_optimizer_state(self):
        exported = full_moments(self.native, self.optimizer, self.device)
        if exported is None:
            return None
        moments, count = exported
        out = {}
        for name, states in moments.items():
            for key, t in states.items():
                for h, moved in self.to_hf(self.raw[name], t).items():
                    out.setdefault(h, {})[key] = moved
        return out, count

    def replicas(self):
        if self._replicated is None:
            self._replicated = self.replicated()
        return dtensor_replicas(self._replicated, self.optimizer)


__all__ = ["TitanView", "Translation", "clean"]
