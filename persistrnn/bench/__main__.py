"""``python -m persistrnn.bench <suite> [options]`` (also ``python -m persistrnn bench <suite>``)."""

from __future__ import annotations

import sys

COMPARISONS = ("grnn-table", "real-models", "scaling", "dtypes")
"""The suites of :mod:`persistrnn.bench.compare`: persistrnn beside its peers."""
SUITES = {
    **{name: "persistrnn.bench.compare" for name in COMPARISONS},
    "targets": "persistrnn.bench.targets",
    "sync": "persistrnn.bench.sync",
    "recurrence": "persistrnn.bench.recurrence",
    "model-accuracy": "persistrnn.bench.model_accuracy",
    "host": "persistrnn.bench.host",
    "compile": "persistrnn.bench.compiled",
    "planner-regret": "persistrnn.bench.planner_regret",
    "training": "persistrnn.bench.training",
    "charlm": "persistrnn.bench.charlm",
    "treelstm": "persistrnn.bench.treelstm",
    "tagger": "persistrnn.bench.tagger",
    "sst": "persistrnn.bench.sst",
    "serve": "persistrnn.bench.serve",
    "step-profile": "persistrnn.bench.step_profile",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m persistrnn bench <suite> [options]\nsuites: {', '.join(SUITES)}")
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; expected one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    from ..runtime import GPUUnavailableError

    module = importlib.import_module(SUITES[suite])
    try:
        return module.main(suite, rest) if suite in COMPARISONS else module.main(rest)
    except GPUUnavailableError as exc:
        print(f"bench {suite}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
