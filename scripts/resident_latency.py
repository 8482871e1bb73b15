"""One stream's push→pull latency with no other load, captured batches against
resident mode, and the resident kernel's bare tick (post and wait, no
engine): what a tick costs once the clients' contention is taken away.

    PYTHONPATH=. python scripts/resident_latency.py [--model lstm:128:1] [--chunks 3000] [--profile]

Prints medians and p99s in µs, and the GPU, driver, torch versions and commit.
With --profile, each engine's run is repeated twice more under cProfile,
once in the worker (its ticks) and once in the client thread (push and
pull; one profiler at a time: Python 3.12 allows no more), and the top
functions by own time of each are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _percentiles(us: list[float]) -> str:
    us = sorted(us)
    return f"p50 {statistics.median(us):8.1f} µs  p99 {us[int(0.99 * (len(us) - 1))]:8.1f} µs"


def _profile(engine, stream, x) -> None:
    """push→pull of every chunk again, under cProfile in the worker's ticks, then in the client thread."""
    import cProfile
    import pstats

    client, worker = cProfile.Profile(), cProfile.Profile()
    tick = engine._tick

    def profiled_tick():
        worker.enable()
        try:
            return tick()
        finally:
            worker.disable()

    engine._tick = profiled_tick  # the worker looks it up on every tick
    for i in range(len(x)):
        if i == len(x) - 1:  # the tick that runs the last chunk is the last profiled one
            engine._tick = tick
        stream.push(x[i])
        stream.pull()
    time.sleep(0.1)  # that tick returns (and stops its profiler) after the chunk is delivered
    for i in range(len(x)):
        client.enable()
        stream.push(x[i])
        stream.pull()
        client.disable()
    for name, prof in (("client (push, pull)", client), ("worker (ticks)", worker)):
        print(f"---- {name}, {len(x)} chunks, by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    import torch

    import persistrnn
    from persistrnn import serve
    from persistrnn.bench.environment import describe, environment
    from persistrnn.bench.serve import parse_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=parse_model, default=parse_model("lstm:128:1"), help="cell:hidden:layers")
    p.add_argument("--chunks", type=int, default=3000)
    p.add_argument("--streams", type=int, default=64, help="the engine's max_streams")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cell, hidden, layers = args.model
    torch.manual_seed(0)
    model = persistrnn.from_torch(getattr(torch.nn, cell.upper())(hidden, hidden, num_layers=layers).cuda().eval())
    x = torch.randn(args.chunks, 1, hidden)
    print(describe(environment()))
    for resident in (False, True):
        with serve.Engine(model, args.streams, resident=resident) as engine:
            engine.warm_up()
            stream = engine.open()
            us = []
            for i in range(args.chunks):
                started = time.perf_counter()
                stream.push(x[i])
                stream.pull()
                us.append((time.perf_counter() - started) * 1e6)
            us = us[len(us) // 10:]  # the first tenth warms the path
            print(f"engine {'resident' if resident else 'captured'}: one stream, push→pull  {_percentiles(us)}")
            if args.profile:
                _profile(engine, stream, x)
            if resident:
                layer = engine._resident  # the worker is idle: the main thread posts ticks itself
                for rows in (1, layer.rows):
                    wide = engine._batch(1, engine._padded_size(rows))
                    wide.index_rows[0], wide.index_rows[1] = engine._zero_row, engine._spare_row
                    x_addr, out_addr, gather, scatter, xw = wide.addresses
                    us = []
                    for _ in range(args.chunks):
                        started = time.perf_counter()
                        layer.run(1, rows, x_addr, out_addr, gather, scatter, xw, 1.0)
                        us.append((time.perf_counter() - started) * 1e6)
                    us = us[len(us) // 10:]
                    print(f"resident kernel alone: a tick of {rows:3d} rows x 1 step            {_percentiles(us)}")
            stream.close()


if __name__ == "__main__":
    main()
