"""Frozen tensors stay as they were set up: LoRA's base (parity/models/adapters.py), checked bit for bit.

A frozen parameter has no gradient, so no norm and no series ever sees it; a strategy that moves it anyway — weight decay
applied to every parameter, an optimizer handed the whole model, a base a framework unfroze — trains another model
with a loss that barely shows it. So each rank digests the frozen pieces it holds (Strategy.frozen_pieces) once at
set-up, as the replica check digests replicas (parity.training.digest.Digester: exact bits), and again at every
replica check; a piece whose digest changed is reported there as a parted tensor of its own kind ("frozen"), so the
verdict FAILs at the first step it moved (docs/running.md#replicas).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity.training.digest import Digester

FROZEN = "frozen"  # what a moved frozen tensor is, in the replica check's entry (replicas.parting_line words it)


class FrozenCheck:
    """This rank's frozen pieces — `strategy.frozen_pieces()`: [(name, local tensor)], [] where nothing is frozen —
    digested at set-up on `device`; `moved()` after a step. Collective: every rank makes it and calls moved() alike."""

    def __init__(self, strategy, device: torch.device):
        pieces = getattr(strategy, "frozen_pieces", lambda: [])()
        self.strategy, self.device, self.digester = strategy, device, Digester()  # its own: a Digester keeps its views
        self.names = [name for name, _ in pieces]
        self.start = self.digester([t for _, t in pieces], device) if pieces else None
        count = torch.tensor([len(pieces)], device=device)
        dist.all_reduce(count)
        self.any = int(count) > 0  # on some rank: then every rank takes part in each check

    def moved(self) -> list[dict]:
        """Every frozen tensor whose bits changed since set-up on some rank, as the replica check lists a parted one
        ({"name", "what": FROZEN, "piece", "ranks": [the ranks where it moved], "max_abs_diff": None}), in name order.
        The same answer on every rank. Collective."""
        mine = []
        if self.start is not None:
            now = self.digester([t for _, t in self.strategy.frozen_pieces()], self.device)
            mine = [self.names[i] for i in (now != self.start).any(1).nonzero().flatten().tolist()]
        count = torch.tensor([len(mine)], device=self.device)
        dist.all_reduce(count)
        if not int(count):
            return []
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        ranks: dict[str, list[int]] = {}
        for rank, names in enumerate(every):
            for name in names:
                ranks.setdefault(name, []).append(rank)
        return [{"name": name, "what": FROZEN, "piece": "", "ranks": [where], "max_abs_diff": None}
                for name, where in sorted(ranks.items())]
