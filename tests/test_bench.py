"""The benchmark suites' harness: tables, ratios, CSV, absent and failing
providers (CPU); the grnn-table suite end to end on a small grid (GPU)."""

import csv
import io
import json

import pytest

from persistrnn.bench import grnn_table
from persistrnn.bench.__main__ import SUITES
from persistrnn.bench.grnn_table import Row


def _case(cell, hidden, batch, ours_graph, ours_eager, cudnn_graph, cudnn_eager, cpu, ours_status="ok"):
    def scaled(v, k):
        return None if v is None else v * k

    rows = [
        Row("persistrnn", ours_status, ours_eager, ours_graph, scaled(ours_eager, 2), 3e-7,
            "plan persistent; first call 2.0 s"),
        Row("cudnn (TF32 allowed)", ms=cudnn_eager, graph_ms=cudnn_graph),
        Row("cudnn (TF32 off)", ms=scaled(cudnn_eager, 1.5), graph_ms=scaled(cudnn_graph, 1.5)),
        Row("torch-cpu", ms=cpu, note="16 threads"),
        Row("onnxruntime-cpu", "absent", note="onnxruntime is not installed"),
        Row("flashrnn", "failed", note="RuntimeError: does not build"),
    ]
    if ours_status != "ok":
        rows[0] = Row("persistrnn", "failed", note="KernelLaunchError: no room")
    return {"cell": cell, "hidden": hidden, "batch": batch, "steps": 100, "rows": [r.__dict__ for r in rows]}


RESULT = {"environment": {}, "config": {}, "cases": [
    _case("lstm", 256, 1, 0.1, 0.2, 0.5, 1.0, 4.0),
    _case("gru", 64, 10, 0.2, 0.3, 0.1, 0.9, 1.2),
    _case("gru_reset_before", 1024, 20, None, None, None, None, 9.0, ours_status="failed"),
]}


def test_suite_is_registered():
    assert SUITES["grnn-table"] == "persistrnn.bench.grnn_table"


def test_table_ratios_are_peer_over_ours_with_the_best_peer_setting():
    table = grnn_table.format_table(RESULT)
    lstm = next(line for line in table.splitlines() if line.startswith("| LSTM"))
    cells = [c.strip() for c in lstm.split("|")[1:-1]]
    assert cells[:5] == ["LSTM", "256", "1", "0.100", "0.200"]
    # the faster cuDNN setting (TF32 allowed here) is the peer: 0.5 / 0.1 and 1.0 / 0.2; the CPU 4.0 / 0.2
    assert cells[8:11] == ["5.00×", "5.00×", "20.00×"]
    gru = next(line for line in table.splitlines() if line.startswith("| GRU |"))
    assert "0.50×" in gru  # ours slower than cuDNN graph: a ratio below 1, not hidden


def test_absent_failed_and_peerless_providers_are_named_not_dropped():
    table = grnn_table.format_table(RESULT)
    assert "failed: KernelLaunchError: no room" in table
    assert "onnxruntime-cpu: absent (onnxruntime is not installed)" in table
    assert "flashrnn: failed (RuntimeError: does not build)" in table


def test_csv_has_a_row_per_provider_and_case():
    rows = list(csv.DictReader(io.StringIO(grnn_table.to_csv(RESULT))))
    assert len(rows) == 3 * 6
    assert {r["provider"] for r in rows} >= {"persistrnn", "cudnn (TF32 off)", "torch-cpu", "flashrnn"}
    first = rows[0]
    assert (first["cell"], first["hidden"], first["graph_ms"], first["status"]) == ("lstm", "256", "0.1", "ok")


def test_a_failing_provider_becomes_a_failed_row():
    def broken():
        raise RuntimeError("cuDNN said no\nsecond line")

    row = grnn_table._guard("cudnn (TF32 off)", broken)
    assert (row.provider, row.status, row.note) == ("cudnn (TF32 off)", "failed", "RuntimeError: cuDNN said no")


def test_an_uninstalled_peer_is_reported_absent():
    row = grnn_table._optional_provider("surely_not_an_installed_module", "peer")
    assert (row.status, row.ms) == ("absent", None) and "not installed" in row.note


def test_an_installed_peer_the_suite_does_not_drive_is_reported_not_run():
    row = grnn_table._optional_provider("json", "json-peer")  # installed everywhere
    assert (row.status, row.ms) == ("not run", None) and "does not drive it yet" in row.note
    case = _case("lstm", 64, 1, 0.1, 0.2, 0.5, 1.0, 4.0)
    case["rows"].append(row.__dict__)
    assert "json-peer: not run (json is installed" in grnn_table.format_table({"cases": [case]})


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    message = grnn_table.plot(RESULT, tmp_path / "p.png")
    assert "matplotlib is not installed" in message and not (tmp_path / "p.png").exists()


def test_cli_refuses_fewer_than_five_repeats(capsys):
    with pytest.raises(SystemExit):
        grnn_table.main(["--repeats", "3"])
    assert "at least 5" in capsys.readouterr().err


@pytest.mark.gpu
def test_grnn_table_runs_a_small_grid_end_to_end(tmp_path):
    out = tmp_path / "t"
    rc = grnn_table.main(["--cells", "lstm", "gru_reset_before", "--hidden", "64", "--batch", "1", "3",
                          "--steps", "7", "--json", f"{out}.json", "--csv", f"{out}.csv", "--markdown", f"{out}.md"])
    assert rc == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert len(result["cases"]) == 4
    for case in result["cases"]:
        rows = {r["provider"]: r for r in case["rows"]}
        ours = rows["persistrnn"]
        assert ours["status"] == "ok" and ours["graph_ms"] > 0 and rows["torch-cpu"]["rel_error"] <= 1e-5
        if ours["note"].startswith("plan cudnn"):  # torch's own numbers, TF32 included where torch allows it
            assert ours["rel_error"] <= 1.5 * max(1e-5, rows["cudnn (TF32 allowed)"]["rel_error"])
        else:
            assert ours["rel_error"] <= 1e-5
        if case["cell"] == "lstm":
            assert rows["cudnn (TF32 off)"]["rel_error"] <= 1e-5 and rows["cudnn (TF32 off)"]["graph_ms"] > 0
        else:
            assert rows["cudnn (TF32 off)"]["status"] == "no peer"
    assert "| LSTM | 64 | 3 |" in (tmp_path / "t.md").read_text()
