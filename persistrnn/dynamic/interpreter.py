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

from ..cells import NUMPY_FUNCTIONS
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


_sigmoid = NUMPY_FUNCTIONS["sigmoid"]  # the cells' reference: exp only sees -|x|, so large inputs do not overflow


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

    def matrix(k: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Matrix k's rows on ``block`` (its cache order), their ids, and their gradient's view."""
        rows = layout.block_rows(k, block)
        cols, base = layout.cols[k], layout.param_offset[k]
        span = slice(base, base + layout.rows[k] * cols)
        grad = None if param_grads is None else param_grads[span].reshape(-1, cols)
        return params[span].reshape(-1, cols)[rows], rows, grad

    def cell_matvec(op: int, block: int, items: np.ndarray, n: int) -> None:
        """A cell over its gates' matvec on ``block``: its rows' gates, then
        its units' cells (forward); the units' gate gradients, then the
        transposed product and the rows' weight gradient (backward)."""
        k, carried = divmod(n, 4)
        w, rows, wgrad = matrix(k, block)
        units, span = layout.rows[k] // layout.gates[k], rows.size // layout.gates[k]
        unit = rows[:span]  # gate 0's rows are the units' ids
        col = np.arange(layout.cols[k])
        out, a, b, addend = (items[:, j, None] for j in range(4))
        source = np.where(col < units, a + col, b + col - units) if carried == 2 else a + col
        lstm = op % BACKWARD == O["lstm_matvec"]
        at = dict(i=0, f=1, g=2, o=3) if lstm else dict(i=0, o=1, g=2)
        forget = [1] if lstm else [3 + j for j in range(carried)]
        cell = [a + units + unit, b + units + unit][:carried]
        if op < BACKWARD:  # the gates' pre-activations, kept after the state for the backward
            z = values[source] @ w.T + values[addend + rows]
            values[out + 2 * units + rows] = z
        else:
            z = values[out + 2 * units + rows]
        gate = {name: z[:, q * span:(q + 1) * span] for name, q in at.items()}
        if op < BACKWARD:
            c = _sigmoid(gate["i"]) * np.tanh(gate["g"])
            for q, kept in zip(forget, cell):
                c = c + _sigmoid(z[:, q * span:(q + 1) * span]) * values[kept]
            values[out + units + unit] = c
            values[out + unit] = _sigmoid(gate["o"]) * np.tanh(c)
            return
        dz = np.zeros_like(z)
        gh, t = grads[out + unit], np.tanh(values[out + units + unit])
        s_o = _sigmoid(gate["o"])
        dz[:, at["o"] * span:(at["o"] + 1) * span] = gh * t * s_o * (1.0 - s_o)
        dc = grads[out + units + unit] + gh * s_o * (1.0 - t ** 2)
        s_i, t_g = _sigmoid(gate["i"]), np.tanh(gate["g"])
        dz[:, :span] = dc * t_g * s_i * (1.0 - s_i)
        dz[:, at["g"] * span:(at["g"] + 1) * span] = dc * s_i * (1.0 - t_g ** 2)
        for q, kept in zip(forget, cell):
            s_f = _sigmoid(z[:, q * span:(q + 1) * span])
            dz[:, q * span:(q + 1) * span] = dc * values[kept] * s_f * (1.0 - s_f)
            np.add.at(grads, kept, dc * s_f)
        np.add.at(grads, addend + rows, dz)
        np.add.at(grads, source, dz @ w)
        wgrad[rows] += dz.T @ values[source]

    def softmax(z: np.ndarray) -> np.ndarray:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def cell_gates(op: int, items: np.ndarray, half: np.ndarray) -> tuple[np.ndarray, ...]:
        """A cell's (count, n/2) index grids: its h and c, its gates i, o, g
        and, per carried cell, the forget gate and the carried cell."""
        out, z, k = (items[:, j, None] + half for j in range(3))
        n = half.size
        if op % BACKWARD == O["lstm_cell"]:
            return out, out + n, z, z + 3 * n, z + 2 * n, [(z + n, k)]
        return out, out + n, z, z + n, z + 2 * n, [(z + 3 * n, k), (z + 4 * n, k + n)]

    def cell_forward(op: int, items: np.ndarray, n: int) -> None:
        h, c, i, o, g, carried = cell_gates(op, items, np.arange(n // 2))
        value = _sigmoid(values[i]) * np.tanh(values[g])
        has = items[:, 3] == 1
        for f, k in carried:
            value[has] += _sigmoid(values[f[has]]) * values[k[has]]
        values[c] = value
        values[h] = _sigmoid(values[o]) * np.tanh(value)

    def cell_backward(op: int, items: np.ndarray, n: int) -> None:
        h, c, i, o, g, carried = cell_gates(op, items, np.arange(n // 2))
        s_o, t_c = _sigmoid(values[o]), np.tanh(values[c])
        np.add.at(grads, o, grads[h] * t_c * s_o * (1.0 - s_o))
        dc = grads[c] + grads[h] * s_o * (1.0 - t_c ** 2)
        s_i, t_g = _sigmoid(values[i]), np.tanh(values[g])
        np.add.at(grads, i, dc * t_g * s_i * (1.0 - s_i))
        np.add.at(grads, g, dc * s_i * (1.0 - t_g ** 2))
        has = items[:, 3] == 1
        for f, k in carried:
            s_f = _sigmoid(values[f[has]])
            np.add.at(grads, f[has], dc[has] * values[k[has]] * s_f * (1.0 - s_f))
            np.add.at(grads, k[has], dc[has] * s_f)

    def execute(block: int, word: np.ndarray) -> None:
        nonlocal loss
        op, n = int(word[0]), int(word[1])
        items = program[word[3]:word[3] + word[2]]
        if op % BACKWARD in (O["lstm_cell"], O["tree_cell"]):
            (cell_backward if op >= BACKWARD else cell_forward)(op, items, n)
            return
        if op % BACKWARD in (O["lstm_matvec"], O["tree_matvec"]):
            cell_matvec(op, block, items, n)
            return
        # (count, n) index grids of the operands
        span = np.arange(n)
        y, x, z = (items[:, k, None] + span for k in range(3))
        if op == O["lookup"]:
            values[y] = params[items[:, 3, None] + span]
        elif op == O["matvec"]:
            w, rows, _ = matrix(int(items[0, 3]), block)
            values[items[:, 0, None] + rows] = values[x] @ w.T
        elif op == O["add"]:
            values[y] = values[x] + values[z]
        elif op == O["mul"]:
            values[y] = values[x] * values[z]
        elif op == O["tanh"]:
            values[y] = np.tanh(values[x])
        elif op == O["sigmoid"]:
            values[y] = _sigmoid(values[x])
        elif op == O["relu"]:
            values[y] = np.maximum(values[x], 0.0)
        elif op == O["sigmoid_mul"]:
            values[y] = _sigmoid(values[x]) * values[z]
        elif op == O["sigmoid_mul_tanh"]:
            values[y] = _sigmoid(values[x]) * np.tanh(values[z])
        elif op == O["copy"]:
            values[y] = values[x]
        elif op == O["loss"]:
            logits = values[x]
            top = logits.max(axis=1)
            each = top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[np.arange(len(items)), items[:, 3]]
            values[items[:, 0]] = each
            loss += each.sum()
        elif op == O["lookup"] + BACKWARD:
            np.add.at(param_grads, items[:, 3, None] + span, grads[y])
        elif op == O["matvec"] + BACKWARD:
            w, rows, wgrad = matrix(int(items[0, 3]), block)
            dy = grads[items[:, 0, None] + rows]
            np.add.at(grads, x, dy @ w)
            wgrad[rows] += dy.T @ values[x]
        elif op == O["add"] + BACKWARD:
            np.add.at(grads, x, grads[y])
            np.add.at(grads, z, grads[y])
        elif op == O["mul"] + BACKWARD:
            np.add.at(grads, x, grads[y] * values[z])
            np.add.at(grads, z, grads[y] * values[x])
        elif op == O["tanh"] + BACKWARD:
            np.add.at(grads, x, grads[y] * (1.0 - values[y] ** 2))
        elif op == O["sigmoid"] + BACKWARD:
            np.add.at(grads, x, grads[y] * values[y] * (1.0 - values[y]))
        elif op == O["relu"] + BACKWARD:
            np.add.at(grads, x, grads[y] * (values[y] > 0))
        elif op == O["sigmoid_mul"] + BACKWARD:
            s = _sigmoid(values[x])
            np.add.at(grads, x, grads[y] * values[z] * s * (1.0 - s))
            np.add.at(grads, z, grads[y] * s)
        elif op == O["sigmoid_mul_tanh"] + BACKWARD:
            s, t = _sigmoid(values[x]), np.tanh(values[z])
            np.add.at(grads, x, grads[y] * t * s * (1.0 - s))
            np.add.at(grads, z, grads[y] * s * (1.0 - t * t))
        elif op == O["copy"] + BACKWARD:
            np.add.at(grads, x, grads[y])
        elif op == O["loss"] + BACKWARD:
            p = softmax(values[x])
            p[np.arange(len(items)), items[:, 3]] -= 1.0
            np.add.at(grads, x, p)
        else:
            raise ArgumentError(f"block {block}: unknown opcode {op} in the script")

    running = set(range(script.blocks))
    while running:
        moved = False
        for block in sorted(running, reverse=True):
            while position[block] < ends[block]:
                word = program[position[block]]
                if word[0] == O["wait"]:
                    if counter < word[3]:
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
            stuck = {b: int(program[position[b]][3]) for b in sorted(running)}
            raise ArgumentError(f"the script deadlocks: counter {counter}, blocks waiting for targets {stuck}")
    if counter != script.signals:
        raise ArgumentError(f"the script signalled {counter} times; its final target is {script.signals}")
    if script.train and optimizer is not None:
        optimizer.update(params, param_grads, {} if state is None else state, step)
    return Result(float(loss), values, grads, param_grads, params)

