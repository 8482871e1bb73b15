"""Packed batches of unequal lengths: persistrnn's call captured (the padded
shape repeated) against its launches as they come (the policy told to
capture nothing), beside cuDNN's call on the same PackedSequence, in one
process, the three interleaved round by round. Inference (no gradients) and
a training step (pack, forward, backward of the packed output's squares,
the pack's backward included, as `bench training --inputs packed` times
it). ms per call from CUDA events around back-to-back calls, median of the
rounds, after a warm-up to steady clocks.

    PYTHONPATH=. python scripts/profile_packed.py [--hidden 256] [--layers 1] [--steps 100] [--batch 8 32]
"""
import argparse
import contextlib

import torch
from torch.nn.utils.rnn import pack_padded_sequence

import persistrnn
from persistrnn import ops, runtime, training
from persistrnn.bench.training import _time_interleaved

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=1)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
parser.add_argument("--calls", type=int, default=20)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--modes", nargs="+", choices=("inference", "training"), default=["inference", "training"])
parser.add_argument("--profile", action="store_true", help="torch.profiler tables of each variant's calls too")
args = parser.parse_args()
# The training operators at every shape ("ours" means them), those where the module would measure cuDNN
# faster and train on it included.
training.cudnn_trains_faster = lambda module, x: False
POLICIES = {"captured": (ops.PADDED_LENGTHS, training.PADDED_LENGTHS),
            "launched": (runtime.RecentShapes(window=1, fits=0), runtime.RecentShapes(window=1, fits=0))}


def use(policy):
    ops.PADDED_LENGTHS, training.PADDED_LENGTHS = POLICIES[policy]


H, T = args.hidden, args.steps


def run_case(mode, B):
    torch.manual_seed(B)
    ours = persistrnn.LSTM(H, H, num_layers=args.layers).cuda()
    theirs = torch.nn.LSTM(H, H, num_layers=args.layers).cuda()
    theirs.load_state_dict(ours.state_dict())
    ours.training_kernels = True
    x = torch.randn(T, B, H, device="cuda", requires_grad=mode == "training")
    lengths = torch.randint(T // 2, T + 1, (B,), generator=torch.Generator().manual_seed(B))
    lengths[0] = T

    def call(module, packed=True):
        inputs = pack_padded_sequence(x, lengths, enforce_sorted=False) if packed else x
        if mode == "inference":
            with torch.no_grad():
                module(inputs)
            return
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = module(inputs)
        (out.data if packed else out).square().sum().backward()

    def ours_with(policy):
        def run():
            use(policy)
            call(ours)
        return run

    variants = {"ours captured": ours_with("captured"), "ours launched": ours_with("launched"),
                "cudnn": lambda: call(theirs), "ours padded": lambda: call(ours, packed=False),
                "cudnn padded": lambda: call(theirs, packed=False)}
    runtime.warm_up(variants["ours captured"])
    for fn in variants.values():
        for _ in range(3):
            fn()
    medians = _time_interleaved({name: (fn, contextlib.nullcontext) for name, fn in variants.items()},
                                args.calls, args.rounds)
    use("captured")
    if mode == "inference":
        print(f"plan at batch {B}: {ours.plan_for(B).for_steps(T)}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in variants.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"---- {mode} batch {B}, {name}, 5 calls", flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    print(f"{mode} batch {B}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in medians.items())
          + f"; captured / launched {medians['ours captured'] / medians['ours launched']:.2f}, "
          f"cuDNN / captured {medians['cudnn'] / medians['ours captured']:.2f}", flush=True)


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, LSTM {H} x{args.layers}, T={T}", flush=True)
for mode in args.modes:
    for B in args.batch:
        run_case(mode, B)
