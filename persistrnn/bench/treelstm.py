"""Tree-LSTM on SST, the dynamic interpreter against PyTorch: ``python -m persistrnn bench treelstm``.

Binary Tree-LSTM (:class:`persistrnn.dynamic.TreeLSTM`), hidden 256 and
embedding 256 as in VPPS Fig. 8, a sentiment loss on every node, SGD; batches
of consecutive SST train trees. Providers, in one process on one GPU:

* **ours**: one launch per batch (forward, backward and update; inference:
  forward only). Training throughput runs ``step()``, which schedules batch
  k+1 on the host while batch k runs; the host time of building and
  scheduling a batch and the kernel's device time (CUDA events, script
  already built) are reported beside it (VPPS Fig. 10).
* **torch eager**: the same model in PyTorch, one node at a time (fp32).
* **torch level-batched**: every node of one height across the batch in one
  op per gate group, as DGL does (fp32).

Training: sentences per second over ``iterations`` batches, wall clock with
the GPU synchronised at both ends, median of ``repeats``. Inference: ms per
batch, wall clock from the trees to the loss on the host (ours: build,
schedule, launch, read), median of ``repeats``. Each provider warms up first.
Before timing, ours is checked against the float64 reference interpreter on
the same parameters and script (relative error of the loss, reported).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from .environment import describe, environment
from .timing import time_cuda_ms

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclasses.dataclass
class Settings:
    hidden: int = 256
    embedding: int = 256
    batches: tuple[int, ...] = BATCHES
    iterations: int = 5  # batches per timing
    repeats: int = 3
    lr: float = 0.05
    trees: int = 2048  # SST train trees read (the vocabulary is theirs)


def _wall_ms(run: Callable[[], None], repeats: int) -> float:
    import torch

    run()  # warm-up: compiles, allocator, clocks
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


class TorchTreeLSTM:
    """The same binary Tree-LSTM in PyTorch (fp32, on the GPU), from the
    interpreter's initial parameters."""

    def __init__(self, model: Any, builder: Any, device: Any) -> None:
        import torch

        flat = model.initial_values()
        self.p = {p.name: torch.tensor(model.view(flat, p), device=device).squeeze(-1).requires_grad_()
                  for p in model.parameters}
        self.H, self.device = builder.hidden, device

    def optimizer(self, lr: float) -> Any:
        import torch

        return torch.optim.SGD(self.p.values(), lr=lr)

    def _cell(self, iou: Any, c_in: Any | None) -> tuple[Any, Any]:
        import torch

        H = self.H
        c = torch.sigmoid(iou[..., :H]) * torch.tanh(iou[..., 2 * H:])
        if c_in is not None:
            c = c + c_in
        return torch.sigmoid(iou[..., H:2 * H]) * torch.tanh(c), c

    def eager_loss(self, trees: list, vocab: Any) -> Any:
        """One node at a time."""
        import torch

        p, H = self.p, self.H
        logits, labels = [], []

        def visit(node: Any) -> tuple[Any, Any]:
            if node.word is not None:
                x = p["embed"][vocab[node.word]]
                h, c = self._cell(p["W_iou"] @ x + p["b_iou"], None)
            else:
                (hl, cl), (hr, cr) = visit(node.children[0]), visit(node.children[1])
                hcat = torch.cat([hl, hr])
                f = torch.sigmoid(p["U_f"] @ hcat + p["b_f"])
                h, c = self._cell(p["U_iou"] @ hcat + p["b_iou"], f[:H] * cl + f[H:] * cr)
            logits.append(p["W_out"] @ h + p["b_out"])
            labels.append(node.label)
            return h, c

        for t in trees:
            visit(t)
        target = torch.tensor(labels, device=self.device)
        return torch.nn.functional.cross_entropy(torch.stack(logits), target, reduction="sum")

    def levels(self, trees: list, vocab: Any) -> dict[str, Any]:
        """Host-side plan of a batch: nodes numbered level by level (height from the leaves)."""
        import torch

        order: list[list[Any]] = []
        number: dict[int, int] = {}
        height: dict[int, int] = {}
        for t in trees:
            for node in t.nodes():
                h = 0 if not node.children else 1 + max(height[id(c)] for c in node.children)
                height[id(node)] = h
                while len(order) <= h:
                    order.append([])
                order[h].append(node)
        count = 0
        for level in order:
            for node in level:
                number[id(node)] = count
                count += 1
        dev = self.device
        plan = {"words": torch.tensor([vocab[n.word] for n in order[0]], device=dev),
                "labels": torch.tensor([n.label for level in order for n in level], device=dev),
                "children": [(torch.tensor([number[id(n.children[0])] for n in level], device=dev),
                              torch.tensor([number[id(n.children[1])] for n in level], device=dev))
                             for level in order[1:]]}
        return plan

    def batched_loss(self, plan: dict[str, Any]) -> Any:
        import torch

        p, H = self.p, self.H
        h, c = self._cell(p["embed"][plan["words"]] @ p["W_iou"].t() + p["b_iou"], None)
        h_all, c_all = h, c
        for left, right in plan["children"]:
            hcat = torch.cat([h_all[left], h_all[right]], 1)
            f = torch.sigmoid(hcat @ p["U_f"].t() + p["b_f"])
            h, c = self._cell(hcat @ p["U_iou"].t() + p["b_iou"], f[:, :H] * c_all[left] + f[:, H:] * c_all[right])
            h_all, c_all = torch.cat([h_all, h]), torch.cat([c_all, c])
        logits = h_all @ p["W_out"].t() + p["b_out"]
        return torch.nn.functional.cross_entropy(logits, plan["labels"], reduction="sum")


def run_batch(batch: int, data: dict[str, Any], settings: Settings) -> dict[str, Any]:
    import torch

    from .. import dynamic

    trees, vocab, model, builder, interp = (data[k] for k in ("trees", "vocab", "model", "builder", "interp"))
    batches = [trees[(i * batch) % len(trees):(i * batch) % len(trees) + batch] for i in range(settings.iterations)]
    batches = [b for b in batches if len(b) == batch]
    row: dict[str, Any] = {"batch": batch, "nodes": sum(len(t.nodes()) for t in batches[0])}

    def graph_of(items: list) -> Any:
        g = dynamic.Graph(model)
        for t in items:
            builder.build(g, t, vocab)
        return g

    # ---- refcheck: the kernel against the float64 reference on one batch
    script = interp.schedule(graph_of(batches[0]), train=False)
    want = dynamic.run_script(script, interp.params.double().cpu().numpy()).loss
    launched = interp.launch(script, poison=True)
    row["ours_loss_error"] = abs(float(launched.loss.item()) - want) / abs(want)
    row["levels"] = script.stages

    # ---- ours
    started = time.perf_counter()
    scripts = [interp.schedule(graph_of(b)) for b in batches]
    row["ours_host_ms_per_batch"] = (time.perf_counter() - started) * 1e3 / len(batches)
    row["ours_train_kernel_ms"] = time_cuda_ms(lambda: interp.launch(scripts[0]), warmup=2, repeats=settings.repeats)

    def ours_train() -> None:
        for b in batches:
            interp.step(graph_of(b))
        interp.sync()

    row["ours_train_sent_s"] = batch * len(batches) / (_wall_ms(ours_train, settings.repeats) / 1e3)
    infer = interp.schedule(graph_of(batches[0]), train=False)
    row["ours_infer_kernel_ms"] = time_cuda_ms(lambda: interp.launch(infer), warmup=2, repeats=settings.repeats)
    row["ours_infer_ms"] = _wall_ms(lambda: interp.run(graph_of(batches[0]), train=False), settings.repeats)

    # ---- PyTorch
    peer = data["peer"]
    opt = peer.optimizer(settings.lr)

    def torch_train(loss_of: Callable[[list], Any]) -> Callable[[], None]:
        def run() -> None:
            for b in batches:
                opt.zero_grad(set_to_none=False)
                loss_of(b).backward()
                opt.step()
        return run

    def eager(b: list) -> Any:
        return peer.eager_loss(b, vocab)

    def level_batched(b: list) -> Any:
        return peer.batched_loss(peer.levels(b, vocab))

    for name, loss_of in (("eager", eager), ("batched", level_batched)):
        row[f"torch_{name}_train_sent_s"] = batch * len(batches) / (
            _wall_ms(torch_train(loss_of), settings.repeats) / 1e3)

        def infer_once(loss_of: Callable[[list], Any] = loss_of) -> None:
            with torch.no_grad():
                float(loss_of(batches[0]))

        row[f"torch_{name}_infer_ms"] = _wall_ms(infer_once, settings.repeats)
    return row


def run(settings: Settings, progress: bool = True) -> dict[str, Any]:
    import torch

    from .. import dynamic

    trees = dynamic.read_sst(dynamic.DATA_DIR / "sst" / "train.txt", limit=settings.trees)
    vocab = dynamic.Vocabulary(w for t in trees for w in t.words())
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, len(vocab), settings.embedding, settings.hidden)
    started = time.perf_counter()
    interp = dynamic.Interpreter(model, optimizer=dynamic.SGD(settings.lr))
    interp.load()
    jit_s = time.perf_counter() - started
    data = {"trees": trees, "vocab": vocab, "model": model, "builder": builder, "interp": interp,
            "peer": TorchTreeLSTM(model, builder, torch.device("cuda"))}
    result: dict[str, Any] = {"environment": environment(), "settings": dataclasses.asdict(settings),
                              "jit_s": jit_s, "blocks": interp.blocks, "rows": []}
    batches = settings.batches
    if progress:
        from rich.progress import track

        batches = track(batches, description="treelstm", transient=True)
    for batch in batches:
        result["rows"].append(run_batch(batch, data, settings))
    return result


COLUMNS = [
    ("batch", "batch", "{}"),
    ("nodes", "nodes", "{}"),
    ("levels", "levels (script stages)", "{}"),
    ("ours_train_sent_s", "ours train sent/s", "{:.0f}"),
    ("torch_batched_train_sent_s", "torch level-batched sent/s", "{:.0f}"),
    ("torch_eager_train_sent_s", "torch eager sent/s", "{:.0f}"),
    ("ours_train_kernel_ms", "ours train kernel ms", "{:.3f}"),
    ("ours_host_ms_per_batch", "ours host ms/batch", "{:.3f}"),
    ("ours_infer_ms", "ours infer ms", "{:.3f}"),
    ("ours_infer_kernel_ms", "ours infer kernel ms", "{:.3f}"),
    ("torch_batched_infer_ms", "torch level-batched infer ms", "{:.3f}"),
    ("torch_eager_infer_ms", "torch eager infer ms", "{:.3f}"),
    ("ours_loss_error", "ours loss error vs float64", "{:.1e}"),
]


def format_table(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " | train speed-up | infer speed-up |",
             "|" + "---|" * (len(COLUMNS) + 2)]
    for r in result["rows"]:
        best_train = max(r["torch_batched_train_sent_s"], r["torch_eager_train_sent_s"])
        best_infer = min(r["torch_batched_infer_ms"], r["torch_eager_infer_ms"])
        cells = [fmt.format(r[key]) for key, _, fmt in COLUMNS]
        cells += [f"{r['ours_train_sent_s'] / best_train:.1f}×", f"{best_infer / r['ours_infer_ms']:.1f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m persistrnn bench treelstm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--embedding", type=int, default=Settings.embedding)
    parser.add_argument("--iterations", type=int, default=Settings.iterations)
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--out", type=Path, default=None, help="write treelstm.{md,csv,json} into this folder")
    args = parser.parse_args(argv)
    settings = Settings(hidden=args.hidden, embedding=args.embedding, batches=tuple(args.batch),
                        iterations=args.iterations, repeats=args.repeats)
    result = run(settings)
    header = describe(result["environment"]) + (f"\n- JIT (compile and load both variants): {result['jit_s']:.2f} s; "
                                                f"{result['blocks']} blocks")
    text = header + "\n\n" + format_table(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "treelstm.md").write_text(text + "\n")
        (args.out / "treelstm.json").write_text(json.dumps(result, indent=2, default=str))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
        (args.out / "treelstm.csv").write_text(buffer.getvalue())
    print(text)
    return 0
