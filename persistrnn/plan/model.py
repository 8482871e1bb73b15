"""The planner's cost model (GRNN §7): ranks configurations by a per-step cost.

The cost of one time step, in µs, is the sum of terms that cannot overlap
(each phase waits for the last):

* **product**, the partial dot products and their reduction. GRNN writes it
  as an FMA baseline over fitted speed-ups: a thread's sequential FMAs times
  the cost of one FMA with one warp per scheduler and no reuse, divided by the
  speed-up that more warps per scheduler and more reuse (rows per work group x
  batch columns per weight load) buy. The speed-ups are not separable on this
  GPU (a saturated FMA pipe makes them multiply to less than their product),
  so they are fitted as one table over (warps per scheduler, rows, batch
  tile, work-group size, weight placement) from :data:`PRODUCT_BENCH`, the
  kernel's own ``prnn_group_product`` timed on one SM. The reduction is the
  per-product fixed part of the same fit: ``log2(group size)`` shuffle rounds
  over the rows' sums. The mma path has its own table, per warp and
  m-tiles per warp.
* **pointwise and block barriers**, from the same micro-benchmarks.
* **exchange**, per sync mode, from the sync calibration
  (:mod:`.floors`): st.async pushes within a cluster by cluster
  size, threads and floats exchanged; the grid's counter barrier by block
  count plus its broadcast of h through L2 by floats.

Calibration runs once per device and is cached on disk, keyed by device name,
SM count and package version (:func:`calibration`). The FFMA products are
measured by batch tile as plans first need them: a plan at batch 1 ranks
tile 1 only, and the calibration's compiles of the other tiles (~80% of its
programs' compile time) wait for a plan at a larger batch (perf-notes §70).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator, TypeVar

from .. import __version__, runtime
from ..errors import ArgumentError, CalibrationError
from ..log import logger
from ..progress import track
from ..persistent import KernelConfig, WARP
from .space import next_power_of_two

SCHEDULERS_PER_SM = 4  # warp schedulers (SM sub-partitions) of every SM since Volta; no device query returns it
WARPS_PER_SCHEDULER = (1, 2, 4, 8)  # blocks of 128-1024 threads
BENCH_ROWS = (1, 2, 4, 8)  # rows per work group (and mma m-tiles per warp) the benches run
BENCH_TILES = (1, 2, 4, 8)
BENCH_GROUPS = (2, 8, 32)
MEASURE_ATTEMPTS = 5
BENCH_CHUNKS = (4, 16)  # two chunk counts separate the per-chunk cost from the fixed part
MMA_CHUNKS = (1, 3)  # k tiles of the mma bench (8 m-tiles x 3 k tiles of A fragments fit in registers)
# Loop lengths of the calibration's timings (each also runs a tenth as long,
# and the difference is kept). Half of 2000 / 4000 measured as close to them
# as two runs at 2000 / 4000 are to each other (entries within 7% at p90; the
# cost model's top 5 of six shapes kept alike), in half the time: the
# calibration 9.0 -> 6.5-7.1 s on an H100 (perf-notes §69).
BENCH_ITERATIONS = 1000
MIN_LOOP_US = 20.0  # what a timed loop's iterations must add over its short run's, to stand out of a launch's jitter
SYNC_STEPS = 2000  # steps of each sync floor's long run (the short one runs a tenth)
CALIBRATION_FORMAT = 3


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured costs of one device, in ns (product, pointwise, barrier) or µs
    (exchange). Tables are keyed by comma-joined integers so they survive JSON.

    clock_mhz: the SM clock the device reports (for the FMA issue bound)
    product: "w,rows,tile,group,shared,chunks" -> ns per product of ``chunks``
        column chunks per lane (the two chunk counts of :data:`BENCH_CHUNKS`),
        for the batch tiles measured so far (:attr:`tiles`)
    mma: "w,m_tiles" -> ns per mma per warp
    pointwise: "w" -> ns per pointwise pass (one LSTM element per thread)
    barrier: "w" -> ns per __syncthreads
    cluster_exchange: "threads,floats,cluster" -> µs per st.async exchange
    grid_barrier: "blocks" -> µs per counter barrier
    grid_exchange: "floats" -> µs per barrier + broadcast of h, all SMs
    """

    device: str
    sm_count: int
    version: str
    clock_mhz: float
    product: dict[str, float]
    mma: dict[str, float]
    pointwise: dict[str, float]
    barrier: dict[str, float]
    cluster_exchange: dict[str, float]
    grid_barrier: dict[str, float]
    grid_exchange: dict[str, float]
    format: int = CALIBRATION_FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ArgumentError(f"not a calibration of format {CALIBRATION_FORMAT}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise ArgumentError(f"calibration fields differ: expected {sorted(fields)}, got {sorted(data)}")
        return cls(**data)

    @property
    def tiles(self) -> frozenset[int]:
        """The batch tiles whose FFMA products are measured."""
        return frozenset(_tile_of(key) for key in self.product)


def _tile_of(product_key: str) -> int:
    """The batch tile of a key of :attr:`Calibration.product` ("w,rows,tile,...")."""
    return int(product_key.split(",")[2])


def tiles_for(batch: int | None) -> frozenset[int]:
    """The bench tiles the FFMA configurations of a plan at ``batch`` use (the
    space's rule: tile 1, and the tiles up to the batch's next power of two);
    None: every bench tile."""
    if batch is None:
        return frozenset(BENCH_TILES)
    return frozenset(t for t in BENCH_TILES if t == 1 or t <= next_power_of_two(batch))


def product_tile(config: KernelConfig) -> int | None:
    """The batch tile whose FFMA products price ``config``; None for the mma
    path, priced by its own table (one sync and pipelines are FFMA only)."""
    return config.batch_tile if config.math == "ffma" else None


def _key(*values: int) -> str:
    return ",".join(str(v) for v in values)


def _interp_log2(points: dict[int, float], x: float, extrapolate_linear: bool = True) -> float:
    """Piecewise-linear interpolation of ``points`` in log2(x). Above the last
    point the cost grows in proportion to x (a saturated pipe); below the first
    it stays at the first."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]] * (x / xs[-1] if extrapolate_linear else 1.0)
    for lo, hi in zip(xs, xs[1:]):
        if lo <= x <= hi:
            f = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return points[lo] + f * (points[hi] - points[lo])
    raise AssertionError("unreachable")


def _interp_linear(points: dict[int, float], x: float) -> float:
    """Linear in x, extended by the last segment's slope above the last point."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return points[lo] + (x - lo) * (points[hi] - points[lo]) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return points[hi] + (x - hi) * (points[hi] - points[lo]) / (hi - lo)


def _table(table: dict[str, float], prefix: tuple[int, ...]) -> dict[int, float]:
    """The slice of ``table`` whose leading key fields equal ``prefix``, keyed by the next field."""
    n = len(prefix)
    out = {}
    for key, value in table.items():
        fields = tuple(int(v) for v in key.split(","))
        if fields[:n] == prefix and len(fields) == n + 1:
            out[fields[n]] = value
    if not out:
        raise CalibrationError(f"calibration has no entries for {prefix}")
    return out


def _entry(table: dict[str, float], w: int, rows: int, *rest: int) -> float:
    """``table[w, rows, *rest]``. Where the bench could not run that block
    (registers or shared memory), the measured entry with the most warps and
    rows not above these, scaled by both ratios (the pipe is saturated there)."""
    for measured_w in (v for v in reversed(WARPS_PER_SCHEDULER) if v <= w):
        for measured_rows in (r for r in reversed(BENCH_ROWS) if r <= rows):
            key = _key(measured_w, measured_rows, *rest)
            if key in table:
                return table[key] * (w / measured_w) * (rows / measured_rows)
    raise CalibrationError(f"calibration has no entry for {_key(w, rows, *rest)}")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted µs per time step of one configuration, by term, summed over
    the consecutive launches (grid sync) or waves of batch slices (more
    slices than the SMs hold at once) a batch needs."""

    product: float
    pointwise: float
    barriers: float
    exchange: float
    launches: int = 1
    waves: int = 1

    @property
    def total(self) -> float:
        return self.product + self.pointwise + self.barriers + self.exchange

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.product + other.product, self.pointwise + other.pointwise,
                        self.barriers + other.barriers, self.exchange + other.exchange,
                        self.launches + other.launches, self.waves)

    def times(self, waves: int) -> "StepCost":
        """``waves`` of this cost, one after another."""
        return StepCost(self.product * waves, self.pointwise * waves, self.barriers * waves, self.exchange * waves,
                        self.launches, self.waves * waves)


class CostModel:
    """Per-step cost of a configuration on a calibrated device."""

    def __init__(self, calibration: Calibration, facts: runtime.DeviceFacts) -> None:
        self.cal = calibration
        self.facts = facts
        self._cache: dict[tuple, float] = {}
        self._tiles = calibration.tiles

    def cover(self, configs: Iterable[KernelConfig]) -> None:
        """Calibrate the batch tiles ``configs`` need that this model's
        calibration lacks (measured now, once per device). Inside a CUDA-graph
        capture nothing can be timed: the configurations this model cannot
        price stay unpriced (:meth:`prices`)."""
        missing = {product_tile(c) for c in configs} - {None} - self._tiles
        if missing and not _capturing():
            self.cal = calibration(progress=False, tiles=missing | self._tiles)
            self._tiles = self.cal.tiles

    def prices(self, config: KernelConfig) -> bool:
        """Whether the calibration holds every entry ``config``'s cost reads."""
        tile = product_tile(config)
        return tile is None or tile in self._tiles

    # ---- fitted terms --------------------------------------------------------

    def _product_ns(self, w: int, rows: int, tile: int, group: int, chunks: int, shared: bool) -> float:
        """One product: ``chunks`` column chunks per lane over ``rows`` rows and
        ``tile`` batch columns, reduced over ``group`` lanes."""
        key = (w, rows, tile, group, chunks, shared)
        if key not in self._cache:
            lo, hi = BENCH_CHUNKS

            def split(r: int, g: int) -> tuple[float, float]:
                """(ns per chunk, fixed ns) at bench rows r and group g. A chunk
                costs at least its FMA issue slots: w warps x r x tile FFMAs,
                one warp instruction per clock per scheduler (the two-point
                slope is noisy where latency hides the chunks)."""
                t_lo = _entry(self.cal.product, w, r, tile, g, int(shared), lo)
                t_hi = _entry(self.cal.product, w, r, tile, g, int(shared), hi)
                per_chunk = max((t_hi - t_lo) / (hi - lo), w * r * tile * 1e3 / self.cal.clock_mhz)
                return per_chunk, max(t_lo - lo * per_chunk, 0.0)

            def at(g: int) -> float:
                by_rows = {}
                for r in BENCH_ROWS:
                    per_chunk, fixed = split(r, g)
                    by_rows[r] = chunks * per_chunk + fixed
                return _interp_log2(by_rows, rows)

            self._cache[key] = _interp_log2({g: at(g) for g in BENCH_GROUPS}, group, False)
        return self._cache[key]

    def _mma_ns(self, w: int, m_tiles: int) -> float:
        # Per mma, so constant once the tensor pipe is saturated.
        return _interp_log2({m: _entry(self.cal.mma, w, m) for m in BENCH_ROWS}, m_tiles, False)

    def exchange_us(self, config: KernelConfig, floats: int) -> float:
        """One exchange of ``floats`` per block (the whole state every block reads)."""
        if config.sync == "single":
            return 0.0
        key = ("exchange", config.sync, config.blocks, config.threads, floats)
        if key not in self._cache:  # the interpolation over the calibration's tables dominated ranking time
            self._cache[key] = self._exchange_us(config, floats)
        return self._cache[key]

    def _exchange_us(self, config: KernelConfig, floats: int) -> float:
        if config.sync == "cluster":
            # Every thread pushes and waits: interpolate in log2(threads)
            # between the block sizes the sync bench ran.
            by_threads = {}
            for threads in sorted({int(k.split(",")[0]) for k in self.cal.cluster_exchange}):
                by_floats = {}
                for f in sorted({int(k.split(",")[1]) for k in self.cal.cluster_exchange}):
                    by_floats[f] = _interp_log2(_table(self.cal.cluster_exchange, (threads, f)), config.blocks, False)
                by_threads[threads] = _interp_linear(by_floats, floats)
            return _interp_log2(by_threads, config.threads, False)
        barrier = _table(self.cal.grid_barrier, ())
        full = self.facts.sm_count
        # The bench reads H floats back with 256 threads, one float each per
        # load; the kernel reads with all its threads, a float4 each: the
        # same number of loads per thread as the bench at 64 * floats / threads.
        bench_floats = floats * 256 / (4 * config.threads)
        return (_interp_linear(_table(self.cal.grid_exchange, ()), bench_floats)
                + _interp_linear(barrier, config.blocks) - _interp_linear(barrier, full))

    # ---- the step ------------------------------------------------------------

    def step_cost(self, config: KernelConfig, batch: int, batch_slice: int | None = None) -> StepCost:
        """Predicted cost of one step of ``batch`` sequences in slices of
        ``batch_slice`` (None: as many as a block holds), as
        :func:`persistrnn.persistent.run_instances` runs them: single and
        cluster sync run every slice at once on its own blocks, in waves
        where the SMs hold fewer (a block owns an SM); grid sync runs one
        slice per launch, one launch after another."""
        most = config.max_batch(self.facts.shared_per_block_optin)
        per_slice = min(batch_slice or most, most, batch)
        if config.sync != "grid":
            slices = -(-batch // per_slice)
            at_once = max(1, self.facts.sm_count // (config.blocks * config.instances))
            return self._launch_cost(config, per_slice).times(-(-slices // at_once))
        full, rest = divmod(batch, per_slice)
        total = None
        for nb in [per_slice] * full + ([rest] if rest else []):
            cost = self._launch_cost(config, nb)
            total = cost if total is None else total + cost
        return total

    def _rows_ns(self, config: KernelConfig, w: int, rows: int, per_launch: int) -> float:
        """ns of an FFMA product of ``rows`` rows per work group over the batch:
        the register chunks, plus the shared ones."""
        tile, group = config.batch_tile, config.group_size
        ns = self._product_ns(w, rows, tile, group, config.register_k, False)
        if config.shared_k_chunks:
            ns += self._product_ns(w, rows, tile, group, config.shared_k_chunks, True)
        return math.ceil(per_launch / tile) * ns

    def _launch_cost(self, config: KernelConfig, per_launch: int) -> StepCost:
        w = max(1, config.threads // WARP // SCHEDULERS_PER_SM)
        spec = config.spec
        bp = config.batch_stride(per_launch)
        product = 0.0
        for s in range(len(config.stages)):
            if config.math == "mma":
                # TF32 runs two m16n8k8 per 16-column tile, where 16-bit runs one m16n8k16
                sequential = (config.m_tiles_per_warp(s) * config.k_tiles_per_warp * math.ceil(per_launch / 8)
                              * (2 if config.tf32 else 1))
                product += sequential * self._mma_ns(w, config.m_tiles_per_warp(s))
                continue
            product += self._rows_ns(config, w, config.rows_per_group(s), per_launch)
        if config.pipeline:  # the next layer's input product, on the same operand
            product += self._rows_ns(config, w, config.next_rows_per_group, per_launch)
        elements = config.units_per_block * per_launch
        passes = math.ceil(elements / config.threads)
        # A pass is latency-bound with few elements: it costs what the bench
        # measured with as many warps per scheduler as the pass keeps busy.
        busy = min(w, max(1, math.ceil(min(elements, config.threads) / WARP / SCHEDULERS_PER_SM)))
        busy = max(v for v in WARPS_PER_SCHEDULER if v <= busy)
        pointwise_ns = self.cal.pointwise[str(busy)] * spec.num_gates / 4  # the bench runs one 4-gate element
        exchanges = 1 if config.one_sync else spec.num_stages
        pointwise = exchanges * passes * pointwise_ns
        # The fused step has no barrier between product and pointwise; a
        # tagged grid exchange none before its poll (its read ends in one).
        grid_barriers = 3 - config.tagged_exchange
        barriers = (exchanges * ((grid_barriers if config.sync == "grid" else 2) - config.fused_step)
                    * self.cal.barrier[str(w)])
        floats = config.hidden_size * bp
        exchange = exchanges * self.exchange_us(config, floats)
        if config.one_sync:
            # The column product of U_r, the partial sums of every block in
            # each exchange, and r * h summed from them for every unit.
            chunks = math.ceil(per_launch / config.batch_tile)
            product += chunks * self._product_ns(w, config.column_rows_per_group, config.batch_tile,
                                                 config.group_size, config.column_chunks, False)
            if config.sync == "cluster":
                partials = config.blocks * config.partial_rows * bp
                exchange += self.exchange_us(config, floats + partials) - self.exchange_us(config, floats)
            pointwise += math.ceil(config.hidden_size * per_launch / config.threads) * pointwise_ns
            barriers += 2 * self.cal.barrier[str(w)]
        return StepCost(product / 1e3, pointwise / 1e3, barriers / 1e3, exchange)

    def rank(self, configs: list[KernelConfig], batch: int,
             batch_slice: int | None = None) -> list[tuple[float, KernelConfig]]:
        """(predicted µs per step, config), cheapest first; ties keep enumeration order."""
        scored = [(self.step_cost(c, batch, batch_slice).total, i, c) for i, c in enumerate(configs)]
        scored.sort(key=lambda x: (x[0], x[1]))
        return [(cost, c) for cost, _, c in scored]


# ----------------------------------------------------------------------------
# Calibration: micro-benchmarks on this device, cached on disk
# ----------------------------------------------------------------------------


def bench_binary(program: tuple[int, int, int, int], arch: str | None = None) -> runtime.CompiledBinary:
    """One micro-benchmark program: (mma, tile, group, chunks). mma 0: every
    rows x placement product kernel at that tile, group and chunk count; mma 1:
    the mma kernels at ``chunks`` k tiles, and the barrier and pointwise ones."""
    mma, tile, group, chunks = program
    source = runtime.read_source("model_bench.cu", includes=("common.cuh", "group_product.cuh"))
    return runtime.compile_source("model_bench", source, arch=arch,
                                  defines={"PRNN_BENCH_MMA": mma, "PRNN_BT": tile, "PRNN_WGS": group,
                                           "PRNN_KCH": chunks, "PRNN_THREADS": "((int)blockDim.x)"})


def bench_programs(tiles: Iterable[int] = BENCH_TILES, whole: bool = True) -> list[tuple[int, int, int, int]]:
    """(mma, tile, group, chunks) of the micro-benchmark programs of the
    FFMA products at ``tiles``, and where ``whole``, the mma, barrier and
    pointwise ones; the heaviest to compile first (ptxas's time grows with
    the unrolled product: 16 column chunks of tile 8 took ~6x as long as 4
    chunks of tile 1), so that the last to finish compiling is a light one."""
    ffma = [(0, t, g, k) for t in sorted(tiles) for g in BENCH_GROUPS for k in BENCH_CHUNKS]
    return sorted(ffma, key=lambda p: -p[1] * p[3]) + ([(1, 1, 1, k) for k in MMA_CHUNKS] if whole else [])


def compile_calibration(arch: str | None = None, tiles: Iterable[int] = BENCH_TILES,
                        whole: bool = True) -> tuple[Future | None, dict[tuple[int, int, int, int], Future]]:
    """Where ``whole``, the sync floors' binary; then the micro-benchmark
    programs of :func:`bench_programs`, compiling in threads. Each future is
    done as soon as its own binary is built, and the calibration times each
    program as it is built: the compiles (~6 s of a fresh H100 machine's host
    for every tile) are the calibration's longest part (perf-notes §69)."""
    from . import floors

    programs = bench_programs(tiles, whole)
    ahead = {p: _AHEAD[p, arch] for p in programs if (p, arch) in _AHEAD}
    rest = [p for p in programs if p not in ahead]
    builds = [functools.partial(floors.sync_binary, arch)] if whole else []
    builds += [functools.partial(bench_binary, p, arch=arch) for p in rest]
    futures = runtime.submit_in_threads(lambda build: build(), builds)
    sync = futures.pop(0) if whole else None
    return sync, {**ahead, **dict(zip(rest, futures))}


# (program, arch) -> the future of its binary, compiled ahead of need
_AHEAD: dict[tuple[tuple[int, int, int, int], str | None], Future] = {}
_AHEAD_LOCK = threading.Lock()


def compile_ahead(tiles: Iterable[int], arch: str | None = None) -> None:
    """Compile the FFMA programs of ``tiles`` into the disk cache in the
    background (:func:`runtime.submit_in_background`), once per process: a
    later plan that needs those tiles then times them without waiting for
    ptxas (tile 8's programs alone took ~5 s of an H100 machine's host;
    perf-notes §70)."""
    with _AHEAD_LOCK:
        programs = [p for p in bench_programs(tiles, whole=False) if (p, arch) not in _AHEAD]
        if programs:
            futures = runtime.submit_in_background(functools.partial(bench_binary, arch=arch), programs)
            _AHEAD.update(zip(((p, arch) for p in programs), futures))


K = TypeVar("K", bound=Hashable)


def as_built(groups: dict[K, list[Future]]) -> Iterator[K]:
    """The keys of ``groups``, each as soon as all its futures are done."""
    pending = dict(groups)
    while pending:
        done = [key for key, futures in pending.items() if all(f.done() for f in futures)]
        if not done:
            wait([f for futures in pending.values() for f in futures if not f.done()], return_when=FIRST_COMPLETED)
        for key in done:
            del pending[key]
            yield key


def loop_ns(run: Callable[[int], None], kernel: str) -> float:
    """ns per iteration of the loop ``run(n)`` launches (n iterations).

    A difference of two timings of one launch each, which a launch's jitter
    (a few µs) or a clock that ramps up between them (an idle H100 sat at
    345 MHz) can swamp: a loop whose iterations add less than MIN_LOOP_US
    (or nothing) is measured again, 4x as long. At 1000 iterations the mma
    bench's one m-tile added ~10 µs and gave no positive difference five
    times in a row on a fresh H100 (perf-notes §70)."""
    iterations = BENCH_ITERATIONS
    for _ in range(MEASURE_ATTEMPTS):
        ns = 1e3 * runtime.per_iteration_us(run, iterations, warmup=1, repeats=5)
        if ns * (iterations - iterations // 10) >= MIN_LOOP_US * 1e3:
            return ns
        iterations *= 4
    raise CalibrationError(f"{kernel}: {MEASURE_ATTEMPTS} timings, up to {iterations // 4} iterations, gave no time "
                           "per iteration above a launch's jitter (the GPU's clock kept changing); calibrate again "
                           "on an idle GPU")


def _measure_micro(compiling: dict[tuple[int, int, int, int], Future], progress: bool,
                   tiles: Iterable[int] = BENCH_TILES, whole: bool = True) -> dict[str, dict[str, float]]:
    """The FFMA products at ``tiles``; where ``whole``, the mma, pointwise and
    barrier tables too."""
    import torch

    dev = torch.device("cuda")
    max_threads = 128 * WARPS_PER_SCHEDULER[-1]
    sink = torch.empty(max_threads, device=dev)
    inputs = torch.rand(max_threads * max(BENCH_ROWS) * max(BENCH_CHUNKS) * 4, device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))

    def per_iteration_ns(program: tuple, kernel: str, threads: int, shared: int) -> float | None:
        """ns per iteration, or None where the block cannot run (registers or shared memory)."""
        k = runtime.get_kernel(compiling[program].result(), kernel)
        if (shared > runtime.device_facts().shared_per_block_optin or k.max_resident_blocks(threads, shared) < 1
                or k.resources.uses_local_memory):  # a spilled bench would time local memory, not the product
            return None
        config = k.config(1, threads, shared=shared)
        return loop_ns(lambda n: runtime.launch(k, config, *runtime.kernel_args(inputs, sink, n)), kernel)

    def mma_per_op(times: dict[int, float | None], per: int) -> float | None:
        """ns per mma from times at two k-tile counts (``per`` m tiles each)."""
        (lo, t_lo), (hi, t_hi) = sorted(times.items())
        if t_lo is None or t_hi is None:
            return None
        return max((t_hi - t_lo) / ((hi - lo) * per), 1e-3)

    product, mma, pointwise, barrier = {}, {}, {}, {}
    pairs = {(t, g): [compiling[0, t, g, k] for k in BENCH_CHUNKS] for t in sorted(tiles) for g in BENCH_GROUPS}
    for tile, group in track(as_built(pairs), progress, "calibrating the FFMA product", total=len(pairs)):
        for rows, shared, w in itertools.product(BENCH_ROWS, (0, 1), WARPS_PER_SCHEDULER):
            threads = 128 * w
            name = f"prnn_product_bench_R{rows}_{'shared' if shared else 'reg'}"
            times = {k: per_iteration_ns((0, tile, group, k), name, threads,
                                         4 * (k * group * tile + threads // group * rows * tile
                                              + (k * rows * threads if shared else 0)))
                     for k in BENCH_CHUNKS}
            if None not in times.values():
                for k, ns in times.items():
                    product[_key(w, rows, tile, group, shared, k)] = ns
    if not whole:
        return {"product": product}
    for m in BENCH_ROWS:
        for w in WARPS_PER_SCHEDULER:
            per_op = mma_per_op({k: per_iteration_ns((1, 1, 1, k), f"prnn_mma_bench_M{m}", 128 * w,
                                                     4 * k * 16 * 12) for k in MMA_CHUNKS}, per=m)
            if per_op is not None:
                mma[_key(w, m)] = per_op
    for w in WARPS_PER_SCHEDULER:
        threads = 128 * w
        program = (1, 1, 1, MMA_CHUNKS[0])
        barrier[str(w)] = per_iteration_ns(program, "prnn_barrier_bench", threads, 0)
        pointwise[str(w)] = per_iteration_ns(program, "prnn_pointwise_bench", threads, 4 * 5 * threads)
    return {"product": product, "mma": mma, "pointwise": pointwise, "barrier": barrier}


def _measure_sync(compiling: Future) -> dict[str, dict[str, float]]:
    from . import floors  # in the library: calibrating needs nothing outside it

    compiling.result()  # the Runner's own compile is then a cache hit
    r = floors.Runner(floors.SyncConfig(steps=SYNC_STEPS, repeats=3, warmup=1))
    facts = runtime.device_facts()
    max_cluster = r.kernel("cluster_barrier").max_cluster_size(floors.BLOCK)
    stasync = floors.cluster_exchanges(r, max_cluster)["cluster_exchange_stasync"]
    return {
        "cluster_exchange": {_key(t, f, n): us for t, by_f in stasync.items() for f, by_n in by_f.items()
                             for n, us in by_n.items()},
        "grid_barrier": {str(b): us
                         for b, us in floors.grid_barriers(r, facts.sm_count)["grid_barrier_counter"].items()},
        "grid_exchange": {str(f): us for f, us in floors.grid_exchange(r, facts.sm_count).items()},
    }


def _measure(tiles: Iterable[int], whole: bool, progress: bool) -> dict[str, dict[str, float]]:
    import torch

    tiles = sorted(tiles)
    sync, programs = compile_calibration(tiles=tiles, whole=whole)
    # Steady clocks before the first timing (an idle H100 sits at 345 MHz):
    # a GEMM loop while the first binaries compile.
    square = torch.rand(2048, 2048, device="cuda")
    runtime.warm_up(functools.partial(torch.mm, square, square))
    tables = _measure_sync(sync) if whole else {}
    tables.update(_measure_micro(programs, progress, tiles, whole))
    return tables


def measure_calibration(progress: bool = True, tiles: Iterable[int] = BENCH_TILES) -> Calibration:
    """Run the micro-benchmarks on the current GPU: the sync floors, the mma,
    pointwise and barrier tables, and the FFMA products at ``tiles`` (~7 s on
    an H100 for every tile: the programs compile in threads while the first
    ones are timed; perf-notes §69)."""
    from cuda.core import Device

    facts = runtime.device_facts()
    tables = _measure(tiles, True, progress)
    clock_mhz = Device(facts.index).properties.clock_rate / 1e3
    return Calibration(device=facts.name, sm_count=facts.sm_count, version=__version__, clock_mhz=clock_mhz, **tables)


def extend_calibration(cal: Calibration, tiles: Iterable[int], progress: bool = True) -> Calibration:
    """``cal`` with the FFMA products at ``tiles`` measured now."""
    measured = _measure(tiles, False, progress)["product"]
    return dataclasses.replace(cal, product={**cal.product, **measured})


def calibration_path(facts: runtime.DeviceFacts) -> Path:
    name = re.sub(r"[^A-Za-z0-9]+", "-", facts.name).strip("-")
    return runtime.cache_dir() / "calibration" / f"{name}-{facts.sm_count}sm-{__version__}.json"


def load_calibration(path: Path) -> Calibration | None:
    """The calibration stored at ``path``, or None if it is missing or unreadable."""
    try:
        return Calibration.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_CALIBRATING = threading.Lock()  # one thread of a process measures; the others wait for its tables


def _stored(path: Path, facts: runtime.DeviceFacts) -> Calibration | None:
    cal = load_calibration(path)
    return cal if cal is not None and cal.device == facts.name and cal.sm_count == facts.sm_count else None


def calibration(*, progress: bool = True, refresh: bool = False, tiles: Iterable[int] | None = None) -> Calibration:
    """This device's calibration, holding at least the FFMA products at batch
    ``tiles`` (None: every bench tile): from the disk cache, extended by the
    tiles it lacks, or measured now; stored either way."""
    wanted = tiles_for(None) if tiles is None else frozenset(tiles)
    if not wanted <= tiles_for(None):
        raise ArgumentError(f"tiles: expected a subset of {sorted(BENCH_TILES)}, got {sorted(wanted)}")
    facts = runtime.device_facts()
    path = calibration_path(facts)
    capturing = _capturing()
    with _CALIBRATING:
        cached = None if refresh else _stored(path, facts)
        # Inside a capture a partial calibration serves: the ranking leaves out what it cannot price.
        if cached is not None and (wanted <= cached.tiles or capturing):
            return cached
        if capturing:
            raise CalibrationError(f"{facts.name} has no calibration yet, and nothing can be timed inside a "
                                   "CUDA-graph capture: call the module once before capturing")
        # A server's workers start together: micro-benchmarks timed beside another process's would each measure
        # both. One process calibrates while the others wait, then read what it stored.
        with runtime.key_lock(path):
            if not refresh and (stored := _stored(path, facts)) is not None:
                cached = stored
                if wanted <= cached.tiles:
                    return cached
            started = time.perf_counter()
            if cached is None:
                logger.info("calibrating the cost model on %s for batch tiles %s (micro-benchmarks, once per "
                            "device; stored in %s)", facts.name, sorted(wanted), path)
                fresh = measure_calibration(progress, wanted)
            else:
                logger.info("calibrating the cost model's FFMA products at batch tiles %s on %s (once per device)",
                            sorted(wanted - cached.tiles), facts.name)
                fresh = extend_calibration(cached, wanted - cached.tiles, progress)
            # An unlocked writer (an unwritable lock file) may have stored tiles meanwhile: keep its products
            # of the tiles this one lacks.
            other = None if refresh else _stored(path, facts)
            if other is not None:
                kept = {k: v for k, v in other.product.items() if _tile_of(k) not in fresh.tiles}
                fresh = dataclasses.replace(fresh, product={**fresh.product, **kept})
            runtime.atomic_write(path, fresh.to_json())
            logger.info("calibrated %s in %.1f s", facts.name, time.perf_counter() - started)
    return fresh


def cost_model(*, progress: bool = True, batch: int | None = None) -> CostModel:
    """The cost model of the current device, calibrated (on first use) for
    plans at ``batch`` (None: every batch). :meth:`CostModel.cover` measures
    what a ranking needs beyond that."""
    return CostModel(calibration(progress=progress, tiles=tiles_for(batch)), runtime.device_facts())
