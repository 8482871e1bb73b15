"""The interpreter kernel: spec -> source -> binary -> launch.

A :class:`KernelSpec` fixes what is compiled in: the weight matrices (their
shapes and offsets, and which block keeps which rows: the placement), the
number of blocks and threads, and the variant (training: forward, backward and update; or
inference: forward only). A batch's script, the workspace, the learning rate
and the wait bound are run-time values: a new batch never recompiles.
:func:`render_source` prepends the spec as macros and a constant table to
``kernels/dynamic.cu``; :func:`compile_spec` compiles it through the
runtime's disk cache (a warm start compiles nothing); :class:`Interpreter`
owns the parameters on the GPU and launches scripts cooperatively (every
block must be resident: blocks wait for each other).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from .. import runtime
from ..runtime.launch import SCRATCH_WORDS
from ..errors import ArgumentError, ConfigError
from .graph import Graph
from .loader import script_loader
from .model import Model
from .optimizers import SGD, Optimizer
from .script import BACKWARD, OPCODES, ROW_GROWTH, WORDS, MatrixLayout, Script, matrix_layout, schedule

__all__ = ["Interpreter", "KERNEL_NAME", "KernelSpec", "check_shared_memory", "compile_spec", "kernel_layout",
           "profile_table", "render_source"]

KERNEL_NAME = "dynamic_interpreter"
THREADS = 256  # VPPS §III-A: 256 threads per block use the whole register file at one block per SM
CHUNK = 128  # instructions fetched into shared memory at a time (2 KB)
GROUP = 8  # vectors a matvec takes at a time: 8 x 512 columns of input is 16 KB of shared memory
# kernels/dynamic.cu's PRNN_DYN_PROFILE_SLOTS: one per opcode (backward ones included), 0 the fetch
PROFILE_SLOTS = 2 * BACKWARD


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one interpreter binary is specialised for."""

    layout: MatrixLayout
    train: bool = True
    threads: int = THREADS
    chunk: int = CHUNK
    group: int = GROUP
    profile: bool = False  # the instrumented build (kernels/dynamic.cu, PRNN_DYN_PROFILE)

    @classmethod
    def of(cls, model: Model, blocks: int, *, train: bool = True, placement: str = "partition",
           shared_bytes: int | None = None) -> KernelSpec:
        """The spec of ``placement``'s layout; ``replicate`` bounded by ``shared_bytes`` per block where given
        (:func:`kernel_layout`)."""
        layout = (matrix_layout(model, blocks, placement) if shared_bytes is None
                  else kernel_layout(model, blocks, placement, shared_bytes))
        return cls(layout, train)

    @property
    def blocks(self) -> int:
        return self.layout.blocks

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block: the script chunk, the vector
        buffers (a group of inputs and of output gradients), the weight cache
        and (training) the gradient cache."""
        lay = self.layout
        floats = (self.chunk * WORDS + self.group * (max(lay.cols) + max(lay.rows_per_block))
                  + lay.shared_floats * (2 if self.train else 1))
        return 4 * floats

    def describe(self) -> str:
        lay = self.layout
        shapes = ",".join(f"{r}x{c}/{h}" + (f"x{n}" if n > 1 else "")
                          for r, c, h, n in zip(lay.rows, lay.cols, lay.holders, lay.replicas))
        return (f"{'train' if self.train else 'infer'}{'-profile' if self.profile else ''}-b{self.blocks}"
                f"-t{self.threads}-{shapes}")


def kernel_layout(model: Model, blocks: int, placement: str, shared_bytes: int) -> MatrixLayout:
    """The layout an :class:`Interpreter` runs: ``placement``'s, where
    ``replicate`` adds replicas only while a training binary still fits
    ``shared_bytes`` of shared memory per block (its vector buffers counted
    at the most rows per block replicas may give a holder, and its static
    shared memory: a flag, each matrix's rows of the block, 28 bytes each,
    and the instrumented build's 1 KB of counters, with room to spare)."""
    if placement != "replicate":
        return matrix_layout(model, blocks, placement)
    partition = matrix_layout(model, blocks, "partition")  # the rows per block that replicas may multiply
    static_bytes = 2048 + 32 * len(partition.rows)
    fixed = CHUNK * WORDS + GROUP * (max(partition.cols) + ROW_GROWTH * max(partition.rows_per_block))
    return matrix_layout(model, blocks, placement, ((shared_bytes - static_bytes) // 4 - fixed) // 2)


def render_source(spec: KernelSpec) -> str:
    """The complete CUDA source of ``spec``: generated prelude + template."""
    lay = spec.layout
    if not lay.rows:
        raise ConfigError("the model declares no weight matrix; the interpreter caches at least one")
    defines = {
        "PRNN_DYN_THREADS": spec.threads,
        "PRNN_DYN_CHUNK": spec.chunk,
        "PRNN_DYN_GROUP": spec.group,
        "PRNN_DYN_MATRICES": len(lay.rows),
        "PRNN_DYN_MAX_COLS": max(lay.cols),
        "PRNN_DYN_MAX_ROWS": max(lay.rows_per_block),
        "PRNN_DYN_WEIGHT_FLOATS": lay.shared_floats,
        "PRNN_DYN_TRAIN": int(spec.train),
        "PRNN_DYN_PROFILE": int(spec.profile),
        "PRNN_DYN_REPLICATED": int(max(lay.replicas) > 1),
        "PRNN_OP_BACKWARD": BACKWARD,
        "PRNN_DYN_PROFILE_SLOTS": PROFILE_SLOTS,
        **{f"PRNN_OP_{name.upper()}": code for name, code in OPCODES.items()},
    }
    table = zip(lay.rows, lay.cols, lay.rows_per_block, lay.param_offset, lay.shared_offset, lay.first_block,
                lay.holders, lay.replicas, lay.gates)
    rows = ", ".join("{" + ", ".join(str(v) for v in entry) + "}" for entry in table)
    prelude = [f"// dynamic interpreter: {spec.describe()}"]
    prelude += [f"#define {k} {v}" for k, v in defines.items()]
    prelude.append(f"__constant__ int prnn_dyn_matrix[{len(lay.rows)}][9] = {{{rows}}};")
    return "\n".join(prelude) + "\n" + runtime.read_source("dynamic.cu")


@functools.lru_cache(maxsize=64)
def compile_spec(spec: KernelSpec, arch: str | None = None) -> runtime.CompiledBinary:
    """Compile ``spec`` (disk-cached); refuses a binary that spills to local memory."""
    binary = runtime.compile_source("dynamic", render_source(spec), arch=arch, tag=spec.describe()[:60])
    res = binary.kernel_resources(KERNEL_NAME)
    if res.uses_local_memory:
        raise ConfigError(f"the dynamic interpreter {spec.describe()} spills to local memory ({res.registers} "
                          f"registers, {res.stack_frame_bytes} bytes stack)")
    return binary


def check_shared_memory(spec: KernelSpec, binary: runtime.CompiledBinary, limit: int) -> None:
    """Refuse ``binary`` where its static shared memory (the compiler's
    count: each matrix's rows of the block, a flag, an instrumented build's
    counters) and ``spec``'s dynamic shared memory together exceed ``limit``
    bytes per block: its launch would fail with a bare CUDA error."""
    static = binary.kernel_resources(KERNEL_NAME).shared_bytes
    if spec.shared_bytes + static > limit:
        raise ConfigError(f"the interpreter {spec.describe()} needs {spec.shared_bytes} bytes of dynamic and "
                          f"{static} of static shared memory per block, {spec.shared_bytes + static} in all; the "
                          f"device allows {limit}: use more blocks")


def _device_script(script: Script, device: Any, stream: Any, copy_stream: Any) -> tuple[Any, Any]:
    """The prefix offsets and the program in one pinned buffer, one copy to
    the device: (starts, program) views of it, ready for ``stream``. The
    program starts on a 16-byte boundary (the kernel reads operands as int4).

    The copy runs on ``copy_stream``, which ``stream`` waits for: it overlaps
    the kernel before it on ``stream`` instead of following it (12-17 µs of
    device time a batch at tagger batch 1 and Tree-LSTM batch 16, perf-notes
    dynamic §30-§31)."""
    import torch

    head = -(-len(script.starts) // WORDS) * WORDS
    pinned = torch.empty(head + script.program.size, dtype=torch.int32, pin_memory=True)
    packed = pinned.numpy()  # written once, in place: no pageable copy to pin afterwards
    packed[:len(script.starts)] = script.starts
    packed[len(script.starts):head] = 0
    packed[head:] = script.program.ravel()
    with torch.cuda.stream(copy_stream):  # the pinned buffer is kept until this stream's copy is done
        on_device = pinned.to(device, non_blocking=True)
    stream.wait_stream(copy_stream)
    on_device.record_stream(stream)  # made on the copy stream, read on the caller's
    return on_device[:len(script.starts)], on_device[head:]


@dataclasses.dataclass
class Launched:
    """A launch in flight: its workspace stays valid until dropped; ``loss``
    is the device word, ``loss_host`` its pinned copy, complete once ``done``
    (an event after the copy) has passed."""

    script: Script
    loss: Any  # float32 (1,) on the device
    values: Any
    grads: Any
    loss_host: Any
    done: Any
    profile: Any = None  # an instrumented interpreter's per-block counts (int64, (blocks, 2 * PROFILE_SLOTS + 2))

    def result(self) -> float:
        """The batch loss, waiting for this launch only (not for later ones)."""
        self.done.synchronize()
        return float(self.loss_host.item())


def _on_its_device(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an :class:`Interpreter` run under ``torch.cuda.device``
    of the interpreter's GPU (its parameters') where that is not the current
    one (:func:`runtime.elsewhere`, the rule of every entry point): the
    kernels' loads, the streams, the scratch and the launches below read the
    current device (a process may run an interpreter per GPU)."""
    @functools.wraps(method)
    def on_device(self: Interpreter, *args: Any, **kwargs: Any) -> Any:
        import torch

        if (device := runtime.elsewhere(self.params)) is not None:
            with torch.cuda.device(device):
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return on_device


class Interpreter:
    """The model's parameters on the GPU and the kernels that run its scripts.

    ``blocks`` defaults to the SM count (one block per SM). ``placement``
    ``replicate`` (the default) gives each matrix its own blocks (VPPS's
    partition), then whole copies of the matrices on further blocks (each
    holder keeping more rows where that makes room) while their caches fit
    the device's shared memory, which share each stage's vectors out
    (measured on an H100 against ``partition``: 1.3-2.2x faster at batch
    16-128, 3% slower in training at batch 1; perf-notes dynamic §18, §20);
    ``partition`` stops before the copies, ``spread`` gives every block
    rows of every matrix. A block
    caches its matrices' rows, and their gradients, in shared memory. ``train``
    runs forward, backward and the ``optimizer``'s update in one launch and
    leaves every parameter's gradient in :attr:`param_grads`; ``infer`` runs
    forward only. ``step``/``sync`` overlap the host's script generation for
    the next batch with the kernel of the previous one, as VPPS does.
    ``device``: a CUDA device; without an index, the current one.
    ``profile`` runs the instrumented build: every launch's
    :attr:`Launched.profile` holds each block's cycles per opcode
    (:func:`profile_table` sums them up).
    """

    def __init__(self, model: Model, *, blocks: int | None = None, optimizer: Optimizer | None = None,
                 placement: str = "replicate", device: Any = "cuda", profile: bool = False) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ArgumentError(f"device: expected a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", runtime.require_gpu())  # the current device, or a clear error
        with torch.cuda.device(self.device.index):
            facts = runtime.device_facts()
        self.model = model
        self.blocks = blocks or facts.sm_count
        self.optimizer = optimizer or SGD()
        with runtime.ordinary_tensors():  # zeroed in place by later launches, in any mode
            self.params = torch.from_numpy(model.initial_values()).to(self.device)
            self.param_grads = torch.zeros_like(self.params)
            self.adam_m = torch.zeros_like(self.params)
            self.adam_v = torch.zeros_like(self.params)
        self.updates = 0
        self._pending: Launched | None = None
        self.placement = placement
        self.profile = bool(profile)
        self.shared_limit = limit = facts.shared_per_block_optin
        self.layout = kernel_layout(model, self.blocks, placement, limit)
        for train in (True, False):
            spec = KernelSpec(self.layout, train)
            if spec.shared_bytes > limit:
                raise ConfigError(f"the model's matrices need {spec.shared_bytes} bytes of shared memory per block "
                                  f"over {self.blocks} blocks; the device allows {limit}: use more blocks")

    @_on_its_device
    def load(self) -> None:
        """Compile (or read from the disk cache) and load both variants now
        rather than at the first launch."""
        self._kernels  # noqa: B018 (the cached property does the work)

    @functools.cached_property
    def _kernels(self) -> dict[bool, tuple[Any, Any]]:
        out = {}
        for train in (True, False):
            spec = KernelSpec(self.layout, train, profile=self.profile)
            binary = compile_spec(spec)
            check_shared_memory(spec, binary, self.shared_limit)
            kernel = runtime.get_kernel(binary, KERNEL_NAME)
            out[train] = (kernel, kernel.config(self.blocks, spec.threads, shared=spec.shared_bytes,
                                                cooperative=True))
        return out

    def schedule(self, graph: Graph | Script, *, train: bool = True) -> Script:
        """``graph``'s script on this interpreter's blocks; a script made
        ahead (:meth:`scripts`) passes through, if it was made for ``train``."""
        if isinstance(graph, Script):
            if graph.train != train:
                raise ArgumentError(f"the script was scheduled with train={graph.train}, got train={train}")
            return graph
        if graph.model is not self.model:
            raise ArgumentError("the graph was built over another model than this interpreter's")
        return schedule(graph, self.blocks, train=train, placement=self.placement, layout=self.layout)

    def scripts(self, batches: Sequence[Any], build: Callable[[Graph, Any], Any], *, train: bool = True,
                workers: int = 0, prefetch: int = 2, per_item: int = 1) -> Any:
        """The scripts of ``batches`` for this interpreter, in order, made
        ahead by ``workers`` processes, ``per_item`` batches at a time
        (:func:`~.loader.script_loader`);
        ``build(graph, batch)`` adds one batch to a graph. For
        ``for script in interp.scripts(...): interp.step(script)``, where one
        process's host work per batch would outlast the kernel."""
        return script_loader(self.model, build, batches, self.blocks, train=train, placement=self.placement,
                             layout=self.layout, workers=workers, prefetch=prefetch, per_item=per_item)

    @_on_its_device
    def launch(self, script: Script, *, poison: bool = False) -> Launched:
        """Launch ``script`` on the current stream; returns without waiting.

        ``poison`` fills the workspace with NaN first (tests: a value read
        before it was written shows in the loss).
        """
        import torch

        if script.layout is not self.layout and script.layout != self.layout:
            raise ArgumentError(f"the script was scheduled for {script.layout}; this interpreter runs "
                                f"{self.layout} (schedule with interp.schedule, or layout=interp.layout)")
        # The per-batch host path, ~0.5 ms at first on the H100's host (more than the tagger's kernel at batch
        # 1, perf-notes dynamic §25): one current-stream lookup, no fill of the values (the scheduler orders
        # every read after its write; `poison` proves it), the gradients and the scratch zeroed by one memset.
        stream = torch.cuda.current_stream()
        kernel, config = self._kernels[script.train]
        starts, program = _device_script(script, self.device, stream, self._copy_stream)
        values = (torch.full((script.workspace_floats,), float("nan"), dtype=torch.float32, device=self.device)
                  if poison else torch.empty(script.workspace_floats, dtype=torch.float32, device=self.device))
        grad_floats = script.workspace_floats if script.train else 0
        own = runtime.scratch(self.device, exchange_floats=grad_floats + 1)  # status, counter, grads, loss: zeros
        floats = own.words[SCRATCH_WORDS:].view(torch.float32)
        grads, loss = (floats[:grad_floats] if script.train else values), floats[grad_floats:]
        if script.train:
            self.param_grads.zero_()
            self.updates += 1
        profile = (torch.zeros((self.blocks, 2 * PROFILE_SLOTS + 2), dtype=torch.int64, device=self.device)
                   if self.profile else None)
        lr, beta1, beta2, eps, correction1, correction2 = self.optimizer.scalars(max(self.updates, 1))
        pointer, f32 = np.uint64, np.float32
        args = (pointer(program.data_ptr()), pointer(starts.data_ptr()), pointer(values.data_ptr()),
                pointer(grads.data_ptr()), *self._state_pointers, pointer(loss.data_ptr()), pointer(own.counters),
                *self._dense_range, f32(lr), f32(beta1), f32(beta2), f32(eps), f32(correction1), f32(correction2),
                pointer(own.status),
                pointer(runtime.report_word(self.device.index)), pointer(runtime.wait_timeout_ns()),
                *(() if profile is None else (pointer(profile.data_ptr()),)))
        runtime.launch(kernel, config, *args, stream=stream)
        loss_host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        loss_host.copy_(loss, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return Launched(script, loss, values, grads, loss_host, done, profile)

    @functools.cached_property
    def _state_pointers(self) -> tuple[np.uint64, ...]:
        """The parameters', their gradients' and Adam's moments' addresses
        (the tensors are updated in place for the interpreter's life)."""
        return tuple(np.uint64(t.data_ptr()) for t in (self.params, self.param_grads, self.adam_m, self.adam_v))

    @functools.cached_property
    def _copy_stream(self) -> Any:
        """The stream that copies scripts to the device (:func:`_device_script`)."""
        import torch

        return torch.cuda.Stream(self.device)

    @functools.cached_property
    def _dense_range(self) -> tuple[np.int32, np.int32]:
        """The flat buffer's biases and embeddings, [matrix floats, total
        floats): fixed with the model's layout (its parameters' sums, not
        taken on every launch)."""
        return np.int32(self.model.matrix_floats), np.int32(self.model.total_floats)

    @_on_its_device
    def run(self, graph: Graph | Script, *, train: bool = True) -> float:
        """Schedule (a graph), launch, wait: the batch loss (sum over loss nodes)."""
        launched = self.launch(self.schedule(graph, train=train))
        runtime.raise_reported_failure(self.device.index, KERNEL_NAME, synchronize=True)
        return launched.result()

    @_on_its_device
    def step(self, graph: Graph | Script, *, train: bool = True) -> float | None:
        """Schedule (a graph) and launch ``graph``, then return the previous
        batch's loss (None for the first). The wait is for the previous launch
        only, so batch k+1 runs while the caller builds and schedules batch
        k+2 (or takes its script from :meth:`scripts`)."""
        script = self.schedule(graph, train=train)
        previous, self._pending = self._pending, self.launch(script)
        if previous is None:
            return None
        value = previous.result()
        runtime.raise_reported_failure(self.device.index, KERNEL_NAME)
        return value

    @_on_its_device
    def sync(self) -> float | None:
        """Wait for the latest launch and return its loss."""
        if self._pending is None:
            return None
        runtime.raise_reported_failure(self.device.index, KERNEL_NAME, synchronize=True)
        value, self._pending = self._pending.result(), None
        return value


def profile_table(launched: Launched) -> list[dict[str, Any]]:
    """Per opcode of an instrumented launch (after it finished): how many
    instructions ran over all blocks, their mean µs each, the sum over
    blocks, and the largest block's total; each block's cycles converted by
    its own cycles-to-nanoseconds ratio over the script loop. ``fetch`` is
    the copy of script chunks into shared memory."""
    if launched.profile is None:
        raise ArgumentError("the launch was not instrumented: make the Interpreter with profile=True")
    counts = launched.profile.cpu().numpy()
    per_slot = counts[:, :2 * PROFILE_SLOTS].reshape(len(counts), PROFILE_SLOTS, 2)
    ns_per_cycle = counts[:, -1] / np.maximum(counts[:, -2], 1)
    us = per_slot[:, :, 0] * ns_per_cycle[:, None] / 1e3  # (blocks, slots)
    names = {0: "fetch"} | {code: name for name, code in OPCODES.items()}
    names |= {code + BACKWARD: f"{name} backward" for name, code in OPCODES.items() if name not in ("wait", "signal")}
    rows = []
    for slot in np.flatnonzero(per_slot[:, :, 1].sum(axis=0)):
        n = int(per_slot[:, slot, 1].sum())
        total = float(us[:, slot].sum())
        rows.append({"op": names.get(int(slot), str(slot)), "instructions": n, "mean_us": total / n,
                     "total_us": total, "largest_block_us": float(us[:, slot].max())})
    return rows
