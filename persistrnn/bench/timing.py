"""CUDA-event timing for the benchmark suites: the library's own
(:mod:`persistrnn.runtime.timing`), so that a suite and the planner time the
same way."""

from ..runtime.timing import per_iteration_us, time_cuda_ms, warm_up

__all__ = ["per_iteration_us", "time_cuda_ms", "warm_up"]
