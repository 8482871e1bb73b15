"""A short training run of the binary Tree-LSTM on SST fine-grained, the
dynamic interpreter beside PyTorch: ``python -m persistrnn bench sst``.

The model is `bench treelstm`'s: :class:`persistrnn.dynamic.TreeLSTM`
(binary, hidden 256, embedding 256, a sentiment loss on every node, summed
over the batch), its vocabulary the words of the training trees (others map
to UNK). Three runs from the model's one initialisation, on one data order
(the training trees shuffled with a fixed seed each epoch, ``batch``
consecutive trees a step), with Adam:

* **persistrnn**: :class:`persistrnn.dynamic.Interpreter`, forward, backward
  and Adam's update in one launch per batch; ``step()`` builds and schedules
  batch k+1 while batch k runs;
* **PyTorch**: the same model level-batched (`bench treelstm`'s
  ``TorchTreeLSTM``: every node of one height in one op), fp32,
  ``torch.optim.Adam``;
* **float64**: the PyTorch run in float64 for the first ``compare_steps``
  steps only, the yardstick of fp32 rounding.

TF32 is off in cuBLAS, so that the fp32 runs can agree to rounding. Each
epoch, each run's training pass is timed on the wall clock with the GPU
synchronised at both ends (graph building, scheduling or planning, launches
and the loss read all count): sentences per second. After each epoch both
runs' parameters are evaluated on the dev trees through the same
level-batched fp32 forward (persistrnn's parameters copied out of the
interpreter): fine-grained (5-class) accuracy at the root and over all
nodes, and the mean loss per node.

Outputs (``--out``): ``sst.md``, ``sst.json`` and, with matplotlib,
``sst.png`` (training loss per node against the step, dev root accuracy
against the epoch).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

PROVIDERS = ("persistrnn", "pytorch")


@dataclasses.dataclass
class Settings:
    hidden: int = 256
    embedding: int = 256
    batch: int = 25
    epochs: int = 3
    lr: float = 1e-3
    compare_steps: int = 200
    train_limit: int = 0  # 0: every training tree
    dev_limit: int = 0  # 0: every dev tree
    seed: int = 0


def epoch_batches(count: int, batch: int, epoch: int, seed: int) -> list[list[int]]:
    """Tree indices of each step of one epoch: a fixed shuffle per (seed, epoch), ``batch`` at a time (the last
    step may be short)."""
    import numpy as np

    order = np.random.default_rng([seed, epoch]).permutation(count).tolist()
    return [order[i:i + batch] for i in range(0, count, batch)]


def evaluate(peer: Any, trees: list, chunk: int = 256) -> dict[str, float]:
    """Root and all-node accuracy and mean loss per node of ``peer``'s parameters on ``trees``."""
    import torch

    roots = nodes = root_hits = node_hits = 0
    loss = 0.0
    with torch.no_grad():
        for start in range(0, len(trees), chunk):
            plan = peer.plan(trees[start:start + chunk])
            logits = peer.logits(plan).float()
            hit = logits.argmax(1) == plan["labels"]
            root_hits += int(hit[plan["roots"]].sum())
            node_hits += int(hit.sum())
            loss += float(torch.nn.functional.cross_entropy(logits, plan["labels"], reduction="sum"))
            roots += len(plan["roots"])
            nodes += len(plan["labels"])
    return {"root_accuracy": root_hits / roots, "node_accuracy": node_hits / nodes, "loss_per_node": loss / nodes}


def run(s: Settings, data_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    import torch

    from .. import dynamic
    from ..progress import track
    from .charlm import fp32_exact
    from .environment import environment
    from .treelstm import TorchTreeLSTM

    root = Path(data_dir) if data_dir is not None else dynamic.DATA_DIR
    train = dynamic.read_sst(root / "sst" / "train.txt", limit=s.train_limit or None)
    dev = dynamic.read_sst(root / "sst" / "dev.txt", limit=s.dev_limit or None)
    vocab = dynamic.Vocabulary(w for t in train for w in t.words())
    model = dynamic.Model(s.seed)
    builder = dynamic.TreeLSTM(model, len(vocab), s.embedding, s.hidden)
    started = time.perf_counter()
    interp = dynamic.Interpreter(model, optimizer=dynamic.Adam(s.lr))
    interp.load()
    jit_s = time.perf_counter() - started
    device = torch.device("cuda")
    theirs = TorchTreeLSTM(model, builder, vocab, device)
    optimiser = torch.optim.Adam(theirs.p.values(), lr=s.lr)
    epochs = [epoch_batches(len(train), s.batch, e, s.seed) for e in range(s.epochs)]
    steps = [b for batches in epochs for b in batches]
    result: dict[str, Any] = {
        "suite": "sst", "environment": environment(), "settings": dataclasses.asdict(s), "jit_s": jit_s,
        "blocks": interp.blocks, "train_trees": len(train), "dev_trees": len(dev), "vocabulary": len(vocab),
        "nodes_per_step": [sum(len(train[i].nodes()) for i in b) for b in steps],
        "initial_dev": evaluate(theirs, dev), "epochs": [], "loss": {p: [] for p in PROVIDERS}}

    def torch_step(peer: Any, opt: Any, batch: list[int]) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = peer.batched_loss(peer.plan([train[i] for i in batch]))
        loss.backward()
        opt.step()
        return loss.detach()

    with fp32_exact():
        reference = TorchTreeLSTM(model, builder, vocab, device)
        reference.p = {k: v.detach().double().requires_grad_() for k, v in reference.p.items()}
        reference_opt = torch.optim.Adam(reference.p.values(), lr=s.lr)
        result["float64_loss"] = [float(torch_step(reference, reference_opt, b)) for b in steps[:s.compare_steps]]
        del reference, reference_opt
        for epoch, batches in enumerate(track(epochs, progress, "sst"), 1):
            row: dict[str, Any] = {"epoch": epoch, "steps": len(batches)}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses = []
            for batch in batches:
                graph = dynamic.Graph(model)
                builder.build_batch(graph, [train[i] for i in batch], vocab)
                previous = interp.step(graph)
                if previous is not None:
                    losses.append(previous)
            losses.append(interp.sync())
            row["persistrnn_sent_s"] = len(train) / (time.perf_counter() - t0)
            result["loss"]["persistrnn"] += losses
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            theirs_losses = [torch_step(theirs, optimiser, b) for b in batches]
            torch.cuda.synchronize()
            row["pytorch_sent_s"] = len(train) / (time.perf_counter() - t0)
            result["loss"]["pytorch"] += [float(x) for x in theirs_losses]
            ours_params = interp.params.detach().cpu().numpy()
            row["persistrnn_dev"] = evaluate(TorchTreeLSTM(model, builder, vocab, device, ours_params), dev)
            row["pytorch_dev"] = evaluate(theirs, dev)
            result["epochs"].append(row)
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def agreement(result: dict[str, Any]) -> dict[str, float]:
    """:func:`.runs.loss_agreement` of the interpreter and PyTorch against the float64 run."""
    from .runs import loss_agreement

    return loss_agreement(result["loss"]["persistrnn"], result["loss"]["pytorch"], result["float64_loss"])


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe
    from .runs import agreement_text

    s = result["settings"]
    a = agreement(result)
    first = result["initial_dev"]
    lines = ["# Tree-LSTM on SST fine-grained, trained with persistrnn's interpreter and with PyTorch "
             "(`python -m persistrnn bench sst`)", "", describe(result["environment"]),
             f"- Model: binary Tree-LSTM, hidden {s['hidden']}, embedding {s['embedding']}, a sentiment loss on "
             f"every node; vocabulary {result['vocabulary']} (the training trees' words, others UNK). "
             f"{result['train_trees']} training trees, {result['dev_trees']} dev trees. Interpreter: "
             f"{result['blocks']} blocks, JIT {result['jit_s']:.2f} s.",
             f"- Training: {s['epochs']} epochs of batches of {s['batch']} trees (shuffled per epoch, one order "
             f"for every run), Adam lr {s['lr']}, the loss summed over the batch's nodes; TF32 off. Sentences/s: "
             "wall clock of an epoch's training pass with the GPU synchronised at both ends. Dev: fine-grained "
             "(5-class) accuracy at the root and over all nodes, each run's parameters through the same "
             "level-batched fp32 forward.", "",
             f"Before training (one initialisation): dev root accuracy {first['root_accuracy']:.3f}, "
             f"loss per node {first['loss_per_node']:.3f}.", "",
             "| epoch | persistrnn sent/s | PyTorch sent/s | speed-up | dev root acc. (persistrnn / PyTorch) "
             "| dev node acc. | dev loss per node |", "|---|---|---|---|---|---|---|"]
    for r in result["epochs"]:
        ours, theirs = r["persistrnn_dev"], r["pytorch_dev"]
        lines.append(f"| {r['epoch']} | {r['persistrnn_sent_s']:,.0f} | {r['pytorch_sent_s']:,.0f} | "
                     f"{r['persistrnn_sent_s'] / r['pytorch_sent_s']:.2f}× | {ours['root_accuracy']:.3f} / "
                     f"{theirs['root_accuracy']:.3f} | {ours['node_accuracy']:.3f} / {theirs['node_accuracy']:.3f} "
                     f"| {ours['loss_per_node']:.4f} / {theirs['loss_per_node']:.4f} |")
    if a["steps"]:
        lines += ["", agreement_text(a, "PyTorch", "persistrnn's losses follow PyTorch's to fp32 rounding")]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> str:
    """Training loss per node (a running mean over 20 steps) and dev root accuracy."""
    from .runs import two_panels

    nodes = result["nodes_per_step"]

    def draw(left: Any, right: Any) -> None:
        for name, style in zip(PROVIDERS, ("-", "--")):
            per_node = [loss / n for loss, n in zip(result["loss"][name], nodes)]
            smooth = [statistics.fmean(per_node[max(0, i - 19):i + 1]) for i in range(len(per_node))]
            left.plot(range(1, len(smooth) + 1), smooth, style, label=name)
            accuracy = [result["initial_dev"]["root_accuracy"]] + [r[f"{name}_dev"]["root_accuracy"]
                                                                   for r in result["epochs"]]
            right.plot(range(len(accuracy)), accuracy, style + "o", label=name)
        ref = [loss / n for loss, n in zip(result["float64_loss"], nodes)]
        left.plot(range(1, len(ref) + 1), ref, ":", label="PyTorch float64 (first steps)")
        left.set(xlabel="training step", ylabel="training loss per node (mean of 20 steps)", title="training")
        right.set(xlabel="epoch", ylabel="dev root accuracy (5 classes)", title="dev")

    return two_panels(path, draw)


def main(argv: list[str] | None = None) -> int:
    import sys

    from . import runs

    return runs.main(argv, "sst", sys.modules[__name__], lambda s: True)
