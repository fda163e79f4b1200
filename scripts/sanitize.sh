#!/usr/bin/env bash
# Run every kernel family under compute-sanitizer (memcheck, racecheck, synccheck, initcheck) at small sizes.
# Kernels are compiled first, outside the sanitizer, so only flashrt's kernels are checked.
set -u
cd "$(dirname "$0")/.."
python3 scripts/sanitize_workload.py >/dev/null || exit 1
status=0
for tool in memcheck racecheck synccheck initcheck; do
    # initcheck must see the writes of torch's kernels that fill the inputs, so it checks every kernel.
    filter=(--kernel-name kns=flashrt_)
    [ "$tool" = initcheck ] && filter=()
    log=$(compute-sanitizer --tool "$tool" "${filter[@]}" --error-exitcode 99 \
          python3 scripts/sanitize_workload.py 2>&1)
    rc=$?
    summary=$(echo "$log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tail -1)
    echo "$tool: exit $rc; ${summary:-no summary}"
    [ $rc -eq 0 ] || { status=1; echo "$log" | head -40; }
done
exit $status
