"""One small launch of each kernel family (cell x sync mode), checked against
the float64 reference, for compute-sanitizer; then the persistent backward
kernel on a cluster and on a grid, against the float64 torch-op steps:

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_recurrence.py
    compute-sanitizer --tool racecheck --report-api-errors no python scripts/sanitize_recurrence.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from test_persistent import _mma, check_against_reference  # noqa: E402
from test_training import direction_inputs, run_steps  # noqa: E402

from persistrnn import training, training_kernel  # noqa: E402
from persistrnn.persistent import KernelConfig  # noqa: E402

FAMILIES = [
    KernelConfig("lstm", 64, "single", 1, 256, 8, 1),
    KernelConfig("gru", 100, "cluster", 4, 128, 4, 4),
    KernelConfig("gru_reset_before", 100, "cluster", 4, 128, 4, 2, 2),
    KernelConfig("rnn_tanh", 64, "grid", 8, 64, 8, 1),
    KernelConfig("lstm", 100, "grid", 10, 128, 8, 2),
    KernelConfig("gru", 100, "grid", 10, 128, 8, 2, tagged_exchange=True),
    _mma("lstm", 100, "cluster", 4, 256, 2, "bfloat16"),
    _mma("gru_reset_before", 64, "grid", 4, 128, 2, "float16"),
    KernelConfig("gru_reset_before", 100, "cluster", 4, 128, 4, 2, one_sync=True),
]
# The backward: H=100 on a cluster, H=601 on a grid (the last block short of units).
BACKWARD = [("lstm", 100), ("gru_reset_before", 100), ("lstm", 601), ("gru_reset_before", 601)]


def check_forward(config: KernelConfig) -> str:
    """"" when ``config`` agrees with the float64 reference (tests/helpers.py's rule), else why not."""
    try:
        check_against_reference(config, batch=3, steps=4, seed=1)
    except AssertionError as error:
        return str(error)
    return ""


def check_backward(cell: str, hidden: int) -> str:
    """"" when the persistent backward steps agree with the float64 torch-op steps to 1e-5, else the errors."""
    inputs = {k: None if v is None else v.float().double()
              for k, v in direction_inputs(cell, steps=3, batch=3, hidden=hidden, seed=1).items()}
    want = run_steps(training._torch_steps, cell, inputs, False)
    got = run_steps(training_kernel.persistent_steps, cell, inputs, False, device="cuda", dtype=torch.float32)
    errors = {name: (got[name].cpu().double() - value).abs().max().item()
              for name, value in want.items() if value is not None and value.numel()}
    return "" if max(errors.values()) <= 1e-5 else f"largest errors {errors}"


def main() -> int:
    failed = 0
    checks = [(str(config), check_forward, (config,)) for config in FAMILIES]
    checks += [(f"persistent backward {cell} H={hidden}", check_backward, (cell, hidden)) for cell, hidden in BACKWARD]
    for name, check, args in checks:
        why = check(*args)
        failed += bool(why)
        print(f"{'FAIL' if why else 'ok  '} {name}{': ' + why if why else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
