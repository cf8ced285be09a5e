#!/usr/bin/env bash
# Seed 000's verification with the main training scripts: DDP (writes the shared initial weights) →
# DeepSpeed AutoTP → FSDP2+DTensor → plot_loss_curves.py, ending with its verdict.
#
# With 4 or more GPUs: the seed configuration (Qwen/Qwen2.5-0.5B, 2 layers, batch 2, seq 1024, 100 steps,
# lr 1e-5, DDP dp=2, the others tp=2 × dp=2). Without: the same shape on qwen2-tiny, CPU workers.
# Ray is started once and shared by the three runs (its start-up is a large part of a CPU run) and
# stopped at the end — also on failure or Ctrl-C.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: run_verification_main.sh [--name value ...]

Every setting is an environment variable, or the flag --lower_case_name value (flags win).
  OUTPUT_DIR      all outputs: shared_weights/, loss_curves/, ray_checkpoints/, logs/   [outputs/verification_main]
  MODEL_NAME      model preset or directory          [GPU: Qwen/Qwen2.5-0.5B, CPU: qwen2-tiny]
  NUM_LAYERS      decoder layers                     [2]
  BATCH_SIZE      samples per DP rank                [2]
  SEQ_LENGTH      tokens per sample                  [GPU: 1024, CPU: 256]
  DEBUG_STEPS     training steps                     [100]
  LEARNING_RATE   AdamW lr                           [GPU: 1e-5, CPU: the preset's (1e-3 for qwen2-tiny)]
  LOG_INTERVAL    log / record rewrite interval      [10]
  TP_SIZE         TP size of DeepSpeed and FSDP      [2]
  DP_SIZE         DP size of all three               [2]
  PRECISION       fp32 | bf16 | auto                 [auto: bf16 on GPU, fp32 on CPU]
  DEVICE          auto | cpu | cuda                  [auto: cuda with >= TP_SIZE*DP_SIZE GPUs]
  STRATEGIES      which runs, in order               ["ddp deepspeed fsdp"]
  TOLERANCE       override the verdict's relative tolerance   [from the precision]
  PYTHON          the interpreter                    [python3]
  EXTRA_ARGS      more flags for every train_*.py    []
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --*=*) name="${1%%=*}"; value="${1#*=}"; shift ;;
    --*) [ $# -ge 2 ] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }
         name="$1"; value="$2"; shift 2 ;;
    *) echo "error: unexpected argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  var=$(printf '%s' "${name#--}" | tr '[:lower:]' '[:upper:]')
  case " OUTPUT_DIR MODEL_NAME NUM_LAYERS BATCH_SIZE SEQ_LENGTH DEBUG_STEPS LEARNING_RATE LOG_INTERVAL TP_SIZE DP_SIZE PRECISION DEVICE STRATEGIES TOLERANCE PYTHON EXTRA_ARGS " in
    *" $var "*) printf -v "$var" '%s' "$value" ;;
    *) echo "error: unknown flag $name (see --help)" >&2; exit 2 ;;
  esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
TP_SIZE="${TP_SIZE:-2}"
DP_SIZE="${DP_SIZE:-2}"
DEVICE="${DEVICE:-auto}"
WORLD=$((TP_SIZE * DP_SIZE))
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$DEVICE" = cuda ] || { [ "$DEVICE" = auto ] && [ "$GPUS" -ge "$WORLD" ]; }; then
  MODEL_NAME="${MODEL_NAME:-Qwen/Qwen2.5-0.5B}"; SEQ_LENGTH="${SEQ_LENGTH:-1024}"
  LEARNING_RATE="${LEARNING_RATE:-1e-5}"; WHERE="$GPUS GPUs"
else
  MODEL_NAME="${MODEL_NAME:-qwen2-tiny}"; SEQ_LENGTH="${SEQ_LENGTH:-256}"
  LEARNING_RATE="${LEARNING_RATE:-}"; WHERE="CPU workers"
fi
OUTPUT_DIR="$(mkdir -p "${OUTPUT_DIR:-outputs/verification_main}" && cd "${OUTPUT_DIR:-outputs/verification_main}" && pwd)"
NUM_LAYERS="${NUM_LAYERS:-2}"; BATCH_SIZE="${BATCH_SIZE:-2}"; DEBUG_STEPS="${DEBUG_STEPS:-100}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"; PRECISION="${PRECISION:-auto}"
STRATEGIES="${STRATEGIES:-ddp deepspeed fsdp}"; TOLERANCE="${TOLERANCE:-}"; EXTRA_ARGS="${EXTRA_ARGS:-}"
LOSS_DIR="$OUTPUT_DIR/loss_curves"; WEIGHTS="$OUTPUT_DIR/shared_weights/init_weights.pt"; LOGS="$OUTPUT_DIR/logs"
mkdir -p "$LOSS_DIR" "$LOGS" "$OUTPUT_DIR/shared_weights"
rm -f "$LOSS_DIR"/loss_*.json  # a verdict only on this invocation's runs

# One Ray cluster for the three runs, held by one process of ours: stopping it stops only that cluster.
ray_head_pid=""
stop_ray() { [ -n "$ray_head_pid" ] && kill "$ray_head_pid" 2>/dev/null && wait "$ray_head_pid" 2>/dev/null || true; }
trap 'status=$?; stop_ray; exit $status' EXIT
trap 'echo "interrupted: stopping Ray" >&2; exit 130' INT TERM
started=$SECONDS
export RAY_AUTH_MODE=token  # the jobs authenticate with the token the cluster saves in ~/.ray/auth_token
rm -f "$LOGS/ray_address"
(cd "$REPO" && exec "$PYTHON" -m parity.ray_head --address_file "$LOGS/ray_address") >"$LOGS/ray_head.log" 2>&1 &
ray_head_pid=$!
until [ -s "$LOGS/ray_address" ]; do
  kill -0 "$ray_head_pid" 2>/dev/null || { echo "error: Ray did not start (see $LOGS/ray_head.log)" >&2; exit 1; }
  sleep 0.5
done
export RAY_ADDRESS="$(cat "$LOGS/ray_address")"
echo "Ray up in $((SECONDS - started)) s at $RAY_ADDRESS; model $MODEL_NAME on $WHERE; outputs in $OUTPUT_DIR"

common=(--model_name "$MODEL_NAME" --num_layers "$NUM_LAYERS" --batch_size "$BATCH_SIZE" --seq_length "$SEQ_LENGTH"
        --debug_steps "$DEBUG_STEPS" --log_interval "$LOG_INTERVAL" --precision "$PRECISION" --device "$DEVICE"
        --loss_output_dir "$LOSS_DIR" --storage_path "$OUTPUT_DIR/ray_checkpoints" --init_weights_path "$WEIGHTS")
[ -n "$LEARNING_RATE" ] && common+=(--learning_rate "$LEARNING_RATE")
read -r -a extra <<<"$EXTRA_ARGS"

for strategy in $STRATEGIES; do
  case "$strategy" in
    ddp) args=(--num_workers "$DP_SIZE" --dp_size "$DP_SIZE" --save_init_weights) ;;
    deepspeed|fsdp) args=(--num_workers "$WORLD" --tp_size "$TP_SIZE" --dp_size "$DP_SIZE") ;;
    *) echo "error: unknown strategy '$strategy' in STRATEGIES (use ddp, deepspeed, fsdp)" >&2; exit 2 ;;
  esac
  echo "== $strategy: train_$strategy.py ${args[*]} (log: $LOGS/$strategy.log)"
  t0=$(date +%s)
  if ! "$PYTHON" "$REPO/train_$strategy.py" "${common[@]}" "${args[@]}" "${extra[@]}" >"$LOGS/$strategy.log" 2>&1; then
    echo "error: the $strategy run failed; its last lines ($LOGS/$strategy.log):" >&2
    grep -v '^\s*$' "$LOGS/$strategy.log" | tail -n 5 >&2
    exit 1
  fi
  echo "   done in $(( $(date +%s) - t0 )) s: $LOSS_DIR/loss_$strategy.json"
done

echo "== comparing"
plot=(--input_dir "$LOSS_DIR" --output "$LOSS_DIR/loss_curves.png")
[ -n "$TOLERANCE" ] && plot+=(--tolerance "$TOLERANCE")
set +e
"$PYTHON" "$REPO/plot_loss_curves.py" "${plot[@]}"
verdict=$?
set -e
case $verdict in
  0) echo "VERDICT: PASS — every strategy trains the same model as DDP within tolerance ($LOSS_DIR/report.md)" ;;
  1) echo "VERDICT: FAIL — see the first failing step above and $LOSS_DIR/report.md" >&2 ;;
  *) echo "VERDICT: no verdict — the runs could not be compared (see above)" >&2 ;;
esac
exit $verdict
