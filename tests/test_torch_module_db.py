"""PyTorch's own test data for ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``, run
against persistrnn's modules.

``torch.testing._internal.common_modules.module_db`` holds, per module, what
torch's ``test/test_modules.py`` runs: samples (``module_inputs_func``:
constructor and forward arguments, here with the packed-sequence samples that
torch's own tests ask for) and inputs that must fail
(``module_error_inputs_func``: the exception type and a message regex). Each is
built here as ``test_modules.py`` builds torch's module, with our class in its
place: ``cls(*constructor_input.args, **constructor_input.kwargs)``, then
``.to(device).to(dtype)``, then ``m(*forward_input.args, **forward_input.kwargs)``;
the torch module beside it has the same weights (ours loads its state_dict).

CPU (CI): every error case raises torch's exception type with a message
matching torch's regex; every sample, in torch's dtypes for these modules
(float32, float64), in eval and training mode, gives torch's outputs and
gradients exactly (our CPU path is torch's), agrees with the sample's own
reference (the same call with a batch dimension), and survives pickle and
deepcopy. The GPU configurations these samples pin compile for sm_90.

GPU: every sample in fp32, fp16 and bf16, under ``torch.no_grad()``, on each
path the plan can choose (pinned, not tuned: persistent kernels in one block,
in a cluster, fused layers or both directions at once, tensor cores in 16
bits; the fallback; cuDNN), against the float64 reference with torch's CUDA
module as the peer of the tolerance rule (tests/helpers.py); with gradients
enabled (torch's path: torch's outputs, and its gradients); and after pickle,
deepcopy and a cpu -> cuda -> cpu round trip. The error cases run on CUDA too.

``python -m pytest tests/test_torch_module_db.py -q`` lists the case counts
(:func:`test_torchs_samples_are_all_here` prints them with ``-s``).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
import sys

import pytest
import torch
from helpers import assert_close_to_reference, exact_torch
from torch.nn.utils.rnn import PackedSequence

import persistrnn

OURS = {torch.nn.LSTM: persistrnn.LSTM, torch.nn.GRU: persistrnn.GRU, torch.nn.RNN: persistrnn.RNN}


def _torch_test_data() -> tuple[dict, type]:
    """module_db's ModuleInfo of each of the three modules, by name, and
    torch's enum of where an error input fails.

    Importing torch's test package changes the whole process, and so every
    other test in it: it freezes ``torch.backends`` flags (an assignment such
    as ``torch.backends.cudnn.allow_tf32 = False``, which the benchmarks and
    other tests make, then raises) and wraps TorchScript calls. Both are put
    back. It imports ``expecttest`` only for the base class of torch's
    TestCase, which nothing here uses: where that package is absent (a
    machine without it and without a network) a stand-in takes its place."""
    import types
    import unittest

    import torch.backends

    frozen = torch.backends.flags_frozen()
    script_calls = torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase, stand_in.ACCEPT = unittest.TestCase, False
        sys.modules["expecttest"] = stand_in
    try:
        from torch.testing._internal.common_modules import ModuleErrorEnum, module_db
    finally:
        if not frozen:  # the flag is a global of torch.backends' own module dict
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = script_calls
    infos = {info.module_cls.__name__: info for info in module_db if info.module_cls in OURS}
    return infos, ModuleErrorEnum


INFOS, ModuleErrorEnum = _torch_test_data()
CPU_DTYPES = ("float32", "float64")  # the dtypes torch's ModuleInfo lists for these modules
GPU_DTYPES = ("float32", "float16", "bfloat16")


def samples(name: str, device: str, dtype: torch.dtype, *, requires_grad: bool = False, training: bool = False):
    """torch's samples for module ``name``, with the packed-sequence ones
    (torch's test_modules asks for them in its RNN tests; the LSTM's function
    has none and ignores the flag)."""
    info = INFOS[name]
    return info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=requires_grad, training=training,
                                   with_packed_sequence=True)


def error_inputs(name: str, device: str):
    info = INFOS[name]
    return info.module_error_inputs_func(info, device=device, dtype=torch.float32, requires_grad=False,
                                         training=False)


# Collected once, on the CPU: the counts and the description of every case.
# A GPU case regenerates its sample on the GPU by index (the functions build
# the same list on every device and dtype).
SAMPLES = {name: samples(name, "cpu", torch.float32) for name in INFOS}
ERRORS = {name: error_inputs(name, "cpu") for name in INFOS}


def _describe(sample) -> str:
    kw = sample.constructor_input.kwargs
    parts = [f"H{kw['hidden_size']}"]
    parts += [k for k in ("bias", "batch_first", "bidirectional") if kw.get(k)]
    if kw.get("proj_size"):
        parts.append(f"proj{kw['proj_size']}")
    if "nonlinearity" in kw:
        parts.append(kw["nonlinearity"])
    args = sample.forward_input.args
    parts.append("packed" if isinstance(args[0], PackedSequence) else "unbatched")
    if len(args) > 1:
        parts.append("hx")
    return "-".join(parts)


def _is_projected(sample) -> bool:
    return bool(sample.constructor_input.kwargs.get("proj_size"))


def _is_packed(sample) -> bool:
    return isinstance(sample.forward_input.args[0], PackedSequence)


SAMPLE_IDS = [(name, i, _describe(s)) for name, group in SAMPLES.items() for i, s in enumerate(group)]
ERROR_IDS = [(name, i, e.error_type.__name__) for name, group in ERRORS.items() for i, e in enumerate(group)]


# ---- helpers -----------------------------------------------------------------


def build(name: str, sample, device: str, dtype: torch.dtype):
    """(torch's module, ours with its weights), built as test_modules.py builds them."""
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    theirs = INFOS[name].module_cls(*args, **kwargs).to(device).to(dtype)
    ours = OURS[INFOS[name].module_cls](*args, **kwargs).to(device).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _map(fn, value):
    """``fn`` over every tensor in a forward argument (tuples and PackedSequences included)."""
    if isinstance(value, PackedSequence):
        return PackedSequence(fn(value.data), value.batch_sizes, value.sorted_indices, value.unsorted_indices)
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    return value


def outputs(result) -> dict[str, torch.Tensor]:
    """A module's (output, state) as named tensors (a PackedSequence by its data)."""
    out, state = result
    states = state if isinstance(state, tuple) else (state,)
    named = {"output": out.data if isinstance(out, PackedSequence) else out, "h_n": states[0]}
    if len(states) == 2:
        named["c_n"] = states[1]
    return named


def assert_same_structure(got, want) -> None:
    """Same kinds, shapes, dtypes and devices; packed outputs packed alike."""
    assert type(got[0]) is type(want[0]), (type(got[0]), type(want[0]))
    if isinstance(want[0], PackedSequence):
        assert torch.equal(got[0].batch_sizes, want[0].batch_sizes)
        for field in ("sorted_indices", "unsorted_indices"):
            a, b = getattr(got[0], field), getattr(want[0], field)
            assert (a is None and b is None) or torch.equal(a, b), field
    assert isinstance(got[1], tuple) == isinstance(want[1], tuple)
    ours, theirs = outputs(got), outputs(want)
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for key, b in theirs.items():
        a = ours[key]
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), (key, a.shape, b.shape, a.dtype, b.dtype)


def assert_equal_outputs(got, want, context: str) -> None:
    """Bit-for-bit equal outputs (the same implementation on the same inputs)."""
    assert_same_structure(got, want)
    for key, a in outputs(got).items():
        torch.testing.assert_close(a, outputs(want)[key], rtol=0, atol=0,
                                   msg=lambda m, key=key: f"{context}, {key}: {m}")


def float64_reference(theirs, args, kwargs):
    """torch's module in float64 on the CPU, on the same (rounded) weights and inputs."""
    reference = copy.deepcopy(theirs).to("cpu", torch.float64)
    with torch.no_grad():
        return reference(*_map(lambda t: t.detach().to("cpu", torch.float64), args), **kwargs)


def gradient_inputs(args) -> list[torch.Tensor]:
    found = []
    _map(lambda t: found.append(t) if t.requires_grad else None, args)
    return found


def gradients(module, result, inputs, weights):
    """d(sum of every output times a fixed weight)/d(inputs and parameters)."""
    loss = sum((t * w).sum() for t, w in zip(outputs(result).values(), weights))
    return torch.autograd.grad(loss, [*inputs, *module.parameters()], allow_unused=True)


def seeded() -> int:
    """A fresh seed per run (random inputs on every check), set and reported."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


# ---- the data is there --------------------------------------------------------


def test_torchs_samples_are_all_here():
    # The cases below are generated from module_db: an empty function would
    # leave them vacuous, so its presence and shape are checked first.
    assert set(INFOS) == {"LSTM", "GRU", "RNN"}
    for name in INFOS:
        assert ERRORS[name] and SAMPLES[name], name
        # both constructor and forward errors, and every sample is torch's unbatched or packed input
        assert {e.error_on for e in ERRORS[name]} == {ModuleErrorEnum.CONSTRUCTION_ERROR,
                                                        ModuleErrorEnum.FORWARD_ERROR}
        assert all(_is_packed(s) or s.forward_input.args[0].dim() == 2 for s in SAMPLES[name])
    assert any(_is_projected(s) for s in SAMPLES["LSTM"]) and any(_is_packed(s) for s in SAMPLES["GRU"])
    paths = sum(len(gpu_paths(s, d)) for name in INFOS for s in SAMPLES[name] for d in GPU_DTYPES)
    print(f"\nmodule_db: {sum(map(len, ERRORS.values()))} error cases, {sum(map(len, SAMPLES.values()))} samples "
          f"({', '.join(f'{n} {len(SAMPLES[n])}' for n in INFOS)}); GPU forward cases (sample x dtype x path): "
          f"{paths}")


def test_importing_torchs_test_data_left_torchs_flags_assignable():
    # Other tests and the benchmarks assign torch.backends flags directly,
    # which raises while torch's test package has them frozen.
    assert not torch.backends.flags_frozen()
    torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32


# ---- CPU ----------------------------------------------------------------------


@pytest.mark.parametrize("name, index, kind", ERROR_IDS, ids=[f"{n}-{i}-{k}" for n, i, k in ERROR_IDS])
def test_error_inputs_raise_torchs_error(name, index, kind):
    check_error_input(name, error_inputs(name, "cpu")[index])


def check_error_input(name, error):
    """As test_modules.py's test_errors, with our class: the type (or a
    subclass), and a message that ``re.search`` finds torch's regex in."""
    module_input = error.module_error_input
    cls = OURS[INFOS[name].module_cls]
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    if error.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
        with pytest.raises(error.error_type, match=error.error_regex):
            cls(*args, **kwargs)
    else:
        module = cls(*args, **kwargs)
        forward = module_input.forward_input
        with pytest.raises(error.error_type, match=error.error_regex):
            module(*forward.args, **forward.kwargs)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("name, index, desc", SAMPLE_IDS, ids=[f"{n}-{i}-{d}" for n, i, d in SAMPLE_IDS])
def test_cpu_sample_gives_torchs_outputs_and_gradients(name, index, desc, dtype, training):
    dt = getattr(torch, dtype)
    seed = seeded()
    sample = samples(name, "cpu", dt, requires_grad=True, training=training)[index]
    theirs, ours = build(name, sample, "cpu", dt)
    theirs.train(training)
    ours.train(training)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    context = f"{name} {desc} {dtype} seed {seed}"
    with torch.no_grad():
        assert_equal_outputs(ours(*args, **kwargs), theirs(*args, **kwargs), context)
    got, want = ours(*args, **kwargs), theirs(*args, **kwargs)
    assert_equal_outputs(got, want, context)
    weights = [torch.randn_like(t) for t in outputs(want).values()]
    inputs = gradient_inputs(args)
    assert inputs, "the sample has inputs that require gradients"
    for g_ours, g_theirs in zip(gradients(ours, got, inputs, weights), gradients(theirs, want, inputs, weights)):
        assert (g_ours is None) == (g_theirs is None)
        if g_theirs is not None:
            torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=0)
    if not _is_packed(sample):  # torch's reference for an unbatched input: the same call with a batch of 1
        with torch.no_grad():
            torch.testing.assert_close(ours(*args, **kwargs), sample.reference_fn(ours, *args, **kwargs))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("name, index, desc", SAMPLE_IDS, ids=[f"{n}-{i}-{d}" for n, i, d in SAMPLE_IDS])
def test_cpu_sample_survives_pickle_and_deepcopy(name, index, desc, dtype):
    dt = getattr(torch, dtype)
    sample = samples(name, "cpu", dt)[index]
    theirs, ours = build(name, sample, "cpu", dt)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    with torch.no_grad():
        want = theirs(*args, **kwargs)
        for copied in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)):
            assert type(copied) is type(ours) and copied.cell == ours.cell
            assert_equal_outputs(copied(*args, **kwargs), want, f"{name} {desc} {dtype}")


# ---- the configurations the GPU cases pin ----------------------------------------


GPU_KERNEL_PATHS = ("single", "cluster", "fused", "mma")


def gpu_paths(sample, dtype: str) -> tuple[str, ...]:
    """The paths a GPU case runs the sample on. A projected LSTM runs torch's
    implementation on every plan (no kernel has projections): one case."""
    if _is_projected(sample):
        return ("torch",)
    kernels = GPU_KERNEL_PATHS if dtype != "float32" else GPU_KERNEL_PATHS[:-1]  # tensor cores: 16-bit only
    return (*kernels, "fallback", "cudnn")


def pinned_config(path: str, shape, batch: int, sm_count: int = 132):
    """The persistent configuration of a kernel path for ``shape`` at ``batch``:
    one block; a cluster of two; both layers in a pipeline (unidirectional) or
    both directions in one launch; tensor cores."""
    from persistrnn import persistent

    base = persistent.default_config(shape.cell, shape.hidden_size, batch, sm_count=sm_count, dtype=shape.dtype)
    if path == "single":
        return base
    if path == "cluster":
        return persistent.KernelConfig(shape.cell, shape.hidden_size, "cluster",
                                       persistent.blocks_for(shape.hidden_size, 2), 128, group_size=8,
                                       batch_tile=base.batch_tile, dtype=shape.dtype)
    if path == "fused":
        if shape.bidirectional:
            return dataclasses.replace(base, instances=2)
        assert shape.num_layers == 2, shape  # torch's samples are all 2-layer
        return dataclasses.replace(base, instances=shape.num_layers, pipeline=True)
    if path == "mma":
        return persistent.default_config(shape.cell, shape.hidden_size, batch, sm_count=sm_count, dtype=shape.dtype,
                                         math="mma")
    raise ValueError(path)


def _shape_of(sample, dtype: str, name: str):
    from persistrnn.plan import ModelShape

    kw = sample.constructor_input.kwargs
    cell = {"LSTM": "lstm", "GRU": "gru"}.get(name) or f"rnn_{kw.get('nonlinearity', 'tanh')}"
    return ModelShape(cell, kw["input_size"], kw["hidden_size"], kw["num_layers"], dtype,
                      bool(kw.get("bidirectional")))


def _batch_of(sample) -> int:
    x = sample.forward_input.args[0]
    return int(x.batch_sizes[0]) if isinstance(x, PackedSequence) else 1


def _pinned_configs():
    configs = set()
    for name, group in SAMPLES.items():
        for sample in group:
            for dtype in GPU_DTYPES:
                for path in gpu_paths(sample, dtype):
                    if path in GPU_KERNEL_PATHS:
                        config = pinned_config(path, _shape_of(sample, dtype, name), _batch_of(sample))
                        configs.add(dataclasses.replace(config, lengths=_is_packed(sample)))
    return sorted(configs, key=str)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_pinned_configurations_compile_for_sm90_without_local_memory(cell):
    from persistrnn import persistent, runtime

    configs = [c for c in _pinned_configs() if c.cell == cell]
    assert configs
    binaries = runtime.map_in_threads(lambda c: persistent.compile_config(c, arch="sm_90"), configs)
    for config, binary in zip(configs, binaries):
        resources = binary.kernel_resources(persistent.KERNEL_NAME)
        assert not resources.uses_local_memory, (config, resources)


# ---- GPU ----------------------------------------------------------------------


@pytest.fixture
def pin(monkeypatch):
    """``pin(path)``: every plan of the test is ``path`` (the planner's
    module-global ``plan``, which ``cached_plan`` calls, replaced), with the
    in-process plans forgotten before and after."""
    from persistrnn import runtime
    from persistrnn.plan import Plan, clear_cached_plans, space, tuner

    def pinned(path):
        def plan(shape, batch, **_):
            bucket = space.batch_bucket(batch)
            if path in ("fallback", "cudnn", "torch"):
                return Plan(shape, bucket, "fallback" if path == "torch" else path, None, "model", "pinned by the test")
            config = pinned_config(path, shape, batch, runtime.device_facts().sm_count)
            return Plan(shape, bucket, "persistent", config, "model", "pinned by the test")

        monkeypatch.setattr(tuner, "plan", plan)
        clear_cached_plans()

    yield pinned
    clear_cached_plans()


GPU_FORWARD_CASES = [(name, index, desc, dtype, path) for name, index, desc in SAMPLE_IDS for dtype in GPU_DTYPES
                     for path in gpu_paths(SAMPLES[name][index], dtype)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, index, desc, dtype, path", GPU_FORWARD_CASES,
                         ids=[f"{n}-{i}-{d}-{t}-{p}" for n, i, d, t, p in GPU_FORWARD_CASES])
def test_gpu_sample_gives_torchs_outputs_on_every_path(name, index, desc, dtype, path, pin):
    dt = getattr(torch, dtype)
    seed = seeded()
    pin(path)
    sample = samples(name, "cuda", dt)[index]
    theirs, ours = build(name, sample, "cuda", dt)
    theirs.eval()
    ours.eval()
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    x = args[0].data if _is_packed(sample) else args[0]
    # Nothing but a projection sends the call to torch's implementation: the
    # pinned plan runs (a packed input on a plan without kernels is torch's).
    with torch.no_grad():  # a sample's input may require grad: the call below runs without
        reason = ours._torch_reason(x, warn=False)
    assert reason == ("proj_size" if path == "torch" else None), reason
    with torch.no_grad(), exact_torch():  # torch's peer and our cuDNN path without TF32, as the rule says
        got = ours(*args, **kwargs)
        peer = theirs(*args, **kwargs)
    assert_same_structure(got, peer)
    context = f"{name} {desc} on {path}, seed {seed}"
    assert_close_to_reference(outputs(got), outputs(float64_reference(theirs, args, kwargs)), outputs(peer),
                              dtype=dtype, context=context)
    if not _is_packed(sample):  # torch's own reference: the same call with a batch of 1
        with torch.no_grad(), exact_torch():
            again = sample.reference_fn(ours, *args, **kwargs)
        torch.testing.assert_close(got, again, msg=lambda m: f"{context}: unbatched against batched: {m}")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:persistrnn.*needs gradients")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("name, index, desc", SAMPLE_IDS, ids=[f"{n}-{i}-{d}" for n, i, d in SAMPLE_IDS])
def test_gpu_sample_with_gradients_gives_torchs_outputs_and_gradients(name, index, desc, dtype):
    dt = getattr(torch, dtype)
    seed = seeded()
    # training mode: cuDNN's RNN backward refuses a module in eval mode, for
    # torch's module as for ours (torch's own test_grad is an expected failure there)
    sample = samples(name, "cuda", dt, requires_grad=True, training=True)[index]
    theirs, ours = build(name, sample, "cuda", dt)
    theirs.train()
    ours.train()
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    got, want = ours(*args, **kwargs), theirs(*args, **kwargs)
    context = f"{name} {desc} {dtype}, seed {seed}"
    # A training call runs our training operators (padded input) or torch's
    # function (packed): torch's outputs up to the dtype's default tolerance.
    for key, value in outputs(want).items():
        torch.testing.assert_close(outputs(got)[key], value, msg=lambda m, key=key: f"{context} {key}: {m}")
    weights = [torch.randn_like(t) for t in outputs(want).values()]
    inputs = gradient_inputs(args)
    assert inputs, "the sample has inputs that require gradients"
    for g_ours, g_theirs in zip(gradients(ours, got, inputs, weights), gradients(theirs, want, inputs, weights)):
        assert (g_ours is None) == (g_theirs is None)
        if g_theirs is not None:
            # equal up to the order of cuDNN's accumulations (torch's default tolerance of the dtype)
            torch.testing.assert_close(g_ours, g_theirs, msg=lambda m: f"{context}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("name, index, desc", SAMPLE_IDS, ids=[f"{n}-{i}-{d}" for n, i, d in SAMPLE_IDS])
def test_gpu_sample_survives_pickle_deepcopy_and_a_cpu_cuda_round_trip(name, index, desc, dtype, untuned):
    dt = getattr(torch, dtype)
    seed = seeded()
    sample = samples(name, "cpu", torch.float32)[index]
    theirs, ours = build(name, sample, "cpu", torch.float32)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    context = f"{name} {desc} {dtype}, seed {seed}"
    with torch.no_grad():
        assert_equal_outputs(ours(*args, **kwargs), theirs(*args, **kwargs), context + " on the CPU")
    # to the GPU, in place as Module.to is; the planner's own choice runs
    ours.to("cuda").to(dt)
    theirs.to("cuda").to(dt)
    cuda_args = _map(lambda t: t.to("cuda", dt), args)
    reference = outputs(float64_reference(theirs, cuda_args, kwargs))
    with torch.no_grad(), exact_torch():
        peer = theirs(*cuda_args, **kwargs)
        for label, module in (("moved", ours), ("pickled", pickle.loads(pickle.dumps(ours))),
                              ("deep-copied", copy.deepcopy(ours))):
            assert type(module) is type(ours) and module.weight_hh_l0.is_cuda and module.weight_hh_l0.dtype == dt
            got = module(*cuda_args, **kwargs)
            assert_same_structure(got, peer)
            assert_close_to_reference(outputs(got), reference, outputs(peer), dtype=dtype,
                                      context=f"{context}, {label}")
    # and back: on the CPU again, in fp32, it is torch's module on the same (rounded) weights
    ours.to("cpu").float()
    theirs.to("cpu").float()
    with torch.no_grad():
        assert_equal_outputs(ours(*args, **kwargs), theirs(*args, **kwargs), context + " back on the CPU")


@pytest.mark.gpu
@pytest.mark.parametrize("name, index, kind", ERROR_IDS, ids=[f"{n}-{i}-{k}" for n, i, k in ERROR_IDS])
def test_gpu_error_inputs_raise_torchs_error(name, index, kind):
    check_error_input(name, error_inputs(name, "cuda")[index])
