"""The package imports and explains itself on a machine without a GPU."""

import subprocess
import sys

import pytest


def test_import_needs_no_gpu():
    # A fresh interpreter with CUDA hidden: importing must not touch the GPU.
    code = "import persistrnn, persistrnn.jit, persistrnn.bench.sync; print(persistrnn.__version__)"
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

    from persistrnn import GPUUnavailableError, jit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GPUUnavailableError, match=r"NVIDIA GPU.*torch.cuda.is_available\(\) is False"):
        jit.device_facts()
    with pytest.raises(GPUUnavailableError):
        jit.compile_source("tiny", 'extern "C" __global__ void k() {}')  # arch from the device
