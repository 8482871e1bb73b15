"""Device facts, read from the device itself (never hard-coded), and the
torch math settings the kernels follow."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import GPUUnavailableError

__all__ = ["DeviceFacts", "cudnn_rnn_precision", "cudnn_rnn_settings", "device_facts", "facts_of", "import_cuda_core",
           "elsewhere", "matmul_allows_tf32", "matmul_precision", "require_gpu", "rnn_allows_tf32"]


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


def matmul_allows_tf32() -> bool:
    """Whether torch's fp32 matmuls may run TF32 (its "high" or "medium" fp32
    matmul precision). Read from the CUDA matmul backend's ``fp32_precision``
    (torch 2.9 and later), which resolves the global setting it inherits;
    ``torch.get_float32_matmul_precision()`` instead raises once a program
    has used both the new and the legacy API (e.g. ``torch.backends.fp32_precision``
    beside ``set_float32_matmul_precision``). Earlier torch: ``allow_tf32``."""
    import torch

    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(matmul.allow_tf32)


def elsewhere(tensor: Any) -> int | None:
    """``tensor``'s CUDA device where it is not this thread's current device
    (None: the current one, or not a CUDA tensor). A call on a model on
    another GPU (a process that runs a model per GPU, or one model across
    GPUs) runs under ``torch.cuda.device`` of its tensors, as torch's own
    kernels follow their tensors: the plans, streams, captures and launches
    below it read the current device."""
    import torch

    index = tensor.get_device()  # -1 on the CPU; an int, cheaper than tensor.device
    return index if index >= 0 and index != torch._C._cuda_getDevice() else None


def rnn_allows_tf32() -> bool:
    """Whether fp32 RNN kernels may run TF32 tensor cores: only where torch
    allows TF32 for cuDNN's RNNs (``torch.backends.cudnn.allow_tf32``, on by
    default) and for fp32 matmuls (``set_float32_matmul_precision("high")``
    or ``"medium"``, the setting under which cuBLAS runs the input
    projection in TF32; off by default). So fp32 is exact by default, and a
    program that turns TF32 off for cuDNN's RNNs gets exact RNNs from
    persistrnn too, whatever its matmuls run."""
    return matmul_allows_tf32() and cudnn_rnn_precision() == "tf32"


def cudnn_rnn_precision() -> str:
    """cuDNN RNNs' fp32 precision, "tf32" or "ieee" (torch 2.9 and later:
    ``torch.backends.cudnn.rnn.fp32_precision``, resolved through the
    settings it inherits). torch's one-flag getter
    (``torch.backends.cudnn.allow_tf32``) raises once a program has set the
    TF32 flags with both the legacy and the new API, so nothing here reads it
    on such a torch."""
    import torch

    if hasattr(torch._C, "_get_fp32_precision_getter"):
        return torch._C._get_fp32_precision_getter("cuda", "rnn")
    return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"


@contextlib.contextmanager
def cudnn_rnn_settings(*, enabled: bool = True, tf32: bool | None = None) -> Iterator[None]:
    """cuDNN on or off and (``tf32`` not None) its RNNs' TF32 allowed or not
    for the duration, both put back after. ``torch.backends.cudnn.flags``
    does the same but reads the one-flag getter (see
    :func:`cudnn_rnn_precision`)."""
    import torch

    new_api = hasattr(torch.backends.cudnn, "rnn") and hasattr(torch.backends.cudnn.rnn, "fp32_precision")
    previous = (torch.backends.cudnn.enabled, cudnn_rnn_precision())
    torch.backends.cudnn.enabled = enabled
    if tf32 is not None:
        if new_api:
            torch.backends.cudnn.rnn.fp32_precision = "tf32" if tf32 else "ieee"
        else:
            torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = previous[0]
        if tf32 is not None:
            if new_api:
                torch.backends.cudnn.rnn.fp32_precision = previous[1]
            else:
                torch.backends.cudnn.allow_tf32 = previous[1] == "tf32"


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """torch's fp32 matmul precision set to ``precision`` ("highest",
    "high" or "medium") for the duration, and the CUDA matmul backend's own
    setting put back after (``fp32_precision``, or ``allow_tf32`` before torch
    2.9): what ``torch.get_float32_matmul_precision()`` would return cannot
    always be read (see :func:`matmul_allows_tf32`)."""
    import torch

    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    previous = getattr(matmul, name)
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        setattr(matmul, name, previous)
