"""Parameters of a dynamic network, declared once: weight matrices, biases and
embedding tables, all in one flat float32 buffer.

The kernel is specialised for the weight matrices (their sizes and where each
block keeps its rows), so a model's matrices are fixed once it is compiled;
biases and embedding tables are plain vectors that the kernel reads and
updates in global memory. Matrices come first in the flat buffer, so the
"dense" part (biases, embeddings) is one contiguous range the update phase
walks with all blocks.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError

__all__ = ["Parameter", "Model"]

KINDS = ("matrix", "bias", "embedding")


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One declared parameter. ``offset`` is its first float in the model's
    flat buffer (assigned by :meth:`Model.layout`, matrices first)."""

    name: str
    kind: str  # "matrix" (rows x cols), "bias" (rows,), "embedding" (rows = vocabulary, cols = dimension)
    rows: int
    cols: int
    index: int  # declaration order
    gates: int = 1  # a matrix whose rows are gates of units (Graph.lstm_matvec, tree_matvec): gates * units rows

    @property
    def size(self) -> int:
        return self.rows * self.cols


def _positive(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ArgumentError(f"{what} must be >= 1, got {value}")
    return int(value)


class Model:
    """The parameters of one network, initialised from ``seed``.

    Matrices and embeddings are uniform in ±1/sqrt(cols) (torch's Linear
    default), biases likewise over the matrix they follow. Declaring is only
    allowed before the first :meth:`layout` call (compiling a kernel or
    scheduling a graph takes the layout).
    """

    def __init__(self, seed: int = 0) -> None:
        self.parameters: list[Parameter] = []
        self._rng = np.random.default_rng(seed)
        self._initial: list[np.ndarray] = []
        self._frozen = False

    def _declare(self, name: str, kind: str, rows: int, cols: int, scale: float, gates: int = 1) -> Parameter:
        if self._frozen:
            raise ArgumentError(f"cannot declare {name!r}: the model's layout is already fixed (a graph was "
                                "scheduled or a kernel compiled); declare every parameter first")
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"parameter name must be a non-empty str, got {name!r}")
        if any(p.name == name for p in self.parameters):
            raise ArgumentError(f"parameter {name!r} is declared twice")
        p = Parameter(name, kind, _positive(f"{name} rows", rows), _positive(f"{name} cols", cols),
                      len(self.parameters), _positive(f"{name} gates", gates))
        if p.rows % p.gates:
            raise ArgumentError(f"matrix {name!r}: expected rows a multiple of its {p.gates} gates, got {p.rows}")
        self.parameters.append(p)
        self._initial.append(self._rng.uniform(-scale, scale, p.size))
        return p

    def matrix(self, name: str, rows: int, cols: int, gates: int = 1) -> Parameter:
        """A weight matrix (rows x cols), used by ``Graph.matvec``: cached on chip, its rows spread over blocks.

        ``gates`` > 1: the rows are ``gates`` blocks of ``rows / gates`` units
        each (a cell's gates, as ``Graph.lstm_matvec`` and ``Graph.tree_matvec``
        take them), and every block keeps all gates of its units, so that it
        finishes its units' cells after its rows' products without a barrier."""
        return self._declare(name, "matrix", rows, cols, 1.0 / math.sqrt(cols), gates)

    def bias(self, name: str, size: int, fan_in: int | None = None) -> Parameter:
        """A vector read by ``Graph.parameter``; ``fan_in`` sets the init range as torch's Linear bias."""
        return self._declare(name, "bias", size, 1, 1.0 / math.sqrt(fan_in or size))

    def embedding(self, name: str, vocabulary: int, dimension: int) -> Parameter:
        """A table of ``vocabulary`` rows of ``dimension`` floats, read by ``Graph.lookup``."""
        return self._declare(name, "embedding", vocabulary, dimension, 1.0 / math.sqrt(dimension))

    @property
    def matrices(self) -> list[Parameter]:
        return [p for p in self.parameters if p.kind == "matrix"]

    def layout(self) -> dict[str, int]:
        """Offset of every parameter in the flat buffer (matrices first); fixes the declarations."""
        self._frozen = True
        order = sorted(self.parameters, key=lambda p: (p.kind != "matrix", p.index))
        offsets = np.concatenate([[0], np.cumsum([p.size for p in order])])
        return {p.name: int(o) for p, o in zip(order, offsets)}

    @property
    def total_floats(self) -> int:
        return sum(p.size for p in self.parameters)

    @property
    def matrix_floats(self) -> int:
        """Floats of the matrices: the flat buffer's [0, matrix_floats) range; the dense rest follows."""
        return sum(p.size for p in self.matrices)

    def initial_values(self) -> np.ndarray:
        """The flat float32 buffer of the initial values, in :meth:`layout` order."""
        offsets = self.layout()
        flat = np.empty(self.total_floats, dtype=np.float32)
        for p, values in zip(self.parameters, self._initial):
            flat[offsets[p.name]:offsets[p.name] + p.size] = values
        return flat

    def view(self, flat: np.ndarray, p: Parameter) -> np.ndarray:
        """``p``'s values in ``flat`` (a :meth:`layout`-ordered buffer) as (rows, cols)."""
        o = self.layout()[p.name]
        return flat[o:o + p.size].reshape(p.rows, p.cols)
