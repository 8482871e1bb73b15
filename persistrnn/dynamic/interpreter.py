"""The reference interpreter: runs a :class:`~.script.Script` on the CPU in
float64, instruction for instruction as the kernel does.

Each block's script runs as its own stream: a block runs ahead until a wait
whose target the counter has not reached, then the next block runs; a pass in
which no block moves is a deadlock and raises. The workspace starts as NaN, so
an instruction that reads a value before its producer wrote it (a missing
wait) poisons the loss instead of passing by luck.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ArgumentError
from .optimizers import Optimizer
from .script import BACKWARD, OPCODES, Script

__all__ = ["Result", "run_script"]

O = OPCODES


@dataclasses.dataclass
class Result:
    """What a run leaves: the batch loss, the workspace values and gradients,
    the gradient of every parameter (flat, the model's layout) and, after an
    update, the new parameters."""

    loss: float
    values: np.ndarray
    grads: np.ndarray | None
    param_grads: np.ndarray | None
    params: np.ndarray


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def run_script(script: Script, params: np.ndarray, optimizer: Optimizer | None = None, *, step: int = 1,
               state: dict | None = None) -> Result:
    """Run ``script`` on ``params`` (the model's flat buffer; not modified).

    A training script also runs the backward levels and, with an
    ``optimizer``, the update (``step`` counts updates from 1, for Adam's bias
    corrections; ``state`` holds Adam's moments between calls).
    """
    layout = script.layout
    params = np.asarray(params, dtype=np.float64).copy()
    values = np.full(script.workspace_floats, np.nan)
    grads = np.zeros(script.workspace_floats) if script.train else None
    param_grads = np.zeros_like(params) if script.train else None
    loss = 0.0
    counter = 0
    position = [int(script.starts[p]) for p in range(script.blocks)]
    ends = [int(script.starts[p + 1]) for p in range(script.blocks)]
    program = script.program.astype(np.int64)

    def matrix(k: int, block: int) -> tuple[np.ndarray, int, int]:
        r0, r1 = layout.block_rows(k, block)
        cols, base = layout.cols[k], layout.param_offset[k]
        return params[base + r0 * cols:base + r1 * cols].reshape(r1 - r0, cols), r0, r1

    def execute(block: int, word: np.ndarray) -> None:
        nonlocal loss
        op, n, out, a, b, p0 = (int(v) for v in word[:6])
        y, x = slice(out, out + n), slice(a, a + n)
        if op == O["lookup"]:
            values[y] = params[p0:p0 + n]
        elif op == O["matvec"]:
            w, r0, r1 = matrix(p0, block)
            values[out + r0:out + r1] = w @ values[a:a + w.shape[1]]
        elif op == O["add"]:
            values[y] = values[x] + values[b:b + n]
        elif op == O["mul"]:
            values[y] = values[x] * values[b:b + n]
        elif op == O["tanh"]:
            values[y] = np.tanh(values[x])
        elif op == O["sigmoid"]:
            values[y] = _sigmoid(values[x])
        elif op == O["relu"]:
            values[y] = np.maximum(values[x], 0.0)
        elif op == O["copy"]:
            values[y] = values[x]
        elif op == O["loss"]:
            z = values[x]
            top = z.max()
            values[out] = top + np.log(np.exp(z - top).sum()) - z[p0]
            loss += values[out]
        elif op == O["lookup"] + BACKWARD:
            param_grads[p0:p0 + n] += grads[y]
        elif op == O["matvec"] + BACKWARD:
            w, r0, r1 = matrix(p0, block)
            dy = grads[out + r0:out + r1]
            cols, base = w.shape[1], layout.param_offset[p0]
            grads[a:a + cols] += w.T @ dy
            param_grads[base + r0 * cols:base + r1 * cols] += np.outer(dy, values[a:a + cols]).ravel()
        elif op == O["add"] + BACKWARD:
            grads[x] += grads[y]
            grads[b:b + n] += grads[y]
        elif op == O["mul"] + BACKWARD:
            grads[x] += grads[y] * values[b:b + n]
            grads[b:b + n] += grads[y] * values[x]
        elif op == O["tanh"] + BACKWARD:
            grads[x] += grads[y] * (1.0 - values[y] ** 2)
        elif op == O["sigmoid"] + BACKWARD:
            grads[x] += grads[y] * values[y] * (1.0 - values[y])
        elif op == O["relu"] + BACKWARD:
            grads[x] += grads[y] * (values[y] > 0)
        elif op == O["copy"] + BACKWARD:
            grads[x] += grads[y]
        elif op == O["loss"] + BACKWARD:
            z = values[x]
            p = np.exp(z - z.max())
            p /= p.sum()
            p[p0] -= 1.0
            grads[x] += p
        else:
            raise ArgumentError(f"block {block}: unknown opcode {op} in the script")

    running = set(range(script.blocks))
    while running:
        moved = False
        for block in sorted(running, reverse=True):
            while position[block] < ends[block]:
                word = program[position[block]]
                if word[0] == O["wait"]:
                    if counter < word[5]:
                        break
                elif word[0] == O["signal"]:
                    counter += 1
                else:
                    execute(block, word)
                position[block] += 1
                moved = True
            if position[block] == ends[block]:
                running.discard(block)
        if not moved and running:
            stuck = {b: int(program[position[b]][5]) for b in sorted(running)}
            raise ArgumentError(f"the script deadlocks: counter {counter}, blocks waiting for targets {stuck}")
    if counter != script.signals:
        raise ArgumentError(f"the script signalled {counter} times; its final target is {script.signals}")
    if script.train and optimizer is not None:
        optimizer.update(params, param_grads, {} if state is None else state, step)
    return Result(float(loss), values, grads, param_grads, params)

