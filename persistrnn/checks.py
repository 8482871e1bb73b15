"""Argument checks shared by every kernel path: errors that name the
argument, what was expected and what came."""

from __future__ import annotations

from typing import Any
from .errors import ArgumentError, ArgumentTypeError

__all__ = ["check_lengths", "check_tensor"]


def check_tensor(name: str, t: Any, shape: tuple[int, ...], device: Any, dtype: Any, cuda: bool = True) -> None:
    """Raise TypeError (type, dtype) or ValueError (device, shape, layout)
    naming ``name`` and what was expected, unless ``t`` is a contiguous
    CUDA tensor (any tensor, with ``cuda=False``) of ``shape`` and ``dtype``
    on ``device``."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ArgumentTypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if cuda and t.device.type != "cuda":
        raise ArgumentError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if t.device != device:
        raise ArgumentError(f"{name}: expected a tensor on {device} (where xw is), got one on {t.device}")
    if tuple(t.shape) != shape:
        raise ArgumentError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ArgumentError(f"{name}: expected a contiguous tensor")


def check_lengths(lengths: Any, steps: int, batch: int, device: Any) -> None:
    """Raise unless ``lengths`` is an int32 tensor (batch,) on ``device`` (a
    CUDA device, or the CPU for the training operators' reference path) with
    every length in 1..steps: a reverse instance starts at its length - 1, so
    a length past ``steps`` would read and write outside the tensors. Reads
    the extremes back (synchronises)."""
    import torch

    check_tensor("lengths", lengths, (batch,), device, torch.int32, cuda=torch.device(device).type == "cuda")
    low, high = int(lengths.min()), int(lengths.max())
    if low < 1 or high > steps:
        raise ArgumentError(f"lengths: expected every length in 1..{steps} (the steps of the input), "
                            f"got lengths from {low} to {high}")
