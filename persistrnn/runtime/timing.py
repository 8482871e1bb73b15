"""Device timing: CUDA events, a warm-up to steady clocks, medians.

An idle H100 sits at 345 MHz and ramps up within milliseconds of load;
timings taken right after seconds of CPU work (compiling) read 3-4x slow.
:func:`warm_up` keeps the GPU busy until consecutive timings agree.

Events around work that the host issues more slowly than the device runs it
time the host: ``time_cuda_ms(..., queued=True)`` issues each timed call
while the GPU sleeps, so that the events see the device's time alone.
"""

from __future__ import annotations

import statistics
from typing import Callable
from ..errors import ArgumentError

__all__ = ["per_iteration_us", "time_cuda_ms", "warm_up"]

WARM_UP_MS = 50.0  # of back-to-back work before timing: the measured ramp is a few ms
WARM_UP_TOLERANCE = 0.05  # consecutive medians within 5%: steady
QUEUE_SLEEP_CYCLES = 1 << 20  # ~0.5 ms at the H100's 1.98 GHz: the first sleep a queued timing tries
QUEUE_SLEEP_DOUBLINGS = 12  # up to ~2 s of sleep: a call the host cannot issue in that is refused


def time_cuda_ms(run: Callable[[], None], *, warmup: int = 2, repeats: int = 5,
                 setup: Callable[[], None] | None = None, queued: bool = False) -> float:
    """Median device time of ``run()`` in milliseconds, over ``repeats`` timed calls.

    ``setup`` (e.g. zeroing a barrier counter) runs before each call, outside
    the timed region. Warm-up calls keep module load and first-touch costs out.
    ``queued``: each timed call is issued while the GPU sleeps (the sleep
    doubles until the timed region had not begun when the call returned), so
    the host's time to issue it does not count.
    """
    import torch

    for _ in range(warmup):
        if setup:
            setup()
        run()
    if queued:
        return _queued_ms(run, repeats, setup)
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


def _queued_ms(run: Callable[[], None], repeats: int, setup: Callable[[], None] | None) -> float:
    import torch

    cycles, doublings, times = QUEUE_SLEEP_CYCLES, 0, []
    while len(times) < repeats:
        if setup:
            setup()
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        behind_the_sleep = not start.query()  # the GPU had not reached the timed region when the call returned
        torch.cuda.synchronize()
        if behind_the_sleep:
            times.append(start.elapsed_time(end))
        elif doublings == QUEUE_SLEEP_DOUBLINGS:
            raise ArgumentError(f"time_cuda_ms(queued=True): the host took longer to issue one call than a GPU "
                                f"sleep of {cycles} cycles; time it unqueued")
        else:
            cycles, doublings = 2 * cycles, doublings + 1
    return statistics.median(times)


def warm_up(run: Callable[[], None], *, budget_ms: float = WARM_UP_MS, max_rounds: int = 20) -> float:
    """Run ``run`` back to back until the GPU's clocks are steady: at least
    ``budget_ms`` of work, then until two consecutive medians agree within
    5%. Returns the last median (ms)."""
    previous = time_cuda_ms(run, warmup=1, repeats=3)
    spent = 4 * previous
    for _ in range(max_rounds):
        current = time_cuda_ms(run, warmup=0, repeats=3)
        spent += 3 * current
        if spent >= budget_ms and abs(current - previous) <= WARM_UP_TOLERANCE * max(current, 1e-6):
            return current
        previous = current
    return previous


def per_iteration_us(run_with: Callable[[int], None], iterations: int, *, warmup: int = 2, repeats: int = 5,
                     setup: Callable[[], None] | None = None) -> float:
    """Device time of one iteration of a loop that runs inside one launch, in µs.

    ``run_with(n)`` launches the loop for ``n`` iterations. The loop is timed
    at ``iterations`` and ``iterations // 10``; the difference of the two times
    over the difference of the counts cancels the launch and the prologue.
    """
    if iterations < 20:
        raise ArgumentError(f"iterations must be >= 20 so that iterations // 10 differs, got {iterations}")
    long, short = iterations, iterations // 10
    times = {n: time_cuda_ms(lambda n=n: run_with(n), warmup=warmup, repeats=repeats, setup=setup)
             for n in (short, long)}
    return (times[long] - times[short]) * 1e3 / (long - short)
