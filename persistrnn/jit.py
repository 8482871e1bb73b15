"""Run-time compilation and launch of persistrnn's CUDA kernels.

The one path every kernel takes: a rendered CUDA C++ source is compiled by
NVRTC (through NVIDIA's ``cuda.core``) to a cubin for one architecture, kept in
a disk cache, loaded once per process and launched on torch's current stream.

* :func:`compile_source` needs no GPU: with ``arch="sm_90"`` it runs on a
  CPU-only machine, which is how CI checks every kernel's resource report.
* :func:`get_kernel` loads a compiled binary on the current device.
* :func:`launch` launches plainly, cooperatively or as thread-block clusters.
* :func:`device_facts` reads the limits the planner needs from the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from . import __version__

T = TypeVar("T")
R = TypeVar("R")

CACHE_ENV = "PERSISTRNN_CACHE_DIR"
_CACHE_MAGIC = b"PRNNBIN1"


class GPUUnavailableError(RuntimeError):
    """Raised on the first GPU use when no usable GPU is present."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


class KernelLaunchError(RuntimeError):
    """A launch could not be made safely, or a kernel reported a failure."""


# ----------------------------------------------------------------------------
# Compile
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one entry function."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # static shared memory; dynamic is chosen at launch
    barriers: int

    @property
    def uses_local_memory(self) -> bool:
        return bool(self.stack_frame_bytes or self.spill_store_bytes or self.spill_load_bytes)


@dataclasses.dataclass(frozen=True)
class CompiledBinary:
    """A cubin plus the facts needed to trust and launch it."""

    name: str  # readable prefix, e.g. "sync_bench"
    key: str  # cache key: digest of everything that changes the binary
    arch: str  # e.g. "sm_90"
    cubin: bytes
    resources: dict[str, KernelResources]
    log: str

    def kernel_resources(self, kernel: str) -> KernelResources:
        try:
            return self.resources[kernel]
        except KeyError:
            raise ValueError(
                f"binary {self.name!r} has no kernel {kernel!r}; it has {sorted(self.resources)}"
            ) from None


def cache_dir() -> Path:
    """The disk cache: ``$PERSISTRNN_CACHE_DIR`` or ``~/.cache/persistrnn``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "persistrnn"


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"cannot query the NVRTC version: {err}")
    return int(major), int(minor)


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'sm_90', got {type(arch).__name__}")
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
    return arch


@functools.lru_cache(maxsize=None)
def _header_options() -> tuple[tuple[str, Any], ...]:
    """Where NVRTC finds toolkit headers such as ``cooperative_groups.h``.

    NVRTC 13.3 and newer carries them (``--use-bundled-headers``), so a
    CPU-only machine with only the NVRTC wheel compiles every kernel. Older
    NVRTC (13.0 on our H100 machine) needs a toolkit's or wheel's include dir.
    """
    from cuda.core import ProgramOptions

    if nvrtc_version() >= (13, 3) and "use_bundled_headers" in {f.name for f in dataclasses.fields(ProgramOptions)}:
        return (("use_bundled_headers", True),)
    candidates = []
    with contextlib.suppress(Exception):
        from cuda.pathfinder import find_nvidia_header_directory

        candidates += [find_nvidia_header_directory("cudart"), find_nvidia_header_directory("cccl")]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        candidates += [os.path.join(root, "include"), os.path.join(root, "include", "cccl")]
    # cooperative_groups.h comes with the runtime headers; the <nv/target> it
    # includes comes with CCCL, which wheels and toolkits keep in different places.
    wanted = ("cooperative_groups.h", os.path.join("nv", "target"))
    found = [next((d for d in candidates if d and os.path.exists(os.path.join(d, f))), None) for f in wanted]
    if all(found):
        return (("include_path", list(dict.fromkeys(found))),)
    return ()


def program_options(arch: str, defines: dict[str, Any], name: str = "default_program") -> Any:
    """The NVRTC options of every persistrnn compile (a cuda.core ProgramOptions)."""
    from cuda.core import ProgramOptions

    macros = [f"{k}={v}" for k, v in sorted(defines.items())]
    return ProgramOptions(
        name=name,
        arch=arch,
        std="c++17",
        ptxas_options=["-v"],  # the resource report
        # NVRTC's own cache (12.9+) skips ptxas on a hit, and with it the
        # resource report; our disk cache stores the report beside the cubin.
        no_cache=True,
        define_macro=macros or None,
        **dict(_header_options()),
    )


def cache_key(source: str, arch: str, defines: dict[str, Any] | None = None) -> str:
    """Digest of every input that changes the binary.

    Source, compile options, arch, NVRTC version and package version; a change
    to any of them is a different binary and therefore a different entry.
    """
    opts = program_options(arch, defines or {}).as_bytes("nvrtc")
    payload = json.dumps(
        {
            "source": source,
            "options": [o.decode() for o in opts],
            "arch": arch,
            "nvrtc": nvrtc_version(),
            "persistrnn": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per-kernel registers, stack, spills and shared memory from ``ptxas -v``."""
    report: dict[str, KernelResources] = {}
    current: str | None = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif (m := _PTXAS_FRAME.search(line)) and current:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _PTXAS_USED.search(line)) and current:
            regs, barriers, smem = (int(g) if g else 0 for g in m.groups())
            report[current] = KernelResources(regs, *frame, smem, barriers)
            current = None
    return report


def _cache_path(name: str, key: str) -> Path:
    return cache_dir() / f"{name}-{key}.bin"


def _read_entry(path: Path, key: str) -> CompiledBinary | None:
    """Load a cache entry; anything unreadable or inconsistent is a miss."""
    try:
        blob = path.read_bytes()
        if not blob.startswith(_CACHE_MAGIC):
            return None
        header_len = int.from_bytes(blob[8:16], "little")
        header = json.loads(blob[16 : 16 + header_len])
        cubin = blob[16 + header_len :]
        if header["key"] != key or hashlib.sha256(cubin).hexdigest() != header["sha256"]:
            return None
        return CompiledBinary(
            name=header["name"],
            key=key,
            arch=header["arch"],
            cubin=cubin,
            resources={k: KernelResources(**v) for k, v in header["resources"].items()},
            log=header["log"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_entry(path: Path, binary: CompiledBinary) -> None:
    header = json.dumps(
        {
            "key": binary.key,
            "name": binary.name,
            "arch": binary.arch,
            "sha256": hashlib.sha256(binary.cubin).hexdigest(),
            "resources": {k: dataclasses.asdict(v) for k, v in binary.resources.items()},
            "log": binary.log,
        }
    ).encode()
    blob = _CACHE_MAGIC + len(header).to_bytes(8, "little") + header + binary.cubin
    path.parent.mkdir(parents=True, exist_ok=True)
    # Temp file in the same directory, then an atomic rename: a reader never
    # sees a half-written entry, even with several processes compiling.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _key_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _nvrtc_compile(name: str, source: str, arch: str, defines: dict[str, Any], key: str) -> CompiledBinary:
    from cuda.bindings import nvrtc
    from cuda.core import Program

    program = Program(source, "c++", options=program_options(arch, defines, name))
    try:
        code = program.compile("cubin")
        # The ptxas report is read from NVRTC's program log directly: the
        # log callback of older cuda.core releases does not always deliver it.
        err, size = nvrtc.nvrtcGetProgramLogSize(program.handle)
        log = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(program.handle, log)
    except Exception as exc:  # cuda.core raises NVRTC failures as several types; the log is in the message
        raise CompileError(f"NVRTC failed to compile {name!r} for {arch}:\n{exc}") from exc
    finally:
        program.close()
    text = log.decode(errors="replace").replace("\x00", "")
    resources = parse_ptxas_report(text)
    if not resources:
        raise CompileError(f"NVRTC compiled {name!r} but reported no kernel resources; its log was:\n{text}")
    return CompiledBinary(name, key, arch, bytes(code.code), resources, text)


def compile_source(
    name: str,
    source: str,
    *,
    arch: str | None = None,
    defines: dict[str, Any] | None = None,
) -> CompiledBinary:
    """Compile ``source`` to a cubin, through the disk cache.

    ``arch`` defaults to the current device's (``sm_90`` on an H100); passing
    it explicitly needs no GPU. ``defines`` become ``-D`` macros.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"name must be a non-empty identifier-like str, got {name!r}")
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source must be a non-empty str of CUDA C++")
    arch = _check_arch(arch) if arch is not None else device_facts().arch
    defines = dict(defines or {})
    key = cache_key(source, arch, defines)
    path = _cache_path(name, key)
    if (hit := _read_entry(path, key)) is not None:
        return hit
    with _key_lock(path):
        # Another process may have compiled it while we waited for the lock.
        if (hit := _read_entry(path, key)) is not None:
            return hit
        binary = _nvrtc_compile(name, source, arch, defines, key)
        _write_entry(path, binary)
        global _nvrtc_compiles
        with _count_lock:
            _nvrtc_compiles += 1
        return binary


_nvrtc_compiles = 0
_count_lock = threading.Lock()


def nvrtc_compiles() -> int:
    """NVRTC compilations this process ran (cache misses): lets a caller, or a
    test, see that a warm cache compiled nothing."""
    return _nvrtc_compiles


def map_in_threads(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` in threads: NVRTC releases the GIL, so
    compilations run in parallel. cuda.core's lazily imported modules are
    imported here first, since concurrent first imports race."""
    from cuda.core import Program, ProgramOptions  # noqa: F401

    if not items:
        return []
    workers = max(1, min(len(items), max_workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


# ----------------------------------------------------------------------------
# Device
# ----------------------------------------------------------------------------


def require_gpu() -> int:
    """Index of the current CUDA device, or a clear error saying why there is none."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        raise GPUUnavailableError(
            "persistrnn runs its kernels on an NVIDIA GPU of compute capability 9.0 or newer "
            f"(Hopper), but torch.cuda.is_available() is False; this torch {torch.__version__} "
            f"was built with {built}. The float64 reference (persistrnn.reference) and kernel "
            "compilation for a named arch (persistrnn.jit.compile_source(..., arch='sm_90')) "
            "work without a GPU."
        )
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        raise GPUUnavailableError(
            f"persistrnn needs compute capability 9.0 or newer (thread-block clusters, "
            f"st.async, mbarrier); device {index} ({torch.cuda.get_device_name(index)}) "
            f"is {major}.{minor}"
        )
    return index


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """Limits of one GPU, read from the device itself."""

    index: int
    name: str
    arch: str
    sm_count: int
    registers_per_sm: int
    registers_per_block: int
    shared_per_sm: int
    shared_per_block_optin: int
    max_threads_per_sm: int
    max_threads_per_block: int
    l2_bytes: int
    cooperative_launch: bool
    cluster_launch: bool


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> DeviceFacts:
    from cuda.core import Device

    dev = Device(index)
    p = dev.properties
    major, minor = dev.compute_capability
    return DeviceFacts(
        index=index,
        name=dev.name,
        arch=f"sm_{major}{minor}",
        sm_count=p.multiprocessor_count,
        registers_per_sm=p.max_registers_per_multiprocessor,
        registers_per_block=p.max_registers_per_block,
        shared_per_sm=p.max_shared_memory_per_multiprocessor,
        shared_per_block_optin=p.max_shared_memory_per_block_optin,
        max_threads_per_sm=p.max_threads_per_multiprocessor,
        max_threads_per_block=p.max_threads_per_block,
        l2_bytes=p.l2_cache_size,
        cooperative_launch=bool(p.cooperative_launch),
        cluster_launch=major >= 9,
    )


def device_facts() -> DeviceFacts:
    """Facts of torch's current CUDA device (raises :class:`GPUUnavailableError`)."""
    return _device_facts(require_gpu())


# ----------------------------------------------------------------------------
# Load and launch
# ----------------------------------------------------------------------------


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
        facts = _device_facts(self.device)
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

    def config(self, grid: int, block: int, *, shared: int = 0, cluster: int = 0, cooperative: bool = False) -> Any:
        """A cuda.core LaunchConfig; ``grid`` counts blocks, not clusters.

        A cooperative or cluster launch is one whose blocks wait for each
        other, so all of them must be resident at once: this checks that
        against the device's occupancy and raises :class:`KernelLaunchError`
        rather than launching a kernel that could never finish.
        """
        from cuda.core import LaunchConfig

        _check_positive("grid", grid)
        _check_positive("block", block)
        if block > (limit := _device_facts(self.device).max_threads_per_block):
            raise ValueError(f"block must be <= {limit} threads, got {block}")
        if shared:
            self.reserve_dynamic_shared(shared)
        if cluster:
            _check_positive("cluster", cluster)
            if grid % cluster:
                raise ValueError(f"grid ({grid} blocks) must be a multiple of the cluster size ({cluster})")
            if cluster > (largest := self.max_cluster_size(block, shared)):
                raise KernelLaunchError(f"{self.name}: clusters of {cluster} blocks exceed this device's largest, {largest}")
            config = LaunchConfig(grid=grid // cluster, cluster=cluster, block=block, shmem_size=shared)
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
        return LaunchConfig(grid=grid, block=block, shmem_size=shared, is_cooperative=cooperative)

    def max_resident_blocks(self, block: int, shared: int = 0) -> int:
        """How many blocks of this kernel the whole GPU holds at once."""
        per_sm = self.kernel.occupancy.max_active_blocks_per_multiprocessor(block, shared)
        return per_sm * _device_facts(self.device).sm_count

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
        cfg = LaunchConfig(grid=_device_facts(self.device).sm_count, block=block, shmem_size=shared)
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
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")


_LOADED: dict[tuple[str, int, str], LoadedKernel] = {}


def get_kernel(binary: CompiledBinary, kernel: str) -> LoadedKernel:
    """Load ``kernel`` from ``binary`` on the current device (once per process)."""
    device = require_gpu()
    slot = (binary.key, device, kernel)
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


@functools.lru_cache(maxsize=64)
def _wrapped_stream(handle: int) -> Any:
    from cuda.core import Device

    return Device().create_stream(_TorchStream(handle))


def _stream(torch_stream: Any) -> Any:
    return _wrapped_stream(torch_stream.cuda_stream)


_core_launch = None


def launch(
    kernel: LoadedKernel,
    config: Any,
    *args: Any,
    stream: Any = None,
) -> None:
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
    _core_launch(_wrapped_stream(stream.cuda_stream), config, kernel.kernel, *args)


def capture_graph(fn: Callable[[], None], stream: Any = None) -> Any:
    """A ``torch.cuda.CUDAGraph`` of ``fn()``, captured on ``stream`` (a new
    side stream by default). ``fn`` runs once first on that stream, outside
    the capture, so compilation, module loads and allocations stay out of the
    graph."""
    import torch

    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


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
            raise TypeError(f"kernel argument must be a tensor, int, float or numpy scalar, got {type(v).__name__}")
    return tuple(out)


def sources_dir() -> Path:
    """Folder of the CUDA C++ templates shipped with the package."""
    return Path(__file__).parent / "kernels"


def read_source(filename: str, includes: Sequence[str] = ("common.cuh",)) -> str:
    """A template from :func:`sources_dir`, with our shared headers inlined.

    Inlining (rather than an include path) keeps the cache key honest: the key
    hashes the text that was compiled, headers included.
    """
    parts = [(sources_dir() / inc).read_text() for inc in includes]
    parts.append((sources_dir() / filename).read_text())
    return "\n".join(parts)


_STATUS_MESSAGES = {
    1: "a grid barrier timed out waiting for other blocks: not all blocks were resident "
    "(another process may hold SMs), or a block failed",
    2: "a cluster exchange timed out waiting for its peers' data",
    3: "a layer timed out waiting for the previous layer's outputs: the blocks of the layer before it were not "
    "resident (another process may hold SMs), or that layer failed",
}


def check_status(status: Any, kernel: str) -> None:
    """Raise if a kernel left a failure code in its status word (synchronises)."""
    code = int(status.item())
    if code:
        status.zero_()
        detail = _STATUS_MESSAGES.get(code, f"unknown status code {code}")
        raise KernelLaunchError(f"{kernel}: {detail}")
