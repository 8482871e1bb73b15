"""Where the launching process's time goes in ``Interpreter.step``: scripts
made beforehand in this process (so the loop does nothing but step), the
wall time per batch of a loop of steps against the kernel's own time, the
host time of one ``launch`` call on its own, then the loop under cProfile
(top functions by own time). The kernel columns (training and inference)
are the suites' own: every script launched back to back, queued behind a
GPU sleep (``bench.treelstm.kernel_ms``); ``--top 0`` leaves out cProfile.

    PYTHONPATH=. python scripts/profile_dynamic_step.py [--suite tagger] [--batch 1] [--steps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from persistrnn import dynamic
from persistrnn.bench.tagger import WORKLOADS, loaded_suite
from persistrnn.bench.treelstm import Settings, consecutive_batches, kernel_ms


def profile_batch(interp: dynamic.Interpreter, work, settings: Settings, batch: int, args) -> None:
    scripts, inference = [], []
    for group in consecutive_batches(work.inputs, batch, settings.iterations):
        graph = dynamic.Graph(work.model)
        work.add_batch(graph, group)
        scripts.append(interp.schedule(graph))
        inference.append(interp.schedule(graph, train=False))
    loop = [scripts[i % len(scripts)] for i in range(args.steps)]
    train_ms = kernel_ms(interp, scripts, repeats=5)
    infer_ms = kernel_ms(interp, inference, repeats=5)

    def run() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for script in loop:
            interp.step(script)
        interp.sync()
        return (time.perf_counter() - started) * 1e3 / len(loop)

    def host_us() -> float:
        """Median host µs of one launch call, the GPU idle before each."""
        times = []
        for script in loop:
            torch.cuda.synchronize()
            started = time.perf_counter()
            interp.launch(script)
            times.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
        return sorted(times)[len(times) // 2]

    run()
    walls = sorted(run() for _ in range(3))
    hosts = sorted(host_us() for _ in range(3))
    print(f"{args.suite} batch {batch}: kernel {train_ms:.3f} ms, inference kernel {infer_ms:.3f} ms (queued, "
          f"launches back to back); a loop of {len(loop)} steps {walls[1]:.3f} ms a batch (median of 3); one "
          f"launch call {hosts[1]:.0f} µs of host time (median)")
    if args.top <= 0:
        return
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(WORKLOADS), default="tagger")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    settings = Settings()
    work, interp = loaded_suite(args.suite, settings)
    for batch in args.batch:
        profile_batch(interp, work, settings, batch, args)


if __name__ == "__main__":
    main()
