"""Where a training step's time goes: persistrnn's training operators beside
cuDNN (torch.nn's module of the cell), LSTM unless ``--cell`` says
otherwise, T=100, input = hidden, fp32 unless ``--dtype`` says otherwise.

Per hidden size and batch, each piece is timed three ways (median of
``--repeats`` after a warm-up to steady clocks): host ms, perf_counter around
issuing it; events ms, CUDA events around it as issued (host-bound work reads
its host time here); device ms, CUDA events with its launches queued behind a
GPU sleep, so issue time is hidden and only the GPU's work is timed. The
pieces: the training step (forward + backward of (output²).sum()), the
forward alone, the backward alone, one direction's step loop launched from
Python (``training._fused_steps``, also as host µs per step), one direction's
whole backward (``training.direction_backward``), and cuDNN's step, forward and backward
with torch's default settings. A torch.profiler summary of one of our
training steps per case (top ops by self device and self CPU time) and its
trace go under ``--out``.

    PYTHONPATH=. python scripts/profile_training.py --out profile_training_out
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import persistrnn
from persistrnn import cells, runtime, training

STEPS = 100
SLEEP_CYCLES_PER_MS = 2_000_000  # the H100's boost clock, rounded up: the sleep lasts at least as asked


def timings(run, setup, repeats):
    """(host ms, events ms, device ms) of ``run()``, medians; ``setup()`` runs before each, untimed."""
    host, events, device = [], [], []
    for queued in (False, True):
        for _ in range(repeats):
            setup()
            torch.cuda.synchronize()
            if queued:  # the GPU sleeps until everything ``run`` issues is queued behind it
                torch.cuda._sleep(int((2 * statistics.median(host) + 1) * SLEEP_CYCLES_PER_MS))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            run()
            end.record()
            issued = time.perf_counter() - began
            torch.cuda.synchronize()
            (device if queued else events).append(start.elapsed_time(end))
            if not queued:
                host.append(issued * 1e3)
    return statistics.median(host), statistics.median(events), statistics.median(device)


class TrainingStep:
    """Forward and backward of (output²).sum() on one module, as separable pieces."""

    def __init__(self, module, x):
        self.module, self.x, self.loss = module, x, None

    def clear(self):
        self.module.zero_grad(set_to_none=True)
        self.x.grad, self.loss = None, None

    def forward(self):
        out, _ = self.module(self.x)
        self.loss = out.square().sum()

    def backward(self):
        self.loss.backward()

    def step(self):
        self.clear()
        self.forward()
        self.backward()


def direction_arguments(hidden, batch):
    """Random arguments of one LSTM direction's backward (training.direction_backward's order)."""
    def normal(*shape):
        return torch.randn(*shape, device="cuda") * 0.5

    gh = 4 * hidden
    w_hh = (torch.rand(gh, hidden, device="cuda") * 2 - 1) * hidden ** -0.5
    return (normal(STEPS, batch, gh), normal(STEPS, batch, gh), normal(STEPS, batch, hidden),
            normal(STEPS, batch, hidden), normal(batch, hidden), normal(batch, hidden), w_hh,
            normal(STEPS, batch, hidden), normal(batch, hidden), normal(batch, hidden))


def fused_steps_call(spec, args):
    """``training._fused_steps`` on one direction's arguments, into buffers made once."""
    xw, gates, cs, out, h0, c0, w_hh, d_out, dh_n, dc_n = args
    h_prev, c_prev = training._previous(out, h0, False), training._previous(cs, c0, False)
    d_xw, d_gates = torch.empty_like(xw), torch.empty_like(gates)
    stage_operands = out.new_empty(0, *out.shape)
    return lambda: training._fused_steps(spec, xw, gates, h_prev, c_prev, w_hh, d_out, dh_n, dc_n, False, d_xw,
                                         d_gates, stage_operands)


def profile_step(step, path):
    """torch.profiler over one training step: top ops by self device and self CPU time, and the trace."""
    step.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    path.write_text("\n\n".join(f"Top ops by {key}:\n{averages.table(sort_by=key, row_limit=25)}"
                                for key in ("self_device_time_total", "self_cpu_time_total")))
    prof.export_chrome_trace(str(path.with_suffix(".trace.json")))


MODULES = {"lstm": ("LSTM", {}), "gru": ("GRU", {}), "rnn_tanh": ("RNN", {}),
           "rnn_relu": ("RNN", {"nonlinearity": "relu"})}


def profile_case(hidden, batch, repeats, out_dir, cell="lstm", dtype=torch.float32):
    torch.manual_seed(hidden + batch)
    kind, options = MODULES[cell]
    theirs = getattr(torch.nn, kind)(hidden, hidden, **options).to("cuda", dtype)
    ours = getattr(persistrnn, kind)(hidden, hidden, **options).to("cuda", dtype).train()
    ours.load_state_dict(theirs.state_dict())
    ours.training_kernels = True
    x = torch.randn(STEPS, batch, hidden, device="cuda", dtype=dtype, requires_grad=True)
    # This profiles the training operators at every shape, those where the
    # module would measure cuDNN faster and train on it included.
    training.cudnn_trains_faster = lambda module, x: False
    reason = ours._torch_reason(x, warn=False, trains=True)
    if reason is not None:
        raise RuntimeError(f"persistrnn's {kind} would train on torch's implementation here ({reason})")
    mine, cudnn = TrainingStep(ours, x), TrainingStep(theirs, x)
    runtime.warm_up(mine.step)
    pieces = {
        "ours step": (mine.step, mine.clear),
        "ours forward": (mine.forward, mine.clear),
        "ours backward": (mine.backward, lambda: (mine.clear(), mine.forward())),
    }
    if cell == "lstm" and dtype == torch.float32:  # one fp32 LSTM direction's backward alone
        spec, args = cells.get_cell("lstm"), direction_arguments(hidden, batch)
        pieces["step loop, launched"] = (fused_steps_call(spec, args), lambda: None)
        pieces["direction"] = (lambda: training.direction_backward(spec, *args, False), lambda: None)
    pieces.update({
        "cuDNN step": (cudnn.step, cudnn.clear),
        "cuDNN forward": (cudnn.forward, cudnn.clear),
        "cuDNN backward": (cudnn.backward, lambda: (cudnn.clear(), cudnn.forward())),
    })
    rows = []
    for name, (run, setup) in pieces.items():
        for _ in range(3):  # first calls: compiles, captures, cuBLAS handles
            setup()
            run()
        host, events, device = timings(run, setup, repeats)
        per_step = f"{host * 1e3 / STEPS:.1f}" if name.startswith("step loop") else ""
        rows.append((hidden, batch, name, host, events, device, per_step))
    profile_step(mine, out_dir / f"training_step_{cell}_H{hidden}_B{batch}.txt")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cell", choices=sorted(MODULES), default="lstm")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                    help="torch's fp32 matmul precision ('high': TF32 in ours' fp32 forward and GEMMs)")
    ap.add_argument("--out", type=Path, required=True, help="directory for the torch.profiler summaries and traces")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with runtime.matmul_precision(args.matmul_precision):
        rows = [row for hidden in args.hidden for batch in args.batch
                for row in profile_case(hidden, batch, args.repeats, args.out, args.cell, getattr(torch, args.dtype))]
    print(f"{args.cell}, T={STEPS}, input = hidden, {args.dtype}, fp32 matmul precision {args.matmul_precision}; "
          f"medians of {args.repeats}. host: issuing it; "
          "events: as issued; device: queued behind a GPU sleep. Profiles under", args.out)
    print("| H | batch | piece | host ms | events ms | device ms | host µs per step |")
    print("|---|---|---|---|---|---|---|")
    for hidden, batch, name, host, events, device, per_step in rows:
        print(f"| {hidden} | {batch} | {name} | {host:.3f} | {events:.3f} | {device:.3f} | {per_step} |")


if __name__ == "__main__":
    main()
