#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks named in $BENCH (default: all quick), results to $OUT.
# Usage on the device machine:  bash tools/gpu_run.sh [pytest-args...]
#   BENCH="transfer gather"  BENCH_ARGS="--quick"  TESTS=0 (skip tests)
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/kvstrata-out}"
mkdir -p "$OUT"
export KVSTRATA_BENCH_OUT="$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 300 "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
for job in ${BENCH:-}; do
  echo "=== kvstrata bench $job ${BENCH_ARGS:---quick}"
  # shellcheck disable=SC2086
  python3 -m kvstrata.cli.main bench "$job" ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench_$job.log" | tail -60
done
