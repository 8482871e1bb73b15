"""Cell specs: registry, expression validation, rendering and evaluation."""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import replace

import numpy as np
import pytest

from persistrnn.cells import (
    CELLS,
    CUDA_FUNCTIONS,
    GRU,
    GRU_RESET_BEFORE,
    LSTM,
    NUMPY_FUNCTIONS,
    RNN_RELU,
    RNN_TANH,
    CellSpec,
    Statement,
    evaluate,
    expression_names,
    get_cell,
    render_cuda,
    render_cuda_expression,
    render_numpy_expression,
)
from helpers import linear_cell

# ---- registry ---------------------------------------------------------------


def test_registry_holds_each_cell_under_its_name():
    assert dict(CELLS) == {
        "lstm": LSTM,
        "gru": GRU,
        "gru_reset_before": GRU_RESET_BEFORE,
        "rnn_tanh": RNN_TANH,
        "rnn_relu": RNN_RELU,
    }
    with pytest.raises(TypeError):
        CELLS["mine"] = LSTM  # type: ignore[index]


def test_get_cell():
    assert get_cell("gru_reset_before") is GRU_RESET_BEFORE
    assert get_cell(LSTM) is LSTM
    with pytest.raises(ValueError) as info:
        get_cell("LSTM")
    message = str(info.value)
    assert "'LSTM'" in message
    for name in CELLS:
        assert repr(name) in message
    with pytest.raises(TypeError, match="expected a str or CellSpec, got int"):
        get_cell(4)


@pytest.mark.parametrize(
    ("cell", "gates", "has_cell_state", "outputs", "torch_module"),
    [
        (LSTM, ("i", "f", "g", "o"), True, ("h_new", "c_new"), "LSTM"),
        (GRU, ("r", "z", "n"), False, ("h_new",), "GRU"),
        (GRU_RESET_BEFORE, ("r", "z", "n"), False, ("h_new",), "GRU"),
        (RNN_TANH, ("a",), False, ("h_new",), "RNN"),
        (RNN_RELU, ("a",), False, ("h_new",), "RNN"),
    ],
    ids=lambda v: v.name if isinstance(v, CellSpec) else None,
)
def test_gates_and_state(cell: CellSpec, gates: tuple[str, ...], has_cell_state: bool, outputs: tuple[str, ...],
                         torch_module: str):
    import torch

    assert cell.gates == gates
    assert cell.has_cell_state is has_cell_state
    assert cell.outputs == outputs
    # torch's parameter layout: num_gates blocks of hidden_size rows, one per gate, in the spec's order
    assert getattr(torch.nn, torch_module)(3, 5).weight_ih_l0.shape == (cell.num_gates * 5, 3)
    assert cell.gate_rows(gates[-1], 5) == slice(5 * (len(gates) - 1), 5 * len(gates))


def test_stages():
    for cell in (LSTM, GRU, RNN_TANH, RNN_RELU):
        assert cell.stages == (cell.gates,)
        assert cell.stage_operands == ("h",)
        assert cell.between_stages == ()
    assert GRU_RESET_BEFORE.stages == (("r", "z"), ("n",))
    assert GRU_RESET_BEFORE.stage_operands == ("h", "r_h")
    assert GRU_RESET_BEFORE.between_stages == ((Statement("r", "sigmoid(x_r + h_r)"), Statement("r_h", "r * h")),)
    assert GRU_RESET_BEFORE.num_stages == 2
    assert LSTM.supports_projection
    assert not any(cell.supports_projection for cell in (GRU, GRU_RESET_BEFORE, RNN_TANH, RNN_RELU))


# ---- CUDA rendering ---------------------------------------------------------


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        (
            LSTM,
            [
                "const float i = prnn_sigmoid(x_i + h_i);",
                "const float f = prnn_sigmoid(x_f + h_f);",
                "const float g = tanhf(x_g + h_g);",
                "const float o = prnn_sigmoid(x_o + h_o);",
                "const float c_new = f * c + i * g;",
                "const float h_new = o * tanhf(c_new);",
            ],
        ),
        (
            GRU,
            [
                "const float r = prnn_sigmoid(x_r + h_r);",
                "const float z = prnn_sigmoid(x_z + h_z);",
                "const float n = tanhf(x_n + r * h_n);",
                "const float h_new = (1.0f - z) * n + z * h;",
            ],
        ),
        (
            GRU_RESET_BEFORE,
            [
                "const float z = prnn_sigmoid(x_z + h_z);",
                "const float n = tanhf(x_n + h_n);",
                "const float h_new = (1.0f - z) * n + z * h;",
            ],
        ),
        (RNN_TANH, ["const float h_new = tanhf(x_a + h_a);"]),
        (RNN_RELU, ["const float h_new = prnn_relu(x_a + h_a);"]),
    ],
    ids=lambda v: v.name if isinstance(v, CellSpec) else "",
)
def test_render_cuda_pointwise(cell: CellSpec, expected: list[str]):
    assert render_cuda(cell.pointwise, indent="    ").split("\n") == ["    " + line for line in expected]


def test_render_cuda_between_stages():
    assert render_cuda(GRU_RESET_BEFORE.between_stages[0]) == (
        "const float r = prnn_sigmoid(x_r + h_r);\nconst float r_h = r * h;"
    )


@pytest.mark.parametrize(
    ("expr", "cuda"),
    [
        ("a - (b - c)", "a - (b - c)"),
        ("(a - b) - c", "a - b - c"),
        ("a / (b * c)", "a / (b * c)"),
        ("(a + b) * c", "(a + b) * c"),
        ("-(-a)", "-(-a)"),
        ("-(a + b)", "-(a + b)"),
        ("2 * -a", "2.0f * -a"),
        ("1 / 2", "1.0f / 2.0f"),  # never integer division in C
        ("1e-5 * a", "1e-05f * a"),
        ("sigmoid(tanh(relu(a)))", "prnn_sigmoid(tanhf(prnn_relu(a)))"),
    ],
)
def test_render_cuda_expression(expr: str, cuda: str):
    assert render_cuda_expression(expr) == cuda


def _cuda_to_python(cuda: str) -> str:
    """Map a rendered CUDA expression back to Python: the syntax of this subset is shared."""
    python = re.sub(r"(\d)f\b", r"\1", cuda)
    for name, cuda_name in CUDA_FUNCTIONS.items():
        python = re.sub(rf"\b{cuda_name}\(", f"{name}(", python)
    return python


@pytest.mark.parametrize("cell", list(CELLS.values()), ids=lambda c: c.name)
def test_cuda_rendering_keeps_each_expression_tree(cell: CellSpec):
    # If parentheses were lost or precedence differed, the tree read back would differ.
    for block in (*cell.between_stages, cell.pointwise):
        for _, expr in block:
            rendered = _cuda_to_python(render_cuda_expression(expr))
            assert ast.dump(ast.parse(rendered, mode="eval")) == ast.dump(
                ast.parse(render_numpy_expression(expr), mode="eval")
            )


# ---- expression validation --------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("__import__('os')", "'__import__'"),
        ("x.real", "'x.real'"),
        ("np.exp(x)", "'np.exp'"),
        ("cosh(x)", "'cosh'"),
        ("sigmoid(x, y)", "one positional argument"),
        ("sigmoid(x=1)", "one positional argument"),
        ("sigmoid(*x)", "one positional argument"),
        ("sigmoid + 1", "used as a value"),
        ("x ** 2", "'x ** 2'"),
        ("x % 2", "'x % 2'"),
        ("x[0]", "'x[0]'"),
        ("a if b else c", "'a if b else c'"),
        ("lambda: 0", "'lambda: 0'"),
        ("a < b", "'a < b'"),
        ("(a := 1)", "'(a := 1)'"),
        ("+a", "'+a'"),
        ("True", "'True'"),
        ("'text'", "\"'text'\""),
        ("1e999", "finite"),
        ("x\u00e9", "ASCII"),
        ("prnn_sigmoid(x)", "'prnn_sigmoid'"),
        ("", "valid syntax"),
        ("a +", "valid syntax"),
        ("a = 1", "valid syntax"),
    ],
)
def test_expression_validator_rejects(expr: str, fragment: str):
    with pytest.raises(ValueError) as info:
        expression_names(expr)
    assert fragment in str(info.value)
    with pytest.raises(ValueError):
        render_cuda_expression(expr)
    with pytest.raises(ValueError):
        evaluate([("y", expr)], {})


def test_expression_validator_rejects_non_str():
    with pytest.raises(TypeError, match="expected str, got int"):
        expression_names(3)  # type: ignore[arg-type]


def test_expression_names():
    assert expression_names("(1 - z) * n + z * h") == {"z", "n", "h"}
    assert expression_names("sigmoid(x_i + h_i)") == {"x_i", "h_i"}


# ---- numpy evaluation -------------------------------------------------------


def test_evaluate_runs_statements_in_order():
    rng = np.random.default_rng(0)
    a, b, c = (rng.uniform(0.5, 2.0, 6) * rng.choice([-1.0, 1.0], 6) for _ in range(3))
    env = evaluate(
        [("d", "a - (b - c)"), ("e", "-d / 3"), ("f", "sigmoid(e) * tanh(a) + relu(b)")], {"a": a, "b": b, "c": c}
    )
    d = a - (b - c)
    e = -d / 3
    np.testing.assert_array_equal(env["d"], d)
    np.testing.assert_array_equal(env["e"], e)
    np.testing.assert_allclose(env["f"], 1 / (1 + np.exp(-e)) * np.tanh(a) + np.maximum(b, 0), rtol=1e-15)
    assert set(env) == {"a", "b", "c", "d", "e", "f"}


def test_numpy_functions_are_float64_and_stable():
    x = np.array([-1000.0, -30.0, -1.0, 0.0, 1.0, 30.0, 1000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow for large |x|
        sigmoid = NUMPY_FUNCTIONS["sigmoid"](x)
    assert sigmoid.dtype == np.float64
    np.testing.assert_allclose(sigmoid[1:-1], 1 / (1 + np.exp(-x[1:-1])), rtol=1e-15)
    assert sigmoid[0] == 0.0 and sigmoid[-1] == 1.0
    np.testing.assert_array_equal(NUMPY_FUNCTIONS["relu"](x), np.maximum(x, 0.0))
    np.testing.assert_array_equal(NUMPY_FUNCTIONS["tanh"](x), np.tanh(x))


def test_step_reference_lstm_matches_formula():
    rng = np.random.default_rng(1)
    batch, hidden, proj = 3, 4, 2
    x_proj = rng.standard_normal((batch, 4 * hidden))
    h = rng.standard_normal((batch, proj))
    c = rng.standard_normal((batch, hidden))
    w_hh = rng.standard_normal((4 * hidden, proj))
    b_hh = rng.standard_normal(4 * hidden)
    h_new, c_new = LSTM.step_reference(x_proj, h, c, w_hh, b_hh)
    gates = x_proj + h @ w_hh.T + b_hh
    i, f, g, o = np.split(gates, 4, axis=1)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    expected_c = sig(f) * c + sig(i) * np.tanh(g)
    np.testing.assert_allclose(c_new, expected_c, rtol=1e-13)
    np.testing.assert_allclose(h_new, sig(o) * np.tanh(expected_c), rtol=1e-13)


# ---- spec validation --------------------------------------------------------


def test_spec_accepts_plain_pairs_and_stores_statements():
    assert linear_cell().pointwise == (Statement("h_new", "x_a + h_a"),)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"pointwise": (("h_new", "x_a + h_b"),)}, ["undefined ['h_b']"]),
        ({"pointwise": (("h_new", "x_a + c"),)}, ["undefined ['c']"]),  # no cell state
        ({"pointwise": (("y", "x_a"), ("y", "h_a"), ("h_new", "y"))}, ["'y'", "already defined"]),
        ({"pointwise": (("h", "x_a"), ("h_new", "h"))}, ["'h'", "already defined"]),
        ({"pointwise": (("tanh", "x_a"), ("h_new", "x_a"))}, ["'tanh'"]),
        ({"pointwise": (("prnn_x", "x_a"), ("h_new", "x_a"))}, ["'prnn_x'"]),
        ({"pointwise": (("h new", "x_a"),)}, ["identifier", "'h new'"]),
        ({"pointwise": (("y", "x_a + h_a"),)}, ["('h_new',)", "missing ['h_new']"]),
        ({"pointwise": (("h_new", "x_a.real"),)}, ["'x_a.real'"]),
        ({"has_cell_state": True}, ["missing ['c_new']"]),
        ({"gates": ("a", "b")}, ["each gate of ('a', 'b')"]),
        ({"gates": ("a", "a")}, ["distinct gate names", "('a', 'a')"]),
        ({"gates": ("a-b",), "stages": (("a-b",),)}, ["identifier", "'a-b'"]),
        ({"stages": (("a",), ())}, ["non-empty stages"]),
        ({"stage_operands": ("h", "h")}, ["expected 1 stage operands, got 2"]),
        ({"between_stages": ((("y", "h"),),)}, ["expected 0 between-stage blocks, got 1"]),
        ({"stage_operands": ("x_a",)}, ["'h' or a name assigned before it", "got 'x_a'"]),
        ({"supports_projection": True, "pointwise": (("h_new", "x_a + h"),)}, ["read 'h'", "['h_new']"]),
        ({"name": ""}, ["non-empty str", "''"]),
    ],
)
def test_spec_rejects(changes: dict, fragments: list[str]):
    with pytest.raises(ValueError) as info:
        linear_cell(**changes)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_spec_later_stage_may_only_use_earlier_names():
    two_stage = dict(
        gates=("a", "b"),
        stages=(("a",), ("b",)),
        stage_operands=("h", "s"),
        pointwise=(("h_new", "h_a + h_b + x_b"),),
    )
    linear_cell(**two_stage, between_stages=((("s", "sigmoid(h_a) * h"),),))
    with pytest.raises(ValueError, match=r"got undefined \['h_b'\]"):
        linear_cell(**two_stage, between_stages=((("s", "h_b * h"),),))
    with pytest.raises(ValueError, match="got 's'"):
        linear_cell(**two_stage, between_stages=((("t", "h"),),))


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        LSTM.name = "other"  # type: ignore[misc]
    assert replace(LSTM) == LSTM


def test_a_clipped_cell_clamps_every_gate_pre_activation_but_not_the_lstm_output():
    from persistrnn.cells import with_clip

    lstm = with_clip("lstm", 3)
    assert lstm.name == "lstm+clip=3.0" and get_cell("lstm+clip=3.0") is get_cell("lstm+clip=3.0")
    exprs = dict(lstm.pointwise)
    assert exprs["i"] == "sigmoid(3.0 * hardtanh((x_i + h_i) / 3.0))"
    assert exprs["h_new"] == "o * tanh(c_new)"  # ONNX Runtime does not clip the cell state before h
    gru = dict(with_clip("gru_reset_before", 0.5).between_stages[0])
    assert gru["r"] == "sigmoid(0.5 * hardtanh((x_r + h_r) / 0.5))" and gru["r_h"] == "r * h"
    # the clamp, evaluated: the bound exactly outside it, the value (to rounding) inside, NaN kept
    env = evaluate([("y", "3.0 * hardtanh(x / 3.0)")], {"x": np.array([-1e30, -3.5, -1.0, 2.999, 4.0, np.nan])})
    np.testing.assert_allclose(env["y"][:5], [-3.0, -3.0, -1.0, 2.999, 3.0], rtol=1e-15)
    assert np.isnan(env["y"][5])


def test_clipped_cell_names_are_canonical_and_bad_ones_say_what_was_expected():
    with pytest.raises(ValueError, match=r"cell: expected 'lstm\+clip=3.0', got 'lstm\+clip=3'"):
        get_cell("lstm+clip=3")
    with pytest.raises(ValueError, match=r"cell: expected lstm\+clip=<a positive float>, got 'lstm\+clip=x'"):
        get_cell("lstm+clip=x")
    with pytest.raises(ValueError, match=r"clip: expected a positive finite float, got 0.0"):
        get_cell("gru+clip=0.0")
    with pytest.raises(ValueError,
                       match=r"cell: expected one of .* before '\+clip=' or '\+act=', got 'lsmt\+clip=3.0'"):
        get_cell("lsmt+clip=3.0")
    with pytest.raises(ValueError, match=r"got 'lstm\+clip=3.0\+clip=1.0'"):
        get_cell("lstm+clip=3.0+clip=1.0")
    from persistrnn.cells import with_clip

    with pytest.raises(ValueError, match=r"cell 'lstm\+clip=3.0' is clipped already"):
        with_clip("lstm+clip=3.0", 1.0)


def test_other_activations_replace_each_role_and_keep_a_clip_inside_them():
    from persistrnn.cells import with_activations, with_clip

    lstm = with_activations("lstm+clip=3.0", ["HardSigmoid(0.2,0.5)".lower(), "tanh", "leakyrelu(0.1)"])
    assert lstm.name == "lstm+clip=3.0+act=hardsigmoid(0.2,0.5)/tanh/leakyrelu(0.1)"
    assert get_cell(lstm.name) is get_cell(lstm.name)
    exprs = dict(lstm.pointwise)
    assert exprs["i"] == "0.5 * hardtanh(0.4 * (3.0 * hardtanh((x_i + h_i) / 3.0)) + 0.0) + 0.5"
    assert exprs["g"] == "tanh(3.0 * hardtanh((x_g + h_g) / 3.0))"
    assert exprs["h_new"] == "o * (relu(c_new) - 0.1 * relu(-c_new))"
    assert with_activations("gru", ["sigmoid", "tanh"]).name == "gru"  # its own activations: the cell itself
    # each activation, evaluated against its definition
    x = np.linspace(-6.0, 6.0, 49)
    for text, want in (("hardsigmoid(0.3,0.4)", np.clip(0.3 * x + 0.4, 0, 1)),
                       ("leakyrelu(0.1)", np.where(x >= 0, x, 0.1 * x)),
                       ("affine(0.5,0.1)", 0.5 * x + 0.1), ("scaledtanh(2.0,0.5)", 2.0 * np.tanh(0.5 * x)),
                       ("softsign", x / (1 + np.abs(x))), ("elu(0.5)", np.where(x >= 0, x, 0.5 * np.expm1(x))),
                       ("softplus", np.logaddexp(0, x)), ("thresholdedrelu(0.3)", np.where(x > 0.3, x, 0.0))):
        expr = dict(with_activations("rnn_tanh", [text]).pointwise)["h_new"]
        got = evaluate([("y", expr)], {"x_a": x, "h_a": np.zeros_like(x)})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-15, err_msg=text)
    for bad, match in ((["gelu"], "activation: expected one of"), (["hardsigmoid(0.2)"], "2 parameter"),
                       (["sigmoid", "tanh"], "expected 1 activation"), (["affine(1,inf)"], "finite")):
        with pytest.raises(ValueError, match=match):
            with_activations("rnn_tanh", bad)
    with pytest.raises(ValueError, match=r"derived otherwise \(clip first\)"):
        with_clip("rnn_tanh+act=sigmoid", 1.0)
    with pytest.raises(ValueError, match=r"cell: expected 'rnn_tanh\+act=affine\(1.0,0.0\)'"):
        get_cell("rnn_tanh+act=affine(1,0)")


def test_coupled_gates_make_the_forget_gate_one_minus_the_input_gate():
    from persistrnn.cells import with_coupled_gates

    spec = get_cell("lstm+clip=2.0+act=hardsigmoid(0.2,0.5)/tanh/tanh+coupled")
    assert dict(spec.pointwise)["f"] == "1.0 - i" and spec.name == with_coupled_gates(
        "lstm+clip=2.0+act=hardsigmoid(0.2,0.5)/tanh/tanh").name
    assert dict(spec.pointwise)["i"].startswith("0.5 * hardtanh(")
    for bad in ("gru", "lstm+coupled"):
        with pytest.raises(ValueError, match="expected an LSTM cell whose gates are not coupled yet"):
            with_coupled_gates(bad)
