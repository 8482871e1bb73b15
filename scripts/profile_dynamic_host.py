"""Where the dynamic networks' host time goes: per batch, the graph build
(the builder's ``build_batch``) and the scheduling (``schedule(graph,
blocks, train=True)``) timed apart, median over every batch and repeat,
with the minor page faults per batch beside it (a fresh large NumPy array
is mapped and faulted in page by page unless glibc's malloc reuses freed
heap), then the top functions by own time under cProfile for each.
``--keep-heap`` sets malloc's mmap and trim thresholds (``mallopt``) so
that freed memory stays in the heap: the time without the page faults.
``--gc freeze`` moves everything alive once a suite is loaded out of the
cyclic collector's passes (``gc.freeze()``, as the loader's workers do); the
table counts the full (generation-2) collections during the timed loops and
their ms per batch either way.
``--workers W ...`` also times the scripts made ahead by ``script_loader``
with each number of worker processes (0: in this process): ms per script
from the first script to the last, steady state, and the first one's wait
(the workers' start).

The inputs, model sizes and batches are those of ``bench treelstm`` and
``bench tagger`` (consecutive SST train trees, WikiNER dev sentences, with
those suites' vocabularies); no GPU is used.

    PYTHONPATH=. python scripts/profile_dynamic_host.py [--suite treelstm tagger] [--batch 1 16 128] [--keep-heap]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import ctypes.util
import gc
import io
import os
import pstats
import resource
import statistics
import time
from typing import Callable

import torch

from persistrnn import dynamic
from persistrnn.bench.tagger import WORKLOADS
from persistrnn.bench.treelstm import Settings, Workload, consecutive_batches


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_heap() -> None:
    """Freed memory stays in the heap: no array up to 32 MiB (glibc's largest
    mmap threshold) is mapped, and the heap's top is never trimmed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not (libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise SystemExit("mallopt refused the thresholds (not glibc?)")


def median_ms(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median ms of ``run`` and its minor page faults per call."""
    run()  # warm-up: the builders record their templates on first use
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats


def top(run: Callable[[], object], count: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(count)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


class FullCollections:
    """Generation-2 collections and their seconds, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count, self.seconds, self._started = 0, 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._started = time.perf_counter()
            else:
                self.count, self.seconds = self.count + 1, self.seconds + time.perf_counter() - self._started


FULL = FullCollections()


def profile(work: Workload, batch: int, args: argparse.Namespace) -> tuple[int, float, float, float, float, int,
                                                                           float]:
    """Graph nodes of the first batch, build and schedule ms and page faults
    per batch; prints the cProfile tops."""
    groups = consecutive_batches(work.inputs, batch, args.iterations)

    def build_all() -> list[dynamic.Graph]:
        graphs = []
        for group in groups:
            graphs.append(dynamic.Graph(work.model))
            work.add_batch(graphs[-1], group)
        return graphs

    graphs = build_all()

    def schedule_all() -> None:
        for graph in graphs:
            dynamic.schedule(graph, args.blocks, train=not args.infer)

    count, seconds = FULL.count, FULL.seconds
    build_ms, build_faults = (x / len(groups) for x in median_ms(build_all, args.repeats))
    schedule_ms, schedule_faults = (x / len(groups) for x in median_ms(schedule_all, args.repeats))
    full = (FULL.count - count, (FULL.seconds - seconds) * 1e3 / (len(groups) * (args.repeats + 1)))
    if args.top:
        for phase, run in (("build", build_all), ("schedule", schedule_all)):
            print(f"\n== {work.name} batch {batch}: {phase} ({len(groups)} batches), top {args.top} by own time")
            print(top(run, args.top))
    return len(graphs[0]), build_ms, schedule_ms, build_faults, schedule_faults, *full


def loader_ms(work: Workload, batch: int, workers: int, args: argparse.Namespace) -> tuple[float, float]:
    """(ms per script after the first, ms to the first) through ``script_loader``."""
    groups = consecutive_batches(work.inputs, batch, args.iterations) * args.repeats
    loader = dynamic.script_loader(work.model, work.add_batch, groups, args.blocks, workers=workers)
    started = time.perf_counter()
    scripts = iter(loader)
    next(scripts)
    first = time.perf_counter()
    count = sum(1 for _ in scripts)
    return (time.perf_counter() - first) * 1e3 / count, (first - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", nargs="+", choices=sorted(WORKLOADS), default=["treelstm", "tagger"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--blocks", type=int, default=132, help="virtual processors (an H100's SMs)")
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--embedding", type=int, default=Settings.embedding)
    parser.add_argument("--iterations", type=int, default=Settings.iterations, help="batches per size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=20, help="cProfile rows per phase (0: none)")
    parser.add_argument("--infer", action="store_true", help="schedule inference scripts (forward only)")
    parser.add_argument("--keep-heap", action="store_true", help="freed memory stays in malloc's heap (mallopt)")
    parser.add_argument("--gc", choices=("on", "freeze"), default="on",
                        help="freeze: gc.freeze() once each suite is loaded")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also time script_loader with these numbers of worker processes")
    args = parser.parse_args()
    if args.keep_heap:
        keep_heap()
    settings = Settings(hidden=args.hidden, embedding=args.embedding)
    print(f"hidden {args.hidden}, embedding {args.embedding}, {args.blocks} blocks, {args.iterations} batches "
          f"per size, median of {args.repeats}{', heap kept' if args.keep_heap else ''}")
    rows, loader_rows = [], []
    for suite in args.suite:
        work = WORKLOADS[suite](settings, torch.device("cpu"))
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        rows += [(suite, batch, *profile(work, batch, args)) for batch in args.batch]
        loader_rows += [(suite, batch, w, *loader_ms(work, batch, w, args)) for batch in args.batch
                        for w in args.workers]
    print(f"\n(gc {args.gc})\n\n| suite | batch | nodes (first batch) | build ms/batch | schedule ms/batch "
          "| host ms/batch | page faults/batch: build, schedule | full collections | their ms/batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for suite, batch, nodes, build_ms, schedule_ms, build_faults, schedule_faults, full, full_ms in rows:
        print(f"| {suite} | {batch} | {nodes:,} | {build_ms:.2f} | {schedule_ms:.2f} | {build_ms + schedule_ms:.2f} "
              f"| {build_faults:,.0f}, {schedule_faults:,.0f} | {full} | {full_ms:.2f} |")
    if loader_rows:
        print(f"\nscript_loader, {args.iterations * args.repeats} batches per row ({os.cpu_count()} CPUs)\n\n"
              "| suite | batch | workers | ms per script | ms to the first |\n|---|---|---|---|---|")
        for suite, batch, workers, per_script, to_first in loader_rows:
            print(f"| {suite} | {batch} | {workers} | {per_script:.2f} | {to_first:.1f} |")


if __name__ == "__main__":
    main()
