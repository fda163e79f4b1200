#!/usr/bin/env bash
# The GPU run, on a machine with a GPU and no network (the device machine):
#   scripts/gpu_run.sh [stage ...]     stages: env prewarm test check sanitize bench masks ab scale (default: all)
#   bench: BENCH_SET (quick); masks: the mask kinds against FlexAttention (masks-quick); ab: the dense
#   forward/backward with the wgmma kernels and with FLASHRT_NO_SM90=1, twice, interleaved.
# Wheels carried in .whl/ (platformdirs) are installed to /tmp/site first. Logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashrt-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export FLASHRT_CACHE_DIR=${FLASHRT_CACHE_DIR:-/tmp/flashrt-cache}
stages=${*:-env prewarm test check sanitize bench masks ab scale}
status=0
for stage in $stages; do
    echo "=== $stage"
    t0=$(date +%s)
    case $stage in
        env) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
             python3 -c "import torch, cupy; from flashrt import nvrtc; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc.version(), nvrtc.library_path())" ;;
        prewarm) python3 -m flashrt.cli prewarm --jobs "$(nproc)" 2>/dev/null || status=1
                 python3 -m flashrt.cli prewarm --jobs "$(nproc)" 2>/dev/null | tail -1 ;;
        test) python3 -m pytest -q -ra -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -25
              [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
        check) python3 -m flashrt.cli check 2>&1 | tee "$OUT/check.log" || status=1 ;;
        sanitize) scripts/sanitize.sh 2>&1 | tee "$OUT/sanitize.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
        bench) python3 scripts/bench.py --set "${BENCH_SET:-quick}" --out "$OUT" > "$OUT/bench.log" 2>&1 || status=1
               tail -n 60 "$OUT/bench.md" ;;
        masks) python3 scripts/bench.py --set masks-quick --out "$OUT/masks" > "$OUT/masks.log" 2>&1 || status=1
               grep -A30 "Mask time ratios" "$OUT/masks/bench.md" ;;
        ab) for i in 1 2; do FLASHRT_NO_SM90=1 python3 scripts/dense_ab.py mma && python3 scripts/dense_ab.py wgmma; done \
                2>&1 | tee "$OUT/ab.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
        scale) python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_scale.py -k "128k or 2_31" 2>&1 \
                   | tee "$OUT/scale.log" | grep -E "tokens|passed|failed"
               [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
        *) echo "unknown stage $stage"; status=1 ;;
    esac
    echo "--- $stage: $(( $(date +%s) - t0 ))s"
done
exit $status
