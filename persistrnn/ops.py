"""A whole recurrent model's forward, as a function of tensors and as a torch
operator.

:func:`run_plan` runs a model, from torch's flat weight list, on a
:class:`~persistrnn.plan.Plan`: the persistent kernels, the fallback, or
cuDNN through torch's own RNN function. The modules of
:mod:`persistrnn.nn` call it, eagerly and inside their captured graphs.

``torch.ops.persistrnn.forward`` wraps the same call as a custom operator with
a fake (shape-only) implementation, so that ``torch.compile`` traces a
persistrnn module into one graph instead of breaking at our Python: the
operator's arguments are plain tensors, torch's flat weight list and the
model's sizes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import fallback, persistent
from .cells import get_cell

def layer_params(weights: list[torch.Tensor], num_layers: int, directions: int,
                 has_biases: bool) -> list[list[dict[str, torch.Tensor]]]:
    """torch's flat weight list (per layer and direction: W_ih, W_hh, then
    b_ih, b_hh when the model has biases) as ``layers[l][d]`` dicts. The
    kernels always add a bias, so a model without one gets zeros."""
    per = 4 if has_biases else 2
    if len(weights) != num_layers * directions * per:
        raise ValueError(f"expected {num_layers * directions * per} weights for {num_layers} layer(s), "
                         f"{directions} direction(s), biases {has_biases}; got {len(weights)}")
    layers = []
    for l in range(num_layers):
        directions_of_layer = []
        for d in range(directions):
            w = weights[(l * directions + d) * per:(l * directions + d + 1) * per]
            p = {"w_ih": w[0], "w_hh": w[1]}
            if has_biases:
                p["b_ih"], p["b_hh"] = w[2], w[3]
            else:
                p["b_ih"] = p["b_hh"] = w[0].new_zeros(w[0].shape[0])
            directions_of_layer.append(p)
        layers.append(directions_of_layer)
    return layers


def run_plan(chosen: Any, cell: str, weights: list[torch.Tensor], x: torch.Tensor, h0: torch.Tensor,
             c0: torch.Tensor | None, *, num_layers: int, bidirectional: bool, has_biases: bool, check: bool,
             lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(output (T, B, D*H), h_n, c_n or None (L*D, B, H)) of the model on the
    plan's path: the persistent kernels, the fallback, or torch's own RNN
    function (cuDNN), from torch's flat weight list, time-major, inference.
    ``check`` reads the kernels' status word afterwards (it synchronises).
    ``lengths`` (int32 on the GPU, one per sequence) runs variable lengths, on
    the persistent path only."""
    if lengths is not None and chosen.path != "persistent":
        raise ValueError(f"variable lengths run on the persistent path, got a {chosen.path!r} plan")
    if chosen.path == "cudnn":
        hx = (h0, c0) if c0 is not None else h0
        # torch's function for each cell the planner times cuDNN for has the cell's name
        result = getattr(torch._VF, cell)(x, hx, weights, has_biases, num_layers, 0.0, False, bidirectional, False)
        return result[0], result[1], (result[2] if c0 is not None else None)
    layers = layer_params(weights, num_layers, 2 if bidirectional else 1, has_biases)
    if chosen.path == "persistent":
        return persistent.forward_model(chosen.config, layers, x.contiguous(), h0, c0, lengths=lengths, check=check)
    if chosen.path == "fallback":
        return fallback.forward_model(cell, layers, x.contiguous(), h0, c0)
    raise ValueError(f"run_plan: expected a persistent, fallback or cudnn plan, got {chosen.path!r}")


_PLANS: dict[tuple, Any] = {}


def _plan(cell: str, x: torch.Tensor, hidden: int, num_layers: int, bidirectional: bool) -> Any:
    """The plan for this model and batch on the current GPU, kept in memory
    after its first lookup (tuned then, untuned inside a CUDA-graph capture)."""
    from . import plan as planner

    batch = x.shape[1]
    key = (torch.cuda.current_device(), cell, x.shape[2], hidden, num_layers, bidirectional, x.dtype,
           planner.space.batch_bucket(batch))
    if key not in _PLANS:
        shape = planner.ModelShape(cell, x.shape[2], hidden, num_layers, str(x.dtype).removeprefix("torch."),
                                   bidirectional)
        _PLANS[key] = planner.plan(shape, batch, tune=not torch.cuda.is_current_stream_capturing())
    return _PLANS[key]


@torch.library.custom_op("persistrnn::forward", mutates_args=())
def forward(x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], weights: list[torch.Tensor], cell: str,
            num_layers: int, bidirectional: bool, has_biases: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A model's forward on CUDA: ``x`` (T, B, I) time-major, ``h0`` and
    ``c0`` (L*D, B, H) (``c0`` None for cells without a cell state), torch's
    flat weight list. Returns (output (T, B, D*H), h_n, c_n); c_n is empty for
    cells without a cell state (an operator returns tensors only)."""
    if x.device.type != "cuda":
        raise ValueError(f"persistrnn::forward: expected CUDA tensors, got x on {x.device}")
    hidden = h0.shape[2]
    chosen = _plan(cell, x, hidden, num_layers, bidirectional)
    out, h_n, c_n = run_plan(chosen, cell, weights, x, h0, c0, num_layers=num_layers, bidirectional=bidirectional,
                             has_biases=has_biases, check=not torch.cuda.is_current_stream_capturing())
    return out, h_n, (c_n if c_n is not None else h0.new_empty(0))


@forward.register_fake
def _(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases):
    directions = 2 if bidirectional else 1
    out = x.new_empty(x.shape[0], x.shape[1], directions * h0.shape[2])
    c_n = c0.new_empty(c0.shape) if c0 is not None else h0.new_empty(0)
    get_cell(cell)  # an unknown cell fails while tracing, not at run time
    return out, h0.new_empty(h0.shape), c_n
