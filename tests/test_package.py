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


def test_demo_without_gpu_says_so_and_runs_the_cpu_part():
    out = _run_module("persistrnn")
    assert out.returncode == 0, out.stderr
    assert "No CUDA GPU is visible" in out.stdout
    err = float(out.stdout.split("relative error ")[1].split()[0])
    assert err < 1e-10  # the float64 reference agrees with torch
    assert "cluster_exchange_stasync" in out.stdout and "0 B spills" in out.stdout


def test_bench_without_gpu_fails_clearly():
    out = _run_module("persistrnn.bench", "sync", "--steps", "100")
    assert out.returncode == 2
    assert "torch.cuda.is_available() is False" in out.stderr
    out = _run_module("persistrnn.bench", "grnn-table", "--hidden", "64")
    assert out.returncode == 2
    assert "torch.cuda.is_available() is False" in out.stderr
    out = _run_module("persistrnn.bench", "nosuch")
    assert out.returncode == 2 and "expected one of: grnn-table" in out.stderr
