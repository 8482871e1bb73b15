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
  in training mode, and (with a one-time warning) a call that needs
  gradients, unless the module's ``training_kernels`` is set: then a padded
  CUDA call, or a ``PackedSequence`` (each sequence with its length), runs
  :mod:`persistrnn.training`'s forward and backward, through autograd,
  dropout between layers included, where that step measured faster than
  cuDNN's at the call's shape (:func:`persistrnn.training.cudnn_trains_faster`:
  timed once per shape; always under ``torch.use_deterministic_algorithms``).

Every call is independent: any number of threads and streams may call one
module at once, and each call gets its own answer (the captured forwards are
kept per stream, and every launch owns its scratch; see
:mod:`persistrnn.runtime.graphs`). Under CUDA ``torch.autocast`` a call runs
and returns the dtype torch's module gives (fp16 where cuDNN is enabled,
whatever the autocast dtype). Batch 0 returns empty
outputs. ``torch.compile`` traces a module into one ``torch.ops.persistrnn.forward``
call; ``torch.jit.script`` is refused with :class:`~persistrnn.errors.UnsupportedError`.

``GRU(reset_after=False)`` is the canonical GRU (Cho et al.; ONNX
``linear_before_reset=0``): ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``.
Its parameters have torch's GRU names and shapes (gates r, z, n in that row
order); torch has no such cell, so its CPU and gradient path is this
package's own (:func:`torch_forward`, autograd through torch ops).

Bad inputs raise :class:`~persistrnn.errors.InputShapeError` (a
``ValueError``: shapes, sizes, dtypes, devices) or
:class:`~persistrnn.errors.InputTypeError` (a ``TypeError``: not a tensor) in
torch's wording; both are also ``RuntimeError``s, which torch raises for some
of the same inputs, so code written against torch still catches them.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from . import ops, persistent, runtime, training
from .training import TORCH_FUNCTIONS
from .cells import (ACTIVATIONS_SUFFIX, COUPLED_SUFFIX, CellSpec, get_cell, with_activations, with_clip,
                    with_coupled_gates)
from .errors import ArgumentError, ArgumentTypeError, InputShapeError, InputTypeError, UnsupportedError

__all__ = ["LSTM", "GRU", "RNN", "InputShapeError", "InputTypeError", "StreamSession", "from_torch", "convert",
           "torch_forward"]



_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _packed_positions(batch_sizes: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row of the time-major padded (T * B) layout, in the sorted order,
    that each row of a packed sequence's data fills, on ``device``; each
    sorted sequence's length, on the CPU), from ``batch_sizes`` alone. Packed
    rows run step by step, each step's sequences longest first: row k of
    step t is sorted column k - (the rows of the steps before t). In NumPy:
    a few small operations each, which cost the H100's host ~10-40 µs apiece
    as CPU tensor operations (perf-notes §74)."""
    sizes = batch_sizes.numpy()
    steps, batch = len(sizes), int(sizes[0])
    step_of_row = np.repeat(np.arange(steps), sizes)
    first_row = np.cumsum(sizes) - sizes
    positions = step_of_row * batch + np.arange(len(step_of_row)) - first_row[step_of_row]
    lengths = (sizes[None, :] > np.arange(batch)[:, None]).sum(1).astype(np.int32)
    return runtime.to_device_async(torch.from_numpy(positions), device), torch.from_numpy(lengths)


def _permuted(states: torch.Tensor | None, order: torch.Tensor | None) -> torch.Tensor | None:
    """(L*D, B, H) states with their batch rows in ``order`` (None: as they are)."""
    return states if states is None or order is None else states.index_select(1, order)


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
    # class-level defaults, so that a module pickled before these existed loads and prints as it ran
    clip: float | None = None
    activations: tuple[str, ...] | None = None
    input_forget: bool = False
    training_kernels: bool = False
    """Whether a CUDA call that needs gradients runs :mod:`persistrnn.training`'s
    operators (deterministic gradients, through autograd) instead of torch's
    implementation. Off by default: a first training call plans its layers
    (seconds, as a first inference call does), and where the persistent
    backward kernel does not hold the layer a step can be slower than
    cuDNN's (LSTM 1024, T=100, batch 32: 0.74x on the H100; 1.6-2.3x faster
    at H=256, batch 1-32, and H=1024, batch 1-8;
    ``python -m persistrnn bench training``)."""

    def _init_persistent(self) -> None:
        self._checked: set[tuple] = set()
        self._shapes: dict[torch.dtype, Any] = {}
        self._cast: tuple[tuple, list[torch.Tensor]] | None = None

    def __getstate__(self) -> dict:
        """Copies and pickles leave the per-process caches behind (a copy's
        parameters live elsewhere)."""
        state = dict(super().__getstate__())  # type: ignore[misc]
        state["_checked"], state["_shapes"], state["_cast"] = set(), {}, None
        return state

    def __prepare_scriptable__(self) -> Any:
        raise UnsupportedError(f"torch.jit.script cannot compile persistrnn.{type(self).__name__}: its forward "
                               "plans and launches kernels from Python. Use torch.compile(model), "
                               "torch.export.export(model, args) or torch.jit.trace(model, args), which run the "
                               "persistent kernels")

    @property
    def spec(self) -> CellSpec:
        return get_cell(self.cell)

    # ---- which path: the one rule ----------------------------------------------

    def _torch_reason(self, input: torch.Tensor, hx: Any = None, *, warn: bool = True,
                      trains: bool = False) -> str | None:
        """Why this call runs torch's implementation (None: ours runs). The one
        rule for every call: eager, packed, compiled and streaming. ``hx``: the
        call's initial states (a tensor, a tuple of them, or None). ``trains``:
        the caller runs a call that needs gradients on the training operators
        (:mod:`persistrnn.training`: a padded input, under autocast too; they
        also run dropout between layers in training mode)."""
        if input.device.type != "cuda":
            return "a CPU input"
        if getattr(self, "proj_size", 0):
            return "proj_size"
        needs_grad = self._needs_grad(input, hx)
        trains = (trains and self.training_kernels and needs_grad
                  and input.numel())  # torch's path returns empties
        if self.training and self.dropout > 0 and self.num_layers > 1 and not trains:
            return "dropout between layers in training mode"  # the training operators draw it; inference has none
        if input.dtype not in _DTYPES:
            return f"dtype {input.dtype} (the kernels run {', '.join(persistent.DTYPES)})"
        if needs_grad:
            if trains:
                x = input.transpose(0, 1) if self.batch_first and input.dim() == 3 else input
                if training.cudnn_trains_faster(self, x if x.dim() == 3 else x.unsqueeze(1)):
                    return "training: cuDNN measured faster at this shape"
                return None
            if warn:
                _warn_once(f"grad-{type(self).__name__}",
                           f"persistrnn.{type(self).__name__}: this call needs gradients; it runs torch's "
                           "implementation (training_kernels=True runs persistrnn's training operators where they "
                           "measure faster than cuDNN; always, and deterministic, under "
                           "torch.use_deterministic_algorithms(True))")
            return "gradients"
        return None

    def _needs_grad(self, input: torch.Tensor, hx: Any = None) -> bool:
        """Whether this call records gradients: of the input, a weight or an
        initial state (a learned initial state, or a state from an encoder,
        into a frozen RNN: the inference paths would drop its gradient)."""
        if not torch.is_grad_enabled():
            return False
        states = hx if isinstance(hx, (tuple, list)) else (hx,)
        return (input.requires_grad or any(p.requires_grad for p in self._flat_weights)
                or any(isinstance(s, torch.Tensor) and s.requires_grad for s in states))

    def _torch_forward(self, input: Any, hx: Any) -> Any:
        if self.cell not in _TORCH_CELLS:  # the canonical GRU, a clipped cell: no torch module computes them
            return _spec_torch_forward(self, input, hx)
        return super().forward(input, hx)  # type: ignore[misc]

    def _set_cell(self, base: str, clip: float | None, activations: Any, input_forget: bool = False) -> None:
        """The cell this module runs: ``base``, with its gates clipped (ONNX
        ``clip``), other activations (ONNX ``activations``) and the LSTM's
        forget gate coupled to its input gate (ONNX ``input_forget``) where given."""
        spec = get_cell(base) if clip is None else with_clip(base, clip)
        if activations is not None:
            if isinstance(activations, str) or not all(isinstance(a, str) for a in activations):
                raise ArgumentTypeError(f"activations: expected a sequence of names, got {activations!r}")
            spec = with_activations(spec, list(activations))
        if not isinstance(input_forget, bool):
            raise ArgumentTypeError(f"input_forget: expected a bool, got {type(input_forget).__name__}")
        if input_forget:
            spec = with_coupled_gates(spec)
        self.clip = None if clip is None else float(clip)
        # canonical names: "hardsigmoid(0.2,0.5)", not "HardSigmoid"
        named = spec.name.removesuffix(COUPLED_SUFFIX).partition(ACTIVATIONS_SUFFIX)[2]
        self.activations = tuple(named.split("/")) if named else None
        self.input_forget = input_forget
        self.cell = spec.name

    def extra_repr(self) -> str:
        extra = ("" if self.clip is None else f", clip={self.clip!r}") + (
            "" if self.activations is None else f", activations={self.activations!r}") + (
            ", input_forget=True" if self.input_forget else "")
        return super().extra_repr() + extra  # type: ignore[misc]

    def _shape(self, dtype: torch.dtype) -> Any:
        shape = self._shapes.get(dtype)
        if shape is None:
            from .plan import ModelShape

            shape = self._shapes[dtype] = ModelShape(self.cell, self.input_size, self.hidden_size, self.num_layers,
                                                     str(dtype).removeprefix("torch."), bool(self.bidirectional))
        return shape

    def _refresh_flat_weights(self) -> None:
        """Make ``_flat_weights`` the weights the module's attributes hold
        now, as torch's forward does (``_update_flat_weights``): a
        ``torch.func.functional_call`` swaps the parameters' entries, and a
        parametrization (e.g. ``weight_norm``) computes its weight at each
        access, so a kept list would run stale weights. torch's check cost
        7.5 µs a call on the CPU machine; this one, the parameters' entries
        against the list by identity, 0.3 µs, and calls torch's refresh only
        where one differs."""
        parameters = self._parameters
        for name, weight in zip(self._flat_weights_names, self._flat_weights):
            if parameters.get(name) is not weight:
                self._update_flat_weights()
                return

    def _rebuild_flat_weights(self) -> None:
        """``_flat_weights`` and torch's weak references to them from the
        module's attributes now: torch's ``_init_flat_weights`` without its
        ``flatten_parameters`` (cuDNN's packing, which our kernels do not
        need and Dynamo cannot trace: a set of data pointers). Where the weak
        references no longer name the parameters, torch's forward rebuilds
        both lists at every call (``_weights_have_changed``)."""
        self._flat_weights = [getattr(self, n) for n in self._flat_weights_names]
        self._flat_weight_refs = [weakref.ref(w) for w in self._flat_weights]

    def _weights_for(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The flat weights in ``dtype``: the parameters themselves, or (under
        autocast) copies cast once and kept while the parameters are unchanged."""
        weights = self._flat_weights
        if weights[0].dtype == dtype:
            return weights
        key = (dtype, tuple((w.data_ptr(), w._version) for w in weights))
        if self._cast is None or self._cast[0] != key:
            self._cast = (key, [w.detach().to(dtype) for w in weights])
        return self._cast[1]

    def forward(self, input: Any, hx: Any = None) -> Any:  # noqa: D401 - torch's signature
        if torch.compiler.is_compiling() or torch._C._is_tracing():  # torch.jit.trace records the operator too
            return self._compiled_forward(input, hx)
        data = input.data if isinstance(input, PackedSequence) else input
        if isinstance(data, torch.Tensor) and (device := runtime.elsewhere(data)) is not None:
            with torch.cuda.device(device):  # a model on another GPU than the current one
                return self.forward(input, hx)
        if _dynamo_callback() is not None:
            # Run eagerly inside a compiled model (a graph break at this module, e.g. without torch's
            # allow_rnn): Dynamo would otherwise try to trace each of our frames it meets, down to the
            # captured replays, and fail on their real tensors.
            return _eager_forward_without_dynamo()(self, input, hx)
        return self._eager_forward(input, hx)

    def _eager_forward(self, input: Any, hx: Any) -> Any:
        self._refresh_flat_weights()
        if isinstance(input, PackedSequence):
            return self._packed_forward(input, hx)
        autocast = isinstance(input, torch.Tensor) and input.is_cuda and torch.is_autocast_enabled("cuda")
        if autocast:
            input, hx = self._autocast_inputs(input, hx)
        x, states, unbatched = self._normalise(input, hx)  # every path gets the same checks and errors
        if self._torch_reason(input, hx, trains=True) is not None:
            return self._torch_forward(input, hx)
        pairs = self.spec.has_cell_state
        h0, c0 = (states if pairs else (states, None)) if states is not None else (None, None)
        needs_grad = self._needs_grad(input, hx)
        if autocast and needs_grad:  # the weights cast as autocast casts them: differentiably
            out, h_n, c_n = training.run_module(self, x, h0, c0, [w.to(x.dtype) for w in self._flat_weights])
        elif autocast:  # the kernels' input GEMM returns fp32 projections, which autocast would round
            with torch.autocast("cuda", enabled=False):
                out, h_n, c_n = ops.forward(self._shape(x.dtype), self._weights_for(x.dtype), x, h0, c0, self.bias,
                                            self._plan_for_dtype(x.dtype))
        elif needs_grad:
            out, h_n, c_n = training.run_module(self, x, h0, c0)
        else:
            out, h_n, c_n = self._inference_forward(x, h0, c0)
        if unbatched:
            out, h_n = out.squeeze(1), h_n.squeeze(1)
            c_n = c_n.squeeze(1) if pairs else None
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, ((h_n, c_n) if pairs else h_n)

    def _inference_forward(self, x: torch.Tensor, h0: torch.Tensor | None,
                           c0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, h_n, c_n or None) of a CUDA call without gradients, ``x``
        (T, B, I): the operator, replayed from C++ where the plan cache's plans
        serve and the native replay loads; otherwise :func:`ops.forward`."""
        if self._plans_by_cache() and runtime.native.available():
            out, h_n, c_n = torch.ops.persistrnn.forward(x, h0, c0, self._flat_weights, self.cell, self.num_layers,
                                                         self.bidirectional, self.bias)
            return out, h_n, (c_n if self.spec.has_cell_state else None)  # the operator's c_n: empty there
        return ops.forward(self._shape(x.dtype), self._flat_weights, x, h0, c0, self.bias, self.plan_for)

    def _autocast_inputs(self, input: torch.Tensor, hx: Any) -> tuple[torch.Tensor, Any]:
        """torch's RNNs under CUDA autocast run (and return) fp16 when cuDNN is
        enabled, whatever the autocast dtype (autocast casts cuDNN's RNN to
        half: measured on the H100, torch 2.11, a bf16 autocast returns fp16),
        and the autocast dtype otherwise (the RNN is then matmuls); so do ours."""
        dtype = torch.float16 if torch.backends.cudnn.enabled else torch.get_autocast_dtype("cuda")
        if not input.is_floating_point() or input.dtype == dtype:
            return input, hx

        def cast(t: Any) -> Any:
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        if hx is not None:
            hx = tuple(cast(s) for s in hx) if isinstance(hx, (tuple, list)) else cast(hx)
        return cast(input), hx

    def _packed_forward(self, packed: PackedSequence, hx: Any) -> Any:
        """A PackedSequence on the kernels, run as torch runs it: padded in
        the sorted order (longest first, as the packed data is), each sequence
        with its length, hx and the final states permuted by the sequence's
        ``sorted_indices`` and back. Padding and packing are one gather each
        (:func:`_packed_positions`): torch's ``pad_packed_sequence`` /
        ``pack_padded_sequence`` copy one time step at a time (the backward of
        the latter measured 2.6 ms of host time per call at T=100 on the
        H100's host), and the sorted order needs nothing from the device, so
        nothing here synchronises. A batch whose sequences all run every step
        is its packed data as it stands, and runs as a padded call."""
        data, batch_sizes = packed.data, packed.batch_sizes
        if data.dim() != 2:  # torch's check and message
            raise InputShapeError(f"input must have 2 dimensions, got {data.dim()}")
        steps, batch = len(batch_sizes), int(batch_sizes[0])
        # The checks and the choice of path see the padded input's shape only: where torch's implementation
        # runs, nothing is padded (an unallocated stand-in of that shape, not a copy of the data).
        probe = data.new_empty(1).requires_grad_(data.requires_grad and torch.is_grad_enabled()).expand(
            (batch, steps, data.shape[1]) if self.batch_first else (steps, batch, data.shape[1]))
        _, states, _ = self._normalise(probe, hx)
        if self._torch_reason(probe, hx, trains=True) is not None or data.is_cuda and torch.is_autocast_enabled("cuda"):
            return self._torch_forward(packed, hx)
        trains = self._needs_grad(probe, hx)  # the training operators, with each sequence's length
        chosen = None if trains else self.plan_for(batch).for_steps(steps)
        if chosen is not None and chosen.path != "persistent":
            return self._torch_forward(packed, hx)
        if int(batch_sizes[-1]) == batch:
            # Every sequence runs all T steps (a batch of one, or of equal lengths): the packed rows are the
            # padded input itself, time-major in the sorted order, and the call runs without lengths, i.e.
            # from the captured graphs of a padded call from the first (a call with lengths captures once its
            # padded shape repeats: a packed LSTM 256 batch-1 training step measured 5.5 ms uncaptured,
            # 3.2-3.4 ms as a padded call, §73).
            positions, lengths = None, None
            x = data.reshape(steps, batch, data.shape[1])
        else:
            positions, lengths = _packed_positions(batch_sizes, data.device)
            # (T * B, I) zeros, each packed row at its (step, sorted column): time-major
            x = data.new_zeros(steps * batch, data.shape[1]).index_copy(0, positions, data).view(steps, batch, -1)
        runtime.raise_reported_failure(x.device.index)
        pairs = self.spec.has_cell_state
        # None: zero states, which every path below starts from without a tensor of zeros
        h0, c0 = (states if pairs else (states, None)) if states is not None else (None, None)
        h0, c0 = _permuted(h0, packed.sorted_indices), _permuted(c0, packed.sorted_indices)
        if trains:
            out, h_n, c_n = training.run_module(self, x, h0, c0, lengths=lengths)
        elif lengths is None:
            out, h_n, c_n = self._inference_forward(x, h0, c0)
        else:  # lengths on the host: checked there, copied without a synchronise
            out, h_n, c_n = ops.forward(self._shape(x.dtype), self._flat_weights, x, h0, c0, self.bias,
                                        self.plan_for, lengths=lengths)
        h_n, c_n = _permuted(h_n, packed.unsorted_indices), _permuted(c_n, packed.unsorted_indices)
        rows = out.reshape(steps * batch, -1)
        packed_out = PackedSequence(rows if positions is None else rows.index_select(0, positions), batch_sizes,
                                    packed.sorted_indices, packed.unsorted_indices)
        return packed_out, ((h_n, c_n) if pairs else h_n)

    def _compiled_forward(self, input: Any, hx: Any) -> Any:
        """The forward as ``torch.compile`` and ``torch.jit.trace`` trace it:
        torch's checks, then one ``torch.ops.persistrnn.forward`` call (no
        Python state that would break the graph, and no shape read as a
        number, which a trace would fix; the operator keeps the plans and
        captured graphs, so a traced model runs any shape)."""
        if self._weights_have_changed():  # swapped (functional_call, an assigned state dict), or parametrized
            self._rebuild_flat_weights()
        if isinstance(input, PackedSequence) or self._torch_reason(input, hx, warn=False, trains=True) is not None:
            return self._torch_forward(input, hx)  # traced as torch's own module
        if torch.is_autocast_enabled("cuda"):
            input, hx = self._autocast_inputs(input, hx)
        pairs = self.spec.has_cell_state
        unbatched = input.dim() == 2
        batched = input.unsqueeze(0 if self.batch_first else 1) if unbatched else input
        x = batched.transpose(0, 1) if self.batch_first else batched
        if hx is None:  # zeros made inside the operator's captured forward: no kernels for them here
            states = (None, None)
            self.check_input(batched, None)  # torch's checks and messages
        else:
            states = tuple(hx) if pairs else (hx, None)
            if unbatched:
                states = tuple(s.unsqueeze(1) if s is not None else None for s in states)
            self.check_forward_args(batched, states if pairs else states[0], None)
        weights = self._flat_weights
        if weights[0].dtype != x.dtype:
            weights = [w.to(x.dtype) for w in weights]
        if self._needs_grad(input, hx):
            out, h_n, c_n = training.run_module(self, x, states[0], states[1], weights)
        else:
            out, h_n, c_n = torch.ops.persistrnn.forward(x, states[0], states[1], list(weights), self.cell,
                                                         self.num_layers, self.bidirectional, self.bias)
        if unbatched:
            out, h_n, c_n = out.squeeze(1), h_n.squeeze(1), (c_n.squeeze(1) if pairs else c_n)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, ((h_n, c_n) if pairs else h_n)

    # ---- checks in torch's wording ------------------------------------------

    def _normalise(self, input: Any, hx: Any) -> tuple[torch.Tensor, Any, bool]:
        """(x as (T, B, I), hx as (L*D, B, H) tensors or None, whether the input was unbatched)."""
        if not isinstance(input, torch.Tensor):
            raise InputTypeError(f"{type(self).__name__}: expected input to be a Tensor or PackedSequence, "
                                 f"got {type(input).__name__}")
        unbatched = input.dim() == 2
        if unbatched:
            x = input.unsqueeze(1)  # (T, I) is time-major in both layouts
        elif self.batch_first and input.dim() == 3:
            x = input.transpose(0, 1)
        else:
            x = input
        pairs = self.spec.has_cell_state
        if hx is not None:
            if pairs and not isinstance(hx, (tuple, list)):  # one tensor: a shape error; anything else: a type error
                error = InputShapeError if isinstance(hx, torch.Tensor) else InputTypeError
                raise error(f"{type(self).__name__}: expected hx to be a tuple (h_0, c_0), got {type(hx).__name__}")
            if pairs and len(hx) != 2:
                raise InputShapeError(f"{type(self).__name__}: expected hx to be a tuple (h_0, c_0), "
                                      f"got a {type(hx).__name__} of {len(hx)}")
            states = tuple(hx) if pairs else (hx,)
            for s in states:
                if not isinstance(s, torch.Tensor):
                    raise InputTypeError(f"{type(self).__name__}: expected hx to hold tensors, got {type(s).__name__}")
        else:
            states = ()
        weight = self._flat_weights[0]
        signature = (input.shape, input.dtype, input.device, weight.dtype, weight.device,
                     tuple((s.shape, s.dtype, s.device) for s in states), torch._C._is_any_autocast_enabled())
        if signature not in self._checked:  # the checks cost more than a replay: once per signature
            self._check(input, x, states, unbatched)
            self._checked.add(signature)
        if hx is None:
            return x, None, unbatched
        if unbatched:
            states = tuple(s.unsqueeze(1) for s in states)
        return x, (states if pairs else states[0]), unbatched

    def _check(self, input: torch.Tensor, x: torch.Tensor, states: tuple, unbatched: bool) -> None:
        """torch's checks in torch's wording (ValueError as torch raises it, its
        RuntimeErrors as :class:`InputShapeError`, both), then ours."""
        name = type(self).__name__
        if input.dim() not in (2, 3):  # torch's RNN says "tensor" where its LSTM and GRU do not
            raise InputShapeError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D "
                                  f"{'tensor ' if isinstance(self, torch.nn.RNN) else ''}instead")
        pairs = self.spec.has_cell_state
        want = 2 if unbatched else 3
        for s in states:
            if s.dim() != want:
                kind = "unbatched 2-D" if unbatched else "batched 3-D"
                got = f"({', '.join(f'{t.dim()}-D' for t in states)}) tensors" if pairs else f"{s.dim()}-D tensor"
                raise InputShapeError(f"For {kind} input, hx" + (" and cx" if pairs else "")
                                      + f" should also be {want}-D but got {got}")
        batched = input.unsqueeze(0 if self.batch_first else 1) if unbatched else input
        check_states = tuple(s.unsqueeze(1) for s in states) if unbatched else states
        if check_states:
            try:
                self.check_forward_args(batched, check_states if pairs else check_states[0], None)
            except (RuntimeError, ValueError) as exc:  # torch's own checks and messages
                raise InputShapeError(str(exc)) from None
        else:
            try:
                self.check_input(batched, None)
            except (RuntimeError, ValueError) as exc:
                raise InputShapeError(str(exc)) from None
        weight = self._flat_weights[0]
        autocast = torch._C._is_any_autocast_enabled()  # torch's module leaves dtypes to autocast then
        if x.dtype != weight.dtype and not autocast:  # as torch's check
            raise InputShapeError(f"RNN input dtype ({x.dtype}) does not match weight dtype ({weight.dtype}). "
                                  f"Convert input: input.to({weight.dtype}), or convert model: model.to({x.dtype})")
        if x.device != weight.device:
            raise InputShapeError(f"Input and parameter tensors are not at the same device, found input tensor at "
                                  f"{x.device} and parameter tensor at {weight.device}")
        for s in states:
            if s.device != x.device or (s.dtype != x.dtype and not autocast):
                raise InputShapeError(f"{name}: expected hx of dtype {x.dtype} on {x.device}, got {s.dtype} on "
                                      f"{s.device}")
        if x.shape[0] < 1:
            raise InputShapeError(f"{name}: Expected sequence length to be larger than 0 in RNN, got input of shape "
                                  f"{tuple(input.shape)}")  # torch's wording

    # ---- running ----------------------------------------------------------------

    def _plans_by_cache(self) -> bool:
        """Whether this module's plans are the plan cache's (the operator's),
        not a ``plan_for`` of a subclass or of the instance."""
        return type(self).plan_for is _Persistent.plan_for and "plan_for" not in self.__dict__

    def plan_for(self, batch: int) -> Any:
        """The plan this module runs ``batch`` sequences with on the current GPU
        (tuned on first use, then from the cache; untuned inside a CUDA-graph
        capture, where nothing may be timed)."""
        from . import plan as planner

        return planner.cached_plan(self._shape(self._flat_weights[0].dtype), batch)

    def _plan_for_dtype(self, dtype: torch.dtype) -> Any:
        """``plan_for`` at another dtype than the parameters' (autocast)."""
        from . import plan as planner

        return lambda batch: planner.cached_plan(self._shape(dtype), batch)

    def stream(self, batch_size: int) -> "StreamSession":
        """A streaming session over ``batch_size`` sequences (see :class:`StreamSession`)."""
        return StreamSession(self, batch_size)


# Dynamo's frame callback (None outside torch.compile's frames): read in ~15 ns.
_dynamo_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: None)


@functools.cache
def _eager_forward_without_dynamo() -> Any:
    """The eager forward with Dynamo kept out of it (made on first use:
    torch._dynamo is a heavy import)."""
    return torch._dynamo.disable(_Persistent._eager_forward, recursive=True)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_TORCH_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
"""The cells torch's own modules compute (their CPU and gradient path is torch's)."""


def _spec_torch_forward(module: "_Persistent", input: Any, hx: Any) -> Any:
    """A cell torch has no module for (the canonical GRU, a clipped cell), with torch ops from its spec."""
    if isinstance(input, PackedSequence):
        raise UnsupportedError(f"persistrnn.{type(module).__name__} with cell {module.cell!r} takes a "
                               "PackedSequence only where the persistent kernels run it (a CUDA call without "
                               "gradients whose plan is persistent); pass padded input here")
    x, hx, unbatched = module._normalise(input, hx)
    if hx is None:
        zeros = x.new_zeros(module.num_layers * (2 if module.bidirectional else 1), x.shape[1], module.hidden_size)
        hx = (zeros, zeros) if module.spec.has_cell_state else zeros
    out, state = torch_forward(module.spec, module, x, hx)
    if unbatched:
        out = out.squeeze(1)
        state = tuple(s.squeeze(1) for s in state) if isinstance(state, tuple) else state.squeeze(1)
    elif module.batch_first:
        out = out.transpose(0, 1)
    return out, state


class LSTM(_Persistent, torch.nn.LSTM):
    """``torch.nn.LSTM`` with a persistent-kernel forward (see the module docstring)."""

    def __init__(self, *args: Any, clip: float | None = None, activations: Any = None, input_forget: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._set_cell("lstm", clip, activations, input_forget)
        self._init_persistent()


class GRU(_Persistent, torch.nn.GRU):
    """``torch.nn.GRU`` with a persistent-kernel forward. ``reset_after=False``
    selects the canonical GRU (reset gate applied before the recurrent
    product), with the same parameter names and shapes."""

    def __init__(self, *args: Any, reset_after: bool = True, clip: float | None = None, activations: Any = None,
                 **kwargs: Any) -> None:
        if not isinstance(reset_after, bool):
            raise ArgumentTypeError(f"reset_after: expected a bool, got {type(reset_after).__name__}")
        super().__init__(*args, **kwargs)
        self.reset_after = reset_after
        self._set_cell("gru" if reset_after else "gru_reset_before", clip, activations)
        self._init_persistent()

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.reset_after else ", reset_after=False")


class RNN(_Persistent, torch.nn.RNN):
    """``torch.nn.RNN`` (tanh or relu) with a persistent-kernel forward."""

    def __init__(self, *args: Any, clip: float | None = None, activations: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._set_cell(f"rnn_{self.nonlinearity}", clip, activations)
        self._init_persistent()


class StreamSession:
    """Runs a model on a stream of chunks, keeping the states on the GPU between calls.

    ``session(x_chunk)`` runs a chunk of any length (1 included) and returns
    its output; the concatenated outputs of the chunks equal one call on the
    whole sequence. ``session.reset(idx)`` clears the states of the chosen
    batch rows (all rows when ``idx`` is None), e.g. when a new utterance
    starts in that slot. The states are ``session.state``, updated in place.

    On the GPU, each chunk shape's forward (on whichever path the plan chose)
    is captured once per stream, reading its initial states from the
    session's buffers and writing its final states back to them, so a call is
    a copy in, a replay and a copy out. Elsewhere (CPU, a call needing
    gradients, inside a caller's capture) the chunk runs through the module.
    Each session has its own buffers and graphs: sessions of one module may
    run at the same time from any threads; one session's chunks are in order.
    """

    GRAPHS = 8  # chunk shapes (per stream) a session keeps captured

    def __init__(self, module: _Persistent, batch_size: int) -> None:
        if module.bidirectional:
            raise ArgumentError("stream: expected a unidirectional model, got bidirectional=True (the reverse "
                                "direction needs the whole sequence)")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ArgumentError(f"stream: expected a positive int batch_size, got {batch_size!r}")
        self.module = module
        self.batch_size = batch_size
        weight = module.weight_hh_l0
        with runtime.ordinary_tensors():  # updated in place by later calls, in any mode
            h = weight.new_zeros(module.num_layers, batch_size, getattr(module, "proj_size", 0) or module.hidden_size)
            c = weight.new_zeros(module.num_layers, batch_size, module.hidden_size)
        self._buffers = (h, c) if module.spec.has_cell_state else (h,)
        self._graphs = runtime.GraphCache(self.GRAPHS)

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
        if (device := runtime.elsewhere(chunk)) is not None:
            with torch.cuda.device(device):  # a model on another GPU than the current one
                return self(chunk)
        x, _, _ = module._normalise(chunk, self.state)  # the module's checks and errors
        if (module._torch_reason(chunk) is not None or torch.cuda.is_current_stream_capturing()
                or torch.is_autocast_enabled("cuda")):
            out, state = module(chunk, self.state)
            for dst, src in zip(self._buffers, state if isinstance(state, tuple) else (state,)):
                dst.copy_(src)
            return out
        runtime.raise_reported_failure(x.device.index)
        module._refresh_flat_weights()
        weights = module._flat_weights
        chosen = module.plan_for(batch).for_steps(x.shape[0])
        key = (x.shape, x.dtype, chosen.launch, ops.launch_settings(),
               tuple(w.data_ptr() for w in weights))
        out = self._graphs.call(key, lambda: self._capture(chosen, x), x.device.index, x, *self._buffers)[0]
        return out.transpose(0, 1) if module.batch_first else out

    def _capture(self, chosen: Any, x: torch.Tensor) -> runtime.CapturedCall:
        module = self.module
        pairs = module.spec.has_cell_state

        def run(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None = None) -> tuple[torch.Tensor]:
            out, h_n, c_n = ops.run_plan(chosen, module.cell, module._flat_weights, x, h, c,
                                         num_layers=module.num_layers, bidirectional=False, has_biases=module.bias)
            h.copy_(h_n)
            if pairs:
                c.copy_(c_n)
            return (out,)

        # Capturing runs the body once before recording it; the carried
        # states must come out of that run as they went in.
        saved = [b.clone() for b in self._buffers]
        captured = runtime.CapturedCall(run, (x, *self._buffers), copy_in=(True,) + (False,) * len(self._buffers),
                                        copy_nodes=True)
        for dst, src in zip(self._buffers, saved):
            dst.copy_(src)
        return captured

    def reset(self, idx: Any = None) -> None:
        """Zero the states of batch rows ``idx`` (an int, a sequence, a mask or a slice; None: all)."""
        rows = slice(None) if idx is None else idx
        for s in self._buffers:
            s[:, rows] = 0


_CLASSES = {torch.nn.LSTM: LSTM, torch.nn.GRU: GRU, torch.nn.RNN: RNN}


def from_torch(module: torch.nn.RNNBase) -> torch.nn.Module:
    """The persistrnn module equal to a ``torch.nn.LSTM``/``GRU``/``RNN``: same
    arguments, same parameters (shared, not copied), same device and dtype,
    and the module's hooks and attributes of its own."""
    cls = _CLASSES.get(type(module))
    if cls is None:
        raise ArgumentTypeError(f"from_torch: expected a torch.nn.LSTM, GRU or RNN, got {type(module).__name__}")
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
    new._rebuild_flat_weights()  # the weak references too: a compiled call failed on stale ones (perf notes §98)
    new.train(module.training)
    for key, value in vars(module).items():  # hooks (the same dicts: a handle removes from both) and user attributes
        if key not in vars(new) or "hook" in key:
            vars(new)[key] = value
    return new


def convert(model: torch.nn.Module, *, training_kernels: bool | None = None) -> torch.nn.Module:
    """Replace every ``torch.nn.LSTM``/``GRU``/``RNN`` inside ``model`` (or
    ``model`` itself) with its persistrnn module, in place; returns the model.
    An instance that appears in several places becomes one persistrnn module
    in all of them. ``training_kernels`` (when given) is set on every
    persistrnn module in the result, converted or already one:
    ``convert(model, training_kernels=True)`` before the optimiser loop trains
    on the training operators."""
    if training_kernels is not None and not isinstance(training_kernels, bool):
        raise ArgumentTypeError(f"convert: expected training_kernels to be a bool or None, got "
                                f"{type(training_kernels).__name__}")
    model = _converted(model, {})
    if training_kernels is not None:
        for module in model.modules():
            if isinstance(module, _Persistent):
                module.training_kernels = training_kernels
    return model


def _converted(module: torch.nn.Module, done: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """``module`` converted, and its children in place; ``done`` maps each
    module already visited to its result, so a shared instance stays shared."""
    if id(module) in done:
        return done[id(module)]
    result = done[id(module)] = from_torch(module) if type(module) in _CLASSES else module
    if result is module:
        for name, child in list(module._modules.items()):  # every name: named_children() skips repeats
            if child is not None:
                module._modules[name] = _converted(child, done)
    return result
