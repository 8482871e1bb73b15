"""Scripts made ahead of the kernel, in worker processes.

A batch's host work (its graph, then its schedule) measured 2.5-4.5x the
training kernel's time at every batch on the H100's host (perf-notes, dynamic
§9), so ``Interpreter.step``'s overlap of one batch's host work with the
previous batch's kernel leaves the GPU waiting. The batches of a training
loop are known ahead, and each one's script depends on nothing but the batch,
the model's declarations and the block count: :func:`script_loader` makes
them in a :class:`torch.utils.data.DataLoader`'s worker processes, several
batches at once and in order, while the main process launches. With ``w``
workers the host's rate is up to ``w`` times one process's, until the
launches or the GPU are the limit.

Each worker holds its own copy of the model's declarations, the ``build``
callable and the batches (on Linux they are inherited by ``fork``, not
pickled). A worker never touches the GPU.

A script's arrays (3.6 MB for a Tree-LSTM batch of 128, 5.8 MB for the
tagger's) come back through shared memory, not the DataLoader's pipe: a
pipe carried 0.3-1 GB/s on the machines measured, 4-6 ms per batch of 128
in the launching process, which bounded the loop past ~10 workers
(perf-notes, dynamic §23). Each worker writes into its own slots of one
anonymous shared mapping made before the workers fork; only the slot's
number and the small fields go through the pipe, and the launching process
copies the arrays out under the slot's lock. A slot rewritten before it was
read (a worker further ahead than its slots) is detected by its tag and
that batch is made again in this process; a script larger than a slot
comes through the pipe.

The DataLoader costs the launching process ~0.1-0.25 ms per item it hands
over (its queues, its pickled handle, its bookkeeping; perf-notes dynamic
§32), which is a third of a batch-1 kernel. ``per_item`` makes each item
several consecutive batches' scripts, so that cost is shared; a worker
whose item fails part way hands back the scripts before the failure, and
the launching process makes the rest itself, raising the failure there.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import mmap
import multiprocessing
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import ArgumentError
from ..log import logger
from .graph import Graph
from .model import Model
from .script import PLACEMENTS, MatrixLayout, Script, schedule

__all__ = ["WORKER_TIMEOUT_S", "script_loader"]

WORKER_TIMEOUT_S = 300.0
"""Longest wait for the next script from the workers before the loop fails:
a worker that is stuck (not dead: a dead one fails the loop at once) never
hangs it. Scripts of the largest measured batches take well under a second."""


SLOT_BYTES = 16 << 20
"""Bytes of one shared-memory slot: the arrays of one script. A larger
script comes through the pipe. Pages are allocated as a slot is first
written, so unused capacity costs address space only."""

_ARRAYS = ("program", "starts", "offsets", "losses")


@dataclasses.dataclass(frozen=True)
class _MakeHere:
    """The rest of a worker's item after a batch of it failed: the
    launching process makes these batches itself, and so raises the failure
    with its own type, message and traceback."""

    indices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _InSlot:
    """What a worker sends for a script written into a slot: the batch's
    index, the slot, the tag it wrote there, each array's (dtype, shape,
    byte offset) and the script's other fields."""

    index: int
    slot: int
    tag: int
    arrays: tuple[tuple[str, tuple[int, ...], int], ...]
    fields: dict[str, Any]


class _Slots:
    """``per_worker`` slots of :data:`SLOT_BYTES` for each of ``workers``
    workers in one anonymous shared mapping (inherited by the forked
    workers), each with a lock and a tag (the worker's count of scripts
    written, with its id: unique per loader)."""

    def __init__(self, workers: int, per_worker: int) -> None:
        context = multiprocessing.get_context("fork")
        self.per_worker = per_worker
        self.memory = mmap.mmap(-1, workers * per_worker * SLOT_BYTES)  # MAP_SHARED | MAP_ANONYMOUS
        self.tags = np.frombuffer(context.RawArray("q", workers * per_worker), dtype=np.int64)
        self.locks = [context.Lock() for _ in range(workers * per_worker)]
        self.written = itertools.count()  # this worker's scripts (each worker counts in its own copy)

    def put(self, worker: int, index: int, script: Script) -> _InSlot | Script:
        arrays = [np.ascontiguousarray(getattr(script, name)) for name in _ARRAYS]
        if sum(-(-a.nbytes // 8) * 8 for a in arrays) > SLOT_BYTES:
            return script
        n = next(self.written)
        slot, tag = worker * self.per_worker + n % self.per_worker, (n << 16) + worker + 1
        layout, at = [], slot * SLOT_BYTES
        if not self.locks[slot].acquire(timeout=WORKER_TIMEOUT_S):
            raise ArgumentError(f"script_loader: the launching process held slot {slot} for {WORKER_TIMEOUT_S} s")
        try:
            for a in arrays:
                np.frombuffer(self.memory, dtype=a.dtype, count=a.size, offset=at)[:] = a.ravel()
                layout.append((a.dtype.str, a.shape, at))
                at += -(-a.nbytes // 8) * 8
            self.tags[slot] = tag
        finally:
            self.locks[slot].release()
        fields = {f.name: getattr(script, f.name) for f in dataclasses.fields(script) if f.name not in _ARRAYS}
        return _InSlot(index, slot, tag, tuple(layout), fields)

    def take(self, item: _InSlot) -> Script | None:
        """The script in ``item``'s slot, copied out; None where the slot
        holds another script by now."""
        if not self.locks[item.slot].acquire(timeout=WORKER_TIMEOUT_S):
            raise ArgumentError(f"script_loader: a worker held slot {item.slot} for {WORKER_TIMEOUT_S} s")
        try:
            if self.tags[item.slot] != item.tag:
                return None
            arrays = {name: np.frombuffer(self.memory, dtype=dtype, count=int(np.prod(shape)), offset=at)
                      .reshape(shape).copy() for name, (dtype, shape, at) in zip(_ARRAYS, item.arrays)}
        finally:
            self.locks[item.slot].release()
        return Script(**arrays, **item.fields)


class _Scripts:
    """Map-style dataset: item ``j`` is the scripts of batches ``j *
    per_item`` up to ``(j + 1) * per_item`` (in a worker with slots, handles
    on them in shared memory)."""

    def __init__(self, model: Model, build: Callable[[Graph, Any], Any], batches: Sequence[Any], blocks: int,
                 train: bool, placement: str, layout: MatrixLayout | None, slots: _Slots | None,
                 per_item: int) -> None:
        self.model, self.build, self.batches = model, build, batches
        self.blocks, self.train, self.placement, self.layout = blocks, train, placement, layout
        self.slots, self.per_item = slots, per_item

    def __len__(self) -> int:
        return -(-len(self.batches) // self.per_item)

    def script(self, i: int) -> Script:
        graph = Graph(self.model)
        self.build(graph, self.batches[i])
        return schedule(graph, self.blocks, train=self.train, placement=self.placement, layout=self.layout)

    def __getitem__(self, item: int) -> tuple[Script | _InSlot | _MakeHere, ...]:
        import torch.utils.data

        worker = torch.utils.data.get_worker_info()
        indices = range(item * self.per_item, min(len(self.batches), (item + 1) * self.per_item))
        made: list[Script | _InSlot | _MakeHere] = []
        for i in indices:
            try:
                script = self.script(i)
            except Exception:
                if not made:
                    raise  # the DataLoader raises it in the loop, with its type and message
                made.append(_MakeHere(tuple(indices[len(made):])))
                break
            made.append(script if worker is None or self.slots is None else self.slots.put(worker.id, i, script))
        return tuple(made)


class _Loader:
    """The DataLoader's items as scripts, in order: a slot's copied out."""

    def __init__(self, loader: Any, scripts: _Scripts) -> None:
        self.loader, self.scripts = loader, scripts

    def __len__(self) -> int:
        return len(self.scripts.batches)

    def __iter__(self) -> Iterator[Script]:
        scripts = self.scripts
        for item in self.loader:
            for one in item:
                if isinstance(one, _MakeHere):
                    yield from (scripts.script(i) for i in one.indices)
                elif isinstance(one, _InSlot):
                    yield scripts.slots.take(one) or scripts.script(one.index)
                else:
                    yield one


def _as_is(item: tuple[Script | _InSlot | _MakeHere, ...]) -> tuple[Script | _InSlot | _MakeHere, ...]:
    return item


def script_loader(model: Model, build: Callable[[Graph, Any], Any], batches: Sequence[Any], blocks: int, *,
                  train: bool = True, placement: str = "partition", layout: MatrixLayout | None = None,
                  workers: int = 0, prefetch: int = 2, per_item: int = 1) -> Any:
    """An iterable of the scripts of ``batches``, in their order: for each
    batch, ``build(graph, batch)`` adds it to a new :class:`~.graph.Graph` of
    ``model``, which is scheduled on ``blocks`` blocks (:func:`~.script.schedule`).

    ``workers`` processes make them ahead (0: in this process, one at a time
    as the loop asks), ``per_item`` consecutive batches at a time, each up to
    ``prefetch`` such items ahead; they start at the first loop and stay for
    the next ones (a loop per epoch pays their start once). Where a script
    takes about a millisecond to make (batches of a few inputs), a
    ``per_item`` of ~4 shares the launching process's cost per item; larger
    items take longer to the first script and ``per_item`` times the shared
    memory. A failure in a worker (a malformed input, say) is raised in
    the loop with its type and message. ``Interpreter.scripts`` calls this
    with the interpreter's blocks, placement and ``layout``.
    """
    import torch.utils.data

    for name, value, low in (("workers", workers, 0), ("prefetch", prefetch, 1), ("blocks", blocks, 1),
                             ("per_item", per_item, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ArgumentError(f"script_loader: {name} must be an int >= {low}, got {value!r}")
    if placement not in PLACEMENTS:
        raise ArgumentError(f"script_loader: placement must be one of {PLACEMENTS}, got {placement!r}")
    if not callable(build):
        raise ArgumentError(f"script_loader: build must be a callable (graph, batch), got {type(build).__name__}")
    if workers and "fork" not in multiprocessing.get_all_start_methods():
        raise ArgumentError(f"script_loader: workers start by fork, which this platform lacks (it has "
                            f"{multiprocessing.get_all_start_methods()}); use workers=0")
    model.layout()  # fixes the declarations here, before any worker copies the model
    # A worker is at most `prefetch` items ahead of the loop (the DataLoader sends it an item as the loop takes
    # one of its items), so (prefetch + 1) * per_item slots are never rewritten before they are read. In this
    # process an item is one script: the loop overlaps each with the kernel before it.
    per_item = per_item if workers else 1
    slots = None
    if workers:
        try:
            slots = _Slots(workers, (prefetch + 1) * per_item)
        except OSError as error:  # address space or shared memory refused (a strict overcommit limit, say)
            logger.warning("script_loader: no shared memory for %d workers' slots (%s); scripts come back through "
                           "the DataLoader's pipe", workers, error)
    scripts = _Scripts(model, build, batches, blocks, train, placement, layout, slots, per_item)
    loader = torch.utils.data.DataLoader(scripts, batch_size=None, shuffle=False, num_workers=workers,
                                         collate_fn=_as_is, prefetch_factor=prefetch if workers else None,
                                         persistent_workers=workers > 0, timeout=WORKER_TIMEOUT_S if workers else 0,
                                         # the inputs and `build` (a lambda, say) reach the workers by fork,
                                         # unpickled, whatever this Python's default start method
                                         multiprocessing_context="fork" if workers else None,
                                         worker_init_fn=_freeze_inherited)
    return _Loader(loader, scripts)


def _freeze_inherited(worker_id: int) -> None:
    """A worker keeps what it inherited (the inputs, the model) out of the
    cyclic collector's passes: a full pass over an SST loop's ~300k objects
    took ~0.17 s, about one in 40 scripts at batch 128 (+4 ms a script on
    average, perf-notes dynamic §35), and it writes to every object's header,
    copying the pages the fork shared."""
    gc.freeze()
