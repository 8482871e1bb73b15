"""A model on another GPU than the current one: one process that serves or
trains models on several GPUs (model parallelism, one model per GPU) calls
each where its tensors are, whatever ``torch.cuda.current_device()`` is, as
torch's modules do. Needs two GPUs; skipped with the reason elsewhere."""

import pytest
import torch
from helpers import assert_close_to_reference, exact_torch, plan_path

import persistrnn


@pytest.fixture
def first_gpu_current():
    """Two GPUs, the first one current (skipped with the reason elsewhere)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(0)


def _float64_twin(model):
    twin = getattr(torch.nn, type(model).__name__)(model.input_size, model.hidden_size,
                                                    num_layers=model.num_layers, bidirectional=model.bidirectional,
                                                    batch_first=model.batch_first).double()
    twin.load_state_dict({k: v.detach().double().cpu() for k, v in model.state_dict().items()})
    return twin


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["persistent", "fallback", "cudnn"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_gpu_a_model_on_the_second_gpu_infers_there_from_the_first_as_current(untuned, first_gpu_current,
                                                                              monkeypatch, kind, path):
    torch.manual_seed(31)
    model = getattr(persistrnn, kind)(16, 48, num_layers=2, bidirectional=True).to("cuda:1").eval()
    plan_path(model, path, monkeypatch)
    twin = _float64_twin(model)
    for call in range(3):  # captured, then replayed (natively where the library has loaded)
        x = torch.randn(9, 3, 16, device="cuda:1")
        with torch.no_grad(), exact_torch():
            out, state = model(x)
        want_out, want_state = twin(x.double().cpu())
        h_n, want_h = (state[0], want_state[0]) if kind == "LSTM" else (state, want_state)
        assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
        assert_close_to_reference({"out": out, "h_n": h_n}, {"out": want_out, "h_n": want_h}, dtype="float32",
                                  context=f"{kind} {path} call {call}")


@pytest.mark.gpu
def test_gpu_two_models_one_per_gpu_called_in_turn_from_one_thread(untuned, first_gpu_current):
    torch.manual_seed(32)
    models = [persistrnn.LSTM(16, 64).to(f"cuda:{d}").eval() for d in (0, 1)]
    twins = [_float64_twin(m) for m in models]
    for call in range(4):
        for d, (model, twin) in enumerate(zip(models, twins)):
            x = torch.randn(7, 2, 16, device=f"cuda:{d}")
            with torch.no_grad():
                out = model(x)[0]
            want = twin(x.double().cpu())[0]
            assert_close_to_reference(out, want, dtype="float32", context=f"GPU {d} call {call}")


@pytest.mark.gpu
def test_gpu_a_model_on_the_second_gpu_trains_there(untuned, first_gpu_current):
    torch.manual_seed(33)
    model = persistrnn.GRU(16, 40, num_layers=2).to("cuda:1").train()
    model.training_kernels = True
    twin = _float64_twin(model)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        x = torch.randn(8, 3, 16, device="cuda:1", requires_grad=True)
        weights = torch.randn(8, 3, 40, dtype=torch.float64)
        (model(x)[0].double().cpu() * weights).sum().backward()
        x64 = x.detach().double().cpu().requires_grad_()
        (twin(x64)[0] * weights).sum().backward()
        names = ["x", *model._flat_weights_names]
        got = [x.grad, *(w.grad for w in model._flat_weights)]
        want = [x64.grad, *(getattr(twin, n).grad for n in model._flat_weights_names)]
        assert_close_to_reference(dict(zip(names, got)), dict(zip(names, want)), dtype="float32",
                                  context=f"step {step}")


@pytest.mark.gpu
def test_gpu_the_operator_and_a_stream_session_on_the_second_gpu(untuned, first_gpu_current):
    torch.manual_seed(34)
    model = persistrnn.LSTM(16, 32).to("cuda:1").eval()
    twin = _float64_twin(model)
    x = torch.randn(10, 2, 16, device="cuda:1")
    want = twin(x.double().cpu())[0]
    with torch.no_grad():
        for _ in range(3):
            out = torch.ops.persistrnn.forward(x, None, None, list(model._flat_weights), "lstm", 1, False, True)[0]
            assert_close_to_reference(out, want, dtype="float32", context="operator")
        session = persistrnn.StreamSession(model, batch_size=2)
        chunks = [session(x[i:i + 5]) for i in (0, 5)]
    assert_close_to_reference(torch.cat(chunks), want, dtype="float32", context="stream session")
