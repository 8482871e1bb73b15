"""Device facts, read from the device itself (never hard-coded)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading

from ..errors import GPUUnavailableError

__all__ = ["DeviceFacts", "device_facts", "facts_of", "import_cuda_core", "require_gpu"]


_CUDA_CORE_LOCK = threading.Lock()


def import_cuda_core() -> None:
    """Import cuda.core once, under a lock. Its first import from several
    threads at once raised ``ImportError: cannot import name 'Device' from
    'cuda.core.cu13'`` in one of them on the H100 machine (cuda.core picks
    its CUDA-major submodule while it imports), so every path that reaches
    cuda.core first comes through here (:func:`require_gpu`, compilation)."""
    if "cuda.core" not in sys.modules or not hasattr(sys.modules["cuda.core"], "Device"):
        with _CUDA_CORE_LOCK:
            import cuda.core  # noqa: F401


def require_gpu() -> int:
    """Index of the current CUDA device, or a clear error saying why there is none."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        raise GPUUnavailableError(
            "persistrnn runs its kernels on an NVIDIA GPU of compute capability 9.0 or newer "
            f"(Hopper), but torch.cuda.is_available() is False; this torch {torch.__version__} "
            f"was built with {built}. The float64 reference (persistrnn.reference) and kernel "
            "compilation for a named arch (persistrnn.runtime.compile_source(..., arch='sm_90')) "
            "work without a GPU."
        )
    import_cuda_core()
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
def facts_of(index: int) -> DeviceFacts:
    """Facts of device ``index`` (read once per process)."""
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
    return facts_of(require_gpu())
