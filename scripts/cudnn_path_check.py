"""Why a module that trains on cuDNN (LSTM 1024, batch 32) can step slower
than torch's own module: the two steps interleaved (CUDA events around 10
steps, 5 rounds, medians), whether each module's weights sit in one
contiguous buffer (cuDNN's flattened layout), and any synchronisation in
one step of ours (torch.cuda.set_sync_debug_mode). With --suite-first the
training suite's padded rows run first in this process, as they do before
this row in `bench training`; then each module is also timed under the
settings the suite times cuDNN with (TF32 allowed, set for the duration)
and under the process's own (as the suite times ours), with cuDNN RNN's
precision printed before and after.

    PYTHONPATH=. python scripts/cudnn_path_check.py [--hidden 1024] [--batch 32] [--suite-first]
"""
import argparse
import contextlib
import warnings

import torch

from persistrnn import runtime
from persistrnn.bench import training as bench

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--suite-first", action="store_true")
args = parser.parse_args()
print("cuDNN RNN precision at start:", runtime.cudnn_rnn_precision())
if args.suite_first:
    for hidden, batch in ((256, 1), (256, 8), (256, 32), (1024, 1), (1024, 8)):
        row = bench.run_case(hidden, batch, 10, 5)
        print(f"suite row H={hidden} b{batch}: ours {row['ours_ms']:.3f} ms, cuDNN {row['cudnn_ms']:.3f} / "
              f"{row['cudnn_exact_ms']:.3f} ms")
    print("cuDNN RNN precision after the rows:", runtime.cudnn_rnn_precision())
theirs, ours = bench._modules("lstm", args.hidden)
x = torch.randn(100, args.batch, args.hidden, device="cuda", requires_grad=True)
print("ours trains on:", ours._torch_reason(x, warn=False, trains=True))


def contiguous(module):
    weights = module._flat_weights
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(weights, weights[1:]))


print("flattened weights: theirs", contiguous(theirs), "ours", contiguous(ours))
steps = {"theirs": bench._step(theirs, x), "ours": bench._step(ours, x)}
for run in steps.values():
    for _ in range(3):
        run()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    steps["ours"]()
    torch.cuda.set_sync_debug_mode("default")
print("synchronisations in one step of ours:", [str(w.message)[:120] for w in caught if "sync" in str(w.message)])
print(bench._time_interleaved({name: (run, contextlib.nullcontext) for name, run in steps.items()}, 10, 5))
ours.flatten_parameters()
print("after ours.flatten_parameters(): flattened", contiguous(ours),
      bench._time_interleaved({name: (run, contextlib.nullcontext) for name, run in steps.items()}, 10, 5))


def tf32():
    return runtime.cudnn_rnn_settings(enabled=True, tf32=True)


print("process settings / TF32 set:", bench._time_interleaved(
    {f"{name} {label}": (run, settings) for name, run in steps.items()
     for label, settings in (("process", contextlib.nullcontext), ("tf32", tf32))}, 10, 5))
print("cuDNN RNN precision at the end:", runtime.cudnn_rnn_precision())
