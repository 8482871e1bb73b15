"""Ready builders: a Tree-LSTM with a sentiment loss on every node (Tai et
al. 2015; binary N-ary or child-sum) and a BiLSTM tagger with a tag loss per
token. Each declares its parameters on a :class:`~.model.Model` once and
adds one input's expressions to a :class:`~.graph.Graph` per call.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ArgumentError
from .data import Tree
from .graph import Expr, Graph
from .model import Model

__all__ = ["BiLSTMTagger", "TreeLSTM"]

VARIANTS = ("binary", "childsum")


class TreeLSTM:
    """Tree-LSTM over constituency trees.

    Every node: ``i, o, u`` from ``iou = W_iou x + U_iou h_in + b_iou`` (the
    ``W_iou x`` term where the node has a word, the ``U_iou`` term where it
    has children), ``c = sigmoid(i) * tanh(u) + sum_k f_k * c_k``,
    ``h = sigmoid(o) * tanh(c)``, logits ``W_out h + b_out`` and a
    cross-entropy loss against the node's label.

    * ``binary`` (N-ary with N = 2): ``h_in = [h_l; h_r]``, forget gates
      ``[f_l; f_r] = sigmoid(U_f [h_l; h_r] + b_f)``; every inner node has two
      children. ``U_iou`` and ``U_f`` are one matrix ``U`` (rows ``[U_iou; U_f]``):
      one matvec over the concatenated children gives all five gates, so an
      inner node costs one matvec stage, not two.
    * ``childsum``: ``h_in = sum_k h_k``, ``f_k = sigmoid(U_f h_k + b_f)``; any number of children.
    """

    def __init__(self, model: Model, vocabulary: int, embedding: int, hidden: int, classes: int = 5,
                 variant: str = "binary") -> None:
        if variant not in VARIANTS:
            raise ArgumentError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant, self.hidden, self.classes = variant, hidden, classes
        arity = 2 if variant == "binary" else 1
        H = hidden
        self.embed = model.embedding("embed", vocabulary, embedding)
        self.w_iou = model.matrix("W_iou", 3 * H, embedding)
        if variant == "binary":
            self.u = model.matrix("U", 5 * H, 2 * H)
        else:
            self.u_iou = model.matrix("U_iou", 3 * H, H)
            self.u_f = model.matrix("U_f", H, H)
        self.w_out = model.matrix("W_out", classes, H)
        self.b_iou = model.bias("b_iou", 3 * H, fan_in=embedding)
        self.b_f = model.bias("b_f", arity * H, fan_in=arity * H)
        self.b_out = model.bias("b_out", classes, fan_in=H)

    def build(self, g: Graph, tree: Tree, word_ids: dict[str, int] | None = None,
              ids: Sequence[int] | None = None) -> list[Expr]:
        """Add ``tree``'s expressions to ``g``; returns its loss nodes (children first, the root last).

        Words map through ``word_ids`` (a :class:`~.data.Vocabulary`), or ``ids``
        gives the leaves' ids in order.
        """
        if word_ids is None and ids is None:
            raise ArgumentError("build: pass word_ids (a Vocabulary) or ids (one per leaf)")
        leaf_ids = iter(ids) if ids is not None else None
        H = self.hidden
        state: dict[int, tuple[Expr, Expr]] = {}
        losses = []
        for node in tree.nodes():
            iou = None
            if node.word is not None:
                if node.children:
                    raise ArgumentError(f"a tree node has both a word ({node.word!r}) and children")
                row = next(leaf_ids) if leaf_ids is not None else word_ids[node.word]
                iou = g.matvec(self.w_iou, g.lookup(self.embed, row))
            kids = [state.pop(id(c)) for c in node.children]
            if kids:
                if self.variant == "binary" and len(kids) != 2:
                    raise ArgumentError(f"the binary Tree-LSTM takes nodes of 0 or 2 children, got one of "
                                        f"{len(kids)} (use variant='childsum')")
                if self.variant == "binary":
                    gates = g.matvec(self.u, g.concat([h for h, _ in kids]))
                    recurrent = gates[0:3 * H]
                else:
                    recurrent = g.matvec(self.u_iou, g.sum([h for h, _ in kids]))
                iou = recurrent if iou is None else iou + recurrent
            elif node.word is None:
                raise ArgumentError("a tree node has neither a word nor children")
            iou = iou + g.parameter(self.b_iou)
            c = g.sigmoid(iou[0:H]) * g.tanh(iou[2 * H:3 * H])
            if kids:
                if self.variant == "binary":
                    f = g.sigmoid(gates[3 * H:5 * H] + g.parameter(self.b_f))
                    forget = [f[k * H:(k + 1) * H] for k in range(2)]
                else:
                    forget = [g.sigmoid(g.matvec(self.u_f, h) + g.parameter(self.b_f)) for h, _ in kids]
                c = g.sum([c] + [fk * ck for fk, (_, ck) in zip(forget, kids)])
            h = g.sigmoid(iou[H:2 * H]) * g.tanh(c)
            state[id(node)] = (h, c)
            losses.append(g.loss(g.matvec(self.w_out, h) + g.parameter(self.b_out), node.label))
        return losses


class BiLSTMTagger:
    """Embeddings, a forward and a backward LSTM, and per token
    ``W_out [h_fwd; h_bwd] + b_out`` with a cross-entropy loss against its tag.

    LSTM step (gates i, f, g, o in torch's order): ``z = W_x x + W_h h + b``,
    ``c = sigmoid(f) * c + sigmoid(i) * tanh(g)``, ``h = sigmoid(o) * tanh(c)``;
    the first step starts from zero state (no ``W_h`` term, no ``f * c``).
    """

    def __init__(self, model: Model, vocabulary: int, tags: int, embedding: int, hidden: int) -> None:
        self.hidden, self.tags = hidden, tags
        H = hidden
        self.embed = model.embedding("embed", vocabulary, embedding)
        self.directions = []
        for d in ("fwd", "bwd"):
            self.directions.append((model.matrix(f"W_x_{d}", 4 * H, embedding), model.matrix(f"W_h_{d}", 4 * H, H),
                                    model.bias(f"b_{d}", 4 * H, fan_in=H)))
        self.w_out = model.matrix("W_out", tags, 2 * H)
        self.b_out = model.bias("b_out", tags, fan_in=2 * H)

    def _run(self, g: Graph, xs: list[Expr], direction: int) -> list[Expr]:
        w_x, w_h, b = self.directions[direction]
        H = self.hidden
        h = c = None
        out = []
        for x in xs:
            z = g.matvec(w_x, x) + g.parameter(b)
            if h is not None:
                z = z + g.matvec(w_h, h)
            c_new = g.sigmoid(z[0:H]) * g.tanh(z[2 * H:3 * H])
            c = c_new if c is None else g.sigmoid(z[H:2 * H]) * c + c_new
            h = g.sigmoid(z[3 * H:4 * H]) * g.tanh(c)
            out.append(h)
        return out

    def build(self, g: Graph, words: Sequence[int], tags: Sequence[int]) -> list[Expr]:
        """Add one sentence (word ids, tag ids) to ``g``; returns its loss nodes, one per token."""
        if len(words) == 0:
            raise ArgumentError("BiLSTMTagger.build: expected a sentence of at least one word, got an empty one")
        if len(words) != len(tags):
            raise ArgumentError(f"BiLSTMTagger.build: expected one tag per word, got {len(words)} words and "
                                f"{len(tags)} tags")
        xs = [g.lookup(self.embed, w) for w in words]
        forward = self._run(g, xs, 0)
        backward = self._run(g, xs[::-1], 1)[::-1]
        return [g.loss(g.matvec(self.w_out, g.concat([hf, hb])) + g.parameter(self.b_out), t)
                for hf, hb, t in zip(forward, backward, tags)]
