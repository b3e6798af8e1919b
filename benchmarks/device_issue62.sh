#!/usr/bin/env bash
# Issue 62's GPU measurement in one run on the device machine (torch with CUDA and
# transformers; no TransformerLens needed): the maxima route's agreement with the row path
# and the eager weights (bench_call's check, printed first), then bare / all / maxima at
# 8k and 32k tokens, LLaMA-3.2-1B shape, bf16, random weights of scale 0.1 (peaked rows).
# Writes results.json (and the log) under $OUT; copy its bench_call_llama-1b_cuda_* entry
# into benchmarks/results.json here.
# bench_call records results.json after every length: a run stopped by the timeout (at
# 32k, say) still brings back the agreement (in the log) and the 8k rows.
set -uo pipefail
OUT=${OUT:-/tmp/issue62}
mkdir -p "$OUT"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
timeout 540 python benchmarks/bench_call.py --device cuda --dtype bfloat16 --config llama-1b \
    --init 0.1 --check-length 2049 --lengths 8192,32768 --modes bare,all,maxima --launches \
    2>&1 | tee "$OUT/bench_call.log"
rc=${PIPESTATUS[0]}
cp benchmarks/results.json "$OUT/results.json"
echo "bench_call exit status: $rc"
exit "$rc"
