"""Host time per call, measured on its own: ``python -m persistrnn bench host``.

For every case of the grnn-table and real-models suites (the cases come from
their one definition, :func:`.compare.suite_cases`), in one process:

* **host µs**: the host time of one eager call of the persistrnn module:
  ``time.perf_counter`` around ``host_calls`` calls back to back, with no wait
  for the GPU inside, divided by the count; the median of ``repeats`` such
  timings. Each timing starts with the GPU idle, and a call queues a few
  operations only (copy in, one graph launch, one copy out), so the launch
  queue never fills and the host never waits for the device in the loop.
* **eager ms**: the same call timed with CUDA events, ``calls`` calls back to
  back (the median of ``repeats``): what a caller sees, the larger of the host
  and the device time when one of them dominates.
* **graph ms**: the device time of one call replayed from a CUDA graph of the
  module's forward (one graph per rotated input).
* **torch eager ms**: the ``torch.nn`` module (cuDNN, torch's own settings)
  timed as the eager call.

Every case first runs the module once (planning or reading its plan, and
capturing its forward), compares its output with the float64 reference
(``--no-refcheck`` skips that) and warms the GPU up to steady clocks. Inputs
rotate among ``buffers`` tensors, so that the L2 cache does not flatter small
models.

Each case is judged against two targets (data in :mod:`.targets`): the eager
call costs at most its graph device time + 25 µs, and it is no slower than
torch's eager call.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

from . import compare, targets
from .compare import DTYPE_NAMES, Case, Row
from .environment import add_result_arguments, run_or_load

CASE_SUITES = ("grnn-table", "real-models")
"""The suites whose cases this suite runs."""
AXES = tuple(dict.fromkeys(a for name in CASE_SUITES for a in compare.SUITES[name].axes))
"""CLI axes; each narrows the suites that take it (``--hidden`` only the grnn-table)."""


@dataclasses.dataclass
class Settings:
    calls: int = 20  # calls per CUDA-event timing
    host_calls: int = 50  # calls per host timing
    repeats: int = 5
    warmup: int = 3
    buffers: int = 4
    refcheck: bool = True


@dataclasses.dataclass
class HostRow(Row):
    """A provider on one case; ``host_us``: host time per eager call (ours only)."""

    host_us: float | None = None


def host_targets() -> tuple[targets.Target, targets.Target]:
    """(eager ≤ graph + 25 µs, eager ≤ torch eager): the targets this suite measures."""
    mine = [t for t in targets.TARGETS if "host" in t.suites]
    assert len(mine) == 2, [t.text for t in mine]
    return mine[0], mine[1]


def cases(suites: tuple[str, ...] = CASE_SUITES, **axes: Any) -> list[Case]:
    """The cases of ``suites``, each narrowed by the axes it takes."""
    return list(dict.fromkeys(c for name in suites for c in compare.suite_cases(name, **axes)))


def host_us(call: Callable[[Any], Any], inputs: list[Any], calls: int, repeats: int) -> float:
    """Median host µs per ``call(x)`` over ``calls`` back-to-back calls (inputs rotated)."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()  # an idle GPU: the loop below never waits for room in the launch queue
        t0 = time.perf_counter()
        for k in range(calls):
            call(inputs[k % len(inputs)])
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def run_case(case: Case, s: Settings) -> dict[str, Any]:
    import torch

    from .. import runtime

    theirs, ours = compare._modules(case)
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.hidden * 1000 + case.batch * 10 + case.layers)
    host = [torch.randn(case.steps, case.batch, case.input, generator=gen).to(dtype) for _ in range(s.buffers)]
    inputs = [h.to("cuda") for h in host]
    want = compare._reference(ours, host[0]) if s.refcheck else None
    timing = compare.Settings(calls=s.calls, repeats=s.repeats, warmup=s.warmup)
    rows: list[Row] = []

    def measured(label: str, module: Any, **extra: Any) -> HostRow:
        out = module(inputs[0])[0]  # the first call plans, captures and compiles: kept out of the timings
        error = compare._rel(out, want) if want is not None else None
        runtime.warm_up(lambda: module(inputs[0]))
        eager, graph = compare._gpu_times(module, inputs, timing)
        return HostRow(label, ms=eager, graph_ms=graph, rel_error=error, **extra)

    with torch.no_grad():
        def ours_row() -> HostRow:
            row = measured("persistrnn", ours, plan=ours.plan_for(case.batch).for_steps(case.steps).path)
            row.host_us = host_us(ours, inputs, s.host_calls, s.repeats)
            return row

        rows.append(compare._guard("persistrnn", ours_row))
        if theirs is None:
            rows.append(HostRow("cudnn", "no peer", note=f"torch has no {compare.CELL_NAMES[case.cell]}"))
        else:
            tf32 = "allowed" if runtime.cudnn_rnn_precision() == "tf32" else "off"
            rows.append(compare._guard("cudnn", lambda: measured("cudnn", theirs,
                                                                 note=f"torch's settings: TF32 {tf32}")))
    return {**dataclasses.asdict(case), "rows": [dataclasses.asdict(r) for r in rows]}


def run(case_list: list[Case], s: Settings | None = None, progress: bool = True,
        after_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every case; ``after_case(result so far)`` runs after each (a long run interrupted keeps what it measured)."""
    from ..progress import track
    from .environment import environment

    s = s or Settings()
    result: dict[str, Any] = {"suite": "host", "environment": environment(), "settings": dataclasses.asdict(s),
                              "cases": []}
    for case in track(case_list, progress, "host time"):
        result["cases"].append(run_case(case, s))
        if after_case:
            after_case(result)
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _verdict(target: targets.Target, case: dict[str, Any]) -> str:
    return targets.judge(target, case)[0] if targets._applies(target, case) else "—"


def format_table(result: dict[str, Any]) -> str:
    """One line per case: our eager, graph and host times, torch's eager time, and both targets."""
    overhead, versus_torch = host_targets()
    limit = f"{targets.EAGER_OVER_GRAPH_US:.0f}"
    lines = [f"| model | dtype | T | batch | plan | eager ms | graph ms | host µs | eager − graph µs | bound by "
             f"| torch eager ms | eager ≤ graph + {limit} µs | eager ≤ torch eager | rel. error |",
             "|" + "---|" * 14]
    for case in result["cases"]:
        rows = compare.providers(case)
        ours, theirs = rows["persistrnn"], rows.get("cudnn", {})
        head = f"| {case['model']} | {DTYPE_NAMES[case['dtype']]} | {case['steps']} | {case['batch']} "
        if ours["status"] != "ok":
            lines.append(head + f"| {ours['status']}: {ours['note']} |" + " |" * 9)
            continue
        gap = (ours["ms"] - ours["graph_ms"]) * 1e3
        host = ours.get("host_us")
        bound = "—" if host is None else ("host" if host > ours["graph_ms"] * 1e3 else "device")
        torch_ms = _fmt(theirs.get("ms")) if theirs.get("status") == "ok" else theirs.get("status", "—")
        lines.append(head + f"| {ours['plan']} | {_fmt(ours['ms'])} | {_fmt(ours['graph_ms'])} | {_fmt(host, 1)} "
                     f"| {gap:+.1f} | {bound} | {torch_ms} | {_verdict(overhead, case)} "
                     f"| {_verdict(versus_torch, case)} | {compare._sci(ours['rel_error'])} |")
    failed = sorted({f"{r['provider']}: {r['status']} ({r['note']})" for c in result["cases"] for r in c["rows"]
                     if r["status"] == "failed" and r["provider"] != "persistrnn"})
    notes = ["", "bound by: host where the host time of a call exceeds its graph device time (a call timed back "
             "to back cannot be faster than its host time), else device. torch runs with its own settings "
             "(TF32 for cuDNN as torch allows it)."]
    if failed:
        notes.append("Not timed: " + "; ".join(failed) + ".")
    return "\n".join(lines + notes)


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    s = result["settings"]
    method = (f"- Method: host µs = perf_counter over {s['host_calls']} eager calls back to back, no GPU wait "
              f"inside, per call; eager and graph ms = CUDA events over {s['calls']} calls back to back; each the "
              f"median of {s['repeats']} timings, after {s['warmup']} warm-up calls and a warm-up to steady clocks, "
              f"inputs rotated among {s['buffers']} buffers.")
    return (f"# Host time per call (`python -m persistrnn bench host`)\n\n{describe(result['environment'])}\n"
            f"{method}\n\n{format_table(result)}\n\n## Speed targets in this run\n\n"
            f"{targets.format_targets([result])}\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m persistrnn bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", nargs="+", choices=CASE_SUITES, default=list(CASE_SUITES),
                   help="whose cases to run (default: both)")
    for axis in AXES:
        takers = ", ".join(n for n in CASE_SUITES if axis in compare.SUITES[n].axes)
        p.add_argument(f"--{axis}", **compare._AXES[axis], help=f"replaces the {axis} of: {takers}")
    p.add_argument("--calls", type=int, default=Settings.calls, help="calls per CUDA-event timing")
    p.add_argument("--host-calls", type=int, default=Settings.host_calls, help="calls per host timing")
    p.add_argument("--repeats", type=int, default=Settings.repeats)
    p.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    add_result_arguments(p)
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = parser()
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error(f"--repeats: the method takes the median of at least 5 timings, got {args.repeats}")
    for name in ("calls", "host_calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    for axis in ("hidden", "batch", "steps"):
        values = getattr(args, axis, None) or []
        if any(v < 1 for v in values):
            p.error(f"--{axis}: expected positive integers, got {values}")
    return args, p


def main(argv: list[str] | None = None) -> int:
    args, p = parse(argv)
    settings = Settings(calls=args.calls, host_calls=args.host_calls, repeats=args.repeats, refcheck=args.refcheck)
    result = run_or_load(args, p, "host", lambda save: run(
        cases(tuple(args.suites), **{a: getattr(args, a) for a in AXES}), settings, progress=args.progress,
        after_case=save))
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(format_table(result))
    return 0
