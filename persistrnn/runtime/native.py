"""The native replay (``replay.cpp``): a captured forward replayed from C++.

A module call or ``torch.ops.persistrnn.forward`` whose forward was captured
before is a hash of its arguments in C++, the copies in and out, and one
``cuGraphLaunch``; nothing of it runs Python. Everything else (the plan, the
capture, errors, calls inside a caller's capture) stays in Python: the C++
kernel of ``persistrnn::forward`` calls ``persistrnn::forward_capture``, our
Python implementation, for any call it has no bound forward for.

The library is built from its one source with the host's C++ compiler
against the torch that runs it (~15 s on the H100's host, once per torch
build: the disk cache keeps it), in a thread of its own that the first
forward on CUDA starts; calls take the Python path until it is loaded.
Where it cannot be built (no compiler) or loaded, a warning says so once and
every call takes the Python path, which computes the same thing. ``$PERSISTRNN_NATIVE=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from ..errors import CompileError
from ..log import logger
from .cache import cache_dir, digest, entry_name, key_lock
from .compile import lower_thread_priority

__all__ = ["NATIVE_ENV", "SOURCE", "add_entry", "available", "bind", "build", "launch_state_changed", "library_path",
           "replay", "report_word_created", "retire", "unbind_all"]

NATIVE_ENV = "PERSISTRNN_NATIVE"
SOURCE = Path(__file__).with_name("replay.cpp")
COMPILE_TIMEOUT_S = 300

_LOCK = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def library_path() -> Path:
    """Where the library for this torch build lives in the disk cache: the
    name says what it is, the digest covers the source, torch's version and
    C++ ABI, and the compiler."""
    import torch

    key = digest([SOURCE.read_text(), torch.__version__, torch.version.git_version,
                  bool(torch._C._GLIBCXX_USE_CXX11_ABI), _compiler()])
    return cache_dir() / "native" / (entry_name("replay", f"torch{torch.__version__}", key=key) + ".so")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def build(target: Path) -> None:
    """Compile ``replay.cpp`` into ``target`` (a temp name, then a rename:
    a reader never sees half a library). Raises :class:`CompileError` with
    the compiler's output.

    The compiler and the rename run in one child shell whose output goes to
    a file, not to a pipe of this process: a process that ends during the
    build (the build runs beside a first call, and a short script ends in
    less than its ~15 s) leaves the child to finish it, so the next process
    finds the library instead of a temp file of this one's."""
    import torch
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    command = [_compiler(), "-O2", "-std=c++20", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-isystem{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", tmp,
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    log = tmp + ".log"
    # The log goes before the rename: whoever sees the library in place never sees the log beside it.
    then_rename = 'tmp="$1" target="$2" log="$3"; shift 3; "$@" >"$log" 2>&1 && rm -f "$log" && mv -f "$tmp" "$target"'
    try:
        done = subprocess.run(["sh", "-c", then_rename, "sh", tmp, str(target), log, *command],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            with open(log, errors="replace") as output:
                raise CompileError(f"building the native replay failed ({' '.join(command[:1])} exit "
                                   f"{done.returncode}):\n{output.read()[-4000:]}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CompileError(f"building the native replay failed: {exc}") from exc
    finally:
        for leftover in (tmp, log):
            if os.path.exists(leftover):
                os.unlink(leftover)


def available(*, wait: bool = False) -> bool:
    """Whether the native replay is loaded. The first call loads it where
    the disk cache has it; where it has to be built, the build runs in a
    thread of its own and calls take the Python path until it is done (a
    first call must not wait ~15 s for a compiler), unless ``wait`` (tests,
    benchmarks). False, with one warning, where it cannot be had; False
    without one where ``$PERSISTRNN_NATIVE`` is 0."""
    global _loaded, _builder, _path
    if _loaded is not None:
        return _loaded
    with _LOCK:
        if _loaded is None and _builder is None:
            import torch

            # One library per process, wherever the cache folder points later: a second copy loaded would
            # register its operators twice, which torch refuses by aborting.
            _path = _path or library_path()
            if os.environ.get(NATIVE_ENV, "1") == "0":
                _loaded = False
            elif not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
                logger.warning("the native replay needs torch.cuda.CUDAGraph.raw_cuda_graph_exec (torch %s has "
                               "none): calls take the Python path", torch.__version__)
                _loaded = False
            elif _path.exists():
                _loaded = _load()
            else:
                _builder = threading.Thread(target=_build_cached, name="persistrnn-native-build", daemon=True)
                _builder.start()
        builder = _builder
    if _loaded is None and builder is not None:
        if wait:
            builder.join()
        if not builder.is_alive():
            with _LOCK:
                if _loaded is None:
                    _loaded = _build_error is None and _load()
                    if _build_error is not None:
                        logger.warning("the native replay is unavailable (%s): calls take the Python path",
                                       _build_error)
    return bool(_loaded)


_builder: threading.Thread | None = None
_build_error: Exception | None = None
_path: Path | None = None  # the library this process builds and loads


def _build_cached() -> None:
    """Build the library into the disk cache, unless another process does
    (the cache's lock) or did."""
    global _build_error
    import time

    import torch

    # This thread and the compiler it starts at the lowest priority: on a
    # first call the build runs beside the calibration's and the tuner's
    # NVRTC compiles, which the call waits for and the build's 12 s of CPU
    # would slow.
    lower_thread_priority()
    path = _path
    try:
        with key_lock(path):
            if not path.exists():
                start = time.perf_counter()
                build(path)
                logger.info("built the native replay for torch %s in %.1f s: %s", torch.__version__,
                            time.perf_counter() - start, path)
    except CompileError as exc:
        _build_error = exc


def _load() -> bool:
    """Load the built library and tell it the driver's entry points, the
    report words and the launch state."""
    import torch

    try:
        torch.ops.load_library(str(_path))
        torch.ops.persistrnn_native.configure(*driver_entry_points())
        torch.ops.persistrnn_native.configure_copy_nodes(list(copy_node_entry_points()))
    except (OSError, RuntimeError, AttributeError) as exc:
        logger.warning("the native replay is unavailable (%s): calls take the Python path", exc)
        return False
    from .launch import report_words

    for device, address in report_words().items():
        torch.ops.persistrnn_native.set_report_word(device, address)
    _push_launch_state()
    return True


def driver_entry_points() -> tuple[int, int]:
    """The addresses of the CUDA driver's ``cuGraphLaunch`` and
    ``cuStreamIsCapturing``, which the C++ side calls."""
    driver = ctypes.CDLL("libcuda.so.1")
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (driver.cuGraphLaunch, driver.cuStreamIsCapturing))


def copy_node_entry_points() -> tuple[int, ...]:
    """The addresses of the driver functions that find a captured graph's
    copy nodes and set their addresses per launch: ``cuGraphGetNodes``,
    ``cuGraphNodeGetType``, ``cuGraphMemcpyNodeGetParams``,
    ``cuGraphExecMemcpyNodeSetParams``, ``cuCtxGetCurrent``."""
    driver = ctypes.CDLL("libcuda.so.1")
    names = ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphMemcpyNodeGetParams", "cuGraphExecMemcpyNodeSetParams",
             "cuCtxGetCurrent")
    return tuple(ctypes.cast(getattr(driver, name), ctypes.c_void_p).value for name in names)


def launch_state_changed() -> None:
    """Tell the native keys the kernels' wait bound and test hook (Python
    state that a capture fixes), after either changed."""
    if _loaded:
        _push_launch_state()


def _push_launch_state() -> None:
    import torch

    from .launch import failure_hook, wait_timeout_ns

    torch.ops.persistrnn_native.set_launch_state(wait_timeout_ns(), failure_hook())


def report_word_created(device: int, address: int) -> None:
    """Tell the native path where ``device``'s report word is: a call finds a
    reported failure there and takes the Python path, which raises it."""
    if _loaded:
        import torch

        torch.ops.persistrnn_native.set_report_word(device, address)


def add_entry(inputs: Sequence[Any], outputs: Sequence[Any], graph: Any, spread: bool,
              sources: Sequence[Any] = (), sinks: Sequence[Any] = ()) -> int:
    """Register a captured call (its static inputs and outputs and its
    executable graph) for native replays; returns its id. ``sources`` and
    ``sinks`` (where the graph was captured with copy nodes, see
    :class:`~persistrnn.runtime.graphs.CapturedCall`): the stand-ins its
    nodes copy each input from and each output to, which a replay replaces by
    the caller's tensors and the new outputs."""
    import torch

    from .graphs import LARGE_COPY_ELEMENTS

    raw = graph.raw_cuda_graph() if sources or sinks else 0
    return torch.ops.persistrnn_native.add_entry(list(inputs), list(outputs), graph.raw_cuda_graph_exec(), spread,
                                                 LARGE_COPY_ELEMENTS, raw, list(sources), list(sinks))


def replay(entry: int, given: Sequence[Any]) -> list[Any] | None:
    """One replay of ``entry`` on ``given``; None once it is retired."""
    import torch

    results = torch.ops.persistrnn_native.replay(entry, given)
    return results if results else None


def bind(entry: int, x: Any, h0: Any, c0: Any, weights: Sequence[Any], cell: str, num_layers: int,
         bidirectional: bool, has_biases: bool) -> None:
    """Make ``entry`` what ``torch.ops.persistrnn.forward`` replays for these
    arguments (their shapes, the weights' addresses, the current stream and
    settings) without entering Python."""
    import torch

    torch.ops.persistrnn_native.bind(entry, x, h0, c0, list(weights), cell, num_layers, bidirectional, has_biases)


def retire(entry: int) -> None:
    """No replay of ``entry`` after this returns, and none in progress."""
    import torch

    torch.ops.persistrnn_native.retire(entry)


def unbind_all() -> None:
    """Forget every binding (the plans changed); entries stay until retired."""
    if _loaded:
        import torch

        torch.ops.persistrnn_native.unbind_all()
