#!/usr/bin/env bash
# session-local device driver (untracked)
cd "$(dirname "$0")/.."
scripts/gpu_run.sh env prewarm || exit 1
export PYTHONPATH=$PWD:/tmp/site FLASHRT_CACHE_DIR=/tmp/flashrt-cache
python3 -m pytest -x -q -p no:cacheprovider tests/test_gpu.py -k "wgmma or deterministic or dynamic_smem or (float64 and (D64 or D128))" 2>&1 | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
scripts/gpu_run.sh ab sanitize test
