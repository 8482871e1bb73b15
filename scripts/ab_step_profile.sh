#!/usr/bin/env bash
# A/B of the persistent kernels between a commit and the working tree, on one GPU machine:
# `python -m persistrnn bench step-profile ARGS...` run for each tree in turn, ROUNDS times,
# each tree from its own folder (python -m puts the working directory first on sys.path, so a
# PYTHONPATH alone would import the working tree's package both times). JSON per run goes to
# $OUT/ab-<tree>-<round>.json; a table of µs per step and phases per case is printed last.
#
#   scripts/ab_step_profile.sh REV [ROUNDS] -- ARGS...
#   e.g. scripts/ab_step_profile.sh 6623351 3 -- --no-plan --case lstm:64:1 \
#            --config sync=single,blocks=1,threads=128,group_size=2,fused_step=True
#
# REV's package comes from `git archive` where the checkout has its history; otherwise put it
# under ./ab_before/persistrnn first (e.g. `git archive REV persistrnn | tar -x -C ab_before`
# on the machine that has the history) and pass REV only as the label.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1
shift
ROUNDS=3
if [ "${1:-}" != "--" ]; then ROUNDS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-$PWD/ab_out}
mkdir -p "$OUT"
export PERSISTRNN_CACHE_DIR=${PERSISTRNN_CACHE_DIR:-/tmp/persistrnn-cache}
BEFORE=$PWD/ab_before
if [ ! -d "$BEFORE/persistrnn" ]; then
    mkdir -p "$BEFORE"
    git archive "$REV" persistrnn | tar -x -C "$BEFORE"
fi
for round in $(seq 1 "$ROUNDS"); do
    for tree in before after; do
        dir=$([ $tree = before ] && echo "$BEFORE" || echo "$PWD")
        (cd "$dir" && PYTHONPATH="$dir" python3 -m persistrnn bench step-profile "$@" \
            --json "$OUT/ab-$tree-$round.json" > "$OUT/ab-$tree-$round.log" 2>&1)
    done
done
python3 - "$OUT" "$REV" <<'PY'
import glob, json, os, sys
out, rev = sys.argv[1], sys.argv[2]
print(f"before: {rev}; after: the working tree; µs per step (shipped / instrumented) and phases by round")
for path in sorted(glob.glob(os.path.join(out, "ab-*.json"))):
    tree_round = os.path.basename(path)[3:-5]
    for case in json.load(open(path))["cases"]:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in case["phases_us"].items() if v > 0.005)
        print(f"{tree_round:10s} {case['cell']} {case['hidden']} b{case['batch']} {case.get('variant') or ''}: "
              f"{case['shipped_us_per_step']:.3f} / {case['instrumented_us_per_step']:.3f} ({phases})")
PY
