"""Planner: configuration space and pruning, cost model, tuning cache (CPU),
and tuning on the GPU."""

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import synthetic_calibration

from persistrnn import runtime, persistent
from persistrnn.plan import model as cost
from persistrnn.plan import space, tuner

ROOT = Path(__file__).resolve().parents[1]
H100 = runtime.DeviceFacts(**json.loads((ROOT / "docs/results/sync-h100.json").read_text())["device"])


def _calibrations():
    """The synthetic calibration, and the H100's measured one when it is in the repo."""
    out = [synthetic_calibration()]
    measured = ROOT / "docs/results/calibration-h100.json"
    if measured.exists():
        out.append(cost.Calibration.from_json(measured.read_text()))
    return out


CALIBRATIONS = _calibrations()


# ---- space and pruning --------------------------------------------------------


def _random_shapes(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        yield (rng.choice(["lstm", "gru", "gru_reset_before", "rnn_tanh"]), rng.choice([5, 33, 64, 100, 256, 511,
               1024, 1536]), rng.choice([1, 3, 8, 20, 64]), rng.choice(persistent.DTYPES))


@pytest.mark.parametrize("cell,hidden,batch,dtype", list(_random_shapes(12, seed=1)))
def test_pruning_never_admits_a_configuration_over_a_limit(cell, hidden, batch, dtype):
    facts = H100
    kept = space.pruned_space(cell, hidden, batch, dtype, facts)
    for c in kept:
        assert c.estimated_registers <= space.register_limit(c.threads, facts)
        assert c.estimated_registers * c.threads <= facts.registers_per_sm
        assert c.shared_bytes(c.batch_align) <= facts.shared_per_block_optin
        assert c.max_batch(facts.shared_per_block_optin) >= 1
        assert c.blocks <= facts.sm_count and c.threads <= facts.max_threads_per_block
        assert space.idle_fraction(c) <= space.IDLE_BOUND
        assert c.cell == cell and c.hidden_size == hidden and c.dtype == dtype


def test_pruning_reads_limits_from_the_device_facts():
    small = dataclasses.replace(H100, sm_count=20, shared_per_block_optin=48 * 1024, registers_per_sm=32768,
                                registers_per_block=32768)
    big = space.pruned_space("lstm", 256, 8, "float32", H100)
    little = space.pruned_space("lstm", 256, 8, "float32", small)
    assert little and len(little) < len(big)
    assert all(c.blocks <= 20 and c.shared_bytes(c.batch_align) <= 48 * 1024 for c in little)
    assert max(c.blocks for c in big) > 20


def test_space_covers_every_dimension_of_the_issue():
    kept = space.pruned_space("gru_reset_before", 128, 16, "bfloat16", H100)
    assert {c.sync for c in kept} == {"single", "cluster", "grid"}
    assert {c.math for c in kept} == {"ffma", "mma"}
    assert {c.one_sync for c in kept} == {False, True}
    assert len({c.threads for c in kept}) > 1 and len({c.group_size for c in kept}) > 1
    assert len({c.batch_tile for c in kept}) > 1
    assert any(c.shared_k_chunks == 0 for c in kept) and any(0 < c.shared_k_chunks < c.k_per_thread for c in kept)


def test_a_model_too_large_for_the_chip_has_an_empty_space():
    assert space.pruned_space("lstm", 4096, 1, "float32", H100) == []


def test_prune_names_the_limit_it_hit():
    c = persistent.KernelConfig("lstm", 1024, "single", 1, 128, group_size=32)
    assert "registers" in space.prune(c, 1, H100)
    wide = persistent.KernelConfig("lstm", 64, "cluster", 16, 1024, group_size=16)
    assert "idle" in space.prune(wide, 1, H100)


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 3), (20, 20), (64, 64), (65, 128), (129, 256)])
def test_batch_bucket(batch, bucket):
    assert space.batch_bucket(batch) == bucket


@pytest.mark.parametrize("bad", [0, -1, 2.0, "1"])
def test_batch_bucket_rejects_bad_batches(bad):
    with pytest.raises(ValueError, match="batch"):
        space.batch_bucket(bad)


# ---- cost model -------------------------------------------------------------


@pytest.mark.parametrize("cal", CALIBRATIONS, ids=lambda c: c.device)
def test_more_work_per_thread_costs_more_all_else_equal(cal):
    model = cost.CostModel(cal, H100)
    rng = random.Random(0)
    for cell, hidden, batch, dtype in _random_shapes(8, seed=2):
        configs = space.pruned_space(cell, hidden, batch, dtype, H100)
        for c in rng.sample(configs, min(20, len(configs))):
            # More sequences: more FMAs per thread, same everything else.
            assert model.step_cost(c, batch + c.batch_align).total > model.step_cost(c, batch).total
    # More rows per work group (a larger hidden size on one block), same mapping.
    small = persistent.KernelConfig("lstm", 64, "single", 1, 256, group_size=8)
    large = persistent.KernelConfig("lstm", 96, "single", 1, 256, group_size=8)
    assert large.rows_per_group(0) > small.rows_per_group(0)
    assert model.step_cost(large, 1).total > model.step_cost(small, 1).total


@pytest.mark.parametrize("cal", CALIBRATIONS, ids=lambda c: c.device)
def test_step_cost_terms_are_positive_and_only_one_block_exchanges_nothing(cal):
    model = cost.CostModel(cal, H100)
    for c in space.pruned_space("gru_reset_before", 256, 4, "float32", H100)[::37]:
        s = model.step_cost(c, 4)
        assert s.product > 0 and s.pointwise > 0 and s.barriers > 0 and s.exchange >= 0
        assert (s.exchange == 0) == (c.sync == "single")


@pytest.mark.parametrize("cal", CALIBRATIONS, ids=lambda c: c.device)
def test_a_grid_batch_over_one_launch_costs_one_launch_per_share(cal):
    model = cost.CostModel(cal, H100)
    config = persistent.KernelConfig("lstm", 256, "grid", 16, batch_tile=8)
    most = config.max_batch(H100.shared_per_block_optin)
    one, split = model.step_cost(config, most), model.step_cost(config, 2 * most + 3)
    assert one.launches == 1 and split.launches == 3  # two full launches, then one of 3 sequences
    assert split.total > 2 * one.total
    # a slice below what a block holds: one launch per slice, one after another
    assert model.step_cost(config, 8, batch_slice=2).launches == 4


@pytest.mark.parametrize("cal", CALIBRATIONS, ids=lambda c: c.device)
def test_cluster_slices_run_at_once_then_in_waves(cal):
    model = cost.CostModel(cal, H100)
    config = persistent.KernelConfig("lstm", 256, "cluster", 8)
    one = model.step_cost(config, 2, batch_slice=2)
    at_once = model.step_cost(config, 2 * 16 - 1, batch_slice=2)  # 16 slices x 8 blocks <= 132 SMs
    assert at_once == one and one.waves == 1 and one.launches == 1
    waves = model.step_cost(config, 2 * 17, batch_slice=2)  # 17 x 8 = 136 blocks: a second wave
    assert waves.waves == 2 and waves.total == pytest.approx(2 * one.total)
    # unsliced, the whole batch is one slice's product
    assert model.step_cost(config, 32).total > one.total


def test_slice_sizes_are_powers_of_two_below_the_bucket():
    assert tuner.slice_sizes(1) == [None]
    assert tuner.slice_sizes(32) == [None, 1, 2, 4, 8, 16]


def test_ranking_offers_slices_that_fit_the_sms_at_once():
    model = cost.CostModel(synthetic_calibration(), H100)
    shape = tuner.ModelShape("lstm", 256, 256)
    ranked = tuner.ranked_configs(shape, 32, model)
    sliced = [r for r in ranked if r.batch_slice is not None]
    assert sliced and {r.batch_slice for r in sliced} <= {1, 2, 4, 8, 16}
    for r in sliced:
        assert r.config.sync != "grid"
        assert -(-32 // r.batch_slice) * r.config.blocks * r.config.instances <= H100.sm_count
        assert r.us == pytest.approx(model.step_cost(r.config, 32, r.batch_slice).total)
    assert [r.us for r in ranked] == sorted(r.us for r in ranked)


def test_tf32_configurations_are_candidates_of_fp32_models_only_where_torch_allows_tf32(monkeypatch):
    import torch

    model = cost.CostModel(synthetic_calibration(), H100)
    shape = tuner.ModelShape("lstm", 1024, 1024)
    plain = tuner.ranked_configs(shape, 16, model)
    with_tf32 = tuner.ranked_configs(shape, 16, model, tf32=True)
    assert not [r for r in plain if r.config.math == "mma"]
    tf32 = [r for r in with_tf32 if r.config.math == "mma"]
    assert tf32 and all(r.config.tf32 and r.config.dtype == "float32" for r in tf32)
    assert len(with_tf32) == len(plain) + len(tf32)
    # two m16n8k8 per 16-column tile: the model prices a TF32 product twice a 16-bit one's
    half = dataclasses.replace(tf32[0].config, dtype="bfloat16")
    assert model.step_cost(tf32[0].config, 16).product == pytest.approx(2 * model.step_cost(half, 16).product)
    # the switch is torch's fp32 matmul precision, which also puts the input projection's GEMM in TF32, and
    # only where torch allows TF32 in cuDNN's RNNs too: a program that turns that off gets exact RNNs
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision, torch.backends.fp32_precision
    try:
        for precision, allowed in (("highest", False), ("high", True), ("medium", True)):
            with runtime.matmul_precision(precision):
                assert tuner.tf32_allowed(shape) is allowed
                assert tuner.tf32_allowed(dataclasses.replace(shape, dtype="bfloat16")) is False
                with runtime.cudnn_rnn_settings(tf32=False):
                    assert tuner.tf32_allowed(shape) is False
                with runtime.cudnn_rnn_settings(tf32=True):
                    assert tuner.tf32_allowed(shape) is allowed
            assert tuner.tf32_allowed(shape) is False  # put back
        # torch's global setting, which the matmul backend inherits. torch.get_float32_matmul_precision()
        # raises once a program has used the new API beside the legacy one; the switch must not read it, or
        # every forward would raise.
        def mixed():
            raise RuntimeError("PyTorch is checking the matmul precision without a specific backend name")

        monkeypatch.setattr(torch, "get_float32_matmul_precision", mixed)
        torch.backends.fp32_precision, matmul.fp32_precision = "tf32", "none"
        assert tuner.tf32_allowed(shape) is True
        torch.backends.fp32_precision = "ieee"
        assert tuner.tf32_allowed(shape) is False
    finally:
        torch.backends.fp32_precision, matmul.fp32_precision = saved[1], saved[0]


def test_rank_orders_by_predicted_cost():
    model = cost.CostModel(synthetic_calibration(), H100)
    configs = space.pruned_space("lstm", 256, 1, "float32", H100)
    ranked = model.rank(configs, 1)
    costs = [us for us, _ in ranked]
    assert costs == sorted(costs) and len(ranked) == len(configs)


def test_calibration_round_trips_and_rejects_other_formats(tmp_path):
    cal = synthetic_calibration()
    assert cost.Calibration.from_json(cal.to_json()) == cal
    bad = json.loads(cal.to_json())
    bad["format"] = 99
    with pytest.raises(ValueError):
        cost.Calibration.from_json(json.dumps(bad))
    path = tmp_path / "c.json"
    path.write_text(cal.to_json()[:100])  # truncated
    assert cost.load_calibration(path) is None
    assert cost.load_calibration(tmp_path / "missing.json") is None


def test_calibration_path_is_keyed_by_device_sm_count_and_version(isolated_cache):
    a = cost.calibration_path(H100)
    assert a.parent == isolated_cache / "calibration"
    assert cost.calibration_path(dataclasses.replace(H100, name="NVIDIA H200")) != a
    assert cost.calibration_path(dataclasses.replace(H100, sm_count=114)) != a


def test_the_calibration_compiles_every_program_once_heaviest_first():
    programs = cost.bench_programs()
    assert len(set(programs)) == len(programs) == len(cost.BENCH_TILES) * len(cost.BENCH_GROUPS) * len(
        cost.BENCH_CHUNKS) + len(cost.MMA_CHUNKS)
    ffma = [p for p in programs if p[0] == 0]
    assert ffma[0][1:] == (max(cost.BENCH_TILES), cost.BENCH_GROUPS[0], max(cost.BENCH_CHUNKS))
    assert [p[1] * p[3] for p in ffma] == sorted((p[1] * p[3] for p in ffma), reverse=True)


def test_the_calibration_times_a_program_pair_as_soon_as_both_are_built():
    import threading
    from concurrent.futures import Future

    a1, a2, b1, b2 = (Future() for _ in range(4))
    b1.set_result(1)
    a1.set_result(2)
    b2.set_result(3)
    order = cost.as_built({"a": [a1, a2], "b": [b1, b2]})
    assert next(order) == "b"  # a waits for its second program
    threading.Timer(0.05, a2.set_result, (4,)).start()
    assert next(order) == "a" and a2.done()
    assert list(order) == []


def _with_tiles(cal, tiles):
    """``cal`` as if only the FFMA products at ``tiles`` had been measured."""
    return dataclasses.replace(cal, product={k: v for k, v in cal.product.items() if int(k.split(",")[2]) in tiles})


@pytest.mark.parametrize("batch,tiles", [(1, {1}), (2, {1, 2}), (3, {1, 2, 4}), (8, {1, 2, 4, 8}), (64, {1, 2, 4, 8})])
def test_a_plan_at_a_batch_is_calibrated_for_the_tiles_its_space_offers(batch, tiles):
    assert cost.tiles_for(batch) == tiles
    offered = {cost.product_tile(c) for c in space.pruned_space("lstm", 256, batch, "float32", H100)}
    assert offered == tiles
    assert cost.tiles_for(None) == set(cost.BENCH_TILES)


def test_programs_compiled_ahead_are_the_calibration_s_own_futures(monkeypatch):
    built = []
    monkeypatch.setattr(cost, "_AHEAD", {})
    monkeypatch.setattr(cost, "bench_binary", lambda program, arch=None: built.append(program) or program)
    cost.compile_ahead({2}, arch="sm_90")
    programs = cost.bench_programs({2}, whole=False)
    ahead = {p: cost._AHEAD[p, "sm_90"] for p in programs}
    assert [f.result(timeout=30) for f in ahead.values()] == programs and sorted(built) == sorted(programs)
    cost.compile_ahead({2}, arch="sm_90")  # once per process
    assert len(built) == len(programs)
    sync, compiling = cost.compile_calibration("sm_90", tiles={1, 2}, whole=False)
    assert sync is None and all(compiling[p] is f for p, f in ahead.items())
    assert {p: f.result(timeout=30) for p, f in compiling.items()} == {p: p for p in cost.bench_programs({1, 2}, False)}
    assert sorted(built) == sorted(cost.bench_programs({1, 2}, whole=False))  # tile 2's not built again


def test_a_calibration_of_some_tiles_compiles_only_their_product_programs():
    some = cost.bench_programs({1, 4}, whole=False)
    assert {p[1] for p in some} == {1, 4} and all(p[0] == 0 for p in some)
    assert len(some) == 2 * len(cost.BENCH_GROUPS) * len(cost.BENCH_CHUNKS)
    whole = cost.bench_programs({1, 4})
    assert whole[:len(some)] == some and {p for p in whole if p[0] == 1} == {(1, 1, 1, k) for k in cost.MMA_CHUNKS}
    with pytest.raises(ValueError, match="tiles"):
        cost.calibration(progress=False, tiles={3})


def test_ranking_calibrates_the_tiles_it_needs_once_and_inside_a_capture_ranks_what_it_can_price(monkeypatch):
    full = synthetic_calibration()
    asked = []

    def calibration(*, progress=True, refresh=False, tiles=None):
        asked.append(set(tiles))
        return _with_tiles(full, set(tiles))

    monkeypatch.setattr(cost, "calibration", calibration)
    shape = tuner.ModelShape("lstm", 256, 256)
    model = cost.CostModel(_with_tiles(full, {1}), H100)
    assert tuner.ranked_configs(shape, 1, model) and asked == []
    ranked = tuner.ranked_configs(shape, 8, model)
    assert asked == [{1, 2, 4, 8}] and model.cal.tiles == {1, 2, 4, 8}
    everything = tuner.ranked_configs(shape, 8, cost.CostModel(full, H100))
    assert [(r.config, r.batch_slice, r.us) for r in ranked] == [(r.config, r.batch_slice, r.us) for r in everything]
    tuner.ranked_configs(shape, 8, model)
    assert len(asked) == 1  # measured once
    # The mma configurations (batch tile 8) are priced by their own table: tile 1 prices every one at batch 1.
    bf16 = tuner.ModelShape("gru_reset_before", 256, 256, 2, dtype="bfloat16")
    ranked = tuner.ranked_configs(bf16, 1, cost.CostModel(_with_tiles(full, {1}), H100))
    assert len(asked) == 1 and {r.config.batch_tile for r in ranked} == {1, persistent.MMA_BATCH}
    monkeypatch.setattr(cost, "_capturing", lambda: True)
    captured = tuner.ranked_configs(shape, 8, cost.CostModel(_with_tiles(full, {1}), H100))
    assert len(asked) == 1 and captured
    assert {cost.product_tile(r.config) for r in captured} == {1}


def test_a_stored_calibration_is_extended_by_the_tiles_it_lacks_keeping_what_another_process_stored(
        isolated_cache, monkeypatch):
    monkeypatch.setattr(runtime, "device_facts", lambda: H100)
    full = synthetic_calibration(H100.name, H100.sm_count)
    path = cost.calibration_path(H100)
    measured = []

    def measure(progress=True, tiles=cost.BENCH_TILES):
        measured.append(("whole", set(tiles)))
        return _with_tiles(full, set(tiles))

    def extend(cal, tiles, progress=True):
        measured.append(("extend", set(tiles)))
        runtime.atomic_write(path, _with_tiles(full, {1, 8}).to_json())  # another process, meanwhile
        return dataclasses.replace(cal, product={**cal.product, **_with_tiles(full, set(tiles)).product})

    monkeypatch.setattr(cost, "measure_calibration", measure)
    monkeypatch.setattr(cost, "extend_calibration", extend)
    first = cost.calibration(progress=False, tiles={1})
    assert measured == [("whole", {1})] and first.tiles == {1} and cost.load_calibration(path) == first
    assert cost.calibration(progress=False, tiles={1}) == first and len(measured) == 1
    second = cost.calibration(progress=False, tiles={1, 2})
    assert measured[-1] == ("extend", {2}) and second.tiles == {1, 2, 8}
    assert cost.load_calibration(path) == second == _with_tiles(full, {1, 2, 8})
    assert cost.calibration(progress=False, tiles={8}) == second and len(measured) == 2
    monkeypatch.setattr(runtime, "device_facts", lambda: dataclasses.replace(H100, name="NVIDIA H200"))
    cost.calibration(progress=False, tiles={1})  # another device: its own calibration
    assert measured[-1] == ("whole", {1})


def _held_by_another_process(path, store, hold=0.3):
    """A thread standing in for another process: it takes ``path``'s lock
    (flock, on a file description of its own), stores what ``store()``
    writes after ``hold`` seconds, and lets go. Returns (thread, held event, the time
    it let go, filled in then)."""
    held, released = threading.Event(), []

    def other():
        with runtime.key_lock(path):
            held.set()
            time.sleep(hold)
            store()
            released.append(time.perf_counter())

    thread = threading.Thread(target=other)
    thread.start()
    assert held.wait(5)
    return thread, released


def test_a_calibration_another_process_is_measuring_is_waited_for_and_read_not_measured_again(
        isolated_cache, monkeypatch):
    # A server's workers start together: micro-benchmarks timed beside another's would each measure both.
    monkeypatch.setattr(runtime, "device_facts", lambda: H100)
    theirs = _with_tiles(synthetic_calibration(H100.name, H100.sm_count), {1, 2})
    path = cost.calibration_path(H100)
    measured = []
    monkeypatch.setattr(cost, "measure_calibration", lambda *a, **k: measured.append(a) or theirs)
    thread, released = _held_by_another_process(path, lambda: runtime.atomic_write(path, theirs.to_json()))
    got = cost.calibration(progress=False, tiles={1})
    returned = time.perf_counter()
    thread.join()
    assert got == theirs and measured == [] and returned >= released[0]


def test_a_plan_another_process_is_tuning_is_waited_for_and_read_not_tuned_again(monkeypatch, offline_tuning):
    shape = tuner.ModelShape("lstm", 256, 256)
    key = tuner.cache_key(H100, shape, space.batch_bucket(1), False)
    theirs = tuner.Plan(shape, space.batch_bucket(1), "cudnn", None, "tuned", "timed by another process")
    timed = []
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, progress=False: timed.append(candidates))
    thread, released = _held_by_another_process(tuner.cache_path(key), lambda: tuner.store_plan(key, theirs))
    got = tuner.plan(shape, 1)
    returned = time.perf_counter()
    thread.join()
    assert (got.path, got.reason, got.source) == ("cudnn", "timed by another process", "cache")
    assert timed == [] and returned >= released[0]


def test_a_plan_tuned_after_waiting_for_another_process_counts_its_own_work_only(monkeypatch, offline_tuning):
    # The other process held the lock 1.5 s and stored nothing (e.g. it failed): this one tunes, and the plan's
    # tuning_seconds is its ranking and tuning (~0.3 s here), not the wait.
    shape = tuner.ModelShape("lstm", 256, 256)
    key = tuner.cache_key(H100, shape, space.batch_bucket(1), False)
    monkeypatch.setattr(tuner, "timing_candidates", lambda shape, batch, top, steps: [
        tuner.Candidate("fallback", "fallback", None, None), tuner.Candidate("cudnn", "cudnn", None, None)])
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, progress=False: {"fallback": 0.2, "cudnn": 0.1})
    thread, released = _held_by_another_process(tuner.cache_path(key), lambda: None, hold=1.5)
    started = time.perf_counter()
    got = tuner.plan(shape, 1)
    elapsed = time.perf_counter() - started
    thread.join()
    assert got.path == "cudnn" and got.source == "tuned"
    assert elapsed >= 1.4 and got.tuning_seconds < elapsed - 0.8


@pytest.mark.parametrize("program", cost.bench_programs())
def test_micro_benchmarks_compile_for_sm90_without_local_memory(program):
    binary = cost.bench_binary(program, arch="sm_90")
    names = set(binary.resources)
    if program[0]:
        mma = {f"prnn_mma_bench_M{m}" for m in cost.BENCH_ROWS}
        assert mma | {"prnn_barrier_bench", "prnn_pointwise_bench"} <= names
    else:
        assert {f"prnn_product_bench_R{r}_{p}" for r in cost.BENCH_ROWS for p in ("reg", "shared")} <= names
    for name, res in binary.resources.items():
        assert not res.uses_local_memory, (name, res)


# ---- tuning cache -----------------------------------------------------------

SHAPE = tuner.ModelShape("lstm", 128, 256, 2, "float32")


def test_cache_key_changes_with_each_component():
    base = tuner.cache_key(H100, SHAPE, 8)
    variants = [
        tuner.cache_key(dataclasses.replace(H100, name="NVIDIA H200"), SHAPE, 8),
        tuner.cache_key(dataclasses.replace(H100, sm_count=114), SHAPE, 8),
        tuner.cache_key(H100, dataclasses.replace(SHAPE, cell="gru"), 8),
        tuner.cache_key(H100, dataclasses.replace(SHAPE, input_size=64), 8),
        tuner.cache_key(H100, dataclasses.replace(SHAPE, hidden_size=512), 8),
        tuner.cache_key(H100, dataclasses.replace(SHAPE, num_layers=3), 8),
        tuner.cache_key(H100, dataclasses.replace(SHAPE, dtype="bfloat16"), 8),
        tuner.cache_key(H100, SHAPE, 16),
        tuner.cache_key(H100, SHAPE, 8, tf32=True),
    ]
    paths = {tuner.cache_path(k) for k in [base] + variants}
    assert len(paths) == len(variants) + 1
    assert base["version"] == __import__("persistrnn").__version__
    # NVRTC's version decides which configurations compile without spilling, and what they time
    assert base["nvrtc"] == list(runtime.nvrtc_version())
    assert tuner.cache_path({**base, "nvrtc": [base["nvrtc"][0] + 1, 0]}) != tuner.cache_path(base)


def _a_plan():
    config = persistent.KernelConfig("lstm", 256, "cluster", 8, 256, group_size=8)
    return tuner.Plan(SHAPE, 8, "persistent", config, "tuned", "timed", predicted_us=1.5,
                      measured_ms={"a": 0.1, "fallback": 0.5}, steps=100, tuning_seconds=2.0)


def test_a_stored_plan_is_read_back_as_a_cache_hit(isolated_cache):
    key = tuner.cache_key(H100, SHAPE, 8)
    assert tuner.load_plan(key) is None
    tuner.store_plan(key, _a_plan())
    hit = tuner.load_plan(key)
    assert hit == dataclasses.replace(_a_plan(), source="cache")
    assert tuner.load_plan(tuner.cache_key(H100, SHAPE, 16)) is None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong key", "bad config", "bad path", "empty"])
def test_a_corrupted_cache_file_is_a_miss_not_a_crash(isolated_cache, damage):
    key = tuner.cache_key(H100, SHAPE, 8)
    tuner.store_plan(key, _a_plan())
    path = tuner.cache_path(key)
    data = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:57])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff" * 40)
    elif damage == "wrong key":
        data["key"]["hidden_size"] = 1
        path.write_text(json.dumps(data))
    elif damage == "bad config":
        data["plan"]["config"]["group_size"] = 3
        path.write_text(json.dumps(data))
    elif damage == "bad path":
        data["plan"]["path"] = "magic"
        path.write_text(json.dumps(data))
    else:
        path.write_text("")
    assert tuner.load_plan(key) is None


def test_model_shape_validates():
    with pytest.raises(ValueError, match="hidden_size"):
        tuner.ModelShape("lstm", 8, 0)
    with pytest.raises(ValueError, match="dtype"):
        tuner.ModelShape("lstm", 8, 8, dtype="float64")
    with pytest.raises(ValueError, match="cell"):
        tuner.ModelShape("transformer", 8, 8)


def test_shape_of_reads_torch_modules():
    import torch

    assert tuner.shape_of(torch.nn.LSTM(10, 20, num_layers=3)) == tuner.ModelShape("lstm", 10, 20, 3)
    assert tuner.shape_of(torch.nn.GRU(10, 20).to(torch.bfloat16)).dtype == "bfloat16"
    assert tuner.shape_of(torch.nn.RNN(4, 8, nonlinearity="relu")).cell == "rnn_relu"
    with pytest.raises(TypeError, match="LSTM, GRU or RNN"):
        tuner.shape_of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="proj_size"):
        tuner.shape_of(torch.nn.LSTM(10, 20, proj_size=5))


def test_cli_plans_under_the_matmul_precision_it_is_given(monkeypatch):
    from persistrnn import __main__ as cli
    from persistrnn import plan as planner

    seen = []
    monkeypatch.setattr(planner, "explain", lambda shape, batch: seen.append(runtime.matmul_allows_tf32()))
    with runtime.matmul_precision("highest"):  # put back whatever the CLI set
        argv = ["--cell", "lstm", "--input-size", "8", "--hidden-size", "8", "--batch", "1"]
        assert cli._plan_command("explain", argv + ["--matmul-precision", "high"]) == 0
        assert cli._plan_command("explain", argv + ["--matmul-precision", "highest"]) == 0
    assert seen == [True, False]


def test_cli_tune_without_a_gpu_says_so():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "persistrnn", "tune", "--cell", "lstm", "--input-size", "8",
                          "--hidden-size", "8", "--batch", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and ("GPU" in run.stderr or "CUDA" in run.stderr), run.stderr


# ---- GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.real_calibration  # the one GPU test that runs the micro-benchmarks: it tests them
def test_calibration_is_cached_per_device_and_extended_by_tile(isolated_cache):
    first = cost.calibration(progress=False, tiles={1})
    path = cost.calibration_path(runtime.device_facts())
    assert path.exists()
    assert cost.load_calibration(path) == first and first.tiles == {1}
    assert first.sm_count == runtime.device_facts().sm_count
    assert all(v > 0 for v in first.product.values()) and first.clock_mhz > 0
    assert all(v > 0 for v in first.cluster_exchange.values()) and first.mma and first.pointwise and first.barrier
    extended = cost.calibration(progress=False, tiles={1, 2})
    assert extended.tiles == {1, 2} and cost.load_calibration(path) == extended
    assert dataclasses.replace(extended, product=first.product) == first  # only tile 2's products were added
    assert all(v > 0 for v in extended.product.values())
    assert cost.calibration(progress=False, tiles={2}) == extended


_REUSE_SCRIPT = """
import json, sys
from persistrnn import runtime, plan
shape = plan.ModelShape("lstm", 48, 96, 2, "float32")
p = plan.tune(shape, int(sys.argv[1]), k=3, steps=20, progress=False)
print(json.dumps({"source": p.source, "path": p.path, "config": str(p.config), "compiles": runtime.nvrtc_compiles(),
                  "measured": len(p.measured_ms)}))
"""


@pytest.mark.gpu
def test_tuned_choice_is_reused_from_cache_in_a_new_process(tmp_path, monkeypatch):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PERSISTRNN_CACHE_DIR=str(tmp_path / "cache"))
    # The child processes plan with the synthetic calibration too: stored
    # where calibration() looks first, for this device and package version.
    monkeypatch.setenv("PERSISTRNN_CACHE_DIR", env["PERSISTRNN_CACHE_DIR"])
    facts = runtime.device_facts()
    runtime.atomic_write(cost.calibration_path(facts), synthetic_calibration(
        facts.name, facts.sm_count, __import__("persistrnn").__version__).to_json())

    def tune(batch):
        run = subprocess.run([sys.executable, "-c", _REUSE_SCRIPT, str(batch)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.strip().splitlines()[-1])

    first = tune(65)
    assert first["source"] == "tuned" and first["compiles"] > 0 and first["measured"] >= 2
    second = tune(100)  # the same batch bucket (128)
    assert second == {**first, "source": "cache", "compiles": 0}


@pytest.mark.gpu
def test_a_model_too_large_for_the_chip_is_planned_onto_the_fallback(isolated_cache):
    from persistrnn import plan

    p = plan.plan(plan.ModelShape("gru_reset_before", 64, 4096, 1, "float32"), 2, tune=True, k=2, steps=3)
    assert p.path == "fallback" and p.config is None and "fits" in p.reason
    untuned = plan.plan(plan.ModelShape("lstm", 64, 4096, 1, "float32"), 2, tune=False)
    assert untuned.path == "fallback"


@pytest.mark.gpu
def test_tune_picks_a_measured_candidate_and_explain_prints_it(isolated_cache, capsys):
    import torch

    from persistrnn import explain, tune

    lstm = torch.nn.LSTM(32, 64)
    p = tune(lstm, 2, k=2, steps=10, progress=False)
    assert p.source == "tuned" and p.path in tuner.PATHS
    finite = {k: v for k, v in p.measured_ms.items() if v == v}
    # the plan is the fastest timed candidate, by its label
    assert min(finite, key=finite.get) == (tuner.config_label(p.config, p.batch_slice) if p.path == "persistent"
                                           else p.path)
    shown = explain(lstm, 2)
    assert shown.source == "cache" and shown.path == p.path
    text = capsys.readouterr().out
    assert "lstm input 32, hidden 64" in text and "cost model, top" in text


def test_the_space_offers_the_tagged_exchange_for_batch_1_grid_exchanges_only():
    one = space.pruned_space("lstm", 1024, 1, "float32", H100)
    tagged = [c for c in one if c.tagged_exchange]
    assert tagged and all(c.sync == "grid" and 1024 <= c.threads * persistent.TAGGED_READS_PER_THREAD
                          for c in tagged)
    assert {dataclasses.replace(c, tagged_exchange=False) for c in tagged} <= set(one)  # beside the barrier's
    for batch in (2, 10):
        assert not any(c.tagged_exchange for c in space.pruned_space("lstm", 1024, batch, "float32", H100))
    model = cost.CostModel(synthetic_calibration(), H100)
    c = tagged[0]
    barrier, poll = model.step_cost(dataclasses.replace(c, tagged_exchange=False), 1), model.step_cost(c, 1)
    assert poll.barriers < barrier.barriers and poll.product == barrier.product
    assert "tagged" in tuner.config_label(c) and "tagged" not in tuner.config_label(dataclasses.replace(
        c, tagged_exchange=False))


def test_the_tuner_times_each_of_its_top_k_with_its_tagged_twin_beside_it(monkeypatch):
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    ranked = tuner.ranked_configs(tuner.ModelShape("lstm", 1024, 1024), 1, model)
    assert any(r.config.tagged_exchange for r in ranked[:5])  # twins rank among the top: they must not crowd it
    spilled = next(r.config for r in ranked if not r.config.tagged_exchange)  # the top barrier one spills
    monkeypatch.setattr(tuner, "compiles", lambda c: c != spilled)
    top = tuner.compile_top(ranked, 3, families=False)
    own = [r for r in top if not r.config.tagged_exchange]
    assert own == [r for r in ranked if not r.config.tagged_exchange and r.config != spilled][:3]
    twins = [r for r in top if r.config.tagged_exchange]
    assert [r.config for r in twins] == [dataclasses.replace(r.config, tagged_exchange=True) for r in own]
    assert all(r in ranked for r in twins)
    assert tuner.compile_top(ranked, 3, twins=False, families=False) == own  # the untimed path compiles no twin
    # At batch 2 the space has no twins, nor for cluster and single blocks: the top k is the model's top k.
    for shape, batch in ((tuner.ModelShape("lstm", 1024, 1024), 2), (tuner.ModelShape("lstm", 256, 256), 1),
                         (tuner.ModelShape("gru", 64, 64), 1)):
        ranked = tuner.ranked_configs(shape, batch, model)
        assert tuner.compile_top(ranked, 3, families=False) == [r for r in ranked if r.config != spilled][:3]
    # A mixed ranking (a grid layer whose top includes cluster configurations) pairs the grid ones only.
    mixed = tuner.ranked_configs(tuner.ModelShape("lstm", 448, 448), 1, model)
    top = tuner.compile_top(mixed, 8, families=False)
    own = top[:8]
    assert {r.config.sync for r in own} == {"grid", "cluster"} and not any(r.config.tagged_exchange for r in own)
    assert [r.config for r in top[8:]] == [
        dataclasses.replace(r.config, tagged_exchange=True) for r in own if r.config.sync == "grid"]


@pytest.fixture
def offline_tuning(monkeypatch, tmp_path):
    """The tuner on an H100's facts and calibration, with every configuration
    compiling and a tuning cache of the test's own: the cost model (returned)
    and the tuning path run without a GPU, the tests fake the timing."""
    monkeypatch.setenv("PERSISTRNN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "device_facts", lambda: H100)
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    monkeypatch.setattr(cost, "cost_model", lambda progress=False, batch=None: model)
    monkeypatch.setattr(tuner, "compiles", lambda config: True)
    monkeypatch.setattr(persistent, "launched_config", lambda config, batch, batch_slice, device: config)
    return model


def test_tuning_keeps_the_fastest_of_the_top_k_and_their_twins_and_says_where_it_ranked(monkeypatch, offline_tuning):
    # The tuning path with the timing faked (it needs a GPU): the twin of the model's third choice is fastest.
    model = offline_tuning
    shape = tuner.ModelShape("lstm", 1024, 1024)
    ranked = tuner.ranked_configs(shape, 1, model)
    own = [r for r in tuner.compile_top(ranked, 5) if not r.config.tagged_exchange]  # compile_top's own tests
    extra = len(own) - 5
    winner = next(r for r in ranked if r.config == dataclasses.replace(own[2].config, tagged_exchange=True))
    monkeypatch.setattr(tuner, "timing_candidates", lambda shape, batch, top, steps: [
        tuner.Candidate(tuner.candidate_label(r), "persistent", r, None) for r in top]
        + [tuner.Candidate("fallback", "fallback", None, None), tuner.Candidate("cudnn", "cudnn", None, None)])
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, progress=False: {
        c.label: 0.1 if c.ranked == winner else 0.2 for c in candidates})
    chosen = tuner.plan(shape, 1)
    assert chosen.path == "persistent" and chosen.config == winner.config
    twins = sum(1 for r in own if dataclasses.replace(r.config, tagged_exchange=True) in {x.config for x in ranked})
    rank = sorted(own + [r for r in ranked if r.config.tagged_exchange and dataclasses.replace(
        r.config, tagged_exchange=False) in {o.config for o in own}], key=ranked.index).index(winner) + 1
    assert (f"fastest of the model's top 5{f', {extra} more of its kernel families' if extra else ''} and "
            f"{twins} tagged twin(s) (model rank {rank})" in chosen.reason)
    assert len(chosen.measured_ms) == 5 + extra + twins + 2
    # A layer whose candidates are clusters has no twins: the model's top 5, and the first FAMILY_MEMBERS of each
    # kernel family they leave out (here the fused step's).
    small = tuner.ModelShape("lstm", 256, 256)
    ranked = tuner.ranked_configs(small, 1, model)
    winner = ranked[1]
    families = ({tuner.family(r.config, r.batch_slice) for r in ranked}
                - {tuner.family(r.config, r.batch_slice) for r in ranked[:5]})
    assert families == {("ffma", False, True, 1, None)}  # batch 1: no slices
    chosen = tuner.plan(small, 1)
    assert chosen.config == winner.config and chosen.config.sync == "cluster"
    fused = [r for r in ranked if tuner.family(r.config, r.batch_slice) == ("ffma", False, True, 1, None)]
    members = 1 + (fused[1].us <= fused[0].us * (1 + tuner.FAMILY_TIE))  # the second where the model ties them
    assert f"fastest of the model's top 5, {members} more of its kernel families (model rank 2)" in chosen.reason
    assert len(chosen.measured_ms) == 5 + members + 2


def test_a_tuned_plan_then_compiles_the_calibration_s_missing_tiles_in_the_background(monkeypatch, offline_tuning):
    model = cost.CostModel(_with_tiles(offline_tuning.cal, {1}), H100)
    monkeypatch.setattr(cost, "cost_model", lambda progress=False, batch=None: model)
    monkeypatch.setattr(tuner, "timing_candidates", lambda shape, batch, top, steps: [
        tuner.Candidate(tuner.candidate_label(r), "persistent", r, None) for r in top])
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, progress=False: {
        c.label: 0.1 for c in candidates})
    ahead = []
    monkeypatch.setattr(cost, "compile_ahead", lambda tiles: ahead.append(set(tiles)))
    tuner.plan(tuner.ModelShape("lstm", 256, 256), 1)
    assert ahead == [{2, 4, 8}]  # after the tuning, not beside it
    monkeypatch.setattr(cost, "cost_model", lambda progress=False, batch=None: offline_tuning)
    tuner.plan(tuner.ModelShape("lstm", 256, 256), 2)
    assert len(ahead) == 1  # a whole calibration: nothing to compile ahead


def test_the_space_offers_the_fused_step_where_a_work_group_owns_a_unit():
    configs = space.pruned_space("lstm", 256, 1, "float32", H100)
    fused = [c for c in configs if c.fused_step]
    assert fused and all(c.work_groups == c.units_per_block for c in fused)
    assert not any(c.fused_step for c in space.pruned_space("gru_reset_before", 256, 1, "float32", H100))
    model = cost.CostModel(synthetic_calibration(), H100)
    c = fused[0]
    plain, one = model.step_cost(dataclasses.replace(c, fused_step=False), 1), model.step_cost(c, 1)
    assert one.barriers < plain.barriers and one.product == plain.product


def test_a_derived_cell_plans_its_own_kernels_without_cudnn_and_its_plan_round_trips(monkeypatch, offline_tuning):
    """A clipped cell with other activations (ONNX clip, activations): its configurations carry its name, cuDNN
    (which has no such cell) is not a candidate, and its plan survives the plan cache's JSON."""
    model = offline_tuning

    class NoWorkload:  # the timing needs a GPU; the candidates' list does not
        def __init__(self, shape, batch, steps):
            pass

        def persistent(self, config, batch_slice):
            return None

        def fallback(self):
            return None

        def cudnn(self):
            raise AssertionError("cuDNN has no clipped cell")

    monkeypatch.setattr(tuner, "_Workload", NoWorkload)
    shape = tuner.ModelShape("lstm+clip=0.5+act=hardsigmoid(0.2,0.5)/tanh/tanh", 256, 256)
    ranked = tuner.ranked_configs(shape, 1, model)
    assert ranked and all(r.config.cell == shape.cell for r in ranked)
    labels = [c.label for c in tuner.timing_candidates(shape, 1, ranked[:3], 100)]
    assert "cudnn" not in labels and "fallback" in labels
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, progress=False: {
        c.label: 0.1 if c.label == labels[1] else 0.2 for c in candidates})
    chosen = tuner.plan(shape, 1)
    assert chosen.path == "persistent" and chosen.label == labels[1] and chosen.config.cell == shape.cell
    assert tuner.Plan.from_json(json.loads(json.dumps(chosen.to_json()))) == chosen


def test_a_plans_device_time_scales_its_own_timing_to_the_calls_steps():
    """``Plan.device_us`` (what decides whether a captured call spreads its
    copies) reads the timing of the plan's own choice, not another
    candidate's, scaled from the tuner's steps to the call's; untimed and
    failed choices give None."""
    plan = _a_plan()
    label = plan.label
    timed = dataclasses.replace(plan, measured_ms={label: 0.2, "fallback": 0.9, "cudnn": 0.05})
    assert timed.device_us(100) == pytest.approx(200.0)
    assert timed.device_us(25) == pytest.approx(50.0)
    cudnn = dataclasses.replace(timed, path="cudnn", config=None)
    assert cudnn.device_us(100) == pytest.approx(50.0)
    assert plan.device_us(100) is None  # its choice is not among the timed labels
    assert dataclasses.replace(timed, measured_ms={label: float("nan")}).device_us(100) is None
    assert dataclasses.replace(timed, steps=None).device_us(100) is None


def test_a_short_sequence_runs_the_path_that_wins_it_up_to_where_the_lines_cross():
    # LSTM 256 b1 on the H100 (scaling-h100.md): a step on the persistent plan 0.014 ms, on cuDNN 0.010 ms;
    # 100 steps 0.109 against 0.47. Linear between: cuDNN wins T = 1 and 2 (they cross at T = 2.08).
    long_ms, short_ms = {"mine": 0.109, "cudnn": 0.47, "fallback": 0.9}, {"mine": 0.014, "cudnn": 0.010,
                                                                          "fallback": 0.009}
    assert tuner.short_sequence_path("mine", long_ms, short_ms, 100) == ("fallback", 1)  # the faster at T = 1
    assert tuner.short_sequence_path("mine", long_ms, {**short_ms, "fallback": 0.02}, 100) == ("cudnn", 2)
    # Crossing at T = 3 exactly: a tie goes to the persistent choice.
    assert tuner.short_sequence_path("mine", {"mine": 0.5, "cudnn": 12.625}, {"mine": 0.5, "cudnn": 0.25},
                                     100) == ("cudnn", 2)
    # Nothing to gain: the persistent choice is fastest at one step too, or the others were not timed or failed.
    assert tuner.short_sequence_path("mine", long_ms, {**short_ms, "mine": 0.009}, 100) == (None, 0)
    assert tuner.short_sequence_path("mine", long_ms, {"mine": 0.014}, 100) == (None, 0)
    assert tuner.short_sequence_path("mine", long_ms, {"mine": 0.014, "cudnn": float("nan")}, 100) == (None, 0)
    assert tuner.short_sequence_path("mine", {"mine": 0.109}, short_ms, 100) == (None, 0)
    assert tuner.short_sequence_path("mine", long_ms, {"cudnn": 0.01}, 100) == (None, 0)


def test_a_plan_gives_its_short_path_to_calls_of_at_most_its_short_steps_and_round_trips():
    plan = dataclasses.replace(_a_plan(), short_path="cudnn", short_steps=3,
                               short_measured_ms={"a": 0.014, "cudnn": 0.010, "fallback": 0.02})
    assert plan.for_steps(4) is plan and plan.for_steps(100) is plan
    short = plan.for_steps(3)
    assert short is plan.for_steps(1)  # made once
    assert short.path == "cudnn" and short.config is None and short.batch_slice is None and short.launch == (
        "cudnn", None, None)
    assert short.for_steps(1) is short and "a sequence of at most 3 steps: cudnn" in short.reason
    assert short.device_us(100) is None  # cuDNN was not timed at 100 steps in _a_plan
    assert "a sequence of at most 3 steps runs cudnn" in plan.describe() and "cudnn 0.010" in plan.describe()
    again = tuner.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.for_steps(2).path == "cudnn"
    assert _a_plan().for_steps(1) is not None and _a_plan().for_steps(1).path == "persistent"


def test_tuning_times_a_persistent_choice_at_one_step_beside_the_other_paths(monkeypatch, offline_tuning):
    # The timing faked (it needs a GPU): the persistent choice wins 100 steps, cuDNN a single step.
    lengths = []

    def candidates(shape, batch, top, steps):
        lengths.append((len(top), steps))
        return ([tuner.Candidate(tuner.candidate_label(r), "persistent", r, steps) for r in top]
                + [tuner.Candidate(p, p, None, steps) for p in ("fallback", "cudnn")])

    monkeypatch.setattr(tuner, "timing_candidates", candidates)
    long_ms = {"fallback": 0.9, "cudnn": 0.47}
    short_ms = {"fallback": 0.02, "cudnn": 0.010}
    monkeypatch.setattr(tuner, "time_candidates", lambda cs, progress=False: {
        c.label: (short_ms if c.run == 1 else long_ms).get(c.label, 0.014 if c.run == 1 else 0.109) for c in cs})
    chosen = tuner.plan(tuner.ModelShape("lstm", 256, 256), 1)
    timed = len(tuner.compile_top(tuner.ranked_configs(tuner.ModelShape("lstm", 256, 256), 1, offline_tuning), 5))
    assert chosen.path == "persistent" and lengths == [(timed, 100), (1, 1)]
    assert (chosen.short_path, chosen.short_steps) == ("cudnn", 2)
    assert chosen.short_measured_ms == {chosen.label: 0.014, **short_ms}
    assert tuner.load_plan(tuner.cache_key(H100, chosen.shape, 1)).for_steps(2).path == "cudnn"
    # A choice that is not persistent is not timed again.
    long_ms["cudnn"] = 0.05
    lengths.clear()
    chosen = tuner.plan(tuner.ModelShape("lstm", 256, 256), 1, refresh=True)
    assert chosen.path == "cudnn" and lengths == [(timed, 100)] and chosen.short_path is None


def test_pin_plan_refuses_what_is_not_a_plan():
    with pytest.raises(TypeError, match="pin_plan: expected a persistrnn.plan.Plan, got dict"):
        tuner.pin_plan(_a_plan().to_json())


@pytest.mark.parametrize("dtype, batch", [("bfloat16", 8), ("float16", 16), ("float32", 1)])
def test_the_tuner_times_the_first_members_of_every_kernel_family_its_top_k_leaves_out(monkeypatch, dtype, batch):
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    ranked = tuner.ranked_configs(tuner.ModelShape("lstm", 256, 256, dtype=dtype), batch, model)
    own = [r for r in ranked if not r.config.tagged_exchange]
    of = tuner.candidate_families(own)
    k = 3
    left = [f for f in dict.fromkeys(of[k:]) if f is not None and f not in of[:k]]
    assert left, "the case must leave a family out of its top k"
    by_family = {f: [r for r, g in zip(own, of) if g == f] for f in left}
    spilled = by_family[left[0]][0].config  # the first of a left-out family spills: the next ones stand in
    monkeypatch.setattr(tuner, "compiles", lambda c: c != spilled)
    top = tuner.compile_top(ranked, k, twins=False)
    assert top[:k] == own[:k] and spilled not in {r.config for r in top}
    for f, members in by_family.items():
        got = [r for r in top[k:] if of[own.index(r)] == f]
        built = [r for r in members if r.config != spilled]
        # The family's best-ranked that built, then the next that ties with the family's first (the spilled one's
        # stand-in has no such second: no round more is compiled for it), at most FAMILY_MEMBERS.
        assert got == built[:len(got)] and 1 <= len(got) <= tuner.FAMILY_MEMBERS
        assert all(r.us <= members[0].us * (1 + tuner.FAMILY_TIE) for r in got[1:])
        if f[0] == "mma":  # one of an mma family: the model prices its products at ~0
            assert len(got) == 1
    assert top[k:] == sorted(top[k:], key=own.index)
    assert {of[own.index(r)] for r in top} - {None} == set(of) - {None}
    # a slice size priced past the window is not timed unless it is in the top k (batch 1 has no slices)
    assert (None in of) == (batch > 1) and all(of[own.index(r)] is not None for r in top[k:])
    assert tuner.compile_top(ranked, k, twins=False, families=False) == own[:k]


def test_each_slice_size_priced_near_its_family_s_best_is_a_family_of_its_own():
    # 16-bit LSTM 256 at batch 8: the fused step in slices of 1 (clusters of 8 x 256 threads) measured 13% faster
    # than the plan, which had timed the fused step only in slices of 2 (perf-notes §103).
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    own = [r for r in tuner.ranked_configs(tuner.ModelShape("lstm", 256, 256, dtype="float16"), 8, model)
           if not r.config.tagged_exchange]
    of = tuner.candidate_families(own)
    first = {}
    for r in own:
        first.setdefault(tuner.family(r.config, r.batch_slice), r)
    for f, r in first.items():
        kernel = [s for g, s in first.items() if g[:-1] == f[:-1]]
        within = r.us <= min(s.us for s in kernel) * (1 + tuner.SLICE_WINDOW)
        assert (of[own.index(r)] == f) == within, (f, r.us)
    assert len({f for f in of if f is not None and f[:-1] == ("ffma", False, True, 1)}) >= 2



def test_an_mma_family_s_tied_second_is_not_timed_where_an_ffma_family_s_is(monkeypatch):
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    ranked = tuner.ranked_configs(tuner.ModelShape("lstm", 1024, 1024, dtype="bfloat16"), 1, model)
    own = [r for r in ranked if not r.config.tagged_exchange]
    monkeypatch.setattr(tuner, "compiles", lambda c: True)
    top = tuner.compile_top(ranked, 1, twins=False)
    by_family = {}
    for r in own:
        by_family.setdefault(tuner.family(r.config, r.batch_slice), []).append(r)
    tied = {f: m for f, m in by_family.items() if len(m) > 1 and m[1].us <= m[0].us * (1 + tuner.FAMILY_TIE)}
    assert {f[0] for f in tied} == {"ffma", "mma"}, "the case must have ties of both kinds"
    for f, members in tied.items():
        assert [r for r in top if tuner.family(r.config, r.batch_slice) == f] == members[:2 if f[0] == "ffma" else 1]


def test_a_left_out_family_with_a_member_already_built_compiles_nothing_more(monkeypatch):
    # The top k's compile round compiles twice what is missing: a left-out family's members built there (past the k
    # kept) are that family's candidates, beside its first FAMILY_MEMBERS, and none of its later members is
    # compiled.
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    ranked = tuner.ranked_configs(tuner.ModelShape("lstm", 256, 256, dtype="bfloat16"), 8, model)
    own = [r for r in ranked if not r.config.tagged_exchange]
    k = 3
    of = tuner.candidate_families(own)
    over = [r for r, f in zip(own[k:2 * k], of[k:2 * k]) if f is not None and f not in of[:k]]
    assert over, "the case must build a left-out family's member in the first round"
    tried = []
    monkeypatch.setattr(tuner, "compiles", lambda c: tried.append(c) or True)
    top = tuner.compile_top(ranked, k, twins=False)
    for f in {of[own.index(r)] for r in over}:
        members = [r for r, g in zip(own, of) if g == f]
        ties = [r for r in members[1:tuner.FAMILY_MEMBERS]
                if r.config.math == "ffma" and r.us <= members[0].us * (1 + tuner.FAMILY_TIE)]
        assert members[0] in over
        assert [r for r in top[k:] if of[own.index(r)] == f] == [members[0]] + ties
        # nothing of the family is compiled but the first round and its timed members
        assert {r.config for r in members if r.config in tried} <= {r.config for r in own[:2 * k] + ties}


@pytest.mark.parametrize("shape, batch", [(tuner.ModelShape("lstm", 1024, 1024), 1),
                                          (tuner.ModelShape("lstm", 256, 256, dtype="bfloat16"), 8),
                                          (tuner.ModelShape("gru", 512, 512), 4)])
def test_where_nothing_spills_the_tuner_compiles_its_candidates_in_one_round(monkeypatch, shape, batch):
    # Each round of compiles is ~1 s of a fresh machine's host time: the top k, the first members of every family
    # they leave out and the twins of both go in one round.
    model = cost.CostModel(CALIBRATIONS[-1], H100)
    ranked = tuner.ranked_configs(shape, batch, model)
    monkeypatch.setattr(tuner, "compiles", lambda c: True)
    rounds = []
    real = runtime.map_in_threads
    monkeypatch.setattr(runtime, "map_in_threads", lambda fn, items: rounds.append(len(items)) or real(fn, items))
    top = tuner.compile_top(ranked, 5)
    assert len([n for n in rounds if n]) == 1 and rounds[0] >= len(top)
    own = [r for r in ranked if not r.config.tagged_exchange]
    kept = [r for r in top if not r.config.tagged_exchange]
    assert kept[:5] == own[:5]
    of = tuner.candidate_families(own)
    assert {of[own.index(r)] for r in kept} - {None} == set(of) - {None}
    twins = [t for r in kept for t in ranked if t.config.tagged_exchange and t.batch_slice == r.batch_slice
             and dataclasses.replace(t.config, tagged_exchange=False) == r.config]
    assert [r for r in top if r.config.tagged_exchange] == twins and (shape.hidden_size < 1024 or twins)


def test_a_micro_benchmark_loop_too_short_to_time_runs_again_longer(monkeypatch):
    asked = []

    def per_iteration_us(run, iterations, warmup=2, repeats=5):
        asked.append(iterations)
        return {1000: -0.001, 4000: 0.004, 16000: 0.0041}.get(iterations, 0.0)  # µs per iteration

    monkeypatch.setattr(runtime, "per_iteration_us", per_iteration_us)
    assert cost.loop_ns(lambda n: None, "k") == pytest.approx(4.1)  # 4000 x 4 ns: 14 µs, under MIN_LOOP_US
    assert asked == [1000, 4000, 16000]
    asked.clear()
    monkeypatch.setattr(runtime, "per_iteration_us", lambda *a, **k: asked.append(a[1]) or 0.0)
    with pytest.raises(cost.CalibrationError, match="k: 5 timings, up to 256000 iterations"):
        cost.loop_ns(lambda n: None, "k")
    assert asked == [1000 * 4 ** i for i in range(cost.MEASURE_ATTEMPTS)]
