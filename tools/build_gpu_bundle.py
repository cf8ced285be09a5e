#!/usr/bin/env python
"""Build what the GPU check carries to the device machine (docs/gpu.md), within its 64 MiB:

  .whl/<wheels>          cp312 manylinux / py3-none-any wheels of what the device image lacks or has at another
                         version and the check imports: transformers (the pinned one; the image has 5.17.0) and regex
                         (transformers checks its minimum when imported; the image's is not known), and trl
                         (the own_trainer step's SFTTrainer and GRPOTrainer; pure Python), and peft (the lora step's
                         adapters; pure Python), and requirements-torchtitan.txt's pins but triton (the own_trainer
                         step's torchtitan job; the image's triton is its torch's), and datasets with dill and
                         multiprocess (TRL and torchtitan import it; the image has none of them)
  .whl/project.tar.gz    the project: the working tree's files as the device tool sends them (tracked and untracked
                         but not ignored), as they are now: a record of what the check ran
  .whl/bundle.json       what is in it: each file's bytes, each wheel's tags, the commit, and what travels in all
                         (the working tree, which the device tool copies anyway, plus the bundle)

.whl/ is ignored by git (.gitignore), so it travels only as a carried path: `carry: [".whl"]`. DeepSpeed (an sdist,
which builds CUDA ops) and Ray (over 64 MiB) are left out: the check needs neither. Not built by the test suite;
tests/test_gpu_check.py checks a built bundle when there is one. Needs pip and PyPI; run from anywhere:

    python tools/build_gpu_bundle.py            # → .whl/ in the repository's root
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 64 * 2**20  # the device tool's limit on what travels in one call
PYTHON = "3.12"  # the device image's
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
EXTRA = {"regex": None,  # wheels beside the pinned ones: name → version (None: the one installed here)
         "trl": "1.16.0",  # gpu_check's own_trainer step (TRL's SFTTrainer); the image has lightning, not trl
         "peft": "0.21.2",  # gpu_check's lora step (pyproject.toml's lora extra; pure Python)
         "datasets": None, "dill": None, "multiprocess": None,  # TRL's trainers and torchtitan's loader import datasets
         "megatron-core": "0.19.2"}  # pyproject.toml's megatron extra for Python 3.12: megatron-core's loops
# (the image has none of the three); pyarrow, xxhash, fsspec and huggingface_hub are the image's
# requirements-torchtitan.txt's pins the bundle leaves to the image: its own triton is the one its torch was built with
IMAGE_HAS = ("triton",)


def pins(file: str = "requirements.txt") -> dict[str, str]:
    """A requirements file's pins, by name."""
    found = {}
    with open(os.path.join(ROOT, file)) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s#]+)", line.strip())
            if m:
                found[m.group(1).lower()] = m.group(3)
    return found


def wanted() -> dict[str, str]:
    """name → version of every wheel the bundle carries."""
    from importlib.metadata import version

    titan = {n: v for n, v in pins("requirements-torchtitan.txt").items() if n not in IMAGE_HAS}
    return {"transformers": pins()["transformers"], **titan, **{n: v or version(n) for n, v in EXTRA.items()}}


def download(name: str, ver: str, folder: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               PYTHON, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", folder,
               f"{name}=={ver}"]
    subprocess.run(command, check=True)


def wheel_tags(path: str) -> list[str]:
    """The Tag lines of a wheel's WHEEL file (py3-none-any, cp312-cp312-manylinux_2_17_x86_64 …)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
        return [line.split(":", 1)[1].strip() for line in z.read(name).decode().splitlines() if line.startswith("Tag:")]


def tree_files() -> list[str]:
    """What the device tool copies besides carried paths: tracked and untracked-not-ignored files, as they are now."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))})


def travelling_tree_bytes() -> int:
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in tree_files())


def build(folder: str) -> dict:
    os.makedirs(folder, exist_ok=True)
    versions = wanted()
    for stale in os.listdir(folder):  # one version of each: two stop the device's install
        if stale.endswith(".whl") and not any(stale.lower().startswith(f"{n.replace('-', '_')}-{v}-")
                                              for n, v in versions.items()):
            os.remove(os.path.join(folder, stale))
    for name, ver in versions.items():
        download(name, ver, folder)
    project = os.path.join(folder, "project.tar.gz")
    with tarfile.open(project, "w:gz") as tar:
        for rel in tree_files():
            tar.add(os.path.join(ROOT, rel), arcname=os.path.join("parity-harness", rel))
    files = sorted(f for f in os.listdir(folder) if f != "bundle.json")
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in files}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    bundle = sum(sizes.values())
    manifest = {"files": sizes, "wheels": {f: wheel_tags(os.path.join(folder, f)) for f in files if f.endswith(".whl")},
                "versions": versions, "head": head, "bundle_bytes": bundle,
                "working_tree_bytes": travelling_tree_bytes(), "limit_bytes": LIMIT,
                "left_out": {"deepspeed": "an sdist that builds CUDA ops: the check does not use DeepSpeed",
                             "ray": "over 64 MiB: the check launches local process groups"}}
    manifest["travelling_bytes"] = bundle + manifest["working_tree_bytes"]
    with open(os.path.join(folder, "bundle.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default=os.path.join(ROOT, ".whl"), help="the bundle's folder (default: .whl/)")
    args = p.parse_args(argv)
    try:
        m = build(args.output_dir)
    except subprocess.CalledProcessError as exc:
        print(f"error: {' '.join(exc.cmd[:4])} … failed (exit {exc.returncode}): is PyPI reachable?", file=sys.stderr)
        return 2
    for name, size in m["files"].items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"bundle {m['bundle_bytes'] / 2**20:.2f} MiB + working tree {m['working_tree_bytes'] / 2**20:.2f} MiB = "
          f"{m['travelling_bytes'] / 2**20:.2f} MiB of {LIMIT // 2**20} MiB")
    if m["travelling_bytes"] > LIMIT:
        print("error: over the device tool's limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
