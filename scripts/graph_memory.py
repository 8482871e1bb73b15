"""Memory held by captured forwards: N forwards of one module at N batch
sizes, captured on one stream, with their graphs' pools shared per stream
(the library's way) or one pool per graph (``--pool-per-graph``, as before
perf notes §95). Prints the reserved and allocated memory the captures added
and the worst error of a second call of every shape against torch's module
(TF32 off). Plans from the cost model alone (no tuning).

    PYTHONPATH=. python scripts/graph_memory.py [--pool-per-graph] [--hidden 256] [--steps 50] [--batches 16]
"""

import argparse

import torch

import persistrnn
from persistrnn import runtime
from persistrnn import plan as planner
from persistrnn.plan import tuner
from persistrnn.runtime import graphs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool-per-graph", action="store_true")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", type=int, default=16)
    args = parser.parse_args()
    if args.pool_per_graph:
        shared_capture = graphs.capture
        graphs.capture = lambda *a, shared_pool=False, **k: shared_capture(*a, **k)
    untimed_plan = tuner.plan
    tuner.plan = planner.plan = lambda shape, batch, tune=True, **kw: untimed_plan(
        shape, batch, tune=False, refresh=True, **{k: v for k, v in kw.items() if k != "refresh"})
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    theirs = torch.nn.LSTM(args.hidden, args.hidden).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    xs = [torch.randn(args.steps, b, args.hidden, device="cuda") for b in range(1, args.batches + 1)]
    with torch.no_grad(), runtime.matmul_precision("highest"):
        for x in xs[:1]:  # compile and load outside the measured span
            ours(x)
        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        for x in xs[1:]:
            ours(x)
        torch.cuda.synchronize()
        added_reserved = (torch.cuda.memory_reserved() - reserved) / 2**20
        added_allocated = (torch.cuda.memory_allocated() - allocated) / 2**20
        worst = max(float((ours(x)[0].double() - theirs(x)[0].double()).norm() / theirs(x)[0].double().norm())
                    for x in xs)
    n = len(xs) - 1
    mode = "a pool per graph" if args.pool_per_graph else "one pool per stream"
    print(f"{mode}: {n} captured forwards of LSTM {args.hidden}, T={args.steps}: reserved +{added_reserved:.1f} MiB "
          f"({added_reserved / n:.1f} per forward), allocated +{added_allocated:.1f} MiB "
          f"({added_allocated / n:.2f} per forward); worst rel. error {worst:.1e}; plans: "
          f"{sorted({ours.plan_for(x.shape[1]).describe() for x in xs})[:3]}")


if __name__ == "__main__":
    main()
