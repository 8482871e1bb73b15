"""Argument checks shared by every kernel path: errors that name the
argument, what was expected and what came."""

from __future__ import annotations

from typing import Any
from .errors import ArgumentError, ArgumentTypeError

__all__ = ["check_lengths", "check_recurrence", "check_tensor"]


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


def check_recurrence(spec: Any, xw: Any, w_hh: Any, b_hh: Any, h0: Any, c0: Any | None, hidden_size: int,
                     dtype: Any) -> tuple[int, int]:
    """Check one recurrence's arguments as every kernel path takes them
    (``xw`` (T, B, G*H) float32, ``w_hh`` (G*H, H), ``b_hh`` (G*H,), ``h0``
    and, for a cell with a cell state only, ``c0`` (B, H), all but ``xw`` of
    ``dtype``, on ``xw``'s CUDA device); returns (T, B)."""
    import torch

    G, H = spec.num_gates, hidden_size
    if not isinstance(xw, torch.Tensor) or xw.dim() != 3:
        raise ArgumentError(f"xw: expected a 3-D tensor (T, B, {G * H}), got "
                            f"{tuple(xw.shape) if isinstance(xw, torch.Tensor) else type(xw).__name__}")
    T, B = xw.shape[0], xw.shape[1]
    if spec.has_cell_state and c0 is None:
        raise ArgumentError(f"cell {spec.name} carries a cell state: expected c0 of shape {(B, H)}, got None")
    if not spec.has_cell_state and c0 is not None:
        raise ArgumentError(f"cell {spec.name} has no cell state: expected c0=None, got a tensor")
    check_tensor("xw", xw, (T, B, G * H), xw.device, torch.float32)
    check_tensor("w_hh", w_hh, (G * H, H), xw.device, dtype)
    check_tensor("b_hh", b_hh, (G * H,), xw.device, dtype)
    check_tensor("h0", h0, (B, H), xw.device, dtype)
    if spec.has_cell_state:
        check_tensor("c0", c0, (B, H), xw.device, dtype)
    if T < 1 or B < 1 or H < 1:
        raise ArgumentError(f"expected at least one step, sequence and hidden unit, got xw of shape {tuple(xw.shape)} "
                            f"and w_hh of shape {tuple(w_hh.shape)}")
    return T, B


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
