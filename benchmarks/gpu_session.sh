#!/usr/bin/env bash
# One device call that verifies and measures the primitives on the GPU:
#   bash benchmarks/gpu_session.sh [pytest paths...]
# gpu-marked tests (parallel: they are bound by Triton compilation), then
# `alignzoo check --device cuda`, then the primitive benchmarks.  Each step has
# its own time limit (env TEST_S, CHECK_S, BENCH_S) so one slow step cannot eat
# the call; logs go to $OUT (or ./gpu_out).
. "$(dirname "$0")/gpu_env.sh"
out=${OUT:-gpu_out}; mkdir -p "$out"
timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark "${@:-tests}" \
  > "$out/gpu_tests.txt" 2>&1; echo "pytest exit $?" >> "$out/gpu_tests.txt"
tail -15 "$out/gpu_tests.txt"
timeout "${CHECK_S:-90}" python3 -m alignzoo.cli check --device cuda > "$out/check_cuda.txt" 2>&1
echo "check exit $?" >> "$out/check_cuda.txt"; grep -E "FAIL|passed|exit" "$out/check_cuda.txt"
timeout "${BENCH_S:-180}" python3 benchmarks/bench_primitives.py --out "$out" ${BENCH_OPS:+--ops "$BENCH_OPS"} \
  > "$out/bench_log.txt" 2>&1; echo "bench exit $?" >> "$out/bench_log.txt"
tail -60 "$out/bench_log.txt"
