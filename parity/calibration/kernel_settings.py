"""The CPU kernel settings a clean run must PASS under (issue 66's clean matrix: tools/kernel_matrix.py, and one
perturbed setting per capability in the tests): each sets, in a whole command's environment, what moves the kernels a
CPU kind or a GPU would — MKL's fp32 matrix products (MKL_ENABLE_INSTRUCTIONS on Intel; MKL_CBWR's compatible path on
any x86 CPU, AMD's included, where MKL takes one path whatever the ISA), oneDNN's bf16 ones (ONEDNN_MAX_CPU_ISA) and
the thread count (reduction orders). Measured on AMD EPYC: MKL_ENABLE_INSTRUCTIONS=AVX2 gives the default's bits,
MKL_CBWR=COMPATIBLE other fp32 bits; ONEDNN_MAX_CPU_ISA=AVX2 other bf16 bits (docs/tolerances.md#the-clean-matrix).
On CUDA (CUDA_SETTINGS) what a whole command's environment can move on a GPU: cuBLAS's deterministic workspace (other
algorithms) and TF32 forced on for fp32 matrix products (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE: the setting many users train
with)."""

from __future__ import annotations

SETTINGS = {
    "default": {},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "compatible_1thread": {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "OMP_NUM_THREADS": "1"},
}
CUDA_SETTINGS = {
    "default": {},
    "cublas_deterministic": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "tf32": {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"},
}
BY_DEVICE = {"cpu": SETTINGS, "cuda": CUDA_SETTINGS}


def environment(setting: str, base: dict[str, str], device: str = "cpu") -> dict[str, str]:
    """`base` (an environment) with `setting`'s variables (of `device`'s settings) set and every other setting's of that
    device removed."""
    names = {k for s in BY_DEVICE[device].values() for k in s}
    return {**{k: v for k, v in base.items() if k not in names}, **BY_DEVICE[device][setting]}
