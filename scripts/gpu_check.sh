#!/usr/bin/env bash
# One call on a GPU machine: every test (GPU ones included), compute-sanitizer
# over each kernel family, the demo, then the benchmarks. Full logs and JSON go
# under $OUT (default ./gpu_check_out); a short summary is printed last. Runs
# from a checkout with no install and no network: PYTHONPATH points at the
# repository. Where the copy has no .git, set PERSISTRNN_COMMIT so that results
# name their commit. BENCH_ARGS narrows the recurrence benchmark (e.g.
# "--case lstm:256:1").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PERSISTRNN_CACHE_DIR=${PERSISTRNN_CACHE_DIR:-/tmp/persistrnn-cache}
PY=${PYTHON:-python3}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
$PY -m pytest tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -n 3
tests_rc=${PIPESTATUS[0]}
san_rc=0
for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 $PY scripts/sanitize_recurrence.py >"$OUT/sanitizer-$tool.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && san_rc=$rc
done
$PY -m persistrnn >"$OUT/demo.log" 2>&1
demo_rc=$?
$PY -m persistrnn.bench sync --json "$OUT/sync.json" --markdown "$OUT/sync.md" >"$OUT/bench_sync.log" 2>&1
sync_rc=$?
$PY -m persistrnn.bench recurrence ${BENCH_ARGS:-} --json "$OUT/recurrence.json" --markdown "$OUT/recurrence.md" \
    >"$OUT/bench_recurrence.log" 2>&1
rec_rc=$?

echo
echo "==== summary (commit ${PERSISTRNN_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}) ===="
echo "tests: exit $tests_rc: $(tail -n 1 "$OUT/tests.log")"
for tool in memcheck racecheck; do echo "sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|FAIL' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"; done
echo "demo: exit $demo_rc"; cat "$OUT/demo.log"
echo "bench sync: exit $sync_rc"
echo "bench recurrence: exit $rec_rc"
if [ -f "$OUT/recurrence.md" ]; then cat "$OUT/recurrence.md"; else tail -n 30 "$OUT/bench_recurrence.log"; fi
[ "$tests_rc" -eq 0 ] && [ "$san_rc" -eq 0 ] && [ "$demo_rc" -eq 0 ] && [ "$sync_rc" -eq 0 ] && [ "$rec_rc" -eq 0 ]
