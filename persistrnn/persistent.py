"""Persistent recurrence kernels: configuration, source rendering, launch.

One launch of ``kernels/recurrence.cu`` runs every time step of one layer.
A :class:`KernelConfig` fixes everything that is baked into the binary (cell,
hidden size, sync mode, block count, thread mapping, weight placement); batch
size and sequence length stay run-time values, so a new batch or length never
recompiles.

The path is: :class:`KernelConfig` -> :func:`render_source` ->
:func:`compile_config` (NVRTC, disk cache) -> :func:`run_recurrence` (launch).
:func:`forward_layer` adds the input-projection GEMM in front.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from . import runtime
from .errors import ConfigError
from .cells import CellSpec, get_cell, render_pointwise_functions

SYNC_MODES = ("single", "cluster", "grid")
"""single: one block, ``__syncthreads``; cluster: 2-16 blocks of one cluster,
st.async + mbarrier; grid: cooperative launch, global buffer + counter barrier."""

DTYPES = ("float32", "float16", "bfloat16")
"""The layer's dtype: weights, states and outputs. Input projections and all
arithmetic stay fp32."""
MATH_PATHS = ("ffma", "mma")
"""ffma: fp32 fused multiply-adds (16-bit weights are widened once, at load);
mma: tensor cores, mma.sync m16n8k16 on 16-bit weights with fp32 accumulation."""
MMA_TILE = 16  # rows and columns of one m16n8k16 A fragment
MMA_BATCH = 8  # batch columns of one B fragment

KERNEL_NAME = "prnn_recurrence"
MAX_INSTANCES = 8
"""Most recurrences (layers or directions) one launch runs; each has its own
pointer parameters, chosen by a select chain that stays in registers."""
PIPELINE_RELEASE_EVERY = 4
"""A pipeline's producer counts its forwarded steps in groups of this many: a
count is a GPU-scope release, which every step cost ~0.25 µs per step; a
consumer then runs up to this many steps further behind."""
MAX_CLUSTER = 16  # Hopper's largest (non-portable) cluster; the driver confirms at launch
WARP = 32
# Per-thread registers ptxas may use under __launch_bounds__(threads, 1).
MAX_REGISTERS_PER_THREAD = 255
# Registers a thread needs beside weights, accumulators and bias (indices,
# pointers, loop state); fitted to ptxas reports of the sm_90 builds.
REGISTER_OVERHEAD = 40


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
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
        math: one of :data:`MATH_PATHS`. ``mma`` needs a 16-bit dtype, a warp
            per work group (group_size 32), batch_tile 8 and every weight in
            registers.
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

    def __post_init__(self) -> None:
        spec = get_cell(self.cell)
        for name in ("hidden_size", "blocks", "threads", "group_size", "batch_tile", "prefetch_steps", "k_split",
                     "instances"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"KernelConfig.{name}: expected an int, got {type(value).__name__}")
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
            raise ConfigError(
                f"KernelConfig.blocks: {self.blocks} blocks of {self.units_per_block} units leave a block "
                f"without units for hidden_size {self.hidden_size}; use {math.ceil(self.hidden_size / self.units_per_block)}"
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
        if self.dtype == "float32":
            raise ConfigError("KernelConfig.math: 'mma' runs 16-bit weights, expected dtype float16 or bfloat16, "
                              "got float32")
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

    # ---- derived sizes ------------------------------------------------------

    @property
    def spec(self) -> CellSpec:
        return get_cell(self.cell)

    @property
    def units_per_block(self) -> int:
        return math.ceil(self.hidden_size / self.blocks)

    @property
    def work_groups(self) -> int:
        return self.threads // self.group_size

    @property
    def k_per_thread(self) -> int:
        """Column chunks of a row each lane holds (the tile width)."""
        return math.ceil(self.hidden_size / self.group_size)

    @property
    def register_k(self) -> int:
        return self.k_per_thread - self.shared_k_chunks

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The gates of each row-partitioned product. One-sync GRU: U_z on h
        and U_n on r * h; r comes from the column-partitioned product."""
        return (("z",), ("n",)) if self.one_sync else self.spec.stages

    def stage_rows(self, stage: int) -> int:
        """Rows of W_hh one block multiplies in ``stage``."""
        return len(self.stages[stage]) * self.units_per_block

    # one-sync: the column-partitioned U_r[:, slice], all H rows.

    @property
    def column_rows_per_group(self) -> int:
        return math.ceil(self.hidden_size / self.work_groups) if self.one_sync else 0

    @property
    def column_chunks(self) -> int:
        """Columns of the block's slice each lane holds."""
        return math.ceil(self.units_per_block / self.group_size) if self.one_sync else 0

    @property
    def partial_rows(self) -> int:
        """Rows of one block's partial sums (H, rounded to 16 bytes)."""
        return -(-self.hidden_size // 4) * 4 if self.one_sync else 0

    def rows_per_group(self, stage: int) -> int:
        """Rows of ``stage`` each work group produces (the tile height)."""
        return math.ceil(self.stage_rows(stage) / self.work_groups)

    @property
    def next_rows_per_group(self) -> int:
        """(pipeline) Rows of the next layer's W_ih each work group multiplies:
        every gate of the block's units."""
        return math.ceil(self.spec.num_gates * self.units_per_block / self.work_groups) if self.pipeline else 0

    # mma: a warp holds m_tiles_per_warp(s) x k_tiles_per_warp A fragments.

    @property
    def k_tiles_per_warp(self) -> int:
        return math.ceil(math.ceil(self.hidden_size / MMA_TILE) / self.k_split)

    def m_tiles_per_warp(self, stage: int) -> int:
        row_groups = self.threads // WARP // self.k_split
        return math.ceil(math.ceil(self.stage_rows(stage) / MMA_TILE) / row_groups)

    @property
    def padded_hidden(self) -> int:
        """Rows of the shared h buffers: covers every lane's (or k tile's)
        columns and every block's slice."""
        if self.math == "mma":
            columns = self.k_split * self.k_tiles_per_warp * MMA_TILE
        else:
            columns = self.k_per_thread * self.group_size
        rows = max(columns, self.blocks * self.units_per_block)
        if self.one_sync:  # the last block's column chunks read past its slice
            rows = max(rows, (self.blocks - 1) * self.units_per_block + self.column_chunks * self.group_size)
        return -(-rows // 4) * 4

    @property
    def batch_align(self) -> int:
        """Batch columns are padded to this; a slice is then whole 16-byte vectors."""
        return self.batch_tile if self.units_per_block % 4 == 0 else max(self.batch_tile, 4)

    @property
    def batch_pad(self) -> int:
        """Extra columns after the aligned batch. mma reads h at rows 2*tig (+1)
        for 8 batch columns; a row stride of 8j + 4 floats puts the four tig
        rows in distinct banks (8j alone is a 2- or 4-way conflict)."""
        return 4 if self.math == "mma" else 0

    def batch_stride(self, batch: int) -> int:
        return -(-batch // self.batch_align) * self.batch_align + self.batch_pad

    @property
    def register_weights(self) -> int:
        """Weight registers per thread, over all stages."""
        stages = range(self.spec.num_stages)
        if self.math == "mma":  # a fragment is 4 registers of two 16-bit values
            return sum(4 * self.m_tiles_per_warp(s) * self.k_tiles_per_warp for s in stages)
        return (sum(self.rows_per_group(s) * self.register_k for s in stages)
                + self.next_rows_per_group * self.register_k
                + self.column_rows_per_group * self.column_chunks)

    @property
    def estimated_registers(self) -> int:
        """Registers per thread the planner expects ptxas to need."""
        stages = range(self.spec.num_stages)
        if self.math == "mma":  # two accumulator fragments per tile, two B registers
            acc = max(8 * self.m_tiles_per_warp(s) for s in stages) + 2
        else:
            acc = max([self.rows_per_group(s) * self.batch_tile for s in stages]
                      + [self.next_rows_per_group * self.batch_tile]) + self.batch_tile
        # Several instances: each parameter is chosen at run time, so the
        # pointers live in registers (two each) instead of parameter space.
        pointers = 2 * len(_instance_fields(self)) if self.instances > 1 else 0
        return self.register_weights + acc + REGISTER_OVERHEAD + pointers

    @property
    def bias_floats(self) -> int:
        """b_hh of one block's rows, in shared memory (rounded to 16 bytes)."""
        return -(-self.spec.num_gates * self.units_per_block // 4) * 4

    @property
    def shared_weight_floats(self) -> int:
        """Weights that live in shared memory (the recurrent stages', then the next layer's)."""
        rows = sum(self.rows_per_group(s) for s in range(self.spec.num_stages))
        return rows * self.shared_k_chunks * self.threads

    @property
    def next_shared_weight_floats(self) -> int:
        return self.next_rows_per_group * self.shared_k_chunks * self.threads

    def shared_bytes(self, batch: int) -> int:
        """Dynamic shared memory of one block for ``batch`` sequences."""
        bp = self.batch_stride(batch)
        g, u = self.spec.num_gates, self.units_per_block
        xw = (self.prefetch_steps + 1) * g * u * bp
        floats = 2 * self.padded_hidden * bp + self.k_split * g * u * bp + xw + (u * bp if self.spec.has_cell_state else 0)
        if self.one_sync:  # double-buffered partial sums of every block, and r * h
            floats += 2 * self.blocks * self.partial_rows * bp + self.padded_hidden * bp
        if self.pipeline:  # the next layer's b_ih and shared weights
            floats += self.bias_floats + self.next_shared_weight_floats
        return 4 * (floats + self.bias_floats + self.shared_weight_floats)

    def pipe_floats(self, steps: int, batch: int) -> int:
        """(pipeline) The global buffer of the next layers' projections."""
        per_step = self.blocks * self.spec.num_gates * self.units_per_block * self.batch_stride(batch)
        return (self.instances - 1) * steps * per_step if self.pipeline else 0

    def max_batch(self, shared_limit: int) -> int:
        """Most sequences one launch holds within ``shared_limit`` bytes per block (0: none)."""
        per_column = self.shared_bytes(self.batch_align) - self.shared_bytes(0)
        fixed = self.shared_bytes(0)
        if fixed + per_column > shared_limit:
            return 0
        return (shared_limit - fixed) // per_column * self.batch_align


# ----------------------------------------------------------------------------
# Source
# ----------------------------------------------------------------------------


_DEVICE_TYPES = {"float32": "float", "float16": "prnn_f16", "bfloat16": "prnn_bf16"}


def _instance_fields(config: KernelConfig) -> list[tuple[str, str]]:
    """(C type, name) of each per-instance kernel parameter, in order."""
    io = _DEVICE_TYPES[config.dtype]
    fields = [("const float*", "xw"), (f"const {io}*", "w_hh"), (f"const {io}*", "b_hh"), (f"const {io}*", "h0"),
              (f"const {io}*", "c0"), (f"{io}*", "out"), (f"{io}*", "h_n"), (f"{io}*", "c_n"), ("int", "reverse")]
    if config.pipeline:
        fields += [(f"const {io}*", "w_next"), (f"const {io}*", "b_next")]
    return fields


def _instance_params(config: KernelConfig) -> str:
    return ", ".join(f"{ctype} {name}_{i}" for i in range(config.instances) for ctype, name in _instance_fields(config))


def _select_instance(config: KernelConfig) -> str:
    """This block's instance's parameters as plain names (a select chain:
    an indexed array of parameters would live in local memory)."""
    statements = []
    for ctype, name in _instance_fields(config):
        chain = f"{name}_{config.instances - 1}"
        for i in range(config.instances - 2, -1, -1):
            chain = f"inst == {i} ? {name}_{i} : {chain}"
        statements.append(f"{ctype} const {name} = {chain};")
    return " ".join(statements)


def render_source(config: KernelConfig) -> str:
    """The complete CUDA source of ``config``: generated prelude + template."""
    spec = config.spec
    defines = {
        "PRNN_H": config.hidden_size,
        "PRNN_G": spec.num_gates,
        "PRNN_NB": config.blocks,
        "PRNN_SYNC": SYNC_MODES.index(config.sync),
        "PRNN_THREADS": config.threads,
        "PRNN_WGS": config.group_size,
        "PRNN_BT": config.batch_tile,
        "PRNN_BP_ALIGN": config.batch_align,
        "PRNN_BP_PAD": config.batch_pad,
        "PRNN_U": config.units_per_block,
        "PRNN_KPT": config.k_per_thread,
        "PRNN_KPAD": config.padded_hidden,
        "PRNN_HAS_C": int(spec.has_cell_state),
        "PRNN_STAGES": spec.num_stages,
        "PRNN_IO_T": _DEVICE_TYPES[config.dtype],
        "PRNN_MMA": int(config.math == "mma"),
        "PRNN_KS": config.k_split,
        "PRNN_KTW": config.k_tiles_per_warp,
        "PRNN_SHARED_W_FLOATS": config.shared_weight_floats,
        "PRNN_ONE_SYNC": int(config.one_sync),
        "PRNN_FIRST_STAGE": spec.num_stages - 1 if config.one_sync else 0,  # the first stage with an exchange
        "PRNN_C_RPW": max(config.column_rows_per_group, 1),
        "PRNN_CPT": max(config.column_chunks, 1),
        "PRNN_PROWS": config.partial_rows,
        "PRNN_BIAS_FLOATS": config.bias_floats,
        "PRNN_XW_DEPTH": config.prefetch_steps,
        "PRNN_INSTANCES": config.instances,
        "PRNN_PIPELINE": int(config.pipeline),
        "PRNN_RELEASE_EVERY": PIPELINE_RELEASE_EVERY,
        "PRNN_LENGTHS": int(config.lengths),
        "PRNN_N_RPW": max(config.next_rows_per_group, 1),
        "PRNN_N_KREG": config.register_k,
        "PRNN_INSTANCE_PARAMS": _instance_params(config),
        "PRNN_SELECT_INSTANCE": _select_instance(config),
    }
    first_gates = []
    for s, stage in enumerate(config.stages):
        defines[f"PRNN_S{s}_NG"] = len(stage)
        defines[f"PRNN_S{s}_RPW"] = config.rows_per_group(s)
        defines[f"PRNN_S{s}_KREG"] = config.register_k
        defines[f"PRNN_S{s}_MTW"] = config.m_tiles_per_warp(s)
        first_gates.append(spec.gates.index(stage[0]))
    prelude = [f"// {config}"]
    prelude += [f"#define {k} {v}" for k, v in defines.items()]
    source = runtime.read_source("recurrence.cu", includes=("common.cuh", "group_product.cuh"))
    # The stage gate lookup and the cell's math go after common.cuh (which
    # defines prnn_sigmoid etc.) and before the kernel that calls them.
    generated = [
        "__device__ __forceinline__ int prnn_stage_gate(int stage, int slot) {",
        "    return " + " : ".join(f"stage == {s} ? {g} + slot" for s, g in enumerate(first_gates[:-1]))
        + (" : " if len(first_gates) > 1 else "") + f"{first_gates[-1]} + slot;",
        "}",
        render_pointwise_functions(spec),
    ]
    marker = "// ---- kernel ----"
    head, _, body = source.partition(marker)
    if not body:
        raise RuntimeError(f"recurrence.cu lost its {marker!r} line")
    return "\n".join(prelude) + "\n" + head + "\n".join(generated) + "\n" + marker + body


@functools.lru_cache(maxsize=256)
def compile_config(config: KernelConfig, arch: str | None = None) -> runtime.CompiledBinary:
    """Compile ``config`` (disk-cached) and check that it keeps weights on chip.

    Raises :class:`ConfigError` if ptxas put anything in local memory: a
    spilled weight array runs at DRAM speed and defeats the kernel.
    """
    binary = runtime.compile_source("recurrence", render_source(config), arch=arch)
    res = binary.kernel_resources(KERNEL_NAME)
    if res.uses_local_memory:
        raise ConfigError(
            f"{config} spills to local memory ({res.registers} registers, {res.stack_frame_bytes} bytes stack, "
            f"{res.spill_store_bytes} bytes spill stores); it needs fewer register weights per thread "
            f"(now {config.register_weights})"
        )
    return binary


# ----------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Instance:
    """One recurrence of a launch (see :func:`run_instances`).

    xw: (T, B, G*H) float32 input projections (None for a pipeline's later
    layers, which get theirs from the layer before). w_hh (G*H, H), b_hh
    (G*H,), h0, c0, h_n, c_n (B, H): the layer's dtype, contiguous. out:
    (T, B, out_row), of which this instance writes columns
    [out_column, out_column + H); None writes no output. w_next, b_next: the
    next layer's W_ih (G*H, H) and b_ih (pipeline, all but the last).
    """

    xw: Any
    w_hh: Any
    b_hh: Any
    h0: Any
    c0: Any
    out: Any
    h_n: Any
    c_n: Any
    reverse: bool = False
    out_column: int = 0
    w_next: Any = None
    b_next: Any = None


def _address(t: Any, offset: int = 0) -> Any:
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr() + offset * t.element_size())


def run_instances(config: KernelConfig, instances: list[Instance], steps: int, batch: int, *,
                  lengths: Any = None, check: bool = True) -> None:
    """Launch ``config`` over ``instances`` (``config.instances`` of them).

    ``lengths``: an int32 CUDA tensor (batch,) of each sequence's steps, 1 to
    ``steps``; past its length a sequence keeps its state and its outputs are
    zero (a reverse instance starts at its last step). None: all ``steps``.

    Batches larger than one launch holds run as consecutive launches. The
    tensors are taken as they are (the callers made them); :func:`run_recurrence`
    is the checked single-recurrence entry.
    """
    import numpy as np
    import torch

    if len(instances) != config.instances:
        raise ValueError(f"expected {config.instances} instances for {config}, got {len(instances)}")
    if config.lengths != (lengths is not None):  # the variant compiled with (or without) the lengths code
        config = dataclasses.replace(config, lengths=lengths is not None)
    device = instances[0].w_hh.device
    H, GH = config.hidden_size, config.spec.num_gates * config.hidden_size
    out_row = next((i.out.shape[2] for i in instances if i.out is not None), H)
    per_launch = batch_per_launch(config, device.index)
    report = np.uint64(runtime.report_word(device.index))
    timeout, abandon = np.uint64(runtime.wait_timeout_ns()), np.int32(runtime.failure_hook())
    for b0 in range(0, batch, per_launch):
        nb = min(per_launch, batch - b0)
        kernel, launch_config = _prepared_launch(config, device.index, nb)
        # The launch's own status word, counters and (grid) exchange buffer;
        # zeros, since the kernel reads exchange rows it never writes.
        own = runtime.scratch(device, 2 * config.padded_hidden * config.batch_stride(nb)
                              if config.sync == "grid" else 0)
        pipe = torch.empty(config.pipe_floats(steps, nb), dtype=torch.float32, device=device) if config.pipeline else None
        args = []
        for i in instances:
            c0 = i.c0 if i.c0 is not None else i.h0
            c_n = i.c_n if i.c_n is not None else i.h_n
            args += [_address(i.xw, b0 * GH), _address(i.w_hh), _address(i.b_hh), _address(i.h0, b0 * H),
                     _address(c0, b0 * H), _address(i.out, b0 * out_row + i.out_column), _address(i.h_n, b0 * H),
                     _address(c_n, b0 * H), int(i.reverse)]
            if config.pipeline:
                args += [_address(i.w_next), _address(i.b_next)]
        args += [np.uint64(own.exchange), np.uint64(own.counters), _address(pipe), _address(lengths, b0), steps, nb,
                 batch, out_row, np.uint64(own.status), report, timeout, abandon]
        runtime.launch(kernel, launch_config, *runtime.kernel_args(*args))
    if check:
        runtime.raise_reported_failure(device.index, KERNEL_NAME, synchronize=True)


def run_recurrence(
    config: KernelConfig,
    xw: Any,
    w_hh: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None,
    *,
    out: Any | None = None,
    h_n: Any | None = None,
    c_n: Any | None = None,
    reverse: bool = False,
    lengths: Any = None,
    check: bool = True,
) -> tuple[Any, Any, Any | None]:
    """Run the recurrence on precomputed input projections.

    Args:
        xw: (T, B, G*H) float32 CUDA tensor, ``x @ W_ih^T + b_ih``.
        w_hh: (G*H, H); b_hh: (G*H,); h0, c0: (B, H); all of ``config.dtype``.
        out, h_n, c_n: optional destinations, (T, B, H) and (B, H).
        reverse: run the steps from the last to the first (out[t] is still
            the output at position t).
        lengths: int32 (B,) steps of each sequence, as in :func:`run_instances`.
        check: synchronise and raise if the kernel reported a failure.

    Returns (output (T, B, H), h_n (B, H), c_n (B, H) or None).
    Batches larger than one launch holds run as consecutive launches.
    """
    import torch

    if config.instances != 1:
        raise ConfigError(f"run_recurrence runs one recurrence; {config} has {config.instances} instances "
                          "(run_instances runs those)")
    spec = config.spec
    H, G = config.hidden_size, spec.num_gates
    if not isinstance(xw, torch.Tensor) or xw.dim() != 3:
        raise ValueError(f"xw: expected a 3-D tensor (T, B, {G * H}), got "
                         f"{tuple(xw.shape) if isinstance(xw, torch.Tensor) else type(xw).__name__}")
    T, B = xw.shape[0], xw.shape[1]
    dtype = getattr(torch, config.dtype)
    check_tensor("xw", xw, (T, B, G * H), xw.device, torch.float32)
    check_tensor("w_hh", w_hh, (G * H, H), xw.device, dtype)
    check_tensor("b_hh", b_hh, (G * H,), xw.device, dtype)
    check_tensor("h0", h0, (B, H), xw.device, dtype)
    if spec.has_cell_state:
        if c0 is None:
            raise ValueError(f"cell {spec.name} carries a cell state: expected c0 of shape {(B, H)}, got None")
        check_tensor("c0", c0, (B, H), xw.device, dtype)
    elif c0 is not None:
        raise ValueError(f"cell {spec.name} has no cell state: expected c0=None, got a tensor")
    if T < 1 or B < 1:
        raise ValueError(f"expected at least one step and one sequence, got xw of shape {tuple(xw.shape)}")

    def destination(name: str, given: Any, shape: tuple[int, ...]) -> Any:
        if given is None:
            return torch.empty(shape, dtype=dtype, device=xw.device)
        check_tensor(name, given, shape, xw.device, dtype)
        return given

    out = destination("out", out, (T, B, H))
    h_n = destination("h_n", h_n, (B, H))
    c_n = destination("c_n", c_n, (B, H)) if spec.has_cell_state else None
    if lengths is not None:
        check_lengths(lengths, T, B, xw.device)
    run_instances(config, [Instance(xw, w_hh, b_hh, h0, c0, out, h_n, c_n, reverse)], T, B, lengths=lengths,
                  check=check)
    return out, h_n, c_n


@functools.lru_cache(maxsize=None)
def batch_per_launch(config: KernelConfig, device: int) -> int:
    """Most sequences one launch of ``config`` holds on ``device``."""
    kernel = runtime.get_kernel(compile_config(config), KERNEL_NAME)
    limit = runtime.device_facts().shared_per_block_optin - kernel.resources.shared_bytes
    per_launch = config.max_batch(limit)
    if per_launch < 1:
        raise ConfigError(f"{config} needs {config.shared_bytes(1)} bytes of shared memory per block; "
                          f"the device allows {limit}")
    return per_launch


@functools.lru_cache(maxsize=1024)
def _prepared_launch(config: KernelConfig, device: int, batch: int) -> tuple[runtime.LoadedKernel, Any]:
    """The loaded kernel and checked launch configuration, once per (config, device, batch):
    the residency queries cost far more than a launch."""
    kernel = runtime.get_kernel(compile_config(config), KERNEL_NAME)
    return kernel, _launch_config(kernel, config, config.shared_bytes(batch))


def _launch_config(kernel: runtime.LoadedKernel, config: KernelConfig, shared: int) -> Any:
    if config.sync == "single":
        return kernel.config(config.instances, config.threads, shared=shared)
    if config.sync == "cluster":
        return kernel.config(config.blocks * config.instances, config.threads, shared=shared, cluster=config.blocks)
    return kernel.config(config.blocks, config.threads, shared=shared, cooperative=True)


def check_tensor(name: str, t: Any, shape: tuple[int, ...], device: Any, dtype: Any) -> None:
    """Raise TypeError (type, dtype) or ValueError (device, shape, layout)
    naming ``name`` and what was expected, unless ``t`` is a contiguous
    CUDA tensor of ``shape`` and ``dtype`` on ``device``."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where xw is), got one on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def check_lengths(lengths: Any, steps: int, batch: int, device: Any) -> None:
    """Raise unless ``lengths`` is an int32 tensor (batch,) on ``device`` with
    every length in 1..steps: a reverse instance starts at its length - 1, so
    a length past ``steps`` would read and write outside the tensors. Reads
    the extremes back (synchronises)."""
    import torch

    check_tensor("lengths", lengths, (batch,), device, torch.int32)
    low, high = int(lengths.min()), int(lengths.max())
    if low < 1 or high > steps:
        raise ValueError(f"lengths: expected every length in 1..{steps} (the steps of the input), "
                         f"got lengths from {low} to {high}")


def input_projection(x: Any, w_ih: Any, b_ih: Any) -> Any:
    """``x @ W_ih^T + b_ih`` for every step at once: (T, B, I) -> (T, B, G*H) float32.

    One GEMM through torch. A 16-bit layer's GEMM accumulates and returns
    fp32, so the recurrence starts from unrounded projections.
    """
    import torch

    T, B, I = x.shape
    x2 = x.reshape(T * B, I)
    if x.dtype == torch.float32:
        xw = torch.addmm(b_ih, x2, w_ih.t())
    else:
        xw = torch.addmm(b_ih.float(), x2, w_ih.t(), out_dtype=torch.float32)
    return xw.view(T, B, -1)


def forward_layer(
    config: KernelConfig,
    x: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None = None,
    *,
    check: bool = True,
) -> tuple[Any, Any, Any | None]:
    """One layer, one direction: :func:`input_projection`, then the recurrence.

    ``x`` is (T, B, I) of ``config.dtype``; the rest as in :func:`run_recurrence`.
    """
    return run_recurrence(config, input_projection(x, w_ih, b_ih), w_hh, b_hh, h0, c0, check=check)


def forward_model(config: KernelConfig, layers: list[list[dict[str, Any]]], x: Any, h0: Any, c0: Any | None, *,
                  lengths: Any = None, check: bool = True) -> tuple[Any, Any, Any | None]:
    """A whole model on ``config``: every layer and direction.

    ``layers[l][d]`` holds the tensors ``w_ih``, ``w_hh``, ``b_ih``, ``b_hh``
    of layer l, direction d (1: reverse); ``x`` is (T, B, I); ``h0``, ``c0``
    are (L*D, B, H); ``lengths`` as in :func:`run_instances`. Returns
    (output (T, B, D*H), h_n, c_n (L*D, B, H)).

    A pipeline configuration runs all layers in one launch; one with two
    instances runs a bidirectional layer's directions in one launch;
    otherwise each layer and direction is a launch of its own. The reverse
    direction runs its steps backwards in the kernel (no flipped copies).
    """
    import torch

    L, D = len(layers), len(layers[0])
    T, B, _ = x.shape
    if lengths is not None:
        check_lengths(lengths, T, B, x.device)
    H = config.hidden_size
    has_c = config.spec.has_cell_state
    h0 = h0.contiguous()
    c0 = c0.contiguous() if has_c else None
    h_n = torch.empty_like(h0)
    c_n = torch.empty_like(c0) if has_c else None

    def instance(l: int, d: int, xw: Any, out: Any) -> Instance:
        i = l * D + d
        p = layers[l][d]
        return Instance(xw, p["w_hh"], p["b_hh"], h0[i], c0[i] if has_c else None, out, h_n[i],
                        c_n[i] if has_c else None, reverse=d == 1, out_column=d * H)

    if config.pipeline:
        if D != 1 or config.instances != L:
            raise ConfigError(f"{config} runs {config.instances} layers of one direction; the model has {L} "
                              f"layer(s) of {D} direction(s)")
        out = torch.empty(T, B, H, dtype=x.dtype, device=x.device)
        first = layers[0][0]
        instances = [instance(l, 0, input_projection(x, first["w_ih"], first["b_ih"]) if l == 0 else None,
                              out if l == L - 1 else None) for l in range(L)]
        for l in range(L - 1):
            instances[l].w_next, instances[l].b_next = layers[l + 1][0]["w_ih"], layers[l + 1][0]["b_ih"]
        run_instances(config, instances, T, B, lengths=lengths, check=check)
        return out, h_n, c_n
    if config.instances not in (1, D):
        raise ConfigError(f"{config} runs {config.instances} recurrences at once; the model has {D} direction(s)")
    layer_input = x
    for l in range(L):
        out = torch.empty(T, B, D * H, dtype=x.dtype, device=x.device)
        group = [instance(l, d, input_projection(layer_input, layers[l][d]["w_ih"], layers[l][d]["b_ih"]), out)
                 for d in range(D)]
        last = l == L - 1
        if config.instances == D:
            run_instances(config, group, T, B, lengths=lengths, check=check and last)
        else:
            for d, one in enumerate(group):
                run_instances(config, [one], T, B, lengths=lengths, check=check and last and d == D - 1)
        layer_input = out
    return layer_input, h_n, c_n


# ----------------------------------------------------------------------------
# A default configuration until the planner chooses
# ----------------------------------------------------------------------------


def blocks_for(hidden_size: int, wanted: int) -> int:
    """The block count nearest ``wanted`` (not above) that leaves no block without units."""
    units = math.ceil(hidden_size / min(wanted, hidden_size))
    return math.ceil(hidden_size / units)


def default_config(cell: str, hidden_size: int, batch: int, *, sm_count: int, register_budget: int | None = None,
                   threads: int = 256, dtype: str = "float32", math: str = "ffma") -> KernelConfig:
    """A reasonable configuration from sizes alone: the fewest blocks whose
    weights fit ``register_budget`` registers per thread, in the cheapest sync
    mode that holds them. The planner replaces this with a tuned choice.

    The default budget is 128 registers for ffma and 64 for mma: ptxas loads
    every B fragment of a step ahead of its mma (4 registers per k tile), and
    at 128 weight registers the sm_90 builds spilled."""
    spec = get_cell(cell)
    if register_budget is None:
        register_budget = 64 if math == "mma" else 128
    batch_tile = 1 if batch == 1 else 2 if batch == 2 else 4 if batch <= 4 else 8
    for sync, counts in (("single", (1,)), ("cluster", (2, 4, 8, 16)), ("grid", range(17, sm_count + 1))):
        for wanted in counts:
            blocks = blocks_for(hidden_size, wanted)
            if sync == "grid" and blocks <= MAX_CLUSTER:
                continue  # a cluster holds it with a cheaper exchange
            if math == "mma":  # a warp per work group; split K until the fragments fit
                mappings = [dict(group_size=WARP, batch_tile=MMA_BATCH, k_split=k) for k in (1, 2, 4, 8)]
            else:
                mappings = [dict(group_size=g, batch_tile=batch_tile) for g in (8, 16, 32, 4)]
            for mapping in mappings:
                try:  # KernelConfig rejects block counts the sync mode cannot run
                    cfg = KernelConfig(cell, hidden_size, sync, blocks, threads, dtype=dtype, math=math, **mapping)
                except ConfigError:
                    continue
                if math == "ffma":
                    tile = max(cfg.rows_per_group(s) for s in range(spec.num_stages)) * cfg.batch_tile
                    while tile > 32 and cfg.batch_tile > 1:
                        cfg = dataclasses.replace(cfg, batch_tile=cfg.batch_tile // 2)
                        tile //= 2
                if cfg.register_weights <= register_budget:
                    return cfg
    raise ConfigError(
        f"{spec.name} with hidden_size {hidden_size} does not fit on chip in {register_budget} registers "
        f"per thread over {sm_count} blocks"
    )
