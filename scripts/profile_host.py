"""Where a call's host time goes: host µs per call (back to back, no GPU
wait) of the eager module, its torch.compile'd form and the operator, then
the top functions by own time under cProfile for each.

    PYTHONPATH=. python scripts/profile_host.py [--batch 1] [--calls 300]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

import persistrnn


def host_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def top(fn, calls, n=30):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-profile", action="store_true", help="the host times only, no cProfile listings")
    args = ap.parse_args()
    torch._dynamo.config.allow_rnn = True
    model = persistrnn.LSTM(128, 128, num_layers=2).cuda().eval()
    x = torch.randn(50, args.batch, 128, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    plus_one = torch.compile(lambda t: t + 1, fullgraph=True)
    weights = list(model._flat_weights)
    h0 = torch.zeros(2, args.batch, 128, device="cuda")
    own_plans = persistrnn.LSTM(128, 128, num_layers=2).cuda().eval()  # plans of its own: the Python path
    own_plans.load_state_dict(model.state_dict())
    own_plans.plan_for = model.plan_for
    with torch.no_grad():
        runs = {
            "eager module": lambda: model(x),
            "eager, Python path": lambda: own_plans(x),
            "compiled module": lambda: compiled(x),
            "operator": lambda: torch.ops.persistrnn.forward(x, h0, h0, weights, "lstm", 2, False, True),
            "operator, no h0": lambda: torch.ops.persistrnn.forward(x, None, None, weights, "lstm", 2, False, True),
            # torch.compile's own per-call cost, for a graph of one pointwise op
            "compiled x + 1": lambda: plus_one(x),
            "ops.forward": lambda: persistrnn.ops.forward(model._shape(torch.float32), weights, x, None, None, True),
        }
        for name, fn in runs.items():
            print(f"{name:<18} host {host_us(fn, args.calls):7.1f} µs per call")
        if args.no_profile:
            return
        for name, fn in runs.items():
            print(f"\n== {name}\n{top(fn, args.calls)}")


if __name__ == "__main__":
    main()
