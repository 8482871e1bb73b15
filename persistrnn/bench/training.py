"""One training step beside cuDNN's: ``python -m persistrnn bench training``.

For a cell (LSTM by default; ``--cell rnn_relu --hidden 1152`` is the
Persistent RNNs paper's Figure 3) at each hidden size and batch (T = 100,
input = hidden, fp32), in one process: a persistrnn module and torch's module
of that cell with the same weights, each timed for forward + backward of ``(output ** 2).sum()`` with
CUDA events around ``calls`` steps back to back (median of ``repeats``
rounds, the three timings interleaved in each round, after a warm-up to
steady clocks). torch runs cuDNN's training path with its
own settings (TF32 allowed in cuDNN, torch's default) and without TF32
("exact"). Before timing, the input gradient of each is compared with
float64 autograd of torch's CPU module. "ours" is the persistrnn module with
``training_kernels``: where cuDNN measured faster at a shape it trains on
cuDNN (the row says which ran). ``--inputs packed`` times the same
step on a PackedSequence (unsorted; each sequence's length drawn uniformly
from T/2..T, the first T), for both: the loss is then over the packed data.

Useful TFLOP/s (``--plot``: against the batch, ours beside cuDNN's faster
setting) counts the model's arithmetic, not what either implementation
does: per step and sequence, the forward's products 2·G·H·(I+H) (G gates),
and twice that for the backward (the data gradients and the weight
gradients), so 6·G·H·(I+H)·T·B per training step.

``--matmul-precision high`` runs every row under torch's fp32 matmul
precision "high", where persistrnn's fp32 training forward may run a TF32
configuration (its plan, as an inference call's) and the backward's GEMMs
run TF32 through cuBLAS; the persistent backward kernel stays exact fp32.
cuDNN's two settings are its RNNs' own and do not change with it.

``--memory`` reports, at T=1000, batch 4, what a forward in training mode
keeps for the backward (``torch.cuda.memory_allocated`` after a forward,
less before it and less the tensors it returns; the second such call, so
that one-time buffers are already there) for each module (cuDNN's is its
reserve space), and what persistrnn's captured training graphs hold for
that shape across steps (``torch.cuda.memory_reserved`` after capturing one
step's forward and backward anew, less before, the caching allocator's free
blocks released on both sides).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from .compare import DTYPE_NAMES

HIDDEN = (256, 1024)
BATCHES = (1, 8, 32)
STEPS = 100
CELLS = {"lstm": ("LSTM", {}, 4), "gru": ("GRU", {}, 3), "rnn_tanh": ("RNN", {"nonlinearity": "tanh"}, 1),
         "rnn_relu": ("RNN", {"nonlinearity": "relu"}, 1)}
"""Cells torch trains on cuDNN: (module class, its arguments, gates)."""
MEMORY_SHAPE = (1000, 4)
"""(T, batch) of ``--memory``: the issue's activation-memory comparison."""


def _modules(cell: str, hidden: int, dtype: str = "float32") -> tuple[Any, Any]:
    """(torch's module, persistrnn's with the same weights), on the GPU, in ``dtype``."""
    import torch

    import persistrnn

    name, kwargs, _ = CELLS[cell]
    theirs = getattr(torch.nn, name)(hidden, hidden, **kwargs).to("cuda", getattr(torch, dtype))
    ours = getattr(persistrnn, name)(hidden, hidden, **kwargs).to("cuda", getattr(torch, dtype))
    ours.load_state_dict(theirs.state_dict())
    ours.training_kernels = True  # opt-in: without it the module trains on torch's implementation
    return theirs, ours


def useful_tflops(cell: str, hidden: int, batch: int, steps: int, ms: float) -> float:
    """The model's training arithmetic (6·G·H·(I+H)·T·B, input = hidden) over ``ms``, in TFLOP/s."""
    return 6 * CELLS[cell][2] * hidden * 2 * hidden * steps * batch / (ms * 1e-3) / 1e12


def _step(module: Any, x: Any, lengths: Any = None):
    from torch.nn.utils.rnn import pack_padded_sequence

    def run() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = module(x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False))
        (out if lengths is None else out.data).square().sum().backward()
    return run


def _time_interleaved(runs: dict[str, tuple[Any, Any]], calls: int, repeats: int) -> dict[str, float]:
    """{name: ms per call}, the median of ``repeats`` rounds; each round
    times every ``(run, settings)`` of ``runs`` in turn, ``calls`` calls
    back to back inside ``settings()``, so that the host's and the GPU's
    swings from second to second fall on every side alike."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (run, settings) in runs.items():
            with settings():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    run()
                end.record()
                torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def _input_grad_error(module: Any, x: Any, want: Any, lengths: Any) -> float:
    _step(module, x, lengths)()
    got = x.grad.double().cpu()
    return float((got - want).norm() / want.norm())


def run_case(hidden: int, batch: int, calls: int, repeats: int, inputs: str = "padded",
             cell: str = "lstm", dtype: str = "float32") -> dict[str, Any]:
    import torch

    from .. import runtime, training

    torch.manual_seed(hidden * 1000 + batch)
    theirs, ours = _modules(cell, hidden, dtype)
    x = torch.randn(STEPS, batch, hidden, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    reference = copy.deepcopy(theirs).cpu().double()
    x64 = x.detach().double().cpu().requires_grad_()
    lengths = None
    if inputs == "packed":
        lengths = torch.randint(STEPS // 2, STEPS + 1, (batch,), generator=torch.Generator().manual_seed(batch))
        lengths[0] = STEPS
    _step(reference, x64, lengths)()
    row: dict[str, Any] = {"cell": cell, "dtype": dtype, "hidden": hidden, "batch": batch, "steps": STEPS,
                           "inputs": inputs}
    reason = ours._torch_reason(x, warn=False, trains=True)  # times the two steps on first use
    row["runs"] = "persistrnn" if reason is None else "cuDNN"
    if reason is not None and not training.cudnn_trains_faster(ours, x):  # anything else would time torch as ours
        raise RuntimeError(f"persistrnn's {cell} would train on torch's implementation here ({reason})")
    row["ours_grad_error"] = _input_grad_error(ours, x, x64.grad, lengths)
    with runtime.cudnn_rnn_settings(enabled=True, tf32=False):
        row["cudnn_exact_grad_error"] = _input_grad_error(theirs, x, x64.grad, lengths)
    with runtime.cudnn_rnn_settings(enabled=True, tf32=True):
        row["cudnn_grad_error"] = _input_grad_error(theirs, x, x64.grad, lengths)
    runtime.warm_up(_step(ours, x, lengths))
    row.update(_time_interleaved({
        "ours_ms": (_step(ours, x, lengths), contextlib.nullcontext),
        "cudnn_ms": (_step(theirs, x, lengths), functools.partial(runtime.cudnn_rnn_settings, enabled=True, tf32=True)),
        "cudnn_exact_ms": (_step(theirs, x, lengths),
                           functools.partial(runtime.cudnn_rnn_settings, enabled=True, tf32=False)),
    }, calls, repeats))
    row["speedup"] = min(row["cudnn_ms"], row["cudnn_exact_ms"]) / row["ours_ms"]
    return row


def _tflops(row: dict[str, Any]) -> tuple[float, float]:
    """(ours, cuDNN's faster setting) useful TFLOP/s of a row."""
    cell = row.get("cell", "lstm")
    return tuple(useful_tflops(cell, row["hidden"], row["batch"], row["steps"], ms)  # type: ignore[return-value]
                 for ms in (row["ours_ms"], min(row["cudnn_ms"], row["cudnn_exact_ms"])))


def activation_memory(cell: str, hidden: int, steps: int, batch: int, dtype: str = "float32") -> dict[str, Any]:
    """Memory of a training step beside cuDNN's: what a forward keeps for its
    backward (ours and cuDNN's, TF32 allowed and not), and what persistrnn's
    captured operator graphs hold for this shape across steps."""
    import gc

    import torch

    from .. import runtime, training

    theirs, ours = _modules(cell, hidden, dtype)
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)

    def kept(module: Any) -> int:
        for _ in range(2):  # the second call: one-time buffers (captured graphs, workspaces) are already there
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out, state = module(x)
            returned = [out, *(state if isinstance(state, tuple) else (state,))]
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - before - sum(t.numel() * t.element_size() for t in returned)
            del out, state, returned
        return held

    def graphs_hold() -> int:
        """Device memory reserved by the training forward's and backward's graphs (their static inputs and
        outputs and the pools of what they allocate), captured anew for one step."""
        training.OPERATOR_GRAPHS.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        out, _ = ours(x)
        out.float().square().sum().backward()
        del out
        ours.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() - before

    reason = ours._torch_reason(x, warn=False, trains=True)
    row: dict[str, Any] = {"cell": cell, "dtype": dtype, "hidden": hidden, "steps": steps, "batch": batch,
                           "runs": "persistrnn" if reason is None else f"torch ({reason})",
                           "ours_bytes": kept(ours)}
    row["ours_graph_bytes"] = graphs_hold() if reason is None else 0
    for label, tf32 in (("cudnn_bytes", True), ("cudnn_exact_bytes", False)):
        with runtime.cudnn_rnn_settings(enabled=True, tf32=tf32):
            row[label] = kept(theirs)
    return row


def _error(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def _precision_note(precision: str) -> str:
    if precision == "highest":
        return ""
    return (f" torch's fp32 matmul precision: '{precision}' (TF32 allowed): ours may run a TF32 forward "
            "configuration, and its backward's GEMMs run TF32; its backward kernel stays exact fp32.")


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    cells = ", ".join(sorted({CELLS[r.get("cell", "lstm")][0] + ("" if r.get("cell", "lstm") in ("lstm", "gru")
                                                                else f" ({r['cell'][4:]})") for r in result["rows"]}))
    lines = ["# A training step beside cuDNN's (`python -m persistrnn bench training`)", "",
             describe(result["environment"]),
             f"- Method: {cells or 'LSTM'}, T={STEPS}, input = hidden; forward + backward of (output²).sum(), "
             f"CUDA events around {result['calls']} steps back to back, median of {result['repeats']} rounds "
             "(ours and cuDNN's two settings interleaved in each round), after a warm-up to steady clocks. "
             "cuDNN with TF32 allowed (torch's default) and without (alike in 16-bit). "
             "Gradient error: the "
             "input gradient against float64 autograd of torch's CPU module. Inputs packed: a PackedSequence "
             "(unsorted) of lengths drawn uniformly from T/2..T (the first T), the loss over its data. Runs: "
             "what the module trains on at that shape (persistrnn's operators, or cuDNN where that measured faster; "
             "`training.cudnn_trains_faster`). Useful TFLOP/s: 6·G·H·(I+H)·T·B per step (G gates) over the time, "
             "cuDNN's at its faster setting."
             + _precision_note(result.get("settings", {}).get("matmul_precision", "highest")), "",
             "| cell | dtype | inputs | H | batch | runs | ours ms | cuDNN ms (TF32 / exact) | "
             "speed-up vs cuDNN's faster | useful TFLOP/s (ours / cuDNN) | ours grad error | "
             "cuDNN grad error (TF32 / exact) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cell = r.get("cell", "lstm")
        flops = " / ".join(f"{v:.2f}" for v in _tflops(r))
        dtype = DTYPE_NAMES[r.get("dtype", "float32")]
        lines.append(f"| {cell} | {dtype} | {r.get('inputs', 'padded')} | {r['hidden']} | {r['batch']} | "
                     f"{r.get('runs', 'persistrnn')} | {r['ours_ms']:.3f} | {r['cudnn_ms']:.3f} / "
                     f"{r['cudnn_exact_ms']:.3f} | {r['speedup']:.2f}× | {flops} | {r['ours_grad_error']:.1e} | "
                     f"{_error(r.get('cudnn_grad_error'))} / {r['cudnn_exact_grad_error']:.1e} |")
    if result.get("memory"):
        lines += ["", "Memory of a training step: what a forward keeps for the backward (bytes allocated after it, "
                      "less before it and less what it returns; the second call), and what persistrnn's captured "
                      "training graphs hold for the shape across steps (device memory reserved by capturing one "
                      "step's forward and backward anew: their static inputs and outputs and their pools):", "",
                  "| cell | dtype | H | T | batch | runs | persistrnn kept MiB | persistrnn graphs MiB "
                  "| persistrnn total MiB | cuDNN kept MiB (TF32 / exact) | cuDNN over ours (kept / total) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in result["memory"]:
            mib = {k: m.get(k, 0) / 2**20 for k in ("ours_bytes", "ours_graph_bytes", "cudnn_bytes",
                                                     "cudnn_exact_bytes")}
            total = mib["ours_bytes"] + mib["ours_graph_bytes"]
            cudnn = min(mib["cudnn_bytes"], mib["cudnn_exact_bytes"])
            lines.append(f"| {m['cell']} | {DTYPE_NAMES[m.get('dtype', 'float32')]} | {m['hidden']} | {m['steps']} | "
                         f"{m['batch']} | {m.get('runs', 'persistrnn')} | {mib['ours_bytes']:.1f} | "
                         f"{mib['ours_graph_bytes']:.1f} | {total:.1f} | {mib['cudnn_bytes']:.1f} / "
                         f"{mib['cudnn_exact_bytes']:.1f} | {cudnn / mib['ours_bytes']:.2f}× / {cudnn / total:.2f}× |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> str:
    """Useful TFLOP/s against the batch, ours beside cuDNN's faster setting, a line per cell and size."""
    from .compare import NO_MATPLOTLIB, _pyplot

    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    series: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        series.setdefault((r.get("cell", "lstm"), r.get("dtype", "float32"), r["hidden"], r.get("inputs", "padded")),
                          []).append(r)
    for (cell, dtype, hidden, inputs), rows in series.items():
        rows.sort(key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        label = f"{cell} {hidden} {DTYPE_NAMES[dtype]}" + ("" if inputs == "padded" else f" {inputs}")
        ours, cudnn = zip(*(_tflops(r) for r in rows))
        line, = ax.plot(batches, ours, "-o", label=f"persistrnn, {label}")
        ax.plot(batches, cudnn, "--s", color=line.get_color(), label=f"cuDNN (faster setting), {label}")
    ax.set(xscale="log", xlabel="batch", ylabel="useful TFLOP/s (forward + backward)",
           title=f"training step, T={STEPS}")
    ax.set_xticks(sorted({r["batch"] for r in result["rows"]}), labels=[str(b) for b in
                                                                        sorted({r["batch"] for r in result["rows"]})])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    from .environment import environment, write_result

    p = argparse.ArgumentParser(prog="python -m persistrnn bench training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", choices=sorted(CELLS), default="lstm")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    p.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--inputs", nargs="+", choices=("padded", "packed"), default=["padded"],
                   help="a padded tensor, and/or a PackedSequence of random lengths")
    p.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                   help="torch's fp32 matmul precision for every row ('high': TF32 in ours' fp32 forward and GEMMs)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", action="store_true",
                   help=f"also what a training forward keeps, at T={MEMORY_SHAPE[0]}, batch {MEMORY_SHAPE[1]}, "
                        "for each --hidden")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--plot", type=Path, help="useful TFLOP/s against the batch, as a PNG")
    p.add_argument("--from-json", type=Path, help="write the table and plot of an earlier run's --json instead")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        from ..runtime import matmul_precision, require_gpu

        require_gpu()
        with matmul_precision(args.matmul_precision):
            result = {"environment": environment(), "calls": args.calls, "repeats": args.repeats,
                      "settings": {"matmul_precision": args.matmul_precision},
                      "rows": [run_case(h, b, args.calls, args.repeats, inputs, args.cell, args.dtype)
                               for inputs in args.inputs for h in args.hidden for b in args.batch],
                      "memory": [activation_memory(args.cell, h, *MEMORY_SHAPE, args.dtype) for h in args.hidden]
                      if args.memory else []}
    text = markdown(result)
    if args.plot:
        text += "\n" + plot(result, args.plot) + "\n"
    write_result(args, result, text)
    return 0
