"""Whether DDP's gradient all-reduce overlaps the backward, measured.

    torchrun --nproc_per_node 2 scripts/profile_ddp.py [--hidden 1024] [--layers 2] [--batch 8]

Each rank trains `DistributedDataParallel` over a persistrnn LSTM (training
operators) and a linear head, T=100, its own batch, then profiles
``--steps`` training steps with torch.profiler (CUDA kernels from CUPTI,
which sees the NVRTC kernels too). Rank 0 prints one JSON line: the GPU time
of the NCCL kernels per step, how much of it ran while another kernel
(the backward's) ran on the same GPU, and the step time with and without
DDP's all-reduce (``no_sync``), so the cost the all-reduce adds to a step is
measured, not inferred.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import persistrnn


class Model(torch.nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.rnn = persistrnn.LSTM(hidden, hidden, layers)
        self.rnn.training_kernels = True
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    a, b = merged(a), merged(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DistributedDataParallel(Model(args.hidden, args.layers).cuda(), device_ids=[local])
    x = torch.randn(100, args.batch, args.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimiser.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimiser.step()

    def no_sync_step() -> None:
        with model.no_sync():
            step()

    def step_ms(run, count: int = 10) -> float:
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            for _ in range(count):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / count)
        return statistics.median(times)

    for _ in range(10):  # plans, captures, the training choice, NCCL's set-up
        step()
    with_allreduce, without = step_ms(step), step_ms(no_sync_step)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.device_index == local and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    nccl_us = sum(end - start for start, end in merged(nccl))
    overlapped_us = overlap(nccl, compute)
    if rank == 0:
        print(json.dumps({
            "world_size": dist.get_world_size(), "gpu": torch.cuda.get_device_name(), "hidden": args.hidden,
            "layers": args.layers, "batch_per_rank": args.batch, "seq_len": 100,
            "parameters": sum(p.numel() for p in model.parameters()),
            "step_ms": with_allreduce, "step_ms_no_sync": without,
            "allreduce_kernel_ms_per_step": nccl_us / 1e3 / args.steps,
            "allreduce_overlapped_ms_per_step": overlapped_us / 1e3 / args.steps,
            "overlapped_fraction": overlapped_us / nccl_us if nccl_us else None,
            "kernels_profiled": len(kernels)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
