"""A whole recurrent model's forward on CUDA: one function for every path,
its captured form, and the torch operator.

* :func:`run_plan` runs a model, from torch's flat weight list, on a
  :class:`~persistrnn.plan.Plan`: the persistent kernels, the fallback, or
  cuDNN through torch's own RNN function. Its launches go on torch's current
  stream; inside a CUDA-graph capture they become part of that graph.
* :func:`forward` is what a module call and the operator run: the plan from
  the one plan cache, then a replay of the forward captured for this shape,
  these weights and the current stream (:class:`persistrnn.runtime.GraphCache`),
  or the launches themselves inside a caller's capture.
* ``torch.ops.persistrnn.forward`` wraps :func:`forward` as a custom operator
  with a fake (shape-only) implementation, so that ``torch.compile`` traces a
  persistrnn module into one graph instead of breaking at our Python. On CUDA
  its kernel is C++ where the native replay loads
  (:mod:`persistrnn.runtime.native`): a call whose forward was captured before
  replays it without Python; any other call comes back here, through
  ``persistrnn::forward_capture``.

Nothing here synchronises: a kernel that gave up waiting reports through the
pinned report word, which the next call reads
(:func:`persistrnn.runtime.raise_reported_failure`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from . import fallback, persistent, runtime
from .cells import get_cell
from .checks import check_lengths
from .errors import ArgumentError, ArgumentTypeError, UnsupportedError
from .runtime import native

GRAPHS = runtime.GraphCache(capacity=64)
"""Captured forwards of every module and operator call, one per (model, input
shape, weights' addresses, plan, stream); each holds its own buffers."""

PADDED_LENGTHS = runtime.RecentShapes(window=32, fits=16)
"""The recent padded shapes of calls with lengths (packed batches), whose
padded length (the longest sequence) may change from call to call: such a
call is captured, its lengths an input of the graph, once its shape repeats
while the recent ones would share :data:`GRAPHS` with the padded calls'
(:class:`persistrnn.runtime.RecentShapes`)."""


def layer_params(weights: list[torch.Tensor], num_layers: int, directions: int,
                 has_biases: bool) -> list[list[dict[str, torch.Tensor]]]:
    """torch's flat weight list (per layer and direction: W_ih, W_hh, then
    b_ih, b_hh when the model has biases) as ``layers[l][d]`` dicts of
    contiguous tensors. The kernels always add a bias, so a model without
    one gets zeros."""
    per = 4 if has_biases else 2
    if len(weights) != num_layers * directions * per:
        raise ArgumentError(f"expected {num_layers * directions * per} weights for {num_layers} layer(s), "
                            f"{directions} direction(s), biases {has_biases}; got {len(weights)}")
    layers = []
    for layer in range(num_layers):
        directions_of_layer = []
        for d in range(directions):
            # The kernels read each matrix by address, row-major: a strided parameter (e.g. a transposed
            # view) is copied first, and inside a capture the copy is part of the graph.
            w = [t.contiguous() for t in weights[(layer * directions + d) * per:(layer * directions + d + 1) * per]]
            p = {"w_ih": w[0], "w_hh": w[1]}
            if has_biases:
                p["b_ih"], p["b_hh"] = w[2], w[3]
            else:
                p["b_ih"] = p["b_hh"] = w[0].new_zeros(w[0].shape[0])
            directions_of_layer.append(p)
        layers.append(directions_of_layer)
    return layers


def run_plan(chosen: Any, cell: str, weights: list[torch.Tensor], x: torch.Tensor, h0: torch.Tensor | None,
             c0: torch.Tensor | None, *, num_layers: int, bidirectional: bool, has_biases: bool,
             lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(output (T, B, D*H), h_n, c_n or None (L*D, B, H)) of the model on the
    plan's path: the persistent kernels, the fallback, or torch's own RNN
    function (cuDNN), from torch's flat weight list, time-major, inference.
    ``h0`` None: zero states (``c0`` None too, for cells with a cell state),
    which the persistent kernels start from without a tensor of zeros.
    ``lengths`` (int32, one per sequence; on the CPU it is checked there and
    copied without a synchronise) runs variable lengths, on the persistent
    path only."""
    if lengths is not None and chosen.path != "persistent":
        raise ArgumentError(f"variable lengths run on the persistent path, got a {chosen.path!r} plan")
    has_c = get_cell(cell).has_cell_state
    if h0 is None and chosen.path != "persistent":
        directions = 2 if bidirectional else 1
        h0 = x.new_zeros(num_layers * directions, x.shape[1], weights[1].shape[1])
        c0 = torch.zeros_like(h0) if has_c else None
    if chosen.path == "cudnn":
        # cuDNN refuses states that are not contiguous ("rnn: hx is not contiguous"), e.g. a learned initial
        # state expanded over the batch, which the other paths take: the call must not depend on the plan.
        hx = (h0.contiguous(), c0.contiguous()) if c0 is not None else h0.contiguous()
        # torch's function for each cell the planner times cuDNN for has the cell's name
        result = getattr(torch._VF, cell)(x, hx, weights, has_biases, num_layers, 0.0, False, bidirectional, False)
        return result[0], result[1], (result[2] if has_c else None)
    layers = layer_params(weights, num_layers, 2 if bidirectional else 1, has_biases)
    if chosen.path == "persistent":
        return persistent.forward_model(chosen.config, layers, x.contiguous(), h0, c0, lengths=lengths,
                                        batch_slice=chosen.batch_slice, check=False)
    if chosen.path == "fallback":
        return fallback.forward_model(cell, layers, x.contiguous(), h0, c0)
    raise ArgumentError(f"run_plan: expected a persistent, fallback or cudnn plan, got {chosen.path!r}")


def launch_settings() -> tuple:
    """What a capture fixes beside shapes and addresses, so a graph is kept
    per value: cuDNN's settings (a captured cuDNN call), the kernels' wait
    bound and test hook (kernel arguments), and what a captured fp32 GEMM
    fixes (the input projection, the backward's GEMMs): whether cuBLAS may
    use TF32 (:func:`runtime.matmul_allows_tf32`), and the BLAS library
    torch calls. Read on every call: cuDNN's flags and the BLAS library
    through the C getters that torch's properties wrap (the properties'
    Python layers cost more than the reads on the H100's host)."""
    return (torch._C._get_cudnn_enabled(), runtime.cudnn_rnn_precision(), runtime.wait_timeout_ns(),
            runtime.failure_hook(), runtime.matmul_allows_tf32(), torch._C._get_blas_preferred_backend())


def forward(shape: Any, weights: list[torch.Tensor], x: torch.Tensor, h0: torch.Tensor | None,
            c0: torch.Tensor | None, has_biases: bool, plan_for: Any = None, *,
            on_replay: Any = None, lengths: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A model's forward on CUDA (inference): ``shape`` a
    :class:`persistrnn.plan.ModelShape`, torch's flat weight list, ``x``
    (T, B, I) time-major, ``h0``/``c0`` (L*D, B, H) or None for zeros.
    ``plan_for(batch)`` gives the plan (default: the plan cache's), whose
    :meth:`~persistrnn.plan.Plan.for_steps` says what a call of T steps runs.
    ``on_replay(instance)`` runs after a replay of a captured forward.
    ``lengths``: None, or a CPU integer tensor (B,) of each sequence's steps
    (1 to T, checked on the host), run on the plan's persistent path as
    :func:`run_plan` runs them; captured once the padded shape repeats
    (:data:`PADDED_LENGTHS`), its launches as they come before.
    Returns fresh (output (T, B, D*H), h_n, c_n or None)."""
    runtime.raise_reported_failure(x.device.index)
    has_c = get_cell(shape.cell).has_cell_state
    T, B = x.shape[0], x.shape[1]
    states = (shape.num_layers * shape.directions, B, shape.hidden_size)
    if B == 0:  # torch returns empty outputs and states
        out = x.new_empty(T, 0, shape.directions * shape.hidden_size)
        return out, x.new_empty(states), (x.new_empty(states) if has_c else None)
    if plan_for is None:
        from .plan import cached_plan

        plan_for = functools.partial(cached_plan, shape)
    chosen = plan_for(B).for_steps(T)
    replays = not torch.cuda.is_current_stream_capturing()  # inside a caller's capture its graph takes our launches
    if lengths is not None:
        lengths = lengths_on_device(lengths, T, B, x.device)
        if replays:
            PADDED_LENGTHS.note((shape, x.shape, x.device))
            replays = PADDED_LENGTHS.repeats((shape, x.shape, x.device))

    def run(x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None,
            lengths: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        out, h_n, c_n = run_plan(chosen, shape.cell, weights, x, h0, c0, num_layers=shape.num_layers,
                                 bidirectional=shape.bidirectional, has_biases=has_biases, lengths=lengths)
        return (out, h_n, c_n) if has_c else (out, h_n)

    if not replays:
        result = run(x, h0, c0, lengths)
    else:
        key = (shape, has_biases, chosen.launch, x.shape, x.dtype, h0 is None, lengths is None, launch_settings(),
               tuple(w.data_ptr() for w in weights))  # graphs read the weights where they live
        def capture() -> Any:
            return runtime.CapturedCall(run, (x, h0, c0, lengths), spread_copies=_device_bound(chosen, T),
                                        copy_nodes=True)

        result = GRAPHS.call(key, capture, x.device.index, x, h0, c0, lengths, on_replay=on_replay)
    return result[0], result[1], (result[2] if has_c else None)


def lengths_on_device(lengths: torch.Tensor, steps: int, batch: int, device: torch.device) -> torch.Tensor:
    """``lengths`` checked on the host (a CPU integer tensor (B,), every
    length in 1..T, as torch's ``pack_padded_sequence`` takes them: no
    device synchronisation), as int32 on ``device``: the inference forward's
    and the training operators' one check."""
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in (torch.int64, torch.int32):
        got = lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise ArgumentTypeError(f"lengths: expected a torch.int64 or torch.int32 tensor, got {got}")
    if lengths.device.type != "cpu":
        raise ArgumentError(f"lengths: expected a CPU tensor (as torch.nn.utils.rnn.pack_padded_sequence takes "
                            f"them), got one on {lengths.device}")
    lengths = lengths.to(torch.int32).contiguous()
    check_lengths(lengths, steps, batch, lengths.device)  # the shape and the range, as the kernels' launches check
    return runtime.to_device_async(lengths, device)


def _device_bound(chosen: Any, steps: int) -> bool:
    """Whether a call of ``steps`` steps on ``chosen`` keeps the device busy
    longer than the host takes to issue it, by the tuner's timing of the
    plan: such a call spreads its copies (:func:`runtime.copy_tensors`)."""
    device_us = chosen.device_us(steps)
    return device_us is not None and device_us >= runtime.DEVICE_BOUND_US


# The operator is defined with torch.library's low-level registration, not
# torch.library.custom_op: custom_op's wrappers (the autograd kernel, the
# aliasing checks) measured ~250 µs of host time per call on the H100's host,
# three times the rest of the call.
_LIBRARY = torch.library.Library("persistrnn", "DEF")
_LIBRARY.define("forward(Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
                "bool bidirectional, bool has_biases) -> (Tensor, Tensor, Tensor)")


def forward_op(x: torch.Tensor, h0: Optional[torch.Tensor], c0: Optional[torch.Tensor], weights: list[torch.Tensor],
               cell: str, num_layers: int, bidirectional: bool,
               has_biases: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.persistrnn.forward``: a model's forward on CUDA. ``x``
    (T, B, I) time-major, ``h0`` and ``c0`` (L*D, B, H) or None for zeros
    (``c0`` None for cells without a cell state), torch's flat weight list.
    Returns (output (T, B, D*H), h_n, c_n); c_n is empty for cells without a
    cell state (an operator returns tensors only)."""
    from .plan import ModelShape

    if torch.is_grad_enabled():
        _refuse_gradients(x, h0, c0, weights)
    if x.device.type != "cuda":
        raise ArgumentError(f"persistrnn::forward: expected CUDA tensors, got x on {x.device}")
    if (device := runtime.elsewhere(x)) is not None:
        with torch.cuda.device(device):  # tensors on another GPU than the current one
            return forward_op(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases)
    get_cell(cell)
    hidden = weights[1].shape[1]
    shape = _OP_SHAPES.get((cell, x.shape[2], hidden, num_layers, x.dtype, bidirectional))
    if shape is None:
        shape = _OP_SHAPES[(cell, x.shape[2], hidden, num_layers, x.dtype, bidirectional)] = ModelShape(
            cell, x.shape[2], hidden, num_layers, str(x.dtype).removeprefix("torch."), bidirectional)

    def bind(instance: Any) -> None:  # the next call with these arguments replays from C++
        if instance.native_id is not None:
            native.bind(instance.native_id, x, h0, c0, weights, cell, num_layers, bidirectional, has_biases)

    out, h_n, c_n = forward(shape, weights, x, h0, c0, has_biases, on_replay=bind if native.available() else None)
    return out, h_n, (c_n if c_n is not None else x.new_empty(0))


def _refuse_gradients(x: torch.Tensor, h0: Optional[torch.Tensor], c0: Optional[torch.Tensor],
                      weights: list[torch.Tensor]) -> None:
    """The operator has no autograd kernel: torch's fallback would give
    tensors that require grad a gradient of nothing from it, with a
    warning. Refused instead (the native kernel sends such calls here)."""
    named = [("x", x), ("h0", h0), ("c0", c0)] + [(f"weights[{i}]", w) for i, w in enumerate(weights)]
    wanting = [name for name, t in named if t is not None and t.requires_grad]
    if wanting:
        raise UnsupportedError(
            f"persistrnn::forward computes no gradients, but {', '.join(wanting)} require(s) grad with gradients "
            "enabled: call the persistrnn module (LSTM, GRU or RNN), which trains through "
            "persistrnn::train_forward, or call the operator under torch.no_grad()")


_OP_SHAPES: dict[tuple, Any] = {}
# For every device (CPU inputs are refused, with the error that says why); a CUDA kernel of the same
# operator registered by the native replay takes precedence over this one for CUDA tensors.
_LIBRARY.impl("forward", forward_op, "CompositeExplicitAutograd")
# What the native kernel calls for a call it has no captured forward for: the same Python.
_LIBRARY.define("forward_capture(Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
                "bool bidirectional, bool has_biases) -> (Tensor, Tensor, Tensor)")
_LIBRARY.impl("forward_capture", forward_op, "CompositeExplicitAutograd")


@torch.library.register_fake("persistrnn::forward")
def _(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases):
    spec = get_cell(cell)  # an unknown cell fails while tracing, not at run time
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if len(weights) != num_layers * directions * per:
        raise ArgumentError(f"persistrnn::forward: expected {num_layers * directions * per} weights for "
                            f"{num_layers} layer(s), {directions} direction(s), biases {has_biases}; "
                            f"got {len(weights)}")
    hidden = weights[1].shape[1]
    states = (num_layers * directions, x.shape[1], hidden)
    out = x.new_empty(x.shape[0], x.shape[1], directions * hidden)
    c_n = x.new_empty(states) if spec.has_cell_state else x.new_empty(0)
    return out, x.new_empty(states), c_n
