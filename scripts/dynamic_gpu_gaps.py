"""Where the GPU idles in a training loop of the dynamic interpreter whose
scripts come from worker processes (as ``bench treelstm`` / ``bench tagger``
time it): the loop past its ramp under torch.profiler, then, from the GPU
activities of the trace, the wall time per batch, the interpreter kernel's
median duration, the other device work per batch (copies, memsets), and the
idle time between activities, with the largest gaps and what the host was
doing in them (the CPU-side op spans that overlap each gap).

    PYTHONPATH=. python scripts/dynamic_gpu_gaps.py [--suite tagger] [--batch 1] [--workers 14]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from persistrnn.bench.tagger import WORKLOADS, loaded_suite
from persistrnn.bench.treelstm import Settings, consecutive_batches

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(WORKLOADS), default="tagger")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 1) - 2)))
    parser.add_argument("--batches", type=int, default=120, help="batches timed past the ramp")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    settings = Settings()
    work, interp = loaded_suite(args.suite, settings)
    batches = consecutive_batches(work.inputs, args.batch, settings.iterations)
    ramp = 2 * args.workers
    ahead = [batches[i % len(batches)] for i in range(ramp + args.batches)]
    scripts = iter(interp.scripts(ahead, work.add_batch, workers=args.workers))
    for _ in range(ramp):
        interp.step(next(scripts))
    interp.sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for script in scripts:
            interp.step(script)
        interp.sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e]
    kernels = [e["dur"] for e in gpu if "dynamic_interpreter" in e["name"]]
    window = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, gaps, end = 0.0, [], gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["ts"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    n = len(kernels)
    other = sum(e["dur"] for e in gpu if "dynamic_interpreter" not in e["name"]) / n
    print(f"{args.suite} batch {args.batch}, {args.workers} workers, {n} batches: {window / n / 1e3:.3f} ms a batch "
          f"on the GPU's clock; interpreter kernel median {statistics.median(kernels) / 1e3:.3f} ms (mean "
          f"{statistics.mean(kernels) / 1e3:.3f}); other device work {other:.1f} µs a batch; idle "
          f"{(window - busy) / n:.1f} µs a batch in {len(gaps)} gaps")
    by_name: dict[str, float] = {}
    for e in gpu:
        if "dynamic_interpreter" not in e["name"]:
            by_name[e["name"][:60]] = by_name.get(e["name"][:60], 0.0) + e["dur"] / n
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  device: {us:7.1f} µs a batch  {name}")
    for length, start, stop in sorted(gaps, reverse=True)[:args.top]:
        during = sorted({e["name"][:50] for e in cpu if e["ts"] < stop and e["ts"] + e["dur"] > start})[:6]
        print(f"  gap {length:7.1f} µs; host ops overlapping it: {', '.join(during) or '-'}")


if __name__ == "__main__":
    main()
