"""Script generation: a :class:`~.graph.Graph` becomes one int32 program per
virtual processor (block), packed into one buffer with prefix offsets.

* Every node gets storage in one float workspace (values, and gradients at
  the same offsets); a slice is a view, at its parent's offset plus its start.
* Nodes are sorted by depth. A weight matrix's rows are spread over the
  blocks (:class:`MatrixLayout`), so a matrix-vector node runs on every block
  that holds rows of its matrix, each writing its rows; any other node goes to
  the least-loaded block of its level (longest first, VPPS §III-B1).
* Levels are ordered by one counter that only grows: every block that works
  in a level signals (+1) when its part is done, and every block that works in
  the next level first waits until the counter reaches the number of signals
  of all earlier levels. A level's signals can only start after the level
  before it has completed, so reaching a target means every earlier level is
  done. Training appends the backward levels in reverse depth order on the
  same counter (targets keep growing), then a barrier of every block before
  the optimiser updates the biases and embeddings.

Instructions are :data:`WORDS` int32 each: ``op, n, out, a, b, p0, p1, p2``
(offsets count floats of the workspace; see :data:`OPCODES`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ArgumentError
from .graph import OP, Graph
from .model import Model

__all__ = ["BACKWARD", "MatrixLayout", "OPCODES", "Script", "WORDS", "matrix_layout", "schedule"]

WORDS = 8
OPCODES = {
    "wait": 1,  # p0: counter target
    "signal": 2,
    "lookup": 3,  # out[0:n] = params[p0:p0+n]
    "matvec": 4,  # out[rows of this block] = W[p0] @ a (n = the matrix's rows)
    "add": 5, "mul": 6, "tanh": 7, "sigmoid": 8, "relu": 9,
    "copy": 10,  # out[0:n] = a[0:n] (one part of a concat)
    "loss": 11,  # out[0] = logsumexp(a[0:n]) - a[p0]; added into the batch loss
}
BACKWARD = 16
"""Added to a forward opcode: the same node's backward instruction."""

_KERNEL_OP = np.full(len(OP), -1, dtype=np.int64)
for _name, _code in OPCODES.items():
    if _name in OP:
        _KERNEL_OP[OP[_name]] = _code


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """Where the blocks keep the rows of every weight matrix.

    Matrix ``k`` (in declaration order among matrices) keeps rows
    [p * rows_per_block[k], min(rows, (p + 1) * rows_per_block[k])) on block
    ``p``, at ``shared_offset[k]`` floats into the block's weight cache; blocks
    past ``holders[k]`` keep none of it.
    """

    blocks: int
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    rows_per_block: tuple[int, ...]
    holders: tuple[int, ...]
    param_offset: tuple[int, ...]
    shared_offset: tuple[int, ...]

    @property
    def shared_floats(self) -> int:
        """Weight-cache floats per block (the gradient cache is as large again)."""
        return sum(r * c for r, c in zip(self.rows_per_block, self.cols))

    def block_rows(self, k: int, block: int) -> tuple[int, int]:
        start = block * self.rows_per_block[k]
        return min(start, self.rows[k]), min(start + self.rows_per_block[k], self.rows[k])


def matrix_layout(model: Model, blocks: int) -> MatrixLayout:
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ArgumentError(f"blocks must be an int >= 1, got {blocks!r}")
    offsets = model.layout()
    mats = model.matrices
    rpb = [-(-m.rows // blocks) for m in mats]
    shared = np.concatenate([[0], np.cumsum([r * m.cols for r, m in zip(rpb, mats)])])[:-1]
    return MatrixLayout(blocks, tuple(m.rows for m in mats), tuple(m.cols for m in mats), tuple(rpb),
                        tuple(-(-m.rows // r) for m, r in zip(mats, rpb)), tuple(offsets[m.name] for m in mats),
                        tuple(int(s) for s in shared))


@dataclasses.dataclass(frozen=True)
class Script:
    """A scheduled batch.

    program: (instructions, WORDS) int32, block 0's script first; starts:
    (blocks + 1,) prefix offsets in instructions. offsets: each node's
    workspace offset. losses: the loss nodes. signals: the counter's final
    value. stages: levels (forward, then backward when training).
    """

    program: np.ndarray
    starts: np.ndarray
    offsets: np.ndarray
    workspace_floats: int
    losses: np.ndarray
    signals: int
    stages: int
    train: bool
    layout: MatrixLayout

    @property
    def blocks(self) -> int:
        return self.layout.blocks

    def block_program(self, block: int) -> np.ndarray:
        return self.program[self.starts[block]:self.starts[block + 1]]


def _storage(g: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
    """Workspace offset of every node: own storage for every node but a
    slice; a slice at its parent's offset plus its start (resolved through
    chains of slices, one link per pass)."""
    is_view = g["op"] == OP["slice"]
    own = np.where(is_view, 0, g["size"])
    offsets = np.concatenate([[0], np.cumsum(own)])
    total = int(offsets[-1])
    offsets = offsets[:-1].copy()
    views = np.flatnonzero(is_view)
    parent, start = g["a"][views], g["extra"][views]
    while views.size:
        offsets[views] = offsets[parent] + start
        chained = is_view[parent]
        views, start, parent = views[chained], start[chained] + g["extra"][parent[chained]], g["a"][parent[chained]]
    return offsets, total


def _costs(g: dict[str, np.ndarray], layout: MatrixLayout, matrix_slot: np.ndarray) -> np.ndarray:
    """A load estimate per node, in floats touched (VPPS weighs the cached
    matrices above the other operations)."""
    cost = g["size"].astype(np.float64)
    cost[g["op"] == OP["loss"]] = 4 * g["size"][g["a"][g["op"] == OP["loss"]]]
    mv = g["op"] == OP["matvec"]
    k = matrix_slot[g["extra"][mv]]
    cost[mv] = np.asarray(layout.rows_per_block)[k] * np.asarray(layout.cols)[k]
    return cost


def schedule(graph: Graph, blocks: int, *, train: bool = True) -> Script:
    """Schedule ``graph`` on ``blocks`` virtual processors (forward only
    unless ``train``)."""
    model = graph.model
    layout = matrix_layout(model, blocks)
    g = graph.arrays()
    offsets, workspace = _storage(g)
    poff = np.asarray([model.layout()[p.name] for p in model.parameters], dtype=np.int64)
    pcols = np.asarray([p.cols for p in model.parameters], dtype=np.int64)
    matrix_slot = np.full(len(model.parameters), -1, dtype=np.int64)
    for k, m in enumerate(model.matrices):
        matrix_slot[m.index] = k

    op = g["op"]
    run = np.flatnonzero(op != OP["slice"])
    # One row per instruction of a node: (node, block, words). A node's words.
    words = np.zeros((len(run), WORDS), dtype=np.int64)
    r_op = op[run]
    words[:, 0] = _KERNEL_OP[r_op]
    words[:, 1] = g["size"][run]
    words[:, 2] = offsets[run]
    has_a, has_b = g["a"][run] >= 0, g["b"][run] >= 0
    words[has_a, 3] = offsets[g["a"][run][has_a]]
    words[has_b, 4] = offsets[g["b"][run][has_b]]
    lk = r_op == OP["lookup"]
    words[lk, 5] = poff[g["extra"][run][lk]] + g["row"][run][lk] * pcols[g["extra"][run][lk]]
    ls = r_op == OP["loss"]
    words[ls, 1] = g["size"][g["a"][run][ls]]
    words[ls, 5] = g["extra"][run][ls]
    mv = r_op == OP["matvec"]
    words[mv, 5] = matrix_slot[g["extra"][run][mv]]
    nodes = run.copy()

    # A concat is one copy per part, on one block.
    cat = np.flatnonzero(r_op == OP["concat"])
    if cat.size:
        extra_nodes, extra_words = [], []
        for i in run[cat]:
            start = offsets[i]
            for part in graph.parts[int(i)]:
                extra_nodes.append(i)
                extra_words.append((OPCODES["copy"], g["size"][part], start, offsets[part], 0, 0, 0, 0))
                start += g["size"][part]
        keep = np.ones(len(run), dtype=bool)
        keep[cat] = False
        nodes = np.concatenate([nodes[keep], extra_nodes])
        words = np.concatenate([words[keep], np.asarray(extra_words, dtype=np.int64)])

    # Assign blocks level by level: matvec rows to their holders, the rest
    # longest first to the least-loaded block of the level.
    depth = g["depth"][nodes]
    cost = _costs(g, layout, matrix_slot)[nodes]
    is_mv = words[:, 0] == OPCODES["matvec"]
    holders = np.asarray(layout.holders)
    mv_rows = np.flatnonzero(is_mv)
    mv_count = holders[words[mv_rows, 5]]
    mv_index = np.repeat(mv_rows, mv_count)
    mv_block = np.arange(mv_count.sum()) - np.repeat(np.cumsum(mv_count) - mv_count, mv_count)
    other = np.flatnonzero(~is_mv)
    block = np.empty(len(nodes), dtype=np.int64)
    levels = np.unique(depth)
    by_level = np.argsort(depth[other], kind="stable")
    bounds = np.append(np.searchsorted(depth[other][by_level], levels), len(other))
    # The matvec rows' load of each (level, block), for the balance of the rest.
    mv_stage = np.searchsorted(levels, depth[mv_index])
    mv_load = np.bincount(mv_stage * blocks + mv_block, weights=cost[mv_index],
                          minlength=len(levels) * blocks).reshape(len(levels), blocks)
    for li in range(len(levels)):
        items = other[by_level[bounds[li]:bounds[li + 1]]]
        if items.size:
            items = items[np.argsort(-cost[items], kind="stable")]
            block[items] = np.argsort(mv_load[li], kind="stable")[np.arange(items.size) % blocks]
    inst_index = np.concatenate([other, mv_index])
    inst_block = np.concatenate([block[other], mv_block])
    inst_words = words[inst_index]
    inst_level = depth[inst_index]

    # Stages: forward levels in depth order, then (training) backward levels
    # in reverse depth order.
    stage_of_level = np.searchsorted(levels, inst_level)
    stage_words = [inst_words]
    stage = [stage_of_level]
    stage_block = [inst_block]
    if train:
        back = inst_words.copy()
        back[:, 0] += BACKWARD
        stage_words.append(back)
        stage.append(2 * len(levels) - 1 - stage_of_level)
        stage_block.append(inst_block)
    ops_words = np.concatenate(stage_words)
    ops_stage = np.concatenate(stage)
    ops_block = np.concatenate(stage_block)
    stages = len(levels) * (2 if train else 1)

    # Who works in each stage: those signal at its end and wait before it.
    key = np.unique(ops_stage * blocks + ops_block)
    part_stage, part_block = key // blocks, key % blocks
    per_stage = np.bincount(part_stage, minlength=stages)
    through = np.cumsum(per_stage)  # counter value once stage s is done
    waits = part_stage > 0
    wait_words = np.zeros((int(waits.sum()), WORDS), dtype=np.int64)
    wait_words[:, 0] = OPCODES["wait"]
    wait_words[:, 5] = through[part_stage[waits] - 1]
    signal_words = np.zeros((len(key), WORDS), dtype=np.int64)
    signal_words[:, 0] = OPCODES["signal"]
    all_words = [wait_words, ops_words, signal_words]
    all_block = [part_block[waits], ops_block, part_block]
    all_stage = [part_stage[waits], ops_stage, part_stage]
    all_phase = [np.zeros(len(wait_words)), np.ones(len(ops_words)), np.full(len(key), 2)]
    if not train:
        # Nobody waits on the last level's signals.
        last = part_stage == stages - 1
        all_words[2], all_block[2] = signal_words[~last], part_block[~last]
        all_stage[2], all_phase[2] = part_stage[~last], all_phase[2][~last]
        signals = int(through[-2]) if stages > 1 else 0
    else:
        # Every block, then the update of biases and embeddings.
        final = np.zeros((2 * blocks, WORDS), dtype=np.int64)
        final[:blocks, 0] = OPCODES["signal"]
        final[blocks:, 0] = OPCODES["wait"]
        signals = int(through[-1]) + blocks
        final[blocks:, 5] = signals
        all_words.append(final)
        all_block.append(np.tile(np.arange(blocks), 2))
        all_stage.append(np.full(2 * blocks, stages))
        all_phase.append(np.repeat([0, 1], blocks))
    w = np.concatenate(all_words)
    b = np.concatenate(all_block)
    order = np.lexsort((np.concatenate(all_phase), np.concatenate(all_stage), b))
    program = w[order]
    if program.max() >= 2**31:
        raise ArgumentError(f"the batch needs a workspace of {workspace} floats; offsets must fit in int32: "
                            "split the batch")
    starts = np.concatenate([[0], np.cumsum(np.bincount(b, minlength=blocks))])
    losses = np.flatnonzero(op == OP["loss"])
    return Script(program.astype(np.int32), starts.astype(np.int32), offsets, workspace, losses, signals,
                  stages, train, layout)
