"""The optimisers the interpreter applies at the end of a training launch:
plain SGD and Adam, with torch.optim's formulas (dense: Adam's moments decay
for every parameter, as torch's do for a dense gradient)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ArgumentError

__all__ = ["SGD", "Adam", "Optimizer"]


def _check(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ArgumentError(f"{name} must be a number in [{low}, {high}), got {value!r}")


@dataclasses.dataclass(frozen=True)
class SGD:
    lr: float = 0.05

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, float("inf"))

    def scalars(self, step: int) -> tuple[float, float, float, float, float, float]:
        """(lr, beta1, beta2, eps, both bias corrections) as the kernel takes them; beta1 = 0 marks SGD."""
        return (float(self.lr), 0.0, 0.0, 0.0, 1.0, 1.0)

    def update(self, params: np.ndarray, grads: np.ndarray, state: dict, step: int) -> None:
        params -= self.lr * grads


@dataclasses.dataclass(frozen=True)
class Adam:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, float("inf"))
        _check("beta1", self.beta1, 0.0, 1.0)
        if float(np.float32(self.beta1)) == 0.0:  # the kernel reads beta1 = 0 (in fp32) as SGD's marker
            raise ArgumentError(f"Adam: beta1 must be above 0 in float32 (0 is how the kernel tells SGD apart), got "
                                f"{self.beta1!r}; use a small positive beta1, or SGD")
        _check("beta2", self.beta2, 0.0, 1.0)
        _check("eps", self.eps, 0.0, float("inf"))

    def corrections(self, step: int) -> tuple[float, float]:
        """1 / (1 - beta1^t) and sqrt(1 / (1 - beta2^t)) for update number ``step`` (from 1)."""
        return 1.0 / (1.0 - self.beta1 ** step), (1.0 / (1.0 - self.beta2 ** step)) ** 0.5

    def scalars(self, step: int) -> tuple[float, float, float, float, float, float]:
        return (float(self.lr), float(self.beta1), float(self.beta2), float(self.eps), *self.corrections(step))

    def update(self, params: np.ndarray, grads: np.ndarray, state: dict, step: int) -> None:
        m = state.setdefault("m", np.zeros_like(params))
        v = state.setdefault("v", np.zeros_like(params))
        m *= self.beta1
        m += (1 - self.beta1) * grads
        v *= self.beta2
        v += (1 - self.beta2) * grads * grads
        c1, c2 = self.corrections(step)
        params -= self.lr * c1 * m / (np.sqrt(v) * c2 + self.eps)


Optimizer = SGD | Adam
