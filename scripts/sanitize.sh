#!/usr/bin/env bash
# Run every kernel family under compute-sanitizer (memcheck, racecheck, synccheck, initcheck) at small sizes.
# Kernels are compiled first, outside the sanitizer, so only flashrt's kernels are checked. The four tools run
# at once, one process each on the one GPU (each instruments only its own process); logs in $OUT/sanitize-<tool>.log.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashrt-out}
mkdir -p "$OUT"
python3 scripts/sanitize_workload.py >/dev/null || exit 1
tools=(memcheck racecheck synccheck initcheck)
for tool in "${tools[@]}"; do
    # initcheck must see the writes of torch's kernels that fill the inputs, so it checks every kernel. (A narrower
    # racecheck filter that leaves decode.cu's cluster kernels uninstrumented stops at them with "failed to handle a
    # hardware exception": the tool's; docs/history/perf-notes-log.md, "Racecheck and the cluster decode".)
    # initcheck does not see the global writes of bulk copies (scripts/probes/initcheck_bulk.py), so it runs with the
    # ordered backward zeroing dq_accum first (FLASHRT_NO_DQ_FIRST_STORE=1) instead of storing its first dQ turns.
    filter=(--kernel-name kns=flashrt_) variables=()
    [ "$tool" = initcheck ] && filter=() variables=(FLASHRT_NO_DQ_FIRST_STORE=1)
    env "${variables[@]}" compute-sanitizer --tool "$tool" "${filter[@]}" --error-exitcode 99 \
        python3 scripts/sanitize_workload.py > "$OUT/sanitize-$tool.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!tools[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    log="$OUT/sanitize-${tools[$i]}.log"
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    echo "${tools[$i]}: exit $rc; ${summary:-no summary}"
    [ $rc -eq 0 ] || { status=1; head -40 "$log"; }
done
exit $status
