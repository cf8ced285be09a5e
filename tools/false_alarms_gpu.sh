#!/bin/bash
# The false-alarm campaign's CUDA slice (issue 81, item 3; docs/false_alarms.md#on-a-gpu): on a lent GPU machine, the
# megatron-core bf16 Qwen2 job (the clean run once called FAIL there) at 12 and 100 steps, and Trainer's, TRL SFT's,
# GRPO's and DPO's bf16 rows, each under the default cuBLAS setting and its deterministic one
# (parity/calibration/kernel_settings.py CUDA_SETTINGS), every cell verified and replayed on the GPU — 12 cells,
# 4 at once, within 9 minutes on an H100 (the cells' own timeout 240 s).
# The bundle first (python tools/build_gpu_bundle.py here; the device call carries [".whl"]), as tools/megatron_gpu.sh.
# Run from the repository's root: `timeout 540 bash tools/false_alarms_gpu.sh`; the page goes to $OUT/false_alarms.md,
# the cells' records (no weights) to $OUT/records.tar.gz. DRY_RUN=1: the cells' commands only (on any machine).
OUT=${OUT:-/tmp/false_alarms_gpu_out}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then
    exec python3 tools/false_alarms.py --output_dir "$OUT/cells" --device cuda --plan cuda --seeds 1 --dry_run
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" >"$OUT/device.txt" 2>&1
timeout 500 python3 tools/false_alarms.py --output_dir "$OUT/cells" --device cuda --plan cuda --seeds 1 --jobs 4 \
    --cell_timeout 240 >"$OUT/campaign.log" 2>&1
echo "== exit $?" >>"$OUT/campaign.log"
cp "$OUT/cells/false_alarms.md" "$OUT/" 2>/dev/null
tar czf "$OUT/records.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude=runs \
    --exclude=own --exclude=final_model -C "$OUT" cells
tail -40 "$OUT/campaign.log"
