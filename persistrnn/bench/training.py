"""One training step beside cuDNN's: ``python -m persistrnn bench training``.

For LSTM at each hidden size and batch (T = 100, input = hidden, fp32), in
one process: a persistrnn module and a ``torch.nn.LSTM`` with the same
weights, each timed for forward + backward of ``(output ** 2).sum()`` with
CUDA events around ``calls`` steps back to back (median of ``repeats``,
after a warm-up to steady clocks). torch runs cuDNN's training path with its
own settings (TF32 allowed in cuDNN, torch's default) and without TF32
("exact"). Before timing, the input gradient of each is compared with
float64 autograd of torch's CPU module. "ours" is the persistrnn module with
``training_kernels``: where cuDNN measured faster at a shape it trains on
cuDNN (the row says which ran). ``--inputs packed`` times the same
step on a PackedSequence (unsorted; each sequence's length drawn uniformly
from T/2..T, the first T), for both: the loss is then over the packed data.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

HIDDEN = (256, 1024)
BATCHES = (1, 8, 32)
STEPS = 100


def _step(module: Any, x: Any, lengths: Any = None):
    from torch.nn.utils.rnn import pack_padded_sequence

    def run() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = module(x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False))
        (out if lengths is None else out.data).square().sum().backward()
    return run


def _time_ms(run: Any, calls: int, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _input_grad_error(module: Any, x: Any, want: Any, lengths: Any) -> float:
    _step(module, x, lengths)()
    got = x.grad.double().cpu()
    return float((got - want).norm() / want.norm())


def run_case(hidden: int, batch: int, calls: int, repeats: int, inputs: str = "padded") -> dict[str, Any]:
    import torch

    import persistrnn
    from .. import runtime, training

    torch.manual_seed(hidden * 1000 + batch)
    theirs = torch.nn.LSTM(hidden, hidden).cuda()
    ours = persistrnn.LSTM(hidden, hidden).cuda()
    ours.load_state_dict(theirs.state_dict())
    ours.training_kernels = True  # opt-in: without it the module trains on torch's implementation
    x = torch.randn(STEPS, batch, hidden, device="cuda", requires_grad=True)
    reference = torch.nn.LSTM(hidden, hidden).double()
    reference.load_state_dict(theirs.state_dict())
    x64 = x.detach().double().cpu().requires_grad_()
    lengths = None
    if inputs == "packed":
        lengths = torch.randint(STEPS // 2, STEPS + 1, (batch,), generator=torch.Generator().manual_seed(batch))
        lengths[0] = STEPS
    _step(reference, x64, lengths)()
    row: dict[str, Any] = {"hidden": hidden, "batch": batch, "steps": STEPS, "inputs": inputs}
    reason = ours._torch_reason(x, warn=False, trains=True)  # times the two steps on first use
    row["runs"] = "persistrnn" if reason is None else "cuDNN"
    if reason is not None and not training.cudnn_trains_faster(ours, x):  # anything else would time torch as ours
        raise RuntimeError(f"persistrnn.LSTM would train on torch's implementation here ({reason})")
    row["ours_grad_error"] = _input_grad_error(ours, x, x64.grad, lengths)
    runtime.warm_up(_step(ours, x, lengths))
    row["ours_ms"] = _time_ms(_step(ours, x, lengths), calls, repeats)
    for label, tf32 in (("cudnn_ms", True), ("cudnn_exact_ms", False)):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            if not tf32:
                row["cudnn_exact_grad_error"] = _input_grad_error(theirs, x, x64.grad, lengths)
            row[label] = _time_ms(_step(theirs, x, lengths), calls, repeats)
    row["speedup"] = min(row["cudnn_ms"], row["cudnn_exact_ms"]) / row["ours_ms"]
    return row


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    lines = ["# A training step beside cuDNN's (`python -m persistrnn bench training`)", "",
             describe(result["environment"]),
             f"- Method: LSTM, T={STEPS}, input = hidden, fp32; forward + backward of (output²).sum(), CUDA events "
             f"around {result['calls']} steps back to back, median of {result['repeats']}, after a warm-up to "
             "steady clocks. cuDNN with TF32 allowed (torch's default) and without. Gradient error: the input "
             "gradient against float64 autograd of torch's CPU module. Inputs packed: a PackedSequence (unsorted) "
             "of lengths drawn uniformly from T/2..T (the first T), the loss over its data. Runs: what the module "
             "trains on at that shape (persistrnn's operators, or cuDNN where that measured faster; "
             "`training.cudnn_trains_faster`).", "",
             "| inputs | H | batch | runs | ours ms | cuDNN ms (TF32 / exact) | speed-up vs cuDNN's faster | "
             "ours grad error | cuDNN exact grad error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r.get('inputs', 'padded')} | {r['hidden']} | {r['batch']} | "
                     f"{r.get('runs', 'persistrnn')} | {r['ours_ms']:.3f} | {r['cudnn_ms']:.3f} / "
                     f"{r['cudnn_exact_ms']:.3f} | {r['speedup']:.2f}× | {r['ours_grad_error']:.1e} | "
                     f"{r['cudnn_exact_grad_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .environment import environment, write_result

    p = argparse.ArgumentParser(prog="python -m persistrnn bench training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--inputs", nargs="+", choices=("padded", "packed"), default=["padded"],
                   help="a padded tensor, and/or a PackedSequence of random lengths")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"environment": environment(), "calls": args.calls, "repeats": args.repeats,
                              "rows": [run_case(h, b, args.calls, args.repeats, inputs)
                                       for inputs in args.inputs for h in args.hidden for b in args.batch]}
    text = markdown(result)
    write_result(args, result, text)
    return 0
