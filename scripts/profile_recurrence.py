"""Run one persistent-recurrence configuration a few times, for a profiler.

    ncu --kernel-name prnn_recurrence --launch-skip 2 --launch-count 1 \
        python scripts/profile_recurrence.py lstm 64 1 --sync single --blocks 1

Also prints µs per step from the difference of a long and a short launch,
which cancels the prologue (weight loads) and the launch.
"""

import argparse
import dataclasses

import torch

from persistrnn import persistent
from persistrnn.bench.step_profile import parse_config_fields
from persistrnn.bench.timing import time_cuda_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cell")
    ap.add_argument("hidden", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--config", default=None, help="KernelConfig fields as k=v,k=v (default: default_config)")
    args = ap.parse_args()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = persistent.default_config(args.cell, args.hidden, args.batch, sm_count=sm)
    if args.config:
        cfg = dataclasses.replace(cfg, **parse_config_fields(args.config))
    print(cfg)
    G, H, B = cfg.spec.num_gates, args.hidden, args.batch
    dt = getattr(torch, cfg.dtype)
    w_hh = (torch.randn(G * H, H, device="cuda") / H**0.5).to(dt)
    b_hh = torch.randn(G * H, device="cuda", dtype=dt)
    h0, c0 = torch.randn(B, H, device="cuda", dtype=dt), torch.randn(B, H, device="cuda", dtype=dt)
    times = {}
    c0 = c0 if cfg.spec.has_cell_state else None
    for steps in (args.steps, args.steps * 10):
        xw = torch.randn(steps, B, G * H, device="cuda")
        times[steps] = time_cuda_ms(lambda xw=xw: persistent.run_recurrence(cfg, xw, w_hh, b_hh, h0, c0, check=False),
                                    warmup=2, repeats=5)
    short, long = args.steps, args.steps * 10
    per_step = (times[long] - times[short]) / (long - short) * 1000
    print(f"launch of {short} steps: {times[short] * 1000:.1f} µs; per step: {per_step:.3f} µs; "
          f"prologue+launch ≈ {times[short] * 1000 - per_step * short:.1f} µs")


if __name__ == "__main__":
    main()
