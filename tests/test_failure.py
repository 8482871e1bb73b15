"""A persistent launch in which one block stops taking part (the test-only
hook :func:`persistrnn.runtime.inject_failure`) returns control within the
wait timeout plus 10 ms, raises the error that names the stage that waited,
and leaves the next call unaffected. A module call never synchronises to
check: the failure raises at the next call."""

import time

import pytest
import torch

import persistrnn
from persistrnn import persistent, runtime
from persistrnn.errors import KernelTimeoutError
from persistrnn.plan import tuner

pytestmark = pytest.mark.gpu

TIMEOUT_S = 0.05
SLACK_S = 0.010

CASES = {
    "cluster": (persistent.KernelConfig("lstm", 256, "cluster", 8), 1, "cluster exchange"),
    "grid": (persistent.KernelConfig("lstm", 512, "grid", 32, batch_tile=2, group_size=16), 1, "grid barrier"),
    "tagged grid": (persistent.KernelConfig("lstm", 512, "grid", 32, batch_tile=2, group_size=16,
                                            tagged_exchange=True), 1, "grid barrier"),
    # the second layer's blocks wait for the first layer's outputs: abandon a block of layer 0
    "pipeline": (persistent.KernelConfig("lstm", 128, "cluster", 4, instances=2, pipeline=True), 1,
                 "cluster exchange|previous layer"),
}


@pytest.fixture
def short_timeout():
    saved = runtime.wait_timeout_ns()
    runtime.set_wait_timeout(TIMEOUT_S)
    yield
    runtime.set_wait_timeout(saved / 1e9)


def model_inputs(config, batch=3, steps=64):
    torch.manual_seed(0)
    H, G = config.hidden_size, config.spec.num_gates
    layers = config.instances if config.pipeline else 1
    params = [[{"w_ih": torch.randn(G * H, H, device="cuda") * H ** -0.5,
                "w_hh": torch.randn(G * H, H, device="cuda") * H ** -0.5,
                "b_ih": torch.randn(G * H, device="cuda") * 0.1,
                "b_hh": torch.randn(G * H, device="cuda") * 0.1}] for _ in range(layers)]
    x = torch.randn(steps, batch, H, device="cuda")
    h0 = torch.randn(layers, batch, H, device="cuda")
    return params, x, h0, torch.randn_like(h0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_abandoned_block_fails_the_launch_within_the_timeout(case, short_timeout):
    config, block, stage = CASES[case]
    params, x, h0, c0 = model_inputs(config)
    good = persistent.forward_model(config, params, x, h0, c0)  # compiled, loaded and warm
    with runtime.inject_failure(block):
        # the hook's variant compiled, loaded and warm too: the timing below is the failure's alone
        with pytest.raises(KernelTimeoutError):
            persistent.forward_model(config, params, x, h0, c0, check=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with pytest.raises(KernelTimeoutError, match=stage):
            persistent.forward_model(config, params, x, h0, c0, check=True)
        elapsed = time.perf_counter() - started
    assert elapsed <= TIMEOUT_S + SLACK_S, f"{case}: control came back after {elapsed * 1e3:.1f} ms"
    again = persistent.forward_model(config, params, x, h0, c0, check=True)  # the next launch is clean
    assert all(torch.equal(a, b) for a, b in zip(again, good))


def test_a_module_reports_the_failure_at_its_next_call_without_synchronising(short_timeout):
    model = persistrnn.LSTM(256, 256).cuda().eval()
    config = CASES["cluster"][0]
    shape = model._shape(torch.float32)
    tuner.pin_plan(persistrnn.Plan(shape, 3, "persistent", config, "model", "pinned by the failure test"))
    assert model.plan_for(3).config == config
    x = torch.randn(20, 3, 256, device="cuda")
    try:
        with torch.no_grad():
            want = model(x)[0]
            with runtime.inject_failure(1):
                model(x)  # the kernel fails on the GPU; this call does not read the report
            torch.cuda.synchronize()
            with pytest.raises(KernelTimeoutError, match="cluster exchange"):
                model(x)
            got = model(x)[0]  # the report was cleared: the next call runs normally
        assert torch.equal(got, want)
    finally:
        tuner.clear_cached_plans()
