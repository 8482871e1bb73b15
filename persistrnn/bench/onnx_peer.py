"""ONNX Runtime on the CPU as a benchmark peer.

The model is written with ONNX's own recurrent operators (``LSTM``, ``GRU``,
``RNN``), one node per layer, from the module's parameters: no exporter sits
between torch and the graph, and ONNX's GRU has both forms
(``linear_before_reset=1`` is torch's reset-after GRU, ``0`` the canonical
reset-before one), so the canonical GRU gets a peer too.

ONNX orders the gates differently from torch: LSTM ``i, o, f, c`` against
torch's ``i, f, g, o``; GRU ``z, r, h`` against torch's ``r, z, n``. Each
operator takes ``[num_directions, gates * H, in]`` weights and one bias row
of the input biases followed by the recurrent ones. Its ``Y`` output is
``[T, num_directions, B, H]``, so a layer's output is transposed to
``[T, B, num_directions * H]`` for the next layer.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..reference import Params

# Opset 17 and IR version 8 (their pairing in ONNX's version table): a newer onnx
# package writes a newer IR by default, which an older ONNX Runtime refuses.
OPSET = 17
IR_VERSION = 8

# torch's gate blocks, in the order ONNX wants them.
_GATE_ORDER = {
    "lstm": (0, 3, 1, 2),  # torch i f g o -> ONNX i o f c
    "gru": (1, 0, 2),  # torch r z n -> ONNX z r h
    "gru_reset_before": (1, 0, 2),
    "rnn_tanh": (0,),
    "rnn_relu": (0,),
}
_OPERATOR = {"lstm": "LSTM", "gru": "GRU", "gru_reset_before": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


def _reorder(w: np.ndarray, cell: str) -> np.ndarray:
    blocks = np.split(w, len(_GATE_ORDER[cell]), axis=0)
    return np.concatenate([blocks[k] for k in _GATE_ORDER[cell]], axis=0)


def _recurrent_node(cell: str, entries: Any, hidden_size: int, layer_input: str, prefix: str,
                    outputs: list[str]) -> tuple[Any, list[Any]]:
    """One layer as ONNX's recurrent operator: (the node, its W, R and B initializers)."""
    from onnx import helper, numpy_helper

    gates = len(_GATE_ORDER[cell])
    directions = len(entries)

    def stacked(key: str) -> np.ndarray:
        return np.stack([_reorder(e[key], cell) for e in entries])

    def bias(key: str) -> np.ndarray:
        return np.stack([_reorder(e[key], cell) if key in e else np.zeros(gates * hidden_size) for e in entries])

    w, r = stacked("w_ih"), stacked("w_hh")
    b = np.concatenate([bias("b_ih"), bias("b_hh")], axis=1)
    initializers = [numpy_helper.from_array(value.astype(np.float32), f"{prefix}_{key}")
                    for key, value in (("W", w), ("R", r), ("B", b))]
    attributes: dict[str, Any] = {"hidden_size": hidden_size,
                                  "direction": "bidirectional" if directions == 2 else "forward"}
    if cell.startswith("gru"):
        attributes["linear_before_reset"] = int(cell == "gru")
    if cell.startswith("rnn"):
        attributes["activations"] = ["Tanh" if cell == "rnn_tanh" else "Relu"] * directions
    node = helper.make_node(_OPERATOR[cell], [layer_input, f"{prefix}_W", f"{prefix}_R", f"{prefix}_B"], outputs,
                            name=f"{prefix}_{_OPERATOR[cell]}", **attributes)
    return node, initializers


def _check_cell(cell: str, params: Params) -> None:
    if cell not in _OPERATOR:
        raise ValueError(f"cell: expected one of {sorted(_OPERATOR)}, got {cell!r}")
    if any("w_hr" in entry for entries in params for entry in entries):
        raise ValueError("ONNX's LSTM has no projection (proj_size > 0)")


def build_node_model(cell: str, params: Params, input_size: int, hidden_size: int) -> bytes:
    """A serialised ONNX model of one layer as one recurrent node and nothing
    else: ``X [T, B, input_size]`` float32 to the node's own ``Y [T, D, B, H]``
    and ``Y_h [D, B, H]``, as an exported model holds it."""
    from onnx import TensorProto, helper

    _check_cell(cell, params)
    if len(params) != 1:
        raise ValueError(f"build_node_model: expected one layer, got {len(params)}")
    directions = len(params[0])
    node, initializers = _recurrent_node(cell, params[0], hidden_size, "X", "l0", ["Y", "Y_h"])
    graph = helper.make_graph(
        [node], f"persistrnn_{cell}_node",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", input_size])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", directions, "B", hidden_size]),
         helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [directions, "B", hidden_size])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                             ir_version=IR_VERSION).SerializeToString()


def build_model(cell: str, params: Params, input_size: int, hidden_size: int) -> bytes:
    """A serialised ONNX model: ``x [T, B, input_size]`` float32 to ``y [T, B, D * H]``.

    ``params[layer][direction]`` holds torch's shapes (see :mod:`persistrnn.reference`);
    biases are optional (zero when absent); projections are not supported.
    """
    from onnx import TensorProto, helper, numpy_helper

    _check_cell(cell, params)
    nodes, initializers = [], []
    layer_input = "x"
    for layer, entries in enumerate(params):
        directions = len(entries)
        names = {k: f"l{layer}_{k}" for k in ("Y", "Yt", "y")}
        node, weights = _recurrent_node(cell, entries, hidden_size, layer_input, f"l{layer}", [names["Y"]])
        nodes.append(node)
        initializers += weights
        # Y [T, D, B, H] -> [T, B, D, H] -> [T, B, D * H]
        nodes.append(helper.make_node("Transpose", [names["Y"]], [names["Yt"]], perm=[0, 2, 1, 3]))
        shape_name = f"l{layer}_shape"
        initializers.append(numpy_helper.from_array(np.array([0, 0, directions * hidden_size], np.int64), shape_name))
        out = "y" if layer == len(params) - 1 else names["y"]
        nodes.append(helper.make_node("Reshape", [names["Yt"], shape_name], [out]))
        layer_input = out
    graph = helper.make_graph(
        nodes, f"persistrnn_{cell}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", input_size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", "B", len(params[0]) * hidden_size])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                             ir_version=IR_VERSION).SerializeToString()


def session(cell: str, params: Params, input_size: int, hidden_size: int, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session of :func:`build_model` using ``threads`` cores (default: all)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    return ort.InferenceSession(build_model(cell, params, input_size, hidden_size), options,
                                providers=["CPUExecutionProvider"])


def run(sess: Any, x: np.ndarray) -> np.ndarray:
    """``y`` for a float32 ``x [T, B, input_size]``."""
    return sess.run(["y"], {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]
