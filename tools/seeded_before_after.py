#!/usr/bin/env python
"""Every seeded bug's catching step and ratio before and after the optimizer's own noise (issue 81;
docs/tensors.md#every-seeded-bug-before-and-after): each folder under ROOT that a comparison was written in
(curve_comparison.json: a test's or a user's) is judged again from its own records twice — with the references'
bounds alone (tolerances.OPTIMIZER_NOISE_K 0) and as the verdict judges today — and every run that
FAILs either way is one row: its first step outside, what, and the deviation ÷ bound there.

    python -m pytest -q tests --basetemp OUT/tmp       # the suite's runs, kept
    python tools/seeded_before_after.py OUT/tmp        # the table (markdown), the folders neither way FAILs left out
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

from parity.comparing import tolerances
from parity.comparing.curves import compare, load_references, load_runs


@contextlib.contextmanager
def optimizer_noise(k: float):
    saved, tolerances.OPTIMIZER_NOISE_K = tolerances.OPTIMIZER_NOISE_K, k  # its readers read it at use
    try:
        yield
    finally:
        tolerances.OPTIMIZER_NOISE_K = saved


def caught(folder: str, baseline: str) -> dict[str, str]:
    """{run: "step S, quantity, ratio R×" or "PASS"} of the folder's comparison, judged now."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        c = compare(load_runs(folder), baseline, references=load_references(folder), allow_incomplete=True)
    out = {}
    for r in c.results:
        f = r.verdict.first_outside
        out[r.run.label] = ("PASS" if r.verdict.passed else
                            f"step {f.step}, {f.quantity}, {f.rel_diff / f.tolerance:.3g}×" if f and f.tolerance else
                            "FAIL (" + (f.quantity if f else "replicas or teacher-forced check") + ")")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    args = p.parse_args(argv)
    rows = []
    for folder, _, files in sorted(os.walk(args.root)):
        if "curve_comparison.json" not in files:
            continue
        baseline = json.load(open(os.path.join(folder, "curve_comparison.json"))).get("baseline", "ddp")
        try:
            with optimizer_noise(0.0):
                before = caught(folder, baseline)
            after = caught(folder, baseline)
        except Exception as exc:  # a folder the suite left half-made, or one its test judges with flags of its own
            print(f"<!-- {os.path.relpath(folder, args.root)}: not judged again ({type(exc).__name__}) -->")
            continue
        rows += [(os.path.relpath(folder, args.root), run, before[run], after[run]) for run in after
                 if "PASS" not in (before[run], after[run]) or before[run] != after[run]]
    print("| folder | run | before (the references' bounds alone) | after (and the optimizer's own noise) |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
