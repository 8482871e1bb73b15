"""persistrnn: recurrent networks on NVIDIA GPUs with persistent kernels.

Importing the package needs no GPU; the first use of a kernel does, and says
so clearly (:class:`persistrnn.errors.GPUUnavailableError`) when there is none.
Every error the package raises derives from :class:`persistrnn.errors.PersistRNNError`.
"""

__version__ = "0.1.0"

from .errors import (ArgumentError, ArgumentTypeError, CalibrationError, CompileError, ConfigError,  # noqa: E402
                     EngineFullError, GPUUnavailableError,
                     InputShapeError, InputTypeError, KernelLaunchError, KernelTimeoutError, PersistRNNError,
                     UnsupportedError)
from .plan import ModelShape, Plan, explain, tune  # noqa: E402
from .nn import GRU, LSTM, RNN, StreamSession, convert, from_torch  # noqa: E402
from .onnx_import import from_onnx  # noqa: E402
from . import serve  # noqa: E402

__all__ = ["__version__", "PersistRNNError", "ArgumentError", "ArgumentTypeError", "GPUUnavailableError",
           "CompileError", "KernelLaunchError",
           "KernelTimeoutError", "ConfigError", "CalibrationError", "InputShapeError", "InputTypeError",
           "UnsupportedError", "ModelShape", "Plan", "explain", "tune", "LSTM", "GRU", "RNN", "StreamSession",
           "convert", "from_torch", "from_onnx", "EngineFullError", "serve"]
