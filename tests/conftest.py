"""Test configuration: the ``gpu`` marker, an isolated kernel cache, plans
without tuning, a synthetic cost-model calibration for every GPU test, and
training on persistrnn's operators wherever a module asks for them."""

import pytest


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU; torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    if torch.cuda.get_device_capability()[0] < 9:
        return (f"needs compute capability >= 9.0; {torch.cuda.get_device_name()} is "
                f"{torch.cuda.get_device_capability()}")
    return None


def pytest_configure(config):
    config.addinivalue_line("markers",
                            "gpu: needs a Hopper (sm_90+) GPU; skipped with the reason where none is present")
    config.addinivalue_line("markers", "real_calibration: a GPU test of the calibration itself, which runs the "
                                       "micro-benchmarks instead of the synthetic calibration")


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


@pytest.fixture(scope="session")
def _tuning_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tuning")


@pytest.fixture(autouse=True)
def synthetic_cost_model(request, monkeypatch, _tuning_dir):
    """Every GPU test plans with a synthetic calibration
    (:func:`helpers.synthetic_calibration`, for the current device's name and
    SM count) instead of running the ~19 s of micro-benchmarks: correctness
    must not depend on timing, and the calibration only ranks configurations.
    Tests of the calibration itself opt out with ``real_calibration``.

    Plans tuned from a synthetic ranking must not reach the user's tuning
    cache, where a later real run would reuse them: the tuning cache of these
    tests lives in a temporary folder for the session (the kernel cache stays
    shared, so compiled binaries are reused); a test with its own cache
    folder keeps it."""
    if request.node.get_closest_marker("gpu") is None or request.node.get_closest_marker("real_calibration"):
        yield None
        return
    from helpers import synthetic_calibration

    from persistrnn import __version__, runtime
    from persistrnn.plan import model as cost
    from persistrnn.plan import tuner

    made = {}

    def calibration(*, progress=True, refresh=False, tiles=None):
        facts = runtime.device_facts()  # read on use: the fixture itself never touches the GPU
        key = (facts.name, facts.sm_count)
        if key not in made:
            made[key] = synthetic_calibration(device=facts.name, sm_count=facts.sm_count, version=__version__)
        return made[key]

    real_cache_path, users = tuner.cache_path, runtime.cache_dir()

    def cache_path(key):
        # a test's own cache (isolated_cache) stays where the test put it
        return _tuning_dir / real_cache_path(key).name if runtime.cache_dir() == users else real_cache_path(key)

    monkeypatch.setattr(cost, "calibration", calibration)
    monkeypatch.setattr(tuner, "cache_path", cache_path)
    yield calibration


@pytest.fixture(autouse=True)
def training_runs_persistrnn(monkeypatch):
    """A module with ``training_kernels`` trains on persistrnn's operators in
    every test, whatever timing them against cuDNN would choose: the timing
    is replaced by one where they are faster, and no choice is kept between
    tests. Tests of the choice itself put their own timing in."""
    from persistrnn import training

    monkeypatch.setattr(training, "_time_training_steps", lambda module, x: (1.0, 2.0))
    monkeypatch.setattr(training, "_TRAINING_CHOICES", {})


@pytest.fixture
def untuned(monkeypatch):
    """Plans from the cost model alone: quick, untimed, and never cuDNN (a
    tuned plan may send a shape to cuDNN, which these tests do not test); the
    persistent kernels where a configuration fits, else the fallback.

    ``cached_plan`` (every module and operator call) calls the tuner's
    module-global ``plan``, and ``persistrnn.plan.tune``/``explain`` the
    package's: both are replaced. The disk cache is bypassed (it may hold a
    tuned cuDNN choice), and the in-process plans are forgotten before and
    after, so no plan crosses into or out of the test."""
    from persistrnn import plan as planner
    from persistrnn.plan import tuner

    real = tuner.plan

    def untimed(shape, batch, tune=True, **kw):
        kw.pop("refresh", None)
        return real(shape, batch, tune=False, refresh=True, **kw)

    monkeypatch.setattr(tuner, "plan", untimed)
    monkeypatch.setattr(planner, "plan", untimed)
    planner.clear_cached_plans()
    yield
    planner.clear_cached_plans()
