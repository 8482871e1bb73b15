"""The one layer below every kernel family: compile, cache, device facts,
launch, graphs and timing.

The forward recurrence (:mod:`persistrnn.persistent`), the fallback and the
planner use it; the benchmarks use it through the library. Everything public
in the submodules is importable from here.
"""

from ..errors import CompileError, GPUUnavailableError, KernelLaunchError, KernelTimeoutError
from .cache import CACHE_ENV, atomic_write, cache_dir, digest, entry_name, key_lock
from .compile import (CompiledBinary, KernelResources, cache_key, compile_source, lower_thread_priority,
                      map_in_threads, nvrtc_compiles, nvrtc_version, parse_ptxas_report, program_options, read_source,
                      render_template, sources_dir, submit_in_background, submit_in_threads)
from .device import (DeviceFacts, cudnn_rnn_precision, cudnn_rnn_settings, device_facts, elsewhere, facts_of,
                     matmul_allows_tf32, matmul_precision, require_gpu, rnn_allows_tf32)
from .graphs import (DEVICE_BOUND_US, CapturedCall, GraphCache, RecentShapes, capture, capture_graph, copy_tensors,
                     ordinary_tensors, own_stream, release_stream)
from . import native
from .launch import (HOST_SPIN_S, WAIT_TIMEOUT_ENV, LoadedKernel, Scratch, check_status, failure_hook, get_kernel,
                     inject_failure, kernel_args, launch, raise_failure_code, raise_reported_failure, report_word,
                     scratch, set_wait_timeout, to_device_async, wait_timeout_ns)
from .timing import per_iteration_us, time_cuda_ms, warm_up

__all__ = [
    "CACHE_ENV", "DEVICE_BOUND_US", "HOST_SPIN_S", "WAIT_TIMEOUT_ENV", "CapturedCall", "CompileError",
    "CompiledBinary", "DeviceFacts",
    "GPUUnavailableError", "GraphCache", "KernelLaunchError", "KernelResources", "KernelTimeoutError",
    "LoadedKernel", "RecentShapes", "Scratch",
    "atomic_write", "cache_dir", "cache_key", "capture", "capture_graph", "check_status",
    "compile_source", "copy_tensors", "cudnn_rnn_precision", "cudnn_rnn_settings",
    "device_facts", "digest", "elsewhere", "entry_name", "facts_of", "failure_hook", "get_kernel",
    "inject_failure", "kernel_args", "key_lock", "launch", "lower_thread_priority", "map_in_threads",
    "matmul_allows_tf32", "matmul_precision", "native", "rnn_allows_tf32", "nvrtc_compiles", "nvrtc_version",
    "ordinary_tensors", "own_stream", "release_stream",
    "parse_ptxas_report", "per_iteration_us", "program_options", "raise_failure_code", "raise_reported_failure",
    "read_source",
    "render_template",
    "report_word", "require_gpu", "scratch", "set_wait_timeout", "sources_dir", "submit_in_background",
    "submit_in_threads", "time_cuda_ms",
    "to_device_async",
    "wait_timeout_ns",
    "warm_up",
]
