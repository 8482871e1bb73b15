"""The non-persistent path (GEMM per stage + fused pointwise kernels, CUDA
graph): sm_90 builds of every cell and dtype, input checks and the product
layout on the CPU; agreement with the float64 reference on a GPU."""

import numpy as np
import pytest
from helpers import reference_forward, rel, rounded_layer, tolerance

from persistrnn import cells, fallback, persistent
from persistrnn.persistent import KernelConfig

CELL_NAMES = tuple(cells.CELLS)
CLIPPED_NAMES = ("lstm+clip=0.5", "gru+clip=0.5", "gru_reset_before+clip=0.5", "rnn_relu+clip=0.5",
                 "lstm+act=hardsigmoid(0.2,0.5)/tanh/leakyrelu(0.1)", "rnn_tanh+clip=0.5+act=affine(0.5,0.1)",
                 "lstm+clip=0.5+coupled", "lstm+act=sigmoid/elu(0.5)/softplus",
                 "gru_reset_before+act=sigmoid/thresholdedrelu(0.2)")
"""Cells with their gates clamped (ONNX clip, cells.with_clip; at 0.5 many of the tests' pre-activations
lie outside the bound), other activations (cells.with_activations) or coupled LSTM gates
(cells.with_coupled_gates)."""
DTYPES = persistent.DTYPES


# ---- source and sm_90 builds (CPU) -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELL_NAMES + CLIPPED_NAMES)
def test_pointwise_compiles_for_sm90_without_local_memory(cell, dtype):
    binary = fallback.compile_pointwise(cell, dtype, arch="sm_90")
    kernels = {fallback.POINTWISE_KERNEL}
    if cells.get_cell(cell).num_stages > 1:
        kernels.add(fallback.BETWEEN_KERNEL)
    assert set(binary.resources) == kernels
    for name in kernels:
        res = binary.kernel_resources(name)
        assert not res.uses_local_memory, (name, res)
        # A memory-bound kernel wants every thread slot: 65536 registers per SM
        # hold 2048 threads at 32 registers each.
        assert res.registers <= 32, (name, res)


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_pointwise_source_carries_the_cell_math(cell):
    spec = cells.get_cell(cell)
    src = fallback.pointwise_source(cell, "bfloat16")
    assert "#define PRNN_IO_T prnn_bf16" in src
    assert f"#define PRNN_G {spec.num_gates}" in src
    for statement in spec.pointwise + tuple(s for block in spec.between_stages for s in block):
        assert cells.render_cuda([statement]) in src, statement
    # One generator for both paths: the persistent kernel has the same text.
    generated = cells.render_pointwise_functions(spec)
    assert generated in src
    assert generated in persistent.render_source(KernelConfig(cell, 64, "single", 1))
    assert ("float prnn_between(" in src) == (spec.num_stages > 1)  # defined only for 2-stage cells


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_stage_products_land_where_the_kernels_read_them(cell):
    import torch

    spec = cells.get_cell(cell)
    H, B = 5, 3
    gen = torch.Generator().manual_seed(0)
    w_hh = torch.randn(spec.num_gates * H, H, generator=gen, dtype=torch.float64)
    h = torch.randn(B, H, generator=gen, dtype=torch.float64)
    hg = torch.full((B * spec.num_gates * H,), float("nan"), dtype=torch.float64)
    for rows, product in zip(fallback.stage_rows(cell, H), fallback.stage_products(cell, hg, B, H)):
        torch.mm(h, w_hh[rows].t(), out=product)
    full = h @ w_hh.t()
    seen = set()
    for g in range(spec.num_gates):
        for b in range(B):
            for j in range(H):
                k = fallback.hg_index(cell, g, b, j, H, B)
                seen.add(k)
                assert abs(hg[k] - full[b, g * H + j]) <= 1e-12 * abs(full[b, g * H + j]), (g, b, j)  # NaN fails
    assert seen == set(range(B * spec.num_gates * H))


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_generated_hg_index_agrees_with_hg_index(cell):
    # The kernels' prnn_hg_index is a chain "gate == g ? expr : ... : expr" of
    # int arithmetic, which Python evaluates the same way.
    src = fallback.pointwise_source(cell, "float32")
    body = src.split("int prnn_hg_index(int gate, int b, int j, int H, int B) {\n    return ", 1)[1].split(";", 1)[0]
    *chained, last = body.split(" : ")
    branches = {int(cond.split(" ? ")[0].removeprefix("gate == ")): cond.split(" ? ")[1] for cond in chained}
    G, H, B = cells.get_cell(cell).num_gates, 7, 3
    for g in range(G):
        expr = branches.get(g, last)
        for b in range(B):
            for j in range(H):
                assert eval(expr, {}, {"B": B, "H": H, "b": b, "j": j}) == fallback.hg_index(cell, g, b, j, H, B)


# ---- the host loop (CPU, with the kernels emulated) --------------------------


class _EmulatedKernels:
    """The two kernels' contract, run on CPU tensors from the CellSpec
    (float64 numpy), so the host loop can be checked without a GPU: which
    buffers each step reads and writes, at which offsets, in which order."""

    pointwise, between, launch = "pointwise", "between", None

    def __init__(self, spec, tensors):
        self.spec, self.tensors = spec, tensors

    def _view(self, ptr, numel):
        for t in self.tensors:
            flat = t.view(-1)
            offset, rest = divmod(int(ptr) - t.data_ptr(), t.element_size())
            if rest == 0 and 0 <= offset and offset + numel <= flat.numel():
                return flat[offset : offset + numel]
        raise AssertionError(f"pointer {int(ptr):#x} ({numel} elements) is in no buffer of the run")

    def __call__(self, kernel, config, *args):
        spec, G = self.spec, self.spec.num_gates
        H, B = int(args[-2]), int(args[-1])
        xw = self._view(args[0], B * G * H).view(B, G, H).double().numpy()
        hg = self._view(args[1], B * G * H).double().numpy()
        h = self._view(args[2], B * H)
        env = {"h": h.view(B, H).double().numpy()}
        for g, gate in enumerate(spec.gates):
            env[f"x_{gate}"] = xw[:, g]
            env[f"h_{gate}"] = np.array([[hg[fallback.hg_index(spec, g, b, j, H, B)] for j in range(H)]
                                         for b in range(B)])
        if kernel == "between":
            stage = int(args[4])
            env = cells.evaluate(spec.between_stages[stage], env)
            self._view(args[3], B * H).copy_(_flat_tensor(env[spec.stage_operands[stage + 1]]))
            return
        if spec.has_cell_state:  # c_{t-1} in, c_t out (the same buffer, or a saved position's)
            env["c"] = self._view(args[3], B * H).view(B, H).double().numpy()
        for block in spec.between_stages:
            env = cells.evaluate(block, env)
        env = cells.evaluate(spec.pointwise, env)
        h.copy_(_flat_tensor(env["h_new"]))
        self._view(args[5], B * H).copy_(_flat_tensor(env["h_new"]))
        if spec.has_cell_state:
            self._view(args[4], B * H).copy_(_flat_tensor(env["c_new"]))
        if int(args[6]):  # a training forward's saved products, (B, G*H)
            products = np.stack([env[f"h_{gate}"] for gate in spec.gates], axis=1)  # (B, G, H)
            self._view(args[6], B * G * H).copy_(_flat_tensor(products))


def _flat_tensor(a):  # numpy float64 -> flat torch tensor, for copy_ into a buffer of any dtype
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)


@pytest.mark.parametrize("cell", CELL_NAMES + CLIPPED_NAMES)
def test_step_loop_with_emulated_kernels_matches_reference(cell, monkeypatch):
    # fp32 only: torch's CPU build has no addmm with out_dtype.
    import torch

    spec = cells.get_cell(cell)
    H, B, T = 6, 3, 4
    t, x, h0, c0 = rounded_layer(cell, "float32", 5, H, B, T, np.random.default_rng(1), device="cpu")
    ref = reference_forward(cell, t, x, h0, c0)
    xw = persistent.input_projection(x, t["w_ih"], t["b_ih"])
    work = fallback._Work.allocate(spec, B, H, torch.float32, "cpu")
    out = torch.full((T, B, H), float("nan"))
    h_n = torch.full((B, H), float("nan"))
    c_n = torch.full((B, H), float("nan")) if spec.has_cell_state else None
    buffers = [b for b in (xw, work.h, work.c, work.hg, work.operand, out) if b is not None]
    kernels = _EmulatedKernels(spec, buffers)
    monkeypatch.setattr(fallback.runtime, "launch", kernels)
    fallback._run_steps(spec, kernels, xw, t["w_hh"], t["b_hh"], h0, c0 if spec.has_cell_state else None, work,
                        out, h_n, c_n)
    errors = _errors(spec, (out, h_n, c_n), ref)
    assert all(e <= tolerance("float32") for e in errors.values()), errors


@pytest.mark.parametrize("cell,reverse", [(cell, reverse) for cell in CELL_NAMES + CLIPPED_NAMES
                                          for reverse in (False, True)])
def test_step_loop_saving_gates_with_emulated_kernels_matches_the_training_forward(cell, reverse, monkeypatch):
    # What a training forward on the fallback keeps (every gate's recurrent product with b_hh, c per position)
    # against the torch-op training forward in float64, in both directions.
    import torch

    from persistrnn import training

    spec = cells.get_cell(cell)
    H, B, T = 6, 3, 4
    t, x, h0, c0 = rounded_layer(cell, "float32", 5, H, B, T, np.random.default_rng(2), device="cpu")
    c0 = c0 if spec.has_cell_state else None
    xw = persistent.input_projection(x, t["w_ih"], t["b_ih"])
    work = fallback._Work.allocate(spec, B, H, torch.float32, "cpu")
    out, gates = torch.full((T, B, H), float("nan")), torch.full((T, B, spec.num_gates * H), float("nan"))
    h_n = torch.full((B, H), float("nan"))
    c_n, cs = (torch.full((B, H), float("nan")), torch.full((T, B, H), float("nan"))) if c0 is not None else (None,
                                                                                                               None)
    buffers = [b for b in (xw, work.h, work.c, work.hg, work.operand, out, gates, cs) if b is not None]
    monkeypatch.setattr(fallback.runtime, "launch", _EmulatedKernels(spec, buffers))
    fallback._run_steps(spec, _EmulatedKernels(spec, buffers), xw, t["w_hh"], t["b_hh"], h0, c0, work, out, h_n, c_n,
                        reverse, gates, cs)
    want = training.direction_forward(spec, xw.double(), t["w_hh"].double(), t["b_hh"].double(), h0.double(),
                                      None if c0 is None else c0.double(), reverse)
    for name, got, expected in zip(("out", "gates", "c", "h_n", "c_n"), (out, gates, cs, h_n, c_n), want):
        if expected is not None:
            assert rel(got.double().numpy(), expected.numpy()) <= tolerance("float32"), name


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_forward_model_runs_reverse_directions_from_the_last_position(cell, monkeypatch):
    # A 2-layer bidirectional model through forward_model's wiring (directions, concatenation, final states),
    # each direction's projection and recurrence in float64 torch ops, against the float64 reference model.
    import torch

    from persistrnn import reference, training

    spec = cells.get_cell(cell)
    H, B, T, I = 5, 3, 4, 6
    rng = np.random.default_rng(3)

    def direction(spec, xw, w_hh, b_hh, h0, c0, *, reverse=False):
        out, _, _, h, c = training.direction_forward(spec, xw, w_hh, b_hh, h0, c0, reverse)
        return out, h, c

    monkeypatch.setattr(fallback, "run_fallback", direction)
    monkeypatch.setattr(persistent, "input_projection", lambda x, w_ih, b_ih: x @ w_ih.T + b_ih)  # fp32-only on CPU
    G = spec.num_gates
    shapes = [{"w_ih": (G * H, I if l == 0 else 2 * H), "w_hh": (G * H, H), "b_ih": (G * H,), "b_hh": (G * H,)}
              for l in range(2)]
    params = [[{k: rng.standard_normal(s) * 0.5 for k, s in shapes[l].items()} for _ in range(2)] for l in range(2)]
    x, h0, c0 = rng.standard_normal((T, B, I)), rng.standard_normal((4, B, H)), rng.standard_normal((4, B, H))
    layers = [[{k: torch.from_numpy(v) for k, v in p.items()} for p in directions] for directions in params]
    out, h_n, c_n = fallback.forward_model(spec, layers, torch.from_numpy(x), torch.from_numpy(h0),
                                           torch.from_numpy(c0) if spec.has_cell_state else None)
    hx = (h0, c0) if spec.has_cell_state else h0
    want_out, want_state = reference.rnn_forward(cell, x, params, num_layers=2, bidirectional=True, hx=hx)
    want_h, want_c = want_state if spec.has_cell_state else (want_state, None)
    assert rel(out.numpy(), want_out) <= 1e-12
    assert rel(h_n.numpy(), want_h) <= 1e-12
    if spec.has_cell_state:
        assert rel(c_n.numpy(), want_c) <= 1e-12


def test_pointwise_source_rejects_unknown_dtype_and_cell():
    with pytest.raises(ValueError, match=r"dtype: expected one of \('float32', 'float16', 'bfloat16'\), got 'float64'"):
        fallback.pointwise_source("lstm", "float64")
    with pytest.raises(ValueError, match="cell: expected one of"):
        fallback.pointwise_source("lstm2", "float32")


# ---- input checks (CPU: they run before anything touches a GPU) -------------


def _cpu_layer(cell="lstm", H=8, B=2, T=3, dtype="float32"):
    import torch

    spec = cells.get_cell(cell)
    dt = getattr(torch, dtype)
    G = spec.num_gates
    xw = torch.randn(T, B, G * H)
    w = torch.randn(G * H, H).to(dt)
    b = torch.randn(G * H).to(dt)
    h0 = torch.randn(B, H).to(dt)
    c0 = torch.randn(B, H).to(dt) if spec.has_cell_state else None
    return xw, w, b, h0, c0


def test_cpu_tensors_are_refused_naming_cuda():
    xw, w, b, h0, c0 = _cpu_layer()
    with pytest.raises(ValueError, match="xw: expected a CUDA tensor, got one on cpu"):
        fallback.run_fallback("lstm", xw, w, b, h0, c0)
    with pytest.raises(ValueError, match="xw: expected a CUDA tensor, got one on cpu"):
        fallback.run_fallback("gru", *_cpu_layer("gru", dtype="bfloat16"))


def test_wrong_dtypes_raise_type_errors():
    xw, w, b, h0, c0 = _cpu_layer()
    with pytest.raises(TypeError, match="w_hh: expected the layer's dtype, one of torch.float32, torch.float16, "
                                        "torch.bfloat16, got torch.float64"):
        fallback.run_fallback("lstm", xw, w.double(), b, h0, c0)
    with pytest.raises(TypeError, match="xw: expected dtype torch.float32, got torch.float16"):
        fallback.run_fallback("lstm", xw.half(), w, b, h0, c0)
    with pytest.raises(TypeError, match="w_hh: expected a torch.Tensor, got ndarray"):
        fallback.run_fallback("lstm", xw, w.numpy(), b, h0, c0)
    with pytest.raises(TypeError, match="cell: expected a str or CellSpec, got int"):
        fallback.run_fallback(4, xw, w, b, h0, c0)


def test_wrong_shapes_and_states_raise_value_errors():
    xw, w, b, h0, c0 = _cpu_layer()
    with pytest.raises(ValueError, match=r"w_hh: expected shape \(4 \* H, H\) for cell lstm, got \(8, 32\)"):
        fallback.run_fallback("lstm", xw, w.t(), b, h0, c0)
    with pytest.raises(ValueError, match=r"xw: expected a 3-D tensor \(T, B, 32\), got \(6, 32\)"):
        fallback.run_fallback("lstm", xw.view(6, 32), w, b, h0, c0)
    with pytest.raises(ValueError, match=r"lstm carries a cell state: expected c0 of shape \(2, 8\), got None"):
        fallback.run_fallback("lstm", xw, w, b, h0, None)
    gxw, gw, gb, gh0, _ = _cpu_layer("gru")
    with pytest.raises(ValueError, match="gru has no cell state: expected c0=None, got a tensor"):
        fallback.run_fallback("gru", gxw, gw, gb, gh0, gh0)
    with pytest.raises(ValueError, match="gru has no cell state: expected c_n=None, got a tensor"):
        fallback.run_fallback("gru", gxw, gw, gb, gh0, None, c_n=gh0)
    with pytest.raises(ValueError, match="cell: expected one of"):
        fallback.run_fallback("lstm2", xw, w, b, h0, c0)


# ---- GPU: agreement with the float64 reference -------------------------------


def _poisoned(spec, steps, batch, hidden, dtype):
    import torch

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")

    return nan(steps, batch, hidden), nan(batch, hidden), nan(batch, hidden) if spec.has_cell_state else None


def _errors(spec, result, ref):
    out, h_n, c_n = result
    errors = {"output": rel(out.double().cpu().numpy(), ref[0]), "h_n": rel(h_n.double().cpu().numpy(), ref[1])}
    if spec.has_cell_state:
        errors["c_n"] = rel(c_n.double().cpu().numpy(), ref[2])
    else:
        assert c_n is None
    return errors


def check_fallback(cell, dtype, hidden, batch, steps, seed, *, input_size=None):
    """Relative errors of one run_fallback (into NaN-poisoned destinations)
    against the float64 reference on the same rounded parameters."""
    rng = np.random.default_rng(seed)
    spec = cells.get_cell(cell)
    t, x, h0, c0 = rounded_layer(cell, dtype, input_size or hidden, hidden, batch, steps, rng)
    ref = reference_forward(cell, t, x, h0, c0)
    out, h_n, c_n = _poisoned(spec, steps, batch, hidden, dtype)
    xw = persistent.input_projection(x, t["w_ih"], t["b_ih"])
    result = fallback.run_fallback(cell, xw, t["w_hh"], t["b_hh"], h0, c0 if spec.has_cell_state else None,
                                   out=out, h_n=h_n, c_n=c_n)
    assert result[0] is out and result[1] is h_n and result[2] is c_n
    return _errors(spec, result, ref)


# Odd sizes (37 units, 3 sequences: no block or warp is full) and the
# smallest sequence at a round size; every cell x dtype.
SIZES = [(37, 3, 7), (256, 1, 1)]
GPU_CASES = [(cell, dtype, *size) for cell in CELL_NAMES for dtype in DTYPES for size in SIZES]
GPU_CASES += [(cell, "float32", *SIZES[0]) for cell in CLIPPED_NAMES]


@pytest.mark.gpu
@pytest.mark.parametrize("cell, dtype, hidden, batch, steps", GPU_CASES,
                         ids=[f"{c}-{d}-H{h}-B{b}-T{t}" for c, d, h, b, t in GPU_CASES])
def test_fallback_matches_float64_reference(cell, dtype, hidden, batch, steps):
    # A fresh seed per run (str hashes are salted per process); printed on failure.
    seed = hash((cell, dtype, hidden, batch, steps)) % 2**32
    errors = check_fallback(cell, dtype, hidden, batch, steps, seed)
    assert all(e <= tolerance(dtype) for e in errors.values()), (seed, errors)


@pytest.mark.gpu
def test_lstm_whose_weights_do_not_fit_on_chip():
    # fp32 LSTM, H=4096: 256 MB of W_hh, which default_config refuses for the
    # persistent kernel (test_persistent); this path is what runs it.
    seed = hash("lstm-4096") % 2**32
    errors = check_fallback("lstm", "float32", 4096, 2, 3, seed, input_size=64)
    assert all(e <= tolerance("float32") for e in errors.values()), (seed, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELL_NAMES)
def test_captured_replay_gives_the_answer_of_the_new_inputs_and_weights(cell, dtype):
    from persistrnn import runtime

    seed = hash((cell, dtype, "replay")) % 2**32
    rng = np.random.default_rng(seed)
    spec = cells.get_cell(cell)
    H, B, T = 37, 3, 7
    t, x1, h1, c1 = rounded_layer(cell, dtype, H, H, B, T, rng)
    _, x2, h2, c2 = rounded_layer(cell, dtype, H, H, B, T, rng)  # new inputs for the same weights

    def layer(x, h0, c0):
        out, h_n, c_n = fallback.fallback_forward_layer(cell, x, t["w_ih"], t["w_hh"], t["b_ih"], t["b_hh"], h0, c0)
        return (out, h_n, c_n) if spec.has_cell_state else (out, h_n)

    captured = runtime.CapturedCall(layer, (x1, h1, c1 if spec.has_cell_state else None))

    def run(x, h0, c0):
        result = captured(x, h0, c0 if spec.has_cell_state else None)
        return result[0], result[1], (result[2] if spec.has_cell_state else None)

    first = run(x1, h1, c1)
    second = run(x2, h2, c2)
    tol = tolerance(dtype)
    errors = _errors(spec, second, reference_forward(cell, t, x2, h2, c2))
    assert all(e <= tol for e in errors.values()), ("second call", seed, errors)
    # The first call's tensors are the caller's: the replay did not overwrite them.
    errors = _errors(spec, first, reference_forward(cell, t, x1, h1, c1))
    assert all(e <= tol for e in errors.values()), ("first call", seed, errors)

    # The graph reads W_hh and b_hh where they live: an in-place update is seen.
    new, *_ = rounded_layer(cell, dtype, H, H, B, T, rng)
    t["w_hh"].copy_(new["w_hh"])
    t["b_hh"].copy_(new["b_hh"])
    third = run(x2, h2, c2)
    errors = _errors(spec, third, reference_forward(cell, t, x2, h2, c2))
    assert all(e <= tol for e in errors.values()), ("updated weights", seed, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_inside_a_callers_capture_the_loop_joins_the_callers_graph(cell):
    import torch

    seed = hash((cell, "capture")) % 2**32
    rng = np.random.default_rng(seed)
    spec = cells.get_cell(cell)
    H, B, T = 37, 3, 7
    t, x, h0, c0 = rounded_layer(cell, "float32", H, H, B, T, rng)
    _, x2, h2, c2 = rounded_layer(cell, "float32", H, H, B, T, rng)
    c0 = c0 if spec.has_cell_state else None
    xw = persistent.input_projection(x, t["w_ih"], t["b_ih"])
    fallback.run_fallback(cell, xw, t["w_hh"], t["b_hh"], h0, c0)  # compile and load outside the capture

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fallback.run_fallback(cell, xw, t["w_hh"], t["b_hh"], h0, c0)

    xw.copy_(persistent.input_projection(x2, t["w_ih"], t["b_ih"]))
    h0.copy_(h2)
    if c0 is not None:
        c0.copy_(c2)
    graph.replay()
    torch.cuda.synchronize()
    errors = _errors(spec, result, reference_forward(cell, t, x2, h2, c2))
    assert all(e <= tolerance("float32") for e in errors.values()), (seed, errors)


@pytest.mark.parametrize("run", ["fallback", "persistent"])
def test_both_paths_check_a_recurrence_with_the_same_rule(run):
    """run_fallback and persistent.run_recurrence share checks.check_recurrence: the same errors, in the same
    order, before either touches a GPU (CPU tensors reach the device check last)."""
    from persistrnn import persistent

    def call(cell, xw, w, b, h0, c0):
        if run == "fallback":
            return fallback.run_fallback(cell, xw, w, b, h0, c0)
        return persistent.run_recurrence(persistent.KernelConfig(cell, 8, "single", 1), xw, w, b, h0, c0)

    xw, w, b, h0, c0 = _cpu_layer()
    with pytest.raises(ValueError, match=r"xw: expected a 3-D tensor \(T, B, 32\), got \(6, 32\)"):
        call("lstm", xw.view(6, 32), w, b, h0, c0)
    with pytest.raises(ValueError, match=r"lstm carries a cell state: expected c0 of shape \(2, 8\), got None"):
        call("lstm", xw, w, b, h0, None)
    gxw, gw, gb, gh0, _ = _cpu_layer("gru")
    with pytest.raises(ValueError, match="gru has no cell state: expected c0=None, got a tensor"):
        call("gru", gxw, gw, gb, gh0, gh0)
    with pytest.raises(ValueError, match="xw: expected a CUDA tensor, got one on cpu"):
        call("lstm", xw, w, b, h0, c0)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_check_recurrence_returns_steps_and_batch_of_a_well_formed_layer(monkeypatch, cell):
    from functools import partial

    from persistrnn import checks

    monkeypatch.setattr(checks, "check_tensor", partial(checks.check_tensor, cuda=False))  # CPU tensors stand in
    xw, w, b, h0, c0 = _cpu_layer(cell, H=8, B=2, T=3)
    assert checks.check_recurrence(cells.get_cell(cell), xw, w, b, h0, c0, 8, w.dtype) == (3, 2)
    with pytest.raises(ValueError, match=r"xw: expected shape \(3, 2, \d+\), got \(3, 2, \d+\)"):  # H is the one given
        checks.check_recurrence(cells.get_cell(cell), xw, w, b, h0, c0, 9, w.dtype)
