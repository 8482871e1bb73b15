"""A real training run: a character-level LSTM language model on Penn Treebank,
trained with persistrnn and with ``torch.nn.LSTM``: ``python -m persistrnn bench charlm``.

The model: a character embedding, a 2-layer LSTM of hidden size 512 and a
linear layer to the vocabulary. It trains on ``ptb/dev.txt`` and validates on
``ptb/test.txt`` (the data sets' README), one character a token, the lines
joined by their newlines.

Three runs from one initialisation, on one data order, in one process:

* **persistrnn**: the model after ``persistrnn.convert(model,
  training_kernels=True)``: persistrnn's training operators, or cuDNN where
  the module measured cuDNN faster at this shape (the result says which ran);
* **torch.nn**: the same model unconverted (cuDNN), TF32 off;
* **torch.nn (TF32)**: the same again with TF32 allowed in cuDNN (torch's
  default), for its speed; its losses are not compared;
* **float64**: the torch model in float64 on the GPU for the first
  ``compare_steps`` steps only, the yardstick of fp32 rounding.

persistrnn and torch.nn train with TF32 off (cuDNN and cuBLAS), so that
their losses can agree to fp32 rounding: the suite reports how far each fp32
run's loss is from the float64 run's over the first ``compare_steps`` steps.
Training is truncated back-propagation through time: ``batch`` contiguous
streams of the text, ``steps`` characters a window (the last, shorter
window of each pass is left out), the state carried (detached) from one
window to the next and reset at each pass over the text; Adam with gradient
clipping.

Tokens per second: CUDA events around windows of ``log_every`` training
steps (forward, loss, backward, clipping, the optimiser's step), the three
runs' windows interleaved, the median over the windows after the first
(which plans, tunes and captures); the validation passes run between
windows, outside the timing. persistrnn's speed-up, and the target, are
against the faster torch.nn run. Validation: bits per character over the
validation text (``valid_chars`` of it), eval mode, no gradients, every
``validate_every`` steps and at the end.

Outputs (``--out``): ``charlm.md``, ``charlm.json`` and, with matplotlib,
``charlm.png`` (training loss and validation bits per character against the
step, both runs together).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

PTB_TRAIN, PTB_VALID = "ptb/dev.txt", "ptb/test.txt"
PROVIDERS = ("persistrnn", "torch.nn", "torch.nn (TF32)")
COMPARED = PROVIDERS[:2]
"""The runs whose losses are compared (both with TF32 off)."""
TF32_ALLOWED = {"torch.nn (TF32)"}
TARGET_SPEEDUP = 2.0
"""The issue's target: persistrnn's training tokens/s at least 2x torch.nn.LSTM's on cuDNN, at batch 8."""


@dataclasses.dataclass
class Settings:
    hidden: int = 512
    layers: int = 2
    embedding: int = 128
    batch: int = 8
    steps: int = 100  # characters per window (truncated BPTT length)
    train_steps: int = 1000
    compare_steps: int = 100  # steps trained in float64 too: the rounding yardstick
    log_every: int = 50  # training steps per timed window
    validate_every: int = 250
    valid_batch: int = 32
    valid_chars: int = 200_000
    learning_rate: float = 2e-3
    clip: float = 1.0
    seed: int = 0
    device: str = "cuda"


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------

def read_text(path: Path) -> str:
    """A PTB text file as one string (its lines keep their newlines)."""
    from ..errors import ArgumentError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ArgumentError(f"charlm: could not read {path} ({exc}); expected the PTB text of the data sets "
                            f"(set PERSISTRNN_DATA to their folder)") from exc
    if not text:
        raise ArgumentError(f"charlm: {path} is empty; expected PTB text")
    return text


def vocabulary(*texts: str) -> dict[str, int]:
    """Every character of ``texts``, sorted, to its id."""
    return {c: i for i, c in enumerate(sorted(set().union(*texts)))}


def encode(text: str, vocab: dict[str, int]) -> Any:
    """``text`` as an int64 tensor of character ids."""
    import numpy as np
    import torch

    table = np.full(max(map(ord, vocab)) + 1, -1, dtype=np.int64)
    for c, i in vocab.items():
        table[ord(c)] = i
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(table[codes])


def streams(ids: Any, batch: int) -> Any:
    """(n, batch) time-major: the text cut into ``batch`` contiguous streams of n characters."""
    from ..errors import ArgumentError

    n = len(ids) // batch
    if n < 2:
        raise ArgumentError(f"charlm: expected at least {2 * batch} characters for batch {batch}, got {len(ids)}")
    return ids[:n * batch].view(batch, n).t().contiguous()


def windows(data: Any, steps: int) -> list[tuple[int, int]]:
    """(start, length) of every window: inputs ``data[start:start+length]``,
    targets one character later."""
    return [(s, min(steps, len(data) - 1 - s)) for s in range(0, len(data) - 1, steps)]


# ----------------------------------------------------------------------------
# Model and training
# ----------------------------------------------------------------------------

def make_model(vocab_size: int, s: Settings) -> Any:
    import torch

    class CharLM(torch.nn.Module):
        """Embedding, a multi-layer LSTM, a linear layer to the vocabulary."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab_size, s.embedding)
            self.rnn = torch.nn.LSTM(s.embedding, s.hidden, s.layers)
            self.head = torch.nn.Linear(s.hidden, vocab_size)

        def forward(self, x: Any, state: Any = None) -> tuple[Any, Any]:
            out, state = self.rnn(self.embed(x), state)
            return self.head(out), state

    torch.manual_seed(s.seed)
    return CharLM()


class Trainer:
    """One model's training loop: windows in order, the state carried."""

    def __init__(self, model: Any, data: Any, s: Settings) -> None:
        import torch

        self.model, self.data, self.s = model, data, s
        self.optimiser = torch.optim.Adam(model.parameters(), lr=s.learning_rate)
        # Full windows only: a pass's last, shorter window would be a shape of its own (a capture, a plan)
        # inside a timed window.
        self.windows = [w for w in windows(data, s.steps) if w[1] == s.steps] or windows(data, s.steps)
        self.position, self.state = 0, None
        self.losses: list[Any] = []  # one 0-dim tensor per step: read once at the end (no synchronise per step)

    def step(self) -> None:
        import torch

        if self.position == len(self.windows):  # a new pass over the text starts from zero states
            self.position, self.state = 0, None
        start, length = self.windows[self.position]
        self.position += 1
        x, y = self.data[start:start + length], self.data[start + 1:start + 1 + length]
        self.model.train()
        self.optimiser.zero_grad(set_to_none=True)
        logits, state = self.model(x, self.state)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.clip)
        self.optimiser.step()
        self.state = tuple(t.detach() for t in state)
        self.losses.append(loss.detach())

    def run(self, count: int) -> None:
        for _ in range(count):
            self.step()


def bits_per_character(model: Any, data: Any, steps: int) -> float:
    """Mean cross-entropy over every predicted character of ``data`` (n, B), in bits."""
    import torch

    model.eval()
    total, count, state = 0.0, 0, None
    with torch.no_grad():
        for start, length in windows(data, steps):
            x, y = data[start:start + length], data[start + 1:start + 1 + length]
            logits, state = model(x, state)
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                             reduction="sum"))
            count += y.numel()
    model.train()
    return total / count / math.log(2)


def _window_ms(run: Any, device: str) -> float:
    """Milliseconds of ``run()``: CUDA events on the GPU, the wall clock on the CPU."""
    import torch

    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def _tokens_per_s(window_ms: list[float], s: Settings) -> float | None:
    """Median tokens/s over the timed windows after the first (planning, tuning, capture)."""
    steady = window_ms[1:] or window_ms
    return s.batch * s.steps * s.log_every / (statistics.median(steady) / 1e3) if steady else None


def _curve(trainer: Trainer) -> list[float]:
    import torch

    return torch.stack(trainer.losses).double().cpu().tolist() if trainer.losses else []


def fp32_exact() -> Any:
    """TF32 off in cuDNN and cuBLAS for the duration: fp32 losses that can agree to rounding."""
    import contextlib

    from .. import runtime

    @contextlib.contextmanager
    def scope() -> Any:
        with runtime.matmul_precision("highest"), runtime.cudnn_rnn_settings(enabled=True, tf32=False):
            yield
    return scope()


def run(s: Settings, data_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    import torch

    import persistrnn
    from .. import runtime, training
    from ..dynamic import DATA_DIR
    from ..progress import track
    from .environment import environment

    root = Path(data_dir) if data_dir is not None else DATA_DIR
    train_text, valid_text = read_text(root / PTB_TRAIN), read_text(root / PTB_VALID)
    vocab = vocabulary(train_text, valid_text)
    train_data = streams(encode(train_text, vocab), s.batch).to(s.device)
    valid_data = streams(encode(valid_text[:s.valid_chars], vocab), s.valid_batch).to(s.device)
    torch_model = make_model(len(vocab), s).to(s.device)
    reference = copy.deepcopy(torch_model).double()
    ours_model = persistrnn.convert(copy.deepcopy(torch_model), training_kernels=True)
    tf32_model = copy.deepcopy(torch_model)
    for model in (ours_model, tf32_model):  # a deep copy's RNN weights are separate tensors: cuDNN's layout again
        model.rnn.flatten_parameters()
    trainers = {"persistrnn": Trainer(ours_model, train_data, s), "torch.nn": Trainer(torch_model, train_data, s),
                "torch.nn (TF32)": Trainer(tf32_model, train_data, s)}
    result: dict[str, Any] = {"suite": "charlm", "environment": environment() if s.device.startswith("cuda") else {},
                              "settings": dataclasses.asdict(s), "vocabulary": len(vocab),
                              "train_chars": len(train_text), "valid_chars": min(len(valid_text), s.valid_chars)}
    with fp32_exact():
        float64 = Trainer(reference, train_data, s)
        float64.run(min(s.compare_steps, s.train_steps))
        valid: dict[str, list[tuple[int, float]]] = {p: [] for p in PROVIDERS}
        window_ms: dict[str, list[float]] = {p: [] for p in PROVIDERS}
        for name, trainer in trainers.items():  # before training: one initialisation, one value
            valid[name].append((0, bits_per_character(trainer.model, valid_data, s.steps)))
        done = 0
        for _ in track(range(0, s.train_steps, s.log_every), progress, "charlm"):
            count = min(s.log_every, s.train_steps - done)
            for name, trainer in trainers.items():  # interleaved: the runs see the same clocks
                with runtime.cudnn_rnn_settings(enabled=True, tf32=name in TF32_ALLOWED):
                    ms = _window_ms(lambda t=trainer, n=count: t.run(n), s.device)
                if count == s.log_every:
                    window_ms[name].append(ms)
            done += count
            if done % s.validate_every == 0 or done == s.train_steps:
                for name, trainer in trainers.items():
                    valid[name].append((done, bits_per_character(trainer.model, valid_data, s.steps)))
    embedded = torch.empty(s.steps, s.batch, s.embedding, device=s.device, requires_grad=True)
    reason = ours_model.rnn._torch_reason(embedded, warn=False, trains=True)  # the choice its training made
    faster = reason is not None and training.cudnn_trains_faster(ours_model.rnn, embedded)
    result["persistrnn_runs"] = ("persistrnn's training operators" if reason is None
                                 else "cuDNN (measured faster)" if faster else f"torch's implementation ({reason})")
    result["float64_loss"] = _curve(float64)
    for name in PROVIDERS:
        result[name] = {"loss": _curve(trainers[name]), "valid_bpc": valid[name], "window_ms": window_ms[name],
                        "tokens_per_s": _tokens_per_s(window_ms[name], s)}
    return result


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def agreement(result: dict[str, Any]) -> dict[str, float]:
    """:func:`.runs.loss_agreement` of persistrnn and torch.nn (TF32 off) against the float64 run."""
    from .runs import loss_agreement

    return loss_agreement(result["persistrnn"]["loss"], result["torch.nn"]["loss"], result["float64_loss"])


def _falls(curve: list[float], head: int = 10) -> bool:
    """The mean of the last ``head`` losses below the mean of the first ``head``."""
    k = min(head, len(curve) // 2)
    return k > 0 and statistics.fmean(curve[-k:]) < statistics.fmean(curve[:k])


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe
    from .runs import agreement_text

    s = result["settings"]
    a = agreement(result)
    lines = ["# A character-level language model trained with persistrnn and with torch.nn "
             "(`python -m persistrnn bench charlm`)", ""]
    if result.get("environment"):
        lines.append(describe(result["environment"]))
    lines += [f"- Model: embedding {s['embedding']}, {s['layers']}-layer LSTM {s['hidden']}, linear to "
              f"{result['vocabulary']} characters. Train: `{PTB_TRAIN}` ({result['train_chars']} characters); "
              f"validate: the first {result['valid_chars']} characters of `{PTB_VALID}`.",
              f"- Training: batch {s['batch']} contiguous streams, windows of {s['steps']} characters (state carried, "
              f"detached), {s['train_steps']} steps, Adam lr {s['learning_rate']}, gradient norm clipped at "
              f"{s['clip']}; one initialisation and one data order for every run; TF32 off in cuDNN and cuBLAS. "
              f"persistrnn: `persistrnn.convert(model, training_kernels=True)`, which trained on "
              f"**{result['persistrnn_runs']}** at this shape.",
              f"- Tokens/s: CUDA events around windows of {s['log_every']} steps (forward, loss, backward, clipping, "
              "Adam), the runs' windows interleaved, the median over the windows after the first; validation "
              "outside the timing. torch.nn (TF32): the same model trained with TF32 allowed in cuDNN (torch's "
              "default), timed beside the others; its losses are not compared.", "",
              "| run | tokens/s | persistrnn's speed-up over it | first loss (bits/char) | last loss (bits/char, "
              "mean of 10) | validation bits/char (first → last) | loss falls |", "|---|---|---|---|---|---|---|"]
    ours = result["persistrnn"]["tokens_per_s"]
    for name in (p for p in PROVIDERS if p in result):
        r = result[name]
        bits = [x / math.log(2) for x in r["loss"]]
        valid = r["valid_bpc"]
        tokens = r["tokens_per_s"]
        speed = "—" if name == "persistrnn" or not (tokens and ours) else f"{ours / tokens:.2f}×"
        lines.append(f"| {name} | {tokens:,.0f} | {speed} | {bits[0]:.3f} | {statistics.fmean(bits[-10:]):.3f} | "
                     f"{valid[0][1]:.3f} → {valid[-1][1]:.3f} | {'yes' if _falls(r['loss']) else 'no'} |"
                     if bits and valid and tokens else f"| {name} | — | — | — | — | — | — |")
    theirs = max((result[p]["tokens_per_s"] or 0 for p in PROVIDERS[1:] if p in result), default=0)
    if a["steps"]:
        lines += ["", agreement_text(a, "torch.nn", "they agree to fp32 rounding")]
    if theirs and result["persistrnn"]["tokens_per_s"]:
        speed = result["persistrnn"]["tokens_per_s"] / theirs
        status = "met" if speed >= TARGET_SPEEDUP else "**missed**"
        lines += ["", f"Target: training tokens/s ≥ {TARGET_SPEEDUP:g}× torch.nn.LSTM on cuDNN (its faster "
                      f"setting) at batch {s['batch']}: {speed:.2f}× ({status})."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> str:
    """Training loss (bits/char, a running mean over 10 steps) and validation bits/char against the step."""
    from .runs import two_panels

    def draw(left: Any, right: Any) -> None:
        for name, style in zip(COMPARED, ("-", "--")):
            bits = [x / math.log(2) for x in result[name]["loss"]]
            smooth = [statistics.fmean(bits[max(0, i - 9):i + 1]) for i in range(len(bits))]
            left.plot(range(1, len(smooth) + 1), smooth, style, label=name)
            steps, bpc = zip(*result[name]["valid_bpc"]) if result[name]["valid_bpc"] else ((), ())
            right.plot(steps, bpc, style + "o", label=name)
        ref = [x / math.log(2) for x in result["float64_loss"]]
        left.plot(range(1, len(ref) + 1), ref, ":", label="torch.nn float64 (first steps)")
        left.set(xlabel="training step", ylabel="training loss, bits/char (mean of 10 steps)", title="training")
        right.set(xlabel="training step", ylabel="bits/char", title="validation")

    return two_panels(path, draw)


def main(argv: list[str] | None = None) -> int:
    import sys

    from . import runs

    return runs.main(argv, "charlm", sys.modules[__name__], lambda s: s.device.startswith("cuda"))
