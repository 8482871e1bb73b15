"""Choosing how to run a model: the model's top K, compiled and timed, cached.

:func:`plan` answers "how does this device run this model at this batch?"
with a :class:`Plan`:

1. A tuned choice for (device, cell, sizes, layers, batch bucket, dtype,
   whether TF32 is allowed, package version) in the on-disk tuning cache is
   reused as is: no compile, no timing (the binary is in the kernel cache too).
2. Otherwise the configuration space is pruned (:mod:`.space`) and ranked by
   the cost model (:mod:`.model`). Without tuning, the top-ranked
   configuration that compiles without spilling is the plan.
3. With tuning, the top ``k`` that compile (in threads), the best-ranked
   of each kernel family the top ``k`` leaves out (:func:`family`), and a
   family's second where the model's predictions tie them,
   each with its tagged-exchange twin where the space offers one, are timed on the real
   shapes, with the non-persistent fallback and cuDNN through torch beside
   them, and the fastest is kept and cached. No persistent configuration at
   all (weights too large for the chip) leaves the fallback and cuDNN.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from .. import __version__, persistent, runtime
from ..errors import ArgumentError, ArgumentTypeError, ConfigError, KernelLaunchError
from ..log import logger
from ..progress import track
from ..cells import get_cell
from ..persistent import KernelConfig
from . import model as cost
from . import space

PATHS = ("persistent", "fallback", "cudnn")
"""persistent: this package's kernels (all layers fused in one launch, both
directions of a layer in one launch, or a launch per layer and direction, as
the configuration says); fallback: the non-persistent path
(:mod:`persistrnn.fallback`); cudnn: torch's own module."""
CUDNN_CELLS = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
DEFAULT_K = 5
# Configurations of each kernel family timed at most, and how close to the
# family's best-ranked a second one's prediction must be to be timed too:
# within a family the model's first two can lie within 1% (LSTM 256 at batch
# 1: the fused clusters of 16 x 128 and 8 x 256 threads, predicted 0.699 and
# 0.701 µs per step, measured 0.089 and 0.100 ms per forward), so which one a
# machine's calibration ranks first is a coin flip (perf-notes §69). FFMA
# families only: the model prices every mma product at ~0 (perf-notes §67),
# so all of a mma family tie, and their second members (with their tagged
# twins) took 16-bit LSTM 1024 at batch 1 from 8.9 to 10.3-10.6 s of tuning
# without a plan that measured faster (perf-notes §71).
FAMILY_MEMBERS = 2
FAMILY_TIE = 0.02
# A family's best at another slice size is timed where the model prices it within this of the family's best
# (its arithmetic is alike there, so the model's error is too): at 16-bit LSTM 256 batch 8 the fused step's best
# in slices of 1 was priced 2.5% above its best in slices of 2 and measured 13% faster (perf-notes §103), while
# slice sizes priced 1.4-5x above took most of the extra candidates (LSTM 256 fp16 batch 16: 23 candidates
# without the window).
SLICE_WINDOW = 0.15
DEFAULT_STEPS = 100
SHORT_STEPS = 1
"""The short sequence length the tuner also times a persistent choice at,
beside the paths with a smaller fixed cost (:func:`short_sequence_path`)."""
CACHE_FORMAT = 9  # 8: the key says whether TF32 was allowed; 9: plans carry their short-sequence path


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the plan depends on: the model's cell, sizes and dtype."""

    cell: str
    input_size: int
    hidden_size: int
    num_layers: int = 1
    dtype: str = "float32"
    bidirectional: bool = False

    def __post_init__(self) -> None:
        get_cell(self.cell)  # raises for an unknown cell
        for name in ("input_size", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"ModelShape.{name}: expected a positive int, got {value!r}")
        if self.dtype not in persistent.DTYPES:
            raise ArgumentError(f"ModelShape.dtype: expected one of {persistent.DTYPES}, got {self.dtype!r}")
        if not isinstance(self.bidirectional, bool):
            raise ArgumentError(f"ModelShape.bidirectional: expected a bool, got {self.bidirectional!r}")

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def layer_input(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.directions * self.hidden_size


def shape_of(module: Any) -> ModelShape:
    """The :class:`ModelShape` of a ``torch.nn.LSTM``/``GRU``/``RNN`` (or a module with the same attributes)."""
    import torch

    kinds = {torch.nn.LSTM: "lstm", torch.nn.GRU: "gru"}
    cell = kinds.get(type(module))
    if cell is None and isinstance(module, torch.nn.RNN):
        cell = f"rnn_{module.nonlinearity}"
    if cell is None:
        cell = getattr(module, "cell", None)
    if cell is None:
        raise ArgumentTypeError(f"expected a torch.nn.LSTM, GRU or RNN, got {type(module).__name__}")
    if getattr(module, "proj_size", 0):
        raise ArgumentError(f"proj_size={module.proj_size}: the persistent kernels run LSTMs without projections")
    dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    return ModelShape(cell, module.input_size, module.hidden_size, module.num_layers, dtype,
                      bool(module.bidirectional))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model runs at a batch bucket, and why.

    source: "cache" (a stored tuned choice), "tuned" (timed now) or "model"
    (the cost model's top choice, untimed). batch_slice: (persistent)
    sequences per batch slice, each slice on its own blocks at once (None:
    as many as a block holds). predicted_us: the model's µs per step of
    ``config`` at that slice (persistent only). measured_ms: device ms per
    forward of ``steps`` steps (CUDA-graph replay) for each timed candidate,
    by label. short_path, short_steps: a call of at most ``short_steps``
    steps runs ``short_path`` instead (:meth:`for_steps`); short_measured_ms:
    the timings of :data:`SHORT_STEPS` steps that decided it, by label.
    """

    shape: ModelShape
    batch_bucket: int
    path: str
    config: KernelConfig | None
    source: str
    reason: str
    predicted_us: float | None = None
    measured_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int | None = None
    tuning_seconds: float | None = None
    batch_slice: int | None = None
    short_path: str | None = None
    short_steps: int = 0
    short_measured_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def for_steps(self, steps: int) -> "Plan":
        """The plan a call of ``steps`` steps runs: this one, or for a
        sequence of at most ``short_steps`` steps its short path."""
        return self._short_plan if steps <= self.short_steps else self

    @functools.cached_property
    def _short_plan(self) -> "Plan":
        return dataclasses.replace(self, path=self.short_path, config=None, batch_slice=None, predicted_us=None,
                                   short_path=None, short_steps=0,
                                   reason=f"a sequence of at most {self.short_steps} steps: {self.short_path} "
                                          f"(its smaller fixed cost); longer ones: {self.reason}")

    @property
    def label(self) -> str:
        """The label the tuner times this plan's choice under (``measured_ms``'s keys)."""
        return config_label(self.config, self.batch_slice) if self.path == "persistent" else self.path

    def device_us(self, steps: int) -> float | None:
        """Device µs of a forward of ``steps`` steps, scaled from the tuner's
        timing of this choice; None where it was not timed."""
        ms = self.measured_ms.get(self.label)
        if ms is None or not self.steps or ms != ms:  # untimed, or NaN: failed to launch
            return None
        return ms * 1e3 * steps / self.steps

    @property
    def launch(self) -> tuple:
        """What a run of this plan launches: path, kernel configuration and
        batch slice (a captured forward is kept per value)."""
        return self.path, self.config, self.batch_slice

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = dataclasses.asdict(self.shape)
        d["config"] = dataclasses.asdict(self.config) if self.config else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        d["shape"] = ModelShape(**d["shape"])
        d["config"] = KernelConfig(**d["config"]) if d["config"] else None
        if d["path"] not in PATHS:
            raise ArgumentError(f"unknown path {d['path']!r}")
        return cls(**d)

    def describe(self) -> str:
        s = self.shape
        lines = [f"{s.cell} input {s.input_size}, hidden {s.hidden_size}, {s.num_layers} layer(s)"
                 f"{', bidirectional' if s.bidirectional else ''}, {s.dtype}, "
                 f"batch bucket {self.batch_bucket}: {self.path} ({self.source})",
                 f"  why: {self.reason}"]
        if self.batch_slice is not None:
            lines.append(f"  batch slices of {self.batch_slice} sequences, each on its own blocks at once")
        if self.config is not None:
            c = self.config
            lines.append(f"  kernel: sync {c.sync}, {c.blocks} block(s) x {c.threads} threads, work groups of "
                         f"{c.group_size}, batch tile {c.batch_tile}, {c.units_per_block} units per block, "
                         f"{c.register_k} register / {c.shared_k_chunks} shared chunks per lane, math "
                         f"{'mma (TF32)' if c.tf32 else c.math}"
                         + (f", k_split {c.k_split}" if c.math == "mma" else "")
                         + (", one sync" if c.one_sync else "") + (", fused step" if c.fused_step else "")
                         + _layout(c))
        if self.predicted_us is not None:
            lines.append(f"  predicted: {self.predicted_us:.2f} µs per step")
        for label, ms in sorted(self.measured_ms.items(), key=lambda kv: kv[1]):
            lines.append(f"  measured: {ms:8.3f} ms per forward of {self.steps} steps (device, graph replay)  {label}")
        if self.short_path is not None:
            timings = ", ".join(f"{label} {ms:.3f}" for label, ms in sorted(self.short_measured_ms.items(),
                                                                             key=lambda kv: kv[1]))
            lines.append(f"  a sequence of at most {self.short_steps} steps runs {self.short_path} (ms per forward "
                         f"of {SHORT_STEPS} step(s): {timings})")
        if self.tuning_seconds is not None:
            lines.append(f"  tuning took {self.tuning_seconds:.1f} s")
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# The tuning cache
# ----------------------------------------------------------------------------


def tf32_allowed(shape: ModelShape) -> bool:
    """Whether an fp32 model may run TF32 tensor cores in its persistent
    kernels (:func:`persistrnn.runtime.rnn_allows_tf32`: torch allows TF32
    both in fp32 matmuls, off by default, and in cuDNN's RNNs)."""
    return shape.dtype == "float32" and runtime.rnn_allows_tf32()


def cache_key(facts: runtime.DeviceFacts, shape: ModelShape, bucket: int, tf32: bool = False) -> dict[str, Any]:
    """Every component a tuned choice depends on."""
    # NVRTC's version: whether a configuration compiles without spilling, and its timings, depend on it
    return {"device": facts.name, "sm_count": facts.sm_count, **dataclasses.asdict(shape),
            "batch_bucket": bucket, "tf32": tf32, "version": __version__, "format": CACHE_FORMAT,
            "nvrtc": list(runtime.nvrtc_version())}


def cache_path(key: dict[str, Any]) -> Path:
    """``tuning/<cell>-i<I>-h<H>-l<L>-<dtype>[-tf32][-bi]-b<bucket>-<device>-<digest>.json``."""
    name = runtime.entry_name(key["cell"], f"i{key['input_size']}", f"h{key['hidden_size']}", f"l{key['num_layers']}",
                              key["dtype"], "tf32" if key["tf32"] else "", "bi" if key["bidirectional"] else "",
                              f"b{key['batch_bucket']}", key["device"], key=runtime.digest(key))
    return runtime.cache_dir() / "tuning" / f"{name}.json"


def load_plan(key: dict[str, Any]) -> Plan | None:
    """The cached plan for ``key``; None when absent, unreadable or for another key."""
    try:
        data = json.loads(cache_path(key).read_text())
        if data.get("key") != key:
            return None
        return dataclasses.replace(Plan.from_json(data["plan"]), source="cache")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def store_plan(key: dict[str, Any], plan: Plan) -> None:
    runtime.atomic_write(cache_path(key), json.dumps({"key": key, "plan": plan.to_json()}, indent=1))


# ----------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------


def layouts(shape: ModelShape) -> list[dict[str, Any]]:
    """How the model's recurrences can share launches: always one launch per
    layer and direction; also both directions of a layer at once
    (bidirectional), or all layers fused in a pipeline (unidirectional, up to
    :data:`persistrnn.persistent.MAX_INSTANCES` layers)."""
    out: list[dict[str, Any]] = [{}]
    if shape.bidirectional:
        out.append(dict(instances=2))
    elif 2 <= shape.num_layers <= persistent.MAX_INSTANCES:
        out.append(dict(instances=shape.num_layers, pipeline=True))
    return out


def forward_steps(config: KernelConfig, shape: ModelShape, steps: int) -> int:
    """Steps a forward of ``steps`` time steps costs on ``config``, one after
    another: in a pipeline, each layer runs up to prefetch_steps +
    PIPELINE_RELEASE_EVERY steps behind the layer before it."""
    if config.pipeline:
        return steps + (shape.num_layers - 1) * (config.prefetch_steps + persistent.PIPELINE_RELEASE_EVERY)
    return shape.num_layers * steps * (shape.directions // config.instances)


class Ranked(NamedTuple):
    """A candidate of the cost model's ranking: predicted µs per step of
    ``config`` run in batch slices of ``batch_slice`` (None: unsliced)."""

    us: float
    config: KernelConfig
    batch_slice: int | None


def slice_sizes(bucket: int) -> list[int | None]:
    """Batch slices the planner considers at ``bucket``: none (one slice as
    large as a block holds), and every power of two below the bucket."""
    return [None] + [1 << i for i in range((bucket - 1).bit_length()) if 1 << i < bucket]


def ranked_configs(shape: ModelShape, bucket: int, model: cost.CostModel,
                   steps: int = DEFAULT_STEPS, *, tf32: bool = False) -> list[Ranked]:
    """Every layout's pruned space at every slice size, cheapest predicted
    forward of ``steps`` steps first. A slice size below the bucket is a
    candidate only where all its slices fit the SMs at once (single and
    cluster sync: grid sync runs one slice per launch). ``tf32``: TF32
    configurations of an fp32 model are candidates too. ``model`` is first
    calibrated for the batch tiles the space needs (:meth:`CostModel.cover`)."""
    pruned = [c for layout in layouts(shape)
              for c in space.pruned_space(shape.cell, shape.hidden_size, bucket, shape.dtype, model.facts, **layout,
                                          tf32=tf32)]
    model.cover(pruned)
    pruned = [c for c in pruned if model.prices(c)]
    ranked: list[Ranked] = []
    for batch_slice in slice_sizes(bucket):
        slices = 1 if batch_slice is None else -(-bucket // batch_slice)
        configs = [c for c in pruned
                   if batch_slice is None or c.sync != "grid" and c.batch_tile <= space.next_power_of_two(batch_slice)
                   and slices * c.blocks * c.instances <= model.facts.sm_count]
        ranked += [Ranked(us, c, batch_slice) for us, c in model.rank(configs, bucket, batch_slice)]
    ranked.sort(key=lambda r: r.us * forward_steps(r.config, shape, steps))  # stable: ties keep model order
    return ranked


def family(config: KernelConfig, batch_slice: int | None) -> tuple[str, bool, bool, int, int | None]:
    """A candidate's kernel family: its math (FFMA, 16-bit or TF32 mma),
    whether its step is fused, an mma product's k split, and its batch
    slices. The cost model ranks within a family better than across
    families: on the H100 it priced the 16-bit mma step of an LSTM 64 at
    batch 8 at 0.19 µs and ranked five mma configurations first, which
    measured 1.6-2.0 µs per step, against 0.66 for the FFMA ones ranked below
    them; it prices an mma product at almost nothing, so its order of k
    splits is arbitrary (GRU 1024 fp16 at batch 20: k split 8 timed 0.516 ms,
    4 0.645; perf-notes §66, §67). And across slice sizes: at 16-bit LSTM 256
    batch 8 the fused step in slices of 2 stood for the fused family while
    slices of 1 on clusters of 8 x 256 threads, never timed, measured 13%
    faster than the plan (perf-notes §103). :func:`compile_top` times a
    slice size other than its kernel family's best-ranked one only where the
    model prices it within :data:`SLICE_WINDOW` of that one."""
    return config.math, config.tf32, config.fused_step, config.k_split, batch_slice


def candidate_families(ranked: list[Ranked]) -> list[tuple | None]:
    """The :func:`family` of each of ``ranked`` (best first), or None where
    its slice size is priced past :data:`SLICE_WINDOW` above its kernel
    family's best-ranked slice size: such a one is timed only among the
    model's top k."""
    return _families_and_prices(ranked)[0]


def _families_and_prices(ranked: list[Ranked]) -> tuple[list[tuple | None], dict[tuple, float]]:
    """:func:`candidate_families`, and each family's best-ranked price."""
    of = [family(r.config, r.batch_slice) for r in ranked]
    best_us: dict[tuple, float] = {}
    for r, f in zip(ranked, of):
        best_us.setdefault(f, r.us)
    kernel_best: dict[tuple, float] = {}  # by family without its slices: the best-ranked slice size's price
    for f, us in best_us.items():
        kernel_best.setdefault(f[:-1], us)
    return [f if best_us[f] <= kernel_best[f[:-1]] * (1 + SLICE_WINDOW) else None for f in of], best_us


def compile_top(ranked: list[Ranked], k: int, *, twins: bool = True, families: bool = True) -> list[Ranked]:
    """The first ``k`` of ``ranked``'s barrier configurations that compile
    without spilling, then (``families``) the best-ranked of every
    :func:`family` that compiles (:func:`candidate_families`), and the next ones whose predictions tie
    with it (:data:`FAMILY_TIE`), up to :data:`FAMILY_MEMBERS` of each with
    the top ``k`` counted, then (``twins``) the tagged-exchange twin
    of each that ``ranked`` holds and that compiles, compiled in threads.
    Neither takes any of the ``k`` places. A twin: the model prices the two
    within 1% of each other, while on the H100 the twin measured from 26%
    faster to 40% slower per step at batch 1 (perf-notes §51), so only
    timing both tells."""
    own = [r for r in ranked if not r.config.tagged_exchange]
    # Keyed by the barrier configuration each is the twin of (cluster and single ones have none).
    tagged = {(dataclasses.replace(r.config, tagged_exchange=False), r.batch_slice): r
              for r in ranked if twins and r.config.tagged_exchange}
    of, best_us = _families_and_prices(own)

    def ties(i: int) -> bool:
        """Whether the model predicts ``own[i]``, of an FFMA family, within FAMILY_TIE of its family's best-ranked."""
        return own[i].config.math == "ffma" and own[i].us <= best_us[of[i]] * (1 + FAMILY_TIE)
    compiled: dict[int, bool] = {}  # by position in own
    twin_built: dict[int, bool] = {}  # by the position in own of the configuration it is the twin of

    def compile_positions(positions: list[int], twins_of: Iterable[int] = ()) -> None:
        """Compiles the configurations at ``positions`` and the twins of those at ``twins_of``, all at once."""
        positions = [i for i in positions if i not in compiled]
        pairs = [i for i in twins_of if i not in twin_built and (own[i].config, own[i].batch_slice) in tagged]
        configs = [own[i].config for i in positions] + [tagged[own[i].config, own[i].batch_slice].config
                                                         for i in pairs]
        results = runtime.map_in_threads(compiles, configs)
        compiled.update(zip(positions, results))
        twin_built.update(zip(pairs, results[len(positions):]))

    def built_before(limit: int) -> list[int]:
        return [i for i in range(min(limit, len(own))) if compiled.get(i)]

    # One round of compiles where nothing spills (on a fresh machine each
    # round is ~1 s of this host's time): twice k (a few spill under some
    # NVRTC versions), every family's best-ranked and the next that ties
    # with it, and the twins of all those that can be timed.
    start = 2 * k
    head = list(range(min(start, len(own))))
    firsts = [i for f in dict.fromkeys(of) if families and f is not None
              for n, i in enumerate([j for j, g in enumerate(of) if g == f][:FAMILY_MEMBERS]) if n == 0 or ties(i)]
    compile_positions(sorted(set(head + firsts)), sorted(set(head[:k] + firsts)))
    while len(built_before(start)) < k and start < len(own):
        missing = k - len(built_before(start))
        compile_positions(list(range(start, min(start + 2 * missing, len(own)))))
        start += 2 * missing
    kept_at = built_before(start)[:k]
    if families:
        timed = collections.Counter(of[i] for i in kept_at)
        # A family none of whose compiled members built: its first two untried (one may spill), at once.
        built = {of[i] for i, ok in compiled.items() if ok}
        compile_positions([i for f in set(of) - built - {None} for i in [j for j, g in enumerate(of)
                                                                if g == f and j not in compiled][:2]])
        for i in sorted(i for i, ok in compiled.items() if ok and i not in kept_at):
            # A family's best-ranked that built, and up to FAMILY_MEMBERS with those that tie with it.
            if of[i] is not None and (not timed[of[i]] or (timed[of[i]] < FAMILY_MEMBERS and ties(i))):
                timed[of[i]] += 1
                kept_at.append(i)
    compile_positions([], kept_at)  # twins of what spills moved into the kept set (none where nothing spilled)
    return [own[i] for i in kept_at] + [tagged[own[i].config, own[i].batch_slice] for i in kept_at
                                         if twin_built.get(i)]


def compiles(config: KernelConfig) -> bool:
    """Whether ``config`` compiles (disk-cached) without spilling under this NVRTC."""
    try:
        persistent.compile_config(config)
        return True
    except ConfigError:  # spilled under this NVRTC: not a candidate
        return False


# ----------------------------------------------------------------------------
# Timing on the real shapes
# ----------------------------------------------------------------------------


class _Workload:
    """Random weights and inputs of ``shape`` at ``batch`` x ``steps`` on the GPU."""

    def __init__(self, shape: ModelShape, batch: int, steps: int) -> None:
        import torch

        self.shape, self.batch, self.steps = shape, batch, steps
        dev = torch.device("cuda")
        dtype = getattr(torch, shape.dtype)
        spec = get_cell(shape.cell)
        G, H = spec.num_gates, shape.hidden_size
        gen = torch.Generator(device=dev).manual_seed(0)
        scale = H ** -0.5

        def rand(*size):
            return ((torch.rand(*size, device=dev, generator=gen) * 2 - 1) * scale).to(dtype)

        self.layers = [[dict(w_ih=rand(G * H, shape.layer_input(l)), w_hh=rand(G * H, H), b_ih=rand(G * H),
                             b_hh=rand(G * H)) for _ in range(shape.directions)] for l in range(shape.num_layers)]
        self.x = rand(steps, batch, shape.input_size) / scale
        states = shape.num_layers * shape.directions
        self.h0 = rand(states, batch, H)
        self.c0 = rand(states, batch, H) if spec.has_cell_state else None

    def persistent(self, config: KernelConfig, batch_slice: int | None):
        def run() -> None:
            persistent.forward_model(config, self.layers, self.x, self.h0, self.c0, batch_slice=batch_slice,
                                     check=False)
        return run

    def fallback(self):
        from .. import fallback

        def run() -> None:
            fallback.forward_model(self.shape.cell, self.layers, self.x, self.h0, self.c0)
        return run

    def cudnn(self):
        import torch

        s = self.shape
        kind = getattr(torch.nn, CUDNN_CELLS[s.cell])
        extra = {"nonlinearity": s.cell.removeprefix("rnn_")} if kind is torch.nn.RNN else {}
        module = kind(s.input_size, s.hidden_size, s.num_layers, bidirectional=s.bidirectional,
                      **extra).to("cuda", getattr(torch, s.dtype))
        torch_names = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh"}
        for l, directions in enumerate(self.layers):
            for d, p in enumerate(directions):
                for name, value in p.items():
                    getattr(module, f"{torch_names[name]}_l{l}{'_reverse' if d else ''}").data.copy_(value)
        module.flatten_parameters()  # cuDNN's single weight buffer, as a served module has it
        hx = self.h0 if self.c0 is None else (self.h0, self.c0)

        def run() -> None:
            with torch.no_grad():
                module(self.x, hx)
        return run


class Candidate(NamedTuple):
    """One runnable choice: a persistent configuration (with its ranking), the fallback or cuDNN."""

    label: str
    path: str
    ranked: Ranked | None  # the persistent candidates'
    run: Any


def timing_candidates(shape: ModelShape, batch: int, top: list[Ranked], steps: int) -> list[Candidate]:
    """The forwards the tuner times for ``shape`` at ``batch``: ``top``'s
    persistent candidates, the fallback, and cuDNN where torch has the cell,
    on one random workload."""
    work = _Workload(shape, batch, steps)
    candidates = [Candidate(candidate_label(r), "persistent", r, work.persistent(r.config, r.batch_slice))
                  for r in top]
    candidates.append(Candidate("fallback", "fallback", None, work.fallback()))
    if shape.cell in CUDNN_CELLS:
        candidates.append(Candidate("cudnn", "cudnn", None, work.cudnn()))
    return candidates


def candidate_label(ranked: Ranked) -> str:
    return config_label(ranked.config, ranked.batch_slice)


TIMING_ROUNDS = 7
CALLS_PER_TIMING = 3


def time_candidates(candidates: list[Candidate], progress: bool = False) -> dict[str, float]:
    """Device ms per forward of each candidate, by label, at steady clocks:
    each forward captured in a CUDA graph, the GPU warmed up to steady clocks
    first, then :data:`TIMING_ROUNDS` rounds that time every candidate once
    in turn (replays of :data:`CALLS_PER_TIMING` forwards back to back, CUDA
    events), the median round kept. Interleaved rounds put every candidate
    under the same clocks and temperature; timed one after another right
    after compiling, a candidate read 3-4x its steady time (an idle H100
    sits at 345 MHz). A candidate that cannot launch here is reported as
    ``"<label> (failed: <why>)"`` with NaN.

    Device time, not host time: called eagerly, a small model's forward is
    bound by Python issue time, which is the same for every configuration
    and would hide their differences (measured: 0.175 ms per eager call of
    an H=256 LSTM whose kernel takes 0.094 ms). Every candidate, cuDNN
    included, is timed the same way."""
    measured: dict[str, float] = {}
    graphs = {}
    for c in track(candidates, progress, "capturing candidates"):
        try:
            graphs[c.label] = runtime.capture_graph(c.run)
        except (ConfigError, KernelLaunchError) as exc:  # cannot be resident here, or out of shared memory
            measured[f"{c.label} (failed: {exc})"] = float("nan")

    def replays(graph: Any):
        def many() -> None:
            for _ in range(CALLS_PER_TIMING):
                graph.replay()
        return many

    runs = {label: replays(graph) for label, graph in graphs.items()}
    if runs:
        runtime.warm_up(next(iter(runs.values())))
    rounds: dict[str, list[float]] = {label: [] for label in runs}
    for _ in track(range(TIMING_ROUNDS), progress, "timing candidates"):
        for label, many in runs.items():
            rounds[label].append(runtime.time_cuda_ms(many, warmup=1, repeats=1) / CALLS_PER_TIMING)
    measured.update({label: statistics.median(times) for label, times in rounds.items()})
    return measured


def time_forward_ms(run, *, calls: int = CALLS_PER_TIMING, warmup: int = 2, repeats: int = 5) -> float:
    """Device ms per forward of ``run`` alone, as :func:`time_candidates`
    times one: captured in a CUDA graph, the replay of ``calls`` back to
    back timed with CUDA events, median of ``repeats``."""
    graph = runtime.capture_graph(run)

    def many() -> None:
        for _ in range(calls):
            graph.replay()

    return runtime.time_cuda_ms(many, warmup=warmup, repeats=repeats) / calls


def _layout(c: KernelConfig) -> str:
    if c.pipeline:
        return f", {c.instances} layers fused"
    return f", {c.instances} directions at once" if c.instances > 1 else ""


def config_label(c: KernelConfig, batch_slice: int | None = None) -> str:
    """A persistent configuration (and batch slice) in a few words: the
    tuner's key for its timings, and the benchmarks' column."""
    return (f"persistent {c.sync}x{c.blocks} t{c.threads} g{c.group_size} bt{c.batch_tile} sk{c.shared_k_chunks}"
            f" {'tf32' if c.tf32 else c.math}" + (f" ks{c.k_split}" if c.math == "mma" else "")
            + (" 1sync" if c.one_sync else "")
            + (" fused" if c.fused_step else "") + (" tagged" if c.tagged_exchange else "")
            + (f" pipeline{c.instances}" if c.pipeline else f" x{c.instances}" if c.instances > 1 else "")
            + (f" slices of {batch_slice}" if batch_slice else ""))


# ----------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------


def plan(shape: ModelShape, batch: int, *, tune: bool = True, k: int = DEFAULT_K, steps: int = DEFAULT_STEPS,
         progress: bool = False, refresh: bool = False) -> Plan:
    """How to run ``shape`` at ``batch`` on the current GPU (see the module docstring)."""
    if not isinstance(k, int) or k < 1:
        raise ArgumentError(f"k: expected a positive int, got {k!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ArgumentError(f"steps: expected a positive int, got {steps!r}")
    facts = runtime.device_facts()
    bucket = space.batch_bucket(batch)
    tf32 = tf32_allowed(shape)
    key = cache_key(facts, shape, bucket, tf32)
    if not refresh:
        cached = load_plan(key)
        if cached is not None:
            return cached
    started = time.perf_counter()
    model = cost.cost_model(progress=progress, batch=bucket)
    ranked = ranked_configs(shape, bucket, model, steps, tf32=tf32)
    if not tune:
        top = compile_top(ranked, 1, twins=False, families=False)  # untimed: the model's choice alone
        if not top:
            return Plan(shape, bucket, "fallback", None, "model", _no_fit_reason(shape, facts))
        return Plan(shape, bucket, "persistent", top[0].config, "model",
                    f"the cost model's top choice of {len(ranked)} candidates (untimed)", predicted_us=top[0].us,
                    batch_slice=top[0].batch_slice)

    # A server's workers start together and tune the same shapes at once, each timing its candidates beside
    # the others' timings and compiles: one process tunes a key while the others wait for its plan.
    waiting = time.perf_counter()
    with runtime.key_lock(cache_path(key)):
        if not refresh and (cached := load_plan(key)) is not None:
            return cached
        started += time.perf_counter() - waiting  # tuning_seconds: the work, not the wait for another process
        logger.info("tuning %s at batch %d on %s: compiling the cost model's top %d of %d configurations and timing "
                    "them with the fallback and cuDNN", shape, batch, facts.name, k, len(ranked))
        top = compile_top(ranked, k)
        # A launch of whole slices runs the candidate's build for that slice size: compiled now, in threads.
        device = runtime.device_facts().index
        runtime.map_in_threads(lambda r: persistent.launched_config(r.config, bucket, r.batch_slice, device), top)
        ranks = sorted(top, key=ranked.index)  # the model's order, twins beside their own
        own = sum(not r.config.tagged_exchange for r in top)
        timed_configs = f"model's top {min(k, own)}" + (
            f", {n} more of its kernel families" if (n := own - min(k, own)) else "") + (
            f" and {n} tagged twin(s)" if (n := sum(r.config.tagged_exchange for r in top)) else "")
        candidates = timing_candidates(shape, bucket, top, steps)
        measured = time_candidates(candidates, progress)
        timed = [c for c in candidates if c.label in measured]
        best = min(timed, key=lambda c: measured[c.label])
        chosen = best.ranked or Ranked(None, None, None)
        if best.path == "persistent":
            rank = ranks.index(best.ranked) + 1
            reason = f"fastest of the {timed_configs} (model rank {rank}), the fallback and cuDNN, timed"
        elif top:
            reason = f"{best.path} was faster than the {timed_configs} persistent configurations, timed"
        else:
            reason = _no_fit_reason(shape, facts) + f"; {best.path} was the faster of the rest, timed"
        path, config, us = best.path, chosen.config, chosen.us
        short_path, short_steps, short_measured = None, 0, {}
        if best.path == "persistent" and steps > SHORT_STEPS:
            short_measured = time_candidates(timing_candidates(shape, bucket, [best.ranked], SHORT_STEPS), progress)
            short_path, short_steps = short_sequence_path(best.label, measured, short_measured, steps)
        result = Plan(shape, bucket, path, config, "tuned", reason, predicted_us=us, measured_ms=measured, steps=steps,
                      tuning_seconds=time.perf_counter() - started, batch_slice=chosen.batch_slice,
                      short_path=short_path, short_steps=short_steps, short_measured_ms=short_measured)
        store_plan(key, result)
        logger.info("tuned %s at batch %d in %.1f s: %s", shape, batch, result.tuning_seconds, result.describe())
        # The calibration's programs a later plan at a larger batch needs, compiled
        # now in the background: started during the tuning, they slowed it by
        # 0.6 s or more beside its own compiles (perf-notes §70).
        if rest := cost.tiles_for(None) - model.cal.tiles:
            cost.compile_ahead(rest)
        return result


def short_sequence_path(chosen: str, long_ms: dict[str, float], short_ms: dict[str, float],
                        long_steps: int, short_steps: int = SHORT_STEPS) -> tuple[str | None, int]:
    """(path, most steps) for short sequences, or (None, 0): the path other
    than the chosen persistent one (label ``chosen``) that is fastest at
    ``short_steps`` steps, where it beats the chosen one there, and the
    longest sequence it still wins, each path's time taken as linear in the
    steps between its two timings (``long_ms`` at ``long_steps``,
    ``short_ms`` at ``short_steps``, device ms per forward by label). A
    persistent launch pays its weights' load and its launch once per call
    (~10 µs), where cuDNN's per-step kernels start sooner: on the H100 a
    single step of an LSTM 256 took 0.014 ms on its persistent plan and 0.010
    on cuDNN (``docs/results/scaling-h100.md``)."""
    def timed(ms: dict[str, float], label: str) -> bool:
        return math.isfinite(ms.get(label, math.nan))  # absent, or NaN: failed to launch

    others = [(short_ms[path], path) for path in ("fallback", "cudnn")
              if timed(short_ms, path) and timed(long_ms, path)]
    if not (timed(short_ms, chosen) and timed(long_ms, chosen) and others):
        return None, 0
    mine_short, mine_long = short_ms[chosen], long_ms[chosen]
    other_short, path = min(others)
    if not other_short < mine_short:
        return None, 0
    # other(T) - mine(T) = (other_short - mine_short) + (T - short) * slope: negative at T = short, positive at
    # long_steps (the chosen one won there), so the slope is positive and the sign changes once, at `crossing`.
    slope = ((long_ms[path] - other_short) - (mine_long - mine_short)) / (long_steps - short_steps)
    if not slope > 0:
        return None, 0
    crossing = short_steps + (mine_short - other_short) / slope
    return path, max(short_steps, math.ceil(crossing) - 1)


_MEMO: dict[tuple, Plan] = {}
_MEMO_LOCK = threading.Lock()


def cached_plan(shape: ModelShape, batch: int) -> Plan:
    """The plan every call of ``shape`` at ``batch`` runs: the one in-process
    plan cache, in front of the disk cache. Tuned on first use (one thread
    tunes; the others wait for its choice). Inside a CUDA-graph capture, where
    nothing may be timed, the untimed choice is returned and not remembered."""
    import torch

    key = _memo_key(shape, batch)
    chosen = _MEMO.get(key)
    if chosen is not None:
        return chosen
    if torch.cuda.is_current_stream_capturing():
        return plan(shape, batch, tune=False)
    with _MEMO_LOCK:
        chosen = _MEMO.get(key)
        if chosen is None:
            chosen = _MEMO[key] = plan(shape, batch, tune=True)
    return chosen


def _memo_key(shape: ModelShape, batch: int) -> tuple:
    import torch

    return torch.cuda.current_device(), shape, space.batch_bucket(batch), tf32_allowed(shape)


def pin_plan(chosen: Plan) -> None:
    """Make every call of ``chosen.shape`` at a batch of its bucket, on the
    current device, run ``chosen`` in this process until
    :func:`clear_cached_plans` (as :func:`cached_plan` would have chosen it;
    the tests pin each path this way). The native replay's bindings, which
    stand for the plans before, are dropped."""
    if not isinstance(chosen, Plan):
        raise ArgumentTypeError(f"pin_plan: expected a persistrnn.plan.Plan, got {type(chosen).__name__}")
    _MEMO[_memo_key(chosen.shape, chosen.batch_bucket)] = chosen
    _plans_changed()


def clear_cached_plans() -> None:
    """Forget the in-process plans (the disk cache stays), and what stands
    for them: the native replay's bindings and the choices derived from them
    (:func:`on_plans_changed`)."""
    _MEMO.clear()
    _plans_changed()


_DERIVED_FROM_PLANS: list[Callable[[], None]] = []


def on_plans_changed(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever the in-process plans are cleared or pinned:
    a module that caches a choice made from plans (the training forward's
    configuration) registers its cache's clear, so that a retuned shape is
    not served its earlier choice, without this module importing it."""
    _DERIVED_FROM_PLANS.append(forget)


def _plans_changed() -> None:
    runtime.native.unbind_all()
    for forget in _DERIVED_FROM_PLANS:
        forget()


def _no_fit_reason(shape: ModelShape, facts: runtime.DeviceFacts) -> str:
    return (f"no persistent configuration of {shape.cell} H={shape.hidden_size} ({shape.dtype}) fits the "
            f"registers and shared memory of {facts.sm_count} SMs")
