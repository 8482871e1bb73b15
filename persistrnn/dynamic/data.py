"""Readers for the two benchmark data sets, and the vocabulary.

* SST (Stanford Sentiment Treebank): one tree a line in PTB brackets, a
  sentiment label 0-4 on every node: ``(3 (2 It) (4 (2 's) ...))``.
* WikiNER: one sentence a line, tokens ``word|TAG``.

Malformed input raises :class:`~persistrnn.errors.ArgumentError` naming the
file, the line and what was expected. Words outside a :class:`Vocabulary`
map to its UNK id, 0: a model declares its table with ``len(vocabulary)``
rows, and row 0 is trained as the embedding of every unknown word.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError

T = TypeVar("T")

__all__ = ["DATA_DIR", "PostOrder", "Tree", "Vocabulary", "parse_tree", "read_sst", "read_wikiner"]

def _data_dir() -> Path:
    """``$PERSISTRNN_DATA``, else ``shared/data`` in the repository, else beside it."""
    if "PERSISTRNN_DATA" in os.environ:
        return Path(os.environ["PERSISTRNN_DATA"])
    root = Path(__file__).resolve().parents[2]
    inside = root / "shared" / "data"
    return inside if inside.is_dir() else root.parent / "shared" / "data"


DATA_DIR = _data_dir()
"""The offline copies of the data sets (SST, WikiNER, PTB): ``$PERSISTRNN_DATA``,
or ``shared/data`` in or beside the repository."""

SST_LABELS = 5
UNK = "<unk>"


def integers(values: Sequence[Any]) -> np.ndarray:
    """``values`` as int64, refusing what is not an integer (a float, a bool,
    a string), as the expression API refuses it: ``np.asarray(..., int64)``
    alone would truncate 1.7 to 1 and read True as 1."""
    array = np.asarray(values)
    # a list mixing True with ints comes out int64: the bools are looked for in the list itself (by their
    # types, collected in C: half the time of a generator over the values)
    if array.size and (array.dtype.kind not in "iu" or (not isinstance(values, np.ndarray)
                                                         and bool in set(map(type, values)))):
        bad = next(v for v in values if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)))
        raise ArgumentTypeError(f"build: expected integer ids and labels, got {bad!r} ({type(bad).__name__})")
    return array.astype(np.int64, copy=False).reshape(-1)


@dataclasses.dataclass(frozen=True)
class PostOrder:
    """A tree's nodes, children before parents, as arrays (:attr:`Tree.post_order`).

    child_count: per node; children: each node's children's positions, all
    nodes' lists one after another; label: per node; level: a leaf 0, else 1
    + its deepest child's; leaf_at: the leaves' positions; words: the
    leaves' words in order. The arrays are read-only."""

    child_count: np.ndarray
    children: np.ndarray
    label: np.ndarray
    level: np.ndarray
    leaf_at: np.ndarray
    words: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Tree:
    """A node of a constituency tree: a leaf has a word and no children."""

    label: int
    word: str | None = None
    children: tuple[Tree, ...] = ()

    @functools.cached_property
    def post_order(self) -> PostOrder:
        """The subtree's nodes as arrays, walked once per tree (a tree is
        immutable) and kept: a training loop builds every tree once an epoch,
        and the walk (~1 µs a node, Python) was a quarter of a batch's graph
        build (perf-notes dynamic §32). One walk over an explicit stack (a
        tree's depth is not bounded by Python's recursion limit); a finished
        node leaves its position on a stack, so its parent takes its
        children's positions from there, with no lookup by node."""
        child_count: list[int] = []
        children: list[int] = []
        labels: list[int] = []
        level: list[int] = []
        leaf_at: list[int] = []
        words: list[str] = []
        todo: list[tuple[Tree, bool]] = [(self, False)]  # (node, its children are done)
        finished: list[int] = []  # positions of finished nodes whose parent is not
        while todo:
            node, children_done = todo.pop()
            kids = node.children
            if kids and not children_done:
                if node.word is not None:
                    raise ArgumentError(f"a tree node has both a word ({node.word!r}) and children")
                todo.append((node, True))
                todo.extend((child, False) for child in reversed(kids))  # the first child first
                continue
            if kids:
                inner = finished[-len(kids):]
                del finished[-len(kids):]
                child_count.append(len(inner))
                children.extend(inner)
                level.append(1 + max([level[k] for k in inner]))
            else:
                if node.word is None:
                    raise ArgumentError("a tree node has neither a word nor children")
                leaf_at.append(len(labels))
                words.append(node.word)
                child_count.append(0)
                level.append(0)
            labels.append(node.label)
            finished.append(len(labels) - 1)
        arrays = [np.asarray(child_count, dtype=np.int64), np.asarray(children, dtype=np.int64),
                  integers(labels), np.asarray(level, dtype=np.int64), np.asarray(leaf_at, dtype=np.int64)]
        for array in arrays:  # kept and shared by every build of the tree: read-only, as the tree is
            array.flags.writeable = False
        return PostOrder(*arrays, tuple(words))

    def nodes(self) -> list[Tree]:
        """Every node, children before parents (a post-order)."""
        out: list[Tree] = []
        stack: list[tuple[Tree, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded or not node.children:
                out.append(node)
            else:
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(node.children))
        return out

    def words(self) -> list[str]:
        return [n.word for n in self.nodes() if n.word is not None]


_SEPARATORS = re.compile(r"[ \t\r\n\f\v]+")
"""ASCII whitespace only: SST words may hold a no-break space (``8\xa01\\/2``, one word), which
``str.split()`` would cut in two."""


def _split(text: str) -> list[str]:
    return [t for t in _SEPARATORS.split(text) if t]


def _tokens(text: str) -> list[str]:
    return _split(text.replace("(", " ( ").replace(")", " ) "))


_LABEL = re.compile(r"-?[0-9]+")


def parse_tree(text: str, *, where: str = "tree", labels: int = SST_LABELS) -> Tree:
    """One PTB-bracketed tree with an integer label in [0, labels) on every
    node. Parsed over an explicit stack: a tree's depth is not bounded by
    Python's recursion limit."""
    tokens = _tokens(text)
    if not tokens:
        raise ArgumentError(f"{where}: expected a bracketed tree such as '(3 (2 a) (2 b))', got an empty line")
    position = 0

    def fail(expected: str) -> ArgumentError:
        got = repr(tokens[position]) if position < len(tokens) else "the end of the line"
        return ArgumentError(f"{where}: expected {expected} at token {position}, got {got}")

    open_nodes: list[tuple[int, list[Tree]]] = []  # (label, children so far) of the nodes not closed yet
    tree: Tree | None = None
    while True:
        # a node opens: "(" label, then a word and ")" (a leaf) or its children
        if position >= len(tokens) or tokens[position] != "(":
            raise fail("'('")
        position += 1
        if position >= len(tokens) or not _LABEL.fullmatch(tokens[position]):
            raise fail("an integer label")
        label = int(tokens[position])
        if not 0 <= label < labels:
            raise ArgumentError(f"{where}: expected a label in [0, {labels}), got {label}")
        position += 1
        if position < len(tokens) and tokens[position] not in "()":
            word = tokens[position]
            position += 1
            if position >= len(tokens) or tokens[position] != ")":
                raise fail("')' after the word")
            position += 1
            done = Tree(label, word)
        else:
            if position >= len(tokens) or tokens[position] != "(":
                raise fail("a word or a child '('")
            open_nodes.append((label, []))
            continue
        # close every node whose children are complete
        while open_nodes:
            open_nodes[-1][1].append(done)
            if position < len(tokens) and tokens[position] == "(":
                break  # another child of the innermost open node
            if position >= len(tokens) or tokens[position] != ")":
                raise fail("')'")
            position += 1
            parent_label, children = open_nodes.pop()
            done = Tree(parent_label, None, tuple(children))
        else:
            tree = done
            break
    if position != len(tokens):
        raise fail("the end of the tree")
    return tree


def _read_lines(path: str | Path, limit: int | None, parse: Callable[[str, str], T]) -> list[T]:
    """``parse(line, where)`` of each line of ``path`` (``where`` names the
    file and line for errors), the first ``limit`` if given."""
    path = Path(path)
    items: list[T] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            items.append(parse(line, f"{path}:{number}"))
    return items


def read_sst(path: str | Path, limit: int | None = None) -> list[Tree]:
    """The trees of an SST file (``train.txt``, ``dev.txt``, ``test.txt``), the first ``limit`` if given,
    each with its :attr:`Tree.post_order` walked as it is read (+0.35 s on the 1.3-2.3 s read of the 8,544
    training trees): worker processes forked later inherit the walks, so no epoch walks a tree again."""

    def walked(line: str, where: str) -> Tree:
        tree = parse_tree(line, where=where)
        tree.post_order  # noqa: B018 (computed and kept on the tree)
        return tree

    return _read_lines(path, limit, walked)


def _parse_sentence(line: str, where: str) -> list[tuple[str, str]]:
    tokens = _split(line)
    if not tokens:
        raise ArgumentError(f"{where}: expected a sentence of word|TAG tokens, got an empty line")
    sentence = []
    for k, token in enumerate(tokens):
        word, bar, tag = token.rpartition("|")
        if not bar or not word or not tag:
            raise ArgumentError(f"{where}: token {k} must be word|TAG, got {token!r}")
        sentence.append((word, tag))
    return sentence


def read_wikiner(path: str | Path, limit: int | None = None) -> list[list[tuple[str, str]]]:
    """The sentences of a WikiNER file as lists of (word, tag); a line without tokens is an error."""
    return _read_lines(path, limit, _parse_sentence)


class Vocabulary:
    """Strings to ids; id 0 is UNK, which every word not in the vocabulary maps to."""

    def __init__(self, items: Iterable[str], *, unk: bool = True) -> None:
        self.items = ([UNK] if unk else []) + [w for w in dict.fromkeys(items) if not (unk and w == UNK)]
        self.ids = {w: i for i, w in enumerate(self.items)}
        self.unk = unk

    @classmethod
    def counted(cls, items: Iterable[str], min_count: int = 1) -> Vocabulary:
        """Items seen at least ``min_count`` times, most frequent first."""
        counts = Counter(items)
        return cls(w for w, c in counts.most_common() if c >= min_count)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, item: str) -> int:
        found = self.ids.get(item)
        if found is None:
            if not self.unk:
                raise ArgumentError(f"{item!r} is not one of the {len(self)} known items {self.items[:8]}...")
            return 0
        return found

    def encode(self, items: Sequence[str]) -> list[int]:
        if self.unk:  # one dict lookup per item, no method call: the Tree-LSTM batch's leaves go through here
            ids = self.ids
            return [ids.get(w, 0) for w in items]
        return [self[w] for w in items]
