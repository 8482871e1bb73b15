"""The expression API: one :class:`Graph` per batch, holding any number of
inputs' computation graphs side by side.

Every expression is a node with a vector value. Nodes are recorded in
creation order, which is a topological order (an expression's inputs exist
before it). Two numbers are known when a node is made:

* its **depth**, 1 + its inputs' deepest: nodes of one depth never depend on
  each other, so the scheduler runs them as one batched instruction;
* its **stage**, the barrier-separated step of the script it runs in. A
  *distributed* node (a matvec, or a cell over its gates' matvec:
  ``lstm_matvec``, ``tree_matvec``) runs on its matrix's holders in the first
  stage after all its inputs are complete; any other node in the first stage
  in which all its inputs can be read: its elementwise inputs' stage (it
  runs on their block), a distributed input's next one. So a chain of
  elementwise nodes stays in one stage, on one block, without a barrier; a
  Tree-LSTM level costs two stages as a matvec and a cell, one as a
  ``tree_matvec``.

A slice is a view of its parent's storage and runs nothing (``root`` is the
node that owns the storage); the loss of a node (softmax cross-entropy) ends a
path and adds into the batch's loss, the sum over every loss node.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError
from .model import Model, Parameter

__all__ = ["Expr", "Graph", "OPS"]

OPS = ("lookup", "matvec", "add", "mul", "tanh", "sigmoid", "relu", "concat", "loss", "slice", "sigmoid_mul",
       "sigmoid_mul_tanh", "lstm_cell", "tree_cell", "lstm_matvec", "tree_matvec")
"""Node kinds; ``lookup`` covers embedding rows and whole bias vectors; ``sigmoid_mul``
and ``sigmoid_mul_tanh`` are an LSTM's gated products as one node each,
``lstm_cell`` / ``tree_cell`` a whole cell from its gates' pre-activations, and
``lstm_matvec`` / ``tree_matvec`` a cell over its gates' matvec, as one node."""
OP = {name: i for i, name in enumerate(OPS)}
DISTRIBUTED = (OP["matvec"], OP["lstm_matvec"], OP["tree_matvec"])
"""Nodes that run on their matrix's holders; the others run on one block each."""


class Expr:
    """A node of a :class:`Graph`: ``a + b``, ``a * b`` and ``a[i:j]`` build nodes too."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: Graph, node: int) -> None:
        self.graph, self.id = graph, node

    @property
    def size(self) -> int:
        graph = self.graph
        if graph._tail:
            graph._absorb()
        return graph.size[self.id]

    def __add__(self, other: Expr) -> Expr:
        return self.graph.add(self, other)

    def __mul__(self, other: Expr) -> Expr:
        return self.graph.mul(self, other)

    def __getitem__(self, index: slice) -> Expr:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise ArgumentError(f"an expression takes a contiguous slice such as x[0:64], got {index!r}")
        start, stop, _ = index.indices(self.size)
        return self.graph.slice(self, start, stop)


class Graph:
    """Nodes of one batch over ``model``'s parameters.

    Columns per node: ``op`` (index in :data:`OPS`), ``size``, inputs ``a``,
    ``b`` and ``c`` (node ids, -1 for none; ``c``: a cell matvec's addend),
    ``extra`` (parameter index for lookup and the matvecs, label for a loss,
    start for a slice), ``row`` (a lookup's table
    row), ``depth``, ``stage`` and ``root`` (see the module's docstring). A
    concat's inputs are the pairs (``concat_node``, ``concat_part``), in order.

    The ready builders append whole batches of nodes as arrays (``_tail``,
    after the listed nodes); the expression API turns them into list entries
    only when it next makes or reads a node.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.op: list[int] = []
        self.size: list[int] = []
        self.a: list[int] = []
        self.b: list[int] = []
        self.c: list[int] = []
        self.extra: list[int] = []
        self.row: list[int] = []
        self.depth: list[int] = []
        self.stage: list[int] = []
        self.root: list[int] = []
        self.concat_node: list[int] = []
        self.concat_part: list[int] = []
        self._tail: list[dict[str, np.ndarray]] = []
        self._tail_nodes = 0

    def __len__(self) -> int:
        return len(self.op) + self._tail_nodes

    def _append(self, columns: dict[str, np.ndarray]) -> None:
        """Append nodes given as int64 columns (ids already counted from ``len(self)``)."""
        self._tail.append(columns)
        self._tail_nodes += len(columns["op"])

    def _absorb(self) -> None:
        """Move the appended arrays into the lists, for the expression API."""
        for columns in self._tail:
            for name, values in columns.items():
                getattr(self, name).extend(values.tolist())
        self._tail, self._tail_nodes = [], 0

    # ---- recording -------------------------------------------------------

    def _ready(self, node: int) -> int:
        """The first stage in which an elementwise node can read ``node``'s value."""
        root = self.root[node]
        return self.stage[root] + (self.op[root] in DISTRIBUTED)

    def _node(self, op: str, size: int, a: int = -1, b: int = -1, extra: int = 0, row: int = 0,
              inputs: Sequence[int] = (), c: int = -1) -> Expr:
        # Called for every node of a hand-built graph: the common cases (no
        # input, one, two) are written out, as the graph's build time is host time.
        if self._tail:
            self._absorb()
        node = len(self.op)
        depth_of, ready = self.depth, self._ready
        if op == "slice":
            depth, stage, root = depth_of[a], self.stage[a], self.root[a]
        elif op == "matvec":  # the first stage after the input is complete
            depth, stage, root = 1 + depth_of[a], self.stage[a] + 1, node
        elif op in ("lstm_matvec", "tree_matvec"):
            used = [i for i in (a, b, c) if i >= 0]
            depth, stage, root = 1 + max(depth_of[i] for i in used), 1 + max(self.stage[i] for i in used), node
        elif inputs:
            depth, stage, root = 1 + max(depth_of[i] for i in inputs), max(ready(i) for i in inputs), node
        elif b >= 0:
            depth, stage, root = 1 + max(depth_of[a], depth_of[b]), max(ready(a), ready(b)), node
        elif a >= 0:
            depth, stage, root = 1 + depth_of[a], ready(a), node
        else:
            depth, stage, root = 0, 0, node
        self.op.append(OP[op])
        self.size.append(size)
        self.a.append(a)
        self.b.append(b)
        self.c.append(c)
        self.extra.append(extra)
        self.row.append(row)
        self.depth.append(depth)
        self.stage.append(stage)
        self.root.append(root)
        return Expr(self, node)

    def _own(self, what: str, x: Expr) -> int:
        if not isinstance(x, Expr):
            raise ArgumentTypeError(f"{what}: expected an expression of this graph, got {type(x).__name__}")
        if x.graph is not self:
            raise ArgumentError(f"{what}: the expression belongs to another graph")
        if self._tail:
            self._absorb()
        if self.op[x.id] == OP["loss"]:
            raise ArgumentError(f"{what}: a loss ends a path (it adds into the batch loss) and cannot be an input")
        return x.id

    def _param(self, what: str, p: Parameter, kinds: tuple[str, ...]) -> None:
        if not isinstance(p, Parameter) or p.index >= len(self.model.parameters) \
                or self.model.parameters[p.index] is not p:
            raise ArgumentError(f"{what}: expected a parameter of this graph's model, got {p!r}")
        if p.kind not in kinds:
            raise ArgumentError(f"{what}: expected a {' or '.join(kinds)} parameter, got {p.kind} {p.name!r}")

    def _same_size(self, what: str, a: int, b: int) -> None:
        if self.size[a] != self.size[b]:
            raise ArgumentError(f"{what}: operands must have one size, got {self.size[a]} and {self.size[b]}")

    # ---- the expressions -------------------------------------------------

    def lookup(self, table: Parameter, row: int) -> Expr:
        """Row ``row`` of an embedding table (``row`` in [0, vocabulary))."""
        self._param("lookup", table, ("embedding",))
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < table.rows:
            raise ArgumentError(f"lookup: row must be an int in [0, {table.rows}) for {table.name!r}, got {row!r}")
        return self._node("lookup", table.cols, extra=table.index, row=int(row))

    def parameter(self, bias: Parameter, *more: Parameter) -> Expr:
        """A bias vector as an expression. With ``more``: biases declared one
        after another (only matrices between them), read in place as their
        concatenation, one node (the flat buffer keeps them adjacent)."""
        biases = (bias, *more)
        for p in biases:
            self._param("parameter", p, ("bias",))
        if more:  # one bias (every node of a hand-built graph) needs no adjacency check
            dense = [p.index for p in self.model.parameters if p.kind != "matrix"]
            at = [dense.index(p.index) for p in biases]
            if at != list(range(at[0], at[0] + len(at))):
                raise ArgumentError(f"parameter: expected biases declared one after another, got "
                                    f"{[p.name for p in biases]}, declared in the order "
                                    f"{[self.model.parameters[i].name for i in dense]}")
        return self._node("lookup", sum(p.rows for p in biases), extra=bias.index)

    def matvec(self, matrix: Parameter, x: Expr) -> Expr:
        """``matrix @ x`` with the matrix cached on chip."""
        self._param("matvec", matrix, ("matrix",))
        i = self._own("matvec", x)
        if self.size[i] != matrix.cols:
            raise ArgumentError(f"matvec: {matrix.name!r} takes vectors of {matrix.cols}, got {self.size[i]}")
        return self._node("matvec", matrix.rows, a=i, extra=matrix.index)

    def _binary(self, op: str, x: Expr, y: Expr) -> Expr:
        a, b = self._own(op, x), self._own(op, y)
        self._same_size(op, a, b)
        return self._node(op, self.size[a], a=a, b=b)

    def add(self, x: Expr, y: Expr) -> Expr:
        return self._binary("add", x, y)

    def mul(self, x: Expr, y: Expr) -> Expr:
        """Elementwise product."""
        return self._binary("mul", x, y)

    def _unary(self, op: str, x: Expr) -> Expr:
        a = self._own(op, x)
        return self._node(op, self.size[a], a=a)

    def tanh(self, x: Expr) -> Expr:
        return self._unary("tanh", x)

    def sigmoid(self, x: Expr) -> Expr:
        return self._unary("sigmoid", x)

    def relu(self, x: Expr) -> Expr:
        return self._unary("relu", x)

    def sigmoid_mul(self, gate: Expr, x: Expr) -> Expr:
        """``sigmoid(gate) * x`` as one node: an LSTM's forget term. One pass
        over the elements where ``sigmoid`` then ``mul`` take two, each its own
        instruction on the chain of a cell (perf-notes dynamic §36)."""
        return self._binary("sigmoid_mul", gate, x)

    def sigmoid_mul_tanh(self, gate: Expr, x: Expr) -> Expr:
        """``sigmoid(gate) * tanh(x)`` as one node: an LSTM's ``i * g`` and
        ``o * tanh(c)``, where three nodes took three passes."""
        return self._binary("sigmoid_mul_tanh", gate, x)

    def _cell(self, op: str, gates: Expr, c: Expr | None, gate_rows: int, carried: int) -> Expr:
        z = self._own(op, gates)
        if c is None:
            if self.size[z] % gate_rows:
                raise ArgumentError(f"{op}: expected gates of {gate_rows} * n floats, got {self.size[z]}")
            return self._node(op, 2 * (self.size[z] // gate_rows), a=z)
        k = self._own(op, c)
        n = self.size[k] // carried
        if self.size[k] % carried or self.size[z] != (gate_rows + carried) * n:
            raise ArgumentError(f"{op}: expected gates of {gate_rows + carried} * n floats and a carried cell of "
                                f"{carried} * n, got {self.size[z]} and {self.size[k]}")
        return self._node(op, 2 * n, a=z, b=k)

    def lstm_cell(self, gates: Expr, c: Expr | None = None) -> Expr:
        """An LSTM step's cell as one node: from ``gates`` = [i, f, g, o]
        (4n pre-activations, torch's order) and the previous cell ``c`` (n;
        None: zero state), ``[h; c']`` (2n), with
        c' = sigmoid(f) * c + sigmoid(i) * tanh(g) and h = sigmoid(o) * tanh(c').
        One pass over the elements where the gated products took five
        instructions on a step's chain (perf-notes dynamic §37)."""
        if c is None:
            return self._cell("lstm_cell", gates, None, 4, 1)
        return self._cell("lstm_cell", gates, c, 3, 1)

    def tree_cell(self, gates: Expr, c: Expr | None = None) -> Expr:
        """A binary Tree-LSTM node's cell as one node: from ``gates`` =
        [i, o, u, f_1, f_2] (5n pre-activations) and its children's cells
        ``c`` = [c_1; c_2] (2n), ``[h; c']`` (2n), with
        c' = sigmoid(i) * tanh(u) + sigmoid(f_1) * c_1 + sigmoid(f_2) * c_2 and
        h = sigmoid(o) * tanh(c'). A leaf: ``gates`` = [i, o, u] (3n), ``c`` None."""
        return self._cell("tree_cell", gates, c, 3, 2)

    def _cell_matvec(self, op: str, matrix: Parameter, inputs: Sequence[Expr], addend: Expr, lstm: bool) -> Expr:
        self._param(op, matrix, ("matrix",))
        ids = [self._own(op, x) for x in inputs]
        z = self._own(op, addend)
        if not 1 <= len(ids) <= (1 if lstm else 2):
            raise ArgumentError(f"{op}: expected {'one input' if lstm else 'one or two inputs'}, got {len(ids)}")
        plain = len(ids) == 1 and self.size[ids[0]] == matrix.cols  # an input vector, zero state
        carried = 0 if plain else len(ids)
        gates = 4 if lstm else 3 + carried
        n = matrix.rows // gates  # exact: Model.matrix refuses rows that are not a multiple of its gates
        if matrix.gates != gates:
            raise ArgumentError(f"{op}: expected a matrix declared with gates={gates} ({'LSTM' if lstm else 'tree'} "
                                f"cell, {carried} carried), got {matrix.name!r} with gates={matrix.gates}")
        if not plain and (matrix.cols != carried * n or any(self.size[i] != 2 * n for i in ids)):
            raise ArgumentError(f"{op}: {matrix.name!r} takes an input of {matrix.cols} or {carried} state(s) [h; c] "
                                f"of {2 * n} each, got {[self.size[i] for i in ids]}")
        if self.size[z] != matrix.rows:
            raise ArgumentError(f"{op}: expected an addend of {matrix.rows} (the gates), got {self.size[z]}")
        return self._node(op, 2 * n, a=ids[0], b=ids[1] if len(ids) > 1 else -1, c=z, extra=matrix.index)

    def lstm_matvec(self, matrix: Parameter, x: Expr, addend: Expr) -> Expr:
        """An LSTM step over its gates' matvec as one node:
        ``lstm_cell(matrix @ h + addend, c)`` for the previous state ``x`` =
        [h; c] (2n), or ``lstm_cell(matrix @ x + addend)`` for an input
        vector ``x`` of ``matrix.cols`` floats (zero state). ``matrix`` is
        declared with ``gates=4`` (rows [i, f, g, o], 4n). It runs on the
        matrix's holders, each finishing the cells of its units after its
        rows' products: one stage where a matvec and a cell took two
        (perf-notes dynamic §40)."""
        return self._cell_matvec("lstm_matvec", matrix, [x], addend, True)

    def tree_matvec(self, matrix: Parameter, inputs: Sequence[Expr], addend: Expr) -> Expr:
        """A Tree-LSTM node over its gates' matvec as one node: for children
        states ``inputs`` = [[h_1; c_1], [h_2; c_2]] (or one child),
        ``tree_cell(matrix @ [h_1; h_2] + addend, [c_1; c_2])``, with
        ``matrix`` declared with ``gates=5`` (``gates=4`` for one child); for a
        leaf, ``inputs`` = [x] (``matrix.cols`` floats) and
        ``tree_cell(matrix @ x + addend)``, ``gates=3``."""
        return self._cell_matvec("tree_matvec", matrix, list(inputs), addend, False)

    def sum(self, xs: Sequence[Expr]) -> Expr:
        """The sum of one or more same-size expressions (a child sum), as a
        balanced tree of adds: depth grows with log2 of the count."""
        items = [Expr(self, self._own("sum", x)) for x in xs]
        if not items:
            raise ArgumentError("sum: expected at least one expression, got none")
        while len(items) > 1:
            items = [self.add(items[k], items[k + 1]) if k + 1 < len(items) else items[k]
                     for k in range(0, len(items), 2)]
        return items[0]

    def concat(self, xs: Sequence[Expr]) -> Expr:
        """The expressions one after another, as one vector."""
        ids = [self._own("concat", x) for x in xs]
        if not ids:
            raise ArgumentError("concat: expected at least one expression, got none")
        node = self._node("concat", sum(self.size[i] for i in ids), inputs=ids)
        self.concat_node.extend([node.id] * len(ids))
        self.concat_part.extend(ids)
        return node

    def slice(self, x: Expr, start: int, stop: int) -> Expr:
        """Elements [start, stop) of ``x``: a view of its storage, no work."""
        a = self._own("slice", x)
        if not 0 <= start < stop <= self.size[a]:
            raise ArgumentError(f"slice: expected 0 <= start < stop <= {self.size[a]}, got [{start}, {stop})")
        return self._node("slice", stop - start, a=a, extra=start)

    def loss(self, logits: Expr, label: int) -> Expr:
        """Softmax cross-entropy of ``logits`` against class ``label``, added into the batch loss."""
        a = self._own("loss", logits)
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < self.size[a]:
            raise ArgumentError(f"loss: label must be an int in [0, {self.size[a]}), got {label!r}")
        return self._node("loss", 1, a=a, extra=int(label))

    # ---- arrays for the scheduler ----------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The node columns (and the concat pairs) as int64 arrays."""
        if not len(self):
            raise ArgumentError("the graph is empty: build at least one input's expressions first")
        names = ("op", "size", "a", "b", "c", "extra", "row", "depth", "stage", "root", "concat_node",
                 "concat_part")
        listed = [{k: np.asarray(getattr(self, k), dtype=np.int64) for k in names}] if self.op else []
        chunks = listed + self._tail
        if len(chunks) == 1:
            return dict(chunks[0])
        return {k: np.concatenate([c[k] for c in chunks]) for k in names}
