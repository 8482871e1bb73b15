"""``torch.compile`` of persistrnn modules: ``python -m persistrnn bench compile``.

Per case, in one process and under ``torch.no_grad()``, the same weights run
five ways:

* ``persistrnn``: the eager module;
* ``persistrnn compiled``: ``torch.compile(model, fullgraph=True)``, the
  default mode (one ``torch.ops.persistrnn.forward`` in the graph; fullgraph
  makes a graph break an error rather than a silent slow path);
* ``persistrnn compiled (reduce-overhead)``: the same with
  ``mode="reduce-overhead"`` (inductor's CUDA graphs around the model);
* ``torch.nn``: torch's eager module (cuDNN, torch's own settings);
* ``torch.nn compiled``: ``torch.compile`` of torch's module, default mode
  (graph breaks allowed: how dynamo treats torch's RNN modules is torch's
  business, and the row notes how many there were).

Beside the times, the host time per call (back to back, no wait for the
GPU) of the eager and compiled persistrnn module, and of ``torch.compile``'s
default mode around one pointwise op (``x + 1`` on the same input): what a
compiled call costs the host before any work of ours, on this machine and in
this process. Where the compiled module's host time exceeds the eager call's
device time, the compiled call is host-bound (perf-notes §60, §72).

Dynamo traces RNN modules only with ``torch._dynamo.config.allow_rnn``
(persistrnn modules are ``torch.nn.RNNBase`` subclasses), so every call runs
with it set, as the operator tests do. Every compiled variant is compiled
from a fresh dynamo state.

Method. Before any timing, each variant's output is compared with the
float64 reference of the same weights: the first (compiling) call's output,
and one after the warm-up calls, which for reduce-overhead is a CUDA-graph
replay. A variant further than :data:`CHECK_TOLERANCE` from it is reported
failed and not timed. Times are ms per call: CUDA events around ``calls``
calls back to back, the median of ``repeats`` timings after a warm-up to
steady clocks, inputs rotated among ``buffers`` tensors. The first call's
time (compiling included) is kept in the row.

The target (data in :mod:`.targets`): compiled in the default mode, at most
1.1x the eager persistrnn module's time and no slower than eager torch.nn.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Callable

from . import compare, host, targets
from .compare import Case, Row
from .environment import add_result_arguments, run_or_load

CASES = {
    "lstm-2x128-b1": Case("2-layer LSTM 128", "lstm", 128, 128, 2, False, "float32", 50, 1),
    "lstm-2x128-b8": Case("2-layer LSTM 128", "lstm", 128, 128, 2, False, "float32", 50, 8),
    "gru-256-b1": Case("GRU 256", "gru", 256, 256, 1, False, "float32", 100, 1),
}
"""The issue's case (2-layer LSTM 128, T=50, batch 1), a batch, and another cell and size."""

EAGER, COMPILED, REDUCE_OVERHEAD = "persistrnn", "persistrnn compiled", "persistrnn compiled (reduce-overhead)"
TORCH, TORCH_COMPILED = "torch.nn", "torch.nn compiled"
COMPILE_FLOOR = "torch.compile of x + 1"
PROVIDERS = (EAGER, COMPILED, REDUCE_OVERHEAD, TORCH, TORCH_COMPILED, COMPILE_FLOOR)
HOST_TIMED = (EAGER, COMPILED)
"""The variants whose host time per call is measured too."""

CHECK_TOLERANCE = 1e-2
"""Largest relative error against float64 a variant may have and be timed.
cuDNN with TF32 (torch's default) errs by ~1e-3 and the fp32 paths by ~1e-6;
a variant that returns another call's output or stale graph memory errs by ~1."""


@dataclasses.dataclass
class Settings:
    calls: int = 20
    repeats: int = 5
    warmup: int = 3
    buffers: int = 4
    host_calls: int = 100  # calls per host timing (back to back, no wait for the GPU), median of ``repeats``
    torch_compile: bool = True  # compile torch.nn too (inductor unrolls the recurrence: tens of seconds)


@dataclasses.dataclass
class CompileRow(Row):
    """A variant on one case; ``host_us``: host µs per call (:data:`HOST_TIMED` and :data:`COMPILE_FLOOR`)."""

    host_us: float | None = None


def _counters() -> tuple[int, int]:
    """(cudagraph skips, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)), sum(counters["graph_break"].values())


def _variant(label: str, make: Callable[[], Any], inputs: list[Any], want: Any, s: Settings,
             **extra: Any) -> Row:
    """Build (compile) a variant, check it against float64, time it."""
    import torch

    from .. import runtime
    from .timing import time_cuda_ms

    torch._dynamo.reset()  # every compiled variant starts from a fresh dynamo (and CUDA-graph) state
    skips, breaks = _counters()
    model = make()
    t0 = time.perf_counter()
    out = model(inputs[0])[0]
    errors = [compare._rel(out, want)]  # read before the next call: a CUDA-graph output is overwritten then
    first_s = time.perf_counter() - t0
    for k in range(s.warmup):
        model(inputs[k % len(inputs)])
    errors.append(compare._rel(model(inputs[0])[0], want))
    notes = []
    skips, breaks = (now - before for now, before in zip(_counters(), (skips, breaks)))
    if skips:
        notes.append(f"inductor skipped CUDA graphs {skips} time(s)")
    if breaks:
        notes.append(f"{breaks} graph break(s)")
    if max(errors) > CHECK_TOLERANCE:
        return CompileRow(label, "failed", rel_error=max(errors), first_call_s=first_s,
                   note="; ".join([f"output differs from float64 (rel. error {max(errors):.1e}): not timed"] + notes))
    k = iter(range(10**9))

    def many() -> None:
        for _ in range(s.calls):
            model(inputs[next(k) % len(inputs)])

    runtime.warm_up(many)
    ms = time_cuda_ms(many, warmup=1, repeats=s.repeats) / s.calls
    host_us = host.host_us(model, inputs, s.host_calls, s.repeats) if label in HOST_TIMED else None
    # The first call's time is the compile time for a compiled variant; an
    # eager one's (planning, capturing) belongs to the other suites.
    return CompileRow(label, ms=ms, rel_error=max(errors), first_call_s=first_s if label in (COMPILED, REDUCE_OVERHEAD)
                      else None, note="; ".join(notes), host_us=host_us, **extra)


def _compile_floor(inputs: list[Any], s: Settings) -> CompileRow:
    """Host µs per call of ``torch.compile(lambda x: x + 1)`` (default mode)
    on the case's inputs: torch.compile's own per-call path around one
    kernel, which a compiled module's call pays before any work of ours."""
    import torch

    torch._dynamo.reset()
    plus_one = torch.compile(lambda x: x + 1, fullgraph=True)
    error = max((plus_one(x) - (x + 1)).abs().max().item() for x in inputs)
    if error:
        return CompileRow(COMPILE_FLOOR, "failed", note=f"x + 1 differs from eager by {error:.1e}: not timed")
    return CompileRow(COMPILE_FLOOR, host_us=host.host_us(plus_one, inputs, s.host_calls, s.repeats))


def run_case(case: Case, s: Settings) -> dict[str, Any]:
    import torch

    theirs, ours = compare._modules(case)
    gen = torch.Generator().manual_seed(case.hidden * 1000 + case.batch * 10 + case.layers)
    host = [torch.randn(case.steps, case.batch, case.input, generator=gen) for _ in range(s.buffers)]
    inputs = [h.to("cuda") for h in host]
    want = compare._reference(theirs, host[0])
    plan = ours.plan_for(case.batch).for_steps(case.steps).path
    variants: list[tuple[str, Callable[[], Any], dict[str, Any]]] = [
        (EAGER, lambda: ours, {"plan": plan}),
        (COMPILED, lambda: torch.compile(ours, fullgraph=True), {"plan": plan}),
        (REDUCE_OVERHEAD, lambda: torch.compile(ours, mode="reduce-overhead", fullgraph=True), {"plan": plan}),
        (TORCH, lambda: theirs, {}),
    ]
    if s.torch_compile:
        variants.append((TORCH_COMPILED, lambda: torch.compile(theirs), {}))
    rows: list[Row] = []
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        for label, make, extra in variants:
            # A compile failure's first line names the cause (an operator rule, a graph break): keep it whole.
            rows.append(compare._guard(label, lambda label=label, make=make, extra=extra: _variant(
                label, make, inputs, want, s, **extra), limit=600))
    if not s.torch_compile:
        rows.append(Row(TORCH_COMPILED, "not run", note="--no-torch-compile"))
    rows.append(compare._guard(COMPILE_FLOOR, lambda: _compile_floor(inputs, s), limit=600))
    torch._dynamo.reset()
    return {**dataclasses.asdict(case), "rows": [dataclasses.asdict(r) for r in rows]}


def run(keys: list[str], s: Settings | None = None, progress: bool = True,
        after_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    from ..progress import track
    from .environment import environment

    from .. import runtime

    s = s or Settings()
    result: dict[str, Any] = {"suite": "compile", "environment": environment(), "settings": dataclasses.asdict(s),
                              "torch_settings": {"cudnn_allow_tf32": runtime.cudnn_rnn_precision() == "tf32",
                                                 "matmul_allow_tf32": runtime.matmul_allows_tf32()},
                              "cases": []}
    for key in track(keys, progress, "torch.compile"):
        result["cases"].append({"key": key, **run_case(CASES[key], s)})
        if after_case:
            after_case(result)
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def _ms(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    if row["status"] != "ok":
        return row["status"]
    return "—" if row["ms"] is None else f"{row['ms']:.4f}"


def _host_us(row: dict[str, Any] | None) -> str:
    return "—" if row is None or row.get("host_us") is None else f"{row['host_us']:.0f}"


def _over(rows: dict[str, dict[str, Any]], label: str, base: str = EAGER) -> str:
    a, b = rows.get(label), rows.get(base)
    if not a or not b or a.get("ms") is None or b.get("ms") is None or a["status"] != "ok" or b["status"] != "ok":
        return "—"
    return f"{a['ms'] / b['ms']:.2f}×"


def format_table(result: dict[str, Any]) -> str:
    """One line per case: ms per call of each variant, and compiled over eager persistrnn."""
    lines = ["| model | T | batch | plan | persistrnn eager ms | compiled ms | compiled / eager | reduce-overhead ms "
             "| reduce-overhead / eager | torch.nn eager ms | torch.nn compiled ms | compiled / torch.nn eager "
             "| largest rel. error | compile s (default, reduce-overhead) | host µs per call: eager / compiled "
             "/ compiled x + 1 |",
             "|" + "---|" * 15]
    for case in result["cases"]:
        rows = compare.providers(case)
        errors = [r["rel_error"] for r in rows.values() if r.get("rel_error") is not None]
        compile_s = " / ".join("—" if rows.get(p, {}).get("first_call_s") is None
                               else f"{rows[p]['first_call_s']:.1f}" for p in (COMPILED, REDUCE_OVERHEAD))
        plan = rows.get(EAGER, {}).get("plan") or "—"
        host_us = " / ".join(_host_us(rows.get(p)) for p in (*HOST_TIMED, COMPILE_FLOOR))
        lines.append(f"| {case['model']} | {case['steps']} | {case['batch']} | {plan} | {_ms(rows.get(EAGER))} "
                     f"| {_ms(rows.get(COMPILED))} | {_over(rows, COMPILED)} | {_ms(rows.get(REDUCE_OVERHEAD))} "
                     f"| {_over(rows, REDUCE_OVERHEAD)} | {_ms(rows.get(TORCH))} | {_ms(rows.get(TORCH_COMPILED))} "
                     f"| {_over(rows, COMPILED, TORCH)} | {compare._sci(max(errors, default=None))} | {compile_s} "
                     f"| {host_us} |")
    notes = sorted({f"{c['model']} batch {c['batch']}, {r['provider']}: {r['status']}" + (f" ({r['note']})" if r["note"]
                                                                                         else "")
                    for c in result["cases"] for r in c["rows"] if r["status"] != "ok" or r["note"]})
    out = ["", f"The {targets.COMPILED_OVER_EAGER}× target is on compiled / eager (default mode); "
           "compiled / torch.nn eager must be at most 1."]
    if notes:
        out.append("Notes: " + "; ".join(notes) + ".")
    return "\n".join(lines + out)


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    s = result["settings"]
    method = (f"- Method: ms per call = CUDA events around {s['calls']} calls back to back, the median of "
              f"{s['repeats']} timings after {s['warmup']} warm-up calls and a warm-up to steady clocks, inputs "
              f"rotated among {s['buffers']} buffers; under torch.no_grad() with "
              "torch._dynamo.config.allow_rnn; every output checked against float64 before timing.")
    if "host_calls" in s:
        method += (f" Host µs per call: {s['host_calls']} calls back to back from an idle GPU, the median of "
                   f"{s['repeats']}; `compiled x + 1` is torch.compile (default mode) of one pointwise op on the "
                   "same input, torch.compile's own per-call path.")
    tf32 = result.get("torch_settings")
    if tf32:
        method += (f" torch's settings: TF32 {'allowed' if tf32['cudnn_allow_tf32'] else 'off'} in cuDNN, "
                   f"{'allowed' if tf32['matmul_allow_tf32'] else 'off'} in matmuls.")
    return (f"# torch.compile (`python -m persistrnn bench compile`)\n\n{describe(result['environment'])}\n{method}"
            f"\n\n{format_table(result)}\n\n## Speed targets in this run\n\n{targets.format_targets([result])}\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m persistrnn bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="default: all")
    p.add_argument("--calls", type=int, default=Settings.calls, help="calls per CUDA-event timing")
    p.add_argument("--repeats", type=int, default=Settings.repeats)
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                   help="do not compile torch.nn (the slowest part: inductor unrolls the recurrence)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    add_result_arguments(p)
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = parser()
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error(f"--repeats: the method takes the median of at least 5 timings, got {args.repeats}")
    if args.calls < 1:
        p.error(f"--calls: expected a positive integer, got {args.calls}")
    return args, p


def main(argv: list[str] | None = None) -> int:
    args, p = parse(argv)
    settings = Settings(calls=args.calls, repeats=args.repeats, torch_compile=args.torch_compile)
    result = run_or_load(args, p, "compile",
                         lambda save: run(list(args.cases), settings, progress=args.progress, after_case=save))
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(format_table(result))
    return 0
