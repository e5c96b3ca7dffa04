#!/usr/bin/env bash
# The session's last device call: device-object tests with diagnostics, every other GPU test, then the
# device / store (device rows) / all-gather benchmarks. Logs and JSON land in $OUT (no PNGs: 8 files max).
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/kvstrata-out}"; mkdir -p "$OUT"
KVSTRATA_LOG=debug KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest tests/test_devobj_gpu.py -x -rA \
  -p no:cacheprovider > "$OUT/devobj_tests.log" 2>&1; tail -40 "$OUT/devobj_tests.log"
timeout 170 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
  --ignore=tests/test_devobj_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -12 "$OUT/gpu_tests.log"
timeout 100 python3 -m kvstrata.cli.main bench device --quick --wait 30 --out "$OUT" > "$OUT/bench_device.log" 2>&1
tail -25 "$OUT/bench_device.log"; rm -f "$OUT"/*.png
timeout 60 python3 -m kvstrata.cli.main bench store --no-redis --sizes 1MiB --clients 1 --out "$OUT" \
  > "$OUT/bench_store.log" 2>&1; tail -12 "$OUT/bench_store.log"; rm -f "$OUT"/*.png
timeout 80 python3 -m kvstrata.cli.main bench allgather --quick --out "$OUT" > "$OUT/bench_allgather.log" 2>&1
tail -8 "$OUT/bench_allgather.log"; rm -f "$OUT"/*.png; ls "$OUT"
