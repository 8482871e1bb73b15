"""The instrumented build (KernelConfig.step_profile) and `bench step-profile`."""

import dataclasses

import numpy as np
import pytest

from persistrnn import persistent
from persistrnn.bench.step_profile import PHASES, phase_table
from persistrnn.errors import ArgumentError
from persistrnn.persistent import ConfigError, KernelConfig

# Every sync mode, the fused step, tensor cores, a two-stage cell in one
# block and the one-sync GRU: each path's phases have their own marks.
PROFILED = [
    KernelConfig("gru", 64, "single", 1),
    KernelConfig("gru_reset_before", 96, "single", 1, 256, 8, 2),
    KernelConfig("lstm", 250, "cluster", 8),
    KernelConfig("lstm", 192, "cluster", 12, 128, 8, 1, fused_step=True),
    KernelConfig("lstm", 256, "cluster", 8, 256, 32, 8, dtype="bfloat16", math="mma", k_split=2),
    KernelConfig("gru_reset_before", 256, "cluster", 8, one_sync=True),
    KernelConfig("rnn_tanh", 500, "grid", 16, 256, 8, 4),
]


@pytest.mark.parametrize("config", PROFILED, ids=str)
def test_instrumented_build_compiles_for_sm90_without_local_memory(config):
    instrumented = dataclasses.replace(config, step_profile=True)
    source = persistent.render_source(instrumented)
    assert "unsigned long long* __restrict__ profile" in source
    assert "unsigned long long* __restrict__ profile" not in persistent.render_source(config)
    res = persistent.compile_config(instrumented, arch="sm_90").kernel_resources(persistent.KERNEL_NAME)
    assert not res.uses_local_memory, res


def test_resident_build_is_not_instrumented():
    with pytest.raises(ConfigError, match="without pipeline, lengths, test hook, saved gates or step profile; "
                                          "got step_profile True"):
        KernelConfig("lstm", 128, "cluster", 8, resident_input_size=40, step_profile=True)


def test_profile_tensor_goes_with_the_instrumented_build_only():
    import torch

    h = torch.zeros(2, 64)
    instance = persistent.Instance(torch.zeros(3, 2, 192), torch.zeros(192, 64), torch.zeros(192), h, None, None,
                                   h, None)
    with pytest.raises(ArgumentError, match="profile: expected a tensor exactly for an instrumented build "
                                            r"\(step_profile True\), got None"):
        persistent.run_instances(KernelConfig("gru", 64, "single", 1, step_profile=True), [instance], 3, 2)
    with pytest.raises(ArgumentError, match=r"\(step_profile False\), got a tensor"):
        persistent.run_instances(KernelConfig("gru", 64, "single", 1), [instance], 3, 2,
                                 profile=torch.zeros(10, dtype=torch.int64))


def test_phase_table_converts_each_block_at_its_own_clock():
    config = KernelConfig("lstm", 256, "cluster", 2)
    # block 0: 2000 cycles in 1000 ns (2 GHz); block 1: 1000 cycles in 1000 ns (1 GHz)
    cycles = np.zeros((2, len(PHASES)))
    cycles[0, PHASES.index("product")], cycles[0, PHASES.index("exchange_wait")] = 800, 1000
    cycles[1, PHASES.index("product")], cycles[1, PHASES.index("exchange_wait")] = 600, 300
    words = np.concatenate([cycles, [[2000, 1000], [1000, 1000]]], axis=1).astype(np.int64)
    table = phase_table(words, config)
    assert table["phases_ns"]["product"] == pytest.approx((400 + 600) / 2)
    assert table["phases_max_ns"]["product"] == pytest.approx(600)
    assert table["phases_ns"]["exchange_wait"] == pytest.approx((500 + 300) / 2)
    assert table["phases_ns"]["push"] == 0
    assert table["uncovered_ns"] == pytest.approx(((1000 - 900) + (1000 - 900)) / 2)
    assert table["clock_ghz"] == pytest.approx(1.5)
    assert table["blocks"] == 2


def test_phase_table_refuses_words_no_launch_wrote():
    config = KernelConfig("lstm", 256, "cluster", 2)
    unwritten = np.full((2, len(PHASES) + 2), -1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"2 of 2 blocks recorded no step loop \(blocks \[0, 1\];"):
        phase_table(unwritten, config)
    unwritten[0, -2:] = 1000
    with pytest.raises(ValueError, match=r"1 of 2 blocks recorded no step loop \(blocks \[1\];"):
        phase_table(unwritten, config)
    over = np.zeros((1, len(PHASES) + 2), dtype=np.int64)
    over[0, 0], over[0, -2], over[0, -1] = 500, 400, 200
    with pytest.raises(ValueError, match="add up to more cycles than the step loop took"):
        phase_table(over, config)


GPU_CASES = [(c, b, s) for c, b, s in [
    (PROFILED[0], 3, None), (PROFILED[1], 5, None), (PROFILED[2], 7, 3), (PROFILED[3], 5, 2), (PROFILED[4], 9, 8),
    (PROFILED[5], 4, None), (PROFILED[6], 3, None),
]]


@pytest.mark.gpu
@pytest.mark.parametrize("config, batch, batch_slice", GPU_CASES, ids=[f"{c}-B{b}-s{s}" for c, b, s in GPU_CASES])
def test_instrumented_build_gives_the_shipped_outputs_and_covers_the_step_loop(config, batch, batch_slice):
    import torch

    from persistrnn import runtime

    spec = config.spec
    G, H, T = spec.num_gates, config.hidden_size, 23
    dev, dtype = torch.device("cuda"), getattr(torch, config.dtype)
    gen = torch.Generator(device=dev).manual_seed(7)
    w_hh = (torch.randn(G * H, H, device=dev, generator=gen) / H**0.5).to(dtype)
    b_hh = torch.randn(G * H, device=dev, generator=gen).to(dtype)
    h0 = torch.randn(batch, H, device=dev, generator=gen).to(dtype)
    c0 = torch.randn(batch, H, device=dev, generator=gen).to(dtype) if spec.has_cell_state else None
    xw = torch.randn(T, batch, G * H, device=dev, generator=gen)
    instrumented = dataclasses.replace(config, step_profile=True)
    slices = -(-batch // (batch_slice or batch))
    profile = torch.full((persistent.profile_words(config, slices),), -1, dtype=torch.int64, device=dev)
    results = []
    for kernel_config in (config, instrumented):
        out = torch.full((T, batch, H), float("nan"), dtype=dtype, device=dev)
        h_n = torch.full_like(h0, float("nan"))
        c_n = torch.full_like(h0, float("nan")) if c0 is not None else None
        persistent.run_instances(kernel_config, [persistent.Instance(xw, w_hh, b_hh, h0, c0, out, h_n, c_n)], T,
                                 batch, batch_slice=batch_slice,
                                 profile=profile if kernel_config.step_profile else None)
        results.append((out, h_n, c_n))
    runtime.raise_reported_failure(dev.index, persistent.KERNEL_NAME, synchronize=True)
    for shipped, profiled in zip(*results):
        if shipped is not None:
            assert not shipped.isnan().any()
            assert torch.equal(shipped, profiled)
    words = profile.cpu().numpy().reshape(-1, len(PHASES) + 2)
    assert len(words) == slices * config.blocks
    table = phase_table(words, instrumented)  # every block wrote, and no phase sum exceeds its loop
    covered = words[:, :len(PHASES)].sum(axis=1) / words[:, -2]
    assert covered.min() > 0.8, covered  # the marks cover the step loop but for its own few instructions
    assert table["phases_ns"]["product"] > 0
    if config.sync != "single":
        assert table["phases_ns"]["exchange_wait"] > 0
    assert 0.5 < table["clock_ghz"] < 3.0


def test_published_profile_renders_from_its_json(tmp_path):
    """`--from-json` writes the table of a saved run without a GPU."""
    from pathlib import Path

    from persistrnn.bench.step_profile import main

    saved = Path(__file__).parent.parent / "docs" / "results" / "step-profile-h200.json"
    markdown = tmp_path / "profile.md"
    assert main(["--from-json", str(saved), "--markdown", str(markdown)]) == 0
    rows = [line for line in markdown.read_text().splitlines() if line.startswith("| lstm") or line.startswith("| gru")]
    assert len(rows) == 7
    assert all(len(row.split("|")) == 6 + len(PHASES) + 2 for row in rows)
    assert "plan: persistent clusterx16 t256 g8 bt1 sk0 ffma | 0.917" in rows[0]


def test_layer_cases_parse_and_a_malformed_one_is_a_usage_error(capsys):
    import argparse

    from persistrnn.bench.environment import parse_layer_case
    from persistrnn.bench.step_profile import main

    assert parse_layer_case("lstm:256:8") == ("lstm", 256, 8, "float32")
    assert parse_layer_case("gru_reset_before:33:5:bfloat16") == ("gru_reset_before", 33, 5, "bfloat16")
    for bad in ("lstm:256", "lsmt:256:8", "lstm:256:0", "lstm:x:8", "lstm:256:8:float64", "lstm:256:8:fp16:1"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a case as cell:hidden:batch.*got '{bad}'"):
            parse_layer_case(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["--case", "lstm:256"])
    assert exit_info.value.code == 2 and "expected a case as cell:hidden:batch" in capsys.readouterr().err


def test_variants_alternate_within_each_round_and_the_table_names_the_round(monkeypatch):
    """An A/B: every case once per variant, in turn, the whole set `rounds` times; each row keeps its
    variant and round, and the fields reach the configuration (a wrong order or a lost variant would show)."""
    from persistrnn.bench import step_profile

    calls = []

    def fake_case(cell, hidden, batch, dtype, cfg, variant=None):
        fields = step_profile.parse_config_fields(cfg.config) | step_profile.parse_config_fields(variant)
        config = dataclasses.replace(KernelConfig(cell, hidden, "grid", 128, 256, 32, 1), **fields)
        calls.append((cell, hidden, variant))
        zero = {p: 0.0 for p in PHASES}
        return {"cell": cell, "hidden": hidden, "batch": batch, "dtype": dtype,
                "config": dataclasses.asdict(config), "batch_slice": None, "source": f"default with {variant}",
                "shipped_us_per_step": 1.0 + len(calls), "instrumented_us_per_step": 2.0, "phases_us": zero,
                "phases_max_us": zero, "uncovered_us": 0.0, "clock_ghz": 1.98}

    monkeypatch.setattr(step_profile, "run_case", fake_case)
    monkeypatch.setattr("persistrnn.bench.environment.environment", lambda: {})
    cfg = step_profile.StepProfileConfig(cases=(("lstm", 1024, 1, "float32"), ("gru", 1024, 1, "float32")),
                                         config="fused_step=True", rounds=2, from_plan=False,
                                         variants=("tagged_exchange=False", "tagged_exchange=True"))
    result = step_profile.run(cfg)
    off, on = cfg.variants
    assert calls == [("lstm", 1024, off), ("lstm", 1024, on), ("gru", 1024, off), ("gru", 1024, on)] * 2
    assert [(c["round"], c["variant"]) for c in result["cases"]] == [(r, v) for r in (0, 1) for _ in "lg"
                                                                     for v in (off, on)]
    assert [c["config"]["tagged_exchange"] for c in result["cases"]] == [False, True] * 4
    assert all(c["config"]["fused_step"] for c in result["cases"])
    table = step_profile.format_table(result)
    assert "| lstm 1024 b1 float32 (round 2) | default with tagged_exchange=True: " in table
    assert "fused tagged | 7.000 |" in table  # the sixth call: its own timing, not another row's


def test_a_variant_that_names_no_configuration_field_is_a_usage_error(capsys):
    from persistrnn.bench.step_profile import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--variant", "taged_exchange=True"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "expected KernelConfig fields as k=v,k=v, got 'taged_exchange=True'" in err
    assert "'taged_exchange' is not a KernelConfig field" in err


def test_stall_summary_reads_ncu_source_page_and_ranks_instructions(capsys):
    # Ten rows of a real ncu source page (the kernel's name line, then the header): the summary adds the warp
    # samples up, by opcode (a predicate guard and a dotted suffix are not the opcode) and by instruction.
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("stall_profile", root / "scripts" / "stall_profile.py")
    stall_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stall_profile)
    stall_profile.summarise(str(root / "tests" / "data" / "ncu-source-lstm256-b1.csv"), top=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "10 instructions, 3026 warp samples (Warp Stall Sampling (All Samples))"
    assert lines[1].startswith("by opcode: BRA 63.3%, CCTL 27.5%, B2R 6.0%, FFMA 1.3%, SYNCS 0.9%")
    top = [line for line in lines if line.startswith("0x")]
    assert len(top) == 2
    assert top[0].split()[:3] == ["0x7f5c777c2f10", "1915", "63.3%"] and "barrier 1891" in top[0]
    assert top[1].split()[:3] == ["0x7f5c777c3460", "832", "27.5%"] and "long_sb 822" in top[1]
    assert top[1].endswith("CCTL.IVALL")
