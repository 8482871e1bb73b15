"""``python -m persistrnn``: the demo, and the entry to the other commands.

The demo is the library's main job: a model with a 2-layer LSTM inside, as an
application has it, run through :func:`persistrnn.convert` beside the same
``torch.nn`` model on the same GPU. For batch 1 and 8 it prints how far the
outputs are apart (and each one's error against float64), the plan the
converted model runs, and both models' eager call times. It needs a GPU: on a
machine without one it says so and exits with status 2.
"""

from __future__ import annotations

import sys
import time

USAGE = """usage: python -m persistrnn [demo | bench <suite> ... | tune ... | explain ... | onnx model.onnx]

  demo      (the default) a 2-layer LSTM model through persistrnn.convert beside torch.nn: outputs, plan, times
  bench     the benchmark suites (python -m persistrnn bench --help)
  tune      tune the plan of a model shape and cache it (python -m persistrnn tune --help)
  explain   print the plan of a model shape and the cost model's ranking (python -m persistrnn explain --help)
  onnx      an ONNX model on persistrnn modules: what runs where, time against ONNX Runtime (onnx --help)"""

FEATURES, HIDDEN, LAYERS, CLASSES, STEPS, BATCHES = 256, 256, 2, 32, 100, (1, 8)
REPEATS = 20


def _demo_model():
    """A sequence tagger: a 2-layer LSTM over the steps, a linear read-out per step."""
    import torch

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(FEATURES, HIDDEN, num_layers=LAYERS)
            self.head = torch.nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):
            out, _ = self.rnn(x)
            return self.head(out)

    return Tagger()


def _errors(got, want) -> tuple[float, float]:
    """(max |got - want|, ‖got - want‖ / ‖want‖), in float64."""
    diff = got.double().cpu() - want.double().cpu()
    return float(diff.abs().max()), float(diff.norm() / want.double().cpu().norm().clamp_min(1e-30))


def _eager_ms(module, x) -> float:
    """Median ms of an eager call, timed with CUDA events after warm-up."""
    import torch

    from . import runtime

    def call() -> None:
        with torch.no_grad():
            module(x)

    runtime.warm_up(call)  # steady clocks first: an idle GPU's first timings read several times slow
    return runtime.time_cuda_ms(call, warmup=3, repeats=REPEATS)


def _demo() -> int:
    import copy
    import logging

    import torch

    import persistrnn

    from . import runtime
    from .errors import GPUUnavailableError

    try:
        facts = runtime.device_facts()
    except GPUUnavailableError as exc:
        print(f"python -m persistrnn: the demo needs a GPU. {exc}\n"
              "The tests run without one (python -m pytest; the GPU tests are skipped, with the reason).",
              file=sys.stderr)
        return 2

    # Planning a new shape on first use (and, once per GPU, calibrating the
    # cost model) takes seconds: the library logs what it is doing.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("  [persistrnn] %(message)s"))
    log = logging.getLogger("persistrnn")
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    torch.manual_seed(0)
    model = _demo_model().cuda().eval()
    ours = persistrnn.convert(copy.deepcopy(model))  # the same weights; every nn.LSTM inside swapped
    reference = copy.deepcopy(model).double().cpu()
    tf32 = persistrnn.runtime.cudnn_rnn_precision() == "tf32"
    print(f"{facts.name}, {facts.sm_count} SMs; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"model: LSTM({FEATURES}, {HIDDEN}, num_layers={LAYERS}) -> Linear({HIDDEN}, {CLASSES}) per step, "
          f"{STEPS} steps, fp32, eval; torch.nn beside persistrnn.convert(model)")
    print("The first call of a new shape plans it, a few seconds (the first on a new GPU also calibrates the cost "
          "model); both are cached on disk.\n")
    for batch in BATCHES:
        x = torch.randn(STEPS, batch, FEATURES, device="cuda")
        with torch.no_grad():
            started = time.perf_counter()
            got = ours(x)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            want = model(x)
            exact = reference(x.double().cpu())
        plan = ours.rnn.plan_for(batch)
        max_abs, relative = _errors(got, want)
        print(f"batch {batch}")
        print(f"  plan ({first_s:.1f} s for the first call):")
        print("    " + plan.describe().replace("\n", "\n    "))
        print(f"  outputs: persistrnn against torch.nn: max |difference| {max_abs:.2e}, relative {relative:.2e}")
        print(f"           against float64: persistrnn {_errors(got, exact)[1]:.2e}, "
              f"torch.nn {_errors(want, exact)[1]:.2e}" + (" (torch's default: cuDNN may use TF32)" if tf32 else ""))
        torch_ms, ours_ms = _eager_ms(model, x), _eager_ms(ours, x)
        print(f"  eager call, median of {REPEATS} (CUDA events, after warm-up): torch.nn {torch_ms:.3f} ms, "
              f"persistrnn {ours_ms:.3f} ms ({torch_ms / ours_ms:.2f}x)\n")
    print("More: python -m persistrnn bench real-models (graph replays, ONNX Runtime and the CPU beside cuDNN)")
    return 0


def _plan_parser(command: str):
    import argparse

    from .cells import CELLS
    from .persistent import DTYPES
    from .plan.tuner import DEFAULT_K, DEFAULT_STEPS

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
    p.add_argument("--matmul-precision", choices=("highest", "high", "medium"), default=None,
                   help="torch's fp32 matmul precision to plan under ('high' or 'medium': fp32 layers may run TF32 "
                        "tensor cores); default: the process's")
    if command == "tune":
        p.add_argument("--k", type=int, default=DEFAULT_K, help="configurations to compile and time")
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="sequence length to time")
        p.add_argument("--refresh", action="store_true", help="tune again even if a choice is cached")
    return p


def _plan_command(command: str, argv: list[str]) -> int:
    from . import plan
    from .errors import GPUUnavailableError

    args = _plan_parser(command).parse_args(argv)
    if args.matmul_precision:
        import torch

        torch.set_float32_matmul_precision(args.matmul_precision)
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
        return _demo()
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if command == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    if command in ("tune", "explain"):
        return _plan_command(command, argv[1:])
    if command == "onnx":
        from .onnx_import import main as onnx_main

        return onnx_main(argv[1:])
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
