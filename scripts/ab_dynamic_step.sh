#!/usr/bin/env bash
# A/B of the dynamic interpreter between a commit and the working tree, on one GPU machine:
# scripts/profile_dynamic_step.py (the suites' queued kernel columns, training and inference, and
# a loop of steps) for the tagger and the Tree-LSTM at batch 1, 16 and 128, over REV's package
# and the working tree's in turn, ROUNDS times. The measuring script is the working tree's both
# times; only the package on PYTHONPATH changes.
#
#   scripts/ab_dynamic_step.sh REV [ROUNDS]
#
# REV's package comes from `git archive` where the checkout has its history; otherwise put it
# under ./ab_before/persistrnn first and pass REV only as the label.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1
ROUNDS=${2:-2}
export PERSISTRNN_CACHE_DIR=${PERSISTRNN_CACHE_DIR:-/tmp/persistrnn-cache}
export PERSISTRNN_DATA=${PERSISTRNN_DATA:-$PWD/shared/data}
BEFORE=$PWD/ab_before
if [ ! -d "$BEFORE/persistrnn" ]; then
    mkdir -p "$BEFORE"
    git archive "$REV" persistrnn | tar -x -C "$BEFORE"
fi
echo "before: $REV; after: the working tree"
for round in $(seq 1 "$ROUNDS"); do
    for tree in before after; do
        dir=$([ $tree = before ] && echo "$BEFORE" || echo "$PWD")
        for suite in tagger treelstm; do
            PYTHONPATH=$dir timeout 200 python3 scripts/profile_dynamic_step.py --suite $suite --batch 1 16 128 \
                --steps 50 --top 0 2>&1 | grep "batch" | sed "s/^/$tree r$round /"
        done
    done
done
