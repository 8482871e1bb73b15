"""The configuration of one persistent-recurrence binary, and its validation.

A :class:`KernelConfig` fixes everything that is baked into the binary (cell,
hidden size, sync mode, block count, thread mapping, weight placement); batch
size and sequence length stay run-time values, so a new batch or length never
recompiles. The sizes it implies are :class:`~.layout.KernelLayout`'s.
"""

from __future__ import annotations

import dataclasses
import math

from ..cells import get_cell
from ..errors import ArgumentTypeError, ConfigError
from .layout import MMA_BATCH, WARP, KernelLayout

__all__ = ["DTYPES", "KERNEL_NAME", "MATH_PATHS", "MAX_CLUSTER", "MAX_INSTANCES", "MAX_REGISTERS_PER_THREAD",
           "PIPELINE_RELEASE_EVERY", "STEP_PROFILE_PHASES", "SYNC_MODES", "TAGGED_READS_PER_THREAD", "KernelConfig"]

SYNC_MODES = ("single", "cluster", "grid")
"""single: one block, ``__syncthreads``; cluster: 2-16 blocks of one cluster,
st.async + mbarrier; grid: cooperative launch, global buffer + counter barrier."""

DTYPES = ("float32", "float16", "bfloat16")
"""The layer's dtype: weights, states and outputs. Input projections and all
arithmetic stay fp32."""
MATH_PATHS = ("ffma", "mma")
"""ffma: fp32 fused multiply-adds (16-bit weights are widened once, at load);
mma: tensor cores with fp32 accumulation, mma.sync m16n8k16 on 16-bit
weights, and on fp32 weights TF32 (m16n8k8; weights and h rounded to a
10-bit mantissa), which the planner offers only where torch's fp32 matmul
precision allows TF32."""

KERNEL_NAME = "prnn_recurrence"
MAX_INSTANCES = 8
"""Most recurrences (layers or directions) one launch runs; each has its own
pointer parameters, chosen by a select chain that stays in registers."""
# The largest slice size compiled in (KernelConfig.slice_sequences). At one sequence per slice a step lost
# 29-34% (perf-notes §64); each size is one more build, and a larger slice unrolls longer column loops.
MAX_SLICE_SEQUENCES = 8
PIPELINE_RELEASE_EVERY = 4
"""A pipeline's producer counts its forwarded steps in groups of this many: a
count is a GPU-scope release, which every step cost ~0.25 µs per step; a
consumer then runs up to this many steps further behind."""
RESIDENT_CONTROL = ("doorbell", "stop", "done", "exited", "steps", "rows", "x", "out", "gather", "scatter", "xw")
"""The int64 words of a resident launch's control block, in order (pinned
host memory; see recurrence.cu's prnn_next_tick): the host writes a tick's
descriptor (steps .. xw, the last seven) and then its number into
``doorbell``; the kernel echoes the number into ``done`` once the tick's
outputs are in host memory, and writes its generation into ``exited`` when
it leaves (``stop`` set, idle, or its lifetime over)."""
RESIDENT_TICK = RESIDENT_CONTROL[RESIDENT_CONTROL.index("steps"):]
STEP_PROFILE_PHASES = ("product", "projection_wait", "product_barrier", "pointwise", "slice_barrier", "push",
                       "prefetch", "exchange_wait", "exchange_copy")
"""The phases of a step that an instrumented build (``step_profile``) times,
in the order of its counters (see recurrence.cu's PRNN_MARK): the recurrent
product (with the pointwise update in a fused step), the wait for the step's
prefetched projections, the block barrier after the product (the slowest
warp's lag), the pointwise update, the barrier that completes the block's
slice, the slice's push to peers (a grid's arrival), the next projections'
prefetch, the exchange's wait (a grid's barrier; a tagged grid's polled read
of h), and a grid's copy of h from L2 after its barrier (zero elsewhere)."""

TAGGED_READS_PER_THREAD = 8
"""A tagged grid exchange's loads in flight per thread (recurrence.cu's
PRNN_READ_BATCH), as many as the barrier's copy keeps. Its words are 8 bytes
where the copy reads 16, so past one round of them the copy measured faster
(perf-notes §51); the planner offers the tagged exchange only up to it."""

MAX_CLUSTER = 16  # Hopper's largest (non-portable) cluster; the driver confirms at launch
# Per-thread registers ptxas may use under __launch_bounds__(threads, 1).
MAX_REGISTERS_PER_THREAD = 255


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig(KernelLayout):
    """Everything compiled into one persistent-recurrence binary.

    Attributes:
        cell: a name in :data:`persistrnn.cells.CELLS`.
        hidden_size: H.
        sync: one of :data:`SYNC_MODES`.
        blocks: 1 for ``single``, 2-16 for ``cluster``, up to the SM count for ``grid``.
        threads: threads per block, a multiple of 32.
        group_size: lanes of a work group that split one row's dot product
            (a power of two <= 32); ``threads // group_size`` work groups.
        batch_tile: batch columns each weight load is reused for (1, 2, 4, 8).
        shared_k_chunks: per thread, how many of its column chunks of each row
            sit in shared memory instead of registers.
        prefetch_steps: how many steps ahead the input projections are copied
            into shared memory (their load latency exceeds a step).
        dtype: one of :data:`DTYPES`.
        math: one of :data:`MATH_PATHS`. ``mma`` needs a warp per work
            group (group_size 32), batch_tile 8 and every weight in
            registers; with dtype float32 it runs TF32.
        k_split: (mma) warps that split one row tile's columns; their partial
            products are summed in the pointwise phase.
        one_sync: (reset-before GRU) one exchange per step instead of two:
            U_r is split by columns and every block's partial sums travel
            with its h slice (GRNN Fig. 7b). ``single`` or ``cluster`` sync,
            ffma, prefetch_steps >= 2.
        instances: independent recurrences in one launch (up to
            :data:`MAX_INSTANCES`), each on its own ``blocks`` blocks: the
            two directions of a bidirectional layer, or the layers of a
            pipeline. ``single`` or ``cluster`` sync.
        pipeline: the instances are consecutive layers of one model, fused:
            instance i also computes instance i + 1's input projections from
            its outputs, one step after it made them, and instance i + 1 runs
            behind it (``ffma``, not ``one_sync``; every layer's input size is
            ``hidden_size``).
        lengths: compiled for variable lengths (each sequence its own number
            of steps). :func:`run_instances` picks it when lengths are given;
            without it a launch carries none of the lengths code (which cost
            ~0.1 µs per step of a single LSTM 128 layer).
        fused_step: the pointwise update runs in the work groups' lanes
            right after their product: every work group owns every gate row
            of one unit (work groups = units per block), so the gates never
            go through shared memory and a step has one block barrier fewer.
            One-stage cells, ffma, batch_tile <= group_size, not one_sync,
            not a pipeline.
        test_hook: compiled with the test-only failure hook
            (:func:`persistrnn.runtime.inject_failure`); :func:`run_instances`
            picks it while the hook is set. Without it the kernel carries none
            of the hook's code: at their register limit, kernels compiled by
            NVRTC 13.0 spilled with it.
        resident_input_size: (serving) 0, or the input size I of a resident
            kernel: the launch stays and runs the ticks a serving engine
            posts to a control block in host memory (see recurrence.cu),
            computing each tick's input projections itself. One instance
            of sync ``single`` or ``cluster``; no pipeline, lengths, test
            hook or saved gates.
        save_gates: (training) the kernel also writes, per step, every gate's
            recurrent product with b_hh and the new cell state, fp32, for the
            backward (:mod:`persistrnn.training`). Inference binaries carry
            none of its code or registers. Not with ``one_sync`` (r's product
            is split over blocks) or ``pipeline`` (fused layers keep no
            per-layer outputs).
        step_profile: an instrumented build: thread 0 of every block adds
            up the SM cycles of each phase of a step
            (:data:`STEP_PROFILE_PHASES`) and writes them, with the step
            loop's cycles and nanoseconds, to one more kernel argument
            (:func:`~.launch.run_instances`'s ``profile``). Its clock reads
            cost a few cycles per phase; production binaries carry none.
            Not resident.
        tagged_exchange: (grid) each new h value goes to L2 with its
            exchange's tag in one 64-bit word, and every block polls the
            whole vector back: one L2 round trip per exchange instead of a
            barrier (a GPU-scope release, a counter wait and a second read
            of h). Faster where a thread reads at most
            :data:`TAGGED_READS_PER_THREAD` words (perf-notes §51).
        slice_sequences: 0, or compiled for exactly this many sequences in
            every batch slice (batch 1, or a batch of whole slices): the
            slice's column count and row stride are constants, so its loops
            over columns and its shared-memory indices fold (perf-notes §64).
            :func:`run_instances` picks it for such launches, up to
            :data:`MAX_SLICE_SEQUENCES`, wherever it compiles without
            spilling, except with ``tagged_exchange`` (slower there,
            measured). Not resident (a tick's rows vary).
    """

    cell: str
    hidden_size: int
    sync: str
    blocks: int
    threads: int = 256
    group_size: int = 8
    batch_tile: int = 1
    shared_k_chunks: int = 0
    prefetch_steps: int = 4
    dtype: str = "float32"
    math: str = "ffma"
    k_split: int = 1
    one_sync: bool = False
    instances: int = 1
    pipeline: bool = False
    lengths: bool = False
    fused_step: bool = False
    test_hook: bool = False
    save_gates: bool = False
    resident_input_size: int = 0
    step_profile: bool = False
    tagged_exchange: bool = False
    slice_sequences: int = 0

    def __post_init__(self) -> None:
        spec = get_cell(self.cell)
        # Kept on the instance (not a field): the planner's ranking reads it
        # ~40 times per configuration, and looking it up again took ~10% of
        # a ranking (perf-notes §69).
        object.__setattr__(self, "_spec", spec)
        for name in ("hidden_size", "blocks", "threads", "group_size", "batch_tile", "prefetch_steps", "k_split",
                     "instances"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentTypeError(f"KernelConfig.{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ConfigError(f"KernelConfig.{name}: expected >= 1, got {value}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"KernelConfig.dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.math not in MATH_PATHS:
            raise ConfigError(f"KernelConfig.math: expected one of {MATH_PATHS}, got {self.math!r}")
        if self.math == "mma":
            self._check_mma()
        elif self.k_split != 1:
            raise ConfigError(f"KernelConfig.k_split: only the mma path splits K, expected 1, got {self.k_split}")
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"KernelConfig.sync: expected one of {SYNC_MODES}, got {self.sync!r}")
        if self.one_sync:
            self._check_one_sync()
        self._check_instances()
        if self.fused_step:
            self._check_fused_step()
        if self.save_gates and (self.one_sync or self.pipeline):
            raise ConfigError(f"KernelConfig.save_gates: expected one_sync and pipeline off, got one_sync "
                              f"{self.one_sync}, pipeline {self.pipeline}")
        if self.resident_input_size:
            self._check_resident()
        if not isinstance(self.slice_sequences, int) or isinstance(self.slice_sequences, bool):
            raise ArgumentTypeError(f"KernelConfig.slice_sequences: expected an int, got "
                                    f"{type(self.slice_sequences).__name__}")
        if not 0 <= self.slice_sequences <= MAX_SLICE_SEQUENCES:
            raise ConfigError(f"KernelConfig.slice_sequences: expected 0..{MAX_SLICE_SEQUENCES}, got "
                              f"{self.slice_sequences}")
        if self.slice_sequences and self.resident_input_size:
            raise ConfigError("KernelConfig.slice_sequences: a resident kernel's ticks hold any number of rows, "
                              f"expected resident_input_size 0, got {self.resident_input_size}")
        if self.tagged_exchange and self.sync != "grid":
            raise ConfigError(f"KernelConfig.tagged_exchange: only sync 'grid' exchanges through L2, got sync "
                              f"{self.sync!r}")
        if self.sync == "single" and self.blocks != 1:
            raise ConfigError(f"KernelConfig.blocks: sync 'single' runs 1 block, got {self.blocks}")
        if self.sync == "cluster" and not 2 <= self.blocks <= MAX_CLUSTER:
            raise ConfigError(f"KernelConfig.blocks: sync 'cluster' needs 2..{MAX_CLUSTER} blocks, got {self.blocks}")
        if self.sync == "grid" and self.blocks < 2:
            raise ConfigError(f"KernelConfig.blocks: sync 'grid' needs >= 2 blocks, got {self.blocks}")
        if self.blocks > self.hidden_size:
            raise ConfigError(
                f"KernelConfig.blocks: each block needs at least one hidden unit; got {self.blocks} blocks "
                f"for hidden_size {self.hidden_size}"
            )
        if math.ceil(self.hidden_size / self.units_per_block) != self.blocks:
            fitting = math.ceil(self.hidden_size / self.units_per_block)
            raise ConfigError(
                f"KernelConfig.blocks: {self.blocks} blocks of {self.units_per_block} units leave a block "
                f"without units for hidden_size {self.hidden_size}; use {fitting}"
            )
        if self.threads % WARP or self.threads > 1024:
            raise ConfigError(f"KernelConfig.threads: expected a multiple of 32 up to 1024, got {self.threads}")
        if not _pow2(self.group_size) or self.group_size > WARP:
            raise ConfigError(f"KernelConfig.group_size: expected a power of two <= 32, got {self.group_size}")
        if self.batch_tile not in (1, 2, 4, 8):
            raise ConfigError(f"KernelConfig.batch_tile: expected 1, 2, 4 or 8, got {self.batch_tile}")
        if not 0 <= self.shared_k_chunks <= self.k_per_thread:
            raise ConfigError(
                f"KernelConfig.shared_k_chunks: expected 0..{self.k_per_thread} (the column chunks per thread), "
                f"got {self.shared_k_chunks}"
            )
        for stage in spec.stages:
            first = spec.gates.index(stage[0])
            if tuple(spec.gates[first : first + len(stage)]) != tuple(stage):
                raise ConfigError(f"cell {spec.name}: the kernel needs each stage's gates consecutive, got {stage}")
        if spec.num_stages > 2:
            raise ConfigError(f"cell {spec.name}: the kernel runs at most 2 stages, got {spec.num_stages}")

    def _check_mma(self) -> None:
        fixed = {"group_size": WARP, "batch_tile": MMA_BATCH, "shared_k_chunks": 0}
        for name, want in fixed.items():
            if getattr(self, name) != want:
                raise ConfigError(f"KernelConfig.{name}: math 'mma' needs {want}, got {getattr(self, name)}")
        warps = self.threads // WARP
        if not _pow2(self.k_split) or warps % self.k_split:
            raise ConfigError(f"KernelConfig.k_split: expected a power of two dividing the {warps} warps, "
                              f"got {self.k_split}")

    def _check_one_sync(self) -> None:
        if self.cell != "gru_reset_before":
            raise ConfigError(f"KernelConfig.one_sync: only cell 'gru_reset_before' has a 1-sync variant, "
                              f"got {self.cell!r}")
        if self.sync == "grid":
            raise ConfigError("KernelConfig.one_sync: expected sync 'single' or 'cluster', got 'grid' (every block "
                              "would read every block's partial sums from L2 each step)")
        if self.math != "ffma":
            raise ConfigError(f"KernelConfig.one_sync: expected math 'ffma', got {self.math!r}")
        if self.prefetch_steps < 2:
            raise ConfigError(f"KernelConfig.one_sync: the partial sums need the next step's projections, "
                              f"expected prefetch_steps >= 2, got {self.prefetch_steps}")

    def _check_fused_step(self) -> None:
        why = []
        if self.spec.num_stages != 1 or self.one_sync:
            why.append(f"a one-stage cell without one_sync (cell {self.cell!r}, one_sync {self.one_sync})")
        if self.math != "ffma" or self.pipeline:
            why.append(f"math 'ffma' and no pipeline (math {self.math!r}, pipeline {self.pipeline})")
        units = math.ceil(self.hidden_size / self.blocks)
        if self.threads // self.group_size != units:
            why.append(f"one work group per unit of the block ({self.threads // self.group_size} work groups, "
                       f"{units} units per block)")
        if self.batch_tile > self.group_size:
            why.append(f"batch_tile <= group_size (a lane per column; got {self.batch_tile} > {self.group_size})")
        if why:
            raise ConfigError("KernelConfig.fused_step needs " + "; ".join(why))

    def _check_resident(self) -> None:
        size = self.resident_input_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"KernelConfig.resident_input_size: expected an int >= 0, got {size!r}")
        why = [f"{name} {getattr(self, name)}" for name, ok in (
            ("instances", self.instances == 1), ("sync", self.sync != "grid"), ("pipeline", not self.pipeline),
            ("lengths", not self.lengths), ("test_hook", not self.test_hook), ("save_gates", not self.save_gates),
            ("step_profile", not self.step_profile),
        ) if not ok]
        # A tick's input rows pass through the projections' prefetch buffer (recurrence.cu), at least one
        # row (of I | 1 floats) at a time.
        if (self.prefetch_steps + 1) * self.spec.num_gates * self.units_per_block * self.batch_stride(1) < size | 1:
            why.append(f"input size {size} (one input row must fit the projections' shared buffer)")
        if why:
            raise ConfigError("KernelConfig.resident_input_size: a resident kernel runs one instance of sync "
                              "'single' or 'cluster' without pipeline, lengths, test hook, saved gates or step "
                              "profile; got "
                              + ", ".join(why))

    def _check_instances(self) -> None:
        if self.instances > MAX_INSTANCES:
            raise ConfigError(f"KernelConfig.instances: expected 1..{MAX_INSTANCES}, got {self.instances}")
        if self.instances > 1 and self.sync == "grid":
            raise ConfigError(f"KernelConfig.instances: {self.instances} instances need sync 'single' or 'cluster' "
                              "(the grid barrier spans the whole launch), got 'grid'")
        if not self.pipeline:
            return
        if self.instances < 2:
            raise ConfigError(f"KernelConfig.pipeline: expected at least 2 instances (layers), got {self.instances}")
        if self.math != "ffma" or self.one_sync:
            raise ConfigError(f"KernelConfig.pipeline: expected math 'ffma' without one_sync, got math "
                              f"{self.math!r}, one_sync {self.one_sync}")
