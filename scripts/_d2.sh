set -u
scripts/gpu_run.sh env prewarm test sanitize
export PYTHONPATH=$PWD:/tmp/site FLASHRT_CACHE_DIR=/tmp/flashrt-cache PYTHONUNBUFFERED=1
python3 scripts/host_overhead.py > $OUT/host.log 2>&1; tail -5 $OUT/host.log
python3 scripts/host_overhead.py 2>&1 | tail -4
python3 scripts/bench.py --set seed --out $OUT/seed > $OUT/seed.log 2>&1; grep "| seed" $OUT/seed/bench.md | cut -c1-130
