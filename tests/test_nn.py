"""Drop-in modules: conformance with torch.nn (CPU), the canonical GRU's own
path against the float64 reference, streaming, errors, and (GPU) agreement
of the persistent path with the float64 reference and with cuDNN."""

import contextlib
import copy
import itertools
import pickle
import random

import pytest
import torch

import persistrnn
from persistrnn import nn as pnn
from persistrnn import ops
from persistrnn import reference
from helpers import assert_close_to_reference, exact_torch, plan_path, rel


def _matrix(n, seed):
    """Random constructor options over every torch argument."""
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(["LSTM", "GRU", "RNN"])
        kw = dict(input_size=rng.choice([1, 5, 16]), hidden_size=rng.choice([3, 8, 33]),
                  num_layers=rng.choice([1, 2, 3]), bias=rng.random() < 0.8, batch_first=rng.random() < 0.5,
                  dropout=rng.choice([0.0, 0.0, 0.3]), bidirectional=rng.random() < 0.4)
        if kind == "LSTM" and rng.random() < 0.3:
            kw["proj_size"] = rng.choice([1, 2])
        if kind == "RNN":
            kw["nonlinearity"] = rng.choice(["tanh", "relu"])
        yield kind, kw


MATRIX = list(_matrix(24, seed=5))


def _pair(kind, kw, seed=0):
    torch.manual_seed(seed)
    ours = getattr(persistrnn, kind)(**kw)
    theirs = getattr(torch.nn, kind)(**kw)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _input(module, T, B, dtype=torch.float32, device="cpu", gen=None):
    shape = (B, T, module.input_size) if module.batch_first else (T, B, module.input_size)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


@pytest.mark.parametrize("kind,kw", MATRIX)
def test_parameters_match_torch_names_and_shapes(kind, kw):
    ours, theirs = _pair(kind, kw)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    assert isinstance(ours, getattr(torch.nn, kind))


@pytest.mark.parametrize("kind,kw", MATRIX)
def test_state_dict_round_trips_both_ways(kind, kw):
    ours, theirs = _pair(kind, kw)
    torch.manual_seed(1)
    other = getattr(torch.nn, kind)(**kw)
    ours.load_state_dict(other.state_dict())
    for (n, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    theirs.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("kind,kw", MATRIX)
def test_cpu_forward_has_torchs_structure_and_values(kind, kw):
    ours, theirs = _pair(kind, kw)
    ours.eval(), theirs.eval()
    x = _input(ours, 4, 3)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
        assert torch.equal(got[0], want[0])
        if kind == "LSTM":
            assert torch.equal(got[1][0], want[1][0]) and torch.equal(got[1][1], want[1][1])
        else:
            assert torch.equal(got[1], want[1])
        unbatched = x[0] if ours.batch_first else x[:, 0]
        assert torch.equal(ours(unbatched)[0], theirs(unbatched)[0])


def _reference_canonical_gru(module, x, h0):
    """float64 reference of a canonical GRU module (x in the module's layout)."""
    params = reference.params_from_torch(module)
    out, h_n = reference.rnn_forward("gru_reset_before", x.double().numpy(), params,
                                     num_layers=module.num_layers, bidirectional=module.bidirectional,
                                     batch_first=module.batch_first,
                                     hx=None if h0 is None else h0.double().numpy())
    return out, h_n


CANONICAL_CASES = list(itertools.product([1, 2], [False, True], [False, True], [True, False], [False, True]))[::3]


@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,with_h0", CANONICAL_CASES)
def test_canonical_gru_matches_the_float64_reference(layers, bidirectional, batch_first, bias, with_h0):
    torch.manual_seed(3)
    gru = persistrnn.GRU(6, 9, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias,
                         reset_after=False).double()
    x = _input(gru, 5, 4, dtype=torch.float64)
    D = 2 if bidirectional else 1
    h0 = torch.randn(layers * D, 4, 9, dtype=torch.float64) if with_h0 else None
    with torch.no_grad():
        out, h_n = gru(x, h0)
    want_out, want_h = _reference_canonical_gru(gru, x, h0)
    assert rel(out.numpy(), want_out) < 1e-12 and rel(h_n.numpy(), want_h) < 1e-12


def test_canonical_gru_differs_from_torchs_gru_and_has_gradients():
    torch.manual_seed(4)
    canonical = persistrnn.GRU(3, 4, reset_after=False).double()
    after = torch.nn.GRU(3, 4).double()
    after.load_state_dict(canonical.state_dict())
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    assert not torch.allclose(canonical(x)[0], after(x)[0])
    assert torch.autograd.gradcheck(lambda x: canonical(x)[0], (x,))
    assert "reset_after=False" in repr(canonical)


@pytest.mark.parametrize("kind,kw", [("LSTM", dict(input_size=4, hidden_size=5, num_layers=2)),
                                     ("GRU", dict(input_size=4, hidden_size=5, batch_first=True, reset_after=False)),
                                     ("RNN", dict(input_size=4, hidden_size=5, nonlinearity="relu"))])
def test_stream_chunks_equal_one_call(kind, kw):
    torch.manual_seed(5)
    model = getattr(persistrnn, kind)(**kw).eval()
    x = _input(model, 11, 3)
    with torch.no_grad():
        whole, _ = model(x)
        session = model.stream(3)
        parts, start = [], 0
        for length in (1, 3, 1, 6):
            chunk = x[:, start:start + length] if model.batch_first else x[start:start + length]
            parts.append(session(chunk))
            start += length
    got = torch.cat(parts, dim=1 if model.batch_first else 0)
    assert torch.allclose(got, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("made_under", ["inference_mode", "no_grad"])
def test_a_stream_session_made_in_one_mode_runs_chunks_in_the_other(made_under):
    # A session's states are updated in place by every chunk, whatever mode the chunk's call runs in.
    torch.manual_seed(7)
    model = persistrnn.LSTM(4, 6, num_layers=2).eval()
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
    x = torch.randn(7, 2, 4)
    with modes[made_under]():
        session = model.stream(2)
    assert not any(s.is_inference() for s in session.state)
    parts = []
    for i, (a, b) in enumerate(((0, 2), (2, 3), (3, 7))):
        with modes[list(modes)[i % 2]]():
            parts.append(session(x[a:b]))
    with torch.no_grad():
        whole, _ = model(x)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6, rtol=0)


def test_the_flat_weights_follow_functional_call_and_parametrizations():
    # The CUDA paths read _flat_weights; torch's forward re-reads it where the attributes changed, and so must
    # ours: functional_call swaps the parameters' entries, a parametrization computes the weight per access.
    model = persistrnn.LSTM(4, 6, num_layers=2)
    before = model._flat_weights
    model._refresh_flat_weights()
    assert model._flat_weights is before  # nothing changed: the list is kept, not rebuilt
    swapped = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    seen = []
    real = model._refresh_flat_weights
    model._refresh_flat_weights = lambda: (real(), seen.append(list(model._flat_weights)))
    x = torch.randn(3, 2, 4)
    with torch.no_grad():
        torch.func.functional_call(model, swapped, (x,))
    assert all(w is swapped[n] for n, w in zip(model._flat_weights_names, seen[-1]))
    model._refresh_flat_weights = real
    model._refresh_flat_weights()  # the module's own parameters again
    assert all(w is p for w, (_, p) in zip(model._flat_weights, model.named_parameters()))
    torch.nn.utils.parametrizations.weight_norm(model, "weight_hh_l1")
    with torch.no_grad():
        model.parametrizations.weight_hh_l1.original0.mul_(2.0)  # the norm g: the weight doubles
    model._refresh_flat_weights()
    assert torch.allclose(model._flat_weights[5], model.weight_hh_l1)


def test_stream_reset_clears_chosen_rows_only():
    torch.manual_seed(6)
    model = persistrnn.LSTM(3, 4).eval()
    session = model.stream(3)
    with torch.no_grad():
        session(torch.randn(5, 3, 3))
        h, c = (s.clone() for s in session.state)
        session.reset([1])
    assert torch.equal(session.state[0][:, 1], torch.zeros(1, 4))
    assert torch.equal(session.state[1][:, 1], torch.zeros(1, 4))
    assert torch.equal(session.state[0][:, 0], h[:, 0]) and torch.equal(session.state[1][:, 2], c[:, 2])
    with torch.no_grad():  # a reset row restarts: its output equals a fresh run's
        x = torch.randn(2, 3, 3)
        out = session(x)
        fresh, _ = model(x[:, 1:2])
    assert torch.allclose(out[:, 1:2], fresh, atol=1e-6, rtol=0)


def test_stream_refuses_bidirectional_and_wrong_batches():
    model = persistrnn.GRU(3, 4, bidirectional=True)
    with pytest.raises(ValueError, match="unidirectional"):
        model.stream(2)
    session = persistrnn.GRU(3, 4).stream(2)
    with pytest.raises(ValueError, match="batch 2, got 3"):
        session(torch.randn(5, 3, 3))
    with pytest.raises(ValueError, match="batch_size"):
        persistrnn.LSTM(3, 4).stream(0)


@pytest.mark.parametrize("make_input,hx,error,match", [
    (lambda: torch.randn(2, 3, 4, 5), None, ValueError, "Expected input to be 2D or 3D, got 4D"),
    (lambda: torch.randn(5, 3, 7), None, ValueError, "input_size. Expected 4, got 7"),
    (lambda: torch.randn(5, 3, 4, dtype=torch.float64), None, ValueError, "does not match weight dtype"),
    (lambda: torch.randn(5, 3, 4), (torch.zeros(1, 2, 6), torch.zeros(1, 2, 6)), ValueError,
     r"Expected hidden\[0\] size \(1, 3, 6\)"),
    (lambda: torch.randn(5, 3, 4), (torch.zeros(3, 6), torch.zeros(3, 6)), ValueError, "3-D"),
    (lambda: torch.randn(5, 3, 4), torch.zeros(1, 3, 6), ValueError, "tuple"),
    (lambda: [1, 2, 3], None, TypeError, "Tensor or PackedSequence, got list"),
    (lambda: torch.randn(0, 3, 4), None, ValueError, "Expected sequence length to be larger than 0 in RNN"),
    (lambda: torch.randn(0, 4), None, ValueError, "Expected sequence length to be larger than 0 in RNN"),
])
def test_bad_inputs_raise_value_or_type_errors_in_torchs_wording(make_input, hx, error, match):
    model = persistrnn.LSTM(4, 6)
    with pytest.raises(error, match=match) as caught:
        model(make_input(), hx)
    assert isinstance(caught.value, RuntimeError)  # what torch raises: code written against torch still catches it


@pytest.mark.parametrize("kind, kwargs", [("LSTM", {}), ("GRU", {"bias": False}), ("RNN", {"num_layers": 2})])
def test_from_torch_leaves_torchs_weak_references_naming_the_shared_weights(kind, kwargs):
    # torch's forward (ours calls it under torch.compile) rebuilds and flattens the flat weights wherever its weak
    # references no longer name the parameters; Dynamo cannot trace that rebuild (flatten_parameters' set of data
    # pointers), so a converted model failed to compile with fullgraph=True.
    ours = persistrnn.from_torch(getattr(torch.nn, kind)(3, 4, **kwargs))
    assert not ours._weights_have_changed()
    assert [r() for r in ours._flat_weight_refs] == ours._flat_weights == [getattr(ours, n) for n in
                                                                           ours._flat_weights_names]


def test_a_compiled_call_reads_swapped_weights_without_torchs_flatten(monkeypatch):
    # Under torch.compile the forward re-reads weights that functional_call swapped in, as torch's forward does,
    # but without torch's rebuild: its flatten_parameters (a set of data pointers) does not trace on CUDA.
    torch.manual_seed(6)
    model = persistrnn.GRU(3, 4, num_layers=2)
    theirs = torch.nn.GRU(3, 4, num_layers=2)
    other = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    x = torch.randn(5, 2, 3)
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        want = torch.func.functional_call(theirs, other, (x,))[0]
        monkeypatch.setattr(torch.nn.RNNBase, "flatten_parameters", lambda self: pytest.fail("flatten_parameters ran"))
        swapped = torch.compile(lambda p, x: torch.func.functional_call(model, p, (x,)), fullgraph=True,
                                backend="aot_eager")
        got = swapped(other, x)[0]
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
        mine = torch.compile(model, fullgraph=True, backend="aot_eager")(x)[0]  # its own weights after the swap
    monkeypatch.undo()
    with torch.no_grad():
        theirs.load_state_dict(model.state_dict())
        assert torch.allclose(mine, theirs(x)[0], atol=1e-6, rtol=0)


def test_from_torch_shares_parameters_and_convert_swaps_nested_modules():
    inner = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True, dropout=0.1, proj_size=2)
    ours = persistrnn.from_torch(inner)
    assert type(ours) is persistrnn.LSTM and ours.proj_size == 2 and ours.dropout == 0.1 and ours.batch_first
    assert ours.weight_hh_l1 is inner.weight_hh_l1
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.GRU(3, 3),
                                                                           torch.nn.RNN(3, 3, nonlinearity="relu")))
    assert persistrnn.convert(model) is model
    assert type(model[1][0]) is persistrnn.GRU and type(model[1][1]) is persistrnn.RNN
    assert model[1][1].cell == "rnn_relu"
    assert not model[1][0].training_kernels  # opt-in
    mixed = torch.nn.Sequential(torch.nn.LSTM(2, 3), persistrnn.GRU(3, 3), torch.nn.Linear(3, 1))
    assert persistrnn.convert(mixed, training_kernels=True) is mixed
    assert type(mixed[0]) is persistrnn.LSTM and mixed[0].training_kernels and mixed[1].training_kernels
    assert persistrnn.convert(torch.nn.LSTM(2, 3), training_kernels=True).training_kernels
    with pytest.raises(TypeError, match="expected training_kernels to be a bool or None, got str"):
        persistrnn.convert(torch.nn.LSTM(2, 3), training_kernels="False")  # truthy: it must not read as True
    with pytest.raises(TypeError, match="LSTM, GRU or RNN"):
        persistrnn.from_torch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("seed", range(4))
def test_packed_positions_pad_and_pack_as_torch_in_the_sorted_order(seed):
    # Random unsorted lengths (one of them T, some equal): one index_copy
    # pads the packed data in the sorted order, one index_select packs it
    # back, and the lengths are the sorted ones.
    gen = torch.Generator().manual_seed(seed)
    steps, batch = 7, 6
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
    lengths[seed % batch] = steps
    x = torch.randn(steps, batch, 3, generator=gen)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    positions, sorted_lengths = pnn._packed_positions(packed.batch_sizes, torch.device("cpu"))
    padded = packed.data.new_zeros(steps * batch, 3).index_copy(0, positions, packed.data).view(steps, batch, 3)
    want, want_lengths = torch.nn.utils.rnn.pad_packed_sequence(packed)
    assert torch.equal(padded, want.index_select(1, packed.sorted_indices))
    assert torch.equal(sorted_lengths, want_lengths[packed.sorted_indices])
    assert torch.equal(padded.reshape(steps * batch, 3).index_select(0, positions), packed.data)
    states = torch.randn(2, batch, 4, generator=gen)
    there = pnn._permuted(states, packed.sorted_indices)
    assert torch.equal(pnn._permuted(there, packed.unsorted_indices), states)
    assert pnn._permuted(None, packed.sorted_indices) is None and pnn._permuted(states, None) is states


def test_a_call_on_another_gpu_than_the_current_one_runs_under_its_device(monkeypatch):
    # torch's kernels follow their tensors' device; ours read the current device below the module (plans,
    # streams, captures, launches), so a call whose tensors are elsewhere enters torch.cuda.device(theirs).
    from persistrnn import runtime, training

    class Tensorish:
        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # absent from CPU builds
    assert runtime.elsewhere(Tensorish(1)) == 1
    assert runtime.elsewhere(Tensorish(0)) is None and runtime.elsewhere(Tensorish(-1)) is None
    entered, inside = [], []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        inside.append(index)
        yield
        inside.pop()

    monkeypatch.setattr(runtime, "elsewhere", lambda t: None if inside else 1)
    monkeypatch.setattr(torch.cuda, "device", device)
    torch.manual_seed(3)
    model = persistrnn.GRU(3, 4)
    theirs = torch.nn.GRU(3, 4)
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        assert torch.equal(model(x)[0], theirs(x)[0]) and entered == [1]
        session = persistrnn.StreamSession(model, batch_size=2)
        assert torch.equal(session(x), theirs(x)[0]) and entered == [1, 1]
        weights = [w.detach() for w in model._flat_weights]
        out = torch.ops.persistrnn.train_forward(x, None, None, weights, "gru", 1, False, True, [], None)[0]
    assert torch.equal(out, training.forward(x, None, None, weights, "gru", 1, False, True, [])[0])
    assert entered == [1, 1, 1]


def test_the_layer_entries_run_under_their_weights_device(monkeypatch):
    # persistent.run_instances and fallback.run_fallback, called directly (the README's lower-level use), enter
    # torch.cuda.device of their weights as the module does: their launches read the current device.
    from persistrnn import fallback, runtime
    from persistrnn.persistent import launch

    entered, inside = [], []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        inside.append(index)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(runtime, "elsewhere", lambda t: None if inside else 1)
    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []

    def stops_here(*args, **kwargs):  # what runs first below the guard: records the device it runs under
        seen.append(list(inside))
        raise RuntimeError("stop")

    monkeypatch.setattr(fallback, "check_recurrence", stops_here)
    w_hh = torch.randn(12, 4)
    with pytest.raises(RuntimeError, match="stop"):
        fallback.run_fallback("gru", torch.randn(3, 2, 12), w_hh, torch.randn(12), torch.randn(2, 4), None)
    monkeypatch.setattr(launch.runtime, "failure_hook", stops_here)
    config = persistrnn.persistent.KernelConfig("gru", 4, "single", 1)
    with pytest.raises(RuntimeError, match="stop"):
        launch.run_instances(config, [launch.Instance(None, w_hh, None, None, None, None, None, None)], 3, 2)
    assert entered == [1, 1] and seen == [[1], [1]]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_call_needs_gradients_when_an_initial_state_requires_them(kind):
    # A frozen RNN fed an encoder's state: only the state requires grad, and the call must record it.
    model = getattr(persistrnn, kind)(3, 4).requires_grad_(False)
    x = torch.randn(5, 2, 3)
    h0 = torch.randn(1, 2, 4, requires_grad=True)
    hx = (h0, torch.randn(1, 2, 4)) if kind == "LSTM" else h0
    assert model._needs_grad(x, hx) and not model._needs_grad(x, None)
    if kind == "LSTM":
        assert model._needs_grad(x, (torch.randn(1, 2, 4), h0))
    with torch.no_grad():
        assert not model._needs_grad(x, hx)
    out, state = model(x, hx)  # CPU: torch's implementation
    (state[0] if kind == "LSTM" else state).sum().backward()
    assert h0.grad is not None and h0.grad.abs().sum() > 0


def test_cpu_gradients_flow_through_torchs_implementation():
    model = persistrnn.LSTM(3, 4)
    theirs = torch.nn.LSTM(3, 4)
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(5, 2, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    model(x)[0].square().sum().backward()  # CPU: torch's implementation
    theirs(x2)[0].square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(model.weight_hh_l0.grad, theirs.weight_hh_l0.grad)


# ---- GPU -------------------------------------------------------------------------


def _gpu_matrix(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(["LSTM", "GRU", "GRU_canonical", "RNN"])
        kw = dict(input_size=rng.choice([7, 32, 64]), hidden_size=rng.choice([33, 64, 128, 256]),
                  num_layers=rng.choice([1, 2]), bias=rng.random() < 0.8, batch_first=rng.random() < 0.5,
                  bidirectional=rng.random() < 0.4)
        if kind == "RNN":
            kw["nonlinearity"] = rng.choice(["tanh", "relu"])
        yield kind, kw, rng.choice([1, 3, 8]), rng.choice([1, 5, 20]), rng.random() < 0.5


GPU_MATRIX = list(_gpu_matrix(20, seed=11))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw,batch,steps,with_state", GPU_MATRIX)
def test_gpu_forward_matches_float64_reference_and_cudnn(untuned, kind, kw, batch, steps, with_state):
    torch.manual_seed(hash((kind, batch, steps)) % 2**31)
    canonical = kind == "GRU_canonical"
    model = (persistrnn.GRU(**kw, reset_after=False) if canonical else getattr(persistrnn, kind)(**kw)).cuda().eval()
    cell = model.cell
    D = 2 if model.bidirectional else 1
    x = _input(model, steps, batch, device="cuda")
    hx = None
    if with_state:
        h0 = torch.randn(model.num_layers * D, batch, model.hidden_size, device="cuda") * 0.5
        hx = (h0, torch.randn_like(h0) * 0.5) if cell == "lstm" else h0
    with torch.no_grad():
        out, state = model(x, hx)
    params = reference.params_from_torch(model)
    f64 = lambda t: t.double().cpu().numpy()  # noqa: E731
    ref_hx = None if hx is None else ((f64(hx[0]), f64(hx[1])) if cell == "lstm" else f64(hx))
    want_out, want_state = reference.rnn_forward(cell, f64(x), params, num_layers=model.num_layers,
                                                 bidirectional=model.bidirectional, batch_first=model.batch_first,
                                                 hx=ref_hx)
    err = rel(f64(out), want_out)
    h = state[0] if cell == "lstm" else state
    want_h = want_state[0] if cell == "lstm" else want_state
    assert out.shape == torch.Size(want_out.shape) and h.shape == torch.Size(want_h.shape)
    assert err < 1e-5 and rel(f64(h), want_h) < 1e-5
    if not canonical:
        torch_model = getattr(torch.nn, kind)(**kw).cuda().eval()
        torch_model.load_state_dict(model.state_dict())
        with torch.no_grad(), exact_torch():
            peer = f64(torch_model(x, hx)[0])
        assert_close_to_reference(f64(out), want_out, peer, dtype="float32", context=f"{kind} {kw}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_gpu_a_tf32_plan_under_high_matmul_precision_matches_float64_within_tf32s_bounds(monkeypatch, kind):
    from persistrnn import plan as planner
    from persistrnn import runtime
    from persistrnn.persistent import KernelConfig
    from persistrnn.plan import tuner

    torch.manual_seed(3)
    model = getattr(persistrnn, kind)(40, 256).cuda().eval()
    shape = planner.shape_of(model)
    config = KernelConfig(model.cell, 256, "cluster", 8, 256, group_size=32, batch_tile=8, math="mma", k_split=2)
    monkeypatch.setattr(model, "plan_for", lambda batch: planner.Plan(shape, batch, "persistent", config, "tuned",
                                                                      "test"))
    x = _input(model, 30, 5, device="cuda")
    assert not tuner.tf32_allowed(shape)  # torch's default: exact fp32 products only
    with runtime.matmul_precision("high"):
        assert tuner.tf32_allowed(shape)
        with torch.no_grad():
            out, state = model(x)
    f64 = lambda t: t.double().cpu().numpy()  # noqa: E731
    want_out, want_state = reference.rnn_forward(model.cell, f64(x), reference.params_from_torch(model))
    h, want_h = (state[0], want_state[0]) if kind == "LSTM" else (state, want_state)
    assert_close_to_reference({"out": f64(out), "h_n": f64(h)}, {"out": want_out, "h_n": want_h}, dtype="tf32",
                              context=f"{kind} on {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_gpu_stream_chunks_equal_one_call(untuned, kind):
    torch.manual_seed(7)
    model = getattr(persistrnn, kind)(16, 128, num_layers=2).cuda().eval()
    x = torch.randn(12, 1, 16, device="cuda")
    with torch.no_grad():
        whole, _ = model(x)
        session = model.stream(1)
        parts = [session(x[t:t + 1]) for t in range(12)]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_gpu_bad_device_and_grad_paths(untuned):
    model = persistrnn.LSTM(8, 16).cuda()
    with pytest.raises(ValueError, match="same device"):
        model(torch.randn(3, 2, 8))
    pnn._warned.clear()
    x = torch.randn(3, 2, 8, device="cuda", requires_grad=True)
    with pytest.warns(UserWarning, match="gradients"):  # by default torch's implementation trains
        model(x)
    model.training_kernels = True
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a padded training call runs our operators: no fallback warning
        out, _ = model(x)
    out.square().sum().backward()
    theirs = torch.nn.LSTM(8, 16).cuda()
    theirs.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # cuDNN's RNNs use TF32 by default
        theirs(x2)[0].square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=0, atol=1e-5)
    x.grad = x2.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a packed training call runs our operators too
        out, _ = model(torch.nn.utils.rnn.pack_padded_sequence(x, [3, 2]))
    out.data.square().sum().backward()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        theirs(torch.nn.utils.rnn.pack_padded_sequence(x2, [3, 2]))[0].data.square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_replayed_forward_sees_new_inputs_and_weights(untuned):
    import copy

    torch.manual_seed(8)
    model = persistrnn.GRU(16, 64, num_layers=2).cuda().eval()

    def check():
        x = torch.randn(7, 2, 16, device="cuda")
        twin = copy.deepcopy(model).cpu()  # torch's CPU implementation, fp32
        with torch.no_grad():
            out, h = model(x)
            want_out, want_h = twin(x.cpu())
        assert rel(out.cpu().numpy(), want_out.numpy()) < 1e-5 and rel(h.cpu().numpy(), want_h.numpy()) < 1e-5

    ops.GRAPHS.clear()
    check()
    check()  # the same shape: a replay, with new inputs
    assert len(ops.GRAPHS) == 1
    with torch.no_grad():
        model.weight_hh_l1.mul_(0.5)  # in place: the captured graph reads it
    check()
    assert len(ops.GRAPHS) == 1
    model.weight_hh_l0 = torch.nn.Parameter(model.weight_hh_l0.detach() * 1.5)  # a new tensor: a new graph
    check()
    assert len(ops.GRAPHS) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback", "cudnn"])
@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_gpu_calls_under_inference_mode_and_no_grad_mix_on_one_module(untuned, monkeypatch, path, first):
    # Serving code calls under torch.inference_mode(), other code under no_grad: a shape first captured under
    # one mode replays under the other, on the operator's path (the plan cache's plans) and the module's own.
    torch.manual_seed(14)
    model = persistrnn.LSTM(12, 40, num_layers=2).cuda().eval()
    monkeypatch.setattr(ops, "GRAPHS", persistrnn.runtime.GraphCache(capacity=64))  # empty
    plan_path(model, path, monkeypatch)
    twin = copy.deepcopy(model).cpu().double()
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
    for mode in [first, *(m for m in modes if m != first)] * 2:
        x = torch.randn(9, 3, 12, device="cuda")
        with modes[mode](), exact_torch():  # cuDNN's plan without TF32, which torch allows it by default
            out, (h, c) = model(x)
        with torch.no_grad():
            want, (want_h, want_c) = twin(x.cpu().double())
        for got, expected in ((out, want), (h, want_h), (c, want_c)):
            assert rel(got.cpu().double().numpy(), expected.numpy()) <= 1e-5, (mode, path)
    with torch.no_grad():
        out = model(torch.randn(9, 3, 12, device="cuda"))[0]
    scale = torch.ones_like(out, requires_grad=True)
    (out * scale).sum().backward()  # a no_grad call's output is an ordinary tensor, autograd may save it
    assert torch.equal(scale.grad, out)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback", "cudnn"])
def test_gpu_initial_states_expanded_over_the_batch_run_on_every_path(untuned, monkeypatch, path):
    # One learned row of states expanded over the batch (stride 0), as models with learned initial states
    # pass them: every path takes them (cuDNN itself refuses states that are not contiguous).
    torch.manual_seed(17)
    model = persistrnn.LSTM(12, 40, num_layers=2).cuda().eval()
    plan_path(model, path, monkeypatch)
    twin = copy.deepcopy(model).cpu().double()
    rows = (torch.randn(2, 1, 40, device="cuda"), torch.randn(2, 1, 40, device="cuda"))
    for _ in range(2):  # the capture, then a replay
        x = torch.randn(9, 5, 12, device="cuda")
        hx = tuple(r.expand(2, 5, 40) for r in rows)
        with torch.no_grad(), exact_torch():
            out, (h, c) = model(x, hx)
            want, (want_h, want_c) = twin(x.cpu().double(), tuple(s.cpu().double() for s in hx))
        for got, expected in ((out, want), (h, want_h), (c, want_c)):
            assert rel(got.cpu().double().numpy(), expected.numpy()) <= 1e-5, path


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback", "cudnn"])
def test_gpu_functional_call_and_weight_norm_run_the_weights_they_give(untuned, monkeypatch, path):
    # torch.func.functional_call (ensembles, meta-learning) and weight_norm: the call runs the weights the
    # module's attributes hold at that call, as torch's module does, before and after a captured call.
    torch.manual_seed(20)
    model = persistrnn.GRU(12, 40, num_layers=2).cuda().eval()
    plan_path(model, path, monkeypatch)
    theirs = torch.nn.GRU(12, 40, num_layers=2).cuda().eval()
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(9, 3, 12, device="cuda")
    swapped = {name: torch.randn_like(p) * 0.3 for name, p in model.named_parameters()}

    def close(a, b):
        return rel(a.double().cpu().numpy(), b.double().cpu().numpy()) <= 1e-5

    with torch.no_grad(), exact_torch():
        assert close(model(x)[0], theirs(x)[0])  # captured with the module's own weights
        assert close(torch.func.functional_call(model, swapped, (x,))[0],
                     torch.func.functional_call(theirs, swapped, (x,))[0])
        assert close(model(x)[0], theirs(x)[0])  # its own weights again
        for module in (model, theirs):
            torch.nn.utils.parametrizations.weight_norm(module, "weight_hh_l1")
            module.parametrizations.weight_hh_l1.original0.mul_(1.5)
        assert close(model(x)[0], theirs(x)[0])


@pytest.mark.gpu
def test_gpu_strided_parameters_are_read_by_value(untuned, monkeypatch):
    # The kernels read a matrix by address, row-major: a parameter that is a
    # transposed view (same values, other strides) must give the same outputs
    # and gradients as a contiguous one, in inference and in training.
    from persistrnn import training

    monkeypatch.setattr(training, "cudnn_trains_faster", lambda module, x: False)  # the training operators
    torch.manual_seed(12)
    model = persistrnn.LSTM(16, 64, num_layers=2).cuda()
    model.training_kernels = True
    twin = copy.deepcopy(model)
    for name in ("weight_hh_l0", "weight_ih_l1"):
        value = getattr(model, name).detach()
        setattr(twin, name, torch.nn.Parameter(value.t().contiguous().t()))  # equal values, column-major
        assert not getattr(twin, name).is_contiguous()
    twin._flat_weights = [getattr(twin, n) for n in twin._flat_weights_names]
    x = torch.randn(9, 3, 16, device="cuda")
    with torch.no_grad():
        for m in (model, twin):
            m.eval()
        assert torch.equal(model(x)[0], twin(x)[0])
    for m in (model, twin):
        m.train()
    grads = []
    for m in (model, twin):
        leaf = x.clone().requires_grad_()
        out, _ = m(leaf)
        grads.append(torch.autograd.grad(out.square().sum(), [leaf, *m._flat_weights]))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_copies_and_pickles_leave_the_caches_behind():
    import copy
    import pickle

    model = persistrnn.LSTM(3, 4)
    model._checked.add("stale")  # stands for per-process state, which a copy must not carry
    model._cast = ("stale", [object()])  # stands for weights cast under autocast (not picklable)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is persistrnn.LSTM and not clone._checked and clone._cast is None
        assert torch.equal(clone.weight_hh_l0, model.weight_hh_l0)
    assert "stale" in model._checked


def test_checks_still_run_for_a_new_signature_after_a_good_call():
    model = persistrnn.GRU(4, 6).eval()
    with torch.no_grad():
        model(torch.randn(5, 3, 4))
        model(torch.randn(5, 3, 4))  # the same signature: checked once
        with pytest.raises(ValueError, match=r"Expected hidden size \(1, 3, 6\), got \[1, 2, 6\]"):
            model(torch.randn(5, 3, 4), torch.zeros(1, 2, 6))
        with pytest.raises(ValueError, match="does not match weight dtype"):
            model(torch.randn(5, 3, 4, dtype=torch.float64))


@pytest.mark.gpu
def test_gpu_float64_model_runs_torchs_implementation():
    torch.manual_seed(9)
    model = persistrnn.LSTM(5, 7).cuda().double().eval()
    twin = torch.nn.LSTM(5, 7).cuda().double().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 2, 5, device="cuda", dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(x)[0], twin(x)[0])


@pytest.mark.gpu
def test_gpu_stream_session_replays_on_its_own_state_buffers(untuned):
    torch.manual_seed(8)
    model = persistrnn.LSTM(8, 64, num_layers=2, batch_first=True).cuda().eval()
    x = torch.randn(3, 10, 8, device="cuda")
    with torch.no_grad():
        whole, (h, c) = model(x)
        session = model.stream(3)
        parts = [session(x[:, a:b]) for a, b in ((0, 1), (1, 4), (4, 5), (5, 10))]
        assert len(session._graphs) == 3  # one captured forward per chunk length: 1, 3, 5
        assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-6, rtol=0)
        assert torch.allclose(session.state[0], h, atol=1e-6, rtol=0)
        assert torch.allclose(session.state[1], c, atol=1e-6, rtol=0)
        session.reset([0])
        out = session(x[:, :2])
        fresh, _ = model(x[0:1, :2])
        assert torch.allclose(out[0:1], fresh, atol=1e-6, rtol=0)
        model.weight_hh_l1.mul_(0.5)  # in place: the captured forwards read it where it lives
        session.reset()
        halved, _ = model(x[:, :1])
        assert torch.allclose(session(x[:, :1]), halved, atol=1e-6, rtol=0)


def _cudnn_plan(module, monkeypatch):
    """Make ``module`` run the cuDNN plan, as the planner picks where cuDNN measured faster."""
    plan_path(module, "cudnn", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw", [("LSTM", dict(num_layers=2, bidirectional=True)),
                                     ("GRU", dict(num_layers=3, batch_first=True)),
                                     ("RNN", dict(nonlinearity="tanh", bias=False))])
def test_gpu_cudnn_plan_replays_torchs_own_numbers_from_a_graph(monkeypatch, kind, kw):
    torch.manual_seed(12)
    theirs = getattr(torch.nn, kind)(7, 48, **kw).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    _cudnn_plan(ours, monkeypatch)
    x = torch.randn(3, 9, 7, device="cuda") if theirs.batch_first else torch.randn(9, 3, 7, device="cuda")
    D = 2 if theirs.bidirectional else 1
    h0 = torch.randn(theirs.num_layers * D, 3, 48, device="cuda")
    hx = (h0, torch.randn_like(h0)) if kind == "LSTM" else h0

    def same(a, b):
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        return all(torch.equal(p, q) for p, q in zip(a, b))

    ops.GRAPHS.clear()
    with torch.no_grad():
        for _ in range(2):  # the capture, then a replay
            (out, state), (want, want_state) = ours(x, hx), theirs(x, hx)
            assert same(out, want) and same(state, want_state)  # bit for bit: the same cuDNN call
        assert len(ops.GRAPHS) == 1
        theirs.weight_hh_l0.mul_(0.5)  # in place: the graph reads the parameters where they live
        assert same(ours(x, hx)[0], theirs(x, hx)[0])
        previous = torch.backends.cudnn.allow_tf32
        try:
            torch.backends.cudnn.allow_tf32 = not previous  # fixed at capture: a graph per setting
            assert same(ours(x, hx)[0], theirs(x, hx)[0]) and len(ops.GRAPHS) == 2
        finally:
            torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.gpu
def test_gpu_stream_session_replays_a_cudnn_plan(monkeypatch):
    torch.manual_seed(13)
    model = persistrnn.LSTM(8, 64, num_layers=2).cuda().eval()
    _cudnn_plan(model, monkeypatch)
    x = torch.randn(6, 2, 8, device="cuda")
    with torch.no_grad():
        whole = torch.nn.LSTM.forward(model, x)[0]  # torch's own forward on the same parameters
        session = model.stream(2)
        parts = [session(x[a:b]) for a, b in ((0, 1), (1, 4), (4, 5), (5, 6))]
    assert len(session._graphs) == 2  # chunk lengths 1 and 3, replayed on the session's buffers
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kw", [("LSTM", dict(num_layers=2, bidirectional=True)),
                                     ("GRU", dict(num_layers=3, batch_first=True)),
                                     ("GRU", dict(reset_after=False, bidirectional=True)),
                                     ("RNN", dict(nonlinearity="relu"))])
@pytest.mark.parametrize("lengths", [[3, 8, 1, 5, 8], [8, 8, 8], [8]])  # unsorted; every sequence full; one
def test_gpu_packed_sequences_run_the_kernels_and_match_float64(untuned, kind, kw, lengths, monkeypatch):
    from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

    torch.manual_seed(9)
    model = getattr(persistrnn, kind)(6, 40, **kw).cuda().eval()
    monkeypatch.setattr(persistrnn.ops, "GRAPHS", persistrnn.runtime.GraphCache(capacity=64))  # empty
    monkeypatch.setattr(persistrnn.ops, "PADDED_LENGTHS", persistrnn.runtime.RecentShapes(window=32, fits=16))
    seqs = [torch.randn(n, 6, device="cuda") for n in lengths]
    packed = pack_sequence(seqs, enforce_sorted=False)
    D = 2 if model.bidirectional else 1
    h0 = torch.randn(model.num_layers * D, len(lengths), 40, device="cuda")
    hx = (h0, torch.randn_like(h0)) if kind == "LSTM" else h0
    with torch.no_grad():
        out, state = model(packed, hx)
    assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
    assert torch.equal(out.batch_sizes, packed.batch_sizes) and torch.equal(out.sorted_indices, packed.sorted_indices)
    # sequences that all run every step are a padded call, replayed from its captured graph
    assert len(persistrnn.ops.GRAPHS) == (min(lengths) == max(lengths))

    def flat(result):
        out, state = result
        return [out.data, *(state if isinstance(state, tuple) else (state,))]

    # Again: with lengths, the padded shape has repeated, so the call replays a forward captured with the
    # lengths as its input; bit for bit the launches' answer, for these lengths and for others.
    with torch.no_grad():
        again = model(packed, hx)
    assert len(persistrnn.ops.GRAPHS) == 1
    assert all(torch.equal(a, b) for a, b in zip(flat(again), flat((out, state)), strict=True))
    if min(lengths) < max(lengths):
        other = pack_sequence([torch.randn(n, 6, device="cuda") for n in [8, 2, 6, 8, 4]], enforce_sorted=False)
        with torch.no_grad():
            replayed = model(other, hx)
        assert len(persistrnn.ops.GRAPHS) == 1
        monkeypatch.setattr(persistrnn.ops, "PADDED_LENGTHS", persistrnn.runtime.RecentShapes(window=32, fits=16))
        with torch.no_grad():
            launched = model(other, hx)  # a shape seen once: its launches
        assert all(torch.equal(a, b) for a, b in zip(flat(replayed), flat(launched), strict=True))
    with torch.no_grad():  # no hx: the zero states the kernels start from, as given zeros
        zero = torch.zeros_like(h0)
        bare, bare_state = model(packed)
        given, given_state = model(packed, (zero, zero) if kind == "LSTM" else zero)
    for a, b in zip((bare.data, *(bare_state if kind == "LSTM" else (bare_state,))),
                    (given.data, *(given_state if kind == "LSTM" else (given_state,)))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # float64 reference: the same module on the CPU (the canonical GRU's own torch path takes padded input)
    ref = copy.deepcopy(model).to("cpu", torch.float64)
    padded, _ = pad_packed_sequence(out, batch_first=model.batch_first)
    hx64 = tuple(s.cpu().double() for s in hx) if isinstance(hx, tuple) else hx.cpu().double()
    with torch.no_grad():
        for b, n in enumerate(lengths):  # one sequence at a time: its own length, no padding
            seq = seqs[b].cpu().double().unsqueeze(0 if model.batch_first else 1)
            h_b = tuple(s[:, b:b + 1] for s in hx64) if isinstance(hx64, tuple) else hx64[:, b:b + 1]
            want, want_state = ref(seq, h_b)
            got = padded[b, :n] if model.batch_first else padded[:n, b]
            assert rel(got.unsqueeze(0 if model.batch_first else 1).double().cpu().numpy(), want.numpy()) <= 1e-5
            got_h = state[0][:, b:b + 1] if isinstance(state, tuple) else state[:, b:b + 1]
            want_h = want_state[0] if isinstance(want_state, tuple) else want_state
            assert rel(got_h.double().cpu().numpy(), want_h.numpy()) <= 1e-5
            rest = padded[b, n:] if model.batch_first else padded[n:, b]
            assert not rest.any()


def test_jit_script_is_refused_naming_the_alternatives():
    with pytest.raises(persistrnn.UnsupportedError, match=r"torch\.compile.*torch\.export.*torch\.jit\.trace"):
        torch.jit.script(persistrnn.LSTM(4, 8))


@pytest.mark.gpu
def test_gpu_flatten_parameters_in_place_updates_and_an_assigned_state_dict_after_a_call(untuned):
    # flatten_parameters moves every weight into one buffer (new addresses), an optimiser-like update
    # changes values in place, load_state_dict(assign=True) replaces the parameters: each call after one
    # of these runs the weights the module has then.
    torch.manual_seed(25)
    model = persistrnn.LSTM(16, 48, num_layers=2).cuda().eval()
    ref = torch.nn.LSTM(16, 48, num_layers=2).double()
    x = torch.randn(9, 4, 16, device="cuda")

    def check(context):
        ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
        with torch.no_grad():
            got = model(x)[0]
        want = ref(x.double().cpu())[0]
        assert float((got.double().cpu() - want).norm() / want.norm()) <= 1e-5, context

    check("first call")
    before = [w.data_ptr() for w in model._flat_weights]
    model.flatten_parameters()
    check("after flatten_parameters")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    check("after an in-place update")
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()}, assign=True)
    assert [w.data_ptr() for w in model._flat_weights] != before
    check("after load_state_dict(assign=True)")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_gpu_jit_trace_records_the_operator_and_the_trace_runs_other_shapes(untuned, kind):
    # A trace once failed inside the planner: under tracing a shape reads as a tensor. The traced model calls
    # persistrnn::forward, so it runs any length and batch, and survives torch.jit.save / load.
    import io

    torch.manual_seed(23)
    model = getattr(persistrnn, kind)(16, 40, num_layers=2, batch_first=True).cuda().eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, (torch.randn(2, 6, 16, device="cuda"),))
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
    assert "persistrnn::forward" in str(traced.graph)
    ref = getattr(torch.nn, kind)(16, 40, num_layers=2, batch_first=True).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    for runner in (traced, loaded):
        for batch, steps in ((3, 9), (1, 4)):
            x = torch.randn(batch, steps, 16, device="cuda")
            with torch.no_grad():
                out, state = runner(x)
            want_out, want_state = ref(x.double().cpu())
            assert out.shape == want_out.shape
            assert float((out.double().cpu() - want_out).norm() / want_out.norm()) <= 1e-5
            h_n, want_h = (state[0], want_state[0]) if kind == "LSTM" else (state, want_state)
            assert float((h_n.double().cpu() - want_h).norm() / want_h.norm()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_gpu_batch_zero_returns_empty_outputs_of_torchs_shapes(untuned, kind, batch_first):
    ours = getattr(persistrnn, kind)(5, 16, num_layers=2, bidirectional=True, batch_first=batch_first).cuda().eval()
    theirs = getattr(torch.nn, kind)(5, 16, num_layers=2, bidirectional=True, batch_first=batch_first).cuda().eval()
    x = torch.randn(0, 7, 5, device="cuda") if batch_first else torch.randn(7, 0, 5, device="cuda")
    with torch.no_grad():
        (out, state), (want, want_state) = ours(x), theirs(x)
    assert out.shape == want.shape
    for s, w in zip(state if isinstance(state, tuple) else (state,), want_state if isinstance(want_state, tuple)
                    else (want_state,)):
        assert s.shape == w.shape and s.dtype == w.dtype and s.device == w.device


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_gpu_autocast_runs_and_returns_torchs_dtype_at_no_worse_an_error(untuned, kind, dtype):
    torch.manual_seed(21)
    ours = getattr(persistrnn, kind)(32, 64, num_layers=2).cuda().eval()
    theirs = getattr(torch.nn, kind)(32, 64, num_layers=2).cuda().eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(12, 3, 32, device="cuda")
    with torch.no_grad():
        want64 = getattr(torch.nn, kind)(32, 64, num_layers=2).double().cuda().eval()
        want64.load_state_dict(ours.state_dict())
        ref = want64(x.double())[0]
        with torch.autocast("cuda", dtype=dtype):
            out, state = ours(x)
            peer, peer_state = theirs(x)
    assert out.dtype == peer.dtype  # fp16 under either autocast: torch casts cuDNN's RNN to half
    h, peer_h = (state[0], peer_state[0]) if kind == "LSTM" else (state, peer_state)
    assert h.dtype == peer_h.dtype
    ref = ref.cpu().numpy()
    err, peer_err = rel(out.double().cpu().numpy(), ref), rel(peer.double().cpu().numpy(), ref)
    # the same rounding of inputs and weights; our error at most 2x torch's (the tolerance rule)
    assert err <= max(2 * peer_err, 1e-5), (err, peer_err)


# ---- parity with torch.nn found by review --------------------------------------------

@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_cpu_autocast_runs_as_torchs_module_does(kind):
    # Under CPU autocast torch's module takes a bf16 input and bf16 states
    # (its dtype check steps aside for autocast); so must ours.
    torch.manual_seed(4)
    theirs = getattr(torch.nn, kind)(4, 5)
    ours = pnn.from_torch(theirs)
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(6, 2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_state = theirs(lin(x))
        got, got_state = ours(lin(x))
        assert got.dtype == want.dtype and torch.equal(got, want)
        again_want, _ = theirs(lin(x), want_state)  # the returned bf16 state fed back
        again_got, _ = ours(lin(x), got_state)
    assert torch.equal(again_got, again_want)


def test_convert_keeps_a_shared_instance_shared():
    shared = torch.nn.LSTM(4, 5)
    model = torch.nn.Module()
    model.a, model.b = shared, shared
    model.seq = torch.nn.Sequential(shared, torch.nn.Identity())
    persistrnn.convert(model)
    assert isinstance(model.a, persistrnn.LSTM) and model.a is model.b is model.seq[0]


def test_from_torch_keeps_the_modules_hooks_and_attributes():
    theirs = torch.nn.GRU(4, 5)
    calls = []
    theirs.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    theirs.tag = "encoder"
    ours = pnn.from_torch(theirs)
    ours(torch.randn(3, 2, 4))
    assert calls == ["GRU"] and ours.tag == "encoder" and type(ours) is persistrnn.GRU


def test_a_stream_session_runs_an_lstm_with_projections():
    torch.manual_seed(5)
    model = persistrnn.LSTM(4, 6, proj_size=3, num_layers=2)
    x = torch.randn(7, 2, 4)
    session = model.stream(2)
    with torch.no_grad():
        whole, _ = model(x)
        parts = torch.cat([session(x[t:t + 1]) for t in range(7)])
    assert parts.shape == (7, 2, 3) and torch.allclose(parts, whole, atol=1e-6, rtol=0)


def test_more_bad_inputs_raise_what_torch_raises():
    from torch.nn.utils.rnn import pack_sequence

    with pytest.raises(ValueError, match="Expected input to be 2D or 3D, got 4D tensor instead"):
        persistrnn.RNN(4, 5)(torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="Expected input to be 2D or 3D, got 4D instead"):
        persistrnn.LSTM(4, 5)(torch.randn(1, 2, 3, 4))
    with pytest.raises(TypeError, match="expected hx to be a tuple \\(h_0, c_0\\), got int"):
        persistrnn.LSTM(4, 5)(torch.randn(3, 2, 4), 3)
    with pytest.raises(ValueError, match="input must have 2 dimensions, got 1"):
        persistrnn.GRU(1, 5)(pack_sequence([torch.randn(3), torch.randn(2)]))


# ---- clipped cells (ONNX clip): the modules' clip argument ------------------------------------------------


CLIPPED_MODULES = [(persistrnn.LSTM, {}), (persistrnn.GRU, {}), (persistrnn.GRU, {"reset_after": False}),
                   (persistrnn.RNN, {"nonlinearity": "relu"}), (persistrnn.RNN, {})]


@pytest.mark.parametrize("cls, kwargs", CLIPPED_MODULES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_clipped_module_on_the_cpu_matches_the_float64_reference_and_differs_from_the_unclipped(cls, kwargs):
    """The CPU path of a clipped cell (torch ops from its spec, autograd through them) against the float64
    reference, two layers both ways, inputs large enough that most gates clip; batch first and unbatched
    give torch's shapes."""
    torch.manual_seed(5)
    m = cls(4, 5, num_layers=2, bidirectional=True, clip=0.3, **kwargs).double()
    assert m.cell.endswith("+clip=0.3") and m.clip == 0.3 and "clip=0.3" in repr(m)
    x = torch.randn(7, 3, 4, dtype=torch.float64) * 3
    out, _ = m(x)
    layers = [[{k: v.detach().numpy() for k, v in d.items()} for d in layer] for layer in pnn._layers(m)]
    want, _ = reference.rnn_forward(m.cell, x.numpy(), layers, num_layers=2, bidirectional=True)
    assert rel(out.detach().numpy(), want) <= 1e-14
    unclipped = cls(4, 5, num_layers=2, bidirectional=True, **kwargs).double()
    unclipped.load_state_dict(m.state_dict())
    assert rel(unclipped(x)[0].detach().numpy(), want) > 1e-2  # the clip changed the answer
    out.sum().backward()  # gradients through the clamp
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    first = cls(4, 5, batch_first=True, clip=0.3, **kwargs)
    assert first(torch.randn(2, 7, 4))[0].shape == (2, 7, 5)
    assert first(torch.randn(7, 4))[0].shape == (7, 5)


def test_clip_must_be_a_positive_finite_float():
    with pytest.raises(ValueError, match=r"clip: expected a positive finite float, got -1.0"):
        persistrnn.LSTM(4, 5, clip=-1.0)
    with pytest.raises(ValueError, match=r"clip: expected a positive finite float, got inf"):
        persistrnn.GRU(4, 5, clip=float("inf"))
    with pytest.raises(TypeError, match=r"clip: expected a positive float, got str"):
        persistrnn.RNN(4, 5, clip="3")
    assert persistrnn.LSTM(4, 5).clip is None and persistrnn.LSTM(4, 5).cell == "lstm"
    assert persistrnn.GRU(4, 5, clip=3).cell == "gru+clip=3.0"


def test_other_activations_on_a_module_run_its_cell_on_the_cpu_and_say_so():
    torch.manual_seed(6)
    m = persistrnn.GRU(4, 5, reset_after=False, clip=0.5, activations=["hardsigmoid(0.2,0.5)", "tanh"]).double()
    assert m.cell == "gru_reset_before+clip=0.5+act=hardsigmoid(0.2,0.5)/tanh"
    assert repr(m) == ("GRU(4, 5, clip=0.5, activations=('hardsigmoid(0.2,0.5)', 'tanh'), reset_after=False)")
    x = torch.randn(6, 2, 4, dtype=torch.float64) * 3
    out, _ = m(x)
    layers = [[{k: v.detach().numpy() for k, v in d.items()} for d in layer] for layer in pnn._layers(m)]
    want, _ = reference.rnn_forward(m.cell, x.numpy(), layers)
    assert rel(out.detach().numpy(), want) <= 1e-14
    assert persistrnn.LSTM(4, 5, activations=("sigmoid", "tanh", "tanh")).activations is None  # its own
    with pytest.raises(TypeError, match="activations: expected a sequence of names, got 'tanh'"):
        persistrnn.RNN(4, 5, activations="tanh")
    with pytest.raises(ValueError, match="expected 3 activation"):
        persistrnn.LSTM(4, 5, activations=["sigmoid", "tanh"])


def test_input_forget_couples_the_lstm_gates_on_the_cpu():
    torch.manual_seed(7)
    m = persistrnn.LSTM(4, 5, input_forget=True).double()
    assert m.cell == "lstm+coupled" and repr(m) == "LSTM(4, 5, input_forget=True)"
    x = torch.randn(6, 2, 4, dtype=torch.float64)
    out, _ = m(x)
    layers = [[{k: v.detach().numpy() for k, v in d.items()} for d in layer] for layer in pnn._layers(m)]
    want, _ = reference.rnn_forward("lstm+coupled", x.numpy(), layers)
    assert rel(out.detach().numpy(), want) <= 1e-14
    with pytest.raises(TypeError, match="input_forget: expected a bool, got int"):
        persistrnn.LSTM(4, 5, input_forget=1)


def test_a_module_pickled_before_clip_and_activations_existed_loads_and_prints():
    m = persistrnn.GRU(3, 4, reset_after=False)
    old = {k: v for k, v in pickle.loads(pickle.dumps(m)).__dict__.items()
           if k not in ("clip", "activations", "input_forget")}
    loaded = persistrnn.GRU.__new__(persistrnn.GRU)
    loaded.__dict__.update(old)
    assert repr(loaded) == "GRU(3, 4, reset_after=False)" and loaded.cell == "gru_reset_before"
    assert loaded(torch.randn(5, 2, 3))[0].shape == (5, 2, 4)


def test_a_module_a_compiled_model_breaks_at_runs_eagerly_with_dynamo_kept_out_of_its_frames(monkeypatch):
    # Without torch's allow_rnn switch Dynamo breaks the graph at an RNN module and runs it eagerly, with
    # its frame callback still set: the module's eager path must not be traced frame by frame (on the GPU
    # that reached the captured replays and failed on their real tensors).
    from persistrnn import nn as ours

    used = []
    real = ours._eager_forward_without_dynamo
    monkeypatch.setattr(ours, "_eager_forward_without_dynamo", lambda: used.append(1) or real())
    torch.manual_seed(2)
    model = torch.nn.Sequential(persistrnn.GRU(6, 10), _First(), torch.nn.Linear(10, 3)).eval()
    x = torch.randn(7, 3, 6)
    with torch.no_grad():
        want = model(x)
        assert not used  # outside torch.compile: the plain eager path
        torch._dynamo.reset()
        got = torch.compile(model)(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert used


class _First(torch.nn.Module):
    def forward(self, pair):
        return pair[0]
