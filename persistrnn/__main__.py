"""``python -m persistrnn``: the demo, and the entry to the other commands.

On a GPU the demo measures what a persistent kernel pays per timestep against
what cuDNN pays per timestep on the same GPU, today's reason for persistrnn.
Without a GPU it says so and runs what runs on a CPU: the float64 reference
against torch, and the compilation of every kernel for sm_90.
"""

from __future__ import annotations

import sys
import time


def _cpu_demo() -> int:
    import numpy as np
    import torch

    from . import reference
    from .bench import sync

    print("No CUDA GPU is visible, so persistrnn's kernels cannot run here: they need an NVIDIA GPU of")
    print(f"compute capability 9.0 or newer (torch {torch.__version__}, torch.cuda.is_available() is False).")
    print("Running what runs on a CPU instead.\n")

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(64, 128, num_layers=2, batch_first=True).double()
    x = torch.randn(3, 50, 64, dtype=torch.float64)
    with torch.no_grad():
        want, (h_want, _) = lstm(x)
    got, (h_got, _) = reference.rnn_forward(
        "lstm", x.numpy(), reference.params_from_torch(lstm), num_layers=2, batch_first=True
    )
    err = np.linalg.norm(got - want.numpy()) / np.linalg.norm(want.numpy())
    print(f"1. float64 reference vs torch.nn.LSTM (2 layers, H=128, T=50, B=3): relative error {err:.1e}")

    t0 = time.perf_counter()
    binary = sync.sync_binary(arch="sm_90")
    print(f"2. NVRTC compiled the sync kernels for sm_90 in {time.perf_counter() - t0:.2f} s (cached after the first time):")
    for name, res in sorted(binary.resources.items()):
        print(f"     {name:28s} {res.registers:3d} registers, {res.stack_frame_bytes} B stack, "
              f"{res.spill_store_bytes} B spills")
    return 0


def _gpu_demo() -> int:
    import torch

    from . import runtime
    from .bench import sync
    from .bench.timing import time_cuda_ms

    facts = runtime.device_facts()
    print(f"{facts.name}: {facts.sm_count} SMs, {facts.registers_per_sm // 1024}K registers and "
          f"{facts.shared_per_sm // 1024} KB shared memory per SM\n")

    H, T, B = 256, 100, 1
    lstm = torch.nn.LSTM(H, H).cuda()
    x = torch.randn(T, B, H, device="cuda")
    with torch.no_grad():
        cudnn_ms = time_cuda_ms(lambda: lstm(x), warmup=3, repeats=20)
    print(f"cuDNN through torch, LSTM H={H}, T={T}, batch {B}: {cudnn_ms:.3f} ms = {cudnn_ms * 1e3 / T:.2f} µs per step")

    r = sync.Runner(sync.SyncConfig(steps=5_000, repeats=5))
    k = r.kernel("cluster_exchange_stasync")
    state = torch.empty(H, device="cuda")
    cluster = 8
    cfg = k.config(cluster, sync.BLOCK, shared=sync.exchange_shared_bytes("cluster_exchange_stasync", H), cluster=cluster)
    us = r.per_step_us("cluster_exchange_stasync", cfg, lambda s: runtime.kernel_args(state, H, s, r.status))
    print(f"persistent kernel floor: exchanging h (H={H}) across a cluster of {cluster} blocks: {us:.2f} µs per step")
    print(f"\nThe synchronisation a persistent LSTM needs per step costs {cudnn_ms * 1e3 / T / us:.0f}x less than")
    print("a step of cuDNN here. Full table: python -m persistrnn.bench sync")
    return 0


def _plan_parser(command: str):
    import argparse

    from .cells import CELLS
    from .persistent import DTYPES
    from .plan import DEFAULT_K, DEFAULT_STEPS

    what = ("time the cost model's top K configurations, the fallback and cuDNN, and cache the fastest"
            if command == "tune" else "print the plan and the cost model's ranking")
    p = argparse.ArgumentParser(prog=f"python -m persistrnn {command}", description=f"{command}: {what}")
    p.add_argument("--cell", required=True, choices=sorted(CELLS))
    p.add_argument("--input-size", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--batch", type=int, nargs="+", required=True, help="one or more batch sizes")
    if command == "tune":
        p.add_argument("--k", type=int, default=DEFAULT_K, help="configurations to compile and time")
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="sequence length to time")
        p.add_argument("--refresh", action="store_true", help="tune again even if a choice is cached")
    return p


def _plan_command(command: str, argv: list[str]) -> int:
    from . import plan
    from .runtime import GPUUnavailableError

    args = _plan_parser(command).parse_args(argv)
    try:
        shape = plan.ModelShape(args.cell, args.input_size, args.hidden_size, args.layers, args.dtype,
                                args.bidirectional)
        for batch in args.batch:
            if command == "tune":
                print(plan.tune(shape, batch, k=args.k, steps=args.steps, refresh=args.refresh).describe())
            else:
                plan.explain(shape, batch)
    except (GPUUnavailableError, ValueError) as exc:
        print(f"persistrnn {command}: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else "demo"
    if command == "demo":
        import torch

        return _gpu_demo() if torch.cuda.is_available() else _cpu_demo()
    if command == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    if command in ("tune", "explain"):
        return _plan_command(command, argv[1:])
    print(f"unknown command {command!r}; expected 'demo' (the default), 'bench <suite>', 'tune' or 'explain'",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
