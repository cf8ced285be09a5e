#!/bin/bash
# Issue 84 in one device call (docs/gpu.md): the bundle installed (python tools/build_gpu_bundle.py here), then
# 1. the recorder's share of a step on the GPU before and after its change, alone on the GPU: the tree before it
#    unpacked into .gpu_before here (git archive <commit> parity examples | tar -x -C .gpu_before; next: f7ade14, the
#    code before the squares' reads took three ops; 7cf75bf was measured on 2026-11-30), both carried, with
#    torch.profiler's breakdown of each (tools/recorder_gpu_cost.py), at qwen2-tiny and at 24 layers of Qwen2.5-0.5B's
#    config, where the recorder's walks of the module (once a step since 0a5c77b) cost most;
# 2. side by side: the false-alarm campaign's CUDA slice (tools/false_alarms.py --plan cuda: megatron-core's bf16
#    Qwen2 job at 12 and 100 steps and fp32, its Llama bf16 job with the distributed optimizer, Trainer, GRPO, DPO,
#    the own loop, LoRA, SFT and LoRA over a bf16 base in bf16, the seeds SEEDS names — seed 1 ran on 2026-11-28, 2-3 on 2026-11-30 (30 of
#    52 cells; seed 3's TF32 and deterministic cells not reached: SEEDS is 3 by default) — under the
#    default cuBLAS, TF32 and the deterministic cuBLAS, breadth first: what the time allows) and megatron-core's MoE
#    jobs and TransformerEngine's layouts where the image has TE
#    (tools/megatron_gpu.sh PART=moe; MEGATRON=none leaves them out, the campaign alone on the GPU).
# One call, carry [".whl", ".gpu_before"], timeout_s 480: `timeout 460 bash tools/gpu_session.sh`. What comes back in
# $OUT: recorder.log, recorder_gpu.json, campaign.log, false_alarms.md, runs.log (megatron-core), records.tar.gz.
OUT=${OUT:-/tmp/gpu_session_out}
CAMPAIGN_S=${CAMPAIGN_S:-220}
SEEDS=${SEEDS:-3}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
'transformers', transformers.__version__)" >"$OUT/recorder.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$OUT/recorder.log" 2>&1
s=$(date +%s)
timeout 200 python3 tools/recorder_gpu_cost.py --output_dir /tmp/rgc --code before=.gpu_before --code after=. \
    --examples plain_loop.py --steps 20 --profile \
    --size "deep=--model_name Qwen/Qwen2.5-0.5B --model_layers 24 --seq_length 1024 --batch_size 2 --bf16" \
    >>"$OUT/recorder.log" 2>&1
echo "== recorder exit $? in $(($(date +%s) - s)) s" >>"$OUT/recorder.log"
cp /tmp/rgc/recorder_gpu.json "$OUT/" 2>/dev/null
s=$(date +%s)
(timeout "$CAMPAIGN_S" python3 tools/false_alarms.py --output_dir /tmp/fa --device cuda --plan cuda --seeds "$SEEDS" \
    --jobs 10 --cell_timeout 240 >"$OUT/campaign.log" 2>&1; echo "== campaign exit $? in $(($(date +%s) - s)) s" \
    >>"$OUT/campaign.log") &
[ "${MEGATRON:-moe}" = none ] || (PART=moe OUT="$OUT" timeout "$CAMPAIGN_S" bash tools/megatron_gpu.sh >/dev/null 2>&1) &
wait
pkill -f 'verify_trainer[.]py' 2>/dev/null
python3 tools/false_alarms.py --output_dir /tmp/fa --device cuda --plan cuda --seeds "$SEEDS" --page_only \
    >>"$OUT/campaign.log" 2>&1
cp /tmp/fa/false_alarms.md "$OUT/" 2>/dev/null
tar czf "$OUT/records.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude=runs \
    --exclude=own --exclude=final_model --exclude=batches --exclude=states -C /tmp fa rgc mg 2>/dev/null
ls -la "$OUT"; tail -5 "$OUT/recorder.log"; tail -30 "$OUT/campaign.log"; cat "$OUT/runs.log" 2>/dev/null
