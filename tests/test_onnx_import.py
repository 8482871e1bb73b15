"""ONNX import: every LSTM/GRU/RNN node against ONNX's own references.

References, all independent of the conversion:

* ``onnx.reference.ReferenceEvaluator`` (ONNX's numpy operators). It ignores
  ``sequence_lens``, so a case with lengths is evaluated one sequence at a
  time over its own steps, which is what sequence_lens means; its RNN knows
  only Tanh, so relu RNNs are checked against ONNX Runtime alone.
* ONNX Runtime's CPU provider, which implements ``sequence_lens`` itself. It
  refuses ``layout=1``, so a layout-1 model is run there as its layout-0 twin
  with the inputs and outputs transposed.
* The ONNX project's backend node tests (``onnx.backend.test``), built in
  memory by the onnx package from the same generators as its .pb test data.

On the CPU the converted modules run torch's implementation (the canonical
GRU, which torch lacks, this package's torch-ops path); the ``gpu`` tests run
the same cases on CUDA, where the persistent kernels run them.
"""

import functools
import sys
import types
import zlib

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import persistrnn  # noqa: E402
from helpers import ELEMENT_FLOOR  # noqa: E402
from persistrnn import ArgumentError, ArgumentTypeError, InputShapeError, UnsupportedError, from_onnx  # noqa: E402
from persistrnn.onnx_import import RecurrentNode  # noqa: E402

# ONNX's backend-test rule, per element: |got - expected| <= RELATIVE * |expected| + ABSOLUTE.
RELATIVE, ABSOLUTE = 1e-5, 1e-6
# The random models (larger and longer than the backend cases) take ABSOLUTE
# relative to max(1, the output's largest magnitude), as float32 rounding grows
# with the values: torch's float32 CPU relu RNN measured 4.5e-6 from float64 on
# an element of 0.027 in an output reaching 6.6. Over 960 random cases (8 per
# combination below), ours measured at most 5.1e-7 of that scale from
# onnx.reference in float64 on the same float32 values, ONNX Runtime 7.9e-7,
# and ours from ONNX Runtime 9.6e-7: both round, so against ONNX Runtime the
# term is twice as wide.
ORT_ABSOLUTE = 2 * ABSOLUTE
ORT_IR_VERSION = 10
"""The models' IR version: one every ONNX Runtime release since 1.16 loads
(a newer onnx writes IR 14 by default, which ONNX Runtime 1.30 refuses)."""

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}

# Odd sizes, and one sequence of length 1 and one of full length among the lengths.
STEPS, BATCH, INPUT, HIDDEN = 7, 3, 5, 9
LENGTHS = (7, 1, 4)

# (op, attributes): the five cells the import maps to.
CELLS = [
    ("LSTM", {}),
    ("GRU", {"linear_before_reset": 0}),
    ("GRU", {"linear_before_reset": 1}),
    ("RNN", {}),
    ("RNN", {"activations": ["Relu"]}),
]
CELL_IDS = ["lstm", "gru-lbr0", "gru-lbr1", "rnn-tanh", "rnn-relu"]
DIRECTIONS = ("forward", "reverse", "bidirectional")


def node_model(op, attributes=None, *, direction="forward", layout=0, lengths=None, states=False, seed=0,
               steps=STEPS, batch=BATCH, input_size=INPUT, hidden=HIDDEN, dtype=np.float32, state_inputs=True):
    """A one-node model with random weights as initializers, and random feeds.
    Graph inputs: X, sequence_lens (with ``lengths``), initial_h and, for LSTM,
    initial_c (with ``states``; as initializers where ``state_inputs`` is False)."""
    attributes = dict(attributes or {})
    rng = np.random.default_rng(seed)
    directions = 2 if direction == "bidirectional" else 1
    if attributes.get("activations") and direction == "bidirectional":
        attributes["activations"] = attributes["activations"] * 2
    gates = GATES[op]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weights = {"W": 0.5 * rng.standard_normal((directions, gates * hidden, input_size)),
               "R": 0.5 * rng.standard_normal((directions, gates * hidden, hidden)),
               "B": 0.5 * rng.standard_normal((directions, 2 * gates * hidden))}
    x_shape = [batch, steps, input_size] if layout else [steps, batch, input_size]
    state_shape = [batch, directions, hidden] if layout else [directions, batch, hidden]
    feeds = {"X": rng.standard_normal(x_shape).astype(dtype)}
    inputs = ["X", "W", "R", "B", "", "", ""]
    graph_inputs = [helper.make_tensor_value_info("X", elem, x_shape)]
    if lengths is not None:
        inputs[4] = "sequence_lens"
        feeds["sequence_lens"] = np.array(lengths, dtype=np.int32)
        graph_inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    if states:
        for index, name in ((5, "initial_h"), (6, "initial_c"))[:2 if op == "LSTM" else 1]:
            inputs[index] = name
            value = rng.standard_normal(state_shape).astype(dtype)
            if state_inputs:
                feeds[name] = value
                graph_inputs.append(helper.make_tensor_value_info(name, elem, state_shape))
            else:
                weights[name] = value
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    while inputs and not inputs[-1]:
        inputs.pop()
    node = helper.make_node(op, inputs, outputs, name=f"{op.lower()}_node", hidden_size=hidden, layout=layout,
                            direction=direction, **attributes)
    graph = helper.make_graph([node], "recurrent", graph_inputs,
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v, dtype=dtype), n) for n, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=ORT_IR_VERSION), feeds


def run_module(module, feeds, device="cpu"):
    """The converted one-node module on ``feeds``, outputs as float64 arrays."""
    def tensor(name):
        return None if name not in feeds else torch.from_numpy(feeds[name]).to(device)

    outputs = module.to(device)(tensor("X"), tensor("sequence_lens"), tensor("initial_h"), tensor("initial_c"))
    return [o.detach().double().cpu().numpy() for o in (outputs if isinstance(outputs, tuple) else (outputs,))]


def onnx_reference(model, feeds, layout):
    """ONNX's reference outputs; with sequence_lens, each sequence alone over its own steps."""
    evaluator = ReferenceEvaluator(model)
    if "sequence_lens" not in feeds:
        return evaluator.run(None, feeds)
    lengths = feeds["sequence_lens"]
    steps = feeds["X"].shape[1 if layout else 0]
    alone = []
    for b, length in enumerate(lengths):
        one = {"sequence_lens": lengths[b:b + 1],
               "X": feeds["X"][b:b + 1, :length] if layout else feeds["X"][:length, b:b + 1]}
        for name in ("initial_h", "initial_c"):
            if name in feeds:
                one[name] = feeds[name][b:b + 1] if layout else feeds[name][:, b:b + 1]
        alone.append(evaluator.run(None, one))
    # Y is [T, D, B, H] ([B, T, D, H] with layout 1), zero past each length;
    # Y_h and Y_c are [D, B, H] ([B, D, H]).
    y_part = alone[0][0]
    if layout:
        y = np.zeros((len(lengths), steps) + y_part.shape[2:], y_part.dtype)
        for b, length in enumerate(lengths):
            y[b, :length] = alone[b][0][0]
    else:
        y = np.zeros((steps, y_part.shape[1], len(lengths), y_part.shape[3]), y_part.dtype)
        for b, length in enumerate(lengths):
            y[:length, :, b] = alone[b][0][:, :, 0]
    states = [np.concatenate([a[i] for a in alone], axis=0 if layout else 1) for i in range(1, len(alone[0]))]
    return [y, *states]


def onnxruntime_reference(model, feeds, layout):
    """ONNX Runtime's CPU outputs; a layout-1 model runs as its layout-0 twin."""
    ort = pytest.importorskip("onnxruntime")
    if layout:
        twin = onnx.ModelProto()
        twin.CopyFrom(model)
        for attribute in twin.graph.node[0].attribute:
            if attribute.name == "layout":
                attribute.i = 0
        for value in twin.graph.input:
            if value.name != "sequence_lens":
                dims = value.type.tensor_type.shape.dim
                dims[0].dim_value, dims[1].dim_value = dims[1].dim_value, dims[0].dim_value
        feeds = {n: (v if n == "sequence_lens" else v.swapaxes(0, 1)) for n, v in feeds.items()}
        model = twin
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    if layout:  # Y [T, D, B, H] -> [B, T, D, H]; Y_h, Y_c [D, B, H] -> [B, D, H]
        outputs = [outputs[0].transpose(2, 0, 1, 3)] + [o.swapaxes(0, 1) for o in outputs[1:]]
    return outputs


def assert_onnx_close(got, expected, what, *, absolute=ABSOLUTE, scaled=False):
    """``|got - expected| <= RELATIVE * |expected| + absolute`` per element of
    every output (``scaled``: ``absolute * max(1, the output's largest
    magnitude)``); errors name the output, the element and the bound."""
    assert len(got) == len(expected), f"{what}: {len(got)} outputs, expected {len(expected)}"
    for index, (g, e) in enumerate(zip(got, expected)):
        g, e = np.asarray(g, dtype=np.float64), np.asarray(e, dtype=np.float64)
        assert g.shape == e.shape, f"{what}: output {index} has shape {g.shape}, expected {e.shape}"
        largest = float(np.abs(e).max())
        assert largest > 0.05, f"{what}: output {index} is all near zero, a check that could not fail"
        term = absolute * max(1.0, largest) if scaled else absolute
        excess = np.abs(g - e) - (RELATIVE * np.abs(e) + term)
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess[worst] <= 0, (
            f"{what}: output {index} element {tuple(int(i) for i in worst)} is {g[worst]:.7g}, expected "
            f"{e[worst]:.7g} (bound {RELATIVE} * |expected| + {term:.2g})")


def float64_twin(model, feeds):
    """The model and feeds in float64, from the same float32 (or float16)
    values: onnx.reference then computes without rounding of its own."""
    narrow = (TensorProto.FLOAT, TensorProto.FLOAT16)
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for tensor in twin.graph.initializer:
        if tensor.data_type in narrow:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))
    for value in list(twin.graph.input) + list(twin.graph.output):
        if value.type.tensor_type.elem_type in narrow:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    return twin, {n: (v.astype(np.float64) if v.dtype.kind == "f" else v) for n, v in feeds.items()}


# ---- random weights, every attribute combination --------------------------------------------------

# Every combination of the five cells, three directions, two layouts, lengths
# or none and initial states or none: 120 small cases, each its own weights.
COMBINATIONS = [
    pytest.param(op, attributes, direction, layout, lengths, states,
                 id=f"{cell}-{direction}-layout{layout}-{'lengths' if lengths else 'full'}-"
                    f"{'states' if states else 'zeros'}")
    for (op, attributes), cell in zip(CELLS, CELL_IDS)
    for direction in DIRECTIONS
    for layout in (0, 1)
    for lengths in (None, LENGTHS)
    for states in (False, True)
]


def _check_combination(request, op, attributes, direction, layout, lengths, states, device):
    seed = zlib.crc32(request.node.callspec.id.encode())
    model, feeds = node_model(op, attributes, direction=direction, layout=layout, lengths=lengths, states=states,
                              seed=seed)
    module = from_onnx(model)
    assert isinstance(module, RecurrentNode)
    got = run_module(module, feeds, device)
    if attributes.get("activations") != ["Relu"]:  # onnx.reference's RNN has no Relu
        assert_onnx_close(got, onnx_reference(*float64_twin(model, feeds), layout), "against onnx.reference",
                          scaled=True)
    assert_onnx_close(got, onnxruntime_reference(model, feeds, layout), "against ONNX Runtime",
                      absolute=ORT_ABSOLUTE, scaled=True)


@pytest.mark.parametrize("op, attributes, direction, layout, lengths, states", COMBINATIONS)
def test_node_matches_onnx_reference_and_onnxruntime(request, op, attributes, direction, layout, lengths, states):
    _check_combination(request, op, attributes, direction, layout, lengths, states, "cpu")


# clip: onnx.reference ignores it, so ONNX Runtime is the reference; at 0.5 many pre-activations clip.
CLIP_CASES = [
    pytest.param(op, {**attributes, "clip": 0.5}, direction, lengths,
                 id=f"{cell}-{direction}-{'lengths' if lengths else 'full'}")
    for (op, attributes), cell in zip(CELLS, CELL_IDS)
    for direction in DIRECTIONS
    for lengths in (None, LENGTHS)
]


def _check_clip(request, op, attributes, direction, lengths, device):
    seed = zlib.crc32(request.node.callspec.id.encode())
    model, feeds = node_model(op, attributes, direction=direction, lengths=lengths, states=True, seed=seed)
    module = from_onnx(model)
    assert module.rnn.clip == 0.5 and module.rnn.cell.endswith("+clip=0.5")
    got = run_module(module, feeds, device)
    assert_onnx_close(got, onnxruntime_reference(model, feeds, 0), "against ONNX Runtime",
                      absolute=ORT_ABSOLUTE, scaled=True)
    unclipped = run_module(from_onnx(_set_attribute(model, "clip", 1e30)), feeds, device)
    assert max(float(np.abs(u - g).max()) for u, g in zip(unclipped, got)) > 1e-2  # the clip mattered


@pytest.mark.parametrize("op, attributes, direction, lengths", CLIP_CASES)
def test_clip_matches_onnxruntime(request, op, attributes, direction, lengths):
    _check_clip(request, op, attributes, direction, lengths, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op, attributes, direction, lengths", CLIP_CASES)
def test_gpu_clip_matches_onnxruntime(request, untuned, op, attributes, direction, lengths):
    _check_clip(request, op, attributes, direction, lengths, "cuda")


# Activations other than the defaults (onnx.reference has some, ONNX Runtime all): the parametrised ones
# with activation_alpha/beta consumed as ONNX Runtime consumes them (each list by the activations that take
# it, in order), HardSigmoid and LeakyRelu also with their defaults; with clip too, inside them.
ACTIVATION_CASES = [
    ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Tanh"]}),
    ("LSTM", {"activations": ["Sigmoid", "LeakyRelu", "ScaledTanh"], "activation_alpha": [0.1, 1.5],
              "activation_beta": [0.7]}),
    ("LSTM", {"activations": ["HardSigmoid", "Affine", "Relu"], "activation_alpha": [0.3, 0.5],
              "activation_beta": [0.4, 0.1], "clip": 0.8}),
    ("GRU", {"linear_before_reset": 0, "activations": ["HardSigmoid", "Tanh"]}),
    ("GRU", {"linear_before_reset": 1, "activations": ["Sigmoid", "LeakyRelu"]}),
    ("GRU", {"linear_before_reset": 0, "activations": ["HardSigmoid", "ScaledTanh"], "activation_alpha": [0.25, 2.0],
             "activation_beta": [0.45, 0.5], "clip": 0.6}),
    ("RNN", {"activations": ["Sigmoid"]}),
    ("RNN", {"activations": ["Softsign"]}),
    ("LSTM", {"activations": ["Sigmoid", "Elu", "Softplus"]}),
    ("GRU", {"linear_before_reset": 0, "activations": ["Sigmoid", "ThresholdedRelu"], "activation_alpha": [0.2]}),
    ("RNN", {"activations": ["Elu"], "activation_alpha": [0.5]}),
    ("GRU", {"linear_before_reset": 1, "activations": ["Softsign", "Softsign"]}),
    ("RNN", {"activations": ["LeakyRelu"], "activation_alpha": [0.2]}),
    ("RNN", {"activations": ["Affine"], "activation_alpha": [0.5], "activation_beta": [0.1]}),
    # input_forget=1: the forget gate is 1 - the input gate (with other activations and a clip too)
    ("LSTM", {"input_forget": 1}),
    ("LSTM", {"input_forget": 1, "activations": ["HardSigmoid", "Tanh", "Tanh"], "clip": 0.7}),
]
ACTIVATION_PARAMS = [
    pytest.param(op, attributes, direction, id=f"{op.lower()}-{'-'.join(attributes.get('activations', ['default']))}"
                 f"{'-clip' if 'clip' in attributes else ''}{'-input_forget' if 'input_forget' in attributes else ''}"
                 f"-{direction}")
    for op, attributes in ACTIVATION_CASES for direction in ("forward", "bidirectional")
]


def _check_activations(request, op, attributes, direction, device):
    seed = zlib.crc32(request.node.callspec.id.encode())
    attributes = dict(attributes)
    if direction == "bidirectional":  # the same activations (and parameters) for the reverse direction
        for name in ("activation_alpha", "activation_beta"):
            if name in attributes:
                attributes[name] = attributes[name] * 2
    model, feeds = node_model(op, attributes, direction=direction, lengths=LENGTHS, states=True, seed=seed)
    module = from_onnx(model)
    assert module.rnn.cell != {"LSTM": "lstm", "GRU": "gru_reset_before", "RNN": "rnn_tanh"}[op]
    got = run_module(module, feeds, device)
    assert_onnx_close(got, onnxruntime_reference(model, feeds, 0), "against ONNX Runtime",
                      absolute=ORT_ABSOLUTE, scaled=True)
    for name in ("activations", "activation_alpha", "activation_beta", "input_forget"):  # the defaults: another answer
        for attribute in [a for a in model.graph.node[0].attribute if a.name == name]:
            model.graph.node[0].attribute.remove(attribute)
    default = run_module(from_onnx(model), feeds, device)
    assert max(float(np.abs(d - g).max()) for d, g in zip(default, got)) > 1e-2


@pytest.mark.parametrize("op, attributes, direction", ACTIVATION_PARAMS)
def test_activations_match_onnxruntime(request, op, attributes, direction):
    _check_activations(request, op, attributes, direction, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op, attributes, direction", ACTIVATION_PARAMS)
def test_gpu_activations_match_onnxruntime(request, untuned, op, attributes, direction):
    _check_activations(request, op, attributes, direction, "cuda")


# Sequences of length 0 (ONNX Runtime's zeros for Y, Y_h and Y_c), among others and all of them.
EMPTY_CASES = [
    pytest.param(op, attributes, direction, layout, lengths, id=f"{cell}-{direction}-layout{layout}-{name}")
    for (op, attributes), cell in zip(CELLS, CELL_IDS)
    for direction in DIRECTIONS
    for layout in (0, 1)
    for lengths, name in (((7, 0, 4), "one-empty"), ((0, 7, 0), "full-and-empty"), ((0, 0, 0), "all-empty"))
]


def _check_empty_sequences(request, op, attributes, direction, layout, lengths, device):
    seed = zlib.crc32(request.node.callspec.id.encode())
    model, feeds = node_model(op, attributes, direction=direction, layout=layout, lengths=lengths, states=True,
                              seed=seed)
    got = run_module(from_onnx(model), feeds, device)
    expected = onnxruntime_reference(model, feeds, layout)
    empty = np.asarray(lengths) == 0
    for index, (g, e) in enumerate(zip(got, expected)):
        batch_axis = 0 if layout else (2 if index == 0 else 1)
        assert not np.take(g, np.flatnonzero(empty), axis=batch_axis).any(), f"output {index}: not zero where empty"
        assert np.array_equal(g.shape, e.shape), (index, g.shape, e.shape)
    if empty.all():
        assert all(not np.asarray(e).any() for e in expected)  # ONNX Runtime's zeros, too
    else:
        assert_onnx_close(got, expected, "against ONNX Runtime", absolute=ORT_ABSOLUTE, scaled=True)


@pytest.mark.parametrize("op, attributes, direction, layout, lengths", EMPTY_CASES)
def test_sequences_of_length_zero_give_onnxruntimes_zeros(request, op, attributes, direction, layout, lengths):
    _check_empty_sequences(request, op, attributes, direction, layout, lengths, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op, attributes, direction, layout, lengths", EMPTY_CASES)
def test_gpu_sequences_of_length_zero_give_onnxruntimes_zeros(request, untuned, op, attributes, direction, layout,
                                                               lengths):
    _check_empty_sequences(request, op, attributes, direction, layout, lengths, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op, attributes, direction, layout, lengths, states", COMBINATIONS)
def test_gpu_node_matches_onnx_reference_and_onnxruntime(request, untuned, op, attributes, direction, layout,
                                                         lengths, states):
    _check_combination(request, op, attributes, direction, layout, lengths, states, "cuda")


def test_converted_modules_are_persistrnn_modules_with_the_right_form():
    expected = {"lstm": (persistrnn.LSTM, "lstm"), "gru-lbr0": (persistrnn.GRU, "gru_reset_before"),
                "gru-lbr1": (persistrnn.GRU, "gru"), "rnn-tanh": (persistrnn.RNN, "rnn_tanh"),
                "rnn-relu": (persistrnn.RNN, "rnn_relu")}
    for (op, attributes), cell in zip(CELLS, CELL_IDS):
        for direction in DIRECTIONS:
            rnn = from_onnx(node_model(op, attributes, direction=direction)[0]).rnn
            cls, name = expected[cell]
            assert type(rnn) is cls and rnn.cell == name
            assert rnn.bidirectional == (direction == "bidirectional")
            assert not any(p.requires_grad for p in rnn.parameters())  # the kernels run without no_grad()


def test_constant_states_and_weights_from_constant_nodes():
    """initial_h/initial_c held as initializers are the call's defaults; W from
    a Constant node is read as a constant."""
    model, feeds = node_model("LSTM", direction="bidirectional", states=True, state_inputs=False, seed=3)
    module = from_onnx(model)
    expected = ReferenceEvaluator(model).run(None, feeds)
    assert_onnx_close(run_module(module, feeds), expected, "states as initializers")

    w = next(t for t in model.graph.initializer if t.name == "W")
    model.graph.initializer.remove(w)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["W"], value=w))
    assert_onnx_close(run_module(from_onnx(model), feeds), expected, "W from a Constant node")


def test_zero_peepholes_and_explicit_default_activations_are_accepted():
    model, feeds = node_model("LSTM", {"activations": ["sigmoid", "TANH", "Tanh"]}, states=True, seed=4)
    expected = ReferenceEvaluator(model).run(None, feeds)
    node = model.graph.node[0]
    node.input.extend([""] * (7 - len(node.input)) + ["P"])
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((1, 3 * HIDDEN), np.float32), "P"))
    assert_onnx_close(run_module(from_onnx(model), feeds), expected, "zero P, explicit activations")


@pytest.mark.parametrize("outputs, returned", [(["Y"], 1), (["", "Y_h"], 2), (["Y", "", "Y_c"], 3)])
def test_outputs_as_the_node_lists_them(outputs, returned):
    model, feeds = node_model("LSTM", seed=5)
    expected = ReferenceEvaluator(model).run(None, feeds)
    node = model.graph.node[0]
    del node.output[:]
    node.output.extend(outputs)
    result = from_onnx(model)(torch.from_numpy(feeds["X"]))
    result = result if isinstance(result, tuple) else (result,)
    assert len(result) == returned
    assert_onnx_close([r.numpy() for r in result], expected[:returned], f"outputs {outputs}")


def test_float64_model_runs_in_float64():
    model, feeds = node_model("GRU", direction="bidirectional", lengths=LENGTHS, states=True, dtype=np.float64,
                              seed=6)
    module = from_onnx(model)
    assert module.rnn.weight_hh_l0.dtype == torch.float64
    got = run_module(module, feeds)
    expected = onnx_reference(model, feeds, 0)
    for g, e in zip(got, expected):  # float64 throughout: far inside the float32 rule
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("op, attributes", CELLS[:3], ids=CELL_IDS[:3])
def test_gpu_float16_model_runs_the_16_bit_kernels(untuned, op, attributes):
    """A float16 model on the fp16 kernels, against float64 on the same
    float16 values, by the package's fp16 element bound (tests/helpers.py)."""
    model, feeds = node_model(op, attributes, direction="bidirectional", lengths=LENGTHS, states=True,
                              dtype=np.float16, seed=10)
    module = from_onnx(model)
    assert module.rnn.weight_hh_l0.dtype == torch.float16
    got = run_module(module, feeds, "cuda")
    expected = onnx_reference(*float64_twin(model, feeds), 0)
    for index, (g, e) in enumerate(zip(got, expected)):
        bound = ELEMENT_FLOOR["float16"] * max(1.0, float(np.abs(e).max()))
        assert np.abs(g - e).max() <= bound, f"output {index}: largest error {np.abs(g - e).max():.3g} > {bound:.3g}"


def test_path_inputs(tmp_path):
    model, feeds = node_model("RNN", seed=7)
    path = tmp_path / "rnn.onnx"
    onnx.save(model, str(path))
    expected = ReferenceEvaluator(model).run(None, feeds)
    for source in (path, str(path)):
        assert_onnx_close(run_module(from_onnx(source), feeds), expected, f"from {type(source).__name__}")


# ---- the ONNX project's backend node tests ----------------------------------------------------------

SUPPORTED_BACKEND_CASES = [
    "test_lstm_defaults", "test_lstm_with_initial_bias", "test_lstm_batchwise", "test_lstm_reverse",
    "test_lstm_bidirectional",
    "test_gru_defaults", "test_gru_with_initial_bias", "test_gru_seq_length", "test_gru_batchwise",
    "test_gru_reverse", "test_gru_bidirectional",
    "test_simple_rnn_defaults", "test_simple_rnn_with_initial_bias", "test_rnn_seq_length",
    "test_simple_rnn_batchwise", "test_simple_rnn_reverse", "test_simple_rnn_bidirectional",
]
UNSUPPORTED_BACKEND_CASES = {
    "test_lstm_with_peepholes": "peepholes",  # P is 0.1 everywhere: the cells have no peephole connections
}


@functools.cache
def backend_cases():
    """The onnx package's node test cases of LSTM, GRU and RNN, by name
    (collecting builds every operator's cases: ~7 s, once)."""
    from onnx.backend.test.case.node import collect_testcases

    return {case.name: case for case in collect_testcases()
            if {n.op_type for n in case.model.graph.node} & set(GATES)}


def backend_model(case):
    """The case's model with its weight inputs (W, R, B, P) made initializers
    from the case's data, as an exporter writes them; the rest stays fed."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    node = model.graph.node[0]
    inputs, outputs = case.data_sets[0]
    feeds = dict(zip([v.name for v in case.model.graph.input], inputs))
    weights = {node.input[i] for i in (1, 2, 3, 7) if i < len(node.input) and node.input[i]}
    for value in list(model.graph.input):
        if value.name in weights:
            model.graph.input.remove(value)
            model.graph.initializer.append(numpy_helper.from_array(feeds.pop(value.name), value.name))
    return model, feeds, dict(zip([v.name for v in case.model.graph.output], outputs))


def test_backend_case_list_is_complete():
    known = set(SUPPORTED_BACKEND_CASES) | set(UNSUPPORTED_BACKEND_CASES)
    assert set(backend_cases()) <= known, f"new ONNX backend cases to sort: {set(backend_cases()) - known}"


def _check_backend_case(name, device):
    case = backend_cases().get(name)
    if case is None:
        pytest.skip(f"onnx {onnx.__version__} has no {name}")
    model, feeds, expected = backend_model(case)
    node = model.graph.node[0]
    module = from_onnx(model).to(device)
    inputs = list(node.input) + [""] * 8
    args = [None if not inputs[i] or inputs[i] not in feeds else torch.from_numpy(feeds[inputs[i]]).to(device)
            for i in (0, 4, 5, 6)]
    result = module(*args)
    result = dict(zip(node.output, result if isinstance(result, tuple) else (result,)))
    names = sorted(expected)
    assert_onnx_close([result[n].double().cpu().numpy() for n in names], [expected[n] for n in names], name)


@pytest.mark.parametrize("name", SUPPORTED_BACKEND_CASES)
def test_backend_case(name):
    _check_backend_case(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", SUPPORTED_BACKEND_CASES)
def test_gpu_backend_case(untuned, name):
    _check_backend_case(name, "cuda")


@pytest.mark.parametrize("name, reason", sorted(UNSUPPORTED_BACKEND_CASES.items()))
def test_unsupported_backend_case_names_the_reason(name, reason):
    case = backend_cases().get(name)
    if case is None:
        pytest.skip(f"onnx {onnx.__version__} has no {name}")
    with pytest.raises(UnsupportedError, match=reason):
        from_onnx(backend_model(case)[0])


# ---- what the cells cannot run, and bad models and inputs -------------------------------------------


@pytest.mark.parametrize("op, attributes, inputs, match", [
    ("LSTM", {}, {7: 0.1 * np.ones((1, 3 * HIDDEN), np.float32)}, "input P"),
    ("LSTM", {"activations": ["Sigmoid", "Tanh", "Gelu"]}, {}, "attribute activations.*'gelu' is not among"),
    ("RNN", {"activations": ["ThresholdedRelu"]}, {}, "thresholdedrelu needs its activation_alpha value"),
    ("LSTM", {"activations": ["Sigmoid", "Affine", "Tanh"]}, {}, "affine needs its activation_alpha value"),
])
def test_unsupported_attributes_name_the_node_and_attribute(op, attributes, inputs, match):
    model, _ = node_model(op, attributes)
    node = model.graph.node[0]
    for index, value in inputs.items():
        node.input.extend([""] * (index - len(node.input)) + [f"input{index}"])
        model.graph.initializer.append(numpy_helper.from_array(value, f"input{index}"))
    with pytest.raises(UnsupportedError, match=match) as error:
        from_onnx(model)
    assert f"{op} node '{op.lower()}_node'" in str(error.value)


def test_a_bidirectional_rnn_with_one_activation_says_one_per_direction():
    model = _set_attribute(node_model("RNN", direction="bidirectional")[0], "activations", ["Tanh"])
    with pytest.raises(ArgumentError, match=r"activations: expected 2 names \(1 per direction\), got 1"):
        from_onnx(model)


def test_mixed_rnn_activations_across_directions_are_unsupported():
    model, _ = node_model("RNN", direction="bidirectional")
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("activations", ["Tanh", "Relu"]))
    with pytest.raises(UnsupportedError, match="must be the same in both"):
        from_onnx(model)


def test_weights_fed_at_run_time_are_unsupported():
    model, _ = node_model("GRU")
    r = next(t for t in model.graph.initializer if t.name == "R")
    model.graph.initializer.remove(r)
    model.graph.input.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, list(r.dims)))
    with pytest.raises(UnsupportedError, match="input R .* constant"):
        from_onnx(model)


def _set_attribute(model, name, value):
    node = model.graph.node[0]
    for attribute in list(node.attribute):
        if attribute.name == name:
            node.attribute.remove(attribute)
    node.attribute.append(helper.make_attribute(name, value))
    return model


@pytest.mark.parametrize("name, value, match", [
    ("direction", "backward", r"direction: expected one of \['forward', 'reverse', 'bidirectional'\], "
                              r"got 'backward'"),
    ("layout", 2, "layout: expected 0 or 1, got 2"),
    ("hidden_size", HIDDEN + 1, f"hidden_size: expected {HIDDEN} .*, got {HIDDEN + 1}"),
    ("linear_before_reset", "yes", "linear_before_reset: expected an int, got b?'yes'"),
    ("activations", ["Sigmoid"], r"activations: expected 2 names .*, got 1"),
    ("no_such_attribute", 1, "got 'no_such_attribute'"),
    ("clip", -1.0, r"clip: expected a positive finite float, got -1.0"),
])
def test_malformed_nodes_say_what_was_expected(name, value, match):
    model = _set_attribute(node_model("GRU")[0], name, value)
    with pytest.raises(ArgumentError, match=match):
        from_onnx(model)


def test_bidirectional_weights_for_one_direction_are_refused():
    model = _set_attribute(node_model("LSTM")[0], "direction", "bidirectional")
    with pytest.raises(ArgumentError, match=r"input R: expected shape \[2, "):
        from_onnx(model)


def test_from_onnx_argument_type():
    with pytest.raises(ArgumentTypeError, match="expected a path or an onnx.ModelProto, got int"):
        from_onnx(3)


def test_bad_run_time_inputs():
    model, feeds = node_model("LSTM", lengths=LENGTHS, states=True, seed=8)
    module = from_onnx(model)
    x = torch.from_numpy(feeds["X"])
    with pytest.raises(ArgumentError, match=r"sequence_lens: expected every length in 0\.\.7 .*got \[7, -1, 4\]"):
        module(x, torch.tensor([7, -1, 4], dtype=torch.int32))
    with pytest.raises(ArgumentError, match=r"got \[8, 1, 4\]"):
        module(x, torch.tensor([8, 1, 4]))
    with pytest.raises(ArgumentTypeError, match="sequence_lens: expected an integer tensor, got torch.float32"):
        module(x, torch.tensor([7.0, 1.0, 4.0]))
    with pytest.raises(InputShapeError, match=r"sequence_lens: expected shape \(3,\)"):
        module(x, torch.tensor([7, 1]))
    with pytest.raises(InputShapeError, match=r"initial_h: expected shape \(1, 3, 9\) \[num_directions, "
                                              r"batch_size, hidden_size\], got \(3, 1, 9\)"):
        module(x, None, torch.zeros(3, 1, HIDDEN))
    with pytest.raises(InputShapeError, match=r"X: expected a 3-D tensor \[seq_length, batch_size, input_size\]"):
        module(x[0])


# ---- whole models through onnx2torch ------------------------------------------------------------------


@pytest.fixture
def onnx2torch(monkeypatch):
    """onnx2torch, where installed. It imports torchvision for its NMS and
    RoiAlign converters only; where torchvision is absent, a stand-in
    without those operators lets it import (no model here uses them)."""
    import importlib.util

    if importlib.util.find_spec("onnx2torch") is None:
        pytest.skip('onnx2torch is not installed (pip install "persistrnn[onnx]")')
    if importlib.util.find_spec("torchvision") is None and "onnx2torch" not in sys.modules:
        stand_in, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
        ops.nms = ops.box_convert = ops.roi_align = None
        stand_in.ops = ops
        monkeypatch.setitem(sys.modules, "torchvision", stand_in)
        monkeypatch.setitem(sys.modules, "torchvision.ops", ops)
    import onnx2torch

    return onnx2torch


def stacked_model(seed=9):
    """A tagger as exporters write one: a bidirectional canonical GRU, its Y
    reshaped to [T, B, 2H], a forward LSTM on that with initial states from
    graph inputs, and a MatMul + Add read-out per step."""
    rng = np.random.default_rng(seed)

    def init(name, shape):
        return numpy_helper.from_array((0.5 * rng.standard_normal(shape)).astype(np.float32), name)

    classes = 4
    nodes = [
        helper.make_node("GRU", ["X", "W1", "R1", "B1"], ["Y1"], name="encoder", hidden_size=HIDDEN,
                         direction="bidirectional"),
        helper.make_node("Transpose", ["Y1"], ["Y1t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["Y1t", "shape"], ["H1"]),
        helper.make_node("LSTM", ["H1", "W2", "R2", "B2", "", "h0", "c0"], ["Y2", "Y2_h"], name="decoder",
                         hidden_size=HIDDEN + 2),
        helper.make_node("Squeeze", ["Y2", "axis"], ["H2"]),
        helper.make_node("MatMul", ["H2", "head"], ["logits0"]),
        helper.make_node("Add", ["logits0", "bias"], ["logits"]),
    ]
    initializers = [
        init("W1", (2, 3 * HIDDEN, INPUT)), init("R1", (2, 3 * HIDDEN, HIDDEN)), init("B1", (2, 6 * HIDDEN)),
        init("W2", (1, 4 * (HIDDEN + 2), 2 * HIDDEN)), init("R2", (1, 4 * (HIDDEN + 2), HIDDEN + 2)),
        init("B2", (1, 8 * (HIDDEN + 2))), init("head", (HIDDEN + 2, classes)), init("bias", (classes,)),
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "shape"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
    ]
    graph = helper.make_graph(nodes, "tagger", [
        helper.make_tensor_value_info("X", TensorProto.FLOAT, ["steps", "batch", INPUT]),
        helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, "batch", HIDDEN + 2]),
        helper.make_tensor_value_info("c0", TensorProto.FLOAT, [1, "batch", HIDDEN + 2]),
    ], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=ORT_IR_VERSION)
    feeds = {"X": rng.standard_normal((STEPS, BATCH, INPUT)).astype(np.float32),
             "h0": rng.standard_normal((1, BATCH, HIDDEN + 2)).astype(np.float32),
             "c0": rng.standard_normal((1, BATCH, HIDDEN + 2)).astype(np.float32)}
    return model, feeds


def _check_whole_model(device):
    model, feeds = stacked_model()
    module = from_onnx(model).to(device)
    nodes = [m for m in module.modules() if isinstance(m, RecurrentNode)]
    assert [(n.op_type, n.rnn.cell) for n in nodes] == [("GRU", "gru_reset_before"), ("LSTM", "lstm")]
    with torch.no_grad():
        got = module(*[torch.from_numpy(feeds[v.name]).to(device) for v in model.graph.input])
    assert_onnx_close([got.double().cpu().numpy()], ReferenceEvaluator(model).run(None, feeds), "whole model")


def test_whole_model_through_onnx2torch(onnx2torch):
    _check_whole_model("cpu")


@pytest.mark.gpu
def test_gpu_whole_model_through_onnx2torch(untuned, onnx2torch):
    _check_whole_model("cuda")


def test_whole_model_without_onnx2torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx2torch", None)  # as if not installed
    with pytest.raises(UnsupportedError, match=r"onnx2torch.*pip install \"persistrnn\[onnx\]\".*torchvision"):
        from_onnx(stacked_model()[0])


def test_unsupported_node_in_a_whole_model_fails_before_onnx2torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx2torch", None)
    model = _set_attribute(stacked_model()[0], "activations", ["Gelu", "Tanh"] * 2)  # bidirectional
    with pytest.raises(UnsupportedError, match="GRU node 'encoder': attribute activations"):
        from_onnx(model)


# ---- python -m persistrnn onnx ------------------------------------------------------------------------


def test_cli_without_a_gpu_prints_the_conversion(tmp_path, capsys, monkeypatch):
    from persistrnn import __main__ as cli
    from persistrnn import runtime
    from persistrnn.errors import GPUUnavailableError

    def no_gpu():
        raise GPUUnavailableError("no CUDA device")

    monkeypatch.setattr(runtime, "device_facts", no_gpu)
    model, _ = node_model("GRU", direction="bidirectional", lengths=LENGTHS)
    _set_attribute(model, "hidden_size", HIDDEN)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "steps"
    path = tmp_path / "gru.onnx"
    onnx.save(model, str(path))
    assert cli.main(["onnx", str(path), "--steps", "11"]) == 0
    out = capsys.readouterr().out
    assert "GRU node 'gru_node' (input 5, hidden 9, bidirectional, layout 0, linear_before_reset=0) -> " \
           "persistrnn.GRU(cell 'gru_reset_before', bidirectional" in out
    assert "X [11, 3, 5] float32" in out and "sequence_lens [3] int32 (full lengths)" in out
    assert "timing needs a GPU" in out


def test_cli_refuses_an_unsupported_model(tmp_path, capsys):
    from persistrnn import __main__ as cli

    path = tmp_path / "elu.onnx"
    onnx.save(node_model("LSTM", {"activations": ["Sigmoid", "Gelu", "Tanh"]})[0], str(path))
    assert cli.main(["onnx", str(path)]) == 2
    assert "'gelu' is not among the activations the cells compute" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_cli_times_against_onnxruntime(untuned, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from persistrnn import __main__ as cli

    path = tmp_path / "lstm.onnx"
    onnx.save(node_model("LSTM", direction="bidirectional")[0], str(path))
    assert cli.main(["onnx", str(path)]) == 0
    out = capsys.readouterr().out
    assert "LSTM node 'lstm_node' at batch 3: persistent kernels" in out
    assert "ONNX Runtime CPUExecutionProvider:" in out and "outputs differ by at most" in out


def test_the_speed_target_models_import_as_their_cells(tmp_path):
    # scripts/onnx_models.py writes the models `gpu_check.sh`'s onnx stage times:
    # the canonical GRU must come back as the reset-before GRU, the LSTM as an
    # LSTM, and both must give ONNX's reference outputs.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "onnx_models.py"
    spec = importlib.util.spec_from_file_location("onnx_models", path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    written = {p.stem: p for p in models.write(tmp_path)}
    assert sorted(written) == ["gru256", "lstm256"]
    x = np.random.default_rng(3).standard_normal((7, 2, 256)).astype(np.float32)
    for name, cell in (("gru256", "gru_reset_before"), ("lstm256", "lstm")):
        module = persistrnn.from_onnx(str(written[name]))
        assert [m.rnn.cell for m in module.modules() if isinstance(m, RecurrentNode)] == [cell]
        want = ReferenceEvaluator(str(written[name])).run(None, {"X": x})
        with torch.no_grad():
            got = module(torch.from_numpy(x))
        assert len(got) == len(want) == 2  # Y (T, 1, B, H) and Y_h (1, B, H)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.abs(g.numpy() - w).max() <= 1e-5 * np.abs(w).max() + 1e-6


def test_a_nonzero_linear_before_reset_is_torchs_gru_and_trailing_unnamed_outputs_are_left_out():
    # ONNX applies the product before the reset for any nonzero value (ONNX
    # Runtime takes 2); a node whose outputs are ["Y", ""] gives Y alone.
    model, feeds = node_model("GRU", {"linear_before_reset": 2})
    want = ReferenceEvaluator(model).run(None, feeds)
    module = from_onnx(model)
    assert module.rnn.cell == "gru"
    for got, expected in zip(run_module(module, feeds), want, strict=True):
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() + 1e-6
    del model.graph.node[0].output[1:]
    model.graph.node[0].output.append("")
    del model.graph.output[1:]
    assert len(run_module(from_onnx(model), feeds)) == 1


def test_unnamed_node_outputs_get_names_of_their_own_before_a_whole_model_is_converted():
    # onnx2torch lists node outputs by name: an unnamed output ("") would be
    # taken for a missing optional input of a later recurrent node.
    from persistrnn.onnx_import import _named_outputs

    model, _ = node_model("LSTM")
    node = model.graph.node[0]
    del node.output[:]
    node.output.extend(["", "Y_h", ""])
    node.input.extend(["", ""])  # missing optional inputs stay missing
    named = _named_outputs(model)
    outputs = list(named.graph.node[0].output)
    assert outputs[1] == "Y_h" and all(outputs) and len(set(outputs)) == 3
    assert list(named.graph.node[0].input)[-2:] == ["", ""]
