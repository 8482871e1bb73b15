"""The configuration space of one persistent layer, and its pruning.

A point of the space is a :class:`persistrnn.persistent.KernelConfig` (frozen):
its dimensions, in GRNN's terms (§6-7), are

* sync mode and block count: one block, a cluster of 2-16, or a grid of up to
  one block per SM; the block count fixes the tile width (hidden units per
  block, ``units_per_block``);
* tile height: rows of a stage per work group (``rows_per_group``, derived
  from the block's rows and its work groups) and batch columns per weight
  load (``batch_tile``);
* work groups per block and work-group size (``threads``, ``group_size``);
* weight placement: every column chunk in registers, some in shared memory,
  or all in shared memory (``shared_k_chunks``);
* math path: FFMA, or mma.sync on tensor cores for 16-bit layers (with its
  K split);
* for the reset-before GRU, one exchange per step or two (``one_sync``);
* for one-stage cells with a work group per unit, the fused step
  (``fused_step``: the pointwise update in the product's lanes);
* for grid sync, the exchange: a counter barrier and a copy of h, or tagged
  words polled in one L2 round trip (``tagged_exchange``), the latter only
  at batch 1 and where a thread reads at most
  :data:`persistrnn.persistent.TAGGED_READS_PER_THREAD` of them.

:func:`prune` keeps a configuration only if it fits the device (registers,
shared memory, co-residency) and leaves at most :data:`IDLE_BOUND` of its
threads' work slots idle. Every limit comes from a
:class:`persistrnn.runtime.DeviceFacts`, which :func:`persistrnn.runtime.device_facts`
reads from the device.
"""

from __future__ import annotations

import math
from typing import Iterator

from .. import persistent
from ..runtime import DeviceFacts
from ..persistent import ConfigError, KernelConfig, MAX_CLUSTER, WARP
from ..errors import ArgumentError

THREADS = (128, 256, 512, 1024)
GROUP_SIZES = (2, 4, 8, 16, 32)
BATCH_TILES = (1, 2, 4, 8)
K_SPLITS = (1, 2, 4, 8)
# Steps of input projections in flight: 4 covered the global-load latency at
# every measured shape (perf notes §6); it is not a dimension of the search.
PREFETCH_STEPS = 4
IDLE_BOUND = 0.5
"""Most of a configuration's row slots (work groups x rows per group) or
column slots (lanes x chunks per lane) that may hold no work."""
# The register file is allocated to warps in units of 256 registers (8 per thread).
REGISTER_GRANULE = 8


EXACT_BATCHES = 64
"""Batches up to this are tuned one by one. A choice timed at the next power
of two and run at the batch itself measured up to 1.5x slower than the best
candidate there (planner-regret: LSTM 1024 at batch 10, tuned at 16); the
first call of a new batch size pays one tuning (a few seconds), once per
machine (the tuning cache)."""


def next_power_of_two(batch: int) -> int:
    if not isinstance(batch, int) or batch < 1:
        raise ArgumentError(f"batch: expected a positive int, got {batch!r}")
    return 1 << (batch - 1).bit_length()


def batch_bucket(batch: int) -> int:
    """The batch a tuned choice is kept for: the batch itself up to
    :data:`EXACT_BATCHES`, then the next power of two. A choice is timed at
    the bucket's top, so it holds every batch in the bucket."""
    power = next_power_of_two(batch)  # checks the batch
    return batch if batch <= EXACT_BATCHES else power


def block_counts(hidden_size: int, sm_count: int) -> list[tuple[str, int]]:
    """(sync, blocks) pairs: every distinct tile width each mode can run."""
    out: list[tuple[str, int]] = [("single", 1)]
    seen = {1}
    for wanted in range(2, min(sm_count, hidden_size) + 1):
        blocks = persistent.blocks_for(hidden_size, wanted)
        if blocks in seen:
            continue
        seen.add(blocks)
        out.append(("cluster" if blocks <= MAX_CLUSTER else "grid", blocks))
        if blocks <= MAX_CLUSTER and blocks <= sm_count:
            # A grid of few blocks pays the L2 exchange for nothing a cluster
            # would not do cheaper; it stays in the space for completeness.
            out.append(("grid", blocks))
    return out


def _mappings(dtype: str, threads: int, batch: int, k_per_thread, tf32: bool) -> Iterator[dict]:
    tiles = [t for t in BATCH_TILES if t == 1 or t <= next_power_of_two(batch)]
    for group in GROUP_SIZES:
        k = k_per_thread(group)
        placements = sorted({0, k // 2, k})  # registers, split, shared
        for tile in tiles:
            for shared in placements:
                yield dict(math="ffma", group_size=group, batch_tile=tile, shared_k_chunks=shared)
    if dtype != "float32" or tf32:
        for k_split in K_SPLITS:
            if threads // WARP % k_split == 0:
                yield dict(math="mma", group_size=WARP, batch_tile=persistent.MMA_BATCH, shared_k_chunks=0,
                           k_split=k_split)


def enumerate_space(cell: str, hidden_size: int, batch: int, dtype: str, facts: DeviceFacts, *, instances: int = 1,
                    pipeline: bool = False, tf32: bool = False) -> Iterator[KernelConfig]:
    """Every well-formed configuration for the layer (before pruning), each
    running ``instances`` recurrences per launch (a ``pipeline`` of layers).
    ``tf32``: an fp32 layer may also run TF32 tensor cores (math 'mma')."""
    one_sync_options = (False, True) if cell == "gru_reset_before" else (False,)
    for sync, blocks in block_counts(hidden_size, facts.sm_count):
        units = math.ceil(hidden_size / blocks)
        for threads in THREADS:
            if threads > facts.max_threads_per_block:
                continue
            # Measured on the H100 (perf-notes §51): the tagged words won at batch 1 in 3 of 5 configurations
            # (GRU 1024 fused -26% per step; LSTM 1024 at 256 threads +34-40%) and lost in every one timed at
            # batch 2 (+49-71%), as at the larger batches where the copy's 16-byte reads win (+45% at batch 10).
            tagged_options = ((False, True) if sync == "grid" and batch == 1
                              and hidden_size <= threads * persistent.TAGGED_READS_PER_THREAD else (False,))
            for mapping in _mappings(dtype, threads, batch, lambda g: math.ceil(hidden_size / g), tf32):
                # The fused step needs a work group per unit of the block.
                fused_options = (False, True) if threads // mapping["group_size"] == units else (False,)
                for one_sync in one_sync_options:
                    for fused_step in fused_options:
                        for tagged in tagged_options:
                            try:
                                yield KernelConfig(cell, hidden_size, sync, blocks, threads,
                                                   prefetch_steps=PREFETCH_STEPS, dtype=dtype, one_sync=one_sync,
                                                   instances=instances, pipeline=pipeline, fused_step=fused_step,
                                                   tagged_exchange=tagged, **mapping)
                            except ConfigError:
                                continue


def register_limit(threads: int, facts: DeviceFacts) -> int:
    """Registers a thread may use when one block of ``threads`` owns an SM."""
    per_thread = min(facts.registers_per_block, facts.registers_per_sm) // threads
    return min(persistent.MAX_REGISTERS_PER_THREAD, per_thread // REGISTER_GRANULE * REGISTER_GRANULE)


def idle_fraction(config: KernelConfig) -> float:
    """The larger idle share of row slots or column slots."""
    idle = []
    for s in range(len(config.stages)):
        if config.math == "mma":
            rows = config.m_tiles_per_warp(s) * persistent.MMA_TILE * (config.threads // WARP // config.k_split)
        else:
            rows = config.rows_per_group(s) * config.work_groups
        idle.append(1 - config.stage_rows(s) / rows)
    columns = (config.k_split * config.k_tiles_per_warp * persistent.MMA_TILE if config.math == "mma"
               else config.k_per_thread * config.group_size)
    idle.append(1 - config.hidden_size / columns)
    return max(idle)


def prune(config: KernelConfig, batch: int, facts: DeviceFacts) -> str | None:
    """Why ``config`` cannot (or should not) run ``batch`` sequences on this
    device, or None if it stays in the space."""
    limit = register_limit(config.threads, facts)
    if config.estimated_registers > limit:
        return f"needs ~{config.estimated_registers} registers per thread, the device gives {limit}"
    if config.max_batch(facts.shared_per_block_optin) < 1:
        return (f"needs {config.shared_bytes(config.batch_align)} bytes of shared memory per block, "
                f"the device allows {facts.shared_per_block_optin}")
    if config.blocks * config.instances > facts.sm_count:
        return (f"needs {config.blocks * config.instances} co-resident blocks of one SM each, the device has "
                f"{facts.sm_count} SMs")
    if config.threads > facts.max_threads_per_sm:
        return f"{config.threads} threads exceed the {facts.max_threads_per_sm} an SM holds"
    idle = idle_fraction(config)
    if idle > IDLE_BOUND:
        return f"leaves {idle:.0%} of its work slots idle (bound {IDLE_BOUND:.0%})"
    return None


def pruned_space(cell: str, hidden_size: int, batch: int, dtype: str, facts: DeviceFacts, *, instances: int = 1,
                 pipeline: bool = False, tf32: bool = False) -> list[KernelConfig]:
    """The configurations :func:`prune` keeps, in enumeration order."""
    return [c for c in enumerate_space(cell, hidden_size, batch, dtype, facts, instances=instances, pipeline=pipeline,
                                       tf32=tf32)
            if prune(c, batch, facts) is None]

