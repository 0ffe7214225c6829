#!/usr/bin/env bash
# A device call's GPU work in one command, one mode a call; logs and results go under $OUT (default ./gpu_out).
#   bash benchmarks/gpu_session.sh tests [pytest paths...]   # every gpu-marked test (or those under the paths),
#                                                            # then `alignzoo check --device cuda`
#   bash benchmarks/gpu_session.sh perf                      # run_suite (the suite's results.json and the
#                                                            # docs/PERFORMANCE.md page), then profile_decode at
#                                                            # qwen3-8b, batch 1 and 64
#   bash benchmarks/gpu_session.sh train                     # the MoE / trainer gpu tests, the experts' forward +
#                                                            # backward (bench_moe_train), the qwen35_gdn trainer
#                                                            # against transformers side by side (bench_trainer)
#   STEPS=... bash benchmarks/gpu_session.sh mx              # the MXFP4 experts, the steps named in STEPS
#                                                            # (default tests,bench): tests = the MoE gpu tests;
#                                                            # bench = bench_moe's MXFP4 rows (GLM-5, DeepSeek-V4;
#                                                            # TOKENS, MX_CONFIGS) split by kernel; base = the
#                                                            # same bench in the tree at BASE (a `git archive` of
#                                                            # the commit to compare); ceiling = the bench on a
#                                                            # copy whose decode is one xor a byte pair (wrong
#                                                            # values, same loads and dots); ws =
#                                                            # experiments/probe_mx_ws.py (the decode in warps of
#                                                            # its own; WS_TOKENS); ncu = Nsight Compute on
#                                                            # GLM-5's two kernels at 16384 tokens; repeat =
#                                                            # experiments/probe_mx_repeat.py (each launch config
#                                                            # 20 times, quiet and beside a busy stream)
# Each step has its own time limit in seconds (env TEST_S, CHECK_S, SUITE_S, PROFILE_S, MOE_S, TRAINER_S, WS_S,
# REPEAT_S, NCU_S) so one slow step cannot eat the call; WORKERS sets pytest's workers (8 for tests, 4 otherwise).
# Set ALIGNZOO_COMMIT=<sha> where the device's .git is stale: the results record the commit they ran.
# The whole gpu suite (607 tests) needs more than the default 300 s: 8 workers reached ~602 in 420 s on the H200
# (results/2026-12-05-h200-mxfp4-readings-repeat.md); more workers than ~10 can run out of GPU memory (each
# engine takes 30% of what is free).
. "$(dirname "$0")/gpu_env.sh"
out=${OUT:-gpu_out}; mkdir -p "$out"; out=$(cd "$out" && pwd)  # absolute: the mx mode runs a second tree
mode=${1:-tests}; shift || true
case "$mode" in
tests)
  timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu -n "${WORKERS:-8}" -p no:cacheprovider -p no:benchmark \
    --durations=10 "${@:-tests}" > "$out/gpu_tests.txt" 2>&1; echo "pytest exit $?" >> "$out/gpu_tests.txt"
  tail -15 "$out/gpu_tests.txt"
  timeout "${CHECK_S:-120}" python3 -m alignzoo.cli check --device cuda > "$out/check_cuda.txt" 2>&1
  echo "check exit $?" >> "$out/check_cuda.txt"; grep -E "FAIL|passed|exit" "$out/check_cuda.txt"
  ;;
perf)
  timeout "${SUITE_S:-400}" python3 benchmarks/run_suite.py --out "$out" --budget-s "$(( ${SUITE_S:-400} - 20 ))" \
    > "$out/suite_log.txt" 2>&1; echo "run_suite exit $?" >> "$out/suite_log.txt"; tail -5 "$out/suite_log.txt"
  timeout "${PROFILE_S:-150}" python3 benchmarks/profile_decode.py --config qwen3-8b --batches 1,64 --out "$out" \
    > "$out/profile_log.txt" 2>&1; echo "profile exit $?" >> "$out/profile_log.txt"; head -20 "$out/profile_decode.md"
  ;;
train)
  timeout "${TEST_S:-240}" python3 -m pytest -q -m gpu -n "${WORKERS:-4}" -p no:cacheprovider -p no:benchmark \
    tests/test_moe_experts.py tests/test_experts_lora.py tests/test_fp8.py "tests/test_models.py" -k "moe or expert or fp8 \
    or qwen35" > "$out/gpu_tests.txt" 2>&1; echo "pytest exit $?" >> "$out/gpu_tests.txt"; tail -8 "$out/gpu_tests.txt"
  timeout "${MOE_S:-240}" python3 benchmarks/bench_moe_train.py --out "$out" --tokens 4096 --formats bf16,fp8,mxfp4 \
    > "$out/moe_train_log.txt" 2>&1
  echo "bench_moe_train exit $?" >> "$out/moe_train_log.txt"; tail -8 "$out/moe_train_log.txt"
  timeout "${TRAINER_S:-200}" python3 benchmarks/bench_trainer.py --device cuda --config qwen35_gdn/qwen3.5-35b-a3b-4l \
    --seqs 2 --len 2048 --warm 2 --steps 3 --json "$out/trainer.json" > "$out/trainer_log.txt" 2>&1
  echo "bench_trainer exit $?" >> "$out/trainer_log.txt"; tail -8 "$out/trainer_log.txt"
  ;;
mx)
  steps=",${STEPS:-tests,bench},"
  if [[ $steps == *,tests,* ]]; then
  timeout "${TEST_S:-180}" python3 -m pytest -q -m gpu -n "${WORKERS:-4}" -p no:cacheprovider -p no:benchmark \
    tests/test_moe_experts.py tests/test_experts_lora.py > "$out/gpu_tests.txt" 2>&1
  echo "pytest exit $?" >> "$out/gpu_tests.txt"; tail -8 "$out/gpu_tests.txt"
  fi
  mx_default='[{}]'
  bench=(--formats mxfp4 --shapes glm-5,deepseek-v4-flash --tokens "${TOKENS:-1,64,4096,16384}"
         --mx-configs "${MX_CONFIGS:-$mx_default}")
  if [[ $steps == *,bench,* ]]; then
  timeout "${MOE_S:-200}" python3 benchmarks/bench_moe.py --out "$out/mx" "${bench[@]}" --split \
    > "$out/mx_log.txt" 2>&1; echo "bench_moe exit $?" >> "$out/mx_log.txt"; tail -20 "$out/mx/moe.md"
  fi
  if [[ $steps == *,base,* ]]; then
    (cd "${BASE:?base needs BASE=DIR}" && . benchmarks/gpu_env.sh && timeout "${MOE_S:-200}" python3 benchmarks/bench_moe.py \
      --out "$out/mx_base" "${bench[@]}") > "$out/mx_base_log.txt" 2>&1
    echo "base bench_moe exit $?" >> "$out/mx_base_log.txt"; tail -12 "$out/mx_base/moe.md"
  fi
  if [[ $steps == *,ceiling,* ]]; then
    rm -rf /tmp/ceiling && cp -r . /tmp/ceiling && python3 - /tmp/ceiling/common/moe/kernel.py <<'PY'
import re, sys
p = sys.argv[1]; s = open(p).read()
s, n = re.subn(r'_E2M1X2_BF16 = tl.constexpr\("""\{.*?\}"""\)',
               '_E2M1X2_BF16 = tl.constexpr("""{\n.reg .b32 m;\nxor.b32 m, $2, $3;\nmov.b32 {$0, $1}, m;\n}""")', s,
               flags=re.S)
assert n == 1, "the decode's asm was not found"
open(p, "w").write(s)
PY
    (cd /tmp/ceiling && . benchmarks/gpu_env.sh && timeout "${MOE_S:-200}" python3 benchmarks/bench_moe.py \
      --out "$out/mx_ceiling" "${bench[@]}") > "$out/mx_ceiling_log.txt" 2>&1
    echo "ceiling bench_moe exit $?" >> "$out/mx_ceiling_log.txt"; tail -12 "$out/mx_ceiling/moe.md"
  fi
  if [[ $steps == *,ws,* ]]; then
    timeout "${WS_S:-420}" python3 benchmarks/experiments/probe_mx_ws.py --out "$out" \
      --tokens "${WS_TOKENS:-4096,16384}" > "$out/ws_log.txt" 2>&1
    echo "probe_mx_ws exit $?" >> "$out/ws_log.txt"; tail -6 "$out/ws_log.txt"
  fi
  if [[ $steps == *,repeat,* ]]; then
    timeout "${REPEAT_S:-240}" bash -c "python3 benchmarks/experiments/probe_mx_repeat.py --out $out/repeat && \
      python3 benchmarks/experiments/probe_mx_repeat.py --busy --out $out/repeat_busy" > "$out/repeat_log.txt" 2>&1
    echo "probe_mx_repeat exit $?" >> "$out/repeat_log.txt"; tail -16 "$out/repeat_log.txt"
  fi
  if [[ $steps == *,ncu,* ]]; then  # Firecracker only (device KINDS.md); skips the bf16 reference call's two launches
    timeout "${NCU_S:-240}" ncu --clock-control none --kernel-name regex:'_gate_up_kernel|_down_kernel' \
      --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
      python3 benchmarks/bench_moe.py --out "$out/ncu_bench" --formats mxfp4 --shapes glm-5 --tokens 16384 \
      --mx-configs '[{}]' > "$out/ncu.txt" 2>&1; echo "ncu exit $?" >> "$out/ncu.txt"; tail -4 "$out/ncu.txt"
  fi
  ;;
*)
  echo "usage: gpu_session.sh tests [pytest paths...] | perf | train | mx" >&2; exit 2
  ;;
esac
