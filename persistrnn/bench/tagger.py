"""BiLSTM tagger on WikiNER, the dynamic interpreter against PyTorch: ``python -m persistrnn bench tagger``.

:class:`persistrnn.dynamic.BiLSTMTagger`, hidden 256 and embedding 256, a
tag loss on every token, SGD; batches of consecutive WikiNER sentences
(``DATA_DIR/wikiner/dev.txt``). The harness, providers, method and outputs
are those of ``bench treelstm`` (:mod:`persistrnn.bench.treelstm`); the
level-batched peer runs one LSTM step of every sentence still running in one
op per direction (sentences sorted by length, as a packed sequence), the
eager peer one token at a time.
"""

from __future__ import annotations

from typing import Any

from .dynet_peer import DyNetTagger
from .treelstm import Settings, Workload, _torch_params, main as run_suite, tree_lstm_workload

__all__ = ["TorchTagger", "loaded_suite", "main", "tagger_workload"]


class TorchTagger:
    """The same BiLSTM tagger in PyTorch (fp32), from the interpreter's initial parameters."""

    def __init__(self, model: Any, builder: Any, device: Any) -> None:
        self.p = _torch_params(model, device)
        self.H, self.device = builder.hidden, device

    def optimizer(self, lr: float) -> Any:
        import torch

        return torch.optim.SGD(self.p.values(), lr=lr)

    def _step(self, z: Any, c: Any | None) -> tuple[Any, Any]:
        """One LSTM step from the pre-activations ``z`` (gates i, f, g, o)."""
        import torch

        H = self.H
        c_new = torch.sigmoid(z[..., :H]) * torch.tanh(z[..., 2 * H:3 * H])
        if c is not None:
            c_new = torch.sigmoid(z[..., H:2 * H]) * c + c_new
        return torch.sigmoid(z[..., 3 * H:]) * torch.tanh(c_new), c_new

    def eager_loss(self, sentences: list) -> Any:
        """One token of one sentence at a time."""
        import torch

        p = self.p
        logits, labels = [], []
        for words, tags in sentences:
            outputs = []
            for d, order in (("fwd", words), ("bwd", words[::-1])):
                h = c = None
                states = []
                for w in order:
                    z = p[f"W_x_{d}"] @ p["embed"][w] + p[f"b_{d}"]
                    if h is not None:
                        z = z + p[f"W_h_{d}"] @ h
                    h, c = self._step(z, c)
                    states.append(h)
                outputs.append(states if d == "fwd" else states[::-1])
            logits += [p["W_out"] @ torch.cat([hf, hb]) + p["b_out"] for hf, hb in zip(*outputs)]
            labels += list(tags)
        return torch.nn.functional.cross_entropy(torch.stack(logits), torch.tensor(labels, device=self.device),
                                                 reduction="sum")

    def plan(self, sentences: list) -> dict[str, Any]:
        """Sentences by length (longest first); per step the number still
        running; per token its row among the stacked step outputs of each
        direction."""
        import torch

        order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i][0]))
        lengths = [len(sentences[i][0]) for i in order]
        running = [sum(1 for n in lengths if n > t) for t in range(lengths[0])]
        first_row = [sum(running[:t]) for t in range(len(running))]
        forward_ids, backward_ids, rows_f, rows_b, labels = [], [], [], [], []
        for t, count in enumerate(running):
            forward_ids += [sentences[order[k]][0][t] for k in range(count)]
            backward_ids += [sentences[order[k]][0][lengths[k] - 1 - t] for k in range(count)]
        for k, i in enumerate(order):
            for t in range(lengths[k]):
                rows_f.append(first_row[t] + k)
                rows_b.append(first_row[lengths[k] - 1 - t] + k)
            labels += list(sentences[i][1])
        dev = self.device
        return {"running": running, "words": {"fwd": torch.tensor(forward_ids, device=dev),
                                              "bwd": torch.tensor(backward_ids, device=dev)},
                "rows": {"fwd": torch.tensor(rows_f, device=dev), "bwd": torch.tensor(rows_b, device=dev)},
                "labels": torch.tensor(labels, device=dev)}

    def batched_loss(self, plan: dict[str, Any]) -> Any:
        import torch

        p = self.p
        states = {}
        for d in ("fwd", "bwd"):
            # The input projections of every token in one product; the steps
            # run the recurrent product of the sentences still running.
            zx = p["embed"][plan["words"][d]] @ p[f"W_x_{d}"].t() + p[f"b_{d}"]
            h = c = None
            outputs, row = [], 0
            for count in plan["running"]:
                z = zx[row:row + count]
                if h is not None:
                    z = z + h[:count] @ p[f"W_h_{d}"].t()
                h, c = self._step(z, None if c is None else c[:count])
                outputs.append(h)
                row += count
            states[d] = torch.cat(outputs)[plan["rows"][d]]
        logits = torch.cat([states["fwd"], states["bwd"]], 1) @ p["W_out"].t() + p["b_out"]
        return torch.nn.functional.cross_entropy(logits, plan["labels"], reduction="sum")


def tagger_workload(settings: Settings, device: Any) -> Workload:
    from .. import dynamic

    sentences = dynamic.read_wikiner(dynamic.DATA_DIR / "wikiner" / "dev.txt", limit=settings.inputs)
    words = dynamic.Vocabulary(w for s in sentences for w, _ in s)
    tags = dynamic.Vocabulary((t for s in sentences for _, t in s), unk=False)
    encoded = [(words.encode([w for w, _ in s]), tags.encode([t for _, t in s])) for s in sentences]
    model = dynamic.Model(0)
    builder = dynamic.BiLSTMTagger(model, len(words), len(tags), settings.embedding, settings.hidden)
    return Workload("tagger", encoded, model, lambda g, sentence: builder.build(g, *sentence),
                    TorchTagger(model, builder, device), add_batch=lambda g, group: builder.build_batch(g, group),
                    dynet=lambda dy, lr: DyNetTagger(dy, model, builder, lr))


WORKLOADS = {"treelstm": tree_lstm_workload, "tagger": tagger_workload}
"""The dynamic-network suites' workloads by name (the profiling scripts take them)."""


def loaded_suite(suite: str, settings: Settings) -> tuple[Workload, Any]:
    """A suite's workload on the GPU and the interpreter the suite runs (SGD
    at the suite's rate), compiled and loaded: the profiling scripts' start."""
    import torch

    from .. import dynamic

    work = WORKLOADS[suite](settings, torch.device("cuda"))
    interp = dynamic.Interpreter(work.model, optimizer=dynamic.SGD(settings.lr))
    interp.load()
    return work, interp


def main(argv: list[str] | None = None) -> int:
    return run_suite(argv, suite="tagger", make_workload=tagger_workload, description=__doc__)
