#!/usr/bin/env bash
# First runs as a user's short scripts make them, each on a fresh cache folder
# (calibration, tuning and compiles included): each one's exit status and wall
# time, and that the native replay's build, cut short by the first process's
# end, still leaves the library. A process that ends with work of the library
# still running must exit with 0 (perf-notes §86). Logs under $OUT.
#
#   PYTHONPATH=. OUT=/tmp/first-run bash scripts/first_run_check.sh
set -u
OUT=${OUT:-/tmp/first-run}
mkdir -p /tmp/p "$OUT"
cat > /tmp/p/infer.py <<'PY'
import torch, persistrnn
m = persistrnn.LSTM(256, 256).cuda().eval()
with torch.no_grad():
    m(torch.randn(50, 1, 256, device="cuda"))
torch.cuda.synchronize(); print("ran", flush=True)
PY
cat > /tmp/p/train.py <<'PY'
import torch, persistrnn
m = persistrnn.LSTM(256, 256).cuda(); m.training_kernels = True
x = torch.randn(100, 8, 256, device="cuda", requires_grad=True)
for _ in range(3):
    m.zero_grad(); m(x)[0].square().sum().backward()
torch.cuda.synchronize(); print("ran", flush=True)
PY
cat > /tmp/p/serve.py <<'PY'
import torch, persistrnn
m = persistrnn.LSTM(128, 128).cuda().eval()
engine = persistrnn.serve.Engine(m, max_streams=8, resident=True)
engine.warm_up()
s = engine.open(); s.push(torch.randn(1, 128)); out = s.pull(timeout=30)
print("ran", tuple(out.shape), flush=True)
PY
cat > /tmp/p/convert.py <<'PY'
import torch, persistrnn
rnn = torch.nn.GRU(64, 96, num_layers=2, bidirectional=True, batch_first=True).cuda().eval()
ours = persistrnn.convert(rnn)
x = torch.randn(3, 40, 64, device="cuda")
with torch.no_grad():
    d = (ours(x)[0] - rnn(x)[0]).abs().max().item()
print("ran", d, flush=True)
PY
# the native library, built once and copied into the later cases' caches (its build is not what they time)
rm -rf /tmp/base; PERSISTRNN_CACHE_DIR=/tmp/base python -c "from persistrnn.runtime import native; assert native.available(wait=True)"
probe_case() {  # name, native (copy|fresh), command...
  local name=$1 how=$2; shift 2
  rm -rf /tmp/c; mkdir -p /tmp/c; [ "$how" = copy ] && cp -r /tmp/base/native /tmp/c/
  local t0=$(date +%s.%N)
  PERSISTRNN_CACHE_DIR=/tmp/c timeout 300 "$@" > /tmp/p/$name.log 2>&1
  local rc=$?
  echo "$name ($how native): rc $rc, $(python -c "print(round($(date +%s.%N)-$t0,1))") s; last: $(grep -v Warn /tmp/p/$name.log | tail -1 | cut -c1-150)"
  cp /tmp/p/$name.log "$OUT/"
}
probe_case infer fresh python /tmp/p/infer.py
sleep 20; echo "native/ 20 s after that process ended: $(ls /tmp/c/native | tr '\n' ' ')"
probe_case demo copy python -m persistrnn
probe_case train copy python /tmp/p/train.py
probe_case serve copy python /tmp/p/serve.py
probe_case convert copy python /tmp/p/convert.py
