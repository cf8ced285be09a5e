"""Replicas: every tensor that several ranks hold must stay the same, bit for bit, and the loop checks it.

A strategy knows which ranks hold the same tensor (`Strategy.replicas`): DDP's parameters on every DP rank, a
parameter TP leaves whole on every rank of a TP group, the pipeline's two copies of a tied embedding, and the
optimizer state of each. When copies part, the loss record shows only their mean (the loss is gathered from
every DP rank, the norms are one rank's), so a small desync shows late, far from its cause, or in bf16 never.
So after a step every rank digests each tensor it declared, the digests go round in one collective, and only
when they differ is the tensor itself sent to its group, to say by how much (docs/running.md#replicas).

The digest (parity/training/digest.py) reads exact bits: a float checksum of the values would not do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parity.training.digest import Digester
from parity.training.frozen import FrozenCheck
from parity.training.optimizer import ADAMW_MOMENTS

LISTED = 8  # parted tensors a check lists in the record
MEASURED = 8  # parted tensors whose max |difference| a check measures (their copies sent over their group)
DIFF_CHUNK = 1 << 22  # elements compared at once in float64 when measuring a difference


@dataclass(frozen=True)
class Replica:
    """A tensor this rank holds that every rank of `ranks` holds too, bit for bit."""

    name: str  # the parameter's Hugging Face name (a tied weight under its first name: model.embed_tokens.weight)
    ranks: tuple[int, ...]  # every rank that holds it, this one among them, ascending
    tensor: torch.Tensor | None  # this rank's copy, a plain tensor; None while it does not exist (Adam's moments
    # before the first step): then no rank of `ranks` may hold it
    what: str = "parameter"  # "parameter", "exp_avg", "exp_avg_sq", "master", "ZeRO-3 partition", ...
    piece: str = ""  # which part of the parameter, where a rank holds a part: "[0:64]" (its flat elements)

    @property
    def key(self) -> tuple:
        return self.name, self.what, self.piece, self.ranks


def label(name: str, what: str = "parameter", piece: str = "") -> str:
    """How a report names a replica: the parameter, then what of it, if not the parameter itself."""
    if what == "parameter" and not piece:
        return name
    return f"{name} ({' '.join(p for p in (what if what != 'parameter' else '', piece) if p)})"


def ranks_text(groups: list[list[int]]) -> str:
    """'rank 0 and rank 1', 'ranks 0, 2 and ranks 1, 3': a parted tensor's ranks, grouped by the bits they hold."""
    return " and ".join(f"rank {g[0]}" if len(g) == 1 else "ranks " + ", ".join(map(str, g)) for g in groups)


def parting_line(step: int, found: dict) -> str:
    """One line for a check that found copies parted (`found`: its record entry): the first tensor it lists (the
    parameter whose copies moved apart most), its ranks grouped by the bits they hold, the max |difference|, how many
    more parted — or a frozen tensor that moved (parity.training.frozen)."""
    first = found["tensors"][0]
    if first["what"] == "frozen":
        more = found["parted"] - 1
        return (f"a frozen tensor moved at step {step}: {first['name']} changed on {ranks_text(first['ranks'])} since "
                f"set-up" + (f" ({more} more tensor{'s' if more > 1 else ''} moved or parted)" if more else ""))
    diff = (f"max |difference| {first['max_abs_diff']:.3e}" if first.get("max_abs_diff") is not None
            else "their sizes differ, or some do not hold it")
    more = found["parted"] - 1
    return (f"replicas part at step {step}: {label(first['name'], first['what'], first['piece'])} differs between "
            f"{ranks_text(first['ranks'])} ({diff}" + (f"; {more} more tensor{'s' if more > 1 else ''} parted" if more
                                                        else "") + ")")


# --- what a strategy declares (helpers for Strategy.replicas) ------------------------------------------------

def moments(optimizer, param, name: str, ranks: tuple[int, ...],
            local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list[Replica]:
    """AdamW's two moments of `param` (a torch optimizer's state), held by `ranks` as the parameter is; `local`
    gives this rank's piece (a DTensor's to_local). None before the optimizer's first step."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return [Replica(name, ranks, local(state[key]) if key in state else None, key) for key in ADAMW_MOMENTS]


def held(name: str, ranks: tuple[int, ...], param, optimizer, master=None,
         local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list[Replica]:
    """A parameter as `ranks` hold it: the parameter itself, its fp32 master copy where a precision policy keeps one
    apart (`master`: bf16_params, fp16), and the AdamW moments of what the optimizer steps (the master, if any)."""
    stepped = param if master is None else master
    if not param.requires_grad:  # frozen (LoRA's base): the parameter alone, which no optimizer steps
        return [Replica(name, ranks, local(param))]
    return [Replica(name, ranks, local(param)), *([Replica(name, ranks, master, "master")] if stepped is not param
                                                   else []), *moments(optimizer, stepped, name, ranks, local)]


def whole_model(model, optimizer, ranks: tuple[int, ...], master_of=None) -> list[Replica]:
    """Every parameter of `model` (each once: a tied weight under its first name), its master copy (`master_of`, a
    PolicyOptimizer's) and its moments, held whole by every rank of `ranks`."""
    return [r for name, p in model.named_parameters()
            for r in held(name, ranks, p, optimizer, master_of(p) if master_of else None)]


def mesh_replica_ranks(t) -> tuple[int, ...]:
    """The ranks that hold the same local piece of the DTensor `t` as this rank, found on the root of `t`'s own
    mesh (a strategy may build several: FSDP2's experts live on an ("efsdp", "ep") mesh beside the ("dp", "tp")
    one): along each of the root's dims that `t`'s mesh lacks (a tensor on the "dp" sub-mesh is the same on every
    "tp" rank) and along each of its own dims where it is Replicate."""
    root = t.device_mesh._get_root_mesh()
    own = list(t.device_mesh.mesh_dim_names or ())
    coordinate = root.get_coordinate()
    if t.device_mesh is root:  # its own mesh is the root (fully_shard's default mesh has no dim names)
        index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(t.placements, coordinate))
    else:
        index = tuple(coordinate[i] if dim in own and not t.placements[own.index(dim)].is_replicate() else slice(None)
                      for i, dim in enumerate(root.mesh_dim_names))
    return tuple(sorted(int(r) for r in root.mesh[index].flatten().tolist()))


# --- the check ---------------------------------------------------------------------------------------------

class ReplicaDeclarationError(RuntimeError):
    """A strategy declared replicas that its ranks do not agree on: a defect of the strategy, not of the run."""


def agreed_keys(declared: list[list[tuple]], strategy: str) -> list[tuple]:
    """Every replica key of the run, in declaration order (the lowest declaring rank's, then the next rank's
    new ones ...), after checking that the ranks agree: each rank declares each key at most once and only keys
    it is among the ranks of, and every rank a key names declares it. Raises ReplicaDeclarationError."""
    holders: dict[tuple, list[int]] = {}
    for rank, keys in enumerate(declared):
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise ReplicaDeclarationError(f"{strategy} declares the replica {label(*twice[:3])} twice on rank {rank}")
        for key in keys:
            if rank not in key[3]:
                raise ReplicaDeclarationError(f"{strategy} declares the replica {label(*key[:3])} on rank {rank} for "
                                              f"ranks {list(key[3])}, which do not include rank {rank}")
            holders.setdefault(key, []).append(rank)
    for key, ranks in holders.items():
        if tuple(ranks) != key[3]:
            missing = sorted(set(key[3]) - set(ranks))
            raise ReplicaDeclarationError(f"{strategy} declares the replica {label(*key[:3])} for ranks {list(key[3])}, "
                                          f"but rank {missing[0]} does not declare it (its ranks must declare the same "
                                          f"name, what, piece and ranks)")
    return list(holders)


def summary(keys: list[tuple], declared: list[list[tuple]], interval: int) -> dict:
    """What the record says of the declaration: how many replica groups, of what, over which ranks."""
    by_what, by_ranks = {}, {}
    for name, what, piece, ranks in keys:
        by_what[what] = by_what.get(what, 0) + 1
        group = ",".join(map(str, ranks))
        by_ranks[group] = by_ranks.get(group, 0) + 1
    return {"declared": True, "interval": interval, "groups": len(keys), "tensors_per_rank": [len(d) for d in declared],
            "by_what": by_what, "by_ranks": by_ranks}


class ReplicaCheck:
    """One run's replica check on this rank, over the world's process group. Built after the strategy's setup (a
    collective: every rank's declaration is gathered once and checked against the others'); `check` after a step (a
    collective). `strategy` is what declares the replicas: a Strategy, or any object with its `replicas()` (a recorder
    of another training loop: parity/training/observer.py); `device` is where the digests are gathered (the
    backend's device: CUDA under NCCL), by default the strategy's (strategy.ctx.device)."""

    def __init__(self, strategy, interval: int, device: torch.device | None = None, moments_every: int = 1):
        self.strategy, self.interval, self.moments_every, self.checks = strategy, interval, moments_every, 0
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = device if device is not None else strategy.ctx.device
        mine = self._declared()
        self.frozen = FrozenCheck(strategy, self.device)  # frozen tensors must not move either
        declared: list = [None] * self.world_size
        dist.all_gather_object(declared, None if mine is None else [r.key for r in mine])
        self.declared = all(d is not None for d in declared)
        if not self.declared:
            if any(d is not None for d in declared):
                raise ReplicaDeclarationError(f"{type(strategy).__name__}.replicas() declares on some ranks and not "
                                              f"on others")
            self.summary = {"declared": False, "interval": interval}
            return
        self.local_keys = [r.key for r in mine]
        self.keys = agreed_keys(declared, type(strategy).__name__)
        self.width = max(1, max(len(d) for d in declared))
        position = {(rank, key): i for rank, keys in enumerate(declared) for i, key in enumerate(keys)}
        # Where each member's digest lands in the gathered table (rank × width + its index on that rank).
        self._at = {(k, rank): rank * self.width + position[(rank, key)] for k, key in enumerate(self.keys)
                    for rank in key[3]}
        self._member_key = torch.tensor([k for k, _ in self._at], dtype=torch.int64)
        self._member_at = torch.tensor(list(self._at.values()), dtype=torch.int64)
        self._first_at = torch.tensor([self._at[(k, key[3][0])] for k, key in enumerate(self.keys)], dtype=torch.int64)
        self.summary = summary(self.keys, declared, interval)
        self._digester = Digester()
        self._groups: dict[tuple[int, ...], object] = {}

    def _declared(self) -> list[Replica] | None:
        """The strategy's replicas, but a tensor only one rank holds (nothing to compare it with)."""
        mine = self.strategy.replicas()
        return None if mine is None else [r for r in mine if len(r.ranks) > 1]

    def due(self, done: int, total_steps: int, checkpoint: bool) -> bool:
        """Whether to check after `done` steps: every --replica_check_interval, at every checkpoint, at the end (never
        where no two ranks hold the same tensor)."""
        something = self.declared and bool(self.keys) or self.frozen.any
        return something and (done % self.interval == 0 or done == total_steps or checkpoint)

    def check(self, full: bool = False) -> dict:
        """Digest every declared tensor and compare them across their ranks: the record's entry for this step,
        {"checked": replica groups, "parted": how many differ, and when some do "tensors": up to LISTED of them (see
        _describe), each with its name, what, piece, its ranks grouped by the bits they hold and its max |difference|
        (None where not measured)}. The same answer on every rank. Collective. AdamW's moments are digested at every
        `moments_every`-th check and where `full` (a checkpoint, the last step): the other checks read the parameters
        (and masters) alone (docs/running.md#replicas: what that gives up)."""
        digests = self.digests(full)
        if digests is None:
            return self.compare(None)
        gathered = [torch.empty_like(digests) for _ in range(self.world_size)]
        dist.all_gather(gathered, digests)
        return self.compare(torch.cat(gathered))

    def digests(self, full: bool = False) -> torch.Tensor | None:
        """This rank's half of a check: [width, 3] int64, the digest of each tensor it declared in declaration order —
        (−2, −2, −2) for a moment this check leaves out, alike on every rank — to be gathered over the world in rank
        order (check's all_gather, or a collective of the caller's: a recorder's step exchange) and handed to
        `compare`; None where there is nothing to digest. Local."""
        self._full = full or self.checks % self.moments_every == 0
        self.checks += 1
        if not (self.declared and self.keys):
            return None
        mine = self._declared()
        if [r.key for r in mine] != self.local_keys:
            raise ReplicaDeclarationError(f"{type(self.strategy).__name__}.replicas() changed its declaration after "
                                          f"set-up: declare every tensor from the start (None while it does not exist)")
        chosen = [i for i, r in enumerate(mine) if self._full or r.what not in ADAMW_MOMENTS]
        digests = torch.full((self.width, 3), -2, dtype=torch.int64, device=self.device)
        if chosen:
            digests[chosen] = self._digester([mine[i].tensor for i in chosen], self.device)
        self._mine = mine
        return digests

    def compare(self, gathered: torch.Tensor | None) -> dict:
        """The other half: the check's entry (check's docstring) from every rank's digests as gathered, [world × width,
        3] in rank order (None where `digests` had nothing to digest). Collective (the frozen tensors' check, and a
        parted tensor's measure)."""
        moved = self.frozen.moved() if self.frozen.any else []
        entry = self._replicas(gathered.cpu()) if gathered is not None and gathered.numel() else \
            {"checked": 0, "parted": 0}
        if moved:  # a frozen tensor that moved first: the nearer cause
            entry = {**entry, "parted": entry["parted"] + len(moved),
                     "tensors": (moved + entry.get("tensors", []))[:LISTED]}
        return entry

    def _replicas(self, table: torch.Tensor) -> dict:
        """The replicas' part of compare, from the gathered digests `table` [world × width, 3]. Collective where some
        parted."""
        differs = (table[self._member_at] != table[self._first_at[self._member_key]]).any(1)
        parted = sorted(set(self._member_key[differs].tolist()))
        checked = len(self.keys) if self._full else sum(k[1] not in ADAMW_MOMENTS for k in self.keys)
        entry = {"checked": checked, "parted": len(parted)}
        if parted:
            entry["tensors"] = self._describe(parted, table, self._mine)
        return entry

    def _describe(self, parted: list[int], table: torch.Tensor, mine: list[Replica]) -> list[dict]:
        """The parted tensors to list, each with its ranks grouped by the bits they hold; the first MEASURED of them,
        parameters' copies before moments, in declaration order, with their max |difference| — and the list ordered
        by it (the parameters' first): where every copy moved apart at once, the tensor that moved most is the one
        nearest the cause (a clip factor differing across ranks moves every copy a little, a skipped or unreduced
        update moves its own by a whole step)."""
        order = sorted(parted, key=lambda k: (self.keys[k][1] in ADAMW_MOMENTS, k))
        holders = {k: self._holders(k, table) for k in order}
        measured = torch.zeros(MEASURED, dtype=torch.float64, device=self.device)
        sizes = {k: {bits[0] for bits in holders[k]} for k in order[:MEASURED]}
        comparable = [k for k, n in sizes.items() if len(n) == 1 and min(n) >= 0]  # held everywhere, at one size
        for n, k in enumerate(comparable):
            ranks = self.keys[k][3]
            group = self._group(ranks)
            if self.rank in ranks:
                measured[n] = self._max_difference(mine[self.local_keys.index(self.keys[k])].tensor, ranks, group)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        diffs = {k: float(measured[n]) for n, k in enumerate(comparable)}
        listed = sorted(order, key=lambda k: (self.keys[k][1] in ADAMW_MOMENTS, k not in diffs, -diffs.get(k, 0.0), k))
        return [{"name": self.keys[k][0], "what": self.keys[k][1], "piece": self.keys[k][2],
                 "ranks": list(holders[k].values()), "max_abs_diff": diffs.get(k)} for k in listed[:LISTED]]

    def _holders(self, k: int, table: torch.Tensor) -> dict[tuple, list[int]]:
        """The ranks of replica `k` grouped by the digest each holds (words, S, W), in rank order."""
        by_bits: dict[tuple, list[int]] = {}
        for rank in self.keys[k][3]:
            by_bits.setdefault(tuple(table[self._at[(k, rank)]].tolist()), []).append(rank)
        return by_bits

    def _group(self, ranks: tuple[int, ...]):
        """The process group of `ranks` (the world's when they are all): made once, by every rank (new_group is a
        collective of the world), in the order every rank meets the same parted tensors."""
        if len(ranks) == self.world_size:
            return None
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks))
        return self._groups[ranks]

    def _max_difference(self, mine: torch.Tensor, ranks: tuple[int, ...], group) -> float:
        """max |this rank's copy − the first rank's|, in float64, the first rank's copy broadcast over `ranks`."""
        device = self.device
        reference = mine.detach().to(device).contiguous().clone() if self.rank == ranks[0] else \
            torch.empty(mine.shape, dtype=mine.dtype, device=device)
        dist.broadcast(reference, src=ranks[0], group=group)
        a, b = mine.detach().reshape(-1), reference.reshape(-1)
        worst = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, a.numel(), DIFF_CHUNK):
            piece = a[start:start + DIFF_CHUNK].to(device, torch.float64) - b[start:start + DIFF_CHUNK].double()
            worst = torch.maximum(worst, piece.abs().max())  # a NaN stays NaN
        worst = float(worst)
        return worst if math.isfinite(worst) else math.inf  # NaN on one copy: no finite difference to report
