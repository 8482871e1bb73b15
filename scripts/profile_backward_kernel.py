"""The persistent backward kernel alone (``training_kernel.persistent_steps``)
beside the per-step launches it replaces (``training._fused_steps``), one
layer direction, T=100, fp32: device ms per direction and µs per step, each
launch queued behind a GPU sleep so that only the GPU's work is timed
(medians of ``--repeats`` after a warm-up to steady clocks), and the sync
mode (cluster or grid) and block count the kernel ran with.

    PYTHONPATH=. python scripts/profile_backward_kernel.py --cell lstm --hidden 256 1024 --batch 1 8 32

``--tagged-ab``: instead, on a grid, the exchange as tagged words and
through the counter barrier (``training_kernel.TAGGED_MAX_BATCH`` set past
the batch, then to 0), alternated over ``--repeats`` rounds in one process,
device ms of each (median).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from profile_training import STEPS, timings  # noqa: E402
from test_training import direction_inputs  # noqa: E402

from persistrnn import cells, runtime, training, training_kernel  # noqa: E402


def direction_call(steps_backward, cell, hidden, batch):
    """One direction's ``steps_backward`` on random inputs, into buffers made once."""
    spec = cells.get_cell(cell)
    t = {k: None if v is None else v.to("cuda", torch.float32)
         for k, v in direction_inputs(cell, steps=STEPS, batch=batch, hidden=hidden, seed=hidden + batch).items()}
    d_xw, d_gates = torch.empty_like(t["xw"]), torch.empty_like(t["gates"])
    operands = torch.empty(spec.num_stages - 1, STEPS, batch, hidden, device="cuda")
    return lambda: steps_backward(spec, t["xw"], t["gates"], t["h_prev"], t["c_prev"], t["w_hh"], t["d_out"],
                                  t["dh_n"], t["dc_n"], False, d_xw, d_gates, operands)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", nargs="+", default=["lstm"], choices=sorted(cells.CELLS))
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tagged-ab", action="store_true")
    args = ap.parse_args()
    if args.tagged_ab:
        tagged_ab(args)
        return
    print(f"One direction, T={STEPS}, fp32; device ms (queued behind a GPU sleep), medians of {args.repeats}.")
    print("| cell | H | batch | kernel | persistent ms | µs per step | per-step launches ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in args.cell:
        for hidden in args.hidden:
            for batch in args.batch:
                device = torch.cuda.current_device()
                if not training_kernel.fits(cell, hidden, batch, device):
                    print(f"| {cell} | {hidden} | {batch} | does not fit | | | | |")
                    continue
                config = training_kernel._prepared(cells.get_cell(cell), hidden, batch, device)[0]
                ours = direction_call(training_kernel.persistent_steps, cell, hidden, batch)
                fused = direction_call(training._fused_steps, cell, hidden, batch)
                runtime.warm_up(ours)
                ms = timings(ours, lambda: None, args.repeats)[2]
                fused_ms = timings(fused, lambda: None, args.repeats)[2]
                print(f"| {cell} | {hidden} | {batch} | {config.sync} of {config.blocks} | {ms:.3f} | "
                      f"{ms * 1e3 / STEPS:.2f} | {fused_ms:.3f} | {fused_ms / ms:.1f}× |", flush=True)


def use_tagged(tagged, cell, hidden, batch, call):
    """Run ``call`` on the grid's tagged exchange or its counter barrier: the
    launch's configuration is prepared (and cached) on the call after this."""
    training_kernel.TAGGED_MAX_BATCH = batch if tagged else 0
    training_kernel._prepared.cache_clear()
    config = training_kernel._prepared(cells.get_cell(cell), hidden, batch, torch.cuda.current_device())[0]
    assert config.sync == "grid" and config.tagged == tagged, config
    call()
    return config.blocks


def tagged_ab(args):
    import statistics

    print(f"One direction on a grid, T={STEPS}, fp32; device ms (queued behind a GPU sleep): tagged words against "
          f"the counter barrier, alternated over {args.repeats} rounds, medians.")
    print("| cell | H | batch | blocks | tagged ms | barrier ms | tagged µs per step | barrier µs per step |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in args.cell:
        for hidden in args.hidden:
            for batch in args.batch:
                call = direction_call(training_kernel.persistent_steps, cell, hidden, batch)
                times, blocks = {True: [], False: []}, None
                for tagged in (True, False):
                    use_tagged(tagged, cell, hidden, batch, call)
                    runtime.warm_up(call)
                for _ in range(args.repeats):
                    for tagged in (True, False):
                        blocks = use_tagged(tagged, cell, hidden, batch, call)
                        times[tagged].append(timings(call, lambda: None, 3)[2])
                ms = {tagged: statistics.median(t) for tagged, t in times.items()}
                print(f"| {cell} | {hidden} | {batch} | {blocks} | {ms[True]:.3f} | {ms[False]:.3f} | "
                      f"{ms[True] * 1e3 / STEPS:.2f} | {ms[False] * 1e3 / STEPS:.2f} |", flush=True)


if __name__ == "__main__":
    main()
