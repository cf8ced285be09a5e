"""Model-state memory: the bytes of parameters, gradients, optimizer states and master copies a rank holds,
counted from its tensors, and the ZeRO paper's lower bound for them.

Each strategy says where it keeps its model states (`Strategy.model_state_bytes`); this module counts them
once each. Tensors are reduced to their storage, (data_ptr, nbytes): a view, a slice of a flat buffer, a
DTensor's local shard or a tied weight all land on one key, so every byte is counted once, in the first
category that names it, and a whole storage is counted when any view of it is held (that is what the
allocator keeps) — except in a communication buffer (`count_by_view`). The measurement points, the peak
and what each strategy keeps: docs/benchmark.md.
"""

from __future__ import annotations

import torch

from parity.precision import DTYPES, POLICIES, Policy

# The categories, in the order a strategy names them (the first to name a storage gets it).
PARAMS, MASTER, GRADS, OPTIMIZER, GRAD_BUCKETS, OFFLOAD_BUFFERS, GATHERED = (
    "params", "master_params", "grads", "optimizer_states", "grad_buckets", "offload_buffers", "gathered_params")
BOUND_CATEGORIES = (PARAMS, GRADS, OPTIMIZER)  # what the ZeRO paper's formula covers
# The model states: each value once, where its owner keeps it (DeepSpeed's master copy is its own category:
# the paper's K counts it with the optimizer states). The rest are copies made to compute or communicate
# (DDP's reducer copy of the gradients, all-gathered parameters, offload staging), counted beside.
MODEL_STATES = (PARAMS, MASTER, GRADS, OPTIMIZER)
# Where a strategy may keep model states between uses: on the device, or offloaded to host memory (the choices of
# DeepSpeed's --offload_optimizer / --offload_param and FSDP2's --offload).
OFFLOAD = ("none", "cpu")


def model_state_total(held: dict[str, int]) -> int:
    """The model-state bytes of a {category: bytes} count, without the copies."""
    return sum(held.get(category, 0) for category in MODEL_STATES)


# The two peaks of a step (what is compared first, then to break ties): the most model-state bytes, and the
# most bytes in all.
PEAK_ORDERS = {"peak": lambda held: (model_state_total(held), sum(held.values())),
               "peak_all": lambda held: (sum(held.values()), model_state_total(held))}


def bytes_per_param(policy: Policy) -> tuple[int, int, int]:
    """Bytes per parameter of (params, gradients, optimizer states) a rank holds under a precision policy: parameters
    and gradients in the policy's parameter dtype, Adam's two moments in its master dtype, and the master copy where
    the policy keeps one — counted with the optimizer states, as the ZeRO paper's K does. fp32 and bf16 autocast keep
    fp32 weights, gradients and moments (4, 4, 8); bf16_params and fp16 are the paper's mixed precision, 2Ψ + 2Ψ + 12Ψ;
    bf16_pure keeps all in bf16 (2, 2, 4)."""
    params, master = DTYPES[policy.params].itemsize, DTYPES[policy.master].itemsize
    return params, params, 2 * master + (master if policy.master_copy else 0)


BYTES_PER_PARAM = {name: bytes_per_param(policy) for name, policy in POLICIES.items()}  # by policy name


class StateLedger:
    """{category: bytes} of the storages a strategy names, each storage once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: dict[str, int] = {}
        self.offloaded = 0  # of those, bytes kept in host memory while the model computes on an accelerator
        self._seen: set[tuple[int, int]] = set()
        self._by_view: set[int] = set()  # data_ptr of the communication buffers' storages

    def count_by_view(self, buffers) -> None:
        """Communication buffers (ZeRO's reduce buckets: reduce_bucket_size elements whatever they hold, 2 GB
        of fp32 by default): a gradient parked in one is counted by its own bytes, the unused room not at all."""
        self._by_view.update(b.untyped_storage().data_ptr() for b in buffers if b is not None)

    def add(self, category: str, tensor) -> None:
        if tensor is None:
            return
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank
        if local.device.type == "meta":
            return
        storage = local.untyped_storage()
        if storage.data_ptr() in self._by_view:
            nbytes = local.numel() * local.element_size()
            key = (local.data_ptr(), nbytes)
        else:
            nbytes = storage.nbytes()
            key = (storage.data_ptr(), nbytes)
        if nbytes == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.add_bytes(category, nbytes)
        if local.device.type == "cpu" and self.device.type != "cpu":
            self.offloaded += nbytes

    def add_all(self, category: str, tensors) -> None:
        for t in tensors:
            self.add(category, t)

    def add_optimizer_state(self, optimizer) -> None:
        """A torch optimizer's per-parameter state (Adam's exp_avg and exp_avg_sq; the step counters too)."""
        for state in optimizer.state.values():
            self.add_all(OPTIMIZER, (v for v in state.values() if isinstance(v, torch.Tensor)))

    def add_bytes(self, category: str, nbytes: int) -> None:
        """Bytes held in tensors no Python object reaches (DDP's reducer buckets, sized by the reducer)."""
        self.bytes[category] = self.bytes.get(category, 0) + int(nbytes)

    def result(self) -> dict:
        return {"bytes": dict(self.bytes), "offloaded_bytes": self.offloaded}


def zero_bound(stage: int, psi: float, dp_size: int, mode: str = "fp32") -> dict[str, float]:
    """The ZeRO paper's per-rank model-state bytes {params, grads, optimizer_states} for `stage` (0 = plain
    data parallelism; FSDP's full sharding is stage 3) over `dp_size` ranks, of `psi` parameters per model
    replica's rank (the strategy's Strategy.replica_params: the whole model, ÷ tp_size under tensor parallelism,
    the layers ÷ pp_size in a pipeline): stage 1 divides the optimizer states by Nd, stage 2 the gradients too,
    stage 3 the parameters too."""
    p, g, o = (b * psi for b in BYTES_PER_PARAM[mode])
    return {PARAMS: p / dp_size if stage >= 3 else p, GRADS: g / dp_size if stage >= 2 else g,
            OPTIMIZER: o / dp_size if stage >= 1 else o}
