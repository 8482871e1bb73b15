"""The fallback's per-step recurrent GEMM, ``h @ W_hh^T`` (+ b_hh), with
W_hh as torch keeps it (G*H, H), read through the transposed view (what
``fallback._run_steps`` hands cuBLAS), against a copy transposed once,
(H, G*H) contiguous, and against the transposed product ``W_hh @ h^T``
(G*H, B), W_hh as it is: device µs per GEMM (CUDA events around 200 GEMMs back
to back, replayed from one CUDA graph, median of 7 rounds, the three alternated), under torch's
fp32 matmul precision "highest" (exact fp32) unless ``--matmul-precision``.

    PYTHONPATH=. python scripts/fallback_gemm_layout.py [--hidden 256 1024 2048] [--batch 1 8 32 64]
"""
import argparse
import statistics

import torch

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024, 2048])
parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
parser.add_argument("--gates", type=int, default=4)
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
parser.add_argument("--matmul-precision", choices=("highest", "high"), default="highest")
parser.add_argument("--blas", choices=("cublas", "cublaslt"), default="cublas",
                    help="torch.backends.cuda.preferred_blas_library for the GEMMs")
args = parser.parse_args()
torch.set_float32_matmul_precision(args.matmul_precision)
torch.backends.cuda.preferred_blas_library(args.blas)
dtype = getattr(torch, args.dtype)
kwargs = {} if dtype == torch.float32 else {"out_dtype": torch.float32}


def graphed(run, calls=200):
    """``calls`` of ``run`` captured in one CUDA graph: a replay times the GPU's work, not the launches."""
    run()  # cuBLAS's workspace and heuristics, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    return graph


def timed(graph, calls=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


a = torch.randn(4096, 4096, device="cuda")
for _ in range(50):  # steady clocks before timing
    a @ a
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, matmul precision "
      f"{args.matmul_precision}, {args.blas}; µs per GEMM")
print("| H | batch | W_hh^T view | W_hh^T contiguous | (W_hh h^T)^T | view / contiguous | view / transposed |")
print("|---|---|---|---|---|---|---|")
for H in args.hidden:
    w = (torch.randn(args.gates * H, H, device="cuda") * H ** -0.5).to(dtype)
    bias = torch.randn(args.gates * H, device="cuda")
    view, wt = w.t(), w.t().contiguous()
    for B in args.batch:
        h = torch.randn(B, H, device="cuda").to(dtype)
        out = torch.empty(B, args.gates * H, device="cuda")
        out_t, h_t, bias_t = torch.empty(args.gates * H, B, device="cuda"), h.t().contiguous(), bias[:, None]
        runs = {"view": graphed(lambda h=h, w=view, out=out, bias=bias: torch.addmm(bias, h, w, out=out, **kwargs)),
                "contiguous": graphed(lambda h=h, w=wt, out=out, bias=bias: torch.addmm(bias, h, w, out=out,
                                                                                          **kwargs)),
                "transposed": graphed(lambda h=h_t, w=w, out=out_t, bias=bias_t: torch.addmm(bias, w, h, out=out,
                                                                                              **kwargs))}
        for graph in runs.values():
            timed(graph)
        times = {name: [] for name in runs}
        for _ in range(7):
            for name, graph in runs.items():
                times[name].append(timed(graph))
        through_view, contiguous, transposed = (statistics.median(times[name]) for name in runs)
        print(f"| {H} | {B} | {through_view:.1f} | {contiguous:.1f} | {transposed:.1f} | "
              f"{through_view / contiguous:.2f} | {through_view / transposed:.2f} |", flush=True)
