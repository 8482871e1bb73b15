"""float64 numpy reference forward pass for every cell and option.

Follows torch.nn.LSTM / GRU / RNN in inference (no dropout): shapes, parameter
names and layout, multi-layer and bidirectional stacking, initial states,
LSTM projections and packed-sequence semantics for per-sequence lengths. The
cell math comes only from the cell's :class:`~persistrnn.cells.CellSpec`
statements, so the reference checks the same formulas the kernels render.

Parameters are ``params[layer][direction]``, a mapping with torch's shapes:
``w_ih`` (G*H, in), ``w_hh`` (G*H, H_out), optional ``b_ih`` and ``b_hh``
(G*H,) (both or neither) and, with ``proj_size > 0``, ``w_hr`` (proj_size, H);
G = num_gates, H = hidden size, H_out = proj_size or H, direction 1 reverse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from persistrnn.cells import CELLS, CellSpec, get_cell
from .errors import ArgumentError, ArgumentTypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Params",
    "cell_from_torch",
    "load_params_into_torch",
    "param_shapes",
    "params_from_torch",
    "rnn_forward",
]

Params = Sequence[Sequence[Mapping[str, np.ndarray]]]
"""``params[layer][direction][name]``; see the module docstring."""

_TORCH_NAMES = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh", "w_hr": "weight_hr"}
_TORCH_MODES = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def param_shapes(
    cell: str | CellSpec,
    input_size: int,
    hidden_size: int,
    *,
    num_layers: int = 1,
    bidirectional: bool = False,
    bias: bool = True,
    proj_size: int = 0,
) -> list[list[dict[str, tuple[int, ...]]]]:
    """Expected shape of every parameter, as ``shapes[layer][direction][name]``."""
    spec = get_cell(cell)
    rows = spec.num_gates * hidden_size
    out_size = proj_size or hidden_size
    num_dirs = 2 if bidirectional else 1
    shapes = []
    for layer in range(num_layers):
        layer_input = input_size if layer == 0 else num_dirs * out_size
        entry: dict[str, tuple[int, ...]] = {"w_ih": (rows, layer_input), "w_hh": (rows, out_size)}
        if bias:
            entry |= {"b_ih": (rows,), "b_hh": (rows,)}
        if proj_size:
            entry["w_hr"] = (proj_size, hidden_size)
        shapes.append([dict(entry) for _ in range(num_dirs)])
    return shapes


def rnn_forward(
    cell: str | CellSpec,
    x: np.ndarray,
    params: Params,
    *,
    num_layers: int = 1,
    bidirectional: bool = False,
    batch_first: bool = False,
    hx: np.ndarray | tuple[np.ndarray, np.ndarray] | None = None,
    lengths: Sequence[int] | np.ndarray | None = None,
    proj_size: int = 0,
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Run a multi-layer RNN in float64, as torch does in inference.

    Args:
        cell: registry name or CellSpec.
        x: (seq_len, batch, input_size), or (batch, seq_len, input_size) with
            ``batch_first``.
        params: ``params[layer][direction]``; see the module docstring.
        hx: initial state, zeros if None: ``h0`` of shape
            (num_layers * num_directions, batch, H_out), or ``(h0, c0)`` with
            ``c0`` (num_layers * num_directions, batch, H) for cells with a
            cell state.
        lengths: per-sequence lengths in [1, seq_len], any order. As with a
            packed sequence, steps past a sequence's length are skipped
            (output zero), the reverse direction starts at its last valid
            step, and final states are those after that step.
        proj_size: LSTM projection size; 0 for none.

    Returns:
        ``(output, h_n)``, or ``(output, (h_n, c_n))`` with a cell state.
        ``output`` has x's layout with feature size num_directions * H_out;
        ``h_n`` is (num_layers * num_directions, batch, H_out), ``c_n`` the
        same with H. All float64.
    """
    spec = get_cell(cell)
    _check_int("num_layers", num_layers, minimum=1)
    _check_int("proj_size", proj_size, minimum=0)
    _check_bool("bidirectional", bidirectional)
    _check_bool("batch_first", batch_first)
    num_dirs = 2 if bidirectional else 1

    x = _as_float64("x", x)
    layout = "(batch, seq_len, input_size)" if batch_first else "(seq_len, batch, input_size)"
    if x.ndim != 3:
        raise ArgumentError(f"x: expected a 3-D array {layout}, got shape {x.shape}")
    if batch_first:
        x = x.transpose(1, 0, 2)
    seq_len, batch, input_size = x.shape
    if seq_len == 0 or batch == 0:
        raise ArgumentError(f"x: expected non-empty seq_len and batch {layout}, got shape {x.shape}")

    layers = _check_params(spec, params, input_size, num_layers, num_dirs, proj_size)
    hidden = layers[0][0]["w_hh"].shape[0] // spec.num_gates
    out_size = proj_size or hidden
    valid = _valid_steps(lengths, seq_len, batch)
    h0, c0 = _initial_states(spec, hx, num_layers * num_dirs, batch, hidden, out_size)

    layer_input = x
    h_n, c_n = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(num_dirs):
            index = layer * num_dirs + direction
            out, h, c = _run_direction(
                spec,
                layer_input,
                layers[layer][direction],
                h0[index],
                None if c0 is None else c0[index],
                valid,
                reverse=direction == 1,
            )
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        layer_input = np.concatenate(outputs, axis=2)

    output = layer_input.transpose(1, 0, 2) if batch_first else layer_input
    if spec.has_cell_state:
        return output, (np.stack(h_n), np.stack(c_n))
    return output, np.stack(h_n)


def _run_direction(
    spec: CellSpec,
    x: np.ndarray,
    p: Mapping[str, np.ndarray],
    h0: np.ndarray,
    c0: np.ndarray | None,
    valid: np.ndarray,
    *,
    reverse: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One layer, one direction over (seq_len, batch, in); returns (output, h_last, c_last)."""
    seq_len, batch, _ = x.shape
    x_proj = x @ p["w_ih"].T
    if "b_ih" in p:
        x_proj = x_proj + p["b_ih"]
    h = h0.copy()
    c = None if c0 is None else c0.copy()
    output = np.zeros((seq_len, batch, h0.shape[1]))
    for t in reversed(range(seq_len)) if reverse else range(seq_len):
        # Only sequences still running take this step; the others keep their
        # state, so each ends with the state after its own last step, and the
        # reverse direction of each starts at its own last valid step.
        rows = np.flatnonzero(valid[t])
        if rows.size == 0:
            continue
        h_new, c_new = spec.step_reference(
            x_proj[t, rows], h[rows], None if c is None else c[rows], p["w_hh"], p.get("b_hh")
        )
        if "w_hr" in p:
            h_new = h_new @ p["w_hr"].T
        h[rows] = h_new
        if c is not None:
            c[rows] = c_new
        output[t, rows] = h_new
    return output, h, c


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ArgumentError(f"{name}: expected an int >= {minimum}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _as_float64(name: str, value: object) -> np.ndarray:
    """``value`` as a float64 array; only real numbers are accepted."""
    array = np.asarray(value)
    if array.dtype.kind not in "iuf":
        raise ArgumentTypeError(f"{name}: expected a real-valued numeric array, got dtype {array.dtype}")
    return array.astype(np.float64)


def _check_params(
    spec: CellSpec, params: Params, input_size: int, num_layers: int, num_dirs: int, proj_size: int
) -> list[list[dict[str, np.ndarray]]]:
    """Validate ``params`` against the options; return it as float64 arrays."""
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise ArgumentTypeError(f"params: expected a sequence of layers, got {type(params).__name__}")
    if len(params) != num_layers:
        raise ArgumentError(f"params: expected {num_layers} layers (num_layers), got {len(params)}")
    for layer, entries in enumerate(params):
        if not isinstance(entries, Sequence) or isinstance(entries, str):
            raise ArgumentTypeError(f"params[{layer}]: expected a sequence of directions, got {type(entries).__name__}")
        if len(entries) != num_dirs:
            raise ArgumentError(f"params[{layer}]: expected {num_dirs} directions, got {len(entries)}")
        for direction, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise ArgumentTypeError(
                    f"params[{layer}][{direction}]: expected a mapping of weights, got {type(entry).__name__}"
                )

    if proj_size and not spec.supports_projection:
        raise ArgumentError(f"proj_size: expected 0 for cell {spec.name!r}, which has no projection, got {proj_size}")
    first = params[0][0]
    # torch has one bias flag for all layers; the first entry sets it.
    bias = "b_ih" in first or "b_hh" in first
    w_hh = _as_float64("params[0][0]['w_hh']", first["w_hh"]) if "w_hh" in first else None
    if w_hh is None or w_hh.ndim != 2 or w_hh.shape[0] == 0 or w_hh.shape[0] % spec.num_gates:
        got = "no 'w_hh'" if w_hh is None else f"shape {w_hh.shape}"
        raise ArgumentError(
            f"params[0][0]['w_hh']: expected shape ({spec.num_gates} * hidden_size, H_out) "
            f"for cell {spec.name!r}, got {got}"
        )
    hidden = w_hh.shape[0] // spec.num_gates
    if proj_size >= hidden:
        raise ArgumentError(f"proj_size: expected a value smaller than hidden_size {hidden}, got {proj_size}")
    w_ih = first.get("w_ih")
    if w_ih is not None and np.ndim(w_ih) == 2 and np.shape(w_ih)[1] != input_size:
        raise ArgumentError(
            f"x: expected input_size {np.shape(w_ih)[1]} (columns of params[0][0]['w_ih']), got {input_size}"
        )

    expected = param_shapes(
        spec,
        input_size,
        hidden,
        num_layers=num_layers,
        bidirectional=num_dirs == 2,
        bias=bias,
        proj_size=proj_size,
    )
    checked = []
    for layer, entries in enumerate(params):
        checked_layer = []
        for direction, entry in enumerate(entries):
            where = f"params[{layer}][{direction}]"
            shapes = expected[layer][direction]
            if set(entry) != set(shapes):
                raise ArgumentError(f"{where}: expected keys {sorted(shapes)}, got {sorted(entry)}")
            arrays = {}
            for key, shape in shapes.items():
                arrays[key] = _as_float64(f"{where}[{key!r}]", entry[key])
                if arrays[key].shape != shape:
                    raise ArgumentError(f"{where}[{key!r}]: expected shape {shape}, got {arrays[key].shape}")
            checked_layer.append(arrays)
        checked.append(checked_layer)
    return checked


def _valid_steps(lengths: Sequence[int] | np.ndarray | None, seq_len: int, batch: int) -> np.ndarray:
    """Mask (seq_len, batch): whether step t is within sequence b."""
    if lengths is None:
        return np.ones((seq_len, batch), dtype=bool)
    array = np.asarray(lengths)
    if array.dtype.kind not in "iu":
        raise ArgumentTypeError(f"lengths: expected integers, got dtype {array.dtype}")
    if array.shape != (batch,):
        raise ArgumentError(f"lengths: expected shape ({batch},), one per sequence, got shape {array.shape}")
    if np.any(array < 1) or np.any(array > seq_len):
        raise ArgumentError(f"lengths: expected values in [1, {seq_len}], got {array.tolist()}")
    return np.arange(seq_len)[:, None] < array[None, :]


def _initial_states(
    spec: CellSpec, hx: Any, num_states: int, batch: int, hidden: int, out_size: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validated (h0, c0) as float64, zeros where not given; c0 None without a cell state."""
    h_shape = (num_states, batch, out_size)
    c_shape = (num_states, batch, hidden)
    if hx is None:
        return np.zeros(h_shape), (np.zeros(c_shape) if spec.has_cell_state else None)
    if spec.has_cell_state:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise ArgumentTypeError(f"hx: expected a (h0, c0) pair for cell {spec.name!r}, got {type(hx).__name__}")
        h0, c0 = _as_float64("h0", hx[0]), _as_float64("c0", hx[1])
    else:
        if isinstance(hx, (tuple, list)):
            raise ArgumentTypeError(f"hx: expected a single array h0 for cell {spec.name!r}, got {type(hx).__name__}")
        h0, c0 = _as_float64("h0", hx), None
    layout = "(num_layers * num_directions, batch, H_out)"
    if h0.shape != h_shape:
        raise ArgumentError(f"h0: expected shape {h_shape} {layout}, got {h0.shape}")
    if c0 is not None and c0.shape != c_shape:
        raise ArgumentError(f"c0: expected shape {c_shape} (num_layers * num_directions, batch, hidden), "
                            f"got {c0.shape}")
    return h0, c0


def _check_torch_module(module: object) -> None:
    import torch

    if not isinstance(module, torch.nn.RNNBase):
        raise ArgumentTypeError(f"module: expected a torch.nn.LSTM, GRU or RNN, got {type(module).__name__}")


def _torch_name(key: str, layer: int, direction: int) -> str:
    return f"{_TORCH_NAMES[key]}_l{layer}{'_reverse' if direction else ''}"


def cell_from_torch(module: torch.nn.RNNBase) -> CellSpec:
    """The spec a torch LSTM / GRU / RNN module computes."""
    _check_torch_module(module)
    return CELLS[_TORCH_MODES[module.mode]]


def params_from_torch(module: torch.nn.RNNBase) -> list[list[dict[str, np.ndarray]]]:
    """Copy a torch LSTM / GRU / RNN's parameters as float64 ``params[layer][direction]``."""
    _check_torch_module(module)
    keys = ["w_ih", "w_hh"] + (["b_ih", "b_hh"] if module.bias else []) + (["w_hr"] if module.proj_size else [])
    num_dirs = 2 if module.bidirectional else 1
    return [
        [
            {
                key: np.array(getattr(module, _torch_name(key, layer, d)).detach().cpu().numpy(), dtype=np.float64)
                for key in keys
            }
            for d in range(num_dirs)
        ]
        for layer in range(module.num_layers)
    ]


def load_params_into_torch(module: torch.nn.RNNBase, params: Params) -> None:
    """Copy ``params[layer][direction]`` into a torch module (inverse of params_from_torch)."""
    import torch

    expected = params_from_torch(module)  # also checks the module type
    if len(params) != len(expected) or any(len(a) != len(b) for a, b in zip(params, expected)):
        raise ArgumentError(
            f"params: expected {len(expected)} layers of {len(expected[0])} directions, "
            f"got {[len(entries) for entries in params]}"
        )
    with torch.no_grad():
        for layer, entries in enumerate(params):
            for direction, entry in enumerate(entries):
                where = f"params[{layer}][{direction}]"
                shapes = {key: value.shape for key, value in expected[layer][direction].items()}
                if set(entry) != set(shapes):
                    raise ArgumentError(f"{where}: expected keys {sorted(shapes)}, got {sorted(entry)}")
                for key, shape in shapes.items():
                    value = _as_float64(f"{where}[{key!r}]", entry[key])
                    if value.shape != shape:
                        raise ArgumentError(f"{where}[{key!r}]: expected shape {shape}, got {value.shape}")
                    getattr(module, _torch_name(key, layer, direction)).copy_(torch.from_numpy(value))
