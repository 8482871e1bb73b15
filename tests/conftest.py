"""Test configuration: the ``gpu`` marker and an isolated kernel cache."""

import pytest


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU; torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    if torch.cuda.get_device_capability()[0] < 9:
        return f"needs compute capability >= 9.0; {torch.cuda.get_device_name()} is {torch.cuda.get_device_capability()}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper (sm_90+) GPU; skipped with the reason where none is present")


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh, empty kernel cache for tests that inspect cache behaviour."""
    monkeypatch.setenv("PERSISTRNN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def untuned(monkeypatch):
    """Plans from the cost model alone: quick, and always a kernel path (a
    tuned plan may send a shape to cuDNN, which these tests do not test)."""
    from persistrnn import ops
    from persistrnn import plan as planner

    real = planner.plan
    monkeypatch.setattr(planner, "plan", lambda shape, batch, tune=True, **kw: real(shape, batch, tune=False, **kw))
    monkeypatch.setattr(ops, "_PLANS", {})  # the operator's plans, looked up afresh
