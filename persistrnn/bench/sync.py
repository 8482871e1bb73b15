"""Synchronisation floors on the current GPU: ``python -m persistrnn.bench sync``.

What a persistent kernel pays to end one timestep, by each method it can use:
launch gap, grid barriers (cooperative groups and our counter barrier), the
counter barrier plus a broadcast of h through global memory, cluster barriers,
and two ways to exchange h inside a cluster (plain DSMEM stores plus
cluster.sync, and st.async completing on an mbarrier).

Method. Each barrier kernel runs ``steps`` and ``steps // 10`` steps inside one
launch; the per-step cost is the difference of the two times over the
difference of the step counts, which cancels the launch and the prologue.
Each time is the median of ``repeats`` CUDA-event timings after ``warmup``
launches. The exchange kernels compute a checkable recurrence and their final
state is compared exactly with the host's before any number is reported. The
planner calibrates its exchange costs from the same measurements
(:mod:`persistrnn.plan.floors`), run at fewer steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from .. import runtime
# The measurements the planner calibrates from live in the library; this
# suite adds the ones only its table reports (launch gap, cluster barriers,
# residency) and the table itself.
from ..plan.floors import (BLOCK, EXCHANGE_BLOCKS, EXCHANGE_CLUSTERS, STATE_SIZES, Runner, SyncConfig,
                           check_state, cluster_exchanges, exchange_shared_bytes, expected_state, grid_barriers,
                           grid_block_counts, grid_exchange, sync_binary)
from .environment import describe
from .timing import time_cuda_ms

__all__ = ["BLOCK", "EXCHANGE_BLOCKS", "EXCHANGE_CLUSTERS", "RESIDENCY_SHARED", "STATE_SIZES", "Runner", "SyncConfig",
           "check_state", "cluster_barriers", "cluster_exchanges", "exchange_shared_bytes", "expected_state",
           "format_header", "format_table", "grid_barriers", "grid_block_counts", "grid_exchange", "launch_gap",
           "main", "residency", "run", "sync_binary"]

RESIDENCY_SHARED = 200 * 1024  # a persistent block that holds its weights in shared memory


def launch_gap(r: Runner) -> dict[str, float]:
    """Back-to-back empty launches, per launch: issued from Python (host-bound
    when the issue path is slower than the GPU), and replayed from a CUDA graph
    (the device's own gap between dependent kernels)."""
    import torch

    k = r.kernel("empty_kernel")
    cfg = k.config(1, 32)
    n = r.cfg.launches

    def many() -> None:
        for _ in range(n):
            runtime.launch(k, cfg)

    many()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    many()
    host_us = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    issued_us = time_cuda_ms(many, warmup=1, repeats=r.cfg.repeats) * 1e3 / n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        many()
    graph_us = time_cuda_ms(graph.replay, warmup=1, repeats=r.cfg.repeats) * 1e3 / n
    return {"host_issue_us": host_us, "issued_us": issued_us, "graph_us": graph_us}


def cluster_barriers(r: Runner, max_cluster: int) -> dict[int, float]:
    k = r.kernel("cluster_barrier")
    return {
        n: r.per_step_us("cluster_barrier", k.config(n, BLOCK, cluster=n), lambda s: runtime.kernel_args(s))
        for n in range(2, max_cluster + 1)
    }


def residency(r: Runner, max_cluster: int) -> dict[str, dict[int, int]]:
    """Clusters that fit at once: small blocks, and one 200 KB block per SM."""
    k = r.kernel("cluster_barrier")
    sizes = [n for n in (2, 4, 8, 16) if n <= max_cluster]
    return {
        "no_shared": {n: k.max_resident_clusters(n, BLOCK) for n in sizes},
        "shared_200KB": {n: k.max_resident_clusters(n, BLOCK, RESIDENCY_SHARED) for n in sizes},
    }


def run(cfg: SyncConfig | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure every floor; returns the JSON-ready result (with environment)."""
    from .environment import environment

    cfg = cfg or SyncConfig()
    facts = runtime.device_facts()
    r = Runner(cfg)
    stages = [
        ("launch gap", lambda: {"launch": launch_gap(r)}),
        ("grid barriers", lambda: grid_barriers(r, facts.sm_count)),
        ("grid exchange", lambda: {"grid_exchange": grid_exchange(r, facts.sm_count)}),
    ]
    result: dict[str, Any] = {"environment": environment(), "device": dataclasses.asdict(facts),
                              "config": dataclasses.asdict(cfg)}
    max_cluster = r.kernel("cluster_barrier").max_cluster_size(BLOCK)
    result["max_cluster_size"] = max_cluster
    stages += [
        ("cluster barriers", lambda: {"cluster_barrier": cluster_barriers(r, max_cluster)}),
        ("cluster exchanges", lambda: cluster_exchanges(r, max_cluster)),
        ("cluster residency", lambda: {"max_resident_clusters": residency(r, max_cluster)}),
    ]
    for _label, stage in _progress(stages, progress):
        result.update(stage())
    return result


def _progress(stages, enabled: bool):
    if not enabled:
        yield from stages
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("sync floors", total=len(stages))
        for label, stage in stages:
            bar.update(task, description=f"sync floors: {label}")
            yield label, stage
            bar.advance(task)


def format_table(result: dict[str, Any]) -> str:
    """Markdown tables of the floors, in microseconds per step."""
    lines = ["| what | configuration | µs per step |", "|---|---|---|"]
    launch = result["launch"]
    lines.append(f"| empty launches, back to back from Python | host issue time | {launch['host_issue_us']:.2f} |")
    lines.append(f"| empty launches, back to back from Python | device time | {launch['issued_us']:.2f} |")
    lines.append(f"| empty launches, replayed from a CUDA graph | device time | {launch['graph_us']:.2f} |")
    for name, label in (("grid_sync_cg", "cooperative-groups grid.sync"), ("grid_barrier_counter", "counter barrier")):
        for blocks, us in result[name].items():
            lines.append(f"| {label} | {blocks} blocks | {us:.3f} |")
    for H, us in result["grid_exchange"].items():
        lines.append(f"| counter barrier + broadcast of h (global) | H={H}, all SMs | {us:.3f} |")
    for n, us in result["cluster_barrier"].items():
        lines.append(f"| cluster.sync | cluster of {n} | {us:.3f} |")
    sizes = [n for n in EXCHANGE_CLUSTERS if n <= result["max_cluster_size"]]
    lines += ["", "Exchange of h to every block of a cluster, µs per step, by cluster size:", ""]
    lines.append("| method | threads per block | H | " + " | ".join(str(n) for n in sizes) + " |")
    lines.append("|---|---|---|" + "---|" * len(sizes))
    for name, label in (
        ("cluster_exchange_dsmem", "DSMEM stores + cluster.sync"),
        ("cluster_exchange_stasync", "st.async + mbarrier"),
    ):
        for block, by_h in result[name].items():
            for H, row in by_h.items():
                lines.append(f"| {label} | {block} | {H} | " + " | ".join(f"{row[n]:.3f}" for n in sizes) + " |")
    res = result["max_resident_clusters"]
    lines.append("")
    lines.append(
        f"Largest cluster: {result['max_cluster_size']}. Clusters resident at once (256 threads per block): "
        + ", ".join(f"{n}: {c}" for n, c in res["no_shared"].items())
        + "; with 200 KB shared memory per block: "
        + ", ".join(f"{n}: {c}" for n, c in res["shared_200KB"].items())
        + "."
    )
    return "\n".join(lines)


def format_header(result: dict[str, Any]) -> str:
    """Where and how the numbers were taken, for the top of a results file."""
    cfg = result["config"]
    return "\n".join([
        describe(result["environment"]),
        f"- Method: each kernel runs {cfg['steps']} and {cfg['steps'] // 10} steps in one launch; per step = the "
        f"difference of the two times over the difference of the steps. Each time is the median of {cfg['repeats']} "
        f"CUDA-event timings after {cfg['warmup']} warm-up launches. The exchange kernels' final state is checked "
        "exactly before any number is reported.",
    ])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m persistrnn.bench sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=SyncConfig.steps, help="steps in the long launch")
    parser.add_argument("--repeats", type=int, default=SyncConfig.repeats)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    args = parser.parse_args(argv)
    result = run(SyncConfig(steps=args.steps, repeats=args.repeats))
    table = format_table(result)
    header = format_header(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"# Sync floors (`python -m persistrnn.bench sync`)\n\n{header}\n\n{table}\n")
    print(header)
    print(table)
    return 0
