"""Where one persistent configuration's warps stall, instruction by instruction.

Runs one forward of a forced configuration (compiled and warmed first), with
the CUDA profiler range around it only, so that Nsight Compute can sample it:

    ncu --profile-from-start off -k regex:prnn_recurrence --section SourceCounters \
        --section WarpStateStats -o prof python scripts/stall_profile.py --config cluster,11,128,8
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/stall_profile.py --summarise sass.csv

The summary prints the SASS instructions with the most warp samples, each with
its stall reasons, and the samples of the step loop's landmarks (barriers,
shuffles, transcendental units, shared loads) added up.

``--tree-lstm BATCH [BATCH ...]`` profiles the dynamic interpreter instead:
for each batch (the first batch of that many SST train trees, the Tree-LSTM
of ``bench treelstm``) it prints the stages, instructions and median device
time of a training and an inference launch, then where an instrumented
launch of each spent its time, per opcode (``Interpreter(profile=True)``:
each block's SM cycles from an instruction's start to the barrier that ends
it); last, one inference launch of the first batch for Nsight Compute
(``-k regex:dynamic_interpreter``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter


def run(cell: str, hidden: int, batch: int, steps: int, config: str) -> None:
    import torch

    from persistrnn import persistent

    sync, blocks, threads, group = config.split(",")[:4]
    extra = dict(kv.split("=") for kv in config.split(",")[4:])
    cfg = persistent.KernelConfig(cell, hidden, sync, int(blocks), int(threads), int(group), 1,
                                  **{k: (v == "True") if v in ("True", "False") else int(v) for k, v in extra.items()})
    gates = cfg.spec.num_gates
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    w_ih, w_hh = (torch.randn(gates * hidden, hidden, generator=g) * hidden ** -0.5 for _ in range(2))
    b_ih, b_hh = (torch.randn(gates * hidden, generator=g) * 0.1 for _ in range(2))
    x = torch.randn(steps, batch, hidden, generator=g)
    h0 = torch.randn(batch, hidden, generator=g)
    c0 = torch.randn(batch, hidden, generator=g) if cfg.spec.has_cell_state else None
    w_ih, w_hh, b_ih, b_hh, x, h0 = (t.to(dev) for t in (w_ih, w_hh, b_ih, b_hh, x, h0))
    c0 = c0.to(dev) if c0 is not None else None
    xw = persistent.input_projection(x, w_ih, b_ih)
    for _ in range(3):
        persistent.run_recurrence(cfg, xw, w_hh, b_hh, h0, c0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    persistent.run_recurrence(cfg, xw, w_hh, b_hh, h0, c0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(cfg)


def run_tree_lstm(batches: list[int], placement: str, suite: str = "treelstm") -> None:
    import torch

    from persistrnn import dynamic
    from persistrnn.bench.tagger import WORKLOADS
    from persistrnn.runtime.timing import time_cuda_ms, warm_up
    from persistrnn.bench.treelstm import Settings, consecutive_batches

    work = WORKLOADS[suite](Settings(), torch.device("cuda"))
    interp = dynamic.Interpreter(work.model, optimizer=dynamic.SGD(0.05), placement=placement)
    instrumented = dynamic.Interpreter(work.model, optimizer=dynamic.SGD(0.05), placement=placement, profile=True)
    print(f"placement {placement}: {interp.layout}")
    interp.load()
    instrumented.load()
    scripts = []
    for batch in batches:
        graph = dynamic.Graph(work.model)
        work.add_batch(graph, consecutive_batches(work.inputs, batch, 1)[0])
        scripts.append(interp.schedule(graph, train=False))
        for train in (True, False):
            timed = interp.schedule(graph, train=train)
            warm_up(lambda timed=timed: interp.launch(timed))  # steady clocks before the timing
            ms = time_cuda_ms(lambda timed=timed: interp.launch(timed), warmup=3, repeats=20)
            print(f"{suite} batch {batch}, {'training' if train else 'inference'}: {len(graph)} nodes, "
                  f"{timed.stages} stages, {timed.instructions} instructions on {interp.blocks} blocks, {ms:.3f} ms "
                  f"a launch ({ms * 1e3 / timed.stages:.2f} µs a stage)")
            launched = instrumented.launch(timed)
            launched.result()
            print("  instrumented launch, per opcode: instructions, mean µs each, µs summed over blocks, "
                  "largest block's µs")
            for row in sorted(dynamic.profile_table(launched), key=lambda r: -r["largest_block_us"]):
                print(f"  {row['op']:18s} {row['instructions']:8d} {row['mean_us']:9.3f} {row['total_us']:11.1f} "
                      f"{row['largest_block_us']:9.1f}")
    script = scripts[0]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    interp.launch(script).result()
    torch.cuda.cudart().cudaProfilerStop()


def summarise(path: str, top: int) -> None:
    lines = open(path, newline="").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))  # after the kernel's name
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        sys.exit(f"{path}: no rows")
    columns = list(rows[0])
    sampled = next(c for c in columns if c.startswith("Warp Stall Sampling (All"))
    stall_columns = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]

    def value(row, column):
        text = (row.get(column) or "0").replace(",", "")
        try:
            return float(text)
        except ValueError:
            return 0.0

    total = sum(value(r, sampled) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} warp samples ({sampled})")
    groups = Counter()
    for r in rows:
        op = r["Source"].split()[0] if r["Source"].split() else ""
        if op.startswith("@"):
            op = r["Source"].split()[1]
        groups[op.split(".")[0]] += value(r, sampled)
    print("by opcode:", ", ".join(f"{op} {n / total:.1%}" for op, n in groups.most_common(14)))
    print(f"\ntop {top} instructions (address, samples, share, top stall reasons, SASS):")
    for r in sorted(rows, key=lambda r: -value(r, sampled))[:top]:
        reasons = sorted(((value(r, c), c) for c in stall_columns), reverse=True)[:3]
        why = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for v, c in reasons if v > 0)
        print(f"{r.get('Address', '?'):>8} {value(r, sampled):8.0f} {value(r, sampled) / total:6.1%}  {why:60s} "
              f"{r['Source']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", default="lstm")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--config", default="cluster,11,128,8", help="sync,blocks,threads,group_size[,k=v...]")
    parser.add_argument("--summarise", metavar="CSV", help="print the summary of ncu's source page instead")
    parser.add_argument("--tree-lstm", type=int, nargs="+", metavar="BATCH",
                        help="profile the dynamic interpreter's Tree-LSTM at these batches instead")
    parser.add_argument("--suite", default="treelstm", choices=("treelstm", "tagger"),
                        help="the dynamic workload --tree-lstm profiles (the tagger's BiLSTM likewise)")
    parser.add_argument("--placement", default="replicate",
                        help="the interpreter's placement (--tree-lstm; the Interpreter's default)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise, args.top)
    elif args.tree_lstm:
        run_tree_lstm(args.tree_lstm, args.placement, args.suite)
    else:
        run(args.cell, args.hidden, args.batch, args.steps, args.config)


if __name__ == "__main__":
    main()
