"""The comparison suites: their cases, tables, ratios, CSV, plots, absent and
failing providers, the ONNX Runtime peer against float64, and the speed
targets, including the published H100 table (CPU); the host-time and
torch.compile suites' cases, arguments, tables and targets (CPU); the
library's independence from the benchmarks (CPU); each suite end to end on
a small grid (GPU)."""

import ast
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from persistrnn import reference, runtime
from persistrnn.bench import compare, compiled, host, targets
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
    assert compare.main("grnn-table", ["--from-json", str(saved), "--markdown", f"{out}.md",
                                       "--csv", f"{out}.csv"]) == 0
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
    assert first["target"].startswith("first call") and first["status"] == "met"
    assert "over the 3 first calls that tuned" in first["measured"]
    assert "not measured" not in targets.format_targets([RESULT])
    assert "| not measured |" in targets.format_targets([RESULT], measured_only=False)


def test_a_tf32_run_is_judged_and_labelled_apart_from_an_exact_one():
    exact = {**RESULT, "cases": [_case("LSTM 256", "lstm", 256, 1, 0.1, 0.2, 0.5, 1.0, 4.0)]}
    tf32 = {**exact, "settings": {"matmul_precision": "high"},
            "cases": [_case("LSTM 256", "lstm", 256, 1, 0.05, 0.06, 0.5, 1.0, 4.0)]}
    rows = [r for r in targets.evaluate([exact, tf32]) if r["target"].startswith("LSTM H=256, batch 1:")]
    assert [(r["case"], r["status"]) for r in rows] == [("fp32, batch 1", "missed"),
                                                        ("fp32 (TF32 allowed), batch 1", "met")]


def test_a_miss_carries_its_cause_and_a_slow_first_call_is_a_miss():
    slow = {**RESULT, "cases": [_case("LSTM 64", "lstm", 64, 3, 0.1, 0.2, 0.5, 1.0, 4.0, first=42.0)]}
    rows = targets.evaluate([slow])
    small = next(r for r in rows if r["target"].startswith("LSTM H=64"))
    assert small["status"] == "missed" and "latency-bound" in small["cause"]
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


def _table_rows(text):
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| target |")]


def test_the_published_targets_table_is_what_the_published_results_give():
    # Every row of the published table is what the published results give
    # today, and every row they give is published.
    published = (RESULTS / "targets-h100.md").read_text()
    sources = [RESULTS / f"{name}-h100.json" for name in (*COMPARISONS, "host", "compile")]
    present = [p for p in sources if p.exists()]
    assert present == sources, f"published results missing: {sorted(set(sources) - set(present))}"
    results = [json.loads(p.read_text()) for p in sources]
    now = _table_rows(targets.format_targets(results, measured_only=False))
    then = _table_rows(published)
    assert then and sorted(now) == sorted(then)


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


# ----------------------------------------------------------------------------
# The library never imports the benchmarks
# ----------------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "persistrnn"


def _imports_bench(path):
    """Whether ``path`` imports persistrnn.bench (absolutely or relatively)."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1  # packages between persistrnn and the file
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # resolve "from ..bench import x" against the file's package
                base = ["persistrnn", *path.relative_to(PACKAGE).parts[:depth]]
                base = base[:len(base) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else [])) + "." + a.name for a in node.names]
            else:
                names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(re.match(r"persistrnn\.bench(\.|$)", n) for n in names):
            return True
    return False


def test_no_library_module_imports_the_benchmarks():
    # The command line (persistrnn/__main__.py) dispatches to the suites; nothing else may import them.
    library = [p for p in PACKAGE.rglob("*.py") if "bench" not in p.relative_to(PACKAGE).parts[:1]
               and p.name != "__main__.py"]
    assert PACKAGE / "plan" / "model.py" in library and PACKAGE / "plan" / "floors.py" in library
    assert [str(p.relative_to(PACKAGE)) for p in library if _imports_bench(p)] == []
    assert _imports_bench(PACKAGE / "bench" / "host.py")  # "from . import compare" is resolved, and caught


def test_importing_and_building_a_module_loads_no_benchmark():
    code = ("import persistrnn, sys; persistrnn.LSTM(8, 8); import persistrnn.plan.model, persistrnn.plan.floors; "
            "bad = [m for m in sys.modules if m.startswith('persistrnn.bench')]; assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_suites_time_with_the_librarys_timing_and_floors():
    from persistrnn.bench import sync, timing
    from persistrnn.plan import floors

    assert timing.time_cuda_ms is runtime.time_cuda_ms and timing.per_iteration_us is runtime.per_iteration_us
    for name in ("Runner", "SyncConfig", "grid_barriers", "grid_exchange", "cluster_exchanges", "sync_binary",
                 "exchange_shared_bytes", "expected_state", "BLOCK", "STATE_SIZES", "EXCHANGE_BLOCKS"):
        assert getattr(sync, name) is getattr(floors, name), name


def _kernel_params(source):
    """{kernel: [parameter declarations]} of every extern "C" kernel in ``source``."""
    found = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source)
    return {name: [" ".join(p.split()) for p in params.split(",") if p.strip()] for name, params in found}


def test_the_sync_kernels_that_wait_take_report_and_bound_after_status():
    # floors passes Runner.watch() (status, report, timeout) as the last three
    # arguments of every sync kernel that takes a status word.
    params = _kernel_params(runtime.read_source("sync_bench.cu"))
    waiting = {k: p for k, p in params.items() if "int* status" in p}
    assert set(waiting) >= {"grid_barrier_counter", "grid_exchange", "cluster_exchange_stasync"}
    for kernel, p in waiting.items():
        assert p[-3:] == ["int* status", "int* report", "unsigned long long timeout_ns"], (kernel, p)


def test_the_watch_arguments_are_a_pointer_a_null_report_and_a_64_bit_bound():
    import numpy as np
    import torch

    from persistrnn.plan import floors

    r = floors.Runner.__new__(floors.Runner)  # no GPU: only the status word is needed
    r.status = torch.zeros(1, dtype=torch.int32)
    args = runtime.kernel_args(*r.watch())
    assert [type(a) for a in args] == [np.uint64] * 3  # 8 bytes each, as the kernel's int*, int*, u64
    assert [int(a) for a in args] == [r.status.data_ptr(), 0, runtime.wait_timeout_ns()]


# ----------------------------------------------------------------------------
# Host time per call
# ----------------------------------------------------------------------------

def test_host_suite_is_registered_and_runs_every_grnn_table_and_real_models_case():
    assert SUITES["host"] == "persistrnn.bench.host" and SUITES["compile"] == "persistrnn.bench.compiled"
    every = host.cases()
    assert every == compare.suite_cases("grnn-table") + compare.suite_cases("real-models")
    assert len(every) == len(set(every)) == 27 + 11


def test_one_set_of_axes_narrows_each_suite_that_takes_it():
    cases = host.cases(hidden=(64,), batch=(1,), cells=None)
    assert [(c.model, c.batch) for c in cases] == [
        ("LSTM 64", 1), ("GRU 64", 1), ("GRU (reset-before) 64", 1),
        ("char-RNN", 1), ("text classification", 1), ("bidirectional", 8)]
    assert host.cases(("real-models",), hidden=(64,)) == compare.suite_cases("real-models")
    assert compare.suite_cases("real-models", batch=[2], hidden=[64], steps=None) == \
        compare.SUITES["real-models"].build(batch=(2,))


def test_host_arguments(capsys):
    args, _ = host.parse(["--suites", "grnn-table", "--hidden", "64", "--batch", "1", "3", "--host-calls", "10"])
    assert (args.suites, args.hidden, args.batch, args.host_calls, args.calls) == (["grnn-table"], [64], [1, 3], 10, 20)
    assert (args.refcheck, args.progress, args.steps) == (True, True, None)
    for bad, message in ((["--repeats", "4"], "at least 5"),
                         (["--host-calls", "0"], "--host-calls: expected a positive"),
                         (["--batch", "0"], "expected positive integers, got [0]"),
                         (["--suites", "scaling"], "invalid choice: 'scaling'"),
                         (["--dtypes", "float16"], "unrecognized arguments: --dtypes")):
        with pytest.raises(SystemExit):
            host.parse(bad)
        assert message in capsys.readouterr().err, bad


def _host_case(model, cell, hidden, batch, eager, graph, host_us, torch_eager, *, layers=1, steps=100,
               plan="persistent", status="ok"):
    case = Case(model, cell, hidden, hidden, layers, False, "float32", steps, batch)
    ours = host.HostRow("persistrnn", ms=eager, graph_ms=graph, host_us=host_us, rel_error=2e-7, plan=plan)
    if status != "ok":
        ours = Row("persistrnn", status, note="KernelLaunchError: no room")
    theirs = (host.HostRow("cudnn", ms=torch_eager, graph_ms=torch_eager / 2, rel_error=1e-3) if torch_eager
              else host.HostRow("cudnn", "no peer", note="torch has no GRU (reset-before)"))
    return {**case.__dict__, "rows": [ours.__dict__, theirs.__dict__]}


HOST_RESULT = {"suite": "host", "environment": ENV, "settings": host.Settings().__dict__, "cases": [
    _host_case("LSTM 256", "lstm", 256, 1, 0.120, 0.106, 40.0, 1.2),  # both met
    _host_case("LSTM 64", "lstm", 64, 1, 0.090, 0.056, 80.0, 0.135),  # 34 µs over: missed; faster than torch
    _host_case("GRU (reset-before) 64", "gru_reset_before", 64, 1, 0.1, 0.09, 60.0, None),  # no torch peer
    _host_case("text classification", "lstm", 256, 10, 0.30, 0.29, 45.0, 0.28, layers=2, steps=20),
    _host_case("GRU 1024", "gru", 1024, 20, None, None, None, 1.6, status="failed"),
]}


def test_host_targets_are_judged_per_case_from_the_json():
    overhead, versus_torch = host.host_targets()
    cases = HOST_RESULT["cases"]
    assert targets.judge(overhead, cases[0]) == (
        "met", "eager 0.120 ms vs graph 0.106 ms: 1.13×, +14 µs (plan: persistent)")
    assert targets.judge(overhead, cases[1])[0] == "missed" and "+34 µs" in targets.judge(overhead, cases[1])[1]
    assert targets.judge(versus_torch, cases[1])[0] == "met"
    assert targets._applies(overhead, cases[2]) and not targets._applies(versus_torch, cases[2])
    assert targets.judge(versus_torch, cases[3]) == (
        "missed", "eager 0.300 ms vs cuDNN eager 0.280 ms: 1.07×, +20 µs (plan: persistent)")
    assert targets.judge(overhead, cases[4]) == ("missed", "persistrnn failed: KernelLaunchError: no room")
    rows = [r for r in targets.evaluate([HOST_RESULT]) if r["source"] == "host"]
    assert [(r["case"], r["status"]) for r in rows] == [
        ("LSTM 256, T=100, fp32, batch 1", "met"), ("LSTM 64, T=100, fp32, batch 1", "missed"),
        ("GRU (reset-before) 64, T=100, fp32, batch 1", "met"), ("text classification, T=20, fp32, batch 10", "met"),
        ("GRU 1024, T=100, fp32, batch 20", "missed"),
        ("LSTM 256, T=100, fp32, batch 1", "met"), ("LSTM 64, T=100, fp32, batch 1", "met"),
        ("text classification, T=20, fp32, batch 10", "missed"), ("GRU 1024, T=100, fp32, batch 20", "missed")]
    # the comparison suites' targets are theirs alone: a host run judges none of them, and has no first calls
    assert not any(r["source"] == "host" for r in targets.evaluate([HOST_RESULT])
                   if r["issue"] != targets.RUNTIME)


def test_a_host_run_judges_its_cases_before_a_comparison_run_of_the_same_cases():
    same = _case("LSTM 256", "lstm", 256, 1, 0.106, 0.5, 0.5, 1.0, 4.0)  # eager 0.5 ms in that run: missed
    overhead = [r for r in targets.evaluate([RESULT, HOST_RESULT]) if r["target"] == host.host_targets()[0].text]
    lstm = [r for r in overhead if r["case"] == "LSTM 256, T=100, fp32, batch 1"]
    assert [(r["status"], r["source"]) for r in lstm] == [("met", "host")]
    alone = [r for r in targets.evaluate([{**RESULT, "cases": [same]}]) if r["target"] == host.host_targets()[0].text]
    assert [(r["status"], r["source"]) for r in alone] == [("missed", "grnn-table")]


def test_host_table_gives_times_gap_bound_and_verdicts():
    table = host.format_table(HOST_RESULT)
    assert _line(table, "| LSTM 256 |") == ["LSTM 256", "fp32", "100", "1", "persistent", "0.120", "0.106", "40.0",
                                            "+14.0", "device", "1.200", "met", "met", "2.0e-07"]
    lstm64 = _line(table, "| LSTM 64 |")
    assert lstm64[8:13] == ["+34.0", "host", "0.135", "missed", "met"]  # 80 µs of host time > 56 µs of device time
    assert _line(table, "| GRU (reset-before) 64 |")[10:13] == ["no peer", "met", "—"]
    assert "failed: KernelLaunchError: no room" in _line(table, "| GRU 1024 |")[4]


def test_host_json_is_written_again_without_a_gpu(tmp_path, capsys):
    saved = tmp_path / "host.json"
    saved.write_text(json.dumps(HOST_RESULT))
    assert host.main(["--from-json", str(saved), "--markdown", str(tmp_path / "host.md")]) == 0
    md = (tmp_path / "host.md").read_text()
    assert md.startswith("# Host time per call") and "Test GPU" in md and "commit abc" in md
    assert "perf_counter over 50 eager calls" in md and "## Speed targets in this run" in md
    assert "| LSTM 64 | fp32 | 100 | 1 | persistent | 0.090 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        host.main(["--from-json", str(RESULTS / "grnn-table-h100.json")])
    assert "expected a host result, got 'grnn-table'" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------

def test_compile_cases_and_arguments(capsys):
    assert compiled.CASES["lstm-2x128-b1"] == Case("2-layer LSTM 128", "lstm", 128, 128, 2, False, "float32", 50, 1)
    assert {(c.batch, c.cell, c.steps) for c in compiled.CASES.values()} == {(1, "lstm", 50), (8, "lstm", 50),
                                                                            (1, "gru", 100)}
    args, _ = compiled.parse([])
    assert (args.cases, args.torch_compile, args.calls, args.repeats) == (list(compiled.CASES), True, 20, 5)
    args, _ = compiled.parse(["--cases", "gru-256-b1", "--no-torch-compile"])
    assert (args.cases, args.torch_compile) == (["gru-256-b1"], False)
    for bad, message in ((["--cases", "lstm-9"], "invalid choice: 'lstm-9'"), (["--repeats", "1"], "at least 5"),
                         (["--calls", "0"], "--calls: expected a positive")):
        with pytest.raises(SystemExit):
            compiled.parse(bad)
        assert message in capsys.readouterr().err, bad


def _compile_case(key, eager, default, reduce_overhead, torch_eager, torch_compiled, *, failed=None):
    rows = [compiled.CompileRow(compiled.EAGER, ms=eager, rel_error=3e-7, plan="persistent", host_us=31.4),
            compiled.CompileRow(compiled.COMPILED, ms=default, rel_error=3e-7, first_call_s=4.0, host_us=118.6),
            Row(compiled.REDUCE_OVERHEAD, ms=reduce_overhead, rel_error=3e-7, first_call_s=6.0),
            Row(compiled.TORCH, ms=torch_eager, rel_error=1e-3),
            Row(compiled.TORCH_COMPILED, ms=torch_compiled, rel_error=1e-6, note="2 graph break(s)"),
            compiled.CompileRow(compiled.COMPILE_FLOOR, host_us=63.2)]
    if failed:
        rows[1] = Row(compiled.COMPILED, "failed", rel_error=1.3, first_call_s=4.0,
                      note="output differs from float64 (rel. error 1.3e+00): not timed")
    return {"key": key, **compiled.CASES[key].__dict__, "rows": [r.__dict__ for r in rows]}


COMPILE_RESULT = {"suite": "compile", "environment": ENV, "settings": compiled.Settings().__dict__, "cases": [
    _compile_case("lstm-2x128-b1", 0.093, 0.100, 0.060, 0.28, 0.2),   # 1.08x eager, below torch: met
    _compile_case("lstm-2x128-b8", 0.10, 0.46, 0.07, 0.28, 0.2),      # 4.6x eager and slower than torch: missed
    _compile_case("gru-256-b1", 0.10, None, 0.07, 0.3, 0.25, failed=True),
]}


def test_compile_target_is_judged_from_the_json():
    rows = [r for r in targets.evaluate([COMPILE_RESULT]) if r["source"] == "compile"]
    assert [(r["case"], r["status"]) for r in rows] == [
        ("2-layer LSTM 128, T=50, fp32, batch 1", "met"), ("2-layer LSTM 128, T=50, fp32, batch 8", "missed"),
        ("GRU 256, T=100, fp32, batch 1", "missed")]
    assert rows[0]["measured"] == ("compiled 0.100 ms vs eager 0.093 ms: 1.08×, +7 µs; compiled 0.100 ms vs "
                                   "torch.nn eager 0.280 ms: 0.36×, -180 µs (plan: persistent)")
    assert rows[2]["measured"].startswith("persistrnn compiled failed: output differs from float64")
    slower_than_torch = _compile_case("lstm-2x128-b1", 0.30, 0.31, 0.2, 0.28, 0.2)  # 1.03x eager, above torch
    target = next(t for t in targets.TARGETS if "compile" in t.suites)
    assert targets.judge(target, slower_than_torch)[0] == "missed"


def test_compile_table_gives_ratios_to_eager(tmp_path, capsys):
    table = compiled.format_table(COMPILE_RESULT)
    first = _line(table, "| 2-layer LSTM 128 | 50 | 1 |")
    assert first[3:] == ["persistent", "0.0930", "0.1000", "1.08×", "0.0600", "0.65×", "0.2800", "0.2000", "0.36×",
                         "1.0e-03", "4.0 / 6.0", "31 / 119 / 63"]
    gru = _line(table, "| GRU 256 |")
    assert gru[5:7] == ["failed", "—"] and gru[10:12] == ["0.2500", "—"]
    assert gru[-1] == "31 / — / 63"  # a failed variant has no host time
    assert "persistrnn compiled: failed (output differs from float64" in table
    assert "torch.nn compiled: ok (2 graph break(s))" in table
    saved = tmp_path / "compile.json"
    saved.write_text(json.dumps(COMPILE_RESULT))
    assert compiled.main(["--from-json", str(saved), "--markdown", str(tmp_path / "c.md")]) == 0
    md = (tmp_path / "c.md").read_text()
    assert md.startswith("# torch.compile") and "allow_rnn" in md and "**met**" in md
    assert "Host µs per call: 100 calls back to back" in md


def test_targets_cli_judges_host_and_compile_runs_beside_the_comparisons(tmp_path, capsys):
    paths = []
    for name, result in (("grnn", RESULT), ("host", HOST_RESULT), ("compile", COMPILE_RESULT)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    assert targets.main([str(p) for p in paths] + ["--markdown", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out
    assert "| torch.compile (default mode): ≤ 1.1× the eager persistrnn module" in out
    assert "| 2-layer LSTM 128, T=50, fp32, batch 1 |" in out and "| LSTM 64, T=100, fp32, batch 1 |" in out
    first = next(line for line in out.splitlines() if line.startswith("| first call"))
    assert first.endswith("| grnn-table |")  # the host and compile runs have no first calls of their own
    assert "`compile.json` (compile)" in (tmp_path / "t.md").read_text()


# ----------------------------------------------------------------------------
# On the GPU: the host-time and torch.compile suites end to end, one small case each
# ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_host_suite_runs_a_small_case_end_to_end(tmp_path):
    out = tmp_path / "host"
    assert host.main(["--suites", "grnn-table", "--cells", "lstm", "gru_reset_before", "--hidden", "64", "--batch",
                      "3", "--steps", "7", "--host-calls", "10", "--no-progress", "--json", f"{out}.json",
                      "--markdown", f"{out}.md"]) == 0
    result = json.loads(Path(f"{out}.json").read_text())
    assert [c["cell"] for c in result["cases"]] == ["lstm", "gru_reset_before"]
    for case in result["cases"]:
        rows = compare.providers(case)
        ours = rows["persistrnn"]
        assert ours["status"] == "ok" and ours["host_us"] > 0 and ours["ms"] > 0 and ours["graph_ms"] > 0
        if ours["plan"] != "cudnn":  # cuDNN's own numbers may carry TF32's error
            assert ours["rel_error"] <= 1e-5
        assert (rows["cudnn"]["status"] == "ok") == (case["cell"] == "lstm")
    assert "| LSTM 64 | fp32 | 7 | 3 |" in Path(f"{out}.md").read_text()


@pytest.mark.gpu
def test_compile_suite_runs_the_issue_case_end_to_end(tmp_path):
    out = tmp_path / "compile"
    assert compiled.main(["--cases", "lstm-2x128-b1", "--no-torch-compile", "--calls", "5", "--no-progress",
                          "--json", f"{out}.json", "--markdown", f"{out}.md"]) == 0
    (case,) = json.loads(Path(f"{out}.json").read_text())["cases"]
    rows = compare.providers(case)
    for provider in (compiled.EAGER, compiled.COMPILED, compiled.REDUCE_OVERHEAD, compiled.TORCH):
        assert rows[provider]["status"] == "ok" and rows[provider]["ms"] > 0, rows[provider]
        assert rows[provider]["rel_error"] <= compiled.CHECK_TOLERANCE
    assert rows[compiled.TORCH_COMPILED]["status"] == "not run"
    for provider in (*compiled.HOST_TIMED, compiled.COMPILE_FLOOR):
        assert rows[provider]["status"] == "ok" and rows[provider]["host_us"] > 0, rows[provider]
    assert "torch.compile (default mode)" in Path(f"{out}.md").read_text()


# ---- planner regret ------------------------------------------------------------


def _regret_case(model, regret, plan="persistent clusterx8 t256 g8 bt1 sk0 ffma"):
    return {"model": model, "cell": "lstm", "hidden": 256, "layers": 1, "bidirectional": False, "dtype": "float32",
            "steps": 100, "batch": 10, "plan": plan, "plan_source": "tuned", "chosen_ms": 0.2 * regret,
            "best": "cudnn", "best_ms": 0.2, "regret": regret, "measured_ms": {}}


def test_planner_regret_summary_judges_mean_and_worst():
    from persistrnn.bench import planner_regret

    good = [_regret_case("a", 1.0), _regret_case("b", 1.05)]
    assert planner_regret.summary(good) == {"cases": 2, "mean_regret": pytest.approx(1.025),
                                            "worst_regret": 1.05, "met": True}
    assert not planner_regret.summary(good + [_regret_case("c", 1.2)])["met"]  # worst over 1.10
    assert not planner_regret.summary([_regret_case("d", 1.04)] * 3)["met"]  # mean over 1.03
    untimed = dict(_regret_case("e", 1.0), regret=None)  # the chosen plan could not launch: never "met"
    assert not planner_regret.summary(good + [untimed])["met"]


def test_planner_regret_markdown_lists_every_case_and_the_verdict():
    from persistrnn.bench import planner_regret

    result = {"environment": ENV, "k": 5, "cases": [_regret_case("LSTM 256", 1.0), _regret_case("LSTM 64", 1.25)]}
    result["summary"] = planner_regret.summary(result["cases"])
    text = planner_regret.markdown(result)
    assert "| LSTM 64 | fp32 | 100 | 10 |" in text and "| 1.250 |" in text
    assert "Mean regret 1.125, worst 1.250 over 2 cases" in text and "**missed**" in text
    assert ENV["commit"] in text


def test_planner_regret_is_registered():
    from persistrnn.bench import __main__ as bench

    assert bench.SUITES["planner-regret"] == "persistrnn.bench.planner_regret"


def test_training_step_markdown_gives_times_ratio_flops_memory_and_errors(tmp_path, capsys):
    from persistrnn.bench import __main__ as bench, training

    assert bench.SUITES["training"] == "persistrnn.bench.training"
    row = {"hidden": 256, "batch": 8, "steps": 100, "ours_ms": 0.5, "cudnn_ms": 1.5, "cudnn_exact_ms": 2.0,
           "speedup": 3.0, "ours_grad_error": 2e-7, "cudnn_grad_error": 4e-4, "cudnn_exact_grad_error": 3e-7}
    packed = {**row, "inputs": "packed", "runs": "cuDNN", "ours_ms": 0.75, "speedup": 2.0}
    del packed["cudnn_grad_error"]  # a run from before the TF32 error was kept
    relu = {**row, "cell": "rnn_relu", "dtype": "bfloat16", "hidden": 1152, "batch": 4, "ours_ms": 0.4,
            "cudnn_ms": 2.0}
    memory = {"cell": "rnn_relu", "hidden": 1152, "steps": 1000, "batch": 4, "ours_bytes": 40 * 2**20,
              "ours_graph_bytes": 40 * 2**20, "cudnn_bytes": 90 * 2**20, "cudnn_exact_bytes": 80 * 2**20}
    result = {"environment": ENV, "calls": 10, "repeats": 5, "rows": [row, packed, relu], "memory": [memory]}
    text = training.markdown(result)
    # LSTM: 6 * 4 gates * 256 * (256 + 256) * 100 steps * 8 = 2.517e9 FLOP: 5.03 TFLOP/s in 0.5 ms, 1.68 in 1.5
    assert "| lstm | fp32 | padded | 256 | 8 | persistrnn | 0.500 | 1.500 / 2.000 | 3.00× | 5.03 / 1.68 |" in text
    assert "| lstm | fp32 | packed | 256 | 8 | cuDNN | 0.750 | 1.500 / 2.000 | 2.00× | 3.36 / 1.68 |" in text
    # ReLU RNN 1152 (one gate): 6 * 1152 * 2304 * 100 * 4 = 6.37e9 FLOP: 15.93 TFLOP/s in 0.4 ms; cuDNN's faster 2.0
    assert "| rnn_relu | bf16 | padded | 1152 | 4 | persistrnn | 0.400 | 2.000 / 2.000 | 3.00× | 15.93 / 3.19 |" in text
    assert ("| rnn_relu | fp32 | 1152 | 1000 | 4 | persistrnn | 40.0 | 40.0 | 80.0 | 90.0 / 80.0 | 2.00× / 1.00× |"
            in text)
    assert ENV["commit"] in text and "LSTM, RNN (relu)" in text
    assert "| 2.0e-07 | 4.0e-04 / 3.0e-07 |" in text and "| 2.0e-07 | — / 3.0e-07 |" in text
    assert "matmul precision" not in text
    assert "fp32 matmul precision: 'high'" in training.markdown({**result, "settings": {"matmul_precision": "high"}})
    saved = tmp_path / "training.json"
    saved.write_text(json.dumps(result))
    assert training.main(["--from-json", str(saved), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0 and "5.03 / 1.68" in capsys.readouterr().out


# ---- bench charlm ----------------------------------------------------------

def _ptb_folder(tmp_path):
    """A small PTB-like pair of texts in the data sets' layout."""
    words = ["the", "market", "fell", "<unk>", "N", "shares", "rose", "in", "trading", "'s"]
    gen = __import__("random").Random(3)
    for name, lines in (("dev.txt", 60), ("test.txt", 30)):
        text = "".join(" " + " ".join(gen.choice(words) for _ in range(gen.randint(3, 12))) + " \n"
                       for _ in range(lines))
        (tmp_path / "ptb").mkdir(exist_ok=True)
        (tmp_path / "ptb" / name).write_text(text)
    return tmp_path


def test_charlm_data_is_every_character_in_contiguous_streams():
    import torch

    from persistrnn.bench import charlm

    vocab = charlm.vocabulary("ab c\n", "cd")
    assert list(vocab) == sorted(set("ab c\ncd"))
    ids = charlm.encode("abcd cab\n", vocab)
    assert [list(vocab)[i] for i in ids.tolist()] == list("abcd cab\n")
    data = charlm.streams(torch.arange(11), 2)  # 5 characters per stream; the 11th is dropped
    assert data.shape == (5, 2) and data[:, 1].tolist() == [5, 6, 7, 8, 9]
    # every window's targets are its inputs one character later, and the last target is the last character
    assert charlm.windows(data, 2) == [(0, 2), (2, 2)]
    assert charlm.windows(torch.arange(7).view(7, 1), 3) == [(0, 3), (3, 3)]
    with pytest.raises(ValueError, match="at least 8 characters for batch 4, got 5"):
        charlm.streams(torch.arange(5), 4)


def test_charlm_refuses_a_missing_text_naming_the_path(tmp_path):
    from persistrnn.bench import charlm

    with pytest.raises(ValueError, match="could not read .*nothing.txt"):
        charlm.read_text(tmp_path / "nothing.txt")


def test_charlm_trains_both_models_from_one_initialisation_and_writes_its_outputs(tmp_path, capsys):
    """On the CPU both modules run torch's implementation: the two runs must
    then give the same losses step by step (one initialisation, one data
    order), the float64 run stays within rounding of them, and the losses fall."""
    from persistrnn.bench import charlm

    data = _ptb_folder(tmp_path)
    out = tmp_path / "out"
    args = ["--device", "cpu", "--hidden", "24", "--embedding", "8", "--batch", "4", "--steps", "12",
            "--train-steps", "40", "--compare-steps", "10", "--log-every", "10", "--validate-every", "20",
            "--valid-batch", "2", "--valid-chars", "400", "--learning-rate", "0.01", "--data", str(data),
            "--out", str(out), "--no-progress"]
    assert charlm.main(args) == 0
    result = json.loads((out / "charlm.json").read_text())
    ours, theirs = result["persistrnn"], result["torch.nn"]
    assert len(ours["loss"]) == len(theirs["loss"]) == 40 and len(result["float64_loss"]) == 10
    assert ours["loss"] == theirs["loss"]
    a = charlm.agreement(result)
    assert a["persistrnn_vs_peer"] == 0 and 0 < a["peer_vs_float64"] < 1e-4
    assert [s for s, _ in ours["valid_bpc"]] == [0, 20, 40]
    assert ours["valid_bpc"][-1][1] < ours["valid_bpc"][0][1]  # it learns
    assert len(ours["window_ms"]) == 4 and ours["tokens_per_s"] > 0
    assert result["persistrnn_runs"] == "torch's implementation (a CPU input)"
    text = (out / "charlm.md").read_text()
    assert "agree to fp32 rounding" in text and "| persistrnn |" in text and "loss falls" in text
    # written again from its json, without running
    assert charlm.main(["--from-json", str(out / "charlm.json")]) == 0
    assert "| torch.nn |" in capsys.readouterr().out


# ---- bench sst ---------------------------------------------------------------

def _sst_folder(tmp_path, train=40, dev=12):
    """The test copy of SST dev trees split into a train and a dev file, in the data sets' layout."""
    lines = (Path(__file__).parent / "data" / "sst-dev.txt").read_text().splitlines()[:train + dev]
    (tmp_path / "sst").mkdir()
    (tmp_path / "sst" / "train.txt").write_text("\n".join(lines[:train]) + "\n")
    (tmp_path / "sst" / "dev.txt").write_text("\n".join(lines[train:]) + "\n")
    return tmp_path


def test_sst_epochs_visit_every_tree_once_in_a_fixed_order_per_epoch():
    from persistrnn.bench import sst

    first, again, second = (sst.epoch_batches(23, 5, e, 7) for e in (0, 0, 1))
    assert first == again and first != second
    assert [len(b) for b in first] == [5, 5, 5, 5, 3]
    assert sorted(i for b in first for i in b) == list(range(23))


def test_sst_evaluation_scores_each_trees_root_and_every_node():
    """The batched evaluation against one tree at a time (the root's row of a
    one-tree plan) and against the eager one-node-at-a-time loss."""
    import torch

    from persistrnn import dynamic
    from persistrnn.bench import sst
    from persistrnn.bench.treelstm import TorchTreeLSTM

    trees = dynamic.read_sst(Path(__file__).parent / "data" / "sst-dev.txt", limit=9)
    vocab = dynamic.Vocabulary(w for t in trees for w in t.words())
    model = dynamic.Model(3)
    builder = dynamic.TreeLSTM(model, len(vocab), 10, 12)
    peer = TorchTreeLSTM(model, builder, vocab, torch.device("cpu"))
    got = sst.evaluate(peer, trees, chunk=4)  # chunks of 4, 4 and 1 trees
    hits = 0
    for t in trees:
        plan = peer.plan([t])
        root = peer.logits(plan).detach()[plan["roots"]][0]
        assert plan["labels"][plan["roots"]].item() == t.label
        hits += int(root.argmax()) == t.label
    nodes = sum(len(t.nodes()) for t in trees)
    assert got["root_accuracy"] == hits / len(trees)
    assert got["loss_per_node"] == pytest.approx(float(peer.eager_loss(trees).detach()) / nodes, rel=1e-5)
    assert 0 <= got["node_accuracy"] <= 1


def test_sst_markdown_and_plot_from_a_run(tmp_path, capsys):
    from persistrnn.bench import sst

    dev = {"root_accuracy": 0.25, "node_accuracy": 0.6, "loss_per_node": 1.2}
    result = {"suite": "sst", "environment": ENV, "settings": {**sst.Settings().__dict__, "epochs": 1},
              "jit_s": 0.2, "blocks": 132, "train_trees": 4, "dev_trees": 2, "vocabulary": 30,
              "nodes_per_step": [10, 12], "initial_dev": {**dev, "root_accuracy": 0.2},
              "epochs": [{"epoch": 1, "steps": 2, "persistrnn_sent_s": 900.0, "pytorch_sent_s": 300.0,
                          "persistrnn_dev": dev, "pytorch_dev": {**dev, "root_accuracy": 0.3}}],
              "loss": {"persistrnn": [20.0, 18.0], "pytorch": [20.0, 18.0000001]}, "float64_loss": [20.0, 18.0]}
    text = sst.markdown(result)
    assert "| 1 | 900 | 300 | 3.00× | 0.250 / 0.300 | 0.600 / 0.600 | 1.2000 / 1.2000 |" in text
    assert "follow PyTorch's to fp32 rounding" in text and ENV["commit"] in text
    saved = tmp_path / "sst.json"
    saved.write_text(json.dumps(result))
    assert sst.main(["--from-json", str(saved), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "sst.png").stat().st_size > 0 and "| 1 | 900 |" in capsys.readouterr().out


@pytest.mark.gpu
def test_sst_trains_with_the_interpreter_and_pytorch_along_one_curve(tmp_path):
    from persistrnn.bench import sst

    s = sst.Settings(hidden=32, embedding=16, batch=8, epochs=2, compare_steps=6)
    result = sst.run(s, _sst_folder(tmp_path), progress=False)
    a = sst.agreement(result)
    assert a["steps"] == 6 and a["persistrnn_vs_float64"] <= max(2 * a["peer_vs_float64"], 1e-5), a
    assert len(result["loss"]["persistrnn"]) == len(result["loss"]["pytorch"]) == 10  # 2 epochs of 5 batches
    for r in result["epochs"]:
        assert r["persistrnn_sent_s"] > 0 and 0 <= r["persistrnn_dev"]["root_accuracy"] <= 1
        assert r["persistrnn_dev"]["loss_per_node"] == pytest.approx(r["pytorch_dev"]["loss_per_node"], rel=1e-3)


def test_a_run_names_its_commit_and_marks_files_that_differ_from_it(tmp_path, monkeypatch):
    import subprocess

    from persistrnn.bench.environment import commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.cu").write_text("// one\n")
    git("add", "kernel.cu")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    monkeypatch.delenv("PERSISTRNN_COMMIT", raising=False)
    assert commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("// two: the copy's files are newer than its .git\n")
    assert commit(tmp_path) == f"{head} with uncommitted changes"
    monkeypatch.setenv("PERSISTRNN_COMMIT", "abc123")
    assert commit(tmp_path) == "abc123"


def test_training_timings_interleave_the_sides_round_by_round(monkeypatch):
    # Each round times every side in turn, inside its own settings, so that
    # the host's swings fall on every side alike; the medians come back by name.
    import contextlib

    import torch

    from persistrnn.bench import training

    order, clock = [], iter(range(1, 1000))

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def settings(name):
        @contextlib.contextmanager
        def entered():
            order.append(f"enter {name}")
            yield
        return entered

    runs = {name: (lambda name=name: order.append(name), settings(name)) for name in ("ours", "cudnn")}
    got = training._time_interleaved(runs, calls=2, repeats=3)
    assert order == ["enter ours", "ours", "ours", "enter cudnn", "cudnn", "cudnn"] * 3
    assert got == {"ours": 0.5, "cudnn": 0.5}  # one clock tick between the events, over 2 calls


def test_a_queued_timing_doubles_the_sleep_until_the_call_is_issued_behind_it(monkeypatch):
    # Fakes of torch.cuda's sleep, events and synchronize: the host issues a call in 1.2 "sleep units" of
    # 2**20 cycles; a repeat counts only where the timed region had not begun when the call returned, and
    # the sleep doubles until it has not. A host that never gets there is refused, not waited for.
    import torch

    from persistrnn.errors import ArgumentError
    from persistrnn.runtime import timing as runtime_timing

    issue_cycles, slept, taken = [1.2 * runtime_timing.QUEUE_SLEEP_CYCLES], [], []

    class Event:
        def __init__(self, enable_timing):
            self.sleep = None

        def record(self):
            self.sleep = slept[-1]

        def query(self):
            return self.sleep <= issue_cycles[0]  # reached: the sleep ended before the call was issued

        def elapsed_time(self, end):
            return 0.25

    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert runtime_timing.time_cuda_ms(lambda: taken.append(1), warmup=1, repeats=3, queued=True) == 0.25
    assert slept == [runtime_timing.QUEUE_SLEEP_CYCLES] + [2 * runtime_timing.QUEUE_SLEEP_CYCLES] * 3
    assert len(taken) == 1 + 4  # the warm-up, one refused repeat and three timed
    issue_cycles[0] = float("inf")
    slept.clear()
    with pytest.raises(ArgumentError, match="longer to issue one call than a GPU sleep"):
        runtime_timing.time_cuda_ms(lambda: None, warmup=0, repeats=1, queued=True)
    assert len(slept) == runtime_timing.QUEUE_SLEEP_DOUBLINGS + 1


@pytest.mark.gpu
def test_a_queued_timing_leaves_out_the_hosts_time_to_issue():
    # Five tiny kernels with 2 ms of host time between them: events around them see the host's ~10 ms;
    # issued behind a GPU sleep they see the kernels' microseconds.
    import time

    import torch

    x = torch.ones(1024, device="cuda")

    def slow_host():
        for _ in range(5):
            x.add_(1)
            time.sleep(0.002)

    assert runtime.time_cuda_ms(slow_host, repeats=3) >= 8.0
    assert runtime.time_cuda_ms(slow_host, repeats=3, queued=True) < 1.0
