"""Several recurrences in one launch: the layers of a pipeline, the two
directions of a bidirectional layer, and the reverse direction. Configurations,
sm_90 builds and the planner's layouts on the CPU; agreement with the float64
reference on a GPU."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close_to_reference, exact_torch, poison_outputs, random_layer, torch_peer

from persistrnn import cells, persistent, reference, runtime
from persistrnn.persistent import ConfigError, KernelConfig
from persistrnn.plan import model as cost
from persistrnn.plan import space, tuner

ROOT = Path(__file__).resolve().parents[1]
CELL_NAMES = tuple(cells.CELLS)

# ---- configurations (CPU) ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(instances=0), "expected >= 1, got 0"),
        (dict(instances=persistent.MAX_INSTANCES + 1), f"expected 1..{persistent.MAX_INSTANCES}"),
        (dict(instances=2, sync="grid", blocks=4), "need sync 'single' or 'cluster'"),
        (dict(pipeline=True), "expected at least 2 instances"),
        (dict(instances=2, pipeline=True, dtype="float16", math="mma", group_size=32, batch_tile=8),
         "expected math 'ffma' without one_sync"),
        (dict(cell="gru_reset_before", instances=2, pipeline=True, one_sync=True), "without one_sync"),
    ],
)
def test_invalid_instance_configs_name_what_was_expected(kwargs, message):
    base = dict(cell="lstm", hidden_size=64, sync="cluster", blocks=4)
    with pytest.raises(ConfigError, match=message):
        KernelConfig(**{**base, **kwargs})


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_a_pipeline_holds_the_next_layers_weights_beside_its_own(cell):
    one = KernelConfig(cell, 96, "cluster", 4, 128, 8, 2, shared_k_chunks=3)
    fused = KernelConfig(cell, 96, "cluster", 4, 128, 8, 2, shared_k_chunks=3, instances=3, pipeline=True)
    g, u = one.spec.num_gates, one.units_per_block
    assert fused.next_rows_per_group * fused.work_groups >= g * u
    assert fused.register_weights == one.register_weights + fused.next_rows_per_group * one.register_k
    # shared: the next layer's overflow weights and its b_ih
    extra = fused.next_rows_per_group * 3 * fused.threads + fused.bias_floats
    assert fused.shared_bytes(5) == one.shared_bytes(5) + 4 * extra
    assert fused.pipe_floats(7, 5) == 2 * 7 * 4 * g * u * one.batch_stride(5)
    assert one.pipe_floats(7, 5) == 0
    # directions at once change nothing per block
    both = KernelConfig(cell, 96, "cluster", 4, 128, 8, 2, shared_k_chunks=3, instances=2)
    assert both.shared_bytes(5) == one.shared_bytes(5) and both.register_weights == one.register_weights


def test_rendered_source_selects_each_instances_parameters():
    cfg = KernelConfig("gru", 64, "single", 1, instances=3, pipeline=True)
    source = persistent.render_source(cfg)
    for name in ("xw", "w_hh", "out", "reverse", "w_next", "b_next"):
        for i in range(3):
            assert f"{name}_{i}" in source
    assert "inst == 0 ? w_next_0 : inst == 1 ? w_next_1 : w_next_2" in source
    both = persistent.render_source(KernelConfig("gru", 64, "single", 1, instances=2))
    params = next(line for line in both.splitlines() if line.startswith("#define PRNN_INSTANCE_PARAMS"))
    assert "reverse_1" in params and "w_next" not in params


COMPILE_SAMPLE = [
    KernelConfig(cell, hidden, sync, blocks, threads, group, tile, shared_k_chunks=shared, dtype=dtype,
                 instances=instances, pipeline=pipeline)
    for cell in CELL_NAMES
    for hidden, sync, blocks, threads, group, tile, shared, dtype, instances, pipeline in [
        (128, "cluster", 8, 256, 8, 1, 0, "float32", 3, True),
        (48, "single", 1, 256, 8, 1, 0, "float32", 4, True),
        (256, "cluster", 16, 256, 8, 1, 0, "bfloat16", 2, True),
        (64, "single", 1, 256, 8, 2, 4, "float16", persistent.MAX_INSTANCES, True),
        (256, "cluster", 8, 512, 8, 4, 0, "float32", 2, False),
        (33, "single", 1, 128, 4, 1, 0, "float32", 2, False),
    ]
]


def _gpu_configs():
    pipelines = [KernelConfig(c[0], c[3], c[5], c[6], c[7], c[8], c[9], shared_k_chunks=c[10], dtype=c[1],
                              instances=c[4], pipeline=True) for c in PIPELINE_CASES]
    directions = [KernelConfig(c[0], c[3], c[5], c[6], c[7], c[8], 1, dtype=c[1], instances=c[9])
                  for c in BIDIRECTIONAL_CASES]
    sliced = [KernelConfig(c[0], c[3], threads=128, group_size=8, dtype=c[1], **c[6]) for c in SLICE_CASES]
    fused = [KernelConfig(cell, 48, "cluster", 2, 192, 8, 2, instances=2, fused_step=f, lengths=True)
             for cell in ("lstm", "gru", "rnn_tanh") for f in (False, True)]
    return pipelines + directions + sliced + fused


COMPILE_SAMPLE += [KernelConfig(cell, 96, "cluster", 4, 128, 8, 1, instances=2, lengths=True) for cell in CELL_NAMES]
COMPILE_SAMPLE += [KernelConfig("lstm", 128, "cluster", 8, 256, 8, 1, instances=3, pipeline=True, lengths=True)]


def test_lengths_are_a_compiled_variant():
    without = persistent.render_source(KernelConfig("lstm", 64, "single", 1))
    with_lengths = persistent.render_source(KernelConfig("lstm", 64, "single", 1, lengths=True))
    assert "#define PRNN_LENGTHS 0" in without and "#define PRNN_LENGTHS 1" in with_lengths


@pytest.mark.parametrize("config", COMPILE_SAMPLE, ids=str)
def test_fused_kernels_compile_for_sm90_without_local_memory(config):
    res = persistent.compile_config(config, arch="sm_90").kernel_resources(persistent.KERNEL_NAME)
    assert not res.uses_local_memory, res


# ---- planner layouts (CPU) --------------------------------------------------


H100 = runtime.DeviceFacts(**json.loads((ROOT / "docs/results/sync-h100.json").read_text())["device"])


def test_layouts_follow_the_model():
    assert tuner.layouts(tuner.ModelShape("lstm", 8, 16)) == [{}]
    assert tuner.layouts(tuner.ModelShape("lstm", 8, 16, 3)) == [{}, dict(instances=3, pipeline=True)]
    assert tuner.layouts(tuner.ModelShape("lstm", 8, 16, 3, bidirectional=True)) == [{}, dict(instances=2)]
    assert tuner.layouts(tuner.ModelShape("lstm", 8, 16, persistent.MAX_INSTANCES + 1)) == [{}]


def test_forward_steps_count_the_pipeline_fill_and_sequential_directions():
    shape = tuner.ModelShape("lstm", 8, 64, 3)
    per_layer = KernelConfig("lstm", 64, "cluster", 4)
    fused = KernelConfig("lstm", 64, "cluster", 4, instances=3, pipeline=True)
    assert tuner.forward_steps(per_layer, shape, 100) == 300
    assert tuner.forward_steps(fused, shape, 100) == 100 + 2 * (fused.prefetch_steps
                                                                 + persistent.PIPELINE_RELEASE_EVERY)
    bi = tuner.ModelShape("lstm", 8, 64, 2, bidirectional=True)
    assert tuner.forward_steps(per_layer, bi, 10) == 40
    assert tuner.forward_steps(KernelConfig("lstm", 64, "cluster", 4, instances=2), bi, 10) == 20


def test_ranking_weighs_each_layout_by_its_steps_per_forward():
    cal = cost.Calibration.from_json((ROOT / "docs/results/calibration-h100.json").read_text())
    model = cost.CostModel(cal, H100)
    shape = tuner.ModelShape("lstm", 128, 128, 3)
    ranked = tuner.ranked_configs(shape, 1, model, steps=100)
    layouts = {(c.instances, c.pipeline) for _, c, _ in ranked}
    assert layouts == {(1, False), (3, True)}
    totals = [us * tuner.forward_steps(c, shape, 100) for us, c, _ in ranked]
    assert totals == sorted(totals)
    # every fused configuration fits the SMs with all its layers
    assert all(c.blocks * c.instances <= H100.sm_count for _, c, _ in ranked)


def test_prune_counts_every_instances_blocks():
    import dataclasses

    cfg = KernelConfig("rnn_tanh", 64, "cluster", 16, 128, 8, 1, instances=persistent.MAX_INSTANCES, pipeline=True)
    assert space.prune(cfg, 1, dataclasses.replace(H100, sm_count=100)) == (
        "needs 128 co-resident blocks of one SM each, the device has 100 SMs")


def test_shape_of_reads_bidirectional():
    import torch

    assert tuner.shape_of(torch.nn.GRU(4, 8, 2, bidirectional=True)).bidirectional
    assert not tuner.shape_of(torch.nn.GRU(4, 8, 2)).bidirectional


# ---- against the float64 reference (GPU) ----------------------------------


def _model_case(cell, dtype, input_size, hidden, layers, directions, batch, steps, seed):
    """Random model rounded to ``dtype``: (layers[l][d] torch dicts, x, h0, c0, float64 reference)."""
    import torch

    rng = np.random.default_rng(seed)
    spec = cells.get_cell(cell)
    dt = getattr(torch, dtype)
    params, torch_layers = [], []
    for l in range(layers):
        size = input_size if l == 0 else directions * hidden
        drawn = [random_layer(cell, size, hidden, batch, steps, rng)[0] for _ in range(directions)]
        torch_layers.append([{k: torch.tensor(v, dtype=dt, device="cuda") for k, v in p.items()} for p in drawn])
        params.append([{k: v.double().cpu().numpy() for k, v in p.items()} for p in torch_layers[-1]])
    states = layers * directions
    x = torch.tensor(rng.standard_normal((steps, batch, input_size)), dtype=dt, device="cuda")
    h0 = torch.tensor(rng.standard_normal((states, batch, hidden)) * 0.5, dtype=dt, device="cuda")
    c0 = torch.tensor(rng.standard_normal((states, batch, hidden)) * 0.5, dtype=dt, device="cuda")

    def f64(t):
        return t.double().cpu().numpy()

    hx = (f64(h0), f64(c0)) if spec.has_cell_state else f64(h0)
    ref = reference.rnn_forward(cell, f64(x), params, num_layers=layers, bidirectional=directions == 2, hx=hx)
    return torch_layers, x, h0, c0 if spec.has_cell_state else None, ref


def _compare(cell, dtype, result, ref, peer, context):
    """``result`` and ``peer`` (out, h_n, c_n or None) against the reference
    (out, state) by the tolerance rule."""
    ref_out, ref_state = ref
    names = ("output", "h_n", "c_n")
    ours = dict(zip(names, (t for t in result if t is not None)))
    want = dict(zip(names, (ref_out, *ref_state) if cells.get_cell(cell).has_cell_state else (ref_out, ref_state)))
    theirs = None if peer is None else dict(zip(names, (t for t in peer if t is not None)))
    assert_close_to_reference(ours, want, theirs, dtype=dtype, context=context)


def _check(config, cell, dtype, input_size, layers, directions, batch, steps, batch_slice=None):

    seed = hash((str(config), batch, steps, batch_slice)) % 2**32  # fresh per run; printed on failure
    torch_layers, x, h0, c0, ref = _model_case(cell, dtype, input_size, config.hidden_size, layers, directions, batch,
                                               steps, seed)
    poison_outputs([(steps, batch, directions * config.hidden_size), h0.shape, h0.shape], x.dtype)
    with exact_torch():
        result = persistent.forward_model(config, torch_layers, x, h0, c0, batch_slice=batch_slice)
    _compare(cell, dtype, result, ref, torch_peer(cell, torch_layers, x, h0, c0),
             f"{config}, batch {batch} in slices of {batch_slice}, seed {seed}")


PIPELINE_CASES = [
    # (cell, dtype, input, hidden, layers, sync, blocks, threads, group, tile, shared, batch, steps)
    ("lstm", "float32", 128, 128, 3, "cluster", 8, 256, 8, 1, 0, 1, 100),
    ("lstm", "float32", 256, 256, 2, "cluster", 16, 256, 8, 1, 0, 5, 20),
    ("lstm", "float32", 37, 48, 4, "single", 1, 256, 8, 1, 0, 3, 9),
    ("gru", "float32", 20, 64, 2, "cluster", 4, 128, 8, 4, 4, 17, 3),
    ("gru", "bfloat16", 64, 96, 3, "cluster", 4, 128, 8, 2, 0, 8, 12),
    ("gru_reset_before", "float32", 33, 72, 2, "cluster", 4, 128, 4, 1, 0, 2, 6),
    ("rnn_tanh", "float16", 16, 64, persistent.MAX_INSTANCES, "single", 1, 128, 8, 2, 4, 4, 30),
    ("rnn_relu", "float32", 8, 48, 3, "cluster", 2, 128, 8, 1, 0, 1, 1),  # T=1: only the tail forwards
    ("lstm", "float32", 8, 64, 2, "cluster", 4, 128, 8, 1, 0, 1, 2),  # T < prefetch steps
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_layers_match_float64_reference(case):
    cell, dtype, input_size, hidden, layers, sync, blocks, threads, group, tile, shared, batch, steps = case
    config = KernelConfig(cell, hidden, sync, blocks, threads, group, tile, shared_k_chunks=shared, dtype=dtype,
                          instances=layers, pipeline=True)
    _check(config, cell, dtype, input_size, layers, 1, batch, steps)


BIDIRECTIONAL_CASES = [
    # (cell, dtype, input, hidden, layers, sync, blocks, threads, group, instances, batch, steps)
    ("lstm", "float32", 256, 256, 2, "cluster", 16, 256, 8, 2, 8, 100),
    ("gru", "float32", 30, 100, 1, "single", 1, 512, 16, 2, 3, 7),
    ("gru_reset_before", "bfloat16", 16, 64, 2, "cluster", 4, 128, 8, 1, 5, 9),  # directions one after another
    ("rnn_tanh", "float32", 7, 33, 3, "cluster", 3, 128, 8, 2, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", BIDIRECTIONAL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_both_directions_match_float64_reference(case):
    cell, dtype, input_size, hidden, layers, sync, blocks, threads, group, instances, batch, steps = case
    config = KernelConfig(cell, hidden, sync, blocks, threads, group, 1, dtype=dtype, instances=instances)
    _check(config, cell, dtype, input_size, layers, 2, batch, steps)


@pytest.mark.gpu
def test_fused_layers_split_a_large_batch_across_launches():
    config = KernelConfig("gru", 128, "cluster", 8, 256, 8, 8, instances=2, pipeline=True)
    per_launch = config.max_batch(runtime.device_facts().shared_per_block_optin)
    _check(config, "gru", "float32", 40, 2, 1, per_launch + 3, 4)


SLICE_CASES = [
    # (cell, dtype, input, hidden, layers, directions, config kwargs, batch, batch_slice): uneven last slices
    ("lstm", "float32", 64, 96, 3, 1, dict(sync="cluster", blocks=4, instances=3, pipeline=True), 11, 3),
    ("gru", "bfloat16", 40, 40, 2, 1, dict(sync="single", blocks=1, instances=2, pipeline=True), 9, 2),
    ("gru_reset_before", "float32", 17, 48, 1, 2, dict(sync="cluster", blocks=2, instances=2), 13, 4),
    ("rnn_tanh", "float16", 8, 33, 2, 2, dict(sync="single", blocks=1, instances=2), 7, 1),
    ("lstm", "float32", 30, 128, 1, 1, dict(sync="cluster", blocks=8, batch_tile=2), 40, 2),
    ("rnn_relu", "float32", 16, 100, 2, 1, dict(sync="grid", blocks=10), 9, 4),  # one launch per slice
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SLICE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-L{c[4]}-D{c[5]}-B{c[7]}-s{c[8]}")
def test_batch_slices_match_float64_reference(case):
    cell, dtype, input_size, hidden, layers, directions, kwargs, batch, batch_slice = case
    config = KernelConfig(cell, hidden, threads=128, group_size=8, dtype=dtype, **kwargs)
    _check(config, cell, dtype, input_size, layers, directions, batch, 9, batch_slice)


@pytest.mark.gpu
def test_batch_slices_with_variable_lengths():
    import torch

    config = KernelConfig("lstm", 48, "cluster", 2, 128, 8, 1, instances=2)
    lengths = [5, 1, 9, 3, 7, 2, 8]
    torch_layers, x, h0, c0, _ = _model_case("lstm", "float32", 11, 48, 1, 2, len(lengths), 9, seed=5)
    dev_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with exact_torch():
        whole = persistent.forward_model(config, torch_layers, x, h0, c0, lengths=dev_lengths)
        sliced = persistent.forward_model(config, torch_layers, x, h0, c0, lengths=dev_lengths, batch_slice=3)
    for a, b in zip(whole, sliced):  # each sequence's own arithmetic, wherever its slice runs
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_fused_step_is_bitwise_the_unfused_step(cell):
    # The same products and the same pointwise functions, run by other
    # threads: both directions, variable lengths and batch slices included.
    import dataclasses

    import torch

    fused = KernelConfig(cell, 48, "cluster", 2, 192, 8, 2, instances=2, fused_step=True)
    lengths = [5, 1, 9, 3, 7, 2, 8]
    torch_layers, x, h0, c0, _ = _model_case(cell, "float32", 11, 48, 2, 2, len(lengths), 9, seed=6)
    dev_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    runs = [persistent.forward_model(config, torch_layers, x, h0, c0, lengths=dev_lengths, batch_slice=3)
            for config in (fused, dataclasses.replace(fused, fused_step=False))]
    for a, b in zip(*runs):
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_fused_layers_replay_in_a_graph_with_reset_progress_counts():
    import torch

    config = KernelConfig("lstm", 64, "cluster", 4, 128, 8, 1, instances=3, pipeline=True)
    torch_layers, x, h0, c0, (ref_out, _) = _model_case("lstm", "float32", 24, 64, 3, 1, 2, 25, seed=3)
    result = {}

    def run():
        result["out"] = persistent.forward_model(config, torch_layers, x, h0, c0, check=False)[0]

    peer_out = torch_peer("lstm", torch_layers, x, h0, c0)[0]
    with exact_torch():
        graph = runtime.capture_graph(run)
    for replay in range(3):  # every replay starts from progress counts the last one reset
        result["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(result["out"], ref_out, peer_out, dtype="float32", context=f"replay {replay}")
    runtime.raise_reported_failure(x.device.index, synchronize=True)


@pytest.mark.parametrize("config", _gpu_configs(), ids=str)
def test_every_gpu_case_compiles_for_sm90_without_local_memory(config):
    test_fused_kernels_compile_for_sm90_without_local_memory(config)


LENGTH_CASES = [
    # (cell, dtype, layers, directions, config kwargs, lengths)
    ("lstm", "float32", 2, 2, dict(sync="cluster", blocks=4, instances=2), [5, 1, 9, 3]),
    ("gru", "float32", 3, 1, dict(sync="cluster", blocks=4, instances=3, pipeline=True), [2, 9, 9, 7, 1]),
    ("gru_reset_before", "bfloat16", 1, 2, dict(sync="single", blocks=1), [4, 9, 6]),
    ("rnn_relu", "float32", 2, 1, dict(sync="cluster", blocks=2), [9]),
    # 48 units x 2 sequences leave the fourth warp to copy the projections during the update, both directions
    ("lstm", "float32", 1, 2, dict(sync="single", blocks=1), [3, 9]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LENGTH_CASES, ids=lambda c: f"{c[0]}-{c[1]}-L{c[2]}-D{c[3]}")
def test_variable_lengths_match_float64_reference(case):
    import torch

    cell, dtype, layers, directions, kwargs, lengths = case
    config = KernelConfig(cell, 48, threads=128, group_size=8, dtype=dtype, **kwargs)
    T, B = max(lengths), len(lengths)
    seed = hash((str(config), tuple(lengths))) % 2**32
    torch_layers, x, h0, c0, _ = _model_case(cell, dtype, 11, 48, layers, directions, B, T, seed)
    spec = cells.get_cell(cell)

    def f64(t):
        return t.double().cpu().numpy()

    params = [[{k: f64(v) for k, v in p.items()} for p in layer] for layer in torch_layers]
    hx = (f64(h0), f64(c0)) if spec.has_cell_state else f64(h0)
    ref = reference.rnn_forward(cell, f64(x), params, num_layers=layers, bidirectional=directions == 2, hx=hx,
                                lengths=lengths)
    dev_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with exact_torch():
        result = persistent.forward_model(config, torch_layers, x, h0, c0, lengths=dev_lengths)
    for b, n in enumerate(lengths):  # outputs past a sequence's end are exactly zero
        assert not result[0][n:, b].any()
    peer = torch_peer(cell, torch_layers, x, h0, c0, lengths=lengths)
    _compare(cell, dtype, result, ref, peer, f"{config}, lengths {lengths}, seed {seed}")


@pytest.mark.gpu
def test_lengths_outside_the_steps_are_refused_before_launch():
    import torch

    config = KernelConfig("gru", 48, "single", 1, 128, 8, 1, instances=2)
    torch_layers, x, h0, c0, _ = _model_case("gru", "float32", 5, 48, 1, 2, 3, 6, seed=4)
    for bad, message in (([0, 6, 6], "from 0 to 6"), ([7, 1, 2], "from 1 to 7")):
        lengths = torch.tensor(bad, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=f"lengths: expected every length in 1..6 .*got lengths {message}"):
            persistent.forward_model(config, torch_layers, x, h0, c0, lengths=lengths)
    with pytest.raises(TypeError, match="lengths: expected dtype torch.int32, got torch.int64"):
        persistent.forward_model(config, torch_layers, x, h0, c0, lengths=torch.ones(3, dtype=torch.int64,
                                                                                     device="cuda"))
