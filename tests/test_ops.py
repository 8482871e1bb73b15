"""``torch.ops.persistrnn.forward`` and ``torch.compile`` of persistrnn
modules: parameter order and fake shapes on the CPU; agreement, operator
checks and graph breaks on a GPU."""

import re

import pytest
import torch
from helpers import plan_path
from torch._subclasses.fake_tensor import FakeTensorMode

import persistrnn
from persistrnn import ops


def rel(a, b):
    return float((a - b).norm() / b.norm())

MODULES = [
    (persistrnn.LSTM, "lstm", {}),
    (persistrnn.GRU, "gru", {}),
    (persistrnn.GRU, "gru_reset_before", dict(reset_after=False)),
    (persistrnn.RNN, "rnn_tanh", {}),
    (persistrnn.RNN, "rnn_relu", dict(nonlinearity="relu")),
]


def test_launch_settings_change_with_each_setting_a_capture_fixes():
    # Every captured graph is keyed on these: a graph of the old value would
    # replay it (cuDNN's math, cuBLAS's TF32 in a captured projection or
    # backward GEMM, the kernels' wait bound).
    from persistrnn import runtime

    base = ops.launch_settings()
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    # cuBLAS's TF32 through the API this torch reads (fp32_precision from 2.9 on)
    tf32, other = (("fp32_precision", "ieee" if matmul.fp32_precision == "tf32" else "tf32")
                   if hasattr(matmul, "fp32_precision") else ("allow_tf32", not matmul.allow_tf32))
    changed = []
    saved = getattr(matmul, tf32), cudnn.allow_tf32, runtime.wait_timeout_ns() / 1e9
    try:
        setattr(matmul, tf32, other)
        changed.append(ops.launch_settings())
        setattr(matmul, tf32, saved[0])
        cudnn.allow_tf32 = not saved[1]
        changed.append(ops.launch_settings())
        cudnn.allow_tf32 = saved[1]
        runtime.set_wait_timeout(2 * saved[2])
        changed.append(ops.launch_settings())
    finally:
        setattr(matmul, tf32, saved[0])
        cudnn.allow_tf32 = saved[1]
        runtime.set_wait_timeout(saved[2])
    assert ops.launch_settings() == base and len({base, *changed}) == 4


@pytest.mark.skipif(not hasattr(torch.backends.cudnn, "rnn"), reason="torch before 2.9 has one TF32 API")
def test_cudnn_rnn_settings_work_after_a_mix_of_the_legacy_and_new_tf32_apis():
    # torch.backends.cudnn.allow_tf32 (and cudnn.flags, which reads it) raise
    # once cuDNN's conv and RNN flags differ; the library, the benchmarks and
    # the demo read and set cuDNN's RNN precision through runtime instead.
    from persistrnn import runtime

    cudnn = torch.backends.cudnn
    saved = cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.enabled
    try:
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = "ieee", "tf32"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            _ = cudnn.allow_tf32
        assert runtime.cudnn_rnn_precision() == "tf32"
        with runtime.cudnn_rnn_settings(enabled=False, tf32=False):
            assert (runtime.cudnn_rnn_precision(), cudnn.enabled, cudnn.conv.fp32_precision) == ("ieee", False, "ieee")
            assert ops.launch_settings()[:2] == (False, "ieee")
        assert (runtime.cudnn_rnn_precision(), cudnn.enabled) == ("tf32", saved[2])
        with runtime.cudnn_rnn_settings(enabled=True):  # tf32 None: left as it is
            assert runtime.cudnn_rnn_precision() == "tf32" and cudnn.enabled
    finally:
        cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.enabled = saved

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_layer_params_follow_torchs_flat_weight_order(bias, bidirectional):
    m = persistrnn.GRU(5, 7, num_layers=3, bias=bias, bidirectional=bidirectional)
    D = 2 if bidirectional else 1
    layers = ops.layer_params(m._flat_weights, 3, D, bias)
    for l in range(3):
        for d in range(D):
            suffix = f"_l{l}" + ("_reverse" if d else "")
            p = layers[l][d]
            assert p["w_ih"] is getattr(m, "weight_ih" + suffix)
            assert p["w_hh"] is getattr(m, "weight_hh" + suffix)
            if bias:
                assert p["b_ih"] is getattr(m, "bias_ih" + suffix)
                assert p["b_hh"] is getattr(m, "bias_hh" + suffix)
            else:
                assert p["b_ih"].shape == (21,) and not p["b_ih"].any() and not p["b_hh"].any()
    with pytest.raises(ValueError, match=f"expected {3 * D * (4 if bias else 2)} weights .* got "
                                         f"{3 * D * (4 if bias else 2) + 1}"):
        ops.layer_params(m._flat_weights + [m._flat_weights[0]], 3, D, bias)


def _plan(path):
    from persistrnn import plan as planner

    return planner.Plan(planner.ModelShape("lstm", 6, 10), 1, path, None, "tuned", "test")


@pytest.mark.parametrize("cls, cell, kwargs", [m for m in MODULES if m[1] != "gru_reset_before"],
                         ids=[c for _, c, _ in MODULES if c != "gru_reset_before"])
@pytest.mark.parametrize("bidirectional,bias", [(False, True), (True, False)])
def test_run_plan_on_a_cudnn_plan_gives_torchs_numbers(cls, cell, kwargs, bidirectional, bias):
    # torch's RNN function runs on the CPU too: the cuDNN branch is checked against torch's module
    torch.manual_seed(3)
    m = cls(6, 10, num_layers=2, bidirectional=bidirectional, bias=bias, **kwargs)
    D = 2 if bidirectional else 1
    x, h0 = torch.randn(7, 3, 6), torch.randn(2 * D, 3, 10)
    c0 = torch.randn_like(h0) if cell == "lstm" else None
    with torch.no_grad():
        want_out, want_state = m(x, (h0, c0) if c0 is not None else h0)
        out, h_n, c_n = ops.run_plan(_plan("cudnn"), cell, m._flat_weights, x, h0, c0, num_layers=2,
                                     bidirectional=bidirectional, has_biases=bias)
    assert torch.equal(out, want_out)
    assert torch.equal(h_n, want_state[0] if c0 is not None else want_state)
    assert (c_n is None) == (c0 is None) and (c0 is None or torch.equal(c_n, want_state[1]))


def test_run_plan_refuses_lengths_off_the_persistent_path_and_unknown_paths():
    m = persistrnn.LSTM(6, 10)
    x, h0 = torch.randn(4, 2, 6), torch.randn(1, 2, 10)
    kwargs = dict(num_layers=1, bidirectional=False, has_biases=True)
    for path in ("cudnn", "fallback"):
        with pytest.raises(ValueError, match=f"variable lengths run on the persistent path, got a '{path}' plan"):
            ops.run_plan(_plan(path), "lstm", m._flat_weights, x, h0, h0, lengths=torch.tensor([4, 2]), **kwargs)
    with pytest.raises(ValueError, match="expected a persistent, fallback or cudnn plan, got 'elsewhere'"):
        ops.run_plan(_plan("elsewhere"), "lstm", m._flat_weights, x, h0, h0, **kwargs)


@pytest.mark.parametrize("cls, cell, kwargs", MODULES, ids=[c for _, c, _ in MODULES])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fake_forward_has_torchs_output_shapes(cls, cell, kwargs, bidirectional):
    m = cls(6, 10, num_layers=2, bidirectional=bidirectional, **kwargs)
    D = 2 if bidirectional else 1
    with torch.no_grad():
        want_out, want_state = m(torch.randn(7, 3, 6))  # torch's own on the CPU
    has_c = cell == "lstm"
    with FakeTensorMode():
        x = torch.empty(7, 3, 6, device="cuda")
        h0 = torch.empty(2 * D, 3, 10, device="cuda")
        c0 = torch.empty(2 * D, 3, 10, device="cuda") if has_c else None
        weights = [torch.empty(w.shape, device="cuda") for w in m._flat_weights]
        out, h_n, c_n = torch.ops.persistrnn.forward(x, h0, c0, weights, cell, 2, bidirectional, True)
        assert out.shape == want_out.shape and out.device.type == "cuda"
        if has_c:
            assert (h_n.shape, c_n.shape) == (want_state[0].shape, want_state[1].shape)
        else:
            assert h_n.shape == want_state.shape and c_n.numel() == 0


def test_fake_forward_refuses_an_unknown_cell():
    with FakeTensorMode(), pytest.raises(ValueError, match="cell"):
        torch.ops.persistrnn.forward(torch.empty(2, 1, 3, device="cuda"), torch.empty(1, 1, 4, device="cuda"), None,
                                     [], "transformer", 1, False, True)


@pytest.mark.parametrize("wanting", ["x", "h0", "c0", "weights[3]"])
def test_the_operator_refuses_tensors_that_require_grad_naming_them(wanting):
    # No autograd kernel: torch's fallback would leave them without a gradient from it (only a warning).
    m = torch.nn.LSTM(3, 4)
    weights = [w.detach() for w in m._flat_weights]
    args = {"x": torch.randn(2, 1, 3), "h0": torch.randn(1, 1, 4), "c0": torch.randn(1, 1, 4)}
    leaf = weights[3] if wanting == "weights[3]" else args[wanting]
    leaf.requires_grad_(True)
    with pytest.raises(persistrnn.UnsupportedError, match=re.escape(f"but {wanting} require(s) grad")):
        torch.ops.persistrnn.forward(*args.values(), weights, "lstm", 1, False, True)
    with torch.no_grad(), pytest.raises(persistrnn.ArgumentError, match="expected CUDA tensors"):
        torch.ops.persistrnn.forward(*args.values(), weights, "lstm", 1, False, True)


def test_compiling_a_model_on_the_cpu_runs_torchs_implementation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), persistrnn.GRU(8, 16, batch_first=True)).eval()
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        want = model(x)[0]
        got = torch.compile(model, backend="eager")(x)[0]
    torch.testing.assert_close(got, want)


# ---- on a GPU -----------------------------------------------------------------


class Classifier(torch.nn.Module):
    """Embedding-like projection, a persistrnn recurrent layer, a linear head."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, rnn.input_size)
        self.rnn = rnn
        self.head = torch.nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.proj(x))
        return self.head(out[:, -1])


GPU_MODELS = [
    (persistrnn.LSTM, dict(num_layers=2)),
    (persistrnn.GRU, dict(bidirectional=True)),
    (persistrnn.GRU, dict(reset_after=False)),
    (persistrnn.RNN, dict(num_layers=3, nonlinearity="relu")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cls, kwargs", GPU_MODELS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_torch_compile_matches_eager_without_graph_breaks(cls, kwargs, untuned):
    torch.manual_seed(1)
    model = Classifier(cls(16, 32, batch_first=True, **kwargs)).cuda().eval()
    x = torch.randn(4, 9, 12, device="cuda")
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        want = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_converted_torch_model_compiles_without_graph_breaks(untuned):
    # The one-line change (persistrnn.convert of a torch model), then torch.compile: its modules share torch's
    # parameters, and the compiled forward reads them as torch's forward does.
    from helpers import exact_torch

    torch.manual_seed(2)
    model = Classifier(torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)).cuda().eval()
    x = torch.randn(4, 9, 12, device="cuda")
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True), exact_torch():
        want = model(x)
        persistrnn.convert(model)
        assert isinstance(model.rnn, persistrnn.LSTM)
        model(x)  # an eager call first, as a user's warm-up would
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_torch_compile_under_inference_mode_then_no_grad(untuned):
    # A compiled serving model called under torch.inference_mode(), then the same shapes under no_grad.
    torch.manual_seed(4)
    model = Classifier(persistrnn.LSTM(16, 32, num_layers=2, batch_first=True)).cuda().eval()
    compiled = torch.compile(model)
    with torch._dynamo.config.patch(allow_rnn=True):
        for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
            x = torch.randn(3, 7, 12, device="cuda")
            with mode():
                got = compiled(x)
            with torch.no_grad():
                want = model(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_reduce_overhead_with_repeated_and_changing_shapes(untuned, monkeypatch, path, dynamic):
    # mode="reduce-overhead" (CUDA-graph trees) clears torch's cuBLAS workspaces around every warm-up and
    # recording. A forward of ours captured with the shared workspace of its stream then replayed into freed
    # memory: an illegal address at the next eager call, every run.
    torch.manual_seed(5)
    model = Classifier(persistrnn.LSTM(16, 32, num_layers=2, batch_first=True)).cuda().eval()
    plan_path(model.rnn, path, monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=dynamic)
    with torch._dynamo.config.patch(allow_rnn=True), torch.no_grad():
        for B, T in ((3, 7), (3, 7), (3, 7), (5, 7), (3, 11), (1, 4), (5, 7), (3, 7), (2, 9), (3, 7)):
            x = torch.randn(B, T, 12, device="cuda")
            got = compiled(x).clone()  # the trees' outputs are overwritten by their next replay
            want = model(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_compile_under_autocast_gives_the_eager_calls_outputs(untuned, monkeypatch, path, dtype):
    # Mixed-precision serving: a compiled model called under CUDA autocast, every path.
    torch.manual_seed(8)
    model = Classifier(persistrnn.LSTM(16, 32, num_layers=2, batch_first=True)).cuda().eval()
    plan_path(model.rnn, path, monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch._dynamo.config.patch(allow_rnn=True), torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        for _ in range(3):
            x = torch.randn(3, 7, 12, device="cuda")
            got, want = compiled(x), model(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback"])
def test_forwards_evicted_from_a_full_cache_leave_the_others_intact(untuned, monkeypatch, path):
    # Three shapes through a cache of two: every call captures one forward and frees another, on streams
    # that earlier captures used too, each graph with its own cuBLAS GEMMs.
    monkeypatch.setattr(ops, "GRAPHS", persistrnn.runtime.GraphCache(capacity=2))
    torch.manual_seed(7)
    model = persistrnn.LSTM(16, 32, num_layers=2).cuda().eval()
    plan_path(model, path, monkeypatch)
    twin = torch.nn.LSTM(16, 32, num_layers=2).double()
    twin.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    for _ in range(4):
        for batch in (2, 3, 5):
            x = torch.randn(6, batch, 16, device="cuda")
            with torch.no_grad():
                got = model(x)[0]
            want = twin(x.double().cpu())[0]
            assert float((got.double().cpu() - want).norm() / want.norm()) <= 1e-5
    assert len(ops.GRAPHS) == 2


@pytest.mark.gpu
def test_torch_compile_without_torchs_rnn_switch_still_agrees(untuned):
    torch.manual_seed(3)
    model = Classifier(persistrnn.LSTM(16, 32, batch_first=True)).cuda().eval()
    x = torch.randn(2, 5, 12, device="cuda")
    with torch.no_grad():
        want = model(x)
        torch._dynamo.reset()
        got = torch.compile(model)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("cell, bidirectional", [("lstm", False), ("gru", True), ("rnn_tanh", False)])
def test_operator_passes_torchs_operator_checks(cell, bidirectional, untuned):
    torch.manual_seed(2)
    D = 2 if bidirectional else 1
    kind = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN}[cell]
    m = kind(8, 24, num_layers=2, bidirectional=bidirectional).cuda()
    x = torch.randn(6, 3, 8, device="cuda")
    h0 = torch.randn(2 * D, 3, 24, device="cuda")
    c0 = torch.randn(2 * D, 3, 24, device="cuda") if cell == "lstm" else None
    weights = [w.detach() for w in m._flat_weights]
    args = (x, h0, c0, weights, cell, 2, bidirectional, True)
    torch.library.opcheck(torch.ops.persistrnn.forward, args)
    out, h_n, c_n = torch.ops.persistrnn.forward(*args)
    # Against torch's module in float64 on the CPU (cuDNN itself runs TF32
    # by default: ~1e-4, above the fp32 budget).
    ref = m.to("cpu", torch.float64)
    with torch.no_grad():
        hx = tuple(s.cpu().double() for s in (h0, c0)) if c0 is not None else h0.cpu().double()
        want_out, want_state = ref(x.cpu().double(), hx)
    want_h = want_state[0] if c0 is not None else want_state
    assert rel(out.cpu().double(), want_out) <= 1e-5
    assert rel(h_n.cpu().double(), want_h) <= 1e-5
    if c0 is not None:
        assert rel(c_n.cpu().double(), want_state[1]) <= 1e-5
    else:
        assert c_n.numel() == 0


def test_a_call_spreads_its_copies_only_where_its_plans_timing_says_it_is_device_bound():
    """``ops._device_bound``: the tuner's timing of the plan's own choice,
    scaled to the call's steps, against ``runtime.DEVICE_BOUND_US``; an
    untimed plan keeps the one multi-tensor copy."""
    from persistrnn import runtime
    from persistrnn.plan import ModelShape, tuner

    shape = ModelShape("lstm", 64, 64, 1, "float32", False)
    bound_ms = runtime.DEVICE_BOUND_US / 1e3
    timed = tuner.Plan(shape, 10, "cudnn", None, "tuned", "timed", measured_ms={"cudnn": bound_ms}, steps=100)
    assert ops._device_bound(timed, 100)  # exactly at the bound
    assert ops._device_bound(timed, 200)
    assert not ops._device_bound(timed, 99)
    assert not ops._device_bound(tuner.Plan(shape, 10, "cudnn", None, "model", "untimed"), 10_000)


@pytest.mark.gpu
def test_gpu_a_short_sequence_runs_its_plans_short_path_in_a_call_a_stream_and_a_packed_call(monkeypatch, untuned):
    """A plan whose short path is cuDNN for at most 2 steps: calls of 1 and 2
    steps run cuDNN, 5 steps the persistent kernel, in a module call, a
    stream session's chunks (the carried states across paths) and a packed
    call; every output against float64."""
    from helpers import assert_close_to_reference, exact_torch

    from persistrnn import plan as planner
    from persistrnn import persistent, runtime

    torch.manual_seed(11)
    model = persistrnn.LSTM(24, 40).cuda().eval()
    exact = torch.nn.LSTM(24, 40).double()
    exact.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    config = persistent.default_config("lstm", 40, 3, sm_count=runtime.device_facts().sm_count)
    planner.pin_plan(planner.Plan(model._shape(torch.float32), 3, "persistent", config, "model", "pinned",
                                  short_path="cudnn", short_steps=2))
    ran = []
    real = ops.run_plan
    monkeypatch.setattr(ops, "run_plan", lambda chosen, *a, **k: (ran.append(chosen.path), real(chosen, *a, **k))[1])

    def check(got, want, context):
        assert_close_to_reference(got.detach(), want.detach(), dtype="float32", context=context)

    with torch.no_grad(), exact_torch():  # cuDNN without TF32: the tolerance rule's fp32
        for steps, path in ((1, "cudnn"), (2, "cudnn"), (5, "persistent")):
            x, h0, c0 = torch.randn(steps, 3, 24, device="cuda"), torch.randn(1, 3, 40), torch.randn(1, 3, 40)
            ran.clear()
            out, (h_n, c_n) = model(x, (h0.cuda(), c0.cuda()))
            assert set(ran) == {path}, (steps, ran)
            want, (want_h, want_c) = exact(x.double().cpu(), (h0.double(), c0.double()))
            check(out.cpu(), want, f"{steps} steps")
            check(h_n.cpu(), want_h, f"{steps} steps, h_n")
            check(c_n.cpu(), want_c, f"{steps} steps, c_n")
        # A stream of chunks of 1, 2 and 5 steps: each chunk's path by its length, the states carried across.
        session = model.stream(3)
        x = torch.randn(8, 3, 24, device="cuda")
        outs = []
        for start, stop, path in ((0, 1, "cudnn"), (1, 3, "cudnn"), (3, 8, "persistent")):
            ran.clear()
            outs.append(session(x[start:stop]))
            assert set(ran) == {path}, (start, stop, ran)
        want, _ = exact(x.double().cpu())
        check(torch.cat(outs).cpu(), want, "stream")
        # Packed: the padded length decides (2 steps: cuDNN through torch's own packed call, which run_plan does not
        # see; 5 steps: the kernels with each sequence's length).
        for lengths, path in (([2, 1, 2], None), ([5, 3, 1], "persistent")):
            x = torch.randn(max(lengths), 3, 24, device="cuda")
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
            ran.clear()
            out, _ = model(packed)
            assert set(ran) == ({path} if path else set()), (lengths, ran)
            want, _ = exact(torch.nn.utils.rnn.pack_padded_sequence(x.double().cpu(), torch.tensor(lengths),
                                                                     enforce_sorted=False))
            check(torch.nn.utils.rnn.pad_packed_sequence(out)[0].cpu(),
                  torch.nn.utils.rnn.pad_packed_sequence(want)[0], f"packed {lengths}")


def test_a_call_with_lengths_is_captured_once_its_padded_shape_repeats(monkeypatch):
    """``ops.forward`` with lengths (a packed batch), on the CPU with the
    graph cache, the plan and the launches emulated: the lengths are checked
    on the host and reach the launches; the first call of a padded shape
    runs its launches, a repeat replays a graph captured with the lengths as
    its input (its own key beside the call without lengths), and a shape
    among more recent ones than fit the cache is not captured."""
    from persistrnn import runtime
    from persistrnn.plan import ModelShape

    launched, replayed = [], []

    def run_plan(chosen, cell, weights, x, h0, c0, *, lengths, **options):
        launched.append(lengths)
        return x, x, None

    class Graphs:
        def call(self, key, make, device, *args, on_replay=None):
            replayed.append((key, args[3]))
            return list(args[:2])

    shape = ModelShape("gru", 3, 4, 1, "float32", False)
    plan = type("Plan", (), {"for_steps": lambda self, steps: type("Chosen", (), {"launch": None})()})()
    monkeypatch.setattr(ops, "run_plan", run_plan)
    monkeypatch.setattr(ops, "GRAPHS", Graphs())
    monkeypatch.setattr(ops, "PADDED_LENGTHS", runtime.RecentShapes(window=4, fits=2))
    monkeypatch.setattr(runtime, "raise_reported_failure", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(runtime, "to_device_async", lambda tensor, device: tensor)
    x = type("X", (), {"shape": (5, 2, 3), "device": type("D", (), {"index": 0})(), "dtype": torch.float32})()
    weights = [torch.zeros(12, 3), torch.zeros(12, 4)]

    def call(lengths, steps=5):
        x.shape = (steps, 2, 3)
        return ops.forward(shape, weights, x, None, None, True, lambda batch: plan, lengths=lengths)

    call(torch.tensor([5, 2]))
    assert len(launched) == 1 and launched[0].dtype == torch.int32 and not replayed  # seen once: launched
    call(torch.tensor([3, 5], dtype=torch.int32))
    assert len(launched) == 1 and torch.equal(replayed[-1][1], torch.tensor([3, 5], dtype=torch.int32))
    call(None)
    assert replayed[-1][1] is None and replayed[-1][0] != replayed[-2][0]  # without lengths: a key of its own
    call(torch.tensor([4, 1]), steps=4)
    call(torch.tensor([3, 1]), steps=3)  # three padded shapes among the last four calls: none captured
    call(torch.tensor([5, 1]))
    assert len(launched) == 4 and len(replayed) == 2
    with pytest.raises(ValueError, match=r"lengths: expected every length in 1\.\.5 .* got lengths from 0 to 5"):
        call(torch.tensor([5, 0]))
    with pytest.raises(TypeError, match="lengths: expected a torch.int64 or torch.int32 tensor, got torch.float32"):
        call(torch.tensor([5.0, 1.0]))
