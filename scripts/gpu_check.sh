#!/usr/bin/env bash
# One call on a GPU machine: every test (GPU ones included), then the
# benchmarks. Full logs and JSON go under $OUT (default ./gpu_check_out); a
# short summary is printed last. Runs from a checkout with no install and no
# network: PYTHONPATH points at the repository. Where the copy has no .git,
# set PERSISTRNN_COMMIT so that results name their commit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PERSISTRNN_CACHE_DIR=${PERSISTRNN_CACHE_DIR:-/tmp/persistrnn-cache}
PY=${PYTHON:-python3}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
$PY -m pytest tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
$PY -m persistrnn >"$OUT/demo.log" 2>&1
demo_rc=$?
$PY -m persistrnn.bench sync --json "$OUT/sync.json" --markdown "$OUT/sync.md" >"$OUT/bench_sync.log" 2>&1
bench_rc=$?

echo
echo "==== summary (commit ${PERSISTRNN_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}) ===="
echo "tests: exit $tests_rc: $(tail -n 1 "$OUT/tests.log")"
echo "demo: exit $demo_rc"; cat "$OUT/demo.log"
echo "bench sync: exit $bench_rc"
if [ -f "$OUT/sync.md" ]; then cat "$OUT/sync.md"; else tail -n 30 "$OUT/bench_sync.log"; fi
[ "$tests_rc" -eq 0 ] && [ "$demo_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
