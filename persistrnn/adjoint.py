"""The backward of one cell step, generated from the cell's spec.

:func:`step_backward_program` differentiates a :class:`~persistrnn.cells.CellSpec`
source to source, once per spec: the result is straight-line assignment
statements in the cell expression language, one list per statement block
(block j runs after stage j's recurrent products), in the order the backward
walks them: the last block first. Each block's statements

1. recompute the forward values its adjoints need, in three-address form
   (every operator's value gets a name), from the step's inputs ``x_<gate>``,
   ``h_<gate>`` (the recurrent products with b_hh the forward kept), ``h`` and
   ``c`` (and ``step_runs``, of a cell with lengths: data, not differentiated);
2. run reverse mode over the block's statements, last first, with the local
   derivatives sigmoid' = s (1 - s), tanh' = 1 - t², relu' = (x > 0) (0 at 0,
   as torch's), hardtanh' = (-1 < x < 1) (0 at the bounds, as torch's),
   exp' = exp, log' = 1 / x, step' = 0, and those of + - * / and unary minus.

Between two blocks the recurrent product of the later stage is a matrix
product, not a statement: the backward adds ``d_product_j @ W_j`` into the
adjoint of stage j's operand (``h``, or a name like ``r_h``) outside the
statements. So every adjoint that crosses a block boundary lives in a named
*slot*: ``d xg`` (``x_<gate>``), ``d gates`` (``h_<gate>``, the stage's
``d_product``), ``dh_{t-1}`` (``h``), ``dc_{t-1}`` (``c``), or one plane of a
carry buffer (any other name, e.g. an operand). A block reads the slots a
later block stored (``adjoints_in``) and stores what it changed
(``adjoints_out``); ``h_new``'s and ``c_new``'s adjoints are the step's
``dh``/``dc``.

The same statements run two ways (``persistrnn.training``): with torch
functions (the CPU and float64 path) and rendered into one CUDA kernel per
block (:func:`block_kernel_source`, fp32), one thread per (batch row, unit).

Generated names start with the reserved ``prnn_`` prefix, so they never meet
a spec's names: ``prnn_v<k>`` the forward's operator values, ``prnn_g<k>``
gradient terms, ``prnn_d<k>_<name>`` the k-th value of ``name``'s adjoint
(one name per value: the statements assign each name once, and the blocks'
lists concatenated are one valid program in which a block's loads read the
names the block before it stored).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

from . import runtime
from .cells import CUDA_FUNCTIONS, NUMPY_FUNCTIONS, STEP_RUNS, CellSpec, Statement, _parse, _render, get_cell

__all__ = ["FUNCTIONS", "HARDTANH_GRAD", "KERNEL_NAME", "RELU_GRAD", "THREADS", "BlockBackward", "StepBackward",
           "block_kernel_source", "compile_block_kernel", "render_block_body", "render_python", "step_backward_program"]

RELU_GRAD = "prnn_relu_grad"
"""A function the adjoint statements add to the expression language: relu's
derivative, 1 where the argument is > 0, else 0."""

HARDTANH_GRAD = "prnn_hardtanh_grad"
"""The other: hardtanh's derivative, 1 where the argument is strictly inside
(-1, 1), else 0."""

FUNCTIONS = (*NUMPY_FUNCTIONS, RELU_GRAD, HARDTANH_GRAD)
"""Every function the adjoint statements call."""

_CHAIN_RULES = {
    "sigmoid": lambda grad, value, arg: f"{grad} * ({value} * (1.0 - {value}))",
    "tanh": lambda grad, value, arg: f"{grad} * (1.0 - {value} * {value})",
    "relu": lambda grad, value, arg: f"{grad} * {RELU_GRAD}({arg})",
    "hardtanh": lambda grad, value, arg: f"{grad} * {HARDTANH_GRAD}({arg})",
    "exp": lambda grad, value, arg: f"{grad} * {value}",
    "log": lambda grad, value, arg: f"{grad} / {arg}",
    "step": None,  # constant where it is differentiable (torch's gradient of the comparison is 0 too)
}
"""For each function of the cell language, its argument's gradient from the
gradient of its value (texts of names), or None where it is zero."""
assert set(_CHAIN_RULES) == set(NUMPY_FUNCTIONS), "every function of the cell language needs its derivative"

KERNEL_NAME = "prnn_step_backward"
THREADS = 256  # per block of the backward kernels; one thread per (batch row, hidden unit)

_OPERATOR_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclasses.dataclass(frozen=True)
class BlockBackward:
    """The backward of statement block ``block`` of one step.

    ``statements``: the forward recomputation, then the adjoints.
    ``inputs``: the forward names it reads from the step's inputs
    (``x_<gate>``, ``h_<gate>``, ``h``, ``c``). ``adjoints_in``: (name, the
    statement name its adjoint is read into), from the slots a later block
    stored (or the step's ``dh``/``dc`` for ``h_new``/``c_new``).
    ``adjoints_out``: (name, the statement name holding its adjoint, or None
    for zero) stored into the slots. ``operands_out``: (stage, name) of the
    stage operands this block computes, which the weight gradient needs.
    After the block, the matrix product ``d_product @ W`` of its stage goes
    into the stage operand's slot: ``accumulate`` says whether it adds to a
    part a block stored or writes the slot; ``through_w`` names the operand's
    adjoint it leaves there (a later block's ``adjoints_in`` reads it).
    """

    block: int
    statements: tuple[Statement, ...]
    inputs: tuple[str, ...]
    adjoints_in: tuple[tuple[str, str], ...]
    adjoints_out: tuple[tuple[str, str | None], ...]
    operands_out: tuple[tuple[int, str], ...]
    accumulate: bool
    through_w: str


@dataclasses.dataclass(frozen=True)
class StepBackward:
    """A cell's backward step: its blocks in walk order (the last block
    first), and the names whose adjoints cross blocks in a carry plane."""

    spec: CellSpec
    blocks: tuple[BlockBackward, ...]
    carried: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Node:
    """A lowered expression node: ``value`` is the text of its value (a
    name or a literal); ``kind`` is "name", "constant", "neg", an operator
    symbol or a function name."""

    kind: str
    value: str
    args: tuple[_Node, ...] = ()


def _reads(expr: str) -> set[str]:
    """The variable names a generated expression reads."""
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)} - set(FUNCTIONS)


def _normalised(expr: str) -> str:
    """Generated text in the expression language's canonical rendering (fewest parentheses)."""
    return _render(ast.parse(expr, mode="eval").body, {name: name for name in FUNCTIONS}, "")


class _Lowering:
    """The forward in three-address form: every operator's value gets a name."""

    def __init__(self) -> None:
        self.blocks: list[list[Statement]] = []
        self.trees: dict[str, _Node] = {}
        self._temps = 0

    def block(self, statements: tuple[Statement, ...]) -> None:
        self.blocks.append([])
        for name, expr in statements:
            self.trees[name] = self._lower(_parse(expr), name)

    def _lower(self, node: ast.expr, name: str | None = None) -> _Node:
        if isinstance(node, (ast.Name, ast.Constant)):
            leaf = _Node("name", node.id) if isinstance(node, ast.Name) else _Node("constant", repr(float(node.value)))
            if name is not None:  # a statement that is a name or a number: an alias
                self.blocks[-1].append(Statement(name, leaf.value))
            return leaf
        if isinstance(node, ast.Call):
            args = (self._lower(node.args[0]),)
            kind, expr = node.func.id, f"{node.func.id}({args[0].value})"
        elif isinstance(node, ast.UnaryOp):
            args = (self._lower(node.operand),)
            kind, expr = "neg", f"-{args[0].value}"
        else:
            args = (self._lower(node.left), self._lower(node.right))
            kind = _OPERATOR_SYMBOLS[type(node.op)]
            expr = f"{args[0].value} {kind} {args[1].value}"
        if name is None:
            name, self._temps = f"prnn_v{self._temps}", self._temps + 1
        self.blocks[-1].append(Statement(name, expr))
        return _Node(kind, name, args)


class _Adjoints:
    """Reverse mode over the lowered trees, emitting statements; the same
    formulas, in the same order, as the walk it replaces (the left operand's
    gradient before the right's, each added into its name's adjoint as it comes)."""

    def __init__(self, seeds: dict[str, str]) -> None:
        self.carried = dict(seeds)  # name -> statement name of its adjoint in a slot
        self.versions = {name: 0 for name in seeds}
        self._terms = 0
        self.start_block()

    def start_block(self) -> None:
        self.statements: list[Statement] = []
        self.current: dict[str, str] = {}  # name -> statement name of its adjoint, assigned in this block
        self.loaded: list[tuple[str, str]] = []

    def _emit(self, name: str, expr: str) -> None:
        self.statements.append(Statement(name, _normalised(expr)))

    def _load(self, name: str) -> str:
        adjoint = self.carried.pop(name)
        self.loaded.append((name, adjoint))
        return adjoint

    def pop(self, name: str) -> str | None:
        """The whole adjoint of ``name`` (every reader walked), or None where nothing read it."""
        if name in self.current:
            return self.current.pop(name)
        return self._load(name) if name in self.carried else None

    def fresh(self, name: str) -> str:
        self.versions[name] = self.versions.get(name, 0) + 1
        return f"prnn_d{self.versions[name]}_{name}"

    def add(self, name: str, expr: str) -> None:
        previous = self.current.get(name) or (self._load(name) if name in self.carried else None)
        adjoint = self.fresh(name)
        self._emit(adjoint, expr if previous is None else f"{previous} + ({expr})")
        self.current[name] = adjoint

    def walk(self, node: _Node, grad: str) -> None:
        """Add ``grad`` (the gradient of ``node``'s value) into the adjoints of the names it reads."""
        if node.kind == "constant" or node.value == STEP_RUNS or (  # step_runs is data, not a variable
                node.kind in _CHAIN_RULES and _CHAIN_RULES[node.kind] is None):
            return
        if node.kind == "name":
            self.add(node.value, grad)
            return
        if not re.fullmatch(r"\w+", grad):  # an operator's gradient is used more than once: name it
            term, self._terms = f"prnn_g{self._terms}", self._terms + 1
            self._emit(term, grad)
            grad = term
        value, args = node.value, node.args
        if node.kind in _CHAIN_RULES:
            self.walk(args[0], _CHAIN_RULES[node.kind](grad, value, args[0].value))
        elif node.kind == "neg":
            self.walk(args[0], f"-{grad}")
        elif node.kind == "+":
            self.walk(args[0], grad)
            self.walk(args[1], grad)
        elif node.kind == "-":
            self.walk(args[0], grad)
            self.walk(args[1], f"-{grad}")
        elif node.kind == "*":
            self.walk(args[0], f"{grad} * {args[1].value}")
            self.walk(args[1], f"{grad} * {args[0].value}")
        else:  # "/"
            self.walk(args[0], f"{grad} / {args[1].value}")
            self.walk(args[1], f"-{grad} * {value} / {args[1].value}")


def _live(statements: list[Statement], needed: set[str]) -> list[Statement]:
    """The statements that ``needed`` depends on, in order (the rest is dead)."""
    kept = []
    for statement in reversed(statements):
        if statement.name in needed:
            kept.append(statement)
            needed |= _reads(statement.expr)
    return kept[::-1]


@functools.lru_cache(maxsize=None)
def step_backward_program(cell: str | CellSpec) -> StepBackward:
    """The backward of one step of ``cell``, generated once per spec."""
    spec = get_cell(cell)
    blocks = (*spec.between_stages, spec.pointwise)
    lowering = _Lowering()
    for block in blocks:
        lowering.block(block)
    assigned_in = {name: j for j, block in enumerate(blocks) for name, _ in block}
    seeds = {"h_new": "prnn_d0_h_new", **({"c_new": "prnn_d0_c_new"} if spec.has_cell_state else {})}
    adjoints = _Adjoints(seeds)
    finals = [f"x_{gate}" for gate in spec.gates] + (["c"] if spec.has_cell_state else [])
    walked, carried = [], []
    for j in reversed(range(len(blocks))):
        adjoints.start_block()
        for name, _ in reversed(blocks[j]):
            grad = adjoints.pop(name)
            if grad is not None:
                adjoints.walk(lowering.trees[name], grad)
        # Stage j's products are read only by blocks j and later, all walked:
        # their adjoints are whole. One stored by a later block and not read
        # here is in its slot already; one nothing read is zero.
        products = [f"h_{gate}" for gate in spec.stages[j]]
        stored: list[tuple[str, str | None]] = list(adjoints.current.items())
        for name in products:
            if name not in adjoints.current and adjoints.carried.pop(name, None) is None:
                stored.append((name, None))
        adjoints.carried.update((name, adjoint) for name, adjoint in adjoints.current.items()
                                if name not in products)
        operand = spec.stage_operands[j]
        accumulate = operand in adjoints.carried
        through_w = adjoints.carried[operand] = adjoints.fresh(operand)
        if j == 0:
            stored += [(name, None) for name in finals if name not in adjoints.carried]
        operands_out = tuple((s, name) for s, name in enumerate(spec.stage_operands)
                             if s and assigned_in.get(name) == j)
        needed = {adjoint for _, adjoint in stored if adjoint} | {name for _, name in operands_out}
        statements = tuple(_live([s for block in lowering.blocks[:j + 1] for s in block] + adjoints.statements, needed))
        defined = {s.name for s in statements} | {adjoint for _, adjoint in adjoints.loaded}
        inputs = sorted(set().union(*(_reads(s.expr) for s in statements)) - defined)
        walked.append(BlockBackward(j, statements, tuple(inputs), tuple(adjoints.loaded), tuple(stored),
                                    operands_out, accumulate, through_w))
        carried += [name for name, _ in (*adjoints.loaded, *stored) if _slot_kind(spec, name) == "carry"]
    return StepBackward(spec, tuple(walked), tuple(dict.fromkeys(carried)))


def _slot_kind(spec: CellSpec, name: str) -> str:
    """Where a name's adjoint crosses blocks: its row of d xg or d gates, dh, dc, the step's seeds, or a carry plane."""
    if name.startswith("x_") and name[2:] in spec.gates:
        return "x"
    if name.startswith("h_") and name[2:] in spec.gates:
        return "gate"
    return name if name in ("h", "c", "h_new", "c_new") else "carry"


def render_python(statements: tuple[Statement, ...]) -> str:
    """Statements as Python assignments over the names in :data:`FUNCTIONS`."""
    return "\n".join(f"{name} = {_normalised(expr)}" for name, expr in statements)


# ---- the CUDA rendering -----------------------------------------------------------


def _address(program: StepBackward, name: str) -> str:
    """The element of ``name``'s adjoint slot for this thread's (batch row, unit)."""
    spec, kind = program.spec, _slot_kind(program.spec, name)
    if kind in ("x", "gate"):
        return f"prnn_d{'xg' if kind == 'x' else 'gates'}[prnn_row + {spec.gates.index(name[2:])} * prnn_hidden]"
    if kind in ("h", "c"):
        return f"prnn_d{kind}_prev[prnn_n]"
    return f"prnn_carry[{program.carried.index(name)} * prnn_batch * prnn_hidden + prnn_n]"


def _value_address(spec: CellSpec, name: str) -> str:
    """The element of forward input ``name`` for this thread."""
    if name == STEP_RUNS:  # one per batch row
        return "prnn_step_runs[prnn_b]"
    if name in ("h", "c"):
        return f"prnn_{name}[prnn_n]"
    source = "prnn_xg" if name.startswith("x_") else "prnn_gates"
    return f"{source}[prnn_row + {spec.gates.index(name[2:])} * prnn_hidden]"


def render_block_body(program: StepBackward, block: BlockBackward) -> str:
    spec = program.spec
    functions = {**CUDA_FUNCTIONS, RELU_GRAD: RELU_GRAD, HARDTANH_GRAD: HARDTANH_GRAD}
    lines = ["    // the forward values this block reads"]
    lines += [f"    const float {name} = {_value_address(spec, name)};" for name in block.inputs]
    lines.append("    // the adjoints the blocks after this one stored (h_new's and c_new's: the step's dh, dc)")
    seeds = {"h_new": "prnn_dh[prnn_n] + prnn_dout[prnn_n]", "c_new": "prnn_dc[prnn_n]"}
    lines += [f"    const float {adjoint} = {seeds.get(name) or _address(program, name)};"
              for name, adjoint in block.adjoints_in]
    lines.append("    // the forward recomputed, then the adjoints")
    lines += [f"    const float {name} = {_render(ast.parse(expr, mode='eval').body, functions, 'f')};"
              for name, expr in block.statements]
    lines.append("    // the adjoints later blocks and the matrix products read, and the operands dW_hh needs")
    lines += [f"    {_address(program, name)} = {adjoint or '0.0f'};" for name, adjoint in block.adjoints_out]
    lines += [f"    prnn_operands[{stage - 1} * prnn_operand_stride + prnn_n] = {name};"
              for stage, name in block.operands_out]
    return "\n".join(lines)


def block_kernel_source(cell: str | CellSpec, block: int) -> str:
    """The complete CUDA source of the backward kernel of ``cell``'s statement block ``block``."""
    program = step_backward_program(cell)
    (walked,) = [b for b in program.blocks if b.block == block]
    return runtime.render_template("step_backward.cu", title=f"step backward: cell {program.spec.name}, block {block}",
                                   defines={"PRNN_G": program.spec.num_gates, "PRNN_THREADS": THREADS},
                                   marker="    // ---- the block's statements ----",
                                   generated=render_block_body(program, walked), keep_marker=False)


@functools.lru_cache(maxsize=None)
def compile_block_kernel(cell: str | CellSpec, block: int, arch: str | None = None) -> runtime.CompiledBinary:
    """NVRTC-compile (disk-cached) the backward kernel of ``cell``'s block ``block``;
    ``arch=None`` is the current device's."""
    spec = get_cell(cell)
    name = "step_backward_" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name) + f"_block{block}"
    return runtime.compile_source(name, block_kernel_source(spec, block), arch=arch)
