"""A resident launch: one layer's persistent kernel that stays on the GPU
between a serving engine's ticks (``recurrence.cu``, ``PRNN_RESIDENT``).

The host posts a tick by writing its descriptor (steps, rows, and the
addresses of the input rows, output rows, gather and scatter slots and a
projection scratch) into a control block of int64 words in pinned host
memory (:data:`~.config.RESIDENT_CONTROL`), then the tick's number into the
doorbell word; the kernel runs the tick and echoes the number into ``done``
once every output row is in host memory. Posting and waiting are NumPy
reads and writes of pinned memory: no CUDA call, no launch, and (in the
engine's worker) no release of the GIL.

Every wait is bounded. The kernel leaves by itself when it sees no doorbell
for ``idle`` seconds or has run ``lifetime`` seconds (a device-wide
synchronise anywhere in the process waits for it), and the next tick
launches it again. A failure inside it is reported in a report word of the
layer's own (not the device's, which other launches share);
:meth:`ResidentLayer.stop` asks it to leave and waits for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from .. import runtime
from ..errors import ArgumentError, ConfigError, KernelLaunchError
from .config import KERNEL_NAME, RESIDENT_CONTROL, SYNC_MODES, KernelConfig
from .heuristic import default_config
from .launch import _address, _prepared_launch, batch_per_launch
from .source import compile_config

__all__ = ["DEFAULT_IDLE_S", "DEFAULT_LIFETIME_S", "ResidentLayer", "resident_config"]

DEFAULT_IDLE_S = 0.02
"""A resident launch leaves after this long without a tick (the next tick
launches it again)."""
DEFAULT_LIFETIME_S = 0.2
"""A resident launch leaves after this long even while busy: a device-wide
synchronise elsewhere in the process waits at most this long for it."""

_WORD = {name: i for i, name in enumerate(RESIDENT_CONTROL)}


def resident_config(shape: Any, rows: int) -> tuple[KernelConfig, int]:
    """The resident configuration of a one-layer, one-direction model
    ``shape`` (:class:`persistrnn.plan.ModelShape`) for up to ``rows`` rows a
    tick, and the rows it runs a tick. The candidates: the planner's choice
    at that batch where it is a cluster or single-block kernel, the
    configuration from sizes alone, and clusters of 8 and 16 blocks (more
    blocks, fewer units each: more rows fit a block's shared memory); each
    made resident and kept if it compiles without spills. The first that
    holds ``rows`` rows in one launch wins, else the one that holds the most
    (a batch of more rows then runs as several ticks). Raises
    :class:`ConfigError` naming why none runs."""
    import torch

    from ..plan import cached_plan
    from .heuristic import blocks_for

    if shape.num_layers != 1 or shape.bidirectional:
        raise ConfigError(f"a resident kernel runs one layer of one direction, got {shape.num_layers} layers, "
                          f"bidirectional={shape.bidirectional}")
    facts = runtime.device_facts()
    H = shape.hidden_size
    candidates = []
    chosen = cached_plan(shape, rows)
    if chosen.path == "persistent" and chosen.config.sync != "grid" and chosen.config.instances == 1:
        candidates.append(chosen.config)
    with contextlib.suppress(ConfigError):
        candidates.append(default_config(shape.cell, H, rows, sm_count=facts.sm_count, dtype=shape.dtype))
    for wanted in (8, 16):
        with contextlib.suppress(ConfigError):
            blocks = blocks_for(H, wanted)
            candidates.append(KernelConfig(shape.cell, H, "cluster" if blocks > 1 else "single", blocks, 256,
                                           group_size=8, batch_tile=8, dtype=shape.dtype))
    why, best = [], None
    for config in candidates:
        if config.sync not in SYNC_MODES[:2]:
            why.append(f"{config}: sync {config.sync!r}")
            continue
        config = dataclasses.replace(config, resident_input_size=shape.input_size, lengths=False, test_hook=False,
                                     save_gates=False)
        try:
            compile_config(config)
            device = torch.cuda.current_device()
            holds = batch_per_launch(config, device)
            _prepared_launch(config, device, min(holds, rows), 1)  # its cluster can be resident
        except (ConfigError, KernelLaunchError) as exc:
            why.append(str(exc))
            continue
        if holds >= rows:
            return config, rows
        if best is None or holds > best[1]:
            best = (config, holds)
    if best is not None:
        return best
    raise ConfigError(f"no resident kernel of {shape.cell} H={H} ({shape.dtype}) fits one cluster: "
                      + ("; ".join(why) or "no single-block or cluster configuration"))


class ResidentLayer:
    """The host side of one layer's resident launches on one device.

    ``weights``: (w_ih, w_hh, b_ih, b_hh) of the layer, contiguous, on the
    device, in the config's dtype (zeros for a layer without biases).
    ``h_pool``, ``c_pool``: (slots, H) state pools that ticks gather from and
    scatter to by slot (``c_pool`` None for cells without a cell state).
    ``rows``: the most rows a tick has. Ticks are posted and waited for by
    one thread at a time (the engine's worker)."""

    def __init__(self, config: KernelConfig, weights: tuple[Any, Any, Any, Any], h_pool: Any, c_pool: Any,
                 rows: int, *, idle: float = DEFAULT_IDLE_S, lifetime: float = DEFAULT_LIFETIME_S) -> None:
        import torch

        if not config.resident_input_size:
            raise ArgumentError(f"ResidentLayer: expected a resident configuration, got {config}")
        for name, value in (("idle", idle), ("lifetime", lifetime)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ArgumentError(f"ResidentLayer: expected a positive number of seconds for {name}, got {value!r}")
        self.config = config
        self.device = h_pool.device
        self.weights = weights
        self.h_pool, self.c_pool = h_pool, c_pool
        self.rows = rows
        self.idle_ns, self.lifetime_ns = int(idle * 1e9), int(lifetime * 1e9)
        self.kernel, self.launch_config = _prepared_launch(config, self.device.index, rows, 1)
        self.control = torch.zeros(len(RESIDENT_CONTROL), dtype=torch.int64, pin_memory=True)
        self.words = self.control.numpy()
        self.report = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # this layer's failures only
        self.reported = self.report.numpy()
        self.stream = runtime.own_stream(self.device.index)
        self.tick = 0  # the last tick posted
        self.generation = 0  # launches made so far; the last one's number
        self.launches = 0
        self._scratch: Any = None  # the running launch's status word, kept alive while it runs
        self._stop_asked = False
        self.stopped = False  # stop() saw the last launch leave: nothing of this layer runs

    def _launch(self) -> None:
        """Launch generation ``generation + 1``, serving from the pending tick
        on; ``generation`` counts it once the launch call has returned (a
        launch that raised never runs, and nothing waits for its exit)."""
        import numpy as np
        import torch

        w_ih, w_hh, b_ih, b_hh = self.weights
        H = self.config.hidden_size
        c_pool = self.c_pool if self.c_pool is not None else self.h_pool
        generation = self.generation + 1
        with torch.cuda.stream(self.stream):
            own = runtime.scratch(self.device, 0, counters=self.config.counter_words)
            args = [np.uint64(0), _address(w_hh), _address(b_hh), _address(self.h_pool), _address(c_pool),
                    np.uint64(0), _address(self.h_pool), _address(c_pool), 0, np.uint64(0),
                    _address(w_ih), _address(b_ih), np.uint64(self.control.data_ptr()), np.int64(self.tick),
                    np.int64(generation), np.uint64(self.idle_ns), np.uint64(self.lifetime_ns),
                    np.uint64(0), np.uint64(own.counters), np.uint64(0), np.uint64(0), 1, self.rows, self.rows,
                    self.rows, H, np.uint64(own.status), np.uint64(self.report.data_ptr()),
                    np.uint64(runtime.wait_timeout_ns()), np.int32(-1)]
            runtime.launch(self.kernel, self.launch_config, *runtime.kernel_args(*args))
        self.generation = generation
        self._scratch = own
        self.launches += 1

    def run(self, steps: int, rows: int, x: int, out: int, gather: int, scatter: int, xw: int,
            timeout: float) -> None:
        """Post one tick and wait until its outputs are in host memory (at
        most ``timeout`` seconds). Addresses: ``x`` (rows, steps, I) and
        ``out`` (rows, steps, H) in pinned host memory, ``gather`` and
        ``scatter`` (rows,) pinned int64 slot numbers, ``xw`` device float32
        scratch of at least steps * rows * G*H. Raises the kernel's reported
        failure, or :class:`TimeoutError` when the tick did not finish in time
        (the launch is then asked to stop)."""
        if self._stop_asked:
            raise KernelLaunchError("ResidentLayer.run: the resident kernel was stopped")
        if not 1 <= rows <= self.rows:
            raise ArgumentError(f"ResidentLayer.run: expected 1..{self.rows} rows, got {rows}")
        words = self.words
        self.tick += 1
        tick = self.tick
        words[_WORD["steps"]] = steps
        words[_WORD["rows"]] = rows
        words[_WORD["x"]] = x
        words[_WORD["out"]] = out
        words[_WORD["gather"]] = gather
        words[_WORD["scatter"]] = scatter
        words[_WORD["xw"]] = xw
        words[_WORD["doorbell"]] = tick  # last: the kernel reads the descriptor once it sees this
        if self.generation == 0 or words[_WORD["exited"]] == self.generation:
            self._launch()  # the first, or after a launch left (idle, lifetime, a failure, or a launch that raised)
        done, exited = _WORD["done"], _WORD["exited"]
        started = time.perf_counter()
        deadline = started + timeout
        spin_until = started + runtime.HOST_SPIN_S
        while words[done] != tick:
            if words[exited] == self.generation:  # it left without this tick: its failure, or idle or old
                if words[done] == tick:
                    break
                code, self.reported[0] = int(self.reported[0]), 0
                runtime.raise_failure_code(code, f"{KERNEL_NAME} (resident)")
                self._launch()
                continue
            now = time.perf_counter()
            if now > deadline:
                self.stop(timeout=0.0)
                raise TimeoutError(f"a resident kernel's tick did not finish on {self.device} within {timeout} s")
            if now > spin_until:
                time.sleep(0)  # lets client threads run while a longer tick finishes

    def stop(self, timeout: float) -> bool:
        """Ask the running launch to leave and wait up to ``timeout``
        seconds for it; True if none is running now."""
        self._stop_asked = True
        words = self.words
        words[_WORD["stop"]] = 1
        deadline = time.perf_counter() + timeout
        while self.generation and words[_WORD["exited"]] != self.generation:
            if time.perf_counter() > deadline:
                return False
            time.sleep(0)
        self.stopped = True
        return True

    def release(self) -> None:
        """Give the launch stream back (after :meth:`stop` returned True)."""
        runtime.release_stream(self.stream)
