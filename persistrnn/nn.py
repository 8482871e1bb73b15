"""Drop-in ``torch.nn`` recurrent modules that run on persistent kernels.

``persistrnn.LSTM``, ``GRU`` and ``RNN`` are the torch modules themselves
(subclasses): the same constructor arguments, parameter names and shapes,
``state_dict``, and outputs. Only ``forward`` differs, and only where it can:

* a CUDA input in fp32, fp16 or bf16 that needs no gradient (``torch.no_grad``,
  ``inference_mode``, or parameters and input that do not require grad) runs
  the path the planner chose for this shape and batch
  (:func:`persistrnn.plan.plan`): persistent kernels, the non-persistent
  fallback, or cuDNN where cuDNN measured faster (torch's own function,
  replayed from the same per-shape CUDA graph); a ``PackedSequence`` runs
  the persistent kernels with each sequence's length where the plan is
  persistent;
* everything else runs torch's own implementation: a CPU input, a
  ``PackedSequence`` on another plan, ``proj_size``, dropout between layers
  in training mode, and (with a one-time warning) a call that needs gradients.

``GRU(reset_after=False)`` is the canonical GRU (Cho et al.; ONNX
``linear_before_reset=0``): ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``.
Its parameters have torch's GRU names and shapes (gates r, z, n in that row
order); torch has no such cell, so its CPU and gradient path is this
package's own (:func:`torch_forward`, autograd through torch ops).

Bad inputs raise :class:`InputShapeError` (a ``ValueError``) or
:class:`InputTypeError` (a ``TypeError``) in torch's wording; both are also
``RuntimeError``s, which torch raises, so code written against torch still
catches them.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from . import jit, ops, persistent
from .cells import CellSpec, get_cell

__all__ = ["LSTM", "GRU", "RNN", "InputShapeError", "InputTypeError", "StreamSession", "from_torch", "convert",
           "torch_forward"]

TORCH_FUNCTIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu}
"""The cell expression language's functions on tensors (autograd included)."""


class InputShapeError(ValueError, RuntimeError):
    """A wrong rank, feature size, batch or state shape (torch raises RuntimeError)."""


class InputTypeError(TypeError, RuntimeError):
    """A wrong dtype (torch raises RuntimeError)."""


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def torch_forward(spec: CellSpec, module: torch.nn.RNNBase, x: torch.Tensor, hx: Any) -> tuple[torch.Tensor, Any]:
    """Any cell with torch ops, step by step (autograd through it): the
    reset-before GRU's path where no kernel runs. ``x`` is (T, B, I), ``hx``
    (layers * directions, B, H) (a pair for cells with a cell state)."""
    D = 2 if module.bidirectional else 1
    h_all, c_all = hx if spec.has_cell_state else (hx, None)
    layers = _layers(module)
    layer_input, h_n, c_n = x, [], []
    for layer in range(module.num_layers):
        outputs = []
        for d in range(D):
            p = layers[layer][d]
            h = h_all[layer * D + d]
            c = None if c_all is None else c_all[layer * D + d]
            xw = layer_input @ p["w_ih"].T + p["b_ih"]
            steps = range(x.shape[0] - 1, -1, -1) if d else range(x.shape[0])
            out = [None] * x.shape[0]
            for t in steps:
                h, c = spec.step_reference(xw[t], h, c, p["w_hh"], p["b_hh"], TORCH_FUNCTIONS)
                out[t] = h
            outputs.append(torch.stack(out))
            h_n.append(h)
            c_n.append(c)
        layer_input = torch.cat(outputs, dim=2) if D == 2 else outputs[0]
        if module.training and module.dropout > 0 and layer < module.num_layers - 1:
            layer_input = torch.nn.functional.dropout(layer_input, module.dropout, training=True)
    state = torch.stack(h_n)
    return layer_input, ((state, torch.stack(c_n)) if spec.has_cell_state else state)


def _layers(module: torch.nn.RNNBase) -> list[list[dict[str, torch.Tensor]]]:
    """The module's parameters as ``layers[l][d]`` dicts (zeros for absent biases)."""
    return ops.layer_params(module._flat_weights, module.num_layers, 2 if module.bidirectional else 1, module.bias)


class _Persistent:
    """The persistent forward shared by the three modules (a mixin before the torch class)."""

    cell: str

    def _init_persistent(self) -> None:
        self._plans: dict[tuple, Any] = {}
        self._graphs: collections.OrderedDict[tuple, _GraphedForward] = collections.OrderedDict()
        self._checked: set[tuple] = set()
        self._zeros: dict[tuple, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        """Copies and pickles leave the per-device caches behind (a CUDA graph
        cannot be copied, and a copy's parameters live elsewhere)."""
        state = super().__getstate__()  # type: ignore[misc]
        state = dict(state)
        state["_plans"], state["_graphs"], state["_checked"] = {}, collections.OrderedDict(), set()
        state["_zeros"] = {}
        return state

    @property
    def spec(self) -> CellSpec:
        return get_cell(self.cell)

    # ---- which path ---------------------------------------------------------

    def _needs_torch(self, input: Any) -> str | None:
        """Why this call runs torch's implementation (None: ours may run)."""
        if input.device.type != "cuda":
            return "a CPU input"
        if getattr(self, "proj_size", 0):
            return "proj_size"
        if self.training and self.dropout > 0 and self.num_layers > 1:
            return "dropout between layers in training mode"
        if str(input.dtype).removeprefix("torch.") not in persistent.DTYPES:
            return f"dtype {input.dtype} (the kernels run {', '.join(persistent.DTYPES)})"
        if torch.is_grad_enabled() and (input.requires_grad or any(p.requires_grad for p in self._flat_weights)):
            _warn_once(f"grad-{type(self).__name__}",
                       f"persistrnn.{type(self).__name__}: this call needs gradients, which the persistent kernels "
                       "do not compute yet; it runs torch's implementation (wrap inference in torch.no_grad() or "
                       "torch.inference_mode() for the persistent path)")
            return "gradients"
        return None

    def _torch_forward(self, input: Any, hx: Any) -> Any:
        if self.cell == "gru_reset_before":
            return _canonical_gru_torch_forward(self, input, hx)
        return super().forward(input, hx)  # type: ignore[misc]

    def forward(self, input: Any, hx: Any = None) -> Any:  # noqa: D401 - torch's signature
        if torch.compiler.is_compiling():
            return self._compiled_forward(input, hx)
        if isinstance(input, PackedSequence):
            return self._packed_forward(input, hx)
        x, states, unbatched = self._normalise(input, hx)  # every path gets the same checks and errors
        if self._needs_torch(input) is not None:
            return self._torch_forward(input, hx)
        chosen = self.plan_for(x.shape[1])
        if torch.cuda.is_current_stream_capturing():  # the caller's graph takes our launches
            out, state = self._run(chosen, x, states)
        else:
            out, state = self._graphed(chosen, x, states)(x, states)
        if self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
            state = tuple(s.squeeze(1) for s in state) if isinstance(state, tuple) else state.squeeze(1)
        return out, state

    def _zero_state(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Zeros (L*D, B, size) like ``x``, made once per shape: the paths that
        take them only read them, and a call without hx then allocates nothing."""
        shape = (self.num_layers * (2 if self.bidirectional else 1), x.shape[1], size)
        key = (shape, x.dtype, x.device)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = x.new_zeros(shape)
        return zeros

    def _packed_forward(self, packed: PackedSequence, hx: Any) -> Any:
        """A PackedSequence on the kernels: padded in the batch's own order,
        run with each sequence's length, packed again in the input's order
        (hx and the final states are in the batch's own order, as torch's)."""
        padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=self.batch_first)
        x, states, _ = self._normalise(padded, hx)
        chosen = None if self._needs_torch(padded) is not None else self.plan_for(x.shape[1])
        if chosen is None or chosen.path != "persistent":
            return self._torch_forward(packed, hx)
        out, state = self._run(chosen, x, states, lengths.to(x.device, torch.int32))
        if packed.sorted_indices is not None:
            out, lengths = out.index_select(1, packed.sorted_indices), lengths[packed.sorted_indices.cpu()]
        data = torch.nn.utils.rnn.pack_padded_sequence(out, lengths).data
        return PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices), state

    def _compiled_forward(self, input: Any, hx: Any) -> Any:
        """The forward as ``torch.compile`` traces it: torch's checks, then one
        ``torch.ops.persistrnn.forward`` call (no Python state that would
        break the graph: no plan or capture caches, which the operator keeps)."""
        if (isinstance(input, PackedSequence) or input.device.type != "cuda" or getattr(self, "proj_size", 0)
                or (self.training and self.dropout > 0 and self.num_layers > 1)
                or input.dtype not in (torch.float32, torch.float16, torch.bfloat16)
                or (torch.is_grad_enabled() and (input.requires_grad
                                                 or any(p.requires_grad for p in self._flat_weights)))):
            return self._torch_forward(input, hx)  # traced as torch's own module
        pairs = self.spec.has_cell_state
        unbatched = input.dim() == 2
        batched = input.unsqueeze(0 if self.batch_first else 1) if unbatched else input
        x = batched.transpose(0, 1) if self.batch_first else batched
        D = 2 if self.bidirectional else 1
        shape = (self.num_layers * D, x.shape[1], self.hidden_size)
        if hx is None:
            states = (x.new_zeros(shape), x.new_zeros(shape)) if pairs else (x.new_zeros(shape),)
        else:
            states = tuple(hx) if pairs else (hx,)
            if unbatched:
                states = tuple(s.unsqueeze(1) for s in states)
        self.check_forward_args(batched, states if pairs else states[0], None)  # torch's checks and messages
        out, h_n, c_n = torch.ops.persistrnn.forward(x.contiguous(), states[0], states[1] if pairs else None,
                                                     list(self._flat_weights), self.cell, self.num_layers,
                                                     self.bidirectional, self.bias)
        if self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out, h_n, c_n = out.squeeze(1), h_n.squeeze(1), (c_n.squeeze(1) if pairs else c_n)
        return out, ((h_n, c_n) if pairs else h_n)

    # ---- checks in torch's wording ------------------------------------------

    def _normalise(self, input: torch.Tensor, hx: Any) -> tuple[torch.Tensor, Any, bool]:
        """(x as (T, B, I), hx as (L*D, B, H) tensors, whether the input was unbatched)."""
        name = type(self).__name__
        if not isinstance(input, torch.Tensor):
            raise InputTypeError(f"{name}: expected input to be a Tensor or PackedSequence, got {type(input).__name__}")
        if input.dim() not in (2, 3):
            raise InputShapeError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D instead")
        unbatched = input.dim() == 2
        if unbatched:
            input = input.unsqueeze(0 if self.batch_first else 1)
        x = input.transpose(0, 1) if self.batch_first else input
        D = 2 if self.bidirectional else 1
        B = x.shape[1]
        pairs = self.spec.has_cell_state
        if hx is None:
            real = getattr(self, "proj_size", 0) or self.hidden_size
            zeros = self._zero_state(x, self.hidden_size)
            hx = (self._zero_state(x, real), zeros) if pairs else zeros
        else:
            states = hx if pairs else (hx,)
            if pairs and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
                raise InputShapeError(f"{name}: expected hx to be a tuple (h_0, c_0), got {type(hx).__name__}")
            want = 2 if unbatched else 3
            for s in states:
                if not isinstance(s, torch.Tensor):
                    raise InputTypeError(f"{name}: expected hx to hold tensors, got {type(s).__name__}")
                if s.dim() != want:
                    kind = "unbatched 2-D" if unbatched else "batched 3-D"
                    raise InputShapeError(f"For {kind} input, hx" + (" and cx" if pairs else "")
                                          + f" should also be {want}-D but got {s.dim()}-D tensor" + ("s" if pairs else ""))
            if unbatched:
                states = tuple(s.unsqueeze(1) for s in states)
            hx = states if pairs else states[0]
        weight = self.weight_hh_l0
        signature = (input.shape, input.dtype, input.device, weight.dtype, weight.device,
                     tuple((s.shape, s.dtype, s.device) for s in (hx if pairs else (hx,))))
        if signature not in self._checked:  # the checks cost more than a replay: once per signature
            self._check(name, input, x, hx, pairs, B)
            self._checked.add(signature)
        return x, hx, unbatched

    def _check(self, name: str, input: torch.Tensor, x: torch.Tensor, hx: Any, pairs: bool, B: int) -> None:
        """torch's checks (its wording, as ValueError/TypeError), then ours."""
        try:
            self.check_forward_args(input, hx, None)  # torch's own checks and messages, in the module's layout
        except (RuntimeError, ValueError) as exc:
            message = str(exc)
            if "must have the type" in message or "dtype" in message:
                raise InputTypeError(message) from None
            raise InputShapeError(message) from None
        weight = self.weight_hh_l0
        if x.dtype != weight.dtype:
            raise InputTypeError(f"input must have the type {weight.dtype}, got type {x.dtype}")
        if x.device != weight.device:
            raise InputShapeError(f"Input and parameter tensors are not at the same device, found input tensor at "
                                  f"{x.device} and parameter tensor at {weight.device}")
        for s in (hx if pairs else (hx,)):
            if s.device != x.device or s.dtype != x.dtype:
                raise InputTypeError(f"{name}: expected hx of dtype {x.dtype} on {x.device}, got {s.dtype} on {s.device}")
        if x.shape[0] < 1 or B < 1:
            raise InputShapeError(f"{name}: expected at least one step and one sequence, got input of shape "
                                  f"{tuple(input.shape)}")

    # ---- running ----------------------------------------------------------------

    def plan_for(self, batch: int) -> Any:
        """The plan this module runs ``batch`` sequences with on the current GPU
        (tuned on first use, then from the cache; untuned inside a CUDA-graph
        capture, where nothing may be timed)."""
        from . import plan as planner

        key = (torch.cuda.current_device(), planner.space.batch_bucket(batch))
        if key not in self._plans:
            shape = planner.shape_of(self)
            capturing = torch.cuda.is_current_stream_capturing()
            self._plans[key] = planner.plan(shape, batch, tune=not capturing)
        return self._plans[key]

    def _run(self, chosen: Any, x: torch.Tensor, hx: Any, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        pairs = self.spec.has_cell_state
        h_all, c_all = hx if pairs else (hx, None)
        # A kernel that gave up (a peer never arrived) leaves a status word;
        # reading it synchronises, so it is never read inside a CUDA-graph
        # capture (the captured forward copies it out instead).
        out, h_n, c_n = ops.run_plan(chosen, self.cell, self._flat_weights, x, h_all, c_all,
                                     num_layers=self.num_layers, bidirectional=self.bidirectional,
                                     has_biases=self.bias, check=not torch.cuda.is_current_stream_capturing(),
                                     lengths=lengths)
        return out, ((h_n, c_n) if pairs else h_n)

    def _graphed(self, chosen: Any, x: torch.Tensor, hx: Any) -> "_GraphedForward":
        """This shape's captured forward (captured on first use, least recently used dropped)."""
        key = (x.shape, x.dtype, x.device, chosen.path, chosen.config, _cudnn_settings(),
               tuple(p.data_ptr() for p in self._flat_weights))  # torch keeps this list current
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = _GraphedForward(self, chosen, x, hx)
            self._graphs[key] = graphed
            if len(self._graphs) > GRAPHS_PER_MODULE:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return graphed

    def stream(self, batch_size: int) -> "StreamSession":
        """A streaming session over ``batch_size`` sequences (see :class:`StreamSession`)."""
        return StreamSession(self, batch_size)


def _cudnn_settings() -> tuple[bool, bool]:
    """What a captured cuDNN call fixed at capture time: a graph is kept per setting."""
    return torch.backends.cudnn.enabled, torch.backends.cudnn.allow_tf32


GRAPHS_PER_MODULE = 8
"""Input shapes whose whole forward a module keeps captured (each holds its own buffers)."""


class _GraphedForward:
    """A module's whole forward at one input shape, captured as a CUDA graph.

    Called eagerly, a small model's forward is bound by Python issue time
    (measured on the H100: 0.19 ms per call of a 1-layer LSTM 128 at one step,
    0.87 ms for a 3-layer LSTM 128 whose device work is 0.25 ms); a replay is
    a handful of launches. The graph reads the parameters where they live, so
    in-place updates are seen; parameters at new addresses get a new graph
    (their addresses are in the key).

    A kernel that gave up (a peer block never arrived) leaves a status word.
    Reading it synchronises, so the graph copies it to pinned host memory and
    the next call reads that copy without waiting: a failure raises one call
    late, and never hangs (the kernel's waits are bounded).
    """

    def __init__(self, module: _Persistent, chosen: Any, x: torch.Tensor, hx: Any, *, carry: bool = False) -> None:
        """``carry``: ``hx`` are buffers the graph reads its initial states
        from and writes its final states back to (a streaming session's);
        otherwise the graph has copies of its own."""
        self.module = module
        self.x = x.clone()
        given = hx if isinstance(hx, tuple) else (hx,)
        self.states = given if carry else tuple(s.clone() for s in given)
        stream = torch.cuda.Stream(device=x.device)
        self.where = (x.device.index, stream.cuda_stream)
        self.device_status = persistent.status_word(*self.where)
        self.host_status = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._host_view = self.host_status.numpy()
        self.result: Any = None

        def body() -> None:
            hx_in = self.states if isinstance(hx, tuple) else self.states[0]
            self.result = module._run(chosen, self.x, hx_in)
            if carry:
                out_states = self.result[1] if isinstance(hx, tuple) else (self.result[1],)
                for dst, src in zip(self.states, out_states):
                    dst.copy_(src)
            self.host_status.copy_(self.device_status, non_blocking=True)

        # capture_graph runs the body once before capturing it; carried
        # states must come out of that run as they went in.
        saved = tuple(s.clone() for s in self.states) if carry else ()
        self.graph = jit.capture_graph(body, stream)
        for dst, src in zip(self.states if carry else (), saved):
            dst.copy_(src)

    # Where Dynamo runs a module's forward eagerly (it breaks the graph at
    # torch's RNN classes unless torch._dynamo.config.allow_rnn is set), the
    # replay is opaque to it: a host read and a graph launch, not traceable.
    def _raise_on_failure(self) -> None:
        if self._host_view[0]:
            torch.cuda.synchronize(self.x.device)
            self._host_view[0] = 0
            persistent.check_launches(*self.where)  # raises, and clears the word and the barrier counters

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """(carry) The output for ``x``; the states advance in place."""
        self._raise_on_failure()
        self.x.copy_(x)
        self.graph.replay()
        return self.result[0].clone()

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, hx: Any) -> tuple[torch.Tensor, Any]:
        self._raise_on_failure()
        self.x.copy_(x)
        for dst, src in zip(self.states, hx if isinstance(hx, tuple) else (hx,)):
            dst.copy_(src)
        self.graph.replay()
        out, state = self.result
        state = tuple(s.clone() for s in state) if isinstance(state, tuple) else state.clone()
        return out.clone(), state


def _canonical_gru_torch_forward(module: "GRU", input: Any, hx: Any) -> Any:
    if isinstance(input, PackedSequence):
        raise NotImplementedError("GRU(reset_after=False) takes a PackedSequence only where the persistent kernels "
                                  "run it (a CUDA call without gradients whose plan is persistent); pass padded "
                                  "input here")
    x, hx, unbatched = module._normalise(input, hx)
    out, state = torch_forward(module.spec, module, x, hx)
    if module.batch_first:
        out = out.transpose(0, 1)
    if unbatched:
        out, state = out.squeeze(1), state.squeeze(1)
    return out, state


class LSTM(_Persistent, torch.nn.LSTM):
    """``torch.nn.LSTM`` with a persistent-kernel forward (see the module docstring)."""

    cell = "lstm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_persistent()


class GRU(_Persistent, torch.nn.GRU):
    """``torch.nn.GRU`` with a persistent-kernel forward. ``reset_after=False``
    selects the canonical GRU (reset gate applied before the recurrent
    product), with the same parameter names and shapes."""

    def __init__(self, *args: Any, reset_after: bool = True, **kwargs: Any) -> None:
        if not isinstance(reset_after, bool):
            raise TypeError(f"reset_after: expected a bool, got {type(reset_after).__name__}")
        super().__init__(*args, **kwargs)
        self.reset_after = reset_after
        self.cell = "gru" if reset_after else "gru_reset_before"
        self._init_persistent()

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.reset_after else ", reset_after=False")


class RNN(_Persistent, torch.nn.RNN):
    """``torch.nn.RNN`` (tanh or relu) with a persistent-kernel forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cell = f"rnn_{self.nonlinearity}"
        self._init_persistent()


class StreamSession:
    """Runs a model on a stream of chunks, keeping the states on the GPU between calls.

    ``session(x_chunk)`` runs a chunk of any length (1 included) and returns
    its output; the concatenated outputs of the chunks equal one call on the
    whole sequence. ``session.reset(idx)`` clears the states of the chosen
    batch rows (all rows when ``idx`` is None), e.g. when a new utterance
    starts in that slot. The states are ``session.state``, updated in place.

    On the GPU, each chunk shape's forward (on whichever path the plan chose)
    is captured once with the session's state buffers as its initial and
    final states, so a call is a copy in, a replay and a copy out (a module
    call would also copy the states in and out, and check its arguments).
    Elsewhere (CPU, a call needing gradients) the chunk runs through the
    module.
    """

    def __init__(self, module: _Persistent, batch_size: int) -> None:
        if module.bidirectional:
            raise ValueError("stream: expected a unidirectional model, got bidirectional=True (the reverse "
                             "direction needs the whole sequence)")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"stream: expected a positive int batch_size, got {batch_size!r}")
        self.module = module
        self.batch_size = batch_size
        weight = module.weight_hh_l0
        zeros = weight.new_zeros(module.num_layers, batch_size, module.hidden_size)
        self._buffers = (zeros, zeros.clone()) if module.spec.has_cell_state else (zeros,)
        self._graphs: dict[tuple, _GraphedForward] = {}

    @property
    def state(self) -> Any:
        return self._buffers if self.module.spec.has_cell_state else self._buffers[0]

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        if not isinstance(chunk, torch.Tensor) or chunk.dim() != 3:
            raise InputShapeError(f"stream: expected a 3-D chunk, got "
                                  f"{chunk.dim() if isinstance(chunk, torch.Tensor) else type(chunk).__name__}"
                                  f"{'-D' if isinstance(chunk, torch.Tensor) else ''}")
        module = self.module
        batch = chunk.shape[0] if module.batch_first else chunk.shape[1]
        if batch != self.batch_size:
            raise InputShapeError(f"stream: expected a chunk of batch {self.batch_size}, got {batch}")
        graphed = self._graph_for(chunk)
        if graphed is None:
            out, state = module(chunk, self.state)
            for dst, src in zip(self._buffers, state if isinstance(state, tuple) else (state,)):
                dst.copy_(src)
            return out
        out = graphed.step(chunk.transpose(0, 1) if module.batch_first else chunk)
        return out.transpose(0, 1) if module.batch_first else out

    def _graph_for(self, chunk: torch.Tensor) -> "_GraphedForward | None":
        """This chunk shape's captured forward on the session's buffers, or
        None where the chunk runs through the module instead."""
        module = self.module
        if chunk.device.type != "cuda":
            return None
        weights = module._flat_weights
        key = (chunk.shape, chunk.dtype, chunk.device, _cudnn_settings(), tuple(w.data_ptr() for w in weights))
        if torch.cuda.is_current_stream_capturing() or torch.is_grad_enabled() and (
                chunk.requires_grad or any(w.requires_grad for w in weights)):
            return None
        graphed = self._graphs.get(key)
        if graphed is not None:
            return graphed
        x, _, _ = module._normalise(chunk, self.state)  # the module's checks and errors
        if module._needs_torch(chunk) is not None:
            return None
        chosen = module.plan_for(x.shape[1])
        graphed = self._graphs[key] = _GraphedForward(module, chosen, x, self.state, carry=True)
        return graphed

    def reset(self, idx: Any = None) -> None:
        """Zero the states of batch rows ``idx`` (an int, a sequence, a mask or a slice; None: all)."""
        rows = slice(None) if idx is None else idx
        for s in self._buffers:
            s[:, rows] = 0


_CLASSES = {torch.nn.LSTM: LSTM, torch.nn.GRU: GRU, torch.nn.RNN: RNN}


def from_torch(module: torch.nn.RNNBase) -> torch.nn.Module:
    """The persistrnn module equal to a ``torch.nn.LSTM``/``GRU``/``RNN``: same
    arguments, same parameters (shared, not copied), same device and dtype."""
    cls = _CLASSES.get(type(module))
    if cls is None:
        raise TypeError(f"from_torch: expected a torch.nn.LSTM, GRU or RNN, got {type(module).__name__}")
    kwargs = dict(input_size=module.input_size, hidden_size=module.hidden_size, num_layers=module.num_layers,
                  bias=module.bias, batch_first=module.batch_first, dropout=module.dropout,
                  bidirectional=module.bidirectional)
    if cls is LSTM:
        kwargs["proj_size"] = module.proj_size
    if cls is RNN:
        kwargs["nonlinearity"] = module.nonlinearity
    with torch.device("meta"):
        new = cls(**kwargs)
    for name, param in module.named_parameters():
        setattr(new, name, param)  # the same Parameter objects: training the one trains the other
    new._flat_weights = [getattr(new, n) for n in new._flat_weights_names]
    new.train(module.training)
    return new


def convert(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``torch.nn.LSTM``/``GRU``/``RNN`` inside ``model`` (or
    ``model`` itself) with its persistrnn module, in place; returns the model."""
    if type(model) in _CLASSES:
        return from_torch(model)
    for name, child in model.named_children():
        setattr(model, name, convert(child))
    return model
