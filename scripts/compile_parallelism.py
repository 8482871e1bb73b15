"""How well NVRTC compilations run in parallel on this machine: the cost
model's micro-benchmark programs compiled one after another, in threads and
in processes, each way into a fresh cache folder, then the calibration's
phases (compiling, the sync floors, the FFMA/mma/pointwise timings) timed
apart where a GPU is present: twice from built binaries, then once as the
library runs it, compiling while it times; the tables of the three runs are
compared entry by entry (does timing beside the compiles change them?).

    python scripts/compile_parallelism.py [--programs N] [--arch sm_90] [--no-calibration]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor


def _fresh_cache() -> None:
    os.environ["PERSISTRNN_CACHE_DIR"] = tempfile.mkdtemp(prefix="prnn-compile-")


def _compile_one(args: tuple) -> float:
    program, arch = args
    from persistrnn.plan import model

    started = time.perf_counter()
    model.bench_binary(program, arch=arch)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=16)
    parser.add_argument("--arch", default=None, help="default: this GPU's")
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--first-calls", action="store_true",
                        help="then time a new process's first calls of three new shapes on an empty cache")
    parser.add_argument("--iterations", type=int, default=None,
                        help="bench iterations of the library's calibration run (default: the library's)")
    parser.add_argument("--sync-steps", type=int, default=None,
                        help="sync floor steps of the library's calibration run (default: the library's)")
    args = parser.parse_args()

    from persistrnn import runtime
    from persistrnn.plan import model

    arch = args.arch or runtime.device_facts().arch
    programs = model.bench_programs()[: args.programs]
    workers = min(len(programs), os.cpu_count() or 1)
    print(f"NVRTC {runtime.nvrtc_version()}, {os.cpu_count()} CPUs, {len(programs)} programs for {arch}")
    rows = []

    _fresh_cache()
    serial = [_compile_one((p, arch)) for p in programs[:4]]
    rows.append((f"one after another ({len(serial)} programs)", sum(serial), sum(serial) / len(serial)))

    _fresh_cache()
    started = time.perf_counter()
    runtime.map_in_threads(lambda p: model.bench_binary(p, arch=arch), programs)
    wall = time.perf_counter() - started
    rows.append((f"{workers} threads ({len(programs)} programs)", wall, wall / len(programs)))

    _fresh_cache()
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_compile_one, [(p, arch) for p in programs]))
    wall = time.perf_counter() - started
    rows.append((f"{workers} processes ({len(programs)} programs, pool start included)", wall,
                 wall / len(programs)))

    print(f"{'way':<60} {'wall s':>8} {'s per program':>14}")
    for way, wall, per in rows:
        print(f"{way:<60} {wall:8.2f} {per:14.3f}")

    if args.no_calibration:
        return
    _fresh_cache()
    started = time.perf_counter()
    sync, programs = model.compile_calibration()
    built = {p: f.result() for p, f in programs.items()}
    print(f"calibration's compiles alone: {time.perf_counter() - started:.2f} s")
    runs = {}
    default = (model.BENCH_ITERATIONS, model.SYNC_STEPS)
    for label, (iterations, sync_steps) in (("defaults", default), ("defaults again", default),
                                            ("half the iterations", (default[0] // 2, default[1] // 2))):
        model.BENCH_ITERATIONS, model.SYNC_STEPS = iterations, sync_steps
        started = time.perf_counter()
        tables = model._measure_sync(sync)
        sync_s = time.perf_counter() - started
        started = time.perf_counter()
        tables.update(model._measure_micro({p: _done(b) for p, b in built.items()}, progress=False))
        print(f"from built binaries, {label} ({iterations} bench iterations, {sync_steps} sync steps): "
              f"sync floors {sync_s:.2f} s, micro-benchmarks {time.perf_counter() - started:.2f} s")
        runs[label] = tables
    model.BENCH_ITERATIONS, model.SYNC_STEPS = args.iterations or default[0], args.sync_steps or default[1]
    _fresh_cache()
    started = time.perf_counter()
    runs["the library's, compiling beside"] = dataclasses.asdict(model.measure_calibration(progress=False))
    print(f"the library's calibration ({model.BENCH_ITERATIONS} bench iterations, {model.SYNC_STEPS} sync steps, "
          f"compiling while it times), fresh cache: {time.perf_counter() - started:.2f} s")
    print(f"{'tables against the defaults':<44} {'entries':>8} {'median |a/b-1|':>15} {'p90':>8} {'max':>8}")
    base = runs.pop("defaults")
    for name, tables in runs.items():
        ratios = sorted(abs(tables[t][k] / base[t][k] - 1) for t in base if isinstance(base[t], dict)
                        for k in base[t] if k in tables.get(t, {}) and base[t][k])
        print(f"{name:<44} {len(ratios):8d} {ratios[len(ratios) // 2]:15.3f} {ratios[int(0.9 * len(ratios))]:8.3f} "
              f"{ratios[-1]:8.3f}")
    # What the planner would do with each: the cost model's top 5 (the
    # configurations the tuner times) for a few shapes, against the defaults'.
    from persistrnn.plan import tuner

    facts = runtime.device_facts()
    meta = {"device": facts.name, "sm_count": facts.sm_count, "version": "probe", "clock_mhz": 1980.0}
    shapes = [(tuner.ModelShape("lstm", 256, 256), 1), (tuner.ModelShape("lstm", 256, 256), 8),
              (tuner.ModelShape("gru", 64, 64), 1), (tuner.ModelShape("lstm", 1024, 1024), 1),
              (tuner.ModelShape("lstm", 256, 256, dtype="bfloat16"), 8),
              (tuner.ModelShape("lstm", 128, 128, num_layers=3), 10)]

    def top5(tables: dict, shape: tuner.ModelShape, batch: int) -> list:
        costs = model.CostModel(model.Calibration(**{**tables, **meta}), facts)
        return [(r.config, r.batch_slice) for r in tuner.ranked_configs(shape, batch, costs)[:5]]

    print("the cost model's top 5 under each calibration: how many of the defaults' top 5 it keeps")
    for name, tables in runs.items():
        kept = [len(set(top5(tables, s, b)) & set(top5(base, s, b))) for s, b in shapes]
        print(f"  {name:<44} " + ", ".join(f"{s.cell} {s.hidden_size} {s.dtype} x{s.num_layers} b{b}: {k}/5"
                                          for (s, b), k in zip(shapes, kept)))
    if args.first_calls:
        first_calls()


FIRST_CALLS = """
import logging, os, time, torch, persistrnn
if os.environ.get("FIRST_CALLS_LOG"):  # every compile and tuning step, ms since the process started
    logging.basicConfig(format="  [%(relativeCreated)6.0f ms %(threadName)s] %(message)s")
    logging.getLogger("persistrnn").setLevel(os.environ["FIRST_CALLS_LOG"])
print("persistrnn from", os.path.dirname(persistrnn.__file__))
for cell, size, batch in (("LSTM", 256, 1), ("GRU", 512, 4), ("LSTM", 128, 8)):
    model = getattr(persistrnn, cell)(size, size).cuda()
    x = torch.randn(100, batch, size, device="cuda")
    started = time.perf_counter()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    print(f"first call of persistrnn.{cell}({size}, {size}) at batch {batch}: {time.perf_counter() - started:.2f} s"
          f" (plan: {model.plan_for(batch).path})")
"""


def first_calls() -> None:
    """A new process on an empty cache: its first call calibrates and tunes,
    the next new shapes only tune."""
    env = {**os.environ, "PERSISTRNN_CACHE_DIR": tempfile.mkdtemp(prefix="prnn-first-")}
    subprocess.run([sys.executable, "-c", FIRST_CALLS], env=env, check=True)


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


if __name__ == "__main__":
    main()
