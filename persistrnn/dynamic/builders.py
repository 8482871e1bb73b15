"""Ready builders: a Tree-LSTM with a sentiment loss on every node (Tai et
al. 2015; binary N-ary or child-sum) and a BiLSTM tagger with a tag loss per
token. Each declares its parameters on a :class:`~.model.Model` once and adds one
input's expressions (``build``), or a whole batch's (``build_batch``), to a
:class:`~.graph.Graph`.

The cell code (``_cell``, ``_step``) is written with the expression API and
runs once per cell shape, to record a :class:`~.batch.Template`; a batch's
cells are then written as arrays (:func:`~.batch.instantiate`): the nodes and
their order are those of calling the cell code per node and token, at
~0.1 µs per node instead of ~2 µs.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import ArgumentError
from .batch import Instances, Template, instantiate
from .data import Tree, Vocabulary, integers
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
        binary = variant == "binary"
        self.w_iou = model.matrix("W_iou", 3 * H, embedding, gates=3 if binary else 1)
        if binary:
            self.u = model.matrix("U", 5 * H, 2 * H, gates=5)
        else:
            self.u_iou = model.matrix("U_iou", 3 * H, H)
            self.u_f = model.matrix("U_f", H, H)
        self.w_out = model.matrix("W_out", classes, H)
        self.b_iou = model.bias("b_iou", 3 * H, fan_in=embedding)
        self.b_f = model.bias("b_f", arity * H, fan_in=arity * H)
        self.b_out = model.bias("b_out", classes, fan_in=H)
        self._templates: dict[int, Template] = {}

    def build(self, g: Graph, tree: Tree, word_ids: dict[str, int] | None = None,
              ids: Sequence[int] | None = None) -> list[Expr]:
        """Add ``tree``'s expressions to ``g``; returns its loss nodes (children first, the root last).

        Words map through ``word_ids`` (a :class:`~.data.Vocabulary`), or ``ids``
        gives the leaves' ids in order.
        """
        return self.build_batch(g, [tree], word_ids, None if ids is None else [ids])[0]

    def build_batch(self, g: Graph, trees: Sequence[Tree], word_ids: dict[str, int] | None = None,
                    ids: Sequence[Sequence[int]] | None = None) -> list[list[Expr]]:
        """Add every tree's expressions to ``g`` at once: the nodes of calling
        :meth:`build` tree after tree. ``ids`` holds one sequence of leaf ids
        per tree. Returns each tree's loss nodes."""
        if word_ids is None and ids is None:
            raise ArgumentError("build: pass word_ids (a Vocabulary) or ids (one per leaf)")
        if not trees:
            return []
        kid_count, kid_flat, words, labels, level, tree_nodes = self._flatten(trees, word_ids, ids)
        _check_range("lookup", "row", words, self.embed.rows, f" for {self.embed.name!r}")
        _check_range("loss", "label", labels, self.classes, "")
        kid_start = np.cumsum(kid_count) - kid_count
        groups = []
        for count in np.unique(kid_count).tolist():
            members = np.flatnonzero(kid_count == count)
            sources = kid_flat[kid_start[members, None] + np.arange(count)]
            groups.append(Instances(self._template(g, count), members, sources, level[members], words[members],
                                    labels[members]))
        return _losses(g, instantiate(g, groups), groups, np.cumsum(tree_nodes)[:-1])

    def _flatten(self, trees: Sequence[Tree], word_ids: dict[str, int] | None, ids: Sequence[Sequence[int]] | None
                 ) -> tuple[np.ndarray, ...]:
        """The batch's tree nodes in creation order (tree after tree, post-order)
        as arrays: their child counts, their children's positions (all nodes'
        lists one after another), word ids (0 for inner nodes), labels and
        levels (a leaf 0, else 1 + its children's deepest); nodes per tree.
        Each tree's own arrays (:attr:`~.data.Tree.post_order`, walked once per
        tree) are joined, their positions shifted by the nodes before."""
        orders = [tree.post_order for tree in trees]
        if ids is not None and len(ids) != len(trees):
            raise ArgumentError(f"build: expected one id sequence per tree ({len(trees)}), got {len(ids)}")
        tree_nodes = np.asarray([o.label.size for o in orders], dtype=np.int64)
        first = np.cumsum(tree_nodes) - tree_nodes

        def joined(name: str, shifted: bool) -> np.ndarray:
            parts = [getattr(o, name) for o in orders]
            out = np.concatenate(parts)
            if shifted:
                out += np.repeat(first, [p.size for p in parts])
            return out

        kid_count = joined("child_count", False)
        if self.variant == "binary" and ((odd := (kid_count != 0) & (kid_count != 2)).any()):
            raise ArgumentError(f"the binary Tree-LSTM takes nodes of 0 or 2 children, got one of "
                                f"{int(kid_count[odd][0])} (use variant='childsum')")
        if ids is None:
            leaf_words = [w for o in orders for w in o.words]
            leaf_ids = (word_ids.encode(leaf_words) if isinstance(word_ids, Vocabulary)
                        else [_lookup(word_ids, w) for w in leaf_words])
        else:  # each tree's leaves in order, one id each
            leaf_ids = []
            for t, (o, given) in enumerate(zip(orders, ids)):
                given = list(given)
                if len(given) != len(o.words):
                    raise ArgumentError(f"build: tree {t} has {len(o.words)} leaves, got {len(given)} ids")
                leaf_ids.extend(given)
        words = np.zeros(int(tree_nodes.sum()), dtype=np.int64)
        words[joined("leaf_at", True)] = integers(leaf_ids)
        return kid_count, joined("children", True), words, joined("label", False), joined("level", False), tree_nodes

    def _template(self, g: Graph, children: int) -> Template:
        """The cell of a leaf (``children`` 0) or of an inner node of ``children`` children."""
        template = self._templates.get(children)
        if template is None:
            H = self.hidden

            def cell(probe: Graph, slots: list[Expr]) -> list[Expr]:
                return [self._cell(probe, None if children else 0, slots, 0)]

            template = Template.record(g, [2 * H] * children, [0] * children, self.embed if not children else None,
                                       cell)
            self._templates[children] = template
        return template

    def _cell(self, g: Graph, word: int | None, kids: list[Expr], label: int) -> Expr:
        """One tree node's expressions (a leaf's ``word``, or its children's
        states), its loss last; returns its state ``[h; c]`` (2 * hidden).
        The binary cell is one node over its gates' matvec
        (``Graph.tree_matvec``) with ``[b_iou; b_f]`` read in place: a tree
        level costs one stage, where a matvec and a cell took two (perf-notes
        dynamic §37, §40)."""
        H = self.hidden
        if self.variant == "binary":
            if kids:
                state = g.tree_matvec(self.u, kids, g.parameter(self.b_iou, self.b_f))
            else:
                state = g.tree_matvec(self.w_iou, [g.lookup(self.embed, word)], g.parameter(self.b_iou))
        else:
            iou = None
            if word is not None:
                iou = g.matvec(self.w_iou, g.lookup(self.embed, word))
            if kids:
                recurrent = g.matvec(self.u_iou, g.sum([k[0:H] for k in kids]))
                iou = recurrent if iou is None else iou + recurrent
            iou = iou + g.parameter(self.b_iou)
            c = g.sigmoid_mul_tanh(iou[0:H], iou[2 * H:3 * H])
            if kids:
                forget = [g.matvec(self.u_f, k[0:H]) + g.parameter(self.b_f) for k in kids]
                c = g.sum([c] + [g.sigmoid_mul(f, k[H:2 * H]) for f, k in zip(forget, kids)])
            state = g.concat([g.sigmoid_mul_tanh(iou[H:2 * H], c), c])
        g.loss(g.matvec(self.w_out, state[0:H]) + g.parameter(self.b_out), label)
        return state


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
            self.directions.append((model.matrix(f"W_x_{d}", 4 * H, embedding, gates=4),
                                    model.matrix(f"W_h_{d}", 4 * H, H, gates=4),
                                    model.bias(f"b_{d}", 4 * H, fan_in=H)))
        self.w_out = model.matrix("W_out", tags, 2 * H)
        self.b_out = model.bias("b_out", tags, fan_in=2 * H)
        self._templates: dict[str, Template] = {}
        self._sentences: dict[int, dict[str, np.ndarray]] = {}

    def build(self, g: Graph, words: Sequence[int], tags: Sequence[int]) -> list[Expr]:
        """Add one sentence (word ids, tag ids) to ``g``; returns its loss nodes, one per token."""
        return self.build_batch(g, [(words, tags)])[0]

    def build_batch(self, g: Graph, sentences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[Expr]]:
        """Add every sentence (word ids, tag ids) to ``g`` at once: the nodes of
        calling :meth:`build` sentence after sentence. Returns each sentence's
        loss nodes."""
        for words, tags in sentences:
            if len(words) == 0:
                raise ArgumentError("BiLSTMTagger.build: expected a sentence of at least one word, got an empty "
                                    "one")
            if len(words) != len(tags):
                raise ArgumentError(f"BiLSTMTagger.build: expected one tag per word, got {len(words)} words and "
                                    f"{len(tags)} tags")
        if not sentences:
            return []
        words = integers([w for s, _ in sentences for w in s])
        tags = integers([t for _, s in sentences for t in s])
        _check_range("lookup", "row", words, self.embed.rows, f" for {self.embed.name!r}")
        _check_range("loss", "label", tags, self.tags, "")
        # A sentence's nodes depend only on its length, up to the word and tag
        # ids and a shift of every node id: the batch is its sentences' blocks
        # one after another.
        length = np.asarray([len(w) for w, _ in sentences], dtype=np.int64)
        blocks = [self._sentence(g, n) for n in length.tolist()]
        nodes = np.asarray([b["op"].size for b in blocks], dtype=np.int64)
        base = len(g) + np.concatenate([[0], np.cumsum(nodes)[:-1]])
        columns = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
        shift = np.repeat(base, nodes)
        for k in ("a", "b", "c", "root"):
            columns[k] = np.where(columns[k] >= 0, columns[k] + shift, -1)
        pairs = np.repeat(base, [b["concat_node"].size for b in blocks])
        columns["concat_node"] += pairs
        columns["concat_part"] += pairs
        token_base = np.repeat(base, length)
        lookups = columns.pop("lookups") + token_base
        losses = columns.pop("losses") + token_base
        columns["row"][lookups - len(g)] = words
        columns["extra"][losses - len(g)] = tags
        g._append(columns)
        return [[Expr(g, i) for i in part.tolist()] for part in np.split(losses, np.cumsum(length)[:-1])]

    def _sentence(self, g: Graph, length: int) -> dict[str, np.ndarray]:
        """The node columns of one sentence of ``length`` tokens (word and tag
        ids 0, node ids from 0), with its lookups' and losses' node ids in
        token order; made once per length. Instances in order: the lookups,
        the forward steps, the backward steps (last token first), the outputs."""
        block = self._sentences.get(length)
        if block is None:
            t = np.arange(length)
            lookup, forward, backward, output = t, length + t, 3 * length - 1 - t, 3 * length + t
            zeros = np.zeros(length, dtype=np.int64)
            groups = [Instances(self._template(g, "lookup"), lookup, zeros[:, None][:, :0], zeros, zeros)]
            for d, step in enumerate((forward, backward)):
                start = 0 if d == 0 else length - 1  # the token each direction starts from
                later = t != start
                groups.append(Instances(self._template(g, f"first{d}"), step[[start]], lookup[[start], None],
                                        np.ones(1, dtype=np.int64)))
                chain = t + 1 if d == 0 else length - t  # steps from the direction's start
                groups.append(Instances(self._template(g, f"step{d}"), step[later],
                                        np.stack([lookup, step - 1], axis=1)[later], chain[later]))
            groups.append(Instances(self._template(g, "output"), output, np.stack([forward, backward], axis=1),
                                    np.full(length, length + 1), label=zeros))
            scratch = Graph(g.model)
            first = instantiate(scratch, groups)
            block = scratch.arrays()
            block["lookups"] = first[lookup]
            block["losses"] = first[output] + groups[-1].template.label_row[0]
            self._sentences[length] = block
        return block

    def _template(self, g: Graph, kind: str) -> Template:
        """``lookup`` (a token's embedding), ``first<d>`` / ``step<d>`` (an LSTM
        step of direction d from zero state / from the previous step), ``output``."""
        template = self._templates.get(kind)
        if template is None:
            H, E = self.hidden, self.embed.cols
            if kind == "lookup":
                template = Template.record(g, [], [], self.embed, lambda p, s: [p.lookup(self.embed, 0)])
            elif kind == "output":
                template = Template.record(g, [2 * H, 2 * H], [0, 0], None,
                                           lambda p, s: [self._output(p, s[0], s[1], 0)])
            elif kind.startswith("first"):
                d = int(kind[-1])
                template = Template.record(g, [E], [0], None, lambda p, s: [self._step(p, d, s[0], None)])
            else:
                d = int(kind[-1])
                template = Template.record(g, [E, 2 * H], [0, 0], None, lambda p, s: [self._step(p, d, s[0], s[1])])
            self._templates[kind] = template
        return template

    def _step(self, g: Graph, direction: int, x: Expr, state: Expr | None) -> Expr:
        """One LSTM step of ``direction`` on ``x`` from ``state`` (``[h; c]``; None:
        zero); returns the new state, one node over the recurrent matvec
        (``Graph.lstm_matvec``: a step costs one stage where a matvec and a
        cell took two, perf-notes dynamic §40), the input's term its addend."""
        w_x, w_h, b = self.directions[direction]
        if state is None:
            return g.lstm_matvec(w_x, x, g.parameter(b))
        return g.lstm_matvec(w_h, state, g.matvec(w_x, x) + g.parameter(b))

    def _output(self, g: Graph, forward: Expr, backward: Expr, tag: int) -> Expr:
        H = self.hidden
        return g.loss(g.matvec(self.w_out, g.concat([forward[0:H], backward[0:H]])) + g.parameter(self.b_out), tag)


def _lookup(word_ids: Mapping[str, int], word: str) -> int:
    """A word's id in a mapping that is not a :class:`~.data.Vocabulary` (which maps unknown words to UNK)."""
    try:
        return word_ids[word]
    except KeyError:
        raise ArgumentError(f"build: the word {word!r} is not in word_ids ({len(word_ids)} words); pass a "
                            "Vocabulary, whose id 0 takes every unknown word") from None


def _check_range(what: str, name: str, values: np.ndarray, bound: int, table: str) -> None:
    """The expression API's check on a lookup row or a loss label, for a whole batch."""
    bad = (values < 0) | (values >= bound)
    if bad.any():
        raise ArgumentError(f"{what}: {name} must be an int in [0, {bound}){table}, got {int(values[bad][0])}")


def _losses(g: Graph, first: np.ndarray, groups: list[Instances], splits: np.ndarray) -> list[list[Expr]]:
    """Each input's loss nodes: every instance's loss row, in creation order, split per input."""
    node = np.empty(first.size, dtype=np.int64)
    for gr in groups:
        node[gr.index] = first[gr.index] + gr.template.label_row[0]
    return [[Expr(g, i) for i in part.tolist()] for part in np.split(node, splits)]
