"""The non-persistent path: cuBLAS GEMMs per step, fused pointwise kernels,
the step loop replayed as a CUDA graph.

The persistent kernel (:mod:`persistrnn.persistent`) keeps W_hh on chip for
the whole sequence. When it cannot, the planner sends the layer here:

* the weights do not fit in the registers and shared memory of the blocks
  that can run at once (an fp32 LSTM with H=4096 has 256 MB of W_hh, against
  about 64 MB of registers and shared memory on an H100);
* the blocks a configuration needs cannot all be co-resident (another
  process holds SMs, or the register and shared-memory budget per block
  leaves too few blocks per SM for a grid barrier to be safe).

It follows the cuDNN 5 recipe (``../shared/seeds/cudnn5-rnn-optimizations-blog.txt``):

1. the input projection of all steps is one GEMM (:func:`persistent.input_projection`),
   done by the caller, who passes ``xw`` exactly as to :func:`persistent.run_recurrence`;
2. per step, the recurrent GEMMs of all gates are combined: one ``torch.addmm``
   per cell *stage* (one for LSTM, GRU and RNN; two for the reset-before GRU,
   whose n rows multiply ``r * h``), written into preallocated fp32 buffers;
3. the cell's pointwise math is one fused kernel per step (and one more per
   extra stage, writing the next stage's operand), generated from the
   :class:`~persistrnn.cells.CellSpec` by the same renderer as the persistent
   kernel's (:func:`persistrnn.cells.render_pointwise_functions`);
4. the T-step loop runs eagerly here; the modules capture the whole forward
   once per shape and stream (:mod:`persistrnn.ops`) and replay it, so a call
   costs one graph launch instead of 2T+ launches from Python.

The blog's streams (overlapping the input and recurrent GEMMs) are not needed:
the input GEMM of every step runs before the loop. The layer wavefront is
for a multi-layer driver, not this one-layer path. W_hh is not pre-transposed:
torch hands cuBLAS the transposed view ``W_hh[rows].t()`` without a copy.

Public API: :func:`run_fallback` (on precomputed ``xw``),
:func:`fallback_forward_layer` (input projection included),
:func:`pointwise_source` and :func:`compile_pointwise` (no GPU needed with
``arch="sm_90"``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from . import persistent, runtime
from .checks import check_recurrence, check_tensor
from .cells import CellSpec, get_cell, render_pointwise_functions
from .errors import ArgumentError, ArgumentTypeError

__all__ = [
    "compile_pointwise",
    "fallback_forward_layer",
    "hg_index",
    "pointwise_source",
    "run_fallback",
    "stage_layout",
    "stage_products",
    "stage_rows",
]

POINTWISE_KERNEL = "prnn_fallback_pointwise"
BETWEEN_KERNEL = "prnn_fallback_between"
THREADS = 256  # per block of the pointwise kernels; one thread per (batch row, hidden unit)
_INDEX_LIMIT = 2**31  # the kernels index one step's (B, G*H) gates with int


# ----------------------------------------------------------------------------
# Source
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def stage_layout(cell: str | CellSpec) -> tuple[tuple[int, int], ...]:
    """(first gate, gate count) of each stage; rows ``first*H .. (first+count)*H``
    of W_hh are the stage's one GEMM.

    Raises ValueError for a cell whose stages this path cannot run.
    """
    spec = get_cell(cell)
    layout = []
    for stage in spec.stages:
        first = spec.gates.index(stage[0])
        if tuple(spec.gates[first : first + len(stage)]) != tuple(stage):
            # One GEMM per stage needs the stage's rows of W_hh to be one slice.
            raise ArgumentError(f"cell {spec.name}: the fallback needs each stage's gates consecutive in W_hh's rows, "
                                f"got stage {stage} of gates {spec.gates}")
        layout.append((first, len(stage)))
    if len(layout) > 2:
        # prnn_between(k) renders only between_stages[k]; a third stage's
        # statements could read names assigned by the block before.
        raise ArgumentError(f"cell {spec.name}: the fallback runs at most 2 stages, got {len(layout)}")
    return tuple(layout)


def hg_index(cell: str | CellSpec, gate: int, b: int, j: int, hidden: int, batch: int) -> int:
    """Where the stage GEMMs leave gate ``gate``'s product for batch row ``b``,
    unit ``j``: stage k's (B, count*H) output starts at element B*H*first.
    The kernels' generated ``prnn_hg_index`` is rendered from these terms."""
    for first, count in stage_layout(cell):
        if first <= gate < first + count:
            return batch * hidden * first + b * count * hidden + (gate - first) * hidden + j
    raise ArgumentError(f"gate: expected 0..{get_cell(cell).num_gates - 1}, got {gate}")


def stage_rows(cell: str | CellSpec, hidden: int) -> list[slice]:
    """Per stage, its rows of W_hh and b_hh."""
    return [slice(first * hidden, (first + count) * hidden) for first, count in stage_layout(cell)]


def stage_products(cell: str | CellSpec, hg: Any, batch: int, hidden: int) -> list[Any]:
    """Per stage, the (B, count*H) view of the flat product buffer ``hg`` its
    GEMM writes: the layout :func:`hg_index` describes."""
    return [hg[batch * hidden * first : batch * hidden * (first + count)].view(batch, count * hidden)
            for first, count in stage_layout(cell)]


def _render_hg_index(spec: CellSpec) -> str:
    terms = []
    for first, count in stage_layout(spec):
        for gate in range(first, first + count):
            terms.append((gate, f"B * H * {first} + b * ({count} * H) + {gate - first} * H + j"))
    body = " : ".join(f"gate == {g} ? {expr}" for g, expr in terms[:-1])
    body = (body + " : " if body else "") + terms[-1][1]
    # Called with a compile-time gate (an unrolled loop), so the chain folds away.
    return ("__device__ __forceinline__ int prnn_hg_index(int gate, int b, int j, int H, int B) {\n"
            f"    return {body};\n}}")


def _check_dtype(dtype: str) -> str:
    if dtype not in persistent.DTYPES:
        raise ArgumentError(f"dtype: expected one of {persistent.DTYPES}, got {dtype!r}")
    return dtype


def pointwise_source(cell: str | CellSpec, dtype: str) -> str:
    """The complete CUDA source of ``cell``'s pointwise kernels in ``dtype``:
    defines, ``common.cuh``, the generated cell math, ``kernels/pointwise.cu``."""
    spec = get_cell(cell)
    _check_dtype(dtype)
    defines = {
        "PRNN_G": spec.num_gates,
        "PRNN_HAS_C": int(spec.has_cell_state),
        "PRNN_STAGES": len(stage_layout(spec)),
        "PRNN_IO_T": persistent.DEVICE_TYPES[dtype],
        "PRNN_THREADS": THREADS,
    }
    # The generated functions call prnn_sigmoid etc. from common.cuh, which
    # read_source puts first, and are called by the kernels after the marker.
    generated = [_render_hg_index(spec), render_pointwise_functions(spec)]
    return runtime.render_template("pointwise.cu", title=f"fallback pointwise kernels: cell {spec.name}, dtype {dtype}",
                                   defines=defines, marker="// ---- kernels ----",
                                   generated="\n".join(generated) + "\n", keep_marker=True)


@functools.lru_cache(maxsize=64)
def compile_pointwise(cell: str | CellSpec, dtype: str, arch: str | None = None) -> runtime.CompiledBinary:
    """NVRTC-compile (disk-cached) ``cell``'s pointwise kernels in ``dtype``;
    ``arch=None`` is the current device's."""
    spec = get_cell(cell)
    name = "pointwise_" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name) + "_" + _check_dtype(dtype)
    return runtime.compile_source(name, pointwise_source(spec, dtype), arch=arch)


# ----------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Kernels:
    pointwise: runtime.LoadedKernel
    between: runtime.LoadedKernel | None
    launch: Any  # LaunchConfig covering batch * hidden threads


@functools.lru_cache(maxsize=256)
def _kernels(spec: CellSpec, dtype: str, device: int, threads: int) -> _Kernels:
    """Loaded kernels and launch configuration, once per (cell, dtype, device, B*H)."""
    binary = compile_pointwise(spec, dtype)
    pointwise = runtime.get_kernel(binary, POINTWISE_KERNEL)
    between = runtime.get_kernel(binary, BETWEEN_KERNEL) if spec.num_stages > 1 else None
    return _Kernels(pointwise, between, pointwise.config(-(-threads // THREADS), THREADS))


@dataclasses.dataclass
class _Work:
    """Per-run scratch: fp32 states, the stage products, the staged operand."""

    h: Any  # (B, H) fp32
    c: Any | None  # (B, H) fp32, cells with a cell state
    hg: Any  # (B*G*H,) fp32 stage products, laid out as hg_index says
    operand: Any | None  # (B, H) layer dtype: the second stage's A matrix
    bias: Any | None  # (G*H,) fp32 copy of a 16-bit b_hh

    @classmethod
    def allocate(cls, spec: CellSpec, batch: int, hidden: int, dtype: Any, device: Any) -> _Work:
        import torch

        def f32(*shape: int) -> Any:
            # zeros, not empty: the between-stage kernel loads (and drops)
            # later stages' products, which must not be uninitialised reads.
            return torch.zeros(shape, dtype=torch.float32, device=device)

        G = spec.num_gates
        return cls(
            h=f32(batch, hidden),
            c=f32(batch, hidden) if spec.has_cell_state else None,
            hg=f32(batch * G * hidden),
            operand=torch.zeros(batch, hidden, dtype=dtype, device=device) if spec.num_stages > 1 else None,
            bias=f32(G * hidden) if dtype != torch.float32 else None,
        )


def _run_steps(spec: CellSpec, kernels: _Kernels, xw: Any, w_hh: Any, b_hh: Any, h0: Any, c0: Any | None,
               work: _Work, out: Any, h_n: Any, c_n: Any | None, reverse: bool = False, saved_gates: Any = None,
               saved_c: Any = None) -> None:
    """Every step of one layer on the current stream: per step, one GEMM per
    stage and one pointwise kernel per stage. Eager, or under capture.
    ``reverse``: the positions last to first. ``saved_gates``,
    ``saved_c``: the pointwise kernel also writes step t's stage products
    into ``saved_gates[t]`` (B, G*H) and c_t into ``saved_c[t]``, reading
    c_{t-1} from the position before."""
    import numpy as np
    import torch

    T, B, GH = xw.shape
    H = GH // spec.num_gates
    work.h.copy_(h0)
    if spec.has_cell_state:
        work.c.copy_(c0)
    if work.bias is not None:
        work.bias.copy_(b_hh)  # exact: a 16-bit value is an fp32 value
        bias = work.bias
    else:
        bias = b_hh
    # The addmm bias must be fp32 for an fp32 output from 16-bit operands
    # (as in persistent.input_projection); fp32 accumulation either way.
    gemm_kwargs = {} if w_hh.dtype == torch.float32 else {"out_dtype": torch.float32}
    stages = [(bias[rows], w_hh[rows].t(), product)
              for rows, product in zip(stage_rows(spec, H), stage_products(spec, work.hg, B, H))]

    ptr = np.uint64
    n_h, n_b = np.int32(H), np.int32(B)
    xw_ptr, xw_step = xw.data_ptr(), B * GH * xw.element_size()
    out_ptr, out_step = out.data_ptr(), B * H * out.element_size()
    h_ptr, hg_ptr = ptr(work.h.data_ptr()), ptr(work.hg.data_ptr())
    c_ptr = ptr(work.c.data_ptr() if work.c is not None else 0)
    c_in = c_out = c_ptr
    c_step, gates_step = B * H * 4, B * GH * 4  # saved_c and saved_gates are fp32
    positions = range(T - 1, -1, -1) if reverse else range(T)
    for n, t in enumerate(positions):
        xw_t = ptr(xw_ptr + t * xw_step)
        operand = h0 if n == 0 else out[t + 1 if reverse else t - 1]
        for k, (stage_bias, weight, product) in enumerate(stages):
            if k:
                runtime.launch(kernels.between, kernels.launch, xw_t, hg_ptr, h_ptr, ptr(work.operand.data_ptr()),
                               np.int32(k - 1), n_h, n_b)
                operand = work.operand
            torch.addmm(stage_bias, operand, weight, out=product, **gemm_kwargs)
        if saved_c is not None:
            c_in, c_out = c_out, ptr(saved_c.data_ptr() + t * c_step)
        gates_t = ptr(saved_gates.data_ptr() + t * gates_step if saved_gates is not None else 0)
        runtime.launch(kernels.pointwise, kernels.launch, xw_t, hg_ptr, h_ptr, c_in, c_out,
                       ptr(out_ptr + t * out_step), gates_t, n_h, n_b)
    last = positions[-1]
    h_n.copy_(out[last])
    if spec.has_cell_state:
        c_n.copy_(work.c if saved_c is None else saved_c[last])  # rounds to nearest, like the kernels' cvt.rn


def run_fallback(
    cell: str | CellSpec,
    xw: Any,
    w_hh: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None,
    *,
    out: Any | None = None,
    h_n: Any | None = None,
    c_n: Any | None = None,
    reverse: bool = False,
    saved_gates: Any | None = None,
    saved_c: Any | None = None,
) -> tuple[Any, Any, Any | None]:
    """Run the recurrence on precomputed input projections, non-persistently.

    Args:
        cell: a name in :data:`persistrnn.cells.CELLS`, or a CellSpec.
        xw: (T, B, G*H) float32 CUDA tensor, ``x @ W_ih^T + b_ih``.
        w_hh: (G*H, H); its dtype (float32, float16 or bfloat16) is the
            layer's. b_hh: (G*H,); h0, c0: (B, H); all of the layer's dtype.
            c0 is None for cells without a cell state.
        out, h_n, c_n: optional destinations, (T, B, H) and (B, H).
        reverse: run the positions last to first (a reverse direction:
            ``out[t]`` is still position t's output).
        saved_gates, saved_c: what a training forward keeps for the backward
            (:mod:`persistrnn.training`), as the persistent kernel's
            ``save_gates`` writes them: (T, B, G*H) fp32, every gate's
            recurrent product with ``b_hh`` (a later stage's of its operand,
            e.g. ``r * h``), and (T, B, H) fp32, the cell state after each
            position (cells with one). Both or neither.

    Returns (output (T, B, H), h_n (B, H), c_n (B, H) or None), fresh
    tensors unless destinations were given. The step loop launches 2T+
    kernels from Python: the modules replay it from a CUDA graph
    (:mod:`persistrnn.ops`), and inside a caller's capture it becomes part of
    the caller's graph.
    """
    import torch

    spec = get_cell(cell)
    stage_layout(spec)
    G = spec.num_gates
    if not isinstance(w_hh, torch.Tensor):
        raise ArgumentTypeError(f"w_hh: expected a torch.Tensor, got {type(w_hh).__name__}")
    if (device := runtime.elsewhere(w_hh)) is not None:  # a layer on another GPU than the current one
        with torch.cuda.device(device):
            return run_fallback(spec, xw, w_hh, b_hh, h0, c0, out=out, h_n=h_n, c_n=c_n, reverse=reverse,
                                saved_gates=saved_gates, saved_c=saved_c)
    dtypes = tuple(getattr(torch, d) for d in persistent.DTYPES)
    if w_hh.dtype not in dtypes:
        raise ArgumentTypeError(f"w_hh: expected the layer's dtype, one of {', '.join(map(str, dtypes))}, "
                                f"got {w_hh.dtype}")
    if w_hh.dim() != 2 or w_hh.shape[0] != G * w_hh.shape[1]:
        raise ArgumentError(f"w_hh: expected shape ({G} * H, H) for cell {spec.name}, got {tuple(w_hh.shape)}")
    dtype, H = w_hh.dtype, w_hh.shape[1]
    if not spec.has_cell_state and c_n is not None:
        raise ArgumentError(f"cell {spec.name} has no cell state: expected c_n=None, got a tensor")
    T, B = check_recurrence(spec, xw, w_hh, b_hh, h0, c0, H, dtype)
    if B * G * H >= _INDEX_LIMIT:
        raise ArgumentError(f"expected batch * {G} * hidden below 2**31 (the kernels' int indices), got {B * G * H}")
    for name, given, shape in (("out", out, (T, B, H)), ("h_n", h_n, (B, H)), ("c_n", c_n, (B, H))):
        if given is not None:
            check_tensor(name, given, shape, xw.device, dtype)
    if saved_gates is not None or saved_c is not None:
        if saved_gates is None or (saved_c is not None) != spec.has_cell_state:
            wanted = "saved_gates and saved_c" if spec.has_cell_state else "saved_gates alone (no cell state)"
            raise ArgumentError(f"saved_gates, saved_c: expected {wanted} for cell {spec.name}, got saved_gates "
                                f"{'None' if saved_gates is None else 'a tensor'} and saved_c "
                                f"{'None' if saved_c is None else 'a tensor'}")
        check_tensor("saved_gates", saved_gates, (T, B, G * H), xw.device, torch.float32)
        if saved_c is not None:
            check_tensor("saved_c", saved_c, (T, B, H), xw.device, torch.float32)

    kernels = _kernels(spec, persistent.DTYPES[dtypes.index(dtype)], xw.device.index, B * H)
    out = torch.empty(T, B, H, dtype=dtype, device=xw.device) if out is None else out
    h_n = torch.empty(B, H, dtype=dtype, device=xw.device) if h_n is None else h_n
    if spec.has_cell_state and c_n is None:
        c_n = torch.empty(B, H, dtype=dtype, device=xw.device)
    work = _Work.allocate(spec, B, H, dtype, xw.device)
    _run_steps(spec, kernels, xw, w_hh, b_hh, h0, c0, work, out, h_n, c_n, reverse, saved_gates, saved_c)
    return out, h_n, (c_n if spec.has_cell_state else None)


def fallback_forward_layer(
    cell: str | CellSpec,
    x: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None = None,
) -> tuple[Any, Any, Any | None]:
    """One layer, one direction: :func:`persistent.input_projection`, then
    :func:`run_fallback`. ``x`` is (T, B, I) of the layer's dtype."""
    return run_fallback(cell, persistent.input_projection(x, w_ih, b_ih), w_hh, b_hh, h0, c0)


def forward_model(cell: str | CellSpec, layers: list[list[dict[str, Any]]], x: Any, h0: Any,
                  c0: Any | None) -> tuple[Any, Any, Any | None]:
    """A whole model on the fallback, with the arguments and results of
    :func:`persistrnn.persistent.forward_model`. A reverse direction steps
    from the last position to the first (``run_fallback``'s ``reverse``), on
    the layer's input as it is: no flipped copies of it or of its output."""
    import torch

    spec = get_cell(cell) if isinstance(cell, str) else cell
    D = len(layers[0])
    layer_input, h_n, c_n = x, [], []
    for l, directions in enumerate(layers):
        outputs = []
        for d, p in enumerate(directions):
            i = l * D + d
            xw = persistent.input_projection(layer_input, p["w_ih"], p["b_ih"])
            out, h, c = run_fallback(spec, xw, p["w_hh"], p["b_hh"], h0[i].contiguous(),
                                     c0[i].contiguous() if spec.has_cell_state else None, reverse=d == 1)
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        layer_input = torch.cat(outputs, dim=2) if D == 2 else outputs[0]
    return layer_input, torch.stack(h_n), (torch.stack(c_n) if spec.has_cell_state else None)
