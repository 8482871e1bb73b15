"""Training throughput of the dynamic interpreter against the number of
processes that make its scripts ahead (``Interpreter.scripts(...,
workers=W)``), the way ``bench treelstm`` / ``bench tagger`` time their
"scripts made ahead" column: past the ramp, the median of 3 loops, with the
launching process's time split into waiting for the next script and
stepping. Each row also gives the kernel's time for the batch's first
script (CUDA events), the floor a loop can reach.

    PYTHONPATH=. python scripts/profile_dynamic_workers.py --workers 8 12 14 \
        [--suite treelstm tagger] [--batch 1 16 128]
"""

from __future__ import annotations

import argparse
import functools
import os


from persistrnn import dynamic
from persistrnn.bench.tagger import WORKLOADS, loaded_suite
from persistrnn.bench.treelstm import Settings, _steady_ms, consecutive_batches
from persistrnn.runtime.timing import time_cuda_ms, warm_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", nargs="+", choices=sorted(WORKLOADS), default=["treelstm", "tagger"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--workers", type=int, nargs="+", required=True)
    args = parser.parse_args()
    settings = Settings()
    print(f"{os.cpu_count()} CPUs; {settings.iterations} batches per loop, repeated past a ramp of 2 x workers")
    print("| suite | batch | kernel ms | workers | sent/s | ms/batch | waiting ms/batch | in step ms/batch |")
    print("|---|---|---|---|---|---|---|---|")
    for suite in args.suite:
        work, interp = loaded_suite(suite, settings)
        for batch in args.batch:
            batches = consecutive_batches(work.inputs, batch, settings.iterations)
            graph = dynamic.Graph(work.model)
            work.add_batch(graph, batches[0])
            first = interp.schedule(graph)
            launch = functools.partial(interp.launch, first)
            warm_up(launch)
            kernel_ms = time_cuda_ms(launch, warmup=2, repeats=10)
            for workers in args.workers:
                ramp = 2 * workers
                ahead = batches * -(-3 * ramp // len(batches))
                scripts = interp.scripts(ahead, work.add_batch, workers=workers)
                wall, waiting, stepping = _steady_ms(interp, scripts, ramp, settings.repeats)
                timed = len(ahead) - ramp
                print(f"| {suite} | {batch} | {kernel_ms:.3f} | {workers} | {batch * timed / (wall / 1e3):,.0f} "
                      f"| {wall / timed:.2f} | {waiting / timed:.2f} | {stepping / timed:.2f} |", flush=True)
                del scripts  # its workers end before the next count's start


if __name__ == "__main__":
    main()
