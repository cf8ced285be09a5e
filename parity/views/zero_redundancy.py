"""torch's own ZeRO-1, ZeroRedundancyOptimizer, over DDP or a plain module: the model whole on every rank as under DDP
(read as DataParallel reads it), the optimizer's state in pieces — each rank's local optimizer (`optim`, of ZeRO's
`optimizer_class`) steps the parameters ZeRO assigned it and holds their moments alone, then ZeRO broadcasts the
updated parameters from their owners. Its update is `optimizer_class`'s (AdamW, Adam), its groups' settings ZeRO's
own groups (which it copies onto the local ones at each step); a saved state's moments are broadcast from their
owners, and the replicas every rank holds alike are the parameters alone. overlap_with_ddp=True steps inside DDP's
backward, before the recorder reads the gradients: refused in one line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity.training.optimizer import ADAMW_MOMENTS, full_moments
from parity.training.replicas import Replica
from parity.views.base import ViewRefused
from parity.views.data_parallel import DataParallel


class ZeroRedundancy(DataParallel):
    """DDP (or a plain module) stepped by a ZeroRedundancyOptimizer: the moments on their owners (rank 0 asks them
    over: a collective)."""

    kind = "data parallel, ZeroRedundancyOptimizer"
    zero_stage = 1
    whole = False

    @classmethod
    def read(cls, model, optimizer, device: torch.device, unwrap) -> "ZeroRedundancy | None":
        """The model as DataParallel reads it, where `optimizer` is a ZeroRedundancyOptimizer; None otherwise."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return None
        if getattr(optimizer, "_overlap_with_ddp", False):
            raise ViewRefused("ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's backward, before "
                              "before_step() can read the gradients: record it with overlap_with_ddp=False (the same "
                              "update, stepped by optimizer.step())")
        view = super().read(model, optimizer, device, unwrap)
        view.device = device
        return view

    def optimizer_kind(self) -> tuple[str, str | None]:
        """The local optimizer's: ZeRO's optimizer_class."""
        return type(self.optimizer.optim).__name__, None

    def full_optimizer_state(self):
        """Every trainable parameter's moments, broadcast from the rank whose local optimizer holds them, in the
        module's order: whole on every rank, as DataParallel's are; with the step count the owners agree on."""
        own = full_moments(self.model.named_parameters(), self.optimizer.optim, torch.device("cpu"))
        if own is None:
            return None
        owned = [None] * self.world
        dist.all_gather_object(owned, (sorted(own[0]), own[1]))
        owner = {name: rank for rank, (names, _) in enumerate(owned) for name in names}
        moments = {}
        for name, p in self.model.named_parameters():
            if name not in owner:  # not stepped yet, or frozen
                continue
            moments[name] = {}
            for key in ADAMW_MOMENTS:
                held = own[0][name][key] if name in own[0] else torch.empty(p.shape, dtype=torch.float32)
                sent = held.to(self.device)
                dist.broadcast(sent, src=owner[name])
                moments[name][key] = sent.cpu()
        return moments, max(count for _, count in owned)

    def replicas(self):
        """What every rank holds alike: every parameter (ZeRO broadcasts each after its owner's step); each moment
        lives on its owner alone."""
        ranks = tuple(range(self.world))
        return [Replica(name, ranks, p.detach()) for name, p in self.model.named_parameters()]


VIEW = ZeroRedundancy
__all__ = ["VIEW", "ZeroRedundancy"]
