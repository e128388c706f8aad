#!/usr/bin/env bash
# The GPU checks, in one short run on a machine with CUDA:
#   1. the CUDA tests of tests/parallel/test_staging.py (pinned side-stream staging, bit-exact
#      bfloat16/float8 round trips from and into device tensors, map_location);
#   2. bench/bench_training.py with CUDA tensors: the model on the GPU (nccl between ranks, one
#      rank per GPU; with one GPU, one rank), ckptfmt_torch.save_async through pinned buffers
#      against the peers, and the to('cpu', non_blocking=True)-into-pinned floor.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT or bench/results). ~5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${1:-${OUT:-bench/results}}
mkdir -p "$OUT_DIR"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY' || { echo "no CUDA device: nothing to check" >&2; exit 2; }
import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 1)
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
status=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/parallel/test_staging.py \
    2>&1 | tee "$OUT_DIR/gpu_tests.txt" || status=1
RANKS=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
timeout 420 "$PY" bench/bench_training.py --device cuda --ranks "$RANKS" --loops gpu \
    --state-mb "${STATE_MB:-300}" --rounds "${ROUNDS:-3}" --every 4 --ckpts 2 \
    --dir "${BENCH_DIR:-/tmp/ckptfmt-bench-training-cuda}" --out "$OUT_DIR/training_cuda.json" \
    --timeout 400 2>&1 | tee "$OUT_DIR/training_cuda.txt" || status=1
exit $status
