"""Training: a forward that keeps what backpropagation through time needs,
the backward, and the autograd operators that join them.

The path of a training call: :func:`train_step` (an ``autograd.Function``)
runs ``torch.ops.persistrnn.train_forward``, which returns, beside the
model's outputs, what the backward reads; autograd keeps those and
``torch.ops.persistrnn.train_backward`` (:func:`backward`) turns the output
gradients into the gradients of the input, the initial states and every
parameter. Both are operators (torch.library, with fake implementations),
so ``torch.compile`` traces a training step through them without breaking
the graph.

What is kept, per layer and direction (the "saved" list of the operator):

* ``xw`` (T, B, G*H): the input projections ``x W_ih^T + b_ih``;
* ``gates`` (T, B, G*H): every gate's recurrent product with ``b_hh``
  (``W_hh h_{t-1} + b_hh``; a later stage's product is of that stage's
  operand, e.g. ``r * h`` of the reset-before GRU);
* ``c`` (T, B, H): the cell state after each position (cells with one);

all in the compute dtype (fp32 on the GPU, the input's dtype on the CPU),
and per layer but the last its output (the next layer's input) in the layer's
dtype. Per position and sequence that is ``4 (2 G H + H_c)`` bytes per
layer direction (``H_c`` = H for cells with a cell state, else 0), plus
``D H`` elements of each layer's output but the last's: an fp32 LSTM of
H=256 keeps 9 KB per position and sequence per direction. cuDNN's reserve
space holds its gate activations and cell states in the layer dtype (not
measured against this).

On CUDA the forward is the persistent kernel compiled with ``save_gates``
(one launch per layer and direction; the kernel writes ``gates`` and ``c``
as it runs), or, for a padded batch where no kernel configuration holds the
layer or the plan timed the fallback faster (:func:`fallback_trains_forward`),
the fallback's step loop, whose pointwise kernel writes them. Elsewhere (a
packed batch no kernel holds, float64, the CPU) the same values come from
:func:`direction_forward`, the recurrence in torch ops.

The backward (:func:`direction_backward`) runs the recurrence backwards step
by step, in the compute dtype. The step is generated from the cell spec
(:mod:`persistrnn.adjoint`: source-to-source reverse mode, once per spec),
as straight-line statements per statement block, so every cell is covered by
its spec; per step and block, the last first, the block's statements
(recompute the forward values from the kept ones, then the adjoints), then
one GEMM: the stage operand's adjoint (``dh_{t-1}``, or e.g. ``d(r * h)``)
``+= d_product_j @ W_j``. On CUDA in fp32 (:func:`_fused_steps`) each block's
statements are one generated kernel over (batch row, unit) and the GEMM is a
``torch.mm``/``addmm_`` into buffers allocated before the loop: two
launches per step and stage, no allocation. Elsewhere (the CPU; float64,
also on CUDA) the same statements run as torch ops (:func:`step_backward`).
After the recurrence: one GEMM each for ``dW_hh`` (per stage: its gradients
by its operands), ``dW_ih`` and ``dx``; bias gradients are sums. Nothing
reduces with atomics, so the same inputs give bit-identical gradients.
Where a layer's W_hh fits the shared memory of a cluster, or of a grid of
one block per SM, :mod:`persistrnn.training_kernel` runs the whole step loop
in one launch instead.

On CUDA both operators replay a graph captured per shape and stream
(:data:`OPERATOR_GRAPHS`), so no step costs Python. A batch with lengths
is captured too, with its lengths an input of the graph, once its padded
shape repeats (:data:`PADDED_LENGTHS`): a packed batch's padded length may
change from batch to batch, and a capture per length would cost more than it
saves.

Lengths (a padded batch of sequences, as a ``PackedSequence`` runs): the
forward kernel's ``lengths`` variant, and the backward generated from
:func:`persistrnn.cells.with_lengths`, the cell that holds its states past a
sequence's length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import threading
import time
from types import CodeType
from typing import Any, Callable

import numpy as np
import torch

from . import adjoint, fallback, ops, persistent, runtime, training_kernel
from .adjoint import HARDTANH_GRAD, RELU_GRAD, BlockBackward, render_python, step_backward_program
from .cells import NUMPY_FUNCTIONS, STEP_RUNS, CellSpec, evaluate, get_cell, with_lengths
from .errors import ArgumentError, ArgumentTypeError, ConfigError, UnsupportedError
from .log import logger
from .plan import tuner

__all__ = ["FALLBACK_FORWARD", "OPERATOR_GRAPHS", "TORCH_FUNCTIONS", "backward", "cudnn_trains_faster",
           "direction_backward", "direction_forward", "dropout_masks", "fallback_trains_forward", "forward",
           "run_module", "saved_shapes", "step_backward", "train_step", "training_config"]

TORCH_FUNCTIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu,
                   "hardtanh": torch.nn.functional.hardtanh, "exp": torch.exp, "log": torch.log,
                   "step": lambda x: torch.where(x > 0, 1.0, torch.where(x <= 0, 0.0, x))}
"""The cell expression language's functions on tensors (autograd included):
torch's by the same names."""
assert set(TORCH_FUNCTIONS) == set(NUMPY_FUNCTIONS), "every function of the cell language needs its torch form"

# ---- the cell, differentiated from its spec ------------------------------------


def _stage_rows(spec: CellSpec, stage: int, hidden: int) -> slice:
    """Rows of stage ``stage``'s gates (consecutive: the kernels need them so too)."""
    first = spec.gates.index(spec.stages[stage][0])
    return slice(first * hidden, (first + len(spec.stages[stage])) * hidden)


def _blocks(spec: CellSpec) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Statement block j runs after stage j's products: the between-stage blocks, then the pointwise."""
    return (*spec.between_stages, spec.pointwise)


def _run_cell(spec: CellSpec, xg: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
              product: Callable[[int, torch.Tensor], torch.Tensor],
              step_runs: torch.Tensor | None = None) -> tuple[dict[str, Any], list]:
    """One step of the cell from its spec: ``product(stage, operand)`` gives
    that stage's gates' recurrent products with b_hh, (B, gates * H);
    ``step_runs`` (B,) the step's rows that run, for a cell with lengths.
    Returns every name's value and each stage's products."""
    hidden = h.shape[1]
    env: dict[str, Any] = {"h": h}
    if step_runs is not None:
        env[STEP_RUNS] = step_runs[:, None]
    if c is not None:
        env["c"] = c
    for i, gate in enumerate(spec.gates):
        env[f"x_{gate}"] = xg[:, i * hidden:(i + 1) * hidden]
    products = []
    for j, block in enumerate(_blocks(spec)):
        products.append(product(j, env[spec.stage_operands[j]]))
        for i, gate in enumerate(spec.stages[j]):
            env[f"h_{gate}"] = products[j][:, i * hidden:(i + 1) * hidden]
        env = evaluate(block, env, TORCH_FUNCTIONS)
    return env, products


_ADJOINT_GLOBALS = {"__builtins__": {}, **TORCH_FUNCTIONS, RELU_GRAD: lambda x: (x > 0).to(x.dtype),
                    HARDTANH_GRAD: lambda x: ((x > -1) & (x < 1)).to(x.dtype)}
"""What the generated backward statements call, on tensors (no builtins:
they need nothing but these functions)."""


@functools.lru_cache(maxsize=None)
def _compiled_blocks(spec: CellSpec) -> tuple[tuple[BlockBackward, CodeType], ...]:
    """The spec's generated backward blocks in walk order, each with its statements compiled to Python."""
    return tuple((block, compile(render_python(block.statements), f"<{spec.name} backward, block {block.block}>",
                                 "exec")) for block in step_backward_program(spec).blocks)


def step_backward(spec: CellSpec, xg: torch.Tensor, gates: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
                  w_stages: list[torch.Tensor], dh: torch.Tensor, dc: torch.Tensor | None,
                  step_runs: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, list[Any]]:
    """One step of the backward recurrence with torch ops: the generated
    statements (:func:`persistrnn.adjoint.step_backward_program`) evaluated on
    tensors, the fused kernels' math.

    ``xg``, ``gates`` (B, G*H): the step's input projections and recurrent
    products (with b_hh); ``h``, ``c`` (B, H): the states it started from;
    ``w_stages[j]``: W_hh's rows of stage j; ``dh``, ``dc``: the gradients of
    its new states; ``step_runs`` (B,): for a cell with lengths
    (:func:`persistrnn.cells.with_lengths`), 1 for the rows whose sequence
    runs the step, else 0. Returns (d xg, d gates (both (B, G*H)), dh_{t-1},
    dc_{t-1} or None, every stage's operand (stage 0's is ``h``)).
    """
    hidden = h.shape[1]
    values: dict[str, Any] = {"h": h, "c": c, STEP_RUNS: None if step_runs is None else step_runs[:, None]}
    for i, gate in enumerate(spec.gates):
        values[f"x_{gate}"] = xg[:, i * hidden:(i + 1) * hidden]
        values[f"h_{gate}"] = gates[:, i * hidden:(i + 1) * hidden]
    slots: dict[str, Any] = {"h_new": dh, "c_new": dc}  # each name's adjoint as the blocks leave it
    operands = [h] * spec.num_stages
    for block, code in _compiled_blocks(spec):
        namespace = {name: values[name] for name in block.inputs}
        namespace.update((statement_name, slots[name]) for name, statement_name in block.adjoints_in)
        exec(code, _ADJOINT_GLOBALS, namespace)
        for name, statement_name in block.adjoints_out:
            slots[name] = namespace[statement_name] if statement_name else torch.zeros_like(h)
        for stage, name in block.operands_out:
            operands[stage] = namespace[name]
        j = block.block
        through_w = torch.cat([slots[f"h_{gate}"] for gate in spec.stages[j]], dim=1) @ w_stages[j]
        operand = spec.stage_operands[j]
        slots[operand] = slots[operand] + through_w if block.accumulate else through_w
    d_xg = torch.cat([slots[f"x_{gate}"] for gate in spec.gates], dim=1)
    d_gates = torch.cat([slots[f"h_{gate}"] for gate in spec.gates], dim=1)
    return d_xg, d_gates, slots["h"], slots["c"] if c is not None else None, operands


# ---- one direction of one layer ----------------------------------------------


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``a @ b`` (2-D, the backward's fp32 operands). For a 16-bit model
    (``dtype`` float16 or bfloat16) on CUDA, the operands are rounded to it
    and the product runs on its tensor cores with fp32 accumulation and
    output, as cuDNN's 16-bit backward runs its GEMMs: in fp32 they were a
    third of bf16 LSTM 1024's training step at batch 16 (perf-notes §76)."""
    if dtype in (torch.float16, torch.bfloat16) and a.is_cuda:
        return torch.mm(a.to(dtype), b.to(dtype), out_dtype=torch.float32)
    return a @ b


def _positions(steps: int, reverse: bool) -> range:
    return range(steps - 1, -1, -1) if reverse else range(steps)


def _previous(sequence: torch.Tensor, initial: torch.Tensor, reverse: bool,
              step_runs: torch.Tensor | None = None) -> torch.Tensor:
    """(T, B, H): the state each position started from (the initial state, then
    the sequence shifted by one step in the direction's order). With
    ``step_runs`` (T, B), a reverse row starts from the initial state at its
    last position: the positions past its length held it (forward rows need
    no such care: a position that runs follows one that ran)."""
    if not reverse:
        return torch.cat([initial[None], sequence[:-1]])
    following = torch.cat([sequence[1:], initial[None]])
    if step_runs is None:
        return following
    following_runs = torch.cat([step_runs[1:], step_runs.new_zeros(1, step_runs.shape[1])])
    return torch.where(following_runs[:, :, None] != 0, following, initial[None])


def direction_forward(spec: CellSpec, xw: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor, h0: torch.Tensor,
                      c0: torch.Tensor | None, reverse: bool,
                      step_runs: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor, Any]:
    """One layer's direction with torch ops, keeping what the backward reads:
    (out (T, B, H), gates (T, B, G*H), c (T, B, H) or None, the final h and
    c or None), in the dtype of ``xw``; the rest as in :func:`step_backward`.
    With ``step_runs`` (T, B) (a cell with lengths) a row holds its states
    where it is 0 and outputs zeros there, as torch does past a packed
    sequence's length; ``c`` keeps the held state."""
    steps, hidden = xw.shape[0], w_hh.shape[1]
    out = xw.new_empty(xw.shape[0], xw.shape[1], hidden)
    gates = torch.empty_like(xw)
    cs = torch.empty_like(out) if c0 is not None else None
    w_stages = [(w_hh[rows].T, b_hh[rows]) for rows in (_stage_rows(spec, j, hidden) for j in range(len(spec.stages)))]
    h, c = h0, c0
    for p in _positions(steps, reverse):
        runs = None if step_runs is None else step_runs[p]
        env, products = _run_cell(spec, xw[p], h, c,
                                  lambda j, operand: torch.addmm(w_stages[j][1], operand, w_stages[j][0]), runs)
        gates[p] = torch.cat(products, dim=1)
        h = env["h_new"]
        out[p] = h if runs is None else h * runs[:, None]
        if cs is not None:
            c = cs[p] = env["c_new"]
    return out, gates, cs, h, c


def direction_backward(spec: CellSpec, xw: torch.Tensor, gates: torch.Tensor, cs: torch.Tensor | None,
                       out: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None, w_hh: torch.Tensor,
                       d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: torch.Tensor | None, reverse: bool,
                       step_runs: torch.Tensor | None = None, gemm_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """The backward recurrence of one layer's direction, all in one dtype.

    ``xw``, ``gates``, ``cs`` as the forward kept them, ``out`` (T, B, H) its
    outputs, ``d_out`` their gradients, ``dh_n``/``dc_n`` the final states'.
    ``step_runs`` (T, B), for a cell with lengths
    (:func:`persistrnn.cells.with_lengths`): 1 where a row's sequence runs the
    position, 0 past its length (where ``out`` is zero and ``d_out`` is not
    read). ``gemm_dtype``: a 16-bit model's dtype, in which the dW_hh GEMM
    runs (:func:`_product`). Returns (d xw, d gates (T, B, G*H), dW_hh, dh0,
    dc0 or None).

    The step loop (on CUDA in fp32
    :func:`persistrnn.training_kernel.persistent_steps` where the layer fits
    it, else :func:`_fused_steps`; elsewhere :func:`_torch_steps`), then the
    dW_hh GEMMs, launched as they come (the training operators capture them
    with the rest of the backward)."""
    if spec.lengths != (step_runs is not None):
        raise ArgumentError(f"step_runs: expected a (T, B) tensor for a cell with lengths and None otherwise; "
                            f"cell {spec.name}, got {'None' if step_runs is None else tuple(step_runs.shape)}")
    hidden = w_hh.shape[1]
    h_prev = _previous(out, h0, reverse, step_runs)
    c_prev = _previous(cs, c0, reverse, step_runs) if cs is not None else None
    dense = torch.contiguous_format  # the fused steps write each step's rows by address
    d_xw, d_gates = torch.empty_like(xw, memory_format=dense), torch.empty_like(gates, memory_format=dense)
    # Stage 0 multiplies h_{t-1}; a later stage's operand is computed in the step.
    stage_operands = out.new_empty(spec.num_stages - 1, *out.shape)
    steps_backward = _torch_steps
    if xw.is_cuda and xw.dtype == torch.float32:
        # One launch for all steps where the layer's W_hh fits the shared
        # memory of a cluster or a grid (training_kernel.fits), else two launches per step.
        fits = training_kernel.fits(spec, hidden, xw.shape[1], xw.device.index)
        steps_backward = training_kernel.persistent_steps if fits else _fused_steps
    dh, dc = steps_backward(spec, xw, gates, h_prev, c_prev, w_hh, d_out, dh_n, dc_n, reverse, d_xw, d_gates,
                            stage_operands, step_runs)
    operands = [h_prev if name == "h" else stage_operands[s - 1] for s, name in enumerate(spec.stage_operands)]
    flat = d_gates.reshape(-1, d_gates.shape[2])
    d_w_hh = torch.cat([_product(flat[:, _stage_rows(spec, s, hidden)].T, operand.reshape(-1, hidden), gemm_dtype)
                        for s, operand in enumerate(operands)])
    return d_xw, d_gates, d_w_hh, dh, dc


def _torch_steps(spec: CellSpec, xw: torch.Tensor, gates: torch.Tensor, h_prev: torch.Tensor, c_prev: Any,
                 w_hh: torch.Tensor, d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: Any, reverse: bool,
                 d_xw: torch.Tensor, d_gates: torch.Tensor, stage_operands: torch.Tensor,
                 step_runs: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """The step loop with torch ops (:func:`step_backward`), any device and
    dtype: fills ``d_xw``, ``d_gates`` (T, B, G*H) and ``stage_operands``
    (stages - 1, T, B, H: the operands of stages 1 and on, but ``h``);
    returns (dh0, dc0 or None). ``h_prev``/``c_prev`` (T, B, H): the states
    each position started from; ``step_runs`` (T, B) for a cell with lengths."""
    w_stages = [w_hh[_stage_rows(spec, j, w_hh.shape[1])] for j in range(spec.num_stages)]
    dh, dc = dh_n, dc_n
    for p in reversed(_positions(xw.shape[0], reverse)):
        d_xw[p], d_gates[p], dh, dc, step_operands = step_backward(
            spec, xw[p], gates[p], h_prev[p], None if c_prev is None else c_prev[p], w_stages, dh + d_out[p], dc,
            None if step_runs is None else step_runs[p])
        for s in range(1, spec.num_stages):
            if spec.stage_operands[s] != "h":
                stage_operands[s - 1, p] = step_operands[s]
    return dh, dc


@functools.lru_cache(maxsize=64)
def _block_kernels(spec: CellSpec, device: int) -> tuple[runtime.LoadedKernel, ...]:
    """The spec's backward kernels on ``device``, in walk order (compiled once, then from the disk cache):
    compiled for that device's architecture and loaded there, whichever device is current."""
    with torch.cuda.device(device):
        arch = runtime.facts_of(device).arch
        return tuple(runtime.get_kernel(adjoint.compile_block_kernel(spec, block.block, arch), adjoint.KERNEL_NAME)
                     for block in step_backward_program(spec).blocks)


def _fused_steps(spec: CellSpec, xw: torch.Tensor, gates: torch.Tensor, h_prev: torch.Tensor, c_prev: Any,
                 w_hh: torch.Tensor, d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: Any, reverse: bool,
                 d_xw: torch.Tensor, d_gates: torch.Tensor, stage_operands: torch.Tensor,
                 step_runs: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """:func:`_torch_steps` on CUDA in fp32, fused: per step and statement
    block (the last first) one generated kernel (:mod:`persistrnn.adjoint`),
    then one GEMM into the block's stage operand's adjoint. The buffers are
    allocated here, before the loop; the loop allocates nothing and passes
    the kernels addresses computed from the step index."""
    program = step_backward_program(spec)
    steps, batch, hidden = h_prev.shape
    kernels = _block_kernels(spec, xw.device.index)
    config = kernels[0].config(-(-batch * hidden // adjoint.THREADS), adjoint.THREADS)
    stream = torch.cuda.current_stream()
    # The kernels read by address: every operand dense. A slot read before
    # it is written would read NaN, so such a bug shows in the gradients.
    xw, gates, d_out = xw.contiguous(), gates.contiguous(), d_out.contiguous()
    step_runs = None if step_runs is None else step_runs.contiguous()
    dh = torch.full((2, batch, hidden), float("nan"), dtype=xw.dtype, device=xw.device)
    dh[0].copy_(dh_n)
    dc = torch.full_like(dh, float("nan")) if c_prev is not None else None
    if dc is not None:
        dc[0].copy_(dc_n)
    carry = torch.full((len(program.carried), batch, hidden), float("nan"), dtype=xw.dtype, device=xw.device)
    stage_rows = [_stage_rows(spec, j, hidden) for j in range(spec.num_stages)]
    w_stages = [w_hh[rows] for rows in stage_rows]
    d_products = [d_gates[:, :, rows] for rows in stage_rows]
    targets = [None if name == "h" else carry[program.carried.index(name)] for name in spec.stage_operands]

    def stepped(tensor: Any) -> tuple[int, int]:
        """(address of ``tensor[0]``, bytes from one index of dim 0 to the next); (0, 0) for no tensor."""
        return (0, 0) if tensor is None else (tensor.data_ptr(), tensor.stride(0) * tensor.element_size())

    def at(base: tuple[int, int], index: int) -> np.uint64:
        return np.uint64(base[0] + index * base[1])

    xg_at, gates_at, h_at, c_at, d_out_at, runs_at, d_xg_at, d_gates_at, dh_at, dc_at = map(
        stepped, (xw, gates, h_prev, c_prev, d_out, step_runs, d_xw, d_gates, dh, dc))
    operands_at = stepped(stage_operands[0] if spec.num_stages > 1 else None)
    carry_at = np.uint64(carry.data_ptr())
    sizes = (np.int32(steps * batch * hidden), np.int32(batch), np.int32(hidden))
    dh_buffers = dh.unbind(0)
    for i, p in enumerate(reversed(_positions(steps, reverse))):
        # dh_t and dc_t are in buffer i % 2; the step leaves dh_{t-1}, dc_{t-1} in the other.
        now, previous = i % 2, 1 - i % 2
        args = (at(xg_at, p), at(gates_at, p), at(h_at, p), at(c_at, p), at(dh_at, now), at(d_out_at, p),
                at(dc_at, now), at(runs_at, p), at(d_xg_at, p), at(d_gates_at, p), at(dh_at, previous),
                at(dc_at, previous), carry_at, at(operands_at, p), *sizes)
        for block, kernel in zip(program.blocks, kernels):
            runtime.launch(kernel, config, *args, stream=stream)
            j = block.block
            target = dh_buffers[previous] if targets[j] is None else targets[j]
            if block.accumulate:
                target.addmm_(d_products[j][p], w_stages[j])
            else:
                torch.mm(d_products[j][p], w_stages[j], out=target)
    return dh[steps % 2], (dc[steps % 2] if dc is not None else None)


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


def saved_bytes(spec: CellSpec, x: torch.Tensor, hidden: int, num_layers: int, directions: int) -> int:
    """Bytes of the saved list (:func:`saved_shapes`) of a forward on ``x`` (T, B, I)."""
    return _saved_bytes(spec, x.shape[0], x.shape[1], hidden, num_layers, directions, x.dtype)


@functools.lru_cache(maxsize=256)
def _saved_bytes(spec: CellSpec, steps: int, batch: int, hidden: int, num_layers: int, directions: int,
                 dtype: torch.dtype) -> int:
    """:func:`saved_bytes`, once per shape: every training forward asks."""
    compute, layer = _compute_dtype(dtype).itemsize, dtype.itemsize
    return sum(math.prod(shape) * (compute if in_compute else layer)
               for shape, in_compute in saved_shapes(spec, steps, batch, hidden, num_layers, directions))


def training_config(cell: str, hidden_size: int, batch: int, dtype: str, device: int,
                    lengths: bool = False) -> tuple[persistent.KernelConfig, int | None] | None:
    """(the kernel configuration a training forward runs, compiled with
    ``save_gates`` (and with ``lengths``, for a padded batch of sequences),
    and its batch slice), or None where none holds the layer on chip. The
    configuration is the plan of one such layer at ``batch``
    (tuned on first use, as an inference call's) where that plan is
    persistent: at batch 32 the default configuration in one slice measured
    4.8 ms for the forward of LSTM 256 (T=100), 16x the planned inference
    forward. Where that one does not compile with ``save_gates`` (or the plan
    runs cuDNN or the fallback), the plan's other timed persistent candidates,
    fastest first; untimed, the cost model's top persistent choice; last, the
    default configuration. Where torch allows TF32 (:func:`persistrnn.runtime.rnn_allows_tf32`),
    an fp32 layer's plan may be a TF32 configuration, as an
    inference call's; the setting is part of the cache key, so that a
    configuration chosen while TF32 was allowed never runs once it is not."""
    # The TF32 setting is read on every call (a key of the cache), the shape only
    # on a miss: building it and reading the setting cost ~6 µs of the H100's
    # host per training forward before this split (perf-notes §81).
    return _training_config(cell, hidden_size, batch, dtype, device, lengths,
                            dtype == "float32" and runtime.rnn_allows_tf32())


@functools.lru_cache(maxsize=256)
def _training_config(cell: str, hidden_size: int, batch: int, dtype: str, device: int, lengths: bool,
                     tf32: bool) -> tuple[persistent.KernelConfig, int | None] | None:
    """:func:`training_config`, once per its arguments and whether TF32 is
    allowed (as :func:`persistrnn.plan.tuner.tf32_allowed` reads it)."""
    from . import plan as planner
    from .plan import ModelShape, model as cost, space

    shape = ModelShape(cell, hidden_size, hidden_size, 1, dtype)
    chosen = planner.cached_plan(shape, batch)
    candidates = [(chosen.config, chosen.batch_slice)] if chosen.path == "persistent" else []
    # Then the plan's other timed persistent candidates, fastest first: the plan's
    # own may not compile with save_gates (exact LSTM 1024 batch 8: its 512-thread
    # grid spills, and the default ran instead, untimed; perf-notes §83).
    timed = sorted((ms, label) for label, ms in chosen.measured_ms.items()
                   if label.startswith("persistent ") and not math.isnan(ms))
    if timed or not candidates:
        bucket = space.batch_bucket(batch)
        ranked = tuner.ranked_configs(shape, bucket, cost.cost_model(batch=bucket), tf32=tf32)
        by_label = {tuner.config_label(r.config, r.batch_slice): (r.config, r.batch_slice) for r in ranked}
        candidates += [by_label[label] for _, label in timed if label in by_label and by_label[label] not in candidates]
        if not candidates:  # the cost model's top persistent choice: at LSTM 1024 batch 32 the default took 4.9 ms
            candidates = [(r.config, r.batch_slice) for r in tuner.compile_top(ranked, 1, twins=False, families=False)]
    try:
        candidates.append((persistent.default_config(cell, hidden_size, batch,
                                                     sm_count=runtime.device_facts().sm_count, dtype=dtype), None))
    except ConfigError:
        pass
    for config, batch_slice in candidates:
        try:
            # save_gates writes every stage's products, which the one-exchange
            # reset-before GRU (one_sync) never holds at once: two exchanges.
            config = dataclasses.replace(config, save_gates=True, one_sync=False, lengths=lengths)
            persistent.batch_per_launch(config, device)  # compiles it; refuses one that spills or fits no sequence
        except ConfigError:
            continue
        return config, batch_slice
    return None


FALLBACK_FORWARD = "fallback"
"""What a training forward launches (in place of :func:`training_config`'s
answer) where :func:`fallback_trains_forward` says so: the fallback's step
loop (:func:`persistrnn.fallback.run_fallback` with ``saved_gates``), one
GEMM per step and stage and one pointwise kernel per step."""


def fallback_trains_forward(cell: str, hidden_size: int, batch: int, dtype: str, device: int, holds: bool) -> bool:
    """Whether a training forward of a padded batch (no lengths) runs the
    fallback's step loop: where no persistent configuration holds the layer
    (``holds`` False: the step in torch ops is the other choice), or where
    the layer's plan at ``batch`` timed the fallback faster than every
    persistent candidate it timed. At exact fp32 LSTM 1024, batch 32, the
    fastest persistent grid timed 8.0 ms (no grid holds 32 sequences in one
    launch, perf-notes §83), and a training step on the fallback's forward
    took 7.2 ms against 12.4 on the grid's (§85)."""
    return _fallback_trains_forward(cell, hidden_size, batch, dtype, device, holds,
                                    dtype == "float32" and runtime.rnn_allows_tf32())


@functools.lru_cache(maxsize=256)
def _fallback_trains_forward(cell: str, hidden_size: int, batch: int, dtype: str, device: int, holds: bool,
                             tf32: bool) -> bool:
    """:func:`fallback_trains_forward`, once per its arguments and whether TF32 is allowed."""
    from . import plan as planner

    if not holds:
        return True
    measured = planner.cached_plan(planner.ModelShape(cell, hidden_size, hidden_size, 1, dtype), batch).measured_ms
    persistent_ms = [ms for label, ms in measured.items() if label.startswith("persistent ") and not math.isnan(ms)]
    return measured.get("fallback", math.nan) < min(persistent_ms, default=math.inf)


# Both choices are read from the plans, and are forgotten with them (a shape retuned in this process).
tuner.on_plans_changed(_training_config.cache_clear)
tuner.on_plans_changed(_fallback_trains_forward.cache_clear)


def forward(x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None, weights: list[torch.Tensor], cell: str,
            num_layers: int, bidirectional: bool, has_biases: bool, dropout_masks: list[torch.Tensor],
            lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                          list[torch.Tensor]]:
    """The training forward (the operator's implementation): (out (T, B, D*H),
    h_n, c_n (empty without a cell state), the saved list). ``h0`` None:
    zero initial states (``c0`` None too), made inside the captured graph.
    ``dropout_masks``: none, or one (T, B, D*H) per layer but the last, which
    multiplies that layer's output before the next layer reads it (0 or
    1 / (1 - p): :func:`dropout_masks`). ``lengths``: None, or a CPU
    integer tensor (B,) (as ``torch.nn.utils.rnn.pack_padded_sequence``
    takes them), each sequence's steps (1 to T) for a padded batch, run as
    torch runs a packed sequence: past its length a sequence outputs zeros
    and keeps its states, and a reverse direction starts at its last step."""
    spec = get_cell(cell)
    if x.dim() != 3 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ArgumentError(f"persistrnn::train_forward: expected x of shape (T >= 1, B >= 1, input), "
                            f"got {tuple(x.shape)}")
    directions = 2 if bidirectional else 1
    layers = ops.layer_params(weights, num_layers, directions, has_biases)
    steps, batch = x.shape[0], x.shape[1]
    hidden = layers[0][0]["w_hh"].shape[1]
    if h0 is None and c0 is not None or spec.has_cell_state and h0 is not None and c0 is None:
        raise ArgumentError(f"persistrnn::train_forward: expected h0 and c0 both (a {cell} keeps a cell state), h0 "
                            f"alone, or neither for zeros; got h0 {'None' if h0 is None else tuple(h0.shape)} and "
                            f"c0 {'None' if c0 is None else tuple(c0.shape)}")
    _check_masks(dropout_masks, num_layers, (steps, batch, directions * hidden), x)
    lengths = None if lengths is None else ops.lengths_on_device(lengths, steps, batch, x.device)
    launch = None
    dtype = str(x.dtype).removeprefix("torch.")
    if x.is_cuda:
        runtime.raise_reported_failure(x.device.index)
    if x.is_cuda and dtype in persistent.DTYPES:  # float64 runs the torch ops, on CUDA too
        launch = training_config(cell, hidden, batch, dtype, x.device.index, lengths is not None)
        if lengths is None and fallback_trains_forward(cell, hidden, batch, dtype, x.device.index,
                                                       launch is not None):
            launch = FALLBACK_FORWARD
    options = (spec, num_layers, bidirectional, has_biases, launch)
    shape = None  # a padded batch's shape needs no policy: only one with lengths is noted and asked about
    limit = GRAPH_SAVED_BYTES
    if lengths is not None:
        shape = _padded_shape(cell, num_layers, bidirectional, hidden, x)
        PADDED_LENGTHS.note(shape)
    elif launch == FALLBACK_FORWARD:
        limit = _step_loop_limit(STEP_LOOP_FORWARDS, _padded_shape(cell, num_layers, bidirectional, hidden, x))
    if not _captures_operators(x, lengths, saved_bytes(spec, x, hidden, num_layers, directions), shape, limit):
        return _forward_launches(*options, x, h0, c0, weights, dropout_masks, lengths)

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        x, h0, c0, lengths, *rest = flat
        out, h_n, c_n, saved = _forward_launches(*options, x, h0, c0, rest[:len(weights)], rest[len(weights):],
                                                 lengths)
        return [out, h_n, c_n, *saved]

    key = ("train_forward", *options, lengths is None, *_operator_key(x, h0, c0, weights, dropout_masks))
    flat = (x, h0, c0, lengths, *weights, *dropout_masks)
    results = OPERATOR_GRAPHS.call(key, lambda: runtime.CapturedCall(  # copy_in: made once, at the capture
        run, flat, [True] * 4 + [key[-1] is None] * len(weights) + [True] * len(dropout_masks)), x.device.index, *flat)
    return results[0], results[1], results[2], results[3:]


def _forward_launches(spec: CellSpec, num_layers: int, bidirectional: bool, has_biases: bool, launch: Any,
                      x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None, weights: list[torch.Tensor],
                      dropout_masks: list[torch.Tensor], lengths: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """:func:`forward` launched op by op (``launch``: :func:`training_config`'s
    answer, or :data:`FALLBACK_FORWARD`; ``lengths`` int32 on ``x``'s device)."""
    directions = 2 if bidirectional else 1
    layers = ops.layer_params(weights, num_layers, directions, has_biases)
    steps, batch = x.shape[0], x.shape[1]
    hidden = layers[0][0]["w_hh"].shape[1]
    compute = _compute_dtype(x.dtype)
    step_runs = _step_runs(lengths, steps, compute)
    h0, c0 = _initial_states(spec, h0, c0, x, num_layers * directions, hidden)
    h_n, c_n = torch.empty_like(h0), (torch.empty_like(c0) if c0 is not None else x.new_empty(0))
    kept, outputs = [], []
    layer_input = x.contiguous()
    for layer in range(num_layers):
        out = x.new_empty(steps, batch, directions * hidden)
        for d in range(directions):
            i, p = layer * directions + d, layers[layer][d]
            if launch == FALLBACK_FORWARD:
                xw = persistent.input_projection(layer_input, p["w_ih"], p["b_ih"])
                gates = torch.empty_like(xw)
                cs = xw.new_empty(steps, batch, hidden) if c0 is not None else None
                # The step loop writes (T, B, H) rows: a direction of two writes its own, then its columns.
                own = out if directions == 1 else x.new_empty(steps, batch, hidden)
                fallback.run_fallback(spec, xw, p["w_hh"], p["b_hh"], h0[i], c0[i] if c0 is not None else None,
                                      out=own, h_n=h_n[i], c_n=c_n[i] if c0 is not None else None, reverse=d == 1,
                                      saved_gates=gates, saved_c=cs)
                if directions == 2:
                    out[:, :, d * hidden:(d + 1) * hidden] = own
            elif launch is not None:
                config, batch_slice = launch
                xw = persistent.input_projection(layer_input, p["w_ih"], p["b_ih"])
                gates = torch.empty_like(xw)
                cs = xw.new_empty(steps, batch, hidden) if c0 is not None else None
                persistent.run_instances(config, [persistent.Instance(
                    xw, p["w_hh"], p["b_hh"], h0[i], c0[i] if c0 is not None else None, out, h_n[i],
                    c_n[i] if c0 is not None else None, reverse=d == 1, out_column=d * hidden, saved_gates=gates,
                    saved_c=cs)], steps, batch, lengths=lengths, batch_slice=batch_slice, check=False)
            else:
                w = {k: v.to(compute) for k, v in p.items()}
                xw = torch.addmm(w["b_ih"], layer_input.reshape(steps * batch, -1).to(compute),
                                 w["w_ih"].T).view(steps, batch, -1)
                hs, gates, cs, h_n[i], c_last = direction_forward(
                    with_lengths(spec) if lengths is not None else spec, xw, w["w_hh"], w["b_hh"], h0[i].to(compute),
                    c0[i].to(compute) if c0 is not None else None, d == 1, step_runs)
                out[:, :, d * hidden:(d + 1) * hidden] = hs
                if cs is not None:
                    c_n[i] = c_last
            kept += [xw, gates] + ([cs] if cs is not None else [])
        if layer < num_layers - 1:
            outputs.append(out)
        layer_input = out * dropout_masks[layer] if dropout_masks and layer < num_layers - 1 else out
    return layer_input, h_n, c_n, kept + outputs


def backward(d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: torch.Tensor | None, x: torch.Tensor,
             h0: torch.Tensor | None, c0: torch.Tensor | None, weights: list[torch.Tensor], out: torch.Tensor,
             saved: list[torch.Tensor], cell: str, num_layers: int, bidirectional: bool, has_biases: bool,
             dropout_masks: list[torch.Tensor], lengths: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The training backward (the operator's implementation): from the
    gradients of (out, h_n, c_n) and what the forward kept, (dx, dh0, dc0
    (empty without a cell state), the gradient of every weight, in the
    weights' order and dtypes; ``h0`` None: the forward's zero states, whose
    gradient is computed all the same). With ``lengths`` (the forward's), the
    gradient of ``out`` past a sequence's length is not read: those outputs
    are zeros whatever the weights."""
    spec = get_cell(cell)
    lengths = None if lengths is None else ops.lengths_on_device(lengths, x.shape[0], x.shape[1], x.device)
    options = (spec, num_layers, bidirectional, has_biases)
    hidden = weights[1].shape[1]
    shape = None if lengths is None else _padded_shape(cell, num_layers, bidirectional, hidden, x)
    limit = _backward_capture_limit(spec, num_layers, bidirectional, hidden, x, lengths is None)
    if not _captures_operators(x, lengths, sum(t.numel() * t.element_size() for t in saved), shape, limit):
        return _backward_launches(*options, d_out, dh_n, dc_n, x, h0, c0, weights, out, saved, dropout_masks,
                                  lengths)
    counts = (len(weights), len(saved))

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        d_out, dh_n, dc_n, x, h0, c0, out, lengths, *rest = flat
        weights, saved, masks = rest[:counts[0]], rest[counts[0]:sum(counts)], rest[sum(counts):]
        dx, dh0, dc0, d_weights = _backward_launches(*options, d_out, dh_n, dc_n, x, h0, c0, weights, out, saved,
                                                     masks, lengths)
        return [dx, dh0, dc0, *d_weights]

    key = ("train_backward", *options, dc_n is None, len(saved), lengths is None,
           *_operator_key(x, h0, c0, weights, dropout_masks))
    flat = (d_out, dh_n, dc_n, x, h0, c0, out, lengths, *weights, *saved, *dropout_masks)
    results = OPERATOR_GRAPHS.call(key, lambda: runtime.CapturedCall(  # copy_in: made once, at the capture
        run, flat, [True] * 8 + [key[-1] is None] * len(weights) + [True] * (len(saved) + len(dropout_masks))),
        x.device.index, *flat)
    return results[0], results[1], results[2], results[3:]


def _backward_launches(spec: CellSpec, num_layers: int, bidirectional: bool, has_biases: bool, d_out: torch.Tensor,
                       dh_n: torch.Tensor, dc_n: torch.Tensor | None, x: torch.Tensor, h0: torch.Tensor,
                       c0: torch.Tensor | None, weights: list[torch.Tensor], out: torch.Tensor,
                       saved: list[torch.Tensor], dropout_masks: list[torch.Tensor], lengths: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`backward` launched op by op (``lengths`` int32 on ``x``'s device)."""
    directions = 2 if bidirectional else 1
    layers = ops.layer_params(weights, num_layers, directions, has_biases)
    hidden = layers[0][0]["w_hh"].shape[1]
    compute = _compute_dtype(x.dtype)
    per = 3 if spec.has_cell_state else 2
    outputs = saved[num_layers * directions * per:] + [out]
    per_weight = 4 if has_biases else 2
    d_weights: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
    h0, c0 = _initial_states(spec, h0, c0, x, num_layers * directions, hidden)
    dh0 = torch.empty(h0.shape, dtype=compute, device=h0.device)
    dc0 = torch.empty(c0.shape, dtype=compute, device=c0.device) if spec.has_cell_state else None
    step_runs = _step_runs(lengths, x.shape[0], compute)
    if step_runs is not None:
        spec = with_lengths(spec)
    d_layer_out = d_out.to(compute) if step_runs is None else d_out.to(compute) * step_runs[:, :, None]
    for layer in reversed(range(num_layers)):
        layer_input = x if layer == 0 else outputs[layer - 1] * dropout_masks[layer - 1] if dropout_masks else \
            outputs[layer - 1]
        layer_input = layer_input.to(compute)
        d_layer_input = None
        for d in range(directions):
            i, p = layer * directions + d, layers[layer][d]
            xw, gates = saved[i * per], saved[i * per + 1]
            cs = saved[i * per + 2] if spec.has_cell_state else None
            columns = slice(d * hidden, (d + 1) * hidden)
            d_xw, d_gates, d_w_hh, dh0[i], dc = direction_backward(
                spec, xw, gates, cs, outputs[layer][:, :, columns].to(compute), h0[i].to(compute),
                c0[i].to(compute) if cs is not None else None, p["w_hh"].to(compute), d_layer_out[:, :, columns],
                dh_n[i].to(compute), dc_n[i].to(compute) if cs is not None else None, d == 1, step_runs, x.dtype)
            if dc0 is not None:
                dc0[i] = dc
            flat = d_xw.reshape(-1, d_xw.shape[2])
            grads = [_product(flat.T, layer_input.reshape(flat.shape[0], -1), x.dtype), d_w_hh]
            if has_biases:
                grads += [flat.sum(0), d_gates.reshape(flat.shape).sum(0)]
            for k, grad in enumerate(grads):
                index = i * per_weight + k
                d_weights[index] = grad.to(weights[index].dtype)
            through = _product(flat, p["w_ih"].to(compute), x.dtype).view(layer_input.shape)
            d_layer_input = through if d_layer_input is None else d_layer_input + through
        d_layer_out = d_layer_input * dropout_masks[layer - 1].to(compute) if dropout_masks and layer else \
            d_layer_input
    return (d_layer_out.to(x.dtype), dh0.to(h0.dtype), dc0.to(c0.dtype) if dc0 is not None else x.new_empty(0),
            d_weights)


# A captured training forward holds its saved tensors and outputs, a
# captured backward its copies of them and the gradients: each about the
# activations of one step (LSTM 1024, T=100, batch 32, one layer: ~0.13 GB).
OPERATOR_GRAPHS = runtime.GraphCache(capacity=8)
"""Captured training forwards and backwards on CUDA (:func:`forward`,
:func:`backward`), one per (:func:`_operator_key` and the model, device,
stream), under the forward's rule (:data:`persistrnn.ops.GRAPHS`): a call
copies its tensors into the graph's inputs, replays it, and copies its
outputs into fresh tensors. Leaf weights (a module's parameters, whose
optimiser updates them in place) are read where they live, as the inference
graphs read them, and their addresses are in the key: a copy of LSTM 1024's
weights is 34 MB, twice a step."""


GRAPH_SAVED_BYTES = 32 << 20
"""The training operators capture a step only while what its forward saves
for the backward is at most this. The captured forward and backward hold
about ten times as much, per shape and across steps (their static copies of
the activations and the pools of what they compute: 344 MiB for the 35 MiB a
ReLU RNN 1152 saves at T=1000, batch 4; perf-notes §45); past the bound the
launches run as they come, and only what autograd keeps stays."""

STEP_LOOP_GRAPH_SAVED_BYTES = 128 << 20
"""The bound of :data:`GRAPH_SAVED_BYTES` for a backward whose layers do not
fit the persistent backward kernel (:func:`training_kernel.fits`) and so
step from the host, two launches per step (:func:`_fused_steps`), once its
shape repeats (:data:`STEP_LOOP_SHAPES`): there the launches, not the GPU,
set the time. At LSTM 1024, batch 32, T=100 (112 MiB saved) the uncaptured
backward took 9.6 ms of the host's time for 2.0 ms of the GPU's; captured,
the step took 3.04 ms against 7.40 (perf-notes §81).
Only the backward is captured past :data:`GRAPH_SAVED_BYTES`: its graph
holds static copies of what it reads (the saved list, x, out and d_out) and
the pool of what it computes, about five times the saved bytes (566 MiB
held across steps for the 112 MiB saved there, against 32 MiB launched);
a forward of one launch per layer and direction stays uncaptured past
:data:`GRAPH_SAVED_BYTES`, and one that steps from the host
(:data:`FALLBACK_FORWARD`) is captured under the same rule
(:data:`STEP_LOOP_FORWARDS`)."""

STEP_LOOP_SHAPES = runtime.RecentShapes(window=16, fits=2)
"""The recent shapes of backwards that step from the host. Such a graph
holds several hundred MiB, so one is captured only once its shape came
twice among the last 16 such calls, and only while those had at most two
shapes: a loader that changes the length or the batch from step to step
runs them uncaptured, and no more than a few of them are held at once."""


STEP_LOOP_FORWARDS = runtime.RecentShapes(window=16, fits=2)
""":data:`STEP_LOOP_SHAPES` for the training forwards that step from the host (:data:`FALLBACK_FORWARD`)."""


def _step_loop_limit(recent: runtime.RecentShapes, shape: tuple) -> int:
    """:data:`STEP_LOOP_GRAPH_SAVED_BYTES` once ``shape`` (noted here) repeats among ``recent``, else
    :data:`GRAPH_SAVED_BYTES`."""
    recent.note(shape)
    return STEP_LOOP_GRAPH_SAVED_BYTES if recent.repeats(shape) else GRAPH_SAVED_BYTES


def _backward_capture_limit(spec: CellSpec, num_layers: int, bidirectional: bool, hidden: int, x: torch.Tensor,
                            padded: bool) -> int:
    """The saved bytes up to which :func:`backward` replays a captured graph:
    :data:`STEP_LOOP_GRAPH_SAVED_BYTES` where the layers do not fit the
    persistent backward kernel and the shape repeats
    (:data:`STEP_LOOP_SHAPES`, noted here), else :data:`GRAPH_SAVED_BYTES`."""
    if not x.is_cuda or x.dtype == torch.float64 or training_kernel.fits(spec, hidden, x.shape[1], x.device.index):
        return GRAPH_SAVED_BYTES
    return _step_loop_limit(STEP_LOOP_SHAPES, (spec.name, num_layers, bidirectional, hidden, tuple(x.shape), x.dtype,
                                               padded, x.device.index))


def _initial_states(spec: CellSpec, h0: torch.Tensor | None, c0: torch.Tensor | None, x: torch.Tensor, count: int,
                    hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h0, c0 or None) contiguous, zeros (``count``, B, H) where ``h0`` is
    None: inside a capture, a fill in the graph rather than a launch of the
    caller's on every step (two tensor ops of ~40 µs of host time each on the
    H100's host, perf-notes §73)."""
    if h0 is None:
        h0 = x.new_zeros(count, x.shape[1], hidden)
        return h0, (torch.zeros_like(h0) if spec.has_cell_state else None)
    return h0.contiguous(), (c0.contiguous() if spec.has_cell_state else None)


PADDED_LENGTHS = runtime.RecentShapes(window=16, fits=OPERATOR_GRAPHS.capacity // 2)
"""The recent padded shapes of batches with lengths (packed batches), whose
padded length (the longest sequence) may change from batch to batch: such a
batch's step is captured once its shape repeats and the recent shapes' forward
and backward graphs fit :data:`OPERATOR_GRAPHS` (:class:`persistrnn.runtime.RecentShapes`),
so a loader that buckets by length replays graphs and one that draws every
length anew runs its launches as they come, not a capture per step."""


def _padded_shape(cell: str, num_layers: int, bidirectional: bool, hidden: int, x: torch.Tensor) -> tuple:
    return cell, num_layers, bidirectional, hidden, tuple(x.shape), x.dtype, x.device


def _captures_operators(x: torch.Tensor, lengths: torch.Tensor | None, saved_bytes: int, shape: tuple | None,
                        limit: int) -> bool:
    """Whether :func:`forward` and :func:`backward` replay a captured graph: on
    CUDA, outside a caller's capture, for a batch whose saved activations are
    at most ``limit`` bytes (:data:`GRAPH_SAVED_BYTES`, or for a backward
    that steps from the host :data:`STEP_LOOP_GRAPH_SAVED_BYTES`), without
    lengths or with a padded ``shape`` (given with lengths only) that
    :data:`PADDED_LENGTHS` says repeats."""
    return (x.is_cuda and saved_bytes <= limit and not torch.cuda.is_current_stream_capturing()
            and (lengths is None or PADDED_LENGTHS.repeats(shape)))


def _operator_key(x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None, weights: list[torch.Tensor],
                  dropout_masks: list[torch.Tensor]) -> tuple:
    """What a captured training operator fixes beside the model: shapes and
    dtypes, the masks' count, the launch and GEMM settings, and the weights'
    addresses where the graph reads them in place (:func:`_reads_in_place`;
    every other tensor's address and value is not in it: the graph reads
    copies). The addresses come last, None where the weights are copied."""
    return (x.shape, x.dtype, None if h0 is None else h0.shape, c0 is None,
            tuple((w.shape, w.dtype) for w in weights), len(dropout_masks),
            ops.launch_settings(),
            tuple(w.data_ptr() for w in weights) if _reads_in_place(weights) else None)


def _reads_in_place(weights: list[torch.Tensor]) -> bool:
    """Whether the captured operators read ``weights`` where they live:
    trainable leaf tensors (parameters, which keep their storage across
    optimiser steps). Others (autocast's casts, made anew each call; the
    tensors torch.compile's runtime passes, with gradients off) are copied,
    or a call could capture a graph of its own."""
    return all(w.is_leaf and w.requires_grad for w in weights)


# ---- persistrnn's training step or cuDNN's: timed once per shape ----------------------

TORCH_TRAINING_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
"""The cells torch trains with cuDNN (``torch._VF.<cell>``); the reset-before GRU has no cuDNN peer."""

_TRAINING_CHOICES: dict[tuple, bool] = {}
_CHOICE_LOCK = threading.Lock()  # one timing at a time: two at once would each time the other's work too
_FORGET_LOCK = threading.Lock()  # a plan change's clear against a finished timing's store of its choice
_plans_generation = 0  # plan changes so far: a timing that spans one keeps no choice


def _forget_training_choices() -> None:
    """Our side of each choice ran the training forward the plans gave: a
    retuned shape is timed again, and a timing running meanwhile keeps nothing."""
    global _plans_generation
    with _FORGET_LOCK:
        _plans_generation += 1
        _TRAINING_CHOICES.clear()  # the module's dict at that time (tests swap it)


tuner.on_plans_changed(_forget_training_choices)


def cudnn_trains_faster(module: Any, x: torch.Tensor) -> bool:
    """Whether ``module``'s training step on ``x`` (T, B, I, time-major) runs
    torch's implementation (cuDNN) because it measured faster than the
    training operators: timed once per (model, dtype, B, T rounded up to a
    power of two, device, cuDNN RNNs' and torch's matmul fp32 precisions)
    on first use, both steps (forward and backward of the output's sum) on
    random inputs with the module's weights, in 5
    interleaved rounds after a warm-up to steady clocks, and logged at INFO.
    Never where determinism is asked for (``torch.use_deterministic_algorithms``:
    cuDNN's RNN gradients are not bit-reproducible), where cuDNN is off or
    has no such cell, under autocast, or while tracing; nor, untimed and
    with no choice kept, for a call on one of autograd's threads while
    another thread times."""
    if (not x.is_cuda or module.cell not in TORCH_TRAINING_CELLS or torch.are_deterministic_algorithms_enabled()
            or not torch.backends.cudnn.enabled or torch.is_autocast_enabled("cuda") or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return False
    steps, batch = x.shape[0], x.shape[1]
    # Each side's speed depends on its fp32 precision: cuDNN's RNNs' own, and the matmuls' for ours (TF32 plans).
    key = (module.cell, module.input_size, module.hidden_size, module.num_layers, bool(module.bidirectional),
           bool(module.bias), x.dtype, batch, 1 << (steps - 1).bit_length(), x.device.index,
           runtime.cudnn_rnn_precision(), runtime.matmul_allows_tf32())
    choice = _TRAINING_CHOICES.get(key)
    if choice is not None:
        return choice
    # Threads training a new shape at once wait for one timing and take its choice. Never on one of autograd's
    # threads (a backward that recomputes a forward, e.g. reentrant checkpointing): the timing thread's own
    # backward may need that thread, so waiting there could deadlock; such a call runs the operators untimed.
    if not _CHOICE_LOCK.acquire(blocking=torch._C._current_graph_task_id() == -1):
        return False
    try:
        choice = _TRAINING_CHOICES.get(key)
        if choice is not None:
            return choice
        generation = _plans_generation
        ours_ms, cudnn_ms = _time_training_steps(module, x)
        choice = cudnn_ms < ours_ms
        with _FORGET_LOCK:
            if generation == _plans_generation:  # else our side was timed on plans since cleared or pinned
                _TRAINING_CHOICES[key] = choice
        logger.info("training %s %d->%d x%d%s, %s, batch %d, T=%d: persistrnn %.3f ms, cuDNN %.3f ms per step; "
                    "runs %s", module.cell, module.input_size, module.hidden_size, module.num_layers,
                    " bidirectional" if module.bidirectional else "", str(x.dtype).removeprefix("torch."), batch,
                    steps, ours_ms, cudnn_ms, "cuDNN" if choice else "persistrnn")
    finally:
        _CHOICE_LOCK.release()
    return choice


def _time_training_steps(module: Any, x: torch.Tensor) -> tuple[float, float]:
    """(persistrnn's, cuDNN's) ms per training step of ``module`` on inputs of ``x``'s shape and dtype."""
    directions = 2 if module.bidirectional else 1
    # Its own generator: the caller's random stream (dropout masks, its own draws) is left where it was.
    generator = torch.Generator(device=x.device).manual_seed(0)
    inputs = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator, requires_grad=True)
    h0 = x.new_zeros(module.num_layers * directions, x.shape[1], module.hidden_size)
    has_c = get_cell(module.cell).has_cell_state
    weights = [w.detach().requires_grad_() for w in module._flat_weights]  # their gradients stay here
    options = (module.num_layers, bool(module.bidirectional), bool(module.bias))

    def ours() -> None:
        out = train_step(inputs, h0, h0 if has_c else None, weights, module.cell, *options, [])[0]
        torch.autograd.grad(out.sum(), [inputs, *weights])

    def cudnn() -> None:
        out = getattr(torch._VF, module.cell)(inputs, (h0, h0) if has_c else h0, weights, options[2], options[0],
                                              0.0, True, options[1], False)[0]
        torch.autograd.grad(out.sum(), [inputs, *weights])

    started = time.perf_counter()
    runtime.warm_up(ours)
    runtime.warm_up(cudnn)
    rounds = [(runtime.time_cuda_ms(ours, warmup=0, repeats=1), runtime.time_cuda_ms(cudnn, warmup=0, repeats=1))
              for _ in range(5)]
    logger.debug("timing the training steps took %.2f s", time.perf_counter() - started)
    return tuple(statistics.median(r[i] for r in rounds) for i in (0, 1))  # type: ignore[return-value]


def run_module(module: Any, x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None,
               weights: list[torch.Tensor] | None = None,
               lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A persistrnn module's training call through the operators: ``x``
    (T, B, I) time-major, ``h0``/``c0`` (L*D, B, H) or None for zeros,
    ``weights`` the module's flat weights (default) or differentiable casts
    of them to ``x``'s dtype (autocast), ``lengths`` (B,) on the CPU for a
    padded batch of sequences (:func:`forward`). Returns (out, h_n, c_n or
    None), differentiable."""
    masks = dropout_masks(module.dropout if module.training else 0.0, module.num_layers,
                          (x.shape[0], x.shape[1], (2 if module.bidirectional else 1) * module.hidden_size), x)
    weights = list(module._flat_weights if weights is None else weights)
    return train_step(x, h0, c0, weights, module.cell, module.num_layers, module.bidirectional, module.bias, masks,
                      lengths)


def dropout_masks(p: float, num_layers: int, shape: tuple[int, int, int], like: torch.Tensor) -> list[torch.Tensor]:
    """Dropout between layers with torch's semantics (``nn.LSTM(dropout=p)``
    in training mode): one mask per layer but the last, each element 0 with
    probability ``p`` and else ``1 / (1 - p)``, drawn from torch's generator
    by ``torch.nn.functional.dropout``. None (an empty list) for ``p`` 0 or
    one layer."""
    if not p or num_layers < 2:
        return []
    ones = torch.ones(shape, dtype=like.dtype, device=like.device)
    return [torch.nn.functional.dropout(ones, p, training=True) for _ in range(num_layers - 1)]


def _step_runs(lengths: torch.Tensor | None, steps: int, dtype: torch.dtype) -> torch.Tensor | None:
    """(T, B) in ``dtype`` on the lengths' device: 1 where sequence b runs
    position t (t < its length), else 0; None without lengths."""
    if lengths is None:
        return None
    return (torch.arange(steps, device=lengths.device)[:, None] < lengths[None, :]).to(dtype)


def _check_masks(masks: list[torch.Tensor], num_layers: int, shape: tuple[int, int, int], x: torch.Tensor) -> None:
    if not masks:
        return
    if len(masks) != num_layers - 1:
        raise ArgumentError(f"dropout_masks: expected none or {num_layers - 1} (one per layer but the last), "
                            f"got {len(masks)}")
    for m in masks:
        if m.dtype != x.dtype:  # a type error, as check_tensor's (torch's convention)
            raise ArgumentTypeError(f"dropout_masks: expected {x.dtype} tensors (x's dtype), got {m.dtype}")
        if tuple(m.shape) != shape or m.device != x.device:
            raise ArgumentError(f"dropout_masks: expected {shape} tensors on {x.device}, got "
                                f"{tuple(m.shape)} on {m.device}")


# ---- the operators -------------------------------------------------------------------

# Defined with torch.library's low-level registration, as persistrnn::forward
# is (persistrnn/ops.py says why); that module defines the namespace.
_LIBRARY = torch.library.Library("persistrnn", "FRAGMENT")
_LIBRARY.define("train_forward(Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
                "bool bidirectional, bool has_biases, Tensor[] dropout_masks, Tensor? lengths) "
                "-> (Tensor, Tensor, Tensor, Tensor[])")
_LIBRARY.define("train_backward(Tensor d_out, Tensor dh_n, Tensor? dc_n, Tensor x, Tensor? h0, Tensor? c0, "
                "Tensor[] weights, Tensor out, Tensor[] saved, str cell, int num_layers, bool bidirectional, "
                "bool has_biases, Tensor[] dropout_masks, Tensor? lengths) -> (Tensor, Tensor, Tensor, Tensor[])")


def _operator(implementation: Callable[..., Any]) -> Callable[..., Any]:
    """An operator's implementation run on its first tensor's device and with
    CUDA autocast off: it chooses its own dtypes (fp32 accumulation), which
    autocast would round to 16 bits in its GEMMs when a caller's autocast
    region is still active."""
    @functools.wraps(implementation)
    def run(*args: Any) -> Any:
        if (device := runtime.elsewhere(args[0])) is not None:
            with torch.cuda.device(device):  # tensors on another GPU than the current one
                return run(*args)
        if not torch.is_autocast_enabled("cuda"):  # the common case: no context to enter (µs a call)
            return implementation(*args)
        with torch.autocast("cuda", enabled=False):
            return implementation(*args)
    return run


for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("train_forward", _operator(forward), _key)
    _LIBRARY.impl("train_backward", _operator(backward), _key)


@torch.library.register_fake("persistrnn::train_forward")
def _(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, dropout_masks, lengths):
    spec = get_cell(cell)
    directions = 2 if bidirectional else 1
    hidden = weights[1].shape[1]
    compute = _compute_dtype(x.dtype)
    saved = [x.new_empty(shape, dtype=compute if in_compute else x.dtype)
             for shape, in_compute in saved_shapes(spec, x.shape[0], x.shape[1], hidden, num_layers, directions)]
    # Contiguous, as the implementation makes them whatever the inputs' strides (an inference of them from a
    # transposed input, as empty_like gives, failed inductor's stride asserts on a batch_first model).
    h_n = x.new_empty(num_layers * directions, x.shape[1], hidden)
    c_n = x.new_empty(h_n.shape) if spec.has_cell_state else x.new_empty(0)
    return x.new_empty(x.shape[0], x.shape[1], directions * hidden), h_n, c_n, saved


@torch.library.register_fake("persistrnn::train_backward")
def _(d_out, dh_n, dc_n, x, h0, c0, weights, out, saved, cell, num_layers, bidirectional, has_biases, dropout_masks,
      lengths):
    # Contiguous, as the implementation makes them (see train_forward's)
    dh0 = dh_n.new_empty(dh_n.shape if h0 is None else h0.shape)
    dc0 = dh0.new_empty(dh0.shape) if get_cell(cell).has_cell_state else x.new_empty(0)
    return x.new_empty(x.shape), dh0, dc0, [w.new_empty(w.shape) for w in weights]


class _TrainingStep(torch.autograd.Function):
    """The operators joined for autograd: the forward operator, whose saved
    list stays in the context, and the backward operator. A plain
    ``autograd.Function`` rather than ``torch.library.register_autograd``:
    the latter's Python around each call (pytree over the ~20 tensors of the
    arguments and outputs) measured ~0.1-0.2 ms of host time per training
    step, 10-15% of a small step. ``torch.compile`` traces it, both operators
    included, without a graph break."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None,
                lengths: torch.Tensor | None, options: tuple, weight_count: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, masks = list(tensors[:weight_count]), list(tensors[weight_count:])
        out, h_n, c_n, saved = torch.ops.persistrnn.train_forward(x, h0, c0, weights, *options, masks, lengths)
        has_c = get_cell(options[0]).has_cell_state
        ctx.options, ctx.layout = options, (weight_count, len(saved), has_c)
        ctx.save_for_backward(x, h0, c0, out, lengths, *weights, *saved, *masks)
        if not has_c:
            ctx.mark_non_differentiable(c_n)  # empty: the cell has no cell state
        return out, h_n, c_n

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: torch.Tensor) -> tuple:
        # An output no loss reached comes as zeros (autograd materialises them).
        x, h0, c0, out, lengths, *rest = ctx.saved_tensors
        weight_count, saved_count, has_c = ctx.layout
        weights, saved = rest[:weight_count], rest[weight_count:weight_count + saved_count]
        masks = rest[weight_count + saved_count:]
        args = (d_out, dh_n, dc_n if has_c else None, x, h0, c0, list(weights), out, list(saved), *ctx.options,
                list(masks), lengths)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            # create_graph: through the operator's autograd, so that a second backward raises (and a traced
            # backward calls the operator as it is)
            dx, dh0, dc0, d_weights = torch.ops.persistrnn.train_backward(*args)
        else:  # a plain backward: past the autograd wrapper, whose Python costs tens of µs a step
            with torch._C._AutoDispatchBelowAutograd():
                dx, dh0, dc0, d_weights = torch.ops.persistrnn.train_backward(*args)
        # zero initial states (h0 None) were made by the operators: no gradient leaves for them
        return (dx, dh0 if h0 is not None else None, dc0 if c0 is not None else None, None, None, None,
                *d_weights, *[None] * len(masks))


def train_step(x: torch.Tensor, h0: torch.Tensor | None, c0: torch.Tensor | None, weights: list[torch.Tensor],
               cell: str, num_layers: int, bidirectional: bool, has_biases: bool, dropout_masks: list[torch.Tensor],
               lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The training forward, differentiable: (out (T, B, D*H), h_n, c_n or
    None), arguments as ``torch.ops.persistrnn.train_forward``'s (:func:`forward`;
    ``h0`` None for zero initial states);
    ``loss.backward()`` runs ``torch.ops.persistrnn.train_backward``. The
    operators themselves carry no autograd: this is the way in."""
    out, h_n, c_n = _TrainingStep.apply(x, h0, c0, lengths, (cell, num_layers, bidirectional, has_biases),
                                        len(weights), *weights, *dropout_masks)
    return out, h_n, (c_n if get_cell(cell).has_cell_state else None)


def _no_double_backward(ctx: Any, *grads: Any) -> tuple:
    raise UnsupportedError(
        "persistrnn's RNN backward is not differentiable (double backward, e.g. a gradient penalty, is not "
        "implemented). Run that model with torch's own module (torch.nn.LSTM/GRU/RNN, or "
        "persistrnn.nn.torch_forward for GRU(reset_after=False)), whose backward is made of differentiable ops")


torch.library.register_autograd("persistrnn::train_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
