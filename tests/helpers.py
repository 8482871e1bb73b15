"""Shared by the tests: random layers, rounding to the layer's dtype, the
float64 reference, torch's own CUDA result beside ours, the one tolerance rule
of every GPU comparison, and a synthetic cost-model calibration.

The tolerance rule (:func:`assert_close_to_reference`)
-------------------------------------------------------
Every GPU result is compared with the float64 reference computed from the
same rounded parameters and inputs, so an error is the computation's own,
never the rounding of its inputs. Two bounds, both must hold:

* norm: ``‖ours − ref‖ / ‖ref‖ <= max(2 · ‖peer − ref‖ / ‖ref‖, NORM_FLOOR[dtype])``
* element: ``max |ours − ref| <= max(2 · max |peer − ref|, ELEMENT_FLOOR[dtype] · max(1, max |ref|))``

``peer`` is torch's CUDA module or function (cuDNN) on the same rounded
inputs in the same dtype, with TF32 off: our fp32 path is exact FFMA, and a
TF32 peer (3e-4) would make the bound 30 times looser than the floor. Where
torch has no kernel for the cell (the reset-before GRU), there is no peer and
the floors are the bound.

The norm is an average: one wrong element among thousands moves it little,
hence the element bound. Over fewer than :data:`MIN_NORM_ELEMENTS` elements
the relative norm is one or two elements' relative error, unbounded where a
reference element is near zero (a single-unit final state), so only the
element bound applies there.
"""

import math
import threading

import numpy as np

from persistrnn import cells, reference

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "tf32": 2.0**-11}

NORM_FLOOR = {
    # The fp32 bound: the FFMA paths measure 1.5e-7 to 5.2e-7.
    "float32": 1e-5,
    # One unit roundoff u, twice the error the README documents (~2e-3 for
    # bf16, ~2e-4 for fp16): rounding the outputs alone costs up to u/2 per
    # element and about 0.3u in norm, and the measured errors are 0.43u.
    # (The old bound of 2e-2 was ten times the documented bf16 error.)
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    # fp32 tensors with TF32 products (weights and h rounded to a 10-bit
    # mantissa, u = 2^-11, fp32 sums): every product carries up to 2u, so a
    # gate's pre-activation up to ~2u of the sum of its terms' magnitudes;
    # 4u in norm is the 16-bit floors' margin over their u.
    "tf32": 2.0**-9,
}

ELEMENT_FLOOR = {
    # Relative to max(1, max |ref|): outputs of tanh/sigmoid cells are below
    # 1, the LSTM cell state and relu RNNs may not be.
    "float32": 1e-5,
    # 4u, two ulps of 1.0: an element carries its own rounding (<= u/2) plus
    # that of the 16-bit states and layer outputs it was computed from.
    # Simulated (fp32 cell math, 16-bit states, float64 reference) on inputs
    # like the kernel tests' (standard normal, h0 of 0.5), it never exceeded
    # 1.5u. On torch's module samples (inputs and states up to 9) rounding
    # reaches 4-5u for any implementation, torch's CUDA module included, and
    # the peer term is the bound where the peer's own rounding was unlucky.
    # Where it was lucky, ours measured 3.45u (bf16 2-unit RNN, relu, packed)
    # and 2.3u (fp16 3-unit bidirectional GRU, unbatched) on the H100, once
    # each in ~2,760 samples with fresh seeds: a 2u floor failed those. A
    # real defect (a wrong gate, row or step) is off by far more than a
    # rounding step.
    "bfloat16": 2.0**-6,
    "float16": 2.0**-9,
    # 16u: an element's pre-activations carry ~2u of the sum of their
    # products' magnitudes, which at H=1024 is several times the sum itself.
    "tf32": 2.0**-7,
}

MIN_NORM_ELEMENTS = 32

FP32_TOLERANCE = NORM_FLOOR["float32"]


def tolerance(dtype: str) -> float:
    """The relative-norm bound where no peer runs (the floor of the rule)."""
    return NORM_FLOOR[dtype]


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_f64(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor, on any device and in any dtype
        a = a.detach().double().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def measure(ours, ref) -> dict:
    """Errors of ``ours`` against the float64 ``ref``: relative norm, largest
    element error and the reference's largest magnitude."""
    a, r = _as_f64(ours), _as_f64(ref)
    if a.shape != r.shape:
        raise AssertionError(f"shape {a.shape}, reference {r.shape}")
    diff = a - r
    ref_norm = float(np.linalg.norm(r))
    return {
        "rel": float(np.linalg.norm(diff)) / max(ref_norm, 1e-30),
        "max_abs": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "ref_max": float(np.max(np.abs(r))) if r.size else 0.0,
        "n": int(r.size),
    }


def _named(value) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, (list, tuple)):
        return {str(i): v for i, v in enumerate(value)}
    return {"": value}


def assert_close_to_reference(ours, ref, peer=None, *, dtype, context="") -> dict:
    """Check ``ours`` against the float64 ``ref`` by the tolerance rule (module
    docstring). ``ours``, ``ref`` and ``peer`` are arrays or tensors, or dicts
    (or sequences) of them with the same keys; ``peer`` None where torch has no
    kernel for the cell. ``dtype``: the computation's dtype ("float32",
    "bfloat16", "float16" or the torch dtype). NaN anywhere fails. Raises
    AssertionError naming every tensor over a bound with the numbers; returns
    the measurements by name."""
    dtype = _dtype_name(dtype)
    ours, ref = _named(ours), _named(ref)
    peer = None if peer is None else _named(peer)
    if set(ours) != set(ref) or (peer is not None and set(peer) != set(ref)):
        raise AssertionError(f"{context}: tensors differ: ours {sorted(ours)}, reference {sorted(ref)}"
                             + ("" if peer is None else f", peer {sorted(peer)}"))
    failures, report = [], {}
    for name in ref:
        m = measure(ours[name], ref[name])
        if peer is not None:
            p = measure(peer[name], ref[name])
            m["peer_rel"], m["peer_max_abs"] = p["rel"], p["max_abs"]
            norm_bound = max(2 * p["rel"], NORM_FLOOR[dtype])
            element_bound = max(2 * p["max_abs"], ELEMENT_FLOOR[dtype] * max(1.0, m["ref_max"]))
        else:
            norm_bound = NORM_FLOOR[dtype]
            element_bound = ELEMENT_FLOOR[dtype] * max(1.0, m["ref_max"])
        m["norm_bound"], m["element_bound"] = norm_bound, element_bound
        report[name] = m
        # "not <=" so that NaN fails
        if m["n"] >= MIN_NORM_ELEMENTS and not m["rel"] <= norm_bound:
            failures.append(f"{name or 'result'}: relative norm error {m['rel']:.3e} > bound {norm_bound:.3e}")
        if not m["max_abs"] <= element_bound:
            failures.append(f"{name or 'result'}: largest element error {m['max_abs']:.3e} > bound "
                            f"{element_bound:.3e}")
    if failures:
        details = "; ".join(
            f"{k or 'result'}: rel {v['rel']:.3e}, max_abs {v['max_abs']:.3e}"
            + (f" (peer rel {v['peer_rel']:.3e}, max_abs {v['peer_max_abs']:.3e})" if "peer_rel" in v else " (no peer)")
            for k, v in report.items())
        raise AssertionError(f"{context + ': ' if context else ''}{dtype}: " + "; ".join(failures)
                             + f". All: {details}")
    return report


# ---- random layers and the float64 reference --------------------------------


def random_layer(cell, input_size, hidden, batch, steps, rng):
    spec = cells.get_cell(cell)
    bound = 1.0 / math.sqrt(hidden)
    g = spec.num_gates * hidden
    p = {
        "w_ih": rng.uniform(-bound, bound, (g, input_size)),
        "w_hh": rng.uniform(-bound, bound, (g, hidden)),
        "b_ih": rng.uniform(-bound, bound, g),
        "b_hh": rng.uniform(-bound, bound, g),
    }
    x = rng.standard_normal((steps, batch, input_size))
    h0 = rng.standard_normal((1, batch, hidden)) * 0.5
    c0 = rng.standard_normal((1, batch, hidden)) * 0.5
    return p, x, h0, c0


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rounded_layer(cell, dtype, input_size, hidden, batch, steps, rng, device="cuda"):
    """:func:`random_layer` drawn in float64 and rounded to ``dtype`` on
    ``device``: (params dict, x (T, B, I), h0 (B, H), c0 (B, H)) as torch tensors."""
    import torch

    p, x, h0, c0 = random_layer(cell, input_size, hidden, batch, steps, rng)
    dt = getattr(torch, dtype)
    params = {k: torch.tensor(v, dtype=dt, device=device) for k, v in p.items()}
    return (params, *(torch.tensor(v, dtype=dt, device=device) for v in (x, h0[0], c0[0])))


def reference_forward(cell, params, x, h0, c0):
    """The float64 reference on the (rounded) torch tensors, so that an error
    is the kernel's own, not the rounding of its inputs: numpy (out, h_n, c_n
    or None)."""
    spec = cells.get_cell(cell)

    def f64(t):
        return t.double().cpu().numpy()

    p = {k: f64(v) for k, v in params.items()}
    hx = (f64(h0)[None], f64(c0)[None]) if spec.has_cell_state else f64(h0)[None]
    out, state = reference.rnn_forward(cell, f64(x), [[p]], hx=hx)
    if spec.has_cell_state:
        return out, state[0][0], state[1][0]
    return out, state[0], None


# ---- torch's own result: the peer of the tolerance rule ---------------------

TORCH_MODULES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
"""The cells torch has a CUDA kernel for (cuDNN), by torch module name."""


def exact_torch():
    """A context in which torch's fp32 CUDA math is exact fp32 (no TF32 in
    cuDNN or in matmuls): the peer of the tolerance rule, and the setting the
    fp32 floor of 1e-5 is stated for."""
    import contextlib


    from persistrnn import runtime

    @contextlib.contextmanager
    def context():
        # not torch.backends.cuda.matmul.allow_tf32: its getter raises once the
        # process has used torch's new precision API beside the legacy one
        with runtime.matmul_precision("highest"), runtime.cudnn_rnn_settings(enabled=True, tf32=False):
            yield

    return context()


def torch_peer(cell, layers, x, h0, c0=None, *, lengths=None):
    """torch's CUDA module for ``cell`` on the same (rounded) tensors, in their
    dtype, TF32 off: (out (T, B, D*H), h_n, c_n or None), or None for a cell
    torch has no kernel for. ``layers[l][d]`` dicts of w_ih, w_hh, b_ih, b_hh;
    ``x`` (T, B, I); ``h0``/``c0`` (L*D, B, H) or (B, H) for one layer and
    direction; ``lengths`` runs a PackedSequence (outputs past a sequence's
    end are zero, as torch pads them)."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    if cell not in TORCH_MODULES:
        return None
    directions = len(layers[0])
    hidden = layers[0][0]["w_hh"].shape[1]
    kwargs = dict(num_layers=len(layers), bidirectional=directions == 2)
    if cell.startswith("rnn_"):
        kwargs["nonlinearity"] = cell.removeprefix("rnn_")
    module = getattr(torch.nn, TORCH_MODULES[cell])(layers[0][0]["w_ih"].shape[1], hidden, **kwargs)
    module = module.to(device=x.device, dtype=x.dtype).eval()
    names = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh"}
    with torch.no_grad():
        for l, layer in enumerate(layers):
            for d, p in enumerate(layer):
                for key, value in p.items():
                    getattr(module, f"{names[key]}_l{l}{'_reverse' if d else ''}").copy_(value)
    module.flatten_parameters()
    h0 = h0 if h0.dim() == 3 else h0[None]
    hx = h0 if c0 is None else (h0, c0 if c0.dim() == 3 else c0[None])
    with torch.no_grad(), exact_torch():
        if lengths is None:
            out, state = module(x, hx)
        else:
            packed = pack_padded_sequence(x, torch.as_tensor(lengths).cpu(), enforce_sorted=False)
            out, state = module(packed, hx)
            out, _ = pad_packed_sequence(out, total_length=x.shape[0])
    h_n, c_n = state if c0 is not None else (state, None)
    return out, h_n, c_n


# ---- running calls: poisoned outputs, threads on streams of their own ----------


def poison_outputs(shapes, dtype):
    """NaN blocks of the outputs' sizes, allocated and freed, so that the
    caching allocator hands them back for the outputs a call makes itself:
    an element the kernel never writes stays NaN and fails the comparison."""
    import torch

    poison = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape in shapes]
    del poison


def on_own_streams(threads, work):
    """[``work(i, stream)`` for each thread i], run in ``threads`` threads
    started together, each inside its own CUDA stream (``stream``), which it
    synchronises before it ends; the first failure is raised here, naming
    its thread."""
    import torch

    torch.cuda.synchronize()  # the inputs the threads read, made on this thread's stream, are ready
    start, results, errors = threading.Barrier(threads), [None] * threads, []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                start.wait()
                results[i] = work(i, stream)
            stream.synchronize()
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            errors.append((i, error))
            start.abort()  # the threads still waiting to start fail too, instead of waiting forever

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise AssertionError(f"thread {errors[0][0]} failed") from errors[0][1]
    return results


# ---- a synthetic calibration of the cost model --------------------------------


def synthetic_calibration(device="synthetic", sm_count=132, version="0"):
    """A :class:`persistrnn.plan.model.Calibration` from plain throughput
    formulas, with magnitudes of the H100's measured one
    (docs/results/calibration-h100.json): the GPU tests plan with it instead
    of running the micro-benchmarks (it only ranks configurations), and the
    CPU tests check the cost model's structure with it.

    product: a column chunk costs its FMAs over a speed-up that grows with
    warps and reuse up to 4x (3.5 ns at one warp, one row, one column, as
    measured), shared weights 1.5x more; the reduction is ~14 ns per shuffle
    round. pointwise 60 + 30 ns per warp per scheduler (85-330 measured),
    __syncthreads 4 + 2 ns per warp (5-22). Exchanges grow with the floats
    each thread moves: st.async 0.25-1.9 µs, the grid barrier 0.75-1.0 µs
    by blocks, barrier plus broadcast 1.15 µs + H / 1450."""
    from persistrnn.plan import model as cost

    product, mma = {}, {}
    for w in cost.WARPS_PER_SCHEDULER:
        for r in cost.BENCH_ROWS:
            for t in cost.BENCH_TILES:
                for g in cost.BENCH_GROUPS:
                    for sh in (0, 1):
                        fmas = r * t
                        chunk = 3.5 * w * fmas / min(4.0, (w * fmas) ** 0.5) * (1.5 if sh else 1.0)
                        fixed = 14.0 * (g.bit_length() - 1) * max(1.0, fmas / 4) / min(w, 2)
                        for k in cost.BENCH_CHUNKS:
                            product[cost._key(w, r, t, g, sh, k)] = fixed + k * chunk
            mma[cost._key(w, r)] = 1.0 * max(1.0, w * r / 2)
    return cost.Calibration(
        device=device, sm_count=sm_count, version=version, clock_mhz=1980.0, product=product, mma=mma,
        pointwise={str(w): 60.0 + 30.0 * w for w in cost.WARPS_PER_SCHEDULER},
        barrier={str(w): 4.0 + 2.0 * w for w in cost.WARPS_PER_SCHEDULER},
        cluster_exchange={cost._key(t, f, n): 0.25 + 0.01 * n + f / (80.0 * t) for t in (32, 256, 1024)
                          for f in (256, 1024, 4096) for n in (2, 4, 8, 16)},
        grid_barrier={str(b): 0.75 + b / 500 for b in sorted({8, 16, 32, 64, 128, sm_count}) if b <= sm_count},
        grid_exchange={str(f): 1.15 + f / 1450 for f in (256, 1024, 4096)},
    )


# ---- cells outside the registry ---------------------------------------------


def linear_cell(**changes):
    """A one-gate cell outside the registry (h_new = x_a + h_a unless changed):
    tests of code that must follow a spec's statements, not a known cell."""
    fields = dict(
        name="linear",
        gates=("a",),
        has_cell_state=False,
        stages=(("a",),),
        stage_operands=("h",),
        between_stages=(),
        pointwise=(("h_new", "x_a + h_a"),),
    )
    fields.update(changes)
    return cells.CellSpec(**fields)


def plan_path(module, path, monkeypatch):
    """Make ``module`` run ``path`` ("cudnn" or "fallback"), as the planner picks where that path measured
    fastest; "persistent" leaves the module's plans (the untuned fixture's: persistent where a kernel fits)."""
    from persistrnn import plan as planner

    if path != "persistent":
        shape = planner.shape_of(module)
        monkeypatch.setattr(module, "plan_for", lambda batch: planner.Plan(shape, batch, path, None, "tuned", "test"))
