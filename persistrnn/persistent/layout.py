"""Layout arithmetic of a :class:`~.config.KernelConfig`: how the hidden
units, gate rows and weight columns divide over blocks, work groups and
lanes, how many weight registers a thread holds, and the shared memory one
block needs for a batch. A mixin of the configuration's fields; no state.
"""

from __future__ import annotations

import math

from ..cells import CellSpec

RESIDENT_PROJECTION_ROWS = 4
"""Projection rows a warp of a resident kernel sums at once (independent
chains; recurrence.cu's prnn_tick_projections); a block keeps its W_ih rows
padded to a multiple of this."""

__all__ = ["MMA_BATCH", "MMA_TILE", "REGISTER_OVERHEAD", "WARP", "KernelLayout"]

MMA_TILE = 16  # rows and columns of one m16n8k16 A fragment
MMA_BATCH = 8  # batch columns of one B fragment
WARP = 32
# Registers a thread needs beside weights, accumulators and bias (indices,
# pointers, loop state); fitted to ptxas reports of the sm_90 builds.
REGISTER_OVERHEAD = 40


class KernelLayout:
    """Derived sizes, from the fields of :class:`~.config.KernelConfig`."""

    cell: str
    hidden_size: int
    sync: str
    blocks: int
    threads: int
    group_size: int
    batch_tile: int
    shared_k_chunks: int
    prefetch_steps: int
    dtype: str
    math: str
    k_split: int
    one_sync: bool
    instances: int
    pipeline: bool
    lengths: bool
    fused_step: bool
    resident_input_size: int

    _spec: CellSpec  # the cell's spec, set once by KernelConfig.__post_init__

    @property
    def spec(self) -> CellSpec:
        return self._spec

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
    def early_prefetch(self) -> bool:
        """Whether the warps with no unit of the pointwise update copy the
        next projections while the others update (at launches whose batch
        leaves such a warp), rather than every thread after the update.
        Single blocks only: there nothing else hides the copies, while in a
        cluster or a grid they run in the exchange's shadow, and moved into
        the update they only slowed it (perf-notes §101). Not in a fused step
        (each thread copies the projections it updates), a one-sync GRU (its
        partial sums read the next step's projections between the two), a
        pipeline (a consumer's copy waits for its producer) or a resident
        kernel (its ticks make their projections)."""
        return self.sync == "single" and not (self.fused_step or self.one_sync or self.pipeline
                                              or self.resident_input_size)

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
    def tf32(self) -> bool:
        """The mma path on fp32 weights: TF32 tensor cores."""
        return self.math == "mma" and self.dtype == "float32"

    @property
    def fragment_registers(self) -> int:
        """Registers of one 16 x 16 A fragment: two 16-bit values each, or one TF32 value."""
        return 8 if self.tf32 else 4

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
    def h_buffers(self) -> int:
        """Copies of h in a block's shared memory: two (exchanges alternate), or
        one for a grid block of a one-stage cell without tagged words, whose
        values go to L2 and whose copy of h_t from L2 follows every read of
        h_{t-1} (recurrence.cu)."""
        return 1 if self.sync == "grid" and not self.tagged_exchange and self.spec.num_stages == 1 else 2

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
        if self.math == "mma":
            return sum(self.fragment_registers * self.m_tiles_per_warp(s) * self.k_tiles_per_warp for s in stages)
        return (sum(self.rows_per_group(s) * self.register_k for s in stages)
                + self.next_rows_per_group * self.register_k
                + self.column_rows_per_group * self.column_chunks)

    @property
    def estimated_registers(self) -> int:
        """Registers per thread the planner expects ptxas to need."""
        from .source import instance_fields  # the kernel's parameters are the source's

        stages = range(self.spec.num_stages)
        if self.math == "mma":  # two accumulator fragments per tile, two B registers
            acc = max(8 * self.m_tiles_per_warp(s) for s in stages) + 2
        else:
            acc = max([self.rows_per_group(s) * self.batch_tile for s in stages]
                      + [self.next_rows_per_group * self.batch_tile]) + self.batch_tile
        # Several instances: each parameter is chosen at run time, so the
        # pointers live in registers (two each) instead of parameter space.
        pointers = 2 * len(instance_fields(self)) if self.instances > 1 else 0
        return self.register_weights + acc + REGISTER_OVERHEAD + pointers

    @property
    def bias_floats(self) -> int:
        """One bias (b_hh, or b_ih) of one block's rows, in shared memory (rounded to 16 bytes)."""
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
        cell_state = u * bp if self.spec.has_cell_state else 0
        floats = self.h_buffers * self.padded_hidden * bp + self.k_split * g * u * bp + xw + cell_state
        if self.one_sync:  # double-buffered partial sums of every block, and r * h
            floats += 2 * self.blocks * self.partial_rows * bp + self.padded_hidden * bp
        if self.pipeline:  # the next layer's b_ih and shared weights
            floats += self.bias_floats + self.next_shared_weight_floats
        if self.resident_input_size:  # each row's two state slots (int32), W_ih's rows and b_ih (recurrence.cu)
            rows = -(-g * u // RESIDENT_PROJECTION_ROWS) * RESIDENT_PROJECTION_ROWS
            floats += 2 * bp + rows * (self.resident_input_size + 1)
        return 4 * (floats + 2 * self.bias_floats + self.shared_weight_floats)  # b_hh and b_ih

    def exchange_floats(self, batch: int) -> int:
        """(grid) Floats of one launch's exchange buffer: two [KPAD][BP]
        copies of h (tagged: 64-bit words, two floats each); 0 otherwise."""
        if self.sync != "grid":
            return 0
        return 2 * self.padded_hidden * self.batch_stride(batch) * (2 if self.tagged_exchange else 1)

    @property
    def counter_words(self) -> int:
        """Counter words one batch slice of a launch uses: grid-barrier
        arrivals, exits, then each instance's progress (pipeline)."""
        return 2 + self.instances

    def pipe_floats(self, steps: int, batch: int) -> int:
        """(pipeline) The global buffer of the next layers' projections."""
        per_step = self.blocks * self.spec.num_gates * self.units_per_block * self.batch_stride(batch)
        return (self.instances - 1) * steps * per_step if self.pipeline else 0

    def max_batch(self, shared_limit: int) -> int:
        """Most sequences one launch holds within ``shared_limit`` bytes per block (0: none)."""
        fixed = self.shared_bytes(0)
        per_column = self.shared_bytes(self.batch_align) - fixed
        if fixed + per_column > shared_limit:
            return 0
        return (shared_limit - fixed) // per_column * self.batch_align
