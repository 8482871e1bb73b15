"""Where the dynamic networks' host time goes: per batch, the graph build
(the builder's ``build_batch``) and the scheduling (``schedule(graph,
blocks, train=True)``) timed apart, median over every batch and repeat, then
the top functions by own time under cProfile for each.

The inputs, model sizes and batches are those of ``bench treelstm`` and
``bench tagger`` (consecutive SST train trees, WikiNER dev sentences; the
vocabulary of the first ``--inputs``); no GPU is used.

    PYTHONPATH=. python scripts/profile_dynamic_host.py [--suite treelstm tagger] [--batch 1 16 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Callable

import torch

from persistrnn import dynamic
from persistrnn.bench.tagger import tagger_workload
from persistrnn.bench.treelstm import Settings, Workload, consecutive_batches, tree_lstm_workload

WORKLOADS = {"treelstm": tree_lstm_workload, "tagger": tagger_workload}


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: the builders record their templates on first use
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def top(run: Callable[[], object], count: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(count)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def profile(work: Workload, batch: int, args: argparse.Namespace) -> tuple[int, float, float]:
    """Graph nodes of the first batch, build and schedule ms per batch; prints the cProfile tops."""
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
            dynamic.schedule(graph, args.blocks, train=True)

    build_ms = median_ms(build_all, args.repeats) / len(groups)
    schedule_ms = median_ms(schedule_all, args.repeats) / len(groups)
    if args.top:
        for phase, run in (("build", build_all), ("schedule", schedule_all)):
            print(f"\n== {work.name} batch {batch}: {phase} ({len(groups)} batches), top {args.top} by own time")
            print(top(run, args.top))
    return len(graphs[0]), build_ms, schedule_ms


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
    args = parser.parse_args()
    settings = Settings(hidden=args.hidden, embedding=args.embedding)
    print(f"hidden {args.hidden}, embedding {args.embedding}, {args.blocks} blocks, {args.iterations} batches "
          f"per size, median of {args.repeats}")
    rows = []
    for suite in args.suite:
        work = WORKLOADS[suite](settings, torch.device("cpu"))
        rows += [(suite, batch, *profile(work, batch, args)) for batch in args.batch]
    print("\n| suite | batch | nodes (first batch) | build ms/batch | schedule ms/batch | host ms/batch |")
    print("|---|---|---|---|---|---|")
    for suite, batch, nodes, build_ms, schedule_ms in rows:
        print(f"| {suite} | {batch} | {nodes:,} | {build_ms:.2f} | {schedule_ms:.2f} | {build_ms + schedule_ms:.2f} |")


if __name__ == "__main__":
    main()
