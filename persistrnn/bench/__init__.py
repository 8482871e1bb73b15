"""Benchmarks: ``python -m persistrnn.bench <suite>`` (suites: sync)."""
