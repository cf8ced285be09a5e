"""The layer check's comparison: single-step dumps, tensor by tensor, and the first divergence.

Every tensor is full size under its Hugging Face name in every dump, so a pair of runs is compared
element-wise: the norm in each run, the max absolute difference, and the relative difference
max|a − b| / scale, where scale is the reference tensor's max |value| — or, for a tensor far below the
rest of its kind, a floor: 1e-3 of the kind's largest max |value| (1e-2 for updated parameters, see
SCALE_FLOOR). The floor exists for tensors far smaller than the rest of their kind, like the k_proj
bias gradients (~1e-3 of the largest gradient: softmax ignores a shift shared by all keys, and only
RoPE's rotation of that shift leaves a gradient at all): their rounding measured against themselves would
read as divergence.

Order matters for diagnosis: the first divergence is the first tensor over tolerance in execution order
— module outputs in forward order, then output gradients in backward order, then parameter gradients,
then the updated parameters — named as module + phase.

A mixture of experts' routing (routing/<router>: each token's chosen experts) is compared beside the tensors: the
tokens each expert received in each run, and every token routed to other experts, with the reference's gap between
its k-th and (k+1)-th router logit (a near-tie another reduction order tips). A flip is always reported; the tensors'
tolerances decide the verdict (docs/moe.md).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from parity import fingerprint
from parity.comparing import tolerances
from parity.comparing.verdict import Outside, Verdict
from parity.errors import ConfigError
from parity.registry import KNOWN, run_label

KINDS = ("output", "output_grad", "grad", "param")
PHASES = {"output": "forward output", "output_grad": "backward (output gradient)", "grad": "parameter gradient",
          "param": "parameter after the optimizer step"}
SCALE_FLOOR = {"output": 1e-3, "output_grad": 1e-3, "grad": 1e-3, "param": 1e-2}
"""The floor of the scale, as a fraction of the kind's largest max |value|. Updated parameters get 1e-2:
the zero-initialised q/k/v biases hold nothing but one AdamW step (≈ lr), and for elements whose gradient
is near AdamW's eps the step turns the gradients' last-bit differences into update differences amplified
by lr/eps; against 1e-2 of the largest parameter that stays far below the fp32 tolerance, while a bias that
missed its update still reads far above it (docs/tolerances.md has the numbers)."""


@dataclass
class Dump:
    strategy: str
    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def label(self) -> str:
        return run_label(self.strategy, self.meta)


@dataclass
class Row:
    key: str
    kind: str
    name: str
    norm_a: float
    norm_b: float
    max_abs: float
    rel: float


@dataclass
class PairResult:
    """Run `a` against reference `b`: every tensor's row, and the verdict (the first tensor over tolerance
    in execution order, named as module + phase)."""

    a: str
    b: str
    tolerance: float | dict[str, float]  # one for every tensor, or per tensor (calibrated)
    rows: list[Row]
    bit_identical: bool
    loss_a: float
    loss_b: float
    verdict: Verdict
    routing: list[dict] | None = None  # a mixture of experts: per router, its expert loads and flips (compare_routing)

    @property
    def max_rel(self) -> float:
        return max(r.rel for r in self.rows)


REFERENCE_STEM = "noise_reference_ddp"  # DDP's step again in fp32: how far bf16 rounding moves each tensor


def load_dumps(input_dir: str) -> dict[str, Dump]:
    """Every dump_<strategy> of the folder; ConfigError if they are not dumps of the same step."""
    metas = sorted(glob.glob(os.path.join(input_dir, "dump_*.json")))
    if not metas:
        raise ConfigError(f"{input_dir} holds no dump_*.json: run run_verification.py --output_dir {input_dir} first")
    dumps = {}
    for meta_path in metas:
        dump = _read_dump(meta_path)
        dumps[dump.strategy] = dump
    _check_same_step(list(dumps.values()))
    return dumps


def load_noise_reference(input_dir: str, dumps: dict[str, Dump]) -> Dump | None:
    """The folder's noise reference (DDP's step in fp32), checked against the dumps; None if there is none."""
    meta_path = os.path.join(input_dir, REFERENCE_STEM + ".json")
    if not os.path.exists(meta_path):
        return None
    reference = _read_dump(meta_path)
    _check_same_step([*dumps.values(), reference])
    if reference.meta["precision"] != "fp32":
        raise ConfigError(f"{REFERENCE_STEM}.json is {reference.meta['precision']}: the layer check's noise reference "
                          f"is DDP's step in fp32; delete it and rerun run_verification.py")
    return reference


META_KEYS = ("strategy", "tp_size", "dp_size", "precision", "loss", "dp_rank_losses", "grad_norm", "learning_rate",
             "inputs_sha256", "init_weights_sha256", "model_config", "forward_order", "backward_order", "fingerprint")


def _read_dump(meta_path: str) -> Dump:
    """A dump's metadata and tensors, checked; ConfigError naming the file for anything unreadable."""
    from safetensors.torch import load_file

    name = os.path.basename(meta_path)
    tensor_path = meta_path[: -len(".json")] + ".safetensors"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name} cannot be read ({type(exc).__name__}: {str(exc)[:80]}): rerun that strategy "
                          f"into the folder") from None
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if missing:
        raise ConfigError(f"{name} is not a dump's metadata (it lacks {', '.join(missing[:3])}"
                          f"{' …' if len(missing) > 3 else ''}): rerun that strategy into the folder")
    try:
        tensors = load_file(tensor_path)
    except Exception as exc:  # missing, truncated or not safetensors: safetensors raises its own error type
        raise ConfigError(f"{os.path.basename(tensor_path)} cannot be read ({str(exc).splitlines()[0][:80]}): "
                          f"rerun that strategy into the folder") from None
    return Dump(meta["strategy"], meta, tensors)


def _check_same_step(dumps: list[Dump]) -> None:
    first = dumps[0]
    for dump in dumps:
        code = fingerprint.differences(first.meta["fingerprint"], dump.meta["fingerprint"], strategy=False)
        if code:
            raise ConfigError(f"dumps of other code: {first.strategy} and {dump.strategy} ran other shared code or "
                              f"libraries ({'; '.join(code)}): rerun both into a fresh folder")
        for key, what in (("inputs_sha256", "inputs"), ("init_weights_sha256", "initial weights"),
                          ("model_config", "model config"), ("learning_rate", "learning rate"),
                          ("replay", "replay starts")):
            if dump.meta.get(key) != first.meta.get(key):
                raise ConfigError(f"dumps from different {what}: {first.strategy} and {dump.strategy} differ in "
                                  f"{key}; rerun both with the same --output_dir")
        if dump.meta["dp_size"] != first.meta["dp_size"]:
            raise ConfigError(f"dumps from different DP sizes: {first.strategy} has dp={first.meta['dp_size']}, "
                              f"{dump.strategy} dp={dump.meta['dp_size']}; rerun with one --dp_size")


def tolerance_for(a: Dump, b: Dump, override: float | None = None,
                  noise: dict[str, float] | None = None) -> tuple[float | dict[str, float], str]:
    """(tolerance, where it came from): the override; else, for a bf16 pair with the noise reference's
    per-tensor noise, LAYER_NOISE_K × that noise (never below the fp32 tolerance); else the looser
    precision's fixed tolerance (uncalibrated)."""
    if override is not None:
        return override, "--tolerance"
    looser = tolerances.looser_precision(a.meta["precision"], b.meta["precision"])
    if looser == "bf16" and noise is not None:
        # An updated parameter may also differ by two AdamW steps (±lr each) where rounding flips the sign of
        # a noise-level gradient: a difference the fp32 reference cannot show.
        flip = {k: tolerances.ADAM_SIGN_FLIP * a.meta["learning_rate"] / scale
                for k, scale in tensor_scales(a).items() if k.startswith("param/")}
        return ({key: max(tolerances.LAYER_NOISE_K * n, flip.get(key, 0.0), tolerances.LAYERS["fp32"])
                 for key, n in noise.items()},
                f"calibrated: {tolerances.LAYER_NOISE_K} × each tensor's {a.meta['precision']} rounding "
                f"({REFERENCE_STEM})")
    why = "no noise reference" if looser == "bf16" else "fp32"
    return tolerances.LAYERS[looser], f"the fixed {looser} tolerance ({why})"


def rounding_noise(reference: Dump, dumps: dict[str, Dump]) -> dict[str, float] | None:
    """Per tensor: how far the policy's rounding moves it — DDP's dump in a low-precision policy against DDP's fp32
    step, by the same measure the pairs are compared with. None without such a DDP dump to measure it on."""
    ddp = dumps.get("ddp")
    if reference is None or ddp is None or ddp.meta["precision"] == "fp32":
        return None
    return {row.key: row.rel for row in compare_pair(ddp, reference, 1.0).rows}


def execution_order(dump: Dump) -> list[str]:
    """Keys in the order the step produced them."""
    keys = [f"output/{n}" for n in dump.meta["forward_order"]]
    keys += [f"output_grad/{n}" for n in dump.meta["backward_order"]]
    for kind in ("grad", "param"):
        keys += [k for k in dump.tensors if k.startswith(kind + "/")]
    return [k for k in keys if k in dump.tensors]


def tensor_scales(dump: Dump) -> dict[str, float]:
    """What each tensor's difference is measured against: its own max |value|, or for a tensor far below the
    rest of its kind, SCALE_FLOOR of the kind's largest max |value|."""
    keys = execution_order(dump)
    largest = {kind: max((float(dump.tensors[k].abs().max()) for k in keys if k.startswith(kind + "/")), default=0.0)
               for kind in KINDS}
    return {k: max(float(dump.tensors[k].abs().max()) if dump.tensors[k].numel() else 0.0,
                   SCALE_FLOOR[k.split("/", 1)[0]] * largest[k.split("/", 1)[0]], 1e-30) for k in keys}


def compare_pair(a: Dump, b: Dump, tolerance: float | dict[str, float], source: str = "") -> PairResult:
    """Compare run `a` against reference `b` (b is the earlier of the pair: DDP first)."""
    keys = execution_order(b)
    missing = [k for k in keys if k not in a.tensors]
    if missing:
        raise ConfigError(f"dump of {a.strategy} lacks {missing[0]} that {b.strategy} has "
                          f"({len(missing)} tensors): rerun both with the same version of the harness")
    scales = tensor_scales(b)
    rows, first = [], None
    for key in keys:
        kind, name = key.split("/", 1)
        ta, tb = a.tensors[key].double(), b.tensors[key].double()
        if ta.shape != tb.shape:
            raise ConfigError(f"{key} has shape {tuple(ta.shape)} in {a.strategy} and {tuple(tb.shape)} in "
                              f"{b.strategy}: a strategy did not gather it to full size")
        max_abs = float((ta - tb).abs().max()) if ta.numel() else 0.0
        row = Row(key, kind, name, float(ta.norm()), float(tb.norm()), max_abs, max_abs / scales[key])
        rows.append(row)
        bound = tolerance[key] if isinstance(tolerance, dict) else tolerance
        if first is None and not row.rel <= bound:  # NaN is a divergence too
            first = Outside(quantity=PHASES[kind], rel_diff=row.rel, tolerance=bound, module=name)
    worst = {kind: max((r.rel for r in rows if r.kind == kind), default=0.0) for kind in KINDS}
    return PairResult(a=a.strategy, b=b.strategy, tolerance=tolerance, rows=rows,
                      bit_identical=all(r.max_abs == 0 for r in rows) and a.meta["loss"] == b.meta["loss"],
                      loss_a=a.meta["loss"], loss_b=b.meta["loss"],
                      verdict=Verdict(a.strategy, b.strategy, source, worst, first), routing=compare_routing(a, b))


def compare_routing(a: Dump, b: Dump) -> list[dict] | None:
    """Per router of a mixture of experts (in layer order): the tokens each expert received in run `a` and in the
    reference `b`, and the tokens `a` routed to other experts than `b`, each with `b`'s logit gap at its top-k
    boundary. None for a dense model."""
    from parity.training.routing import flips

    routers = [k.split("/", 1)[1] for k in b.tensors if k.startswith("routing/")]
    if not routers:
        return None
    found = []
    for name in routers:
        ids_a, ids_b = a.tensors.get(f"routing/{name}"), b.tensors[f"routing/{name}"]
        if ids_a is None or ids_a.shape != ids_b.shape:
            raise ConfigError(f"dump of {a.strategy} lacks the routing of {name} that {b.strategy} has: rerun both "
                              f"with the same version of the harness")
        experts = b.tensors[f"output/{name}"].shape[-1]
        loads = [torch.bincount(ids.reshape(-1).long(), minlength=experts).tolist() for ids in (ids_a, ids_b)]
        found.append({"router": name, "loads": loads[0], "reference_loads": loads[1],
                      "flips": flips(ids_a, ids_b, b.tensors[f"output/{name}"], ids_b.shape[-1])})
    return found


def compare_all(dumps: dict[str, Dump], override: float | None = None, reference: Dump | None = None) -> list[PairResult]:
    if len(dumps) < 2:
        raise ConfigError(f"only {', '.join(dumps)} has a dump: a comparison needs two strategies")
    known = [s for s in KNOWN if s in dumps] + sorted(s for s in dumps if s not in KNOWN)  # yours after the table's
    pairs = [(x, y) for i, x in enumerate(known) for y in known[i + 1:]]  # every pair, DDP's first
    noise = rounding_noise(reference, dumps)
    return [compare_pair(dumps[y], dumps[x], *tolerance_for(dumps[x], dumps[y], override, noise)) for x, y in pairs]


def summary_json(dumps: dict[str, Dump], results: list[PairResult]) -> dict:
    return {
        "runs": {s: {k: d.meta[k] for k in ("tp_size", "dp_size", "precision", "loss", "dp_rank_losses",
                                             "grad_norm", "perturbed", "fingerprint")} for s, d in dumps.items()},
        "pairs": [{**r.verdict.to_dict(), "calibrated": isinstance(r.tolerance, dict), "bit_identical": r.bit_identical,
                   "max_rel": _finite(r.max_rel), "loss": r.loss_a, "reference_loss": r.loss_b, "routing": r.routing,
                   "rows": [{**{k: _finite(v) for k, v in asdict(row).items()},
                             "tolerance": r.tolerance[row.key] if isinstance(r.tolerance, dict) else r.tolerance}
                            for row in r.rows]} for r in results],
    }


def _finite(x):
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)
