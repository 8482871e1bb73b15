"""Training steps that step from the host (a forward on the fallback's
step loop, a backward whose layer does not fit the persistent backward
kernel), captured against launched, and the fallback's forward against the
persistent one: ms per training step (CUDA events around 10 steps, median of
5 rounds, the variants interleaved) and the memory each holds across steps
(``torch.cuda.memory_reserved`` after steps, the caching allocator's free
blocks released, less before; and the peak allocated during a step), for an
LSTM (or ``--cell gru``) at T=100, input = hidden, under torch's fp32 matmul precision
``--matmul-precision``; cuDNN's step (torch's module, with TF32 allowed, as
torch's default, and without) beside them.

    PYTHONPATH=. python scripts/step_loop_capture.py [--hidden 1024] [--batch 32] [--matmul-precision highest]
"""
import argparse
import contextlib

import torch

import persistrnn
from persistrnn import runtime, training, training_kernel
from persistrnn.bench.training import _step, _time_interleaved

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--cell", choices=("lstm", "gru"), default="lstm")
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--matmul-precision", choices=("highest", "high"), default="highest")
args = parser.parse_args()
training.cudnn_trains_faster = lambda module, x: False  # the training operators, whatever cuDNN measures
runtime.native.available(wait=True)
torch.manual_seed(0)
kind = {"lstm": "LSTM", "gru": "GRU"}[args.cell]
ours = getattr(persistrnn, kind)(args.hidden, args.hidden).cuda()
ours.training_kernels = True
x = torch.randn(100, args.batch, args.hidden, device="cuda", requires_grad=True)
print("persistent backward kernel holds the layer:",
      training_kernel.fits(args.cell, args.hidden, args.batch, torch.cuda.current_device()))
step = _step(ours, x)
peer = getattr(torch.nn, kind)(args.hidden, args.hidden).cuda()
cudnn_step = _step(peer, x)


@contextlib.contextmanager
def _settings(limit=training.STEP_LOOP_GRAPH_SAVED_BYTES, fallback=None):
    """The step-loop capture bound ``limit``; the forward on the fallback
    where ``fallback`` is None and the plan says so, else as it says."""
    saved = training.STEP_LOOP_GRAPH_SAVED_BYTES, training.fallback_trains_forward
    training.STEP_LOOP_GRAPH_SAVED_BYTES = limit
    if fallback is not None:
        training.fallback_trains_forward = lambda *args: fallback
    try:
        yield
    finally:
        training.STEP_LOOP_GRAPH_SAVED_BYTES, training.fallback_trains_forward = saved


def held(settings):
    """(MiB reserved across steps, MiB peak allocated in a step) under ``settings``."""
    training.OPERATOR_GRAPHS.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with settings():
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    torch.cuda.empty_cache()
    return (torch.cuda.memory_reserved() - before) / 2**20, peak / 2**20


with runtime.matmul_precision(args.matmul_precision):
    print("the plan's choice of forward:", "fallback" if training.fallback_trains_forward(
        args.cell, args.hidden, args.batch, "float32", torch.cuda.current_device(), True) else "persistent")
    runs = {"as planned, captured": _settings, "as planned, launched": lambda: _settings(limit=1),
            "fallback forward, captured": lambda: _settings(fallback=True),
            "persistent forward, captured": lambda: _settings(fallback=False)}
    memory = {name: held(settings) for name, settings in runs.items()}
    for settings in runs.values():
        with settings():
            runtime.warm_up(step)
    timed = {name: (step, settings) for name, settings in runs.items()}
    timed["cuDNN, TF32 allowed (torch's default)"] = (cudnn_step, contextlib.nullcontext)
    timed["cuDNN, exact"] = (cudnn_step, lambda: torch.backends.cudnn.flags(enabled=True, allow_tf32=False))
    times = _time_interleaved(timed, calls=10, repeats=5)
    print(f"{kind} {args.hidden}, batch {args.batch}, T=100, fp32 matmul precision {args.matmul_precision}")
    for name in timed:
        held_text = (f"; held across steps {memory[name][0]:.0f} MiB, peak in a step {memory[name][1]:.0f} MiB"
                     if name in memory else "")
        print(f"  {name}: {times[name]:.3f} ms per step{held_text}")
