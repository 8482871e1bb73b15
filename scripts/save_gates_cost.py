"""What a training forward's saved gates and cell states cost the kernel:
per case, the training configuration (``training.training_config``) timed
with ``save_gates`` (every step's gate products and c written to global
memory, as a training forward runs it) and the same configuration without
it (an inference launch), device ms per 100-step forward from CUDA-graph
replays (``tuner.time_forward_ms``), the two alternated over rounds.

    PYTHONPATH=. python scripts/save_gates_cost.py [--cases lstm:1024:8:float32 ...]
"""
import argparse
import dataclasses
import statistics

import torch

from persistrnn import cells, persistent, training
from persistrnn.plan import tuner

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--cases", nargs="+", default=[
    "lstm:256:8:float32", "lstm:1024:1:float32", "lstm:1024:8:float32", "rnn_relu:1152:4:float32",
    "lstm:1024:16:bfloat16"])
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
T = 100


def run_case(case):
    cell, hidden, batch, dtype = case.split(":")
    H, B = int(hidden), int(batch)
    config, batch_slice = training.training_config(cell, H, B, dtype, torch.cuda.current_device())
    spec = cells.get_cell(cell)
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return ((torch.rand(*shape, device="cuda", generator=gen) * 2 - 1) * H ** -0.5).to(dt)

    xw = torch.randn(T, B, spec.num_gates * H, device="cuda", generator=gen)
    w_hh, b_hh, h0 = rand(spec.num_gates * H, H), rand(spec.num_gates * H), rand(B, H)
    c0 = rand(B, H) if spec.has_cell_state else None
    out, h_n = torch.empty(T, B, H, device="cuda", dtype=dt), torch.empty(B, H, device="cuda", dtype=dt)
    c_n = torch.empty_like(h_n) if c0 is not None else None
    gates, cs = torch.empty(T, B, spec.num_gates * H, device="cuda"), torch.empty(T, B, H, device="cuda")

    def launch(save):
        chosen = config if save else dataclasses.replace(config, save_gates=False)

        def run():
            persistent.run_instances(chosen, [persistent.Instance(
                xw, w_hh, b_hh, h0, c0, out, h_n, c_n, saved_gates=gates if save else None,
                saved_c=cs if save and c0 is not None else None)], T, B, batch_slice=batch_slice, check=False)
        return run

    times = {True: [], False: []}
    for _ in range(args.rounds):
        for save in (False, True):
            times[save].append(tuner.time_forward_ms(launch(save)))
    plain, saved = statistics.median(times[False]), statistics.median(times[True])
    print(f"{case} {tuner.config_label(config, batch_slice)}: without saving {plain:.3f} ms, with {saved:.3f} ms "
          f"(+{(saved - plain) * 1e3 / T:.2f} us per step)", flush=True)


for case in args.cases:
    run_case(case)
