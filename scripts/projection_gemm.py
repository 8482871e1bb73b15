"""The input projection x @ W_ih^T + b_ih as a forward's graph replays it:
each way of asking torch for it, timed per shape (CUDA events over graph
replays, median of 20 after a warm-up), with the device events of one replay.

    python scripts/projection_gemm.py            (needs a GPU)

A probe for perf-notes §68: at LSTM 64, T=100, batch 1 the planned
``torch.addmm`` took cuBLASLt's split-K path (a workspace memset, a scale
kernel, the GEMM and a separate bias epilogue: ~13.5 µs of kernels in a 73 µs
forward).
"""

import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from persistrnn.runtime import capture_graph
from persistrnn.runtime.timing import time_cuda_ms, warm_up


def variants(dtype: torch.dtype):
    if dtype == torch.float32:
        return {
            "addmm(b)": lambda x, w, b: torch.addmm(b, x, w.t()),
            "mm": lambda x, w, b: torch.mm(x, w.t()),
            "mm + b": lambda x, w, b: torch.mm(x, w.t()).add_(b),
            "addmm(b expanded)": lambda x, w, b: torch.addmm(b.expand(x.shape[0], w.shape[0]), x, w.t()),
        }
    return {
        "addmm(b.float(), fp32 out)": lambda x, w, b: torch.addmm(b.float(), x, w.t(), out_dtype=torch.float32),
        "addmm(b, fp32 out)": lambda x, w, b: torch.addmm(b, x, w.t(), out_dtype=torch.float32),
        "mm(fp32 out)": lambda x, w, b: torch.mm(x, w.t(), out_dtype=torch.float32),
        "mm(fp32 out) + b": lambda x, w, b: torch.mm(x, w.t(), out_dtype=torch.float32).add_(b),
    }


def kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    found = sorted(((e.time_range.start, e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA))
    return [f"{name[:48]} {dur:.1f}" for _, name, dur in found]


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"BLAS {torch.backends.cuda.preferred_blas_library()}")
    shapes = [(m, i, n) for i, n in ((64, 256), (64, 192), (128, 512), (256, 1024), (256, 768), (1024, 4096))
              for m in (20, 100, 160, 800, 2000)]
    for dtype in (torch.float32, torch.float16):
        for M, K, N in shapes:
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            w = torch.randn(N, K, device="cuda", dtype=dtype)
            b = torch.randn(N, device="cuda", dtype=dtype)
            cells = []
            for name, fn in variants(dtype).items():
                graph = capture_graph(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b))
                warm_up(graph.replay, budget_ms=20)
                us = statistics.median(time_cuda_ms(graph.replay, warmup=3, repeats=20) for _ in range(3)) * 1000
                cells.append(f"{name}: {us:5.1f} µs [{' | '.join(kernels(graph))}]")
            print(f"\n{str(dtype)[6:]} M={M} K={K} N={N}")
            for c in cells:
                print("  " + c)


if __name__ == "__main__":
    main()
