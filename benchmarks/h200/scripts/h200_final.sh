#!/usr/bin/env bash
# One lease on the H200: cold start, pretune over the manifest (writes tkjit/tuning_db_data/), GPU tests,
# then the benchmark table with the tuned configs. Every step has its own time limit so one slow
# step cannot lose the others' results. Results go to $OUT (at most 8 files come back).
#   bash benchmarks/h200/scripts/h200_final.sh   (paths below are from the repository root)
cd "$(dirname "$0")/../../.." || exit 1
source .gpu/env.sh
export TKJIT_CACHE_DIR=/tmp/tkc TKJIT_JOBS=16
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 45 python tools/coldstart.py --runs 3 --breakdown > "$OUT/coldstart.txt" 2>&1
python -X importtime -c "import torch; import tvm_ffi" 2>&1 | sort -t'|' -k2 -n | tail -12 >> "$OUT/coldstart.txt"
timeout 220 python tools/pretune.py --arch sm_90a --update-shipped --time-budget 16 --quiet --json "$OUT/pretune.json" \
  > "$OUT/pretune.txt" 2>&1; echo "pretune rc=$?" >> "$OUT/pretune.txt"
cp tkjit/tuning_db_data/sm_90a/*.json "$OUT/" 2>/dev/null
TKJIT_CACHE_DIR=/tmp/tkc-fresh timeout 30 python -c "
import tkjit
for shape in ({'num_tokens': 1048576}, {'num_tokens': 4096}):
    k = tkjit.get('sinkhorn_fwd', shape); print('fresh process, empty cache:', shape, k.config_source, k.config)
" >> "$OUT/pretune.txt" 2>&1
timeout 120 python tools/bench.py --reps 30 --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
timeout 110 python -m pytest -q -p no:cacheprovider -rf --durations=5 \
  tests/gpu/test_gpu_tuning.py tests/gpu/test_gpu_sinkhorn_bwd.py tests/gpu/test_gpu_transpose.py \
  tests/gpu/test_gpu_per_token_cast.py tests/gpu/test_gpu_topk_gate.py tests/gpu/test_gpu_sinkhorn.py \
  -k "not every and not speed and not report_time and not 28_configs" > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.txt"
tail -5 "$OUT/pytest.txt"; tail -25 "$OUT/pretune.txt"; grep -v Warn "$OUT/bench.txt" | tail -40
