"""CUDA graphs: capture, replay, ownership.

A small model's forward is bound by Python issue time when called eagerly
(measured on the H100: 0.87 ms per call of a 3-layer LSTM 128 whose device
work is 0.25 ms); a replay of its captured forward is one graph launch.

Concurrency is the design constraint. A captured graph has fixed input,
output and scratch buffers, so two replays of one graph that can overlap
would overwrite each other. :class:`GraphCache` therefore keeps one captured
instance **per stream**: the replays of one instance are ordered by that
stream, so each sees its own inputs to the end. Threads that share a stream
take the instance's lock for the few microseconds of host work (copy in,
replay, copy out), which only puts their work in the stream order it would
have anyway. A call never waits for another stream's work. (A pool of
instances guarded by events would also be correct, but every call would pay
an event query; per-stream instances cost nothing per call.)

Everything a graph reads or writes (its static buffers, the scratch of its
launches, the intermediate tensors, the cuBLAS workspace of its GEMMs) lives
in a memory pool that no one but our graphs allocates from, and is freed only
with the graph; an evicted graph is dropped only after its last replay has
finished. The graphs of a :class:`CapturedCall` replay on one stream, so
those of one stream share one pool (:func:`capture`'s ``shared_pool``):
their replays never overlap, and what one frees at the end of its capture
(its intermediates, a 32 MiB cuBLAS workspace) the next one's capture reuses.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, Callable, Sequence

from . import native

__all__ = ["CapturedCall", "GraphCache", "RecentShapes", "capture", "capture_graph", "copy_tensors",
           "ordinary_tensors", "own_stream", "release_stream"]

_CAPTURE_LOCK = threading.RLock()  # held by a capture, and by a wait on a stream that a capture might use
# (device, raw replay stream) -> its live graphs, whose pool the next capture for that stream shares. A pool is
# named by a live graph's pool(), never kept as a handle: torch refuses a capture into a pool whose graphs are
# all gone (an internal assert, until its memory is freed), and a stream's graphs may all be dropped at once.
_STREAM_GRAPHS: dict[tuple[int, int], weakref.WeakSet] = {}
_FREE_STREAMS: dict[int, list[Any]] = {}
_STREAMS_LOCK = threading.Lock()


def own_stream(device: int) -> Any:
    """A CUDA stream (a torch ``ExternalStream``) that no one else holds
    until :func:`release_stream` gives it back: a free one of ours, or a
    new one. torch's ``torch.cuda.Stream()`` hands out 32 pooled streams
    round robin, so two holders that each believe a stream theirs can share
    it, and a capture on it by one thread then takes in (or is invalidated
    by) the other's launches. Our streams are never destroyed: tensors whose
    memory torch's allocator ties to a stream may outlive any holder (a
    destroyed stream aborted the process at exit, when the allocator
    recorded an event on it)."""
    import torch

    with _STREAMS_LOCK:
        free = _FREE_STREAMS.setdefault(device, [])
        if free:
            return free.pop()
    from cuda.bindings import runtime as cudart

    with torch.cuda.device(device):
        err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamCreateWithFlags on device {device}: {err}")
    return torch.cuda.ExternalStream(int(handle), device=device)


def release_stream(stream: Any) -> None:
    """Give back a stream from :func:`own_stream` for another holder (work
    queued on it stays ordered before the next holder's)."""
    with _STREAMS_LOCK:
        _FREE_STREAMS.setdefault(stream.device.index, []).append(stream)


@contextlib.contextmanager
def ordinary_tensors() -> Any:
    """Tensors made inside are ordinary tensors, also where the caller runs
    under ``torch.inference_mode()``; grad mode stays off there, as inference
    mode had it. For buffers kept across calls (a captured call's static
    tensors, a session's or an engine's states): a later call updates them in
    place in whatever mode it runs, and torch refuses an in-place update of
    an inference tensor outside inference mode."""
    import torch

    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def capture_graph(fn: Callable[[], Any], stream: Any = None) -> Any:
    """``fn()`` captured as a ``torch.cuda.CUDAGraph`` (see :func:`capture`)."""
    return capture(fn, stream=stream)[0]


def capture(record: Callable[[], Any], warm: Callable[[], Any] | None = None, *,
            stream: Any = None, keep_graph: bool = False, shared_pool: bool = False) -> tuple[Any, Any]:
    """(graph, result) for ``record()`` captured as a ``torch.cuda.CUDAGraph``.

    The capture runs on ``stream`` (default: one of :func:`own_stream`'s,
    held for the capture). ``warm()`` (default: ``record``) runs once first on the capture stream,
    outside the capture, so compilation, module loads, cuBLAS workspaces and
    lazy allocations stay out of the graph; it may itself capture graphs (a
    module called inside ``fn`` does), so it runs before the capture lock is
    taken. The captures themselves are serialised within the process (a
    wait on a stream, :meth:`CapturedCall.retire`, must not meet a capture
    on it) and run in thread-local mode: other threads keep launching and
    allocating meanwhile. A capture that fails keeps its stream out of the
    free list (it may still be capturing). ``result``
    is what the captured call returned; its tensors, and every tensor
    ``record`` allocates, live in the graph's memory pool, ordinary
    tensors whatever the caller's mode (:func:`ordinary_tensors`): the graph
    serves later calls in any mode. ``shared_pool``: the graph is replayed
    on the caller's current stream only, and shares its pool with the other
    graphs so captured for that stream (their replays are ordered by it, so
    the memory one graph uses only while it runs can be another's), the pool
    of one of them that is alive, or a new one where none is; the tensors
    each graph holds stay its own. ``keep_graph``:
    the graph keeps its ``cudaGraph_t`` (``raw_cuda_graph()``) beside the
    instantiated one, for finding its nodes."""
    import torch

    held = stream is None
    if held:
        stream = own_stream(torch.cuda.current_device())
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    # The outer stream context restores the caller's stream on every exit: torch's graph context does not
    # when ending the capture raises.
    with torch.cuda.stream(stream), ordinary_tensors():
        try:
            (warm or record)()
        except BaseException:
            if held:  # not capturing yet: the stream can serve another holder
                release_stream(stream)
            raise
        with _CAPTURE_LOCK:
            graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
            siblings = anchor = None
            if shared_pool:
                with _STREAMS_LOCK:
                    siblings = _STREAM_GRAPHS.setdefault((caller.device.index, caller.cuda_stream),
                                                         weakref.WeakSet())
                    anchor = next(iter(siblings), None)  # held to the capture's end: its pool stays live
            # torch keeps one cuBLAS workspace per (handle, stream), and a captured GEMM embeds its address.
            # Cleared before the capture, the workspace a GEMM of this graph needs is allocated inside it, from
            # the graph's pool, and lives as long as the graph; cleared after, torch's map keeps no address
            # in that pool. Otherwise our graphs shared the map's workspace, which torch frees whenever it
            # clears the map: torch.compile's CUDA-graph trees (mode="reduce-overhead") clear it around every
            # warm-up and recording, and the next replay of a forward of ours raised an illegal address (H100,
            # 6 of 6 runs). The same as those trees do for their own graphs. In a pool of its own every graph
            # kept a 32 MiB workspace (48 against 17 MiB reserved per captured forward, perf notes §92); in a
            # stream's shared pool the next capture there reuses the one this capture frees at its end.
            torch._C._cuda_clearCublasWorkspaces()
            try:
                with torch.cuda.graph(graph, pool=None if anchor is None else anchor.pool(), stream=stream,
                                      capture_error_mode="thread_local"):
                    result = record()
            finally:
                torch._C._cuda_clearCublasWorkspaces()
            if keep_graph:
                graph.instantiate()
            if siblings is not None:
                with _STREAMS_LOCK:
                    siblings.add(graph)
    caller.wait_stream(stream)
    if held:  # only after a capture that ended well: a failed one's stream is not handed to anyone
        release_stream(stream)
    return graph, result


# The copies in and out of a captured call trade device time against host
# time. torch._foreach_copy_ (multi_tensor_apply) copies every tensor in one
# launch but gives each 65,536-element chunk of a tensor one thread block, so
# a large tensor is copied by a handful of SMs; Tensor.copy_ spreads a tensor
# over the whole GPU but is a launch of its own. Measured on the H100 (eager
# calls back to back, all in one multi-tensor launch against each tensor of
# at least 16 K elements on its own): device-bound forwards gained 10-20 µs
# per call (LSTM 128 x 3 at batch 10, graph 177 µs: 197 -> 186; LSTM 1024
# batch 10: 781 -> 764; GRU 1024 batch 20: 1020 -> 1000), while host-bound
# ones, whose calls the host's issue time sets, lost 20-30 µs to the extra
# launches (LSTM 64 at batch 10-20, graph 56 µs: 90 -> 114, 105 -> 136).
# So a call spreads its copies only where its device time exceeds what the
# host takes to issue a call (70-130 µs on the H100's host).
LARGE_COPY_ELEMENTS = 1 << 14  # below this (64 KB of fp32) one block copies a tensor in about a launch's time
DEVICE_BOUND_US = 150.0


def copy_tensors(dst: Sequence[Any], src: Sequence[Any], *, spread: bool) -> None:
    """``dst[i].copy_(src[i])`` for every i. ``spread``: each tensor of at
    least :data:`LARGE_COPY_ELEMENTS` elements by its own copy, the rest in
    one multi-tensor launch (the least device time); otherwise all in one
    multi-tensor launch (the least host time)."""
    import torch

    if not spread:  # the host-bound calls': no Python per tensor
        torch._foreach_copy_(dst, src)
        return
    small_dst, small_src = [], []
    for d, s in zip(dst, src, strict=True):
        if d.numel() >= LARGE_COPY_ELEMENTS:
            d.copy_(s)
        else:
            small_dst.append(d)
            small_src.append(s)
    if small_dst:
        torch._foreach_copy_(small_dst, small_src)


class CapturedCall:
    """``fn(*args)`` captured once, on static input buffers of the shapes of
    the example ``args``.

    A call is a copy into the static inputs, one replay, and a copy of the
    graph's outputs into fresh tensors (:func:`copy_tensors`; ``spread_copies``
    where the call is device-bound), so the caller owns what it gets and no
    later replay touches it. With ``copy_nodes``, where the native replay is
    loaded at capture and the call is host-bound (not ``spread_copies``),
    the copies are the graph's own first and last nodes, captured from
    stand-in tensors, and the native replay points them at the caller's
    tensors and the new outputs before each launch: one launch per call
    instead of three (perf notes §60); the stand-ins double the static
    buffers. ``fn`` returns a tuple of tensors. ``None`` arguments stay
    None. Arguments marked False in ``copy_in`` are not copied: the graph
    reads (and may write) them where they are, e.g. a stream's carried
    states.

    Where the native replay loads (:mod:`persistrnn.runtime.native`), a call
    is one C++ call (the outputs' allocations, the copies and the launch,
    ~1 µs of host time per tensor less than from Python), and the forward
    operator's C++ kernel can replay the instance without Python at all;
    every replay, from Python or C++, takes the one lock there. The native
    replay is a ``cuGraphLaunch``: it skips what ``CUDAGraph.replay`` does
    for torch's random generators, so ``fn`` must draw no random numbers
    (dropout masks come in as arguments).

    The static inputs are allocated inside the capture, so every buffer the
    graph uses is in the pool of our graphs replayed on its stream (none in
    whatever pool is current around the call, e.g. ``torch.compile``'s
    CUDA-graph pool while it warms up), and lives exactly as long as the
    graph.
    """

    native_id: int | None = None  # the instance's id in the native replay's table, where it has one

    def __init__(self, fn: Callable[..., Sequence[Any]], args: Sequence[Any],
                 copy_in: Sequence[bool] | None = None, *, spread_copies: bool = False,
                 copy_nodes: bool = False) -> None:
        import torch

        self.spread_copies = spread_copies
        copy_in = [True] * len(args) if copy_in is None else list(copy_in)
        self.copy_in = [c and a is not None for a, c in zip(args, copy_in)]
        self.copied: list[Any] = []

        # Host-bound calls that asked for them only: the stand-ins double the static buffers (a training
        # step's saved activations would double its graph's memory), and a device-bound call (spread_copies)
        # gains nothing from fewer launches.
        copy_nodes = copy_nodes and not spread_copies and native.available()
        self.sources: list[Any] = []  # what the copy nodes were captured copying from and to
        self.sinks: list[Any] = []

        def record() -> Sequence[Any]:
            inputs = [torch.empty_like(a, memory_format=torch.contiguous_format) if c else a
                      for a, c in zip(args, self.copy_in)]
            self.copied = [t for t, c in zip(inputs, self.copy_in) if c]
            if copy_nodes:
                self.sources = [torch.empty_like(t) for t in self.copied]
                for t, s in zip(self.copied, self.sources):
                    t.copy_(s)
            outs = fn(*inputs)
            if copy_nodes:
                self.sinks = [torch.empty_like(o) for o in outs]
                for s, o in zip(self.sinks, outs):
                    s.copy_(o)
            return outs

        self.graph, outs = capture(record, lambda: fn(*args), keep_graph=copy_nodes, shared_pool=True)
        self.outputs = list(outs)
        self.device = self.outputs[0].device
        self.lock = threading.Lock()
        self.retired = False
        self.adopt_native()

    def adopt_native(self) -> None:
        """Hand the replays to the native replay, where it is loaded (it may
        finish building after the capture). Under the instance's lock, which
        a Python replay holds throughout, and checked again inside it: no
        Python replay runs after this, and no C++ replay before."""
        if self.native_id is not None or not native.available():
            return
        with self.lock:
            if self.native_id is None and not self.retired:
                self.native_id = native.add_entry(self.copied, self.outputs, self.graph, self.spread_copies,
                                                  self.sources, self.sinks)
                # an instance dropped without retire (its cache cleared by the GC) frees its buffers there too
                weakref.finalize(self, native.retire, self.native_id).atexit = False

    def __call__(self, *args: Any) -> list[Any] | None:
        """The outputs of one replay on ``args``; None if the instance was
        retired (evicted from its cache) before this call took its lock: the
        caller then takes the cache's current instance
        (:meth:`GraphCache.call`)."""
        import torch

        given = [a for a, c in zip(args, self.copy_in) if c]
        if self.native_id is None:
            self.adopt_native()
        if self.native_id is None:
            results = [torch.empty_like(o) for o in self.outputs]
            with self.lock:
                if self.retired:
                    return None
                if self.native_id is None:  # not adopted meanwhile
                    # (a graph captured with copy nodes copies from and to its stand-ins itself)
                    if given:
                        copy_tensors(self.sources or self.copied, given, spread=self.spread_copies)
                    self.graph.replay()
                    copy_tensors(results, self.sinks or self.outputs, spread=self.spread_copies)
                    return results
        return native.replay(self.native_id, given)

    def retire(self, stream: int) -> None:
        """No replay after this, and every replay queued before it finished,
        before the graph and its pool are freed. Replays queue under the
        instance's lock, so once it is taken here every earlier replay is on
        ``stream`` (the raw handle of the only stream this instance is
        replayed on), and a thread that took the instance from the cache just
        before its eviction finds it retired instead of replaying a graph
        about to be freed. A wait on that stream only, on eviction only (an
        event recorded per call would cost every call, and a device-wide wait
        is refused while another thread captures)."""
        import torch

        with self.lock:
            self.retired = True  # no adoption after this
            entry = self.native_id
        if entry is not None:
            native.retire(entry)  # the lock the native replays take: none in progress after this
        with _CAPTURE_LOCK:  # the stream may be one of ours, now another thread's capture stream
            torch.cuda.ExternalStream(stream, device=self.device).synchronize()


class GraphCache:
    """Captured calls, one per (key, device, stream), the oldest dropped
    first beyond ``capacity`` (a hit moves nothing: no lock on the call path).

    ``call(key, make, device, *args)`` replays the instance of ``key`` for
    torch's current stream on ``device`` on ``args``, capturing it with
    ``make()`` on first use; ``on_replay(instance)``, if given, runs after
    the replay with the instance that made it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple, CapturedCall] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def call(self, key: tuple, make: Callable[[], CapturedCall], device: int, *args: Any,
             on_replay: Callable[[CapturedCall], None] | None = None) -> list[Any]:
        """One replay of ``key``'s instance on ``args`` (again with the
        current instance if another thread evicted the one taken)."""
        while (results := (instance := self.get(key, make, device))(*args)) is None:
            pass
        if on_replay is not None:
            on_replay(instance)
        return results

    def get(self, key: tuple, make: Callable[[], CapturedCall], device: int) -> CapturedCall:
        import torch

        # the raw handle, read in C: torch.cuda.current_stream() costs several µs of Python
        full = (key, device, torch._C._cuda_getCurrentRawStream(device))
        entry = self._entries.get(full)
        if entry is not None:
            return entry
        entry = make()  # outside the cache lock: capturing takes milliseconds
        with self._lock:
            entry = self._entries.setdefault(full, entry)
            evicted = []
            while len(self._entries) > self.capacity:
                evicted.append(self._entries.popitem(last=False))
        for (_, _, stream), old in evicted:
            old.retire(stream)
        return entry

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.items()), collections.OrderedDict()
        for (_, _, stream), entry in entries:
            entry.retire(stream)


class RecentShapes:
    """Which calls of a shape that may change from call to call are worth a
    capture: a packed batch's padded length is its longest sequence, which a
    loader that buckets by length repeats and one that does not draws anew
    each batch. A capture costs about two uncaptured calls (a warm-up and the
    capture itself), so a shape is captured once it came at least twice among
    the last ``window`` calls, and only while those calls had at most
    ``fits`` distinct shapes: the graphs of more would evict each other in a
    :class:`GraphCache` before their replays paid for them.

    ``note(shape)`` records a call; ``repeats(shape)`` says whether to capture it.
    """

    def __init__(self, window: int, fits: int) -> None:
        self.fits = fits
        self._recent: collections.deque[Any] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def note(self, shape: Any) -> None:
        with self._lock:
            self._recent.append(shape)

    def repeats(self, shape: Any) -> bool:
        with self._lock:
            recent = list(self._recent)
        return recent.count(shape) >= 2 and len(set(recent)) <= self.fits

    def clear(self) -> None:
        with self._lock:
            self._recent.clear()
