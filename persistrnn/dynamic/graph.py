"""The expression API: one :class:`Graph` per batch, holding any number of
inputs' computation graphs side by side.

Every expression is a node with a vector value. Nodes are recorded in
creation order, which is a topological order (an expression's inputs exist
before it), and each node's depth (1 + its inputs' deepest) is known when it
is made: the scheduler sorts by it. A slice is a view of its parent's storage
and runs nothing; the loss of a node (softmax cross-entropy) ends a path and
adds into the batch's loss, the sum over every loss node.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError
from .model import Model, Parameter

__all__ = ["Expr", "Graph", "OPS"]

OPS = ("lookup", "matvec", "add", "mul", "tanh", "sigmoid", "relu", "concat", "loss", "slice")
"""Node kinds; ``lookup`` covers embedding rows and whole bias vectors."""
OP = {name: i for i, name in enumerate(OPS)}


class Expr:
    """A node of a :class:`Graph`: ``a + b``, ``a * b`` and ``a[i:j]`` build nodes too."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: Graph, node: int) -> None:
        self.graph, self.id = graph, node

    @property
    def size(self) -> int:
        return self.graph.size[self.id]

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

    Columns per node: ``op`` (index in :data:`OPS`), ``size``, inputs ``a`` and
    ``b`` (node ids, -1 for none), ``extra`` (parameter index for lookup and
    matvec, label for a loss, start for a slice), ``row`` (a lookup's table
    row), ``depth``; ``parts`` lists a concat's inputs.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.op: list[int] = []
        self.size: list[int] = []
        self.a: list[int] = []
        self.b: list[int] = []
        self.extra: list[int] = []
        self.row: list[int] = []
        self.depth: list[int] = []
        self.parts: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.op)

    # ---- recording -------------------------------------------------------

    def _node(self, op: str, size: int, a: int = -1, b: int = -1, extra: int = 0, row: int = 0,
              depth: int | None = None) -> Expr:
        if depth is None:
            depth = 1 + max(self.depth[i] for i in (a, b) if i >= 0)
        self.op.append(OP[op])
        self.size.append(size)
        self.a.append(a)
        self.b.append(b)
        self.extra.append(extra)
        self.row.append(row)
        self.depth.append(depth)
        return Expr(self, len(self.op) - 1)

    def _own(self, what: str, x: Expr) -> int:
        if not isinstance(x, Expr):
            raise ArgumentTypeError(f"{what}: expected an expression of this graph, got {type(x).__name__}")
        if x.graph is not self:
            raise ArgumentError(f"{what}: the expression belongs to another graph")
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
        return self._node("lookup", table.cols, extra=table.index, row=int(row), depth=0)

    def parameter(self, bias: Parameter) -> Expr:
        """A bias vector as an expression."""
        self._param("parameter", bias, ("bias",))
        return self._node("lookup", bias.rows, extra=bias.index, depth=0)

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
        node = self._node("concat", sum(self.size[i] for i in ids),
                          depth=1 + max(self.depth[i] for i in ids))
        self.parts[node.id] = ids
        return node

    def slice(self, x: Expr, start: int, stop: int) -> Expr:
        """Elements [start, stop) of ``x``: a view of its storage, no work."""
        a = self._own("slice", x)
        if not 0 <= start < stop <= self.size[a]:
            raise ArgumentError(f"slice: expected 0 <= start < stop <= {self.size[a]}, got [{start}, {stop})")
        return self._node("slice", stop - start, a=a, extra=start, depth=self.depth[a])

    def loss(self, logits: Expr, label: int) -> Expr:
        """Softmax cross-entropy of ``logits`` against class ``label``, added into the batch loss."""
        a = self._own("loss", logits)
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < self.size[a]:
            raise ArgumentError(f"loss: label must be an int in [0, {self.size[a]}), got {label!r}")
        return self._node("loss", 1, a=a, extra=int(label))

    # ---- arrays for the scheduler ----------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The node columns as int64 arrays."""
        if not self.op:
            raise ArgumentError("the graph is empty: build at least one input's expressions first")
        return {k: np.asarray(getattr(self, k), dtype=np.int64)
                for k in ("op", "size", "a", "b", "extra", "row", "depth")}
