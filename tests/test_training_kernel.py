"""The persistent backward kernel (persistrnn.training_kernel): its source
for every cell, on a cluster and on a grid, compiles for sm_90 without local
memory and the size rule refuses what does not fit (CPU); on a GPU its step
loop equals the float64 torch-op steps to fp32 rounding, bit for bit from
run to run."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from test_training import direction_inputs, run_steps

from persistrnn import cells, training, training_kernel
from persistrnn.errors import ArgumentError, ConfigError, UnsupportedError

CELL_NAMES = tuple(cells.CELLS)
H100_SHARED = 232448  # the H100's opt-in shared memory per block (227 KB): the size rule's numbers on the CPU
H100_SMS = 132  # and its SM count, the most blocks of a grid launch

# fp32 against float64 on the same fp32-rounded inputs: per element, and the
# largest error against the largest value (a few wrong elements among large
# ones pass a per-element rtol, not this).
RTOL = ATOL = 1e-5
MAX_ERROR = 1e-5


# H=37 at batch 3: partial blocks (16 blocks of 3 units, the last ones idle)
# and one partial batch tile; H=256 at batch 32: the widest tile, the most
# registers. On a grid (a cluster's shared memory does not hold the layer):
# H=1024 at batch 1 (tagged words) and 16 (the widest tile), and H=1100 at batch 5, its last block short of units.
@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("hidden,batch", [(37, 3), (256, 32), (1024, 1), (1024, 16), (1100, 5)])
@pytest.mark.parametrize("cell", CELL_NAMES)
def test_kernel_compiles_for_sm90_without_local_memory(cell, hidden, batch, lengths):
    config = training_kernel.plan(cells.with_lengths(cell) if lengths else cell, hidden, batch, H100_SHARED,
                                  grid_limit=H100_SMS)
    assert config.sync == ("cluster" if hidden <= 256 else "grid")
    binary = training_kernel.compile_kernel(config, arch="sm_90")
    resources = binary.kernel_resources(training_kernel.KERNEL_NAME)
    assert not resources.uses_local_memory, resources
    assert resources.shared_bytes == 0, resources  # all dynamic: the size rule counts it
    assert "warning" not in binary.log, binary.log


@pytest.mark.parametrize("cell", CELL_NAMES)
def test_kernel_source_holds_the_generated_statements(cell):
    source = training_kernel.kernel_source(training_kernel.plan(cell, 100, 3, H100_SHARED))
    spec = cells.get_cell(cell)
    assert "// ---- the step's blocks ----" not in source
    assert source.count("prnn_d0_h_new = prnn_dh[prnn_n] + prnn_dout[prnn_n];") == 1  # the first block's seed
    assert source.count("if (!prnn_exchanged(prnn_i * ") == spec.num_stages  # one exchange per stage
    assert f"#define PRNN_G {spec.num_gates}" in source and f"#define PRNN_EXCHANGES {spec.num_stages}" in source
    assert "#define PRNN_GRID 0" in source
    grid = training_kernel.kernel_source(training_kernel.plan(cell, 1000, 3, H100_SHARED, grid_limit=H100_SMS))
    assert "#define PRNN_GRID 1" in grid and grid.count("if (!prnn_exchanged(prnn_i * ") == spec.num_stages


def test_the_reset_before_gru_exchanges_d_r_h_before_its_first_stage():
    # Walk order: the pointwise block and the n rows' product (d(r * h) into
    # its carry plane), then block 0 and the r, z rows' product (dh).
    config = training_kernel.plan("gru_reset_before", 37, 3, H100_SHARED)
    assert config.stage_rows == ((0, 8), (8, 12)) and config.gate_row0 == (0, 3, 8) and config.carry_planes == 1
    source = training_kernel.kernel_source(config)
    order = [source.index(text) for text in ("// statement block 1", "prnn_product(8, 12, prnn_i * 2 + 0);",
                                             "// statement block 0",
                                             "prnn_carry_planes[0 * prnn_elements + prnn_e] = prnn_gathered(",
                                             "prnn_product(0, 8, prnn_i * 2 + 1);")]
    assert order == sorted(order)


def test_a_later_stage_that_multiplies_h_is_refused():
    spec = cells.CellSpec("two_products_of_h", ("a", "b"), False, (("a",), ("b",)), ("h", "h"), ((),),
                          (("h_new", "tanh(x_a + h_a + x_b + h_b)"),))
    with pytest.raises(UnsupportedError, match="stage operands are \\('h', 'h'\\)"):
        training_kernel.plan(spec, 64, 1, H100_SHARED)


@pytest.mark.parametrize("hidden,cluster_limit", [(1, 16), (5, 16), (37, 16), (256, 16), (256, 8), (100, 1)])
def test_the_cluster_covers_every_unit(hidden, cluster_limit):
    config = training_kernel.plan("gru", hidden, 2, H100_SHARED, cluster_limit)
    # The largest power of two the limit and the units allow; every unit has an owner.
    assert config.blocks & (config.blocks - 1) == 0
    assert config.blocks <= min(cluster_limit, hidden) < 2 * config.blocks
    assert config.blocks * config.units >= hidden
    assert config.rows % 4 == 0 and config.rows >= 3 * config.units
    assert config.w_stride % 8 == 4 and config.w_stride >= config.rows


@pytest.mark.parametrize("cell,hidden", [("lstm", 465), ("lstm", 1024), ("gru", 529), ("rnn_relu", 1152),
                                         ("gru_reset_before", 1500)])
def test_a_layer_a_cluster_does_not_hold_runs_on_a_grid(cell, hidden):
    # The cluster while it fits (464 is LSTM's largest H at batch 1 on an
    # H100, 528 GRU's); past it, as many blocks as SMs allow, none idle.
    assert training_kernel.plan(cell, hidden - 1 if hidden < 600 else 200, 1, H100_SHARED,
                                grid_limit=H100_SMS).sync == "cluster"
    config = training_kernel.plan(cell, hidden, 1, H100_SHARED, grid_limit=H100_SMS)
    assert config.sync == "grid" and config.blocks <= H100_SMS
    assert config.units == -(-hidden // H100_SMS) and (config.blocks - 1) * config.units < hidden
    assert config.blocks * config.units >= hidden
    assert config.shared_bytes(1) <= H100_SHARED
    # The exchange stays in global memory ([parity][owner][b][block][unit]):
    # per element one shared float, not two per block, and the gather's lane
    # sums. Up to TAGGED_MAX_BATCH its words carry their exchange's tag: twice the bytes.
    stride = -(-config.units // 4) * 4  # the units padded to float4s
    assert config.tagged and config.recv_slots == 1
    assert config.exchange_floats(3) == 2 * 2 * config.blocks * 3 * config.blocks * stride
    plain = training_kernel.plan(cell, hidden, training_kernel.TAGGED_MAX_BATCH + 1, H100_SHARED, grid_limit=H100_SMS)
    assert not plain.tagged and plain.exchange_floats(3) == 2 * plain.blocks * 3 * plain.blocks * stride
    with pytest.raises(ArgumentError, match="tagged: a grid's exchange only, got sync 'cluster'"):
        training_kernel.BackwardKernelConfig(config.spec, hidden, 16, 1, "cluster", True)
    assert config.shared_bytes(3) == config.slice_bytes() + 3 * config.batch_row_bytes() + 16 * training_kernel.THREADS
    with pytest.raises(ConfigError, match="a cluster of 16 blocks"):  # without a grid, it is refused
        training_kernel.plan(cell, hidden, 1, H100_SHARED)


@pytest.mark.parametrize("cell,hidden,most_batch", [("lstm", 1024, 16), ("rnn_relu", 1152, 10)])
def test_a_grid_whose_exchange_outgrows_l2_leaves_the_layer_to_the_per_step_launches(cell, hidden, most_batch):
    # 128 blocks x batch x 1024 units (8 a block) x 4 bytes: 8 MiB at batch
    # 16; at H=1152 (9 units a block, padded to 12) 6 MiB at batch 8.
    config = training_kernel.plan(cell, hidden, most_batch, H100_SHARED, grid_limit=H100_SMS)
    assert config.sync == "grid" and config.exchange_bytes(most_batch) <= training_kernel.GRID_EXCHANGE_BYTES
    with pytest.raises(ConfigError, match=f"per-step launches measured faster \\(batch up to {most_batch} stays"):
        training_kernel.plan(cell, hidden, most_batch + 1, H100_SHARED, grid_limit=H100_SMS)


def test_an_exchange_past_the_limit_at_every_batch_says_so(monkeypatch):
    monkeypatch.setattr(training_kernel, "GRID_EXCHANGE_BYTES", 1024)
    with pytest.raises(ConfigError, match="no batch stays on the grid at H=1024"):
        training_kernel.plan("lstm", 1024, 2, H100_SHARED, grid_limit=H100_SMS)


def test_shared_bytes_counts_the_layout():
    # LSTM H=256 on 16 blocks: 16 units, 64 rows, column stride 68; per batch
    # row 64 d gates, 2 x 16 blocks x 16 partials, 2 x 11 planes x 16 staged, 16 dc.
    config = training_kernel.plan("lstm", 256, 8, H100_SHARED)
    assert (config.blocks, config.units, config.rows, config.w_stride) == (16, 16, 64, 68)
    assert config.shared_bytes(8) == 4 * (256 * 68 + 8 * (64 + 2 * 16 * 16 + 2 * 11 * 16 + 16))
    gru = training_kernel.plan("gru", 256, 8, H100_SHARED)
    assert gru.direct_dh and not config.direct_dh


@pytest.mark.parametrize("cell,hidden,batch,grid_limit", [("lstm", 512, 1, 0), ("rnn_tanh", 1024, 1, 0),
                                                          ("lstm", 256, 4096, 0), ("lstm", 4096, 1, H100_SMS),
                                                          ("gru", 1600, 1, H100_SMS)])
def test_too_large_is_refused_naming_what_fits(cell, hidden, batch, grid_limit):
    with pytest.raises(ConfigError) as refused:
        training_kernel.plan(cell, hidden, batch, H100_SHARED, grid_limit=grid_limit)
    message = str(refused.value)
    assert f"the device allows {H100_SHARED}" in message
    most_hidden = re.search(r"H up to (\d+) fits|no H fits", message)
    most_batch = re.search(r"batch up to (\d+) fits|no batch fits", message)
    assert most_hidden and most_batch, message
    if most_hidden.group(1):
        training_kernel.plan(cell, int(most_hidden.group(1)), batch, H100_SHARED, grid_limit=grid_limit)
        with pytest.raises(ConfigError):
            training_kernel.plan(cell, int(most_hidden.group(1)) + 1, batch, H100_SHARED, grid_limit=grid_limit)
    if most_batch.group(1):
        training_kernel.plan(cell, hidden, int(most_batch.group(1)), H100_SHARED, grid_limit=grid_limit)
        with pytest.raises(ConfigError):
            training_kernel.plan(cell, hidden, int(most_batch.group(1)) + 1, H100_SHARED, grid_limit=grid_limit)


def test_shared_memory_grows_with_hidden_once_the_cluster_is_full():
    # "H up to X fits" holds for every H below X; below 16 units the cluster
    # grows with H and a block's share may shrink, but every such H fits.
    for cell in CELL_NAMES:
        sizes = [training_kernel.plan(cell, h, 4, 1 << 30).shared_bytes(4) for h in range(16, 600)]
        assert sizes == sorted(sizes), cell
        assert all(training_kernel.plan(cell, h, 4, H100_SHARED) for h in range(1, 16))


def test_the_sanitizer_script_imports_and_runs_the_backward_on_a_cluster_and_a_grid():
    path = Path(__file__).resolve().parents[1] / "scripts" / "sanitize_recurrence.py"
    spec = importlib.util.spec_from_file_location("sanitize_recurrence", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its imports from the tests resolve (main() runs only as a script)
    modes = {training_kernel.plan(cell, hidden, 3, H100_SHARED, grid_limit=H100_SMS).sync
             for cell, hidden in script.BACKWARD}
    assert modes == {"cluster", "grid"}


# ---- on the GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_fits_follows_the_size_rule():
    device = torch.cuda.current_device()
    assert training_kernel.fits("lstm", 256, 8, device)
    assert training_kernel.fits(cells.get_cell("gru"), 100, 3, torch.device("cuda"))
    assert training_kernel.fits("gru_reset_before", 64, 1, device)
    assert training_kernel.fits("lstm", 1024, 8, device)  # on a grid
    assert not training_kernel.fits("lstm", 1024, 32, device)  # the grid's exchange: the per-step launches are faster
    assert not training_kernel.fits("lstm", 4096, 1, device)


# Odd and even step counts (the last step's parity), batch 1, a partial tile
# (3 < 8) and several full tiles (32), partial blocks (H=37, 100); on a grid
# (a cluster does not hold the layer): H=601 (every cell but the RNN's; the
# last block short of units) and H=1000 (every cell), tagged words at batch 1 and 2.
@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("steps,batch,hidden", [(7, 3, 37), (5, 1, 100), (6, 8, 256), (1, 32, 256), (5, 3, 601),
                                                (5, 2, 601), (4, 9, 1000), (3, 1, 1000)])
@pytest.mark.parametrize("cell", CELL_NAMES)
@pytest.mark.parametrize("lengths", [False, True])
def test_gpu_persistent_steps_equal_the_float64_torch_op_steps(cell, steps, batch, hidden, reverse, lengths):
    inputs = {k: None if v is None else v.float().double()
              for k, v in direction_inputs(cell, steps=steps, batch=batch, hidden=hidden, seed=hidden + batch,
                                           lengths=lengths).items()}
    want = run_steps(training._torch_steps, cell, inputs, reverse)
    got = run_steps(training_kernel.persistent_steps, cell, inputs, reverse, device="cuda", dtype=torch.float32)
    for name, value in want.items():
        if value is None or value.numel() == 0:
            assert got[name] is None or got[name].numel() == 0, name
            continue
        result = got[name].cpu().double()
        torch.testing.assert_close(result, value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        error = (result - value).abs().max().item()
        assert error <= MAX_ERROR * max(1.0, value.abs().max().item()), f"{name}: max error {error}"


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,batch", [(100, 5), (1000, 5), (1000, 2)])  # a cluster, a grid, tagged words
@pytest.mark.parametrize("cell", CELL_NAMES)
def test_gpu_persistent_steps_are_bit_identical_run_to_run(cell, hidden, batch):
    inputs = direction_inputs(cell, steps=9, batch=batch, hidden=hidden, seed=3)
    first = run_steps(training_kernel.persistent_steps, cell, inputs, True, device="cuda", dtype=torch.float32)
    second = run_steps(training_kernel.persistent_steps, cell, inputs, True, device="cuda", dtype=torch.float32)
    for name, value in first.items():
        assert (value is None) == (second[name] is None), name
        assert value is None or torch.equal(value, second[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("cell", CELL_NAMES)
def test_gpu_the_tagged_exchange_gives_the_barriers_results_bit_for_bit(cell, lengths, monkeypatch):
    # The same partials summed in the same order, whichever way they travel:
    # tagged words (each owner waits for the words) and the counter barrier.
    inputs = direction_inputs(cell, steps=6, batch=3, hidden=1000, seed=8, lengths=lengths)
    results = {}
    for tagged in (True, False):
        monkeypatch.setattr(training_kernel, "TAGGED_MAX_BATCH", 3 if tagged else 0)
        training_kernel._prepared.cache_clear()
        config = training_kernel._prepared(cells.with_lengths(cell) if lengths else cells.get_cell(cell), 1000, 3,
                                           torch.cuda.current_device())[0]
        assert config.sync == "grid" and config.tagged == tagged
        results[tagged] = run_steps(training_kernel.persistent_steps, cell, inputs, False, device="cuda",
                                    dtype=torch.float32)
    training_kernel._prepared.cache_clear()
    for name, value in results[True].items():
        assert (value is None) == (results[False][name] is None), name
        assert value is None or torch.equal(value, results[False][name]), name


@pytest.mark.parametrize("cell", [f"{name}+clip=0.5" for name in CELL_NAMES])
def test_a_clipped_cells_backward_compiles_for_sm90_without_local_memory(cell):
    """hardtanh's derivative (prnn_hardtanh_grad) in the generated statements of every clipped cell."""
    config = training_kernel.plan(cell, 256, 8, H100_SHARED, grid_limit=H100_SMS)
    binary = training_kernel.compile_kernel(config, arch="sm_90")
    assert "prnn_hardtanh_grad(prnn_v" in training_kernel.kernel_source(config)
    assert not binary.kernel_resources(training_kernel.KERNEL_NAME).uses_local_memory
