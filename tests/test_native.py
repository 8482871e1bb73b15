"""The native replay (``persistrnn/runtime/replay.cpp``).

CPU: the library builds against this torch and loads; its key changes with
every setting a capture fixes; its entry table copies in, launches, copies
out and refuses a retired entry (with a stand-in for ``cuGraphLaunch`` that
runs the "graph" in Python); the operator still refuses CPU tensors once the
C++ kernel is registered. GPU: a second call of the operator or of a module
replays from C++ without entering Python, gives every call its own inputs'
answer, and goes back through Python where a setting, the plans or the graph
cache changed.
"""

import copy
import os
import re
import ctypes
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import persistrnn
from persistrnn import ops, runtime
from persistrnn.runtime import native

NEEDS_COMPILER = pytest.mark.skipif(shutil.which(native._compiler()) is None,
                                    reason=f"no C++ compiler ({native._compiler()}) on this machine")


@pytest.fixture(scope="module")
def library():
    """The native library for this torch, built (once per torch build and
    source: the disk cache keeps it) and loaded."""
    if native._path is None:  # the one library this process loads (a second copy would abort it)
        native._path = native.library_path()
    path = native._path
    if not path.exists():
        native.build(path)
    torch.ops.load_library(str(path))
    return torch.ops.persistrnn_native


_DRIVER_ENTRY_POINTS = native.driver_entry_points, native.copy_node_entry_points  # before any test patches them


def _restore_driver(library):
    """The driver entry points loading configured, after a test's stand-ins
    (none on a machine without a driver): later tests in this process replay
    through the loaded library."""
    launch_points, copy_points = _DRIVER_ENTRY_POINTS
    try:
        library.configure(*launch_points())
        library.configure_copy_nodes(list(copy_points()))
    except OSError:
        library.configure(0, 0)
        library.configure_copy_nodes([0] * 5)


def test_a_build_that_outlives_its_process_still_leaves_the_library_and_no_temp_file(tmp_path):
    # The build runs in a thread beside a first call; a process that ends first leaves its compiler to finish,
    # and the library is renamed into place for the next process (a stand-in compiler that takes a second). The
    # process ends once the compiler has started (it marks a file): a fixed wait raced the thread's own imports
    # (torch's, over a second on a machine with CUDA).
    import time

    compiler, started = tmp_path / "slow-c++", tmp_path / "compiler-started"
    compiler.write_text(f'#!/bin/sh\ntouch "{started}"\nwhile [ "$1" != "-o" ]; do shift; done\nsleep 1\n'
                        'echo built > "$2"\n')
    compiler.chmod(0o755)
    target = tmp_path / "cache" / "replay.so"
    code = ("import sys, threading, time\nfrom pathlib import Path\nfrom persistrnn.runtime import native\n"
            "threading.Thread(target=native.build, args=(Path(sys.argv[1]),), daemon=True).start()\n"
            "deadline = time.monotonic() + 60\n"
            "while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
            "print('ended')\n")
    ended = subprocess.run([sys.executable, "-c", code, str(target), str(started)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "CXX": str(compiler)})
    assert started.exists(), ended.stderr[-2000:]
    assert (ended.returncode, ended.stdout.strip(), target.exists()) == (0, "ended", False), ended.stderr[-2000:]
    deadline = time.monotonic() + 30
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert target.read_text() == "built\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["replay.so"]


@NEEDS_COMPILER
def test_the_library_builds_from_its_one_source_and_a_build_error_names_the_compiler_output(tmp_path, monkeypatch):
    target = tmp_path / "replay.so"
    native.build(target)
    assert target.stat().st_size > 0 and not list(tmp_path.glob("*.tmp"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(persistrnn.CompileError, match="broken.cpp"):
        native.build(tmp_path / "broken.so")
    assert not (tmp_path / "broken.so").exists() and not list(tmp_path.glob("broken.so*"))


@NEEDS_COMPILER
def test_the_native_key_changes_with_every_setting_a_capture_fixes(library):
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.fp32_precision, cudnn.rnn.fp32_precision, cudnn.enabled, runtime.wait_timeout_ns(),
             torch.backends.fp32_precision)
    library.set_launch_state(saved[3], runtime.failure_hook())
    keys = [tuple(library.settings_key())]
    try:
        matmul.fp32_precision = "ieee" if saved[0] == "tf32" else "tf32"
        keys.append(tuple(library.settings_key()))
        cudnn.rnn.fp32_precision = "ieee" if saved[1] == "tf32" else "tf32"
        keys.append(tuple(library.settings_key()))
        cudnn.enabled = not saved[2]
        keys.append(tuple(library.settings_key()))
        library.set_launch_state(2 * saved[3], runtime.failure_hook())
        keys.append(tuple(library.settings_key()))
        library.set_launch_state(saved[3], 3)
        keys.append(tuple(library.settings_key()))
        # The global setting the backends inherit, set by the new API beside the legacy one: the key still
        # answers where torch's one-flag getters refuse (ops.launch_settings reads the same way).
        torch.backends.fp32_precision = "tf32" if saved[4] != "tf32" else "ieee"
        keys.append(tuple(library.settings_key()))
        ops.launch_settings()
    finally:
        matmul.fp32_precision, cudnn.rnn.fp32_precision, cudnn.enabled = saved[:3]
        torch.backends.fp32_precision = saved[4]
        library.set_launch_state(saved[3], runtime.failure_hook())
    assert len(set(keys)) == len(keys), keys
    assert tuple(library.settings_key()) == keys[0]


@NEEDS_COMPILER
@pytest.mark.parametrize("spread", [False, True])
def test_an_entry_copies_in_launches_once_and_copies_out_into_fresh_tensors(library, spread):
    rng = np.random.default_rng(5)
    static_in = [torch.full((300,), float("nan")), torch.full((20_000,), float("nan"))]  # one of each copy kind
    static_out = [torch.full((300,), float("nan")), torch.full((20_000,), float("nan"))]
    launches = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def graph_launch(graph_exec, stream):  # the "graph": out = 2 * in + 1
        launches.append(graph_exec)
        for i, o in zip(static_in, static_out):
            o.copy_(2 * i + 1)
        return 0

    library.configure(ctypes.cast(graph_launch, ctypes.c_void_p).value, 0)
    entry = library.add_entry(static_in, static_out, 0x5EED, spread, runtime.graphs.LARGE_COPY_ELEMENTS, 0, [], [])
    try:
        for _ in range(3):
            given = [torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)) for t in static_in]
            results = native.replay(entry, given)
            for got, g, o in zip(results, given, static_out):
                torch.testing.assert_close(got, 2 * g + 1, rtol=0, atol=0)
                assert got.data_ptr() != o.data_ptr()  # the caller's own tensor
        assert launches == [0x5EED] * 3
        results[0].fill_(7.0)  # a later replay does not touch what an earlier one returned
        assert native.replay(entry, given)[0].ne(7.0).all()
        library.retire(entry)
        assert native.replay(entry, given) is None and len(launches) == 4
    finally:
        library.retire(entry)
        _restore_driver(library)


class _Memcpy3D(ctypes.Structure):  # the driver's CUDA_MEMCPY3D
    _fields_ = [(f"{side}{name}", kind) for side in ("src", "dst") for name, kind in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("Z", ctypes.c_size_t), ("LOD", ctypes.c_size_t),
        ("MemoryType", ctypes.c_int), ("Host", ctypes.c_void_p), ("Device", ctypes.c_uint64),
        ("Array", ctypes.c_void_p), ("Reserved", ctypes.c_void_p), ("Pitch", ctypes.c_size_t),
        ("Height", ctypes.c_size_t))] + [(n, ctypes.c_size_t) for n in ("WidthInBytes", "Height", "Depth")]


class _FakeDriver:
    """A captured graph as the driver shows it to the native replay: copy
    nodes from each stand-in source into a static input and from each static
    output into a stand-in sink, around a "kernel" (out = 2 * in + 1). Its
    launch runs the copies with the parameters set on the executable graph,
    as the GPU would; ``refuse`` names addresses a node will not take."""

    def __init__(self, sources, static_in, static_out, sinks):
        self.static_in, self.static_out, self.refuse = static_in, static_out, set()
        self.captured, self.launches, self.calls = {}, [], []
        pairs = [(s, t) for s, t in zip(sources, static_in)] + [(o, s) for o, s in zip(static_out, sinks)]
        for node, (src, dst) in enumerate(pairs, start=1):
            p = _Memcpy3D(srcMemoryType=2, srcDevice=src.data_ptr(), dstMemoryType=2, dstDevice=dst.data_ptr(),
                          WidthInBytes=src.nbytes, Height=1, Depth=1)
            self.captured[node] = p
        self.inputs = list(range(1, len(sources) + 1))
        self.exec_params = {n: _Memcpy3D.from_buffer_copy(p) for n, p in self.captured.items()}
        c = ctypes.CFUNCTYPE
        self.functions = [
            c(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))(
                self.get_nodes),
            c(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(self.get_type),
            c(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Memcpy3D))(self.get_params),
            c(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Memcpy3D), ctypes.c_void_p)(
                self.set_params),
            c(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))(self.context)]
        self.launch = c(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(self.run)

    def addresses(self):
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self.functions]

    def get_nodes(self, graph, nodes, count):
        ids = [99] + list(self.captured)  # 99: the kernel, not a copy
        if nodes:
            for i, n in enumerate(ids):
                nodes[i] = n
        count[0] = len(ids)
        return 0

    def get_type(self, node, kind):
        kind[0] = 1 if node in self.captured else 0
        return 0

    def get_params(self, node, params):
        ctypes.memmove(params, ctypes.byref(self.captured[node]), ctypes.sizeof(_Memcpy3D))
        return 0

    def set_params(self, graph_exec, node, params, context):
        p = params.contents
        if {p.srcDevice, p.dstDevice} & self.refuse:
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.calls.append(node)
        self.exec_params[node] = _Memcpy3D.from_buffer_copy(p)
        return 0

    def context(self, out):
        out[0] = 0xC0
        return 0

    def run(self, graph_exec, stream):
        self.launches.append(graph_exec)
        copy = lambda n: ctypes.memmove(self.exec_params[n].dstDevice, self.exec_params[n].srcDevice,  # noqa: E731
                                        self.exec_params[n].WidthInBytes)
        for n in self.inputs:
            copy(n)
        for i, o in zip(self.static_in, self.static_out):
            o.copy_(2 * i + 1)
        for n in self.captured:
            if n not in self.inputs:
                copy(n)
        return 0


@NEEDS_COMPILER
def test_an_entry_with_copy_nodes_points_them_at_each_calls_tensors_and_launches_once(library):
    rng = np.random.default_rng(7)
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    static_in, static_out = [nan(5, 3), nan(4)], [nan(5, 3), nan(4)]
    sources, sinks = [nan(5, 3), nan(4)], [nan(5, 3), nan(4)]
    driver = _FakeDriver(sources, static_in, static_out, sinks)
    library.configure(ctypes.cast(driver.launch, ctypes.c_void_p).value, 0)
    library.configure_copy_nodes(driver.addresses())
    entry = library.add_entry(static_in, static_out, 0xE1, False, runtime.graphs.LARGE_COPY_ELEMENTS, 0x6,
                              sources, sinks)
    try:
        assert library.copy_nodes(entry) == [2, 2]
        for case in ("contiguous", "strided", "refused"):
            given = [torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)) for t in static_in]
            if case == "strided":  # a transposed view: made contiguous before its address is handed over
                given[0] = torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)).t()
            if case == "refused":  # the driver refuses the caller's address: copied through the stand-in
                driver.refuse = {given[1].data_ptr()}
            driver.calls.clear()
            results = native.replay(entry, given)
            for got, g, o in zip(results, given, static_out):
                torch.testing.assert_close(got, 2 * g + 1, rtol=0, atol=0)
                assert got.data_ptr() != o.data_ptr()
            assert sorted(driver.calls) == [1, 2, 3, 4]  # every node set before the launch
            assert driver.exec_params[3].dstDevice == results[0].data_ptr()  # the output copied straight in
            if case == "contiguous":
                assert driver.exec_params[1].srcDevice == given[0].data_ptr()
            if case == "refused":
                assert driver.exec_params[2].srcDevice == sources[1].data_ptr()
        assert driver.launches == [0xE1] * 3
        # No driver to find the nodes with: the graph still copies through its stand-ins, and so does a call.
        library.configure_copy_nodes([0] * 5)
        blind = library.add_entry(static_in, static_out, 0xE2, False, runtime.graphs.LARGE_COPY_ELEMENTS, 0x6,
                                  sources, sinks)
        driver.exec_params = {n: _Memcpy3D.from_buffer_copy(p) for n, p in driver.captured.items()}
        try:
            assert library.copy_nodes(blind) == [0, 0]
            given = [torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)) for t in static_in]
            for got, g in zip(native.replay(blind, given), given):
                torch.testing.assert_close(got, 2 * g + 1, rtol=0, atol=0)
        finally:
            library.retire(blind)
    finally:
        library.retire(entry)
        _restore_driver(library)


@NEEDS_COMPILER
def test_the_operator_still_refuses_cpu_tensors_beside_the_native_cuda_kernel(library):
    m = torch.nn.LSTM(4, 8)
    with pytest.raises(persistrnn.ArgumentError, match="expected CUDA tensors, got x on cpu"):
        torch.ops.persistrnn.forward(torch.randn(3, 2, 4), None, None, [w.detach() for w in m._flat_weights],
                                     "lstm", 1, False, True)


@NEEDS_COMPILER
def test_loading_configures_the_driver_entry_points_report_words_and_launch_state(library, monkeypatch):
    launches = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def graph_launch(graph_exec, stream):
        launches.append(graph_exec)
        return 0

    address = ctypes.cast(graph_launch, ctypes.c_void_p).value
    monkeypatch.setattr(native, "driver_entry_points", lambda: (address, 0))
    monkeypatch.setattr(native, "copy_node_entry_points", lambda: (0,) * 5)  # no driver here: no copy nodes
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_builder", None)
    try:
        assert native.available() is True
        assert library.settings_key()[-2:] == [runtime.wait_timeout_ns(), -1]
        with runtime.inject_failure(5):
            assert library.settings_key()[-1] == 5
        assert library.settings_key()[-1] == -1
        saved = runtime.wait_timeout_ns() / 1e9
        runtime.set_wait_timeout(3 * saved)
        try:
            assert library.settings_key()[-2] == runtime.wait_timeout_ns()
        finally:
            runtime.set_wait_timeout(saved)
        entry = native.add_entry([torch.zeros(2)], [torch.ones(2)], type("Graph", (), {
            "raw_cuda_graph_exec": lambda self: 77})(), False)
        assert native.replay(entry, [torch.ones(2)])[0].tolist() == [1.0, 1.0] and launches == [77]
        native.retire(entry)
    finally:
        _restore_driver(library)
        library.set_launch_state(runtime.wait_timeout_ns(), -1)


def test_no_native_replay_where_it_is_turned_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_builder", None)
    assert native.available() is False and native._builder is None


@NEEDS_COMPILER
def test_a_library_not_built_yet_is_built_in_the_background_while_calls_take_the_python_path(
        library, tmp_path, monkeypatch):
    import threading

    built = native._path
    release = threading.Event()

    def slow_build(target):
        assert release.wait(30)
        # the library already loaded, by another name: a second copy of it would register its operators twice
        target.symlink_to(built)

    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "replay.so")
    monkeypatch.setattr(native, "build", slow_build)
    monkeypatch.setattr(native, "driver_entry_points", lambda: (0, 0))
    monkeypatch.setattr(native, "copy_node_entry_points", lambda: (0,) * 5)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_builder", None)
    monkeypatch.setattr(native, "_path", None)
    try:
        assert native.available() is False  # the build is running: not loaded, not failed
        assert native.available() is False and native._loaded is None and native._builder.is_alive()
        release.set()
        assert native.available(wait=True) is True and (tmp_path / "replay.so").exists()
    finally:
        release.set()
        _restore_driver(library)
        library.set_launch_state(runtime.wait_timeout_ns(), -1)


@NEEDS_COMPILER
def test_a_failed_build_warns_once_and_leaves_the_python_path(tmp_path, monkeypatch, caplog):
    def failing_build(target):
        raise persistrnn.CompileError("the compiler said no")

    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "replay.so")
    monkeypatch.setattr(native, "build", failing_build)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_builder", None)
    monkeypatch.setattr(native, "_path", None)
    monkeypatch.setattr(native, "_build_error", None)
    with caplog.at_level("WARNING", logger="persistrnn"):
        assert native.available(wait=True) is False
        assert native.available(wait=True) is False
    assert [r.getMessage() for r in caplog.records].count(
        "the native replay is unavailable (the compiler said no): calls take the Python path") == 1


# ---- GPU ------------------------------------------------------------------------


def _reference(ref, x, hx):
    with torch.no_grad():
        return ref(x.cpu().double(), tuple(s.cpu().double() for s in hx))


@pytest.mark.gpu
def test_a_captured_call_copies_through_its_own_nodes_pointed_at_each_calls_tensors():
    assert native.available(wait=True), "the native replay did not load on this GPU machine (see the log's warning)"
    gen = torch.Generator(device="cuda").manual_seed(8)
    fn = lambda a, b: (a * 2 + b, (a - b).sum(0))  # noqa: E731
    example = [torch.randn(37, 5, device="cuda", generator=gen) for _ in range(2)]
    call = runtime.CapturedCall(fn, example, copy_nodes=True)
    assert torch.ops.persistrnn_native.copy_nodes(call.native_id) == [2, 2]  # every copy is a node of the graph
    kept = []
    for layout in ("contiguous", "transposed", "contiguous"):
        a, b = (torch.randn(37, 5, device="cuda", generator=gen) for _ in range(2))
        if layout == "transposed":  # a view whose bytes are not laid out as the static input's
            a = torch.randn(5, 37, device="cuda", generator=gen).t()
        got = call(a, b)
        for g, want in zip(got, fn(a, b)):  # the sum's order may differ with its input's alignment
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-5)
            assert all(g.data_ptr() != o.data_ptr() for o in call.outputs)
        kept.append((got, fn(a, b)))
    torch.cuda.synchronize()
    for got, want in kept:  # no later call wrote into what an earlier one returned
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5)
    for plain in (runtime.CapturedCall(fn, example),  # not asked for (a training step's): copies around the launch
                  runtime.CapturedCall(fn, example, copy_nodes=True, spread_copies=True)):  # device-bound: the same
        assert torch.ops.persistrnn_native.copy_nodes(plain.native_id) == [0, 0]


@pytest.mark.gpu
def test_a_process_that_ends_with_native_entries_left_exits_cleanly():
    # A captured call adopted by the native replay and alive as the process ends (its static CUDA tensors in the
    # native tables): the process exits with 0, not a crash as its libraries' static data is destroyed.
    code = ("import torch\nfrom persistrnn import runtime\nfrom persistrnn.runtime import native\n"
            "assert native.available(wait=True)\n"
            "call = runtime.CapturedCall(lambda a: (a * 2 + 1,), [torch.randn(64, device='cuda')])\n"
            "x = torch.randn(64, device='cuda')\n"
            "assert call.native_id is not None and torch.equal(call(x)[0], x * 2 + 1)\nprint('ran')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout.strip()) == (0, "ran"), run.stderr[-3000:]


@pytest.mark.gpu
def test_a_second_call_replays_from_cpp_with_each_calls_own_inputs(untuned, monkeypatch):
    assert native.available(wait=True), "the native replay did not load on this GPU machine (see the log's warning)"
    torch.manual_seed(4)
    m = torch.nn.LSTM(12, 40, num_layers=2).cuda()
    weights = [w.detach() for w in m._flat_weights]
    ref = copy.deepcopy(m).to("cpu", torch.float64)
    entered = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **k: entered.append(1) or real(*a, **k))
    for call in range(4):
        x = torch.randn(7, 3, 12, device="cuda")
        hx = (torch.randn(2, 3, 40, device="cuda"), torch.randn(2, 3, 40, device="cuda"))
        out, h_n, c_n = torch.ops.persistrnn.forward(x, *hx, weights, "lstm", 2, False, True)
        want, (want_h, want_c) = _reference(ref, x, hx)
        for got, expected in ((out, want), (h_n, want_h), (c_n, want_c)):
            assert float((got.cpu().double() - expected).norm() / expected.norm()) <= 1e-5
        assert len(entered) == 1, f"call {call} entered Python"  # the first call captured and bound
    out.fill_(float("nan"))  # what a call returned is the caller's: the next call is unaffected
    assert not torch.ops.persistrnn.forward(x, *hx, weights, "lstm", 2, False, True)[0].isnan().any()


@pytest.mark.gpu
def test_a_call_that_records_gradients_is_refused_by_name_past_a_bound_replay(untuned, monkeypatch):
    # The operator has no autograd kernel: torch's fallback would give a tensor that requires grad no
    # gradient from it (a warning, then silently nothing). A call bound to a native replay goes to Python
    # for the refusal; the same call under no_grad still replays from C++.
    assert native.available(wait=True)
    torch.manual_seed(7)
    weights = [w.detach() for w in torch.nn.LSTM(12, 32).cuda()._flat_weights]
    x = torch.randn(5, 2, 12, device="cuda")
    h0, c0 = (torch.randn(1, 2, 32, device="cuda") for _ in range(2))
    entered = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **k: entered.append(1) or real(*a, **k))
    with torch.no_grad():
        want = torch.ops.persistrnn.forward(x, h0, c0, weights, "lstm", 1, False, True)[0].clone()
    for name, leaf in (("x", x), ("h0", h0), ("c0", c0), ("weights[2]", weights[2])):
        leaf.requires_grad_(True)
        try:
            with pytest.raises(persistrnn.UnsupportedError, match=re.escape(f"but {name} require(s) grad")):
                torch.ops.persistrnn.forward(x, h0, c0, weights, "lstm", 1, False, True)
            with torch.no_grad():
                got = torch.ops.persistrnn.forward(x, h0, c0, weights, "lstm", 1, False, True)[0]
        finally:
            leaf.requires_grad_(False)
        assert torch.equal(got, want), name
    assert len(entered) == 1, "a call under no_grad entered Python"


@pytest.mark.gpu
def test_a_module_call_replays_from_cpp_unless_its_plans_are_its_own(untuned, monkeypatch):
    assert native.available(wait=True)
    torch.manual_seed(6)
    model = persistrnn.GRU(10, 24, batch_first=True).cuda().eval()
    entered = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **k: entered.append(1) or real(*a, **k))
    x = torch.randn(5, 9, 10, device="cuda")
    with torch.no_grad():
        first = model(x)[0]
        second = model(x)[0]
    assert len(entered) == 1 and torch.equal(first, second)
    chosen = model.plan_for(5)
    monkeypatch.setattr(model, "plan_for", lambda batch: chosen)  # a plan of its own: the Python path
    with torch.no_grad():
        third = model(x)[0]
    assert len(entered) == 2 and torch.equal(first, third)


@pytest.mark.gpu
def test_a_changed_setting_plan_cache_or_graph_cache_goes_through_python_again(untuned, monkeypatch):
    from persistrnn.plan import tuner

    assert native.available(wait=True)
    torch.manual_seed(8)
    m = torch.nn.RNN(6, 16).cuda()
    weights = [w.detach() for w in m._flat_weights]
    x = torch.randn(4, 2, 6, device="cuda")
    h0 = torch.randn(1, 2, 16, device="cuda")
    entered = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **k: entered.append(1) or real(*a, **k))

    def call():
        return torch.ops.persistrnn.forward(x, h0, None, weights, "rnn_tanh", 1, False, True)[0]

    want = call()
    saved = runtime.wait_timeout_ns() / 1e9
    try:
        runtime.set_wait_timeout(2 * saved)  # a kernel argument: a new capture
        assert torch.equal(call(), want) and len(entered) == 2
    finally:
        runtime.set_wait_timeout(saved)
    assert torch.equal(call(), want) and len(entered) == 2  # the first binding again
    tuner.clear_cached_plans()
    assert torch.equal(call(), want) and len(entered) == 3
    ops.GRAPHS.clear()  # retired: the C++ side must not replay a freed graph
    assert torch.equal(call(), want) and len(entered) == 4
    assert torch.equal(call(), want) and len(entered) == 4


@pytest.mark.gpu
def test_a_stream_sessions_chunks_replay_natively_and_carry_the_state(untuned):
    assert native.available(wait=True)
    torch.manual_seed(9)
    model = persistrnn.LSTM(8, 16, num_layers=2).cuda().eval()
    session = model.stream(3)
    chunks = [torch.randn(4, 3, 8, device="cuda") for _ in range(3)]
    ref = torch.nn.LSTM(8, 16, num_layers=2).double()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = torch.cat([session(c) for c in chunks])
        want, _ = ref(torch.cat(chunks).cpu().double())  # the whole sequence at once, in float64
    assert all(entry.native_id is not None for entry in session._graphs._entries.values())
    assert float((got.cpu().double() - want).norm() / want.norm()) <= 1e-5


@pytest.mark.gpu
def test_a_forward_captured_before_the_library_loaded_is_adopted_then_replayed_from_cpp(untuned, monkeypatch):
    assert native.available(wait=True)
    torch.manual_seed(10)
    model = persistrnn.LSTM(6, 20).cuda().eval()
    x = torch.randn(5, 2, 6, device="cuda")
    entered = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **k: entered.append(1) or real(*a, **k))
    with torch.no_grad():
        monkeypatch.setattr(native, "_loaded", False)  # still building: the Python path captures
        first = model(x)[0]
        instance = list(ops.GRAPHS._entries.values())[-1]  # the newest: this model's
        assert instance.native_id is None
        monkeypatch.setattr(native, "_loaded", True)  # loaded now
        second = model(x)[0]  # the C++ kernel finds no binding: Python adopts the instance and binds it
        assert instance.native_id is not None and len(entered) == 2
        third = model(x)[0]
    assert len(entered) == 2  # replayed from C++
    assert torch.equal(first, second) and torch.equal(first, third)
