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
pickled; a script comes back pickled, ~0.5 ms at 3.5 MB). A worker never
touches the GPU.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable, Sequence

from ..errors import ArgumentError
from .graph import Graph
from .model import Model
from .script import PLACEMENTS, MatrixLayout, Script, schedule

__all__ = ["WORKER_TIMEOUT_S", "script_loader"]

WORKER_TIMEOUT_S = 300.0
"""Longest wait for the next script from the workers before the loop fails:
a worker that is stuck (not dead: a dead one fails the loop at once) never
hangs it. Scripts of the largest measured batches take well under a second."""


class _Scripts:
    """Map-style dataset: item ``i`` is batch ``i``'s script."""

    def __init__(self, model: Model, build: Callable[[Graph, Any], Any], batches: Sequence[Any], blocks: int,
                 train: bool, placement: str, layout: MatrixLayout | None) -> None:
        self.model, self.build, self.batches = model, build, batches
        self.blocks, self.train, self.placement, self.layout = blocks, train, placement, layout

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Script:
        graph = Graph(self.model)
        self.build(graph, self.batches[i])
        return schedule(graph, self.blocks, train=self.train, placement=self.placement, layout=self.layout)


def _as_is(script: Script) -> Script:
    return script


def script_loader(model: Model, build: Callable[[Graph, Any], Any], batches: Sequence[Any], blocks: int, *,
                  train: bool = True, placement: str = "partition", layout: MatrixLayout | None = None,
                  workers: int = 0, prefetch: int = 2) -> Any:
    """An iterable of the scripts of ``batches``, in their order: for each
    batch, ``build(graph, batch)`` adds it to a new :class:`~.graph.Graph` of
    ``model``, which is scheduled on ``blocks`` blocks (:func:`~.script.schedule`).

    ``workers`` processes make them ahead (0: in this process, one at a time
    as the loop asks), each up to ``prefetch`` scripts ahead; they start at
    the first loop and stay for the next ones (a loop per epoch pays their
    start once). A failure in a worker (a malformed input, say) is raised in
    the loop with its type and message. ``Interpreter.scripts`` calls this
    with the interpreter's blocks, placement and ``layout``.
    """
    import torch.utils.data

    for name, value, low in (("workers", workers, 0), ("prefetch", prefetch, 1), ("blocks", blocks, 1)):
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
    return torch.utils.data.DataLoader(_Scripts(model, build, batches, blocks, train, placement, layout),
                                       batch_size=None,
                                       shuffle=False, num_workers=workers, collate_fn=_as_is,
                                       prefetch_factor=prefetch if workers else None,
                                       persistent_workers=workers > 0, timeout=WORKER_TIMEOUT_S if workers else 0,
                                       # the inputs and `build` (a lambda, say) reach the workers by fork,
                                       # unpickled, whatever this Python's default start method
                                       multiprocessing_context="fork" if workers else None)
