"""Where the serving engine's host time goes, under the load of ``bench serve``
(Poisson arrivals, a chunk every 32 ms per stream, client threads) on a CPU
model small enough that its compute is negligible. For each number of live
streams it reports:

* push→delivery latency percentiles, delivered chunks/s against the offered
  rate, and the mean batch (the saturation point is where delivered falls
  behind offered);
* the worker's host µs per tick split into its parts (forming the tick under
  the lock, the batch: stack, model, split; settling: outputs, futures and
  their callbacks) and the same per chunk, and the worker's share of the run;
* the clients' host µs per chunk inside their calls to the engine:
  ``Stream.submit`` (the ``stream`` hand-over: a call per chunk), or
  ``Engine.push_many`` and ``Engine.pull_many`` (the ``gateway`` hand-over: a
  call per group of due chunks);
* the garbage collector's pauses by generation.

Times are wall and per-thread CPU time: wall includes the waits for the GIL
and the lock; CPU time does not, which makes it the steadier measure on a
shared machine. ``--closed-loop ROUNDS`` first measures capacity: clients
push a chunk to each of their streams and then take every output, unpaced
(by a call per chunk, or by one ``push_many`` and one ``pull_many`` per
round).
``--gc freeze`` moves every object alive before the load to the permanent
generation (``gc.freeze()``); ``--gc off`` disables the collector during the
load; ``--cprofile`` prints the worker thread's top functions by own time.

    PYTHONPATH=. python scripts/profile_serve.py [--streams 64 1000] [--seconds 5] [--closed-loop 30] [--gc freeze]
        [--handovers stream gateway]
"""

import argparse
import collections
import cProfile
import gc
import io
import pstats
import sys
import threading
import time

import torch

from persistrnn import serve
from persistrnn.bench import serve as bench

TICK_PARTS = ("_take_chunks", "_run_batch", "_settle_tick")
"""The engine methods a tick is split into; the rest of a tick's time is the
worker's wait for input (and the calls of ``warm_up``)."""


class Timers:
    """Wall seconds, the calling thread's CPU seconds, calls and chunks per
    named part. Wall time includes waits for the GIL and the lock; CPU time
    does not, so it is the steadier measure of the work on a shared machine."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.chunks: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # client threads add at once: a bare += loses updates

    def wrap(self, name: str, fn, chunks=lambda *args, **kw: 1):
        """``fn`` timed under ``name``; ``chunks(*args, **kw)``: the chunks a call handles."""
        def timed(*args, **kw):
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                seconds, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                handled = chunks(*args, **kw)
                with self._lock:
                    self.seconds[name] += seconds
                    self.cpu[name] += cpu
                    self.calls[name] += 1
                    self.chunks[name] += handled
        return timed


class GCPauses:
    """The collector's pauses by generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def report(self) -> list[str]:
        lines = []
        for generation in range(3):
            pauses = [p for g, p in self.pauses if g == generation]
            if pauses:
                lines.append(f"  gc gen{generation}: {len(pauses)} pauses, max {max(pauses) * 1e3:.2f} ms, "
                             f"total {sum(pauses) * 1e3:.1f} ms")
        return lines or ["  gc: no collection"]


CLIENT_CALLS = ("submit", "push_many", "pull_many")
"""The clients' calls to the engine that are timed (``Stream.submit``, ``Engine.push_many``, ``Engine.pull_many``)."""


def instrumented_engine(model: torch.nn.Module, slots: int, timers: Timers, worker_profile: cProfile.Profile | None):
    """An engine whose tick parts and whose clients' calls are timed."""

    class TimedEngine(serve.Engine):
        def _serve(self) -> None:
            if worker_profile is None:
                return super()._serve()
            worker_profile.enable()
            try:
                return super()._serve()
            finally:
                worker_profile.disable()

        def _tick(self) -> bool:
            return timers.wrap("tick", super()._tick)()

    for name in TICK_PARTS:
        setattr(TimedEngine, name, timers.wrap(name, getattr(serve.Engine, name)))
    for name in CLIENT_CALLS[1:]:
        setattr(TimedEngine, name, timers.wrap(name, getattr(serve.Engine, name),
                                               lambda engine, streams, *args, **kw: len(streams)))
    return TimedEngine(model, slots)


def run_load(model: torch.nn.Module, streams: int, settings: bench.Settings, handover: str, gc_mode: str,
             cprofile: bool) -> list[str]:
    timers = Timers()
    worker_profile = cProfile.Profile() if cprofile else None
    submit = serve.Stream.submit
    serve.Stream.submit = timers.wrap("submit", submit)
    pauses = GCPauses()
    try:
        with instrumented_engine(model, bench.slots_for(streams), timers, worker_profile) as engine:
            load = bench._Load(engine, streams, settings, handover)
            if gc_mode == "off":
                gc.disable()
            gc.callbacks.append(pauses)
            ticks, chunks = engine.ticks, engine.chunks_run
            started = time.perf_counter()
            load.run()
            elapsed = time.perf_counter() - started
            ticks, chunks = engine.ticks - ticks, engine.chunks_run - chunks
            gc.callbacks.remove(pauses)
            gc.enable()
    finally:
        serve.Stream.submit = submit
    ms = [v * 1e3 for v in load.latencies]
    offered = streams / (settings.chunk_ms / 1e3)
    lines = [f"{streams} live streams, {handover} hand-over: delivered {load.delivered / settings.seconds:.0f} "
             f"chunks/s of {offered:.0f} offered, mean batch {chunks / max(ticks, 1):.1f}, {ticks} ticks in "
             f"{elapsed:.1f} s"]
    if ms:
        lines.append("  latency ms: " + ", ".join(f"p{q} {bench._percentile(ms, q):.3f}" for q in (50, 90, 99))
                     + f", max {max(ms):.2f}")
    if load.counts:
        lines.append(f"  refused or failed: {dict(load.counts)}")
    run_chunks = max(engine.chunks_run, 1)
    run_ticks = max(timers.calls["tick"], 1)
    busy = sum(timers.seconds[name] for name in TICK_PARTS)
    lines.append(f"  worker: busy {busy / elapsed:.0%} of the run (wall); µs per tick (wall, CPU) and per chunk (CPU):")
    for name in TICK_PARTS + ("all parts",):
        wall, cpu = (sum(t[n] for n in TICK_PARTS) if name == "all parts" else t[name]
                     for t in (timers.seconds, timers.cpu))
        lines.append(f"    {name:<14} {wall / run_ticks * 1e6:9.1f} {cpu / run_ticks * 1e6:9.1f} "
                     f"{cpu / run_chunks * 1e6:9.2f}")
    for name in CLIENT_CALLS:
        if timers.calls[name]:
            calls, chunks = timers.calls[name], max(timers.chunks[name], 1)
            lines.append(f"  clients: {name} {timers.seconds[name] / chunks * 1e6:.2f} µs wall, "
                         f"{timers.cpu[name] / chunks * 1e6:.2f} µs CPU per chunk ({calls} calls, "
                         f"{chunks / calls:.1f} chunks per call)")
    lines += pauses.report()
    if worker_profile is not None:
        out = io.StringIO()
        pstats.Stats(worker_profile, stream=out).sort_stats("tottime").print_stats(25)
        lines += ["  worker's top functions by own time:"] + \
            ["    " + line for line in out.getvalue().splitlines() if line.strip()]
    return lines


def closed_loop(model: torch.nn.Module, streams: int, threads: int, rounds: int, mode: str) -> str:
    """Capacity: ``threads`` clients each push one chunk to each of their
    streams (or submit it), then take every output, ``rounds`` times; the
    engine is never idle and never waits for a due time. ``mode``: push and
    pull, or submit, a call per chunk; or push_many, one call to push and one
    to pull per round."""
    chunk = torch.randn(1, model.input_size)
    rows = torch.randn(streams, 1, model.input_size)  # a gateway's receive buffer
    timers = Timers()
    with instrumented_engine(model, streams, timers, None) as engine:
        opened = [engine.open() for _ in range(streams)]

        def client(k: int) -> None:
            mine = opened[k::threads]
            for _ in range(rounds):
                if mode == "push":
                    for stream in mine:
                        stream.push(chunk)
                    for stream in mine:
                        stream.pull()
                elif mode == "push_many":
                    engine.push_many(mine, rows[:len(mine)])
                    engine.pull_many(mine)
                else:
                    for future in [stream.submit(chunk) for stream in mine]:
                        future.result(timeout=engine.timeout)

        workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - started
        chunks, ticks = engine.chunks_run, engine.ticks
    worker_cpu = sum(timers.cpu[name] for name in TICK_PARTS)
    return (f"closed loop, {streams} streams, {threads} client thread(s), {mode}: {chunks / elapsed:.0f} chunks/s, "
            f"mean batch {chunks / max(ticks, 1):.1f}, worker CPU {worker_cpu / chunks * 1e6:.2f} µs per chunk "
            f"({timers.cpu['_run_batch'] / ticks * 1e6:.0f} µs per tick in the batch)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", nargs="+", type=int, default=[64, 1000], help="live streams on average")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--warmup-seconds", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=16, help="LSTM hidden size (= input size)")
    ap.add_argument("--threads", type=int, default=bench.Settings.threads, help="client threads")
    ap.add_argument("--handovers", nargs="+", choices=bench.HANDOVERS, default=list(bench.HANDOVERS),
                    help="the paced load's hand-overs: a call per chunk (stream), per group of due chunks (gateway)")
    ap.add_argument("--closed-loop-modes", nargs="+", choices=("push", "submit", "push_many"),
                    default=["push", "submit", "push_many"], help="the closed loop's ways of handing chunks over")
    ap.add_argument("--gc", choices=("on", "freeze", "off"), default="on")
    ap.add_argument("--cprofile", action="store_true", help="the worker thread's top functions")
    ap.add_argument("--closed-loop", type=int, default=0, metavar="ROUNDS",
                    help="also run ROUNDS rounds of the closed loop (capacity) at each number of streams")
    ap.add_argument("--switch-interval-ms", type=float, help="sys.setswitchinterval: how long a thread waiting "
                                                               "for the GIL waits before it asks for a switch")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    torch.set_num_threads(1)  # the model's compute is not what is measured: keep it off the other core
    torch.manual_seed(0)
    model = torch.nn.LSTM(args.hidden, args.hidden).eval()
    settings = bench.Settings(seconds=args.seconds, warmup_seconds=args.warmup_seconds, threads=args.threads)
    print(f"CPU host profile: LSTM {args.hidden}, 1 layer, {args.threads} client threads, gc {args.gc}, "
          f"python {sys.version.split()[0]}, torch {torch.__version__}, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms, {threading.active_count()} threads before the load")
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    for streams in args.streams:
        if args.closed_loop:
            for threads in (1, args.threads):
                for mode in args.closed_loop_modes:
                    if threads == 1 or mode != "submit":
                        print(closed_loop(model, streams, threads, args.closed_loop, mode), flush=True)
        for handover in args.handovers:
            print("\n".join(run_load(model, streams, settings, handover, args.gc, args.cprofile)), flush=True)


if __name__ == "__main__":
    main()
