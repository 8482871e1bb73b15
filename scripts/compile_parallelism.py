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
    built = {p: f.result() for p, f in model.compile_bench_programs().items()}
    print(f"calibration's compiles alone: {time.perf_counter() - started:.2f} s")
    quiet = []
    for _ in range(2):
        started = time.perf_counter()
        tables = model._measure_sync()
        sync = time.perf_counter() - started
        started = time.perf_counter()
        tables.update(model._measure_micro({p: _done(b) for p, b in built.items()}, progress=False))
        print(f"from built binaries: sync floors {sync:.2f} s, micro-benchmarks {time.perf_counter() - started:.2f} s")
        quiet.append(tables)
    _fresh_cache()
    started = time.perf_counter()
    pipelined = model.measure_calibration(progress=False)
    print(f"the library's calibration (compiling while it times), fresh cache: {time.perf_counter() - started:.2f} s")
    print(f"{'tables':<28} {'entries':>8} {'median |a/b-1|':>15} {'p90':>8} {'max':>8}")
    for name, a, b in (("quiet vs quiet", quiet[0], quiet[1]),
                       ("quiet vs compiling beside", quiet[0], dataclasses.asdict(pipelined))):
        ratios = sorted(abs(a[t][k] / b[t][k] - 1) for t in a for k in a[t]
                        if isinstance(a[t], dict) and k in b.get(t, {}) and b[t][k])
        print(f"{name:<28} {len(ratios):8d} {ratios[len(ratios) // 2]:15.3f} {ratios[int(0.9 * len(ratios))]:8.3f} "
              f"{ratios[-1]:8.3f}")


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


if __name__ == "__main__":
    main()
