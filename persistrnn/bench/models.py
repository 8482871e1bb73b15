"""Whole models, persistrnn modules against torch.nn (cuDNN): ``python -m persistrnn.bench models``.

The module-level speed targets: char-RNN (3-layer LSTM, 128 hidden, T=100),
text classification (2-layer LSTM, 256 hidden, T=20), a bidirectional 2-layer
LSTM (256 hidden, T=100, batch 8), and streaming (1-layer LSTM, 128 hidden,
one step per call, batch 1).

Both models hold the same weights and run under ``torch.no_grad()`` in fp32
(cuDNN with torch's default settings). Ours is tuned before timing (the
first call's cost is reported apart). Each is timed called eagerly back to
back (what a Python caller pays, host included) and replayed from a CUDA
graph (device time); each time is the median of ``repeats`` CUDA-event
timings of ``calls`` calls after warm-up. Outputs are compared before any
time is taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from ..jit import capture_graph
from .timing import time_cuda_ms

BATCHES = (1, 5, 10, 20, 40)


@dataclasses.dataclass
class ModelsConfig:
    cases: tuple[tuple[str, int, int, int, bool, int, int], ...] = tuple(
        [("char-RNN", 128, 128, 3, False, 100, b) for b in BATCHES]
        + [("text classification", 256, 256, 2, False, 20, b) for b in BATCHES]
        + [("bidirectional", 256, 256, 2, True, 100, 8)]
    )
    """(name, input size, hidden size, layers, bidirectional, T, batch)"""
    calls: int = 10
    repeats: int = 5
    warmup: int = 3


def _time(fn, cfg: ModelsConfig) -> float:
    def many() -> None:
        for _ in range(cfg.calls):
            fn()

    return time_cuda_ms(many, warmup=cfg.warmup, repeats=cfg.repeats) / cfg.calls


def _both(fn, cfg: ModelsConfig) -> tuple[float, float]:
    graph = capture_graph(fn)
    return _time(fn, cfg), _time(graph.replay, cfg)


def run_case(name: str, inp: int, hidden: int, layers: int, bidirectional: bool, steps: int, batch: int,
             cfg: ModelsConfig) -> dict[str, Any]:
    import torch

    import persistrnn

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(inp, hidden, layers, bidirectional=bidirectional).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    x = torch.randn(steps, batch, inp, device="cuda")
    with torch.no_grad():
        t0 = time.perf_counter()
        got = ours(x)[0]
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        want = theirs(x)[0]
        diff = float((got - want).abs().max() / want.abs().max())
        plan = ours.plan_for(batch)
        ours_eager, ours_graph = _both(lambda: ours(x), cfg)
        torch_eager, torch_graph = _both(lambda: theirs(x), cfg)
    return {"name": name, "input": inp, "hidden": hidden, "layers": layers, "bidirectional": bidirectional,
            "steps": steps, "batch": batch, "path": plan.path, "config": str(plan.config), "first_call_s": first_s,
            "max_rel_diff_vs_cudnn": diff, "ours_eager_ms": ours_eager, "ours_graph_ms": ours_graph,
            "cudnn_eager_ms": torch_eager, "cudnn_graph_ms": torch_graph}


def streaming_case(cfg: ModelsConfig, hidden: int = 128, steps: int = 200) -> dict[str, Any]:
    """One step per call at batch 1: our session against the torch module fed its own states."""
    import torch

    import persistrnn

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(hidden, hidden).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    xs = torch.randn(steps, 1, 1, hidden, device="cuda")
    with torch.no_grad():
        session = ours.stream(1)
        session(xs[0])  # plan and compile
        state = None
        k = iter(range(10**9))

        def ours_step() -> None:
            session(xs[next(k) % steps])

        def torch_step() -> None:
            nonlocal state
            _, state = theirs(xs[next(k) % steps], state)

        ours_ms, torch_ms = _time(ours_step, cfg), _time(torch_step, cfg)
    return {"name": "streaming", "input": hidden, "hidden": hidden, "layers": 1, "steps": 1, "batch": 1,
            "path": ours.plan_for(1).path, "ours_call_ms": ours_ms, "cudnn_call_ms": torch_ms}


def run(cfg: ModelsConfig | None = None, progress: bool = True) -> dict[str, Any]:
    from ..progress import track
    from .environment import environment

    cfg = cfg or ModelsConfig()
    result: dict[str, Any] = {"environment": environment(), "config": dataclasses.asdict(cfg), "cases": []}
    for case in track(cfg.cases, progress, "models"):
        result["cases"].append(run_case(*case, cfg))
    result["cases"].append(streaming_case(cfg))
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = ["| model | T | batch | path | ours eager ms | cuDNN eager ms | eager speed-up | ours graph ms "
             "| cuDNN graph ms | graph speed-up | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        if c["name"] == "streaming":
            lines.append(f"| streaming (LSTM 128, 1 step per call) | 1 | 1 | {c['path']} | {c['ours_call_ms']:.4f} | "
                         f"{c['cudnn_call_ms']:.4f} | {c['cudnn_call_ms'] / c['ours_call_ms']:.2f}× | — | — | — | — |")
            continue
        model = f"{c['name']} ({c['layers']}-layer{' bi' if c['bidirectional'] else ''} LSTM {c['hidden']})"
        lines.append(f"| {model} | {c['steps']} | {c['batch']} | {c['path']} | {c['ours_eager_ms']:.3f} | "
                     f"{c['cudnn_eager_ms']:.3f} | {c['cudnn_eager_ms'] / c['ours_eager_ms']:.2f}× | "
                     f"{c['ours_graph_ms']:.3f} | {c['cudnn_graph_ms']:.3f} | "
                     f"{c['cudnn_graph_ms'] / c['ours_graph_ms']:.2f}× | {c['first_call_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .environment import describe

    p = argparse.ArgumentParser(prog="python -m persistrnn.bench models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    result = run()
    table = format_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text("# Models against torch.nn (`python -m persistrnn.bench models`)\n\n"
                                 + describe(result["environment"]) + "\n\n" + table + "\n")
    print(table)
    return 0
