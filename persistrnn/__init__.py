"""persistrnn: recurrent networks on NVIDIA GPUs with persistent kernels.

Importing the package needs no GPU; the first use of a kernel does, and says
so clearly (:class:`persistrnn.jit.GPUUnavailableError`) when there is none.
"""

__version__ = "0.1.0"

from .jit import GPUUnavailableError, CompileError, KernelLaunchError  # noqa: E402

from .plan import ModelShape, Plan, explain, tune  # noqa: E402
from .nn import GRU, LSTM, RNN, StreamSession, convert, from_torch  # noqa: E402

__all__ = ["__version__", "GPUUnavailableError", "CompileError", "KernelLaunchError", "ModelShape", "Plan", "explain",
           "tune", "LSTM", "GRU", "RNN", "StreamSession", "convert", "from_torch"]
