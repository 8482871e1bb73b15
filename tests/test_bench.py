"""The comparison suites: their cases, tables, ratios, CSV, plots, absent and
failing providers, the ONNX Runtime peer against float64, and the speed
targets, including the published H100 table (CPU); each suite end to end on
a small grid (GPU)."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from persistrnn import reference
from persistrnn.bench import compare, targets
from persistrnn.bench.__main__ import COMPARISONS, SUITES
from persistrnn.bench.__main__ import main as bench_main
from persistrnn.bench.compare import Case, Row

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _case(model, cell, hidden, batch, ours_graph, ours_eager, cudnn_graph, cudnn_eager, cpu, *, layers=1,
          bidirectional=False, dtype="float32", steps=100, ours_status="ok", first=2.0, tuned=True, plan="persistent"):
    def scaled(v, k):
        return None if v is None else v * k

    rows = [Row("persistrnn", ours_status, ours_eager, ours_graph, scaled(ours_eager, 2), 3e-7, first_call_s=first,
                tuned=tuned, plan=plan)]
    if ours_status != "ok":
        rows[0] = Row("persistrnn", "failed", note="KernelLaunchError: no room")
    if dtype == "float32":
        rows += [Row("cudnn (TF32 allowed)", ms=cudnn_eager, graph_ms=cudnn_graph),
                 Row("cudnn (TF32 off)", ms=scaled(cudnn_eager, 1.5), graph_ms=scaled(cudnn_graph, 1.5)),
                 Row("torch-cpu", ms=cpu, note="16 threads"),
                 Row("onnxruntime-cpu", ms=scaled(cpu, 0.5), note="16 threads")]
    else:
        rows += [Row("cudnn", ms=cudnn_eager, graph_ms=cudnn_graph),
                 Row("torch-cpu", "not run", note="the CPU peers are timed in fp32 cases only"),
                 Row("onnxruntime-cpu", "not run", note="the CPU peers are timed in fp32 cases only")]
    rows.append(Row("flashrnn", "absent", note="flashrnn is not installed"))
    case = Case(model, cell, hidden, hidden, layers, bidirectional, dtype, steps, batch)
    return {**case.__dict__, "rows": [r.__dict__ for r in rows]}


ENV = {"gpu": "Test GPU", "torch": "2.x", "cuda_runtime": "13.0", "cudnn": 1, "cuda_core": "1", "nvrtc": "13.0",
       "persistrnn": "0", "commit": "abc", "date": "today"}
RESULT = {"suite": "grnn-table", "environment": ENV, "settings": {}, "cases": [
    _case("LSTM 256", "lstm", 256, 1, 0.1, 0.2, 0.5, 1.0, 4.0),
    _case("GRU 64", "gru", 64, 10, 0.2, 0.3, 0.1, 0.9, 1.2),
    _case("GRU (reset-before) 1024", "gru_reset_before", 1024, 20, None, None, None, None, 9.0, ours_status="failed"),
    _case("LSTM 256", "lstm", 256, 8, 0.04, 0.05, 0.14, 0.3, None, dtype="float16"),
]}


# ----------------------------------------------------------------------------
# Suites and their cases
# ----------------------------------------------------------------------------

def test_every_comparison_suite_is_registered_with_the_harness():
    assert set(COMPARISONS) == set(compare.SUITES)
    assert all(SUITES[name] == "persistrnn.bench.compare" for name in COMPARISONS)
    assert SUITES["targets"] == "persistrnn.bench.targets"


def test_suites_hold_the_cases_the_issue_lists():
    grnn = compare.SUITES["grnn-table"].build()
    assert len(grnn) == 3 * 3 * 3 and {c.cell for c in grnn} == {"lstm", "gru", "gru_reset_before"}
    assert {(c.steps, c.input == c.hidden, c.layers, c.dtype) for c in grnn} == {(100, True, 1, "float32")}
    real = compare.SUITES["real-models"].build()
    assert [(c.model, c.layers, c.hidden, c.steps, c.batch) for c in real if c.batch == 5] == [
        ("char-RNN", 3, 128, 100, 5), ("text classification", 2, 256, 20, 5)]
    assert [c for c in real if c.bidirectional] == [Case("bidirectional", "lstm", 256, 256, 2, True, "float32", 100, 8)]
    scaling = compare.SUITES["scaling"].build()
    assert len(scaling) == len(set(scaling)) == 2 * (7 + 4 - 1)  # the T=100, batch 1 case once per H
    assert {c.batch for c in scaling if c.steps == 100} == {1, 2, 4, 8, 16, 32, 64}
    assert {c.steps for c in scaling if c.batch == 1} == {1, 10, 100, 1000}
    dtypes = compare.SUITES["dtypes"].build()
    assert len(dtypes) == 2 * 3 * 3 * 5 and {c.batch for c in dtypes} == {1, 8, 10, 16, 20}


def test_cli_axes_replace_the_suites_defaults():
    cases = compare.SUITES["grnn-table"].build(cells=("lstm",), hidden=(63,), batch=(3,), steps=(7,))
    assert cases == [Case("LSTM 63", "lstm", 63, 63, 1, False, "float32", 7, 3)]
    assert {c.batch for c in compare.SUITES["real-models"].build(batch=(2,))} == {2, 8}


def test_cli_refuses_an_axis_the_suite_does_not_take_and_too_few_repeats(capsys):
    with pytest.raises(SystemExit):
        compare.main("real-models", ["--hidden", "64"])
    assert "unrecognized arguments: --hidden" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main("grnn-table", ["--repeats", "3"])
    assert "at least 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main("scaling", ["--batch", "0", "4"])
    assert "expected positive integers, got [0, 4]" in capsys.readouterr().err


def test_bench_names_an_unknown_suite(capsys):
    assert bench_main(["no-such-suite"]) == 2
    assert "expected one of: grnn-table, real-models, scaling, dtypes" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# Tables and files
# ----------------------------------------------------------------------------

def _line(table, start):
    return [c.strip() for c in next(line for line in table.splitlines() if line.startswith(start)).split("|")[1:-1]]


def test_table_ratios_are_peer_over_ours_with_the_best_cudnn_setting():
    table = compare.format_table(RESULT)
    lstm = _line(table, "| LSTM 256 | fp32")
    assert lstm[:6] == ["LSTM 256", "fp32", "100", "1", "0.100", "0.200"]
    assert lstm[6:8] == ["0.500 / 0.750", "1.000 / 1.500"]  # TF32 allowed / off
    # the faster cuDNN setting: 0.5 / 0.1 and 1.0 / 0.2; the CPU 4.0 / 0.2; ONNX Runtime 2.0 / 0.2
    assert lstm[10:14] == ["5.00×", "5.00×", "20.00×", "10.00×"]
    assert lstm[16:] == ["persistent", "2.0 (tuned)"]
    assert "0.50×" in _line(table, "| GRU 64")  # ours slower than cuDNN graph: a ratio below 1, not hidden
    half = _line(table, "| LSTM 256 | fp16")
    assert half[6:10] == ["0.140", "0.300", "—", "—"] and half[10] == "3.50×"


def test_absent_failed_not_run_and_peerless_providers_are_named_not_dropped():
    table = compare.format_table(RESULT)
    assert "failed: KernelLaunchError: no room" in table
    assert "flashrnn: absent (flashrnn is not installed)" in table
    assert "torch-cpu: not run (the CPU peers are timed in fp32 cases only)" in table


def test_csv_has_a_row_per_provider_and_case():
    rows = list(csv.DictReader(io.StringIO(compare.to_csv(RESULT))))
    assert len(rows) == 3 * 6 + 5
    assert {r["provider"] for r in rows} >= {"persistrnn", "cudnn (TF32 off)", "cudnn", "torch-cpu", "flashrnn"}
    first = rows[0]
    assert (first["model"], first["hidden"], first["graph_ms"], first["status"], first["plan"]) == (
        "LSTM 256", "256", "0.1", "ok", "persistent")


def test_a_failing_provider_becomes_a_failed_row():
    def broken():
        raise RuntimeError("cuDNN said no\nsecond line")

    row = compare._guard("cudnn (TF32 off)", broken)
    assert (row.provider, row.status, row.note) == ("cudnn (TF32 off)", "failed", "RuntimeError: cuDNN said no")


def test_an_uninstalled_peer_is_reported_absent():
    row = compare._absent("surely_not_an_installed_module", "peer")
    assert (row.status, row.ms) == ("absent", None) and "not installed" in row.note
    assert compare._absent("json", "json-peer") is None  # installed everywhere


def test_markdown_records_the_environment_and_the_targets_of_the_run():
    text = compare.markdown(RESULT, compare.SUITES["grnn-table"])
    assert "Test GPU" in text and "commit abc" in text
    assert "| LSTM H=256, batch 1: ≤ 0.06 ms and ≥ 15× cuDNN eager | fp32, batch 1 | 0.100 ms (persistent), " \
           "5.0× cuDNN eager | **missed** |" in text


def test_streaming_rows_are_tabled():
    result = {**RESULT, "streaming": {"model": "streaming (LSTM 128, 1 step per call)", "hidden": 128, "batch": 1,
                                      "plan": "persistent", "ours_call_ms": 0.05, "cudnn_call_ms": 0.1,
                                      "rel_error": 1e-7}}
    assert "| streaming (LSTM 128, 1 step per call) | persistent | 0.0500 | 0.1000 | 2.00× | 1.0e-07 |" in \
        compare.format_table(result)


def test_plots_are_written_for_every_suite(tmp_path):
    pytest.importorskip("matplotlib")
    for name in COMPARISONS:
        suite = compare.SUITES[name]
        cases = suite.build()[:12]
        result = {"suite": name, "environment": ENV, "cases": [
            _case(c.model, c.cell, c.hidden, c.batch, 0.1 * (k + 1), 0.2, 0.5, 1.0, 4.0, layers=c.layers,
                  bidirectional=c.bidirectional, dtype=c.dtype, steps=c.steps) for k, c in enumerate(cases)]}
        for plot, path in ((compare.plot_latency, tmp_path / f"{name}.png"),
                           (compare.plot_speedup, tmp_path / f"{name}-speedup.png")):
            assert "written" in plot(result, suite, path), name
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_earlier_run_is_written_again_from_its_json_without_a_gpu(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(RESULT))
    out = tmp_path / "again"
    assert compare.main("grnn-table", ["--from-json", str(saved), "--markdown", f"{out}.md", "--csv", f"{out}.csv"]) == 0
    assert "| LSTM 256 | fp32 | 100 | 1 | 0.100 |" in Path(f"{out}.md").read_text()
    assert len(list(csv.DictReader(io.StringIO(Path(f"{out}.csv").read_text())))) == 3 * 6 + 5
    capsys.readouterr()
    with pytest.raises(SystemExit):
        compare.main("dtypes", ["--from-json", str(saved)])
    assert "expected a dtypes result, got 'grnn-table'" in capsys.readouterr().err


def test_plots_without_matplotlib_say_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    for plot in (compare.plot_latency, compare.plot_speedup):
        message = plot(RESULT, compare.SUITES["grnn-table"], tmp_path / "p.png")
        assert "matplotlib is not installed" in message and not (tmp_path / "p.png").exists()


# ----------------------------------------------------------------------------
# ONNX Runtime peer
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("cell", ["lstm", "gru", "gru_reset_before", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("layers,bidirectional,bias", [(1, False, True), (3, True, True), (2, False, False)])
def test_onnxruntime_peer_matches_the_float64_reference(cell, layers, bidirectional, bias):
    pytest.importorskip("onnxruntime")
    from persistrnn.bench import onnx_peer

    rng = np.random.default_rng(layers * 10 + bidirectional)
    shapes = reference.param_shapes(cell, 5, 7, num_layers=layers, bidirectional=bidirectional, bias=bias)
    params = [[{k: rng.standard_normal(s) * 0.5 for k, s in e.items()} for e in es] for es in shapes]
    x = rng.standard_normal((6, 3, 5))
    want, _ = reference.rnn_forward(cell, x, params, num_layers=layers, bidirectional=bidirectional)
    got = onnx_peer.run(onnx_peer.session(cell, params, 5, 7, threads=1), x)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_onnxruntime_peer_refuses_what_onnx_cannot_express():
    pytest.importorskip("onnx")
    from persistrnn.bench import onnx_peer

    params = [[{"w_ih": np.ones((8, 2)), "w_hh": np.ones((8, 1)), "w_hr": np.ones((1, 2))}]]
    with pytest.raises(ValueError, match="no projection"):
        onnx_peer.build_model("lstm", params, 2, 2)
    with pytest.raises(ValueError, match="cell: expected one of"):
        onnx_peer.build_model("mlstm", params, 2, 2)


# ----------------------------------------------------------------------------
# Speed targets
# ----------------------------------------------------------------------------

def _target(text):
    return next(t for t in targets.TARGETS if t.text.startswith(text))


def test_targets_are_judged_on_the_bound_and_on_each_speedup():
    lstm = _target("LSTM H=256, batch 1")
    assert targets.judge(lstm, _case("LSTM 256", "lstm", 256, 1, 0.05, 0.06, 0.5, 1.0, 4.0)) == (
        "met", "0.050 ms (persistent), 16.7× cuDNN eager")
    assert targets.judge(lstm, _case("LSTM 256", "lstm", 256, 1, 0.07, 0.06, 0.5, 1.0, 4.0))[0] == "missed"
    assert targets.judge(lstm, _case("LSTM 256", "lstm", 256, 1, 0.05, 0.1, 0.5, 1.0, 4.0))[0] == "missed"
    bi = _target("bidirectional")
    case = _case("bidirectional", "lstm", 256, 8, 0.5, 0.6, 1.2, 6.0, 9.0, layers=2, bidirectional=True)
    assert targets.judge(bi, case) == ("missed", "0.500 ms (persistent), 10.0× cuDNN eager, 2.4× cuDNN graph")
    failed = _case("LSTM 256", "lstm", 256, 1, None, None, 0.5, 1.0, 4.0, ours_status="failed")
    assert targets.judge(lstm, failed) == ("missed", "persistrnn failed: KernelLaunchError: no room")


def test_targets_apply_only_to_their_cases_and_unmeasured_ones_are_listed():
    rows = targets.evaluate([RESULT])
    measured = {(r["target"][:22], r["case"]) for r in rows if r["status"] != "not measured"}
    assert ("LSTM H=256, batch 1: ≤", "fp32, batch 1") in measured
    assert ("LSTM fp16/bf16, H=256,", "fp16, batch 8") in measured
    assert not any(r["target"].startswith("LSTM H=256, batch 10") and r["status"] != "not measured" for r in rows)
    unmeasured = [r for r in rows if r["status"] == "not measured"]
    assert any(r["target"].startswith("char-RNN") for r in unmeasured)
    first = rows[-1]
    assert first["target"].startswith("first call") and first["status"] == "met" and "over the 3 first calls that tuned" in first["measured"]
    assert "not measured" not in targets.format_targets([RESULT])
    assert "| not measured |" in targets.format_targets([RESULT], measured_only=False)


def test_a_miss_carries_its_cause_and_a_slow_first_call_is_a_miss():
    slow = {**RESULT, "cases": [_case("LSTM 64", "lstm", 64, 3, 0.1, 0.2, 0.5, 1.0, 4.0, first=42.0)]}
    rows = targets.evaluate([slow])
    small = next(r for r in rows if r["target"].startswith("LSTM H=64"))
    assert small["status"] == "missed" and "small-H persistent kernel" in small["cause"]
    assert rows[-1]["status"] == "missed" and "42.0 s" in rows[-1]["measured"]


def test_first_calls_that_found_a_cached_plan_do_not_count():
    cached = {**RESULT, "cases": [_case("LSTM 64", "lstm", 64, 3, 0.1, 0.2, 0.5, 1.0, 4.0, first=0.01, tuned=False),
                                  _case("LSTM 64", "lstm", 64, 9, 0.1, 0.2, 0.5, 1.0, 4.0, first=3.0)]}
    assert "3.0–3.0 s over the 1 first calls that tuned" in targets.evaluate([cached])[-1]["measured"]
    cached["cases"].pop()
    first = targets.evaluate([cached])[-1]
    assert first["status"] == "not measured" and "found its plan in the cache" in first["measured"]
    assert "0.0 (cached plan)" in compare.format_table(cached)


def test_targets_cli_refuses_a_file_that_is_not_a_suite_result(tmp_path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        targets.main([str(wrong)])
    assert "expected a comparison suite's JSON result" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(RESULT))
    assert targets.main([str(good), "--markdown", str(tmp_path / "t.md")]) == 0
    assert "`good.json` (grnn-table)" in (tmp_path / "t.md").read_text()


def test_the_published_targets_table_is_what_the_published_results_give():
    published = (RESULTS / "targets-h100.md").read_text()
    sources = [RESULTS / f"{name}-h100.json" for name in COMPARISONS]
    present = [p for p in sources if p.exists()]
    assert present == sources, f"published results missing: {sorted(set(sources) - set(present))}"
    results = [json.loads(p.read_text()) for p in sources]
    assert targets.format_targets(results, measured_only=False) in published


# ----------------------------------------------------------------------------
# On the GPU: each suite end to end on a small grid
# ----------------------------------------------------------------------------

def _run(tmp_path, suite, *args):
    out = tmp_path / suite
    assert compare.main(suite, [*args, "--no-progress", "--json", f"{out}.json", "--csv", f"{out}.csv",
                                "--markdown", f"{out}.md", "--plot", f"{out}.png"]) == 0
    return json.loads(Path(f"{out}.json").read_text()), Path(f"{out}.md").read_text()


def _check_ours(rows, tolerance):
    ours = rows["persistrnn"]
    assert ours["status"] == "ok" and ours["graph_ms"] > 0 and ours["first_call_s"] > 0
    assert isinstance(ours["tuned"], bool)
    if ours["plan"] == "cudnn":  # torch's own numbers, TF32 included where torch allows it
        cudnn = max(r["rel_error"] for p, r in rows.items() if p.startswith("cudnn") and r["status"] == "ok")
        assert ours["rel_error"] <= 1.5 * max(tolerance, cudnn)
    else:
        assert ours["rel_error"] <= tolerance


@pytest.mark.gpu
def test_grnn_table_runs_a_small_grid_end_to_end(tmp_path):
    result, md = _run(tmp_path, "grnn-table", "--cells", "lstm", "gru_reset_before", "--hidden", "64", "--batch", "1",
                      "3", "--steps", "7")
    assert len(result["cases"]) == 4
    for case in result["cases"]:
        rows = compare.providers(case)
        _check_ours(rows, 1e-5)
        assert rows["torch-cpu"]["rel_error"] <= 1e-5
        onnx = rows["onnxruntime-cpu"]
        assert onnx["status"] == "absent" or (onnx["status"] == "ok" and onnx["rel_error"] <= 1e-5 and onnx["ms"] > 0)
        if case["cell"] == "lstm":
            assert rows["cudnn (TF32 off)"]["rel_error"] <= 1e-5 and rows["cudnn (TF32 off)"]["graph_ms"] > 0
        else:
            assert rows["cudnn (TF32 off)"]["status"] == "no peer"
    assert "| LSTM 64 | fp32 | 7 | 3 |" in md
    for png in ("grnn-table.png", "grnn-table-speedup.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_dtypes_runs_half_precision_against_cudnn(tmp_path):
    result, md = _run(tmp_path, "dtypes", "--cells", "gru", "--hidden", "64", "--batch", "3", "--dtypes", "float16",
                      "bfloat16")
    assert [c["dtype"] for c in result["cases"]] == ["float16", "bfloat16"]
    for case in result["cases"]:
        rows = compare.providers(case)
        _check_ours(rows, 2e-2)
        assert rows["cudnn"]["status"] == "ok" and rows["cudnn"]["rel_error"] <= 2e-2
        assert rows["torch-cpu"]["status"] == "not run"
    assert "| GRU 64 | bf16 | 100 | 3 |" in md


@pytest.mark.gpu
def test_real_models_and_streaming_run_end_to_end(tmp_path):
    result, md = _run(tmp_path, "real-models", "--batch", "2")
    assert [(c["model"], c["batch"]) for c in result["cases"]] == [
        ("char-RNN", 2), ("text classification", 2), ("bidirectional", 8)]
    for case in result["cases"]:
        _check_ours(compare.providers(case), 1e-5)
    streaming = result["streaming"]
    assert streaming["ours_call_ms"] > 0 and streaming["rel_error"] <= 1e-5
    assert "## Speed targets in this run" in md and "bidirectional 2-layer LSTM 256" in md


@pytest.mark.gpu
def test_scaling_sweeps_batch_and_steps(tmp_path):
    result, _ = _run(tmp_path, "scaling", "--hidden", "64", "--batch", "1", "2", "--steps", "1", "5")
    assert {(c["batch"], c["steps"]) for c in result["cases"]} == {(1, 100), (2, 100), (1, 1), (1, 5)}
    for case in result["cases"]:
        _check_ours(compare.providers(case), 1e-5)
