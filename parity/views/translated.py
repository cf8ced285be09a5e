"""The recorder's view of a framework's own module read under Hugging Face names (parity/training/view.py): the
module's parameters (`native`: its names) translate into the transformers model's tensors (`targets`: each native
parameter's Hugging Face tensors and, where it splits into several, the flat indices of the parameter's full tensor
each holds). torchtitan's and megatron-core's views (frameworks/torchtitan/view.py, frameworks/megatron/view.py)
differ in how a parameter is sharded and translated; what follows from the translation is here, once:

- the names the record and the replay use, and the optimizer's groups, are the transformers model's;
- each step's per-tensor pieces come from each rank's local shard alone: a parameter the translation keeps whole
  hands over its shard; one it splits hands each Hugging Face tensor the elements of its shard that land there (the
  full tensor's element indices sharded as the parameter is — `local_index` — then matched to each target's);
- a piece is counted on the first of the ranks that hold it alike (`holders`), the replicas are those ranks' copies.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from parity.views.base import View
from parity.training.tensor_norms import Piece


class TranslatedView(View):
    """Subclasses set `native` ([(name, parameter)], a tied weight once), `targets` ({name: [(Hugging Face name, flat
    indices of the full parameter, or None: the whole of it)]}) and `self.model` (the transformers model, on the meta
    device will do), and give `holders(p)` and `local_index(p, index)`."""

    refused = ValueError  # the framework's one-line refusal

    def holders(self, p: torch.Tensor) -> tuple[int, ...]:
        """The ranks that hold the same local piece of `p` as this one, ascending."""
        raise NotImplementedError

    def local_index(self, p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `index`, a tensor of `p`'s full shape, sharded as `p` is."""
        raise NotImplementedError

    # --- names: the transformers model's ------------------------------------------------------------------
    def names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def buffer_names(self) -> list[str]:
        return [n for n in self.model.state_dict() if n not in dict(self.model.named_parameters())]

    def stepped(self, p: torch.Tensor) -> torch.Tensor:
        """The native parameter that the optimizer's parameter `p` steps (itself, or the parameter a shard of it is)."""
        return p

    def group_params(self) -> list[list]:
        """Each optimizer group's parameters as the transformers model's (a split parameter's tensors in its place)."""
        hf = dict(self.model.named_parameters())
        native = {id(p): n for n, p in self.native}
        return [[hf[h] for p in map(self.stepped, g["params"]) if p.requires_grad
                 for h, _ in self.targets[native[id(p)]]] for g in self.optimizer.param_groups]

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.native if p.requires_grad]

    def tensor_names(self) -> list[str]:
        return [h for n, _ in self.trainable() for h, _ in self.targets[n]]

    def frozen_pieces(self) -> list[tuple[str, torch.Tensor]]:
        return [(self.targets[n][0][0], self.local_piece(p)) for n, p in self.native if not p.requires_grad]

    def replicated(self) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
        """(the first Hugging Face name, parameter, the ranks that hold it alike) of each parameter several hold."""
        return [(self.targets[n][0][0], p, ranks) for n, p in self.native for ranks in [self.holders(p)]
                if len(ranks) > 1]

    # --- each rank's pieces under Hugging Face names ------------------------------------------------------------
    def gradient_pieces(self) -> list[Piece]:
        return self._pieces(lambda p: p.grad)

    def parameter_pieces(self) -> list[Piece]:
        return self._pieces(lambda p: p.detach())

    def _pieces(self, read) -> list[Piece]:
        pieces = []
        for name, p in self.trainable():
            t = read(p)
            local = None if t is None else self.piece_of(p, t)
            for h, held in self._held[name]:
                pieces.append(Piece(h, None if local is None else local if held is None else local.reshape(-1)[held],
                                    self._counted_native[name] and local is not None))
        return pieces

    def piece_of(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What this rank holds of `t`, the parameter `p` or a tensor of its shape: its local shard."""
        return self.local_piece(t)

    @functools.cached_property
    def _counted_native(self) -> dict[str, bool]:
        return {n: self.holders(p)[0] == self.rank for n, p in self.native}

    @functools.cached_property
    def _held(self) -> dict[str, list[tuple[str, torch.Tensor | None]]]:
        """Per native parameter, each Hugging Face tensor's elements of this rank's shard (a boolean mask; None: the
        whole shard): the parameter's full flat indices sharded as the parameter is, then matched to each target's."""
        held = {}
        for name, p in self.native:
            if self.targets[name][0][1] is None:
                held[name] = [(self.targets[name][0][0], None)]
                continue
            index = self.local_index(p, torch.arange(p.numel() * self.shards(p), dtype=torch.int64,
                                                     device=self.device).view(self.full_shape(p)))
            index = index.reshape(-1).cpu()
            held[name] = [(h, torch.isin(index, flat).to(self.device)) for h, flat in self.targets[name]]
        return held

    def shards(self, p: torch.Tensor) -> int:
        """How many pieces of `p`'s size its full tensor holds (1 where `p` is a DTensor: its shape is the full one)."""
        return 1

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return tuple(p.shape)

    def native_names(self) -> list[str]:
        """Every rank's native parameters' names, alike on every rank (a pipeline stage holds its own: gathered)."""
        return [n for n, _ in self.native]

    def check_held(self) -> None:
        """Every element of every split parameter lands on exactly one Hugging Face tensor over the world (the
        sharded indices cover the parameter once): a collective, at the view's start."""
        names, here = self.native_names(), dict(self.native)
        covered = torch.zeros(len(names), dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        whole = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for i, name in enumerate(names):
            p = here.get(name)
            if p is not None and self.targets[name][0][1] is not None:
                whole[i] = p.numel() * self.shards(p)
                covered[i] = sum(int(m.sum()) for _, m in self._held[name]) * self._counted_native[name]
        dist.all_reduce(covered)
        dist.all_reduce(whole, op=dist.ReduceOp.MAX)
        for name, got, full in zip(names, covered.tolist(), whole.tolist()):
            if full and int(got) != int(full):
                raise self.refused(f"{name}'s shards cover {int(got)} of its {int(full)} elements once translated: "
                                   f"its sharding is not read here")


__all__ = ["TranslatedView"]
