"""The package imports and explains itself on a machine without a GPU."""

import subprocess
import sys

import pytest


def test_import_needs_no_gpu():
    # A fresh interpreter with CUDA hidden: importing must not touch the GPU.
    code = "import persistrnn, persistrnn.runtime, persistrnn.bench.sync; print(persistrnn.__version__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"CUDA_VISIBLE_DEVICES": "", **_env()}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


def test_first_gpu_use_without_gpu_says_why(monkeypatch):
    import torch

    from persistrnn import GPUUnavailableError, runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GPUUnavailableError, match=r"NVIDIA GPU.*torch.cuda.is_available\(\) is False"):
        runtime.device_facts()
    with pytest.raises(GPUUnavailableError):
        runtime.compile_source("tiny", 'extern "C" __global__ void k() {}')  # arch from the device


def _run_module(*args):
    env = {**_env(), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300)


def test_demo_without_gpu_says_it_needs_one_and_fails_without_a_traceback():
    out = _run_module("persistrnn")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "the demo needs a GPU" in out.stderr and "torch.cuda.is_available() is False" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_the_other_commands_are_still_there():
    help_text = _run_module("persistrnn", "--help")
    assert help_text.returncode == 0 and all(c in help_text.stdout for c in ("demo", "bench", "tune", "explain"))
    explain = _run_module("persistrnn", "explain", "--cell", "lstm", "--input-size", "8", "--hidden-size", "8",
                          "--batch", "1")
    assert explain.returncode == 2 and "torch.cuda.is_available() is False" in explain.stderr
    unknown = _run_module("persistrnn", "nosuch")
    assert unknown.returncode == 2 and "unknown command 'nosuch'" in unknown.stderr


def test_bench_without_gpu_fails_clearly():
    out = _run_module("persistrnn.bench", "sync", "--steps", "100")
    assert out.returncode == 2
    assert "torch.cuda.is_available() is False" in out.stderr
    out = _run_module("persistrnn.bench", "grnn-table", "--hidden", "64")
    assert out.returncode == 2
    assert "torch.cuda.is_available() is False" in out.stderr
    out = _run_module("persistrnn.bench", "nosuch")
    assert out.returncode == 2 and "expected one of: grnn-table" in out.stderr


def test_the_library_never_imports_the_benchmarks():
    code = ("import persistrnn, sys; persistrnn.LSTM(8, 8); import persistrnn.plan.model, persistrnn.runtime; "
            "assert not [m for m in sys.modules if m.startswith('persistrnn.bench')], 'persistrnn.bench imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
