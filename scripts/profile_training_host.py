"""Where a training step's host time goes, padded and on a PackedSequence,
ours beside cuDNN (LSTM, T=100; 256 units at batch 8 unless --hidden and
--batch say otherwise): ms per step, then torch.profiler tables (self and
total CPU time per op) of 10 steps each; with --cprofile, the padded step's
Python functions by own time (cProfile over 50 steps) instead.

    PYTHONPATH=. python scripts/profile_training_host.py [--cprofile]
"""
import argparse
import time

import torch
from torch.nn.utils.rnn import pack_padded_sequence
from torch.profiler import ProfilerActivity, profile

import persistrnn
from persistrnn import training
from persistrnn.runtime import native

# The training operators at every shape ("ours" means them), those where the
# module would measure cuDNN faster and train on it included.
training.cudnn_trains_faster = lambda module, x: False
torch.manual_seed(0)
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--cprofile", action="store_true")
parser.add_argument("--times-only", action="store_true", help="the ms per step only, no profiles")
args = parser.parse_args()
native.available(wait=True)  # the captured steps replay from C++ from the first, as in the benchmarks
H, B, T = args.hidden, args.batch, 100
ours = persistrnn.LSTM(H, H).cuda()
ours.training_kernels = True
theirs = torch.nn.LSTM(H, H).cuda()
x = torch.randn(T, B, H, device="cuda", requires_grad=True)
lengths = torch.randint(T // 2, T + 1, (B,))
lengths[0] = T


def step(module, packed):
    module.zero_grad(set_to_none=True)
    x.grad = None
    out, _ = module(pack_padded_sequence(x, lengths, enforce_sorted=False) if packed else x)
    (out.data if packed else out).square().sum().backward()


for name, module, packed in (("ours padded", ours, False), ("ours packed", ours, True),
                             ("cudnn padded", theirs, False), ("cudnn packed", theirs, True)):
    for _ in range(5):
        step(module, packed)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step(module, packed)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms per step", flush=True)


if args.times_only:
    raise SystemExit(0)
if args.cprofile:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step(ours, False)
    prof.disable()
    torch.cuda.synchronize()
    print("==== ours padded, 50 steps under cProfile: by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(45)
    raise SystemExit(0)

for name, module, packed in (("ours padded", ours, False), ("ours packed", ours, True), ("cudnn packed", theirs, True)):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step(module, packed)
        torch.cuda.synchronize()
    print(f"==== {name}, 10 steps: by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    print(f"==== {name}, 10 steps: by total CPU time")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
