"""The CPU kernel settings a clean run must PASS under (issue 66's clean matrix: tools/kernel_matrix.py, and one
perturbed setting per capability in the tests): each sets, in a whole command's environment, what moves the kernels a
CPU kind or a GPU would — MKL's fp32 matrix products (MKL_ENABLE_INSTRUCTIONS on Intel; MKL_CBWR's compatible path on
any x86 CPU, AMD's included, where MKL takes one path whatever the ISA), oneDNN's bf16 ones (ONEDNN_MAX_CPU_ISA) and
the thread count (reduction orders). Measured on AMD EPYC: MKL_ENABLE_INSTRUCTIONS=AVX2 gives the default's bits,
MKL_CBWR=COMPATIBLE other fp32 bits; ONEDNN_MAX_CPU_ISA=AVX2 other bf16 bits (docs/tolerances.md#the-clean-matrix)."""

from __future__ import annotations

SETTINGS = {
    "default": {},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "compatible_1thread": {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "OMP_NUM_THREADS": "1"},
}


def environment(setting: str, base: dict[str, str]) -> dict[str, str]:
    """`base` (an environment) with `setting`'s variables set and every other setting's removed."""
    names = {k for s in SETTINGS.values() for k in s}
    return {**{k: v for k, v in base.items() if k not in names}, **SETTINGS[setting]}
