"""A server's workers starting together on a fresh cache: N processes at
once, each making its first call of LSTM 256 (batch 1, T=50) and 20 more on
new inputs, against torch's module (TF32 off). Prints, per process, the time
of its first call, whether it calibrated the cost model or tuned the shape
itself (the package logger's INFO lines), the plan, the tuner's timing of
the chosen plan and the worst error; then what the cache holds (plans, temp
files left), and a second round of N processes on the now warm cache.

``--unlocked``: calibration and tuning without the cache's cross-process
locks (every process measures for itself, beside the others), for
comparison.

    PYTHONPATH=. python scripts/many_processes.py [--processes 4] [--unlocked]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import contextlib, json, logging, sys, time
import torch
import persistrnn
from persistrnn import runtime

if "--unlocked" in sys.argv:
    runtime.key_lock = lambda path: contextlib.nullcontext()  # the planner's locks only (compiles keep theirs)
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("persistrnn").addHandler(handler)
logging.getLogger("persistrnn").setLevel(logging.INFO)
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
theirs = torch.nn.LSTM(256, 256).cuda().eval()
ours = persistrnn.from_torch(theirs)
gen = torch.Generator(device="cuda").manual_seed(int(sys.argv[1]))
worst = 0.0
with torch.no_grad():
    torch.cuda.synchronize()
    started = time.perf_counter()
    ours(torch.randn(50, 1, 256, device="cuda", generator=gen))
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    for _ in range(20):
        x = torch.randn(50, 1, 256, device="cuda", generator=gen)
        a, b = ours(x)[0].double(), theirs(x)[0].double()
        worst = max(worst, float((a - b).norm() / b.norm()))
plan = ours.plan_for(1)
print(json.dumps({"first_s": round(first, 2), "calibrated": any(s.startswith("calibrat") for s in said),
                  "tuned": any(s.startswith("tuning") for s in said), "plan": plan.describe().splitlines()[0],
                  "source": plan.source, "chosen_ms": min(plan.measured_ms.values()) if plan.measured_ms else None,
                  "worst": worst}))
"""


def round_of(n: int, cache: Path, unlocked: bool) -> list[dict]:
    env = dict(os.environ, PERSISTRNN_CACHE_DIR=str(cache))
    flag = ["--unlocked"] if unlocked else []
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(i), *flag], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for i in range(n)]
    rows = []
    for i, child in enumerate(children):
        out, err = child.communicate(timeout=540)
        line = out.strip().splitlines()[-1] if out.strip() else "{}"
        rows.append({"process": i, "exit": child.returncode, **json.loads(line)}
                    | ({"stderr": err.strip().splitlines()[-3:]} if child.returncode else {}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--unlocked", action="store_true")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="persistrnn-fresh-"))
    for name in ("fresh", "warm"):
        started = time.perf_counter()
        rows = round_of(args.processes, cache, args.unlocked)
        print(f"{name} cache{' (unlocked)' if args.unlocked else ''}: {args.processes} processes at once, "
              f"{time.perf_counter() - started:.1f} s in all")
        for row in rows:
            print("  " + json.dumps(row))
    plans = sorted(p.name for p in (cache / "tuning").glob("*.json")) if (cache / "tuning").exists() else []
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*.tmp"))
    print(f"cache: {len(plans)} plan(s); temp files left: {left or 'none'}")


if __name__ == "__main__":
    main()
