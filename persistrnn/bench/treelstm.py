"""Tree-LSTM on SST, the dynamic interpreter against PyTorch: ``python -m persistrnn bench treelstm``.

Binary Tree-LSTM (:class:`persistrnn.dynamic.TreeLSTM`), hidden 256 and
embedding 256 as in VPPS Fig. 8, a sentiment loss on every node, SGD; batches
of consecutive SST train trees. Providers, in one process on one GPU:

* **ours**: one launch per batch (forward, backward and update; inference:
  forward only). Training throughput runs ``step()``, which schedules batch
  k+1 on the host while batch k runs; the host time of building and
  scheduling a batch (VPPS Fig. 10) and the kernel's device time are
  reported beside it (:func:`kernel_ms`: every timed batch's script, built
  beforehand, launched back to back between two CUDA events, ms per
  launch). A second training
  timing takes each batch's script from ``host_workers`` worker processes
  that make them ahead (``Interpreter.scripts``), over the batches repeated
  to at least six per worker, timed after each loop's first two per worker
  (the workers' ramp); the train speed-up is the faster of the two against
  the best peer.
* **torch eager**: the same model in PyTorch, one node at a time (fp32).
* **DyNet autobatch (CPU)**: the same model in DyNet with automatic
  batching (VPPS's baseline; :mod:`.dynet_peer`), where ``dynet38`` is
  installed, else absent.
* **torch level-batched**: every node of one height across the batch in one
  op per gate group, as DGL does (fp32); the host plans each batch (child
  indices per level) inside the timing.
* **torch level-batched + CUDA graph**: the same ops captured once per batch
  (forward, backward and the SGD step) and replayed; capture and planning
  happen in the warm-up, outside the timing: the strongest PyTorch peer.
  Where capture fails the provider is reported absent.

Training: sentences per second over ``iterations`` batches, wall clock with
the GPU synchronised at both ends, median of ``repeats``. Inference: ms per
batch, wall clock from the inputs to the loss on the host (ours: build,
schedule, launch, read), median of ``repeats``. Each provider warms up first.
Before timing, ours is checked against the float64 reference interpreter on
the same parameters and script (relative error of the loss, reported).
Outputs (``--out``): ``<suite>.md``, ``.csv``, ``.json`` and, with
matplotlib, ``<suite>.png`` (throughput and latency against batch).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import importlib.metadata
import io
import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from .dynet_peer import DyNetTreeLSTM, load_dynet
from .environment import describe, environment
from .timing import time_cuda_ms, warm_up

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
ITEM_KERNEL_MS = 2.0
"""Kernel time a worker's item of scripts holds in the loop with workers (``per_item`` is the batches'
scripts that reach it, up to :data:`MAX_PER_ITEM`)."""
MAX_PER_ITEM = 8


@dataclasses.dataclass
class Settings:
    hidden: int = 256
    embedding: int = 256
    batches: tuple[int, ...] = BATCHES
    iterations: int = 5  # batches per timing
    repeats: int = 3
    lr: float = 0.05
    inputs: int = 2048  # training inputs read (the vocabulary is theirs)
    # Processes that make scripts ahead (dynamic.script_loader) for the second training timing, leaving two
    # CPUs to the launching process and the system (0: not timed). On the 16-CPU H100 host 14 workers ran the
    # Tree-LSTM 1.6x faster than 8 at batch 128 and 1.2x at 16, 0.9x at batch 1; above 16, not measured
    # (perf-notes dynamic §23).
    host_workers: int = max(0, min(16, (os.cpu_count() or 1) - 2))


@dataclasses.dataclass
class Workload:
    """What a suite runs: the inputs, the model and its builder, how one
    input goes into a graph, and the PyTorch peer (``eager_loss(items)``,
    ``plan(items)``, ``batched_loss(plan)``, ``optimizer(lr)``).
    ``add_batch``, where given, adds a whole batch at once (a builder's
    ``build_batch``) in place of ``add_to_graph`` per input."""

    name: str
    inputs: list
    model: Any
    add_to_graph: Callable[[Any, Any], None]
    peer: Any
    add_batch: Callable[[Any, list], None] | None = None
    dynet: Callable[[Any, float], Any] | None = None  # (dynet, lr) -> the DyNet peer (bench.dynet_peer)


def kernel_ms(interp: Any, scripts: list, repeats: int) -> float:
    """Device ms per launch of ``scripts`` (every timed batch's, built
    beforehand), launched back to back between two CUDA events, the median
    of ``repeats`` after a warm-up to steady clocks (the row's scheduling
    leaves the GPU idle before it). The launches are issued while the GPU
    sleeps (``queued``), so a launch's host work and any stall of the host
    between two launches do not count. Timing the first batch's launch
    alone, between its own events, counted both: the tagger's batch-1 kernel
    read 3.010 ms where its loop of steps ran 0.81 ms a batch (perf-notes
    dynamic §28); back to back without the sleep, the Tree-LSTM's 0.19 ms
    batch-1 inference kernel read 0.273 ms on a slow host (§32)."""
    def launches() -> None:
        for script in scripts:
            interp.launch(script)

    warm_up(launches)
    return time_cuda_ms(launches, warmup=1, repeats=repeats, queued=True) / len(scripts)


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


def _steady_ms(interp: Any, scripts: Any, ramp: int, repeats: int) -> tuple[float, float, float]:
    """A training loop over ``scripts`` (an iterable, one pass a loop)
    from the return of the ``ramp``-th ``step`` to the loop's end, the GPU
    synchronised: (wall ms, ms of it the loop waited for the next script, ms
    it spent in ``step``: the launch and the wait for the previous batch);
    after a warm-up loop, the repeat of median wall time."""
    import torch

    def loop() -> tuple[float, float, float]:
        torch.cuda.synchronize()
        waiting = stepping = 0.0
        scripts_in_order = iter(scripts)
        for i in itertools.count(1):
            asked = time.perf_counter()
            script = next(scripts_in_order, None)
            got = time.perf_counter()
            if script is None:
                break
            interp.step(script)
            if i > ramp:
                waiting, stepping = waiting + got - asked, stepping + time.perf_counter() - got
            elif i == ramp:
                started = time.perf_counter()
        interp.sync()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3, waiting * 1e3, stepping * 1e3

    loop()  # warm-up: the workers' start
    runs = sorted(loop() for _ in range(repeats))
    return runs[len(runs) // 2]


def _torch_params(model: Any, device: Any, flat: Any = None) -> dict[str, Any]:
    """The parameters as torch tensors from a flat buffer in the model's layout (default: the initial values)."""
    import torch

    flat = model.initial_values() if flat is None else flat
    return {p.name: torch.tensor(model.view(flat, p), device=device).squeeze(-1).requires_grad_()
            for p in model.parameters}


class TorchTreeLSTM:
    """The same binary Tree-LSTM in PyTorch (fp32), from the interpreter's
    initial parameters; ``U`` holds ``[U_iou; U_f]`` as the builder's does."""

    def __init__(self, model: Any, builder: Any, vocab: Any, device: Any, flat: Any = None) -> None:
        self.p = _torch_params(model, device, flat)
        self.H, self.vocab, self.device = builder.hidden, vocab, device

    def optimizer(self, lr: float) -> Any:
        import torch

        return torch.optim.SGD(self.p.values(), lr=lr)

    def _cell(self, iou: Any, c_in: Any | None) -> tuple[Any, Any]:
        import torch

        H = self.H
        c = torch.sigmoid(iou[..., :H]) * torch.tanh(iou[..., 2 * H:3 * H])
        if c_in is not None:
            c = c + c_in
        return torch.sigmoid(iou[..., H:2 * H]) * torch.tanh(c), c

    def _visit(self, node: Any, logits: list, labels: list) -> tuple[Any, Any]:
        """(h, c) of ``node``, its subtree's logits and labels appended. A method, not a closure that calls
        itself: such a cycle would keep the step's graph (and its AccumulateGrad nodes, bound to this stream)
        alive until a garbage collection, and a later capture on another stream then fails
        (cudaErrorStreamCaptureImplicit in backward)."""
        import torch

        p, H = self.p, self.H
        if node.word is not None:
            x = p["embed"][self.vocab[node.word]]
            h, c = self._cell(p["W_iou"] @ x + p["b_iou"], None)
        else:
            (hl, cl), (hr, cr) = (self._visit(child, logits, labels) for child in node.children)
            gates = p["U"] @ torch.cat([hl, hr])
            f = torch.sigmoid(gates[3 * H:] + p["b_f"])
            h, c = self._cell(gates[:3 * H] + p["b_iou"], f[:H] * cl + f[H:] * cr)
        logits.append(p["W_out"] @ h + p["b_out"])
        labels.append(node.label)
        return h, c

    def eager_loss(self, trees: list) -> Any:
        """One node at a time."""
        import torch

        logits, labels = [], []
        for t in trees:
            self._visit(t, logits, labels)
        target = torch.tensor(labels, device=self.device)
        return torch.nn.functional.cross_entropy(torch.stack(logits), target, reduction="sum")

    def plan(self, trees: list) -> dict[str, Any]:
        """Host-side plan of a batch: nodes numbered level by level (height from the leaves); ``roots``
        numbers each tree's root."""
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
        return {"words": torch.tensor([self.vocab[n.word] for n in order[0]], device=dev),
                "labels": torch.tensor([n.label for level in order for n in level], device=dev),
                "children": [(torch.tensor([number[id(n.children[0])] for n in level], device=dev),
                              torch.tensor([number[id(n.children[1])] for n in level], device=dev))
                             for level in order[1:]],
                "roots": torch.tensor([number[id(t)] for t in trees], device=dev)}

    def logits(self, plan: dict[str, Any]) -> Any:
        """(nodes, classes): every node's sentiment logits, in the plan's numbering."""
        import torch

        p, H = self.p, self.H
        h, c = self._cell(p["embed"][plan["words"]] @ p["W_iou"].t() + p["b_iou"], None)
        h_all, c_all = h, c
        for left, right in plan["children"]:
            gates = torch.cat([h_all[left], h_all[right]], 1) @ p["U"].t()
            f = torch.sigmoid(gates[:, 3 * H:] + p["b_f"])
            h, c = self._cell(gates[:, :3 * H] + p["b_iou"], f[:, :H] * c_all[left] + f[:, H:] * c_all[right])
            h_all, c_all = torch.cat([h_all, h]), torch.cat([c_all, c])
        return h_all @ p["W_out"].t() + p["b_out"]

    def batched_loss(self, plan: dict[str, Any]) -> Any:
        import torch

        return torch.nn.functional.cross_entropy(self.logits(plan), plan["labels"], reduction="sum")


@dataclasses.dataclass
class CapturedStep:
    """One batch of the level-batched peer captured in a CUDA graph.

    ``plan`` is held here because the graph reads its index tensors by
    address: dropped, their memory goes back to the caching allocator, the
    next plan is allocated over it and replays gather with another batch's
    (out-of-range) indices. ``loss`` is the static output, detached: keeping
    the captured autograd graph would keep its AccumulateGrad nodes, bound to
    the capture stream, alive into later backward passes on other streams.
    Where the device cannot capture (the CPU), ``graph`` is None and
    :meth:`replay` runs the same step eagerly on the same plan.
    """

    graph: Any
    loss: Any
    plan: dict[str, Any]
    body: Callable[[], Any]

    def replay(self) -> None:
        if self.graph is None:
            self.loss = self.body()
        else:
            self.graph.replay()


def capture_step(peer: Any, plan: dict[str, Any], opt: Any | None, stream: Any | None = None,
                 pool: Any | None = None) -> CapturedStep:
    """``peer.batched_loss(plan)`` (and, with ``opt``, its backward and the
    SGD step) captured in a CUDA graph on ``stream`` into the memory pool
    ``pool`` (None: a pool of its own). Graphs that share a pool must be
    replayed in the order they were captured, as the training loop does."""
    import torch

    def body() -> Any:
        if opt is None:
            with torch.no_grad():
                return peer.batched_loss(plan)
        opt.zero_grad(set_to_none=False)
        loss = peer.batched_loss(plan)
        loss.backward()
        opt.step()
        return loss.detach()

    if plan["labels"].device.type != "cuda":
        return CapturedStep(None, body(), plan, body)
    # Graphs of earlier eager steps still held (in reference cycles, say) keep AccumulateGrad nodes bound to
    # the stream they ran on; a backward captured on `side` cannot wait on that stream.
    gc.collect()
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream, off the default one, as torch.cuda.graph asks
        for _ in range(2):
            body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        loss = body()
    torch.cuda.current_stream().wait_stream(side)
    return CapturedStep(graph, loss, plan, body)


def release_device_memory() -> None:
    """Return the memory of dropped graphs, pools and cached blocks to the
    device, so that one batch size's captures do not crowd out the next."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def consecutive_batches(items: list, batch: int, iterations: int) -> list[list]:
    """``iterations`` batches of ``batch`` consecutive inputs, wrapping
    around; a batch that would run past the end is left out."""
    batches = [items[(i * batch) % len(items):(i * batch) % len(items) + batch] for i in range(iterations)]
    return [b for b in batches if len(b) == batch]


def run_batch(batch: int, work: Workload, interp: Any, settings: Settings) -> dict[str, Any]:
    import torch

    from .. import dynamic

    batches = consecutive_batches(work.inputs, batch, settings.iterations)

    def build(g: Any, group: list) -> None:
        if work.add_batch is not None:
            work.add_batch(g, group)
        else:
            for item in group:
                work.add_to_graph(g, item)

    def graph_of(group: list) -> Any:
        g = dynamic.Graph(work.model)
        build(g, group)
        return g

    first = graph_of(batches[0])
    row: dict[str, Any] = {"batch": batch, "nodes": len(first)}

    # ---- refcheck: the kernel against the float64 reference on one batch
    script = interp.schedule(first, train=False)
    want = dynamic.run_script(script, interp.params.double().cpu().numpy()).loss
    launched = interp.launch(script, poison=True)
    row["ours_loss_error"] = abs(launched.result() - want) / abs(want)
    row["stages_infer"] = script.stages

    # ---- ours
    started = time.perf_counter()
    graphs = [graph_of(b) for b in batches]
    built = time.perf_counter()
    scripts = [interp.schedule(g) for g in graphs]
    done = time.perf_counter()
    row["ours_build_ms_per_batch"] = (built - started) * 1e3 / len(batches)
    row["ours_schedule_ms_per_batch"] = (done - built) * 1e3 / len(batches)
    row["ours_host_ms_per_batch"] = row["ours_build_ms_per_batch"] + row["ours_schedule_ms_per_batch"]
    row["ours_instructions_per_input"] = scripts[0].instructions / batch
    row["stages_train"] = scripts[0].stages
    row["ours_trainkernel_ms"] = kernel_ms(interp, scripts, settings.repeats)

    def ours_train() -> None:
        for b in batches:
            interp.step(graph_of(b))
        interp.sync()

    row["ours_train_sent_s"] = batch * len(batches) / (_wall_ms(ours_train, settings.repeats) / 1e3)
    row["host_workers"] = settings.host_workers
    if settings.host_workers:
        # The same loop with each batch's script made ahead by worker processes (they start in the warm-up
        # run). Each loop starts with a ramp: every worker makes its first `prefetch` (2) items at once, and the
        # launches wait for them (a loop of 20 batches, as timed first, holds its ramp in full; perf-notes dynamic
        # §11). An epoch has hundreds of batches, so the rate is timed past the ramp: from the launch of batch
        # 2 W per_item to the end of the loop, over the batches repeated to at least three times that.
        # A worker's item holds ~ITEM_KERNEL_MS of kernel time in scripts: the launching process's cost per
        # DataLoader item (~0.1-0.25 ms, perf-notes dynamic §32) is then a small part of the kernel's time.
        per_item = max(1, min(MAX_PER_ITEM, math.ceil(ITEM_KERNEL_MS / row["ours_trainkernel_ms"])))
        row["ours_workers_per_item"] = per_item
        ramp = 2 * settings.host_workers * per_item
        ahead = batches * -(-3 * ramp // len(batches))
        scripts_ahead = interp.scripts(ahead, build, workers=settings.host_workers, per_item=per_item)
        wall, waiting, stepping = _steady_ms(interp, scripts_ahead, ramp, settings.repeats)
        timed = len(ahead) - ramp
        row["ours_workers_train_sent_s"] = batch * timed / (wall / 1e3)
        # Where the launching process's time goes past the ramp: waiting for the workers' next script, or in
        # step (the launch, then the wait for the previous batch's kernel).
        row["ours_workers_wait_ms_per_batch"] = waiting / timed
        row["ours_workers_step_ms_per_batch"] = stepping / timed
    row["ours_inferkernel_ms"] = kernel_ms(interp, [interp.schedule(g, train=False) for g in graphs],
                                             settings.repeats)
    row["ours_infer_ms"] = _wall_ms(lambda: interp.run(graph_of(batches[0]), train=False), settings.repeats)

    # ---- PyTorch
    peer = work.peer
    opt = peer.optimizer(settings.lr)

    def torch_train(loss_of: Callable[[list], Any]) -> Callable[[], None]:
        def run() -> None:
            for b in batches:
                opt.zero_grad(set_to_none=False)
                loss_of(b).backward()
                opt.step()
        return run

    def level_batched(b: list) -> Any:
        return peer.batched_loss(peer.plan(b))

    for name, loss_of in (("eager", peer.eager_loss), ("batched", level_batched)):
        row[f"torch_{name}_train_sent_s"] = batch * len(batches) / (
            _wall_ms(torch_train(loss_of), settings.repeats) / 1e3)

        def infer_once(loss_of: Callable[[list], Any] = loss_of) -> None:
            with torch.no_grad():
                float(loss_of(batches[0]))

        row[f"torch_{name}_infer_ms"] = _wall_ms(infer_once, settings.repeats)

    # ---- DyNet with automatic batching, on the CPU, where it is installed
    dy, _ = load_dynet()
    row["dynet_train_sent_s"] = row["dynet_infer_ms"] = None
    if dy is not None and work.dynet is not None:
        dynet = work.dynet(dy, settings.lr)

        def dynet_train() -> None:
            for b in batches:
                dynet.train_step(b)

        row["dynet_train_sent_s"] = batch * len(batches) / (_wall_ms(dynet_train, settings.repeats) / 1e3)
        row["dynet_infer_ms"] = _wall_ms(lambda: dynet.infer(batches[0]), settings.repeats)

    # One capture stream and one pool for this batch size's training graphs
    # (replayed in capture order); everything is dropped and the cache
    # emptied before the next batch size, on failure too.
    captured: list[CapturedStep] = []
    infer_step: CapturedStep | None = None
    try:
        # A capture that fails can leave its stream current; leaving this
        # context makes the default stream current again.
        with torch.cuda.stream(torch.cuda.current_stream()):
            side, train_pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            captured = [capture_step(peer, peer.plan(b), opt, side, train_pool) for b in batches]

            def graph_train() -> None:
                for step in captured:
                    step.replay()

            row["torch_graph_train_sent_s"] = batch * len(batches) / (
                _wall_ms(graph_train, settings.repeats) / 1e3)
            infer_step = capture_step(peer, peer.plan(batches[0]), None, side)

            def graph_infer() -> None:
                infer_step.replay()
                float(infer_step.loss)

            row["torch_graph_infer_ms"] = _wall_ms(graph_infer, settings.repeats)
    except RuntimeError as exc:  # an op that cannot be captured: the provider is absent, with the reason
        row["torch_graph_train_sent_s"] = row["torch_graph_infer_ms"] = None
        while exc.__context__ is not None:  # the first error, not capture_end's "previous error during capture"
            exc = exc.__context__
        row["torch_graph_error"] = str(exc).splitlines()[0]
    finally:
        captured, infer_step = [], None
        release_device_memory()
    return row


def tree_lstm_workload(settings: Settings, device: Any) -> Workload:
    from .. import dynamic

    trees = dynamic.read_sst(dynamic.DATA_DIR / "sst" / "train.txt", limit=settings.inputs)
    vocab = dynamic.Vocabulary(w for t in trees for w in t.words())
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, len(vocab), settings.embedding, settings.hidden)
    return Workload("treelstm", trees, model, lambda g, tree: builder.build(g, tree, vocab),
                    TorchTreeLSTM(model, builder, vocab, device),
                    add_batch=lambda g, group: builder.build_batch(g, group, vocab),
                    dynet=lambda dy, lr: DyNetTreeLSTM(dy, model, builder, vocab, lr))


def run(settings: Settings, make_workload: Callable[[Settings, Any], Workload] = tree_lstm_workload,
        progress: bool = True) -> dict[str, Any]:
    import torch

    from .. import dynamic

    work = make_workload(settings, torch.device("cuda"))
    started = time.perf_counter()
    interp = dynamic.Interpreter(work.model, optimizer=dynamic.SGD(settings.lr))
    interp.load()
    jit_s = time.perf_counter() - started
    dy, why = load_dynet()
    result: dict[str, Any] = {"suite": work.name, "environment": environment(),
                              "settings": dataclasses.asdict(settings), "jit_s": jit_s, "blocks": interp.blocks,
                              "placement": interp.placement, "rows": [],
                              "dynet": f"dynet38 {importlib.metadata.version('dynet38')}" if dy is not None else why}
    batches = settings.batches
    if progress:
        from rich.progress import track

        batches = track(batches, description=work.name, transient=True)
    initial = interp.params.clone()
    # The inputs, the models and the interpreter, out of the cyclic collector's full passes (~0.17 s each over
    # an SST run's ~300k objects, one every few dozen batches of 128 of either side's host work; perf-notes
    # dynamic §35), as a long training or serving process would keep them.
    gc.collect()
    gc.freeze()
    try:
        for batch in batches:
            # Every batch size starts from the initial parameters, so its float64 check measures the kernel on
            # the model it was built with: the timed SGD steps of the rows before (the same few batches,
            # hundreds of times) drove the tagger into saturation, where float32 and float64 runs of one script
            # part by 3e-3 (perf-notes dynamic §24).
            interp.params.copy_(initial)
            result["rows"].append(run_batch(batch, work, interp, settings))
            release_device_memory()
    finally:
        gc.unfreeze()  # as `bench serve` does: a process that runs more than this suite collects them again
    return result


COLUMNS = [
    ("batch", "batch", "{}"),
    ("nodes", "graph nodes", "{}"),
    ("stages_train", "stages (train)", "{}"),
    ("ours_train_sent_s", "ours train sent/s", "{:.0f}"),
    ("ours_workers_train_sent_s", "ours train sent/s, scripts made ahead by host workers", "{:.0f}"),
    ("torch_graph_train_sent_s", "torch level-batched + graph sent/s", "{:.0f}"),
    ("torch_batched_train_sent_s", "torch level-batched sent/s", "{:.0f}"),
    ("torch_eager_train_sent_s", "torch eager sent/s", "{:.0f}"),
    ("dynet_train_sent_s", "DyNet autobatch (CPU) sent/s", "{:.0f}"),
    ("ours_workers_wait_ms_per_batch", "ours with workers: ms/batch waiting for a script", "{:.2f}"),
    ("ours_workers_step_ms_per_batch", "ours with workers: ms/batch in step", "{:.2f}"),
    ("ours_workers_per_item", "ours with workers: scripts per worker item", "{}"),
    ("ours_trainkernel_ms", "ours train kernel ms", "{:.3f}"),
    ("ours_host_ms_per_batch", "ours host ms/batch (build + schedule)", "{:.2f}"),
    ("ours_instructions_per_input", "ours instructions/input", "{:.0f}"),
    ("ours_infer_ms", "ours infer ms", "{:.3f}"),
    ("ours_inferkernel_ms", "ours infer kernel ms", "{:.3f}"),
    ("torch_graph_infer_ms", "torch level-batched + graph infer ms", "{:.3f}"),
    ("torch_batched_infer_ms", "torch level-batched infer ms", "{:.3f}"),
    ("torch_eager_infer_ms", "torch eager infer ms", "{:.3f}"),
    ("dynet_infer_ms", "DyNet autobatch (CPU) infer ms", "{:.3f}"),
    ("ours_loss_error", "ours loss error vs float64", "{:.1e}"),
]
PEERS = ("graph", "batched", "eager")


def best_peer(row: dict[str, Any]) -> tuple[float, float]:
    """The best PyTorch training throughput and inference latency of a row."""
    train = [row[f"torch_{p}_train_sent_s"] for p in PEERS if row.get(f"torch_{p}_train_sent_s") is not None]
    infer = [row[f"torch_{p}_infer_ms"] for p in PEERS if row.get(f"torch_{p}_infer_ms") is not None]
    return max(train), min(infer)


def format_table(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " | train speed-up | infer speed-up |",
             "|" + "---|" * (len(COLUMNS) + 2)]
    for r in result["rows"]:
        best_train, best_infer = best_peer(r)
        cells = ["absent" if r.get(key) is None else fmt.format(r[key]) for key, _, fmt in COLUMNS]
        ours_train = max(r["ours_train_sent_s"], r.get("ours_workers_train_sent_s") or 0)
        cells += [f"{ours_train / best_train:.1f}×", f"{best_infer / r['ours_infer_ms']:.1f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Training throughput and inference latency against batch; None without matplotlib."""
    from .compare import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    rows = result["rows"]
    batch = [r["batch"] for r in rows]
    fig, (train, infer) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("ours", "persistrnn.dynamic", "-o"), ("torch_graph", "torch level-batched + graph",
                              "--s"), ("torch_batched", "torch level-batched", "--^"), ("torch_eager", "torch eager",
                              ":v")):
        train.plot(batch, [r.get(f"{key}_train_sent_s") for r in rows], style, label=label)
        infer.plot(batch, [r.get(f"{key}_infer_ms") for r in rows], style, label=label)
    ahead = [r.get("ours_workers_train_sent_s") for r in rows]
    if any(v is not None for v in ahead):
        train.plot(batch, ahead, "-D", label="persistrnn.dynamic, scripts made ahead by host workers")
    for ax, title, unit in ((train, "training", "sentences/s"), (infer, "inference", "ms per batch")):
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel=unit, title=f"{result['suite']} {title}")
        ax.grid(True, which="both", alpha=0.3)
    train.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def write_outputs(result: dict[str, Any], text: str, out: Path) -> list[str]:
    """``<suite>.md``, ``.csv``, ``.json`` and ``.png`` (with matplotlib) in ``out``; the paths written."""
    name = result["suite"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=sorted({k for r in result["rows"] for k in r}))
    writer.writeheader()
    writer.writerows(result["rows"])
    (out / f"{name}.csv").write_text(buffer.getvalue())
    written = [str(out / f"{name}.{ext}") for ext in ("md", "json", "csv")]
    picture = plot(result, out / f"{name}.png")
    return written + ([picture] if picture else [])


def main(argv: list[str] | None = None, suite: str = "treelstm",
         make_workload: Callable[[Settings, Any], Workload] = tree_lstm_workload, description: str = __doc__) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m persistrnn bench {suite}",
                                     description=description.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--embedding", type=int, default=Settings.embedding)
    parser.add_argument("--iterations", type=int, default=Settings.iterations)
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--host-workers", type=int, default=Settings.host_workers,
                        help="processes that make scripts ahead for the second training timing (0: none)")
    parser.add_argument("--out", type=Path, default=None, help=f"write {suite}.{{md,csv,json,png}} into this folder")
    args = parser.parse_args(argv)
    settings = Settings(hidden=args.hidden, embedding=args.embedding, batches=tuple(args.batch),
                        iterations=args.iterations, repeats=args.repeats, host_workers=args.host_workers)
    result = run(settings, make_workload)
    header = describe(result["environment"]) + (f"\n- JIT (compile and load both variants): {result['jit_s']:.2f} s; "
                                                f"{result['blocks']} blocks, placement {result['placement']}"
                                                f"\n- DyNet (CPU, automatic batching): {result['dynet']}")
    text = header + "\n\n" + format_table(result)
    if args.out:
        text += "\n\n" + "\n".join(f"- wrote {p}" for p in write_outputs(result, text, args.out))
    print(text)
    return 0
