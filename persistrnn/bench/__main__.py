"""``python -m persistrnn.bench <suite> [options]``."""

from __future__ import annotations

import sys

SUITES = {
    "sync": "persistrnn.bench.sync",
    "recurrence": "persistrnn.bench.recurrence",
    "model-accuracy": "persistrnn.bench.model_accuracy",
    "models": "persistrnn.bench.models",
    "grnn-table": "persistrnn.bench.grnn_table",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m persistrnn.bench <suite> [options]\nsuites: {', '.join(SUITES)}")
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; expected one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    from ..jit import GPUUnavailableError

    try:
        return importlib.import_module(SUITES[suite]).main(rest)
    except GPUUnavailableError as exc:
        print(f"bench {suite}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
