"""A default configuration from sizes alone, before (or without) the planner."""

from __future__ import annotations

import dataclasses
import math

from ..cells import get_cell
from ..errors import ConfigError
from .config import MAX_CLUSTER, KernelConfig
from .layout import MMA_BATCH, WARP

__all__ = ["blocks_for", "default_config"]


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
