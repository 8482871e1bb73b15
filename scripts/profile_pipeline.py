"""Where a fused pipeline's step time goes: one configuration timed as one
layer, as independent instances in one launch (no pipeline), and as a pipeline
of 2 and 3 layers, as device time of CUDA-graph replays.

    python scripts/profile_pipeline.py [--hidden 128] [--batch 1] [--steps 100]
"""

import argparse
import dataclasses

import torch

from persistrnn import persistent
from persistrnn.plan.tuner import time_forward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=128)
    args = parser.parse_args()
    H, B, T = args.hidden, args.batch, args.steps
    base = persistent.KernelConfig("lstm", H, "cluster", args.blocks, args.threads, 8, 1)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen) * 2 - 1) * H ** -0.5

    layers = [[dict(w_ih=rand(4 * H, H), w_hh=rand(4 * H, H), b_ih=rand(4 * H), b_hh=rand(4 * H))] for _ in range(3)]
    x = rand(T, B, H) * H ** 0.5
    h0, c0 = rand(3, B, H), rand(3, B, H)
    xw = persistent.input_projection(x, layers[0][0]["w_ih"], layers[0][0]["b_ih"])

    def independent(n):
        config = dataclasses.replace(base, instances=n)
        outs = [torch.empty(T, B, H, device="cuda") for _ in range(n)]
        hn = torch.empty(n, B, H, device="cuda")
        instances = [persistent.Instance(xw, layers[i][0]["w_hh"], layers[i][0]["b_hh"], h0[i], c0[i], outs[i],
                                         hn[i], hn[i]) for i in range(n)]
        return lambda: persistent.run_instances(config, instances, T, B, check=False)

    def pipeline(n):
        config = dataclasses.replace(base, instances=n, pipeline=True)
        return lambda: persistent.forward_model(config, layers[:n], x, h0[:n], c0[:n], check=False)

    rows = [("1 layer", 1, independent(1)), ("3 independent instances", 1, independent(3)),
            ("pipeline of 2", 2, pipeline(2)), ("pipeline of 3", 3, pipeline(3))]
    print(f"LSTM H={H} B={B} T={T}, {base.blocks} blocks x {base.threads} threads per layer")
    for label, n, run in rows:
        ms = time_forward_ms(run)
        steps = T + (n - 1) * (base.prefetch_steps + persistent.PIPELINE_RELEASE_EVERY)
        print(f"{label:26s} {ms:7.3f} ms  {1e3 * ms / steps:6.2f} µs per step over {steps} steps")


if __name__ == "__main__":
    main()
