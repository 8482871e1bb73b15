#!/bin/bash
REAL_OUT=$OUT; OUT=$REAL_OUT/l; mkdir -p $OUT
export PERSISTRNN_COMMIT=${COMMIT} PERSISTRNN_CACHE_DIR=/tmp/prnn PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu.txt 2>&1
for spec in $TESTS; do
  f=${spec%%:*}; k=${spec#*:}; [ "$k" = "$spec" ] && k=""
  if [ -n "$k" ]; then
    timeout ${TT:-300} python -m pytest -q -x -m gpu -p no:cacheprovider tests/$f.py -k "$k" > $OUT/$f-$k.log 2>&1; echo "$f[$k] rc=$? $(tail -1 $OUT/$f-$k.log)"
  else
    timeout ${TT:-300} python -m pytest -q -m gpu -p no:cacheprovider tests/$f.py > $OUT/$f.log 2>&1; echo "$f rc=$? $(tail -1 $OUT/$f.log)"
  fi
done
if [ -n "$BENCH" ]; then timeout ${BT:-300} bash -c "$BENCH" > $OUT/bench.log 2>&1; echo "bench rc=$?"; tail -30 $OUT/bench.log; fi
cd $REAL_OUT && tar czf logs.tgz l
