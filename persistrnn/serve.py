"""A serving engine: many live streams share one recurrent model, batched step by step.

``Engine(model, max_streams)`` holds the states of up to ``max_streams``
streams as rows ("slots") of one state tensor on the model's device. A client
opens a stream, pushes chunks of input and pulls their outputs::

    with persistrnn.serve.Engine(lstm.cuda().eval(), max_streams=1000) as engine:
        stream = engine.open()             # EngineFullError when every slot is taken
        stream.push(features)              # (T, I) or (I,); EngineFullError past max_pending unpulled
        y = stream.pull(timeout=1.0)       # that chunk's output: (T, H) or (H,)
        stream.close()                     # the slot is free for the next stream

**Groups.** A front end that receives chunks for many streams at once (a
gateway) hands them over in one call: ``engine.push_many(streams, chunks)``
queues row i of ``chunks`` ((n, T, I) or (n, I), or a sequence of n chunks)
on ``streams[i]``, and ``engine.pull_many(streams)`` takes each stream's
oldest output. Each holds the lock once and copies the group once, where a
call per stream pays both (and a hand-off of the GIL) per chunk. A group is
all or nothing: one closed, failed or full stream refuses the whole call
(full: after waiting up to ``timeout`` for room) and nothing is queued; a
pull of a group waits for every stream's chunk and takes none on a
timeout. An output whose chunk failed comes back as its exception, in its
place. A stream's chunks run in the order queued, by groups or singly.

**Continuous (cellular) batching.** One worker thread per engine runs ticks.
A tick takes the oldest queued chunk of every stream that has one, gathers
those streams' states (``index_select`` on the slot rows), runs the model's
own forward on the gathered batch with those states, and scatters the new
states back (``index_copy_``). Streams join free slots and leave at step
boundaries; a slot without input is not in the batch, so it does not
advance. There is no batching window: a tick starts as soon as the previous
one ends and some stream has input, so a chunk waits at most one tick
before it runs. Chunks of different lengths pending in one tick run as one
batch per length (in the same tick), so every batch is one rectangular call
of the model: no step of a stream is padded.

On CUDA, each batch is padded to the next power of two (at most
``max_streams``) with rows whose results are dropped, and each batch shape
(chunk length, padded size) is captured once as one CUDA graph (see
:class:`_Batch`): the copy of the batch's input rows and slot index from
pinned memory, the gather of its rows' states, the model's forward, the
scatter of the new states, and the copy of the output rows back. The planner
keeps one plan per power-of-two batch already, so these few shapes are all
an engine runs. ``warm_up`` plans and captures them before traffic arrives.
The worker runs on a CUDA stream of its own. A new stream's first chunk reads
its states from a row of zeros, so opening a stream costs the worker
nothing. A pulled output is ready (the worker waits for the batch, polling
with a bound, before delivering it) and lives where its chunk came from: on
the host for a host chunk, on the engine's device for a device chunk.

**Threads and locks.** Any number of client threads may open, push, pull and
close. One lock per engine guards every queue and slot; clients hold it only
to queue or take a chunk, the worker only to form a tick and to settle it,
never while the model runs or while it waits for the device. Pulls wait on
the chunk's ``concurrent.futures.Future``, outside the lock.

**Limits.** Every wait is bounded: ``pull(timeout=None)``, ``close`` and
``warm_up`` wait at most the engine's ``timeout``; the worker waits at most
that long for the device. (A capture, in ``warm_up`` or at a batch shape's
first use, ends with torch's own device synchronise, which has no bound.) A
stream may hold at most ``max_pending`` chunks that were pushed and not yet
pulled (or submitted and not yet run); ``push(chunk, timeout=0.0)`` waits
up to ``timeout`` for room, then raises
:class:`~persistrnn.errors.EngineFullError`. A stream whose client stops
pulling only fills its own queue; the others run on.

**Errors.** An exception of the model in a tick is set on every chunk of
that tick (a pull raises it) and on every chunk those streams queued after
it; those streams are failed (their state missed a chunk) and refuse further
pushes until closed. A persistent kernel's failure is read from the device's
report word after each batch, so a failure of another persistrnn call on the
same device in that window is charged to the batch. A closed stream refuses
pushes with :class:`~persistrnn.errors.ArgumentError`. Closing a stream or the engine
cancels the chunks that have not run: their pulls raise
``concurrent.futures.CancelledError`` saying so. A pull that times out raises
``TimeoutError`` and leaves the chunk to a later pull. ``Engine.close`` (also
on leaving a ``with`` block and at interpreter exit) stops the worker.

**Resident mode.** ``Engine(model, max_streams, resident=True)`` (a
one-layer persistrnn model on CUDA) runs every tick on one persistent kernel
that stays launched between ticks (:mod:`persistrnn.persistent.resident`):
the worker writes the tick's input rows, its slots and a descriptor into
pinned host memory and rings a doorbell word there; the kernel, polling it,
computes the input projections itself, runs the steps, writes the output
rows straight to pinned memory and echoes the tick's number, which the
worker polls. A tick costs no launch, no copy and no CUDA call. Each stream
has two state slots that its ticks alternate between (a tick reads one and
writes the other), so no block of the kernel overwrites states another has
not read yet. A tick of more chunks than the kernel's rows (at most
:data:`_RESIDENT_ROWS`) runs as several. The kernel leaves by itself after
:data:`~persistrnn.persistent.resident.DEFAULT_IDLE_S` without a tick and
after :data:`~persistrnn.persistent.resident.DEFAULT_LIFETIME_S` in any
case (a device-wide synchronise or a pinned allocation elsewhere in the
process waits for it; ``warm_up`` makes every batch's pinned buffers before
traffic), and the next tick launches it again; closing the engine (also at
interpreter exit) stops it. A failure inside it is reported in a word of its
own and delivered to the tick's chunks; a tick that does not finish within
the engine's timeout stops the engine.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

import torch

from . import runtime
from .errors import ArgumentError, ArgumentTypeError, EngineFullError, InputShapeError, InputTypeError
from .ops import launch_settings

__all__ = ["Engine", "Stream"]

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Stops every engine still open when the interpreter exits (workers are
    daemon threads: the interpreter would not wait for them)."""
    for engine in list(_LIVE_ENGINES):
        try:
            engine.close()
        except TimeoutError as exc:  # the process is ending: say so, and let the daemon worker die with it
            logging.getLogger("persistrnn").warning("closing %r at exit: %s", engine, exc)


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless it already has one (its client may have
    cancelled it while it was queued)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


class _Chunk:
    """One pushed chunk: its input (T, I), whether it came as (I,), for a
    device chunk the event its input is ready at, its stream (set when it is
    queued), and its outcome. A pushed chunk keeps its output (or error) for
    :meth:`Stream.pull`; a submitted one has a future, set once the outcome is
    known."""

    __slots__ = ("stream", "x", "steps", "single_step", "ready", "future", "done", "out", "error")

    def __init__(self, x: torch.Tensor, single_step: bool, ready: Any) -> None:
        self.x, self.steps, self.single_step, self.ready = x, x.shape[0], single_step, ready
        self.stream: Stream | None = None
        self.future: concurrent.futures.Future | None = None
        self.done = False
        self.out: Any = None
        self.error: BaseException | None = None


def _finish(chunk: _Chunk, out: Any, error: BaseException | None, futures: list[_Chunk]) -> None:
    """Under the engine's lock: record ``chunk``'s outcome unless it has one (a
    close that gave up on the worker may have failed it first). A submitted
    chunk stops counting against ``max_pending`` and joins ``futures``, whose
    futures the caller sets after releasing the lock (their callbacks may call
    the engine). The caller wakes the stream's waiters."""
    if chunk.done:
        return
    chunk.done, chunk.out, chunk.error = True, out, error
    if chunk.future is not None:
        chunk.stream._held -= 1
        futures.append(chunk)


def _set_futures(futures: list[_Chunk]) -> None:
    for chunk in futures:
        _settle(chunk.future, chunk.out, chunk.error)


def _check_wait(what: str, timeout: Any, *, positive: bool = False) -> float:
    """``timeout``, checked: seconds to wait, a number >= 0 (> 0 where
    ``positive``) and at most ``threading.TIMEOUT_MAX`` (the most a thread's
    wait takes: more raised OverflowError inside the wait)."""
    expected = (f"a timeout in seconds (a number {'> 0' if positive else '>= 0'} and at most "
                f"threading.TIMEOUT_MAX, {threading.TIMEOUT_MAX:.3g})")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{what}: expected {expected}, got {timeout!r}")
    if not (timeout > 0 if positive else timeout >= 0) or not timeout <= threading.TIMEOUT_MAX:
        raise ArgumentError(f"{what}: expected {expected}, got {timeout!r}")
    return timeout


def _first_not_run(streams: list["Stream"], start: int) -> int | None:
    """Under the lock: the index of the first of ``streams[start:]`` whose
    oldest pushed chunk not yet pulled has no outcome (or that has none)."""
    for i in range(start, len(streams)):
        unpulled = streams[i]._unpulled
        if not (unpulled and unpulled[0].done):
            return i
    return None


def _split(chunks: list[_Chunk], rows: torch.Tensor) -> Sequence[torch.Tensor]:
    """Each chunk's output from ``rows`` (one row (T, H) per chunk, in their
    order): the row, or its one step (H,) for a chunk pushed as (I,). One
    unbind for all rows, not one index per chunk: ~0.4 µs a row against ~1.5."""
    single_steps = sum(c.single_step for c in chunks)
    if not single_steps:
        return rows.unbind(0)
    steps = rows[:, 0].unbind(0)
    if single_steps == len(chunks):
        return steps
    whole = rows.unbind(0)
    return [steps[i] if c.single_step else whole[i] for i, c in enumerate(chunks)]


class Stream:
    """One client's sequence in an :class:`Engine` (made by :meth:`Engine.open`)."""

    def __init__(self, engine: "Engine", slot: int, number: int) -> None:
        self.engine = engine
        self.slot = slot
        self.number = number
        self._queued: collections.deque[_Chunk] = collections.deque()  # not yet taken by a tick
        self._unpulled: collections.deque[_Chunk] = collections.deque()  # pushed, in push order
        self._held = 0  # chunks counted against max_pending
        self._in_tick = False
        self._fresh = True  # no chunk run yet: the first one starts from zero states (the worker's alone)
        self._closed = False
        self._failure: BaseException | None = None
        # Pulls waiting for an outcome and pushes waiting for room wait here. A
        # notify costs ~0.7 µs of the worker's time per chunk, so it is sent only
        # while ``_waiting`` counts a waiter: most chunks have none.
        self._changed = threading.Condition(engine._lock)
        self._waiting = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failure else "open"
        return f"Stream({self.number}, slot {self.slot}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Chunks the stream holds against ``max_pending``: pushed and not yet
        pulled, or submitted and not yet run."""
        return self._held

    def push(self, chunk: torch.Tensor, timeout: float = 0.0) -> None:
        """Queue ``chunk`` ((T, I) or (I,)) for :meth:`pull`. Waits up to
        ``timeout`` seconds while the stream holds ``max_pending`` unpulled
        chunks, then raises :class:`~persistrnn.errors.EngineFullError`."""
        self.engine._queue("push", [self], [self.engine._chunk_input(chunk, "push")], timeout)

    def submit(self, chunk: torch.Tensor, timeout: float = 0.0) -> concurrent.futures.Future:
        """Queue ``chunk`` and return the future of its output instead of
        keeping it for :meth:`pull`; it counts against ``max_pending`` until it
        has run. A device output belongs to the engine's CUDA stream: call
        ``out.record_stream(torch.cuda.current_stream())`` before using it on
        another (``pull`` does this). Cancelling the future before its tick
        skips the chunk (the state does not advance)."""
        item = self.engine._chunk_input(chunk, "submit")
        item.future = concurrent.futures.Future()
        self.engine._queue("submit", [self], [item], timeout)
        return item.future

    def _wait(self, seconds: float) -> None:
        self._waiting += 1
        try:
            self._changed.wait(seconds)
        finally:
            self._waiting -= 1

    def _spent(self) -> bool:
        """Under the lock: closed or failed, with nothing left to pull."""
        return not self._unpulled and (self._closed or self._failure is not None)

    def _check_open(self, what: str) -> None:
        if self._failure is not None:
            raise ArgumentError(f"{what}: expected a stream that can run, got stream {self.number} failed by "
                                f"{self._failure!r}; close it and open another") from self._failure
        if self._closed:
            raise ArgumentError(f"{what}: expected an open stream, got stream {self.number} closed")

    def pull(self, timeout: float | None = None) -> torch.Tensor:
        """The output of the oldest pushed chunk not yet pulled: (T, H) for a
        (T, I) chunk, (H,) for an (I,) one. Waits at most ``timeout`` seconds
        (None: the engine's ``timeout``) for the chunk to be pushed and run,
        then raises ``TimeoutError`` and leaves the chunk to a later pull.
        Raises the model's error if the chunk's tick failed, and
        ``concurrent.futures.CancelledError`` if a close cancelled it."""
        (outcome,) = self.engine._take("pull", [self], timeout)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        """Free the slot: chunks that have not run are cancelled (a chunk in
        the running tick completes, and outputs already made can still be
        pulled); later pushes raise. Closing twice does nothing."""
        futures: list[_Chunk] = []
        with self.engine._lock:
            self.engine._close_stream(self, "the stream was closed", futures)
        _set_futures(futures)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Engine:
    """Serves up to ``max_streams`` streams of ``model`` (a persistrnn or
    ``torch.nn`` LSTM/GRU/RNN, unidirectional; a torch module is converted
    with :func:`persistrnn.from_torch`, sharing its parameters, unless
    ``convert=False``, which runs torch's implementation). See the module
    docstring for the tick policy, threads and limits.

    ``max_pending``: chunks one stream may hold unpulled. ``timeout``: the
    bound, in seconds, of every wait that is not given one (pulls, closing,
    warm-up, and the worker's wait for the device). ``resident``: run the
    ticks on one resident kernel (see the module docstring; a one-layer
    persistrnn model on CUDA, else :class:`~persistrnn.errors.ArgumentError`).
    A resident kernel reads the weights when it launches, so change a served
    model's weights only between engines."""

    capture_batches = True
    """On CUDA, run each batch shape as one captured graph (see :class:`_Batch`)."""

    def __init__(self, model: torch.nn.Module, max_streams: int, *, max_pending: int = 8,
                 timeout: float = 30.0, convert: bool = True, resident: bool = False) -> None:
        from .nn import _Persistent, from_torch

        if not isinstance(model, torch.nn.RNNBase):
            raise ArgumentTypeError(f"Engine: expected a persistrnn or torch.nn LSTM, GRU or RNN, got "
                                    f"{type(model).__name__}")
        if convert and not isinstance(model, _Persistent):
            model = from_torch(model)
        if model.bidirectional:
            raise ArgumentError("Engine: expected a unidirectional model, got bidirectional=True (the reverse "
                                "direction needs a stream's whole sequence)")
        if model.training and model.dropout > 0 and model.num_layers > 1:
            raise ArgumentError(f"Engine: expected a model in eval mode, got one in training mode with dropout "
                                f"{model.dropout} between layers (call model.eval())")
        for name, value, low in (("max_streams", max_streams, 1), ("max_pending", max_pending, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ArgumentError(f"Engine: expected a positive int {name}, got {value!r}")
        _check_wait("Engine", timeout, positive=True)
        self.model = model
        self.max_streams = max_streams
        self.max_pending = max_pending
        self.timeout = float(timeout)
        weight = model.weight_hh_l0
        self.device, self.dtype = weight.device, weight.dtype
        self.input_size = model.input_size
        self.output_size = getattr(model, "proj_size", 0) or model.hidden_size
        self._has_cell_state = isinstance(model, torch.nn.LSTM)
        self._batches: collections.OrderedDict[tuple, _Batch] = collections.OrderedDict()
        if not isinstance(resident, bool):
            raise ArgumentTypeError(f"Engine: expected a bool resident, got {type(resident).__name__}")
        # The states are updated in place by the worker, which a constructor under torch.inference_mode() does
        # not put in inference mode.
        with runtime.ordinary_tensors():
            self._resident = self._resident_layer() if resident else None
            # The streams' states, where the resident kernel does not keep them in its own slots: one row per
            # slot, then two more: a spare row that the padding rows of a batch write their states to, and a
            # row of zeros, never written, that a new stream's first chunk and the padding rows read.
            self._spare_slot, self._zero_slot = max_streams, max_streams + 1
            self._h = self._c = None
            if self._resident is None:
                self._h = weight.new_zeros(model.num_layers, max_streams + 2, self.output_size)
                if self._has_cell_state:
                    self._c = weight.new_zeros(model.num_layers, max_streams + 2, model.hidden_size)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the worker's alone: input queued, a call, or closing
        self._worker_waiting = False  # the worker waits on _wake: the first push that makes a stream ready wakes it
        self._settled = threading.Condition(self._lock)  # a tick settled (a draining close waits on it)
        self._free_slots = collections.deque(range(max_streams))
        self._streams: dict[int, Stream] = {}  # by slot
        self._ready: dict[Stream, None] = {}  # streams with queued input and none in the running tick
        self._calls: collections.deque[tuple[Any, concurrent.futures.Future]] = collections.deque()
        self._in_tick: list[_Chunk] = []
        self._numbers = itertools.count()
        self._closing = False
        self._failure: BaseException | None = None
        self.ticks = 0  # ticks run, and chunks run in them: chunks_run / ticks is the mean batch
        self.chunks_run = 0

        self._cuda_stream = None
        if self.device.type == "cuda":
            # A stream of the engine's own (a pooled one may be another thread's capture stream too), after
            # the states' zero fill on the constructing thread's stream.
            self._cuda_stream = runtime.own_stream(self.device.index)
            self._cuda_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._worker = threading.Thread(target=self._serve, name=f"persistrnn-engine-{id(self):x}", daemon=True)
        self._worker.start()
        _LIVE_ENGINES.add(self)

    def _resident_layer(self) -> Any:
        """The resident kernel's host side, with its two state slots per
        stream (rows 2s and 2s + 1 of stream slot s; then the zero row and
        the spare row) and which of the two each slot's next tick reads."""
        from .nn import _Persistent
        from .persistent.resident import ResidentLayer, resident_config

        model = self.model
        if not isinstance(model, _Persistent):
            why = f"a persistrnn module (convert=True), got torch's {type(model).__name__}"
        elif model.num_layers != 1:
            why = f"a 1-layer model, got {model.num_layers} layers"
        elif getattr(model, "proj_size", 0):
            why = f"a model without projections, got proj_size={model.proj_size}"
        elif self.device.type != "cuda":
            why = f"a model on a CUDA device, got one on {self.device}"
        else:
            why = None
        if why is not None:
            raise ArgumentError(f"Engine(resident=True): expected {why}")
        with torch.cuda.device(self.device):  # configured, compiled and loaded for the model's device
            config, rows = resident_config(model._shape(self.dtype), min(self.max_streams, _RESIDENT_ROWS))
            weight = model.weight_hh_l0
            weights = tuple(w.detach().contiguous() if w is not None else weight.new_zeros(weight.shape[0])
                            for w in (model.weight_ih_l0, weight, getattr(model, "bias_ih_l0", None),
                                      getattr(model, "bias_hh_l0", None)))
            slots = 2 * self.max_streams + 2
            self._zero_row, self._spare_row = slots - 2, slots - 1
            self._parity = bytearray(self.max_streams)
            h_pool = weight.new_zeros(slots, self.output_size)
            c_pool = weight.new_zeros(slots, model.hidden_size) if self._has_cell_state else None
            torch.cuda.current_stream(self.device).synchronize()  # the zeros are in place before a launch reads them
            return ResidentLayer(config, weights, h_pool, c_pool, rows)

    def __repr__(self) -> str:
        return (f"Engine({type(self.model).__name__}, {len(self._streams)}/{self.max_streams} streams, "
                f"{'closed' if self._closing else 'running'})")

    @property
    def resident(self) -> bool:
        """Whether the ticks run on a resident kernel (``Engine(..., resident=True)``)."""
        return self._resident is not None

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    # ---- clients -----------------------------------------------------------------

    def open(self) -> Stream:
        """A new stream in a free slot, starting from zero states. Raises
        :class:`~persistrnn.errors.EngineFullError` when all ``max_streams``
        slots are taken."""
        with self._lock:
            self._check_running("open")
            if not self._free_slots:
                raise EngineFullError(f"open: expected a free slot, got all {self.max_streams} slots taken by live "
                                      "streams (close one, or make the engine with a larger max_streams)")
            slot = self._free_slots.popleft()
            stream = self._streams[slot] = Stream(self, slot, next(self._numbers))
        return stream

    def _check_running(self, what: str) -> None:
        if self._failure is not None:
            raise ArgumentError(f"{what}: expected a running engine, got one stopped by {self._failure!r}") \
                from self._failure
        if self._closing:
            raise ArgumentError(f"{what}: expected a running engine, got a closed one")

    def push_many(self, streams: Sequence[Stream], chunks: torch.Tensor | Sequence[torch.Tensor],
                  timeout: float = 0.0) -> None:
        """Queue one chunk for each of ``streams`` (distinct streams of this
        engine) under one hold of the lock, for :meth:`pull_many` or
        :meth:`Stream.pull`. ``chunks`` is a tensor (n, T, I) or (n, I) whose
        row i is stream i's chunk, copied at once, or a sequence of n chunks
        shaped as for :meth:`Stream.push`, copied by one stack when they all
        have one shape. The group is queued whole or not at all: a stream that
        is closed or failed refuses it (``ArgumentError``); a stream holding
        ``max_pending`` chunks makes it wait up to ``timeout`` seconds for
        room, then refuses it with :class:`~persistrnn.errors.EngineFullError`
        naming that stream. Each stream's chunks run in the order they were
        queued, whether by this call or by :meth:`Stream.push`."""
        streams = self._group_streams(streams, "push_many")
        self._queue("push_many", streams, self._group_input(chunks, len(streams)), timeout)

    def pull_many(self, streams: Sequence[Stream], timeout: float | None = None) -> list[Any]:
        """For each of ``streams`` (distinct streams of this engine), the
        outcome of its oldest pushed chunk not yet pulled, taken under one
        hold of the lock: its output, shaped as :meth:`Stream.pull` returns
        it, or, where that chunk failed or a close cancelled it, the exception
        ``pull`` would raise, in its place (one stream's error does not cost
        the others their outputs). Waits at most ``timeout`` seconds (None:
        the engine's ``timeout``) for every one of them to have run, then
        raises ``TimeoutError`` naming a stream still waiting; a stream closed
        or failed with nothing left to pull raises ``ArgumentError``. Either
        way nothing is taken."""
        return self._take("pull_many", self._group_streams(streams, "pull_many"), timeout)

    def _group_streams(self, streams: Sequence[Stream], what: str) -> list[Stream]:
        if not isinstance(streams, Sequence):  # a set would pair rows with streams in hash order
            raise ArgumentTypeError(f"{what}: expected a sequence of Stream objects, got {type(streams).__name__}")
        streams = list(streams)
        for stream in streams:
            if not isinstance(stream, Stream):
                raise ArgumentTypeError(f"{what}: expected Stream objects, got {type(stream).__name__}")
            if stream.engine is not self:
                raise ArgumentError(f"{what}: expected streams of {self!r}, got {stream!r} of another engine")
        if len(set(streams)) < len(streams):
            twice = next(stream for i, stream in enumerate(streams) if stream in streams[:i])
            raise ArgumentError(f"{what}: expected distinct streams, got stream {twice.number} twice "
                                "(one call queues or takes one chunk per stream)")
        return streams

    def _check_chunk(self, chunk: Any, what: str, rows: int | None = None) -> None:
        """Raise unless ``chunk`` is a floating-point tensor (T, I) with T >= 1
        or (I,), led by a dimension of ``rows`` when given, on the host or the
        engine's device."""
        if not isinstance(chunk, torch.Tensor):
            raise InputTypeError(f"{what}: expected a chunk tensor, got {type(chunk).__name__}")
        shape = chunk.shape
        body = shape if rows is None else shape[1:]
        if len(body) not in (1, 2) or body[-1] != self.input_size or len(body) == 2 and body[0] < 1 \
                or rows is not None and shape[0] != rows:
            rows_first = "" if rows is None else f"{rows}, "
            one_step = f"({self.input_size},)" if rows is None else f"({rows}, {self.input_size})"
            raise InputShapeError(f"{what}: expected a chunk of shape ({rows_first}T, {self.input_size}) with "
                                  f"T >= 1 or {one_step}, got {tuple(shape)}")
        if not chunk.is_floating_point():
            raise InputShapeError(f"{what}: expected a floating-point chunk, got {chunk.dtype}")
        if not chunk.is_cpu and chunk.device != self.device:
            raise InputShapeError(f"{what}: expected a chunk on the host or on {self.device}, got one on "
                                  f"{chunk.device}")

    def _own_copy(self, chunk: torch.Tensor, copied: bool = False) -> tuple[torch.Tensor, Any]:
        """(``chunk`` in the engine's dtype, in memory the engine owns, so that
        the client may reuse its buffer at once; for a device chunk, the event
        that copy is ready at). One torch call, or none for a ``copied``
        chunk already in the dtype: each call releases the GIL, which then has
        to be won back from the other threads."""
        if chunk.requires_grad:
            chunk = chunk.detach()
        if chunk.dtype != self.dtype:
            chunk = chunk.to(self.dtype)
        elif not copied:
            chunk = chunk.clone()
        ready = None
        if chunk.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(chunk.device))
        return chunk, ready

    def _chunk_input(self, chunk: Any, what: str) -> _Chunk:
        """The chunk, its input a private (T, I) copy in the engine's dtype."""
        self._check_chunk(chunk, what)
        return self._checked_chunk_input(chunk)

    def _checked_chunk_input(self, chunk: torch.Tensor) -> _Chunk:
        x, ready = self._own_copy(chunk)
        return _Chunk(x[None] if chunk.dim() == 1 else x, chunk.dim() == 1, ready)

    def _group_input(self, chunks: Any, count: int) -> list[_Chunk]:
        """:meth:`_chunk_input` of each of ``count`` chunks, from one copy of
        the group where they share a shape."""
        what = "push_many"
        if isinstance(chunks, torch.Tensor):
            self._check_chunk(chunks, what, count)
            x, ready = self._own_copy(chunks)
            single_step = chunks.dim() == 2
        else:
            if not isinstance(chunks, Sequence):
                raise InputTypeError(f"{what}: expected a chunk tensor (n, T, I) or (n, I), or a sequence of "
                                     f"chunks, got {type(chunks).__name__}")
            if len(chunks) != count:
                raise InputShapeError(f"{what}: expected one chunk per stream ({count}), got {len(chunks)}")
            for i, chunk in enumerate(chunks):
                self._check_chunk(chunk, f"{what}: chunk {i}")
            if not count:
                return []
            first = chunks[0]
            if any(c.shape != first.shape or c.dtype != first.dtype or c.device != first.device for c in chunks):
                return [self._checked_chunk_input(chunk) for chunk in chunks]
            x, ready = self._own_copy(torch.stack(list(chunks)), copied=True)
            single_step = first.dim() == 1
        rows = (x[:, None] if single_step else x).unbind(0)  # each (T, I); one torch call for the group
        return [_Chunk(row, single_step, ready) for row in rows]

    def _queue(self, what: str, streams: list[Stream], items: list[_Chunk], timeout: float) -> None:
        """Queue ``items[i]`` on ``streams[i]`` under one hold of the lock,
        every one or none: each stream must be open, and have room under
        ``max_pending``, which it is waited for (up to ``timeout``)."""
        max_pending = self.max_pending
        _check_wait(what, timeout)
        with self._lock:
            deadline = None
            while True:
                full = None
                for stream in streams:
                    if stream._closed or stream._failure is not None:
                        stream._check_open(what)
                    if stream._held >= max_pending and full is None:
                        full = stream
                if full is None:
                    break
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    whole = "; no chunk of the group was queued" if len(streams) > 1 else ""
                    raise EngineFullError(
                        f"{what}: stream {full.number} holds {full._held} chunks that were not pulled (or "
                        f"submitted and not run); expected fewer than max_pending={self.max_pending} (waited "
                        f"{timeout} s){whole}")
                full._wait(remaining)
            became_ready = False
            for stream, item in zip(streams, items):
                item.stream = stream
                stream._held += 1
                stream._queued.append(item)
                if item.future is None:
                    stream._unpulled.append(item)
                if not stream._in_tick:
                    self._ready[stream] = None
                    became_ready = True
            if became_ready and self._worker_waiting:
                self._worker_waiting = False
                self._wake.notify()

    def _take(self, what: str, streams: list[Stream], timeout: float | None) -> list[Any]:
        """Under one hold of the lock, once the oldest unpulled chunk of every
        one of ``streams`` has run (waiting at most ``timeout``, None: the
        engine's), take them all: each one's output, ready for the caller's
        CUDA stream, or its error."""
        timeout = self.timeout if timeout is None else _check_wait(what, timeout)
        deadline = None
        with self._lock:
            start, waited = 0, False
            while True:
                i = _first_not_run(streams, start)
                if i is None:
                    if not waited:
                        break
                    # A chunk seen done before a wait may have been taken since by another thread's pull.
                    start, waited = 0, False
                    continue
                # A stream with nothing left to pull is refused before any wait: that wait would never end.
                spent = next((s for s in itertools.islice(streams, i, None) if s._spent()), None)
                if spent is not None:
                    raise ArgumentError(f"{what}: expected a pushed chunk not yet pulled, got none left in stream "
                                        f"{spent.number}, {'failed' if spent._failure else 'closed'}")
                waiting_on = streams[i]
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    whole = "; no chunk of the group was taken" if len(streams) > 1 else ""
                    if waiting_on._unpulled:
                        raise TimeoutError(f"{what}: stream {waiting_on.number}'s chunk did not run within "
                                           f"{timeout} s{whole}")
                    raise TimeoutError(f"{what}: no chunk was pushed to stream {waiting_on.number} within "
                                       f"{timeout} s{whole}")
                waiting_on._wait(remaining)
                start, waited = i, True
            chunks = []
            for stream in streams:
                chunks.append(stream._unpulled.popleft())
                stream._held -= 1
                if stream._waiting:
                    stream._changed.notify_all()
        if self.device.type == "cuda":  # also after close, which gives the engine's stream back
            for chunk in chunks:
                if chunk.error is None and chunk.out.is_cuda:
                    chunk.out.record_stream(torch.cuda.current_stream(chunk.out.device))
        return [chunk.out if chunk.error is None else chunk.error for chunk in chunks]

    def warm_up(self, steps: Iterable[int] = (1,), batches: Iterable[int] | None = None) -> None:
        """Plan and capture the forward for chunks of each length in ``steps``
        at each batch size the engine runs (default: every padded batch size),
        on the spare slot, before traffic arrives (a first call of a new shape
        plans, ~2-4 s). Waits at most ``timeout`` per shape. On the host it
        does nothing unless ``batches`` are given (torch's implementation
        plans nothing)."""
        if batches is None and self.device.type != "cuda":
            return
        sizes = list(self._batch_sizes() if batches is None else batches)
        for T in steps:
            for size in sizes:
                self._call_in_worker(lambda T=T, size=size: self._warm_shape(T, size))

    def _warm_shape(self, T: int, size: int) -> None:
        batch = self._batch(T, size)  # planned and captured once made
        if batch.graph is None:  # uncaptured: one run plans the shape, every row on the zero and spare slots
            zero, spare = (self._zero_row, self._spare_row) if self._resident else (self._zero_slot, self._spare_slot)
            batch.index_rows[0], batch.index_rows[1] = zero, spare
            batch.run(self.timeout, size)
        self._wait_device()

    def _call_in_worker(self, fn: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running("warm_up")
            self._calls.append((fn, future))
            self._wake.notify()
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the engine's worker did not finish a call within {self.timeout} s") from None

    # ---- closing -----------------------------------------------------------------

    def close(self, cancel: bool = True) -> None:
        """Stop the worker: chunks that have not run are cancelled (their
        pulls raise ``CancelledError``), the running tick completes, and the
        worker ends within ``timeout``; if it does not (the device stopped
        answering), the running tick's chunks fail with ``TimeoutError``.
        ``cancel=False`` first lets the queued chunks run (up to
        ``timeout``). Closing again waits for the worker as the first close
        did. On the worker itself (a chunk's done-callback) ``close()``
        returns at once and the worker stops after its tick; ``cancel=False``
        is refused there, since the worker would wait for itself."""
        on_worker = threading.current_thread() is self._worker
        if not cancel and on_worker:
            raise ArgumentError("Engine.close(cancel=False): called on the engine's worker (from a chunk's "
                                "done-callback), which would wait for itself to run the queued chunks; close "
                                "from another thread, or with cancel=True")
        if not cancel:
            self._drain()
        futures: list[_Chunk] = []
        calls: list[concurrent.futures.Future] = []
        with self._lock:
            if not self._closing:
                self._closing = True
                for stream in list(self._streams.values()):
                    self._close_stream(stream, "the engine was closed", futures)
                calls = [future for _, future in self._calls]
                self._calls.clear()
                self._wake.notify_all()
        _set_futures(futures)
        for future in calls:
            _settle(future, error=concurrent.futures.CancelledError("the engine was closed before this call"))
        if on_worker:  # the worker ends after this tick; the exit hook still joins it
            return
        self._worker.join(min(self.timeout + 1.0, threading.TIMEOUT_MAX))
        if not self._worker.is_alive() and (self._resident is None or self._resident.stopped):
            # Their graphs, pools and pinned buffers go now, not at a later collection; a resident kernel that
            # did not stop may still write into them, so they are kept then.
            self._batches.clear()
            with self._lock:  # two closes at once give the stream back once
                stream, self._cuda_stream = self._cuda_stream, None
            if stream is not None and self._failure is None:  # a failed worker's stream may hold a stalled batch
                runtime.release_stream(stream)
        if self._worker.is_alive():
            error = TimeoutError(f"the engine closed and its worker did not finish the running tick within "
                                 f"{self.timeout} s")
            with self._lock:
                for chunk in self._in_tick:
                    _finish(chunk, None, error, futures)
                    chunk.stream._changed.notify_all()
            _set_futures(futures)
            raise TimeoutError(f"Engine.close: the worker did not stop within {self.timeout} s")
        _LIVE_ENGINES.discard(self)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while self._ready or self._in_tick:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._failure is not None:
                    break
                self._settled.wait(min(remaining, 0.01))

    def _close_stream(self, stream: Stream, why: str, futures: list[_Chunk]) -> None:
        """Under the lock: mark ``stream`` closed, free its slot, and cancel its
        queued chunks (submitted ones join ``futures``). The slot is free at
        once even while the running tick holds one of the stream's chunks: the
        tick writes the closed stream's states back into it, and a new stream
        in that slot reads its first states from the row of zeros, whatever
        the slot holds."""
        if stream._closed:
            return
        stream._closed = True
        for chunk in stream._queued:
            error = concurrent.futures.CancelledError(f"stream {stream.number}: {why} before this chunk ran")
            _finish(chunk, None, error, futures)
        stream._queued.clear()
        self._ready.pop(stream, None)
        self._release_slot(stream)
        stream._changed.notify_all()

    def _release_slot(self, stream: Stream) -> None:
        if self._streams.get(stream.slot) is stream:
            del self._streams[stream.slot]
            self._free_slots.append(stream.slot)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the worker ----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            if self._cuda_stream is not None:
                torch.cuda.set_device(self.device)
                torch.cuda.set_stream(self._cuda_stream)
            with torch.no_grad():
                while self._tick():
                    pass
        except Exception as exc:  # whatever stops the worker is delivered to the waiting pulls
            self._stop(exc)
        finally:
            # Bounded by a second at most: after a tick that timed out, the kernel may never see the stop word.
            if self._resident is not None and self._resident.stop(min(self.timeout, _RESIDENT_STOP_S)):
                self._resident.release()

    def _tick(self) -> bool:
        """One tick; False when the engine is closing and nothing is left."""
        with self._lock:
            while not (self._ready or self._calls or self._closing):
                self._worker_waiting = True
                self._wake.wait(self.timeout)
            self._worker_waiting = False
            if self._closing:
                return False
            calls = list(self._calls)
            self._calls.clear()
            chunks = self._take_chunks()
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as exc:
                _settle(future, error=exc)
        if not chunks:
            return True
        by_steps: collections.defaultdict[int, list[_Chunk]] = collections.defaultdict(list)
        for chunk in chunks:
            by_steps[chunk.steps].append(chunk)
        batches: list[tuple[list[_Chunk], Any, BaseException | None]] = []
        stalled = None
        for group in by_steps.values():
            try:
                batches.append((group, self._run_batch(group), None))
            except Exception as exc:
                batches.append((group, None, exc))
                if isinstance(exc, _DeviceStalled):
                    stalled = exc
        self._settle_tick(batches)
        if stalled is not None:
            raise stalled
        return True

    def _take_chunks(self) -> list[_Chunk]:
        """Under the lock: the oldest queued chunk of every ready stream (a
        future cancelled by its client is skipped: its stream does not advance)."""
        chunks = []
        for stream in self._ready:
            queued = stream._queued
            while queued:
                chunk = queued.popleft()
                if chunk.future is None or chunk.future.set_running_or_notify_cancel():
                    stream._in_tick = True
                    chunks.append(chunk)
                    break
                stream._held -= 1
                if stream._waiting:
                    stream._changed.notify_all()
        self._ready.clear()
        self._in_tick = chunks
        return chunks

    def _settle_tick(self, batches: list[tuple[list[_Chunk], Any, BaseException | None]]) -> None:
        """Record each batch's outputs (or its error) on its chunks under one
        hold of the lock, wake only the streams with a waiter, then set the
        submitted chunks' futures."""
        futures: list[_Chunk] = []
        with self._lock:
            self.ticks += 1
            for chunks, outputs, error in batches:
                if error is None:
                    self.chunks_run += len(chunks)
                for i, chunk in enumerate(chunks):
                    stream = chunk.stream
                    stream._in_tick = False
                    if error is None:
                        _finish(chunk, outputs[i], None, futures)
                    else:
                        _finish(chunk, None, error, futures)
                        if stream._failure is None:
                            stream._failure = error
                            for later in stream._queued:
                                _finish(later, None, error, futures)
                            stream._queued.clear()
                    if stream._closed:
                        self._release_slot(stream)
                    elif stream._queued:
                        self._ready[stream] = None
                    if stream._waiting:
                        stream._changed.notify_all()
            self._in_tick = []
            self._settled.notify_all()
        _set_futures(futures)

    def _stop(self, error: BaseException) -> None:
        """The worker failed outside a model call: every queued and running
        chunk gets the error, and the engine refuses new work."""
        futures: list[_Chunk] = []
        with self._lock:
            self._failure = error
            for chunk in self._in_tick:
                _finish(chunk, None, error, futures)
            for stream in self._streams.values():  # the streams of the running tick among them
                stream._failure = stream._failure or error
                for chunk in stream._queued:
                    _finish(chunk, None, error, futures)
                stream._queued.clear()
                stream._changed.notify_all()
            calls = [future for _, future in self._calls]
            self._calls.clear()
            self._ready.clear()
        _set_futures(futures)
        for future in calls:
            _settle(future, error=error)
        _LIVE_ENGINES.discard(self)

    # ---- one batch -------------------------------------------------------------------

    def _batch_sizes(self) -> list[int]:
        """Every batch size :meth:`_padded_size` gives."""
        return sorted({self._padded_size(n) for n in range(1, self.max_streams + 1)})

    def _padded_size(self, n: int) -> int:
        """The batch ``n`` chunks run as: the next power of two on CUDA (one
        captured forward and one plan per size), ``n`` on the host."""
        if self.device.type != "cuda":
            return n
        return min(1 << (n - 1).bit_length(), self.max_streams)

    def _batch(self, T: int, size: int) -> "_Batch":
        """The :class:`_Batch` of ``size`` rows of ``T`` steps: on CUDA made
        (and captured) once per launch settings (cuDNN's and cuBLAS's flags,
        the kernels' wait bound) and weights' addresses (what a capture
        fixes) and kept, the least recently used dropped beyond
        :data:`_BATCHES_KEPT`; in resident mode, which captures nothing (its
        batches are pinned rows and addresses for the running kernel), once
        per shape; on the host made for the call."""
        if self.device.type != "cuda":
            return _Batch(self, T, size)
        # Reading the settings and every weight's address measured ~20 µs of a resident chunk's ~120 on the
        # H100's host (perf-notes §105).
        key = ((T, size) if self._resident is not None else
               (T, size, launch_settings(), tuple(w.data_ptr() for w in self.model._flat_weights)))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(self, T, size)
            while len(self._batches) > _BATCHES_KEPT:  # the worker waited for every earlier batch
                self._batches.popitem(last=False)
        else:
            self._batches.move_to_end(key)
        return batch

    def _run_batch(self, chunks: list[_Chunk]) -> Sequence[torch.Tensor]:
        """The outputs of ``chunks`` (all of one length), in their order, ready where each came from."""
        n = len(chunks)
        batch = self._batch(chunks[0].steps, self._padded_size(n))
        gather, scatter = batch.index_rows
        if self._resident is None:
            for row, chunk in enumerate(chunks):
                stream = chunk.stream
                scatter[row] = stream.slot
                gather[row] = self._zero_slot if stream._fresh else stream.slot
                stream._fresh = False
            gather[n:] = self._zero_slot
            scatter[n:] = self._spare_slot
        else:  # a stream's ticks alternate between its two slots (see _resident_layer)
            parity = self._parity
            for row, chunk in enumerate(chunks):
                stream = chunk.stream
                slot = 2 * stream.slot + parity[stream.slot]
                gather[row] = self._zero_row if stream._fresh else slot
                scatter[row] = slot ^ 1
                parity[stream.slot] ^= 1
                stream._fresh = False
        on_device = any(chunk.x.is_cuda for chunk in chunks)
        by_rows = n <= _ROWS_BY_NUMPY or on_device
        batch.fill(chunks, by_rows)
        if on_device and self._resident is not None:
            self._wait_device()  # the device chunks' rows are in host memory before the kernel reads them
        batch.run(self.timeout, n)
        if batch.cuda and self._resident is None:  # a persistent kernel that failed inside the batch reported it
            # in host memory (a resident kernel reports in its layer's own word, read as each tick ends)
            runtime.raise_reported_failure(self.device.index)
        outputs = batch.outputs(chunks, by_rows)
        if on_device:
            self._wait_device()  # a device chunk's output is a clone queued after the batch: delivered once made
        return outputs

    def _forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Run the model on ``x`` (B, T, I), each row from the states of slot
        ``index[0]`` (B,), write row b's new states to slot ``index[1, b]``,
        and return the output (B, T, H)."""
        gather, scatter = index
        h0 = self._h.index_select(1, gather)
        hx = (h0, self._c.index_select(1, gather)) if self._c is not None else h0
        out, state = self.model(x if self.model.batch_first else x.transpose(0, 1), hx)
        h_n, c_n = state if self._c is not None else (state, None)
        self._h.index_copy_(1, scatter, h_n)
        if c_n is not None:
            self._c.index_copy_(1, scatter, c_n)
        return out if self.model.batch_first else out.transpose(0, 1)

    def _wait_device(self) -> None:
        """Wait for the worker's CUDA stream, polling so that the wait is
        bounded (a blocking synchronise has no timeout)."""
        if self._cuda_stream is None:
            return
        done = torch.cuda.Event()
        done.record(self._cuda_stream)
        deadline = time.monotonic() + self.timeout
        while not done.query():
            if time.monotonic() > deadline:
                raise _DeviceStalled(f"the engine's batch did not finish on {self.device} within {self.timeout} s")
            time.sleep(0)  # lets client threads run while the batch finishes


_ROWS_BY_NUMPY = 16
"""Up to this many chunks, a batch's rows are written and read one by one
through NumPy (no torch call, so the worker keeps the GIL); past it, by one
torch call each way. Measured on the H100's host under the bench's load
(1-layer LSTM 128, 8 client threads): rows one by one through NumPy halved
the median latency at 64 streams (0.40 against 0.81 ms, batches of ~1.2)
and cut the throughput at 1,000 streams from 29k to 7.6k chunks/s (batches
of hundreds: a few µs of Python per row, contended)."""

_RESIDENT_ROWS = 64
"""The most rows one resident tick runs (a batch of more runs as several
ticks), or fewer where the kernel's shared memory holds fewer rows' states
(:func:`~persistrnn.persistent.resident.resident_config`)."""

_RESIDENT_STOP_S = 1.0
"""How long the worker, as it ends, waits for the resident kernel to leave."""

_BATCHES_KEPT = 32
"""Captured batches an engine keeps (one per chunk length and padded batch
size it has run); an engine with one chunk length runs at most
log2(max_streams) + 1 sizes."""


def _host_rows(t: torch.Tensor) -> Any:
    """A NumPy view of host tensor ``t`` (bfloat16, which NumPy lacks, as its
    16-bit pattern: the rows are copied, never computed on)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class _Batch:
    """One batch shape of an engine (``size`` rows of ``T`` steps) and the
    buffers it runs on: the input rows (size, T, I) and output rows
    (size, T, H) in host memory (pinned on CUDA), and ``index`` (2, size),
    per row the slot its states are read from and the slot they are written
    back to (:meth:`Engine._forward`), set through the host view
    ``index_rows``.

    On CUDA a run is: the index and the input rows copied to the device, the
    gather, the model's forward, the scatter, the output rows copied back,
    and last an echo of the run's number into pinned memory, which the
    worker polls. With the engine's ``capture_batches`` it is captured as one
    CUDA graph, so a batch of up to :data:`_ROWS_BY_NUMPY` host chunks costs
    one torch call (the replay): the rows are written and read through NumPy
    views, and the wait reads the echo (past that, a stack in and a copy and
    a split out as well). Each torch call lets the GIL go, and the worker then waits to win it back
    from the client threads: measured on the H100's host under the bench's
    load at 256 streams (8 client threads, gateway hand-over), ~0.3-1 ms of
    wall time per call, ~8 calls and ~4.9 ms per batch when the input, the
    output and the wait were torch calls. Inside the capture the model's
    kernels are launched directly (a persistrnn module launches into a
    caller's capture); its plan is made by a first, uncaptured run, with
    every row on the spare and zero slots. A device chunk's rows travel
    through the pinned rows too (copied on the worker's stream), and its
    output is cloned from the device output."""

    def __init__(self, engine: "Engine", T: int, size: int) -> None:
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        dtype, device = engine.dtype, engine.device
        self.x_host = torch.zeros((size, T, engine.input_size), dtype=dtype, pin_memory=self.cuda)
        self.x_rows = _host_rows(self.x_host)
        self.index_host = torch.empty((2, size), dtype=torch.long, pin_memory=self.cuda)
        self.index_rows = self.index_host.numpy()
        self.index_rows[0], self.index_rows[1] = engine._zero_slot, engine._spare_slot
        self.out_rows: Any = None
        self.resident = engine._resident
        if self.resident is not None:  # the kernel reads and writes the pinned rows itself
            self.out_host = torch.empty((size, T, engine.output_size), dtype=dtype, pin_memory=True)
            self.out_rows = _host_rows(self.out_host)
            rows = min(size, self.resident.rows)
            self.xw = torch.empty(T * rows * self.resident.config.spec.num_gates * self.resident.config.hidden_size,
                                  dtype=torch.float32, device=device)
            self.addresses = (self.x_host.data_ptr(), self.out_host.data_ptr(), self.index_host.data_ptr(),
                              self.index_host[1].data_ptr(), self.xw.data_ptr())
            self.row_bytes = (self.x_host[0].nbytes, self.out_host[0].nbytes)
        elif self.cuda:
            self.x = self.x_host.to(device)
            self.index = self.index_host.to(device)
            self.out_host = torch.empty((size, T, engine.output_size), dtype=dtype, pin_memory=True)
            self.out_rows = _host_rows(self.out_host)
            self.echo_host = torch.zeros(2, dtype=torch.long, pin_memory=True)  # [the run's number, its echo]
            self.echo_rows = self.echo_host.numpy()
            self.echo = self.echo_host[:1].to(device)
        self.graph = None
        if self.cuda and self.resident is None and engine.capture_batches:
            self.graph, self.out = runtime.capture(self._run, stream=engine._cuda_stream)

    def _run(self) -> torch.Tensor:
        if not self.cuda:
            out = self.engine._forward(self.x_host, self.index_host)
            self.out_rows = _host_rows(out)
            return out
        self.echo.copy_(self.echo_host[:1], non_blocking=True)
        self.index.copy_(self.index_host, non_blocking=True)
        self.x.copy_(self.x_host, non_blocking=True)
        out = self.engine._forward(self.x, self.index)
        self.out_host.copy_(out, non_blocking=True)
        self.echo_host[1:].copy_(self.echo, non_blocking=True)  # last: the rows above are home
        return out

    def fill(self, chunks: list[_Chunk], by_rows: bool) -> None:
        """Row i of the input from ``chunks[i]``: ``by_rows``, a host chunk
        through NumPy (no torch call) and a device chunk by a copy on the
        worker's stream once its input is ready; else all by one stack."""
        if not by_rows:
            torch.stack([chunk.x for chunk in chunks], 0, out=self.x_host[:len(chunks)])
            return
        rows = self.x_rows
        for row, chunk in enumerate(chunks):
            if chunk.x.is_cuda:
                torch.cuda.current_stream(self.engine.device).wait_event(chunk.ready)
                self.x_host[row].copy_(chunk.x, non_blocking=True)
            else:
                rows[row] = _host_rows(chunk.x)

    def run(self, timeout: float, rows: int) -> None:
        """One run on the input rows and ``index``; returns when the output
        rows are written (on CUDA: polls the echo, at most ``timeout``
        seconds). Resident: the first ``rows`` rows, as ticks of the resident
        kernel's rows at most."""
        if self.resident is not None:
            T = self.x_host.shape[1]
            x, out, gather, scatter, xw = self.addresses
            x_row, out_row = self.row_bytes
            step = self.resident.rows
            for r0 in range(0, rows, step):
                try:
                    self.resident.run(T, min(step, rows - r0), x + r0 * x_row, out + r0 * out_row, gather + 8 * r0,
                                      scatter + 8 * r0, xw, timeout)
                except TimeoutError as exc:  # the engine stops: every later tick would wait as long
                    raise _DeviceStalled(str(exc)) from exc
            return
        echo = self.echo_rows if self.cuda else None
        if echo is not None:
            echo[0] += 1  # read by the run's first copy
        if self.graph is None:
            self.out = self._run()
        else:
            self.graph.replay()
        if echo is None:
            return
        # Spin on the echo for as long as a small batch takes, then poll with sleep(0) (runtime.HOST_SPIN_S).
        started = time.perf_counter()
        while echo[1] != echo[0] and time.perf_counter() - started < runtime.HOST_SPIN_S:
            pass
        deadline = started + timeout
        while echo[1] != echo[0]:
            if time.perf_counter() > deadline:
                raise _DeviceStalled(f"the engine's batch did not finish on {self.engine.device} within {timeout} s")
            time.sleep(0)

    def outputs(self, chunks: list[_Chunk], by_rows: bool) -> list[torch.Tensor]:
        """Each chunk's output (T, H), or (H,) for a chunk pushed as (I,), in
        memory of its own: ``by_rows``, host rows copied through NumPy and
        device rows cloned from the device output; else one copy and a split."""
        if not by_rows:
            out = self.out_host if self.cuda else self.out
            return _split(chunks, out[:len(chunks)].clone(memory_format=torch.contiguous_format))
        rows, dtype, results = self.out_rows, self.engine.dtype, []
        for row, chunk in enumerate(chunks):
            if chunk.x.is_cuda:
                out = self.out_host if self.resident is not None else self.out
                out = out[row, 0] if chunk.single_step else out[row]
                results.append(out.to(self.engine.device) if self.resident is not None else out.clone())
            else:
                out = torch.from_numpy((rows[row, 0] if chunk.single_step else rows[row]).copy())
                results.append(out if out.dtype == dtype else out.view(dtype))
        return results


class _DeviceStalled(TimeoutError):
    """The device did not finish a batch within the engine's timeout: the
    engine stops, since every later batch would wait as long."""
