"""GRNN's Table 1 on this GPU: ``python -m persistrnn bench grnn-table``.

LSTM and GRU (torch's reset-after form, which cuDNN runs; and the canonical
reset-before form, which no peer here runs), hidden size H in {64, 256, 1024}
x batch in {1, 10, 20}, T = 100 steps, input size = H, one layer, fp32.

Providers, in one process, every one reported (a provider that is absent or
fails is a row that says so, never a dropped one):

* ``persistrnn``: this package's module, tuned on first use (the tuning time
  is reported apart), eager calls and CUDA-graph replays;
* ``cudnn``: the ``torch.nn`` module on the GPU, eager and graph-replayed,
  with TF32 allowed (torch's default) and not allowed, each labelled;
* ``torch-cpu``: the ``torch.nn`` module on the CPU with every core;
* ``onnxruntime-cpu`` and ``flashrnn``: when installed.

Method. GPU times are CUDA-event timings after warm-up, the median of
``repeats`` (at least 5) timings of ``calls`` calls, over inputs rotated
among ``buffers`` distinct tensors. The CPU's are ``time.perf_counter``
medians. The end-to-end variant (GRNN's table timed the copies too) copies
the input from pinned host memory to the GPU and the output back, inside the
timed call. Before any timing, every provider's output is compared with the
float64 reference (``--no-refcheck`` skips that) and the relative error is
kept beside its times.
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

from ..jit import capture_graph
from .timing import time_cuda_ms

CELLS = ("lstm", "gru", "gru_reset_before")
HIDDEN = (64, 256, 1024)
BATCHES = (1, 10, 20)
STEPS = 100


@dataclasses.dataclass
class TableConfig:
    cells: tuple[str, ...] = CELLS
    hidden: tuple[int, ...] = HIDDEN
    batches: tuple[int, ...] = BATCHES
    steps: int = STEPS
    calls: int = 5
    repeats: int = 5
    warmup: int = 3
    buffers: int = 4
    cpu_repeats: int = 3
    refcheck: bool = True
    end_to_end: bool = True


@dataclasses.dataclass
class Row:
    """One provider on one case: times in ms (None: not measured) and why not."""

    provider: str
    status: str = "ok"  # ok, absent, not run, failed, no peer
    ms: float | None = None
    graph_ms: float | None = None
    end_to_end_ms: float | None = None
    rel_error: float | None = None
    note: str = ""


def _modules(cell: str, hidden: int):
    """(torch module or None where torch has no such cell, our module), same weights, fp32 on the GPU."""
    import torch

    import persistrnn

    torch.manual_seed(0)
    if cell == "gru_reset_before":
        ours = persistrnn.GRU(hidden, hidden, reset_after=False).cuda().eval()
        return None, ours
    theirs = getattr(torch.nn, cell.upper())(hidden, hidden).cuda().eval()
    return theirs, persistrnn.from_torch(theirs)


def _reference(module: Any, x: Any) -> Any:
    """The module's output in float64 on the CPU."""
    import torch

    ref = copy.deepcopy(module).to("cpu", torch.float64)
    with torch.no_grad():
        return ref(x.to("cpu", torch.float64))[0]


def _rel(got: Any, want: Any) -> float:
    import torch

    got = got.to("cpu", torch.float64)
    return float((got - want).norm() / want.norm())


def _gpu_times(fn: Callable[[Any], Any], inputs: list[Any], cfg: TableConfig) -> tuple[float, float]:
    """(eager ms, graph ms) per call, over rotated inputs."""
    k = iter(range(10**9))

    def eager() -> None:
        for _ in range(cfg.calls):
            fn(inputs[next(k) % len(inputs)])

    eager_ms = time_cuda_ms(eager, warmup=cfg.warmup, repeats=cfg.repeats) / cfg.calls
    # A graph replays fixed buffers: one graph per rotated input.
    graphs = [capture_graph(lambda x=x: fn(x)) for x in inputs]

    def replay() -> None:
        for _ in range(cfg.calls):
            graphs[next(k) % len(graphs)].replay()

    return eager_ms, time_cuda_ms(replay, warmup=cfg.warmup, repeats=cfg.repeats) / cfg.calls


def _end_to_end_ms(fn: Callable[[Any], Any], host_inputs: list[Any], cfg: TableConfig) -> float:
    """Host -> device copy of the input, the forward, device -> host copy of the output."""
    k = iter(range(10**9))

    def call() -> None:
        for _ in range(cfg.calls):
            fn(host_inputs[next(k) % len(host_inputs)].to("cuda", non_blocking=True)).to("cpu")

    return time_cuda_ms(call, warmup=cfg.warmup, repeats=cfg.repeats) / cfg.calls


def _cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _guard(provider: str, work: Callable[[], Row]) -> Row:
    try:
        return work()
    except Exception as exc:  # a failing provider is reported, not dropped
        return Row(provider, "failed", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def run_case(cell: str, hidden: int, batch: int, cfg: TableConfig) -> dict[str, Any]:
    import torch

    theirs, ours = _modules(cell, hidden)
    gen = torch.Generator().manual_seed(hidden * 100 + batch)
    host = [torch.randn(cfg.steps, batch, hidden, generator=gen).pin_memory() for _ in range(cfg.buffers)]
    inputs = [h.to("cuda") for h in host]
    want = _reference(ours, host[0]) if cfg.refcheck else None
    rows: list[Row] = []

    def check(out: Any) -> float | None:
        return _rel(out, want) if want is not None else None

    with torch.no_grad():
        def persistrnn_row() -> Row:
            t0 = time.perf_counter()
            out = ours(inputs[0])[0]
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            plan = ours.plan_for(batch)
            eager, graph = _gpu_times(lambda x: ours(x)[0], inputs, cfg)
            e2e = _end_to_end_ms(lambda x: ours(x)[0], host, cfg) if cfg.end_to_end else None
            return Row("persistrnn", ms=eager, graph_ms=graph, end_to_end_ms=e2e, rel_error=check(out),
                       note=f"plan {plan.path}; first call {first:.1f} s")

        rows.append(_guard("persistrnn", persistrnn_row))
        for tf32 in (True, False):
            label = f"cudnn (TF32 {'allowed' if tf32 else 'off'})"
            if theirs is None:
                rows.append(Row(label, "no peer", note="torch has no reset-before GRU"))
                continue

            def cudnn_row(tf32: bool = tf32, label: str = label) -> Row:
                previous = torch.backends.cudnn.allow_tf32
                torch.backends.cudnn.allow_tf32 = tf32
                try:
                    out = theirs(inputs[0])[0]
                    eager, graph = _gpu_times(lambda x: theirs(x)[0], inputs, cfg)
                    e2e = _end_to_end_ms(lambda x: theirs(x)[0], host, cfg) if cfg.end_to_end else None
                    return Row(label, ms=eager, graph_ms=graph, end_to_end_ms=e2e, rel_error=check(out))
                finally:
                    torch.backends.cudnn.allow_tf32 = previous

            rows.append(_guard(label, cudnn_row))

        def cpu_row() -> Row:
            module = ours if theirs is None else theirs
            cpu = copy.deepcopy(module).cpu()
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or threads)
            try:
                out = cpu(host[0])[0]
                ms = _cpu_ms(lambda: cpu(host[1]), cfg.cpu_repeats)
            finally:
                torch.set_num_threads(threads)
            return Row("torch-cpu", ms=ms, rel_error=check(out), note=f"{os.cpu_count()} threads")

        rows.append(_guard("torch-cpu", cpu_row))
    rows += [_optional_provider("onnxruntime", "onnxruntime-cpu"), _optional_provider("flashrnn", "flashrnn")]
    return {"cell": cell, "hidden": hidden, "batch": batch, "steps": cfg.steps,
            "rows": [dataclasses.asdict(r) for r in rows]}


def _optional_provider(module: str, label: str) -> Row:
    """A peer that needs a package of its own: reported absent when it is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return Row(label, "absent", note=f"{module} is not installed")
    return Row(label, "not run", note=f"{module} is installed, but this suite does not drive it yet")


def run(cfg: TableConfig | None = None, progress: bool = True) -> dict[str, Any]:
    from ..progress import track
    from .environment import environment

    cfg = cfg or TableConfig()
    cases = [(c, h, b) for c in cfg.cells for h in cfg.hidden for b in cfg.batches]
    result: dict[str, Any] = {"environment": environment(), "config": dataclasses.asdict(cfg), "cases": []}
    for cell, hidden, batch in track(cases, progress, "grnn-table"):
        result["cases"].append(run_case(cell, hidden, batch, cfg))
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

CELL_NAMES = {"lstm": "LSTM", "gru": "GRU", "gru_reset_before": "GRU (reset-before)"}


def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _sci(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def _ratio(peer: float | None, ours: float | None) -> str:
    """How many times faster ours is than the peer (peer time over ours)."""
    return "—" if peer is None or ours is None else f"{peer / ours:.2f}×"


def format_table(result: dict[str, Any]) -> str:
    """One line per case: ours (graph and eager), each peer's best time, and
    peer over ours (> 1: ours is faster)."""
    lines = ["| cell | H | batch | ours graph ms | ours eager ms | cuDNN graph ms (TF32 allowed / off) "
             "| cuDNN eager ms (allowed / off) | CPU ms | vs cuDNN graph | vs cuDNN eager | vs CPU | ours end-to-end ms "
             "| ours rel. error | plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        rows = {r["provider"]: r for r in case["rows"]}
        ours = rows["persistrnn"]
        allowed, off = rows["cudnn (TF32 allowed)"], rows["cudnn (TF32 off)"]
        cpu = rows["torch-cpu"]
        if ours["status"] != "ok":
            lines.append(f"| {CELL_NAMES[case['cell']]} | {case['hidden']} | {case['batch']} | failed: {ours['note']} "
                         "| | | | | | | | | | |")
            continue
        peer_graph = min((r["graph_ms"] for r in (allowed, off) if r["graph_ms"] is not None), default=None)
        peer_eager = min((r["ms"] for r in (allowed, off) if r["ms"] is not None), default=None)
        lines.append(
            f"| {CELL_NAMES[case['cell']]} | {case['hidden']} | {case['batch']} | {_fmt(ours['graph_ms'])} "
            f"| {_fmt(ours['ms'])} | {_fmt(allowed['graph_ms'])} / {_fmt(off['graph_ms'])} "
            f"| {_fmt(allowed['ms'])} / {_fmt(off['ms'])} | {_fmt(cpu['ms'], 2)} "
            f"| {_ratio(peer_graph, ours['graph_ms'])} | {_ratio(peer_eager, ours['ms'])} | {_ratio(cpu['ms'], ours['ms'])} "
            f"| {_fmt(ours['end_to_end_ms'])} | {_sci(ours['rel_error'])} "
            f"| {ours['note'].split(';')[0].removeprefix('plan ')} |")
    others = sorted({f"{r['provider']}: {r['status']} ({r['note']})" for c in result["cases"] for r in c["rows"]
                     if r["status"] in ("absent", "not run", "failed") and r["provider"] != "persistrnn"})
    if others:
        lines += ["", "Providers not timed: " + "; ".join(others) + "."]
    return "\n".join(lines)


def to_csv(result: dict[str, Any]) -> str:
    out = io.StringIO()
    fields = ["cell", "hidden", "batch", "steps"] + [f.name for f in dataclasses.fields(Row)]
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    for case in result["cases"]:
        for row in case["rows"]:
            writer.writerow({**{k: case[k] for k in ("cell", "hidden", "batch", "steps")}, **row})
    return out.getvalue()


def plot(result: dict[str, Any], path: Path) -> str:
    """Latency against batch per hidden size (ours, cuDNN, CPU), one panel per
    cell; returns what was written, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib)"
    cells = sorted({c["cell"] for c in result["cases"]}, key=CELLS.index)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        cases = [c for c in result["cases"] if c["cell"] == cell]
        for hidden in sorted({c["hidden"] for c in cases}):
            sel = sorted((c for c in cases if c["hidden"] == hidden), key=lambda c: c["batch"])
            batches = [c["batch"] for c in sel]
            for provider, key, style in (("persistrnn", "graph_ms", "-o"), ("cudnn (TF32 allowed)", "graph_ms", "--s"),
                                         ("torch-cpu", "ms", ":^")):
                ys = [next(r[key] for r in c["rows"] if r["provider"] == provider) for c in sel]
                if all(y is not None for y in ys):
                    ax.plot(batches, ys, style, label=f"{provider} H={hidden}")
        ax.set(title=CELL_NAMES[cell], xlabel="batch", ylabel="ms per forward (T=100)", yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    from .environment import describe

    p = argparse.ArgumentParser(prog="python -m persistrnn bench grnn-table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--csv", type=Path)
    p.add_argument("--plot", type=Path, help="PNG of latency against batch")
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    p.add_argument("--hidden", nargs="+", type=int, default=list(HIDDEN))
    p.add_argument("--batch", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    p.add_argument("--no-end-to-end", dest="end_to_end", action="store_false")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error(f"--repeats: the method takes the median of at least 5 timings, got {args.repeats}")
    cfg = TableConfig(cells=tuple(args.cells), hidden=tuple(args.hidden), batches=tuple(args.batch), steps=args.steps,
                      repeats=args.repeats, refcheck=args.refcheck, end_to_end=args.end_to_end)
    result = run(cfg)
    table = format_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.csv:
        args.csv.write_text(to_csv(result))
    if args.markdown:
        args.markdown.write_text("# GRNN's Table 1 on this GPU (`python -m persistrnn bench grnn-table`)\n\n"
                                 + describe(result["environment"]) + "\n\n" + table + "\n")
    if args.plot:
        print(plot(result, args.plot))
    print(table)
    return 0
