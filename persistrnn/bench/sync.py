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
planner reads the JSON written here as its calibration of sync costs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from .. import runtime
from .environment import describe
from .timing import per_iteration_us, time_cuda_ms

BLOCK = 256  # threads per block in every sync kernel: a typical persistent block
STATE_SIZES = (256, 1024, 4096)  # H: floats of state exchanged per step
EXCHANGE_CLUSTERS = (2, 4, 8, 16)  # H must divide by 4 * cluster size
# Threads per block for the exchanges: every thread waits, so the cost grows
# with the block; a persistent RNN block holding weights in registers is large.
EXCHANGE_BLOCKS = (32, 256, 1024)
RESIDENCY_SHARED = 200 * 1024  # a persistent block that holds its weights in shared memory


def sync_binary(arch: str | None = None) -> runtime.CompiledBinary:
    """The compiled sync micro-benchmark kernels (``arch=None``: this GPU's)."""
    return runtime.compile_source("sync_bench", runtime.read_source("sync_bench.cu"), arch=arch)


def exchange_shared_bytes(kernel: str, H: int) -> int:
    """Dynamic shared memory of a cluster exchange kernel: two H-float state
    buffers, then (st.async only) one 8-byte mbarrier per buffer."""
    return 2 * H * 4 + (16 if kernel == "cluster_exchange_stasync" else 0)


def expected_state(H: int, steps: int) -> list[float]:
    """h_S of the exchange recurrence h_s[j] = h_{s-1}[(j+1) mod H] + 1, h_0[j] = j."""
    return [float((j + steps) % H + steps) for j in range(H)]


@dataclasses.dataclass
class SyncConfig:
    steps: int = 20_000
    repeats: int = 5
    warmup: int = 2
    launches: int = 2_000  # for the back-to-back launch gap

    def __post_init__(self) -> None:
        for name in ("steps", "repeats", "launches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.steps < 20:
            raise ValueError(f"steps must be >= 20 so that steps // 10 differs from steps, got {self.steps}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")


class Runner:
    """Times one kernel at two step counts and returns microseconds per step."""

    def __init__(self, cfg: SyncConfig) -> None:
        import torch

        self.cfg = cfg
        self.binary = sync_binary()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.status = torch.zeros(1, dtype=torch.int32, device=self.device)

    def kernel(self, name: str) -> runtime.LoadedKernel:
        return runtime.get_kernel(self.binary, name)

    def per_step_us(self, name: str, config: Any, make_args, setup=None) -> float:
        k = self.kernel(name)
        us = per_iteration_us(lambda steps: runtime.launch(k, config, *make_args(steps)), self.cfg.steps,
                              warmup=self.cfg.warmup, repeats=self.cfg.repeats, setup=setup)
        runtime.check_status(self.status, name)
        return us

    def zero_counter(self) -> None:
        self.counter.zero_()


def _check_state(got: Any, H: int, steps: int, what: str) -> None:
    import torch

    want = torch.tensor(expected_state(H, steps), device=got.device)
    if not torch.equal(got, want):
        bad = int((got != want).sum())
        raise AssertionError(f"{what}: {bad} of {H} state values wrong after {steps} steps (an ordering bug)")


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


def grid_block_counts(sm_count: int) -> list[int]:
    counts = [b for b in (8, 16, 32, 64, 128) if b < sm_count]
    return counts + [sm_count]


def grid_barriers(r: Runner, sm_count: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"grid_sync_cg": {}, "grid_barrier_counter": {}}
    for blocks in grid_block_counts(sm_count):
        cg = r.kernel("grid_sync_cg")
        out["grid_sync_cg"][blocks] = r.per_step_us(
            "grid_sync_cg", cg.config(blocks, BLOCK, cooperative=True), lambda s: runtime.kernel_args(s)
        )
        counter = r.kernel("grid_barrier_counter")
        out["grid_barrier_counter"][blocks] = r.per_step_us(
            "grid_barrier_counter",
            counter.config(blocks, BLOCK, cooperative=True),
            lambda s: runtime.kernel_args(r.counter, s, r.status),
            setup=r.zero_counter,
        )
    return out


def grid_exchange(r: Runner, sm_count: int) -> dict[int, float]:
    import torch

    k = r.kernel("grid_exchange")
    out = {}
    for H in STATE_SIZES:
        hbuf = torch.empty(2 * H, device=r.device)
        initial = torch.arange(H, dtype=torch.float32, device=r.device)

        def setup() -> None:
            r.counter.zero_()
            hbuf[:H].copy_(initial)

        cfg = k.config(sm_count, BLOCK, shared=4 * H, cooperative=True)
        out[H] = r.per_step_us("grid_exchange", cfg, lambda s: runtime.kernel_args(hbuf, H, r.counter, s, r.status), setup)
        setup()
        runtime.launch(k, cfg, *runtime.kernel_args(hbuf, H, r.counter, r.cfg.steps, r.status))
        runtime.check_status(r.status, "grid_exchange")
        S = r.cfg.steps
        _check_state(hbuf[(S & 1) * H : (S & 1) * H + H], H, S, f"grid_exchange H={H}")
    return out


def cluster_barriers(r: Runner, max_cluster: int) -> dict[int, float]:
    k = r.kernel("cluster_barrier")
    return {
        n: r.per_step_us("cluster_barrier", k.config(n, BLOCK, cluster=n), lambda s: runtime.kernel_args(s))
        for n in range(2, max_cluster + 1)
    }


def cluster_exchanges(r: Runner, max_cluster: int) -> dict[str, dict[int, dict[int, dict[int, float]]]]:
    """Per-step exchange cost, indexed [kernel][threads per block][H][cluster size]."""
    import torch

    out: dict[str, dict] = {"cluster_exchange_dsmem": {}, "cluster_exchange_stasync": {}}
    for name, table in out.items():
        k = r.kernel(name)
        with_status = name.endswith("stasync")
        for block in EXCHANGE_BLOCKS:
            table[block] = {}
            for H in STATE_SIZES:
                table[block][H] = {}
                for n in (c for c in EXCHANGE_CLUSTERS if c <= max_cluster):
                    state = torch.full((H,), float("nan"), device=r.device)  # poisoned
                    cfg = k.config(n, block, shared=exchange_shared_bytes(name, H), cluster=n)

                    def make_args(s, state=state, H=H):
                        return runtime.kernel_args(state, H, s, r.status) if with_status else runtime.kernel_args(state, H, s)

                    table[block][H][n] = r.per_step_us(name, cfg, make_args)
                    state.fill_(float("nan"))
                    runtime.launch(k, cfg, *make_args(r.cfg.steps))
                    runtime.check_status(r.status, name)
                    _check_state(state, H, r.cfg.steps, f"{name} H={H} cluster={n} block={block}")
    return out


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
    result: dict[str, Any] = {"environment": environment(), "device": dataclasses.asdict(facts), "config": dataclasses.asdict(cfg)}
    max_cluster = r.kernel("cluster_barrier").max_cluster_size(BLOCK)
    result["max_cluster_size"] = max_cluster
    stages += [
        ("cluster barriers", lambda: {"cluster_barrier": cluster_barriers(r, max_cluster)}),
        ("cluster exchanges", lambda: cluster_exchanges(r, max_cluster)),
        ("cluster residency", lambda: {"max_resident_clusters": residency(r, max_cluster)}),
    ]
    for label, stage in _progress(stages, progress):
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
