#!/usr/bin/env bash
# Device-object GPU tests with diagnostics, then `kvstrata bench device --quick`; logs and JSON to $OUT.
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/kvstrata-out}"; mkdir -p "$OUT"
KVSTRATA_LOG=info KVSTRATA_TEST_WAIT=20 timeout 130 python3 -m pytest tests/test_devobj_gpu.py -rA \
  -p no:cacheprovider > "$OUT/devobj_tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Fatal|crashed" "$OUT/devobj_tests.log" | tail -25
timeout 110 python3 -m kvstrata.cli.main bench device --quick --wait 30 --out "$OUT" > "$OUT/bench_device.log" 2>&1
tail -30 "$OUT/bench_device.log"; rm -f "$OUT"/*.png; ls "$OUT"
