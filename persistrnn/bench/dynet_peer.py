"""DyNet with automatic batching on the CPU: the baseline VPPS measured
against, an optional peer of ``bench treelstm`` and ``bench tagger``.

``pip install dynet38`` (``persistrnn[dynet]``); where it is not installed
the peer is reported absent. Each peer is the suite's model, from the same
initial parameters as the interpreter's, built per input one expression at a
time (DyNet's way), with ``--dynet-autobatch 1`` so that DyNet batches the
nodes of a graph of one batch itself; SGD without gradient clipping, as the
other providers. DyNet runs on the CPU here: VPPS's DyNet numbers were on a
GPU, which the published wheels do not support.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DyNetTagger", "DyNetTreeLSTM", "load_dynet"]

_DYNET: list[Any] = []

DYNET_MEMORY_MB = "3072,3072,512,512"
"""DyNet's forward, backward, parameter and scratch pools in MB
(``--dynet-mem``): with automatic batching it cannot grow them. These hold
this bench's largest batches (128 SST trees or WikiNER sentences, hidden
256)."""


def load_dynet() -> tuple[Any | None, str]:
    """(the ``dynet`` module with automatic batching on, "") or (None, why
    not). Its configuration is fixed at its first import in a process."""
    if not _DYNET:
        try:
            import dynet_config

            dynet_config.set(autobatch=1, random_seed=1, mem=DYNET_MEMORY_MB)
            import dynet
        except ImportError as error:
            return None, f"absent ({error}; pip install dynet38)"
        _DYNET.append(dynet)
    return _DYNET[0], ""


class _DyNetPeer:
    """The model's parameters in a DyNet collection (the embedding as lookup
    parameters), an SGD trainer, and one step: ``loss(items)`` is the
    model's, summed over its loss nodes."""

    def __init__(self, dy: Any, model: Any, lr: float) -> None:
        self.dy = dy
        self.pc = dy.ParameterCollection()
        flat = model.initial_values()
        self.p: dict[str, Any] = {}
        for param in model.parameters:
            value = np.ascontiguousarray(model.view(flat, param), dtype=np.float32)
            if param.kind == "bias":
                value = value.reshape(-1)
            self.p[param.name] = (self.pc.lookup_parameters_from_numpy(value) if param.kind == "embedding"
                                  else self.pc.add_parameters(value.shape, init=dy.NumpyInitializer(value)))
        self.trainer = dy.SimpleSGDTrainer(self.pc, learning_rate=lr)
        self.trainer.set_clip_threshold(0)  # no clipping, as torch's SGD and the interpreter's

    def loss(self, items: list) -> Any:
        raise NotImplementedError

    def train_step(self, items: list) -> float:
        self.dy.renew_cg()
        loss = self.loss(items)
        value = loss.value()
        loss.backward()
        self.trainer.update()
        return value

    def infer(self, items: list) -> float:
        self.dy.renew_cg()
        return self.loss(items).value()


class DyNetTreeLSTM(_DyNetPeer):
    """The binary Tree-LSTM of :class:`persistrnn.dynamic.TreeLSTM` (``U``
    holds ``[U_iou; U_f]``), a sentiment loss on every node."""

    def __init__(self, dy: Any, model: Any, builder: Any, vocab: Any, lr: float) -> None:
        super().__init__(dy, model, lr)
        self.H, self.vocab = builder.hidden, vocab

    def _cell(self, iou: Any, c_in: Any | None) -> tuple[Any, Any]:
        dy, H = self.dy, self.H
        c = dy.cmult(dy.logistic(iou[:H]), dy.tanh(iou[2 * H:3 * H]))
        if c_in is not None:
            c = c + c_in
        return dy.cmult(dy.logistic(iou[H:2 * H]), dy.tanh(c)), c

    def _visit(self, node: Any, losses: list) -> tuple[Any, Any]:
        dy, p, H = self.dy, self.p, self.H
        if node.word is not None:
            h, c = self._cell(p["W_iou"] * p["embed"][self.vocab[node.word]] + p["b_iou"], None)
        else:
            (hl, cl), (hr, cr) = (self._visit(child, losses) for child in node.children)
            gates = p["U"] * dy.concatenate([hl, hr])
            f = dy.logistic(gates[3 * H:] + p["b_f"])
            h, c = self._cell(gates[:3 * H] + p["b_iou"], dy.cmult(f[:H], cl) + dy.cmult(f[H:], cr))
        losses.append(dy.pickneglogsoftmax(p["W_out"] * h + p["b_out"], node.label))
        return h, c

    def loss(self, trees: list) -> Any:
        losses: list = []
        for tree in trees:
            self._visit(tree, losses)
        return self.dy.esum(losses)


class DyNetTagger(_DyNetPeer):
    """The BiLSTM tagger of :class:`persistrnn.dynamic.BiLSTMTagger` (gates
    i, f, g, o), a tag loss on every token."""

    def __init__(self, dy: Any, model: Any, builder: Any, lr: float) -> None:
        super().__init__(dy, model, lr)
        self.H = builder.hidden

    def _direction(self, d: str, words: list) -> list:
        dy, p, H = self.dy, self.p, self.H
        h = c = None
        states = []
        for w in words:
            z = p[f"W_x_{d}"] * p["embed"][w] + p[f"b_{d}"]
            if h is not None:
                z = z + p[f"W_h_{d}"] * h
            c_new = dy.cmult(dy.logistic(z[:H]), dy.tanh(z[2 * H:3 * H]))
            c = c_new if c is None else dy.cmult(dy.logistic(z[H:2 * H]), c) + c_new
            h = dy.cmult(dy.logistic(z[3 * H:]), dy.tanh(c))
            states.append(h)
        return states

    def loss(self, sentences: list) -> Any:
        dy, p = self.dy, self.p
        losses = []
        for words, tags in sentences:
            forward = self._direction("fwd", list(words))
            backward = self._direction("bwd", list(words)[::-1])[::-1]
            losses += [dy.pickneglogsoftmax(p["W_out"] * dy.concatenate([hf, hb]) + p["b_out"], int(tag))
                       for hf, hb, tag in zip(forward, backward, tags)]
        return dy.esum(losses)
