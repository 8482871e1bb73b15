"""One recurrent layer, persistent kernel against cuDNN: ``python -m persistrnn.bench recurrence``.

For each (cell, hidden size, batch, dtype), with input size = hidden size:

* ours: the input-projection GEMM plus one persistent launch. A few
  configurations are timed and the fastest is kept (the planner will choose
  from a model instead). Reported replayed from a CUDA graph (device time) and
  called eagerly from Python back to back (what a plain call costs, host
  included).
* cuDNN through torch, in the same process: eager with torch's default
  settings (in fp32 cuDNN may use TF32), eager with TF32 off (fp32 only), and
  replayed from a CUDA graph (default settings). In fp16/bf16 the module runs
  in that dtype, which is where torch picks cuDNN's persistent kernels.
* relative error ||out - ref|| / ||ref|| of the output sequence against the
  float64 reference on the same (dtype-rounded) parameters, for ours and for
  cuDNN.

Times are medians of ``repeats`` CUDA-event timings, each over ``calls``
back-to-back calls, after warm-up; input buffers rotate over ``ROTATE`` copies
so a small model does not run from a warm L2.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .. import runtime, persistent, reference
from ..cells import get_cell
from ..runtime import capture_graph
from .environment import parse_layer_case
from .timing import time_cuda_ms

ROTATE = 4
TORCH_MODULES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


@dataclasses.dataclass
class RecurrenceBenchConfig:
    cases: tuple[tuple[str, int, int, str], ...] = tuple(
        [("lstm", H, B, "float32") for H in (64, 256, 1024) for B in (1, 8, 10, 20)]
        + [(cell, H, B, "float32") for cell in ("gru", "gru_reset_before", "rnn_tanh") for H in (256, 1024)
           for B in (1, 20)]
        + [("lstm", H, B, dtype) for dtype in ("bfloat16", "float16") for H in (256, 1024) for B in (1, 8, 16, 20)]
    )
    steps: int = 100
    calls: int = 10
    repeats: int = 5
    warmup: int = 2


def candidates(cell: str, hidden: int, batch: int, sm_count: int,
               dtype: str = "float32") -> list[persistent.KernelConfig]:
    """A handful of configurations around the default: fewer or more blocks
    (register budget) and other work-group sizes; for 16-bit dtypes, the
    tensor-core path with other K splits, and the widening FFMA path."""
    if dtype != "float32":
        return _mma_candidates(cell, hidden, batch, sm_count, dtype)
    seen: dict[persistent.KernelConfig, None] = {}
    # Small budgets spread a small model over more blocks, which pays once the
    # batch makes a step compute-bound (H=64, B=20 on one SM: 2.5 µs of FMAs).
    for budget in (16, 32, 64, 128, 160):
        try:
            base = persistent.default_config(cell, hidden, batch, sm_count=sm_count, register_budget=budget)
        except persistent.ConfigError:
            continue
        seen[base] = None
        for group in (4, 16, 32):
            try:
                cfg = dataclasses.replace(base, group_size=group)
            except persistent.ConfigError:
                continue
            if cfg.register_weights <= budget and cfg.estimated_registers <= persistent.MAX_REGISTERS_PER_THREAD:
                seen[cfg] = None
    if cell == "gru_reset_before":  # both variants: two exchanges per step, or one (GRNN Fig. 7b)
        for cfg in list(seen):
            try:
                seen[dataclasses.replace(cfg, one_sync=True)] = None
            except persistent.ConfigError:
                continue
    return list(seen)


def _mma_candidates(cell: str, hidden: int, batch: int, sm_count: int, dtype: str) -> list[persistent.KernelConfig]:
    seen: dict[persistent.KernelConfig, None] = {}
    for budget in (32, 64, 128, 160):
        try:
            base = persistent.default_config(cell, hidden, batch, sm_count=sm_count, register_budget=budget,
                                             dtype=dtype, math="mma")
        except persistent.ConfigError:
            continue
        seen[base] = None
        for k_split in (2 * base.k_split, 4 * base.k_split):
            try:
                cfg = dataclasses.replace(base, k_split=k_split)
            except persistent.ConfigError:
                continue
            seen[cfg] = None
    try:
        seen[persistent.default_config(cell, hidden, batch, sm_count=sm_count, dtype=dtype)] = None
    except persistent.ConfigError:
        pass
    return list(seen)


def _rel(a: Any, b: Any) -> float:
    import numpy as np

    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _per_call_ms(fn, cfg: RecurrenceBenchConfig) -> float:
    def many() -> None:
        for _ in range(cfg.calls):
            fn()

    return time_cuda_ms(many, warmup=cfg.warmup, repeats=cfg.repeats) / cfg.calls


def run_case(cell: str, hidden: int, batch: int, dtype: str, cfg: RecurrenceBenchConfig) -> dict[str, Any]:
    import numpy as np
    import torch

    spec = get_cell(cell)
    T, H, G = cfg.steps, hidden, spec.num_gates
    dev = torch.device("cuda")
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(hash((cell, hidden, batch)) % 2**32)
    bound = 1 / math.sqrt(H)
    on_gpu = lambda a: torch.tensor(a, dtype=tdtype, device=dev)  # noqa: E731
    as_f64 = lambda t: t.double().cpu().numpy()  # noqa: E731
    w = {k: on_gpu(rng.uniform(-bound, bound, shape)) for k, shape in
         (("w_ih", (G * H, H)), ("w_hh", (G * H, H)), ("b_ih", (G * H,)), ("b_hh", (G * H,)))}
    x_gpu = [on_gpu(rng.standard_normal((T, batch, H))) for _ in range(ROTATE)]
    h0_gpu = on_gpu(rng.standard_normal((batch, H)) * 0.5)
    c0_gpu = on_gpu(rng.standard_normal((batch, H)) * 0.5) if spec.has_cell_state else None
    # The reference runs on the rounded values the GPU sees.
    p = {k: as_f64(v) for k, v in w.items()}
    hx_ref = (as_f64(h0_gpu)[None], as_f64(c0_gpu)[None]) if spec.has_cell_state else as_f64(h0_gpu)[None]
    ref_out, _ = reference.rnn_forward(cell, as_f64(x_gpu[0]), [[p]], hx=hx_ref)
    result: dict[str, Any] = {"cell": cell, "hidden": H, "batch": batch, "dtype": dtype, "steps": T}

    # ---- ours: pick the fastest of a few configurations, by graph replay time
    facts = runtime.device_facts()
    timings = []
    for config in candidates(cell, H, batch, facts.sm_count, dtype):
        try:
            def fwd(i=0, config=config, check=False):
                return persistent.forward_layer(config, x_gpu[i], w["w_ih"], w["w_hh"], w["b_ih"], w["b_hh"],
                                                h0_gpu, c0_gpu, check=check)
            out, _, _ = fwd(check=True)  # timed calls skip the status read: it synchronises
            err = _rel(as_f64(out), ref_out)
            graphs = [capture_graph(lambda i=i, fwd=fwd: fwd(i)) for i in range(ROTATE)]
            k = iter(range(10**9))
            ms = _per_call_ms(lambda graphs=graphs, k=k: graphs[next(k) % ROTATE].replay(), cfg)
            timings.append((ms, config, err, fwd))
        except (persistent.ConfigError, runtime.KernelLaunchError, runtime.CompileError) as exc:
            result.setdefault("rejected", []).append(f"{config}: {exc}")
    if not timings:
        raise RuntimeError(f"no configuration ran for {cell} H={H} B={batch} {dtype}: {result.get('rejected')}")
    ms, best, err, fwd = min(timings, key=lambda item: item[0])
    k = iter(range(10**9))
    result.update(
        config=dataclasses.asdict(best),
        ours_graph_ms=ms,
        ours_eager_ms=_per_call_ms(lambda: fwd(next(k) % ROTATE), cfg),
        ours_error=err,
        candidates={str(c): t for t, c, _, _ in timings},
    )

    # ---- cuDNN through torch
    name = TORCH_MODULES.get(cell)
    if name is None:
        result["cudnn"] = "no torch/cuDNN module for this cell"
        return result
    kwargs = {"nonlinearity": cell.split("_")[1]} if name == "RNN" else {}
    module = getattr(torch.nn, name)(H, H, **kwargs).to(dev)
    reference.load_params_into_torch(module, [[p]])
    module = module.to(tdtype)
    hx = (h0_gpu[None], c0_gpu[None]) if spec.has_cell_state else h0_gpu[None]
    # TF32 only exists for fp32; the default settings allow it for cuDNN.
    settings = {"": True, "fp32_": False} if dtype == "float32" else {"": True}
    with torch.no_grad():
        for prefix, tf32 in settings.items():
            with runtime.cudnn_rnn_settings(enabled=torch.backends.cudnn.enabled, tf32=tf32):
                out = module(x_gpu[0], hx)[0]
                result[f"cudnn_{prefix}error"] = _rel(as_f64(out), ref_out)
                k = iter(range(10**9))
                result[f"cudnn_{prefix}eager_ms"] = _per_call_ms(
                    lambda k=k: module(x_gpu[next(k) % ROTATE], hx), cfg)
                if tf32:
                    graphs = [capture_graph(lambda i=i: module(x_gpu[i], hx)) for i in range(ROTATE)]
                    k = iter(range(10**9))
                    result["cudnn_graph_ms"] = _per_call_ms(
                        lambda graphs=graphs, k=k: graphs[next(k) % ROTATE].replay(), cfg)
    return result


def run(cfg: RecurrenceBenchConfig | None = None, progress: bool = True) -> dict[str, Any]:
    from .environment import environment

    cfg = cfg or RecurrenceBenchConfig()
    result: dict[str, Any] = {"environment": environment(), "config": dataclasses.asdict(cfg), "cases": []}
    cases = cfg.cases
    if progress:
        from rich.progress import track

        cases = track(cases, description="recurrence", transient=True)
    for cell, H, B, dtype in cases:
        result["cases"].append(run_case(cell, H, B, dtype, cfg))
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        "| cell | dtype | H | B | ours graph ms | ours eager ms | cuDNN eager ms (default: TF32 allowed) "
        "| cuDNN eager ms (TF32 off) | cuDNN graph ms | speed-up vs eager / graph | µs per step (ours) "
        "| error ours | error cuDNN default / TF32 off | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        cfg = c["config"]
        conf = f"{cfg['sync']} {cfg['blocks']}×{cfg['threads']}, {cfg['math']}"
        conf += (f", k split {cfg['k_split']}" if cfg["math"] == "mma"
                 else f", wg {cfg['group_size']}, bt {cfg['batch_tile']}")
        conf += ", 1-sync" if cfg["one_sync"] else ""
        if "cudnn_eager_ms" in c:
            def fp32(key: str, c: dict = c) -> str:
                return f"{c[key]:.3g}" if key in c else "—"

            speedups = (f"{c['cudnn_eager_ms'] / c['ours_graph_ms']:.1f}× / "
                        f"{c['cudnn_graph_ms'] / c['ours_graph_ms']:.1f}×")
            peer = (f"{c['cudnn_eager_ms']:.3f} | {fp32('cudnn_fp32_eager_ms')} | {c['cudnn_graph_ms']:.3f} | "
                    + speedups)
            errs = f"{c['cudnn_error']:.1e} / {fp32('cudnn_fp32_error')}"
        else:
            peer, errs = "— | — | — | —", "—"
        lines.append(
            f"| {c['cell']} | {c['dtype']} | {c['hidden']} | {c['batch']} | {c['ours_graph_ms']:.4f} | "
            f"{c['ours_eager_ms']:.4f} | {peer} | {1000 * c['ours_graph_ms'] / c['steps']:.2f} | "
            f"{c['ours_error']:.1e} | {errs} | {conf} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m persistrnn.bench recurrence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", default=None, metavar="CELL:H:B[:DTYPE]", type=parse_layer_case,
                        help="run only these cases, e.g. lstm:256:1 or lstm:1024:16:bfloat16 (repeatable)")
    parser.add_argument("--steps", type=int, default=RecurrenceBenchConfig.steps)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    cfg = RecurrenceBenchConfig(steps=args.steps)
    if args.case:
        cfg.cases = tuple(args.case)
    result = run(cfg)
    table = format_table(result)
    from .environment import describe

    header = describe(result["environment"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(header + "\n\n" + table + "\n")
    print(header + "\n\n" + table)
    return 0
