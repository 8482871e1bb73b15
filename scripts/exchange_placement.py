"""Does a grid exchange's time depend on where its buffer lands? The same
planned forward captured again and again in one process (each capture takes
its scratch, the status word, counters and exchange buffer, from a new place
in the graph's pool), then with the exchange buffer moved by a forced offset
inside a larger allocation; each capture's graph timed by CUDA events
(median of several timings after a warm-up) beside the buffer's address.

    python scripts/exchange_placement.py lstm 1024 1 --captures 12 --offsets 0 128 1024 4096 65536
"""

import argparse
import statistics

import torch

import persistrnn
from persistrnn import runtime
from persistrnn.runtime import capture_graph, time_cuda_ms, warm_up
from persistrnn.runtime.launch import SCRATCH_WORDS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cell", choices=("lstm", "gru"))
    ap.add_argument("hidden", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--captures", type=int, default=12, help="captures at the natural placement")
    ap.add_argument("--offsets", type=int, nargs="*", default=[0, 128, 1024, 4096, 65536],
                    help="bytes to move the exchange buffer by (multiples of 128), two captures each")
    args = ap.parse_args()
    torch.manual_seed(0)
    ref = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[args.cell](args.hidden, args.hidden).cuda().eval()
    ours = persistrnn.from_torch(ref).eval()
    x = torch.randn(args.steps, args.batch, args.hidden, device="cuda")
    plan = ours.plan_for(args.batch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; plan: {plan.path} {plan.config} "
          f"slice={plan.batch_slice}")
    real_scratch = runtime.scratch
    placed: list[runtime.Scratch] = []
    shift = [0]

    def scratch(device, exchange_floats=0, counters=SCRATCH_WORDS - 1):
        extra = shift[0] // 4 if exchange_floats else 0
        own = real_scratch(device, exchange_floats + extra, counters)
        if extra:
            own = runtime.Scratch(own.words, own.status, own.counters, own.exchange + 4 * extra)
        placed.append(own)
        return own

    runtime.scratch = scratch
    rows = []

    def one(label: str) -> None:
        placed.clear()
        with torch.no_grad():
            graph = capture_graph(lambda: ours(x))
        warm_up(graph.replay)
        times = [time_cuda_ms(graph.replay, warmup=3, repeats=10) * 1e3 for _ in range(5)]
        ex = placed[-1].exchange if placed else 0
        st = placed[-1].status if placed else 0
        rows.append((label, statistics.median(times), min(times), max(times), ex, st))
        print(f"{label:<22} median {statistics.median(times):7.1f} µs (min {min(times):7.1f}, max {max(times):7.1f})"
              f"  exchange 0x{ex:x} (mod 2 MiB 0x{ex % (2 << 20):06x})  status 0x{st:x}", flush=True)
        del graph

    with torch.no_grad():
        ours(x)
    for i in range(args.captures):
        one(f"natural #{i}")
    for offset in args.offsets:
        shift[0] = offset
        for i in range(2):
            one(f"offset {offset} #{i}")
    shift[0] = 0
    med = [r[1] for r in rows]
    print(f"over {len(rows)} captures: {min(med):.1f}-{max(med):.1f} µs, median {statistics.median(med):.1f}")


if __name__ == "__main__":
    main()
