"""One small launch of each kernel family (cell x sync mode), checked against
the float64 reference, for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_recurrence.py
    compute-sanitizer --tool racecheck --report-api-errors no python scripts/sanitize_recurrence.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_persistent import _mma, _tolerance, check_against_reference  # noqa: E402

from persistrnn.persistent import KernelConfig  # noqa: E402

FAMILIES = [
    KernelConfig("lstm", 64, "single", 1, 256, 8, 1),
    KernelConfig("gru", 100, "cluster", 4, 128, 4, 4),
    KernelConfig("gru_reset_before", 100, "cluster", 4, 128, 4, 2, 2),
    KernelConfig("rnn_tanh", 64, "grid", 8, 64, 8, 1),
    KernelConfig("lstm", 100, "grid", 10, 128, 8, 2),
    _mma("lstm", 100, "cluster", 4, 256, 2, "bfloat16"),
    _mma("gru_reset_before", 64, "grid", 4, 128, 2, "float16"),
    KernelConfig("gru_reset_before", 100, "cluster", 4, 128, 4, 2, one_sync=True),
]

failed = 0
for config in FAMILIES:
    errors = check_against_reference(config, batch=3, steps=4, seed=1)
    ok = max(errors.values()) <= _tolerance(config)
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {config}: {errors}")
sys.exit(1 if failed else 0)
