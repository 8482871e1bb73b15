"""Training: the backward's math against float64 autograd of the reference
and finite differences (CPU), the save_gates kernel variant (sm_90 builds on
the CPU), the captured backward's key and dispatch, and on a GPU the kernels'
gradients against float64 and cuDNN, their determinism, and the captured
backward against the launches it replays."""

import ast
import ctypes
import dataclasses
import random
import re
import types

import numpy as np
import pytest
import torch
from helpers import assert_close_to_reference, exact_torch, on_own_streams

from persistrnn import adjoint, cells, persistent, reference, runtime, training
from persistrnn.errors import ArgumentError, UnsupportedError
from persistrnn.nn import torch_forward
from persistrnn.training import TORCH_FUNCTIONS
from persistrnn.training import _time_training_steps as time_training_steps  # before the fixture replaces it

CELL_NAMES = tuple(cells.CELLS)


def random_model(cell, input_size, hidden, num_layers, bidirectional, has_biases, steps, batch, *,
                 dtype=torch.float64, device="cpu", seed=0):
    """torch's flat weight list (uniform in ±1/sqrt(H), as torch initialises),
    x and initial states of standard-normal scale (h0, c0 halved), all leaves
    that require grad."""
    spec = cells.get_cell(cell)
    gen = torch.Generator().manual_seed(seed)
    directions = 2 if bidirectional else 1
    bound = hidden ** -0.5
    weights = []
    for layer in range(num_layers):
        layer_input = input_size if layer == 0 else directions * hidden
        for _ in range(directions):
            shapes = [(spec.num_gates * hidden, layer_input), (spec.num_gates * hidden, hidden)]
            shapes += [(spec.num_gates * hidden,)] * (2 if has_biases else 0)
            weights += [(torch.rand(s, generator=gen, dtype=torch.float64) * 2 - 1) * bound for s in shapes]
    x = torch.randn(steps, batch, input_size, generator=gen, dtype=torch.float64)
    h0 = torch.randn(num_layers * directions, batch, hidden, generator=gen, dtype=torch.float64) * 0.5
    c0 = torch.randn(h0.shape, generator=gen, dtype=torch.float64) * 0.5 if spec.has_cell_state else None

    def leaf(t):
        return None if t is None else t.to(device=device, dtype=dtype).requires_grad_()

    return leaf(x), leaf(h0), leaf(c0), [leaf(w) for w in weights]


def reference_autograd(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases):
    """torch autograd through the reference's step (the cell spec's statements
    on tensors, persistrnn.nn.torch_forward): (out, h_n, c_n or None)."""
    spec = cells.get_cell(cell)
    model = types.SimpleNamespace(num_layers=num_layers, bidirectional=bidirectional, bias=has_biases,
                                  _flat_weights=weights, training=False, dropout=0.0)
    out, state = torch_forward(spec, model, x, (h0, c0) if spec.has_cell_state else h0)
    return (out, *state) if spec.has_cell_state else (out, state, None)


def ours(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases):
    return training.train_step(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, [])


def loss_of(result, seed=1):
    """A loss that weighs every output element and both final states
    differently (a plain sum would hide transposed or swapped gradients)."""
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for t in result:
        if t is not None:
            total = total + (t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)).sum()
    return total


def gradients(fn, cell, x, h0, c0, weights, *options):
    leaves = [t for t in (x, h0, c0, *weights) if t is not None]
    return torch.autograd.grad(loss_of(fn(cell, x, h0, c0, weights, *options)), leaves)


# ---- the cell, differentiated from its spec ------------------------------------


ACTIVATED_NAMES = ("lstm+act=hardsigmoid(0.2,0.5)/tanh/leakyrelu(0.1)",
                   "gru_reset_before+clip=0.5+act=hardsigmoid(0.2,0.5)/scaledtanh(2.0,0.5)",
                   "gru+act=sigmoid/leakyrelu(0.01)", "rnn_tanh+act=affine(0.5,0.1)", "lstm+coupled",
                   "gru+act=softsign/softsign", "lstm+act=sigmoid/elu(0.5)/softplus",
                   "gru_reset_before+act=sigmoid/thresholdedrelu(0.2)")
"""Cells with other activations (ONNX activations; cells.with_activations), one with a clip inside them, and
the LSTM with its forget gate coupled to its input gate (ONNX input_forget; cells.with_coupled_gates)."""
CLIPPED_NAMES = tuple(f"{name}+clip=0.5" for name in CELL_NAMES)
"""Every cell with its gates clamped (ONNX clip; cells.with_clip): at 0.5 most of the random pre-activations
below lie outside the bound, so both sides of hardtanh's derivative are taken."""


@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("cell", CELL_NAMES + CLIPPED_NAMES + ACTIVATED_NAMES)
def test_step_backward_equals_autograd_of_the_cell_step(cell, lengths):
    # The generated statements evaluated with torch in float64 (random
    # inputs, never zeros; odd sizes), against autograd of the spec's step:
    # every input's gradient, the weights' through d gates and the operands.
    # With lengths, rows past their length (step_runs 0) pass dh and dc
    # through and give their gates zero gradient.
    spec = cells.with_lengths(cell) if lengths else cells.get_cell(cell)
    gen = torch.Generator().manual_seed(3)
    B, H = 5, 3
    xg, h, w, b = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
                   for s in ((B, spec.num_gates * H), (B, H), (spec.num_gates * H, H), (spec.num_gates * H,)))
    c = torch.randn(B, H, generator=gen, dtype=torch.float64, requires_grad=True) if spec.has_cell_state else None
    runs = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64) if lengths else None
    stage_rows = [training._stage_rows(spec, j, H) for j in range(spec.num_stages)]
    env, products = training._run_cell(spec, xg, h, c, lambda j, operand: operand @ w[stage_rows[j]].T +
                                       b[stage_rows[j]], runs)
    dh, dc = torch.randn(B, H, generator=gen, dtype=torch.float64), torch.randn(B, H, generator=gen,
                                                                                  dtype=torch.float64)
    outputs, grads = [env["h_new"]], [dh]
    if c is not None:
        outputs.append(env["c_new"])
        grads.append(dc)
    leaves = [xg, h, w, b] + ([c] if c is not None else [])
    want = dict(zip(["xg", "h", "w", "b", "c"], torch.autograd.grad(outputs, leaves, grads)))
    with torch.no_grad():  # the recurrent products the forward keeps, as the kernel writes them
        d_xg, d_gates, dh_prev, dc_prev, operands = training.step_backward(
            spec, xg, torch.cat(products, 1), h, c, [w[rows] for rows in stage_rows], dh,
            dc if c is not None else None, runs)
    got = {"xg": d_xg, "h": dh_prev, "b": d_gates.sum(0), "c": dc_prev,
           "w": torch.cat([d_gates[:, rows].T @ operand for rows, operand in zip(stage_rows, operands)])}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    if lengths:
        held = runs == 0
        assert torch.equal(d_xg[held], torch.zeros_like(d_xg[held])) and torch.equal(dh_prev[held], dh[held])


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_backward_statements_are_one_straight_line_program(cell):
    # Each adjoint assigned once, each read defined before it (a forward
    # input, a seed, a statement of this or an earlier block, or the matrix
    # product after one): the blocks' statements concatenated in walk order
    # are one valid program.
    program = adjoint.step_backward_program(cell)
    spec = program.spec
    defined = {"h", "c", "prnn_d0_h_new", "prnn_d0_c_new"} | {f"{k}_{g}" for k in "xh" for g in spec.gates}
    assigned = set()
    for block in program.blocks:
        assert {adjoint_name for _, adjoint_name in block.adjoints_in} <= defined, block
        for name, expr in block.statements:
            tree = ast.parse(expr, mode="eval")
            reads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - set(adjoint.FUNCTIONS)
            assert reads <= defined, (name, expr)
            # the forward is recomputed per block; the adjoints are assigned once in the whole step
            assert name not in assigned or not name.startswith("prnn_d"), name
            assigned.add(name)
            defined.add(name)
        assert {a for _, a in block.adjoints_out if a} <= defined, block
        defined.add(block.through_w)


# ---- the operators in float64 on the CPU ---------------------------------------

# Finite differences cost two forwards per input element: sizes of a few
# units (odd, and input != hidden) keep all five cells under seconds.
GRADCHECK_CASES = [
    (cell, layers, bidirectional, bias)
    for cell in CELL_NAMES
    for layers, bidirectional, bias in ((1, False, True), (2, True, True), (2, False, False))
]


@pytest.mark.parametrize("cell,num_layers,bidirectional,has_biases", GRADCHECK_CASES)
def test_gradcheck_of_the_training_operators(cell, num_layers, bidirectional, has_biases):
    x, h0, c0, weights = random_model(cell, 2, 3, num_layers, bidirectional, has_biases, steps=3, batch=2, seed=5)
    leaves = [t for t in (x, h0, c0, *weights) if t is not None]
    has_c = c0 is not None

    def fn(*leaves):
        x, h0, c0 = leaves[0], leaves[1], leaves[2] if has_c else None
        ws = list(leaves[3 if has_c else 2:])
        return ours(cell, x, h0, c0, ws, num_layers, bidirectional, has_biases)[:3 if has_c else 2]

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-6)


def _cpu_matrix(n, seed, cell_names=CELL_NAMES):
    rng = random.Random(seed)
    for cell in cell_names:
        for _ in range(n):
            yield (cell, rng.choice([1, 4, 7]), rng.choice([1, 5, 11]), rng.choice([1, 2, 3]), rng.random() < 0.5,
                   rng.random() < 0.8, rng.choice([1, 2, 6]), rng.choice([1, 3]))


@pytest.mark.parametrize("cell,input_size,hidden,num_layers,bidirectional,has_biases,steps,batch",
                         list(_cpu_matrix(3, seed=16))
                         + list(_cpu_matrix(1, seed=17, cell_names=CLIPPED_NAMES + ACTIVATED_NAMES)))
def test_gradients_equal_float64_autograd_of_the_reference(cell, input_size, hidden, num_layers, bidirectional,
                                                           has_biases, steps, batch):
    options = (num_layers, bidirectional, has_biases)
    x, h0, c0, weights = random_model(cell, input_size, hidden, *options, steps, batch, seed=hidden + steps)
    mine = ours(cell, x, h0, c0, weights, *options)
    want = reference_autograd(cell, x, h0, c0, weights, *options)
    for got, expected in zip(mine, want):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    got = gradients(ours, cell, x, h0, c0, weights, *options)
    expected = gradients(reference_autograd, cell, x, h0, c0, weights, *options)
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_forward_equals_the_numpy_reference(cell):
    x, h0, c0, weights = random_model(cell, 4, 6, 2, True, True, steps=5, batch=3, seed=2)
    out, h_n, c_n = ours(cell, x, h0, c0, weights, 2, True, True)
    names = ("w_ih", "w_hh", "b_ih", "b_hh")
    params = [[{n: weights[(layer * 2 + d) * 4 + k].detach().numpy() for k, n in enumerate(names)}
               for d in range(2)] for layer in range(2)]
    hx = (h0.detach().numpy(), c0.detach().numpy()) if c0 is not None else h0.detach().numpy()
    want_out, want_state = reference.rnn_forward(cell, x.detach().numpy(), params, num_layers=2, bidirectional=True,
                                                 hx=hx)
    np.testing.assert_allclose(out.detach().numpy(), want_out, rtol=1e-12, atol=1e-12)
    want_h = want_state[0] if c0 is not None else want_state
    np.testing.assert_allclose(h_n.detach().numpy(), want_h, rtol=1e-12, atol=1e-12)


def layered_reference(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases, masks):
    """:func:`reference_autograd` one layer at a time, each layer's output
    but the last multiplied by its dropout mask before the next reads it."""
    directions = 2 if bidirectional else 1
    per = directions * (4 if has_biases else 2)
    layer_input, h_n, c_n = x, [], []
    for layer in range(num_layers):
        rows = slice(layer * directions, (layer + 1) * directions)
        out, h, c = reference_autograd(cell, layer_input, h0[rows], None if c0 is None else c0[rows],
                                       weights[layer * per:(layer + 1) * per], 1, bidirectional, has_biases)
        h_n.append(h)
        c_n.append(c)
        layer_input = out * masks[layer] if layer < num_layers - 1 else out
    return layer_input, torch.cat(h_n), (torch.cat(c_n) if c0 is not None else None)


def ours_with_masks(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases, masks):
    return training.train_step(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, masks)


@pytest.mark.parametrize("cell,bidirectional", [("lstm", True), ("gru", False), ("rnn_tanh", True),
                                                ("gru_reset_before", False)])
def test_dropout_between_layers_equals_the_layer_by_layer_reference(cell, bidirectional):
    x, h0, c0, weights = random_model(cell, 7, 5, 3, bidirectional, True, steps=6, batch=3, seed=4)
    torch.manual_seed(12)
    masks = training.dropout_masks(0.4, 3, (6, 3, (2 if bidirectional else 1) * 5), x)
    assert len(masks) == 2 and all(set(m.unique().tolist()) == {0.0, 1 / 0.6} for m in masks)

    def with_masks(fn):
        return lambda *args: fn(*args, masks)

    options = (3, bidirectional, True)
    got = ours_with_masks(cell, x, h0, c0, weights, *options, masks)
    want = layered_reference(cell, x, h0, c0, weights, *options, masks)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(gradients(with_masks(ours_with_masks), cell, x, h0, c0, weights, *options),
                    gradients(with_masks(layered_reference), cell, x, h0, c0, weights, *options)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Without masks the same call is the model with no dropout: the masks changed the result.
    plain = ours_with_masks(cell, x, h0, c0, weights, *options, [])
    assert not torch.allclose(plain[0], got[0])


# ---- variable lengths (packed sequences) ------------------------------------------------


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_a_cell_with_lengths_steps_where_it_runs_and_holds_where_not(cell):
    spec, held = cells.get_cell(cell), cells.with_lengths(cell)
    gen = torch.Generator().manual_seed(4)
    B, H = 4, 3
    env = {"h": torch.randn(B, H, generator=gen, dtype=torch.float64),
           **{f"{k}_{g}": torch.randn(B, H, generator=gen, dtype=torch.float64) for k in "xh" for g in spec.gates}}
    if spec.has_cell_state:
        env["c"] = torch.randn(B, H, generator=gen, dtype=torch.float64)
    for block in spec.between_stages:
        env = cells.evaluate(block, env, TORCH_FUNCTIONS)
    runs = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)[:, None]
    want = cells.evaluate(spec.pointwise, env, TORCH_FUNCTIONS)
    got = cells.evaluate(held.pointwise, {**env, cells.STEP_RUNS: runs}, TORCH_FUNCTIONS)
    for name, state in zip(spec.outputs, ("h", "c")):
        expected = torch.where(runs != 0, want[name], env[state])
        assert torch.equal(got[name], expected), name  # exactly: the step, or the held state
    assert cells.with_lengths(held) is held and held.lengths and not spec.lengths


def ours_with_lengths(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases, lengths):
    return training.train_step(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, [], lengths)


def each_sequence_alone(cell, x, h0, c0, weights, num_layers, bidirectional, has_biases, lengths):
    """The padded batch's results made from each sequence run alone on its own
    steps (no lengths, no padding): outputs zero past a length, as torch's
    packed sequences pad."""
    outs, hs, cs = [], [], []
    for b, length in enumerate(lengths.tolist()):
        out, h_n, c_n = ours(cell, x[:length, b:b + 1], h0[:, b:b + 1], None if c0 is None else c0[:, b:b + 1],
                             weights, num_layers, bidirectional, has_biases)
        outs.append(torch.cat([out, out.new_zeros(x.shape[0] - length, *out.shape[1:])]))
        hs.append(h_n)
        cs.append(c_n)
    return torch.cat(outs, 1), torch.cat(hs, 1), (torch.cat(cs, 1) if c0 is not None else None)


PACKED_CASES = [(cell, layers, bidirectional, bias) for cell in CELL_NAMES
                for layers, bidirectional, bias in ((1, False, True), (2, True, True), (2, False, False))]


@pytest.mark.parametrize("cell,num_layers,bidirectional,has_biases", PACKED_CASES)
def test_lengths_give_each_sequence_run_alone(cell, num_layers, bidirectional, has_biases):
    # A reference with no masking in it: the same sequences one by one on
    # their own steps. Outputs, final states and every gradient (the loss of
    # the batch is the sum of the sequences' losses).
    steps, batch = 7, 5
    options = (num_layers, bidirectional, has_biases)
    x, h0, c0, weights = random_model(cell, 3, 4, *options, steps, batch, seed=steps + num_layers)
    lengths = torch.tensor([7, 2, 5, 7, 1], dtype=torch.int32)
    mine = ours_with_lengths(cell, x, h0, c0, weights, *options, lengths)
    want = each_sequence_alone(cell, x, h0, c0, weights, *options, lengths)
    for got, expected in zip(mine, want):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    got = gradients(ours_with_lengths, cell, x, h0, c0, weights, *options, lengths)
    expected = gradients(each_sequence_alone, cell, x, h0, c0, weights, *options, lengths)
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, i=i: f"gradient {i}: {m}")


TORCH_MODULES = {"lstm": ("LSTM", {}), "gru": ("GRU", {}), "rnn_tanh": ("RNN", {"nonlinearity": "tanh"}),
                 "rnn_relu": ("RNN", {"nonlinearity": "relu"})}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("cell", sorted(TORCH_MODULES))
def test_lengths_give_torchs_packed_sequence_results(cell, bidirectional):
    # torch's own module on a PackedSequence (unsorted, float64, CPU): outputs, states and gradients.
    kind, kwargs = TORCH_MODULES[cell]
    torch.manual_seed(12)
    steps, batch, num_layers = 6, 4, 2
    module = getattr(torch.nn, kind)(3, 5, num_layers, bidirectional=bidirectional, **kwargs).double()
    x, h0, c0, _ = random_model(cell, 3, 5, num_layers, bidirectional, True, steps, batch, seed=2)
    lengths = torch.tensor([3, 6, 1, 4])
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, state = module(packed, (h0, c0) if c0 is not None else h0)
    out = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=steps)[0]
    theirs = (out, *state) if c0 is not None else (out, state, None)
    weights = list(module._flat_weights)
    mine = ours_with_lengths(cell, x, h0, c0, weights, num_layers, bidirectional, True, lengths.to(torch.int32))
    leaves = [t for t in (x, h0, c0, *weights) if t is not None]
    for got, expected in zip(mine, theirs):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(loss_of(mine), leaves),
                                   torch.autograd.grad(loss_of(theirs), leaves))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("lengths, error, message", [
    (torch.tensor([3.0, 1.0]), TypeError, "lengths: expected a torch.int64 or torch.int32 tensor, got torch.float32"),
    (torch.tensor([3, 1, 2], dtype=torch.int32), ValueError, r"lengths: expected shape \(2,\), got \(3,\)"),
    (torch.tensor([4, 1], dtype=torch.int32), ValueError, r"expected every length in 1\.\.3"),
    (torch.tensor([3, 0], dtype=torch.int32), ValueError, r"expected every length in 1\.\.3"),
])
def test_lengths_are_checked(lengths, error, message):
    x, h0, c0, weights = random_model("gru", 2, 3, 1, False, True, steps=3, batch=2)
    with pytest.raises(error, match=message):
        ours_with_lengths("gru", x, h0, c0, weights, 1, False, True, lengths)


# ---- persistrnn's training step or cuDNN's ----------------------------------------------


def choice_module(cell="lstm"):
    return types.SimpleNamespace(cell=cell, input_size=16, hidden_size=32, num_layers=2, bidirectional=True,
                                 bias=True)


def cuda_like(steps, batch):
    """What cudnn_trains_faster reads of a CUDA input, without a GPU."""
    return types.SimpleNamespace(shape=(steps, batch, 16), dtype=torch.float32, is_cuda=True,
                                 device=types.SimpleNamespace(index=0))


def test_cudnn_trains_where_it_measured_faster_timed_once_per_shape(monkeypatch):
    timed = []

    def timing(module, x):
        timed.append(tuple(x.shape))
        return (2.0, 1.0) if x.shape[1] == 32 else (1.0, 2.0)  # cuDNN faster at batch 32 only

    monkeypatch.setattr(training, "_time_training_steps", timing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    module = choice_module()
    assert training.cudnn_trains_faster(module, cuda_like(100, 32))
    assert not training.cudnn_trains_faster(module, cuda_like(100, 8))
    assert training.cudnn_trains_faster(module, cuda_like(90, 32))  # T=90 and 100: one power-of-two bucket
    assert not training.cudnn_trains_faster(module, cuda_like(100, 8))
    assert timed == [(100, 32, 16), (100, 8, 16)]
    assert not training.cudnn_trains_faster(module, types.SimpleNamespace(is_cuda=False))  # the CPU: ours


@pytest.mark.parametrize("why", ["deterministic", "no cuDNN cell", "cuDNN off"])
def test_cudnn_never_trains_where_persistrnn_must(why, monkeypatch):
    monkeypatch.setattr(training, "_time_training_steps", lambda module, x: (2.0, 1.0))  # cuDNN faster
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    module = choice_module("gru_reset_before" if why == "no cuDNN cell" else "lstm")
    with torch.backends.cudnn.flags(enabled=why != "cuDNN off"):
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(why == "deterministic")
        try:
            assert not training.cudnn_trains_faster(module, cuda_like(100, 32))
        finally:
            torch.use_deterministic_algorithms(previous)


def test_a_timing_that_spans_a_plan_change_keeps_no_choice(monkeypatch):
    # Our side was timed on the plans before the change: its choice holds for this call only.
    from persistrnn import plan as planner

    timed = []

    def timing(module, x):
        timed.append(tuple(x.shape))
        if len(timed) == 1:
            planner.clear_cached_plans()  # another thread retunes while this one times
        return 2.0, 1.0

    monkeypatch.setattr(training, "_time_training_steps", timing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    module = choice_module()
    assert training.cudnn_trains_faster(module, cuda_like(100, 32))
    assert not training._TRAINING_CHOICES
    assert training.cudnn_trains_faster(module, cuda_like(100, 32))  # timed again, and kept this time
    assert len(timed) == 2 and len(training._TRAINING_CHOICES) == 1
    planner.clear_cached_plans()


def test_training_choices_made_from_plans_are_forgotten_with_them(monkeypatch):
    # A shape retuned in the process (plans cleared or pinned) must not keep its earlier training forward.
    from persistrnn import plan as planner

    def plan_of(shape, batch):
        return planner.Plan(shape, batch, "fallback", None, "tuned", "test", measured_ms={"fallback": 1.0})

    monkeypatch.setattr(planner, "cached_plan", plan_of)
    monkeypatch.setattr(planner.tuner, "_memo_key", lambda shape, bucket: (0, shape, bucket))  # no device here
    for change in (planner.clear_cached_plans,
                   lambda: planner.pin_plan(plan_of(planner.ModelShape("gru", 8, 8, 1, "float32"), 2))):
        assert training._fallback_trains_forward("lstm", 64, 4, "float32", 0, True, False)
        assert training._fallback_trains_forward.cache_info().currsize >= 1
        monkeypatch.setitem(training._TRAINING_CHOICES, ("lstm", 64, 64, 1, False, True), False)  # a timed choice
        change()
        assert training._fallback_trains_forward.cache_info().currsize == 0
        assert training._training_config.cache_info().currsize == 0
        assert not training._TRAINING_CHOICES  # cuDNN's or ours, timed against the forward of the plans before
    planner.clear_cached_plans()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("learned_states", [False, True])
def test_the_operators_fake_outputs_have_the_real_outputs_strides(cell, learned_states):
    # inductor asserts every output's size and stride from the fake: a batch_first model's transposed input
    # (or an expanded initial state) must not give the fake strides the implementation does not give.
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(26)
    L, B, T, H = 2, 3, 7, 8
    model = getattr(torch.nn, cell.upper())(5, H, num_layers=L)
    weights = [w.detach() for w in model._flat_weights]
    x = torch.randn(B, T, 5).transpose(0, 1)  # (T, B, I), batch-major in memory
    h0 = torch.randn(L, 1, H).expand(L, B, H) if learned_states else None
    c0 = (torch.randn(L, 1, H).expand(L, B, H) if learned_states else None) if cell == "lstm" else None
    options = (cell, L, False, True, [], None)

    def both(*args):
        out, h_n, c_n, saved = torch.ops.persistrnn.train_forward(*args[:4], *options)
        d = [torch.randn(t.shape).to(t) if t.numel() else None for t in (out, h_n, c_n)]
        grads = torch.ops.persistrnn.train_backward(d[0], d[1], d[2], *args[:4], out, saved, *options)
        return [out, h_n, c_n, *saved, *grads[:3], *grads[3]]

    real = both(x, h0, c0, weights)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = both(*(mode.from_tensor(t) if t is not None else None for t in (x, h0, c0)),
                    [mode.from_tensor(w) for w in weights])
    assert [(t.shape, t.stride(), t.dtype) for t in real] == [(t.shape, t.stride(), t.dtype) for t in fake]


def test_dropout_masks_are_checked():
    x, h0, c0, weights = random_model("lstm", 7, 5, 2, False, True, steps=4, batch=2)
    good = training.dropout_masks(0.5, 2, (4, 2, 5), x)
    for masks, error, message in (([good[0], good[0]], ValueError, "expected none or 1"),
                                  ([good[0][:3]], ValueError, r"expected \(4, 2, 5\)"),
                                  ([good[0].float()], TypeError, "expected torch.float64 tensors .*got torch.float32")):
        with pytest.raises(error, match=message):
            torch.ops.persistrnn.train_forward(x, h0, c0, weights, "lstm", 2, False, True, masks, None)
    assert training.dropout_masks(0.0, 2, (4, 2, 5), x) == [] and training.dropout_masks(0.5, 1, (4, 2, 5), x) == []


def test_outputs_without_gradient_count_as_zeros():
    x, h0, c0, weights = random_model("lstm", 3, 5, 2, False, True, steps=4, batch=2, seed=9)
    (got,) = torch.autograd.grad(ours("lstm", x, h0, c0, weights, 2, False, True)[1].sum(), [x])
    (want,) = torch.autograd.grad(reference_autograd("lstm", x, h0, c0, weights, 2, False, True)[1].sum(), [x])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradients_are_bit_identical_run_to_run():
    x, h0, c0, weights = random_model("gru", 5, 7, 2, True, True, steps=6, batch=3, dtype=torch.float32, seed=4)
    first = gradients(ours, "gru", x, h0, c0, weights, 2, True, True)
    second = gradients(ours, "gru", x, h0, c0, weights, 2, True, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_double_backward_raises_and_names_the_alternative():
    x, h0, c0, weights = random_model("lstm", 3, 4, 1, False, True, steps=2, batch=2, seed=1)
    (dx,) = torch.autograd.grad(ours("lstm", x, h0, c0, weights, 1, False, True)[0].square().sum(), [x],
                                create_graph=True)
    with pytest.raises(UnsupportedError, match="double backward.*torch.nn.LSTM"):
        dx.sum().backward()


def test_torch_compile_traces_forward_and_backward_without_a_graph_break():
    x, h0, c0, weights = random_model("lstm", 3, 5, 1, False, True, steps=3, batch=2, seed=6)

    def step(x, h0, c0, *weights):
        out, h_n, c_n = training.train_step(x, h0, c0, list(weights), "lstm", 1, False, True, [])
        return out.square().sum() + h_n.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, h0, c0, *weights), [x, *weights])
    want = torch.autograd.grad(step(x, h0, c0, *weights), [x, *weights])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- the save_gates kernel variant (sm_90 builds on the CPU) -----------------------


def save_gates_config(cell, hidden, batch, dtype="float32", sync=None, lengths=False):
    """The default configuration a training forward compiles, with save_gates
    (and lengths, for a padded batch of sequences)."""
    config = persistent.default_config(cell, hidden, batch, sm_count=132, dtype=dtype)
    if sync == "grid":  # the default takes a cluster wherever one holds the weights
        config = dataclasses.replace(config, sync="grid", blocks=persistent.blocks_for(hidden, 32))
    return dataclasses.replace(config, save_gates=True, one_sync=False, lengths=lengths)


# Every cell in each sync mode (single block, cluster, grid), both 16-bit
# paths through fp16/bf16, odd H, with and without lengths: what the GPU
# tests run, and more.
SAVE_GATES_CONFIGS = sorted({
    save_gates_config(cell, hidden, batch, dtype, sync, lengths)
    for cell in CELL_NAMES
    for lengths in (False, True)
    for hidden, batch, dtype, sync in ((33, 1, "float32", None), (333, 4, "float32", None),
                                       (257, 8, "float32", "grid"), (100, 3, "bfloat16", None),
                                       (64, 8, "float16", None))
}, key=str)


@pytest.mark.parametrize("config", SAVE_GATES_CONFIGS, ids=str)
def test_save_gates_variant_compiles_for_sm90_without_local_memory(config):
    binary = persistent.compile_config(config, arch="sm_90")
    res = binary.kernel_resources(persistent.KERNEL_NAME)
    assert not res.uses_local_memory, res


def test_save_gates_is_compiled_into_training_binaries_only():
    config = persistent.default_config("lstm", 64, 4, sm_count=132)
    inference = persistent.render_source(config)
    train = persistent.render_source(dataclasses.replace(config, save_gates=True))
    assert "#define PRNN_SAVE_GATES 0" in inference and "saved_gates" not in inference.split("// ---- kernel")[0]
    assert "#define PRNN_SAVE_GATES 1" in train and "float* saved_gates_0, float* saved_c_0" in train


@pytest.mark.parametrize("changes, message", [
    (dict(cell="gru_reset_before", one_sync=True, hidden_size=64, sync="cluster", blocks=4), "one_sync True"),
    (dict(cell="lstm", hidden_size=64, sync="cluster", blocks=4, instances=2, pipeline=True), "pipeline True"),
])
def test_save_gates_refuses_variants_without_per_layer_gates(changes, message):
    with pytest.raises(persistent.ConfigError, match=f"save_gates: expected one_sync and pipeline off.*{message}"):
        persistent.KernelConfig(**changes, save_gates=True)


def test_saved_shapes_match_what_the_forward_keeps():
    x, h0, c0, weights = random_model("lstm", 3, 5, 2, True, True, steps=4, batch=2, seed=8)
    _, _, _, saved = torch.ops.persistrnn.train_forward(x, h0, c0, weights, "lstm", 2, True, True, [], None)
    shapes = training.saved_shapes(cells.get_cell("lstm"), 4, 2, 5, 2, 2)
    assert [tuple(t.shape) for t in saved] == [s for s, _ in shapes]


# ---- the fused backward step (sm_90 builds, and its kernels emulated on the CPU) ----------


BLOCK_KERNELS = [(spec, block.block) for spec in (*cells.CELLS.values(), *map(cells.with_lengths, cells.CELLS),
                                                  *map(cells.get_cell, CLIPPED_NAMES + ACTIVATED_NAMES))
                 for block in adjoint.step_backward_program(spec).blocks]


@pytest.mark.parametrize("cell,block", BLOCK_KERNELS, ids=lambda v: v.name if isinstance(v, cells.CellSpec) else str(v))
def test_backward_kernel_compiles_for_sm90_without_local_memory(cell, block):
    binary = adjoint.compile_block_kernel(cell, block, arch="sm_90")
    res = binary.kernel_resources(adjoint.KERNEL_NAME)
    assert not res.uses_local_memory, res


def direction_inputs(cell, steps, batch, hidden, seed, lengths=False):
    """Random float64 inputs of one direction's backward recurrence (standard
    normal, states halved; W_hh uniform in ±1/sqrt(H)), never zeros; with
    ``lengths``, ``step_runs`` (T, B) of random lengths in 1..T (1 and T
    included where the batch has room)."""
    spec = cells.get_cell(cell)
    gen = torch.Generator().manual_seed(seed)
    gh = spec.num_gates * hidden

    def normal(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    has_c = spec.has_cell_state
    return dict(xw=normal(steps, batch, gh), gates=normal(steps, batch, gh),
                h_prev=normal(steps, batch, hidden, scale=0.5),
                c_prev=normal(steps, batch, hidden, scale=0.5) if has_c else None,
                w_hh=(torch.rand(gh, hidden, generator=gen, dtype=torch.float64) * 2 - 1) * hidden ** -0.5,
                d_out=normal(steps, batch, hidden), dh_n=normal(batch, hidden),
                dc_n=normal(batch, hidden) if has_c else None,
                **({"step_runs": step_runs_of(random_lengths(steps, batch, gen), steps)} if lengths else {}))


def random_lengths(steps, batch, gen):
    """int32 (B,): random lengths in 1..T, the first T and the last 1 (where B > 1)."""
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen, dtype=torch.int32)
    lengths[0] = steps
    if batch > 1:
        lengths[-1] = 1
    return lengths


def step_runs_of(lengths, steps):
    return (torch.arange(steps)[:, None] < lengths[None, :]).double()


def run_steps(steps_backward, cell, inputs, reverse, device="cpu", dtype=torch.float64):
    """One direction's step loop on copies of ``inputs``, every output poisoned
    (NaN) first: an element the steps never write shows."""
    spec = cells.with_lengths(cell) if "step_runs" in inputs else cells.get_cell(cell)
    t = {k: None if v is None else v.to(device, dtype) for k, v in inputs.items()}
    d_xw, d_gates = torch.full_like(t["xw"], float("nan")), torch.full_like(t["gates"], float("nan"))
    stage_operands = torch.full((spec.num_stages - 1, *t["h_prev"].shape), float("nan"), dtype=dtype, device=device)
    dh0, dc0 = steps_backward(spec, t["xw"], t["gates"], t["h_prev"], t["c_prev"], t["w_hh"], t["d_out"], t["dh_n"],
                              t["dc_n"], reverse, d_xw, d_gates, stage_operands, t.get("step_runs"))
    return {"d_xw": d_xw, "d_gates": d_gates, "stage_operands": stage_operands, "dh0": dh0, "dc0": dc0}


class EmulatedBlockKernels:
    """The generated backward kernels run on the CPU: a launch executes the
    kernel body NVRTC compiles (its C statements read as Python, over every
    (batch row, unit) element at once) on the memory its pointer arguments
    point at, in float64. So the CUDA rendering (loads, stores, slots) and
    the host loop (addresses, dh/dc buffers, GEMM targets) are checked
    without a GPU."""

    FUNCTIONS = {"prnn_sigmoid": torch.sigmoid, "tanhf": torch.tanh, "prnn_relu": torch.relu,
                 "prnn_hardtanh": torch.nn.functional.hardtanh, "expf": torch.exp, "logf": torch.log,
                 "prnn_step": training.TORCH_FUNCTIONS["step"], "prnn_relu_grad": lambda x: (x > 0).to(x.dtype),
                 "prnn_hardtanh_grad": lambda x: ((x > -1) & (x < 1)).to(x.dtype)}

    def __init__(self, cell):
        program = adjoint.step_backward_program(cell)
        self.spec, self.extent = program.spec, max(program.spec.num_gates, program.spec.num_stages,
                                                   len(program.carried))
        self.kernels = [types.SimpleNamespace(source=adjoint.block_kernel_source(cell, block.block),
                                              config=lambda grid, block: None) for block in program.blocks]

    def __call__(self, kernel, config, *args, stream=None):
        source = re.sub(r"//[^\n]*", "", kernel.source)
        head, _, body = source.partition("prnn_step_backward(")
        signature, _, body = body.partition(") {")
        names = re.findall(r"(?:float\*\s*__restrict__|int)\s+(\w+)", signature)
        assert len(names) == len(args), (names, args)
        operand_stride, batch, hidden = (int(a) for a in args[-3:])
        # Each pointer as a float64 view of host memory, long enough for any index the kernel takes.
        count = operand_stride * self.extent
        env = {name: int(arg) if name in ("prnn_operand_stride", "prnn_batch", "prnn_hidden") else
               (None if int(arg) == 0 else
                torch.from_numpy(np.ctypeslib.as_array((ctypes.c_double * count).from_address(int(arg)))))
               for name, arg in zip(names, args)}
        env.update(prnn_n=torch.arange(batch * hidden), PRNN_G=self.spec.num_gates)
        body = body[:body.rindex("}")].split("return;", 1)[1]
        for line in filter(None, (line.strip().rstrip(";") for line in body.splitlines())):
            if line.startswith("const int "):
                line = line.replace(" / ", " // ")  # C integer division
            line = re.sub(r"^const (?:float|int) ", "", line)
            exec(re.sub(r"\b(\d+\.\d*(?:e[+-]?\d+)?)f\b", r"\1", line), dict(self.FUNCTIONS), env)


@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cell", CELL_NAMES + CLIPPED_NAMES + ACTIVATED_NAMES)
def test_fused_step_loop_with_emulated_kernels_equals_the_torch_op_steps(cell, reverse, lengths, monkeypatch):
    inputs = direction_inputs(cell, steps=4, batch=3, hidden=7, seed=11, lengths=lengths)
    want = run_steps(training._torch_steps, cell, inputs, reverse)
    kernels = EmulatedBlockKernels(cells.with_lengths(cell) if lengths else cell)
    monkeypatch.setattr(training, "_block_kernels", lambda spec, device: kernels.kernels)
    monkeypatch.setattr(training.runtime, "launch", kernels)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    got = run_steps(training._fused_steps, cell, inputs, reverse)
    for name, value in want.items():
        if value is not None:
            torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


# ---- the captured direction backward: key and dispatch (CPU) ----------------------------


def direction_backward_args(cell, steps, batch, hidden, seed, *, device="cuda", dtype=torch.float32):
    """Random arguments of training.direction_backward (xw, gates, cs, out,
    h0, c0, w_hh, d_out, dh_n, dc_n), never zeros; ``out`` and ``d_out`` are
    one direction's columns of a two-direction output, strided, as the
    backward passes them."""
    spec = cells.get_cell(cell)
    gen = torch.Generator().manual_seed(seed)
    gh, has_c = spec.num_gates * hidden, spec.has_cell_state

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)

    w_hh = ((torch.rand(gh, hidden, generator=gen, dtype=torch.float64) * 2 - 1) * hidden ** -0.5).to(device, dtype)
    return (normal(steps, batch, gh), normal(steps, batch, gh),
            normal(steps, batch, hidden, scale=0.5) if has_c else None,
            normal(steps, batch, 2 * hidden, scale=0.5)[:, :, hidden:], normal(batch, hidden, scale=0.5),
            normal(batch, hidden, scale=0.5) if has_c else None, w_hh, normal(steps, batch, 2 * hidden)[:, :, :hidden],
            normal(batch, hidden), normal(batch, hidden) if has_c else None)


def assert_bitwise_equal(got, want):
    """(d xw, d gates, dW_hh, dh0, dc0 or None) equal bit for bit (a NaN anywhere fails)."""
    for name, a, b in zip(("d_xw", "d_gates", "d_w_hh", "dh0", "dc0"), got, want, strict=True):
        assert (a is None) == (b is None), name
        assert a is None or torch.equal(a, b), f"{name}: max difference {(a - b).abs().max().item()}"


class CopyingCall:
    """runtime.CapturedCall's contract without a GPU: ``fn`` runs on dense
    copies of the arguments (those marked False in ``copy_in`` as they are),
    and a call returns copies of its outputs."""

    def __init__(self, fn, args, copy_in=None):
        self.fn = fn
        self.copy_in = [True] * len(args) if copy_in is None else list(copy_in)

    def __call__(self, *args):
        dense = [a if a is None or not c else a.clone(memory_format=torch.contiguous_format)
                 for a, c in zip(args, self.copy_in)]
        return [t.clone() for t in self.fn(*dense)]


@pytest.mark.parametrize("cell,num_layers,bidirectional,has_biases", [("lstm", 2, True, True), ("gru", 1, False, False),
                                                                       ("gru_reset_before", 2, False, True)])
@pytest.mark.parametrize("lengths", [None, torch.tensor([5, 2, 4])])
def test_captured_operators_return_the_plain_results_in_order(cell, num_layers, bidirectional, has_biases, lengths,
                                                              monkeypatch):
    # The operators' replay path with the graph emulated (CopyingCall): the
    # forward's outputs and saved list and the backward's gradients come
    # back in order, bit for bit those of the plain launches, one capture per
    # operator and key; with lengths, an input of the graph like the others.
    options = (num_layers, bidirectional, has_biases)
    x, h0, c0, weights = random_model(cell, 3, 4, *options, steps=5, batch=3, seed=9)

    def ours(*args):
        return ours_with_lengths(*args, lengths)

    want = gradients(ours, cell, x, h0, c0, weights, *options)
    want_forward = torch.ops.persistrnn.train_forward(x, h0, c0, weights, cell, *options, [], lengths)
    keys = []

    def call(key, make, device, *call_args):
        keys.append(key)
        return make()(*call_args)

    monkeypatch.setattr(training, "_captures_operators", lambda x, lengths, saved_bytes, shape, limit: True)
    monkeypatch.setattr(training.runtime, "CapturedCall", CopyingCall)
    monkeypatch.setattr(training, "OPERATOR_GRAPHS", types.SimpleNamespace(call=call))
    got_forward = torch.ops.persistrnn.train_forward(x, h0, c0, weights, cell, *options, [], lengths)
    for a, b in zip([*got_forward[:3], *got_forward[3]], [*want_forward[:3], *want_forward[3]], strict=True):
        assert torch.equal(a, b)
    got = gradients(ours, cell, x, h0, c0, weights, *options)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [key[0] for key in keys] == ["train_forward", "train_forward", "train_backward"]
    assert keys[0] == keys[1]
    assert all((key[6] if key[0] == "train_forward" else key[7]) == (lengths is None) for key in keys)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_relu"])
@pytest.mark.parametrize("captured", [False, True])
def test_no_initial_states_trains_as_zeros_made_by_the_operators(cell, captured, monkeypatch):
    # h0 (and c0) None: the operators make the zero states themselves (inside
    # the captured graph where it captures), and the outputs and every
    # gradient equal those of a call given zeros, bit for bit.
    options = (2, True, True)
    x, h0, c0, weights = random_model(cell, 3, 5, *options, steps=4, batch=3, seed=4)
    zeros = torch.zeros_like(h0, requires_grad=True)
    zero_c = torch.zeros_like(c0, requires_grad=True) if c0 is not None else None
    if captured:
        monkeypatch.setattr(training, "_captures_operators", lambda x, lengths, saved_bytes, shape, limit: True)
        monkeypatch.setattr(training.runtime, "CapturedCall", CopyingCall)
        monkeypatch.setattr(training, "OPERATOR_GRAPHS", types.SimpleNamespace(
            call=lambda key, make, device, *args: make()(*args)))
    want = ours(cell, x, zeros, zero_c, weights, *options)
    got = ours(cell, x, None, None, weights, *options)
    assert (got[2] is None) == (want[2] is None) == (cell != "lstm")
    for a, b in zip(got, want):
        assert a is None or torch.equal(a, b)
    want_grads = torch.autograd.grad(loss_of(want), [x, *weights])
    got_grads = torch.autograd.grad(loss_of(got), [x, *weights])
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    with pytest.raises(ArgumentError, match=r"expected h0 and c0 both .* got h0 None and c0 \(4, 3, 5\)"):
        torch.ops.persistrnn.train_forward(x, None, torch.zeros_like(h0), weights, cell, *options, [], None)
    if cell == "lstm":
        with pytest.raises(ArgumentError, match=r"got h0 \(4, 3, 5\) and c0 None"):
            torch.ops.persistrnn.train_forward(x, h0, None, weights, cell, *options, [], None)


def test_torch_compile_traces_a_step_without_initial_states():
    x, _, _, weights = random_model("lstm", 3, 5, 1, False, True, steps=3, batch=2, seed=6)

    def step(x, *weights):
        out, h_n, c_n = training.train_step(x, None, None, list(weights), "lstm", 1, False, True, [])
        return out.square().sum() + h_n.sum() + c_n.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, *weights), [x, *weights])
    want = torch.autograd.grad(step(x, *weights), [x, *weights])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cell,num_layers,bidirectional", [("lstm", 2, True), ("gru_reset_before", 3, False)])
def test_the_capture_bound_counts_the_saved_list(cell, num_layers, bidirectional):
    # The forward decides from the shapes (saved_bytes), the backward from the
    # tensors it is given: the same number, so both capture or neither does.
    options = (num_layers, bidirectional, True)
    x, h0, c0, weights = random_model(cell, 3, 5, *options, steps=6, batch=2, dtype=torch.float32)
    saved = torch.ops.persistrnn.train_forward(x, h0, c0, weights, cell, *options, [], None)[3]
    got = training.saved_bytes(cells.get_cell(cell), x, 5, num_layers, 2 if bidirectional else 1)
    assert got == sum(t.numel() * t.element_size() for t in saved) > 0


def test_steps_whose_saved_activations_pass_the_bound_are_not_captured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    on_gpu = types.SimpleNamespace(is_cuda=True)
    bound = training.GRAPH_SAVED_BYTES
    monkeypatch.setattr(training, "PADDED_LENGTHS", runtime.RecentShapes(window=4, fits=2))
    assert training._captures_operators(on_gpu, None, bound, "a", bound)
    assert not training._captures_operators(on_gpu, None, bound + 1, "a", bound)
    assert not training._captures_operators(types.SimpleNamespace(is_cuda=False), None, 1, "a", bound)
    # With lengths: once the padded shape repeats among the recent ones
    lengths = torch.ones(2)
    training.PADDED_LENGTHS.note("a")
    assert not training._captures_operators(on_gpu, lengths, 1, "a", bound)
    training.PADDED_LENGTHS.note("a")
    assert training._captures_operators(on_gpu, lengths, 1, "a", bound)
    assert not training._captures_operators(on_gpu, lengths, bound + 1, "a", bound)
    # A backward that steps from the host has a bound of its own, the larger
    assert training.STEP_LOOP_GRAPH_SAVED_BYTES > bound
    assert training._captures_operators(on_gpu, None, bound + 1, "a", training.STEP_LOOP_GRAPH_SAVED_BYTES)


def test_a_backward_that_steps_from_the_host_takes_the_larger_bound_once_its_shape_repeats(monkeypatch):
    from persistrnn import training_kernel

    monkeypatch.setattr(training, "STEP_LOOP_SHAPES", runtime.RecentShapes(window=16, fits=2))
    fits = {"value": False}
    monkeypatch.setattr(training_kernel, "fits", lambda *args: fits["value"])
    spec = cells.get_cell("lstm")

    def limit(batch, padded=True, on_gpu=True):
        x = types.SimpleNamespace(is_cuda=on_gpu, shape=(100, batch, 1024), dtype=torch.float32,
                                  device=types.SimpleNamespace(index=0))
        return training._backward_capture_limit(spec, 1, False, 1024, x, padded)

    small, large = training.GRAPH_SAVED_BYTES, training.STEP_LOOP_GRAPH_SAVED_BYTES
    assert limit(32) == small and limit(32) == large and limit(32) == large  # from its second call
    assert limit(32, padded=False) == small  # with lengths: a shape of its own
    assert limit(16) == small and limit(16) == small  # a third shape among the recent ones: none captured
    assert limit(32) == small
    fits["value"] = True  # the persistent backward kernel holds the layer: one launch, the usual bound
    assert limit(8) == small and limit(8) == small
    assert limit(32, on_gpu=False) == small


def test_forwards_and_backwards_that_step_from_the_host_count_their_shapes_apart(monkeypatch):
    # Forwards and backwards keep their recent shapes apart: a step's forward and
    # backward are two calls of one step, so two shapes of steps (a loader's
    # full batches and its last, smaller one) stay two shapes to each, not four.
    from persistrnn import training_kernel

    monkeypatch.setattr(training, "STEP_LOOP_SHAPES", runtime.RecentShapes(window=16, fits=2))
    monkeypatch.setattr(training, "STEP_LOOP_FORWARDS", runtime.RecentShapes(window=16, fits=2))
    monkeypatch.setattr(training_kernel, "fits", lambda *args: False)
    spec = cells.get_cell("lstm")
    limits = []
    for batch in (32, 16, 32, 16):
        x = types.SimpleNamespace(is_cuda=True, shape=(100, batch, 1024), dtype=torch.float32,
                                  device=torch.device("cuda", 0))
        limits.append(training._step_loop_limit(training.STEP_LOOP_FORWARDS,
                                                training._padded_shape("lstm", 1, False, 1024, x)))
        limits.append(training._backward_capture_limit(spec, 1, False, 1024, x, True))
    small, large = training.GRAPH_SAVED_BYTES, training.STEP_LOOP_GRAPH_SAVED_BYTES
    assert limits == [small] * 4 + [large] * 4


def test_recent_shapes_capture_what_repeats_while_it_fits_the_cache():
    recent = runtime.RecentShapes(window=5, fits=2)
    recent.note(100)
    assert not recent.repeats(100)  # seen once: a one-off length is not worth a capture
    recent.note(100)
    assert recent.repeats(100) and not recent.repeats(90)
    for length in (90, 90):
        recent.note(length)
    assert recent.repeats(100) and recent.repeats(90)  # two shapes: both fit
    recent.note(80)
    assert not recent.repeats(100) and not recent.repeats(90)  # three among the last five: they would evict each other
    for length in (90, 90, 90, 90):
        recent.note(length)
    assert recent.repeats(90) and not recent.repeats(100) and not recent.repeats(80)  # out of the window
    recent.clear()
    assert not recent.repeats(90)


def test_operator_key_holds_what_the_capture_fixes():
    x, h0, c0, weights = random_model("lstm", 3, 4, 2, False, True, steps=5, batch=2, dtype=torch.float32)
    masks = training.dropout_masks(0.5, 2, (5, 2, 4), x)
    key = training._operator_key(x, h0, c0, weights, masks)
    # The graph reads copies of everything but leaf weights (parameters), which it reads in place: other values
    # and addresses share it, other parameters' addresses do not.
    assert all(w.is_leaf for w in weights)
    assert training._operator_key(x.detach() + 1, h0 * 2, c0, weights, masks) == key
    with torch.no_grad():
        weights[0].add_(1)  # an optimiser's step: same storage
    assert training._operator_key(x, h0, c0, weights, masks) == key
    clones = [w.detach().clone().requires_grad_() for w in weights]
    assert training._operator_key(x, h0, c0, clones, masks) != key
    casts = [w * 1 for w in weights]  # e.g. autocast's casts, made anew each call: copied, their addresses left out
    assert not training._reads_in_place(casts)
    assert not training._reads_in_place([w.detach() for w in weights])  # leaves without gradients, e.g. compile's
    doubled = [w * 2 for w in weights]
    assert training._operator_key(x, h0, c0, casts, masks) == training._operator_key(x, h0, c0, doubled, masks)
    others = [training._operator_key(x[:4], h0, c0, weights, masks),
              training._operator_key(x[:, :1], h0[:, :1], c0[:, :1], weights, masks),
              training._operator_key(x.double(), h0.double(), c0.double(), [w.double() for w in weights], masks),
              training._operator_key(x, h0, None, weights, masks),
              training._operator_key(x, h0, c0, weights, []),
              training._operator_key(x, h0, c0, [w[:4] if w.dim() == 1 else w for w in weights], masks)]
    assert len({key, *others}) == len(others) + 1


# ---- GPU ----------------------------------------------------------------------------------


def _gpu_matrix(n, seed, cell_names=CELL_NAMES):
    """Random models over every cell; hidden sizes cover one block (33),
    clusters (100, 333) and, with batch 8, the 16-bit paths."""
    rng = random.Random(seed)
    for i in range(n):
        yield dict(cell=cell_names[i % len(cell_names)], input_size=rng.choice([7, 32]),
                   hidden=rng.choice([33, 100, 333]), num_layers=rng.choice([1, 2]),
                   bidirectional=rng.random() < 0.5, has_biases=rng.random() < 0.8, steps=rng.choice([1, 7, 30]),
                   batch=rng.choice([1, 3, 8]), dtype=rng.choice(["float32", "float32", "bfloat16", "float16"]))


GPU_MATRIX = list(_gpu_matrix(20, seed=16)) + list(_gpu_matrix(8, seed=18, cell_names=CLIPPED_NAMES + ACTIVATED_NAMES))


def _f64_gradients(fn, case, tensors):
    """(outputs, gradients of every input) of ``fn`` on float64 CPU copies of ``tensors``."""
    leaves = [None if t is None else t.detach().double().cpu().requires_grad_() for t in tensors]
    x, h0, c0, *weights = leaves
    options = (case["num_layers"], case["bidirectional"], case["has_biases"])
    result = fn(case["cell"], x, h0, c0, weights, *options)
    return result, torch.autograd.grad(loss_of(result), [t for t in leaves if t is not None])


def _peer_gradients(case, tensors):
    """cuDNN's gradients (torch's module, TF32 off) on the same rounded tensors.
    A derived cell (a clip, other activations), which torch has no module for,
    gets torch autograd through the cell spec's statements in the case's own
    dtype instead: the same kinks (clip bounds, relu-like activations) then
    flip their derivatives on the same rounding that our kernel meets."""
    kinds = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
    cell = case["cell"]
    x, h0, c0, *weights = tensors
    if cell not in kinds:
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
        with exact_torch():
            result = reference_autograd(cell, leaves[0], leaves[1], leaves[2], leaves[3:], case["num_layers"],
                                        case["bidirectional"], case["has_biases"])
            return torch.autograd.grad(loss_of(tuple(None if t is None else t.double() for t in result)),
                                       [t for t in leaves if t is not None])
    kwargs = dict(num_layers=case["num_layers"], bidirectional=case["bidirectional"], bias=case["has_biases"])
    if cell.startswith("rnn_"):
        kwargs["nonlinearity"] = cell.removeprefix("rnn_")
    module = getattr(torch.nn, kinds[cell])(x.shape[2], h0.shape[2], **kwargs).to(x.device, x.dtype)
    with torch.no_grad():
        for p, w in zip(module._flat_weights, weights):
            p.copy_(w)
    leaves = [t.detach().clone().requires_grad_() for t in tensors if t is not None]
    with exact_torch():
        out, state = module(leaves[0], (leaves[1], leaves[2]) if c0 is not None else leaves[1])
        h_n, c_n = state if c0 is not None else (state, None)
        loss = loss_of((out.double(), h_n.double(), None if c_n is None else c_n.double()))
        grads = torch.autograd.grad(loss, leaves[:2 + (c0 is not None)] + list(module._flat_weights))
    return grads


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MATRIX, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_gpu_gradients_match_float64_reference_and_cudnn(case, monkeypatch):
    monkeypatch.setattr(training, "fallback_trains_forward", lambda *args: False)
    assert training.training_config(case["cell"], case["hidden"], case["batch"], case["dtype"],
                                    torch.cuda.current_device()) is not None, "the kernel path must run, not torch ops"
    _check_gradients(case, getattr(torch, case["dtype"]))


FALLBACK_MATRIX = [case for name in dict.fromkeys(case["cell"] for case in GPU_MATRIX)
                   for case in [case for case in GPU_MATRIX if case["cell"] == name][:2]]
"""Two cases of GPU_MATRIX per cell."""


@pytest.mark.gpu
@pytest.mark.parametrize("case", FALLBACK_MATRIX, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_gpu_a_training_forward_on_the_fallback_gives_the_gradients_of_float64(case, monkeypatch):
    # The fallback's step loop in place of the persistent forward (a padded batch).
    ran = []
    run_fallback = training.fallback.run_fallback
    monkeypatch.setattr(training, "fallback_trains_forward", lambda *args: True)
    monkeypatch.setattr(training.fallback, "run_fallback", lambda *a, **kw: ran.append(1) or run_fallback(*a, **kw))
    monkeypatch.setattr(training.persistent, "run_instances",
                        lambda *a, **kw: pytest.fail("the persistent forward ran"))
    _check_gradients(case, getattr(torch, case["dtype"]))
    assert ran


def _check_gradients(case, dtype):
    """Our gradients of a random model of ``case`` against float64 autograd, with cuDNN's as the peer."""
    options = (case["num_layers"], case["bidirectional"], case["has_biases"])
    x, h0, c0, weights = random_model(case["cell"], case["input_size"], case["hidden"], *options, case["steps"],
                                      case["batch"], dtype=dtype, device="cuda", seed=case["hidden"])
    tensors = [x, h0, c0, *weights]
    result = ours(case["cell"], x, h0, c0, weights, *options)
    got = torch.autograd.grad(loss_of(tuple(None if t is None else t.double() for t in result)),
                              [t for t in tensors if t is not None])
    _, want = _f64_gradients(reference_autograd, case, tensors)
    peer = _peer_gradients(case, tensors)
    names = ["x", "h0"] + (["c0"] if c0 is not None else []) + [f"weight{i}" for i in range(len(weights))]
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)),
                              dict(zip(names, peer)), dtype=case["dtype"],
                              context=str(case))


@pytest.mark.gpu
@pytest.mark.parametrize("cell,path", [(cell, "kernel") for cell in CELL_NAMES]
                         + [(cell, "fallback") for cell in CELL_NAMES])
def test_gpu_saved_gates_equal_the_torch_op_forward(cell, path, monkeypatch):
    monkeypatch.setattr(training, "fallback_trains_forward", lambda *args: path == "fallback")
    x, h0, c0, weights = random_model(cell, 16, 100, 1, True, True, steps=9, batch=3, dtype=torch.float32,
                                      device="cuda", seed=2)
    with torch.no_grad():
        kernel = torch.ops.persistrnn.train_forward(x, h0, c0, weights, cell, 1, True, True, [], None)
        cpu = [None if t is None else t.cpu() for t in (x, h0, c0, *weights)]
        ops_path = torch.ops.persistrnn.train_forward(cpu[0], cpu[1], cpu[2], cpu[3:], cell, 1, True, True, [], None)
    for got, want in zip(kernel[3], ops_path[3]):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["plan", "fallback"])
@pytest.mark.parametrize("cell,dtype", [("lstm", torch.float32), ("gru", torch.bfloat16),
                                        ("gru_reset_before", torch.float32), ("rnn_relu", torch.float16)])
def test_gpu_gradients_are_bit_identical_run_to_run(cell, dtype, forward, monkeypatch):
    if forward == "fallback":
        monkeypatch.setattr(training, "fallback_trains_forward", lambda *args: True)
    x, h0, c0, weights = random_model(cell, 32, 333, 2, True, True, steps=20, batch=8, dtype=dtype, device="cuda",
                                      seed=3)
    runs = [gradients(ours, cell, x, h0, c0, weights, 2, True, True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


MODULES = [("LSTM", dict(num_layers=2)), ("GRU", dict(bidirectional=True)), ("GRU", dict(reset_after=False)),
           ("RNN", dict(nonlinearity="relu", batch_first=True))]


@pytest.mark.gpu
def test_gpu_the_training_choice_times_both_steps_once_and_logs_it(untuned, monkeypatch, caplog):
    import logging

    import persistrnn

    monkeypatch.setattr(training, "_time_training_steps", time_training_steps)
    model = persistrnn.LSTM(16, 32, num_layers=2).cuda().train()
    x = torch.randn(7, 3, 16, device="cuda")
    rng = torch.cuda.get_rng_state()
    with caplog.at_level(logging.INFO, logger="persistrnn"):
        first = training.cudnn_trains_faster(model, x)
        assert training.cudnn_trains_faster(model, x) == first
    assert torch.equal(torch.cuda.get_rng_state(), rng)  # the caller's random stream (dropout's) is untouched
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training lstm")]
    assert len(messages) == 1 and re.search(r"persistrnn \d+\.\d+ ms, cuDNN \d+\.\d+ ms per step", messages[0])
    assert all(p.grad is None for p in model.parameters())  # the timing leaves the module's gradients alone


@pytest.mark.gpu
def test_gpu_a_module_trains_on_cudnn_where_it_measured_faster(untuned, monkeypatch, recwarn):
    import persistrnn

    monkeypatch.setattr(training, "_time_training_steps", lambda module, x: (2.0, 1.0))  # cuDNN faster
    torch.manual_seed(4)
    model = persistrnn.LSTM(16, 32, num_layers=2).cuda().train()
    model.training_kernels = True
    theirs = torch.nn.LSTM(16, 32, num_layers=2).cuda().train()
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(7, 3, 16, device="cuda", requires_grad=True)
    assert model._torch_reason(x, trains=True) == "training: cuDNN measured faster at this shape"
    out, _ = model(x)
    assert not [w for w in recwarn if "needs gradients" in str(w.message)]
    assert torch.equal(out, theirs(x)[0])  # torch's own step, on the same weights
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:  # asked to be deterministic: persistrnn's operators, whatever the timing
        assert model._torch_reason(x, trains=True) is None
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.gpu
def test_gpu_module_dropout_between_layers_runs_the_training_operators(untuned, recwarn):
    import persistrnn

    model = persistrnn.LSTM(8, 16, num_layers=3, dropout=0.5, bidirectional=True).cuda().train()
    model.training_kernels = True
    x = torch.randn(5, 4, 8, device="cuda", requires_grad=True)
    torch.manual_seed(7)
    out, (h_n, c_n) = model(x)
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    torch.manual_seed(7)  # the module draws its masks first: the same masks again
    masks = [m.double().cpu() for m in training.dropout_masks(0.5, 3, (5, 4, 32), x)]
    weights = [w.detach().double().cpu().requires_grad_() for w in model._flat_weights]
    x64 = x.detach().double().cpu().requires_grad_()
    zeros = torch.zeros(6, 4, 16, dtype=torch.float64)
    want = layered_reference("lstm", x64, zeros, zeros, weights, 3, True, True, masks)
    assert_close_to_reference({"out": out, "h_n": h_n, "c_n": c_n}, dict(zip(("out", "h_n", "c_n"), want)),
                              dtype="float32", context="dropout 0.5")
    loss_of((out.double(), h_n.double(), c_n.double())).backward()
    loss_of(want).backward()
    assert_close_to_reference({"x": x.grad}, {"x": x64.grad}, dtype="float32", context="dropout 0.5")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_training_under_autocast_gives_torchs_dtypes_at_no_worse_an_error(untuned, recwarn, dtype):
    import persistrnn

    torch.manual_seed(9)
    model = persistrnn.LSTM(16, 33, num_layers=2).cuda().train()
    model.training_kernels = True
    theirs = torch.nn.LSTM(16, 33, num_layers=2).cuda().train()
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(7, 3, 16, device="cuda")
    results = {}
    for name, module in (("ours", model), ("peer", theirs)):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype):
            out, (h_n, c_n) = module(leaf)
        loss_of((out.double(), h_n.double(), c_n.double())).backward()
        results[name] = {"out": out, "h_n": h_n, "x": leaf.grad,
                         **{f"w{i}": w.grad for i, w in enumerate(module._flat_weights)}}
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    assert results["ours"]["out"].dtype == results["peer"]["out"].dtype  # torch casts cuDNN's RNN to half
    assert all(results["ours"][f"w{i}"].dtype == torch.float32 for i in range(8))  # the parameters' dtype
    # float64 on the same rounded inputs and weights: autocast ran both in fp16
    weights = [w.detach().half().double().cpu().requires_grad_() for w in model._flat_weights]
    x64 = x.half().double().cpu().requires_grad_()
    zeros = torch.zeros(2, 3, 33, dtype=torch.float64)
    want = reference_autograd("lstm", x64, zeros, zeros, weights, 2, False, True)
    loss_of(want).backward()
    ref = {"out": want[0], "h_n": want[1], "x": x64.grad, **{f"w{i}": w.grad for i, w in enumerate(weights)}}
    assert_close_to_reference(results["ours"], ref, results["peer"], dtype="float16", context=f"autocast {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_gpu_learned_initial_states_expanded_over_the_batch_train_and_infer(kind, recwarn):
    # A learned initial state, one row expanded over the batch (stride 0): its gradient is the sum over the
    # batch's rows, as autograd gives through expand; the same expanded states in an inference call.
    import persistrnn

    torch.manual_seed(15)
    L, B, H = 2, 5, 40
    model = getattr(persistrnn, kind)(16, H, num_layers=L).cuda().train()
    model.training_kernels = True
    has_c = kind == "LSTM"
    initial = [torch.nn.Parameter(torch.randn(L, 1, H, device="cuda") * 0.5) for _ in range(2 if has_c else 1)]
    x = torch.randn(9, B, 16, device="cuda", requires_grad=True)
    hx = tuple(p.expand(L, B, H) for p in initial)
    out, state = model(x, hx if has_c else hx[0])
    h_n = state[0] if has_c else state
    loss_of((out.double(), h_n.double())).backward()
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *initial, *model._flat_weights)]
    count = len(initial)
    x64, states64, weights64 = leaves[0], [s.expand(L, B, H) for s in leaves[1:1 + count]], leaves[1 + count:]
    want_out, want_h, _ = reference_autograd(model.cell, x64, states64[0], states64[1] if has_c else None, weights64,
                                             L, False, True)
    want = torch.autograd.grad(loss_of((want_out, want_h)), leaves)
    got = [x.grad, *(p.grad for p in initial), *(w.grad for w in model._flat_weights)]
    names = ["x", *(f"initial {i}" for i in range(len(initial))), *model._flat_weights_names]
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32", context=kind)
    model.eval()
    with torch.no_grad(), exact_torch():  # a cuDNN plan without the TF32 torch allows it by default
        again = model(x.detach(), tuple(p.detach().expand(L, B, H) for p in initial) if has_c
                      else initial[0].detach().expand(L, B, H))[0]
    assert float((again.double().cpu() - want_out.detach()).norm() / want_out.detach().norm()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True])
def test_gpu_training_under_activation_checkpointing_gives_float64_gradients(reentrant, recwarn):
    # torch.utils.checkpoint recomputes the forward in the backward: without reentrance, both forwards are
    # training forwards whose saved tensors must agree in number and shape; with it, the first runs under
    # no_grad (the inference path) and the recomputed one trains.
    import persistrnn

    torch.manual_seed(18)
    L, B, H = 2, 4, 32
    model = persistrnn.LSTM(16, H, num_layers=L).cuda().train()
    model.training_kernels = True
    x = torch.randn(8, B, 16, device="cuda", requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda t: model(t)[0], x, use_reentrant=reentrant)
    loss_of((out.double(),)).backward()
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *model._flat_weights)]
    zeros = torch.zeros(L, B, H, dtype=torch.float64)
    want_out, _, _ = reference_autograd("lstm", leaves[0], zeros, zeros, leaves[1:], L, False, True)
    want = torch.autograd.grad(loss_of((want_out,)), leaves)
    got = [x.grad, *(w.grad for w in model._flat_weights)]
    names = ["x", *model._flat_weights_names]
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32",
                              context=f"checkpoint, use_reentrant={reentrant}")


@pytest.mark.gpu
def test_gpu_warm_calls_and_training_steps_make_no_synchronising_cuda_call(untuned):
    # Serving and training loops run with torch.cuda.set_sync_debug_mode("error") to catch host syncs: once a
    # shape is captured, an inference call on every path and a training step make none.
    import persistrnn
    from persistrnn import plan as planner

    torch.manual_seed(19)
    x = torch.randn(10, 3, 16, device="cuda")
    for path in ("persistent", "fallback", "cudnn"):
        model = persistrnn.GRU(16, 32, num_layers=2).cuda().eval()
        if path != "persistent":
            shape = planner.shape_of(model)
            model.plan_for = lambda batch, shape=shape, path=path: planner.Plan(shape, batch, path, None, "tuned",
                                                                                 "test")
        with torch.no_grad():
            want = model(x)[0]  # the capture
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = model(x)[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), path
    model = persistrnn.LSTM(16, 32).cuda().train()
    model.training_kernels = True
    leaf = x.clone().requires_grad_()
    grads = []
    for step in range(3):  # the second call of the shape captures its step
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            model.zero_grad(set_to_none=True)
            model(leaf)[0].square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads.append([w.grad.clone() for w in model._flat_weights])
    assert all(torch.equal(a, b) for a, b in zip(grads[1], grads[2]))  # the same captured step, replayed


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_gpu_a_decoder_loop_of_one_step_calls_trains_as_one_graph(kind, recwarn):
    # A seq2seq decoder: the module called one step at a time, each step's input made from the last output,
    # the states carried, six calls of one shape (one captured training step, replayed) before one backward.
    import persistrnn

    torch.manual_seed(16)
    L, B, H, steps = 2, 3, 24, 6
    model = getattr(persistrnn, kind)(H, H, num_layers=L).cuda().train()
    model.training_kernels = True
    first = torch.randn(1, B, H, device="cuda", requires_grad=True)
    has_c = kind == "LSTM"

    def decode(module, x, state):
        outs = []
        for _ in range(steps):
            out, state = module(x, state)
            outs.append(out)
            x = torch.tanh(out)
        return torch.cat(outs), state

    out, state = decode(model, first, None)
    h_n = state[0] if has_c else state
    loss_of((out.double(), h_n.double())).backward()
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    leaves = [t.detach().double().cpu().requires_grad_() for t in (first, *model._flat_weights)]
    zeros = torch.zeros(L, B, H, dtype=torch.float64)

    def reference(x, state):
        out, h_n, c_n = reference_autograd(model.cell, x, *(state if state is not None else (zeros, zeros)),
                                           leaves[1:], L, False, True)
        return out, (h_n, c_n)

    want_out, (want_h, _) = decode(reference, leaves[0], None)
    want = torch.autograd.grad(loss_of((want_out, want_h)), leaves)
    got = [first.grad, *(w.grad for w in model._flat_weights)]
    names = ["x", *model._flat_weights_names]
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32", context=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw", MODULES)
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_module_training_call_gives_float64_gradients(kind, kw, compiled, recwarn):
    import persistrnn

    torch.manual_seed(5)
    model = getattr(persistrnn, kind)(16, 65, **kw).cuda().train()
    model.training_kernels = True
    x = torch.randn(3, 11, 16, device="cuda", requires_grad=True)
    if compiled:  # Dynamo traces RNN modules only with allow_rnn
        with torch._dynamo.config.patch(allow_rnn=True):
            out, state = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    else:
        out, state = model(x)
    h_n = state[0] if model.cell == "lstm" else state
    loss_of((out.double(), h_n.double())).backward()
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *model._flat_weights)]
    xs = leaves[0].transpose(0, 1) if model.batch_first else leaves[0]
    D = 2 if model.bidirectional else 1
    h0 = torch.zeros(model.num_layers * D, xs.shape[1], 65, dtype=torch.float64)
    want_out, want_h, _ = reference_autograd(model.cell, xs, h0, h0 if model.cell == "lstm" else None, leaves[1:],
                                             model.num_layers, model.bidirectional, model.bias)
    want_out = want_out.transpose(0, 1) if model.batch_first else want_out
    want = torch.autograd.grad(loss_of((want_out, want_h)), leaves)
    got = [x.grad] + [w.grad for w in model._flat_weights]
    names = ["x"] + list(model._flat_weights_names)
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32", context=f"{kind} {kw}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw", MODULES)
@pytest.mark.parametrize("lengths", [[4, 9, 1, 7, 9, 2], [9, 9, 9], [9]])  # unsorted; every sequence full; one
def test_gpu_module_training_on_a_packed_sequence_gives_float64_gradients(kind, kw, lengths, recwarn, monkeypatch):
    # An unsorted PackedSequence through a module with training_kernels:
    # the packed output, the final states and every gradient against the
    # float64 reference run on each sequence alone (no lengths in it).
    # Sequences that all run every step train as a padded batch: from the
    # captured operators. With lengths the first step runs its launches, and
    # the second, its padded shape repeated, replays captured operators:
    # bit for bit the first's gradients.
    import persistrnn

    torch.manual_seed(8)
    model = getattr(persistrnn, kind)(16, 65, **{"num_layers": 2, "bidirectional": True, **kw}).cuda().train()
    model.training_kernels = True
    monkeypatch.setattr(training, "OPERATOR_GRAPHS", runtime.GraphCache(capacity=8))  # empty: what this call captures
    monkeypatch.setattr(training, "PADDED_LENGTHS", runtime.RecentShapes(window=16, fits=4))  # no shape seen yet
    steps, batch = 9, len(lengths)
    lengths = torch.tensor(lengths)
    x = torch.randn(batch, steps, 16, device="cuda", requires_grad=True)  # batch-first: one layout for both
    sequences = [x[b, :n] for b, n in enumerate(lengths.tolist())]
    packed = torch.nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)
    out, state = model(packed)
    h_n = state[0] if model.cell == "lstm" else state
    padded = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=model.batch_first, total_length=steps)[0]
    padded = padded if model.batch_first else padded.transpose(0, 1)  # (B, T, D*H)
    loss_of((padded.double(), h_n.double())).backward()
    assert not [w for w in recwarn if "needs gradients" in str(w.message)], "the call ran torch's implementation"
    assert (len(training.OPERATOR_GRAPHS) == 2) == bool((lengths == steps).all())  # the forward's and the backward's
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *model._flat_weights)]
    h0 = torch.zeros(4, batch, 65, dtype=torch.float64)
    want_out, want_h, _ = each_sequence_alone(model.cell, leaves[0].transpose(0, 1), h0,
                                              h0 if model.cell == "lstm" else None, leaves[1:], 2, True, model.bias,
                                              lengths.to(torch.int32))
    assert_close_to_reference({"out": padded, "h_n": h_n},
                              {"out": want_out.transpose(0, 1), "h_n": want_h}, dtype="float32",
                              context=f"packed {kind} {kw}")
    want = torch.autograd.grad(loss_of((want_out.transpose(0, 1), want_h)), leaves)
    got = [x.grad] + [w.grad for w in model._flat_weights]
    names = ["x"] + list(model._flat_weights_names)
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32",
                              context=f"packed {kind} {kw}")
    first = [g.clone() for g in got]
    for t in (x, *model._flat_weights):
        t.grad = None
    out, state = model(torch.nn.utils.rnn.pack_sequence([x[b, :n] for b, n in enumerate(lengths.tolist())],
                                                       enforce_sorted=False))
    h_n = state[0] if model.cell == "lstm" else state
    padded = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=model.batch_first, total_length=steps)[0]
    loss_of(((padded if model.batch_first else padded.transpose(0, 1)).double(), h_n.double())).backward()
    assert len(training.OPERATOR_GRAPHS) == 2
    again = [x.grad] + [w.grad for w in model._flat_weights]
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("batch,hidden", [(5, 37), (3, 333)])
@pytest.mark.parametrize("cell", CELL_NAMES)
@pytest.mark.parametrize("lengths", [False, True])
def test_gpu_fused_steps_equal_the_float64_torch_op_steps(cell, batch, hidden, reverse, lengths):
    # The fp32 kernels and GEMMs against the torch-op steps in float64 on the
    # same (fp32-rounded) inputs, outputs poisoned; odd sizes, one partial block.
    inputs = {k: None if v is None else v.float().double()
              for k, v in direction_inputs(cell, steps=5, batch=batch, hidden=hidden, seed=hidden,
                                           lengths=lengths).items()}
    want = run_steps(training._torch_steps, cell, inputs, reverse)
    got = run_steps(training._fused_steps, cell, inputs, reverse, device="cuda", dtype=torch.float32)
    for name, value in want.items():
        if value is not None:
            torch.testing.assert_close(got[name].cpu().double(), value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


class FakeStream:
    """A CUDA stream on the CPU (for the thread helper's own test): records that it was synchronised."""

    def __init__(self):
        self.synchronized = False

    def synchronize(self):
        self.synchronized = True


def test_on_own_streams_runs_every_thread_on_its_own_stream_and_names_a_failure(monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    streams = on_own_streams(5, lambda i, stream: stream)
    assert len({id(s) for s in streams}) == 5 and all(s.synchronized for s in streams)
    assert on_own_streams(4, lambda i, stream: i * i) == [0, 1, 4, 9]

    def third_fails(i, stream):
        if i == 2:
            raise ValueError("thread two's own error")
        return i

    with pytest.raises(AssertionError, match="thread 2 failed") as failed:
        on_own_streams(4, third_fails)
    assert isinstance(failed.value.__cause__, ValueError)


@pytest.mark.gpu
@pytest.mark.parametrize("cell,dtype", [("lstm", torch.float32), ("gru_reset_before", torch.float32),
                                        ("rnn_tanh", torch.bfloat16)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_gpu_captured_operators_equal_the_plain_launches_bit_for_bit(cell, dtype, with_lengths, monkeypatch):
    # A training step (forward and backward) replayed from the operators'
    # graphs against the same step launched op by op; then, with every
    # graph's outputs poisoned, a step on fresh inputs: an element a replay
    # does not write, or writes from the capture's inputs, shows.
    # The parameters are read in place (their addresses in the key): the
    # second step updates them in place, as an optimiser does, and must
    # replay the same two graphs and see the new values. With lengths (new
    # ones each step, the padded length kept), a warm-up step's forwards note
    # the padded shape twice, and from then on the steps replay: the lengths
    # are the graph's input.
    options = (2, True, True)
    training.OPERATOR_GRAPHS.clear()
    monkeypatch.setattr(training, "PADDED_LENGTHS", runtime.RecentShapes(window=16, fits=4))
    weights = random_model(cell, 16, 100, *options, steps=9, batch=3, dtype=dtype, device="cuda", seed=1)[3]

    def step(seed):
        x, h0, c0, values = random_model(cell, 16, 100, *options, steps=9, batch=3, dtype=dtype, device="cuda",
                                         seed=seed)
        lengths = random_lengths(9, 3, torch.Generator().manual_seed(seed)) if with_lengths else None
        with torch.no_grad():
            for w, value in zip(weights, values, strict=True):
                w.copy_(value)
        forward = torch.ops.persistrnn.train_forward(x, h0, c0, weights, cell, *options, [], lengths)
        return [*forward[:3], *forward[3], *gradients(ours_with_lengths, cell, x, h0, c0, weights, *options, lengths)]

    def plain(seed):
        with monkeypatch.context() as m:
            m.setattr(training, "_captures_operators", lambda x, lengths, saved_bytes, shape, limit: False)
            return step(seed)

    if with_lengths:
        step(0)
    assert all(torch.equal(a, b) for a, b in zip(step(1), plain(1), strict=True))
    assert len(training.OPERATOR_GRAPHS) == 2  # one forward and one backward, on this stream
    for entry in training.OPERATOR_GRAPHS._entries.values():
        for output in entry.outputs:
            output.fill_(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(step(2), plain(2), strict=True))
    assert len(training.OPERATOR_GRAPHS) == 2  # the same graphs replayed, reading the updated parameters


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_gpu_a_backward_that_steps_from_the_host_is_captured_past_the_bound_of_the_others(cell, monkeypatch):
    # Where a layer does not fit the persistent backward kernel, its backward
    # launches kernels a step from the host; it is captured up to
    # STEP_LOOP_GRAPH_SAVED_BYTES, past GRAPH_SAVED_BYTES (one byte here, so
    # that the forward runs its launches), and equals the same launches
    # uncaptured to fp32 rounding (cuBLAS may pick other kernels for the step
    # GEMMs inside a capture; on the H100 the bits differed), also replayed on
    # fresh inputs with the outputs poisoned, and replays bit for bit.
    from persistrnn import training_kernel

    options = (2, True, True)
    monkeypatch.setattr(training_kernel, "fits", lambda *args: False)
    monkeypatch.setattr(training, "GRAPH_SAVED_BYTES", 1)
    monkeypatch.setattr(training, "STEP_LOOP_SHAPES", runtime.RecentShapes(window=16, fits=2))
    training.OPERATOR_GRAPHS.clear()
    # The parameters' addresses are in the key (read in place): one set, given each step's values.
    weights = random_model(cell, 16, 100, *options, steps=9, batch=3, dtype=torch.float32, device="cuda")[3]

    def step(seed):
        x, h0, c0, values = random_model(cell, 16, 100, *options, steps=9, batch=3, dtype=torch.float32,
                                         device="cuda", seed=seed)
        with torch.no_grad():
            for w, value in zip(weights, values, strict=True):
                w.copy_(value)
        return gradients(ours, cell, x, h0, c0, weights, *options)

    def plain(seed):
        with monkeypatch.context() as m:
            m.setattr(training, "STEP_LOOP_GRAPH_SAVED_BYTES", 1)
            return step(seed)

    def assert_rounding_apart(got, want):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    step(0)  # the shape's first backward runs its launches; from its second the graph
    assert len(training.OPERATOR_GRAPHS) == 0
    assert_rounding_apart(step(1), plain(1))
    assert [key[0][0] for key in training.OPERATOR_GRAPHS._entries] == ["train_backward"]
    for entry in training.OPERATOR_GRAPHS._entries.values():
        for output in entry.outputs:
            output.fill_(float("nan"))
    replayed = step(2)
    assert_rounding_apart(replayed, plain(2))
    assert all(torch.equal(a, b) for a, b in zip(step(2), replayed, strict=True))
    assert len(training.OPERATOR_GRAPHS) == 1
    training.OPERATOR_GRAPHS.clear()


@pytest.mark.gpu
def test_gpu_captured_training_steps_from_four_threads_on_their_own_streams():
    # One model, four threads each on its own stream and inputs, training
    # steps through the module at once: each gradient its single-threaded one.
    import persistrnn

    torch.manual_seed(3)
    model = persistrnn.LSTM(16, 100, num_layers=2).cuda().train()
    model.training_kernels = True
    threads, calls = 4, 5
    inputs = [torch.randn(8, 3, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
              for i in range(threads)]

    def input_gradient(x):
        leaf = x.clone().requires_grad_()
        out, _ = model(leaf)
        return torch.autograd.grad(out.square().sum(), [leaf, *model._flat_weights])

    want = [input_gradient(x) for x in inputs]
    results = on_own_streams(threads, lambda i, stream: [input_gradient(inputs[i]) for _ in range(calls)])
    for i in range(threads):
        for got in results[i]:
            assert all(torch.equal(a, b) for a, b in zip(got, want[i], strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [100, 601])  # the persistent backward on a cluster, on a grid
def test_gpu_direction_backward_from_four_threads_on_their_own_streams(hidden):
    # Four streams at once, each launch with its own scratch (a grid's
    # counter, status word and exchange buffer), each on its own inputs:
    # each result is its thread's single-threaded one, bit for bit.
    spec, threads, calls = cells.get_cell("lstm"), 4, 5
    inputs = [direction_backward_args("lstm", 6, 3, hidden, seed=40 + i) for i in range(threads)]
    want = [training.direction_backward(spec, *args, False) for args in inputs]
    results = on_own_streams(threads, lambda i, stream: [training.direction_backward(spec, *inputs[i], False)
                                                         for _ in range(calls)])
    for i in range(threads):
        for got in results[i]:
            assert_bitwise_equal(got, want[i])


@pytest.mark.gpu
@pytest.mark.parametrize("cell,hidden", [("gru", 37), ("gru_reset_before", 601)])  # a cluster, a grid
def test_gpu_inside_a_callers_capture_the_direction_backward_is_captured(cell, hidden):
    spec = cells.get_cell(cell)
    args = direction_backward_args(cell, 5, 3, hidden, seed=9)
    graph, got = runtime.graphs.capture(lambda: training.direction_backward(spec, *args, True))
    for output in got:
        if output is not None:
            output.fill_(float("nan"))  # the replay must write every output again
    graph.replay()
    assert_bitwise_equal(got, training.direction_backward(spec, *args, True))


def test_threads_training_a_new_shape_at_once_share_one_timing(monkeypatch):
    # The first training call of a shape times both steps; threads that
    # arrive together wait for that one timing (two at once would each time
    # the other's GPU work too) and all take its choice.
    import threading
    import time as clock

    import persistrnn

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timings = []

    def timed(module, x):
        timings.append(threading.get_ident())
        clock.sleep(0.05)
        return 2.0, 1.0  # cuDNN faster

    monkeypatch.setattr(training, "_time_training_steps", timed)
    module = persistrnn.LSTM(3, 4)
    on_gpu = types.SimpleNamespace(is_cuda=True, shape=(10, 2, 3), dtype=torch.float32,
                                   device=types.SimpleNamespace(index=0))
    got = []
    threads = [threading.Thread(target=lambda: got.append(training.cudnn_trains_faster(module, on_gpu)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [True] * 4 and len(timings) == 1
    assert training.cudnn_trains_faster(module, types.SimpleNamespace(**{**vars(on_gpu), "shape": (12, 2, 3)}))
    assert len(timings) == 1  # T=12 rounds up to the same power of two as T=10: the same choice, no timing


def test_a_backward_thread_never_waits_for_a_timing(monkeypatch):
    # A forward recomputed inside a backward (reentrant checkpointing) runs on
    # one of autograd's threads, which the timing thread's own backward may
    # need: there the choice does not wait for the lock. It runs the
    # operators untimed and keeps no choice; the next call outside times.
    import persistrnn

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timings = []
    monkeypatch.setattr(training, "_time_training_steps", lambda module, x: timings.append(1) or (2.0, 1.0))
    module = persistrnn.LSTM(3, 4)
    on_gpu = types.SimpleNamespace(is_cuda=True, shape=(10, 2, 3), dtype=torch.float32,
                                   device=types.SimpleNamespace(index=0))
    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: 7)  # inside a backward
    with training._CHOICE_LOCK:  # another thread is timing
        assert training.cudnn_trains_faster(module, on_gpu) is False
    assert timings == [] and not training._TRAINING_CHOICES
    assert training.cudnn_trains_faster(module, on_gpu) is True  # the lock is free: it times, even there
    assert timings == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_backward_gemms_run_in_the_operands_dtype_on_the_cpu(dtype):
    # Off CUDA (and for fp32 and float64 models everywhere) a product is the plain one.
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(6, 9, generator=gen), torch.randn(9, 4, generator=gen)
    assert torch.equal(training._product(a, b, dtype), a @ b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_a_16_bit_models_backward_gemms_round_the_operands_and_accumulate_in_fp32(dtype):
    # The operands rounded to the model's dtype, the sum in fp32: within fp32
    # rounding of the float64 product of the rounded operands, and fp32 out.
    gen = torch.Generator(device="cuda").manual_seed(6)
    a = torch.randn(800, 1024, device="cuda", generator=gen).T  # a transposed operand, as d_xw.T
    b = torch.randn(800, 257, device="cuda", generator=gen)
    got = training._product(a, b, dtype)
    want = a.to(dtype).double() @ b.to(dtype).double()
    assert got.dtype == torch.float32 and got.shape == (1024, 257)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


# ---- TF32 training where torch's fp32 matmul precision allows it ----------------------


def _plan_by_tf32(monkeypatch, tf32_config, fp32_config):
    """The plan cache answers ``tf32_config`` while torch allows TF32 and
    ``fp32_config`` otherwise (as the tuner keys its plans); the training
    configurations chosen earlier are forgotten before and after."""
    from persistrnn import plan as planner
    from persistrnn.plan import tuner

    def cached_plan(shape, batch):
        config = tf32_config if tuner.tf32_allowed(shape) else fp32_config
        return types.SimpleNamespace(path="persistent", config=config, batch_slice=None, measured_ms={})

    monkeypatch.setattr(planner, "cached_plan", cached_plan)
    training._training_config.cache_clear()
    return training._training_config.cache_clear


def _tf32_config(cell, hidden=100):
    return persistent.KernelConfig(cell, hidden, "cluster", 4, 256, group_size=32, batch_tile=8, dtype="float32",
                                   math="mma", k_split=4)


def test_a_training_configuration_chosen_while_tf32_was_allowed_never_runs_once_it_is_not(monkeypatch):
    forget = _plan_by_tf32(monkeypatch, _tf32_config("lstm"), persistent.KernelConfig("lstm", 100, "cluster", 4))
    monkeypatch.setattr(persistent, "batch_per_launch", lambda config, device: 8)  # no GPU to compile for here
    monkeypatch.setattr(runtime, "device_facts", lambda: types.SimpleNamespace(sm_count=132))
    try:
        with runtime.matmul_precision("high"):
            allowed, _ = training.training_config("lstm", 100, 5, "float32", 0)
        exact, _ = training.training_config("lstm", 100, 5, "float32", 0)
        with runtime.matmul_precision("high"):
            again, _ = training.training_config("lstm", 100, 5, "float32", 0)
    finally:
        forget()
    assert allowed.tf32 and allowed.save_gates and not exact.tf32 and exact.save_gates and again == allowed


@pytest.mark.parametrize("cell,holds,measured,expected", [
    ("lstm", True, {"persistent grid a": 8.0, "persistent grid b": 8.7, "fallback": 1.4, "cudnn": 1.2}, True),
    ("lstm", True, {"persistent cluster a": 0.2, "fallback": 1.4, "cudnn": 1.2}, False),
    ("gru", True, {"persistent cluster a": float("nan"), "fallback": 1.4}, True),  # NaN: it failed to launch
    ("rnn_relu", True, {"persistent cluster a": 2.0, "cudnn": 1.2}, False),  # the fallback untimed
    ("lstm", False, {}, True),  # no persistent configuration holds the layer: the fallback, not torch ops
    ("gru_reset_before", False, {}, True),  # two stages: the pointwise kernel saves every stage's products
])
def test_a_training_forward_runs_the_fallback_where_the_plan_timed_it_faster_than_every_persistent_candidate(
        monkeypatch, cell, holds, measured, expected):
    from persistrnn import plan as planner

    monkeypatch.setattr(planner, "cached_plan", lambda shape, batch: types.SimpleNamespace(measured_ms=measured))
    training._fallback_trains_forward.cache_clear()
    try:
        assert training.fallback_trains_forward(cell, 1024, 32, "float32", 0, holds) is expected
    finally:
        training._fallback_trains_forward.cache_clear()


def test_where_the_plans_choice_does_not_compile_with_save_gates_its_next_fastest_timed_one_runs(monkeypatch):
    import json
    from pathlib import Path

    from helpers import synthetic_calibration

    from persistrnn import plan as planner
    from persistrnn.plan import model as cost, tuner

    facts = runtime.DeviceFacts(**json.loads((Path(__file__).parent.parent / "docs/results/sync-h100.json")
                                             .read_text())["device"])
    monkeypatch.setattr(cost, "cost_model", lambda **kw: cost.CostModel(synthetic_calibration(), facts))
    monkeypatch.setattr(runtime, "device_facts", lambda: facts)
    shape = planner.ModelShape("lstm", 1024, 1024)
    ranked = tuner.ranked_configs(shape, 8, cost.cost_model())
    (first, s1), (second, s2), (third, s3) = [(r.config, r.batch_slice) for r in ranked[:3]]
    timed = {tuner.config_label(first, s1): 0.8, tuner.config_label(second, s2): 1.0,
             tuner.config_label(third, s3): 0.9, "cudnn": 1.1}
    for path in ("persistent", "cudnn"):
        plan = types.SimpleNamespace(path=path, config=first if path == "persistent" else None,
                                     batch_slice=s1 if path == "persistent" else None, measured_ms=timed)
        monkeypatch.setattr(planner, "cached_plan", lambda shape, batch, plan=plan: plan)
        tried = []

        def batch_per_launch(config, device, tried=tried):
            tried.append(dataclasses.replace(config, save_gates=False))
            if config.save_gates and len(tried) == 1:
                raise persistent.ConfigError("spills with save_gates")
            return 8

        monkeypatch.setattr(persistent, "batch_per_launch", batch_per_launch)
        training._training_config.cache_clear()
        try:
            got, got_slice = training.training_config("lstm", 1024, 8, "float32", 0)
        finally:
            training._training_config.cache_clear()
        assert tried[0] == first and (got, got_slice) == (dataclasses.replace(third, save_gates=True), s3), path


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_gpu_float64_training_on_cuda_runs_the_torch_ops_and_gives_the_reference(cell):
    # No kernel runs float64: the operators run the cell's statements as torch ops, on CUDA as on the CPU.
    options = (2, True, True)
    x, h0, c0, weights = random_model(cell, 16, 33, *options, steps=7, batch=3, dtype=torch.float64, device="cuda",
                                      seed=9)
    tensors = [x, h0, c0, *weights]
    got = gradients(ours, cell, x, h0, c0, weights, *options)
    case = {"cell": cell, "num_layers": 2, "bidirectional": True, "has_biases": True}
    _, want = _f64_gradients(reference_autograd, case, tensors)
    for a, b in zip(got, want, strict=True):
        assert a.is_cuda and a.dtype == torch.float64
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9)


TF32_TRAINING_CELLS = ["lstm", "gru", "gru_reset_before", "rnn_relu"]


@pytest.mark.parametrize("cell", TF32_TRAINING_CELLS)
def test_the_tf32_training_forwards_compile_for_sm90_without_local_memory(cell):
    config = dataclasses.replace(_tf32_config(cell), save_gates=True)
    assert config.tf32
    binary = persistent.compile_config(config, arch="sm_90")
    assert not binary.kernel_resources(persistent.KERNEL_NAME).uses_local_memory


@pytest.mark.gpu
@pytest.mark.parametrize("cell", TF32_TRAINING_CELLS)
def test_gpu_a_tf32_training_forward_gives_float64_gradients_within_tf32_bounds(cell, monkeypatch):
    # torch's fp32 matmul precision "high": the forward runs its TF32 plan (saving
    # its gates for the exact FFMA backward kernel), and the GEMMs run TF32.
    forget = _plan_by_tf32(monkeypatch, _tf32_config(cell), None)
    x, h0, c0, weights = random_model(cell, 16, 100, 1, False, True, steps=9, batch=5, dtype=torch.float32,
                                      device="cuda", seed=21)
    tensors = [x, h0, c0, *weights]
    try:
        with runtime.matmul_precision("high"):
            config, _ = training.training_config(cell, 100, 5, "float32", x.device.index)
            assert config.tf32 and config.save_gates
            result = ours(cell, x, h0, c0, weights, 1, False, True)
            got = torch.autograd.grad(loss_of(tuple(None if t is None else t.double() for t in result)),
                                      [t for t in tensors if t is not None])
    finally:
        forget()
    case = {"cell": cell, "num_layers": 1, "bidirectional": False, "has_biases": True}
    _, want = _f64_gradients(reference_autograd, case, tensors)
    names = ["x", "h0"] + (["c0"] if c0 is not None else []) + [f"weight{i}" for i in range(len(weights))]
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), None, dtype="tf32", context=cell)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("training_kernels", [False, True])
@pytest.mark.parametrize("wanting", ["states", "input", "layer 1"])
def test_gpu_a_frozen_rnn_passes_gradients_to_what_requires_them(kind, training_kernels, wanting, recwarn):
    # Fine-tuning around a frozen RNN: an encoder's state (or a learned initial state) into a frozen decoder,
    # features into a frozen RNN, or only the top layer trained. Only the states requiring grad once sent the
    # call down the inference path, whose outputs carry no gradient back to them.
    import persistrnn

    torch.manual_seed(21)
    L, B, H, T = 2, 3, 40, 7
    model = getattr(persistrnn, kind)(16, H, num_layers=L).cuda().train()
    model.training_kernels = training_kernels
    for name, w in zip(model._flat_weights_names, model._flat_weights):
        w.requires_grad_(wanting == "layer 1" and name.endswith("l1"))
    has_c = kind == "LSTM"
    x = torch.randn(T, B, 16, device="cuda", requires_grad=wanting == "input")
    states = [(torch.randn(L, B, H, device="cuda") * 0.5).requires_grad_(wanting == "states")
              for _ in range(2 if has_c else 1)]
    with exact_torch():  # torch's implementation where it runs: without the TF32 torch allows cuDNN by default
        out, state = model(x, tuple(states) if has_c else states[0])
        h_n = state[0] if has_c else state
        assert out.requires_grad and h_n.requires_grad
        loss_of((out.double(), h_n.double())).backward()
    names = {"states": [f"h0/c0 {i}" for i in range(len(states))], "input": ["x"],
             "layer 1": [n for n in model._flat_weights_names if n.endswith("l1")]}[wanting]
    got = {"states": [s.grad for s in states], "input": [x.grad],
           "layer 1": [w.grad for n, w in zip(model._flat_weights_names, model._flat_weights)
                       if n.endswith("l1")]}[wanting]
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *states, *model._flat_weights)]
    count = len(states)
    want_out, want_h, _ = reference_autograd(model.cell, leaves[0], leaves[1], leaves[2] if has_c else None,
                                             leaves[1 + count:], L, False, True)
    all_grads = torch.autograd.grad(loss_of((want_out, want_h)), leaves)
    want = {"states": all_grads[1:1 + count], "input": all_grads[:1],
            "layer 1": [g for n, g in zip(model._flat_weights_names, all_grads[1 + count:]) if n.endswith("l1")]}
    assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want[wanting])), dtype="float32",
                              context=f"{kind}, {wanting}, training_kernels={training_kernels}")
    frozen = [n for n, w in zip(model._flat_weights_names, model._flat_weights) if not w.requires_grad]
    assert all(w.grad is None for w in model._flat_weights if not w.requires_grad), frozen



@pytest.mark.gpu
@pytest.mark.parametrize("training_kernels", [False, True])
def test_gpu_make_graphed_callables_trains_the_module_from_its_replays(untuned, training_kernels):
    # torch.cuda.make_graphed_callables captures the module's forward and backward in the caller's graphs
    # (the training operators then launch op by op inside them); each replay's gradients are its own inputs'.
    import persistrnn

    class Outputs(torch.nn.Module):
        def __init__(self, rnn):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            return self.rnn(x)[0]

    torch.manual_seed(24)
    model = Outputs(persistrnn.LSTM(16, 32, num_layers=2).cuda().train())
    model.rnn.training_kernels = training_kernels
    with exact_torch():
        graphed = torch.cuda.make_graphed_callables(model, (torch.randn(8, 3, 16, device="cuda",
                                                                        requires_grad=True),))
        for replay in range(3):
            x = torch.randn(8, 3, 16, device="cuda", requires_grad=True)
            model.zero_grad(set_to_none=True)
            out = graphed(x)
            loss_of((out.double(),)).backward()
            leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *model.rnn._flat_weights)]
            zeros = torch.zeros(2, 3, 32, dtype=torch.float64)
            want_out, _, _ = reference_autograd("lstm", leaves[0], zeros, zeros, leaves[1:], 2, False, True)
            want = torch.autograd.grad(loss_of((want_out,)), leaves)
            names = ["out", "x", *model.rnn._flat_weights_names]
            got = [out, x.grad, *(w.grad for w in model.rnn._flat_weights)]
            assert_close_to_reference(dict(zip(names, got)), dict(zip(names, [want_out, *want])), dtype="float32",
                                      context=f"replay {replay}, training_kernels={training_kernels}")


@pytest.mark.gpu
@pytest.mark.parametrize("eager_between", [False, True])
def test_gpu_training_under_reduce_overhead_gives_float64_gradients(untuned, eager_between):
    # A small RNN trained with torch.compile(mode="reduce-overhead"): the training operators run inside the
    # CUDA-graph trees' warm-ups and recordings, and eager steps of the same model may come between.
    from test_ops import Classifier

    import persistrnn

    torch.manual_seed(27)
    model = Classifier(persistrnn.LSTM(16, 32, num_layers=2, batch_first=True)).cuda().train()
    model.rnn.training_kernels = True
    twin = Classifier(torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)).double()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch._dynamo.config.patch(allow_rnn=True):
        for step in range(5):
            twin.load_state_dict({k: v.detach().double().cpu() for k, v in model.state_dict().items()})
            model.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)
            x = torch.randn(3, 7, 12, device="cuda")
            compiled(x).square().sum().backward()
            if eager_between:
                model(x).square().sum().backward()  # the same gradient again: twice the compiled step's
            twin(x.double().cpu()).square().sum().backward()
            names = [n for n, _ in model.named_parameters()]
            got = [p.grad / (2 if eager_between else 1) for _, p in model.named_parameters()]
            want = [p.grad for _, p in twin.named_parameters()]
            assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32",
                                      context=f"step {step}, eager steps between: {eager_between}")
