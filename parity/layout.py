"""The run's layout, in one object: its degrees, where each rank sits, the rank groups the strategies build their
process groups and meshes from, and every check of the degrees with its one-line ConfigError.

A run places world_size = dp_size × pp_size × tp_size ranks, rank = (dp_rank × pp_size + pp_rank) × tp_size + tp_rank:
a TP group is tp_size consecutive ranks, a pipeline the pp_size TP groups after one another (pp_size 1 without
pipeline stages), and the data-parallel replicas follow each other. Expert parallelism cuts the same ranks
differently: an EP group is ep_size consecutive ranks, whole TP groups (ep_size is a multiple of tp_size and divides
world_size), and the ranks that hold the same experts are those at the same place in their EP group.

`resolve` (parity/driver/config.py) builds it once from the flags (`Layout.from_flags`, which checks them); RunConfig
carries its degrees as fields and gives it back as `cfg.layout`; a worker's WorkerContext reads its rank's place from
it, and every strategy reads its groups here instead of working them out again. Nothing here imports torch or a
strategy: the groups are rank lists, which a strategy hands to torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from parity.errors import ConfigError

DEFAULT_PP_SIZE = 2  # --pp_size of a strategy with pipeline stages when not given (its smallest pipeline)
STAGE_FLAGS = ("pp_size",)  # the layout flags only a strategy with pipeline stages takes (Strategy.pipeline_parallel)


class Coords(NamedTuple):
    """A rank's place in the layout."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp_size: int
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1  # 1: every expert on every rank

    def __post_init__(self):
        sizes = (self.world_size, self.dp_size, self.tp_size, self.pp_size, self.ep_size)
        if min(sizes) < 1 or self.dp_size * self.pp_size * self.tp_size != self.world_size:
            raise ConfigError(f"layout world_size {self.world_size} ≠ dp_size {self.dp_size} × pp_size {self.pp_size} × "
                              f"tp_size {self.tp_size}: resolve the flags with Layout.from_flags")

    # --- built from the flags, checked ---------------------------------------------------------------------------
    @classmethod
    def from_flags(cls, num_workers: int, tp_size: int = 1, dp_size: int | None = None, pp_size: int = 1,
                   ep_size: int = 1, *, pipeline: bool = False) -> Layout:
        """The layout of --num_workers, --tp_size, --dp_size (default: what the others leave), --pp_size and
        --ep_size, or ConfigError naming the flag to change. `pipeline`: the strategy has pipeline stages, so
        --pp_size is at least 2 (without them it is 1: `resolve` refuses the flag)."""
        if pipeline:
            return cls._pipeline(num_workers, tp_size, dp_size, pp_size, ep_size)
        if dp_size is None:
            if num_workers % tp_size:
                raise ConfigError(f"--num_workers {num_workers} is not a multiple of --tp_size {tp_size}: "
                                  f"num_workers must equal tp_size × dp_size")
            dp_size = num_workers // tp_size
        if tp_size * dp_size != num_workers:
            raise ConfigError(f"--num_workers {num_workers} ≠ --tp_size {tp_size} × --dp_size {dp_size}: "
                              f"pass --num_workers {tp_size * dp_size} or change tp/dp")
        return cls(num_workers, dp_size, tp_size, 1, ep_size)

    @classmethod
    def _pipeline(cls, n: int, t: int, d: int | None, p: int, ep_size: int) -> Layout:
        """num_workers = pp_size × tp_size × dp_size, at least two pipeline ranks (the pipeline's messages say
        pp_size × dp_size: no strategy with stages shards tensors too, and its validate refuses --tp_size first)."""
        if p < 2:
            raise ConfigError(f"--pp_size {p}: a pipeline has at least 2 ranks: use --pp_size 2 or more (or "
                              f"train_ddp.py for none)")
        replica, by = p * t, f"--pp_size {p}" + (f" × --tp_size {t}" if t > 1 else "")
        if n % replica:
            lower, upper = max(replica, n - n % replica), n - n % replica + replica
            raise ConfigError(f"--num_workers {n} is not a multiple of {by} (num_workers = pp_size × "
                              f"{'tp_size × ' if t > 1 else ''}dp_size): use --num_workers {lower} or {upper}")
        d = n // replica if d is None else d
        if replica * d != n:
            raise ConfigError(f"{by} × --dp_size {d} ≠ --num_workers {n}: pass --num_workers {replica * d} or "
                              f"--dp_size {n // replica}")
        return cls(n, d, t, p, ep_size)

    def check_heads(self, num_attention_heads: int, num_key_value_heads: int) -> None:
        """Tensor parallelism splits attention by heads, so tp_size must divide both head counts."""
        for label, count in (("KV-head", num_key_value_heads), ("attention-head", num_attention_heads)):
            if count % self.tp_size:
                divisors = [d for d in range(1, count + 1) if count % d == 0 and num_attention_heads % d == 0]
                raise ConfigError(f"--tp_size {self.tp_size} does not divide the model's {label} count ({count}): "
                                  f"use a tp_size in {divisors}")

    def check_experts(self, moe, model_type: str) -> None:
        """--ep_size > 1 needs a mixture of experts (`moe`: the family's description of its sparse blocks,
        parity.models.families; None for a dense model) whose experts it divides, and a layout it fits: EP groups
        are ep_size consecutive ranks, each whole TP groups — the ranks of a TP group share their tokens and split
        them for the experts."""
        if self.ep_size == 1:
            return
        if moe is None:
            raise ConfigError(f"--ep_size {self.ep_size}: a '{model_type}' model has no experts that transformers' "
                              f"expert-parallel plan names (not a mixture of experts): use --ep_size 1")
        moe.check_ep(self.ep_size)
        world, tp = self.world_size, self.tp_size
        if world % self.ep_size or self.ep_size % tp:
            fits = [e for e in range(tp, world + 1, tp) if world % e == 0 and moe.num_experts % e == 0]
            raise ConfigError(f"--ep_size {self.ep_size} does not fit --dp_size {self.dp_size} × --tp_size {tp}: "
                              f"expert groups are whole TP groups within the {world} ranks, so use an --ep_size in "
                              f"{fits}")

    # --- where a rank sits -----------------------------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """(dp_rank, pp_rank, tp_rank) of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a layout of {self.world_size} ranks")
        return Coords(rank // (self.tp_size * self.pp_size), rank // self.tp_size % self.pp_size, rank % self.tp_size)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """The rank at (dp_rank, pp_rank, tp_rank): (dp × pp_size + pp) × tp_size + tp."""
        return (dp * self.pp_size + pp) * self.tp_size + tp

    # --- the groups of a rank, and all of them (in one order on every rank: torch's new_group is collective) ----
    def tp_group(self, rank: int) -> list[int]:
        """The ranks that shard the same tensors with `rank` (its TP group): tp_size consecutive ranks."""
        c = self.coords(rank)
        return [self.rank(c.dp, c.pp, t) for t in range(self.tp_size)]

    def dp_group(self, rank: int) -> list[int]:
        """The ranks that hold what `rank` holds for other data (the same pipeline rank and TP rank of each
        replica): those gradients are reduced over."""
        c = self.coords(rank)
        return [self.rank(d, c.pp, c.tp) for d in range(self.dp_size)]

    def pp_group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s pipeline, in stage-rank order (only `rank` without pipeline stages)."""
        c = self.coords(rank)
        return [self.rank(c.dp, p, c.tp) for p in range(self.pp_size)]

    def ep_group(self, rank: int) -> list[int]:
        """The ranks `rank`'s tokens are sent among to reach their experts: ep_size consecutive ranks."""
        start = rank - rank % self.ep_size
        return list(range(start, start + self.ep_size))

    def tp_groups(self) -> list[list[int]]:
        return [self.tp_group(r) for r in range(0, self.world_size, self.tp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Every DP group, by (pp_rank, tp_rank)."""
        return [self.dp_group(self.rank(0, p, t)) for p in range(self.pp_size) for t in range(self.tp_size)]

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline, by (dp_rank, tp_rank)."""
        return [self.pp_group(self.rank(d, 0, t)) for d in range(self.dp_size) for t in range(self.tp_size)]

    # --- device meshes (their row-major rank order is the layout's) ----------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp_size, tp_size): the 2-D ("dp", "tp") device mesh of a run without pipeline stages."""
        if self.pp_size != 1:
            raise ValueError(f"a (dp, tp) mesh has no pipeline ranks (pp_size {self.pp_size})")
        return self.dp_size, self.tp_size

    @property
    def expert_mesh_shape(self) -> tuple[int, int]:
        """(world_size ÷ ep_size, ep_size): the mesh whose rows are the EP groups, its columns the ranks that hold the
        same experts."""
        return self.world_size // self.ep_size, self.ep_size


def given_pp_size(strategy_class, flags) -> int:
    """The pipeline ranks per model replica a run of `strategy_class` takes from `flags` (a name → value mapping):
    --pp_size, DEFAULT_PP_SIZE when not given, for a strategy with pipeline stages (`pipeline_parallel`); 1 for any
    other."""
    if not strategy_class.pipeline_parallel:
        return 1
    given = flags.get("pp_size")
    return DEFAULT_PP_SIZE if given is None else given


def job_layout(strategy_class, *, tp_size: int, dp_size: int, pp_size: int, ep_size: int = 1) -> dict:
    """The layout flags one strategy's run takes from the degrees of a job of several runs (the main job, the layer
    check): TP only where it shards tensors, pipeline ranks only where it has stages (the flag only there), EP only
    where it shards experts; num_workers their product."""
    tp = tp_size if strategy_class.tensor_parallel else 1
    pp = pp_size if strategy_class.pipeline_parallel else 1
    flags = {"num_workers": pp * tp * dp_size, "tp_size": tp, "dp_size": dp_size,
             "ep_size": ep_size if strategy_class.expert_parallel else 1}
    return {**flags, "pp_size": pp} if strategy_class.pipeline_parallel else flags
