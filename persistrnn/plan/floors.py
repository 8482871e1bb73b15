"""Synchronisation floors: what a persistent kernel pays to end one timestep,
measured on the current GPU with the kernels of ``sync_bench.cu``.

The cost model (:mod:`.model`) calibrates its exchange terms from these
measurements: the grid's counter barrier by block count, the barrier plus a
broadcast of h through L2 by floats, and st.async exchanges within a cluster
by threads, floats and cluster size. The benchmark suite
``python -m persistrnn bench sync`` runs the same measurements (and a few
more that only its table reports) and prints them.

Method. Each barrier kernel runs ``steps`` and ``steps // 10`` steps inside
one launch; the per-step cost is the difference of the two times over the
difference of the step counts, which cancels the launch and the prologue.
Each time is the median of ``repeats`` CUDA-event timings after ``warmup``
launches. The exchange kernels compute a checkable recurrence whose final
state is compared exactly with the host's before any number is returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .. import runtime
from ..errors import ArgumentError

__all__ = ["BLOCK", "EXCHANGE_BLOCKS", "EXCHANGE_CLUSTERS", "STATE_SIZES", "Runner", "SyncConfig", "check_state",
           "cluster_exchanges", "exchange_shared_bytes", "expected_state", "grid_barriers", "grid_block_counts",
           "grid_exchange", "sync_binary"]

BLOCK = 256  # threads per block in every sync kernel: a typical persistent block
STATE_SIZES = (256, 1024, 4096)  # H: floats of state exchanged per step
EXCHANGE_CLUSTERS = (2, 4, 8, 16)  # H must divide by 4 * cluster size
# Threads per block for the exchanges: every thread waits, so the cost grows
# with the block; a persistent RNN block holding weights in registers is large.
EXCHANGE_BLOCKS = (32, 256, 1024)


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
    launches: int = 2_000  # for the back-to-back launch gap (the suite's table only)

    def __post_init__(self) -> None:
        for name in ("steps", "repeats", "launches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ArgumentError(f"{name} must be a positive int, got {value!r}")
        if self.steps < 20:
            raise ArgumentError(f"steps must be >= 20 so that steps // 10 differs from steps, got {self.steps}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ArgumentError(f"warmup must be a non-negative int, got {self.warmup!r}")


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

    def watch(self) -> tuple[Any, Any, Any]:
        """The arguments a sync kernel that waits takes from ``int* status``
        on: the status word, the report word, the wait bound.

        The report word is null: these measurements read the status word
        themselves (:func:`persistrnn.runtime.check_status`, after each
        kernel), so a failure here must not also be left in the process's
        report word, where the next module call would raise it a second time.
        The bound is the library's current one, read at each launch."""
        import numpy as np

        return self.status, np.uint64(0), np.uint64(runtime.wait_timeout_ns())

    def per_step_us(self, name: str, config: Any, make_args: Callable[[int], tuple],
                    setup: Callable[[], None] | None = None) -> float:
        k = self.kernel(name)
        us = runtime.per_iteration_us(lambda steps: runtime.launch(k, config, *make_args(steps)), self.cfg.steps,
                                      warmup=self.cfg.warmup, repeats=self.cfg.repeats, setup=setup)
        runtime.check_status(self.status, name)
        return us

    def zero_counter(self) -> None:
        self.counter.zero_()


def check_state(got: Any, H: int, steps: int, what: str) -> None:
    """Raise unless ``got`` is exactly the recurrence's state after ``steps`` steps."""
    import torch

    want = torch.tensor(expected_state(H, steps), device=got.device)
    if not torch.equal(got, want):
        bad = int((got != want).sum())
        raise AssertionError(f"{what}: {bad} of {H} state values wrong after {steps} steps (an ordering bug)")


def grid_block_counts(sm_count: int) -> list[int]:
    counts = [b for b in (8, 16, 32, 64, 128) if b < sm_count]
    return counts + [sm_count]


def grid_barriers(r: Runner, sm_count: int) -> dict[str, dict[int, float]]:
    """µs per grid barrier by block count: cooperative groups' grid.sync and
    our counter barrier (the one the grid kernels use)."""
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
            lambda s: runtime.kernel_args(r.counter, s, *r.watch()),
            setup=r.zero_counter,
        )
    return out


def grid_exchange(r: Runner, sm_count: int) -> dict[int, float]:
    """µs per counter barrier plus broadcast of H floats through L2, on every SM, by H."""
    import torch

    k = r.kernel("grid_exchange")
    out = {}
    for H in STATE_SIZES:
        hbuf = torch.empty(2 * H, device=r.device)
        initial = torch.arange(H, dtype=torch.float32, device=r.device)

        def setup(hbuf: Any = hbuf, H: int = H, initial: Any = initial) -> None:
            r.counter.zero_()
            hbuf[:H].copy_(initial)

        def make_args(steps: int, hbuf: Any = hbuf, H: int = H) -> tuple:
            return runtime.kernel_args(hbuf, H, r.counter, steps, *r.watch())

        cfg = k.config(sm_count, BLOCK, shared=4 * H, cooperative=True)
        out[H] = r.per_step_us("grid_exchange", cfg, make_args, setup)
        setup()
        runtime.launch(k, cfg, *make_args(r.cfg.steps))
        runtime.check_status(r.status, "grid_exchange")
        S = r.cfg.steps
        check_state(hbuf[(S & 1) * H : (S & 1) * H + H], H, S, f"grid_exchange H={H}")
    return out


def cluster_exchanges(r: Runner, max_cluster: int) -> dict[str, dict[int, dict[int, dict[int, float]]]]:
    """Per-step exchange cost, indexed [kernel][threads per block][H][cluster size]."""
    import torch

    out: dict[str, dict] = {"cluster_exchange_dsmem": {}, "cluster_exchange_stasync": {}}
    for name, table in out.items():
        k = r.kernel(name)
        waits = name.endswith("stasync")  # the DSMEM kernel waits in cluster.sync only: no status
        for block in EXCHANGE_BLOCKS:
            table[block] = {}
            for H in STATE_SIZES:
                table[block][H] = {}
                for n in (c for c in EXCHANGE_CLUSTERS if c <= max_cluster):
                    state = torch.full((H,), float("nan"), device=r.device)  # poisoned
                    cfg = k.config(n, block, shared=exchange_shared_bytes(name, H), cluster=n)

                    def make_args(s: int, state: Any = state, H: int = H, waits: bool = waits) -> tuple:
                        return (runtime.kernel_args(state, H, s, *r.watch()) if waits
                                else runtime.kernel_args(state, H, s))

                    table[block][H][n] = r.per_step_us(name, cfg, make_args)
                    state.fill_(float("nan"))
                    runtime.launch(k, cfg, *make_args(r.cfg.steps))
                    runtime.check_status(r.status, name)
                    check_state(state, H, r.cfg.steps, f"{name} H={H} cluster={n} block={block}")
    return out
