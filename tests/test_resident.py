"""Resident persistent kernels (``KernelConfig.resident_input_size``,
``persistrnn.persistent.resident``): configurations and sm_90 builds on the
CPU; on a GPU, ticks posted through pinned host memory against the float64
reference (random slots, odd sizes, outputs and new states poisoned first),
and the launch's own exits (idle, lifetime, stop) and relaunches."""

import dataclasses
import time

import numpy as np
import pytest
from helpers import assert_close_to_reference, reference_forward, rounded_layer

from persistrnn import cells, persistent
from persistrnn.persistent import ConfigError, KernelConfig
from persistrnn.persistent.config import RESIDENT_CONTROL

CELL_NAMES = tuple(cells.CELLS)


# ---- configurations and builds (CPU) -------------------------------------------------------


@pytest.mark.parametrize("changes, named", [
    (dict(sync="grid", blocks=20), "sync grid"),
    (dict(instances=2), "instances 2"),
    (dict(lengths=True), "lengths True"),
    (dict(test_hook=True), "test_hook True"),
    (dict(save_gates=True), "save_gates True"),
])
def test_a_resident_config_refuses_what_it_cannot_run_and_names_it(changes, named):
    base = dict(cell="lstm", hidden_size=128, sync="cluster", blocks=8, resident_input_size=40)
    with pytest.raises(ConfigError, match=named):
        KernelConfig(**{**base, **changes})
    with pytest.raises(ConfigError, match="expected an int >= 0"):
        KernelConfig(**{**base, "resident_input_size": -1})
    with pytest.raises(ConfigError, match="input size 4000 \\(one input row must fit"):
        KernelConfig("rnn_tanh", 4, "single", 1, 32, 4, 1, prefetch_steps=1, resident_input_size=4000)


def test_a_resident_layout_adds_two_slot_numbers_per_row_and_the_blocks_input_weights():
    plain = KernelConfig("gru", 100, "cluster", 4, 128, 8, 4)
    resident = dataclasses.replace(plain, resident_input_size=33)
    rows = 76  # 3 gates x 25 units, padded to a multiple of 4 projection rows
    for batch in (1, 17, 64):
        extra = resident.shared_bytes(batch) - plain.shared_bytes(batch)
        assert extra == 4 * (2 * plain.batch_stride(batch) + rows * (33 + 1))


RESIDENT_SAMPLE = [
    KernelConfig("lstm", 128, "cluster", 8, 256, 8, 8, resident_input_size=40),  # the serving shape
    KernelConfig("lstm", 13, "single", 1, 128, 4, 2, resident_input_size=7),  # odd sizes
    KernelConfig("gru", 100, "cluster", 4, 256, 8, 4, resident_input_size=33),
    KernelConfig("gru_reset_before", 64, "single", 1, 256, 8, 4, one_sync=True, prefetch_steps=2,
                 resident_input_size=24),
    KernelConfig("gru_reset_before", 96, "cluster", 4, 128, 8, 2, resident_input_size=5),
    KernelConfig("rnn_tanh", 96, "cluster", 4, 128, 8, 2, dtype="bfloat16", resident_input_size=65),
    KernelConfig("rnn_relu", 64, "single", 1, 256, 8, 4, dtype="float16", resident_input_size=1),
    KernelConfig("lstm", 256, "cluster", 8, 256, 32, 8, dtype="bfloat16", math="mma", resident_input_size=80),
    KernelConfig("lstm", 64, "cluster", 4, 128, 8, 1, fused_step=True, resident_input_size=40),
]


@pytest.mark.parametrize("config", RESIDENT_SAMPLE, ids=str)
def test_resident_kernels_compile_for_sm90_without_local_memory(config):
    binary = persistent.compile_config(config, arch="sm_90")
    assert not binary.kernel_resources(persistent.KERNEL_NAME).uses_local_memory


def test_the_control_block_words_reach_the_source_by_name():
    text = persistent.render_source(RESIDENT_SAMPLE[0])
    for i, word in enumerate(RESIDENT_CONTROL):
        assert f"#define PRNN_CTL_{word.upper()} {i}\n" in text
    assert "long long* __restrict__ ctl" in text
    plain = persistent.render_source(dataclasses.replace(RESIDENT_SAMPLE[0], resident_input_size=0))
    assert "#define PRNN_RESIDENT 0\n" in plain and "#define PRNN_RESIDENT_PARAMS \n" in plain


# ---- ticks on the GPU ---------------------------------------------------------------------


def _layer(config, rows, rng, slots, **kw):
    """A ResidentLayer of ``config`` over random weights and random state pools of ``slots`` rows."""
    import torch

    from persistrnn.persistent.resident import ResidentLayer

    H, I = config.hidden_size, config.resident_input_size
    params, _, _, _ = rounded_layer(config.cell, config.dtype, I, H, 1, 1, rng)
    dtype = getattr(torch, config.dtype)
    pools = [torch.tensor(rng.standard_normal((slots, H)) * 0.5, dtype=dtype, device="cuda") for _ in range(2)]
    c_pool = pools[1] if config.spec.has_cell_state else None
    weights = (params["w_ih"], params["w_hh"], params["b_ih"], params["b_hh"])
    return ResidentLayer(config, weights, pools[0], c_pool, rows, **kw), params


def _tick(layer, params, rng, rows, steps, timeout=20.0):
    """One tick of ``rows`` random input rows from random distinct slots to other distinct slots, with the
    outputs and the destination slots poisoned first; checked against the float64 reference."""
    import torch

    config = layer.config
    H, I = config.hidden_size, config.resident_input_size
    dtype = getattr(torch, config.dtype)
    slots = layer.h_pool.shape[0]
    order = rng.permutation(slots)
    gather, scatter = order[:rows], order[rows:2 * rows]
    x = torch.tensor(rng.standard_normal((rows, steps, I)), dtype=dtype).pin_memory()
    out = torch.full((rows, steps, H), float("nan"), dtype=dtype).pin_memory()
    index = torch.tensor(np.stack([gather, scatter]), dtype=torch.int64).pin_memory()
    xw = torch.empty(steps * rows * config.spec.num_gates * H, dtype=torch.float32, device="cuda")
    h0 = layer.h_pool[torch.from_numpy(gather).cuda()].clone()
    c0 = layer.c_pool[torch.from_numpy(gather).cuda()].clone() if layer.c_pool is not None else h0
    scatter_rows = torch.from_numpy(scatter).cuda()
    layer.h_pool[scatter_rows] = float("nan")
    if layer.c_pool is not None:
        layer.c_pool[scatter_rows] = float("nan")
    torch.cuda.current_stream().synchronize()  # (a device-wide synchronise would wait for the resident launch)
    layer.run(steps, rows, x.data_ptr(), out.data_ptr(), index.data_ptr(), index[1].data_ptr(), xw.data_ptr(),
              timeout)
    ref_out, ref_h, ref_c = reference_forward(config.cell, params, x.cuda().transpose(0, 1), h0, c0)
    ours = {"output": out.transpose(0, 1), "h_n": layer.h_pool[scatter_rows]}
    ref = {"output": ref_out, "h_n": ref_h}
    if layer.c_pool is not None:
        ours["c_n"], ref["c_n"] = layer.c_pool[scatter_rows], ref_c
    assert_close_to_reference(ours, ref, dtype=config.dtype, context=f"{config}, {rows} rows, {steps} steps")


@pytest.mark.gpu
@pytest.mark.parametrize("config", RESIDENT_SAMPLE, ids=str)
def test_gpu_ticks_match_float64_reference(config):
    seed = hash(str(config)) % 2**32  # fresh per run (str hashes are salted); printed on failure
    rng = np.random.default_rng(seed)
    # 26 rows: a layout of 26 columns where the batch tile is 1 or 2 (rows not 16-byte aligned: a step
    # pushes the whole slice), 28 or 32 where it is 4 or 8 (a step pushes only the tick's columns)
    rows = 26
    layer, params = _layer(config, rows, rng, slots=2 * rows + 3, idle=30.0, lifetime=60.0)
    try:
        for n, steps in [(1, 1), (rows, 1), (5, 3), (17, 2), (rows, 4), (3, 1)]:
            _tick(layer, params, rng, n, steps)
        # One launch served the ticks; a second only if the GPU's global timer jumped (it is resynchronised
        # with the host's clock now and then) past the launch's lifetime.
        assert layer.launches <= 2, layer.launches
        assert layer.words[RESIDENT_CONTROL.index("done")] == layer.tick == 6
    finally:
        assert layer.stop(timeout=5.0), f"seed {seed}"
        layer.release()


@pytest.mark.gpu
def test_gpu_an_idle_or_old_launch_leaves_and_the_next_tick_launches_again():
    config = RESIDENT_SAMPLE[0]
    rng = np.random.default_rng(int(time.time()))
    layer, params = _layer(config, 8, rng, slots=20, idle=0.01, lifetime=0.25)
    exited = RESIDENT_CONTROL.index("exited")
    try:
        _tick(layer, params, rng, 3, 1)
        time.sleep(0.1)  # well past the idle bound: it left by itself
        assert layer.words[exited] == layer.generation == 1
        _tick(layer, params, rng, 8, 2)
        assert layer.launches == 2
        started = time.perf_counter()  # ticks every ~2 ms, past the lifetime: it leaves and comes back
        while time.perf_counter() - started < 0.6:
            _tick(layer, params, rng, 4, 1)
            time.sleep(0.002)
        assert layer.launches >= 4
    finally:
        assert layer.stop(timeout=5.0)
        layer.release()
    assert layer.words[exited] == layer.generation
    import torch

    torch.cuda.synchronize()  # nothing of it is left running


@pytest.mark.gpu
def test_gpu_a_stopped_layer_refuses_ticks_and_a_stalled_tick_times_out():
    import torch

    from persistrnn.errors import KernelLaunchError

    config = RESIDENT_SAMPLE[1]
    rng = np.random.default_rng(int(time.time()))
    layer, params = _layer(config, 4, rng, slots=12)
    _tick(layer, params, rng, 2, 1)
    assert layer.stop(timeout=5.0)
    layer.release()
    with pytest.raises(KernelLaunchError, match="stopped"):
        _tick(layer, params, rng, 2, 1)
    # A launch that cannot start yet (a long kernel holds its stream) times out, bounded, and is told to stop.
    blocked, params = _layer(config, 4, rng, slots=12)
    with torch.cuda.stream(blocked.stream):
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles ahead of the launch on its stream
    with pytest.raises(TimeoutError, match="did not finish"):
        _tick(blocked, params, rng, 2, 1, timeout=0.05)
    assert blocked.stop(timeout=10.0)
    blocked.release()


@pytest.mark.gpu
def test_gpu_a_launch_that_raises_is_not_waited_for_and_the_next_tick_launches(monkeypatch):
    from persistrnn import runtime
    from persistrnn.errors import KernelLaunchError
    from persistrnn.persistent import resident

    config = RESIDENT_SAMPLE[1]
    rng = np.random.default_rng(int(time.time()))
    layer, params = _layer(config, 4, rng, slots=12)

    def refused(*args, **kwargs):
        raise KernelLaunchError("refused by the test")

    with monkeypatch.context() as patch:
        patch.setattr(resident.runtime, "launch", refused)
        with pytest.raises(KernelLaunchError, match="refused by the test"):
            _tick(layer, params, rng, 2, 1, timeout=5.0)
    assert layer.generation == 0 and layer.launches == 0  # nothing to wait for
    for pool in (layer.h_pool, layer.c_pool):  # the refused tick left its destination slots poisoned
        pool.normal_(0.0, 0.5)
    _tick(layer, params, rng, 3, 2, timeout=5.0)  # launched now, and right
    assert layer.launches == 1
    assert layer.stop(timeout=5.0) and layer.stopped
    layer.release()
    assert runtime.wait_timeout_ns() > 0


# ---- the resident configuration's choice (CPU, the device's answers stood in) ---------------------


def _stand_in_device(monkeypatch, plan_config, holds, unlaunchable=()):
    """resident_config's device questions answered on the CPU: the planner chooses ``plan_config``, a
    configuration holds ``holds(config)`` rows, and the clusters of ``unlaunchable`` configurations cannot be
    resident."""
    import types

    import torch

    from persistrnn import plan, runtime
    from persistrnn.errors import KernelLaunchError
    from persistrnn.persistent import resident

    monkeypatch.setattr(runtime, "device_facts", lambda: types.SimpleNamespace(sm_count=132))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(plan, "cached_plan", lambda shape, rows: types.SimpleNamespace(
        path="persistent" if plan_config else "fallback", config=plan_config))
    monkeypatch.setattr(resident, "compile_config", lambda config: None)
    monkeypatch.setattr(resident, "batch_per_launch", lambda config, device: holds(config))

    def prepared(config, device, rows, slices):
        if dataclasses.replace(config, resident_input_size=0) in unlaunchable:
            raise KernelLaunchError(f"{config}: its cluster cannot be resident")

    monkeypatch.setattr(resident, "_prepared_launch", prepared)
    return resident


def test_the_resident_choice_is_the_first_candidate_that_holds_every_row(monkeypatch):
    from persistrnn.plan import ModelShape

    planned = KernelConfig("lstm", 128, "cluster", 4, 128, 4, 2, fused_step=True)
    resident = _stand_in_device(monkeypatch, planned, lambda c: {4: 38, 2: 28, 8: 80, 16: 120}[c.blocks])
    config, rows = resident.resident_config(ModelShape("lstm", 40, 128), 64)
    # the planner's choice holds 38 rows and the sizes-alone one (2 blocks) 28: the cluster of 8 holds all 64
    assert (config.sync, config.blocks, config.resident_input_size, rows) == ("cluster", 8, 40, 64)
    assert not config.lengths and not config.test_hook and not config.save_gates
    config, rows = resident.resident_config(ModelShape("lstm", 40, 128), 24)  # the planner's choice holds 24
    assert (config.blocks, config.fused_step, rows) == (4, True, 24)


def test_the_resident_choice_takes_the_most_rows_when_none_holds_all_and_skips_what_cannot_run(monkeypatch):
    from persistrnn.plan import ModelShape

    grid = KernelConfig("lstm", 128, "grid", 32, 256, 8, 8)  # never resident: a grid barrier spans the launch
    unlaunchable = {KernelConfig("lstm", 128, "cluster", 16, 256, 8, 8)}
    resident = _stand_in_device(monkeypatch, grid, lambda c: {2: 28, 8: 40, 16: 60}[c.blocks], unlaunchable)
    config, rows = resident.resident_config(ModelShape("lstm", 40, 128), 64)
    assert (config.blocks, rows) == (8, 40)  # 16 blocks would hold 60, but their cluster cannot be resident


def test_the_resident_choice_names_why_nothing_runs(monkeypatch):
    from persistrnn.plan import ModelShape

    resident = _stand_in_device(monkeypatch, None, lambda c: 0)
    with pytest.raises(ConfigError, match="one layer of one direction, got 2 layers"):
        resident.resident_config(ModelShape("lstm", 40, 128, num_layers=2), 64)

    def spills(config):
        raise ConfigError(f"{config} spills to local memory")

    monkeypatch.setattr(resident, "compile_config", spills)
    with pytest.raises(ConfigError, match="no resident kernel of lstm H=128 .* spills to local memory"):
        resident.resident_config(ModelShape("lstm", 40, 128), 64)
