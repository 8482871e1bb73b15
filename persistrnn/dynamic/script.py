"""Script generation: a :class:`~.graph.Graph` becomes one int32 program per
virtual processor (block), packed into one buffer with prefix offsets.

* Every node gets storage in one float workspace (values, and gradients at
  the same offsets); a slice is a view, at its parent's offset plus its start.
* Placement (VPPS §III-A): each weight matrix lives on its own subset of the
  blocks, a slice of rows per block (:class:`MatrixLayout`; a matrix of
  gates, all gates of a slice of units). All matvec nodes of one stage and
  one matrix are one instruction on each block that holds rows of it, over
  the list of their vectors, and so are its cell matvecs of one kind (each
  holder then finishes its units' cells); where the matrix has replicas
  (whole copies on further blocks), the list is dealt out among them.
* The other nodes of a stage form components (nodes joined by an input of
  the same stage): a component runs on one block, so its chain needs no
  barrier. Components go round-robin over the blocks, the costliest first
  (VPPS §III-B1); on each block, the nodes of one depth, op and size are one
  instruction over the list of their operands.
* Stages are ordered by one counter that only grows: every block that works
  in a stage signals (+1) when its part is done, and every block that works
  in a later stage first waits until the counter reaches the number of
  signals of all earlier stages. A block signals only after it waited for the
  stage before its own, so reaching a target means every earlier stage is
  done. Training appends the backward stages in reverse order on the same
  counter (targets keep growing); then every block waits for the last
  backward stage before the optimiser updates the parameters.

The buffer is (rows, :data:`WORDS`) int32: the instructions of block 0, 1, …,
then the operand lists. An instruction is ``op, n, count, arg``: ``count``
operands of ``n`` floats each, listed from row ``arg``; a wait's ``arg`` is its
counter target; a cell matvec's ``n`` is 4 * its matrix slot + its carried
cells. An operand row is ``out, a, b, p`` (workspace offsets; ``p``: a
lookup's parameter offset, a loss's label, a matvec's matrix slot, a cell
matvec's addend, 1 where a cell carries a cell state in ``b``).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import numpy as np

from ..errors import ArgumentError
from .graph import DISTRIBUTED, OP, Graph
from .model import Model

__all__ = ["BACKWARD", "MatrixLayout", "OPCODES", "PLACEMENTS", "Script", "WORDS", "matrix_layout", "schedule"]

WORDS = 4
OPCODES = {
    "wait": 1,  # arg: counter target
    "signal": 2,
    "lookup": 3,  # out[0:n] = params[p:p+n]
    "matvec": 4,  # out[rows of this block] = W[p] @ a (n = the matrix's columns)
    "add": 5, "mul": 6, "tanh": 7, "sigmoid": 8, "relu": 9,
    "copy": 10,  # out[0:n] = a[0:n] (one part of a concat)
    "loss": 11,  # out[0] = logsumexp(a[0:n]) - a[p]; added into the batch loss
    "sigmoid_mul": 12,  # out = sigmoid(a) * b
    "sigmoid_mul_tanh": 13,  # out = sigmoid(a) * tanh(b)
    # out[0:n/2] = h, out[n/2:n] = c of a cell from its gates a; p = 1 where b
    # holds the carried cell(s), 0 where the state is zero (Graph.lstm_cell, Graph.tree_cell)
    "lstm_cell": 14,
    "tree_cell": 15,
    # A cell over its gates' matvec, on the matrix's holders (Graph.lstm_matvec,
    # Graph.tree_matvec): operand rows out, a, b (the inputs), p (the addend);
    # n = 4 * matrix slot + carried cells
    "lstm_matvec": 16,
    "tree_matvec": 17,
}
BACKWARD = 32
"""Added to a forward opcode: the same nodes' backward instruction."""
assert max(OPCODES.values()) < BACKWARD, "forward opcodes stay below BACKWARD (the profile has a slot per opcode)"

PLACEMENTS = ("partition", "spread", "replicate")
"""``partition``: each matrix on its own blocks (VPPS); ``spread``: every
matrix's rows over all blocks (every block works on every matvec);
``replicate``: the partition, then whole copies of the matrices on further
blocks, which share a stage's vectors out (:func:`matrix_layout`)."""

_DISTRIBUTED = np.zeros(len(OP), dtype=bool)  # by graph op: np.isin sorts, ~20 µs a call on a batch-1 graph
_DISTRIBUTED[list(DISTRIBUTED)] = True
_KERNEL_OP = np.full(len(OP), -1, dtype=np.int64)
for _name, _code in OPCODES.items():
    if _name in OP:
        _KERNEL_OP[OP[_name]] = _code


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """Where the blocks keep the rows of every weight matrix.

    Matrix ``k`` (in declaration order among matrices) lives on the
    ``holders[k] * replicas[k]`` blocks from ``first_block[k]`` on (counted
    modulo ``blocks``); the ``i``-th of them is holder ``i % holders[k]`` of
    replica ``i // holders[k]``. A matrix's rows are ``gates[k]`` blocks of
    ``units = rows / gates`` (1 gate: every row its own unit); holder ``j``
    keeps units [j * u, min(units, (j + 1) * u)) of every gate, u =
    ``rows_per_block[k] / gates[k]``, gate after gate (:meth:`block_rows`),
    at ``shared_offset[k]`` floats into its weight cache (matrices that share
    a block have disjoint cache ranges). Every replica holds the whole
    matrix; a stage's vectors are dealt out among the replicas.
    """

    blocks: int
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    rows_per_block: tuple[int, ...]
    holders: tuple[int, ...]
    first_block: tuple[int, ...]
    param_offset: tuple[int, ...]
    shared_offset: tuple[int, ...]
    replicas: tuple[int, ...]
    gates: tuple[int, ...]

    @property
    def shared_floats(self) -> int:
        """Weight-cache floats per block (the gradient cache is as large again)."""
        return max(o + r * c for o, r, c in zip(self.shared_offset, self.rows_per_block, self.cols))

    def block_rows(self, k: int, block: int) -> np.ndarray:
        """The rows of matrix ``k`` on ``block`` in its cache's order (none
        where it holds none): its units' rows of each gate, gate after gate."""
        at = (block - self.first_block[k]) % self.blocks
        if at >= self.holders[k] * self.replicas[k]:
            return np.zeros(0, dtype=np.int64)
        units, per = self.rows[k] // self.gates[k], self.rows_per_block[k] // self.gates[k]
        start = at % self.holders[k] * per
        return (np.arange(self.gates[k])[:, None] * units + np.arange(start, min(start + per, units))).ravel()


def _partition(sizes: np.ndarray, rows: np.ndarray, blocks: int) -> np.ndarray:
    """Blocks per matrix, in proportion to its floats (VPPS: the cache per
    block is even), at least one each and at most one per row (``rows``: a
    matrix's units)."""
    count = np.clip(np.floor(blocks * sizes / sizes.sum()).astype(np.int64), 1, rows)
    while count.sum() > blocks:  # the floor of one raised small matrices: take from the least loaded
        load = np.where(count > 1, sizes / np.maximum(count - 1, 1), np.inf)
        count[np.argmin(load)] -= 1
    while count.sum() < blocks and np.any(count < rows):
        load = np.where(count < rows, sizes / count, -1.0)
        count[np.argmax(load)] += 1
    return count


def _check_placement(blocks: Any, placement: Any) -> None:
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ArgumentError(f"blocks must be an int >= 1, got {blocks!r}")
    if placement not in PLACEMENTS:
        raise ArgumentError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


ROW_GROWTH = 3
"""``replicate``: the most rows a holder keeps, as a multiple of the
partition's (a backward matvec's column loop runs over them)."""


def _cache_offsets(first: np.ndarray, spans: np.ndarray, slices: np.ndarray, blocks: int) -> np.ndarray:
    """Each matrix's offset in the weight cache: below every earlier matrix
    that shares a block with it. Matrix k spans ``spans[k]`` blocks from
    ``first[k]`` on (modulo ``blocks``), ``slices[k]`` floats on each."""
    on = (np.arange(blocks)[None, :] - first[:, None]) % blocks < spans[:, None]  # (matrices, blocks)
    shared = np.zeros(len(first), dtype=np.int64)
    for k in range(len(first)):
        shares = on[:k] @ on[k] > 0
        shared[k] = max((shared[:k] + slices[:k])[shares], default=0)
    return shared


def matrix_layout(model: Model, blocks: int, placement: str = "partition", cache_floats: int | None = None
                  ) -> MatrixLayout:
    """Place ``model``'s matrices on ``blocks`` blocks. ``partition`` (and
    ``replicate``) fall back to ``spread`` when there are more matrices than
    blocks.

    ``replicate`` starts from the partition and adds replicas one at a time,
    each to the matrices of one shape with the fewest replicas, all of them
    at once, so that matrices used alike (a BiLSTM's two directions') keep
    replicas alike; a matrix's replicas share the blocks, so each replica
    holds more rows where they would not fit otherwise, and the matrices of
    one shape go side by side (not stacked on shared blocks) where only that
    fits (the bench tagger's four LSTM matrices). A shape is done
    where its next replicas would grow a block's weight cache past
    ``cache_floats`` (None: no bound; an :class:`~.kernel.Interpreter`
    passes its device's), or its rows per block past ``ROW_GROWTH`` times
    the partition's. Every holder of a matrix reads all of a stage's
    vectors of it, so a stage of many vectors costs a holder about as long
    whatever its rows (a group of 8 vectors is one trip to memory, measured
    ~1.9 µs at batch 128, perf-notes dynamic §17); replicas divide the
    vectors.
    """
    _check_placement(blocks, placement)
    offsets = model.layout()
    mats = model.matrices
    rows = np.asarray([m.rows for m in mats], dtype=np.int64)
    cols = np.asarray([m.cols for m in mats], dtype=np.int64)
    gates = np.asarray([m.gates for m in mats], dtype=np.int64)
    units = rows // gates  # a holder keeps whole units: all their gates' rows
    partition = placement != "spread" and len(mats) <= blocks
    if partition:
        count = _partition(rows * cols, units, blocks)
    else:
        count = np.minimum(units, blocks)
    rpb = -(-units // count) * gates
    holders = -(-units // (rpb // gates))
    first = np.cumsum(holders) - holders if partition else np.zeros(len(mats), dtype=np.int64)
    replicas = np.ones(len(mats), dtype=np.int64)
    shared = _cache_offsets(first, holders, rpb * cols, blocks)
    if partition and placement == "replicate":
        shape = np.unique(np.stack([rows, cols]), axis=1, return_inverse=True)[1].ravel()
        most_rows = ROW_GROWTH * rpb
        done = np.zeros(len(mats), dtype=bool)
        while True:
            done |= replicas + 1 > blocks
            if done.all():
                break
            grow = (shape == shape[np.argmin(np.where(done, np.iinfo(np.int64).max, replicas))]) & ~done
            more = replicas + grow
            # Holders that fit the replicas: first each matrix's on the grid
            # alone; failing that, where the shape has several matrices (a
            # BiLSTM's four), all of theirs side by side, whose caches then
            # do not stack on shared blocks.
            for spread in sorted({1, int(grow.sum())}):
                fewer = np.where(grow, np.minimum(holders, blocks // (more * spread)), holders)
                more_units = -(-units // np.maximum(fewer, 1))
                fewer, more_rows = -(-units // more_units), more_units * gates
                trial = _cache_offsets(first, fewer * more, more_rows * cols, blocks)
                fits = not ((more_rows > most_rows).any() or cache_floats is not None
                            and int((trial + more_rows * cols).max()) > cache_floats)
                if fits:
                    break
            if not fits:
                done |= grow
            else:
                replicas, holders, rpb, shared = more, fewer, more_rows, trial
    as_tuple = lambda a: tuple(int(v) for v in a)  # noqa: E731
    return MatrixLayout(blocks, as_tuple(rows), as_tuple(cols), as_tuple(rpb), as_tuple(holders), as_tuple(first),
                        tuple(offsets[m.name] for m in mats), as_tuple(shared), as_tuple(replicas), as_tuple(gates))


@dataclasses.dataclass(frozen=True)
class Script:
    """A scheduled batch.

    program: (rows, WORDS) int32, block 0's instructions first, then the
    operand lists; starts: (blocks + 1,) prefix offsets of the instructions.
    offsets: each node's workspace offset. losses: the loss nodes. signals:
    the counter's final value. stages: barrier-separated stages (forward,
    then backward when training).
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

    @property
    def instructions(self) -> int:
        return int(self.starts[-1])

    def block_program(self, block: int) -> np.ndarray:
        return self.program[self.starts[block]:self.starts[block + 1]]

    def operands(self, instruction: np.ndarray) -> np.ndarray:
        """The (count, WORDS) operand rows of one instruction."""
        return self.program[instruction[3]:instruction[3] + instruction[2]]


def _storage(g: dict[str, np.ndarray], extra_floats: np.ndarray) -> tuple[np.ndarray, int]:
    """Workspace offset of every node: own storage for every node but a
    slice (its size plus ``extra_floats``: a cell matvec keeps its gates'
    pre-activations after its state, for the backward); a slice at its
    parent's offset plus its start (resolved through chains of slices, one
    link per pass)."""
    is_view = g["op"] == OP["slice"]
    own = np.where(is_view, 0, g["size"] + extra_floats)
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


def _components(g: dict[str, np.ndarray]) -> np.ndarray:
    """A label per node: nodes joined by an input read in the same stage
    (never through a matvec) share the smallest id among them."""
    op, root, stage = g["op"], g["root"], g["stage"]
    readable = ~_DISTRIBUTED[op]  # a distributed node's output is read one stage after it
    joins = readable & (op != OP["slice"])  # consumers that run in their inputs' stage
    with_a, with_b = (np.flatnonzero(joins & (x >= 0)) for x in (g["a"], g["b"]))
    consumers, sources = [], []
    for consumer, source in ((with_a, g["a"][with_a]), (with_b, g["b"][with_b]),
                             (g["concat_node"], g["concat_part"])):
        source = root[source]
        keep = readable[source] & (stage[source] == stage[consumer])  # filtered per column: no joined copy
        consumers.append(consumer[keep])
        sources.append(source[keep])
    u, v = np.concatenate(consumers), np.concatenate(sources)
    # Hooking and pointer jumping (Shiloach-Vishkin): every edge whose ends
    # have different roots hooks the larger root under the smaller, then
    # every node points at its root. A root is only ever hooked under a
    # smaller id, so each component's root is its smallest node. Two rounds
    # on the benchmarks' batch-128 graphs; measured 1.4-1.6x faster than
    # min-label propagation (five passes).
    parent = np.arange(len(op))
    while True:
        pu, pv = parent[u], parent[v]
        differ = pu != pv
        if not differ.any():
            return parent
        np.minimum.at(parent, np.maximum(pu, pv)[differ], np.minimum(pu, pv)[differ])
        while True:
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                break
            parent = jumped


@dataclasses.dataclass(frozen=True)
class _ModelTables:
    """What scheduling needs of a model and a placement, computed once: the
    layout, and per parameter its flat offset, rows, columns and matrix slot."""

    layout: MatrixLayout
    param_offset: np.ndarray
    param_rows: np.ndarray
    param_cols: np.ndarray
    matrix_slot: np.ndarray


_TABLES: weakref.WeakKeyDictionary[Model, dict[Any, _ModelTables]] = weakref.WeakKeyDictionary()
"""Per model (its layout is fixed once scheduled), per (blocks, placement)
and per layout given."""


def _model_tables(model: Model, blocks: int, placement: str, layout: MatrixLayout | None) -> _ModelTables:
    _check_placement(blocks, placement)  # before the lookup: True and 1.0 hash as 1 does
    if layout is not None and layout.blocks != blocks:  # before the lookup: the tables are per layout
        raise ArgumentError(f"the layout is for {layout.blocks} blocks; the graph is scheduled on {blocks}")
    per_model = _TABLES.setdefault(model, {})
    key = (blocks, placement) if layout is None else layout
    tables = per_model.get(key)
    if tables is None:
        if layout is None:
            layout = matrix_layout(model, blocks, placement)
        elif (layout.rows, layout.cols, layout.gates) != (rows := tuple(m.rows for m in model.matrices),
                                                           cols := tuple(m.cols for m in model.matrices),
                                                           gates := tuple(m.gates for m in model.matrices)):
            raise ArgumentError(f"the layout is for matrices of {layout.rows} rows, {layout.cols} columns and "
                                f"{layout.gates} gates; the graph's model has {rows}, {cols} and {gates}")
        offsets = model.layout()
        matrix_slot = np.full(len(model.parameters), -1, dtype=np.int64)
        for k, m in enumerate(model.matrices):
            matrix_slot[m.index] = k
        column = lambda name: np.asarray([getattr(p, name) for p in model.parameters], dtype=np.int64)  # noqa: E731
        tables = _ModelTables(layout, np.asarray([offsets[p.name] for p in model.parameters], dtype=np.int64),
                              column("rows"), column("cols"), matrix_slot)
        per_model[key] = tables
    return tables


def _sort_groups(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``np.lexsort(keys[::-1])`` (the first key most significant, ties in
    their order) and a flag per sorted position: its key tuple differs from
    the previous one's. Keys whose ranges multiply below 2**63 fold into one
    int64 (mixed radix): one stable argsort in place of one per key, and one
    comparison per position."""
    low = [int(k.min()) if k.size else 0 for k in keys]
    radix = [(int(k.max()) if k.size else 0) - lo + 1 for k, lo in zip(keys, low)]
    starts = np.ones(keys[0].size, dtype=bool)
    if math.prod(radix) >= 2**63:
        order = np.lexsort(keys[::-1])
        ordered = np.stack([k[order] for k in keys])
        starts[1:] = np.any(ordered[:, 1:] != ordered[:, :-1], axis=0)
        return order, starts
    folded = keys[0] - low[0]
    for key, lo, r in zip(keys[1:], low[1:], radix[1:]):
        folded = folded * r + (key - lo)
    order = np.argsort(folded, kind="stable")
    folded = folded[order]
    starts[1:] = folded[1:] != folded[:-1]
    return order, starts


def schedule(graph: Graph, blocks: int, *, train: bool = True, placement: str = "partition",
             layout: MatrixLayout | None = None) -> Script:
    """Schedule ``graph`` on ``blocks`` virtual processors (forward only
    unless ``train``), with ``placement``'s layout of the model's matrices,
    or ``layout`` where given (an interpreter's: :attr:`~.kernel.Interpreter.layout`)."""
    model = graph.model
    tables = _model_tables(model, blocks, placement, layout)
    layout, poff, pcols = tables.layout, tables.param_offset, tables.param_cols
    g = graph.arrays()
    op, size, stage, depth = g["op"], g["size"], g["stage"], g["depth"]
    gate_floats = np.zeros(len(op), dtype=np.int64)  # a cell matvec's gates, kept after its state
    cell_mv = np.flatnonzero((op == OP["lstm_matvec"]) | (op == OP["tree_matvec"]))
    gate_floats[cell_mv] = tables.param_rows[g["extra"][cell_mv]]
    offsets, workspace = _storage(g, gate_floats)

    # Blocks of the elementwise components: round-robin in order of
    # (stage, cost descending, first node); the rank runs on across stages,
    # so the blocks that take one stage's remainder change from stage to
    # stage. Every node has size >= 1, so a component with elementwise
    # nodes has a cost > 0.
    label = _components(g)
    distributed = _DISTRIBUTED[op]
    elementwise = (op != OP["slice"]) & ~distributed
    comp_floats = np.bincount(label[elementwise], weights=size[elementwise], minlength=len(op)).astype(np.int64)
    comps = np.flatnonzero(comp_floats)
    rank = np.empty(len(op), dtype=np.int64)
    rank[comps[_sort_groups([stage[comps], -comp_floats[comps]])[0]]] = np.arange(comps.size)
    node_block = rank[label] % blocks

    # Operand rows of the elementwise nodes: one per node, then one per
    # concat part (a copy), written into one array.
    run = np.flatnonzero(elementwise & (op != OP["concat"]))
    cat, part = g["concat_node"], g["concat_part"]
    items = np.zeros((run.size + cat.size, WORDS), dtype=np.int64)
    node_items = items[:run.size]
    node_items[:, 0] = offsets[run]
    a, b = g["a"][run], g["b"][run]
    node_items[:, 1] = np.where(a >= 0, offsets[np.maximum(a, 0)], 0)
    node_items[:, 2] = np.where(b >= 0, offsets[np.maximum(b, 0)], 0)
    run_op = op[run]
    is_lookup, is_loss = run_op == OP["lookup"], run_op == OP["loss"]
    extra = g["extra"][run]
    table = extra[is_lookup]
    node_items[is_lookup, 3] = poff[table] + g["row"][run[is_lookup]] * pcols[table]
    node_items[is_loss, 3] = extra[is_loss]
    node_items[:, 3] += ((run_op == OP["lstm_cell"]) | (run_op == OP["tree_cell"])) & (b >= 0)
    part_size = size[part]
    kop = np.concatenate([_KERNEL_OP[run_op], np.full(cat.size, OPCODES["copy"])])
    width = np.concatenate([size[run], part_size])
    width[:run.size][is_loss] = size[a[is_loss]]
    owner = np.concatenate([run, cat])
    if cat.size:
        ends = np.cumsum(part_size)
        first_of = np.flatnonzero(np.r_[True, cat[1:] != cat[:-1]])
        before = np.repeat(ends[first_of] - part_size[first_of], np.diff(np.r_[first_of, cat.size]))
        items[run.size:, 0] = offsets[cat] + ends - part_size - before
        items[run.size:, 1] = offsets[part]

    # One instruction per (block, stage, depth, op, width) of elementwise
    # operands; the matvec operands of one (stage, matrix) dealt out among
    # its replicas in contiguous parts, one instruction per part on each
    # holder of its replica.
    # A cell matvec's operand row: out, its inputs a and b, its addend;
    # carried: its states' count (0: an input vector, zero state).
    mv = np.flatnonzero(distributed)
    mv_slot = tables.matrix_slot[g["extra"][mv]]
    mv_a, mv_b, mv_c = g["a"][mv], g["b"][mv], g["c"][mv]
    mv_items = np.zeros((mv.size, WORDS), dtype=np.int64)
    mv_items[:, 0] = offsets[mv]
    mv_items[:, 1] = offsets[mv_a]
    mv_items[:, 2] = np.where(mv_b >= 0, offsets[np.maximum(mv_b, 0)], 0)
    mv_items[:, 3] = np.where(mv_c >= 0, offsets[np.maximum(mv_c, 0)], mv_slot)
    mv_kop = _KERNEL_OP[op[mv]]
    carried = np.where(mv_b >= 0, 2, (size[mv_a] != pcols[g["extra"][mv]]).astype(np.int64))
    item_order, new_group = _sort_groups([node_block[owner], stage[owner], depth[owner], kop, width])
    first_row = np.flatnonzero(new_group)
    first_node, first_item = owner[item_order[first_row]], item_order[first_row]
    mv_order, mv_new = _sort_groups([stage[mv], mv_slot, mv_kop, carried])
    mv_stage = stage[mv][mv_order]
    mv_first = np.flatnonzero(mv_new)
    ew_count = np.diff(np.r_[first_row, len(items)])
    mv_count = np.diff(np.r_[mv_first, len(mv_items)])
    slot = mv_slot[mv_order[mv_first]]
    # matvec: n = the matrix's columns; cell matvec: 4 * matrix slot + carried cells
    mv_word = mv_kop[mv_order[mv_first]]
    mv_n = np.where(mv_word == OPCODES["matvec"], np.asarray(layout.cols)[slot], 4 * slot + carried[mv_order[mv_first]])
    holders, first_block = np.asarray(layout.holders), np.asarray(layout.first_block)
    parts = np.minimum(np.asarray(layout.replicas)[slot], mv_count)  # per (stage, matrix, op, carried) group
    part_group = np.repeat(np.arange(mv_first.size), parts)
    replica = np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts)
    part_count = mv_count[part_group] // parts[part_group] + (replica < mv_count[part_group] % parts[part_group])
    part_first = np.cumsum(part_count) - part_count  # the parts of a group follow each other in the list rows
    slot, mv_word, mv_n = slot[part_group], mv_word[part_group], mv_n[part_group]
    per = holders[slot]
    mv_group = np.repeat(np.arange(part_group.size), per)  # one instruction per part and holder
    holder = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    mv_block = (first_block[slot] + replica * per)[mv_group] + holder
    mv_block %= layout.blocks
    mv_count, mv_first = part_count, part_first
    mv_stage = mv_stage[mv_first]
    # Instructions: (block, stage, order in stage, words); arg is a row of the
    # operand lists, made absolute once the instruction count is known.
    inst_block = np.concatenate([node_block[first_node], mv_block])
    inst_stage = np.concatenate([stage[first_node], mv_stage[mv_group]])
    inst_order = np.concatenate([depth[first_node], slot[mv_group]])
    inst = np.zeros((inst_block.size, WORDS), dtype=np.int64)
    inst[:, 0] = np.concatenate([kop[first_item], mv_word[mv_group]])
    inst[:, 1] = np.concatenate([width[first_item], mv_n[mv_group]])
    inst[:, 2] = np.concatenate([ew_count, mv_count[mv_group]])
    inst[:, 3] = np.concatenate([first_row, len(items) + mv_first[mv_group]])

    # Stages: forward in order, then (training) backward in reverse order,
    # the nodes of a stage in reverse depth order.
    used = np.bincount(inst_stage) > 0
    levels = int(used.sum())
    rank_of = (np.cumsum(used) - 1)[inst_stage]
    ops_words, ops_stage, ops_block, ops_order = [inst], [rank_of], [inst_block], [inst_order]
    if train:
        back = inst.copy()
        back[:, 0] += BACKWARD
        ops_words.append(back)
        ops_stage.append(2 * levels - 1 - rank_of)
        ops_block.append(inst_block)
        ops_order.append(-inst_order)
    ops_words, ops_stage = np.concatenate(ops_words), np.concatenate(ops_stage)
    ops_block, ops_order = np.concatenate(ops_block), np.concatenate(ops_order)
    stages = levels * (2 if train else 1)

    # Who works in each stage: those wait before it and signal at its end.
    works = np.zeros(stages * blocks, dtype=bool)
    works[ops_stage * blocks + ops_block] = True
    key = np.flatnonzero(works)
    part_stage, part_block = key // blocks, key % blocks
    through = np.cumsum(np.bincount(part_stage, minlength=stages))  # counter value once stage s is done
    waits = part_stage > 0
    wait_words = np.zeros((int(waits.sum()), WORDS), dtype=np.int64)
    wait_words[:, 0] = OPCODES["wait"]
    wait_words[:, 3] = through[part_stage[waits] - 1]
    signal = part_stage < stages - 1 if not train else np.ones(key.size, dtype=bool)  # nobody waits on the last
    signal_words = np.zeros((int(signal.sum()), WORDS), dtype=np.int64)
    signal_words[:, 0] = OPCODES["signal"]
    all_words = [wait_words, ops_words, signal_words]
    all_block = [part_block[waits], ops_block, part_block[signal]]
    all_stage = [part_stage[waits], ops_stage, part_stage[signal]]
    # In a stage: the wait first, then the instructions, then the signal.
    wait_order, signal_order = int(ops_order.min()) - 1, int(ops_order.max()) + 1
    all_order = [np.full(wait_words.shape[0], wait_order), ops_order, np.full(signal_words.shape[0], signal_order)]
    signals = int(through[-1]) if train else (int(through[-2]) if stages > 1 else 0)
    if train:
        # Every block waits for the last backward stage (so for all of them)
        # before the update.
        closing = np.zeros((blocks, WORDS), dtype=np.int64)
        closing[:, 0] = OPCODES["wait"]
        closing[:, 3] = signals
        all_words.append(closing)
        all_block.append(np.arange(blocks))
        all_stage.append(np.full(blocks, stages))
        all_order.append(np.zeros(blocks, dtype=np.int64))
    block_of = np.concatenate(all_block)
    order = _sort_groups([block_of, np.concatenate(all_stage), np.concatenate(all_order)])[0]
    words = np.concatenate(all_words)
    words[len(wait_words):len(wait_words) + len(ops_words), 3] += len(words)  # list rows follow the instructions
    # The int32 program is written once: the instructions, then the operand
    # lists gathered straight from their unsorted rows (mode "clip": no
    # bounds buffer; the orders are permutations).
    rows = len(words) + len(items) + len(mv_items)
    high = max(int(words.max()), int(items.max()) if items.size else 0, int(mv_items.max()) if mv_items.size else 0)
    if max(high, workspace) >= 2**31:  # a node that starts below 2**31 may end past it
        raise ArgumentError(f"the batch needs a workspace of {workspace} floats and {rows} script rows; "
                            "offsets must fit in int32: split the batch")
    program = np.empty((rows, WORDS), dtype=np.int32)
    np.take(words, order, axis=0, out=program[:len(words)], mode="clip")
    np.take(items, item_order, axis=0, out=program[len(words):len(words) + len(items)], mode="clip")
    np.take(mv_items, mv_order, axis=0, out=program[len(words) + len(items):], mode="clip")
    starts = np.concatenate([[0], np.cumsum(np.bincount(block_of, minlength=blocks))])
    losses = np.flatnonzero(op == OP["loss"])
    return Script(program, starts.astype(np.int32), offsets, workspace, losses, signals, stages, train, layout)
