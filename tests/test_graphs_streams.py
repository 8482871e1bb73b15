"""The capture's stream bookkeeping (``runtime.graphs``), with torch's CUDA
calls replaced by stand-ins so that it runs without a GPU: a capture holds
one of our own streams and gives it back only when it ended well or failed
before capturing; the caller's stream is current again on every exit; a wait
on a stream (``CapturedCall.retire``) never meets a capture in progress;
the graphs replayed on one stream share one memory pool, and no other
graph is captured into it."""

import threading

import pytest
import torch

from persistrnn.runtime import graphs


class FakeStream:
    handles = iter(range(1000, 2000))

    def __init__(self, name):
        self.name = name
        self.cuda_stream = next(self.handles)  # the raw handle
        self.device = torch.device("cuda", 0)
        self.waited_on = []

    def wait_stream(self, other):
        self.waited_on.append(other.name)

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeGraph:
    pool_id = None

    def pool(self):
        return self.pool_id


class FakeCuda:
    """torch.cuda's calls that ``capture`` makes, recording what happens."""

    def __init__(self, fail_capture_end=False):
        self.current = FakeStream("caller")
        self.fail_capture_end = fail_capture_end
        self.captures = []
        self.pools = []  # the pool each capture was asked to share (None: a pool of its own)
        self.made_pools = iter(range(1000))
        self.events = []  # cuBLAS workspace clears, capture begins and ends, in order

    def clear_cublas_workspaces(self):
        self.events.append("clear workspaces")

    def current_device(self):
        return 0

    def current_stream(self, device=None):
        return self.current

    def stream(self, stream):
        cuda = self

        class Context:
            def __enter__(self):
                self.saved, cuda.current = cuda.current, stream

            def __exit__(self, *exc):
                cuda.current = self.saved

        return Context()

    def CUDAGraph(self):  # noqa: N802 - torch's name
        return FakeGraph()

    def graph(self, graph, pool, stream, capture_error_mode):
        cuda = self
        cuda.pools.append(pool)
        graph.pool_id = pool if pool is not None else ("pool", next(self.made_pools))

        class Capture:
            def __enter__(self):
                self.saved, cuda.current = cuda.current, stream
                cuda.captures.append((stream.name, capture_error_mode))
                cuda.events.append("capture begins")

            def __exit__(self, *exc):
                cuda.events.append("capture ends")
                if cuda.fail_capture_end:  # torch ends the capture before it restores the stream
                    raise RuntimeError("capture invalidated")
                cuda.current = self.saved

        return Capture()


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    for name in ("current_device", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", cuda.clear_cublas_workspaces, raising=False)
    made = iter(range(1000))
    monkeypatch.setattr(graphs, "_FREE_STREAMS", {})
    monkeypatch.setattr(graphs, "_STREAM_GRAPHS", {})

    def own(device):
        with graphs._STREAMS_LOCK:
            free = graphs._FREE_STREAMS.setdefault(device, [])
            if free:
                return free.pop()
        return FakeStream(f"own{next(made)}")

    monkeypatch.setattr(graphs, "own_stream", own)
    return cuda


def free_streams():
    return [s.name for s in graphs._FREE_STREAMS.get(0, [])]


def test_a_capture_that_ends_well_gives_its_stream_back_and_restores_the_callers(fake_cuda):
    ran = []
    graph, result = graphs.capture(lambda: ran.append("record") or "out", lambda: ran.append("warm"))
    assert result == "out" and ran == ["warm", "record"]
    assert fake_cuda.captures == [("own0", "thread_local")]
    assert fake_cuda.current.name == "caller" and free_streams() == ["own0"]
    # torch's cuBLAS workspaces cleared around the capture alone (not the warm-up): a GEMM in the graph gets
    # a workspace of the graph's own pool, which torch's later clears (CUDA-graph trees) cannot free under it
    assert fake_cuda.events == ["clear workspaces", "capture begins", "capture ends", "clear workspaces"]
    graphs.capture(lambda: None)  # the next capture takes the same stream back out
    assert fake_cuda.captures[-1][0] == "own0" and free_streams() == ["own0"]


def test_a_warm_up_that_fails_gives_the_stream_back(fake_cuda):
    def warm():
        raise ValueError("the model's own error")

    with pytest.raises(ValueError, match="the model's own error"):
        graphs.capture(lambda: None, warm)
    assert fake_cuda.captures == [] and fake_cuda.current.name == "caller" and free_streams() == ["own0"]


def test_a_capture_that_fails_keeps_its_stream_and_restores_the_callers(fake_cuda):
    fake_cuda.fail_capture_end = True
    with pytest.raises(RuntimeError, match="capture invalidated"):
        graphs.capture(lambda: None)
    assert fake_cuda.current.name == "caller"  # torch's context left the capture stream current; ours restores it
    assert free_streams() == []  # it may still be capturing: no one else gets it
    assert fake_cuda.events[-1] == "clear workspaces"  # no address of the failed graph's pool left in torch's map


def test_a_given_stream_is_not_taken_or_given_back(fake_cuda):
    mine = FakeStream("mine")
    graphs.capture(lambda: None, stream=mine)
    assert fake_cuda.captures == [("mine", "thread_local")] and free_streams() == []


def test_graphs_replayed_on_one_stream_share_one_pool_and_only_they(fake_cuda):
    # Replays on one stream never overlap, so the graphs of that stream can reuse each other's scratch (their
    # intermediates, a 32 MiB cuBLAS workspace each); a graph of another stream, or one not bound to the
    # caller's stream, must never allocate from that pool.
    first_caller = fake_cuda.current
    kept = [graphs.capture(lambda: None, shared_pool=True)[0] for _ in range(2)]
    fake_cuda.current = FakeStream("other caller")
    kept.append(graphs.capture(lambda: None, shared_pool=True)[0])
    kept.append(graphs.capture(lambda: None)[0])
    fake_cuda.current = first_caller
    kept.append(graphs.capture(lambda: None, shared_pool=True)[0])
    assert fake_cuda.pools == [None, ("pool", 0), None, None, ("pool", 0)]
    assert [g.pool() for g in kept] == [("pool", 0), ("pool", 0), ("pool", 1), ("pool", 2), ("pool", 0)]
    # Every graph of the first stream dropped: torch refuses a capture into a pool whose graphs are all gone
    # (an internal assert), so the next one starts a pool of its own, which later ones share.
    del kept[4], kept[1], kept[0]
    again = [graphs.capture(lambda: None, shared_pool=True)[0] for _ in range(2)]
    assert fake_cuda.pools[-2:] == [None, ("pool", 3)] and [g.pool() for g in again] == [("pool", 3)] * 2


def test_a_captured_call_shares_its_streams_pool(monkeypatch):
    # CapturedCall's graphs are replayed on the stream they were captured for only (GraphCache keys them on it)
    asked = []

    def fake_capture(record, warm=None, **options):
        asked.append(options)
        return object(), [torch.zeros(2)]

    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr(graphs.native, "available", lambda: False)
    graphs.CapturedCall(lambda x: (x,), (torch.ones(2),))
    assert asked == [{"keep_graph": False, "shared_pool": True}]


def test_a_wait_on_a_stream_waits_for_a_capture_in_progress(monkeypatch):
    # retire's synchronise runs under the capture lock, so it cannot meet another thread's capture.
    order = []
    synchronised = threading.Event()

    class Ext:
        def __init__(self, stream, device):
            pass

        def synchronize(self):
            order.append("synchronize")
            synchronised.set()

    monkeypatch.setattr(torch.cuda, "ExternalStream", Ext)
    call = graphs.CapturedCall.__new__(graphs.CapturedCall)
    call.lock, call.retired, call.device = threading.Lock(), False, torch.device("cuda", 0)
    with graphs._CAPTURE_LOCK:  # a capture in progress on another thread
        waiter = threading.Thread(target=call.retire, args=(1234,))
        waiter.start()
        assert not synchronised.wait(0.2)
        order.append("capture ended")
    waiter.join(5)
    assert order == ["capture ended", "synchronize"] and call.retired


def test_copy_tensors_copies_every_tensor_spread_or_grouped(monkeypatch):
    """``copy_tensors`` fills every destination. Spread: the tensors of at
    least ``LARGE_COPY_ELEMENTS`` elements by their own ``copy_`` (a
    multi-tensor copy gives a large tensor a handful of blocks) and the rest
    in one ``_foreach_copy_``; not spread: all in one ``_foreach_copy_``."""
    grouped = []
    foreach = torch._foreach_copy_

    def recording_foreach(dst, src):
        grouped.append([d.numel() for d in dst])
        foreach(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", recording_foreach)
    large = graphs.LARGE_COPY_ELEMENTS
    sizes = [3, large, 7, large + 5, large - 1]
    src = [torch.randn(n, dtype=torch.float64) for n in sizes]
    dst = [torch.full((n,), float("nan"), dtype=torch.float64) for n in sizes]
    graphs.copy_tensors(dst, src, spread=True)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    assert grouped == [[3, 7, large - 1]]
    grouped.clear()
    dst = [torch.full((n,), float("nan"), dtype=torch.float64) for n in sizes]
    graphs.copy_tensors(dst, src, spread=False)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    assert grouped == [sizes]
    grouped.clear()
    dst = [torch.full((large,), float("nan"))]
    graphs.copy_tensors(dst, [torch.ones(large)], spread=True)  # nothing small: no multi-tensor launch
    assert grouped == [] and bool((dst[0] == 1).all())
    with pytest.raises(ValueError):
        graphs.copy_tensors(dst, [], spread=True)
