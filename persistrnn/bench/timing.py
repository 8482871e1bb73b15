"""CUDA-event timing shared by every benchmark suite."""

from __future__ import annotations

import statistics
from typing import Callable


def time_cuda_ms(run: Callable[[], None], *, warmup: int = 2, repeats: int = 5, setup: Callable[[], None] | None = None) -> float:
    """Median device time of ``run()`` in milliseconds, over ``repeats`` timed calls.

    ``setup`` (e.g. zeroing a barrier counter) runs before each call, outside
    the timed region. Warm-up calls keep module load and first-touch costs out.
    """
    import torch

    for _ in range(warmup):
        if setup:
            setup()
        run()
    pairs = []
    for _ in range(repeats):
        if setup:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)
