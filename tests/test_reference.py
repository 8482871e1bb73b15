"""The float64 reference against torch (CPU, float64) and an explicit loop."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from persistrnn.cells import GRU_RESET_BEFORE, Statement
from persistrnn.reference import (
    cell_from_torch,
    load_params_into_torch,
    param_shapes,
    params_from_torch,
    rnn_forward,
)
from helpers import linear_cell

TORCH_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
TOLERANCE = 1e-10


@dataclass(frozen=True, kw_only=True)
class Case:
    cell: str
    input_size: int = 5
    hidden_size: int = 7
    num_layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    bias: bool = True
    with_hx: bool = False
    proj_size: int = 0
    batch: int = 3
    seq_len: int = 4
    lengths: tuple[int, ...] | None = None

    @property
    def num_dirs(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        return self.proj_size or self.hidden_size


def nonzero_uniform(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """Uniform in ±[0.1, 1] * scale: random signs, never zero."""
    return scale * rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)


def random_params(rng: np.random.Generator, case: Case) -> list[list[dict[str, np.ndarray]]]:
    shapes = param_shapes(
        case.cell,
        case.input_size,
        case.hidden_size,
        num_layers=case.num_layers,
        bidirectional=case.bidirectional,
        bias=case.bias,
        proj_size=case.proj_size,
    )
    # 1/sqrt(hidden_size), as torch's init, keeps activations away from saturation.
    scale = 1.0 / np.sqrt(case.hidden_size)
    return [
        [{key: nonzero_uniform(rng, shape, scale) for key, shape in entry.items()} for entry in layer]
        for layer in shapes
    ]


def random_inputs(rng: np.random.Generator, case: Case):
    """x in the case's layout (padding included, non-zero) and hx, or None."""
    layout = (case.batch, case.seq_len) if case.batch_first else (case.seq_len, case.batch)
    x = nonzero_uniform(rng, (*layout, case.input_size))
    if not case.with_hx:
        return x, None
    num_states = case.num_layers * case.num_dirs
    h0 = nonzero_uniform(rng, (num_states, case.batch, case.out_size))
    if case.cell != "lstm":
        return x, h0
    return x, (h0, nonzero_uniform(rng, (num_states, case.batch, case.hidden_size)))


def unsorted_lengths(rng: np.random.Generator, batch: int, seq_len: int) -> tuple[int, ...]:
    """Lengths in [1, seq_len] that are not in decreasing order (batch >= 3, seq_len >= 2)."""
    high = seq_len - 1 if seq_len > 2 and rng.random() < 0.5 else seq_len  # sometimes all shorter than T
    while True:
        lengths = rng.integers(1, high + 1, batch)
        if np.any(np.diff(lengths) > 0):
            return tuple(int(n) for n in lengths)


def random_cases(per_cell: int, seed: int, *, with_lengths: bool) -> list[Case]:
    # The full product of the options below is ~3500 cases per cell. Instead,
    # each option's values are spread evenly over a cell's cases and shuffled
    # (every value of every option appears per cell, see
    # test_case_matrix_covers_every_option); sizes are drawn at random. A few
    # dozen cases run in a few seconds.
    rng = np.random.default_rng(seed)

    def column(values: list) -> list:
        spread = (values * per_cell)[:per_cell]
        return [spread[i] for i in rng.permutation(per_cell)]

    cases = []
    for cell in TORCH_CELLS:
        options = {
            "num_layers": column([1, 2, 3]),
            "bidirectional": column([False, True]),
            "batch_first": column([False, True]),
            "bias": column([False, True]),
            "with_hx": column([False, True]),
            "hidden_size": column([1, 7, 33]),
            "input_size": column([5, 13]),
            "batch": column([3, 5] if with_lengths else [1, 3]),
            "seq_len": column([2, 9] if with_lengths else [1, 2, 9]),
            "projected": column([False, True]),
        }
        for index in range(per_cell):
            chosen = {name: values[index] for name, values in options.items()}
            projected = chosen.pop("projected") and cell == "lstm" and chosen["hidden_size"] > 1
            proj = int(rng.integers(1, chosen["hidden_size"])) if projected else 0
            lengths = unsorted_lengths(rng, chosen["batch"], chosen["seq_len"]) if with_lengths else None
            cases.append(Case(cell=cell, proj_size=proj, lengths=lengths, **chosen))
    return cases


# Plus the combination most likely to break alone: projection with stacked bidirectional layers.
DENSE_CASES = random_cases(12, seed=1234, with_lengths=False) + [
    Case(cell="lstm", input_size=13, hidden_size=33, num_layers=3, bidirectional=True, batch_first=True,
         with_hx=True, proj_size=7, seq_len=9),
]
PACKED_CASES = random_cases(6, seed=5678, with_lengths=True) + [
    Case(cell="lstm", num_layers=2, bidirectional=True, with_hx=True, proj_size=3, batch=5, seq_len=9,
         lengths=(4, 9, 1, 7, 2)),
    Case(cell="lstm", input_size=13, hidden_size=33, num_layers=3, bidirectional=True, batch_first=True,
         bias=False, proj_size=1, seq_len=9, lengths=(2, 8, 5)),
]


def case_id(case: Case) -> str:
    parts = [
        case.cell,
        f"L{case.num_layers}",
        "bi" if case.bidirectional else "uni",
        "bf" if case.batch_first else "tf",
        "bias" if case.bias else "nobias",
        "hx" if case.with_hx else "nohx",
        f"I{case.input_size}H{case.hidden_size}P{case.proj_size}B{case.batch}T{case.seq_len}",
    ]
    if case.lengths:
        parts.append("len" + "-".join(map(str, case.lengths)))
    return "_".join(parts)


def assert_close(actual: np.ndarray, expected: np.ndarray, tolerance: float = TOLERANCE) -> None:
    assert actual.shape == expected.shape
    scale = np.linalg.norm(expected)
    error = np.linalg.norm(actual - expected)
    # An all-zero expectation (possible for relu) must be matched exactly.
    assert error <= tolerance * scale if scale > 0 else error == 0, f"relative error {error / scale:.3e}"


def make_torch_module(case: Case) -> torch.nn.RNNBase:
    common = dict(
        input_size=case.input_size,
        hidden_size=case.hidden_size,
        num_layers=case.num_layers,
        bias=case.bias,
        batch_first=case.batch_first,
        bidirectional=case.bidirectional,
    )
    if case.cell == "lstm":
        module = torch.nn.LSTM(**common, proj_size=case.proj_size)
    elif case.cell == "gru":
        module = torch.nn.GRU(**common)
    else:
        module = torch.nn.RNN(**common, nonlinearity=case.cell.removeprefix("rnn_"))
    return module.double().eval()


def to_torch(value):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(torch.from_numpy(v) for v in value)
    return torch.from_numpy(value)


def to_numpy(value):
    if isinstance(value, tuple):
        return tuple(v.detach().numpy() for v in value)
    return value.detach().numpy()


def run_reference(case: Case, x, params, hx):
    return rnn_forward(
        case.cell,
        x,
        params,
        num_layers=case.num_layers,
        bidirectional=case.bidirectional,
        batch_first=case.batch_first,
        hx=hx,
        lengths=case.lengths,
        proj_size=case.proj_size,
    )


def state_arrays(case: Case, state) -> tuple[np.ndarray, ...]:
    """(h_n, c_n) for LSTM, (h_n,) otherwise; the same for initial states."""
    return tuple(state) if case.cell == "lstm" else (state,)


def assert_same_result(case: Case, actual, expected, tolerance: float = TOLERANCE) -> None:
    assert_close(actual[0], expected[0], tolerance)
    actual_states, expected_states = state_arrays(case, actual[1]), state_arrays(case, expected[1])
    assert len(actual_states) == len(expected_states)
    for got, want in zip(actual_states, expected_states):
        assert_close(got, want, tolerance)


def test_case_matrix_covers_every_option():
    for cases in (DENSE_CASES, PACKED_CASES):
        for cell in TORCH_CELLS:
            mine = [case for case in cases if case.cell == cell]
            for option in ("num_layers", "bidirectional", "batch_first", "bias", "with_hx"):
                values = {getattr(case, option) for case in mine}
                assert len(values) == (3 if option == "num_layers" else 2), (cell, option, values)
    dense = DENSE_CASES
    assert {c.hidden_size for c in dense} == {1, 7, 33}
    assert {c.input_size for c in dense} == {5, 13}
    assert {c.batch for c in dense} == {1, 3}
    assert {c.seq_len for c in dense} == {1, 2, 9}
    for cases in (DENSE_CASES, PACKED_CASES):
        assert any(c.proj_size and c.bidirectional and c.num_layers > 1 for c in cases)
    assert any(max(c.lengths) < c.seq_len for c in PACKED_CASES)


@pytest.mark.parametrize("case", DENSE_CASES, ids=case_id)
def test_matches_torch(case: Case):
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    params = random_params(rng, case)
    x, hx = random_inputs(rng, case)
    module = make_torch_module(case)
    load_params_into_torch(module, params)
    assert cell_from_torch(module).name == case.cell
    with torch.no_grad():
        expected = module(torch.from_numpy(x), to_torch(hx))
    expected = (expected[0].numpy(), to_numpy(expected[1]))

    actual = run_reference(case, x, params, hx)

    assert actual[0].dtype == np.float64
    assert_same_result(case, actual, expected)


@pytest.mark.parametrize("case", PACKED_CASES, ids=case_id)
def test_matches_torch_packed_unsorted_lengths(case: Case):
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    params = random_params(rng, case)
    x, hx = random_inputs(rng, case)  # padding past each length is non-zero
    module = make_torch_module(case)
    load_params_into_torch(module, params)
    packed = pack_padded_sequence(
        torch.from_numpy(x), torch.tensor(case.lengths), batch_first=case.batch_first, enforce_sorted=False
    )
    with torch.no_grad():
        packed_out, state = module(packed, to_torch(hx))
        padded, _ = pad_packed_sequence(packed_out, batch_first=case.batch_first, total_length=case.seq_len)
    expected = (padded.numpy(), to_numpy(state))

    actual = run_reference(case, x, params, hx)
    assert_same_result(case, actual, expected)

    output = actual[0].transpose(1, 0, 2) if case.batch_first else actual[0]  # (T, B, D*H_out)
    h_n = actual[1][0] if case.cell == "lstm" else actual[1]
    last = (case.num_layers - 1) * case.num_dirs
    for b, length in enumerate(case.lengths):
        assert np.all(output[length:, b] == 0)
        # Final states are those of each sequence's own last step.
        np.testing.assert_array_equal(h_n[last, b], output[length - 1, b, : case.out_size])
        if case.bidirectional:
            np.testing.assert_array_equal(h_n[last + 1, b], output[0, b, case.out_size :])


@pytest.mark.parametrize("case", PACKED_CASES, ids=case_id)
def test_lengths_equal_running_each_sequence_alone(case: Case):
    rng = np.random.default_rng(7)
    params = random_params(rng, case)
    x, hx = random_inputs(rng, case)
    output, state = run_reference(case, x, params, hx)
    x_tb = x.transpose(1, 0, 2) if case.batch_first else x
    out_tb = output.transpose(1, 0, 2) if case.batch_first else output
    for b, length in enumerate(case.lengths):
        alone = replace(case, batch=1, seq_len=length, lengths=None, batch_first=False)
        hx_b = None
        if hx is not None:
            hx_b = tuple(s[:, b : b + 1] for s in state_arrays(case, hx))
            hx_b = hx_b if case.cell == "lstm" else hx_b[0]
        result_b = run_reference(alone, x_tb[:length, b : b + 1], params, hx_b)
        expected_b = (out_tb[:length, b : b + 1], tuple(s[:, b : b + 1] for s in state_arrays(case, state)))
        if case.cell != "lstm":
            expected_b = (expected_b[0], expected_b[1][0])
        assert_same_result(alone, result_b, expected_b, 1e-12)


def test_params_round_trip_through_torch():
    case = Case(cell="lstm", num_layers=2, bidirectional=True, proj_size=3)
    params = random_params(np.random.default_rng(0), case)
    module = make_torch_module(case)
    load_params_into_torch(module, params)
    back = params_from_torch(module)
    for layer_params, layer_back in zip(params, back):
        for entry, entry_back in zip(layer_params, layer_back):
            assert entry.keys() == entry_back.keys()
            for key in entry:
                assert entry_back[key].dtype == np.float64
                np.testing.assert_array_equal(entry_back[key], entry[key])


def test_load_params_into_torch_rejects_wrong_shape():
    case = Case(cell="gru")
    params = random_params(np.random.default_rng(0), case)
    params[0][0]["w_hh"] = params[0][0]["w_hh"][:, :6]
    with pytest.raises(ValueError, match=r"expected shape \(21, 7\), got \(21, 6\)"):
        load_params_into_torch(make_torch_module(case), params)


def test_torch_helpers_reject_non_rnn_module():
    with pytest.raises(TypeError, match="expected a torch.nn.LSTM, GRU or RNN, got Linear"):
        params_from_torch(torch.nn.Linear(2, 2))


def test_reference_runs_the_spec_statements():
    # A cell outside the registry: the reference must follow its statements.
    linear = linear_cell(pointwise=(Statement("h_new", "0.5 * (x_a + h_a)"),))
    rng = np.random.default_rng(3)
    x = nonzero_uniform(rng, (4, 2, 3))
    params = [[{key: nonzero_uniform(rng, shape) for key, shape in param_shapes(linear, 3, 5)[0][0].items()}]]
    p = params[0][0]
    h = np.zeros((2, 5))
    expected = []
    for t in range(4):
        h = 0.5 * (x[t] @ p["w_ih"].T + p["b_ih"] + h @ p["w_hh"].T + p["b_hh"])
        expected.append(h)
    output, h_n = rnn_forward(linear, x, params)
    assert_close(output, np.stack(expected))
    assert_close(h_n[0], h)


# ---- GRU with the reset gate applied before the matmul ----------------------


def hand_gru_reset_before(x, params, *, num_layers, bidirectional, h0=None, lengths=None):
    """Cho et al. GRU written out step by step; x is (T, B, I). Deliberately independent of the specs."""
    seq_len, batch, _ = x.shape
    num_dirs = 2 if bidirectional else 1
    lengths = [seq_len] * batch if lengths is None else list(lengths)
    layer_input = x
    h_n = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(num_dirs):
            p = params[layer][direction]
            w_ir, w_iz, w_in = np.split(p["w_ih"], 3)
            w_hr, w_hz, w_hn = np.split(p["w_hh"], 3)
            zeros = np.zeros(p["w_ih"].shape[0])
            b_ir, b_iz, b_in = np.split(p.get("b_ih", zeros), 3)
            b_hr, b_hz, b_hn = np.split(p.get("b_hh", zeros), 3)
            out = np.zeros((seq_len, batch, w_hr.shape[1]))
            finals = []
            for b in range(batch):
                h = np.zeros(w_hr.shape[1]) if h0 is None else h0[layer * num_dirs + direction, b].copy()
                steps = range(lengths[b])
                for t in reversed(steps) if direction == 1 else steps:
                    xt = layer_input[t, b]
                    r = 1.0 / (1.0 + np.exp(-(w_ir @ xt + b_ir + w_hr @ h + b_hr)))
                    z = 1.0 / (1.0 + np.exp(-(w_iz @ xt + b_iz + w_hz @ h + b_hz)))
                    n = np.tanh(w_in @ xt + b_in + w_hn @ (r * h) + b_hn)
                    h = (1.0 - z) * n + z * h
                    out[t, b] = h
                finals.append(h)
            outputs.append(out)
            h_n.append(np.stack(finals))
        layer_input = np.concatenate(outputs, axis=2)
    return layer_input, np.stack(h_n)


RESET_BEFORE_CASES = [
    Case(cell="gru", seq_len=9),
    Case(cell="gru", input_size=13, hidden_size=1, num_layers=2, bidirectional=True, batch_first=True,
         with_hx=True, batch=1, seq_len=2),
    Case(cell="gru", hidden_size=33, num_layers=3, bidirectional=True, bias=False, with_hx=True, seq_len=9,
         lengths=(2, 9, 5)),
    Case(cell="gru", input_size=13, num_layers=2, bidirectional=True, batch_first=True, batch=5, seq_len=9,
         lengths=(3, 1, 8, 8, 2)),
    Case(cell="gru", with_hx=True, seq_len=1),
]


@pytest.mark.parametrize("case", RESET_BEFORE_CASES, ids=case_id)
def test_gru_reset_before_matches_explicit_loop(case: Case):
    rng = np.random.default_rng(11)
    params = random_params(rng, case)
    x, h0 = random_inputs(rng, case)
    x_tb = x.transpose(1, 0, 2) if case.batch_first else x
    expected_out, expected_h = hand_gru_reset_before(
        x_tb,
        params,
        num_layers=case.num_layers,
        bidirectional=case.bidirectional,
        h0=h0,
        lengths=case.lengths,
    )
    if case.batch_first:
        expected_out = expected_out.transpose(1, 0, 2)

    output, h_n = run_reference(replace(case, cell="gru_reset_before"), x, params, h0)

    assert_close(output, expected_out)
    assert_close(h_n, expected_h)
    # Same weights, reset-after form: must differ, or the test could not tell them apart.
    after, _ = run_reference(case, x, params, h0)
    assert np.linalg.norm(after - output) > 1e-3 * np.linalg.norm(output)


def test_gru_reset_before_accepts_spec_object():
    case = RESET_BEFORE_CASES[0]
    params = random_params(np.random.default_rng(1), case)
    x, _ = random_inputs(np.random.default_rng(2), case)
    by_name = rnn_forward("gru_reset_before", x, params)
    by_spec = rnn_forward(GRU_RESET_BEFORE, x, params)
    np.testing.assert_array_equal(by_name[0], by_spec[0])


# ---- input validation -------------------------------------------------------

T, B, I, H, L = 4, 3, 5, 7, 2


def _valid_kwargs(cell: str = "lstm") -> dict:
    case = Case(cell=cell, input_size=I, hidden_size=H, num_layers=L, bidirectional=True, batch=B, seq_len=T)
    rng = np.random.default_rng(0)
    return dict(
        cell=cell,
        x=nonzero_uniform(rng, (T, B, I)),
        params=random_params(rng, case),
        num_layers=L,
        bidirectional=True,
    )


def _with(base_cell: str = "lstm", **changes) -> dict:
    kwargs = _valid_kwargs(base_cell)
    kwargs.update(changes)
    return kwargs


def _with_param(key: str, value, cell: str = "lstm") -> dict:
    kwargs = _valid_kwargs(cell)
    kwargs["params"][1][1][key] = value
    return kwargs


def _without_param(key: str) -> dict:
    kwargs = _valid_kwargs()
    del kwargs["params"][0][1][key]
    return kwargs


ERROR_CASES = [
    pytest.param(_with(x=np.ones((T, I))), ValueError, ["3-D", f"({T}, {I})"], id="x-rank"),
    pytest.param(_with(x=np.ones((T, B, I + 1))), ValueError, [f"input_size {I}", f"got {I + 1}"], id="x-features"),
    pytest.param(_with(x=np.ones((0, B, I))), ValueError, ["non-empty", f"(0, {B}, {I})"], id="x-empty"),
    pytest.param(_with(x=np.full((T, B, I), "a")), TypeError, ["real-valued", "<U1"], id="x-dtype"),
    pytest.param(_with(lengths=[0, 2, 3]), ValueError, [f"[1, {T}]", "[0, 2, 3]"], id="lengths-zero"),
    pytest.param(_with(lengths=[2, T + 1, 1]), ValueError, [f"[1, {T}]", f"[2, {T + 1}, 1]"], id="lengths-long"),
    pytest.param(_with(lengths=[2, 3]), ValueError, [f"({B},)", "(2,)"], id="lengths-count"),
    pytest.param(_with(lengths=[2.0, 3.0, 1.0]), TypeError, ["integers", "float64"], id="lengths-dtype"),
    pytest.param(
        _with(hx=(np.ones((2 * L, B, H + 1)), np.ones((2 * L, B, H)))),
        ValueError,
        [f"({2 * L}, {B}, {H})", f"({2 * L}, {B}, {H + 1})"],
        id="h0-shape",
    ),
    pytest.param(
        _with(hx=(np.ones((2 * L, B, H)), np.ones((L, B, H)))),
        ValueError,
        [f"({2 * L}, {B}, {H})", f"({L}, {B}, {H})"],
        id="c0-shape",
    ),
    pytest.param(_with(hx=np.ones((2 * L, B, H))), TypeError, ["(h0, c0) pair", "ndarray"], id="lstm-hx-not-pair"),
    pytest.param(
        _with("gru", hx=(np.ones((2 * L, B, H)),)), TypeError, ["single array h0", "tuple"], id="gru-hx-tuple"
    ),
    pytest.param(
        _with("gru", hx=np.ones((L, B, H))), ValueError, [f"({2 * L}, {B}, {H})", f"({L}, {B}, {H})"], id="gru-h0"
    ),
    pytest.param(_with(cell="nope"), ValueError, ["'nope'", "'lstm'", "'gru_reset_before'"], id="cell-unknown"),
    pytest.param(_with(cell=3), TypeError, ["str or CellSpec", "int"], id="cell-type"),
    pytest.param(_with(num_layers=3), ValueError, ["expected 3 layers", "got 2"], id="params-layers"),
    pytest.param(_with(bidirectional=False), ValueError, ["expected 1 directions", "got 2"], id="params-dirs"),
    pytest.param(_with(num_layers=0), ValueError, [">= 1", "got 0"], id="num-layers-zero"),
    pytest.param(_with(num_layers="2"), TypeError, ["int", "str"], id="num-layers-type"),
    pytest.param(_with(bidirectional=1), TypeError, ["bool", "int"], id="bidirectional-type"),
    pytest.param(
        _with_param("w_hh", np.ones((4 * H, H + 1))),
        ValueError,
        [f"params[1][1]['w_hh']: expected shape ({4 * H}, {H})", f"got ({4 * H}, {H + 1})"],
        id="param-shape",
    ),
    pytest.param(
        _with_param("w_ih", np.ones((4 * H, I))),
        ValueError,
        [f"expected shape ({4 * H}, {2 * H})", f"got ({4 * H}, {I})"],
        id="param-layer1-input",
    ),
    pytest.param(
        _with_param("w_hr", np.ones((2, H))),
        ValueError,
        ["expected keys ['b_hh', 'b_ih', 'w_hh', 'w_ih']", "'w_hr'"],
        id="param-extra-key",
    ),
    pytest.param(_without_param("b_hh"), ValueError, ["'b_hh'", "got ['b_ih', 'w_hh', 'w_ih']"], id="param-missing"),
    pytest.param(_with("gru", proj_size=3), ValueError, ["expected 0", "'gru'", "got 3"], id="proj-gru"),
    pytest.param(_with(proj_size=H), ValueError, [f"smaller than hidden_size {H}", f"got {H}"], id="proj-too-big"),
    pytest.param(_with(params="w"), TypeError, ["sequence of layers", "str"], id="params-type"),
]


@pytest.mark.parametrize(("kwargs", "error", "fragments"), ERROR_CASES)
def test_bad_input_raises(kwargs: dict, error: type[Exception], fragments: list[str]):
    kwargs = dict(kwargs)
    cell, x, params = kwargs.pop("cell"), kwargs.pop("x"), kwargs.pop("params")
    with pytest.raises(error) as info:
        rnn_forward(cell, x, params, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_call_every_error_case_changes_runs_and_matches_torch(cell):
    # The error cases above differ from this call in one argument only: it
    # must run, and give torch's answer, for their errors to mean anything.
    kwargs = _valid_kwargs(cell)
    case = Case(cell=cell, input_size=I, hidden_size=H, num_layers=L, bidirectional=True, batch=B, seq_len=T)
    module = make_torch_module(case)
    load_params_into_torch(module, kwargs["params"])
    with torch.no_grad():
        out, state = module(torch.from_numpy(kwargs["x"]))
    actual = rnn_forward(kwargs.pop("cell"), kwargs.pop("x"), kwargs.pop("params"), **kwargs)
    assert_same_result(case, actual, (out.numpy(), to_numpy(state)))


# ---- the tolerance rule every GPU comparison uses (tests/helpers.py) ----------


def test_tolerance_rule_bounds_the_norm_by_twice_the_peer_or_the_floor():
    from helpers import assert_close_to_reference

    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000)
    noise = rng.standard_normal(1000)
    peer = ref + 1e-3 * noise
    assert_close_to_reference(ref + 1.9e-3 * noise, ref, peer, dtype="float32")  # under 2x the peer
    with pytest.raises(AssertionError, match="relative norm error"):
        assert_close_to_reference(ref + 3e-3 * noise, ref, peer, dtype="float32")
    # no peer (the reset-before GRU), or a peer more exact than the floor: the floor
    assert_close_to_reference(ref + 5e-7 * noise, ref, None, dtype="float32")
    assert_close_to_reference(ref + 5e-7 * noise, ref, ref, dtype="float32")
    with pytest.raises(AssertionError, match="relative norm error"):
        assert_close_to_reference(ref + 5e-3 * noise, ref, None, dtype="bfloat16")  # over u = 3.9e-3


def test_tolerance_rule_finds_one_bad_element_a_norm_would_hide_and_nan():
    from helpers import assert_close_to_reference

    ref = np.random.default_rng(1).standard_normal(100_000)
    bad = ref.copy()
    bad[123] += 0.05  # 1.6e-4 of the norm: under 2x a peer's 1e-4, and far off as an element
    peer = ref * (1 + 1e-4)
    with pytest.raises(AssertionError, match="largest element error"):
        assert_close_to_reference({"output": bad}, {"output": ref}, {"output": peer}, dtype="float32")
    bad[123] = float("nan")
    with pytest.raises(AssertionError, match="output"):
        assert_close_to_reference({"output": bad}, {"output": ref}, None, dtype="float32")
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_reference(ref[:10], ref, None, dtype="float32")


def test_tolerance_rule_judges_a_few_elements_by_the_element_bound_alone():
    from helpers import ELEMENT_FLOOR, assert_close_to_reference

    # One unit near zero: its relative error is large, its absolute error a rounding step.
    ref = np.array([1e-4, 0.5])
    assert_close_to_reference(ref + 2e-3, ref, None, dtype="bfloat16")
    with pytest.raises(AssertionError, match="largest element error"):
        assert_close_to_reference(ref + 2 * ELEMENT_FLOOR["bfloat16"], ref, None, dtype="bfloat16")
