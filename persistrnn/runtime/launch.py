"""Load and launch: kernels on a device, residency checks, cooperative and
cluster launches, and what each launch owns.

* :func:`get_kernel` loads a compiled binary's kernel on the current device
  (once per process and device).
* :meth:`LoadedKernel.config` checks that a launch whose blocks wait for each
  other can have all of them resident, and raises otherwise: such a kernel
  would never finish.
* :func:`launch` launches on torch's current stream.
* :func:`scratch` gives one launch its own status word, barrier counters and
  exchange buffer, from torch's stream-ordered allocator: two launches that
  can run at the same time never share them, and a launch captured in a CUDA
  graph keeps them in the graph's memory pool for the graph's life.
* A kernel that gives up waiting writes its status code into a per-device
  *report word* in pinned host memory, which the host reads without
  synchronising (:func:`raise_reported_failure`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from typing import Any, Iterator

from ..errors import ArgumentError, ArgumentTypeError, KernelLaunchError, KernelTimeoutError
from .compile import CompiledBinary, KernelResources
from .device import facts_of, require_gpu

__all__ = ["HOST_SPIN_S", "LoadedKernel", "Scratch", "WAIT_TIMEOUT_ENV", "check_status", "get_kernel", "inject_failure",
           "kernel_args", "launch", "raise_failure_code", "raise_reported_failure", "report_word", "scratch",
           "set_wait_timeout",
           "to_device_async", "wait_timeout_ns", "failure_hook"]


@dataclasses.dataclass
class LoadedKernel:
    """A kernel loaded on one device, with its launch attributes applied."""

    binary: CompiledBinary
    name: str
    kernel: Any  # cuda.core Kernel
    device: int
    dynamic_shared_limit: int = 48 * 1024  # the driver's default before opt-in
    non_portable_cluster: bool = False

    @property
    def resources(self) -> KernelResources:
        return self.binary.kernel_resources(self.name)

    def _set_attribute(self, attribute: Any, value: int) -> None:
        from cuda.bindings import driver

        (err,) = driver.cuKernelSetAttribute(attribute, value, self.kernel.handle, self.device)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise KernelLaunchError(f"cuKernelSetAttribute({attribute.name}, {value}) on {self.name}: {err.name}")

    def reserve_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to more than 48 KB of dynamic shared memory (a Hopper launch rule)."""
        if nbytes <= self.dynamic_shared_limit:
            return
        facts = facts_of(self.device)
        available = facts.shared_per_block_optin - self.resources.shared_bytes
        if nbytes > available:
            raise KernelLaunchError(
                f"{self.name} asks for {nbytes} bytes of dynamic shared memory; the device allows "
                f"{available} beside the kernel's {self.resources.shared_bytes} static bytes"
            )
        from cuda.bindings import driver

        self._set_attribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self.dynamic_shared_limit = nbytes

    def allow_non_portable_cluster(self) -> None:
        """Allow clusters above the portable size of 8 (16 on the H100)."""
        if self.non_portable_cluster:
            return
        from cuda.bindings import driver

        self._set_attribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        self.non_portable_cluster = True

    def config(self, grid: int, block: int, *, shared: int = 0, cluster: int = 0, cooperative: bool = False,
               slices: int = 1) -> Any:
        """A cuda.core LaunchConfig; ``grid`` counts blocks, not clusters.

        A cooperative or cluster launch is one whose blocks wait for each
        other, so all of them must be resident at once: this checks that
        against the device's occupancy and raises :class:`KernelLaunchError`
        rather than launching a kernel that could never finish.

        ``slices``: the grid's second dimension, copies of the ``grid``
        blocks that never wait for each other (batch slices), so only one
        slice's blocks must be resident at once. A cooperative launch has one.
        """
        from cuda.core import LaunchConfig

        _check_positive("grid", grid)
        _check_positive("block", block)
        _check_positive("slices", slices)
        if cooperative and slices > 1:
            raise ArgumentError(f"a cooperative launch's barrier spans the whole grid: expected 1 slice, got {slices}")
        if block > (limit := facts_of(self.device).max_threads_per_block):
            raise ArgumentError(f"block must be <= {limit} threads, got {block}")
        if shared:
            self.reserve_dynamic_shared(shared)
        if cluster:
            _check_positive("cluster", cluster)
            if grid % cluster:
                raise ArgumentError(f"grid ({grid} blocks) must be a multiple of the cluster size ({cluster})")
            if cluster > (largest := self.max_cluster_size(block, shared)):
                raise KernelLaunchError(f"{self.name}: clusters of {cluster} blocks exceed this device's largest, "
                                        f"{largest}")
            config = LaunchConfig(grid=(grid // cluster, slices), cluster=(cluster, 1), block=block,
                                  shmem_size=shared)
            resident = self.max_resident_clusters(cluster, block, shared)
            if grid // cluster > resident:
                raise KernelLaunchError(
                    f"{self.name} needs {grid // cluster} clusters of {cluster} blocks resident at once "
                    f"({block} threads, {shared} bytes of dynamic shared memory each); the GPU holds {resident}"
                )
            return config
        if cooperative and grid > (resident := self.max_resident_blocks(block, shared)):
            raise KernelLaunchError(
                f"{self.name} needs {grid} blocks resident at once ({block} threads, {shared} bytes of "
                f"dynamic shared memory each); the GPU holds {resident}"
            )
        return LaunchConfig(grid=(grid, slices), block=block, shmem_size=shared, is_cooperative=cooperative)

    def max_resident_blocks(self, block: int, shared: int = 0) -> int:
        """How many blocks of this kernel the whole GPU holds at once."""
        per_sm = self.kernel.occupancy.max_active_blocks_per_multiprocessor(block, shared)
        return per_sm * facts_of(self.device).sm_count

    def max_cluster_size(self, block: int, shared: int = 0) -> int:
        """Largest cluster of this kernel the device launches (16 on an H100).

        Asked of the driver (cuOccupancyMaxPotentialClusterSize); the
        max-active-clusters query is no guide here: on an H100 it reports
        clusters of 17 and 18 as resident, and their launch then fails.
        """
        import torch
        from cuda.core import LaunchConfig

        self.allow_non_portable_cluster()
        if shared:
            self.reserve_dynamic_shared(shared)
        cfg = LaunchConfig(grid=facts_of(self.device).sm_count, block=block, shmem_size=shared)
        return self.kernel.occupancy.max_potential_cluster_size(cfg, stream=_stream(torch.cuda.current_stream()))

    def max_resident_clusters(self, cluster: int, block: int, shared: int = 0) -> int:
        """How many clusters of ``cluster`` blocks the whole GPU holds at once."""
        import torch

        from cuda.core import LaunchConfig

        if shared:
            self.reserve_dynamic_shared(shared)
        if cluster > 8:
            self.allow_non_portable_cluster()
        cfg = LaunchConfig(grid=1, cluster=cluster, block=block, shmem_size=shared)
        return self.kernel.occupancy.max_active_clusters(cfg, stream=_stream(torch.cuda.current_stream()))


def _check_positive(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ArgumentError(f"{what} must be >= 1, got {value}")


_LOADED: dict[tuple[str, int, str], LoadedKernel] = {}

_LOADED: dict[tuple[str, int, str], LoadedKernel] = {}
_LOAD_LOCK = threading.Lock()


def get_kernel(binary: CompiledBinary, kernel: str) -> LoadedKernel:
    """Load ``kernel`` from ``binary`` on the current device (once per process)."""
    device = require_gpu()
    slot = (binary.key, device, kernel)
    if (loaded := _LOADED.get(slot)) is None:
        with _LOAD_LOCK:
            if (loaded := _LOADED.get(slot)) is None:
                from cuda.core import Device, ObjectCode

                binary.kernel_resources(kernel)  # a clear error for a wrong name
                Device(device).set_current()
                module = ObjectCode.from_cubin(binary.cubin, name=binary.name)
                loaded = _LOADED[slot] = LoadedKernel(binary, kernel, module.get_kernel(kernel), device)
    return loaded


class _TorchStream:
    """Adapts a torch stream to cuda.core's ``__cuda_stream__`` protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_THREAD = threading.local()


def _make_current(device: int) -> None:
    """Make ``device``'s primary context current in this thread (once per
    thread): cuda.core's current device is per thread, and a thread that only
    used torch so far has none."""
    done = getattr(_THREAD, "devices", None)
    if done is None:
        done = _THREAD.devices = set()
    if device not in done:
        from cuda.core import Device

        Device(device).set_current()
        done.add(device)


@functools.lru_cache(maxsize=256)
def _wrapped_stream(handle: int, device: int) -> Any:
    from cuda.core import Device

    return Device(device).create_stream(_TorchStream(handle))


def _stream(torch_stream: Any) -> Any:
    device = torch_stream.device_index
    _make_current(device)
    return _wrapped_stream(torch_stream.cuda_stream, device)


_core_launch = None


def launch(kernel: LoadedKernel, config: Any, *args: Any, stream: Any = None) -> None:
    """Launch on ``stream`` (default: torch's current stream).

    ``args`` must already be C-typed (see :func:`kernel_args`): cuda.core
    copies them by their type. This is the per-call path, so it does no work
    that could be done once: imports and the stream wrapper are cached.
    """
    global _core_launch
    if _core_launch is None:
        from cuda.core import launch as core_launch

        _core_launch = core_launch
    if stream is None:
        import torch

        stream = torch.cuda.current_stream()
    _core_launch(_stream(stream), config, kernel.kernel, *args)


def to_device_async(tensor: Any, device: Any) -> Any:
    """A CPU tensor on ``device`` without synchronising the host with the
    device: through pinned memory and an asynchronous copy (torch's caching
    host allocator keeps the pinned block until the copy has run). A plain
    ``.to(device)`` of pageable memory waits for the stream, which serialises
    a device-bound step's host work with its device work."""
    import torch

    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def kernel_args(*values: Any) -> tuple[Any, ...]:
    """C-type launch arguments: tensors become pointers, ints int32, floats float32."""
    import numpy as np
    import torch

    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(np.uint64(v.data_ptr()))
        elif isinstance(v, bool):
            out.append(np.int32(v))
        elif isinstance(v, int):
            out.append(np.int32(v))
        elif isinstance(v, float):
            out.append(np.float32(v))
        elif isinstance(v, np.generic):
            out.append(v)
        else:
            raise ArgumentTypeError(f"kernel argument must be a tensor, int, float or numpy scalar, "
                                    f"got {type(v).__name__}")
    return tuple(out)


# ----------------------------------------------------------------------------
# What each launch owns
# ----------------------------------------------------------------------------

SCRATCH_WORDS = 16
"""int32 words at the start of a launch's scratch: the status word, then the
barrier counters (arrivals, exits, each instance's progress); the exchange
buffer starts after them, 64-byte aligned."""


@dataclasses.dataclass(frozen=True)
class Scratch:
    """One launch's own device memory (see :func:`scratch`)."""

    words: Any  # int32 tensor: the status word and counters (a multiple of SCRATCH_WORDS), then the exchange floats
    status: int  # address of the status word
    counters: int  # address of the counters
    exchange: int  # address of the exchange buffer (0 when none was asked for)


def scratch(device: Any, exchange_floats: int = 0, counters: int = SCRATCH_WORDS - 1) -> Scratch:
    """Zeroed scratch for one launch on the current stream: status word,
    ``counters`` counter words and ``exchange_floats`` of exchange buffer, in
    one allocation and one memset.

    Allocated from torch's caching allocator, which is stream-ordered: the
    memory goes back to the pool when the caller drops it, and is reused only
    by work ordered after this launch. Inside a CUDA-graph capture it comes
    from the graph's private pool, so the graph owns it for its whole life,
    and the memset is part of the graph (each replay starts from zeros).
    """
    import torch

    header = -(-(1 + counters) // SCRATCH_WORDS) * SCRATCH_WORDS  # the exchange buffer stays 64-byte aligned
    words = torch.zeros(header + exchange_floats, dtype=torch.int32, device=device)
    base = words.data_ptr()
    return Scratch(words, base, base + 4, base + 4 * header if exchange_floats else 0)


# ----------------------------------------------------------------------------
# Failures: the wait bound, the report word, the test hook
# ----------------------------------------------------------------------------

HOST_SPIN_S = 200e-6
"""How long a host thread that waits for a word the GPU writes to mapped host
memory (a resident tick's echo, a serving batch's) spins on it before it
polls with ``time.sleep(0)``: NumPy reads keep the GIL, so the spin answers a
short wait at once, and the sleeps then let client threads run while a longer
one finishes, at the cost of a wait to win the GIL back."""

WAIT_TIMEOUT_ENV = "PERSISTRNN_WAIT_TIMEOUT_MS"
DEFAULT_WAIT_TIMEOUT_MS = 2000.0
"""How long a block waits for a peer that makes no progress before the launch
fails. 2 s is about 10^6 steps of any kernel launched here, so only a peer
that is not running (not resident, or failed) reaches it. Time during which
the waiting block itself was not running (preemption, MPS time-slicing) is
not counted."""


def _timeout_from_env() -> int:
    raw = os.environ.get(WAIT_TIMEOUT_ENV)
    if raw is None:
        return int(DEFAULT_WAIT_TIMEOUT_MS * 1e6)
    try:
        ms = float(raw)
    except ValueError:
        raise ArgumentError(f"{WAIT_TIMEOUT_ENV}: expected milliseconds (a positive number), got {raw!r}") from None
    if not ms > 0:
        raise ArgumentError(f"{WAIT_TIMEOUT_ENV}: expected a positive number of milliseconds, got {raw!r}")
    return int(ms * 1e6)


_wait_timeout_ns = _timeout_from_env()


def set_wait_timeout(seconds: float) -> None:
    """Bound every wait of every persistent kernel launched from now on:
    a block that sees no progress from a peer for ``seconds`` gives up, and
    the launch fails (default 2 s, or ``$PERSISTRNN_WAIT_TIMEOUT_MS``).
    A run-time kernel argument: changing it compiles nothing. Launches
    already captured in a CUDA graph keep the bound they were captured with."""
    global _wait_timeout_ns
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ArgumentError(f"set_wait_timeout: expected a positive number of seconds, got {seconds!r}")
    _wait_timeout_ns = int(seconds * 1e9)
    from . import native

    native.launch_state_changed()


def wait_timeout_ns() -> int:
    """The wait bound passed to launches now, in nanoseconds."""
    return _wait_timeout_ns


_abandon_block = -1


@contextlib.contextmanager
def inject_failure(block: int) -> Iterator[None]:
    """(Tests only.) Launches made inside the block have block ``block``
    stop taking part after its first step, so that its peers must time out,
    report and leave: how a test sees that a failure neither hangs nor costs
    each peer the full timeout."""
    global _abandon_block
    if isinstance(block, bool) or not isinstance(block, int) or block < 0:
        raise ArgumentError(f"inject_failure: expected a block index >= 0, got {block!r}")
    from . import native

    previous, _abandon_block = _abandon_block, block
    native.launch_state_changed()
    try:
        yield
    finally:
        _abandon_block = previous
        native.launch_state_changed()


def failure_hook() -> int:
    """The block to abandon in launches made now (-1: none)."""
    return _abandon_block


STATUS_MESSAGES = {
    1: "a grid barrier timed out waiting for other blocks: not all blocks were resident "
    "(another process may hold SMs), or a block failed",
    2: "a cluster exchange timed out waiting for its peers' data",
    3: "a layer timed out waiting for the previous layer's outputs: the blocks of the layer before it were not "
    "resident (another process may hold SMs), or that layer failed",
    4: "a block abandoned by the test hook (persistrnn.runtime.inject_failure) waited the whole bound, and no peer "
    "waited on it",
}


def _error(code: int, kernel: str) -> KernelLaunchError:
    detail = STATUS_MESSAGES.get(code)
    if detail is None:
        return KernelLaunchError(f"{kernel}: unknown status code {code}")
    bound = f"{_wait_timeout_ns / 1e6:g} ms"
    return KernelTimeoutError(f"{kernel}: {detail} (no progress within the wait timeout, now {bound}; "
                              f"persistrnn.runtime.set_wait_timeout or ${WAIT_TIMEOUT_ENV} sets it)")


_REPORTS: dict[int, tuple[Any, Any]] = {}
_REPORT_LOCK = threading.Lock()


def report_word(device: int | None) -> int:
    """Address of ``device``'s report word: pinned host memory, which a kernel
    writes directly (a pinned allocation has the same address on the host
    and on every device with unified addressing). ``None``: the current
    device (``torch.device("cuda")`` has no index), so that every launch on
    a device reports where the checks of that device's index read."""
    if device is None:
        import torch

        device = torch.cuda.current_device()
    entry = _REPORTS.get(device)
    if entry is None:
        import torch

        with _REPORT_LOCK:
            if (entry := _REPORTS.get(device)) is None:
                word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                entry = _REPORTS[device] = (word, word.numpy())
                from . import native

                native.report_word_created(device, word.data_ptr())
    return entry[0].data_ptr()


def report_words() -> dict[int, int]:
    """{device: address} of the report words made so far."""
    return {device: entry[0].data_ptr() for device, entry in list(_REPORTS.items())}


def raise_reported_failure(device: int | None, kernel: str = "a persistent kernel", *,
                           synchronize: bool = False) -> None:
    """Raise if a kernel launched on ``device`` reported a failure, and clear
    the report. Without ``synchronize`` this reads host memory only (no wait
    for the GPU): a failure raises at the first check after the kernel left,
    which is the next call of any persistrnn module on that device."""
    if device is None and _REPORTS:
        import torch

        device = torch.cuda.current_device()
    entry = _REPORTS.get(device)
    if entry is None:
        return
    if synchronize:
        import torch

        torch.cuda.synchronize(device)
    view = entry[1]
    code = int(view[0])
    if code:
        view[0] = 0
        raise _error(code, kernel)


def raise_failure_code(code: int, kernel: str) -> None:
    """Raise the error of a kernel's status code (PRNN_STATUS_*), if not 0:
    for a caller that reads a report word of its own."""
    if code:
        raise _error(code, kernel)


def check_status(status: Any, kernel: str) -> None:
    """Raise if a kernel left a failure code in the device status word
    ``status`` (an int32 tensor; reading it synchronises)."""
    code = int(status.item())
    if code:
        status.zero_()
        raise _error(code, kernel)
