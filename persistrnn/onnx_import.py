"""ONNX import: every ONNX ``LSTM``, ``GRU`` and ``RNN`` node becomes a persistrnn module.

:func:`from_onnx` reads a model and returns a ``torch.nn.Module``:

* a model that is one recurrent node (the weights as initializers or
  ``Constant`` nodes) becomes that node's :class:`RecurrentNode`;
* any other graph is converted by ``onnx2torch``, with a :class:`RecurrentNode`
  for each recurrent node and onnx2torch's modules for the rest. persistrnn
  executes no graph of its own.

A :class:`RecurrentNode` holds one single-layer ``persistrnn.LSTM``/``GRU``/
``RNN`` with the node's weights in torch's gate order (ONNX stacks LSTM rows
as i, o, f, c and torch as i, f, g, o; ONNX GRU rows as z, r, h and torch as
r, z, n) and adds what ONNX has and torch does not: ``direction="reverse"``
(each sequence's valid steps reversed around a forward layer), ``layout``,
``sequence_lens`` (a packed sequence), and ONNX's output shapes (Y
[T, D, B, H], Y_h and Y_c [D, B, H]; batch first with ``layout=1``). GRU
``linear_before_reset=0`` (ONNX's default) is ``persistrnn.GRU(reset_after=False)``;
``linear_before_reset=1`` is torch's GRU.

``clip`` makes a clipped cell (:func:`persistrnn.cells.with_clip`): every
gate pre-activation clamped to [-clip, clip] before its activation, as ONNX
Runtime computes it (the LSTM's cell state is not clipped before its output
activation there, and not here). ``activations`` other than the defaults
make a cell with those activations (:func:`persistrnn.cells.with_activations`):
every activation ONNX names (Sigmoid, Tanh, Relu, HardSigmoid, LeakyRelu,
Affine, ScaledTanh, Softsign, Elu, Softplus, ThresholdedRelu), with
``activation_alpha``/``activation_beta`` read as ONNX Runtime reads them, the
same in both directions. LSTM ``input_forget=1`` couples the forget gate to
the input gate (f = 1 - i, as ONNX Runtime computes it;
:func:`persistrnn.cells.with_coupled_gates`).

What the cells cannot compute raises :class:`~persistrnn.errors.UnsupportedError`
naming the node and the attribute: LSTM
peepholes (a ``P`` that is not all zeros), activations that differ between
the directions,
and weights that are not constants.

``python -m persistrnn onnx model.onnx`` (:func:`main`) prints what was
converted, what runs where, and, on a GPU, times the model against ONNX
Runtime.
"""

from __future__ import annotations

import contextvars
import os
import statistics
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .errors import ArgumentError, ArgumentTypeError, GPUUnavailableError, InputShapeError, UnsupportedError
from .nn import _TORCH_CELLS, GRU, LSTM, RNN

if TYPE_CHECKING:
    import onnx

__all__ = ["RECURRENT_OPS", "RecurrentNode", "from_onnx", "main", "node_module"]

RECURRENT_OPS = ("LSTM", "GRU", "RNN")

DOMAIN = "persistrnn"
"""The domain the recurrent nodes move to before onnx2torch converts the graph:
onnx2torch then finds our converters for them, and its registry for ONNX's own
operators stays as it was."""

_ONNX_DOMAINS = ("", "ai.onnx")

_TORCH_ROWS = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}
"""For each torch gate block, the ONNX block it comes from (ONNX LSTM i, o, f,
c -> torch i, f, g, o; ONNX GRU z, r, h -> torch r, z, n)."""

_DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh"), "RNN": ("tanh",)}

# output_sequence (opset 1) only says whether Y is an output.
_COMMON_ATTRIBUTES = {"activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size",
                      "layout", "output_sequence"}
_ATTRIBUTES = {"LSTM": _COMMON_ATTRIBUTES | {"input_forget"}, "GRU": _COMMON_ATTRIBUTES | {"linear_before_reset"},
               "RNN": _COMMON_ATTRIBUTES}

_DIRECTIONS = ("forward", "reverse", "bidirectional")

# ONNX's positional inputs: X, W, R, B, sequence_lens, initial_h, initial_c, P.
_RUNTIME_INPUTS = (0, 4, 5, 6)  # what a RecurrentNode's forward takes: X, sequence_lens, initial_h, initial_c
_STATE_INPUTS = {4: "sequence_lens", 5: "initial_h", 6: "initial_c"}


class RecurrentNode(torch.nn.Module):
    """One ONNX LSTM, GRU or RNN node on a single-layer persistrnn module (``self.rnn``).

    ``forward(X, sequence_lens=None, initial_h=None, initial_c=None)`` takes
    the node's run-time inputs with ONNX's shapes and returns its outputs as
    the node lists them: one tensor where the node has one output, else the
    tuple (Y, Y_h[, Y_c]) up to the last output it names. An input the model
    holds as a constant is the default of its argument. ``sequence_lens``
    takes every length in 0..T; steps past a sequence's length output zeros,
    Y_h/Y_c are its last step's state (zeros for a length of 0, as in ONNX
    Runtime), and the reverse direction starts at its last step.

    Runs where the module runs (:mod:`persistrnn.nn`): on CUDA without
    gradients the planner's path (persistent kernels, fallback or cuDNN),
    elsewhere torch's implementation. The parameters are frozen (inference):
    a call runs the kernels without ``torch.no_grad()``.
    """

    def __init__(self, op_type: str, name: str, rnn: torch.nn.Module, *, direction: str, layout: int,
                 num_outputs: int, sequence_lens: torch.Tensor | None = None,
                 initial_h: torch.Tensor | None = None, initial_c: torch.Tensor | None = None) -> None:
        super().__init__()
        self.op_type, self.node_name = op_type, name
        self.rnn = rnn
        self.direction, self.layout, self.num_outputs = direction, layout, num_outputs
        self.register_buffer("default_sequence_lens", sequence_lens)
        self.register_buffer("default_initial_h", initial_h)
        self.register_buffer("default_initial_c", initial_c)

    @property
    def num_directions(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    def extra_repr(self) -> str:
        return f"{self.op_type} node {self.node_name!r}, direction={self.direction}, layout={self.layout}"

    def describe(self) -> str:
        """One line: the node and the module it became."""
        rnn = self.rnn
        form = ""
        if self.op_type == "GRU":
            form = f", linear_before_reset={1 if rnn.reset_after else 0}"
        elif self.op_type == "RNN":
            form = f", {rnn.nonlinearity}"
        return (f"{self.op_type} node {self.node_name!r} (input {rnn.input_size}, hidden {rnn.hidden_size}, "
                f"{self.direction}, layout {self.layout}{form}) -> persistrnn.{type(rnn).__name__}"
                f"(cell {rnn.cell!r}{', bidirectional' if rnn.bidirectional else ''}, {rnn.weight_hh_l0.dtype})")

    def forward(self, X: torch.Tensor, sequence_lens: torch.Tensor | None = None,
                initial_h: torch.Tensor | None = None, initial_c: torch.Tensor | None = None) -> Any:
        where = f"{self.op_type} node {self.node_name!r}"
        layout = "[batch_size, seq_length, input_size] (layout 1)" if self.layout else \
            "[seq_length, batch_size, input_size] (layout 0)"
        if not isinstance(X, torch.Tensor):
            raise ArgumentTypeError(f"{where}: X: expected a torch.Tensor, got {type(X).__name__}")
        if X.dim() != 3:
            raise InputShapeError(f"{where}: X: expected a 3-D tensor {layout}, got shape {tuple(X.shape)}")
        x = X.transpose(0, 1) if self.layout else X  # time-major from here on
        steps, batch = x.shape[0], x.shape[1]
        lengths = self._lengths(self.default_sequence_lens if sequence_lens is None else sequence_lens,
                                steps, batch, where)
        hx = self._initial_states(self.default_initial_h if initial_h is None else initial_h,
                                  self.default_initial_c if initial_c is None else initial_c, x, where)
        if lengths is not None and bool((lengths == 0).any()):
            out, h_n, c_n = self._run_skipping_empty(x, hx, lengths)
        else:
            out, h_n, c_n = self._run(x, hx, lengths)
        y = out.reshape(steps, batch, self.num_directions, self.rnn.hidden_size).permute(0, 2, 1, 3)
        if self.layout:  # Y [B, T, D, H], Y_h and Y_c [B, D, H]
            y, h_n = y.permute(2, 0, 1, 3), h_n.transpose(0, 1)
            c_n = None if c_n is None else c_n.transpose(0, 1)
        outputs = (y, h_n, c_n)[:self.num_outputs]
        return outputs[0] if self.num_outputs == 1 else outputs

    def _run(self, x: torch.Tensor, hx: Any, lengths: torch.Tensor | None) -> tuple[Any, Any, Any]:
        """(out, h_n, c_n) time-major, c_n None but for LSTM; ``lengths`` in 1..T or None."""
        if self.direction == "reverse":
            x = _reverse_steps(x, lengths)
        if lengths is None:
            out, state = self.rnn(x, hx)
        else:
            out, state = self._run_lengths(x, hx, lengths)
        if self.direction == "reverse":
            out = _reverse_steps(out, lengths)
        h_n, c_n = state if isinstance(state, tuple) else (state, None)
        return out, h_n, c_n

    def _run_skipping_empty(self, x: torch.Tensor, hx: Any, lengths: torch.Tensor) -> tuple[Any, Any, Any]:
        """:meth:`_run` on the sequences of length 1 or more; a sequence of
        length 0 gets zeros for Y, Y_h and Y_c, as in ONNX Runtime (not its
        initial states)."""
        steps, batch = x.shape[0], x.shape[1]
        directions, hidden = self.num_directions, self.rnn.hidden_size
        out = x.new_zeros(steps, batch, directions * hidden)
        h_n = x.new_zeros(directions, batch, hidden)
        c_n = x.new_zeros(directions, batch, hidden) if self.op_type == "LSTM" else None
        rows = (lengths > 0).nonzero().squeeze(1)
        if rows.numel():
            on_device = rows.to(x.device)
            part_hx = None if hx is None else (tuple(s.index_select(1, on_device) for s in hx)
                                               if isinstance(hx, tuple) else hx.index_select(1, on_device))
            part = lengths[rows]
            part_out, part_h, part_c = self._run(x.index_select(1, on_device), part_hx,
                                                 None if bool((part == steps).all()) else part)
            out[:, on_device], h_n[:, on_device] = part_out, part_h
            if c_n is not None:
                c_n[:, on_device] = part_c
        return out, h_n, c_n

    def _lengths(self, sequence_lens: Any, steps: int, batch: int, where: str) -> torch.Tensor | None:
        """The lengths as an int64 CPU tensor (what packing takes), None where
        every sequence runs all ``steps``: the unpacked call is the same and faster."""
        if sequence_lens is None:
            return None
        if not isinstance(sequence_lens, torch.Tensor) or sequence_lens.is_floating_point() \
                or sequence_lens.is_complex():
            got = sequence_lens.dtype if isinstance(sequence_lens, torch.Tensor) else type(sequence_lens).__name__
            raise ArgumentTypeError(f"{where}: sequence_lens: expected an integer tensor, got {got}")
        if tuple(sequence_lens.shape) != (batch,):
            raise InputShapeError(f"{where}: sequence_lens: expected shape ({batch},) (batch_size), "
                                  f"got {tuple(sequence_lens.shape)}")
        lengths = sequence_lens.to("cpu", torch.int64)
        if batch and (int(lengths.min()) < 0 or int(lengths.max()) > steps):
            raise ArgumentError(f"{where}: sequence_lens: expected every length in 0..{steps} (seq_length), "
                                f"got {lengths.tolist()}")
        return None if bool((lengths == steps).all()) else lengths

    def _initial_states(self, initial_h: Any, initial_c: Any, x: torch.Tensor, where: str) -> Any:
        """The module's hx, (D, B, H) time-major: None, h0, or (h0, c0) with
        zeros for the one of an LSTM's pair the node leaves out."""
        states = [initial_h, initial_c] if self.op_type == "LSTM" else [initial_h]
        if all(s is None for s in states):
            return None
        shape = (self.num_directions, x.shape[1], self.rnn.hidden_size)
        onnx_shape, axes = ((shape[1], shape[0], shape[2]), "[batch_size, num_directions, hidden_size]") \
            if self.layout else (shape, "[num_directions, batch_size, hidden_size]")
        for i, (name, s) in enumerate(zip(("initial_h", "initial_c"), states)):
            if s is None:
                states[i] = x.new_zeros(shape)
                continue
            if not isinstance(s, torch.Tensor):
                raise ArgumentTypeError(f"{where}: {name}: expected a torch.Tensor, got {type(s).__name__}")
            if tuple(s.shape) != onnx_shape:
                raise InputShapeError(f"{where}: {name}: expected shape {onnx_shape} {axes}, got {tuple(s.shape)}")
            states[i] = s.transpose(0, 1) if self.layout else s
        return tuple(states) if self.op_type == "LSTM" else states[0]

    def _run_lengths(self, x: torch.Tensor, hx: Any, lengths: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The module on a packed sequence (hx and states in the batch's own order, as torch's)."""
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        try:
            out, state = self.rnn(packed, hx)
        except UnsupportedError:
            if self.rnn.cell in _TORCH_CELLS:
                raise
            # A cell torch has no module for (the canonical GRU, a clipped
            # cell) takes a packed sequence only on the persistent kernels
            # (persistrnn.nn); elsewhere each group of equal lengths runs as
            # its own batch, which has the same semantics.
            return self._run_length_groups(x, hx, lengths)
        return pad_packed_sequence(out, total_length=x.shape[0])[0], state

    def _run_length_groups(self, x: torch.Tensor, hx: Any, lengths: torch.Tensor) -> tuple[torch.Tensor, Any]:
        steps, batch = x.shape[0], x.shape[1]
        hidden, directions = self.rnn.hidden_size, self.num_directions
        pairs = self.op_type == "LSTM"
        if hx is None:
            zeros = x.new_zeros(directions, batch, hidden)
            hx = (zeros, zeros) if pairs else zeros
        states = list(hx) if pairs else [hx]
        out = x.new_zeros(steps, batch, directions * hidden)
        finals = [x.new_empty(directions, batch, hidden) for _ in states]
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().squeeze(1).to(x.device)
            part = [s.index_select(1, rows) for s in states]
            part_out, part_state = self.rnn(x[:length].index_select(1, rows), tuple(part) if pairs else part[0])
            out[:length, rows] = part_out
            for final, value in zip(finals, part_state if pairs else (part_state,)):
                final[:, rows] = value
        return out, (tuple(finals) if pairs else finals[0])


def _reverse_steps(seq: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``seq`` (T, B, F) with each sequence's steps 0..length-1 in reverse order
    and its steps past the length left where they are (its own inverse)."""
    if lengths is None:
        return seq.flip(0)
    steps = torch.arange(seq.shape[0])[:, None]
    index = torch.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return seq.gather(0, index.to(seq.device)[:, :, None].expand(-1, -1, seq.shape[2]))


# ---- one node ------------------------------------------------------------------------------------


def _node_name(node: onnx.NodeProto) -> str:
    return node.name or f"producing {[o for o in node.output if o]}"


def _constant_lookup(graph: onnx.GraphProto) -> Callable[[str], np.ndarray | None]:
    """``constant(name)``: the value of an initializer or a ``Constant`` node's
    output, None for anything computed or fed at run time. Values convert on
    request: a large model's other weights are never copied."""
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant" and n.domain in _ONNX_DOMAINS}

    def constant(name: str) -> np.ndarray | None:
        if name in initializers:
            return numpy_helper.to_array(initializers[name])
        node = constants.get(name)
        if node is None or len(node.attribute) != 1:
            return None
        value = helper.get_attribute_value(node.attribute[0])
        if node.attribute[0].name == "value":
            return numpy_helper.to_array(value)
        if node.attribute[0].name in ("value_float", "value_floats", "value_int", "value_ints"):
            return np.asarray(value)
        return None

    return constant


def _attributes(node: onnx.NodeProto, where: str) -> dict[str, Any]:
    from onnx import helper

    allowed = _ATTRIBUTES[node.op_type]
    values = {}
    for attribute in node.attribute:
        if attribute.name not in allowed:
            raise ArgumentError(f"{where}: expected attributes among {sorted(allowed)}, got {attribute.name!r}")
        value = helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        values[attribute.name] = value
    return values


_ALPHA_DEFAULTS = {"hardsigmoid": 0.2, "leakyrelu": 0.01, "elu": 1.0}
_BETA_DEFAULTS = {"hardsigmoid": 0.5}
_USES_ALPHA = ("affine", "leakyrelu", "thresholdedrelu", "scaledtanh", "hardsigmoid", "elu")
_USES_BETA = ("affine", "scaledtanh", "hardsigmoid")
_CELL_ACTIVATIONS = ("sigmoid", "tanh", "relu", "hardsigmoid", "leakyrelu", "affine", "scaledtanh", "softsign", "elu",
                     "softplus", "thresholdedrelu")
"""ONNX's activations a cell computes (persistrnn.cells.with_activations), lower-cased."""


def _activations_of(attributes: dict[str, Any], per_direction: int, directions: int, where: str) -> list[str]:
    """The node's activations as the cells name them (``hardsigmoid(0.2,0.5)``).
    ``activation_alpha``/``activation_beta`` are consumed in order by the
    activations that take them, each list by itself, and a missing value is
    the ONNX operator's default, as ONNX Runtime reads them."""
    names = [a.lower() for a in attributes["activations"]]
    if len(names) != per_direction * directions:
        raise ArgumentError(f"{where}: attribute activations: expected {per_direction * directions} names "
                            f"({per_direction} per direction), got {len(names)}")
    alphas, betas = list(attributes.get("activation_alpha", [])), list(attributes.get("activation_beta", []))
    out = []
    for name in names:
        if name not in _CELL_ACTIVATIONS:
            raise UnsupportedError(f"{where}: attribute activations={attributes['activations']} is not supported: "
                                   f"{name!r} is not among the activations the cells compute "
                                   f"({', '.join(_CELL_ACTIVATIONS)})")
        params = []
        for uses, values, defaults, what in ((_USES_ALPHA, alphas, _ALPHA_DEFAULTS, "activation_alpha"),
                                             (_USES_BETA, betas, _BETA_DEFAULTS, "activation_beta")):
            if name in uses:
                if values:
                    params.append(float(values.pop(0)))
                elif name in defaults:
                    params.append(defaults[name])
                else:
                    raise UnsupportedError(f"{where}: attribute activations: {name} needs its {what} value "
                                           f"(ONNX gives it no default)")
        out.append(name if not params else f"{name}({','.join(repr(p) for p in params)})")
    return out


def _cell_of(node: onnx.NodeProto, attributes: dict[str, Any], directions: int,
             where: str) -> tuple[str, list[str] | None]:
    """The persistrnn cell the node's form selects, and its activations
    where they are not that cell's own (None: its own)."""
    op = node.op_type
    default = _DEFAULT_ACTIVATIONS[op]
    if op == "GRU":
        cell = "gru" if attributes.get("linear_before_reset", 0) else "gru_reset_before"
    else:
        cell = "lstm" if op == "LSTM" else "rnn_tanh"
    if attributes.get("activations") is None:
        return cell, None
    activations = _activations_of(attributes, len(default), directions, where)
    per_direction = {tuple(activations[d * len(default):(d + 1) * len(default)]) for d in range(directions)}
    if len(per_direction) > 1:
        raise UnsupportedError(f"{where}: attribute activations={attributes['activations']} is not supported: "
                               "one module runs both directions, so they must be the same in both")
    (chosen,) = per_direction
    if op == "RNN" and chosen == ("relu",):
        return "rnn_relu", None
    return cell, (None if chosen == default else list(chosen))


def node_module(node: onnx.NodeProto, constant: Callable[[str], np.ndarray | None]) -> RecurrentNode:
    """The :class:`RecurrentNode` of one ONNX LSTM/GRU/RNN node. ``constant(name)``
    gives the value of a constant input (None: fed at run time).

    Raises :class:`UnsupportedError` (naming the node and the attribute or
    input) for what the cells cannot compute, :class:`ArgumentError` for a
    malformed node."""
    op = node.op_type
    if op not in RECURRENT_OPS:
        raise ArgumentError(f"node_module: expected an LSTM, GRU or RNN node, got {op!r}")
    where = f"{op} node {_node_name(node)!r}"
    attributes = _attributes(node, where)
    clip = attributes.get("clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not (np.isfinite(clip) and clip > 0)):
        raise ArgumentError(f"{where}: attribute clip: expected a positive finite float, got {clip!r}")
    direction = attributes.get("direction", "forward")
    if direction not in _DIRECTIONS:
        raise ArgumentError(f"{where}: attribute direction: expected one of {list(_DIRECTIONS)}, got {direction!r}")
    layout = attributes.get("layout", 0)
    if layout not in (0, 1):
        raise ArgumentError(f"{where}: attribute layout: expected 0 or 1, got {layout}")
    linear_before_reset = attributes.get("linear_before_reset", 0)
    if isinstance(linear_before_reset, bool) or not isinstance(linear_before_reset, int):
        raise ArgumentError(f"{where}: attribute linear_before_reset: expected an int, got {linear_before_reset!r}")
    linear_before_reset = int(linear_before_reset != 0)  # ONNX: any nonzero value applies the product first
    directions = 2 if direction == "bidirectional" else 1
    cell, activations = _cell_of(node, attributes, directions, where)

    inputs = list(node.input) + [""] * (8 - len(node.input))
    weights = {}
    for index, name in ((1, "W"), (2, "R"), (3, "B"), (7, "P")):
        if not inputs[index]:
            continue
        value = constant(inputs[index])
        if value is None:
            raise UnsupportedError(f"{where}: input {name} ({inputs[index]!r}) is not supported unless it is a "
                                   "constant (an initializer or a Constant node): the module holds the weights "
                                   "as parameters")
        weights[name] = value
    if "W" not in weights or "R" not in weights:
        raise ArgumentError(f"{where}: expected inputs X, W and R, got {node.input[:3]}")
    gates = len(_TORCH_ROWS[op])
    w, r = weights["W"], weights["R"]
    if r.ndim != 3 or r.shape[0] != directions or r.shape[1] % gates or r.shape[1] != gates * r.shape[2]:
        raise ArgumentError(f"{where}: input R: expected shape [{directions}, {gates} * hidden_size, hidden_size] "
                            f"(direction {direction!r}), got {list(r.shape)}")
    hidden = r.shape[2]
    if attributes.get("hidden_size", hidden) != hidden:
        raise ArgumentError(f"{where}: attribute hidden_size: expected {hidden} (the last dimension of R), "
                            f"got {attributes['hidden_size']}")
    if w.ndim != 3 or w.shape[:2] != (directions, gates * hidden):
        raise ArgumentError(f"{where}: input W: expected shape [{directions}, {gates * hidden}, input_size], "
                            f"got {list(w.shape)}")
    b = weights.get("B")
    if b is None:
        b = np.zeros((directions, 2 * gates * hidden), dtype=w.dtype)
    if b.shape != (directions, 2 * gates * hidden):
        raise ArgumentError(f"{where}: input B: expected shape [{directions}, {2 * gates * hidden}], "
                            f"got {list(b.shape)}")
    p = weights.get("P")
    if p is not None and np.any(p):
        raise UnsupportedError(f"{where}: input P (peepholes) is not supported: the persistrnn LSTM has no "
                               "peephole connections (an all-zero P is accepted)")
    kwargs: dict[str, Any] = dict(num_layers=1, bias=True, bidirectional=directions == 2,
                                  dtype=_torch_dtype(w.dtype, where), clip=clip, activations=activations)
    if op == "LSTM":  # ONNX: any nonzero input_forget couples the gates (f = 1 - i)
        kwargs["input_forget"] = bool(attributes.get("input_forget", 0))
    if op == "GRU":
        rnn = GRU(w.shape[2], hidden, reset_after=cell == "gru", **kwargs)
    elif op == "RNN":
        rnn = RNN(w.shape[2], hidden, nonlinearity=cell.removeprefix("rnn_"), **kwargs)
    else:
        rnn = LSTM(w.shape[2], hidden, **kwargs)
    rows = list(_TORCH_ROWS[op])

    def torch_rows(matrix: np.ndarray) -> torch.Tensor:
        blocks = matrix.reshape(gates, hidden, *matrix.shape[1:])
        return torch.from_numpy(np.ascontiguousarray(blocks[rows].reshape(matrix.shape)))

    with torch.no_grad():
        for d in range(directions):
            suffix = "_l0_reverse" if d else "_l0"
            for name, value in (("weight_ih", w[d]), ("weight_hh", r[d]), ("bias_ih", b[d, :gates * hidden]),
                                ("bias_hh", b[d, gates * hidden:])):
                getattr(rnn, name + suffix).copy_(torch_rows(value))
    rnn = rnn.eval().requires_grad_(False)

    defaults = {}
    for index, name in _STATE_INPUTS.items():
        if index == 6 and op != "LSTM" or not inputs[index]:
            continue
        value = constant(inputs[index])
        if value is not None:
            defaults[name] = torch.from_numpy(np.array(value))
    num_outputs = len(node.output)
    return RecurrentNode(op, _node_name(node), rnn, direction=direction, layout=layout, num_outputs=num_outputs,
                         **defaults)


def _torch_dtype(dtype: np.dtype, where: str) -> torch.dtype:
    torch_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                   np.dtype(np.float64): torch.float64}.get(np.dtype(dtype))
    if torch_dtype is None:
        raise ArgumentTypeError(f"{where}: input W: expected float16, float32 or float64 weights, got {dtype}")
    return torch_dtype


# ---- whole models --------------------------------------------------------------------------------


def _load(path_or_model: Any) -> onnx.ModelProto:
    import onnx

    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    if isinstance(path_or_model, (str, os.PathLike)):
        try:
            return onnx.load(os.fspath(path_or_model))
        except OSError:
            raise
        except Exception as exc:  # protobuf's DecodeError and onnx's own: the file is no ONNX model
            raise ArgumentError(f"from_onnx: expected an ONNX model file, got {os.fspath(path_or_model)!r} "
                                f"({type(exc).__name__}: {exc})") from exc
    raise ArgumentTypeError(f"from_onnx: expected a path or an onnx.ModelProto, got {type(path_or_model).__name__}")


def _is_recurrent(node: onnx.NodeProto) -> bool:
    return node.op_type in RECURRENT_OPS and node.domain in _ONNX_DOMAINS


def from_onnx(path_or_model: Any) -> torch.nn.Module:
    """A torch module computing the ONNX model at ``path_or_model`` (a path or
    an ``onnx.ModelProto``), with every ONNX LSTM, GRU and RNN node on a
    persistrnn module (see the module docstring).

    A model that is one recurrent node returns its :class:`RecurrentNode`,
    called as ``module(X, sequence_lens=None, initial_h=None, initial_c=None)``.
    Any other model returns onnx2torch's ``torch.fx.GraphModule``, called with
    the graph's inputs in order (onnx2torch and torchvision must be installed:
    ``pip install "persistrnn[onnx]"``). The returned module is on the CPU;
    ``.cuda()`` moves it."""
    import onnx

    model = _load(path_or_model)
    graph = model.graph
    constant = _constant_lookup(graph)
    recurrent = [n for n in graph.node if _is_recurrent(n)]
    # Every recurrent node first: what the cells cannot run fails before onnx2torch is needed.
    modules = [node_module(n, constant) for n in recurrent]
    if len(recurrent) == 1 and all(n.op_type == "Constant" for n in graph.node if not _is_recurrent(n)):
        # its outputs up to the last one the node names: ["Y", ""] is Y alone
        modules[0].num_outputs = max((i + 1 for i, name in enumerate(recurrent[0].output) if name), default=1)
        return modules[0]
    onnx2torch = _onnx2torch()
    # Shapes first, while the recurrent nodes are still ONNX's: onnx2torch's
    # converters of later nodes (pooling, normalisation) read them, and shape
    # inference knows nothing of our domain.
    moved = _named_outputs(onnx.shape_inference.infer_shapes(model))
    for node in moved.graph.node:
        if _is_recurrent(node):
            node.domain = DOMAIN
    moved.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    token = _CONVERTED.set({tuple(n.output): module for n, module in
                            zip((n for n in moved.graph.node if n.domain == DOMAIN), modules)})
    try:
        return onnx2torch.convert(moved)
    finally:
        _CONVERTED.reset(token)


def _named_outputs(model: Any) -> Any:
    """``model`` with every empty output name of a node (an output the node
    does not produce, ONNX's idiom: ``["", "Y_h"]``) given a unique name.
    onnx2torch lists node outputs by name, "" included, and would then read a
    missing optional input (also "") as that output."""
    taken = {name for node in model.graph.node for name in [*node.input, *node.output]}
    taken |= {v.name for v in [*model.graph.input, *model.graph.output, *model.graph.initializer]}
    number = 0
    for node in model.graph.node:
        for k, name in enumerate(node.output):
            if not name:
                while f"persistrnn_unused_{number}" in taken:
                    number += 1
                node.output[k] = f"persistrnn_unused_{number}"
                number += 1
    return model


_CONVERTED: contextvars.ContextVar[dict[tuple[str, ...], RecurrentNode] | None] = contextvars.ContextVar(
    "persistrnn_onnx_converted", default=None)
"""The modules :func:`from_onnx` built for the recurrent nodes of the model
onnx2torch is converting, by the nodes' outputs (unique in a graph)."""

_REGISTERING = threading.Lock()


def _onnx2torch() -> Any:
    """onnx2torch, with our converter registered for the recurrent nodes in :data:`DOMAIN`."""
    try:
        import onnx2torch
        from onnx2torch.node_converters.registry import add_converter, get_converter
    except ImportError as exc:
        raise UnsupportedError(
            f"from_onnx: a model with operators beside one recurrent node is converted by onnx2torch, which did "
            f"not import ({exc}). Install it with pip install \"persistrnn[onnx]\"; onnx2torch imports "
            f"torchvision, so a torchvision built for the installed torch ({torch.__version__}) is needed "
            "too") from exc
    with _REGISTERING:
        for op in RECURRENT_OPS:
            try:
                get_converter(op, 1, domain=DOMAIN)
            except NotImplementedError:
                add_converter(op, 1, domain=DOMAIN)(_onnx2torch_converter)
    return onnx2torch


def _onnx2torch_converter(node: Any, graph: Any) -> Any:
    """onnx2torch's converter for a recurrent node: its module, and which values feed its forward."""
    from onnx2torch.utils.common import OnnxMapping, OperationConverterResult

    module = (_CONVERTED.get() or {}).get(tuple(node.output_values))
    if module is None:  # a model with our domain converted by onnx2torch.convert itself
        module = node_module(node.proto, _constant_lookup(graph.proto))
    values = list(node.input_values) + [""] * 8
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(
        inputs=tuple(values[i] for i in _RUNTIME_INPUTS), outputs=node.output_values))


# ---- python -m persistrnn onnx -------------------------------------------------------------------

REPEATS = 20

_PATHS = {"persistent": "persistent kernels", "fallback": "the fallback (one GEMM per step)",
          "cudnn": "cuDNN (measured faster for this shape)"}


def _parser() -> Any:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m persistrnn onnx",
        description="Convert an ONNX model with persistrnn modules for its LSTM/GRU/RNN nodes, print what runs "
                    "where and, on a GPU, time it against ONNX Runtime (CPU, and CUDA where installed)")
    p.add_argument("model", help="path of the .onnx file")
    p.add_argument("--batch", type=int, default=1, help="batch size of the timing inputs (default 1)")
    p.add_argument("--steps", type=int, default=100, help="sequence length of the timing inputs (default 100)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="the size of a named (symbolic) input dimension; repeatable")
    return p


def _recurrent_modules(module: torch.nn.Module) -> list[RecurrentNode]:
    return [m for m in module.modules() if isinstance(m, RecurrentNode)]


def _example_inputs(model: onnx.ModelProto, batch: int, steps: int,
                    dims: dict[str, int]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random inputs for the graph's run-time inputs, by name, and a line
    describing each. A symbolic dimension takes its ``--dim`` size, else
    ``steps`` or ``batch`` where it is the time or batch dimension of a
    recurrent node's X, else 1. sequence_lens inputs are full length, other
    integer inputs zeros."""
    from onnx import helper

    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in initializers}
    named = dict(dims)
    full_lengths = {}  # sequence_lens input -> the steps of its node's X
    for node in filter(_is_recurrent, graph.node):
        layout = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "layout"), 0)
        if len(node.input) > 4 and node.input[4]:
            full_lengths[node.input[4]] = (node.input[0], layout)
        if node.input[0] not in inputs:
            continue
        shape = inputs[node.input[0]].type.tensor_type.shape.dim
        for axis, size in ((1 - layout, batch), (layout, steps)):
            if axis < len(shape) and shape[axis].dim_param:
                named.setdefault(shape[axis].dim_param, size)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, value in inputs.items():
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.dim_value else named.get(d.dim_param, 1) for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        arrays[name] = rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating) else \
            np.zeros(shape, dtype=dtype)
    for name, (x, layout) in full_lengths.items():
        if name in arrays:
            arrays[name][...] = arrays[x].shape[layout] if x in arrays else steps
    lines = [f"{name} {list(a.shape)} {a.dtype.name}" + (" (full lengths)" if name in full_lengths else "")
             for name, a in arrays.items()]
    return arrays, lines


@torch.no_grad()
def _run(module: torch.nn.Module, model: onnx.ModelProto, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The module on the graph's inputs; its results by output name."""
    if isinstance(module, RecurrentNode):
        node = next(filter(_is_recurrent, model.graph.node))
        inputs = list(node.input) + [""] * 8
        result = module(*[tensors.get(inputs[i]) for i in _RUNTIME_INPUTS])
        names = list(node.output)
    else:
        result = module(*[tensors[v.name] for v in model.graph.input if v.name in tensors])
        names = [v.name for v in model.graph.output]
    results = result if isinstance(result, (tuple, list)) and len(names) > 1 else (result,)
    return {name: value for name, value in zip(names, results) if name and isinstance(value, torch.Tensor)}


def main(argv: list[str] | None = None) -> int:
    """``python -m persistrnn onnx model.onnx``: what was converted, what runs
    where and, on a GPU, the time against ONNX Runtime."""
    args = _parser().parse_args(argv)
    dims = {}
    for item in args.dim:
        name, _, size = item.partition("=")
        if not size.isdigit():
            print(f"persistrnn onnx: --dim: expected NAME=SIZE, got {item!r}", file=sys.stderr)
            return 2
        dims[name] = int(size)
    try:
        model = _load(args.model)
        module = from_onnx(model)
    except (OSError, UnsupportedError, ArgumentError, ArgumentTypeError) as exc:
        print(f"persistrnn onnx: {exc}", file=sys.stderr)
        return 2
    nodes = _recurrent_modules(module)
    others = Counter(n.op_type for n in model.graph.node if not _is_recurrent(n) and n.op_type != "Constant")
    print(f"{args.model}: {len(nodes)} recurrent node(s) on persistrnn modules")
    for node in nodes:
        print("  " + node.describe())
    if others:
        print("other operators, on onnx2torch's torch modules: "
              + ", ".join(f"{op} x{count}" for op, count in sorted(others.items())))
    arrays, lines = _example_inputs(model, args.batch, args.steps, dims)
    print("inputs: " + "; ".join(lines))
    from . import runtime

    try:
        facts = runtime.device_facts()
    except GPUUnavailableError as exc:
        print(f"On this machine the persistrnn modules run torch's CPU implementation; timing needs a GPU. {exc}")
        return 0
    return _time_on_gpu(module, model, arrays, facts, bool(others))


def _time_on_gpu(module: torch.nn.Module, model: onnx.ModelProto, arrays: dict[str, np.ndarray], facts: Any,
                 has_others: bool) -> int:
    import logging

    log = logging.getLogger("persistrnn")
    handler = logging.StreamHandler(sys.stderr)  # planning a new shape takes seconds: say so
    handler.setFormatter(logging.Formatter("  [persistrnn] %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return _report_times(module.cuda().eval(), model, arrays, facts, has_others)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _report_times(module: torch.nn.Module, model: onnx.ModelProto, arrays: dict[str, np.ndarray], facts: Any,
                  has_others: bool) -> int:
    from . import runtime

    batches = {}

    def record_batch(node: RecurrentNode, args: tuple) -> None:  # a pre-hook's return value would replace args
        batches.setdefault(node, args[0].shape[0 if node.layout else 1])

    hooks = [node.register_forward_pre_hook(record_batch) for node in _recurrent_modules(module)]
    tensors = {name: torch.from_numpy(a).cuda() for name, a in arrays.items()}
    ours = _run(module, model, tensors)  # the first call plans each node's shape
    for hook in hooks:
        hook.remove()
    print(f"\n{facts.name}, {facts.sm_count} SMs; torch {torch.__version__}\nwhat runs where:")
    for node, batch in batches.items():
        print(f"  {node.op_type} node {node.node_name!r} at batch {batch}: {_PATHS[node.rnn.plan_for(batch).path]}")
    if has_others:
        print("  the other operators: torch, on onnx2torch's modules")

    def call() -> None:
        _run(module, model, tensors)

    # The time a running process sees: its captured calls replay from C++ once
    # the native replay is built (in the background, seconds after the first
    # call of a fresh machine); until then from Python, ~0.1 ms more per call
    # (H100, LSTM 256 at batch 1: 0.232 against 0.110 ms, docs/results/onnx-h100.md).
    native = runtime.native.available(wait=True)
    runtime.warm_up(call)
    device_ms = runtime.time_cuda_ms(call, warmup=3, repeats=REPEATS)
    wall = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        results = _run(module, model, {name: torch.from_numpy(a).cuda() for name, a in arrays.items()})
        for result in results.values():
            result.cpu()
        wall.append((time.perf_counter() - started) * 1e3)
    host_ms = statistics.median(wall)
    print(f"\npersistrnn: {device_ms:.3f} ms with the inputs on the GPU (CUDA events), {host_ms:.3f} ms from host "
          f"arrays to host results (median of {REPEATS}); native replay {'on' if native else 'off'}")
    try:
        import onnxruntime
    except ImportError:
        print("ONNX Runtime is not installed (pip install onnxruntime, or onnxruntime-gpu for its CUDA provider)")
        return 0
    available = onnxruntime.get_available_providers()
    for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"):
        if provider not in available:
            print(f"ONNX Runtime {provider}: not in this onnxruntime build")
            continue
        try:
            ms, outputs, used = _ort_ms(model, arrays, provider)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a line of the report
            print(f"ONNX Runtime {provider}: failed ({type(exc).__name__}: {str(exc).strip()})")
            continue
        differences = [_relative_difference(ours[name], outputs[name]) for name in outputs if name in ours
                       and tuple(ours[name].shape) == outputs[name].shape]
        print(f"ONNX Runtime {provider}" + ("" if provider in used else f" (not loaded; ran on {used})")
              + f": {ms:.3f} ms from host arrays to host results (median of {REPEATS}), {ms / host_ms:.2f}x "
              "persistrnn's time"
              + (f"; outputs differ by at most {max(differences):.2e} of the largest" if differences else ""))
    return 0


def _ort_ms(model: onnx.ModelProto, arrays: dict[str, np.ndarray], provider: str) -> tuple[float, dict, list]:
    """Median wall ms of ONNX Runtime's ``run`` on host arrays, its outputs by
    name, and the providers the session loaded (a CUDA provider whose
    libraries do not load leaves the CPU's)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=[provider])
    names = [o.name for o in session.get_outputs()]
    for _ in range(3):
        outputs = session.run(names, arrays)
    wall = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        session.run(names, arrays)
        wall.append((time.perf_counter() - started) * 1e3)
    return statistics.median(wall), dict(zip(names, outputs)), session.get_providers()


def _relative_difference(ours: torch.Tensor, theirs: np.ndarray) -> float:
    """max |ours - theirs| over max |theirs|, in float64."""
    theirs = np.asarray(theirs, dtype=np.float64)
    return float(np.max(np.abs(ours.double().cpu().numpy() - theirs), initial=0.0)
                 / max(float(np.max(np.abs(theirs), initial=0.0)), 1e-30))
