"""CPU tests of the runtime's compile and cache layers: NVRTC compilation for sm_90, the resource
report, and the disk cache (keys, atomic writes, corrupt entries, locking)."""

import json
import multiprocessing
import os
import sys
import time

import pytest

from pathlib import Path

from persistrnn import runtime
from persistrnn.runtime import compile as runtime_compile

TINY = r"""
extern "C" __global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""

SPILLS = r"""
// A run-time index into a large array forces it to local memory.
extern "C" __global__ void local_array(float* x, int k) {
    float a[256];
    for (int i = 0; i < 256; ++i) a[i] = x[i * 7 + k];
    x[threadIdx.x] = a[(k * 13 + threadIdx.x) & 255];
}
"""


def test_compiles_for_sm90_without_gpu(isolated_cache):
    binary = runtime.compile_source("tiny", TINY, arch="sm_90")
    assert binary.cubin[:4] == b"\x7fELF"
    assert binary.arch == "sm_90"
    res = binary.kernel_resources("scale")
    assert res.registers > 0 and not res.uses_local_memory


def test_resource_report_sees_local_memory(isolated_cache):
    res = runtime.compile_source("spills", SPILLS, arch="sm_90").kernel_resources("local_array")
    assert res.stack_frame_bytes >= 1024, res  # 256 floats on the stack
    assert res.uses_local_memory


def test_parse_ptxas_report():
    log = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
        "ptxas info    : Function properties for k\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 72 registers, used 1 barriers, 1200 bytes smem\n"
        "ptxas info    : Compiling entry function 'j' for 'sm_90'\n"
        "ptxas info    : Function properties for j\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 10 registers\n"
    )
    report = runtime.parse_ptxas_report(log)
    assert report["k"] == runtime.KernelResources(72, 16, 8, 4, 1200, 1)
    assert report["j"] == runtime.KernelResources(10, 0, 0, 0, 0, 0)


def test_second_compile_is_a_cache_hit(isolated_cache, monkeypatch):
    first = runtime.compile_source("tiny", TINY, arch="sm_90")
    monkeypatch.setattr(runtime_compile, "_nvrtc_compile",
                        lambda *a: pytest.fail("compiled again despite a cached entry"))
    second = runtime.compile_source("tiny", TINY, arch="sm_90")
    assert second.cubin == first.cubin and second.resources == first.resources
    assert [p.name for p in (isolated_cache / "kernels").glob("*.bin")] == [f"tiny-sm_90-{first.key}.bin"]


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert runtime.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(runtime.CACHE_ENV)
    assert runtime.cache_dir() == Path.home() / ".cache" / "persistrnn"


def test_cache_key_covers_every_input(monkeypatch):
    base = runtime.cache_key(TINY, "sm_90", {"A": 1})
    assert runtime.cache_key(TINY + " ", "sm_90", {"A": 1}) != base
    assert runtime.cache_key(TINY, "sm_90a", {"A": 1}) != base
    assert runtime.cache_key(TINY, "sm_90", {"A": 2}) != base
    assert runtime.cache_key(TINY, "sm_90", {}) != base
    monkeypatch.setattr(runtime_compile, "nvrtc_version", lambda: (99, 0))
    assert runtime.cache_key(TINY, "sm_90", {"A": 1}) != base
    monkeypatch.undo()
    monkeypatch.setattr(runtime_compile, "__version__", "0.0.0-other")
    assert runtime.cache_key(TINY, "sm_90", {"A": 1}) != base


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "garbage", "empty", "wrong_key"])
def test_corrupt_entry_is_a_miss(isolated_cache, damage):
    binary = runtime.compile_source("tiny", TINY, arch="sm_90")
    path = isolated_cache / "kernels" / f"tiny-sm_90-{binary.key}.bin"
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip_byte":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(blob)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "wrong_key":
        header_len = int.from_bytes(blob[8:16], "little")
        header = json.loads(blob[16 : 16 + header_len])
        header["key"] = "0" * 32
        new = json.dumps(header).encode()
        path.write_bytes(blob[:8] + len(new).to_bytes(8, "little") + new + blob[16 + header_len :])
    assert runtime_compile._read_entry(path, binary.key) is None
    again = runtime.compile_source("tiny", TINY, arch="sm_90")  # recompiles and repairs
    assert again.cubin == binary.cubin
    assert runtime_compile._read_entry(path, binary.key) is not None


def _compile_in_child(cache: str, queue) -> None:
    os.environ[runtime.CACHE_ENV] = cache
    queue.put(runtime.compile_source("tiny", TINY, arch="sm_90").key)


def test_concurrent_processes_share_one_entry(isolated_cache):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(isolated_cache), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    keys = {queue.get(timeout=5) for _ in procs}
    assert len(keys) == 1
    assert len(list((isolated_cache / "kernels").glob("*.bin"))) == 1
    assert not list((isolated_cache / "kernels").glob("*.tmp")), "a temp file was left behind"


def test_compile_error_carries_the_log(isolated_cache):
    with pytest.raises(runtime.CompileError, match="undeclared_thing"):
        runtime.compile_source("broken", 'extern "C" __global__ void k() { undeclared_thing = 1; }', arch="sm_90")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(name="bad name", source=TINY, arch="sm_90"), ValueError, "identifier-like"),
        (dict(name="ok", source="  ", arch="sm_90"), ValueError, "non-empty"),
        (dict(name="ok", source=TINY, arch="90"), ValueError, "sm_90"),
        (dict(name="ok", source=TINY, arch=90), TypeError, "got int"),
    ],
)
def test_compile_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        runtime.compile_source(**kwargs)


def test_wrong_kernel_name_is_named(isolated_cache):
    binary = runtime.compile_source("tiny", TINY, arch="sm_90")
    with pytest.raises(ValueError, match=r"no kernel 'scal'.*\['scale'\]"):
        binary.kernel_resources("scal")


def test_read_source_inlines_common_header():
    src = runtime.read_source("sync_bench.cu")
    assert "prnn_grid_barrier" in src and "cluster_exchange_stasync" in src


def test_render_template_puts_defines_first_and_the_generated_code_at_the_marker(monkeypatch, tmp_path):
    (tmp_path / "common.cuh").write_text("// common")
    (tmp_path / "family.cu").write_text("before\n// ---- here ----\nafter\n")
    monkeypatch.setattr(runtime_compile, "sources_dir", lambda: tmp_path)
    kept = runtime.render_template("family.cu", title="a family", defines={"PRNN_H": 37, "PRNN_G": 4},
                                   marker="// ---- here ----", generated="int generated;\n", keep_marker=True)
    assert kept == ("// a family\n#define PRNN_H 37\n#define PRNN_G 4\n// common\nbefore\n"
                    "int generated;\n// ---- here ----\nafter\n")
    replaced = runtime.render_template("family.cu", title="t", defines={}, marker="// ---- here ----",
                                       generated="int generated;", keep_marker=False)
    assert replaced == "// t\n// common\nbefore\nint generated;\nafter\n"
    with pytest.raises(runtime.CompileError, match="family.cu lost its '// ---- elsewhere ----' line"):
        runtime.render_template("family.cu", title="t", defines={}, marker="// ---- elsewhere ----", generated="",
                                keep_marker=True)


def test_kernel_args_types_and_errors():
    import numpy as np
    import torch

    t = torch.empty(3)
    args = runtime.kernel_args(t, 7, 0.5, True, np.int64(9))
    assert [type(a) for a in args] == [np.uint64, np.int32, np.float32, np.int32, np.int64]
    assert int(args[0]) == t.data_ptr()
    with pytest.raises(TypeError, match="tensor, int, float or numpy scalar, got str"):
        runtime.kernel_args("7")


def test_sync_config_rejects_bad_values():
    from persistrnn.bench.sync import SyncConfig

    with pytest.raises(ValueError, match="steps must be >= 20.*got 10"):
        SyncConfig(steps=10)
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        SyncConfig(repeats=0)
    with pytest.raises(ValueError, match="warmup must be a non-negative int, got -1"):
        SyncConfig(warmup=-1)


def test_the_wait_timeout_and_the_failure_hook_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="positive number of seconds"):
        runtime.set_wait_timeout(0)
    with pytest.raises(ValueError, match="block index"):
        with runtime.inject_failure(-1):
            pass
    saved = runtime.wait_timeout_ns()
    runtime.set_wait_timeout(0.25)
    assert runtime.wait_timeout_ns() == 250_000_000
    runtime.set_wait_timeout(saved / 1e9)
    with runtime.inject_failure(3):
        assert runtime.failure_hook() == 3
    assert runtime.failure_hook() == -1


def test_a_call_that_took_an_evicted_graph_replays_the_current_one(monkeypatch):
    # A thread that took an instance from the cache just before another
    # thread evicted it must not replay it (its graph and pool are being
    # freed): the instance refuses once retired and the call takes the
    # cache's current one.
    import torch

    from persistrnn.runtime import GraphCache

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)

    class Instance:
        def __init__(self, name):
            self.name, self.retired, self.retired_on = name, False, None

        def __call__(self, *args):
            return None if self.retired else [self.name, *args]

        def retire(self, stream):
            self.retired, self.retired_on = True, stream

    cache = GraphCache(capacity=1)
    first = Instance("first")
    taken = cache.get("k", lambda: first, 0)
    cache.get("other", lambda: Instance("other"), 0)  # another thread's key evicts "k"
    assert first.retired and first.retired_on == 7
    assert taken(1) is None
    assert cache.call("k", lambda: Instance("again"), 0, 1) == ["again", 1]
    assert len(cache) == 1


def test_an_unwritable_cache_costs_the_entries_only(tmp_path, monkeypatch, caplog):
    # A cache folder that cannot be made (below a plain file) or written: the
    # compile still returns its binary, a warning says so once, and a write
    # reports False instead of raising.
    import logging

    from persistrnn.runtime import cache

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(runtime.CACHE_ENV, str(blocker / "cache"))
    monkeypatch.setattr(cache, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="persistrnn"):
        binary = runtime.compile_source("tiny", TINY, arch="sm_90")
        again = runtime.compile_source("tiny", TINY, arch="sm_90")  # compiled again: nothing was kept
    assert binary.cubin and again.cubin == binary.cubin
    assert caplog.text.count("cannot be written") == 1
    assert runtime.atomic_write(blocker / "cache" / "entry.json", "{}") is False
    assert runtime.atomic_write(tmp_path / "ok" / "entry.json", "{}") is True
    assert (tmp_path / "ok" / "entry.json").read_text() == "{}"


def test_work_in_the_background_runs_in_order_in_daemon_threads_at_the_lowest_priority():
    import threading

    seen = []

    def work(x):
        if x == 3:
            raise ValueError("three")
        me = threading.current_thread()
        seen.append((x, me.daemon, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                     if sys.platform.startswith("linux") else 19))
        return x * 10

    futures = runtime.submit_in_background(work, [1, 2, 3, 4], max_workers=1)
    assert [f.result(timeout=30) for f in (futures[0], futures[1], futures[3])] == [10, 20, 40]
    with pytest.raises(ValueError, match="three"):
        futures[2].result(timeout=30)
    assert [x for x, _, _ in seen] == [1, 2, 4]  # one worker: the items' order
    assert all(daemon and nice == 19 for _, daemon, nice in seen)
    assert runtime.submit_in_background(work, []) == []


@pytest.mark.gpu
def test_a_process_whose_first_call_calibrated_exits_cleanly(tmp_path):
    # A fresh cache: the first call calibrates and tunes, and leaves compiles running in the background as the
    # process ends. Before those were waited for at exit, such a process ended with SIGSEGV (rc -11), every time.
    import shutil
    import subprocess

    from persistrnn.runtime import native

    assert native.available(wait=True)
    cache = tmp_path / "cache"
    shutil.copytree(native.library_path().parent, cache / "native")  # the native library built: not timed here
    code = ("import torch, persistrnn\nm = persistrnn.LSTM(256, 256).cuda().eval()\nwith torch.no_grad():\n"
            "    m(torch.randn(50, 1, 256, device='cuda'))\ntorch.cuda.synchronize()\nprint('ran')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PERSISTRNN_CACHE_DIR": str(cache)})
    assert (run.returncode, run.stdout.strip()) == (0, "ran"), run.stderr[-3000:]


def test_the_process_end_cancels_background_work_not_started_and_waits_for_the_running_call(monkeypatch):
    import importlib
    import threading

    compile_module = importlib.import_module("persistrnn.runtime.compile")
    monkeypatch.setattr(compile_module, "_BACKGROUND", [])  # this test's work only
    started, release, done = threading.Event(), threading.Event(), []

    def work(x):
        started.set()
        release.wait(30)
        done.append(x)
        return x

    futures = runtime.submit_in_background(work, [1, 2, 3], max_workers=1)
    assert started.wait(30)
    threading.Timer(0.2, release.set).start()
    began = time.perf_counter()
    compile_module._end_background()  # what the process's end runs (atexit)
    assert time.perf_counter() - began >= 0.15 and done == [1]  # the running call finished first
    assert futures[0].result(timeout=0) == 1 and futures[1].cancelled() and futures[2].cancelled()
