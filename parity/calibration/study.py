"""The calibration study: how far correct and buggy bf16 runs fall from the DDP baseline, measured against
several candidate noise references, over seeds and CPU kernel paths — the numbers NOISE_K, DRIFT_K and the
choice of reference rest on (docs/tolerances.md).

Per (shape, kernel path, seed) it trains, in local gloo groups (parity.driver.local_group):
  the baseline   DDP bf16 at DP=2 × batch 2 (the main job's),
  references     DDP fp32 at the same layout (the scale of bf16 rounding itself), DDP bf16 at DP=1 × 4 and
                 DP=4 × 1 (the layout twins), and each TP strategy again at TP=2 × DP=1 × 4 (its TP twin),
  clean runs     DeepSpeed TP=2 × DP=2, FSDP TP=2 × DP=2 with autocast and with the MixedPrecisionPolicy,
and per (kernel path, bug seed) every entry of the seeded-bug catalogue (parity.calibration.bugs), in bf16
and, where the bug exists there, in fp32 (judged by the fixed fp32 table). With other precision policies
(--policies: bf16_params, bf16_pure, fp16) each seed also gets a folder per policy with DDP's baseline and its
references in that policy (the fp32 twin in fp32) and the policy's clean runs (POLICY_CLEAN_RUNS): their false-alarm
rate under the constants the bf16 study chose (docs/tolerances.md). Every run writes its loss record
into a folder of its own; a record that is already complete is not trained again, so a study that stopped
continues where it was. Then each clean and buggy run is measured against each candidate reference:
deviation ÷ noise per curve (its worst step) and the drift statistic — with the comparing package's own
functions, so the study measures exactly what the verdict computes — and, where its record holds every tensor's series,
tensor by tensor by the tensor verdict itself (parity.comparing.tensor_verdict), on the verdict's references.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field

from parity import storage
from parity.calibration.bugs import CATALOGUE, SeededBug
from parity.comparing.noise import drift_statistic, noise_envelope, noise_ratio, relative_diffs
from parity.comparing.tolerances import CURVES, DRIFT_K, NOISE_FLOOR, NOISE_K, QUANTITIES
from parity.comparing import tensor_verdict
from parity.comparing.curves import Run
from parity.training.record import load_record

SETTING = {"seq_length": 128, "debug_steps": 40, "learning_rate": 1e-3, "warmup_steps": 5, "max_grad_norm": 0.8,
           "log_interval": 40, "checkpoint_interval": 0}
"""The shared training setting of every run (qwen2-tiny): long enough for drift to show, with warm-up and
every step clipped, as the main job trains."""

SHAPES = {
    "tiny": {"model_name": "qwen2-tiny"},
    # The Qwen2.5-0.5B layer shape (hidden 896, 14 heads, 2 KV heads, MLP 4864), 2 layers, with an 8192-token
    # vocabulary so that a CPU step takes seconds (the data uses 256 tokens of it).
    "wide": {"model_name": "wide", "seq_length": 256, "debug_steps": 20, "learning_rate": 3e-4,
             "vocab_size": 8192},
}
KERNELS = ("default", "avx512_core_bf16", "avx2")

BASELINE = "ddp_bf16"  # the baseline's run id in the bf16 policy; in another, ddp_<policy> (baseline_id)
REFERENCE_RUNS = {  # run id → (strategy, layout and precision)
    "ddp_bf16": ("ddp", {"precision": "bf16", "num_workers": 2, "batch_size": 2}),
    "ddp_fp32": ("ddp", {"precision": "fp32", "num_workers": 2, "batch_size": 2}),
    "twin_dp1": ("ddp", {"precision": "bf16", "num_workers": 1, "batch_size": 4}),
    "twin_dp4": ("ddp", {"precision": "bf16", "num_workers": 4, "batch_size": 1}),
}
CLEAN_RUNS = {  # run id → (strategy, flags); each has a TP twin "<id>_tp_twin" at TP=2 × DP=1 × 4
    "deepspeed": ("deepspeed", {"tp_size": 2}),
    "fsdp_autocast": ("fsdp", {"tp_size": 2, "mixed_precision": "autocast"}),
    "fsdp_policy": ("fsdp", {"tp_size": 2, "mixed_precision": "policy"}),
}
# The clean runs of each other precision policy, against DDP in that policy with the chosen references (twins + fp32
# twin): TP=2 × DP=2. DeepSpeed at ZeRO-1 and ZeRO-2 (its ZeRO-0 in bf16_params FAILs, tests/test_precision.py says
# why), FSDP2 + TP; fp16 without DeepSpeed, which refuses fp16 on a CPU without fp16 kernels.
POLICY_CLEAN_RUNS = {
    "bf16_params": {"deepspeed_zero1": ("deepspeed", {"tp_size": 2, "zero_stage": 1}),
                    "deepspeed_zero2": ("deepspeed", {"tp_size": 2, "zero_stage": 2}),
                    "fsdp": ("fsdp", {"tp_size": 2})},
    "bf16_pure": {"deepspeed": ("deepspeed", {"tp_size": 2}), "fsdp": ("fsdp", {"tp_size": 2})},
    "fp16": {"fsdp": ("fsdp", {"tp_size": 2})},
}
POLICIES = ("bf16", *POLICY_CLEAN_RUNS)


def baseline_id(policy: str) -> str:
    return f"ddp_{policy}"


def clean_runs(policy: str) -> dict:
    return CLEAN_RUNS if policy == "bf16" else POLICY_CLEAN_RUNS[policy]


def chosen_reference(policy: str) -> str:
    """The verdict's references in a policy (CANDIDATES' name): the twins and the fp32 twin where the master weights
    are fp32, the twins alone in bf16_pure (parity.precision.Policy.fp32_twin_measures_noise)."""
    from parity.precision import POLICIES

    return "twins+fp32" if POLICIES[policy].fp32_twin_measures_noise else "twins"


CANDIDATES = {  # a noise reference: which runs measure the noise (a callable of the run measured gives a TP twin)
    "twins": ("twin_dp1", "twin_dp4"),
    "fp32": ("ddp_fp32",),
    "twins+fp32": ("twin_dp1", "twin_dp4", "ddp_fp32"),
    "tp_twin": "tp_twin",
}


@dataclass(frozen=True)
class Planned:
    """One run of the study: where it sits, and its flags."""

    shape: str
    kernel: str
    seed: int
    run: str  # its id within the seed's folder
    strategy: str
    values: dict = field(default_factory=dict)
    policy: str = "bf16"  # the precision policy of the seed's folder

    @property
    def folder(self) -> str:
        policy = () if self.policy == "bf16" else (self.policy,)
        return os.path.join(self.shape, self.kernel, *policy, f"seed{self.seed}", self.run)


def plan_study(shapes, kernels, seeds, bug_seeds, bugs: tuple[SeededBug, ...] = CATALOGUE,
               policies=("bf16",)) -> list[Planned]:
    """Every run of the study, in no particular order. A bug seed is one of the seeds: its folder holds the
    baseline and the references the bug is judged against. `policies` other than bf16: their clean runs at every
    seed, beside DDP's baseline and references in the policy (no catalogue: it is bf16's)."""
    assert set(bug_seeds) <= set(seeds), "bug seeds are a subset of the seeds"
    planned = []
    for shape, kernel, policy, seed in itertools.product(shapes, kernels, [p for p in policies if p != "bf16"], seeds):
        runs = {baseline_id(policy) if run == BASELINE else run: (strategy, {
            **flags, "precision": "fp32" if flags["precision"] == "fp32" else policy})
            for run, (strategy, flags) in REFERENCE_RUNS.items()}
        for run, (strategy, flags) in POLICY_CLEAN_RUNS[policy].items():
            runs[run] = (strategy, {"precision": policy, "num_workers": 4, "batch_size": 2, **flags})
        planned += [Planned(shape, kernel, seed, run, s, v, policy) for run, (s, v) in runs.items()]
    if "bf16" not in policies:
        return planned
    for shape, kernel in itertools.product(shapes, kernels):
        for seed in seeds:
            runs = {**REFERENCE_RUNS}
            for run, (strategy, flags) in CLEAN_RUNS.items():
                runs[run] = (strategy, {"precision": "bf16", "num_workers": 4, "batch_size": 2, **flags})
                if seed in bug_seeds:  # the TP-twin candidate, measured where its bugs are
                    runs[f"{run}_tp_twin"] = (strategy, {"precision": "bf16", "num_workers": 2, "batch_size": 4,
                                                         **flags})
            planned += [Planned(shape, kernel, seed, run, s, v) for run, (s, v) in runs.items()]
        if shape != "tiny":
            continue  # the wide shape: the clean part only
        for seed, bug in itertools.product(bug_seeds, [b for b in bugs if not b.padded]):  # the baselines: full windows
            for precision in bug.precisions:
                layout = {"num_workers": 2, "batch_size": 2} if bug.strategy == "ddp" else \
                    {"num_workers": 4, "tp_size": 2, "batch_size": 2}
                run = f"bug_{_slug(bug.name)}_{precision}"
                planned.append(Planned(shape, kernel, seed, run, bug.strategy, {"precision": precision, **layout,
                                                                                 **bug.values}))
                if precision == "bf16" and bug.strategy != "ddp":  # the TP twin of the buggy copy itself
                    planned.append(Planned(shape, kernel, seed, f"{run}_tp_twin", bug.strategy,
                                           {"precision": precision, "num_workers": 2, "tp_size": 2, "batch_size": 4,
                                            **bug.values}))
    return planned


def run_study(out: str, planned: list[Planned], log=print) -> float:
    """Train every planned run whose record is not complete yet, one local gloo group per (shape, kernel path,
    world size). Returns the seconds it took."""
    from parity.driver.local_group import plan, run_group

    t0 = time.perf_counter()
    todo = [p for p in planned if not _complete(out, p)]
    groups: dict[tuple, list] = {}
    for p in todo:
        cfg_values = _values(out, p)
        groups.setdefault((p.shape, p.kernel, cfg_values["num_workers"]), []).append(plan(p.strategy, cfg_values))
    log(f"{len(planned)} runs planned, {len(todo)} to train, in {len(groups)} groups")
    for (shape, kernel, world), runs in sorted(groups.items()):
        g0 = time.perf_counter()
        run_group(runs, kernel)
        log(f"  {shape} {kernel} world {world}: {len(runs)} runs in {time.perf_counter() - g0:.0f} s")
    return time.perf_counter() - t0


def _values(out: str, p: Planned) -> dict:
    shape = dict(SHAPES[p.shape])
    model = shape.pop("model_name")
    if model == "wide":
        model = wide_model_dir(out, shape.pop("vocab_size"))
    folder = os.path.join(out, "runs", p.folder)
    return {**SETTING, **shape, "model_name": model, "seed": p.seed,
            "init_weights_path": weights_file(out, p.shape, model, p.seed), "loss_output_dir": folder,
            "storage_path": os.path.join(folder, "ray"), **p.values}


def _complete(out: str, p: Planned) -> bool:
    record = _record_path(out, p)
    if record is None:
        return False
    with open(record) as f:
        return json.load(f).get("complete", False)


def _record_path(out: str, p: Planned) -> str | None:
    folder = os.path.join(out, "runs", p.folder)
    names = [n for n in os.listdir(folder) if n.endswith(".json")] if os.path.isdir(folder) else []
    return os.path.join(folder, names[0]) if names else None


def wide_model_dir(out: str, vocab_size: int) -> str:
    """A model folder (config.json) of the Qwen2.5-0.5B shape with 2 layers and a smaller vocabulary."""
    from parity.models.model import resolve_model_config

    folder = os.path.join(out, "models", f"qwen2.5-0.5b-shape-2-layers-vocab{vocab_size}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        config = resolve_model_config("Qwen/Qwen2.5-0.5B", 2)
        config.vocab_size = vocab_size
        config.bos_token_id = config.eos_token_id = 0
        os.makedirs(folder, exist_ok=True)
        config.save_pretrained(folder)
    return folder


def weights_file(out: str, shape: str, model: str, seed: int) -> str:
    """The initial weights of a seed (what --save_init_weights writes), made once."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    path = os.path.join(out, "weights", f"{shape}_{seed}.pt")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_init_weights(build_model(resolve_model_config(model), seed), path)
    return path


# --- analysis -------------------------------------------------------------------------------------------

def analyze(out: str, planned: list[Planned]) -> dict:
    """Every clean and buggy bf16 run measured against every candidate reference, and every bug's fp32 run
    against the fixed fp32 table: {"clean": [...], "bugs": [...], "fp32_bugs": [...]}, one row per run."""
    series, tensors = {}, {}
    for p in planned:
        path = _record_path(out, p)
        if path:
            record = load_record(path)
            series[p.folder] = {q: [s[q] for s in record["steps"]] for q in QUANTITIES}
            tensors[p.folder] = Run(path, record)
    rows = {"clean": [], "bugs": [], "fp32_bugs": []}
    for p in planned:
        seed_folder = os.path.dirname(p.folder)
        base = series.get(os.path.join(seed_folder, baseline_id(p.policy)))
        mine = series.get(p.folder)
        if base is None or mine is None:
            continue
        where = {"shape": p.shape, "kernel": p.kernel, "seed": p.seed, "run": p.run, "policy": p.policy}
        if p.run in clean_runs(p.policy) or (p.run.startswith("bug_") and p.run.endswith("_bf16")):
            kind = "clean" if p.run in clean_runs(p.policy) else "bugs"
            measured = {}
            for candidate, refs in CANDIDATES.items():
                ids = (f"{p.run}_tp_twin",) if refs == "tp_twin" else refs  # a strategy's own twin, bugs included
                references = [series.get(os.path.join(seed_folder, r)) for r in ids]
                if any(r is None for r in references):
                    continue
                measured[candidate] = measure(mine, base, references)
            references = [tensors.get(os.path.join(seed_folder, r)) for r in CANDIDATES[chosen_reference(p.policy)]]
            rows[kind].append({**where, "measured": measured,
                               "tensors": measure_tensors(tensors[p.folder], tensors[os.path.join(
                                   seed_folder, baseline_id(p.policy))], references, p.policy)})
        elif p.run.startswith("bug_") and p.run.endswith("_fp32"):
            fp32 = series.get(os.path.join(seed_folder, "ddp_fp32"))
            if fp32 is not None:
                worst = {q: max(abs(d) for d in relative_diffs(mine[q], fp32[q])) for q in QUANTITIES}
                first = next((s for s in range(len(mine["loss"])) for q in QUANTITIES
                              if not abs(mine[q][s] - fp32[q][s]) <= CURVES["fp32"].of(q) * abs(fp32[q][s])), None)
                rows["fp32_bugs"].append({**where, "max_rel_diff": worst, "first_fail_step": first})
    return rows


def measure(run: dict, base: dict, references: list[dict]) -> dict:
    """One run against the baseline with these references: per curve, deviation ÷ noise (the worst step) and
    the drift statistic; and whether the verdict of today's constants FAILs it."""
    ratios, drifts = {}, {}
    for q in QUANTITIES:
        envelope = noise_envelope(base[q], [r[q] for r in references], NOISE_FLOOR["bf16"].of(q))
        diffs = relative_diffs(run[q], base[q])
        ratios[q], drifts[q] = noise_ratio(diffs, envelope), drift_statistic(diffs, envelope)
    return {"ratio": ratios, "drift": drifts,
            "fails": max(ratios.values()) > NOISE_K or max(drifts.values()) > DRIFT_K}


def measure_tensors(run: Run | None, base: Run | None, references: list, policy: str = "bf16") -> dict | None:
    """One run's tensor verdict against the baseline's on the verdict's references (tensor_verdict.judge): the worst
    point's deviation ÷ bound and where, and the point it names (None: within at every step); None where the run, the
    baseline or a reference has no tensor series (a strategy that does not hand over its pieces)."""
    if run is None or base is None or any(r is None for r in references):
        return None
    series = {r.file: tensor_verdict.read(r) for r in [run, base, *references]}
    if any(isinstance(x, str) for x in series.values()):
        return None
    steps = min(len(r.steps) for r in [run, base, *references])
    found = tensor_verdict.judge(base, run, references, series, steps)
    worst = max(found.largest.values(), key=lambda p: p.ratio)
    first = found.first
    return {"ratio": worst.ratio, "tensor": worst.tensor, "phase": worst.phase, "step": worst.step,
            "fails": first is not None,
            "first_outside": {"step": first.step, "tensor": first.tensor, "phase": first.phase,
                              "ratio": first.ratio} if first else None}


def summarize_tensors(rows: dict, policy: str = "bf16") -> dict:
    """The per-tensor verdict over the runs with tensor series, under the verdict's references: its false alarms
    among the clean runs (and the worst), and per bug class whether it, the curves or either caught every run."""
    chosen = chosen_reference(policy)
    clean = [r for r in rows["clean"] if r.get("tensors") and r.get("policy", "bf16") == policy]
    bugs = [r for r in rows["bugs"] if r.get("tensors") and chosen in r["measured"]]
    worst = max(clean, key=lambda r: r["tensors"]["ratio"], default=None)
    by_class: dict = {}
    for r in bugs:
        entry = by_class.setdefault(r["run"], {"runs": 0, "tensors": 0, "curves": 0, "either": 0, "min_ratio": None})
        by_tensors, by_curves = r["tensors"]["fails"], r["measured"][chosen]["fails"]
        entry["runs"] += 1
        entry["tensors"] += by_tensors
        entry["curves"] += by_curves
        entry["either"] += by_tensors or by_curves
        ratio = r["tensors"]["ratio"]
        entry["min_ratio"] = ratio if entry["min_ratio"] is None else min(entry["min_ratio"], ratio)
    return {"clean_runs": len(clean), "false_alarms": sum(r["tensors"]["fails"] for r in clean),
            "clean_max_ratio": worst["tensors"]["ratio"] if worst else None,
            "worst_clean": {**{k: worst[k] for k in ("kernel", "seed", "run")},
                            **{k: worst["tensors"][k] for k in ("tensor", "phase", "step")}} if worst else None,
            "bug_runs": len(bugs), "by_bug": dict(sorted(by_class.items()))}


def summarize(rows: dict, noise_k: float = NOISE_K, drift_k: float = DRIFT_K, policy: str = "bf16") -> dict:
    """Per candidate: the worst clean run, the weakest detection per bug class, and the false-alarm and
    detection rates under (noise_k, drift_k), over the clean runs of one precision `policy`."""
    out = {}
    for candidate in CANDIDATES:
        clean = [(r, r["measured"][candidate]) for r in rows["clean"]
                 if candidate in r["measured"] and r.get("policy", "bf16") == policy]
        bugs = [(r, r["measured"][candidate]) for r in rows["bugs"] if candidate in r["measured"]]
        if not clean:
            continue
        score = lambda m: max(max(m["ratio"].values()) / noise_k, max(m["drift"].values()) / drift_k)  # noqa: E731
        worst_clean = max(clean, key=lambda x: score(x[1]))
        by_class = {}
        for r, m in bugs:
            name = r["run"]
            if name not in by_class or score(m) < score(by_class[name][1]):
                by_class[name] = (r, m)
        out[candidate] = {
            "clean_runs": len(clean),
            "false_alarms": sum(score(m) > 1 for _, m in clean),
            "clean_max_ratio": max(max(m["ratio"].values()) for _, m in clean),
            "clean_max_drift": max(max(m["drift"].values()) for _, m in clean),
            "worst_clean": {k: worst_clean[0][k] for k in ("shape", "kernel", "seed", "run")},
            "bug_runs": len(bugs),
            "missed": sum(score(m) <= 1 for _, m in bugs),
            "weakest_per_bug": {name: {"seed": r["seed"], "kernel": r["kernel"], "max_ratio": max(m["ratio"].values()),
                                       "max_drift": max(m["drift"].values()), "caught": score(m) > 1}
                                for name, (r, m) in sorted(by_class.items())},
        }
    return out


def write_outputs(out: str, rows: dict, summary: dict, wall_s: float, settings: dict,
                  by_policy: dict | None = None, tensor_summary: dict | None = None) -> list[str]:
    """calibration_study.json (every row), calibration_study.md (the tables) and calibration_study.png.
    `by_policy`: the other precision policies' summaries under the chosen reference (twins + fp32 twin);
    `tensor_summary`: the per-tensor verdict's (summarize_tensors)."""
    json_path = os.path.join(out, "calibration_study.json")
    md_path = os.path.join(out, "calibration_study.md")
    png_path = os.path.join(out, "calibration_study.png")
    storage.write_json_atomic(json_path, {"settings": settings, "constants": {"NOISE_K": NOISE_K, "DRIFT_K": DRIFT_K},
                                          "wall_s": wall_s, "summary": summary, "by_policy": by_policy or {},
                                          "tensor_summary": tensor_summary, "rows": rows})
    storage.write_text_atomic(md_path, markdown(rows, summary, wall_s, settings, by_policy or {}, tensor_summary))
    from parity.comparing.figures import save_figure
    save_figure(study_figure(rows), png_path)
    return [json_path, md_path, png_path]


def markdown(rows: dict, summary: dict, wall_s: float, settings: dict, by_policy: dict | None = None,
             tensor_summary: dict | None = None) -> str:
    lines = ["# Calibration study", "", f"Settings: `{json.dumps(settings)}`; wall time {wall_s / 60:.1f} min.", "",
             f"Verdict constants: NOISE_K = {NOISE_K}, DRIFT_K = {DRIFT_K}.", "", "## Candidate references", "",
             "| reference | clean runs | false alarms | clean max deviation ÷ noise | clean max drift | bug runs (bf16) "
             "| missed |", "|---|---|---|---|---|---|---|"]
    for candidate, s in summary.items():
        lines.append(f"| {candidate} | {s['clean_runs']} | {s['false_alarms']} | {s['clean_max_ratio']:.1f} | "
                     f"{s['clean_max_drift']:.1f} | {s['bug_runs']} | {s['missed']} |")
    if tensor_summary and tensor_summary["clean_runs"]:
        lines += ["", *tensor_markdown(tensor_summary)]
    lines += ["", "## Clean runs: worst deviation ÷ noise (and drift) per strategy, shape and kernel path", ""]
    for candidate in summary:
        lines += [f"### {candidate}", "", "| shape | kernel | run | max ratio | max drift | worst curve |",
                  "|---|---|---|---|---|---|"]
        groups: dict = {}
        for r in rows["clean"]:
            if candidate in r["measured"] and r.get("policy", "bf16") == "bf16":
                groups.setdefault((r["shape"], r["kernel"], r["run"]), []).append(r["measured"][candidate])
        for (shape, kernel, run), ms in sorted(groups.items()):
            worst = max(ms, key=lambda m: max(m["ratio"].values()))
            curve = max(worst["ratio"], key=worst["ratio"].get)
            lines.append(f"| {shape} | {kernel} | {run} | {max(max(m['ratio'].values()) for m in ms):.1f} | "
                         f"{max(max(m['drift'].values()) for m in ms):.1f} | {curve} |")
        lines += ["", "Weakest detection per bug class (bf16):", "", "| bug | max ratio | max drift | caught |",
                  "|---|---|---|---|"]
        for name, w in summary[candidate]["weakest_per_bug"].items():
            lines.append(f"| {name} | {w['max_ratio']:.1f} | {w['max_drift']:.1f} | {'yes' if w['caught'] else 'NO'} |")
        lines.append("")
    if by_policy:
        lines += ["## Other precision policies: clean runs against DDP in the policy (the verdict's references)", "",
                  "| policy | references | run | kernel | runs | false alarms | max deviation ÷ noise | max drift |",
                  "|---|---|---|---|---|---|---|---|"]
        groups = {}
        for r in rows["clean"]:
            policy = r.get("policy", "bf16")
            if policy in by_policy and chosen_reference(policy) in r["measured"]:
                groups.setdefault((policy, r["run"], r["kernel"]), []).append(r["measured"][chosen_reference(policy)])
        for (policy, run, kernel), ms in sorted(groups.items()):
            fails = sum(max(max(m["ratio"].values()) / NOISE_K, max(m["drift"].values()) / DRIFT_K) > 1 for m in ms)
            lines.append(f"| {policy} | {chosen_reference(policy)} | {run} | {kernel} | {len(ms)} | {fails} | "
                         f"{max(max(m['ratio'].values()) for m in ms):.1f} | "
                         f"{max(max(m['drift'].values()) for m in ms):.1f} |")
        lines.append("")
    if rows["fp32_bugs"]:
        lines += ["## Bugs in fp32 (the fixed 1e-5 table)", "", "| bug | runs | caught | latest first FAIL step |",
                  "|---|---|---|---|"]
        groups = {}
        for r in rows["fp32_bugs"]:
            groups.setdefault(r["run"], []).append(r["first_fail_step"])
        for run, steps in sorted(groups.items()):
            caught = [s for s in steps if s is not None]
            lines.append(f"| {run} | {len(steps)} | {len(caught)} | {max(caught) if caught else '–'} |")
    return "\n".join(lines) + "\n"


def tensor_markdown(t: dict) -> list[str]:
    """The per-tensor verdict's section: false alarms among the clean runs, and per bug class what caught it."""
    w = t["worst_clean"]
    lines = ["## Per-tensor verdict (the tensor verdict: each tensor's gradient and parameter norm within NOISE_K × its "
             "own envelope, twins + fp32 twin)", "",
             f"Clean runs with tensor series: {t['clean_runs']}, false alarms: {t['false_alarms']}; the worst: "
             f"{t['clean_max_ratio']:.2f} of its bound ({w['run']}, {w['kernel']}, seed {w['seed']}: {w['tensor']}, "
             f"{w['phase']}, step {w['step']}).", ""]
    if t["by_bug"]:
        lines += ["| bug | runs | caught by the tensors | by the curves | by either | weakest deviation ÷ bound |",
                  "|---|---|---|---|---|---|"]
        for name, b in t["by_bug"].items():
            lines.append(f"| {name} | {b['runs']} | {b['tensors']} | {b['curves']} | {b['either']} | "
                         f"{b['min_ratio']:.2f} |")
    return lines


def study_figure(rows: dict, candidate: str | None = None):
    """Clean against buggy runs per candidate reference: deviation ÷ noise (left) and the drift statistic
    (right), log scale, NOISE_K and DRIFT_K drawn."""
    from matplotlib.figure import Figure

    candidates = [c for c in CANDIDATES if any(c in r["measured"] for r in rows["clean"])]
    fig = Figure(figsize=(12, 3.2 * len(candidates)), layout="constrained")
    axes = fig.subplots(len(candidates), 2, squeeze=False)
    for (ax_ratio, ax_drift), c in zip(axes, candidates):
        for kind, colour, marker in (("clean", "C0", "o"), ("bugs", "C3", "x")):
            ms = [r["measured"][c] for r in rows[kind] if c in r["measured"]]
            for ax, key in ((ax_ratio, "ratio"), (ax_drift, "drift")):
                values = [max(max(m[key].values()), 1e-2) for m in ms]
                ax.scatter(range(len(values)), values, s=10, c=colour, marker=marker, label=kind)
        ax_ratio.axhline(NOISE_K, color="k", ls="--", label=f"NOISE_K = {NOISE_K}")
        ax_drift.axhline(DRIFT_K, color="k", ls="--", label=f"DRIFT_K = {DRIFT_K}")
        ax_ratio.set(yscale="log", title=f"{c}: deviation ÷ noise (worst curve, worst step)", xlabel="run")
        ax_drift.set(yscale="log", title=f"{c}: drift statistic (worst curve)", xlabel="run")
        ax_ratio.legend(fontsize=7)
    return fig


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_").replace("__", "_")
