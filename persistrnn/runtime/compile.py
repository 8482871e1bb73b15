"""Compilation: CUDA C++ source -> NVRTC (through NVIDIA's ``cuda.core``) ->
cubin for one architecture, with ptxas's resource report, through the disk
cache.

Needs no GPU when ``arch`` is given: CI compiles every kernel variant for
sm_90 on a CPU-only machine and checks the resource report.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from .. import __version__
from ..log import logger
from ..errors import ArgumentError, ArgumentTypeError, CompileError
from .cache import atomic_write, cache_dir, entry_name, key_lock
from .device import device_facts, import_cuda_core

__all__ = ["CompiledBinary", "KernelResources", "cache_key", "compile_source", "lower_thread_priority",
           "map_in_threads", "nvrtc_compiles", "nvrtc_version", "parse_ptxas_report", "program_options", "read_source",
           "render_template", "sources_dir", "submit_in_background", "submit_in_threads"]

T = TypeVar("T")
R = TypeVar("R")

_CACHE_MAGIC = b"PRNNBIN1"

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
            raise ArgumentError(
                f"binary {self.name!r} has no kernel {kernel!r}; it has {sorted(self.resources)}"
            ) from None


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"cannot query the NVRTC version: {err}")
    return int(major), int(minor)


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str):
        raise ArgumentTypeError(f"arch must be a str such as 'sm_90', got {type(arch).__name__}")
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ArgumentError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
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


def _cache_path(name: str, tag: str, key: str) -> Path:
    return cache_dir() / "kernels" / (entry_name(name, tag, key=key) + ".bin")


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
    atomic_write(path, _CACHE_MAGIC + len(header).to_bytes(8, "little") + header + binary.cubin)


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
    tag: str = "",
) -> CompiledBinary:
    """Compile ``source`` to a cubin, through the disk cache.

    ``arch`` defaults to the current device's (``sm_90`` on an H100); passing
    it explicitly needs no GPU. ``defines`` become ``-D`` macros. ``tag``
    describes the variant in the cache entry's name (the key still covers
    the whole source).
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ArgumentError(f"name must be a non-empty identifier-like str, got {name!r}")
    if not isinstance(source, str) or not source.strip():
        raise ArgumentError("source must be a non-empty str of CUDA C++")
    arch = _check_arch(arch) if arch is not None else device_facts().arch
    import_cuda_core()
    defines = dict(defines or {})
    key = cache_key(source, arch, defines)
    path = _cache_path(name, f"{tag}-{arch}" if tag else arch, key)
    if (hit := _read_entry(path, key)) is not None:
        return hit
    with key_lock(path):
        # Another process may have compiled it while we waited for the lock.
        if (hit := _read_entry(path, key)) is not None:
            return hit
        started = time.perf_counter()
        binary = _nvrtc_compile(name, source, arch, defines, key)
        _write_entry(path, binary)
        logger.debug("compiled %s for %s in %.2f s (%s)", path.name, arch, time.perf_counter() - started,
                     ", ".join(f"{k}: {v.registers} registers" for k, v in binary.resources.items()))
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


def submit_in_threads(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[Future[R]]:
    """``fn(x)`` for every item, started in threads in the items' order; a
    future per item, done as soon as its own call is (so a caller can use the
    first results while the last still run). NVRTC releases the GIL, so
    compilations run in parallel. cuda.core's lazily imported modules are
    imported here first, since concurrent first imports race."""
    from cuda.core import Program, ProgramOptions  # noqa: F401

    if not items:
        return []
    workers = max(1, min(len(items), max_workers or os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        return [pool.submit(fn, x) for x in items]
    finally:
        pool.shutdown(wait=False)  # the submitted calls still run; the threads end with them


def map_in_threads(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` in threads (:func:`submit_in_threads`)."""
    return [f.result() for f in submit_in_threads(fn, items, max_workers)]


def lower_thread_priority() -> None:
    """Run the calling thread, and every process it starts (a child inherits
    the thread's nice value), at the lowest priority (Linux; elsewhere
    nothing): work no call waits for then leaves the CPU to work one does."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def submit_in_background(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[Future[R]]:
    """``fn(x)`` for every item, started in the items' order in daemon threads
    at the lowest priority (:func:`lower_thread_priority`); a future per item.
    Unlike :func:`submit_in_threads`, the process does not wait for all of
    them when it exits: the items not started are cancelled, and only the
    calls running then are waited for (:func:`_end_background`)."""
    from cuda.core import Program, ProgramOptions  # noqa: F401  (concurrent first imports race)

    pending = collections.deque((x, Future()) for x in items)
    futures = [future for _, future in pending]

    def work() -> None:
        lower_thread_priority()
        while True:
            try:
                x, future = pending.popleft()
            except IndexError:
                return
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(x))
            except Exception as exc:
                future.set_exception(exc)

    threads = [threading.Thread(target=work, name="persistrnn-background", daemon=True)
               for _ in range(max(1, min(len(futures), max_workers or os.cpu_count() or 1)))]
    with _BACKGROUND_LOCK:
        _BACKGROUND[:] = [(queue, alive) for queue, alive in _BACKGROUND if any(t.is_alive() for t in alive)]
        _BACKGROUND.append((pending, threads))
    for thread in threads:
        thread.start()
    return futures


_BACKGROUND: list[tuple[collections.deque, list[threading.Thread]]] = []
"""Every :func:`submit_in_background` call's queue of items not started and
its threads, while any of them runs."""
_BACKGROUND_LOCK = threading.Lock()
_BACKGROUND_EXIT_WAIT_S = 60.0
"""The most the process's end waits for the background calls running, all
together (a compile takes seconds)."""


@atexit.register
def _end_background() -> None:
    """At the process's end, before the interpreter and the libraries it
    loaded are torn down: the background items not started are cancelled,
    and the calls running are waited for. A daemon thread left inside NVRTC
    would run on while NVRTC's and CUDA's state is destroyed around it."""
    with _BACKGROUND_LOCK:
        running = list(_BACKGROUND)
    for queue, _ in running:
        while True:
            try:
                _, future = queue.popleft()
            except IndexError:
                break
            future.cancel()
    deadline = time.monotonic() + _BACKGROUND_EXIT_WAIT_S
    for _, threads in running:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def sources_dir() -> Path:
    """Folder of the CUDA C++ templates shipped with the package."""
    return Path(__file__).parent.parent / "kernels"


def read_source(filename: str, includes: Sequence[str] = ("common.cuh",)) -> str:
    """A template from :func:`sources_dir`, with our shared headers inlined.

    Inlining (rather than an include path) keeps the cache key honest: the key
    hashes the text that was compiled, headers included.
    """
    parts = [(sources_dir() / inc).read_text() for inc in includes]
    parts.append((sources_dir() / filename).read_text())
    return "\n".join(parts)


def render_template(filename: str, *, title: str, defines: dict[str, Any], marker: str, generated: str,
                    keep_marker: bool, includes: Sequence[str] = ("common.cuh",)) -> str:
    """A kernel family's complete source: ``// title`` and one ``#define``
    per entry of ``defines``, then :func:`read_source`'s text with
    ``generated`` (code rendered from a cell spec) put at ``marker``'s place,
    before the marker where ``keep_marker``, else in its stead."""
    head, _, tail = read_source(filename, includes).partition(marker)
    if not tail:
        raise CompileError(f"{filename} lost its {marker.strip()!r} line")
    prelude = [f"// {title}"] + [f"#define {name} {value}" for name, value in defines.items()]
    return "\n".join(prelude) + "\n" + head + generated + (marker if keep_marker else "") + tail
