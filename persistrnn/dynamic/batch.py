"""Whole-batch graph building with NumPy: the ready builders' fast path.

A ready builder adds the same few node patterns again and again: a Tree-LSTM
cell per tree node, an LSTM step per token. A :class:`Template` records one
pattern once, by running the builder's own cell code on a probe
:class:`~.graph.Graph` whose inputs (the *slots*: a child's ``h`` and ``c``,
a token's embedding) are placeholder nodes. :func:`instantiate` then writes
every instance of every template of a batch into the node columns at once,
in the order the expression API would have created them, so the graph (and
the script scheduled from it) is the one the expression API builds.

A node's depth and stage are ``max(constant, max over slots of slot value +
offset)`` (max-plus linear in the slots), so a template keeps those
coefficients per row; only the instances' outputs are evaluated level by
level (an instance's slots are earlier instances' outputs), every row once
at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ..errors import ArgumentError
from .graph import DISTRIBUTED, OP, Expr, Graph
from .model import Parameter

__all__ = ["Template", "Instances", "instantiate"]

_NONE = -(2**40)
"""A coefficient for "does not depend on this slot": far below any real depth or stage."""
_SLICE, _LOOKUP, _LOSS = OP["slice"], OP["lookup"], OP["loss"]


@dataclasses.dataclass(frozen=True)
class Template:
    """One recorded node pattern of ``rows`` nodes over ``slots`` inputs.

    References (``a``, ``b``, ``c``, ``root``, ``part``): ``r >= 0`` is row
    ``r`` of the same instance, ``-1`` none, ``-2 - s`` slot ``s``. ``depth``,
    ``stage`` and ``ready`` (the first stage an elementwise row can read it in):
    (rows, 1 + 3 slots) max-plus coefficients, column 0 the constant, then
    over the slots' depths, ready stages and stages (a slice of a slot takes
    the slot's stage). Rows that look up a row of ``words`` take the
    instance's word id; loss rows take its label. ``outputs``: the rows other
    instances' slots read; ``slot_output``: which output of its source
    instance each slot reads.
    """

    op: np.ndarray
    size: np.ndarray
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    extra: np.ndarray
    root: np.ndarray
    depth: np.ndarray
    stage: np.ndarray
    ready: np.ndarray
    pair_row: np.ndarray
    pair_ref: np.ndarray
    word_row: np.ndarray
    label_row: np.ndarray
    outputs: np.ndarray
    slot_output: np.ndarray

    @property
    def rows(self) -> int:
        return self.op.size

    @classmethod
    def record(cls, graph: Graph, slot_sizes: Sequence[int], slot_output: Sequence[int], words: Parameter | None,
               cell: Callable[[Graph, list[Expr]], Sequence[Expr]]) -> Template:
        """Run ``cell(probe, slot_exprs)`` on a probe graph of ``graph``'s model;
        ``cell`` returns the output expressions (nodes it made, not slices)."""
        probe = Graph(graph.model)
        slots = [probe._node("lookup", size) for size in slot_sizes]
        outputs = [x.id for x in cell(probe, slots)]
        S = len(slots)
        col = probe.arrays()
        rows = len(col["op"]) - S

        def ref(ids: np.ndarray) -> np.ndarray:
            return np.where(ids < 0, -1, np.where(ids < S, -2 - ids, ids - S))

        op = col["op"][S:]
        # Depth and stage coefficients by the expression API's rules (Graph._node), symbolically.
        depth, stage, ready = (np.full((S + rows, 1 + 3 * S), _NONE, dtype=np.int64) for _ in range(3))
        for s in range(S):
            depth[s, 1 + s] = 0
            ready[s, 1 + S + s] = 0
            stage[s, 1 + 2 * S + s] = 0
        pair_node, pair_part = col["concat_node"], col["concat_part"]
        for node in range(S, S + rows):
            kind, a, b, c = col["op"][node], col["a"][node], col["b"][node], col["c"][node]
            inputs = pair_part[pair_node == node] if kind == OP["concat"] else [i for i in (a, b, c) if i >= 0]
            if kind == _SLICE:
                depth[node], stage[node] = depth[a], stage[a]
            elif kind in DISTRIBUTED:
                depth[node] = np.max([depth[i] for i in inputs], axis=0) + 1
                stage[node] = np.max([stage[i] for i in inputs], axis=0) + 1
            elif len(inputs):
                depth[node] = np.max([depth[i] for i in inputs], axis=0) + 1
                stage[node] = np.max([ready[i] for i in inputs], axis=0)
            else:
                depth[node, 0], stage[node, 0] = 0, 0
            root = col["root"][node]
            ready[node] = ready[root] if root < S else stage[root] + (col["op"][root] in DISTRIBUTED)
        if any(o < S or op[o - S] == _SLICE for o in outputs):
            raise ArgumentError("a template's outputs must be nodes it makes, not slices or its inputs")
        is_word = (op == _LOOKUP) & (col["extra"][S:] == (words.index if words is not None else -1))
        return cls(op, col["size"][S:], ref(col["a"][S:]), ref(col["b"][S:]), ref(col["c"][S:]), col["extra"][S:],
                   ref(col["root"][S:]), depth[S:], stage[S:], ready[S:], pair_node[pair_node >= S] - S,
                   ref(pair_part[pair_node >= S]), np.flatnonzero(is_word), np.flatnonzero(op == _LOSS),
                   np.asarray(outputs, dtype=np.int64) - S, np.asarray(slot_output, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Instances:
    """The instances of one template in a batch: ``index`` their positions in
    creation order (over all templates), ``sources`` (count, slots) the
    instance each slot reads, ``level`` 1 + their sources' deepest level,
    ``word`` and ``label`` (count,) where the template takes them."""

    template: Template
    index: np.ndarray
    sources: np.ndarray
    level: np.ndarray
    word: np.ndarray | None = None
    label: np.ndarray | None = None


def _max_plus(coef: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(count, rows): max(coef[:, 0], max_k values[:, k] + coef[:, 1 + k]), a used slot column at a time."""
    out = np.empty((values.shape[0], coef.shape[0]), dtype=np.int64)
    out[:] = coef[:, 0]
    term = np.empty_like(out)  # both buffers reused for every slot column: no temporaries
    for k in np.flatnonzero(np.any(coef[:, 1:] > _NONE // 2, axis=0)).tolist():
        np.add(values[:, k, None], coef[:, 1 + k], out=term)
        np.maximum(out, term, out=out)
    return out


def _padded(slots: int, padded_slots: int) -> np.ndarray:
    """Where a template's 3 ``slots`` slot columns sit among 3 ``padded_slots``."""
    return np.concatenate([np.arange(slots) + j * padded_slots for j in range(3)])


def instantiate(graph: Graph, groups: Sequence[Instances]) -> np.ndarray:
    """Append every instance of ``groups`` to ``graph``; returns the instances'
    first node ids, in creation order."""
    count = sum(gr.index.size for gr in groups)
    rows = np.zeros(count, dtype=np.int64)
    for gr in groups:
        rows[gr.index] = gr.template.rows
    first = len(graph) + np.concatenate([[0], np.cumsum(rows)[:-1]])
    outputs = max(gr.template.outputs.size for gr in groups)
    out_id = np.zeros((count, outputs), dtype=np.int64)
    for gr in groups:
        out_id[gr.index, :gr.template.outputs.size] = first[gr.index, None] + gr.template.outputs

    # The outputs' depth, ready stage and stage, level by level, all
    # templates at once (a level has few instances; a chain such as the
    # tagger's has one level per token): coefficients padded to the most
    # slots and outputs, (3 outputs, 1 + 3 slots) per template.
    slots = max(gr.template.slot_output.size for gr in groups)
    out_state = np.zeros((count, outputs, 3), dtype=np.int64)
    kind = np.zeros(count, dtype=np.int64)
    sources = np.zeros((count, slots), dtype=np.int64)
    slot_output = np.zeros((len(groups), slots), dtype=np.int64)
    out_coef = np.full((len(groups), 3 * outputs, 1 + 3 * slots), _NONE, dtype=np.int64)
    for k, gr in enumerate(groups):
        t = gr.template
        S, O = t.slot_output.size, t.outputs.size
        kind[gr.index] = k
        sources[gr.index, :S] = gr.sources
        slot_output[k, :S] = t.slot_output
        where = np.concatenate([[0], 1 + _padded(S, slots)])
        for j, coef in enumerate((t.depth, t.ready, t.stage)):
            out_coef[k, j * outputs:j * outputs + O][:, where] = coef[t.outputs]

    def slot_values(members: np.ndarray) -> np.ndarray:
        """(members, 3 slots): the slots' depths, ready stages, stages (padded)."""
        state = out_state[sources[members], slot_output[kind[members]]]
        return state.transpose(0, 2, 1).reshape(members.size, 3 * slots)

    level = np.zeros(count, dtype=np.int64)
    for gr in groups:
        level[gr.index] = gr.level
    # A level has few instances (a tree batch ~30 levels of ~10-200), so the
    # loop is bound by its NumPy calls: everything that does not read the
    # previous levels' outputs is gathered in level order once, before it.
    order = np.argsort(level, kind="stable")
    bounds = np.flatnonzero(np.diff(level[order])) + 1
    ordered_coef = out_coef[kind[order]]
    constant, slot_coef = ordered_coef[:, :, 0], ordered_coef[:, :, 1:]
    ordered_sources, ordered_slot_output = sources[order], slot_output[kind[order]]
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), count]):
        value = constant[lo:hi]
        if slots and lo:  # the lowest level's instances read no other instance (a tree's leaves)
            state = out_state[ordered_sources[lo:hi], ordered_slot_output[lo:hi]]  # (members, slots, 3)
            slot_value = state.transpose(0, 2, 1).reshape(hi - lo, 1, 3 * slots)
            value = np.maximum(value, (slot_value + slot_coef[lo:hi]).max(axis=2))
        out_state[order[lo:hi]] = value.reshape(hi - lo, 3, outputs).transpose(0, 2, 1)

    # Every row of every instance, scattered into creation order.
    total = int(rows.sum())
    columns = {k: np.empty(total, dtype=np.int64)
               for k in ("op", "size", "a", "b", "c", "extra", "depth", "stage", "root")}
    columns["row"] = np.zeros(total, dtype=np.int64)
    pair_nodes, pair_parts = [], []
    for gr in groups:
        t = gr.template
        base = first[gr.index]
        at = (base - len(graph))[:, None] + np.arange(t.rows)
        slot_ids = out_id[gr.sources, t.slot_output]

        def resolve(ref: np.ndarray, base: np.ndarray = base, slot_ids: np.ndarray = slot_ids) -> np.ndarray:
            ids = base[:, None] + ref
            ids[:, ref == -1] = -1
            from_slot = np.flatnonzero(ref < -1)
            ids[:, from_slot] = slot_ids[:, -2 - ref[from_slot]]
            return ids

        values = slot_values(gr.index)[:, _padded(t.slot_output.size, slots)]
        columns["op"][at] = t.op
        columns["size"][at] = t.size
        columns["a"][at] = resolve(t.a)
        columns["b"][at] = resolve(t.b)
        columns["c"][at] = resolve(t.c)
        columns["root"][at] = resolve(t.root)
        columns["extra"][at] = t.extra
        if t.word_row.size:
            columns["row"][at[:, t.word_row]] = gr.word[:, None]
        if t.label_row.size:
            columns["extra"][at[:, t.label_row]] = gr.label[:, None]
        columns["depth"][at] = _max_plus(t.depth, values)
        columns["stage"][at] = _max_plus(t.stage, values)
        if t.pair_row.size:
            pair_nodes.append((base[:, None] + t.pair_row).ravel())
            pair_parts.append(resolve(t.pair_ref).ravel())
    if pair_nodes:
        nodes = np.concatenate(pair_nodes)
        order = np.argsort(nodes, kind="stable")  # by node; a concat's parts keep their order
        columns["concat_node"], columns["concat_part"] = nodes[order], np.concatenate(pair_parts)[order]
    else:
        columns["concat_node"] = columns["concat_part"] = np.zeros(0, dtype=np.int64)
    graph._append(columns)
    return first
