"""Launch: a layer's (or a launch's several layers' and directions')
recurrence on precomputed input projections, with the input-projection GEMM
in front, and a whole model on one configuration.

Every launch owns its scratch (status word, barrier counters, exchange
buffer; :func:`persistrnn.runtime.scratch`), so launches on different streams
or graphs never share them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .. import runtime
from ..checks import check_lengths, check_recurrence, check_tensor
from ..errors import ArgumentError, ConfigError
from .config import KERNEL_NAME, MAX_SLICE_SEQUENCES, STEP_PROFILE_PHASES, KernelConfig
from .source import compile_config

__all__ = ["Instance", "batch_per_launch", "forward_layer", "forward_model", "input_projection", "profile_words",
           "run_instances", "run_recurrence"]


@dataclasses.dataclass
class Instance:
    """One recurrence of a launch (see :func:`run_instances`).

    xw: (T, B, G*H) float32 input projections (None for a pipeline's later
    layers, which get theirs from the layer before), with b_ih, or without
    it where xw_bias (G*H,) is b_ih, which the kernel then adds. w_hh (G*H, H),
    b_hh (G*H,), h0, c0, h_n, c_n (B, H): the layer's dtype, contiguous (h0
    None: zero states, c0 then unused). out:
    (T, B, out_row), of which this instance writes columns
    [out_column, out_column + H); None writes no output. w_next, b_next: the
    next layer's W_ih (G*H, H) and b_ih (pipeline, all but the last).
    saved_gates (T, B, G*H), saved_c (T, B, H): float32 destinations of what
    training's backward reads (``config.save_gates``; saved_c for cells with a
    cell state).
    """

    xw: Any
    w_hh: Any
    b_hh: Any
    h0: Any
    c0: Any
    out: Any
    h_n: Any
    c_n: Any
    reverse: bool = False
    out_column: int = 0
    w_next: Any = None
    b_next: Any = None
    saved_gates: Any = None
    saved_c: Any = None
    xw_bias: Any = None


def _address(t: Any, offset: int = 0) -> Any:
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr() + offset * t.element_size())


def run_instances(config: KernelConfig, instances: list[Instance], steps: int, batch: int, *,
                  lengths: Any = None, batch_slice: int | None = None, check: bool = True,
                  profile: Any = None) -> None:
    """Launch ``config`` over ``instances`` (``config.instances`` of them).

    ``lengths``: an int32 CUDA tensor (batch,) of each sequence's steps, 1 to
    ``steps``; past its length a sequence keeps its state and its outputs are
    zero (a reverse instance starts at its last step). None: all ``steps``.

    ``batch_slice``: sequences per batch slice. The batch runs as
    independent slices of this many sequences (the last may hold fewer),
    each on its own blocks, in one launch (see recurrence.cu). None: slices
    as large as a block's shared memory holds. Grid sync runs one slice per
    launch (its barrier spans the launch), so a batch larger than that runs
    as consecutive launches.

    ``profile``: for an instrumented build (``config.step_profile``) only,
    an int64 CUDA tensor of at least :func:`profile_words` elements, which
    the launch fills per block with its phases' cycles (see
    :data:`~.config.STEP_PROFILE_PHASES`); the batch must run in one launch.

    The tensors are taken as they are (the callers made them);
    :func:`run_recurrence` is the checked single-recurrence entry.
    """
    import numpy as np
    import torch

    if len(instances) != config.instances:
        raise ArgumentError(f"expected {config.instances} instances for {config}, got {len(instances)}")
    if (device := runtime.elsewhere(instances[0].w_hh)) is not None:  # a layer on another GPU than the current one
        with torch.cuda.device(device):
            return run_instances(config, instances, steps, batch, lengths=lengths, batch_slice=batch_slice,
                                 check=check, profile=profile)
    if config.lengths != (lengths is not None):  # the variant compiled with (or without) the lengths code
        config = dataclasses.replace(config, lengths=lengths is not None)
    abandon = runtime.failure_hook()
    if config.test_hook != (abandon >= 0):  # likewise the test hook's
        config = dataclasses.replace(config, test_hook=abandon >= 0)
    if config.step_profile != (profile is not None):
        raise ArgumentError(f"profile: expected a tensor exactly for an instrumented build (step_profile "
                            f"{config.step_profile}), got {'a tensor' if profile is not None else None}")
    device = instances[0].w_hh.device
    H, GH = config.hidden_size, config.spec.num_gates * config.hidden_size
    out_row = next((i.out.shape[2] for i in instances if i.out is not None), H)
    if batch_slice is not None and (not isinstance(batch_slice, int) or batch_slice < 1):
        raise ArgumentError(f"batch_slice: expected a positive int or None, got {batch_slice!r}")
    per_slice = _slice_size(config, batch, batch_slice, device.index)
    config = _whole_slice_build(config, batch, per_slice)
    per_launch = per_slice if config.sync == "grid" else batch
    if profile is not None:
        need = profile_words(config, -(-batch // per_slice))
        if per_launch < batch or profile.dtype != torch.int64 or profile.device != device or profile.numel() < need:
            raise ArgumentError(f"profile: expected one launch and an int64 tensor of at least {need} elements on "
                                f"{device}; got {-(-batch // per_launch)} launch(es), {profile.dtype} "
                                f"{tuple(profile.shape)} on {profile.device}")
    report = np.uint64(runtime.report_word(device.index))
    timeout, abandon = np.uint64(runtime.wait_timeout_ns()), np.int32(abandon)
    for b0 in range(0, batch, per_launch):
        nb = min(per_launch, batch - b0)
        slices = -(-nb // per_slice)
        kernel, launch_config = _prepared_launch(config, device.index, per_slice, slices)
        # The launch's own status word, counters and (grid) exchange buffer;
        # zeros, since the kernel reads exchange rows it never writes (and a
        # tagged exchange's zero tag is no exchange's). (The kernel lays
        # every slice out at the full slice's stride, a shorter last launch
        # included.)
        own = runtime.scratch(device, config.exchange_floats(per_slice), counters=config.counter_words * slices)
        pipe = None
        if config.pipeline:
            pipe = torch.empty(slices * config.pipe_floats(steps, per_slice), dtype=torch.float32, device=device)
        args = []
        for i in instances:
            c0 = i.c0 if i.c0 is not None else i.h0
            c_n = i.c_n if i.c_n is not None else i.h_n
            args += [_address(i.xw, b0 * GH), _address(i.w_hh), _address(i.b_hh), _address(i.h0, b0 * H),
                     _address(c0, b0 * H), _address(i.out, b0 * out_row + i.out_column), _address(i.h_n, b0 * H),
                     _address(c_n, b0 * H), int(i.reverse), _address(i.xw_bias)]
            if config.pipeline:
                args += [_address(i.w_next), _address(i.b_next)]
            if config.save_gates:
                args += [_address(i.saved_gates, b0 * GH), _address(i.saved_c, b0 * H)]
        args += [np.uint64(own.exchange), np.uint64(own.counters), _address(pipe), _address(lengths, b0), steps,
                 per_slice, nb, batch, out_row, np.uint64(own.status), report, timeout, abandon]
        if profile is not None:
            args.append(_address(profile))
        runtime.launch(kernel, launch_config, *runtime.kernel_args(*args))
    if check:
        runtime.raise_reported_failure(device.index, KERNEL_NAME, synchronize=True)


def profile_words(config: KernelConfig, slices: int) -> int:
    """The int64 words an instrumented launch of ``slices`` batch slices
    writes: per block, one per phase, then the step loop's cycles and
    nanoseconds."""
    return slices * config.blocks * config.instances * (len(STEP_PROFILE_PHASES) + 2)


def run_recurrence(
    config: KernelConfig,
    xw: Any,
    w_hh: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None,
    *,
    out: Any | None = None,
    h_n: Any | None = None,
    c_n: Any | None = None,
    reverse: bool = False,
    lengths: Any = None,
    batch_slice: int | None = None,
    check: bool = True,
) -> tuple[Any, Any, Any | None]:
    """Run the recurrence on precomputed input projections.

    Args:
        xw: (T, B, G*H) float32 CUDA tensor, ``x @ W_ih^T + b_ih``.
        w_hh: (G*H, H); b_hh: (G*H,); h0, c0: (B, H); all of ``config.dtype``.
        out, h_n, c_n: optional destinations, (T, B, H) and (B, H).
        reverse: run the steps from the last to the first (out[t] is still
            the output at position t).
        lengths: int32 (B,) steps of each sequence, as in :func:`run_instances`.
        batch_slice: sequences per batch slice, as in :func:`run_instances`.
        check: synchronise and raise if the kernel reported a failure.

    Returns (output (T, B, H), h_n (B, H), c_n (B, H) or None).
    """
    import torch

    if config.instances != 1:
        raise ConfigError(f"run_recurrence runs one recurrence; {config} has {config.instances} instances "
                          "(run_instances runs those)")
    spec = config.spec
    H = config.hidden_size
    dtype = getattr(torch, config.dtype)
    T, B = check_recurrence(spec, xw, w_hh, b_hh, h0, c0, H, dtype)

    def destination(name: str, given: Any, shape: tuple[int, ...]) -> Any:
        if given is None:
            return torch.empty(shape, dtype=dtype, device=xw.device)
        check_tensor(name, given, shape, xw.device, dtype)
        return given

    out = destination("out", out, (T, B, H))
    h_n = destination("h_n", h_n, (B, H))
    c_n = destination("c_n", c_n, (B, H)) if spec.has_cell_state else None
    if lengths is not None:
        check_lengths(lengths, T, B, xw.device)
    run_instances(config, [Instance(xw, w_hh, b_hh, h0, c0, out, h_n, c_n, reverse)], T, B, lengths=lengths,
                  batch_slice=batch_slice, check=check)
    return out, h_n, c_n


@functools.lru_cache(maxsize=None)
def fixed_slice_variant(config: KernelConfig, sequences: int) -> KernelConfig:
    """``config`` compiled for slices of exactly ``sequences`` sequences
    (:attr:`KernelConfig.slice_sequences`), or ``config`` itself past
    :data:`MAX_SLICE_SEQUENCES` or where that build spills. Compiled on first
    use (disk-cached); the tuner compiles it for its candidates beforehand
    (:func:`launched_config`)."""
    # The tagged exchange's read of h, built for one sequence, measured 2.4x slower in its exchange wait
    # (LSTM 1024 b1, 0.67 -> 1.61 µs per step; perf-notes §64): it keeps the general build.
    if sequences > MAX_SLICE_SEQUENCES or config.tagged_exchange:
        return config
    fixed = dataclasses.replace(config, slice_sequences=sequences)
    try:
        compile_config(fixed)
    except ConfigError:
        return config
    return fixed


def launched_config(config: KernelConfig, batch: int, batch_slice: int | None, device: int) -> KernelConfig:
    """The build :func:`run_instances` launches for ``batch`` sequences of
    ``config`` in slices of ``batch_slice``: with the slice size compiled in
    where every slice is full."""
    return _whole_slice_build(config, batch, _slice_size(config, batch, batch_slice, device))


def _slice_size(config: KernelConfig, batch: int, batch_slice: int | None, device: int) -> int:
    """Sequences per slice of a launch of ``batch``: ``batch_slice``, at most what one launch holds."""
    most = batch_per_launch(config, device)
    return min(batch_slice or most, most, batch)


def _whole_slice_build(config: KernelConfig, batch: int, per_slice: int) -> KernelConfig:
    """``config`` with the slice size compiled in where every slice is full (and the build is a general one)."""
    if batch % per_slice or config.slice_sequences or config.resident_input_size:
        return config
    return fixed_slice_variant(config, per_slice)


@functools.lru_cache(maxsize=None)
def batch_per_launch(config: KernelConfig, device: int) -> int:
    """Most sequences one launch of ``config`` holds on ``device``."""
    kernel = runtime.get_kernel(compile_config(config), KERNEL_NAME)
    limit = runtime.device_facts().shared_per_block_optin - kernel.resources.shared_bytes
    per_launch = config.max_batch(limit)
    if per_launch < 1:
        raise ConfigError(f"{config} needs {config.shared_bytes(1)} bytes of shared memory per block; "
                          f"the device allows {limit}")
    return per_launch


@functools.lru_cache(maxsize=1024)
def _prepared_launch(config: KernelConfig, device: int, per_slice: int,
                     slices: int) -> tuple[runtime.LoadedKernel, Any]:
    """The loaded kernel and checked launch configuration, once per (config,
    device, slice size, slices): the residency queries cost far more than a launch."""
    kernel = runtime.get_kernel(compile_config(config), KERNEL_NAME)
    shared = config.shared_bytes(per_slice)
    if config.sync == "single":
        return kernel, kernel.config(config.instances, config.threads, shared=shared, slices=slices)
    if config.sync == "cluster":
        return kernel, kernel.config(config.blocks * config.instances, config.threads, shared=shared,
                                     cluster=config.blocks, slices=slices)
    return kernel, kernel.config(config.blocks, config.threads, shared=shared, cooperative=True)


def input_projection(x: Any, w_ih: Any, b_ih: Any = None) -> Any:
    """``x @ W_ih^T (+ b_ih)`` for every step at once: (T, B, I) -> (T, B, G*H) float32.

    One GEMM through torch. A 16-bit layer's GEMM accumulates and returns
    fp32, so the recurrence starts from unrounded projections. Without
    ``b_ih`` it is a plain GEMM, one launch, and the persistent kernel adds
    the bias (:attr:`Instance.xw_bias`): with it, cuBLASLt's bias epilogue ran
    small layers' projections split-K, a memset and three kernels, and a
    16-bit bias took two more launches (perf-notes §68).
    """
    import torch

    T, B, I = x.shape
    x2 = x.reshape(T * B, I)
    out_dtype = {} if x.dtype == torch.float32 else {"out_dtype": torch.float32}
    xw = torch.mm(x2, w_ih.t(), **out_dtype) if b_ih is None else torch.addmm(b_ih, x2, w_ih.t(), **out_dtype)
    return xw.view(T, B, -1)


def forward_layer(
    config: KernelConfig,
    x: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    h0: Any,
    c0: Any | None = None,
    *,
    check: bool = True,
) -> tuple[Any, Any, Any | None]:
    """One layer, one direction: :func:`input_projection`, then the recurrence.

    ``x`` is (T, B, I) of ``config.dtype``; the rest as in :func:`run_recurrence`.
    """
    return run_recurrence(config, input_projection(x, w_ih, b_ih), w_hh, b_hh, h0, c0, check=check)


def forward_model(config: KernelConfig, layers: list[list[dict[str, Any]]], x: Any, h0: Any, c0: Any | None, *,
                  lengths: Any = None, batch_slice: int | None = None,
                  check: bool = True) -> tuple[Any, Any, Any | None]:
    """A whole model on ``config``: every layer and direction.

    ``layers[l][d]`` holds the tensors ``w_ih``, ``w_hh``, ``b_ih``, ``b_hh``
    of layer l, direction d (1: reverse); ``x`` is (T, B, I); ``h0``, ``c0``
    are (L*D, B, H), or both None for zeros (the kernel starts from zeros:
    no launch fills them); ``lengths`` and ``batch_slice`` as in :func:`run_instances`
    (``lengths`` may also be on the CPU: checked there, copied without a
    synchronise; on the device they are checked with ``check``, which
    synchronises, and are the caller's to check without it). Returns
    (output (T, B, D*H), h_n, c_n (L*D, B, H)).

    A pipeline configuration runs all layers in one launch; one with two
    instances runs a bidirectional layer's directions in one launch;
    otherwise each layer and direction is a launch of its own. The reverse
    direction runs its steps backwards in the kernel (no flipped copies).
    """
    import torch

    L, D = len(layers), len(layers[0])
    T, B, _ = x.shape
    if lengths is not None and lengths.device.type == "cpu":
        # Checked on the host and copied without a synchronise (on the
        # device, the check reads the extremes back: it waits for the stream).
        check_lengths(lengths, T, B, lengths.device)
        lengths = runtime.to_device_async(lengths, x.device)
    elif lengths is not None and check:
        check_lengths(lengths, T, B, x.device)
    H = config.hidden_size
    has_c = config.spec.has_cell_state
    if h0 is None and c0 is not None:
        raise ArgumentError("forward_model: c0 without h0; expected both or neither")
    h0 = h0.contiguous() if h0 is not None else None
    c0 = c0.contiguous() if has_c and h0 is not None else None
    h_n = torch.empty(L * D, B, H, dtype=x.dtype, device=x.device)
    c_n = torch.empty_like(h_n) if has_c else None

    def instance(l: int, d: int, xw: Any, out: Any) -> Instance:
        i = l * D + d
        p = layers[l][d]
        # The first layer's projection is a plain GEMM and the kernel adds
        # b_ih (a pipeline's later layers get theirs, b_ih included, from
        # the layer before).
        return Instance(xw, p["w_hh"], p["b_hh"], None if h0 is None else h0[i], None if c0 is None else c0[i], out,
                        h_n[i], c_n[i] if has_c else None, reverse=d == 1, out_column=d * H,
                        xw_bias=p["b_ih"] if xw is not None else None)

    if config.pipeline:
        if D != 1 or config.instances != L:
            raise ConfigError(f"{config} runs {config.instances} layers of one direction; the model has {L} "
                              f"layer(s) of {D} direction(s)")
        out = torch.empty(T, B, H, dtype=x.dtype, device=x.device)
        first = layers[0][0]
        instances = [instance(l, 0, input_projection(x, first["w_ih"]) if l == 0 else None,
                              out if l == L - 1 else None) for l in range(L)]
        for l in range(L - 1):
            instances[l].w_next, instances[l].b_next = layers[l + 1][0]["w_ih"], layers[l + 1][0]["b_ih"]
        run_instances(config, instances, T, B, lengths=lengths, batch_slice=batch_slice, check=check)
        return out, h_n, c_n
    if config.instances not in (1, D):
        raise ConfigError(f"{config} runs {config.instances} recurrences at once; the model has {D} direction(s)")
    layer_input = x
    for l in range(L):
        out = torch.empty(T, B, D * H, dtype=x.dtype, device=x.device)
        group = [instance(l, d, input_projection(layer_input, layers[l][d]["w_ih"]), out)
                 for d in range(D)]
        last = l == L - 1
        if config.instances == D:
            run_instances(config, group, T, B, lengths=lengths, batch_slice=batch_slice, check=check and last)
        else:
            for d, one in enumerate(group):
                run_instances(config, [one], T, B, lengths=lengths, batch_slice=batch_slice,
                              check=check and last and d == D - 1)
        layer_input = out
    return layer_input, h_n, c_n
