#!/bin/bash
# megatron-core on a lent GPU machine (docs/megatron.md#on-megatron-core-0192-and-on-a-gpu): the bundle installed
# (python tools/build_gpu_bundle.py here; one device call with carry [".whl"]), then side by side:
# tests/test_megatron.py on the bundle's megatron-core (0.19.2, Python 3.12) over gloo on the machine's CPUs, and the
# megatron-core job on CUDA as users run it (NCCL, one rank, no CPU launcher) under verify_trainer.py, in fp32 and
# bf16, a Mixtral-like MoE (EP 1: one GPU) with its router losses, each replayed on the GPU; where the image has
# TransformerEngine, the same jobs on its layer spec (fused norms, TE attention), the MoE's experts as TE's grouped
# GEMM, and fp8 compute (which the recorder refuses in one line: no fp8 reference), else one line saying so.
# The lines that say what each ended with go to $OUT/runs.log, pytest's output to $OUT/pytest.log, the records (no
# weights) to $OUT/records.tar.gz. Run from the repository's root: `timeout 540 bash tools/megatron_gpu.sh`.
# PART=moe (tools/gpu_session.sh, whose campaign runs the dense jobs): the MoE jobs and TransformerEngine's alone.
[ -d /tmp/site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
OUT=${OUT:-/tmp/megatron_gpu_out}
mkdir -p "$OUT" /tmp/mg
L=$OUT/runs.log
python3 -c "import megatron.core, torch, transformers; print('megatron-core', megatron.core.__version__, 'torch',
torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >>"$L" 2>&1
one() {  # NAME ARGS…: the job under verify_trainer.py, on one GPU
    local name=$1 s; shift; s=$(date +%s)
    PARITY_SHARE_ONE_GPU=1 timeout 330 python3 verify_trainer.py --output_dir /tmp/mg/$name -- torchrun \
        --nproc_per_node 1 --master_port $((29600 + RANDOM % 300)) tests/megatron_train_job.py --device cuda "$@" \
        >/tmp/mg/$name.log 2>&1
    echo "== $name exit $? in $(($(date +%s) - s)) s" >>"$L"
    grep -E "PASS|FAIL|rror|deviation|replicas|teacher|refus" /tmp/mg/$name.log | tail -8 >>"$L"
}
if [ "${PART:-all}" != moe ]; then
    (timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_megatron.py >"$OUT/pytest.log" 2>&1
     echo "== pytest exit $?" >>"$L") &
    one fp32 --steps 4 &
    one bf16_distopt --steps 12 --bf16 --distributed_optimizer &
    one bf16_qwen2 --steps 12 --bf16 --family qwen2 &
fi
one moe_mixtral --steps 4 --family mixtral --z_loss_coeff 1e-3 &
one moe_qwen3_bf16 --steps 12 --family qwen3_moe --bf16 --distributed_optimizer &
if python3 -c "import transformer_engine.pytorch" >>"$L" 2>&1; then
    one te_fp32 --steps 4 --spec te &
    one te_bf16_qwen2 --steps 12 --spec te --bf16 --family qwen2 &
    one te_moe_grouped --steps 4 --spec te --family mixtral --grouped_gemm &
    one te_fp8 --steps 2 --spec te --bf16 --fp8 &
else
    echo "== TransformerEngine is not in the image: its spec, grouped GEMM and fp8 not run" >>"$L"
fi
wait
tar czf "$OUT/records.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude=runs -C /tmp mg
cat "$L"
