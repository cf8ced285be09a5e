"""What produced a number: the fingerprint every loss record, checkpoint, layer dump and report carries.

The code is split by place, not by a list:
- strategy_code: sha256 over a strategy's code — the module of its class and of every class it inherits down to
  the shared Strategy interface (ddp_strategy.py; fsdp_strategy.py and the DTensor base,
  parity/training/dtensor_strategy.py; a seeded bug's parity/calibration/bugs.py and the strategy it copies; a
  user's own module), and the helper package of each `<stem>_strategy.py` among them, parity/strategies/<stem>/
  (FSDP's plans and expert parallelism). It differs between strategies by design; a resumed run must have the same.
- shared_code: sha256 over every other .py file of the parity package — the loop, the loss, the data, the
  comparison: not the calibration catalogue, the strategies' helper packages (parity/strategies/) or a module that
  defines a strategy's base class (the DTensor base: editing it is FSDP's and transformers' change, not DDP's).
  Two runs whose shared code differs were not trained "the same way but for the strategy", so they are not
  compared (unless the user asks), and a checkpoint is not resumed by other code.
- versions: python, torch, deepspeed, transformers, ray, numpy, peft (where installed), and the CUDA torch was built
  with (torch.version.cuda, on a CUDA build) — a comparison needs the same libraries.
- device: the accelerator, or the CPU and the bf16 kernel path its matrix products take (oneDNN picks its
  kernels by instruction set: ONEDNN_MAX_CPU_ISA, AMX, AVX512-BF16), which decides the bf16 roundings.
- model_type: the model family trained (qwen2, llama, gemma3_text ...), named where a fingerprint is shown.
- objective: a post-training objective's name and the settings it changes (parity.objectives.describe), where the run
  trains one; absent for the causal-LM token mean (its fingerprints are as they were). The comparison refuses runs of
  other objectives from their configs (parity/comparing/objective.py), not as other code.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import platform

import parity

PACKAGES = ("torch", "deepspeed", "transformers", "ray", "numpy", "peft")  # peft: where installed (LoRA runs)


# parity subpackages that are no run's shared code: the calibration catalogue (seeded bugs: strategy code of the runs
# that train them) and the strategies' helper packages (each its strategy's code)
NOT_SHARED = ("calibration", "strategies")
STRATEGY_BASE = "Strategy"  # the interface every strategy inherits (parity/training/strategy.py): shared code
HELPERS = "strategies"  # parity/strategies/<stem>/: the helper package of a strategy module <stem>_strategy.py


@functools.lru_cache(maxsize=None)
def shared_files() -> tuple[str, ...]:
    """The shared code's files, relative to the parity package, in path order: every .py file but those of
    NOT_SHARED's subpackages and the modules of strategies' bases (strategy_base_files)."""
    root = _package_root()
    candidates = [rel for d, _, files in os.walk(root) for f in files if f.endswith(".py")
                  for rel in [os.path.relpath(os.path.join(d, f), root)] if rel.split(os.sep)[0] not in NOT_SHARED]
    bases = strategy_base_files(tuple(candidates))
    return tuple(sorted(rel for rel in candidates if rel not in bases))


@functools.lru_cache(maxsize=None)
def shared_code_sha256() -> str:
    """sha256 over (relative path, content) of the shared code's files."""
    return _files_sha256(_package_root(), shared_files())


def strategy_base_files(rels: tuple[str, ...]) -> set[str]:
    """Those of `rels` (relative to the parity package) that define a subclass of the Strategy interface — a base
    a strategy inherits, such as the DTensor base — read from their source (importing them would pull their
    libraries): a class counts when it inherits Strategy, or a class that does, by name. A file is parsed only once
    its text names such a class (a few of the package's 300: parsing them all took 0.5 s in each worker)."""
    root = _package_root()
    texts = {}
    for rel in rels:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            texts[rel] = f.read()
    classes: dict[str, list] = {}
    strategies, grown = {STRATEGY_BASE}, True
    while grown:
        grown = False
        for rel, text in texts.items():
            if rel not in classes and any(name in text for name in strategies):
                tree = ast.parse(text, filename=rel)
                classes[rel] = [(node.name, {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                             if isinstance(b, (ast.Name, ast.Attribute))})
                                for node in tree.body if isinstance(node, ast.ClassDef)]
        for defined in classes.values():
            for name, bases in defined:
                if name not in strategies and bases & strategies:
                    strategies.add(name)
                    grown = True
    return {rel for rel, defined in classes.items() if any(bases & strategies for _, bases in defined)}


def helper_files(module_path: str) -> list[str]:
    """The .py files of the helper package of the strategy module at `module_path` when it is `<stem>_strategy.py`:
    parity/strategies/<stem>/ (fsdp_strategy.py's is parity/strategies/fsdp/); none when there is no such package."""
    stem = os.path.splitext(os.path.basename(module_path))[0]
    if not stem.endswith("_strategy") or stem == "_strategy":
        return []
    folder = os.path.join(_package_root(), HELPERS, stem[:-len("_strategy")])
    return sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(".py"))


def strategy_code(cls) -> dict:
    """{"sha256", "files"} over a strategy's code: the source file of `cls` and of every class in its MRO that is
    not shared code (the Strategy interface is), and the helper package of each (helper_files). Files of the
    harness are named by their path from the folder that holds the parity package ("fsdp_strategy.py",
    "parity/training/dtensor_strategy.py"), others (a user's module) by their name alone: never where a checkout
    lies."""
    shared = {os.path.join(_package_root(), rel) for rel in shared_files()}
    files = set()
    for klass in cls.__mro__:
        try:
            source = inspect.getsourcefile(klass)
        except TypeError:  # a builtin (object)
            continue
        path = os.path.abspath(source) if source else None
        if path and path not in shared:
            files.add(path)
            files.update(helper_files(path))
    named = sorted((_file_name(path), path) for path in files)
    return {"sha256": _files_sha256("", [path for _, path in named], named=_file_name),
            "files": [name for name, _ in named]}


def installed_versions(packages) -> dict[str, str]:
    """{package: its installed version} of those of `packages` that are installed (a framework's record names its own)."""
    import importlib.metadata as md

    versions = {}
    for package in packages:
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return versions


def library_versions() -> dict[str, str]:
    import torch

    versions = {"python": platform.python_version(), **installed_versions(PACKAGES)}
    if torch.version.cuda:  # a CUDA build of torch: the CUDA it runs on (a CPU build has none, and says nothing)
        versions["cuda"] = torch.version.cuda
    return versions


def device_description(device) -> str:
    """The accelerator's name; on CPU its model and the bf16 kernel path (what changes bf16 roundings)."""
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{cpu_model()}; bf16 matmuls: {cpu_bf16_kernels()}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_onednn_bf16() -> bool:
    """Whether torch sends bf16 matrix products to oneDNN on this CPU (with oneDNN on): only on one with AVX512,
    by torch's own check. Elsewhere torch computes them itself and ONEDNN_MAX_CPU_ISA changes none of them."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_bf16_kernels() -> str:
    """Which kernels bf16 matrix products take here: oneDNN's for the CPU's bf16 instructions, capped by
    ONEDNN_MAX_CPU_ISA, or torch's own when oneDNN is off or has no bf16 kernels for this CPU."""
    import torch

    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return "torch (oneDNN off)"
    if not cpu_has_onednn_bf16():
        return "torch (no oneDNN bf16 on this CPU)"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    native = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "generic"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"oneDNN, CPU {native}" + (f", ONEDNN_MAX_CPU_ISA={cap}" if cap else "")


def fingerprint(strategy_cls, device, model_type: str, objective: str | None = None) -> dict:
    """The fingerprint of a run of `strategy_cls` training a `model_type` model on `device` (a torch.device), computed
    where it runs; `objective`: its post-training objective in words (parity.objectives.describe), or None."""
    found = {"shared_code_sha256": shared_code_sha256(), "strategy_code": strategy_code(strategy_cls),
             "versions": library_versions(), "device": device_description(device), "model_type": model_type}
    return found if objective is None else {**found, "objective": objective}


def differences(a: dict, b: dict, *, strategy: bool) -> list[str]:
    """What differs between two fingerprints that makes their numbers incomparable (or a checkpoint not
    resumable): the shared code, the library versions, and with `strategy` the strategy's code. Each entry
    names both values."""
    found = []
    if a.get("shared_code_sha256") != b.get("shared_code_sha256"):
        found.append(f"shared code {_short(a.get('shared_code_sha256'))} vs {_short(b.get('shared_code_sha256'))}")
    if strategy and a.get("strategy_code", {}).get("sha256") != b.get("strategy_code", {}).get("sha256"):
        sa, sb = a.get("strategy_code", {}), b.get("strategy_code", {})
        found.append(f"strategy code {_short(sa.get('sha256'))} ({', '.join(sa.get('files', []))}) vs "
                     f"{_short(sb.get('sha256'))} ({', '.join(sb.get('files', []))})")
    va, vb = a.get("versions", {}), b.get("versions", {})
    for package in sorted(va.keys() | vb.keys()):
        if va.get(package) != vb.get(package):
            found.append(f"{package} {va.get(package, 'absent')} vs {vb.get(package, 'absent')}")
    return found


def short(fp: dict) -> str:
    """One line for reports: the model type, shared code, the run's own code (own_code), versions, device."""
    versions = ", ".join(f"{k} {v}" for k, v in fp.get("versions", {}).items())
    model = f"{fp['model_type']}; " if fp.get("model_type") else ""
    return f"{model}shared code {_short(fp.get('shared_code_sha256'))}, {own_code(fp)}; {versions}; {fp.get('device')}"


def own_code(fp: dict) -> str:
    """The code a run adds to the shared code, in words: its strategy's, or for a recorded run (its fingerprint's
    `framework`: parity/recording/recorder.py) the framework, its versions and the user's script with its sha256."""
    framework = fp.get("framework")
    if not framework:
        code = fp.get("strategy_code", {})
        return f"strategy code {_short(code.get('sha256'))} ({', '.join(code.get('files', []))})"
    versions = ", ".join(f"{k} {v}" for k, v in (framework.get("versions") or {}).items())
    return (f"framework {framework.get('name')}{f' ({versions})' if versions else ''}, script "
            f"{framework.get('script') or 'unknown'} {_short(framework.get('script_sha256'))}")


def reported(fp: dict) -> dict:
    """The fingerprint as the reports show it field by field: a recorded run's strategy_code left out beside its
    framework (a recorded run has no strategy: that code is the sha256 of no file)."""
    return {k: v for k, v in fp.items() if not (k == "strategy_code" and fp.get("framework"))}


def _package_root() -> str:
    return os.path.dirname(os.path.abspath(parity.__file__))


def _file_name(path: str) -> str:
    """How strategy_code names a file: from the folder holding the parity package when it is inside the package
    ("parity/strategies/fsdp/plans.py"), else by its name ("fsdp_strategy.py", a user's "my_strategy.py")."""
    home = os.path.dirname(_package_root())
    if path.startswith(_package_root() + os.sep):
        return os.path.relpath(path, home).replace(os.sep, "/")
    return os.path.basename(path)


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "none"


def _files_sha256(root: str, paths, named=lambda path: path) -> str:
    """sha256 over each file's name (as `named` gives it: never where the checkout lies) and content."""
    digest = hashlib.sha256()
    for rel in paths:
        digest.update(named(rel).encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()
