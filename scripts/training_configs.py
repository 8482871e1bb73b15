"""Which kernel configuration a training forward runs (``training.training_config``)
beside what the inference plan at that shape timed: per case, the plan's path,
its persistent candidates' device ms (CUDA-graph replays of a 100-step
inference forward, from the plan's own timing), and the training choice's
label and, where the plan timed it, its ms; the fallback's ms and whether
the training forward runs it (``training.fallback_trains_forward``).

    PYTHONPATH=. python scripts/training_configs.py [--cases lstm:1024:8:float32 ...]
"""
import argparse
import math

import torch

from persistrnn import plan as planner
from persistrnn import runtime, training
from persistrnn.plan import tuner

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--cases", nargs="+", default=[
    "lstm:256:32:float32", "lstm:1024:1:float32", "lstm:1024:8:float32", "lstm:1024:32:float32",
    "rnn_relu:1152:4:float32", "rnn_relu:1152:16:float32", "lstm:1024:16:bfloat16"])
parser.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                    help="torch's fp32 matmul precision ('high': TF32 plans for fp32 layers)")
args = parser.parse_args()
device = torch.cuda.current_device()
with runtime.matmul_precision(args.matmul_precision):
    for case in args.cases:
        cell, hidden, batch, dtype = case.split(":")
        hidden, batch = int(hidden), int(batch)
        chosen = planner.cached_plan(planner.ModelShape(cell, hidden, hidden, 1, dtype), batch)
        persistent = sorted((ms, label) for label, ms in chosen.measured_ms.items()
                            if label.startswith("persistent") and not math.isnan(ms))
        launch = training.training_config(cell, hidden, batch, dtype, device)
        label = tuner.config_label(*launch) if launch else None  # the label leaves save_gates out
        planned_ms = chosen.measured_ms.get(chosen.label, float("nan"))
        print(f"{case}: plan {chosen.path} ({chosen.label}, {planned_ms:.3f} ms); "
              f"cuDNN {chosen.measured_ms.get('cudnn', float('nan')):.3f} ms; "
              f"fallback {chosen.measured_ms.get('fallback', float('nan')):.3f} ms; training forward on the fallback: "
              f"{training.fallback_trains_forward(cell, hidden, batch, dtype, device, launch is not None)}",
              flush=True)
        print(f"  training forward runs: {label} (plan's timing: {chosen.measured_ms.get(label, 'not timed')})")
        for ms, timed in persistent[:6]:
            print(f"  timed {ms:.3f} ms  {timed}")
