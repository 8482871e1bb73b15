"""persistrnn beside its peers: ``python -m persistrnn bench <suite>``.

Suites (each case: cell, input and hidden size, layers, direction, dtype, T, batch):

* ``grnn-table``: GRNN's Table 1. LSTM, GRU (torch's reset-after form, which
  cuDNN runs) and the canonical reset-before GRU (which only ONNX Runtime
  runs among the peers), H in {64, 256, 1024} x batch in {1, 10, 20}, T = 100,
  input = H, one layer, fp32.
* ``real-models``: char-RNN (3-layer LSTM 128, T = 100) and text
  classification (2-layer LSTM 256, T = 20) at batch 1, 5, 10, 20, 40; the
  bidirectional 2-layer LSTM 256 at batch 8; and streaming (LSTM 128, one
  step per call) through a session against torch fed its own states.
* ``scaling``: LSTM at H = 256 and 1024, latency against batch (1 to 64, T = 100)
  and against T (1 to 1000, batch 1).
* ``dtypes``: LSTM and GRU in fp32, fp16 and bf16, H in {64, 256, 1024} x batch
  in {1, 8, 10, 16, 20}. At batch 8 and 16 in fp16, torch picks cuDNN's
  persistent kernel, the strongest peer in half precision.

Providers, in one process, every one reported (a provider that is absent or
fails is a row that says so, never a dropped one):

* ``persistrnn``: this package's module, tuned on first use (the first
  call's time, tuning and compiling included, is kept in the row), called
  eagerly and replayed from a CUDA graph;
* ``cudnn``: the ``torch.nn`` module on the GPU, eager and graph-replayed; in
  fp32 twice, with TF32 allowed (torch's default) and not allowed, labelled;
* ``torch-cpu``: the ``torch.nn`` module on the CPU with every core (fp32 cases);
* ``onnxruntime-cpu``: the same weights in ONNX's LSTM/GRU operators on ONNX
  Runtime's CPU provider with every core (fp32 cases; see :mod:`.onnx_peer`);
* ``flashrnn``: reported absent when it is not installed.

Method. GPU times are CUDA-event timings after warm-up, the median of
``repeats`` (at least 5) timings of ``calls`` calls, over inputs rotated
among ``buffers`` distinct tensors (one captured graph per buffer). CPU times
are ``time.perf_counter`` medians. The end-to-end variant (GRNN's table timed
the copies too) copies the input from pinned host memory to the GPU and the
output back inside the timed call. Before any timing, every provider's output
is compared with the float64 reference (``--no-refcheck`` skips that) and the
relative error is kept beside its times. Ratios are a peer's time over ours:
above 1, ours is faster.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import io
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from ..runtime import capture_graph
from .timing import time_cuda_ms
from .environment import load_result

CELL_NAMES = {"lstm": "LSTM", "gru": "GRU", "gru_reset_before": "GRU (reset-before)", "rnn_tanh": "RNN (tanh)",
              "rnn_relu": "RNN (relu)"}
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One model shape at one batch size and sequence length."""

    model: str  # what the table calls it: "LSTM 256", "char-RNN"
    cell: str
    input: int
    hidden: int
    layers: int
    bidirectional: bool
    dtype: str
    steps: int
    batch: int


@dataclasses.dataclass
class Settings:
    calls: int = 5
    repeats: int = 5
    warmup: int = 3
    buffers: int = 4
    cpu_repeats: int = 3
    refcheck: bool = True
    end_to_end: bool = True
    # torch's fp32 matmul precision for the run: "high" lets fp32 layers run TF32 tensor cores in our kernels
    # (and cuBLAS's input projections), the peer of cuDNN's "TF32 allowed" setting
    matmul_precision: str = "highest"


@dataclasses.dataclass
class Row:
    """One provider on one case: times in ms (None: not measured) and why not."""

    provider: str
    status: str = "ok"  # ok, absent, not run, failed, no peer
    ms: float | None = None
    graph_ms: float | None = None
    end_to_end_ms: float | None = None
    rel_error: float | None = None
    first_call_s: float | None = None
    tuned: bool | None = None  # whether the first call tuned (True) or found its plan in the cache
    plan: str = ""
    plan_label: str = ""  # the configuration the plan runs (the tuner's label), so a run says what it timed
    note: str = ""


# ----------------------------------------------------------------------------
# Suites
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LatencyPlot:
    """Latency against ``x`` ("batch" or "steps") for the cases whose fields
    equal ``fixed``; one panel per value of the ``panel`` fields, one line per
    provider and value of ``series``."""

    x: str
    panel: tuple[str, ...]
    series: str | None = None
    fixed: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    title: str
    build: Callable[..., list[Case]]
    """``build(**axes)``: the cases, with the CLI's axes overriding the defaults."""
    axes: tuple[str, ...]
    """The CLI options this suite takes (cells, hidden, batch, steps, dtypes)."""
    plots: tuple[LatencyPlot, ...]
    streaming: bool = False


def _grid(cells, hidden, batch, dtypes, steps) -> list[Case]:
    """One-layer models with input = hidden, over every combination."""
    return [Case(f"{CELL_NAMES[c]} {h}", c, h, h, 1, False, d, t, b)
            for c in cells for d in dtypes for h in hidden for t in steps for b in batch]


def _grnn_table(cells=("lstm", "gru", "gru_reset_before"), hidden=(64, 256, 1024), batch=(1, 10, 20),
                steps=(100,)) -> list[Case]:
    return _grid(cells, hidden, batch, ("float32",), steps)


def _dtypes(cells=("lstm", "gru"), hidden=(64, 256, 1024), batch=(1, 8, 10, 16, 20),
            dtypes=("float32", "float16", "bfloat16")) -> list[Case]:
    return _grid(cells, hidden, batch, dtypes, (100,))


def _scaling(hidden=(256, 1024), batch=(1, 2, 4, 8, 16, 32, 64), steps=(1, 10, 100, 1000)) -> list[Case]:
    """A batch sweep at T = 100 and a T sweep at batch 1 (their shared case once)."""
    cases = _grid(("lstm",), hidden, batch, ("float32",), (100,)) + _grid(("lstm",), hidden, (1,), ("float32",), steps)
    return list(dict.fromkeys(cases))


def _real_models(batch=(1, 5, 10, 20, 40)) -> list[Case]:
    return ([Case("char-RNN", "lstm", 128, 128, 3, False, "float32", 100, b) for b in batch]
            + [Case("text classification", "lstm", 256, 256, 2, False, "float32", 20, b) for b in batch]
            + [Case("bidirectional", "lstm", 256, 256, 2, True, "float32", 100, 8)])


SUITES = {s.name: s for s in (
    Suite("grnn-table", "GRNN's Table 1 on this GPU", _grnn_table, ("cells", "hidden", "batch", "steps"),
          (LatencyPlot("batch", ("cell",), "hidden"),)),
    Suite("real-models", "Whole models against torch.nn", _real_models, ("batch",),
          (LatencyPlot("batch", ("model",), fixed=(("bidirectional", False),)),), streaming=True),
    Suite("scaling", "Latency against batch and sequence length", _scaling, ("hidden", "batch", "steps"),
          (LatencyPlot("batch", ("hidden",), fixed=(("steps", 100),)),
           LatencyPlot("steps", ("hidden",), fixed=(("batch", 1),)))),
    Suite("dtypes", "fp32, fp16 and bf16", _dtypes, ("cells", "hidden", "batch", "dtypes"),
          (LatencyPlot("batch", ("cell", "dtype"), "hidden"),)),
)}


def suite_cases(name: str, **axes: Any) -> list[Case]:
    """The cases of suite ``name``: the one definition every suite that runs
    them uses (this module's, and the host-time suite's). Of ``axes``, those
    the suite takes replace its defaults; the others, and None values, are
    ignored, so one set of CLI axes can narrow several suites at once."""
    suite = SUITES[name]
    return suite.build(**{a: tuple(v) for a, v in axes.items() if a in suite.axes and v is not None})


# ----------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------

def _modules(case: Case):
    """(torch module or None where torch has no such cell, our module): same
    weights, in the case's dtype, on the GPU."""
    import torch

    import persistrnn

    dtype = getattr(torch, case.dtype)
    torch.manual_seed(0)
    kwargs = dict(num_layers=case.layers, bidirectional=case.bidirectional)
    if case.cell == "gru_reset_before":
        ours = persistrnn.GRU(case.input, case.hidden, reset_after=False, **kwargs)
        return None, ours.to("cuda", dtype).eval()
    torch_class = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}
    if case.cell.startswith("rnn"):
        kwargs["nonlinearity"] = case.cell.removeprefix("rnn_")
    theirs = torch_class[case.cell](case.input, case.hidden, **kwargs).to("cuda", dtype).eval()
    return theirs, persistrnn.from_torch(theirs)


def _reference(module: Any, x: Any) -> Any:
    """The module's output in float64 on the CPU, from its own (rounded) weights."""
    import torch

    ref = copy.deepcopy(module).to("cpu", torch.float64)
    with torch.no_grad():
        return ref(x.to("cpu", torch.float64))[0]


def _rel(got: Any, want: Any) -> float:
    import torch

    got = torch.as_tensor(got).to("cpu", torch.float64)
    return float((got - want).norm() / want.norm())


def _gpu_times(fn: Callable[[Any], Any], inputs: list[Any], s: Settings) -> tuple[float, float]:
    """(eager ms, graph ms) per call, over rotated inputs."""
    k = iter(range(10**9))

    def eager() -> None:
        for _ in range(s.calls):
            fn(inputs[next(k) % len(inputs)])

    eager_ms = time_cuda_ms(eager, warmup=s.warmup, repeats=s.repeats) / s.calls
    # A graph replays fixed buffers: one graph per rotated input.
    graphs = [capture_graph(lambda x=x: fn(x)) for x in inputs]

    def replay() -> None:
        for _ in range(s.calls):
            graphs[next(k) % len(graphs)].replay()

    return eager_ms, time_cuda_ms(replay, warmup=s.warmup, repeats=s.repeats) / s.calls


def _end_to_end_ms(fn: Callable[[Any], Any], host_inputs: list[Any], s: Settings) -> float:
    """Host -> device copy of the input, the forward, device -> host copy of the output."""
    k = iter(range(10**9))

    def call() -> None:
        for _ in range(s.calls):
            fn(host_inputs[next(k) % len(host_inputs)].to("cuda", non_blocking=True)).to("cpu")

    return time_cuda_ms(call, warmup=s.warmup, repeats=s.repeats) / s.calls


def _cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _guard(provider: str, work: Callable[[], Row], limit: int = 160) -> Row:
    """``work()``, or a failed row whose note is the error's first line (``limit`` characters at most)."""
    try:
        return work()
    except Exception as exc:  # a failing provider is reported, not dropped
        first = (str(exc).splitlines() or [""])[0]
        return Row(provider, "failed", note=f"{type(exc).__name__}: {first[:limit]}")


def _all_cores(fn: Callable[[], Any]) -> Any:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def run_case(case: Case, s: Settings) -> dict[str, Any]:
    import torch

    from .. import runtime
    from ..reference import params_from_torch

    theirs, ours = _modules(case)
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.hidden * 1000 + case.batch * 10 + case.layers)
    host = [torch.randn(case.steps, case.batch, case.input, generator=gen).to(dtype).pin_memory()
            for _ in range(s.buffers)]
    inputs = [h.to("cuda") for h in host]
    want = _reference(ours, host[0]) if s.refcheck else None
    fp32 = case.dtype == "float32"
    rows: list[Row] = []

    def check(out: Any) -> float | None:
        return _rel(out, want) if want is not None else None

    def timed(label: str, fn: Callable[[Any], Any], **extra: Any) -> Row:
        out = fn(inputs[0])
        eager, graph = _gpu_times(fn, inputs, s)
        e2e = _end_to_end_ms(fn, host, s) if s.end_to_end else None
        return Row(label, ms=eager, graph_ms=graph, end_to_end_ms=e2e, rel_error=check(out), **extra)

    with torch.no_grad():
        def persistrnn_row() -> Row:
            t0 = time.perf_counter()
            ours(inputs[0])
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            chosen = ours.plan_for(case.batch).for_steps(case.steps)  # what a call of this length runs
            return timed("persistrnn", lambda x: ours(x)[0], first_call_s=first, tuned=chosen.source == "tuned",
                         plan=chosen.path, plan_label=chosen.label)

        rows.append(_guard("persistrnn", persistrnn_row))
        for tf32 in ((True, False) if fp32 else (None,)):
            label = "cudnn" if tf32 is None else f"cudnn (TF32 {'allowed' if tf32 else 'off'})"
            if theirs is None:
                rows.append(Row(label, "no peer", note=f"torch has no {CELL_NAMES[case.cell]}"))
                continue

            def cudnn_row(tf32: bool | None = tf32, label: str = label) -> Row:
                with runtime.cudnn_rnn_settings(enabled=torch.backends.cudnn.enabled, tf32=tf32):
                    return timed(label, lambda x: theirs(x)[0])

            rows.append(_guard(label, cudnn_row))

        def cpu_row() -> Row:
            cpu = copy.deepcopy(theirs if theirs is not None else ours).cpu()
            out = _all_cores(lambda: cpu(host[0])[0])
            ms = _all_cores(lambda: _cpu_ms(lambda: cpu(host[1]), s.cpu_repeats))
            return Row("torch-cpu", ms=ms, rel_error=check(out), note=f"{os.cpu_count()} threads")

        def onnx_row() -> Row:
            from . import onnx_peer

            sess = onnx_peer.session(case.cell, params_from_torch(ours), case.input, case.hidden)
            out = onnx_peer.run(sess, host[0].numpy())
            ms = _cpu_ms(lambda: onnx_peer.run(sess, host[1].numpy()), s.cpu_repeats)
            return Row("onnxruntime-cpu", ms=ms, rel_error=check(out), note=f"{os.cpu_count()} threads")

        for label, work, needs in (("torch-cpu", cpu_row, None), ("onnxruntime-cpu", onnx_row, "onnxruntime")):
            absent = _absent(needs, label) if needs else None
            if absent:
                rows.append(absent)
            elif not fp32:
                rows.append(Row(label, "not run", note="the CPU peers are timed in fp32 cases only"))
            else:
                rows.append(_guard(label, work))
    rows.append(_absent("flashrnn", "flashrnn")
                or Row("flashrnn", "not run", note="flashrnn is installed, but this suite does not drive it yet"))
    return {**dataclasses.asdict(case), "rows": [dataclasses.asdict(r) for r in rows]}


def _absent(module: str, label: str) -> Row | None:
    """An "absent" row when a peer's package is not installed, else None."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return Row(label, "absent", note=f"{module} is not installed")
    return None


def streaming_case(s: Settings, hidden: int = 128, steps: int = 200) -> dict[str, Any]:
    """One step per call at batch 1: our session against the torch module fed its own states."""
    import torch

    import persistrnn

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(hidden, hidden).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    xs = torch.randn(steps, 1, 1, hidden, device="cuda")
    with torch.no_grad():
        session = ours.stream(1)
        got = torch.cat([session(x) for x in xs[:10]])
        error = _rel(got.reshape(10, 1, hidden), _reference(theirs, xs[:10].reshape(10, 1, hidden)))
        session.reset()
        state = None
        k = iter(range(10**9))

        def ours_step() -> None:
            session(xs[next(k) % steps])

        def torch_step() -> None:
            nonlocal state
            _, state = theirs(xs[next(k) % steps], state)

        def per_call(fn: Callable[[], None]) -> float:
            def many() -> None:
                for _ in range(s.calls):
                    fn()

            return time_cuda_ms(many, warmup=s.warmup, repeats=s.repeats) / s.calls

        ours_ms, torch_ms = per_call(ours_step), per_call(torch_step)
    return {"model": f"streaming (LSTM {hidden}, 1 step per call)", "hidden": hidden, "batch": 1,
            "plan": ours.plan_for(1).for_steps(1).path, "ours_call_ms": ours_ms, "cudnn_call_ms": torch_ms,
            "rel_error": error}


def run(suite: Suite, cases: list[Case], s: Settings | None = None, progress: bool = True,
        after_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every case of ``suite``; ``after_case(result so far)`` runs after each, so
    that a long run interrupted part way keeps what it measured."""
    from .. import runtime
    from ..progress import track
    from .environment import environment

    s = s or Settings()
    result: dict[str, Any] = {"suite": suite.name, "environment": environment(), "settings": dataclasses.asdict(s),
                              "cases": []}
    with runtime.matmul_precision(s.matmul_precision):
        for case in track(cases, progress, suite.name):
            result["cases"].append(run_case(case, s))
            if after_case:
                after_case(result)
    if suite.streaming:
        result["streaming"] = streaming_case(s)
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _sci(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def ratio(peer: float | None, ours: float | None) -> float | None:
    """How many times faster ours is than the peer (peer time over ours)."""
    return None if peer is None or ours is None else peer / ours


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def providers(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["provider"]: r for r in case["rows"]}


def best_cudnn(case: dict[str, Any], key: str) -> float | None:
    """The faster cuDNN setting's time (TF32 allowed or off) for ``key``."""
    times = [r[key] for r in case["rows"] if r["provider"].startswith("cudnn") and r[key] is not None]
    return min(times, default=None)


def speedups(case: dict[str, Any]) -> dict[str, float | None]:
    """Each peer's time over ours: cuDNN's faster setting, graph and eager; the CPU peers against our eager time."""
    rows = providers(case)
    ours = rows["persistrnn"]
    return {"cuDNN graph": ratio(best_cudnn(case, "graph_ms"), ours["graph_ms"]),
            "cuDNN eager": ratio(best_cudnn(case, "ms"), ours["ms"]),
            "CPU": ratio(rows.get("torch-cpu", {}).get("ms"), ours["ms"]),
            "ONNX Runtime": ratio(rows.get("onnxruntime-cpu", {}).get("ms"), ours["ms"])}


def _cudnn_cell(case: dict[str, Any], key: str) -> str:
    rows = [r for r in case["rows"] if r["provider"].startswith("cudnn")]
    return " / ".join(_fmt(r[key]) for r in rows) if rows else "—"


def _first_call(ours: dict[str, Any]) -> str:
    if ours["first_call_s"] is None:
        return "—"
    return f"{ours['first_call_s']:.1f}" + {True: " (tuned)", False: " (cached plan)"}.get(ours.get("tuned"), "")


def format_table(result: dict[str, Any]) -> str:
    """One line per case: ours (graph and eager), each peer, and peer over ours (> 1: ours is faster)."""
    lines = ["| model | dtype | T | batch | ours graph ms | ours eager ms | cuDNN graph ms | cuDNN eager ms "
             "| CPU ms | ONNX Runtime ms | vs cuDNN graph | vs cuDNN eager | vs CPU | vs ONNX Runtime "
             "| ours end-to-end ms | ours rel. error | plan | first call s |",
             "|" + "---|" * 18]
    for case in result["cases"]:
        rows = providers(case)
        ours = rows["persistrnn"]
        head = f"| {case['model']} | {DTYPE_NAMES[case['dtype']]} | {case['steps']} | {case['batch']} "
        if ours["status"] != "ok":
            lines.append(head + f"| {ours['status']}: {ours['note']} |" + " |" * 13)
            continue
        sp = speedups(case)
        lines.append(
            head + f"| {_fmt(ours['graph_ms'])} | {_fmt(ours['ms'])} | {_cudnn_cell(case, 'graph_ms')} "
            f"| {_cudnn_cell(case, 'ms')} | {_fmt(rows.get('torch-cpu', {}).get('ms'), 2)} "
            f"| {_fmt(rows.get('onnxruntime-cpu', {}).get('ms'), 2)} "
            f"| {_x(sp['cuDNN graph'])} | {_x(sp['cuDNN eager'])} | {_x(sp['CPU'])} | {_x(sp['ONNX Runtime'])} "
            f"| {_fmt(ours['end_to_end_ms'])} | {_sci(ours['rel_error'])} | {ours['plan']} "
            f"| {_first_call(ours)} |")
    notes = ["", "cuDNN columns: in fp32, TF32 allowed / TF32 off; in fp16 and bf16, one setting. Ratios are a "
             "peer's time over ours (above 1: ours is faster), against cuDNN's faster setting; the CPU peers "
             "against our eager time."]
    others = sorted({f"{r['provider']}: {r['status']} ({r['note']})" for c in result["cases"] for r in c["rows"]
                     if r["status"] in ("absent", "not run", "failed") and r["provider"] != "persistrnn"})
    if others:
        notes.append("Providers not timed in some or all cases: " + "; ".join(others) + ".")
    if "streaming" in result:
        st = result["streaming"]
        notes += ["", "| streaming | plan | ours ms per call | cuDNN ms per call | speed-up | ours rel. error |",
                  "|---|---|---|---|---|---|",
                  f"| {st['model']} | {st['plan']} | {st['ours_call_ms']:.4f} | {st['cudnn_call_ms']:.4f} "
                  f"| {_x(ratio(st['cudnn_call_ms'], st['ours_call_ms']))} | {_sci(st['rel_error'])} |"]
    return "\n".join(lines + notes)


def to_csv(result: dict[str, Any]) -> str:
    case_fields = [f.name for f in dataclasses.fields(Case)]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=case_fields + [f.name for f in dataclasses.fields(Row)])
    writer.writeheader()
    for case in result["cases"]:
        for row in case["rows"]:
            writer.writerow({**{k: case[k] for k in case_fields}, **row})
    return out.getvalue()


def _pyplot() -> Any:
    """matplotlib's pyplot on a file backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install matplotlib)"
PLOTTED = (("persistrnn", "graph_ms", "-o"), ("cudnn (faster setting)", "graph_ms", "--s"), ("torch-cpu", "ms", ":^"),
           ("onnxruntime-cpu", "ms", ":v"))


def _series_value(case: dict[str, Any], provider: str, key: str) -> float | None:
    if provider.startswith("cudnn"):
        return best_cudnn(case, key)
    return providers(case).get(provider, {}).get(key)


def plot_latency(result: dict[str, Any], suite: Suite, path: Path) -> str:
    """Latency against batch or T, ours beside cuDNN's faster setting and the CPU peers."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    panels = []
    for spec in suite.plots:
        cases = [c for c in result["cases"] if all(c[k] == v for k, v in spec.fixed)]
        keys = list(dict.fromkeys(tuple(c[f] for f in spec.panel) for c in cases))
        panels += [(spec, key, [c for c in cases if tuple(c[f] for f in spec.panel) == key]) for key in keys]
    if not panels:
        return "plots skipped: no case to plot"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (spec, key, cases) in zip(axes.flat, panels):
        groups = sorted({c[spec.series] for c in cases}) if spec.series else [None]
        for group in groups:
            sel = sorted((c for c in cases if spec.series is None or c[spec.series] == group), key=lambda c: c[spec.x])
            xs = [c[spec.x] for c in sel]
            for provider, key_ms, style in PLOTTED:
                ys = [_series_value(c, provider, key_ms) for c in sel]
                if any(y is not None for y in ys):
                    label = provider + ("" if group is None else f" {spec.series}={group}")
                    ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], style,
                            label=label)
        title = ", ".join(f"{f}={DTYPE_NAMES.get(v, CELL_NAMES.get(v, v))}" for f, v in zip(spec.panel, key))
        title += f" ({'T' if spec.x == 'steps' else spec.x} sweep)"
        ax.set(title=title, xlabel="T" if spec.x == "steps" else spec.x, ylabel="ms per forward", yscale="log")
        if spec.x == "steps" or max(c[spec.x] for c in cases) >= 32:
            ax.set_xscale("log")
        ax.legend(fontsize=6)
    fig.suptitle(f"{suite.title} ({result['environment'].get('gpu', 'GPU')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"latency plot written to {path}"


def plot_speedup(result: dict[str, Any], suite: Suite, path: Path) -> str:
    """Bars of cuDNN's time over ours (graph and eager) for every case, on a log
    scale with 1 marked. The CPU peers' ratios, 10-100x, are in the table:
    beside them the GPU bars would be unreadable."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    peers = ("cuDNN graph", "cuDNN eager")
    ran = [c for c in result["cases"] if providers(c)["persistrnn"]["status"] == "ok"]
    cases = [c for c in ran if any(speedups(c)[peer] is not None for peer in peers)]
    if not cases:
        return "plots skipped: no case with both persistrnn and cuDNN times"
    labels = [f"{c['model']} {DTYPE_NAMES[c['dtype']]} T={c['steps']} B={c['batch']}" for c in cases]
    bars = {peer: [speedups(c)[peer] for c in cases] for peer in peers}
    fig, ax = plt.subplots(figsize=(min(24.0, max(8.0, 0.3 * len(cases))), 5.5))
    width = 0.8 / len(bars)
    for k, (peer, values) in enumerate(bars.items()):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=f"vs {peer}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # before the formatters: setting the scale replaces them
    ax.yaxis.set_major_formatter("{x:g}×")
    ax.yaxis.set_minor_formatter("{x:g}×")
    ax.tick_params(axis="y", which="minor", labelsize=6)
    ax.set_xticks(range(len(cases)), labels, rotation=90, fontsize=6)
    left_out = len(ran) - len(cases)
    ax.set(ylabel="cuDNN time / ours (above 1: ours faster)",
           title=f"{suite.title}: speed-up over cuDNN's faster setting\n{result['environment'].get('gpu', 'GPU')}"
           + (f"; {left_out} cases without a cuDNN peer are in the table only" if left_out else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"speed-up plot written to {path}"


def markdown(result: dict[str, Any], suite: Suite) -> str:
    from .environment import describe
    from .targets import format_targets

    precision = result.get("settings", {}).get("matmul_precision", "highest")
    tf32 = ("" if precision == "highest" else
            f"\n- torch's fp32 matmul precision: {precision!r}, so fp32 layers may run TF32 tensor cores in "
            "persistrnn's kernels (and cuBLAS's input projections); the fp32 rows' errors are TF32's")
    return (f"# {suite.title} (`python -m persistrnn bench {suite.name}`)\n\n" + describe(result["environment"])
            + tf32 + "\n\n" + format_table(result) + "\n\n## Speed targets in this run\n\n"
            + format_targets([result]) + "\n")


_AXES = {
    "cells": dict(nargs="+", choices=sorted(CELL_NAMES)),
    "hidden": dict(nargs="+", type=int),
    "batch": dict(nargs="+", type=int),
    "steps": dict(nargs="+", type=int),
    "dtypes": dict(nargs="+", choices=sorted(DTYPE_NAMES)),
}


def main(suite_name: str, argv: list[str] | None = None) -> int:
    suite = SUITES[suite_name]
    p = argparse.ArgumentParser(prog=f"python -m persistrnn bench {suite.name}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--csv", type=Path)
    p.add_argument("--plot", type=Path, help="PNG of latency; the speed-up bars go beside it as <name>-speedup.png")
    for axis in suite.axes:
        p.add_argument(f"--{axis}", **_AXES[axis], help=f"replaces the suite's {axis}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    p.add_argument("--no-end-to-end", dest="end_to_end", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                   help="torch's fp32 matmul precision for the run; 'high' lets fp32 layers run TF32 tensor cores")
    p.add_argument("--from-json", type=Path, help="write the table, files and plots of an earlier run's --json "
                                                  "instead of running (no GPU needed)")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error(f"--repeats: the method takes the median of at least 5 timings, got {args.repeats}")
    for axis in ("hidden", "batch", "steps"):
        values = getattr(args, axis, None) or []
        if any(v < 1 for v in values):
            p.error(f"--{axis}: expected positive integers, got {values}")
    if args.from_json:
        result = load_result(args.from_json, suite.name, p)
    else:
        from ..runtime import require_gpu

        require_gpu()
        cases = suite_cases(suite.name, **{a: getattr(args, a) for a in suite.axes})
        settings = Settings(repeats=args.repeats, refcheck=args.refcheck, end_to_end=args.end_to_end,
                            matmul_precision=args.matmul_precision)

        def save(result: dict[str, Any]) -> None:
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))

        result = run(suite, cases, settings, progress=args.progress, after_case=save)
        save(result)
    if args.csv:
        args.csv.write_text(to_csv(result))
    if args.markdown:
        args.markdown.write_text(markdown(result, suite))
    if args.plot:
        print(plot_latency(result, suite, args.plot))
        print(plot_speedup(result, suite, args.plot.with_name(args.plot.stem + "-speedup.png")))
    print(format_table(result))
    return 0
