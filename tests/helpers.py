"""Shared by the GPU tests of every recurrence path (persistent, fallback):
random layers, rounding to the layer's dtype, the float64 reference, and the
error measure with its per-dtype tolerance."""

import math

import numpy as np

from persistrnn import cells, reference

FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 2e-2  # bf16 and fp16 weights, states and outputs


def tolerance(dtype: str) -> float:
    return FP32_TOLERANCE if dtype == "float32" else HALF_TOLERANCE


def random_layer(cell, input_size, hidden, batch, steps, rng):
    spec = cells.get_cell(cell)
    bound = 1.0 / math.sqrt(hidden)
    g = spec.num_gates * hidden
    p = {
        "w_ih": rng.uniform(-bound, bound, (g, input_size)),
        "w_hh": rng.uniform(-bound, bound, (g, hidden)),
        "b_ih": rng.uniform(-bound, bound, g),
        "b_hh": rng.uniform(-bound, bound, g),
    }
    x = rng.standard_normal((steps, batch, input_size))
    h0 = rng.standard_normal((1, batch, hidden)) * 0.5
    c0 = rng.standard_normal((1, batch, hidden)) * 0.5
    return p, x, h0, c0


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rounded_layer(cell, dtype, input_size, hidden, batch, steps, rng, device="cuda"):
    """:func:`random_layer` drawn in float64 and rounded to ``dtype`` on
    ``device``: (params dict, x (T, B, I), h0 (B, H), c0 (B, H)) as torch tensors."""
    import torch

    p, x, h0, c0 = random_layer(cell, input_size, hidden, batch, steps, rng)
    dt = getattr(torch, dtype)
    params = {k: torch.tensor(v, dtype=dt, device=device) for k, v in p.items()}
    return (params, *(torch.tensor(v, dtype=dt, device=device) for v in (x, h0[0], c0[0])))


def reference_forward(cell, params, x, h0, c0):
    """The float64 reference on the (rounded) torch tensors, so that an error
    is the kernel's own, not the rounding of its inputs: numpy (out, h_n, c_n
    or None)."""
    spec = cells.get_cell(cell)

    def f64(t):
        return t.double().cpu().numpy()

    p = {k: f64(v) for k, v in params.items()}
    hx = (f64(h0)[None], f64(c0)[None]) if spec.has_cell_state else f64(h0)[None]
    out, state = reference.rnn_forward(cell, f64(x), [[p]], hx=hx)
    if spec.has_cell_state:
        return out, state[0][0], state[1][0]
    return out, state[0], None


def linear_cell(**changes):
    """A one-gate cell outside the registry (h_new = x_a + h_a unless changed):
    tests of code that must follow a spec's statements, not a known cell."""
    fields = dict(
        name="linear",
        gates=("a",),
        has_cell_state=False,
        stages=(("a",),),
        stage_operands=("h",),
        between_stages=(),
        pointwise=(("h_new", "x_a + h_a"),),
    )
    fields.update(changes)
    return cells.CellSpec(**fields)
