"""The persistent backward kernel: one layer direction's backward recurrence
(backpropagation through time) in one launch, with W_hh on chip.

:func:`persistent_steps` is :func:`persistrnn.training._fused_steps` (same
arguments, same results to fp32 rounding) in fp32: instead of one generated
pointwise kernel and one GEMM per step and stage, one launch of
:attr:`BackwardKernelConfig.blocks` blocks runs every step
(``kernels/step_backward_persistent.cu`` says how): one cluster where the
layer's W_hh fits a cluster's shared memory, else a cooperative grid of up
to one block per SM, whose blocks exchange through global memory (L2) and
wait at a counter barrier bounded by the wait timeout
(:func:`persistrnn.runtime.set_wait_timeout`). Block b owns a
contiguous range of hidden units and keeps the W_hh rows of their gates in
shared memory for the whole launch; per step and statement block of the
cell (one for LSTM, GRU and RNN; two for the reset-before GRU) it runs the
generated statements of the cell's backward (:mod:`persistrnn.adjoint`, the
same rendering as the per-step kernels) for its units, multiplies its d
gates by its rows of that stage, and stores the partial products (``dh_{t-1}``,
or the reset-before GRU's ``d(r * h)``) of every unit into the unit owner's
shared memory (a cluster) or the launch's exchange buffer (a grid); one
barrier per stage and step, and each owner sums the partials in a fixed
order (deterministic: no atomics). The step body is generated per cell
(:func:`kernel_source`).

:func:`fits` says whether a layer gets the kernel on a device; where it does
not (a W_hh slice larger than the shared memory of a block per SM), the
caller keeps the per-step launches. :func:`plan` is the size rule without a
device.

The path: :func:`plan` -> :func:`kernel_source` -> :func:`compile_kernel` ->
:func:`persistent_steps` (through the loaded kernel and launch configuration
cached per shape and device).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
from typing import Any

import numpy as np
import torch

from . import runtime
from .adjoint import render_block_body, step_backward_program
from .cells import CellSpec, get_cell
from .checks import check_tensor
from .errors import ArgumentError, ConfigError, KernelLaunchError, UnsupportedError

__all__ = ["GRID_EXCHANGE_BYTES", "KERNEL_NAME", "MAX_BATCH_TILE", "MAX_CLUSTER", "SYNC_MODES", "TAGGED_MAX_BATCH",
           "THREADS", "BackwardKernelConfig", "compile_kernel", "fits", "kernel_source", "persistent_steps", "plan"]

KERNEL_NAME = "prnn_step_backward_persistent"
THREADS = 256  # per block: one thread per (batch row, owned unit) in the statements, per (column, batch tile) after
MAX_CLUSTER = 16
"""The largest cluster a Hopper GPU launches (non-portable; 8 is portable).
The driver's answer for the kernel's shared memory has the last word
(:meth:`persistrnn.runtime.LoadedKernel.max_cluster_size`)."""
GRID_EXCHANGE_BYTES = 8 << 20
"""The most partials a grid exchanges through L2 per stage and step. Every
block stores partials for every unit and batch row, so the exchange grows as
blocks x batch x H; measured on the H100 (one direction, T=100), the per-step
launches overtook the grid where it exchanged 8.3 MB (RNN 1152, batch ~10)
to 13 MB (LSTM 1024, batch ~25) per stage and step. Past this the layer
keeps the per-step launches."""
MAX_BATCH_TILE = 8
"""Batch rows per thread of the product: each row's d gates are a broadcast
load per 4 weights, so the 4 weights of a column load once for up to 8 rows."""
TAGGED_MAX_BATCH = 2
"""A grid's exchange is tagged words up to this batch: each partial goes to
L2 with its exchange's tag in one 64-bit word and each owner waits for the
words themselves (kernels/common.cuh), with no release and no counter
barrier, at twice the bytes of the plain exchange. Measured on the H100 (one
direction, T=100, µs per step, tagged against the barrier): batch 1 3.33
against 4.37 (LSTM 1024), 2.48 against 3.41 (ReLU RNN 1152); batch 2 4.60
against 4.87 and 3.95 against 3.94; batch 4 6.89 against 5.84 (LSTM 1024)
and 5.35 against 3.96 (ReLU RNN 1024): its words outgrow one round of loads
(perf-notes §78)."""


SYNC_MODES = ("cluster", "grid")
"""How a launch's blocks exchange each step: one cluster (DSMEM stores and
the hardware cluster barrier), or a cooperative grid (global stores and a
counter barrier), for layers a cluster's shared memory does not hold."""


@dataclasses.dataclass(frozen=True)
class BackwardKernelConfig:
    """One compiled variant: the cell, hidden size, block count, the
    product's batch tile, the sync mode, and (a grid) whether its exchange
    is tagged words (:data:`TAGGED_MAX_BATCH`)."""

    spec: CellSpec
    hidden: int
    blocks: int
    batch_tile: int
    sync: str = "cluster"
    tagged: bool = False

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ArgumentError(f"sync: expected one of {SYNC_MODES}, got {self.sync!r}")
        if self.tagged and self.sync != "grid":
            raise ArgumentError(f"tagged: a grid's exchange only, got sync {self.sync!r}")

    @property
    def units(self) -> int:
        """Hidden units per block (the last blocks own fewer, possibly none)."""
        return -(-self.hidden // self.blocks)

    @property
    def stage_rows(self) -> tuple[tuple[int, int], ...]:
        """Per stage, its rows [first, end) of the block's slice: its gates'
        units, each stage's count padded to the product's float4 loads."""
        bounds, first = [], 0
        for stage in self.spec.stages:
            end = first + -(-len(stage) * self.units // 4) * 4
            bounds.append((first, end))
            first = end
        return tuple(bounds)

    @property
    def gate_row0(self) -> tuple[int, ...]:
        """Per gate (torch's order), the slice row of its first owned unit."""
        rows = {}
        for (first, _), stage in zip(self.stage_rows, self.spec.stages):
            rows.update((gate, first + k * self.units) for k, gate in enumerate(stage))
        return tuple(rows[gate] for gate in self.spec.gates)

    @property
    def rows(self) -> int:
        """W_hh rows per block (every gate of its units, each stage padded to 4)."""
        return self.stage_rows[-1][1]

    @property
    def w_stride(self) -> int:
        """Floats from one column of the transposed slice to the next: a
        multiple of 4 that is not one of 8, so a warp's float4 loads of 32
        consecutive columns fall in distinct bank groups."""
        return self.rows if self.rows % 8 == 4 else self.rows + 4

    @property
    def planes(self) -> int:
        """Staged [B][units] planes per step: xg and the gates' products per gate, h, d_out, c
        (cells with one) and step_runs (cells with lengths)."""
        return 2 * self.spec.num_gates + 2 + int(self.spec.has_cell_state) + int(self.spec.lengths)

    @property
    def direct_dh(self) -> bool:
        """Whether the statements store a part of dh_{t-1} beside the product (GRU's z * dh)."""
        return next(b for b in step_backward_program(self.spec).blocks if b.block == 0).accumulate

    @property
    def carry_planes(self) -> int:
        """Per-element planes for adjoints that cross blocks otherwise (the reset-before GRU's d(r * h))."""
        return len(step_backward_program(self.spec).carried)

    def slice_bytes(self) -> int:
        """The block's W_hh slice in shared memory (transposed, padded)."""
        return 4 * self.hidden * self.w_stride

    @property
    def recv_slots(self) -> int:
        """Shared floats per element for what an exchange brings: the two
        parities' partials from every block (a cluster), or their gathered
        sum (a grid, whose partials stay in global memory)."""
        return 2 * self.blocks if self.sync == "cluster" else 1

    def batch_row_bytes(self) -> int:
        """Shared memory per batch row: d gates, what the exchange brings,
        the staged inputs' two parities, dc, the direct part of dh and the
        carry planes."""
        state = int(self.spec.has_cell_state) + int(self.direct_dh) + self.carry_planes
        return 4 * (self.rows + (self.recv_slots + 2 * self.planes + state) * self.units)

    def exchange_floats(self, batch: int) -> int:
        """The grid's exchange buffer in global memory, in 4-byte words (0 in
        a cluster): two parities of every block's partials, [owner][b][block][unit,
        padded to 4], each partial a float or (tagged) a float and its tag."""
        words = 2 * self.blocks * batch * self.blocks * self.unit_stride if self.sync == "grid" else 0
        return 2 * words if self.tagged else words

    @property
    def unit_stride(self) -> int:
        """A grid's exchange: floats per (owner, batch row, block), the units padded to whole float4s."""
        return -(-self.units // 4) * 4

    def exchange_bytes(self, batch: int) -> int:
        """What a grid stores and reads back through L2 per exchange (per stage and step)."""
        return 4 * self.exchange_floats(batch) // 2

    def lane_sum_bytes(self, batch: int) -> int:
        """A grid's gather: a float4 lane sum per thread, or per quad of units where those are more (0 in a cluster)."""
        return 16 * max(THREADS, batch * self.unit_stride // 4) if self.sync == "grid" else 0

    def shared_bytes(self, batch: int) -> int:
        """Dynamic shared memory per block at ``batch`` (kernels/step_backward_persistent.cu's layout):
        the slice, the batch rows, and in a grid the gather's lane sums."""
        return self.slice_bytes() + batch * self.batch_row_bytes() + self.lane_sum_bytes(batch)


def _configs(spec: CellSpec, hidden: int, batch: int, cluster_limit: int,
             grid_limit: int) -> tuple[BackwardKernelConfig, ...]:
    """The candidates in order of preference. First the largest cluster:
    the slice and the product's work per block shrink with it, and each
    block's stores per step stay B x H whatever its size (a power of two, at
    most one block per unit). Then, where ``grid_limit`` allows more blocks
    than a cluster, a grid of up to ``grid_limit`` blocks (one per SM), with
    as many units per block as leave none idle."""
    tile = min(batch, MAX_BATCH_TILE)
    cluster = BackwardKernelConfig(spec, hidden, 1 << (min(cluster_limit, hidden).bit_length() - 1), tile)
    if min(grid_limit, hidden) <= cluster.blocks:
        return (cluster,)
    units = -(-hidden // grid_limit)
    return cluster, BackwardKernelConfig(spec, hidden, -(-hidden // units), tile, "grid", batch <= TAGGED_MAX_BATCH)


def plan(cell: str | CellSpec, hidden: int, batch: int, shared_limit: int,
         cluster_limit: int = MAX_CLUSTER, grid_limit: int = 0) -> BackwardKernelConfig:
    """The configuration for ``hidden`` units and ``batch`` rows on a device
    with ``shared_limit`` bytes of shared memory per block, clusters of up
    to ``cluster_limit`` blocks and ``grid_limit`` SMs (0: no grid launch):
    a cluster where the layer's share fits one, else a grid. Raises
    :class:`UnsupportedError` for a cell whose later stage multiplies ``h``
    itself (no built-in cell does) and :class:`ConfigError`, naming the sizes
    that fit, when a block's share fits neither, or when a grid would
    exchange more than :data:`GRID_EXCHANGE_BYTES` per step (the per-step
    launches are faster there)."""
    spec = get_cell(cell)
    for name, value in (("hidden", hidden), ("batch", batch), ("cluster_limit", cluster_limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{name}: expected a positive int, got {value!r}")
    if isinstance(grid_limit, bool) or not isinstance(grid_limit, int) or grid_limit < 0:
        raise ArgumentError(f"grid_limit: expected an int >= 0, got {grid_limit!r}")
    if "h" in spec.stage_operands[1:]:
        raise UnsupportedError(f"the persistent backward kernel runs cells whose later stages multiply a name "
                               f"their statements assign; {spec.name}'s stage operands are {spec.stage_operands}: "
                               "its per-step launches run it")

    def fitting(h: int, b: int) -> BackwardKernelConfig | None:
        return next((c for c in _configs(spec, h, b, cluster_limit, grid_limit)
                     if c.shared_bytes(b) <= shared_limit), None)

    if config := fitting(hidden, batch):
        if config.sync == "grid" and config.exchange_bytes(batch) > GRID_EXCHANGE_BYTES:
            most = max((b for b in range(1, batch) if config.exchange_bytes(b) <= GRID_EXCHANGE_BYTES), default=0)
            stays = f"batch up to {most} stays" if most else "no batch stays"
            raise ConfigError(
                f"the persistent backward of {spec.name} (H={hidden}, batch {batch}) would run on a grid of "
                f"{config.blocks} blocks exchanging {config.exchange_bytes(batch) / 2**20:.1f} MiB per stage and step "
                f"through L2; past {GRID_EXCHANGE_BYTES >> 20} MiB the per-step launches measured faster ({stays} "
                f"on the grid at H={hidden})")
        return config
    largest = _configs(spec, hidden, batch, cluster_limit, grid_limit)[-1]
    most_batch = (shared_limit - largest.shared_bytes(0)) // largest.batch_row_bytes()
    while most_batch > 0 and largest.shared_bytes(most_batch) > shared_limit:  # a grid's lane sums grow
        most_batch -= 1
    most_hidden = next((h for h in range(hidden - 1, 0, -1) if fitting(h, batch)), 0)
    at_hidden = f"batch up to {most_batch} fits at H={hidden}" if most_batch > 0 else f"no batch fits at H={hidden}"
    at_batch = f"H up to {most_hidden} fits at batch {batch}" if most_hidden > 0 else f"no H fits at batch {batch}"
    launch = f"a {largest.sync} of {largest.blocks} blocks"
    raise ConfigError(
        f"the persistent backward of {spec.name} (H={hidden}, batch {batch}, {launch}) needs "
        f"{largest.shared_bytes(batch)} bytes of shared memory per block ({largest.slice_bytes()} of them its "
        f"W_hh slice); the device allows {shared_limit}: {at_hidden}, and {at_batch}")


def _gate_row0_macro(config: BackwardKernelConfig) -> str:
    """``PRNN_GATE_ROW0(g)``'s expansion: the slice row of gate g's first owned unit."""
    rows = "".join(f"(g) == {g} ? {row} : " for g, row in enumerate(config.gate_row0[:-1]))
    return f"({rows}{config.gate_row0[-1]})"


def _step_source(config: BackwardKernelConfig) -> str:
    """The body of one step: per statement block in walk order, the
    adjoints the exchange before it left (gathered from global memory
    first, in a grid), its statements over the block's elements, then its
    stage's product and one barrier."""
    program, spec = step_backward_program(config.spec), config.spec
    exchanges = spec.num_stages
    leave = "prnn_cp_async_wait<0>(); /* no copy lands after the block left */ return;"
    lines = []
    for walk, block in enumerate(program.blocks):
        j = block.block
        if walk == 0:  # dh_t: the last exchange of the step before, or dL/dh_n
            pass_ = f"if (prnn_i > 0 && !prnn_gather(prnn_i * {exchanges} - 1)) {{ {leave} }}"
            gather = ["const float prnn_dh_now = prnn_i == 0 ? prnn_dh_last[prnn_b * PRNN_H + prnn_u0 + prnn_j]",
                      f"                                      : prnn_gathered_dh((prnn_i * {exchanges} - 1) & 1, "
                      "prnn_e);",
                      "const float* prnn_dh = &prnn_dh_now;"]
        else:  # the operand of the stage exchanged just before: a carry plane
            before = program.blocks[walk - 1]
            plane = program.carried.index(spec.stage_operands[before.block])
            into = f"prnn_carry_planes[{plane} * prnn_elements + prnn_e]"
            summed = f"prnn_gathered((prnn_i * {exchanges} + {walk - 1}) & 1, prnn_e)"
            pass_ = f"if (!prnn_gather(prnn_i * {exchanges} + {walk - 1})) {{ {leave} }}"
            gather = [f"{into} = {into + ' + ' if before.accumulate else ''}{summed};",
                      "[[maybe_unused]] const float* prnn_dh = nullptr;"]
        first, end = config.stage_rows[j]
        body = textwrap.indent("\n".join([
            "const int prnn_b = prnn_e / PRNN_UNITS, prnn_j = prnn_e % PRNN_UNITS;",
            "if (prnn_j >= prnn_owned) continue;",
            *gather,
            "// The statements' names, each at this thread's element (index 0, or g * PRNN_H).",
            "[[maybe_unused]] constexpr int prnn_n = 0, prnn_row = 0, prnn_hidden = PRNN_H;",
            "[[maybe_unused]] const prnn_gate_view prnn_xg{prnn_planes + PRNN_PLANE_XG * prnn_elements + prnn_e, "
            "prnn_elements};",
            "[[maybe_unused]] const prnn_gate_view prnn_gates{prnn_planes + PRNN_PLANE_GATES * prnn_elements + "
            "prnn_e, prnn_elements};",
            "[[maybe_unused]] const float* prnn_h = prnn_planes + PRNN_PLANE_H * prnn_elements + prnn_e;",
            "[[maybe_unused]] const float* prnn_c = prnn_planes + PRNN_PLANE_C * prnn_elements + prnn_e;",
            "[[maybe_unused]] const float* prnn_dout = prnn_planes + PRNN_PLANE_DOUT * prnn_elements + prnn_e;",
            "// step_runs of row b, staged per element: [prnn_b] is this element's.",
            "[[maybe_unused]] const float* prnn_step_runs = prnn_planes + PRNN_PLANE_RUNS * prnn_elements + prnn_e "
            "- prnn_b;",
            "// dc_t in, dc_{t-1} out, in place: the statements read every input before they store.",
            "[[maybe_unused]] float* prnn_dc = prnn_dc_state + prnn_e;",
            "[[maybe_unused]] float* prnn_dc_prev = prnn_dc_state + prnn_e;",
            "[[maybe_unused]] float* prnn_dh_prev = prnn_direct + prnn_e;",
            "[[maybe_unused]] const prnn_carry_view prnn_carry{prnn_carry_planes + prnn_e, prnn_batch * PRNN_H, "
            "prnn_elements};",
            "[[maybe_unused]] float* prnn_operands = prnn_operands_all + ((size_t)prnn_p * prnn_batch + prnn_b) * "
            "PRNN_H + prnn_u0 + prnn_j;",
            "const size_t prnn_gate_at = ((size_t)prnn_p * prnn_batch + prnn_b) * prnn_gh + prnn_u0 + prnn_j;",
            "[[maybe_unused]] float* prnn_dxg = prnn_dxw_all + prnn_gate_at;",
            "[[maybe_unused]] const prnn_gate_tee prnn_dgates{prnn_dgates_all + prnn_gate_at, "
            "prnn_dg + prnn_b * PRNN_ROWS + prnn_j};",
            textwrap.dedent(render_block_body(program, block))]), " " * 4)
        lines += [f"// statement block {j}, then stage {j}'s product", pass_,
                  "for (int prnn_e = threadIdx.x; prnn_e < prnn_elements; prnn_e += PRNN_THREADS) {", body, "}"]
        if walk == 0:  # the next position's inputs, into the other staging buffer, while the products run
            lines.append("if (prnn_i + 1 < prnn_steps) prnn_stage_position(prnn_position(prnn_i + 1), "
                         "(prnn_i & 1) ^ 1);")
        lines += ["__syncthreads();  // the block's d gates are in shared memory",
                  f"prnn_product({first}, {end}, prnn_i * {exchanges} + {walk});",
                  f"if (!prnn_exchanged(prnn_i * {exchanges} + {walk})) {{ {leave} }}"]
    return textwrap.indent("\n".join(lines), " " * 8)


def kernel_source(config: BackwardKernelConfig) -> str:
    """The complete CUDA source of ``config``'s kernel: the template with the
    cell's generated backward statements (:mod:`persistrnn.adjoint`), one
    statement block and one product per stage in each step."""
    defines = {"PRNN_G": config.spec.num_gates, "PRNN_H": config.hidden, "PRNN_BLOCKS": config.blocks,
               "PRNN_GRID": int(config.sync == "grid"), "PRNN_TAGGED": int(config.tagged),
               "PRNN_UNITS": config.units, "PRNN_ROWS": config.rows, "PRNN_W_STRIDE": config.w_stride,
               "PRNN_THREADS": THREADS, "PRNN_BATCH_TILE": config.batch_tile,
               "PRNN_CELL_STATE": int(config.spec.has_cell_state), "PRNN_DIRECT_DH": int(config.direct_dh),
               "PRNN_LENGTHS": int(config.spec.lengths), "PRNN_CARRY": config.carry_planes,
               "PRNN_EXCHANGES": config.spec.num_stages, "PRNN_GATE_ROW0(g)": _gate_row0_macro(config)}
    return runtime.render_template("step_backward_persistent.cu",
                                   title=f"persistent step backward: cell {config.spec.name}", defines=defines,
                                   marker="        // ---- the step's blocks ----", generated=_step_source(config),
                                   keep_marker=False)


@functools.lru_cache(maxsize=None)
def compile_kernel(config: BackwardKernelConfig, arch: str | None = None) -> runtime.CompiledBinary:
    """NVRTC-compile (disk-cached) ``config``'s kernel; ``arch=None`` is the current device's."""
    cell = re.sub(r"[^A-Za-z0-9_.-]", "_", config.spec.name)
    blocks = f"c{config.blocks}" if config.sync == "cluster" else f"g{config.blocks}" + ("_tagged" * config.tagged)
    name = f"step_backward_persistent_{cell}_h{config.hidden}_{blocks}_t{config.batch_tile}"
    return runtime.compile_source(name, kernel_source(config), arch=arch)


@functools.lru_cache(maxsize=256)
def _prepared(spec: CellSpec, hidden: int, batch: int, device: int) -> tuple[BackwardKernelConfig, Any, Any]:
    """(config, loaded kernel, checked launch configuration) on ``device``, once per shape:
    the residency queries cost far more than a launch."""
    with torch.cuda.device(device):
        facts = runtime.facts_of(device)
        limit, sms = facts.shared_per_block_optin, facts.sm_count
        config = plan(spec, hidden, batch, limit, grid_limit=sms)
        kernel = runtime.get_kernel(compile_kernel(config, facts.arch), KERNEL_NAME)
        if config.sync == "cluster":
            largest = kernel.max_cluster_size(THREADS, config.shared_bytes(batch))
            if largest < config.blocks:  # e.g. a GPU partition without 16 SMs in a GPC
                config = plan(spec, hidden, batch, limit, largest, sms)
                kernel = runtime.get_kernel(compile_kernel(config, facts.arch), KERNEL_NAME)
        shared = config.shared_bytes(batch)
        if config.sync == "grid":  # checks that every block can be resident at once, and raises if not
            return config, kernel, kernel.config(config.blocks, THREADS, shared=shared, cooperative=True)
        return config, kernel, kernel.config(config.blocks, THREADS, shared=shared, cluster=config.blocks)


def _device_index(device: Any) -> int:
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        raise ArgumentError(f"device: expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=256)
def fits(spec: str | CellSpec, hidden: int, batch: int, device: Any) -> bool:
    """Whether :func:`persistent_steps` runs a ``hidden``-unit layer of
    ``spec`` at ``batch`` on ``device`` (an index or a CUDA device): a
    block share that fits in shared memory, with a cluster or a grid whose
    blocks the device holds at once. Compiles the kernel (disk-cached)."""
    try:
        _prepared(get_cell(spec), hidden, batch, _device_index(device))
    except (ConfigError, UnsupportedError, KernelLaunchError):
        return False
    return True


def persistent_steps(spec: CellSpec, xw: torch.Tensor, gates: torch.Tensor, h_prev: torch.Tensor, c_prev: Any,
                     w_hh: torch.Tensor, d_out: torch.Tensor, dh_n: torch.Tensor, dc_n: Any, reverse: bool,
                     d_xw: torch.Tensor, d_gates: torch.Tensor, stage_operands: torch.Tensor,
                     step_runs: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """:func:`persistrnn.training._fused_steps` in one launch (fp32
    CUDA tensors): fills ``d_xw`` and ``d_gates`` (T, B, G*H) and
    ``stage_operands`` (stages - 1, T, B, H), contiguous, and returns (dh0,
    dc0 or None). ``h_prev``/``c_prev`` (T, B, H): the states
    each position started from; ``step_runs`` (T, B), for a cell with
    lengths only: 1 where a row's sequence runs the position, else 0.
    Raises where :func:`fits` says no."""
    steps, batch, hidden = h_prev.shape
    if steps < 1:
        raise ArgumentError(f"h_prev: expected at least one step, got shape {tuple(h_prev.shape)}")
    config, kernel, launch_config = _prepared(spec, hidden, batch, xw.device.index)
    gh = spec.num_gates * hidden
    xw, gates, h_prev, w_hh, d_out, dh_n = (t.contiguous() for t in (xw, gates, h_prev, w_hh, d_out, dh_n))
    for name, tensor, shape in (("xw", xw, (steps, batch, gh)), ("gates", gates, (steps, batch, gh)),
                                ("h_prev", h_prev, (steps, batch, hidden)), ("w_hh", w_hh, (gh, hidden)),
                                ("d_out", d_out, (steps, batch, hidden)), ("dh_n", dh_n, (batch, hidden)),
                                ("d_xw", d_xw, (steps, batch, gh)), ("d_gates", d_gates, (steps, batch, gh))):
        check_tensor(name, tensor, shape, xw.device, torch.float32)
    dh0 = torch.empty_like(dh_n)
    no_tensor = np.uint64(0)
    if spec.lengths != (step_runs is not None):
        raise ArgumentError(f"step_runs: expected a (T, B) tensor for a cell with lengths and None otherwise; "
                            f"cell {spec.name}, got {'None' if step_runs is None else tuple(step_runs.shape)}")
    if step_runs is not None:
        step_runs = step_runs.contiguous()
        check_tensor("step_runs", step_runs, (steps, batch), xw.device, torch.float32)
    if spec.has_cell_state:
        c_prev, dc_n = c_prev.contiguous(), dc_n.contiguous()
        check_tensor("c_prev", c_prev, (steps, batch, hidden), xw.device, torch.float32)
        check_tensor("dc_n", dc_n, (batch, hidden), xw.device, torch.float32)
        dc0 = torch.empty_like(dc_n)
        cell_state = (c_prev, dc_n, dc0)
    else:
        dc0 = None
        cell_state = (no_tensor, no_tensor, no_tensor)
    check_tensor("stage_operands", stage_operands, (spec.num_stages - 1, steps, batch, hidden), xw.device,
                 torch.float32)
    # A grid's own counter and status word (zeroed), and its exchange buffer:
    # every slot is written before it is read, so it needs no zeros, but for
    # tagged words, whose tags from another launch must not match.
    grid: tuple[Any, ...] = (no_tensor,) * 5
    if config.sync == "grid":
        own = runtime.scratch(xw.device, counters=1)
        exchange = (torch.zeros if config.tagged else torch.empty)(config.exchange_floats(batch), dtype=torch.float32,
                                                                   device=xw.device)
        grid = (exchange, np.uint64(own.counters), np.uint64(own.status),
                np.uint64(runtime.report_word(xw.device.index)), np.uint64(runtime.wait_timeout_ns()))
    args = runtime.kernel_args(xw, gates, h_prev, cell_state[0], w_hh, d_out, dh_n, cell_state[1],
                               no_tensor if step_runs is None else step_runs, d_xw, d_gates,
                               stage_operands if spec.num_stages > 1 else no_tensor, dh0, cell_state[2], *grid,
                               steps, batch, int(reverse))
    runtime.launch(kernel, launch_config, *args)
    return dh0, dc0
