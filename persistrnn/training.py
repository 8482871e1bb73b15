"""Training: a forward that keeps what backpropagation through time needs,
the backward, and the autograd operators that join them.

The path of a training call: ``torch.ops.persistrnn.train_forward`` runs the
model and returns, beside its outputs, what the backward reads; autograd
keeps those and ``torch.ops.persistrnn.train_backward`` (:func:`backward`)
turns the output gradients into the gradients of the input, the initial
states and every parameter. Both are operators (torch.library, with
``register_autograd``), so ``torch.compile`` traces a training step through
them without breaking the graph.

What is kept, per layer and direction (the "saved" list of the operator):

* ``xw`` (T, B, G*H): the input projections ``x W_ih^T + b_ih``;
* ``gates`` (T, B, G*H): every gate's recurrent product with ``b_hh``
  (``W_hh h_{t-1} + b_hh``; a later stage's product is of that stage's
  operand, e.g. ``r * h`` of the reset-before GRU);
* ``c`` (T, B, H): the cell state after each position (cells with one);

all in the compute dtype (fp32 on the GPU, the input's dtype on the CPU),
and per layer but the last its output (the next layer's input) in the layer's
dtype. With the outputs, that is ``4 G H + 4 H_c + 2 D H`` bytes per position
and sequence of an fp32 layer; cuDNN's reserve space holds the gate
activations and cell states in the layer dtype.

On CUDA the forward is the persistent kernel compiled with ``save_gates``
(one launch per layer and direction; the kernel writes ``gates`` and ``c``
as it runs). Where no kernel configuration holds the layer, and on the CPU,
the same values come from :func:`direction_forward`, the recurrence in torch
ops.

The backward (:func:`direction_backward`) runs the recurrence backwards step
by step with torch ops, in the compute dtype: per step, the gradients of the
gate pre-activations from ``dh``/``dc`` and the kept values (reverse-mode
differentiation of the cell spec's own statements, :func:`step_backward`, so
every cell is covered by its spec), then ``dh_{t-1} = W_hh^T dgates``. After
the recurrence: one GEMM each for ``dW_hh`` (per stage: its gradients by its
operands), ``dW_ih`` and ``dx``; bias gradients are sums. Nothing reduces
with atomics, so the same inputs give bit-identical gradients. This step
loop is the first version of the backward recurrence; a persistent backward
kernel (``W_hh^T`` resident, one exchange per step) replaces it on the GPU.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
from typing import Any, Callable, Optional

import torch

from . import ops, persistent, runtime
from .cells import NUMPY_FUNCTIONS, CellSpec, _parse, get_cell
from .errors import ArgumentError, ConfigError, UnsupportedError

__all__ = ["TORCH_FUNCTIONS", "backward", "direction_backward", "direction_forward", "forward", "run_module",
           "saved_shapes", "step_backward", "training_config"]

TORCH_FUNCTIONS = {name: getattr(torch, name) for name in NUMPY_FUNCTIONS}
"""The cell expression language's functions on tensors (autograd included):
torch's by the same names (sigmoid, tanh, relu)."""

# ---- the cell, differentiated from its spec ------------------------------------


def _stage_rows(spec: CellSpec, stage: int, hidden: int) -> slice:
    """Rows of stage ``stage``'s gates (consecutive: the kernels need them so too)."""
    first = spec.gates.index(spec.stages[stage][0])
    return slice(first * hidden, (first + len(spec.stages[stage])) * hidden)


def _blocks(spec: CellSpec) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Statement block j runs after stage j's products: the between-stage blocks, then the pointwise."""
    return (*spec.between_stages, spec.pointwise)


def _value(node: ast.expr, env: dict[str, Any], values: dict[int, Any]) -> Any:
    """Evaluate a validated expression on tensors, keeping every node's value for :func:`_adjoint`."""
    if isinstance(node, ast.Name):
        value = env[node.id]
    elif isinstance(node, ast.Constant):
        value = float(node.value)
    elif isinstance(node, ast.Call):
        value = TORCH_FUNCTIONS[node.func.id](_value(node.args[0], env, values))
    elif isinstance(node, ast.UnaryOp):
        value = -_value(node.operand, env, values)
    else:
        value = _OPERATORS[type(node.op)](_value(node.left, env, values), _value(node.right, env, values))
    values[id(node)] = value
    return value


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub,
                                                     ast.Mult: operator.mul, ast.Div: operator.truediv}


def _adjoint(node: ast.expr, grad: Any, values: dict[int, Any], adjoints: dict[str, Any]) -> None:
    """Add ``grad`` (the gradient of ``node``'s value) into the adjoints of the names it reads."""
    if isinstance(node, ast.Name):
        adjoints[node.id] = adjoints[node.id] + grad if node.id in adjoints else grad
    elif isinstance(node, ast.Call):
        value, argument = values[id(node)], node.args[0]
        function = node.func.id
        if function == "sigmoid":
            local = value * (1.0 - value)
        elif function == "tanh":
            local = 1.0 - value * value
        else:  # relu; its derivative at 0 is 0, as torch's
            local = (values[id(argument)] > 0).to(value.dtype)
        _adjoint(argument, grad * local, values, adjoints)
    elif isinstance(node, ast.UnaryOp):
        _adjoint(node.operand, -grad, values, adjoints)
    elif isinstance(node, ast.BinOp):
        left, right = values[id(node.left)], values[id(node.right)]
        op = type(node.op)
        if op is ast.Add:
            _adjoint(node.left, grad, values, adjoints)
            _adjoint(node.right, grad, values, adjoints)
        elif op is ast.Sub:
            _adjoint(node.left, grad, values, adjoints)
            _adjoint(node.right, -grad, values, adjoints)
        elif op is ast.Mult:
            _adjoint(node.left, grad * right, values, adjoints)
            _adjoint(node.right, grad * left, values, adjoints)
        else:
            _adjoint(node.left, grad / right, values, adjoints)
            _adjoint(node.right, -grad * values[id(node)] / right, values, adjoints)
    # a constant reads no name


def _run_cell(spec: CellSpec, xg: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
              product: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[dict[str, Any], dict[int, Any], list]:
    """One step of the cell from its spec: ``product(stage, operand)`` gives
    that stage's gates' recurrent products with b_hh, (B, gates * H). Returns
    every name's value, every expression node's value and each stage's products."""
    hidden = h.shape[1]
    env: dict[str, Any] = {"h": h}
    if c is not None:
        env["c"] = c
    for i, gate in enumerate(spec.gates):
        env[f"x_{gate}"] = xg[:, i * hidden:(i + 1) * hidden]
    values: dict[int, Any] = {}
    products = []
    for j, block in enumerate(_blocks(spec)):
        products.append(product(j, env[spec.stage_operands[j]]))
        for i, gate in enumerate(spec.stages[j]):
            env[f"h_{gate}"] = products[j][:, i * hidden:(i + 1) * hidden]
        for name, expr in block:
            env[name] = _value(_parse(expr), env, values)
    return env, values, products


def step_backward(spec: CellSpec, xg: torch.Tensor, gates: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
                  w_stages: list[torch.Tensor], dh: torch.Tensor,
                  dc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, list[Any]]:
    """One step of the backward recurrence.

    ``xg``, ``gates`` (B, G*H): the step's input projections and recurrent
    products (with b_hh); ``h``, ``c`` (B, H): the states it started from;
    ``w_stages[j]``: W_hh's rows of stage j; ``dh``, ``dc``: the gradients of
    its new states. Returns (d xg, d gates (both (B, G*H)), dh_{t-1},
    dc_{t-1} or None, every stage's operand (stage 0's is ``h``)).
    """
    env, values, _ = _run_cell(spec, xg, h, c, lambda j, operand: gates[:, _stage_rows(spec, j, h.shape[1])])
    adjoints: dict[str, Any] = {"h_new": dh}
    if c is not None:
        adjoints["c_new"] = dc
    blocks = _blocks(spec)
    d_products = []
    for j in reversed(range(len(blocks))):
        for name, expr in reversed(blocks[j]):
            grad = adjoints.pop(name, None)
            if grad is not None:
                _adjoint(_parse(expr), grad, values, adjoints)
        # Stage j's products are read only by blocks j and later, all walked:
        # their gradients are whole, and reach the stage's operand through W.
        d_product = torch.cat([_gradient(adjoints.pop(f"h_{gate}", None), h) for gate in spec.stages[j]], dim=1)
        d_products.append(d_product)
        operand = spec.stage_operands[j]
        through_w = d_product @ w_stages[j]
        adjoints[operand] = adjoints[operand] + through_w if operand in adjoints else through_w
    d_xg = torch.cat([_gradient(adjoints.get(f"x_{gate}"), h) for gate in spec.gates], dim=1)
    dc_prev = _gradient(adjoints.get("c"), h) if c is not None else None
    operands = [env[name] for name in spec.stage_operands]
    return d_xg, torch.cat(d_products[::-1], dim=1), adjoints["h"], dc_prev, operands


def _gradient(grad: Any, like: torch.Tensor) -> torch.Tensor:
    """A gradient as a (B, H) tensor: zeros for a name nothing read, a
    broadcast for one that only met constants."""
    if grad is None:
        return torch.zeros_like(like)
    return grad.expand_as(like) if isinstance(grad, torch.Tensor) else torch.full_like(like, grad)


# ---- one direction of one layer ----------------------------------------------


def _positions(steps: int, reverse: bool) -> range:
    return range(steps - 1, -1, -1) if reverse else range(steps)


def _previous(sequence: torch.Tensor, initial: torch.Tensor, reverse: bool) -> torch.Tensor:
    """(T, B, H): the state each position started from (the initial state, then
    the sequence shifted by one step in the direction's order)."""
    if reverse:
        return torch.cat([sequence[1:], initial[None]])
    return torch.cat([initial[None], sequence[:-1]])


def direction_forward(spec: CellSpec, xw: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor, h0: torch.Tensor,
                      c0: torch.Tensor | None, reverse: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One layer's direction with torch ops, keeping what the backward reads:
    (out (T, B, H), gates (T, B, G*H), c (T, B, H) or None), in the dtype of
    ``xw``; the rest as in :func:`step_backward`."""
    steps, hidden = xw.shape[0], w_hh.shape[1]
    out = xw.new_empty(xw.shape[0], xw.shape[1], hidden)
    gates = torch.empty_like(xw)
    cs = torch.empty_like(out) if c0 is not None else None
    w_stages = [(w_hh[rows].T, b_hh[rows]) for rows in (_stage_rows(spec, j, hidden) for j in range(len(spec.stages)))]
    h, c = h0, c0
    for p in _positions(steps, reverse):
        env, _, products = _run_cell(spec, xw[p], h, c,
                                     lambda j, operand: torch.addmm(w_stages[j][1], operand, w_stages[j][0]))
        gates[p] = torch.cat(products, dim=1)
        h = out[p] = env["h_new"]
        if cs is not None:
            c = cs[p] = env["c_new"]
    return out, gates, cs


def direction_backward(spec: CellSpec, xw: torch.Tensor, gates: torch.Tensor, cs: torch.Tensor | None,
                       out: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None, w_hh: torch.Tensor,
                       d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: torch.Tensor | None,
                       reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """The backward recurrence of one layer's direction, all in one dtype.

    ``xw``, ``gates``, ``cs`` as the forward kept them, ``out`` (T, B, H) its
    outputs, ``d_out`` their gradients, ``dh_n``/``dc_n`` the final states'.
    Returns (d xw, d gates (T, B, G*H), dW_hh, dh0, dc0 or None).
    """
    steps, hidden = xw.shape[0], w_hh.shape[1]
    stage_rows = [_stage_rows(spec, j, hidden) for j in range(len(spec.stages))]
    w_stages = [w_hh[rows] for rows in stage_rows]
    h_prev = _previous(out, h0, reverse)
    c_prev = _previous(cs, c0, reverse) if cs is not None else None
    d_xw, d_gates = torch.empty_like(xw), torch.empty_like(gates)
    # Stage 0 multiplies h_{t-1}; a later stage's operand is computed in the step.
    operands = [h_prev] + [torch.empty_like(out) for _ in stage_rows[1:]]
    dh, dc = dh_n, dc_n
    for p in reversed(_positions(steps, reverse)):
        d_xw[p], d_gates[p], dh, dc, step_operands = step_backward(
            spec, xw[p], gates[p], h_prev[p], None if c_prev is None else c_prev[p], w_stages, dh + d_out[p], dc)
        for j in range(1, len(stage_rows)):
            operands[j][p] = step_operands[j]
    flat = d_gates.reshape(-1, d_gates.shape[2])
    d_w_hh = torch.cat([flat[:, rows].T @ operand.reshape(-1, hidden) for rows, operand in zip(stage_rows, operands)])
    return d_xw, d_gates, d_w_hh, dh, dc


# ---- the whole model -------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the GPU's dtypes (16-bit layers accumulate in fp32); float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def saved_shapes(spec: CellSpec, steps: int, batch: int, hidden: int, num_layers: int,
                 directions: int) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, whether in the compute dtype (else the layer dtype)) of each
    tensor of the saved list: per layer and direction xw, gates (and c),
    then each layer's output but the last's."""
    per = [((steps, batch, spec.num_gates * hidden), True)] * 2
    if spec.has_cell_state:
        per.append(((steps, batch, hidden), True))
    return per * (num_layers * directions) + [((steps, batch, directions * hidden), False)] * (num_layers - 1)


@functools.lru_cache(maxsize=256)
def training_config(cell: str, hidden_size: int, batch: int, dtype: str,
                    device: int) -> persistent.KernelConfig | None:
    """The kernel configuration a training forward runs (the default one,
    compiled with ``save_gates``), or None where none holds the layer on chip."""
    try:
        config = dataclasses.replace(
            persistent.default_config(cell, hidden_size, batch, sm_count=runtime.device_facts().sm_count,
                                      dtype=dtype), save_gates=True)
        persistent.batch_per_launch(config, device)  # compiles it; refuses one that spills or fits no sequence
    except ConfigError:
        return None
    return config


def forward(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None, weights: list[torch.Tensor], cell: str,
            num_layers: int, bidirectional: bool,
            has_biases: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The training forward (the operator's implementation): (out (T, B, D*H),
    h_n, c_n (empty without a cell state), the saved list)."""
    spec = get_cell(cell)
    if x.dim() != 3 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ArgumentError(f"persistrnn::train_forward: expected x of shape (T >= 1, B >= 1, input), "
                            f"got {tuple(x.shape)}")
    directions = 2 if bidirectional else 1
    layers = ops.layer_params(weights, num_layers, directions, has_biases)
    steps, batch = x.shape[0], x.shape[1]
    hidden = layers[0][0]["w_hh"].shape[1]
    compute = _compute_dtype(x.dtype)
    config = None
    if x.is_cuda:
        runtime.raise_reported_failure(x.device.index)
        config = training_config(cell, hidden, batch, str(x.dtype).removeprefix("torch."), x.device.index)
    h0 = h0.contiguous()
    c0 = c0.contiguous() if spec.has_cell_state else None
    h_n, c_n = torch.empty_like(h0), (torch.empty_like(c0) if c0 is not None else x.new_empty(0))
    kept, outputs = [], []
    layer_input = x.contiguous()
    for layer in range(num_layers):
        out = x.new_empty(steps, batch, directions * hidden)
        for d in range(directions):
            i, p = layer * directions + d, layers[layer][d]
            if config is not None:
                xw = persistent.input_projection(layer_input, p["w_ih"], p["b_ih"])
                gates = torch.empty_like(xw)
                cs = xw.new_empty(steps, batch, hidden) if c0 is not None else None
                persistent.run_instances(config, [persistent.Instance(
                    xw, p["w_hh"], p["b_hh"], h0[i], c0[i] if c0 is not None else None, out, h_n[i],
                    c_n[i] if c0 is not None else None, reverse=d == 1, out_column=d * hidden, saved_gates=gates,
                    saved_c=cs)], steps, batch, check=False)
            else:
                w = {k: v.to(compute) for k, v in p.items()}
                xw = torch.addmm(w["b_ih"], layer_input.reshape(steps * batch, -1).to(compute),
                                 w["w_ih"].T).view(steps, batch, -1)
                hs, gates, cs = direction_forward(spec, xw, w["w_hh"], w["b_hh"], h0[i].to(compute),
                                                  c0[i].to(compute) if c0 is not None else None, reverse=d == 1)
                out[:, :, d * hidden:(d + 1) * hidden] = hs
                h_n[i] = hs[steps - 1 if d == 0 else 0]
                if cs is not None:
                    c_n[i] = cs[steps - 1 if d == 0 else 0]
            kept += [xw, gates] + ([cs] if cs is not None else [])
        if layer < num_layers - 1:
            outputs.append(out)
        layer_input = out
    return layer_input, h_n, c_n, kept + outputs


def backward(d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: torch.Tensor | None, x: torch.Tensor, h0: torch.Tensor,
             c0: torch.Tensor | None, weights: list[torch.Tensor], out: torch.Tensor, saved: list[torch.Tensor],
             cell: str, num_layers: int, bidirectional: bool,
             has_biases: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The training backward (the operator's implementation): from the
    gradients of (out, h_n, c_n) and what the forward kept, (dx, dh0, dc0
    (empty without a cell state), the gradient of every weight, in the
    weights' order and dtypes)."""
    spec = get_cell(cell)
    directions = 2 if bidirectional else 1
    layers = ops.layer_params(weights, num_layers, directions, has_biases)
    hidden = layers[0][0]["w_hh"].shape[1]
    compute = _compute_dtype(x.dtype)
    per = 3 if spec.has_cell_state else 2
    outputs = saved[num_layers * directions * per:] + [out]
    per_weight = 4 if has_biases else 2
    d_weights: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
    dh0 = torch.empty(h0.shape, dtype=compute, device=h0.device)
    dc0 = torch.empty(c0.shape, dtype=compute, device=c0.device) if spec.has_cell_state else None
    d_layer_out = d_out.to(compute)
    for layer in reversed(range(num_layers)):
        layer_input = (x if layer == 0 else outputs[layer - 1]).to(compute)
        d_layer_input = None
        for d in range(directions):
            i, p = layer * directions + d, layers[layer][d]
            xw, gates = saved[i * per], saved[i * per + 1]
            cs = saved[i * per + 2] if spec.has_cell_state else None
            columns = slice(d * hidden, (d + 1) * hidden)
            d_xw, d_gates, d_w_hh, dh0[i], dc = direction_backward(
                spec, xw, gates, cs, outputs[layer][:, :, columns].to(compute), h0[i].to(compute),
                c0[i].to(compute) if cs is not None else None, p["w_hh"].to(compute), d_layer_out[:, :, columns],
                dh_n[i].to(compute), dc_n[i].to(compute) if cs is not None else None, reverse=d == 1)
            if dc0 is not None:
                dc0[i] = dc
            flat = d_xw.reshape(-1, d_xw.shape[2])
            grads = [flat.T @ layer_input.reshape(flat.shape[0], -1), d_w_hh]
            if has_biases:
                grads += [flat.sum(0), d_gates.reshape(flat.shape).sum(0)]
            for k, grad in enumerate(grads):
                index = i * per_weight + k
                d_weights[index] = grad.to(weights[index].dtype)
            through = (flat @ p["w_ih"].to(compute)).view(layer_input.shape)
            d_layer_input = through if d_layer_input is None else d_layer_input + through
        d_layer_out = d_layer_input
    return (d_layer_out.to(x.dtype), dh0.to(h0.dtype), dc0.to(c0.dtype) if dc0 is not None else x.new_empty(0),
            d_weights)


def run_module(module: Any, x: torch.Tensor, h0: torch.Tensor | None,
               c0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A persistrnn module's training call through the operators: ``x``
    (T, B, I) time-major, ``h0``/``c0`` (L*D, B, H) or None for zeros.
    Returns (out, h_n, c_n or None), differentiable."""
    has_c = get_cell(module.cell).has_cell_state
    if h0 is None:
        h0 = x.new_zeros(module.num_layers * (2 if module.bidirectional else 1), x.shape[1], module.hidden_size)
        c0 = torch.zeros_like(h0) if has_c else None
    out, h_n, c_n, _ = torch.ops.persistrnn.train_forward(x, h0, c0, list(module._flat_weights), module.cell,
                                                          module.num_layers, module.bidirectional, module.bias)
    return out, h_n, (c_n if has_c else None)


# ---- the operators -------------------------------------------------------------------

# Defined with torch.library's low-level registration, as persistrnn::forward
# is (persistrnn/ops.py says why); that module defines the namespace.
_LIBRARY = torch.library.Library("persistrnn", "FRAGMENT")
_LIBRARY.define("train_forward(Tensor x, Tensor h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
                "bool bidirectional, bool has_biases) -> (Tensor, Tensor, Tensor, Tensor[])")
_LIBRARY.define("train_backward(Tensor d_out, Tensor dh_n, Tensor? dc_n, Tensor x, Tensor h0, Tensor? c0, "
                "Tensor[] weights, Tensor out, Tensor[] saved, str cell, int num_layers, bool bidirectional, "
                "bool has_biases) -> (Tensor, Tensor, Tensor, Tensor[])")
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("train_forward", forward, _key)
    _LIBRARY.impl("train_backward", backward, _key)


@torch.library.register_fake("persistrnn::train_forward")
def _(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases):
    spec = get_cell(cell)
    directions = 2 if bidirectional else 1
    hidden = weights[1].shape[1]
    compute = _compute_dtype(x.dtype)
    saved = [x.new_empty(shape, dtype=compute if in_compute else x.dtype)
             for shape, in_compute in saved_shapes(spec, x.shape[0], x.shape[1], hidden, num_layers, directions)]
    c_n = torch.empty_like(h0) if spec.has_cell_state else x.new_empty(0)
    return x.new_empty(x.shape[0], x.shape[1], directions * hidden), torch.empty_like(h0), c_n, saved


@torch.library.register_fake("persistrnn::train_backward")
def _(d_out, dh_n, dc_n, x, h0, c0, weights, out, saved, cell, num_layers, bidirectional, has_biases):
    dc0 = torch.empty_like(c0) if c0 is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(h0), dc0, [torch.empty_like(w) for w in weights]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, h0, c0, weights, cell, num_layers, bidirectional, has_biases = inputs
    out, _, _, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.options = (cell, num_layers, bidirectional, has_biases)
    ctx.layout = (len(weights), len(saved), c0 is not None)
    ctx.save_for_backward(x, h0, c0, out, *weights, *saved)


def _backward(ctx: Any, d_out: Optional[torch.Tensor], dh_n: Optional[torch.Tensor], dc_n: Optional[torch.Tensor],
              _saved_grads: Any) -> tuple:
    x, h0, c0, out, *rest = ctx.saved_tensors
    weight_count, _, has_c = ctx.layout
    weights, saved = rest[:weight_count], rest[weight_count:]
    # An output no loss reached has no gradient: zeros.
    d_out = torch.zeros_like(out) if d_out is None else d_out
    dh_n = torch.zeros_like(h0) if dh_n is None else dh_n
    dc_n = (torch.zeros_like(c0) if dc_n is None else dc_n) if has_c else None
    dx, dh0, dc0, d_weights = torch.ops.persistrnn.train_backward(d_out, dh_n, dc_n, x, h0, c0, list(weights), out,
                                                                   list(saved), *ctx.options)
    return dx, dh0, dc0 if has_c else None, list(d_weights), None, None, None, None


def _no_double_backward(ctx: Any, *grads: Any) -> tuple:
    raise UnsupportedError(
        "persistrnn's RNN backward is not differentiable (double backward, e.g. a gradient penalty, is not "
        "implemented). Run that model with torch's own module (torch.nn.LSTM/GRU/RNN, or "
        "persistrnn.nn.torch_forward for GRU(reset_after=False)), whose backward is made of differentiable ops")


torch.library.register_autograd("persistrnn::train_forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("persistrnn::train_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
