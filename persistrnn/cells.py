"""Cell specifications: the single source of each recurrent cell's math.

A :class:`CellSpec` describes a cell as data: its gates in torch's row order,
the recurrent matrix products grouped into stages, and the pointwise
statements that turn gate pre-activations into the new state. The float64
reference evaluates these statements with numpy and the CUDA kernels render
them to C++, so both run the same formulas.

Expression language: identifiers, int/float literals, binary ``+ - * /``,
unary ``-``, parentheses and the calls ``sigmoid(e)``, ``tanh(e)``,
``relu(e)``, ``hardtanh(e)`` (``e`` clamped to [-1, 1]), ``exp(e)``,
``log(e)`` and ``step(e)`` (1 where ``e`` > 0, else 0). Nothing else parses,
so evaluating a validated expression with ``eval`` cannot reach anything but
arithmetic and those functions.

Names a cell's statements may read:

* ``x_<gate>``: input projection ``W_ih[gate] @ x + b_ih[gate]``;
* ``h_<gate>``: recurrent product ``W_hh[gate] @ operand + b_hh[gate]``, where
  the operand is the one of the stage holding the gate (available once that
  stage has run);
* ``h``: previous hidden state; ``c``: previous cell state (cells with one);
* any name assigned by an earlier statement.

Every cell assigns ``h_new`` (before any LSTM projection) and, with a cell
state, ``c_new``.

:func:`with_clip` derives a cell whose gate pre-activations are clamped to
[-clip, clip] (ONNX's ``clip``); its name, e.g. ``lstm+clip=3.0``, is a cell
name :func:`get_cell` takes like a built-in one.

:func:`with_lengths` derives a cell for sequences of their own lengths
(packed sequences in training): its statements also read ``step_runs``
(1 for a batch row whose sequence runs this step, 0 past its length) and hold
the states where it is 0, so the backward generated from that spec
(:mod:`persistrnn.adjoint`) passes the state gradients through held steps.
"""

from __future__ import annotations

import ast
import copy
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, MappingProxyType
from typing import NamedTuple

import numpy as np
from .errors import ArgumentError, ArgumentTypeError

__all__ = [
    "CELLS",
    "CUDA_FUNCTIONS",
    "GRU",
    "GRU_RESET_BEFORE",
    "LSTM",
    "NUMPY_FUNCTIONS",
    "RNN_RELU",
    "RNN_TANH",
    "CellSpec",
    "Statement",
    "evaluate",
    "expression_names",
    "get_cell",
    "render_cuda",
    "render_cuda_expression",
    "render_numpy_expression",
    "render_pointwise_functions",
    "with_activations",
    "with_clip",
    "with_coupled_gates",
    "with_lengths",
    "STEP_RUNS",
]


class Statement(NamedTuple):
    """One pointwise assignment ``name = expr``."""

    name: str
    expr: str


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function; exp only ever sees -|x|, so it cannot overflow."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _hardtanh(x: np.ndarray) -> np.ndarray:
    """``x`` clamped to [-1, 1]; NaN stays NaN (np.clip keeps it)."""
    return np.clip(x, -1.0, 1.0)


def _step(x: np.ndarray) -> np.ndarray:
    """1 where ``x`` > 0, 0 where ``x`` <= 0; NaN stays NaN."""
    return np.where(x > 0, 1.0, np.where(x <= 0, 0.0, x))


NUMPY_FUNCTIONS: Mapping[str, Callable[[np.ndarray], np.ndarray]] = MappingProxyType(
    {"sigmoid": _sigmoid, "tanh": np.tanh, "relu": _relu, "hardtanh": _hardtanh, "exp": np.exp, "log": np.log,
     "step": _step}
)
"""float64 numpy implementation of each function of the expression language."""

CUDA_FUNCTIONS: Mapping[str, str] = MappingProxyType(
    {"sigmoid": "prnn_sigmoid", "tanh": "tanhf", "relu": "prnn_relu", "hardtanh": "prnn_hardtanh", "exp": "expf",
     "log": "logf", "step": "prnn_step"}
)
"""CUDA name of each function; ``prnn_*`` are ``float -> float`` device functions
the kernel source must define."""

# Identifiers must be valid in both Python and C; "prnn_" is kept for the
# kernels' own symbols so a statement can never shadow one.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RESERVED_PREFIX = "prnn_"

_BINARY_OPERATORS: Mapping[type[ast.operator], tuple[str, int]] = {
    ast.Add: ("+", 1),
    ast.Sub: ("-", 1),
    ast.Mult: ("*", 2),
    ast.Div: ("/", 2),
}
_UNARY_PRECEDENCE = 3
_ATOM_PRECEDENCE = 4
_ALLOWED = "identifiers, numbers, + - * /, parentheses and calls to " + ", ".join(NUMPY_FUNCTIONS)


def _check_identifier(name: object, what: str) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ArgumentError(f"{what}: expected an ASCII identifier, got {name!r}")
    if name.startswith(_RESERVED_PREFIX) or name in NUMPY_FUNCTIONS:
        raise ArgumentError(
            f"{what}: expected a name not starting with {_RESERVED_PREFIX!r} and not one of "
            f"{sorted(NUMPY_FUNCTIONS)}, got {name!r}"
        )
    return name


def _check_node(node: ast.expr, expr: str) -> None:
    """Raise ValueError unless ``node`` uses only the expression language."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        _check_node(node.left, expr)
        _check_node(node.right, expr)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check_node(node.operand, expr)
    elif isinstance(node, ast.Name):
        if node.id in NUMPY_FUNCTIONS:
            raise ArgumentError(f"expression {expr!r}: expected {node.id!r} to be called, got it used as a value")
        if not _IDENTIFIER.match(node.id) or node.id.startswith(_RESERVED_PREFIX):
            raise ArgumentError(f"expression {expr!r}: expected ASCII identifiers not starting with "
                                f"{_RESERVED_PREFIX!r}, got {node.id!r}")
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        try:
            finite = math.isfinite(float(node.value))
        except OverflowError:
            finite = False
        if not finite:
            raise ArgumentError(f"expression {expr!r}: expected a finite number, got {ast.unparse(node)}")
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in NUMPY_FUNCTIONS:
            raise ArgumentError(
                f"expression {expr!r}: expected a call to one of {sorted(NUMPY_FUNCTIONS)}, "
                f"got a call to {ast.unparse(node.func)!r}"
            )
        if len(node.args) != 1 or node.keywords or isinstance(node.args[0], ast.Starred):
            raise ArgumentError(
                f"expression {expr!r}: expected {node.func.id}() to take one positional argument, "
                f"got {ast.unparse(node)!r}"
            )
        _check_node(node.args[0], expr)
    else:
        raise ArgumentError(f"expression {expr!r}: expected only {_ALLOWED}, got {ast.unparse(node)!r}")


@functools.lru_cache(maxsize=None)
def _parse(expr: str) -> ast.expr:
    """Parse and validate ``expr``; cached, so callers must not mutate the tree."""
    if not isinstance(expr, str):
        raise ArgumentTypeError(f"expression: expected str, got {type(expr).__name__}")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as error:
        raise ArgumentError(f"expression {expr!r}: expected valid syntax, got {error.msg}") from None
    _check_node(tree.body, expr)
    return tree.body


def expression_names(expr: str) -> frozenset[str]:
    """Validate ``expr`` and return the variable names it reads.

    Raises ValueError for anything outside the expression language.
    """
    return frozenset(node.id for node in ast.walk(_parse(expr)) if isinstance(node, ast.Name)) - frozenset(
        NUMPY_FUNCTIONS
    )


def _precedence(node: ast.expr) -> int:
    if isinstance(node, ast.BinOp):
        return _BINARY_OPERATORS[type(node.op)][1]
    if isinstance(node, ast.UnaryOp):
        return _UNARY_PRECEDENCE
    return _ATOM_PRECEDENCE


def _render(node: ast.expr, functions: Mapping[str, str], float_suffix: str) -> str:
    """Render a validated tree with the fewest parentheses that keep its order.

    The same tree renders to Python and C, whose precedence agrees for these
    operators. The right operand is parenthesised at equal precedence so that
    ``a - (b - c)`` keeps its grouping (float arithmetic is not associative).
    """
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant):
        # Always a float literal: in C, 1/2 would be integer division.
        return repr(float(node.value)) + float_suffix
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return f"{functions[node.func.id]}({_render(node.args[0], functions, float_suffix)})"
    if isinstance(node, ast.UnaryOp):
        operand = _render(node.operand, functions, float_suffix)
        # Parenthesise a nested unary too: "--x" is a decrement in C.
        return f"-({operand})" if _precedence(node.operand) <= _UNARY_PRECEDENCE else f"-{operand}"
    assert isinstance(node, ast.BinOp)
    symbol, precedence = _BINARY_OPERATORS[type(node.op)]
    left = _render(node.left, functions, float_suffix)
    right = _render(node.right, functions, float_suffix)
    if _precedence(node.left) < precedence:
        left = f"({left})"
    if _precedence(node.right) <= precedence:
        right = f"({right})"
    return f"{left} {symbol} {right}"


def render_cuda_expression(expr: str) -> str:
    """Render ``expr`` as a CUDA float expression (``1`` -> ``1.0f``, ``tanh`` -> ``tanhf``)."""
    return _render(_parse(expr), CUDA_FUNCTIONS, "f")


def render_numpy_expression(expr: str) -> str:
    """Render ``expr`` as Python source over the names in NUMPY_FUNCTIONS."""
    return _render(_parse(expr), {name: name for name in NUMPY_FUNCTIONS}, "")


def render_cuda(statements: Iterable[tuple[str, str]], indent: str = "") -> str:
    """Render statements as CUDA lines ``const float name = expr;``, one per line."""
    lines = []
    for name, expr in statements:
        _check_identifier(name, "statement name")
        lines.append(f"{indent}const float {name} = {render_cuda_expression(expr)};")
    return "\n".join(lines)


def render_pointwise_functions(spec: CellSpec) -> str:
    """The cell's math as CUDA device functions over fp32 gate values.

    Every kernel that runs a cell (the persistent recurrence and the
    fallback's pointwise kernel) includes this one rendering, so they cannot
    disagree about the formulas. It emits:

    * ``prnn_between(stage, xg, hg, h)`` (cells with more than one stage):
      runs ``between_stages[stage]`` and returns the next stage's operand;
    * ``prnn_pointwise(xg, hg, h, c, out_h, out_c)`` (or ``(xg, hg, h,
      out_h)`` without a cell state): the new state.

    ``xg[i]`` / ``hg[i]`` are gate ``i``'s input projection and recurrent
    product (``b_hh`` included). The functions call ``prnn_sigmoid`` etc.,
    which ``kernels/common.cuh`` defines, so they go after that header.
    """
    g = spec.num_gates
    inputs = "\n".join(
        f"    const float x_{gate} = xg[{i}], h_{gate} = hg[{i}];" for i, gate in enumerate(spec.gates)
    )
    lines = []
    if spec.num_stages > 1:
        lines.append(f"__device__ __forceinline__ float prnn_between(int stage, const float (&xg)[{g}], "
                     f"const float (&hg)[{g}], float h) {{")
        lines.append(inputs)
        for k, block in enumerate(spec.between_stages):
            lines.append(f"    if (stage == {k}) {{")
            lines.append(render_cuda(block, indent="        "))
            lines.append(f"        return {spec.stage_operands[k + 1]};")
            lines.append("    }")
        lines.append("    return 0.0f;  // unreachable: the kernel passes a between-stage index")
        lines.append("}")
    state = "float c, float& out_h, float& out_c" if spec.has_cell_state else "float& out_h"
    lines.append(f"__device__ __forceinline__ void prnn_pointwise(const float (&xg)[{g}], const float (&hg)[{g}], "
                 f"float h, {state}) {{")
    lines.append(inputs)
    if spec.num_stages > 1:
        # The final stage needs what the between-stage statements computed.
        for block in spec.between_stages:
            lines.append(render_cuda(block, indent="    "))
    lines.append(render_cuda(spec.pointwise, indent="    "))
    lines.append("    out_h = h_new;")
    if spec.has_cell_state:
        lines.append("    out_c = c_new;")
    lines.append("}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _compile_numpy(expr: str) -> CodeType:
    return compile(render_numpy_expression(expr), f"<expression {expr!r}>", "eval")


def evaluate(statements: Iterable[tuple[str, str]], env: Mapping[str, np.ndarray],
             functions: Mapping[str, Callable] = NUMPY_FUNCTIONS) -> dict[str, np.ndarray]:
    """Run statements in order; return ``env`` extended by their results.

    ``functions`` implements the expression language's functions: numpy's by
    default, torch's to run a cell on tensors (with autograd)."""
    namespace = dict(env)
    # No builtins: a validated expression needs nothing but the three functions.
    functions = {"__builtins__": {}, **functions}
    for name, expr in statements:
        _check_identifier(name, "statement name")
        namespace[name] = eval(_compile_numpy(expr), functions, namespace)
    return namespace


@dataclass(frozen=True)
class CellSpec:
    """A recurrent cell's math as data.

    Attributes:
        name: registry key.
        gates: gate names in torch's row order of ``w_ih`` / ``w_hh``.
        has_cell_state: whether the cell carries ``c`` (LSTM).
        stages: recurrent products, in dependency order; stage ``k`` computes
            ``h_<gate> = W_hh[gate] @ stage_operands[k] + b_hh[gate]`` for each
            of its gates. Every gate is in exactly one stage.
        stage_operands: per stage, the name multiplied by ``W_hh``: ``"h"`` or
            a name assigned in an earlier ``between_stages`` entry.
        between_stages: ``between_stages[k]`` runs after stage ``k`` and before
            stage ``k + 1`` (one entry fewer than ``stages``).
        pointwise: statements run after the last stage; they assign ``h_new``
            and, with a cell state, ``c_new``.
        supports_projection: whether an LSTM-style ``h = W_hr @ h_new``
            projection may follow; such cells must not read ``h`` pointwise,
            since with a projection ``h`` is not hidden-sized.
        lengths: the statements may read :data:`STEP_RUNS` (a cell derived by
            :func:`with_lengths`).
    """

    name: str
    gates: tuple[str, ...]
    has_cell_state: bool
    stages: tuple[tuple[str, ...], ...]
    stage_operands: tuple[str, ...]
    between_stages: tuple[tuple[Statement, ...], ...]
    pointwise: tuple[Statement, ...]
    supports_projection: bool = False
    lengths: bool = False

    def __post_init__(self) -> None:
        # Accept plain (name, expr) pairs; store Statements.
        object.__setattr__(self, "pointwise", tuple(Statement(*s) for s in self.pointwise))
        object.__setattr__(
            self, "between_stages", tuple(tuple(Statement(*s) for s in block) for block in self.between_stages)
        )
        self._validate()

    @property
    def num_gates(self) -> int:
        return len(self.gates)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Names the pointwise statements must assign."""
        return ("h_new", "c_new") if self.has_cell_state else ("h_new",)

    def gate_rows(self, gate: str, hidden_size: int) -> slice:
        """Rows of ``w_ih`` / ``w_hh`` / biases that belong to ``gate``."""
        index = self.gates.index(gate)
        return slice(index * hidden_size, (index + 1) * hidden_size)

    def step_reference(
        self,
        x_proj: np.ndarray,
        h: np.ndarray,
        c: np.ndarray | None,
        w_hh: np.ndarray,
        b_hh: np.ndarray | None,
        functions: Mapping[str, Callable] = NUMPY_FUNCTIONS,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One time step, running this spec's stages and statements: with numpy,
        or on torch tensors given torch's ``functions``.

        Args:
            x_proj: ``x @ w_ih.T + b_ih``, shape (batch, num_gates * hidden).
            h: previous hidden state (batch, w_hh.shape[1]).
            c: previous cell state (batch, hidden), or None without one.
            w_hh: (num_gates * hidden, w_hh.shape[1]); b_hh: (num_gates * hidden,) or None.

        Returns:
            ``(h_new, c_new)``; ``c_new`` is None without a cell state.
        """
        hidden = w_hh.shape[0] // self.num_gates
        env: dict[str, np.ndarray] = {"h": h}
        if self.has_cell_state:
            assert c is not None
            env["c"] = c
        for gate in self.gates:
            env[f"x_{gate}"] = x_proj[:, self.gate_rows(gate, hidden)]
        for k, (stage, operand) in enumerate(zip(self.stages, self.stage_operands)):
            if k > 0:
                env = evaluate(self.between_stages[k - 1], env, functions)
            for gate in stage:
                rows = self.gate_rows(gate, hidden)
                product = env[operand] @ w_hh[rows].T
                env[f"h_{gate}"] = product if b_hh is None else product + b_hh[rows]
        env = evaluate(self.pointwise, env, functions)
        return env["h_new"], env.get("c_new")

    def _validate(self) -> None:
        """Check the spec is well formed, so that every renderer can trust it."""
        where = f"cell {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError(f"cell name: expected a non-empty str, got {self.name!r}")
        if not self.gates or len(set(self.gates)) != len(self.gates):
            raise ArgumentError(f"{where}: expected distinct gate names, got {self.gates!r}")
        for gate in self.gates:
            _check_identifier(gate, f"{where} gate")
        staged = [gate for stage in self.stages for gate in stage]
        if sorted(staged) != sorted(self.gates) or not all(self.stages):
            raise ArgumentError(
                f"{where}: expected non-empty stages covering each gate of {self.gates!r} once, got {self.stages!r}"
            )
        if len(self.stage_operands) != len(self.stages):
            raise ArgumentError(
                f"{where}: expected {len(self.stages)} stage operands, got {len(self.stage_operands)}"
            )
        if len(self.between_stages) != len(self.stages) - 1:
            raise ArgumentError(
                f"{where}: expected {len(self.stages) - 1} between-stage blocks, got {len(self.between_stages)}"
            )

        defined = {f"x_{gate}" for gate in self.gates} | {"h"} | ({"c"} if self.has_cell_state else set())
        defined |= {STEP_RUNS} if self.lengths else set()
        assigned: set[str] = set()  # names assigned by statements; the only valid later operands
        for k, (stage, operand) in enumerate(zip(self.stages, self.stage_operands)):
            if k > 0:
                self._check_block(self.between_stages[k - 1], defined, assigned)
            if operand != "h" and operand not in assigned:
                raise ArgumentError(
                    f"{where}: stage {k} operand: expected 'h' or a name assigned before it "
                    f"({sorted(assigned)}), got {operand!r}"
                )
            defined |= {f"h_{gate}" for gate in stage}
        final = self._check_block(self.pointwise, defined, assigned)
        missing = [name for name in self.outputs if name not in final]
        if missing:
            raise ArgumentError(f"{where}: expected pointwise statements assigning {self.outputs}, missing {missing}")
        if self.supports_projection:
            readers = [s.name for s in self.pointwise if "h" in expression_names(s.expr)]
            if readers:
                raise ArgumentError(
                    f"{where}: expected no pointwise statement to read 'h' with supports_projection, "
                    f"got {readers}"
                )

    def _check_block(self, block: tuple[Statement, ...], defined: set[str], assigned: set[str]) -> set[str]:
        """Check one block of statements in order; update ``defined``/``assigned``; return its names."""
        names = set()
        for name, expr in block:
            what = f"cell {self.name!r} statement {name!r}"
            _check_identifier(name, what)
            if name in defined:
                # Each name becomes one `const float` in CUDA: no reassignment.
                raise ArgumentError(f"{what}: expected a new name, got one already defined")
            unknown = expression_names(expr) - defined
            if unknown:
                raise ArgumentError(
                    f"{what}: expected reads of defined names {sorted(defined)}, got undefined {sorted(unknown)}"
                )
            defined.add(name)
            assigned.add(name)
            names.add(name)
        return names


LSTM = CellSpec(
    name="lstm",
    gates=("i", "f", "g", "o"),
    has_cell_state=True,
    stages=(("i", "f", "g", "o"),),
    stage_operands=("h",),
    between_stages=(),
    pointwise=(
        Statement("i", "sigmoid(x_i + h_i)"),
        Statement("f", "sigmoid(x_f + h_f)"),
        Statement("g", "tanh(x_g + h_g)"),
        Statement("o", "sigmoid(x_o + h_o)"),
        Statement("c_new", "f * c + i * g"),
        Statement("h_new", "o * tanh(c_new)"),
    ),
    supports_projection=True,
)

# torch / cuDNN form: r scales the recurrent product including b_hn.
GRU = CellSpec(
    name="gru",
    gates=("r", "z", "n"),
    has_cell_state=False,
    stages=(("r", "z", "n"),),
    stage_operands=("h",),
    between_stages=(),
    pointwise=(
        Statement("r", "sigmoid(x_r + h_r)"),
        Statement("z", "sigmoid(x_z + h_z)"),
        Statement("n", "tanh(x_n + r * h_n)"),
        Statement("h_new", "(1 - z) * n + z * h"),
    ),
)

# Cho et al. (ONNX linear_before_reset=0, Keras reset_after=False): r scales h
# before the matmul, so U_n's product waits for r. Same parameter layout as
# torch's GRU; b_hn is added after U_n (r * h).
GRU_RESET_BEFORE = CellSpec(
    name="gru_reset_before",
    gates=("r", "z", "n"),
    has_cell_state=False,
    stages=(("r", "z"), ("n",)),
    stage_operands=("h", "r_h"),
    between_stages=(
        (
            Statement("r", "sigmoid(x_r + h_r)"),
            Statement("r_h", "r * h"),
        ),
    ),
    pointwise=(
        Statement("z", "sigmoid(x_z + h_z)"),
        Statement("n", "tanh(x_n + h_n)"),
        Statement("h_new", "(1 - z) * n + z * h"),
    ),
)

def _vanilla_rnn(nonlinearity: str) -> CellSpec:
    """torch.nn.RNN's cell: one gate, h' = f(x_a + h_a)."""
    return CellSpec(
        name=f"rnn_{nonlinearity}",
        gates=("a",),
        has_cell_state=False,
        stages=(("a",),),
        stage_operands=("h",),
        between_stages=(),
        pointwise=(Statement("h_new", f"{nonlinearity}(x_a + h_a)"),),
    )


RNN_TANH = _vanilla_rnn("tanh")
RNN_RELU = _vanilla_rnn("relu")

CELLS: Mapping[str, CellSpec] = MappingProxyType(
    {cell.name: cell for cell in (LSTM, GRU, GRU_RESET_BEFORE, RNN_TANH, RNN_RELU)}
)
"""Registry of the built-in cells by name (read-only)."""


STEP_RUNS = "step_runs"
"""The name a :func:`with_lengths` cell's statements read: per batch row, 1.0
where its sequence runs the step, 0.0 where the step is past its length."""


class _Renamed(ast.NodeTransformer):
    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.names.get(node.id, node.id), node.ctx)


@functools.lru_cache(maxsize=None)
def with_lengths(cell: str | CellSpec) -> CellSpec:
    """``cell`` for a batch of sequences of their own lengths: the cell's step
    where :data:`STEP_RUNS` is 1, its states held where it is 0 (a step past
    the row's length), as torch runs a packed sequence. The pointwise
    statements assign ``h_step`` (and ``c_step``) in place of ``h_new`` (and
    ``c_new``), then ``h_new = step_runs * h_step + (1 - step_runs) * h``
    (likewise c): exactly the step where it runs, exactly the held state where
    it does not (both finite).
    The forward kernels hold states by themselves; this spec is what the
    backward is generated from, so a held step passes dh and dc through and
    gives its gates zero gradient."""
    spec = get_cell(cell)
    if spec.lengths:
        return spec
    renamed = {"h_new": "h_step", "c_new": "c_step"}
    functions = {name: name for name in NUMPY_FUNCTIONS}
    pointwise = [Statement(renamed.get(name, name),
                           _render(_Renamed(renamed).visit(copy.deepcopy(_parse(expr))), functions, ""))
                 for name, expr in spec.pointwise]
    pointwise += [Statement(output, f"{STEP_RUNS} * {renamed[output]} + (1.0 - {STEP_RUNS}) * {state}")
                  for output, state in zip(spec.outputs, ("h", "c"))]
    return CellSpec(f"{spec.name}+lengths", spec.gates, spec.has_cell_state, spec.stages, spec.stage_operands,
                    spec.between_stages, tuple(pointwise), lengths=True)


CLIP_SUFFIX = "+clip="
"""What a :func:`with_clip` cell's name adds to its base cell's: ``lstm+clip=3.0``."""


class _ClipGates(ast.NodeTransformer):
    """Wraps the argument of every activation call that does not read the
    cell state in ``C * hardtanh(arg / C)``."""

    def __init__(self, clip: float) -> None:
        self.clip = clip

    def visit_Call(self, node: ast.Call) -> ast.Call:
        reads = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
        if reads & {"c", "c_new"}:  # LSTM's output activation h(c): ONNX Runtime does not clip it
            return node
        bound = ast.Constant(self.clip)
        clamped = ast.Call(ast.Name("hardtanh", ast.Load()),
                           [ast.BinOp(node.args[0], ast.Div(), bound)], [])
        return ast.Call(node.func, [ast.BinOp(bound, ast.Mult(), clamped)], [])


def with_clip(cell: str | CellSpec, clip: float) -> CellSpec:
    """``cell`` with every gate pre-activation clamped to [-clip, clip]
    before its activation, as ONNX Runtime runs an LSTM, GRU or RNN node's
    ``clip`` (the LSTM's output activation of the cell state is not clipped
    there, so it is not here). The clamp is ``clip * hardtanh(x / clip)``:
    exact at the bounds, within one rounding of ``x`` between them, and no
    cancellation for a large ``x``."""
    spec = get_cell(cell)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        raise ArgumentTypeError(f"clip: expected a positive float, got {type(clip).__name__}")
    if not (math.isfinite(clip) and clip > 0):
        raise ArgumentError(f"clip: expected a positive finite float, got {clip!r}")
    if "+" in spec.name:
        raise ArgumentError(f"cell {spec.name!r} is clipped already or derived otherwise (clip first)")
    clip = float(clip)
    transform = _ClipGates(clip)
    functions = {name: name for name in NUMPY_FUNCTIONS}

    def clipped(block: tuple[Statement, ...]) -> tuple[Statement, ...]:
        return tuple(Statement(name, _render(transform.visit(copy.deepcopy(_parse(expr))), functions, ""))
                     for name, expr in block)

    return CellSpec(f"{spec.name}{CLIP_SUFFIX}{clip!r}", spec.gates, spec.has_cell_state, spec.stages,
                    spec.stage_operands, tuple(clipped(block) for block in spec.between_stages),
                    clipped(spec.pointwise), spec.supports_projection, spec.lengths)


ACTIVATIONS_SUFFIX = "+act="
"""What a :func:`with_activations` cell's name adds: ``lstm+act=hardsigmoid(0.2,0.5)/tanh/tanh``."""

_ACTIVATION_ROLES: Mapping[str, Mapping[str, int]] = MappingProxyType({
    "lstm": {"i": 0, "f": 0, "o": 0, "g": 1, "h_new": 2},
    "gru": {"r": 0, "z": 0, "n": 1},
    "gru_reset_before": {"r": 0, "z": 0, "n": 1},
    "rnn_tanh": {"h_new": 0},
    "rnn_relu": {"h_new": 0},
})
"""For each built-in cell, the statements whose activation is a role of ONNX's
activation list: f (the gates), g (the cell input), h (the LSTM's output)."""

_PARAMETERS = {"sigmoid": 0, "tanh": 0, "relu": 0, "hardsigmoid": 2, "leakyrelu": 1, "affine": 2, "scaledtanh": 2,
               "softsign": 0, "elu": 1, "softplus": 0, "thresholdedrelu": 1}
"""The activations a cell can take (:func:`with_activations`) and how many parameters each has."""


def _activation_tree(text: str, x: ast.expr) -> ast.expr:
    """The expression of activation ``text`` (e.g. ``hardsigmoid(0.2,0.5)``) applied to ``x``."""
    kind, _, rest = text.partition("(")
    if kind not in _PARAMETERS:
        raise ArgumentError(f"activation: expected one of {sorted(_PARAMETERS)}, got {text!r}")
    try:
        params = [float(v) for v in rest.removesuffix(")").split(",")] if rest else []
    except ValueError:
        raise ArgumentError(f"activation {text!r}: expected numbers as its parameters") from None
    if len(params) != _PARAMETERS[kind] or (rest and not rest.endswith(")")):
        raise ArgumentError(f"activation {text!r}: expected {kind} with {_PARAMETERS[kind]} parameter(s)")
    if not all(math.isfinite(v) for v in params):
        raise ArgumentError(f"activation {text!r}: expected finite parameters")

    def num(v: float) -> ast.expr:
        return ast.Constant(float(v))

    def call(name: str, arg: ast.expr) -> ast.expr:
        return ast.Call(ast.Name(name, ast.Load()), [arg], [])

    def mul(a: ast.expr, b: ast.expr) -> ast.expr:
        return ast.BinOp(a, ast.Mult(), b)

    def add(a: ast.expr, b: ast.expr) -> ast.expr:
        return ast.BinOp(a, ast.Add(), b)

    def negative(x: ast.expr) -> ast.expr:
        return ast.UnaryOp(ast.USub(), copy.deepcopy(x))

    def absolute(x: ast.expr) -> ast.expr:  # |x| = relu(x) + relu(-x), exact
        return add(call("relu", copy.deepcopy(x)), call("relu", negative(x)))

    if kind in ("sigmoid", "tanh", "relu"):
        return call(kind, x)
    if kind == "hardsigmoid":  # clamp(a x + b, 0, 1) = (hardtanh(2a x + 2b - 1) + 1) / 2: within a rounding
        a, b = params
        return add(mul(num(0.5), call("hardtanh", add(mul(num(2 * a), x), num(2 * b - 1)))), num(0.5))
    if kind == "leakyrelu":  # x for x >= 0, a x below: relu(x) - a relu(-x), exact
        return ast.BinOp(call("relu", x), ast.Sub(), mul(num(params[0]), call("relu", negative(x))))
    if kind == "affine":
        return add(mul(num(params[0]), x), num(params[1]))
    if kind == "softsign":  # x / (1 + |x|)
        return ast.BinOp(x, ast.Div(), add(num(1.0), absolute(x)))
    if kind == "elu":  # x for x >= 0, a (e^x - 1) below: relu(x) + a (exp(-relu(-x)) - 1), exact
        below = ast.BinOp(call("exp", negative(call("relu", negative(x)))), ast.Sub(), num(1.0))
        return add(call("relu", x), mul(num(params[0]), below))
    if kind == "softplus":  # log(1 + e^x) as relu(x) + log(1 + e^-|x|): no overflow for a large x
        return add(call("relu", copy.deepcopy(x)),
                   call("log", add(num(1.0), call("exp", negative(absolute(x))))))
    if kind == "thresholdedrelu":  # x where x > a, else 0
        return mul(x, call("step", ast.BinOp(copy.deepcopy(x), ast.Sub(), num(params[0]))))
    return mul(num(params[0]), call("tanh", mul(num(params[1]), x)))  # scaledtanh: a tanh(b x)


def _canonical_activation(text: str) -> str:
    kind, _, rest = text.partition("(")
    _activation_tree(text, ast.Name("x", ast.Load()))  # validates
    return kind if not rest else f"{kind}({','.join(repr(float(v)) for v in rest[:-1].split(','))})"


class _Activate(ast.NodeTransformer):
    """Replaces the first activation call of a statement (pre-order) by another activation."""

    def __init__(self, activation: str) -> None:
        self.activation, self.done = activation, False

    def visit_Call(self, node: ast.Call) -> ast.expr:
        if self.done:
            return node
        self.done = True
        return _activation_tree(self.activation, node.args[0])


def with_activations(cell: str | CellSpec, activations: Sequence[str]) -> CellSpec:
    """``cell`` with other activations in ONNX's roles: for the LSTM (f, g,
    h): the gates', the cell input's and the output's; for the GRU (f, g):
    the gates' and the candidate's; for the RNN (f). Each is one of
    ``sigmoid``, ``tanh``, ``relu``, ``hardsigmoid(a,b)`` (clamp(a x + b, 0,
    1)), ``leakyrelu(a)``, ``affine(a,b)`` (a x + b), ``scaledtanh(a,b)``
    (a tanh(b x)), ``softsign`` (x / (1 + |x|)), ``elu(a)``, ``softplus``
    (log(1 + e^x)) and ``thresholdedrelu(a)`` (x where x > a, else 0). A
    clipped cell (:func:`with_clip`) keeps its clip inside the new
    activations. The cell's own activations give the cell itself."""
    spec = get_cell(cell)
    base = spec.name.partition("+")[0]
    if ACTIVATIONS_SUFFIX in spec.name or COUPLED_SUFFIX in spec.name or spec.lengths or base not in _ACTIVATION_ROLES:
        raise ArgumentError(f"with_activations: expected a built-in cell, clipped or not, got {spec.name!r}")
    roles = _ACTIVATION_ROLES[base]
    wanted = [_canonical_activation(a) for a in activations]
    own = list(CELLS[base].pointwise) + [s for block in CELLS[base].between_stages for s in block]
    defaults = [None] * (max(roles.values()) + 1)
    for name, expr in own:
        if name in roles:
            defaults[roles[name]] = next(n.func.id for n in ast.walk(_parse(expr)) if isinstance(n, ast.Call))
    if len(wanted) != len(defaults):
        raise ArgumentError(f"with_activations: expected {len(defaults)} activation(s) for {base}, got {len(wanted)}")
    if wanted == defaults:
        return spec
    functions = {name: name for name in NUMPY_FUNCTIONS}

    def activated(block: tuple[Statement, ...]) -> tuple[Statement, ...]:
        return tuple(Statement(name, expr) if name not in roles else Statement(
            name, _render(_Activate(wanted[roles[name]]).visit(copy.deepcopy(_parse(expr))), functions, ""))
            for name, expr in block)

    return CellSpec(f"{spec.name}{ACTIVATIONS_SUFFIX}{'/'.join(wanted)}", spec.gates, spec.has_cell_state,
                    spec.stages, spec.stage_operands, tuple(activated(b) for b in spec.between_stages),
                    activated(spec.pointwise), spec.supports_projection, spec.lengths)


COUPLED_SUFFIX = "+coupled"
"""What a :func:`with_coupled_gates` cell's name ends with: ``lstm+coupled``."""


def with_coupled_gates(cell: str | CellSpec) -> CellSpec:
    """An LSTM (clipped, with other activations, or neither) whose forget gate
    is one minus its input gate: ONNX's ``input_forget=1``, as ONNX Runtime
    computes it. The forget gate's rows still exist (ONNX keeps them); their
    product goes unused."""
    spec = get_cell(cell)
    if spec.name.partition("+")[0] != "lstm" or COUPLED_SUFFIX in spec.name or spec.lengths:
        raise ArgumentError(f"with_coupled_gates: expected an LSTM cell whose gates are not coupled yet, "
                            f"got {spec.name!r}")
    pointwise = tuple(Statement(name, "1.0 - i" if name == "f" else expr) for name, expr in spec.pointwise)
    return CellSpec(f"{spec.name}{COUPLED_SUFFIX}", spec.gates, spec.has_cell_state, spec.stages,
                    spec.stage_operands, spec.between_stages, pointwise, spec.supports_projection, spec.lengths)


@functools.lru_cache(maxsize=None)
def _derived_cell(name: str) -> CellSpec:
    """A name of the form ``base[+clip=C][+act=A/B/...][+coupled]``, as
    :func:`with_clip`, :func:`with_activations` and :func:`with_coupled_gates`
    name their cells."""
    coupled = name.endswith(COUPLED_SUFFIX)
    rest, _, activations = name.removesuffix(COUPLED_SUFFIX).partition(ACTIVATIONS_SUFFIX)
    base, _, clip_text = rest.partition(CLIP_SUFFIX)
    if base not in CELLS:
        raise ArgumentError(f"cell: expected one of {sorted(CELLS)} before {CLIP_SUFFIX!r} or "
                            f"{ACTIVATIONS_SUFFIX!r}, got {name!r}")
    spec = CELLS[base]
    if CLIP_SUFFIX in rest:
        try:
            clip = float(clip_text)
        except ValueError:
            raise ArgumentError(f"cell: expected {base}{CLIP_SUFFIX}<a positive float>, got {name!r}") from None
        spec = with_clip(spec, clip)
    if ACTIVATIONS_SUFFIX in name:
        spec = with_activations(spec, activations.split("/"))
    if coupled:
        spec = with_coupled_gates(spec)
    if spec.name != name:  # one name per cell, so that plans and binaries are cached once
        raise ArgumentError(f"cell: expected {spec.name!r}, got {name!r}")
    return spec


def get_cell(cell: str | CellSpec) -> CellSpec:
    """Return the spec for a registry name or a derived cell's name
    (:func:`with_clip`, :func:`with_activations`, :func:`with_coupled_gates`),
    or ``cell`` itself if it is a CellSpec."""
    if isinstance(cell, CellSpec):
        return cell
    if not isinstance(cell, str):
        raise ArgumentTypeError(f"cell: expected a str or CellSpec, got {type(cell).__name__}")
    if "+" in cell:
        return _derived_cell(cell)
    try:
        return CELLS[cell]
    except KeyError:
        raise ArgumentError(f"cell: expected one of {sorted(CELLS)}, or one of them derived ({CLIP_SUFFIX}, "
                            f"{ACTIVATIONS_SUFFIX}, {COUPLED_SUFFIX}), got {cell!r}") from None
