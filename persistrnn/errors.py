"""Every error persistrnn raises, under one base class.

``except persistrnn.PersistRNNError`` catches all of them. Each also derives
from the built-in exception a caller would expect for its kind, so code written
against torch keeps working: bad inputs are ``ValueError``/``TypeError`` (and
``RuntimeError``, which torch raises for some of the same inputs), an invalid
kernel configuration is a ``ValueError``, and failures of the GPU, the
compiler or a launch are ``RuntimeError``s.
"""

from __future__ import annotations

__all__ = [
    "PersistRNNError",
    "GPUUnavailableError",
    "CompileError",
    "KernelLaunchError",
    "KernelTimeoutError",
    "ConfigError",
    "CalibrationError",
    "InputShapeError",
    "InputTypeError",
    "UnsupportedError",
    "ArgumentError",
    "ArgumentTypeError",
    "EngineFullError",
]


class PersistRNNError(Exception):
    """The base of every error this package raises."""


class GPUUnavailableError(PersistRNNError, RuntimeError):
    """Raised on the first GPU use when no usable GPU is present."""


class CompileError(PersistRNNError, RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


class KernelLaunchError(PersistRNNError, RuntimeError):
    """A launch could not be made safely (its blocks cannot all be resident,
    the device refuses its cluster size), or a kernel reported a failure."""


class KernelTimeoutError(KernelLaunchError):
    """A persistent kernel gave up waiting: a peer block (or the previous
    layer) made no progress within the wait timeout. The message names the
    stage that waited (:func:`persistrnn.runtime.set_wait_timeout` sets the bound)."""


class ConfigError(PersistRNNError, ValueError):
    """A kernel configuration that is invalid, or does not fit the device."""


class CalibrationError(PersistRNNError, RuntimeError):
    """The planner's micro-benchmarks could not produce a usable timing."""


class InputShapeError(PersistRNNError, ValueError, RuntimeError):
    """A wrong rank, feature size, batch, state shape or dtype of a module's
    input, in torch's wording (torch raises ValueError or RuntimeError)."""


class InputTypeError(PersistRNNError, TypeError, RuntimeError):
    """An input of the wrong kind (not a tensor) in torch's wording."""


class UnsupportedError(PersistRNNError, NotImplementedError):
    """A use this package does not support, with the alternative named in the
    message (e.g. ``torch.jit.script``: use ``torch.compile`` or ``torch.export``)."""


class ArgumentError(PersistRNNError, ValueError):
    """An argument of a library function with a value it does not take; the
    message names the argument, what was expected and what came."""


class ArgumentTypeError(PersistRNNError, TypeError):
    """An argument of a library function of the wrong type; the message names
    the argument, what was expected and what came."""


class EngineFullError(PersistRNNError, RuntimeError):
    """The serving engine has no room: every stream slot is taken (``open``),
    or a stream holds ``max_pending`` chunks not yet pulled (``push``)."""
