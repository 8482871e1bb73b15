"""The serving engine under a voice-activity load: ``python -m persistrnn bench serve``.

For each model and each number of live streams N, two providers run the same
load for ``seconds`` (after ``warmup_seconds`` that are not measured), once
for each way of handing chunks over:

* ``persistrnn``: :class:`persistrnn.serve.Engine` over the persistrnn module
  (cellular batching: a tick runs the streams that have input, padded to a
  power of two, on the planner's path);
* ``persistrnn-resident``: the same engine in resident mode
  (``Engine(..., resident=True)``): every tick runs on one persistent kernel
  that stays launched and takes its input rows from pinned host memory
  (one-layer models only; other models' rows say why they did not run);
* ``cudnn-padded``: the peer, a padding batcher over the ``torch.nn`` module
  (cuDNN) with the same tick policy and the same engine machinery: every
  tick pads its batch to all live streams (the padding rows' states are not
  written back), as a batcher that pads every active stream's chunk into one
  batch does.

Hand-overs:

* ``stream``: a call per chunk. Each client thread submits each stream's
  chunk when it is due (``Stream.submit``) and the future's callback records
  its delivery.
* ``gateway``: a call per group, as a front end receiving frames for many
  streams does. Each client thread hands all of its streams' chunks that are
  due in one ``Engine.push_many`` (one (n, steps, I) tensor, its receive
  buffer), then takes the outputs of its oldest group with one
  ``Engine.pull_many``, waiting at most until its next chunk is due; a
  group's chunks are delivered when that call returns. A stream holding
  ``max_pending`` chunks is left out of its group (a refused push).

The load. N streams are live at the start, each at a random point of its
life; new streams arrive as a Poisson process of rate N / mean life (so N
stay live on average, Little's law) and are refused when all slots are
taken (the engine has N + 4 sqrt(N) + 8 slots). A stream's length in chunks
is exponential with mean ``mean_chunks`` (at least 1). Every stream submits
a chunk of ``steps`` steps every ``chunk_ms`` (32 ms), at its own phase,
from one of ``threads`` client threads. Latency is push→pull: from the call
that queues a chunk to the moment its output is delivered, for chunks pushed
inside the measured window. Throughput counts the chunks delivered in the window.

Before the load, each provider's outputs on one stream of 4 chunks are
compared with the float64 reference (``--no-refcheck`` skips that). Every
padded batch size is planned and captured before the load (ours), so no
first call's tuning falls inside it. After the warm-up, ``gc.freeze()``
moves every object made so far (torch, the model, the engine) out of the
garbage collector's reach, as a latency-minded Python server does once it
has started: a full collection otherwise walks them all while every thread
waits (``--no-gc-freeze`` leaves them in). The clients are Python threads: their
own time under the GIL is part of what is measured, as it is for a Python
server.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import gc
import heapq
import math
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from .environment import add_result_arguments, run_or_load

PROVIDERS = ("persistrnn", "persistrnn-resident", "cudnn-padded")
HANDOVERS = ("stream", "gateway")
REAL_TIME_P99_MS = 10.0
"""A stream is served in real time while the p99 latency stays at or under this."""


@dataclasses.dataclass
class Settings:
    seconds: float = 5.0
    warmup_seconds: float = 1.0
    chunk_ms: float = 32.0
    steps: int = 1
    mean_chunks: float = 100.0
    threads: int = 8
    max_pending: int = 8
    seed: int = 0
    refcheck: bool = True
    gc_freeze: bool = True


def parse_model(text: str) -> tuple[str, int, int]:
    """``lstm:128:1`` -> (cell, hidden size (= input size), layers)."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ("lstm", "gru") or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"expected a model as cell:hidden:layers with cell lstm or gru, e.g. "
                                         f"lstm:128:1, got {text!r}")
    return parts[0], int(parts[1]), int(parts[2])


def slots_for(streams: int) -> int:
    """Slots for an average of ``streams`` live: room for Poisson fluctuations of ~4 standard deviations."""
    return streams + int(4 * math.sqrt(streams)) + 8


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _engines(cell: str, hidden: int, layers: int) -> dict[str, Any]:
    """(torch module, persistrnn module) sharing parameters, on the GPU, in eval mode."""
    import torch

    import persistrnn

    torch.manual_seed(0)
    theirs = getattr(torch.nn, cell.upper())(hidden, hidden, num_layers=layers).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    return {"cudnn-padded": theirs, "persistrnn": ours, "persistrnn-resident": ours}


def _padding_engine_class() -> Any:
    from ..serve import Engine

    class PaddingEngine(Engine):
        """The peer's batching: every tick runs one batch as large as the number of live streams."""

        capture_batches = False  # a batch size per live count: a capture each would cost more than it saves

        def _padded_size(self, n: int) -> int:
            return max(n, self.live_streams)

    return PaddingEngine


def _make_engine(provider: str, module: Any, slots: int, s: Settings) -> Any:
    from ..serve import Engine

    if provider.startswith("persistrnn"):
        return Engine(module, slots, max_pending=s.max_pending, resident=provider == "persistrnn-resident")
    return _padding_engine_class()(module, slots, max_pending=s.max_pending, convert=False)


def _refcheck(engine: Any, module: Any, steps: int) -> float:
    """Relative error of one stream's 4 chunks through the engine against the float64 reference."""
    import copy

    import torch

    x = torch.randn(4 * steps, module.input_size, generator=torch.Generator().manual_seed(1))
    stream = engine.open()
    try:
        for chunk in x.split(steps):
            stream.push(chunk)
        got = torch.cat([stream.pull() for _ in range(4)]).double()
    finally:
        stream.close()
    reference = copy.deepcopy(module).cpu().double()
    with torch.no_grad():
        want = reference(x.double())[0]
    return float((got - want).norm() / want.norm())


CANCELLED = "chunks cancelled (their stream closed first)"
"""A chunk still queued when its stream's last chunk was due and the client
closed it: the engine ran behind the load (see the refusals), not a fault."""


def _outcome_label(error: BaseException | None) -> str:
    """The table's label of a chunk that gave no output: ``error`` None (a
    future cancelled) or a CancelledError is :data:`CANCELLED`; any other is
    a failure, named by its type."""
    if error is None or isinstance(error, concurrent.futures.CancelledError):
        return CANCELLED
    return f"chunks failed ({type(error).__name__})"


class _Load:
    """The load generator of one run (see the module docstring)."""

    def __init__(self, engine: Any, streams: int, s: Settings, handover: str = "stream") -> None:
        import torch

        self.engine, self.streams, self.s, self.handover = engine, streams, s, handover
        self.chunk_s = s.chunk_ms / 1000
        self.rng = random.Random(s.seed)
        gen = torch.Generator().manual_seed(s.seed)
        self.inputs = [torch.randn(s.steps, engine.input_size, generator=gen) for _ in range(64)]
        # A gateway's receive buffer: a group of n chunks is its first n rows (a
        # client has at most one chunk per live stream due at once).
        self.frames = torch.randn(engine.max_streams, s.steps, engine.input_size, generator=gen)
        self.inboxes: list[collections.deque] = [collections.deque() for _ in range(s.threads)]
        self.arrived = [threading.Event() for _ in range(s.threads)]  # wakes a client for a new stream
        self.opened: list[Any] = []  # every stream the load opened, closed after the run
        self.finished: list[tuple[float, float]] = []  # (pushed, delivered) of every chunk delivered
        self.latencies: list[float] = []  # seconds, of the chunks pushed in the measured window (after run)
        self.delivered = 0  # chunks delivered in the measured window (after run)
        self.counts = collections.Counter()
        self.live_samples: list[int] = []
        self.lock = threading.Lock()
        self.measure_from = self.measure_until = 0.0
        self.stop = threading.Event()

    def life(self) -> int:
        return max(1, round(self.rng.expovariate(1 / self.s.mean_chunks)))

    def arrive(self, chunks: int, due: float) -> None:
        try:
            stream = self.engine.open()
        except Exception as exc:  # EngineFullError: counted, as a server refusing a call
            self.count(f"streams refused ({type(exc).__name__})")
            return
        self.opened.append(stream)
        client = stream.number % self.s.threads
        self.inboxes[client].append((due, stream.number, stream, chunks))
        self.arrived[client].set()

    def count(self, what: str, n: int = 1) -> None:
        """Counts one more of ``what`` (a refusal, a cancelled or a failed chunk) for the table."""
        with self.lock:
            self.counts[what] += n

    def done(self, future: Any, pushed: float) -> None:
        """A chunk's future completed (in the engine's worker thread): kept
        cheap, since it runs on the engine's critical path."""
        now = time.perf_counter()
        if future.cancelled() or future.exception() is not None:
            if not self.stop.is_set():  # cancelled by the close after the load: not a failure of the run
                self.count(_outcome_label(future.exception() if not future.cancelled() else None))
            return
        self.finished.append((pushed, now))  # list.append is atomic under the GIL

    def due_chunks(self, due_heap: list, k: int) -> list[tuple[Any, int]]:
        """(stream, input index) of every chunk of client ``k`` due now, one per
        stream; a stream whose last chunk was pushed one period ago leaves."""
        inbox = self.inboxes[k]
        while inbox:
            heapq.heappush(due_heap, inbox.popleft())
        now = time.perf_counter()
        due_now = []
        while due_heap and due_heap[0][0] <= now:
            due_now.append(heapq.heappop(due_heap))
        chunks = []
        for due, number, stream, left in due_now:
            if left == 0:
                stream.close()
                continue
            chunks.append((stream, (number + left) % len(self.inputs)))
            heapq.heappush(due_heap, (due + self.chunk_s, number, stream, left - 1))
        return chunks

    def wait_for_due(self, due_heap: list, k: int) -> None:
        """Sleep until client ``k``'s next chunk is due or a stream arrives:
        polling (every 1 ms in each of 8 threads) takes the GIL from the
        engine it measures."""
        self.arrived[k].wait(max(0.0, due_heap[0][0] - time.perf_counter()) if due_heap else 0.1)

    def client(self, k: int) -> None:
        """Submits each due chunk of client ``k``'s streams in a call of its own."""
        due_heap: list = []
        while not self.stop.is_set():
            self.arrived[k].clear()
            for stream, which in self.due_chunks(due_heap, k):
                pushed = time.perf_counter()
                try:
                    future = stream.submit(self.inputs[which])
                except Exception as exc:  # EngineFullError: the stream is too far behind
                    self.count(f"pushes refused ({type(exc).__name__})")
                else:
                    future.add_done_callback(lambda f, pushed=pushed: self.done(f, pushed))
            self.wait_for_due(due_heap, k)

    def gateway(self, k: int) -> None:
        """Hands all due chunks of client ``k``'s streams over in one
        ``push_many``, then waits, at most until its next chunk is due, for
        the outputs of its oldest group, taken by one ``pull_many``."""
        engine = self.engine
        due_heap: list = []
        groups: collections.deque[tuple[float, list]] = collections.deque()  # (pushed, streams), oldest first
        while not self.stop.is_set():
            self.arrived[k].clear()
            group = []
            for stream, _ in self.due_chunks(due_heap, k):
                if stream.pending >= engine.max_pending:  # it would refuse the group: it is too far behind
                    self.count("pushes refused (EngineFullError)")
                else:
                    group.append(stream)
            if group:
                pushed = time.perf_counter()
                try:
                    engine.push_many(group, self.frames[:len(group)])
                except Exception as exc:  # nothing of the group was queued
                    self.count(f"pushes refused ({type(exc).__name__})", len(group))
                else:
                    groups.append((pushed, group))
            if not groups:
                self.wait_for_due(due_heap, k)
                continue
            until_due = due_heap[0][0] - time.perf_counter() if due_heap else 0.1
            try:
                outcomes = engine.pull_many(groups[0][1], timeout=max(0.0, until_due))
            except TimeoutError:  # a chunk is due: push it, then wait again
                continue
            except Exception as exc:  # the group's pull was refused: its outputs are lost
                self.count(f"chunks failed ({type(exc).__name__})", len(groups.popleft()[1]))
                continue
            delivered = time.perf_counter()
            pushed, _ = groups.popleft()
            errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if not self.stop.is_set():
                for error in errors:
                    self.count(_outcome_label(error))
            self.finished.extend([(pushed, delivered)] * (len(outcomes) - len(errors)))

    def arrivals(self, end: float) -> None:
        rate = self.streams / (self.s.mean_chunks * self.chunk_s)  # streams per second
        next_arrival = time.perf_counter() + self.rng.expovariate(rate)
        next_sample = time.perf_counter()
        while not self.stop.is_set() and time.perf_counter() < end:
            now = time.perf_counter()
            if now >= next_arrival:
                self.arrive(self.life(), now)
                next_arrival += self.rng.expovariate(rate)
                continue
            if now >= next_sample:
                self.live_samples.append(self.engine.live_streams)
                next_sample += 0.1
            time.sleep(min(next_arrival - now, 0.001))

    def run(self) -> None:
        s = self.s
        start = time.perf_counter()
        for _ in range(self.streams):  # live at the start, each at a random point of its life and phase
            self.arrive(self.life(), start + self.rng.random() * self.chunk_s)
        self.measure_from = start + s.warmup_seconds
        self.measure_until = self.measure_from + s.seconds
        client = self.gateway if self.handover == "gateway" else self.client
        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(s.threads)]
        for c in clients:
            c.start()
        self.arrivals(self.measure_until)
        self.stop.set()
        for arrived in self.arrived:
            arrived.set()
        for c in clients:
            c.join(10.0)
        for stream in self.opened:  # frees the slots for the next load on the same engine
            stream.close()
        self.latencies = [delivered - pushed for pushed, delivered in self.finished
                          if self.measure_from <= pushed < self.measure_until]
        self.delivered = sum(self.measure_from <= delivered < self.measure_until for _, delivered in self.finished)


def run_case(model: str, streams: int, provider: str, s: Settings,
             handovers: tuple[str, ...] = HANDOVERS) -> list[dict[str, Any]]:
    """One row per hand-over, each a load on the same engine (planned and captured once)."""
    cell, hidden, layers = parse_model(model)
    module = _engines(cell, hidden, layers)[provider]
    slots = slots_for(streams)
    rows: list[dict[str, Any]] = []
    row: dict[str, Any] = {"model": model, "streams": streams, "provider": provider, "slots": slots}
    try:
        with _make_engine(provider, module, slots, s) as engine:
            row["rel_error"] = _refcheck(engine, module, s.steps) if s.refcheck else None
            engine.warm_up(steps=(s.steps,), batches=None if provider.startswith("persistrnn") else (streams, slots))
            if s.gc_freeze:  # what a latency-minded Python server does once it has started: see the module docstring
                gc.collect()
                gc.freeze()
            for handover in handovers:
                load = _Load(engine, streams, s, handover)
                ticks, chunks = engine.ticks, engine.chunks_run
                load.run()
                ticks, chunks = engine.ticks - ticks, engine.chunks_run - chunks
                lat_ms = [v * 1e3 for v in load.latencies]
                rows.append({
                    **row, "handover": handover, "status": "ok", "note": "",
                    "mean_live": statistics.fmean(load.live_samples) if load.live_samples else None,
                    "chunks_per_s": load.delivered / s.seconds, "measured_chunks": len(lat_ms),
                    "p50_ms": _percentile(lat_ms, 50), "p90_ms": _percentile(lat_ms, 90),
                    "p99_ms": _percentile(lat_ms, 99), "max_ms": max(lat_ms) if lat_ms else None,
                    "mean_batch": chunks / ticks if ticks else None, "counts": dict(load.counts)})
    except Exception as exc:  # a provider that fails is a row that says so, for each hand-over not run
        return rows + [{**row, "handover": handover, "status": "failed", "note": f"{type(exc).__name__}: {exc}"}
                       for handover in handovers[len(rows):]]
    finally:
        if s.gc_freeze:  # only when this case froze it (gc.freeze does not nest)
            gc.unfreeze()
    return rows


def run(models: list[str], streams: list[int], providers: list[str], s: Settings, progress: bool = True,
        after_case: Any = None, handovers: tuple[str, ...] = HANDOVERS) -> dict[str, Any]:
    from ..progress import track
    from .environment import environment

    result: dict[str, Any] = {"suite": "serve", "environment": environment(), "settings": dataclasses.asdict(s),
                              "cases": []}
    runs = [(m, n, p) for m in models for n in streams for p in providers]
    for model, n, provider in track(runs, progress, "serving load"):
        result["cases"] += run_case(model, n, provider, s, handovers)
        if after_case:
            after_case(result)
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _handover(case: dict[str, Any]) -> str:
    return case.get("handover", "stream")  # runs from before the gateway hand-over had only this one


def capacity(result: dict[str, Any], model: str, provider: str, handover: str = "stream") -> int | None:
    """The most live streams of the run held at p99 <= REAL_TIME_P99_MS (None: none was)."""
    held = [c["streams"] for c in result["cases"] if c["model"] == model and c["provider"] == provider
            and _handover(c) == handover and c["status"] == "ok" and c["p99_ms"] is not None
            and c["p99_ms"] <= REAL_TIME_P99_MS]
    return max(held) if held else None


def format_table(result: dict[str, Any]) -> str:
    lines = ["| model | live streams | provider | hand-over | mean live | chunks/s | p50 ms | p90 ms | p99 ms | max ms "
             "| mean batch | p99 of peer / ours | rel. error | refused or failed |", "|" + "---|" * 14]
    ours = {(c["model"], c["streams"], _handover(c)): c for c in result["cases"] if c["provider"] == "persistrnn"}
    for c in result["cases"]:
        head = f"| {c['model']} | {c['streams']} | {c['provider']} | {_handover(c)} "
        if c["status"] != "ok":
            lines.append(head + f"| {c['status']}: {c['note']} |" + " |" * 9)
            continue
        mine = ours.get((c["model"], c["streams"], _handover(c)), {})
        ratio = "—"
        if c["provider"] == "cudnn-padded" and mine.get("status") == "ok" and mine.get("p99_ms") and c["p99_ms"]:
            ratio = f"{c['p99_ms'] / mine['p99_ms']:.2f}×"
        error = "—" if c.get("rel_error") is None else f"{c['rel_error']:.1e}"
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(c["counts"].items())) or "none"
        lines.append(head + f"| {_fmt(c['mean_live'], 1)} | {_fmt(c['chunks_per_s'], 0)} | {_fmt(c['p50_ms'])} "
                     f"| {_fmt(c['p90_ms'])} | {_fmt(c['p99_ms'])} | {_fmt(c['max_ms'])} | {_fmt(c['mean_batch'], 1)} "
                     f"| {ratio} | {error} | {refused} |")
    models = list(dict.fromkeys(c["model"] for c in result["cases"]))
    runs = list(dict.fromkeys((c["provider"], _handover(c)) for c in result["cases"]))
    lines += ["", f"Real-time capacity (the most live streams of this run at p99 ≤ {REAL_TIME_P99_MS:g} ms):"]
    for model in models:
        held = ", ".join(f"{p} ({h}) {capacity(result, model, p, h) or 'none'}" for p, h in runs)
        lines.append(f"- {model}: {held}")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    s = result["settings"]
    method = (f"- Method: {s['seconds']} s measured after {s['warmup_seconds']} s of load; a chunk of {s['steps']} "
              f"step(s) every {s['chunk_ms']} ms per stream; stream lengths exponential, mean {s['mean_chunks']} "
              f"chunks; Poisson arrivals keeping the live count on average; {s['threads']} client threads; "
              f"latency from push to delivery; "
              f"{'gc.freeze() after the warm-up' if s.get('gc_freeze') else 'no gc.freeze()'}. "
              f"`persistrnn-resident` is the same engine with `resident=True` (one-layer models).\n"
              f"- Hand-over: `stream`, a call per chunk (each client thread submits each due chunk with "
              f"`Stream.submit`; delivered when its future completes); `gateway`, a call per group (each client "
              f"thread hands all its due chunks over in one `Engine.push_many` of an (n, steps, I) tensor and takes "
              f"its oldest group's outputs with one `Engine.pull_many`; delivered when that call returns). Both "
              f"run on the same engine, one after the other.")
    return (f"# Serving engine under a voice-activity load (`python -m persistrnn bench serve`)\n\n"
            f"{describe(result['environment'])}\n{method}\n\n{format_table(result)}\n")


def plot(result: dict[str, Any], path: Path) -> str | None:
    """p50 and p99 latency against live streams, one panel per model; None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    models = list(dict.fromkeys(c["model"] for c in result["cases"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for provider, handover in dict.fromkeys((c["provider"], _handover(c)) for c in result["cases"]):
            cases = [c for c in result["cases"] if c["model"] == model and c["provider"] == provider
                     and _handover(c) == handover and c["status"] == "ok" and c["p99_ms"] is not None]
            for key, style in (("p50_ms", "--"), ("p99_ms", "-")):
                ax.plot([c["streams"] for c in cases], [c[key] for c in cases], style, marker="o",
                        label=f"{provider} ({handover}) {key[:3]}")
        ax.set(xscale="log", yscale="log", xlabel="live streams", ylabel="push→pull latency (ms)", title=model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m persistrnn bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", type=parse_model, default=[parse_model("lstm:128:1"),
                                                                     parse_model("lstm:256:2")],
                   help="cell:hidden:layers, input size = hidden (default: lstm:128:1 lstm:256:2)")
    p.add_argument("--streams", nargs="+", type=int, default=[64, 256, 1000], help="live streams on average")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--handovers", nargs="+", choices=HANDOVERS, default=list(HANDOVERS),
                   help="stream: a call per chunk; gateway: a call per group of due chunks (default: both)")
    p.add_argument("--seconds", type=float, default=Settings.seconds, help="measured seconds per run")
    p.add_argument("--warmup-seconds", type=float, default=Settings.warmup_seconds)
    p.add_argument("--chunk-ms", type=float, default=Settings.chunk_ms)
    p.add_argument("--steps", type=int, default=Settings.steps, help="steps per chunk")
    p.add_argument("--mean-chunks", type=float, default=Settings.mean_chunks, help="mean stream length in chunks")
    p.add_argument("--threads", type=int, default=Settings.threads, help="client threads")
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="leave the objects made before the load to the garbage collector's full collections")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    add_result_arguments(p)
    p.add_argument("--plot", type=Path, help="p50/p99 latency against live streams (needs matplotlib)")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = parser()
    args = p.parse_args(argv)
    for name in ("streams",):
        if any(v < 1 for v in getattr(args, name)):
            p.error(f"--{name}: expected positive integers, got {getattr(args, name)}")
    for name in ("seconds", "chunk_ms", "mean_chunks", "steps", "threads"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}: expected a positive number, got {getattr(args, name)}")
    if args.warmup_seconds < 0:
        p.error(f"--warmup-seconds: expected a number >= 0, got {args.warmup_seconds}")
    return args, p


def main(argv: list[str] | None = None) -> int:
    args, p = parse(argv)
    settings = Settings(seconds=args.seconds, warmup_seconds=args.warmup_seconds, chunk_ms=args.chunk_ms,
                        steps=args.steps, mean_chunks=args.mean_chunks, threads=args.threads, seed=args.seed,
                        refcheck=args.refcheck, gc_freeze=args.gc_freeze)
    models = [f"{c}:{h}:{layers}" for c, h, layers in args.models]
    result = run_or_load(args, p, "serve", lambda save: run(models, args.streams, args.providers, settings,
                                                             progress=args.progress, after_case=save,
                                                             handovers=tuple(args.handovers)))
    if args.markdown:
        args.markdown.write_text(markdown(result))
    if args.plot:
        why = plot(result, args.plot)
        if why:
            print(f"no plot: {why}")
    print(format_table(result))
    return 0
