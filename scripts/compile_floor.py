"""What torch.compile's default mode costs the host per call before any work
of ours: host µs per call (back to back, median of interleaved rounds) of
compiled modules whose forward is one stand-in operator that only allocates
its outputs, with the persistrnn operator's schema and 8 weight tensors (a
2-layer LSTM's), or with one flat weight tensor; beside ``x + 1`` compiled,
and, on CUDA, the persistrnn module of the same shape eager and compiled,
and the eager call's device time (CUDA events). Where the stand-in's compiled
call already costs more host time than the eager call's device time, no
operator of that signature can make the compiled call device-bound.

    PYTHONPATH=. python scripts/compile_floor.py [--device cuda] [--batch 1] [--calls 1000] [--rounds 9]
"""

import argparse
import statistics
import time

import torch

HIDDEN, LAYERS, STEPS = 128, 2, 50
LIB = torch.library.Library("prnn_floor", "DEF")
LIB.define("forward(Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
           "bool bidirectional, bool has_biases) -> (Tensor, Tensor, Tensor)")
LIB.define("forward_flat(Tensor x, Tensor weights) -> (Tensor, Tensor, Tensor)")


def _outputs(x):
    states = (LAYERS, x.shape[1], HIDDEN)
    return x.new_empty(x.shape[0], x.shape[1], HIDDEN), x.new_empty(states), x.new_empty(states)


def _stand_in(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases):
    return _outputs(x)


def _stand_in_flat(x, weights):
    return _outputs(x)


for name, fn in (("forward", _stand_in), ("forward_flat", _stand_in_flat)):
    LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"prnn_floor::{name}", fn, lib=LIB)


class EightWeights(torch.nn.Module):
    """A 2-layer LSTM's parameters, torch's names, passed as a list."""

    def __init__(self):
        super().__init__()
        self.names = []
        for layer in range(LAYERS):
            for kind, shape in (("weight_ih", (4 * HIDDEN, HIDDEN)), ("weight_hh", (4 * HIDDEN, HIDDEN)),
                                ("bias_ih", (4 * HIDDEN,)), ("bias_hh", (4 * HIDDEN,))):
                self.names.append(f"{kind}_l{layer}")
                setattr(self, self.names[-1], torch.nn.Parameter(torch.randn(shape)))

    def forward(self, x):
        out, h, c = torch.ops.prnn_floor.forward(x, None, None, [getattr(self, n) for n in self.names], "lstm",
                                                 LAYERS, False, True)
        return out, (h, c)


class FlatWeights(torch.nn.Module):
    """The same floats as one parameter."""

    def __init__(self):
        super().__init__()
        self.flat = torch.nn.Parameter(torch.randn(LAYERS * (8 * HIDDEN * HIDDEN + 8 * HIDDEN)))

    def forward(self, x):
        out, h, c = torch.ops.prnn_floor.forward_flat(x, self.flat)
        return out, (h, c)


class PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    torch._dynamo.config.allow_rnn = True
    x = torch.randn(STEPS, args.batch, HIDDEN, device=device)
    calls = {
        "compiled x + 1 (function)": torch.compile(lambda t: t + 1, fullgraph=True),
        "compiled module, no parameters, x + 1": torch.compile(PlusOne().to(device), fullgraph=True),
        "compiled stand-in operator, 8 weights": torch.compile(EightWeights().to(device), fullgraph=True),
        "compiled stand-in operator, 1 flat weight": torch.compile(FlatWeights().to(device), fullgraph=True),
        "eager stand-in operator, 8 weights": EightWeights().to(device),
    }
    device_ms = None
    if device.type == "cuda":
        import persistrnn

        model = persistrnn.LSTM(HIDDEN, HIDDEN, num_layers=LAYERS).to(device).eval()
        calls["persistrnn eager"] = model
        calls["persistrnn compiled"] = torch.compile(model, fullgraph=True)
        for _ in range(200):
            model(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                model(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 50 * 1000)
        device_ms = statistics.median(times)
    for fn in calls.values():
        for _ in range(200):
            fn(x)
    host = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn(x)
            host[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"device {device}, torch {torch.__version__}, batch {args.batch}, {args.calls} calls x {args.rounds} rounds")
    if device_ms is not None:
        print(f"persistrnn eager, CUDA events: {device_ms:.1f} µs per call")
    print(f"{'host µs per call':<44} {'median':>7} {'min':>7}")
    for name, times in host.items():
        print(f"{name:<44} {statistics.median(times):7.1f} {min(times):7.1f}")


if __name__ == "__main__":
    main()
