"""Persistent recurrence kernels: configurations, sm_90 builds, and (on a GPU)
agreement with the float64 reference."""

import dataclasses

import numpy as np
import pytest
from helpers import assert_close_to_reference, exact_torch, poison_outputs, reference_forward, rounded_layer, torch_peer

from persistrnn import cells, persistent
from persistrnn.persistent import ConfigError, KernelConfig
from persistrnn.plan import config_label

CELL_NAMES = tuple(cells.CELLS)

# ---- configurations (CPU) ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sync="single", blocks=2), "runs 1 block"),
        (dict(sync="cluster", blocks=17), "2..16"),
        (dict(sync="grid", blocks=1), ">= 2 blocks"),
        (dict(sync="ring"), "one of"),
        (dict(threads=100), "multiple of 32"),
        (dict(group_size=3), "power of two"),
        (dict(group_size=64), "power of two"),
        (dict(batch_tile=3), "1, 2, 4 or 8"),
        (dict(shared_k_chunks=99), "column chunks"),
        (dict(hidden_size=3, sync="cluster", blocks=4), "at least one hidden unit"),
        (dict(hidden_size=9, sync="cluster", blocks=4), "without units"),
        (dict(dtype="float64"), "one of"),
        (dict(math="wmma"), "one of"),
        (dict(math="mma"), "group_size: math 'mma' needs 32, got 8"),  # fp32 runs TF32
        (dict(math="mma", dtype="float16"), "group_size: math 'mma' needs 32, got 8"),
        (dict(math="mma", dtype="float16", group_size=32), "batch_tile: math 'mma' needs 8, got 1"),
        (dict(math="mma", dtype="float16", group_size=32, batch_tile=8, k_split=3), "power of two dividing"),
        (dict(math="mma", dtype="float16", group_size=32, batch_tile=8, k_split=16), "dividing the 8 warps"),
        (dict(k_split=2), "only the mma path splits K"),
        (dict(one_sync=True), "only cell 'gru_reset_before'"),
        (dict(cell="gru_reset_before", one_sync=True, sync="grid"), "expected sync 'single' or 'cluster', got 'grid'"),
        (dict(cell="gru_reset_before", one_sync=True, prefetch_steps=1), "expected prefetch_steps >= 2, got 1"),
        (dict(cell="gru_reset_before", one_sync=True, math="mma", dtype="float16", group_size=32, batch_tile=8),
         "expected math 'ffma', got 'mma'"),
        (dict(tagged_exchange=True), "only sync 'grid' exchanges through L2, got sync 'cluster'"),
    ],
)
def test_invalid_configs_name_what_was_expected(kwargs, message):
    base = dict(cell="lstm", hidden_size=64, sync="cluster", blocks=4)
    with pytest.raises(ConfigError, match=message):
        KernelConfig(**{**base, **kwargs})


def test_config_rejects_non_int_sizes():
    with pytest.raises(TypeError, match="expected an int, got float"):
        KernelConfig("lstm", 64.0, "single", 1)
    with pytest.raises(ValueError, match="expected one of"):
        KernelConfig("lstm2", 64, "single", 1)


@pytest.mark.parametrize("cell", CELL_NAMES)
@pytest.mark.parametrize("hidden", [1, 64, 100, 256, 333, 1000, 1024])
def test_derived_sizes_cover_every_row_and_column(cell, hidden):
    cfg = persistent.default_config(cell, hidden, 3, sm_count=132)
    spec = cfg.spec
    # Every hidden unit has a block; every block has a unit.
    assert cfg.blocks * cfg.units_per_block >= hidden > (cfg.blocks - 1) * cfg.units_per_block
    # Every row of each stage has a work group, and every column a lane chunk.
    for s in range(spec.num_stages):
        assert cfg.rows_per_group(s) * cfg.work_groups >= cfg.stage_rows(s)
    assert cfg.k_per_thread * cfg.group_size >= hidden
    assert cfg.padded_hidden >= max(hidden, cfg.blocks * cfg.units_per_block)
    # Slices and vector loads stay 16-byte aligned.
    for batch in (1, 3, 17, 64):
        bp = cfg.batch_stride(batch)
        assert bp >= batch and bp % cfg.batch_tile == 0 and (cfg.units_per_block * bp) % 4 == 0


def test_shared_bytes_grow_with_batch_and_max_batch_fits():
    cfg = KernelConfig("lstm", 256, "cluster", 8, batch_tile=4)
    assert cfg.shared_bytes(8) > cfg.shared_bytes(4) > cfg.shared_bytes(0)
    limit = 227 * 1024
    m = cfg.max_batch(limit)
    assert m >= 32 and cfg.shared_bytes(m) <= limit < cfg.shared_bytes(m + cfg.batch_align)


def test_shared_k_chunks_move_weights_out_of_registers():
    cfg = KernelConfig("gru", 256, "cluster", 8, group_size=8)
    half = dataclasses.replace(cfg, shared_k_chunks=cfg.k_per_thread // 2)
    assert half.register_weights == cfg.register_weights - half.rows_per_group(0) * half.shared_k_chunks
    assert half.shared_bytes(1) - cfg.shared_bytes(1) == 4 * half.shared_weight_floats > 0


def test_default_config_picks_the_cheapest_sync_that_holds_the_weights():
    assert persistent.default_config("rnn_tanh", 64, 1, sm_count=132).sync == "single"
    assert persistent.default_config("lstm", 256, 1, sm_count=132).sync == "cluster"
    assert persistent.default_config("lstm", 1024, 1, sm_count=132).sync == "grid"
    with pytest.raises(ConfigError, match="does not fit on chip"):
        persistent.default_config("lstm", 4096, 1, sm_count=132)


def test_rendered_source_carries_the_cell_math():
    src = persistent.render_source(KernelConfig("gru_reset_before", 100, "cluster", 4))
    assert "#define PRNN_STAGES 2" in src
    assert "const float r_h = r * h;" in src  # the between-stage statement
    assert "prnn_between" in src and "prnn_pointwise" in src
    lstm = persistent.render_source(KernelConfig("lstm", 100, "single", 1))
    assert "const float c_new = f * c + i * g;" in lstm and "PRNN_HAS_C 1" in lstm


# Every family (cell x sync mode) and a spread of mappings, built for sm_90
# without a GPU: no spills, no local memory.
COMPILE_SAMPLE = [
    KernelConfig(cell, hidden, sync, blocks, threads, group, tile, shared)
    for cell in CELL_NAMES
    for (hidden, sync, blocks, threads, group, tile, shared) in (
        (64, "single", 1, 256, 8, 1, 0),
        (100, "single", 1, 256, 32, 1, 3),
        (256, "cluster", 8, 256, 8, 1, 0),
        (333, "cluster", 16, 256, 16, 8, 0),
        (256, "cluster", 4, 256, 8, 2, 20),
        (1024, "grid", 128, 256, 16, 1, 0),
    )
]


def _mma(cell, hidden, sync, blocks, threads, k_split, dtype="bfloat16"):
    return KernelConfig(cell, hidden, sync, blocks, threads, group_size=32, batch_tile=8, dtype=dtype, math="mma",
                        k_split=k_split)


# (hidden, sync, blocks, threads, k_split), batch, steps
MMA_SAMPLE = [
    ((1, "single", 1, 64, 1), 1, 7),
    ((64, "single", 1, 256, 2), 3, 100),
    ((100, "cluster", 4, 256, 4), 17, 7),
    ((256, "cluster", 8, 256, 2), 8, 100),
    ((333, "cluster", 16, 256, 2), 64, 7),
    ((1000, "grid", 125, 256, 8), 1, 7),
    ((1024, "grid", 128, 256, 8), 16, 100),
]
COMPILE_SAMPLE += [_mma(cell, *shape) for cell in CELL_NAMES for shape, _, _ in MMA_SAMPLE]

# TF32 (fp32 weights on the mma path): (hidden, sync, blocks, threads, k_split), batch, steps. Each
# fragment is twice a 16-bit one's registers, so the shapes whose 16-bit fragments fill the registers
# (H=333 on 16 blocks, H=1000 on 125) spill and the planner never offers them.
TF32_SAMPLE = [
    ((1, "single", 1, 64, 1), 1, 7),
    ((64, "single", 1, 256, 2), 3, 100),
    ((100, "cluster", 4, 256, 4), 17, 7),
    ((256, "cluster", 8, 256, 2), 8, 100),
    ((256, "cluster", 16, 256, 2), 20, 50),
    ((1024, "grid", 128, 256, 8), 16, 100),
]
COMPILE_SAMPLE += [_mma(cell, *shape, dtype="float32") for cell in CELL_NAMES for shape, _, _ in TF32_SAMPLE]

# The 1-sync reset-before GRU: (hidden, sync, blocks, threads, group, tile, dtype), batch, steps
ONE_SYNC_SAMPLE = [
    ((100, "single", 1, 256, 16, 2, "float32"), 3, 7),
    ((256, "cluster", 8, 256, 8, 1, "float32"), 1, 100),
    ((256, "cluster", 8, 256, 8, 8, "float32"), 8, 100),
    ((100, "cluster", 4, 128, 4, 4, "float32"), 64, 7),
    ((100, "cluster", 4, 256, 8, 1, "float32"), 3, 1),
    ((333, "cluster", 16, 256, 16, 2, "bfloat16"), 17, 7),
    ((200, "cluster", 8, 256, 8, 1, "float16"), 1, 7),
]


def _one_sync(hidden, sync, blocks, threads, group, tile, dtype):
    return KernelConfig("gru_reset_before", hidden, sync, blocks, threads, group, tile, dtype=dtype, one_sync=True)


COMPILE_SAMPLE += [_one_sync(*shape) for shape, _, _ in ONE_SYNC_SAMPLE]


# ---- GPU: agreement with the float64 reference -------------------------------


def check_against_reference(config, batch, steps, seed, input_size=None, batch_slice=None):
    """One run of ``config`` against the float64 reference, by the tolerance
    rule (tests/helpers.py), with torch's CUDA function on the same tensors as
    the peer (none for the reset-before GRU). Returns the measurements.

    Parameters and inputs are drawn in float64, rounded to the config's dtype
    for the kernel, and the reference runs on the rounded values: the error
    is the kernel's own, not the rounding of its inputs. The outputs start as
    NaN: an element the kernel never writes fails."""
    import torch

    rng = np.random.default_rng(seed)
    spec = config.spec
    H = config.hidden_size
    dtype = getattr(torch, config.dtype)
    dev = torch.device("cuda")
    t, x_t, h0_t, c0_t = rounded_layer(config.cell, config.dtype, input_size or H, H, batch, steps, rng, dev)
    ref_out, ref_h, ref_c = reference_forward(config.cell, t, x_t, h0_t, c0_t)

    nan = float("nan")
    out = torch.full((steps, batch, H), nan, dtype=dtype, device=dev)
    h_n = torch.full((batch, H), nan, dtype=dtype, device=dev)
    c_n = torch.full((batch, H), nan, dtype=dtype, device=dev) if spec.has_cell_state else None
    c0 = c0_t if spec.has_cell_state else None
    with exact_torch():  # the input projection's GEMM in exact fp32, as the fp32 bound assumes
        xw = persistent.input_projection(x_t, t["w_ih"], t["b_ih"])
        persistent.run_recurrence(config, xw, t["w_hh"], t["b_hh"], h0_t, c0, out=out, h_n=h_n, c_n=c_n,
                                  batch_slice=batch_slice)
    ours, ref = {"output": out, "h_n": h_n}, {"output": ref_out, "h_n": ref_h}
    if spec.has_cell_state:
        ours["c_n"], ref["c_n"] = c_n, ref_c
    peer = torch_peer(config.cell, [[t]], x_t, h0_t, c0)
    if peer is not None:
        peer = {"output": peer[0], "h_n": peer[1][0], **({"c_n": peer[2][0]} if spec.has_cell_state else {})}
    return assert_close_to_reference(ours, ref, peer, dtype="tf32" if config.tf32 else config.dtype,
                                     context=f"{config}, batch {batch} in slices of {batch_slice}, {steps} steps, "
                                             f"seed {seed}")


def _gpu_cases():
    """(config, batch, steps): every cell x sync mode, the issue's sizes, and mapping variants."""
    cases = []
    sizes = [(1, 1, 7), (64, 3, 100), (100, 17, 7), (256, 8, 100), (333, 1, 7), (1000, 3, 7), (1024, 1, 100)]
    for cell in CELL_NAMES:
        for hidden, batch, steps in sizes:
            cases.append((persistent.default_config(cell, hidden, batch, sm_count=132), batch, steps))
        # each sync mode on one size, whatever the default would pick
        cases.append((KernelConfig(cell, 100, "single", 1, 256, 16, 2), 3, 7))
        cases.append((KernelConfig(cell, 100, "cluster", 4, 128, 4, 4), 64, 7))
        cases.append((KernelConfig(cell, 100, "grid", 10, 64, 2, 1), 17, 7))
        cases.append((KernelConfig(cell, 256, "cluster", 16, 512, 32, 8, 2), 17, 1))
        cases.append((KernelConfig(cell, 64, "grid", 64, 32, 1, 2), 8, 100))
        # 16-bit: tensor cores in each sync mode, and the widening ffma path
        for dtype in ("bfloat16", "float16"):
            for (hidden, sync, blocks, threads, k_split), batch, steps in MMA_SAMPLE:
                cases.append((_mma(cell, hidden, sync, blocks, threads, k_split, dtype), batch, steps))
            cases.append((KernelConfig(cell, 100, "cluster", 4, 128, 8, 4, dtype=dtype), 17, 7))
        # fp32 on tensor cores: TF32
        for (hidden, sync, blocks, threads, k_split), batch, steps in TF32_SAMPLE:
            cases.append((_mma(cell, hidden, sync, blocks, threads, k_split, "float32"), batch, steps))
    cases += [(_one_sync(*shape), batch, steps) for shape, batch, steps in ONE_SYNC_SAMPLE]
    return cases


GPU_CASES = _gpu_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, steps", GPU_CASES, ids=[f"{c}-B{b}-T{t}" for c, b, t in GPU_CASES])
def test_kernel_matches_float64_reference(config, batch, steps):
    # A fresh seed per run (str hashes are salted per process); printed on failure.
    seed = hash((str(config), batch, steps)) % 2**32
    check_against_reference(config, batch, steps, seed=seed)


@pytest.mark.gpu
def test_large_batch_runs_in_slices_of_what_a_block_holds():
    from persistrnn import runtime

    for cfg in (KernelConfig("lstm", 256, "cluster", 8, batch_tile=8), KernelConfig("gru", 256, "grid", 16)):
        per_launch = cfg.max_batch(runtime.device_facts().shared_per_block_optin)
        check_against_reference(cfg, per_launch + 5, 3, seed=7)


FUSED_CASES = [
    # (config, batch, steps): every one-stage cell; each sync mode; batch tiles; odd units per block
    (KernelConfig("lstm", 256, "cluster", 16, 128, 8, 1, fused_step=True), 1, 100),
    (KernelConfig("gru", 256, "cluster", 16, 128, 8, 2, fused_step=True), 17, 20),
    (KernelConfig("rnn_tanh", 64, "single", 1, 256, 4, 1, fused_step=True), 3, 50),
    (KernelConfig("rnn_relu", 100, "cluster", 4, 800, 32, 4, fused_step=True), 9, 7),
    (KernelConfig("lstm", 33, "cluster", 3, 352, 32, 1, fused_step=True), 5, 9),
    (KernelConfig("lstm", 1024, "grid", 128, 256, 32, 2, fused_step=True), 4, 7),
    (KernelConfig("gru", 96, "cluster", 2, 384, 8, 8, fused_step=True, dtype="bfloat16"), 10, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, steps", FUSED_CASES, ids=[f"{c}-B{b}-T{t}" for c, b, t in FUSED_CASES])
def test_fused_step_matches_float64_reference(config, batch, steps):
    seed = hash((str(config), batch, steps)) % 2**32
    check_against_reference(config, batch, steps, seed=seed, batch_slice=max(1, batch // 2))


TAGGED_CASES = [
    # (config, batch, steps): the grid exchange in tagged words; every cell; the case it is offered for
    # (LSTM 1024 at batch 1), several rounds of reads per thread (H * B over threads x 8), the fused step,
    # a two-stage cell, 16-bit on both math paths
    (KernelConfig("lstm", 1024, "grid", 128, 256, 16, 1, tagged_exchange=True), 1, 100),
    (KernelConfig("gru_reset_before", 100, "grid", 10, 64, 2, 1, tagged_exchange=True), 17, 7),
    (KernelConfig("gru", 64, "grid", 64, 32, 1, 2, tagged_exchange=True), 8, 100),
    (KernelConfig("lstm", 1024, "grid", 128, 256, 32, 2, fused_step=True, tagged_exchange=True), 4, 7),
    (KernelConfig("rnn_tanh", 1000, "grid", 125, 256, 8, 1, dtype="bfloat16", tagged_exchange=True), 3, 7),
    (dataclasses.replace(_mma("rnn_relu", 1000, "grid", 125, 256, 8, "float16"), tagged_exchange=True), 1, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, steps", TAGGED_CASES, ids=[f"{c}-B{b}-T{t}" for c, b, t in TAGGED_CASES])
def test_tagged_exchange_matches_float64_reference(config, batch, steps):
    seed = hash((str(config), batch, steps)) % 2**32
    check_against_reference(config, batch, steps, seed=seed)


ONE_BUFFER_CASES = [
    # (config, batch, steps): grid blocks of one-stage cells keep h once, so a launch holds batches that
    # two copies did not fit (each batch here is above what two copies held, and runs as one launch):
    # TF32, 16-bit and FFMA products, the fused step, every one-stage cell
    (_mma("lstm", 1024, "grid", 128, 256, 8, "float32"), 20, 30),
    (_mma("gru", 1024, "grid", 114, 256, 8, "bfloat16"), 29, 9),
    (KernelConfig("lstm", 1024, "grid", 128, 256, 32, 1, fused_step=True), 33, 7),
    (KernelConfig("rnn_relu", 1024, "grid", 128, 256, 16, 8), 37, 7),
    (KernelConfig("gru", 1000, "grid", 125, 256, 16, 4), 30, 5),
]


def test_a_grid_block_of_a_one_stage_cell_keeps_h_once_and_holds_twice_the_batch():
    lstm = KernelConfig("lstm", 1024, "grid", 128, 256, 32, 1)
    assert lstm.h_buffers == 1 and "#define PRNN_HBUFS 1" in persistent.render_source(lstm)
    two = {"tagged": dataclasses.replace(lstm, tagged_exchange=True),
           "two-stage": KernelConfig("gru_reset_before", 1024, "grid", 128, 256, 32, 1),
           "cluster": KernelConfig("lstm", 256, "cluster", 16)}
    assert all(c.h_buffers == 2 and "#define PRNN_HBUFS 2" in persistent.render_source(c) for c in two.values())
    per_column = lstm.padded_hidden * lstm.batch_align * 4  # one copy of h, one batch_align of columns
    assert (two["tagged"].shared_bytes(lstm.batch_align) - two["tagged"].shared_bytes(0)
            - (lstm.shared_bytes(lstm.batch_align) - lstm.shared_bytes(0))) == per_column
    limit = 227 * 1024
    for config, batch, _ in ONE_BUFFER_CASES:
        assert config.h_buffers == 1
        assert config.max_batch(limit) >= batch > dataclasses.replace(config, tagged_exchange=True).max_batch(limit)


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, steps", ONE_BUFFER_CASES,
                         ids=[f"{c}-B{b}-T{t}" for c, b, t in ONE_BUFFER_CASES])
def test_one_buffer_grid_launches_match_float64_reference(config, batch, steps):
    assert persistent.batch_per_launch(config, 0) >= batch  # one launch: the single buffer is what runs
    seed = hash((str(config), batch, steps)) % 2**32
    check_against_reference(config, batch, steps, seed=seed)


CLIPPED_CASES = [
    # (config, batch, steps): cells with their gates clamped at 0.5 (ONNX clip; cells.with_clip), where most
    # of the tests' pre-activations lie outside the bound: each sync mode, a two-stage cell, the fused step,
    # 16-bit on both math paths
    (KernelConfig("lstm+clip=0.5", 256, "cluster", 16), 3, 20),
    (KernelConfig("gru+clip=0.5", 100, "single", 1, 256, 16, 2), 5, 9),
    (KernelConfig("gru_reset_before+clip=0.5", 100, "grid", 10, 64, 2, 1), 17, 7),
    (KernelConfig("rnn_relu+clip=0.5", 100, "cluster", 4, 128, 4, 4), 9, 7),
    (KernelConfig("lstm+clip=0.5", 256, "cluster", 16, 128, 8, 1, fused_step=True), 1, 50),
    (KernelConfig("gru+clip=0.5", 96, "cluster", 2, 384, 8, 8, fused_step=True, dtype="bfloat16"), 10, 7),
    (_mma("lstm+clip=0.5", 256, "cluster", 8, 256, 2, "float16"), 8, 7),
    # other activations (ONNX activations; cells.with_activations), one with a clip inside them
    (KernelConfig("lstm+act=hardsigmoid(0.2,0.5)/tanh/leakyrelu(0.1)", 256, "cluster", 16), 3, 20),
    (KernelConfig("gru_reset_before+clip=0.5+act=hardsigmoid(0.2,0.5)/scaledtanh(2.0,0.5)", 100, "grid", 10, 64,
                  2, 1), 17, 7),
    (KernelConfig("gru+act=sigmoid/leakyrelu(0.01)", 96, "cluster", 2, 384, 8, 8, fused_step=True), 10, 7),
    # the LSTM's forget gate coupled to its input gate (ONNX input_forget; cells.with_coupled_gates)
    (KernelConfig("lstm+clip=0.5+coupled", 256, "cluster", 16, 128, 8, 1, fused_step=True), 2, 30),
    (KernelConfig("lstm+act=sigmoid/elu(0.5)/softplus", 100, "single", 1, 256, 16, 2), 5, 9),
    (KernelConfig("gru_reset_before+act=sigmoid/thresholdedrelu(0.2)", 100, "cluster", 4, 128, 4, 4), 9, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, steps", CLIPPED_CASES, ids=[f"{c}-B{b}-T{t}" for c, b, t in CLIPPED_CASES])
def test_clipped_cells_match_float64_reference(config, batch, steps):
    seed = hash((str(config), batch, steps)) % 2**32
    check_against_reference(config, batch, steps, seed=seed)


def test_fp32_weights_on_the_mma_path_run_tf32_with_twice_the_fragment_registers():
    tf32 = _mma("lstm", 256, "cluster", 8, 256, 2, "float32")
    half = _mma("lstm", 256, "cluster", 8, 256, 2, "bfloat16")
    assert tf32.tf32 and not half.tf32 and not KernelConfig("lstm", 256, "cluster", 8).tf32
    assert tf32.register_weights == 2 * half.register_weights == 8 * tf32.m_tiles_per_warp(0) * tf32.k_tiles_per_warp
    assert "#define PRNN_TF32 1" in persistent.render_source(tf32)
    assert "#define PRNN_TF32 0" in persistent.render_source(half)
    assert "tf32" in config_label(tf32) and "tf32" not in config_label(half)


def test_tagged_exchange_doubles_the_grid_buffer_only():
    barrier = KernelConfig("lstm", 1024, "grid", 128, 256, 16, 1)
    tagged = dataclasses.replace(barrier, tagged_exchange=True)
    assert tagged.exchange_floats(3) == 2 * barrier.exchange_floats(3) == 4 * 1024 * barrier.batch_stride(3)
    assert KernelConfig("lstm", 256, "cluster", 8).exchange_floats(3) == 0
    assert "#define PRNN_TAGGED 1" in persistent.render_source(tagged)
    assert "#define PRNN_TAGGED 0" in persistent.render_source(barrier)


def test_fused_step_needs_a_work_group_per_unit():
    with pytest.raises(ConfigError, match=r"one work group per unit of the block \(32 work groups, 16 units"):
        KernelConfig("lstm", 256, "cluster", 16, 256, 8, 1, fused_step=True)
    with pytest.raises(ConfigError, match="a one-stage cell"):
        KernelConfig("gru_reset_before", 256, "cluster", 16, 128, 8, 1, fused_step=True)
    with pytest.raises(ConfigError, match="batch_tile <= group_size"):
        KernelConfig("lstm", 64, "single", 1, 256, 4, 8, fused_step=True)


SINGLE_SEQUENCE_CASES = [
    # (config, batch, batch_slice): launches of whole slices run the build with the slice size compiled in: batch 1,
    # slices of 1, 2 and 4, and an uneven last slice that runs the general build; single, cluster and grid sync; the
    # fused step, one-sync, tagged words, tensor cores, 16-bit
    (KernelConfig("lstm", 64, "single", 1, 128, 2, 1, fused_step=True), 1, None),
    (KernelConfig("gru", 256, "cluster", 16, 256, 16, 1, fused_step=True), 5, 1),
    (KernelConfig("gru_reset_before", 256, "cluster", 8, 256, 8, 1, one_sync=True), 3, 1),
    (KernelConfig("lstm", 1024, "grid", 128, 256, 32, 1, fused_step=True, tagged_exchange=True), 1, None),
    (KernelConfig("rnn_relu", 100, "cluster", 4, 128, 4, 1, dtype="float16"), 7, 1),
    (_mma("rnn_tanh", 256, "cluster", 8, 256, 2), 2, 1),
    (KernelConfig("lstm", 256, "cluster", 16, 128, 8, 2, fused_step=True), 8, 2),
    (KernelConfig("gru", 100, "single", 1, 256, 16, 4), 12, 4),
    (_mma("lstm", 256, "cluster", 8, 256, 2, "float16"), 8, None),
    (KernelConfig("rnn_tanh", 64, "cluster", 4, 128, 4, 2), 7, 2),
    # the planner's LSTM 256 batch-1 choice, two stages with shared weight chunks, a grid barrier at batch 1
    (KernelConfig("lstm", 256, "cluster", 16, 256, 8, 1), 1, None),
    (KernelConfig("gru_reset_before", 128, "cluster", 8, 256, 8, 1, shared_k_chunks=4), 3, 1),
    (KernelConfig("rnn_tanh", 512, "grid", 32, 256, 16, 1), 1, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, batch_slice", SINGLE_SEQUENCE_CASES,
                         ids=[f"{c}-B{b}-s{s}" for c, b, s in SINGLE_SEQUENCE_CASES])
def test_whole_slices_run_the_build_with_their_size_compiled_in(config, batch, batch_slice, monkeypatch):
    from persistrnn.persistent import launch

    launched = []
    real = launch._prepared_launch
    monkeypatch.setattr(launch, "_prepared_launch", lambda c, *a: (launched.append(c.slice_sequences), real(c, *a))[1])
    check_against_reference(config, batch, 9, seed=hash((str(config), batch)) % 2**32, batch_slice=batch_slice)
    whole = (batch % (batch_slice or batch) == 0 and (batch_slice or batch) <= persistent.MAX_SLICE_SEQUENCES
             and not config.tagged_exchange)
    assert launched and set(launched) == {(batch_slice or batch) if whole else 0}, launched


def test_idle_warps_prefetch_where_every_thread_copies_only_what_it_reads_otherwise():
    plain = KernelConfig("lstm", 64, "single", 1, 256, 8, 1)
    assert plain.early_prefetch and "#define PRNN_EARLY_PREFETCH 1" in persistent.render_source(plain)
    for other in (dataclasses.replace(plain, fused_step=True, threads=128, group_size=2),
                  KernelConfig("gru_reset_before", 256, "cluster", 8, 256, 8, 1, one_sync=True),
                  KernelConfig("lstm", 128, "cluster", 8, 256, 8, 1, instances=2, pipeline=True),
                  KernelConfig("lstm", 64, "single", 1, resident_input_size=16),
                  KernelConfig("lstm", 256, "cluster", 16, 256, 8, 1), KernelConfig("lstm", 1024, "grid", 128)):
        assert not other.early_prefetch, other
        assert "#define PRNN_EARLY_PREFETCH 0" in persistent.render_source(other), other


def test_a_build_that_spills_with_the_idle_warps_copies_is_made_without_them():
    from persistrnn import runtime

    # At 512 threads (128 registers a thread) this two-instance GRU fits only with the copies after the update.
    config = KernelConfig("gru", 100, "single", 1, 512, 16, 1, instances=2)
    early = runtime.compile_source("recurrence", persistent.render_source(config), arch="sm_90")
    assert early.kernel_resources(persistent.KERNEL_NAME).uses_local_memory
    binary = persistent.compile_config(config, arch="sm_90")
    assert not binary.kernel_resources(persistent.KERNEL_NAME).uses_local_memory
    late = persistent.render_source(config, early_prefetch=False)
    assert "#define PRNN_EARLY_PREFETCH 0" in late
    assert binary.key == runtime.compile_source("recurrence", late, arch="sm_90").key


def test_a_fixed_slice_build_is_the_configuration_itself_where_it_spills_or_is_too_large(monkeypatch):
    from persistrnn.persistent import launch

    config = KernelConfig("lstm", 64, "single", 1, 128, 2, 1, fused_step=True)

    def spills(c, arch=None):
        raise persistent.ConfigError(f"{c} spills")

    launch.fixed_slice_variant.cache_clear()
    try:
        monkeypatch.setattr(launch, "compile_config", lambda c, arch=None: persistent.compile_config(c, "sm_90"))
        assert launch.fixed_slice_variant(config, 1) == dataclasses.replace(config, slice_sequences=1)
        assert launch.fixed_slice_variant(config, persistent.MAX_SLICE_SEQUENCES + 1) is config
        tagged = KernelConfig("lstm", 1024, "grid", 128, 256, 32, 1, fused_step=True, tagged_exchange=True)
        assert launch.fixed_slice_variant(tagged, 1) is tagged  # measured slower with its slice compiled in
        monkeypatch.setattr(launch, "compile_config", spills)
        assert launch.fixed_slice_variant(config, 2) is config
    finally:
        launch.fixed_slice_variant.cache_clear()
    with pytest.raises(persistent.ConfigError, match="slice_sequences: a resident kernel"):
        KernelConfig("lstm", 64, "single", 1, resident_input_size=16, slice_sequences=1)
    with pytest.raises(persistent.ConfigError, match=r"slice_sequences: expected 0\.\.8, got 9"):
        KernelConfig("lstm", 64, "single", 1, slice_sequences=9)
    with pytest.raises(TypeError, match="slice_sequences: expected an int, got bool"):
        KernelConfig("lstm", 64, "single", 1, slice_sequences=True)
    assert "PRNN_SLICE_SEQUENCES 4" in persistent.render_source(dataclasses.replace(config, slice_sequences=4))


SLICED_CASES = [
    # (config, batch, batch_slice): every cell; single, cluster and mma; uneven last slices
    (KernelConfig("lstm", 256, "cluster", 8, 256, 8, 1), 20, 3),
    (KernelConfig("gru", 100, "single", 1, 256, 16, 2), 17, 5),
    (KernelConfig("gru_reset_before", 64, "cluster", 4, 128, 8, 1, one_sync=True, prefetch_steps=4), 9, 2),
    (KernelConfig("rnn_tanh", 33, "single", 1, 128, 4, 1), 6, 1),
    (KernelConfig("rnn_relu", 128, "cluster", 16, 128, 8, 4), 64, 8),
    (KernelConfig("lstm", 256, "cluster", 8, 256, 32, 8, dtype="bfloat16", math="mma", k_split=2), 21, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, batch_slice", SLICED_CASES,
                         ids=[f"{c}-B{b}-s{s}" for c, b, s in SLICED_CASES])
def test_batch_slices_match_float64_reference(config, batch, batch_slice):
    seed = hash((str(config), batch, batch_slice)) % 2**32
    check_against_reference(config, batch, 7, seed=seed, batch_slice=batch_slice)


MODEL_CASES = [
    # (config, layers, directions, batch, steps): the kernel adds b_ih to a plain GEMM's projections, and
    # starts from zero states where none are given: one-stage cells, the reset-after GRU (b_in outside
    # r * ...), the reset-before GRU's one-sync column product, the fused step, 16-bit mma, two launches
    # per bidirectional layer and one, and a pipeline (whose later layers take b_ih with the layer before's h)
    (KernelConfig("lstm", 64, "single", 1, 128, 2, 1, fused_step=True), 1, 1, 3, 9),
    (KernelConfig("gru", 100, "single", 1, 256, 16, 2), 2, 1, 5, 7),
    (KernelConfig("gru_reset_before", 64, "cluster", 4, 128, 8, 1, one_sync=True, prefetch_steps=4), 1, 1, 3, 7),
    (KernelConfig("rnn_tanh", 33, "single", 1, 128, 4, 1), 1, 2, 6, 5),
    (KernelConfig("gru", 128, "cluster", 2, instances=2, batch_tile=2), 1, 2, 4, 7),
    (KernelConfig("lstm", 128, "cluster", 4, instances=2, pipeline=True), 2, 1, 2, 20),
    (_mma("gru", 100, "cluster", 4, 256, 4, "float16"), 1, 1, 17, 7),
    (KernelConfig("rnn_relu", 100, "cluster", 4, 128, 8, 4, dtype="bfloat16"), 1, 1, 9, 7),
    (KernelConfig("gru", 64, "grid", 64, 32, 1, 2, tagged_exchange=True), 1, 1, 8, 20),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config, num_layers, directions, batch, steps", MODEL_CASES,
                         ids=[f"{c}-L{l}-D{d}-B{b}-T{t}" for c, l, d, b, t in MODEL_CASES])
@pytest.mark.parametrize("states", ["given", "zeros"])
def test_forward_model_adds_b_ih_and_starts_from_zero_states(config, num_layers, directions, batch, steps, states):
    import torch

    from persistrnn import reference

    seed = hash((str(config), num_layers, directions, batch, steps, states)) % 2**32
    rng = np.random.default_rng(seed)
    spec, H, dt = config.spec, config.hidden_size, getattr(torch, config.dtype)
    layers = [[rounded_layer(config.cell, config.dtype, H if l == 0 else directions * H, H, 1, 1, rng)[0]
               for _ in range(directions)] for l in range(num_layers)]

    def draw(*shape):  # rounded to the layer's dtype; the reference runs on the rounded values
        return torch.tensor(rng.standard_normal(shape) * 0.5, dtype=dt, device="cuda")

    def f64(t):
        return t.double().cpu().numpy()

    x, h0, c0 = draw(steps, batch, H), draw(num_layers * directions, batch, H), draw(num_layers * directions, batch, H)
    given = states == "given"
    hx = ((f64(h0), f64(c0)) if spec.has_cell_state else f64(h0)) if given else None
    ref_out, ref_state = reference.rnn_forward(config.cell, f64(x), [[{k: f64(v) for k, v in p.items()} for p in layer]
                                                                     for layer in layers], num_layers=num_layers,
                                               bidirectional=directions == 2, hx=hx)
    poison_outputs([(steps, batch, directions * H), h0.shape, h0.shape], dt)
    with exact_torch():  # the input projection's GEMM in exact fp32, as the fp32 bound assumes
        out, h_n, c_n = persistent.forward_model(config, layers, x, h0 if given else None,
                                                 c0 if given and spec.has_cell_state else None)
    ours, ref = {"output": out, "h_n": h_n}, {"output": ref_out}
    if spec.has_cell_state:
        ref["h_n"], ref["c_n"] = ref_state
        ours["c_n"] = c_n
    else:
        ref["h_n"] = ref_state
    assert_close_to_reference(ours, ref, None, dtype="tf32" if config.tf32 else config.dtype,
                              context=f"{config}, {num_layers} layer(s) x {directions}, batch {batch}, {steps} steps, "
                                      f"{states} states, seed {seed}")


def test_forward_model_takes_both_states_or_neither():
    import torch

    with pytest.raises(ValueError, match="c0 without h0; expected both or neither"):
        persistent.forward_model(KernelConfig("lstm", 8, "single", 1), [[{}]], torch.zeros(5, 2, 8), None,
                                 torch.zeros(1, 2, 8))


def test_input_projection_leaves_b_ih_to_the_kernel_where_not_given():
    import torch

    x, w, b = torch.randn(5, 3, 8), torch.randn(12, 8), torch.randn(12)
    plain = persistent.input_projection(x, w)
    assert plain.shape == (5, 3, 12) and torch.allclose(plain, (x @ w.t()))
    assert torch.allclose(persistent.input_projection(x, w, b), x @ w.t() + b)
    assert ("const float*", "xw_bias") in persistent.instance_fields(KernelConfig("lstm", 8, "single", 1))


@pytest.mark.parametrize("lengths,message", [
    ([3, 0], r"every length in 1\.\.5 .*got lengths from 0 to 3"),
    ([6, 2], r"every length in 1\.\.5 .*got lengths from 2 to 6"),
    ([3], r"lengths: expected shape \(2,\), got \(1,\)"),
])
def test_host_lengths_are_checked_on_the_host_before_anything_runs(lengths, message):
    import torch

    layers = [[{}]]  # never read: the lengths are refused first
    x = torch.zeros(5, 2, 3)
    with pytest.raises(ValueError, match=message):
        persistent.forward_model(KernelConfig("gru", 64, "single", 1), layers, x, torch.zeros(1, 2, 64), None,
                                 lengths=torch.tensor(lengths, dtype=torch.int32))
    with pytest.raises(TypeError, match="lengths: expected dtype torch.int32, got torch.int64"):
        persistent.forward_model(KernelConfig("gru", 64, "single", 1), layers, x, torch.zeros(1, 2, 64), None,
                                 lengths=torch.tensor(lengths))


@pytest.mark.gpu
def test_bad_inputs_raise_before_launch():
    import torch

    cfg = KernelConfig("gru", 64, "single", 1)
    dev = torch.device("cuda")
    xw = torch.randn(5, 2, 3 * 64, device=dev)
    w = torch.randn(3 * 64, 64, device=dev)
    b = torch.randn(3 * 64, device=dev)
    h0 = torch.randn(2, 64, device=dev)
    with pytest.raises(ValueError, match=r"w_hh: expected shape \(192, 64\), got \(64, 192\)"):
        persistent.run_recurrence(cfg, xw, w.t().contiguous(), b, h0, None)
    with pytest.raises(TypeError, match="xw: expected dtype torch.float32, got torch.float64"):
        persistent.run_recurrence(cfg, xw.double(), w, b, h0, None)
    with pytest.raises(ValueError, match="xw: expected a CUDA tensor"):
        persistent.run_recurrence(cfg, xw.cpu(), w, b, h0, None)
    with pytest.raises(ValueError, match="h0: expected a CUDA tensor, got one on cpu"):
        persistent.run_recurrence(cfg, xw, w, b, h0.cpu(), None)
    with pytest.raises(ValueError, match="gru has no cell state: expected c0=None"):
        persistent.run_recurrence(cfg, xw, w, b, h0, h0)
    with pytest.raises(ValueError, match=r"xw: expected a 3-D tensor \(T, B, 192\), got \(10, 192\)"):
        persistent.run_recurrence(cfg, xw.view(10, 192), w, b, h0, None)


def _compiled_configs():
    """COMPILE_SAMPLE plus every configuration the GPU tests run (defined below)."""
    single = {dataclasses.replace(c, slice_sequences=s or b) for c, b, s in SINGLE_SEQUENCE_CASES
              if b % (s or b) == 0 and not c.tagged_exchange}
    return sorted(set(COMPILE_SAMPLE) | single | {c for c, _, _ in GPU_CASES + SLICED_CASES + FUSED_CASES
                                                  + TAGGED_CASES + CLIPPED_CASES + ONE_BUFFER_CASES},
                  key=str)


@pytest.mark.parametrize("config", _compiled_configs(), ids=str)
def test_kernel_compiles_for_sm90_without_local_memory(config):
    binary = persistent.compile_config(config, arch="sm_90")
    res = binary.kernel_resources(persistent.KERNEL_NAME)
    assert not res.uses_local_memory, res


@pytest.mark.gpu
def test_grid_that_cannot_be_resident_is_refused_not_hung():
    import torch

    from persistrnn import runtime

    sm_count = runtime.device_facts().sm_count
    blocks = persistent.blocks_for(1024, 2 * sm_count)
    cfg = KernelConfig("rnn_tanh", 1024, "grid", blocks, 512, 32, 1)  # ~128 registers: one block per SM
    dev = torch.device("cuda")
    xw = torch.randn(3, 1, 1024, device=dev)
    with pytest.raises(runtime.KernelLaunchError, match=f"needs {blocks} blocks resident at once"):
        persistent.run_recurrence(cfg, xw, torch.randn(1024, 1024, device=dev), torch.randn(1024, device=dev),
                                  torch.randn(1, 1024, device=dev), None)


@pytest.mark.parametrize("cell", CELL_NAMES)
@pytest.mark.parametrize("shape", [shape for shape, _, _ in MMA_SAMPLE], ids=str)
def test_mma_tiles_cover_every_row_and_column(cell, shape):
    cfg = _mma(cell, *shape)
    row_groups = cfg.threads // 32 // cfg.k_split
    for s in range(cfg.spec.num_stages):
        assert cfg.m_tiles_per_warp(s) * row_groups * 16 >= cfg.stage_rows(s)
    assert cfg.padded_hidden >= cfg.k_split * cfg.k_tiles_per_warp * 16 >= cfg.hidden_size
    assert cfg.register_weights == sum(4 * cfg.m_tiles_per_warp(s) * cfg.k_tiles_per_warp
                                       for s in range(cfg.spec.num_stages))
    for batch in (1, 8, 9, 64):
        bp = cfg.batch_stride(batch)
        # every 8-column tile fits, and B fragment rows 0, 2, 4, 6 fall in distinct banks
        assert bp >= -(-batch // 8) * 8 and bp % 4 == 0
        assert len({(2 * tig * bp) % 32 // 8 for tig in range(4)}) == 4


def test_mma_partials_take_shared_memory_per_k_split():
    one = _mma("lstm", 256, "cluster", 8, 256, 1)
    four = dataclasses.replace(one, k_split=4)
    assert four.shared_bytes(8) - one.shared_bytes(8) == 4 * 3 * 4 * one.units_per_block * one.batch_stride(8)
    assert four.register_weights == one.register_weights  # same fragments, split the other way


@pytest.mark.parametrize("shape", [shape for shape, _, _ in ONE_SYNC_SAMPLE], ids=str)
def test_one_sync_moves_u_r_to_a_column_product_with_the_same_weight_count(shape):
    one = _one_sync(*shape)
    two = dataclasses.replace(one, one_sync=False)
    assert one.stages == (("z",), ("n",)) and two.stages == (("r", "z"), ("n",))
    # U_r's rows move from the row products to the column product: H x U per
    # block either way, up to the rounding of rows over work groups.
    assert one.column_rows_per_group * one.work_groups >= one.hidden_size
    assert one.column_chunks * one.group_size >= one.units_per_block
    assert one.padded_hidden >= (one.blocks - 1) * one.units_per_block + one.column_chunks * one.group_size
    # every block's partial sums, double-buffered, plus r * h
    bp = one.batch_stride(5)
    extra = 2 * one.blocks * one.partial_rows + one.padded_hidden + 2 * (one.padded_hidden - two.padded_hidden)
    assert one.shared_bytes(5) - two.shared_bytes(5) == 4 * extra * bp
    src = persistent.render_source(one)
    assert "#define PRNN_ONE_SYNC 1" in src and "#define PRNN_FIRST_STAGE 1" in src
