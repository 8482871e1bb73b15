"""The dynamic package on the CPU: readers, the expression API, script
generation, the reference interpreter against plain PyTorch autograd in
float64 on real SST trees and WikiNER sentences, the optimisers, and an NVRTC
compile of every interpreter-kernel variant for sm_90.

The PyTorch models here are written from the equations (not from the
scripts): the ground truth of these tests and of tests/test_dynamic_gpu.py."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from pathlib import Path

from persistrnn import dynamic
from persistrnn.dynamic.graph import OP

TEST_DATA = Path(__file__).resolve().parent / "data"
"""The first 64 SST dev trees and 32 WikiNER dev sentences (real data, small enough for CI)."""


def torch_params(model: dynamic.Model, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """Every parameter as a float64 leaf tensor that collects its gradient."""
    return {p.name: torch.tensor(model.view(flat, p).astype(np.float64), requires_grad=True)
            for p in model.parameters}


def tree_lstm_loss(builder: dynamic.TreeLSTM, P: dict[str, torch.Tensor], tree: dynamic.Tree,
                   ids: dict[str, int]) -> torch.Tensor:
    H = builder.hidden
    b_iou, b_f, b_out = P["b_iou"][:, 0], P["b_f"][:, 0], P["b_out"][:, 0]

    def visit(node: dynamic.Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kids = [visit(c) for c in node.children]
        iou = b_iou.clone()
        if node.word is not None:
            iou = iou + P["W_iou"] @ P["embed"][ids[node.word]]
        if kids:
            hs = [h for h, _, _ in kids]
            h_in = torch.cat(hs) if builder.variant == "binary" else torch.stack(hs).sum(0)
            iou = iou + (P["U"][:3 * H] if builder.variant == "binary" else P["U_iou"]) @ h_in
        c = torch.sigmoid(iou[:H]) * torch.tanh(iou[2 * H:])
        if builder.variant == "binary" and kids:
            f = torch.sigmoid(P["U"][3 * H:] @ h_in + b_f)
            c = c + f[:H] * kids[0][1] + f[H:] * kids[1][1]
        for h_k, c_k, _ in kids if builder.variant == "childsum" else ():
            c = c + torch.sigmoid(P["U_f"] @ h_k + b_f) * c_k
        h = torch.sigmoid(iou[H:2 * H]) * torch.tanh(c)
        logits = P["W_out"] @ h + b_out
        loss = torch.nn.functional.cross_entropy(logits[None], torch.tensor([node.label]), reduction="sum")
        return h, c, loss + sum(l for _, _, l in kids)

    return visit(tree)[2]


def tagger_loss(builder: dynamic.BiLSTMTagger, P: dict[str, torch.Tensor], words: list[int],
                tags: list[int]) -> torch.Tensor:
    H = builder.hidden

    def lstm(xs: list[torch.Tensor], d: str) -> list[torch.Tensor]:
        h = torch.zeros(H, dtype=torch.float64)
        c = torch.zeros(H, dtype=torch.float64)
        out = []
        for x in xs:
            z = P[f"W_x_{d}"] @ x + P[f"W_h_{d}"] @ h + P[f"b_{d}"][:, 0]
            i, f, g, o = z.split(H)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(h)
        return out

    xs = [P["embed"][w] for w in words]
    fwd, bwd = lstm(xs, "fwd"), lstm(xs[::-1], "bwd")[::-1]
    logits = torch.stack([P["W_out"] @ torch.cat([a, b]) + P["b_out"][:, 0] for a, b in zip(fwd, bwd)])
    return torch.nn.functional.cross_entropy(logits, torch.tensor(tags), reduction="sum")


def flat_grads(model: dynamic.Model, P: dict[str, torch.Tensor]) -> np.ndarray:
    """The tensors' gradients in the model's flat layout (zeros where none came)."""
    out = np.zeros(model.total_floats)
    offsets = model.layout()
    for p in model.parameters:
        g = P[p.name].grad
        if g is not None:
            out[offsets[p.name]:offsets[p.name] + p.size] = g.numpy().ravel()
    return out


def sst_batch(count: int, hidden: int = 12, embedding: int = 10, variant: str = "binary", seed: int = 0,
              start: int = 0):
    """A Tree-LSTM over ``count`` real SST dev trees: (model, builder, trees, vocabulary, graph)."""
    trees = dynamic.read_sst(TEST_DATA / "sst-dev.txt", limit=start + count)[start:]
    vocab = dynamic.Vocabulary(w for t in trees for w in t.words())
    model = dynamic.Model(seed)
    builder = dynamic.TreeLSTM(model, len(vocab), embedding, hidden, variant=variant)
    graph = dynamic.Graph(model)
    for t in trees:
        builder.build(graph, t, vocab)
    return model, builder, trees, vocab, graph


def wikiner_batch(count: int, hidden: int = 12, embedding: int = 10, seed: int = 0, start: int = 0):
    """A BiLSTM tagger over ``count`` real WikiNER sentences: (model, builder, sentences ids, graph)."""
    sentences = dynamic.read_wikiner(TEST_DATA / "wikiner-dev.txt", limit=start + count)[start:]
    words = dynamic.Vocabulary(w for s in sentences for w, _ in s)
    tags = dynamic.Vocabulary((t for s in sentences for _, t in s), unk=False)
    model = dynamic.Model(seed)
    builder = dynamic.BiLSTMTagger(model, len(words), len(tags), embedding, hidden)
    graph = dynamic.Graph(model)
    encoded = []
    for s in sentences:
        ids = (words.encode([w for w, _ in s]), tags.encode([t for _, t in s]))
        builder.build(graph, *ids)
        encoded.append(ids)
    return model, builder, encoded, graph


# ---- tests -------------------------------------------------------------------

import pytest  # noqa: E402

from persistrnn.errors import ArgumentError, ArgumentTypeError, ConfigError  # noqa: E402

TOLERANCE = 1e-10
"""The reference interpreter and torch both run float64: they differ by summation order only."""


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-300))


def reference_against_torch(model, graph, blocks, loss_fn, placement="partition"):
    flat = model.initial_values()
    script = dynamic.schedule(graph, blocks, placement=placement)
    got = dynamic.run_script(script, flat)
    P = torch_params(model, flat)
    want = loss_fn(P)
    want.backward()
    return got, float(want.detach()), flat_grads(model, P)


# Block counts: 1 (everything on one block), 3 (fewer blocks than the binary
# model's 3 matrices plus... exactly 3: one block per matrix), 7 (odd row
# remainders), 64 (more blocks than most matrices have rows), 132 (an H100's
# SMs: most blocks idle). Hidden 13 and embedding 10: odd sizes.
@pytest.mark.parametrize("placement", dynamic.PLACEMENTS)
@pytest.mark.parametrize("blocks", [1, 3, 7, 64, 132])
@pytest.mark.parametrize("variant", ["binary", "childsum"])
def test_tree_lstm_reference_matches_torch_on_sst(variant, blocks, placement):
    model, builder, trees, vocab, graph = sst_batch(5, hidden=13, variant=variant, seed=blocks)
    got, loss, grads = reference_against_torch(
        model, graph, blocks, lambda P: sum(tree_lstm_loss(builder, P, t, vocab.ids) for t in trees), placement)
    assert abs(got.loss - loss) <= TOLERANCE * abs(loss)
    assert rel(got.param_grads, grads) <= TOLERANCE
    for p in model.parameters:  # every parameter got a gradient, none is silently skipped
        assert np.abs(model.view(got.param_grads, p)).max() > 0, p.name


def test_childsum_takes_any_number_of_children():
    tree = dynamic.parse_tree("(1 (2 a) (3 (4 b) (0 c) (2 d)) (1 e))")
    model = dynamic.Model(3)
    vocab = dynamic.Vocabulary(tree.words())
    builder = dynamic.TreeLSTM(model, len(vocab), 6, 8, variant="childsum")
    graph = dynamic.Graph(model)
    builder.build(graph, tree, vocab)
    got, loss, grads = reference_against_torch(model, graph, 3, lambda P: tree_lstm_loss(builder, P, tree, vocab.ids))
    assert abs(got.loss - loss) <= TOLERANCE * abs(loss)
    assert rel(got.param_grads, grads) <= TOLERANCE


@pytest.mark.parametrize("placement", dynamic.PLACEMENTS)
@pytest.mark.parametrize("blocks", [1, 4, 5, 33, 132])
def test_tagger_reference_matches_torch_on_wikiner(blocks, placement):
    # 4 blocks: fewer than the tagger's 5 matrices (the partition falls back to spread).
    model, builder, sentences, graph = wikiner_batch(3, seed=blocks)
    got, loss, grads = reference_against_torch(
        model, graph, blocks, lambda P: sum(tagger_loss(builder, P, w, t) for w, t in sentences), placement)
    assert abs(got.loss - loss) <= TOLERANCE * abs(loss)
    assert rel(got.param_grads, grads) <= TOLERANCE


@pytest.mark.parametrize("optimizer", [dynamic.SGD(0.3), dynamic.Adam(0.01)], ids=["sgd", "adam"])
def test_update_matches_torch_optim_over_steps(optimizer):
    model, builder, trees, vocab, graph = sst_batch(2, seed=11)
    script = dynamic.schedule(graph, 4)
    flat = model.initial_values().astype(np.float64)
    P = torch_params(model, flat)
    if isinstance(optimizer, dynamic.SGD):
        torch_opt = torch.optim.SGD(P.values(), lr=optimizer.lr)
    else:
        torch_opt = torch.optim.Adam(P.values(), lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                                     eps=optimizer.eps)
    state: dict = {}
    for step in range(1, 4):
        got = dynamic.run_script(script, flat, optimizer, step=step, state=state)
        torch_opt.zero_grad()
        loss = sum(tree_lstm_loss(builder, P, t, vocab.ids) for t in trees)
        loss.backward()
        torch_opt.step()
        assert abs(got.loss - loss.item()) <= TOLERANCE * loss.item()
        flat = got.params
        want = np.zeros_like(flat)
        for p in model.parameters:
            o = model.layout()[p.name]
            want[o:o + p.size] = P[p.name].detach().numpy().ravel()
        assert rel(flat, want) <= TOLERANCE


@pytest.mark.parametrize("blocks", [1, 3])
def test_the_fused_gated_products_match_torch(blocks):
    """sigmoid_mul and sigmoid_mul_tanh, each input in both positions of
    both ops, forward and backward, against their unfused torch formulas."""
    model = dynamic.Model(7)
    w = model.matrix("W", 5, 9)
    a, b = model.bias("a", 9), model.bias("b", 9)
    g = dynamic.Graph(model)
    x, y = g.parameter(a), g.parameter(b)
    mixed = g.sigmoid_mul(x, y) + g.sigmoid_mul_tanh(y, x)
    g.loss(g.matvec(w, g.sigmoid_mul_tanh(x, mixed) + g.sigmoid_mul(mixed, y)), 3)

    flat = model.initial_values()
    for p in (a, b):  # past sigmoid's and tanh's linear range
        model.view(flat, p)[...] *= 3
    got = dynamic.run_script(dynamic.schedule(g, blocks), flat)
    P = torch_params(model, flat)
    X, Y = P["a"][:, 0], P["b"][:, 0]
    m = torch.sigmoid(X) * Y + torch.sigmoid(Y) * torch.tanh(X)
    z = P["W"] @ (torch.sigmoid(X) * torch.tanh(m) + torch.sigmoid(m) * Y)
    want = torch.logsumexp(z, 0) - z[3]
    want.backward()
    assert abs(got.loss - want.item()) <= TOLERANCE * abs(want.item())
    assert rel(got.param_grads, flat_grads(model, P)) <= TOLERANCE
    assert all(np.abs(model.view(got.param_grads, p)).min() > 0 for p in (a, b))


def torch_lstm_cell(z, c=None):
    """[h; c'] of an LSTM cell in torch from its gates z = [i, f, g, o] and its cell c (None: zero state)."""
    i, f, g, o = z.split(z.numel() // 4)
    c = torch.sigmoid(i) * torch.tanh(g) + (0 if c is None else torch.sigmoid(f) * c)
    return torch.cat([torch.sigmoid(o) * torch.tanh(c), c])


def torch_tree_cell(z, cs=()):
    """[h; c'] of a Tree-LSTM cell in torch from its gates z = [i, o, u, f_1, ...] and its children's cells cs."""
    n = z.numel() // (3 + len(cs))
    i, o, u = z[:3 * n].split(n)
    forget = [torch.sigmoid(z[(3 + k) * n:(4 + k) * n]) * ck for k, ck in enumerate(cs)]
    c = torch.sigmoid(i) * torch.tanh(u) + sum(forget)
    return torch.cat([torch.sigmoid(o) * torch.tanh(c), c])


def cells_graph(n: int = 7):
    """Both cells with a carried cell and from zero state, their h and c read
    by one matvec and a loss; every input a bias of its own. Returns (model,
    biases by name, graph, the biases' expressions by name, n)."""
    model = dynamic.Model(3)
    w = model.matrix("W", 5, 8 * n)
    names = {"z_lstm": 4 * n, "c_lstm": n, "z_first": 4 * n, "z_tree": 5 * n, "c_tree": 2 * n, "z_leaf": 3 * n}
    biases = {k: model.bias(k, size) for k, size in names.items()}
    g = dynamic.Graph(model)
    x = {k: g.parameter(p) for k, p in biases.items()}
    states = [g.lstm_cell(x["z_lstm"], x["c_lstm"]), g.lstm_cell(x["z_first"]),
              g.tree_cell(x["z_tree"], x["c_tree"]), g.tree_cell(x["z_leaf"])]
    g.loss(g.matvec(w, g.concat(states)), 2)
    return model, biases, g, x, n


@pytest.mark.parametrize("blocks", [1, 4])
def test_the_cells_match_torch_with_and_without_a_carried_cell(blocks):
    """lstm_cell and tree_cell, each with a carried cell and from zero state,
    h and c both read downstream, forward and backward, against the cell
    equations in torch; odd sizes, pre-activations past the linear range."""
    model, biases, g, x, n = cells_graph()
    flat = model.initial_values()
    for p in biases.values():
        model.view(flat, p)[...] *= 4
    got = dynamic.run_script(dynamic.schedule(g, blocks), flat)
    names = list(biases)

    P = torch_params(model, flat)
    v = {k: P[k][:, 0] for k in names}
    c_tree = v["c_tree"]
    logits = P["W"] @ torch.cat([torch_lstm_cell(v["z_lstm"], v["c_lstm"]), torch_lstm_cell(v["z_first"]),
                                 torch_tree_cell(v["z_tree"], [c_tree[:n], c_tree[n:]]),
                                 torch_tree_cell(v["z_leaf"])])
    want = torch.logsumexp(logits, 0) - logits[2]
    want.backward()
    assert abs(got.loss - want.item()) <= TOLERANCE * abs(want.item())
    grads = flat_grads(model, P)
    assert rel(got.param_grads, grads) <= TOLERANCE
    for k in names:  # every input got a gradient (the zero-state cells' unused forget gates excepted)
        nonzero = np.abs(model.view(got.param_grads, biases[k])[:, 0]) > 0
        unused = {"z_first": slice(n, 2 * n)}.get(k)
        if unused is not None:
            assert not nonzero[unused].any()
            nonzero[unused] = True
        assert nonzero.all(), k
    with pytest.raises(ArgumentError, match=r"lstm_cell: expected gates of 4 \* n floats and a carried cell of 1 "
                                            r"\* n, got 35 and 7"):
        g.lstm_cell(x["z_tree"], x["c_lstm"])
    with pytest.raises(ArgumentError, match=r"tree_cell: expected gates of 3 \* n floats, got 28"):
        g.tree_cell(x["z_lstm"])


def cell_matvecs_graph(n: int = 7, width: int = 5, copies: int = 1):
    """Every form of a cell over its matvec: an LSTM step from a state and
    from an input vector (zero state), a tree node of two children, of one
    child (the LSTM step's output: two cell matvecs chained) and a leaf; and
    a plain matvec with a gated matrix. Their states are read by one matvec
    and a loss; every input is a bias of its own. ``copies`` > 1: the whole
    pattern again on scaled inputs, so that each instruction lists several
    vectors. Returns (model, graph, the biases by name, n, width)."""
    model = dynamic.Model(5)
    mats = {"W_lstm": (4 * n, n, 4), "W_first": (4 * n, width, 4), "U_two": (5 * n, 2 * n, 5),
            "U_one": (4 * n, n, 4), "W_leaf": (3 * n, width, 3)}
    mats = {k: model.matrix(k, *shape[:2], gates=shape[2]) for k, shape in mats.items()}
    w = model.matrix("W", 5, 10 * n + 4 * n)
    names = {"x": width, "s1": 2 * n, "s2": 2 * n, "z4": 4 * n, "z5": 5 * n, "z4b": 4 * n, "z3": 3 * n}
    biases = {k: model.bias(k, size) for k, size in names.items()}
    g = dynamic.Graph(model)
    x0 = {k: g.parameter(p) for k, p in biases.items()}
    for copy in range(copies):
        x = x0 if copy == 0 else {k: g.tanh(v * g.sigmoid(v)) for k, v in x0.items()}
        step = g.lstm_matvec(mats["W_lstm"], x["s1"], x["z4"])
        states = [step, g.lstm_matvec(mats["W_first"], x["x"], x["z4b"]),
                  g.tree_matvec(mats["U_two"], [x["s1"], x["s2"]], x["z5"]),
                  g.tree_matvec(mats["U_one"], [step], x["z4"]), g.tree_matvec(mats["W_leaf"], [x["x"]], x["z3"]),
                  g.matvec(mats["W_lstm"], x["s2"][0:n])]
        g.loss(g.matvec(w, g.concat(states)), 3)
    return model, g, biases, n, width


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_the_cell_matvecs_match_torch(blocks):
    """lstm_matvec and tree_matvec in every form, forward and backward,
    against matvec + cell in torch; odd sizes, whole units per block (8
    blocks: some hold one unit of a matrix, 3: uneven units)."""
    model, g, biases, n, width = cell_matvecs_graph()
    flat = model.initial_values()
    for p in biases.values():
        model.view(flat, p)[...] *= 3
    script = dynamic.schedule(g, blocks)
    got = dynamic.run_script(script, flat)
    for k in range(len(script.layout.rows)):  # every block keeps whole units: all gates of each
        gates = script.layout.gates[k]
        for b in range(blocks):
            units = script.layout.block_rows(k, b).reshape(gates, -1) % (script.layout.rows[k] // gates)
            assert (units == units[0]).all()
    P = torch_params(model, flat)
    v = {k: P[k][:, 0] for k in biases}
    lstm, tree = torch_lstm_cell, torch_tree_cell
    s1, s2 = v["s1"], v["s2"]
    step = lstm(P["W_lstm"] @ s1[:n] + v["z4"], s1[n:])
    states = [step, lstm(P["W_first"] @ v["x"] + v["z4b"]),
              tree(P["U_two"] @ torch.cat([s1[:n], s2[:n]]) + v["z5"], [s1[n:], s2[n:]]),
              tree(P["U_one"] @ step[:n] + v["z4"], [step[n:]]), tree(P["W_leaf"] @ v["x"] + v["z3"]),
              P["W_lstm"] @ s2[:n]]
    logits = P["W"] @ torch.cat(states)
    want = torch.logsumexp(logits, 0) - logits[3]
    want.backward()
    assert abs(got.loss - want.item()) <= TOLERANCE * abs(want.item())
    assert rel(got.param_grads, flat_grads(model, P)) <= TOLERANCE
    for p in model.parameters:
        assert np.abs(model.view(got.param_grads, p)).max() > 0, p.name


def test_the_cell_matvecs_refuse_what_they_cannot_run():
    model = dynamic.Model(0)
    plain = model.matrix("plain", 12, 3)
    lstm = model.matrix("lstm", 12, 3, gates=4)
    tree = model.matrix("tree", 15, 6, gates=5)
    with pytest.raises(ArgumentError, match="matrix 'odd': expected rows a multiple of its 4 gates, got 10"):
        model.matrix("odd", 10, 3, gates=4)
    g = dynamic.Graph(model)
    state, z12, z15 = (g.parameter(model.bias(k, s)) for k, s in (("s", 6), ("z12", 12), ("z15", 15)))
    with pytest.raises(ArgumentError, match=r"lstm_matvec: expected a matrix declared with gates=4 \(LSTM cell, 1 "
                                            r"carried\), got 'plain' with gates=1"):
        g.lstm_matvec(plain, state, z12)
    with pytest.raises(ArgumentError, match=r"tree_matvec: 'tree' takes an input of 6 or 2 state\(s\) \[h; c\] of 6 "
                                            r"each, got \[6, 12\]"):
        g.tree_matvec(tree, [state, z12], z15)
    with pytest.raises(ArgumentError, match=r"lstm_matvec: expected an addend of 12 \(the gates\), got 15"):
        g.lstm_matvec(lstm, state, z15)
    with pytest.raises(ArgumentError, match="tree_matvec: expected one or two inputs, got 3"):
        g.tree_matvec(tree, [state] * 3, z15)
    assert g.tree_matvec(tree, [state, state], z15).size == 6 and g.lstm_matvec(lstm, state, z12).size == 6


def test_biases_declared_one_after_another_read_as_one_parameter():
    model = dynamic.Model(0)
    a, m, b, c = model.bias("a", 3), model.matrix("M", 2, 2), model.bias("b", 2), model.bias("c", 4)
    g = dynamic.Graph(model)
    ab = g.parameter(a, b)
    g.loss(g.concat([ab, g.parameter(c)]), 1)
    flat = model.initial_values()
    got = dynamic.run_script(dynamic.schedule(g, 2), flat)
    np.testing.assert_array_equal(got.values[:5], np.concatenate([model.view(flat, a), model.view(flat, b)])[:, 0])
    assert np.abs(model.view(got.param_grads, a)).min() > 0 and np.abs(model.view(got.param_grads, b)).min() > 0
    with pytest.raises(ArgumentError, match=r"declared one after another, got \['a', 'c'\]"):
        g.parameter(a, c)
    with pytest.raises(ArgumentError, match="expected a bias parameter"):
        g.parameter(a, m)


def test_inference_script_gives_the_training_loss():
    model, builder, trees, vocab, graph = sst_batch(3)
    flat = model.initial_values()
    train = dynamic.run_script(dynamic.schedule(graph, 6), flat)
    infer = dynamic.run_script(dynamic.schedule(graph, 6, train=False), flat)
    assert infer.grads is None and abs(infer.loss - train.loss) <= TOLERANCE * train.loss


def test_the_reference_saturates_without_overflow_on_large_parameters():
    """Parameters trained to large values (the benches time many updates before a later refcheck) drive
    gate pre-activations past exp's float64 range: the reference's sigmoid must give 0 or 1 there, not
    warn, and the loss must stay finite."""
    import warnings

    model, builder, trees, vocab, graph = sst_batch(3)
    flat = model.initial_values() * 1e4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = dynamic.run_script(dynamic.schedule(graph, 6, train=False), flat)
    assert np.isfinite(result.loss)


# ---- script structure ----------------------------------------------------------

def test_script_structure():
    from persistrnn.dynamic.graph import OP
    from persistrnn.dynamic.script import BACKWARD, OPCODES, WORDS

    model, builder, trees, vocab, graph = sst_batch(4)
    blocks = 9
    script = dynamic.schedule(graph, blocks)
    assert script.starts[0] == 0 and script.starts[-1] == script.instructions <= len(script.program)
    assert np.all(np.diff(script.starts) >= 0)
    signals = 0
    operands = {}  # forward opcode -> operand rows over all instructions
    for b in range(blocks):
        prog = script.block_program(b)
        targets = prog[prog[:, 0] == OPCODES["wait"], 3]
        assert np.all(np.diff(targets) > 0), "a block's wait targets only grow"
        signals += int((prog[:, 0] == OPCODES["signal"]).sum())
        assert prog[-1, 0] == OPCODES["wait"] and prog[-1, 3] == script.signals  # the closing barrier
        for inst in prog[(prog[:, 0] > OPCODES["signal"]) & (prog[:, 0] < BACKWARD)]:
            rows = script.operands(inst)
            assert len(rows) == inst[2] > 0
            if inst[0] == OPCODES["matvec"]:  # one matrix per instruction, on a block that holds rows of it
                assert np.all(rows[:, 3] == rows[0, 3]) and script.layout.block_rows(rows[0, 3], b).size > 0
            if inst[0] == OPCODES["tree_matvec"]:  # the matrix in the instruction (its operands' p: the addend)
                assert script.layout.block_rows(inst[1] // 4, b).size > 0 and inst[1] % 4 in (0, 2)
            operands.setdefault(int(inst[0]), []).append(rows)
    assert signals == script.signals
    # Every node but a slice and a concat is one operand row forward (a matvec
    # one per holder block), a concat one row per part; backward mirrors forward.
    g = graph.arrays()
    count = {k: sum(len(r) for r in v) for k, v in operands.items()}
    holders = np.asarray(script.layout.holders)
    slot = {m.index: k for k, m in enumerate(model.matrices)}
    for name in ("matvec", "tree_matvec"):
        assert count[OPCODES[name]] == sum(holders[slot[e]] for o, e in zip(g["op"], g["extra"]) if o == OP[name])
    assert count.get(OPCODES["copy"], 0) == len(g["concat_part"])
    assert count[OPCODES["loss"]] == len(script.losses) == sum(len(t.nodes()) for t in trees)
    for name in ("add", "mul", "tanh", "sigmoid", "lookup", "sigmoid_mul", "sigmoid_mul_tanh", "lstm_cell",
                 "tree_cell", "lstm_matvec"):
        assert count.get(OPCODES[name], 0) == (g["op"] == OP[name]).sum(), name
    ops = script.program[:script.instructions, 0]
    for code in count:
        assert (ops == code).sum() == (ops == code + BACKWARD).sum()
    assert script.program.dtype == np.int32 and script.program.shape[1] == WORDS


def test_a_stage_costs_one_instruction_per_block_and_op_not_one_per_node():
    # VPPS placement: the matvecs of a stage on one matrix are one instruction
    # per holder block, and the elementwise nodes of one depth and op on a
    # block are one instruction, so 16 trees take far fewer instructions than
    # 16 times one tree.
    from persistrnn.dynamic.script import OPCODES

    model, builder, trees, vocab, _ = sst_batch(16, hidden=256, embedding=256)
    one, batch = dynamic.Graph(model), dynamic.Graph(model)
    builder.build(one, trees[0], vocab)
    for t in trees:
        builder.build(batch, t, vocab)
    single, many = dynamic.schedule(one, 132), dynamic.schedule(batch, 132)
    assert many.instructions < 4 * single.instructions
    program = many.program[:many.instructions]
    matvecs = program[program[:, 0] == OPCODES["matvec"]]
    stages = many.stages // 2
    assert len(matvecs) <= stages * 132  # at most one per block and stage
    assert matvecs[:, 2].max() > 16  # some list many vectors


def test_the_partition_gives_each_matrix_its_own_blocks():
    model = dynamic.Model(0)
    dynamic.TreeLSTM(model, 50, 256, 256)
    lay = dynamic.matrix_layout(model, 132)
    owner = np.full(132, -1)
    for k in range(len(lay.rows)):
        blocks = [b for b in range(132) if lay.block_rows(k, b).size > 0]
        assert blocks == list(range(lay.first_block[k], lay.first_block[k] + lay.holders[k]))
        assert np.all(owner[blocks] == -1), "matrices do not share blocks"
        owner[blocks] = k
        covered = sorted(r for b in blocks for r in lay.block_rows(k, b))
        assert covered == list(range(lay.rows[k])), "every row on exactly one block"
    assert lay.shared_offset == (0,) * len(lay.rows)
    # The cache per block is within 30% of an even split of all matrices.
    even = sum(r * c for r, c in zip(lay.rows, lay.cols)) / 132
    assert lay.shared_floats <= 1.3 * even
    spread = dynamic.matrix_layout(model, 132, "spread")
    # 768, 1280 and 5 rows: 6, 10 and 1 per block, from block 0.
    assert spread.first_block == (0, 0, 0) and spread.holders == (128, 128, 5)
    with pytest.raises(ArgumentError, match="placement must be one of"):
        dynamic.matrix_layout(model, 132, "diagonal")


def test_replicas_hold_whole_matrices_on_further_blocks_and_share_the_vectors():
    from persistrnn.dynamic.script import OPCODES

    model = dynamic.Model(0)
    dynamic.TreeLSTM(model, 50, 256, 256)
    from persistrnn.dynamic.script import ROW_GROWTH

    partition = dynamic.matrix_layout(model, 132)
    lay = dynamic.kernel_layout(model, 132, "replicate", H100_SHARED)
    assert lay.first_block == partition.first_block
    # W_iou (768 x 256, 29 holders of 9 units' 3 gates under the partition), U (1280 x 512, 86 of 3 units'
    # 5 gates) and W_out (5 x 256, 1) gain a replica each in turn, on fewer holders with more units where
    # the replicas would not fit, until the caches fill an H100's shared memory; W_out alone then goes on
    # to every block.
    assert (partition.holders, partition.rows_per_block) == ((29, 86, 1), (27, 15, 5))
    assert (lay.replicas, lay.holders, lay.rows_per_block) == ((6, 3, 132), (22, 43, 1), (36, 30, 5))
    assert dynamic.KernelSpec(lay, train=True).shared_bytes <= H100_SHARED
    for k in range(len(lay.rows)):
        assert lay.rows_per_block[k] <= ROW_GROWTH * partition.rows_per_block[k]
        on = [b for b in range(132) if lay.block_rows(k, b).size > 0]
        assert len(on) == lay.holders[k] * lay.replicas[k] <= 132
        covered = sorted(r for b in on for r in lay.block_rows(k, b))
        assert covered == sorted(list(range(lay.rows[k])) * lay.replicas[k]), "each replica holds every row once"
    # A bound on the cache per block stops the replicas: W_out's alone fit here.
    capped = dynamic.matrix_layout(model, 132, "replicate", cache_floats=partition.shared_floats + 5 * 256)
    assert capped.replicas == (1, 1, 132) and capped.shared_floats <= partition.shared_floats + 5 * 256
    # Scheduled: a stage's vectors of a matrix are dealt out among its replicas, each to one replica's holders.
    model, builder, trees, vocab, graph = sst_batch(6, hidden=256, embedding=256)
    script = dynamic.schedule(graph, 132, train=False, placement="replicate")
    lay = script.layout
    program = script.program[:script.instructions]
    seen = {}
    for b in range(132):
        program = script.block_program(b)
        for inst in program[(program[:, 0] == OPCODES["matvec"]) | (program[:, 0] == OPCODES["tree_matvec"])]:
            rows = script.operands(inst)
            k = int(rows[0, 3]) if inst[0] == OPCODES["matvec"] else int(inst[1] // 4)
            replica = (b - lay.first_block[k]) % 132 // lay.holders[k]
            seen.setdefault((k, replica), set()).update(rows[:, 0].tolist())
    for k in range(len(lay.rows)):
        vectors = [seen.get((k, r), set()) for r in range(lay.replicas[k])]
        assert sum(len(v) for v in vectors) == len(set().union(*vectors)), "no vector on two replicas"
    assert len([key for key in seen if key[0] == 2]) > 1  # W_out's vectors went to several replicas
    assert (program[:, 0] == OPCODES["matvec"]).sum() > 0
    flat = model.initial_values()
    for train in (True, False):  # the same float64 results as the partition
        got = dynamic.run_script(dynamic.schedule(graph, 132, train=train, placement="replicate"), flat)
        want = dynamic.run_script(dynamic.schedule(graph, 132, train=train), flat)
        assert abs(got.loss - want.loss) <= 1e-12 * abs(want.loss)
        if train:
            assert rel(got.param_grads, want.param_grads) <= 1e-12


def test_a_shape_of_several_matrices_takes_replicas_side_by_side_where_stacked_caches_would_not_fit():
    # The bench tagger (embedding = hidden = 256): its four LSTM matrices share one shape. A second replica of
    # each on its own 32 holders would stack two matrices' rows on every block past an H100's shared memory;
    # on 16 holders of 64 rows each, the four matrices' eight replicas lie side by side.
    from persistrnn.dynamic.script import ROW_GROWTH

    model = dynamic.Model(0)
    dynamic.BiLSTMTagger(model, 50, 5, 256, 256)
    partition = dynamic.matrix_layout(model, 132)
    lay = dynamic.kernel_layout(model, 132, "replicate", H100_SHARED)
    assert partition.holders[:4] == (32,) * 4 and partition.rows_per_block[:4] == (32,) * 4
    assert (lay.replicas, lay.holders, lay.rows_per_block) == ((2, 2, 2, 2, 132), (16, 16, 16, 16, 1),
                                                               (64, 64, 64, 64, 5))
    assert dynamic.KernelSpec(lay, train=True).shared_bytes <= H100_SHARED
    for b in range(132):  # no block holds rows of two LSTM matrices
        assert sum(lay.block_rows(k, b).size > 0 for k in range(4)) <= 1
    for k in range(4):
        assert lay.rows_per_block[k] <= ROW_GROWTH * partition.rows_per_block[k]
        on = [b for b in range(132) if lay.block_rows(k, b).size > 0]
        covered = sorted(r for b in on for r in lay.block_rows(k, b))
        assert covered == sorted(list(range(1024)) * 2), "each replica holds every row once"
    # The float64 results of a batch on this layout are the partition's.
    model, builder, sentences, graph = wikiner_batch(3, hidden=256, embedding=256)
    flat = model.initial_values()
    got = dynamic.run_script(dynamic.schedule(graph, 132, layout=lay), flat)
    want = dynamic.run_script(dynamic.schedule(graph, 132), flat)
    assert abs(got.loss - want.loss) <= 1e-12 * abs(want.loss)
    assert rel(got.param_grads, want.param_grads) <= 1e-12


def test_a_tree_level_costs_one_stage():
    # Binary Tree-LSTM: one tree_matvec per node (its five gates' products,
    # then its cell, on U's holders); the output layer runs beside the
    # parent's cell and the loss beside the grandparent's. A chain of c
    # leaves (height c - 1) takes c + 3 stages forward: lookups, the leaves'
    # cells, one per height, then the root's output and its loss.
    vocab = dynamic.Vocabulary(["a", "b", "c"])
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, len(vocab), 6, 8)
    graph = dynamic.Graph(model)
    builder.build(graph, dynamic.parse_tree("(1 (2 a) (1 (2 b) (3 (2 c) (0 a))))"), vocab)
    assert dynamic.schedule(graph, 5, train=False).stages == 4 + 3


def test_a_tree_deeper_than_pythons_recursion_limit_builds():
    # A left-branching chain of 3000 leaves (height 2999): the builder walks
    # trees over an explicit stack, so depth is not bounded by recursion.
    import sys

    depth = sys.getrecursionlimit() + 2000
    tree = dynamic.Tree(1, "a")
    for _ in range(depth):
        tree = dynamic.Tree(2, children=(tree, dynamic.Tree(3, "b")))
    vocab = dynamic.Vocabulary(["a", "b"])
    model = dynamic.Model(0)
    graph = dynamic.Graph(model)
    losses = dynamic.TreeLSTM(model, len(vocab), 4, 4).build(graph, tree, vocab)
    assert len(losses) == 2 * depth + 1  # a loss per node, children before parents: the root's last


def test_the_placement_is_checked_before_any_cached_tables():
    model, builder, trees, vocab, _ = sst_batch(1, hidden=8, embedding=6)
    graph = dynamic.Graph(model)
    builder.build(graph, trees[0], vocab)
    dynamic.schedule(graph, 1)  # caches the tables of (1 block, the default placement)
    for blocks in (True, 1.0):  # equal to 1 as dictionary keys
        with pytest.raises(ArgumentError, match="blocks must be an int >= 1"):
            dynamic.schedule(graph, blocks)


def test_training_on_more_blocks_than_work_waits_before_every_signal():
    # Regression: blocks with no work in the last stages used to send their
    # closing signal at once, so the counter reached the targets of later
    # stages early and the float64 reference read unwritten (NaN) values. One
    # small tree on 132 blocks (an H100's SMs) leaves most blocks idle.
    model, builder, trees, vocab, _ = sst_batch(1, hidden=32, embedding=24)
    graph = dynamic.Graph(model)
    builder.build(graph, trees[0], vocab)
    flat = model.initial_values()
    for placement in dynamic.PLACEMENTS:
        train = dynamic.run_script(dynamic.schedule(graph, 132, placement=placement), flat)
        infer = dynamic.run_script(dynamic.schedule(graph, 132, train=False, placement=placement), flat)
        assert np.isfinite(train.loss) and abs(train.loss - infer.loss) <= TOLERANCE * infer.loss
        assert np.all(np.isfinite(train.param_grads))


def test_a_missing_wait_poisons_the_loss_and_a_missing_signal_deadlocks():
    from persistrnn.dynamic.script import OPCODES

    model, builder, trees, vocab, graph = sst_batch(2)
    script = dynamic.schedule(graph, 4, train=False)
    flat = model.initial_values()
    waits = np.flatnonzero(script.program[:script.instructions, 0] == OPCODES["wait"])
    no_wait = script.program.copy()
    no_wait[waits, 3] = 0  # every wait satisfied at once
    broken = dataclasses_replace(script, program=no_wait)
    assert not np.isfinite(dynamic.run_script(broken, flat).loss)
    no_signal = script.program.copy()
    first_signal = np.flatnonzero(no_signal[:script.instructions, 0] == OPCODES["signal"])[0]
    no_signal[first_signal, 0] = OPCODES["wait"]
    no_signal[first_signal, 3] = 0
    with pytest.raises(ArgumentError, match="deadlocks"):
        dynamic.run_script(dataclasses_replace(script, program=no_signal), flat)


def dataclasses_replace(script, **changes):
    import dataclasses

    return dataclasses.replace(script, **changes)


def test_slices_alias_their_parent_storage():
    model = dynamic.Model(0)
    emb = model.embedding("e", 3, 8)
    model.matrix("W", 2, 4)
    g = dynamic.Graph(model)
    x = g.lookup(emb, 2)
    inner = x[2:8][1:5]  # a slice of a slice: offset 3 in x
    y = g.tanh(inner)
    script = dynamic.schedule(g, 2, train=False)
    assert script.offsets[inner.id] == script.offsets[x.id] + 3
    got = dynamic.run_script(script, model.initial_values())
    table = model.view(model.initial_values(), emb)
    assert np.allclose(got.values[script.offsets[y.id]:script.offsets[y.id] + 4], np.tanh(table[2, 3:7]))


# ---- errors --------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    ("", "empty line"),
    ("(3 (2 a) (2 b)", "expected '\\)'"),
    ("(3 (2 a) (2 b)))", "end of the tree"),
    ("(x (2 a))", "integer label"),
    ("(7 a)", "label in \\[0, 5\\)"),
    ("(3 )", "a word or a child"),
    ("(3 a b)", "after the word"),
])
def test_malformed_trees_raise(text, match):
    with pytest.raises(ArgumentError, match=match):
        dynamic.parse_tree(text)


def test_sst_reader_names_the_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("(2 (2 a) (2 b))\n(2 (2 a) (2 b)\n")
    with pytest.raises(ArgumentError, match="bad.txt:2"):
        dynamic.read_sst(path)


def test_a_no_break_space_inside_a_word_does_not_split_it(tmp_path):
    # SST train line 4342 has the leaf "(2 8\xa01\/2)"; str.split() cut it in two and the reader refused the file.
    tree = dynamic.parse_tree("(2 (2 like) (2 8\xa01\\/2))")
    assert tree.words() == ["like", "8\xa01\\/2"]
    path = tmp_path / "ner.txt"
    path.write_text("8\xa01/2|O Smith|I-PER\n", encoding="utf-8")
    assert dynamic.read_wikiner(path) == [[("8\xa01/2", "O"), ("Smith", "I-PER")]]


def test_unknown_words_map_to_unk_and_train_its_row():
    vocab = dynamic.Vocabulary(["film", "lovely"])
    assert vocab["film"] == 1 and vocab["never-seen"] == 0 and vocab.items[0] == "<unk>"
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, len(vocab), 4, 6)
    g = dynamic.Graph(model)
    builder.build(g, dynamic.parse_tree("(3 (2 lovely) (1 zzz))"), vocab)
    got = dynamic.run_script(dynamic.schedule(g, 2), model.initial_values())
    assert np.abs(model.view(got.param_grads, builder.embed)[0]).max() > 0


def test_wikiner_errors(tmp_path):
    path = tmp_path / "ner.txt"
    path.write_text("A|O B|I-PER\n\n")
    with pytest.raises(ArgumentError, match="ner.txt:2: expected a sentence"):
        dynamic.read_wikiner(path)
    path.write_text("A|O Bee\n")
    with pytest.raises(ArgumentError, match="token 1 must be word\\|TAG"):
        dynamic.read_wikiner(path)
    model = dynamic.Model(0)
    tagger = dynamic.BiLSTMTagger(model, 5, 3, 4, 4)
    with pytest.raises(ArgumentError, match="empty one"):
        tagger.build(dynamic.Graph(model), [], [])
    with pytest.raises(ArgumentError, match="one tag per word"):
        tagger.build(dynamic.Graph(model), [1, 2], [0])


def test_expression_errors():
    model = dynamic.Model(0)
    W = model.matrix("W", 4, 3)
    e = model.embedding("e", 5, 3)
    g = dynamic.Graph(model)
    x = g.lookup(e, 1)
    with pytest.raises(ArgumentError, match="row must be an int in \\[0, 5\\)"):
        g.lookup(e, 5)
    with pytest.raises(ArgumentError, match="takes vectors of 3, got 4"):
        g.matvec(W, g.matvec(W, x))
    with pytest.raises(ArgumentError, match="one size, got 3 and 4"):
        g.add(x, g.matvec(W, x))
    loss = g.loss(g.matvec(W, x), 2)
    with pytest.raises(ArgumentError, match="cannot be an input"):
        g.tanh(loss)
    with pytest.raises(ArgumentError, match="empty"):
        dynamic.Graph(model).arrays()
    dynamic.schedule(g, 2)  # takes the layout
    with pytest.raises(ArgumentError, match="already fixed"):
        model.matrix("late", 2, 2)
    with pytest.raises(ArgumentError, match="nodes of 0 or 2 children"):
        m2 = dynamic.Model(0)
        dynamic.TreeLSTM(m2, 4, 4, 4).build(dynamic.Graph(m2), dynamic.parse_tree("(1 (2 a) (2 b) (2 c))"),
                                            dynamic.Vocabulary(["a", "b", "c"]))


# ---- the batch builder against the expression API ------------------------------

def expression_tree_lstm(builder: dynamic.TreeLSTM, g: dynamic.Graph, tree: dynamic.Tree, ids: dict[str, int]):
    """The Tree-LSTM made one expression at a time, node by node in the
    tree's own order (each node's cell through the expression API, as the
    builder did before its batch path): the reference for the nodes and
    their order."""
    state = {}
    for node in tree.nodes():
        kids = [state.pop(id(c)) for c in node.children]
        word = ids[node.word] if node.word is not None else None
        state[id(node)] = builder._cell(g, word, kids, node.label)


def expression_tagger(builder: dynamic.BiLSTMTagger, g: dynamic.Graph, words: list[int], tags: list[int]):
    """The tagger made one expression at a time (the reference, as :func:`expression_tree_lstm`)."""
    H = builder.hidden

    def run(xs, direction):
        state = None
        out = []
        for x in xs:
            state = builder._step(g, direction, x, state)
            out.append(state)
        return out

    xs = [g.lookup(builder.embed, w) for w in words]
    forward, backward = run(xs, 0), run(xs[::-1], 1)[::-1]
    for sf, sb, t in zip(forward, backward, tags):
        g.loss(g.matvec(builder.w_out, g.concat([sf[0:H], sb[0:H]])) + g.parameter(builder.b_out), t)


def assert_same_scripts(model, fast: dynamic.Graph, reference: dynamic.Graph, blocks_list) -> None:
    got, want = fast.arrays(), reference.arrays()
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for blocks in blocks_list:
        for placement in dynamic.PLACEMENTS:
            for train in (True, False):
                a = dynamic.schedule(fast, blocks, train=train, placement=placement)
                b = dynamic.schedule(reference, blocks, train=train, placement=placement)
                assert a.program.dtype == b.program.dtype and a.starts.dtype == b.starts.dtype
                for field in ("program", "starts", "offsets", "losses"):
                    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
                assert (a.workspace_floats, a.signals, a.stages, a.layout) == \
                    (b.workspace_floats, b.signals, b.stages, b.layout)


@pytest.mark.parametrize("variant", ["binary", "childsum"])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_tree_batch_builder_gives_the_expression_api_scripts(variant, batch):
    # Real SST dev trees; the script buffers must be bit-for-bit those of the
    # expression API, for every block count including an H100's 132.
    model, builder, trees, vocab, _ = sst_batch(batch, hidden=13, variant=variant)
    fast, reference = dynamic.Graph(model), dynamic.Graph(model)
    losses = builder.build_batch(fast, trees, vocab)
    for t in trees:
        expression_tree_lstm(builder, reference, t, vocab.ids)
    assert [len(x) for x in losses] == [len(t.nodes()) for t in trees]
    assert [e.id for x in losses for e in x] == np.flatnonzero(reference.arrays()["op"] == OP["loss"]).tolist()
    assert_same_scripts(model, fast, reference, [1, 3, 7, 132])
    again = dynamic.Graph(model)  # the trees' walks are kept from the first build, and joining them changed none
    builder.build_batch(again, trees[::-1] + trees, vocab)
    with_reversed = dynamic.Graph(model)
    for t in trees[::-1] + trees:
        expression_tree_lstm(builder, with_reversed, t, vocab.ids)
    assert_same_scripts(model, again, with_reversed, [132])


def test_a_trees_post_order_is_walked_once_and_matches_its_nodes():
    tree = dynamic.parse_tree("(3 (2 (1 a) (4 b)) (0 (2 c) (1 (3 d) (2 e))))")
    order = tree.post_order
    assert tree.post_order is order  # kept on the (immutable) tree
    nodes = tree.nodes()
    position = {id(n): k for k, n in enumerate(nodes)}
    assert order.label.tolist() == [n.label for n in nodes]
    assert order.child_count.tolist() == [len(n.children) for n in nodes]
    assert order.children.tolist() == [position[id(c)] for n in nodes for c in n.children]
    assert order.words == tuple(tree.words()) == ("a", "b", "c", "d", "e")
    assert order.leaf_at.tolist() == [k for k, n in enumerate(nodes) if n.word is not None]

    def level(n):
        return 1 + max(map(level, n.children)) if n.children else 0

    assert order.level.tolist() == [level(n) for n in nodes]
    with pytest.raises(ValueError, match="read-only"):
        order.label[0] = 4
    bad = dynamic.Tree(1.5, "a")
    for _ in range(2):  # a refused tree keeps nothing: it is refused again
        with pytest.raises(ArgumentTypeError, match="1.5"):
            assert bad.post_order is None
    with pytest.raises(ArgumentError, match="both a word"):
        assert dynamic.Tree(1, "a", (dynamic.Tree(1, "b"),)).post_order is None


@pytest.mark.parametrize("batch", [1, 5, 32])
def test_tagger_batch_builder_gives_the_expression_api_scripts(batch):
    model, builder, sentences, _ = wikiner_batch(batch)
    fast, reference = dynamic.Graph(model), dynamic.Graph(model)
    losses = builder.build_batch(fast, sentences)
    for w, t in sentences:
        expression_tagger(builder, reference, w, t)
    assert [len(x) for x in losses] == [len(w) for w, _ in sentences]
    assert [e.id for x in losses for e in x] == np.flatnonzero(reference.arrays()["op"] == OP["loss"]).tolist()
    assert_same_scripts(model, fast, reference, [1, 4, 33, 132])


def test_batch_builder_between_hand_built_expressions():
    # Hand-built nodes before and after a batch: the batch's arrays join the
    # lists when the expression API next makes a node.
    model, builder, trees, vocab, _ = sst_batch(3, hidden=8, embedding=6, variant="childsum")
    extra = model.bias("extra", 8)

    def hand(g):
        return g.tanh(g.parameter(extra))

    fast, reference = dynamic.Graph(model), dynamic.Graph(model)
    x = hand(fast)
    builder.build_batch(fast, trees, vocab)
    assert x.size == 8
    fast.loss(fast.sigmoid(x) * hand(fast), 3)
    y = hand(reference)
    for t in trees:
        expression_tree_lstm(builder, reference, t, vocab.ids)
    reference.loss(reference.sigmoid(y) * hand(reference), 3)
    assert_same_scripts(model, fast, reference, [5])


@pytest.mark.parametrize("variant", ["binary", "childsum"])
def test_batch_builders_on_the_smallest_inputs(variant):
    # A one-leaf tree (no template has inputs) and a one-token sentence (no
    # step after the first); an empty batch adds nothing.
    vocab = dynamic.Vocabulary(["a", "b"])
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, len(vocab), 4, 5, variant=variant)
    tree = dynamic.parse_tree("(2 a)")
    fast, reference = dynamic.Graph(model), dynamic.Graph(model)
    assert builder.build_batch(fast, [], vocab) == [] and len(fast) == 0
    builder.build(fast, tree, vocab)
    expression_tree_lstm(builder, reference, tree, vocab.ids)
    assert_same_scripts(model, fast, reference, [1, 132])
    model = dynamic.Model(0)
    tagger = dynamic.BiLSTMTagger(model, 5, 3, 4, 4)
    fast, reference = dynamic.Graph(model), dynamic.Graph(model)
    tagger.build_batch(fast, [([3], [2]), ([1, 4], [0, 1])])
    expression_tagger(tagger, reference, [3], [2])
    expression_tagger(tagger, reference, [1, 4], [0, 1])
    assert_same_scripts(model, fast, reference, [1, 132])


@pytest.mark.parametrize("blocks", [1, 132])
def test_batch_built_reference_matches_torch(blocks):
    model, builder, trees, vocab, _ = sst_batch(6, hidden=13, seed=blocks)
    graph = dynamic.Graph(model)
    builder.build_batch(graph, trees, vocab)
    got, loss, grads = reference_against_torch(
        model, graph, blocks, lambda P: sum(tree_lstm_loss(builder, P, t, vocab.ids) for t in trees))
    assert abs(got.loss - loss) <= TOLERANCE * abs(loss)
    assert rel(got.param_grads, grads) <= TOLERANCE
    model, builder, sentences, _ = wikiner_batch(4, seed=blocks)
    graph = dynamic.Graph(model)
    builder.build_batch(graph, sentences)
    got, loss, grads = reference_against_torch(
        model, graph, blocks, lambda P: sum(tagger_loss(builder, P, w, t) for w, t in sentences))
    assert abs(got.loss - loss) <= TOLERANCE * abs(loss)
    assert rel(got.param_grads, grads) <= TOLERANCE


def test_batch_builders_check_ids_and_labels():
    model = dynamic.Model(0)
    builder = dynamic.TreeLSTM(model, 4, 4, 4, classes=3)
    tree = dynamic.parse_tree("(1 (2 a) (2 b))")
    with pytest.raises(ArgumentError, match="row must be an int in \\[0, 4\\) for 'embed', got 4"):
        builder.build(dynamic.Graph(model), tree, ids=[1, 4])
    with pytest.raises(ArgumentError, match="label must be an int in \\[0, 3\\), got 4"):
        builder.build(dynamic.Graph(model), dynamic.parse_tree("(4 (2 a) (2 b))"), ids=[1, 2])
    with pytest.raises(ArgumentError, match="tree 1 has 2 leaves, got 1 ids"):
        builder.build_batch(dynamic.Graph(model), [tree, tree], ids=[[1, 2], [3]])
    tagger_model = dynamic.Model(0)
    tagger = dynamic.BiLSTMTagger(tagger_model, 5, 3, 4, 4)
    with pytest.raises(ArgumentError, match="label must be an int in \\[0, 3\\), got 3"):
        tagger.build_batch(dynamic.Graph(tagger_model), [([1, 2], [0, 1]), ([1], [3])])


# ---- the scheduler's output is pinned ---------------------------------------------

def script_digest(graph: dynamic.Graph, blocks_list) -> str:
    """sha256 over every script of ``graph`` (each block count, placement of
    the pinned ones, training and inference). The layout's replicas and
    gates came later: replicas always 1 in these placements, gates 1 but
    for the fused cells' matrices, they are left out of its repr where 1."""
    digest = hashlib.sha256()
    for blocks in blocks_list:
        for placement in ("partition", "spread"):
            for train in (True, False):
                s = dynamic.schedule(graph, blocks, train=train, placement=placement)
                for array in (s.program, s.starts, s.offsets, s.losses):
                    digest.update(f"{array.dtype}{array.shape}".encode())
                    digest.update(np.ascontiguousarray(array).tobytes())
                assert set(s.layout.replicas) == {1}
                layout = repr(s.layout).replace(f", replicas={s.layout.replicas}", "")
                if set(s.layout.gates) == {1}:
                    layout = layout.replace(f", gates={s.layout.gates}", "")
                digest.update(f"({s.workspace_floats!r}, {s.signals!r}, {s.stages!r}, {layout})".encode())
    return digest.hexdigest()


def digest_case(case: str, batch: int) -> str:
    """The graph of a pinned case, built by the batch builders, and its scripts' digest."""
    if case == "elementwise":  # hand-built, no matvec: the matvec lists are empty
        model = dynamic.Model(0)
        dynamic.TreeLSTM(model, 5, 4, 4)
        bias = model.bias("extra", 6)
        graph = dynamic.Graph(model)
        x = graph.tanh(graph.parameter(bias))
        graph.loss(graph.concat([x[0:2], graph.sigmoid(x)]), 1)
        return script_digest(graph, [1, 5, 132])
    if case == "tagger":
        model, builder, sentences, _ = wikiner_batch(batch, hidden=12)
        graph = dynamic.Graph(model)
        builder.build_batch(graph, sentences)
        return script_digest(graph, [1, 4, 33, 132])
    variant, size = case.split("-")
    hidden, embedding = (256, 256) if size == "bench" else (13, 10)
    model, builder, trees, vocab, _ = sst_batch(batch, hidden=hidden, embedding=embedding, variant=variant)
    graph = dynamic.Graph(model)
    builder.build_batch(graph, trees, vocab)
    return script_digest(graph, [132] if size == "bench" else [1, 3, 7, 132])


SCRIPT_DIGESTS: dict[tuple[str, int], str] = {
    ("binary-small", 1): "62ace712d86123a3d8b267105c5667b2533cb89a61c4b1f1acdcf0cdca38ed9f",
    ("binary-small", 7): "1d70e1a214987e95016a7c7f0891f8893a38ff5f806c26b5ecf2a6b01f398c51",
    ("binary-small", 64): "c857a9f8395ae15d0a2910d295456348f9e71748bd9a65f61e9f598909460a28",
    ("childsum-small", 1): "930c3f3581b2721f73f722a431fb0b22a3f74942c1e5c590a84ab8dad3620523",
    ("childsum-small", 7): "c8ff376eaeb90a9c0a01cedb1c2166b3111852e57610d4e8c460540727c31159",
    ("childsum-small", 64): "6e0b36e18fd5152f6bbec1588e513a06dc3ff08e0a8c992a9c142b9d25d6c507",
    ("binary-bench", 64): "3f240f7cd4b370a848cf413eb6533dde6ac59d429ffb4a8d04cbecfca7ffad00",
    ("tagger", 1): "46edd38162dbf6d45ea275904e05bf565f8c1198aba209fb72dbc273280a1aa3",
    ("tagger", 5): "3b4bab6c215c8a1df5ad1d48a6dc963002754cbdfc7c3034e974242132cba676",
    ("tagger", 32): "ddd73ac07f6fc02d6a93e66b302d89f7c7976fcdebca7c53e888c33d67eca05f",
    ("elementwise", 1): "7e7aff2d9f49219449effc5671675d0deca07efae914c66b573c9b366551c8a2",
}
"""Digests of the scripts the scheduler produced before its vectorised host
path (commit 255ad3e), on real SST and WikiNER inputs: every later change to
the host path must leave the script buffers bit-for-bit the same. The
builders' cases were pinned again when their cells took the fused gated
products (``sigmoid_mul``, ``sigmoid_mul_tanh``) and again when they took
whole cells (``lstm_cell``, ``tree_cell``): new graphs, the scheduler
unchanged (the hand-built ``elementwise`` case kept its digest). All were
pinned again when the backward opcodes moved from 16 + op to 32 + op (the
child-sum programs differed from the ones before in those words alone) and
the binary Tree-LSTM and the tagger took cells over their matvecs
(``tree_matvec``, ``lstm_matvec``), whose matrices keep whole units per
block (the layout's ``gates``)."""


@pytest.mark.parametrize("case, batch", sorted(SCRIPT_DIGESTS))
def test_scripts_are_bit_for_bit_the_pinned_ones(case, batch):
    assert digest_case(case, batch) == SCRIPT_DIGESTS[case, batch]



@pytest.mark.parametrize("high", [50, 2**40])
def test_grouped_sort_is_a_lexsort(high):
    # Keys whose ranges fit fold into one int64 (high 50); others (2**40:
    # the product of the ranges passes 2**63) take np.lexsort. Both give
    # lexsort's order, ties in input order, and a flag where a key tuple starts.
    from persistrnn.dynamic.script import _sort_groups

    rng = np.random.default_rng(1)
    keys = [rng.integers(-3, high, 500), rng.integers(0, 4, 500), rng.integers(-high, high, 500)]
    order, starts = _sort_groups(keys)
    np.testing.assert_array_equal(order, np.lexsort(keys[::-1]))
    tuples = [tuple(int(k[i]) for k in keys) for i in order]
    assert starts.tolist() == [i == 0 or tuples[i] != tuples[i - 1] for i in range(len(tuples))]
    empty = [np.zeros(0, dtype=np.int64)] * 2
    assert [x.size for x in _sort_groups(empty)] == [0, 0]

# ---- the kernel compiles for sm_90 without a GPU ---------------------------------

H100_SHARED = 227 * 1024
"""Opt-in shared memory per block on an H100, bytes."""


def _specs():
    """Every variant (training, inference; both placements) of both
    builders, at the benchmark size (hidden 256, embedding 256, 132 blocks:
    one per H100 SM) and at an odd small size on few blocks; and the
    instrumented build of both modes at the benchmark size."""
    specs = []
    for hidden, blocks in ((256, 132), (37, 5)):
        tree_model = dynamic.Model(0)
        dynamic.TreeLSTM(tree_model, 100, hidden, hidden)
        tagger_model = dynamic.Model(0)
        dynamic.BiLSTMTagger(tagger_model, 100, 5, hidden, hidden)
        for model in (tree_model, tagger_model):
            specs += [dynamic.KernelSpec.of(model, blocks, train=train, placement=placement, shared_bytes=H100_SHARED)
                      for train in (True, False) for placement in dynamic.PLACEMENTS]
    n = len(dynamic.PLACEMENTS)
    specs += [dataclasses.replace(spec, profile=True) for spec in specs[0:2 * n:n]]  # the Tree-LSTM's, both modes
    return specs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    import os

    from persistrnn import runtime

    old = os.environ.get(runtime.CACHE_ENV)
    os.environ[runtime.CACHE_ENV] = str(tmp_path_factory.mktemp("kernels"))
    try:
        specs = _specs()
        return list(zip(specs, runtime.map_in_threads(lambda s: dynamic.compile_spec(s, "sm_90"), specs)))
    finally:
        if old is None:
            del os.environ[runtime.CACHE_ENV]
        else:
            os.environ[runtime.CACHE_ENV] = old


def test_every_kernel_variant_compiles_without_local_memory(compiled):
    from persistrnn.dynamic.kernel import KERNEL_NAME

    assert len(compiled) == 2 * 2 * 2 * len(dynamic.PLACEMENTS) + 2
    assert [spec.profile for spec, _ in compiled].count(True) == 2
    for spec, binary in compiled:
        res = binary.kernel_resources(KERNEL_NAME)
        assert not res.uses_local_memory, (spec.describe(), res)
        assert res.registers <= 255


def test_a_binary_whose_shared_memory_exceeds_the_device_is_refused(compiled):
    # The Interpreter's first check counts dynamic shared memory only; after the compile, the static part (each
    # matrix's rows of the block, the failure flag, a profile build's counters) is added, so a model at the edge
    # gets a ConfigError that names both, not a bare CUDA error at its launch.
    from persistrnn.dynamic.kernel import KERNEL_NAME, check_shared_memory

    for spec, binary in compiled:
        static = binary.kernel_resources(KERNEL_NAME).shared_bytes
        assert static >= 20 * len(spec.layout.rows), (spec.describe(), static)
        check_shared_memory(spec, binary, spec.shared_bytes + static)  # exactly at the limit: fits
        with pytest.raises(ConfigError, match=f"needs {spec.shared_bytes} bytes of dynamic and {static} of static "
                                              f"shared memory per block, {spec.shared_bytes + static} in all; the "
                                              f"device allows {spec.shared_bytes + static - 1}: use more blocks"):
            check_shared_memory(spec, binary, spec.shared_bytes + static - 1)


def test_profile_table_converts_each_blocks_cycles_by_its_own_clock():
    from persistrnn.dynamic.kernel import PROFILE_SLOTS, Launched

    counts = np.zeros((2, 2 * PROFILE_SLOTS + 2), dtype=np.int64)
    from persistrnn.dynamic.script import BACKWARD, OPCODES

    add, backward_mul = OPCODES["add"], OPCODES["mul"] + BACKWARD
    counts[0, 2 * add:2 * add + 2] = (3000, 2)  # block 0: 2 GHz
    counts[0, -2:] = (20_000, 10_000)
    counts[1, 2 * add:2 * add + 2] = (1000, 1)  # block 1: 1 GHz
    counts[1, 2 * backward_mul:2 * backward_mul + 2] = (500, 1)
    counts[1, -2:] = (10_000, 10_000)
    launched = Launched(None, None, None, None, None, None, torch.from_numpy(counts))
    rows = {row["op"]: row for row in dynamic.profile_table(launched)}
    assert set(rows) == {"add", "mul backward"}
    assert rows["add"]["instructions"] == 3
    assert rows["add"]["total_us"] == pytest.approx(1.5 + 1.0)
    assert rows["add"]["mean_us"] == pytest.approx(2.5 / 3)
    assert rows["add"]["largest_block_us"] == pytest.approx(1.5)
    assert rows["mul backward"]["total_us"] == pytest.approx(0.5)
    with pytest.raises(ArgumentError, match="profile=True"):
        dynamic.profile_table(dataclasses.replace(launched, profile=None))


def test_shared_memory_of_the_benchmark_model_fits_an_h100():
    # The replicate placement bounded by an H100's opt-in shared memory (the
    # device's own figure is read at Interpreter construction).
    for spec in _specs():
        assert spec.shared_bytes <= H100_SHARED, spec.describe()


def test_a_model_without_matrices_is_refused():
    model = dynamic.Model(0)
    model.embedding("e", 3, 3)
    with pytest.raises(ConfigError, match="no weight matrix"):
        dynamic.render_source(dynamic.KernelSpec.of(model, 2))


def test_benchmark_peers_compute_the_same_loss():
    # The PyTorch baselines of `bench treelstm` (one node at a time, and level
    # by level) are the same model: a faster wrong baseline would flatter nobody.
    from persistrnn.bench.treelstm import TorchTreeLSTM

    model, builder, trees, vocab, graph = sst_batch(6, seed=5)
    want = dynamic.run_script(dynamic.schedule(graph, 3, train=False), model.initial_values()).loss
    peer = TorchTreeLSTM(model, builder, vocab, torch.device("cpu"))
    eager = peer.eager_loss(trees).item()
    batched = peer.batched_loss(peer.plan(trees)).item()
    assert abs(eager - want) <= 1e-5 * want and abs(batched - want) <= 1e-5 * want


def _dynet_or_skip():
    from persistrnn.bench.dynet_peer import load_dynet

    dy, why = load_dynet()
    if dy is None:
        pytest.skip(f"DyNet {why}")
    return dy


def test_dynet_peers_compute_the_same_loss_and_take_torchs_sgd_step():
    # DyNet's autobatching, VPPS's baseline: the same models from the same initial parameters. One SGD step
    # moves each to the loss torch's SGD reaches (no gradient clipping in either).
    from persistrnn.bench.dynet_peer import DyNetTagger, DyNetTreeLSTM
    from persistrnn.bench.tagger import TorchTagger
    from persistrnn.bench.treelstm import TorchTreeLSTM

    dy = _dynet_or_skip()
    model, builder, trees, vocab, graph = sst_batch(5, seed=6)
    tagger_model, tagger, sentences, tagger_graph = wikiner_batch(4, seed=7)
    lr = 0.05
    for peer, torch_peer, items, g, m in (
            (DyNetTreeLSTM(dy, model, builder, vocab, lr), TorchTreeLSTM(model, builder, vocab, torch.device("cpu")),
             trees, graph, model),
            (DyNetTagger(dy, tagger_model, tagger, lr), TorchTagger(tagger_model, tagger, torch.device("cpu")),
             sentences, tagger_graph, tagger_model)):
        want = dynamic.run_script(dynamic.schedule(g, 3, train=False), m.initial_values()).loss
        assert abs(peer.infer(items) - want) <= 1e-5 * want
        assert abs(peer.train_step(items) - want) <= 1e-5 * want  # the loss before the update
        opt = torch_peer.optimizer(lr)
        torch_peer.eager_loss(items).backward()
        opt.step()
        after = torch_peer.eager_loss(items).item()
        assert after < want and abs(peer.infer(items) - after) <= 1e-4 * after


def test_the_eager_tree_lstm_peer_leaves_no_graph_in_a_reference_cycle():
    # A graph held in a cycle keeps its AccumulateGrad nodes, bound to the stream the eager step ran on, alive
    # into the level-batched peer's capture on another stream, which then fails (`bench treelstm`).
    import gc

    from persistrnn.bench.treelstm import TorchTreeLSTM

    model, builder, trees, vocab, _ = sst_batch(4, seed=2)
    peer = TorchTreeLSTM(model, builder, vocab, torch.device("cpu"))
    peer.eager_loss(trees).backward()  # first-call objects (caches) out of the count
    gc.collect()
    gc.disable()
    # Only the step's own tensors count: other threads of the process (a worker pool's feeders, say) may leave
    # cyclic garbage of their own meanwhile, which a bare count of what gc.collect() frees also took in.
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        peer.eager_loss(trees).backward()
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        assert not held, f"the eager step left {len(held)} tensors that only a garbage collection frees"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_tagger_benchmark_peers_compute_the_same_loss():
    # `bench tagger`: the packed level-batched peer gathers each token's two
    # directions from rows that differ per sentence; a wrong row would still
    # give a finite loss, so compare with the reference interpreter.
    from persistrnn.bench.tagger import TorchTagger

    model, builder, sentences, graph = wikiner_batch(5, seed=2)
    want = dynamic.run_script(dynamic.schedule(graph, 3, train=False), model.initial_values()).loss
    peer = TorchTagger(model, builder, torch.device("cpu"))
    eager = peer.eager_loss(sentences).item()
    batched = peer.batched_loss(peer.plan(sentences)).item()
    assert abs(eager - want) <= 1e-5 * want and abs(batched - want) <= 1e-5 * want


def test_benchmark_outputs_name_an_absent_peer_and_use_the_best_one(tmp_path):
    from persistrnn.bench.treelstm import COLUMNS, format_table, write_outputs

    row = {key: 1.0 for key, _, _ in COLUMNS}
    row.update(batch=4, ours_train_sent_s=300.0, torch_batched_train_sent_s=100.0, torch_eager_train_sent_s=10.0,
               torch_graph_train_sent_s=None, torch_graph_infer_ms=None, ours_infer_ms=0.5,
               torch_batched_infer_ms=2.0, torch_eager_infer_ms=4.0)
    result = {"suite": "tagger", "rows": [row]}
    table = format_table(result)
    assert "absent" in table and "| 3.0× | 4.0× |" in table
    ahead = format_table({"suite": "tagger", "rows": [{**row, "ours_workers_train_sent_s": 500.0}]})
    assert "| 500 |" in ahead and "| 5.0× | 4.0× |" in ahead  # the faster of ours' two training timings
    written = write_outputs(result, table, tmp_path)
    for ext in ("md", "csv", "json", "png"):
        assert (tmp_path / f"tagger.{ext}").stat().st_size > 0, ext
    assert len(written) == 4


def test_the_steady_timing_of_scripts_made_ahead_leaves_out_the_ramp_and_splits_the_wait(monkeypatch):
    import time

    from persistrnn.bench import treelstm

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Interp:
        def step(self, script):
            time.sleep(0.002)

        def sync(self):
            pass

    def scripts():  # the first two (the ramp) arrive late, the rest 1 ms apart
        for i in range(8):
            time.sleep(0.3 if i < 2 else 0.001)
            yield i

    class Loader:
        def __iter__(self):
            return scripts()

    wall, waiting, stepping = treelstm._steady_ms(Interp(), Loader(), ramp=2, repeats=1)
    assert waiting >= 6 * 1.0 and stepping >= 6 * 2.0  # six batches past the ramp, each waited for and stepped
    assert wall >= waiting + stepping - 1e-6 and wall < 300  # the ramp's 0.3 s waits are not in it


@pytest.mark.parametrize("suite", ["treelstm", "tagger"])
def test_benchmark_plans_index_within_their_tables_on_the_real_data(suite):
    # Every index tensor the PyTorch peers gather with (word ids, child
    # rows, per-token rows, labels) is inside the table it indexes, for the
    # data and batches `bench treelstm` / `bench tagger` run; an index out of
    # range is a device-side assert on the GPU and no error at all in some
    # CPU kernels.
    from persistrnn.bench.tagger import tagger_workload
    from persistrnn.bench.treelstm import BATCHES, Settings, consecutive_batches, tree_lstm_workload

    data = dynamic.DATA_DIR / ("sst/train.txt" if suite == "treelstm" else "wikiner/dev.txt")
    if not data.is_file():
        pytest.skip(f"{data} is not here")
    settings = Settings(hidden=4, embedding=4)
    make = tree_lstm_workload if suite == "treelstm" else tagger_workload
    work = make(settings, torch.device("cpu"))
    peer = work.peer
    words, classes = peer.p["embed"].shape[0], peer.p["W_out"].shape[0]
    for batch in BATCHES:
        for group in consecutive_batches(work.inputs, batch, settings.iterations):
            plan = peer.plan(group)
            assert 0 <= int(plan["labels"].min()) and int(plan["labels"].max()) < classes
            if suite == "treelstm":
                assert 0 <= int(plan["words"].min()) and int(plan["words"].max()) < words
                below = len(plan["words"])  # a level's children are numbered before it
                for left, right in plan["children"]:
                    assert 0 <= int(torch.cat([left, right]).min()) and int(torch.cat([left, right]).max()) < below
                    below += len(left)
                assert below == len(plan["labels"])
            else:
                tokens = sum(plan["running"])
                assert tokens == len(plan["labels"])
                for d in ("fwd", "bwd"):
                    assert 0 <= int(plan["words"][d].min()) and int(plan["words"][d].max()) < words
                    assert sorted(plan["rows"][d].tolist()) == list(range(tokens))


def _live_tensors() -> int:
    import gc

    gc.collect()
    # type(), not isinstance: the latter touches deprecated lazy attributes of torch.distributed
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.parametrize("suite", ["treelstm", "tagger"])
def test_captured_peer_holds_its_plan_and_nothing_grows_per_replay(suite):
    # The CUDA-graph peer of `bench treelstm` / `bench tagger`, on the CPU
    # where it runs uncaptured. A graph reads its plan's index tensors by
    # address, so the step must keep them alive (dropped, the next plan was
    # allocated over them and replays gathered out of range); it must not
    # keep the captured autograd graph (its AccumulateGrad nodes, bound to
    # the capture stream, leaked into later backward passes), and replays
    # must not accumulate tensors; dropping the steps frees their plans.
    import gc
    import weakref

    from persistrnn.bench.tagger import TorchTagger
    from persistrnn.bench.treelstm import TorchTreeLSTM, capture_step

    if suite == "treelstm":
        model, builder, items, vocab, _ = sst_batch(12, seed=3)
        peer = TorchTreeLSTM(model, builder, vocab, torch.device("cpu"))
    else:
        model, builder, items, _ = wikiner_batch(12, seed=3)
        peer = TorchTagger(model, builder, torch.device("cpu"))
    opt = peer.optimizer(0.05)
    groups = [items[k:k + 4] for k in range(0, 12, 4)]
    steps = [capture_step(peer, peer.plan(g), opt) for g in groups]
    held = [weakref.ref(t) for step in steps for t in step.plan.values() if isinstance(t, torch.Tensor)]
    gc.collect()
    assert held and all(r() is not None for r in held)
    for step in steps:
        assert step.loss.grad_fn is None and not step.loss.requires_grad

    for step in steps:  # the first replay settles the parameters' gradients
        step.replay()
    before = _live_tensors()
    for _ in range(5):
        for step in steps:
            step.replay()
            assert step.loss.grad_fn is None
    assert _live_tensors() == before

    infer = capture_step(peer, peer.plan(groups[0]), None)
    peer.plan(groups[1])  # a later plan must not disturb the captured one
    infer.replay()
    with torch.no_grad():
        assert float(infer.loss) == pytest.approx(float(peer.batched_loss(peer.plan(groups[0]))), rel=1e-6)

    del steps, step, infer
    gc.collect()
    assert all(r() is None for r in held)


def test_adam_refuses_a_beta1_the_kernel_would_read_as_sgd():
    # The kernel tells SGD apart by beta1 == 0 (in fp32); an Adam with that
    # beta1 would have trained as SGD on the GPU while the reference ran Adam.
    for beta1 in (0.0, 1e-50):
        with pytest.raises(ArgumentError, match="beta1 must be above 0 in float32"):
            dynamic.Adam(beta1=beta1)
    assert dynamic.Adam(beta1=1e-3).scalars(1)[1] > 0


def test_builders_refuse_ids_and_labels_that_are_not_integers():
    from persistrnn import ArgumentTypeError

    model = dynamic.Model(0)
    tagger = dynamic.BiLSTMTagger(model, 5, 3, 4, 4)
    for words, tags in (([1.7, 2], [0, 1]), ([1, 2], [True, 1]), (["3", 2], [0, 1]), (np.array([1.0, 2.0]), [0, 1])):
        with pytest.raises(ArgumentTypeError, match="expected integer ids and labels"):
            tagger.build(dynamic.Graph(model), words, tags)
    tagger.build(dynamic.Graph(model), np.array([1, 2]), [np.int32(0), 2])  # numpy integers are integers
    model = dynamic.Model(0)
    tree_lstm = dynamic.TreeLSTM(model, 5, 4, 6)
    with pytest.raises(ArgumentTypeError, match="2.7"):
        tree_lstm.build(dynamic.Graph(model), dynamic.Tree(2.7, "a"), {"a": 1})
    tree = dynamic.parse_tree("(3 (2 lovely) (1 film))")
    with pytest.raises(ArgumentError, match="tree 0 has 2 leaves, got 3 ids"):
        tree_lstm.build(dynamic.Graph(model), tree, ids=[1, 2, 3])  # extra ids were ignored: a likely mistake
    with pytest.raises(ArgumentError, match="one id sequence per tree \\(1\\), got 2"):
        tree_lstm.build_batch(dynamic.Graph(model), [tree], ids=[[1, 2], [3, 4]])
    with pytest.raises(ArgumentError, match="'film' is not in word_ids"):
        tree_lstm.build(dynamic.Graph(model), tree, {"lovely": 1})


def test_a_workspace_past_int32_is_refused_even_when_every_node_starts_below_it():
    model = dynamic.Model(0)
    table = model.embedding("E", 2, 1)
    model.matrix("W", 2, 1)
    g = dynamic.Graph(model)
    x = g.lookup(table, 0)
    for _ in range(30):
        x = g.concat([x, x])  # 2**30 floats: the last node starts at 2**31 - 1 and ends past it
    g.tanh(x)
    with pytest.raises(ArgumentError, match="offsets must fit in int32"):
        dynamic.schedule(g, 4, train=False)


def test_the_tree_reader_takes_any_depth_and_names_a_bad_label():
    deep = dynamic.parse_tree("(1 " * 3000 + "(2 a)" + ")" * 3000)  # past Python's recursion limit
    depth = 0
    while deep.children:
        deep, depth = deep.children[0], depth + 1
    assert depth == 3000 and deep.word == "a"
    for text in ("(--1 a)", "(\u00b2 a)"):
        with pytest.raises(ArgumentError, match="expected an integer label at token 1"):
            dynamic.parse_tree(text)


# ---- scripts made ahead in worker processes (script_loader) --------------------


@pytest.mark.parametrize("workers, per_item", [(0, 1), (2, 1), (2, 3), (0, 3)])
def test_script_loader_gives_each_batch_its_schedule_in_order(workers, per_item):
    # Real SST trees in batches of different sizes and a BiLSTM tagger's
    # sentences: every script from the workers is bit for bit the one
    # schedule() makes in this process, in the batches' order, one batch or
    # several (the last item short) per worker item.
    model, builder, trees, vocab, _ = sst_batch(12, hidden=13)
    batches = [trees[0:1], trees[1:6], trees[6:12], trees[3:4]]

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    loader = dynamic.script_loader(model, build, batches, 7, workers=workers, prefetch=1, per_item=per_item)
    assert len(loader) == len(batches)
    got = list(loader)
    assert len(got) == len(batches)
    for script, batch in zip(got, batches):
        g = dynamic.Graph(model)
        build(g, batch)
        want = dynamic.schedule(g, 7)
        for field in ("program", "starts", "offsets", "losses"):
            np.testing.assert_array_equal(getattr(script, field), getattr(want, field), err_msg=field)
        assert (script.workspace_floats, script.signals, script.stages, script.train, script.layout) == \
            (want.workspace_floats, want.signals, want.stages, True, want.layout)

    model, tagger, sentences, _ = wikiner_batch(6)
    forward_only = list(dynamic.script_loader(model, tagger.build_batch, [sentences[:2], sentences[2:]], 5,
                                              train=False, placement="spread", workers=workers))
    g = dynamic.Graph(model)
    tagger.build_batch(g, sentences[2:])
    want = dynamic.schedule(g, 5, train=False, placement="spread")
    np.testing.assert_array_equal(forward_only[1].program, want.program)
    assert not forward_only[1].train


@pytest.mark.parametrize("workers", [0, 1])
def test_scripts_follow_a_given_layout_and_refuse_one_of_another_model(workers):
    # An interpreter schedules with its own layout (replicas bounded by its
    # device): schedule() and script_loader() take it, worker processes too.
    model, builder, trees, vocab, graph = sst_batch(5, hidden=13)
    layout = dynamic.kernel_layout(model, 7, "replicate", 14 * 1024)  # W_iou and W_out copied, U not
    assert layout != dynamic.matrix_layout(model, 7, "replicate") and max(layout.replicas) > 1  # the bound binds
    want = dynamic.schedule(graph, 7, layout=layout)
    assert want.layout == layout

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    got = next(iter(dynamic.script_loader(model, build, [trees], 7, layout=layout, workers=workers)))
    assert got.layout == layout
    np.testing.assert_array_equal(got.program, want.program)
    flat = model.initial_values()
    reference = dynamic.run_script(dynamic.schedule(graph, 7), flat)
    assert abs(dynamic.run_script(got, flat).loss - reference.loss) <= 1e-12 * abs(reference.loss)
    other, _, _, _, _ = sst_batch(5, hidden=14)
    with pytest.raises(ArgumentError, match=r"layout is for matrices of \(42, 70, 5\) rows, .* has \(39, 65, 5\)"):
        dynamic.schedule(graph, 7, layout=dynamic.matrix_layout(other, 7))
    with pytest.raises(ArgumentError, match="the layout is for 7 blocks; the graph is scheduled on 9"):
        dynamic.schedule(graph, 9, layout=layout)


def _assert_same_scripts(got, model, build, batches, blocks):
    for script, batch in zip(got, batches, strict=True):
        g = dynamic.Graph(model)
        build(g, batch)
        want = dynamic.schedule(g, blocks)
        for field in ("program", "starts", "offsets", "losses"):
            np.testing.assert_array_equal(getattr(script, field), getattr(want, field), err_msg=field)
        assert (script.workspace_floats, script.signals, script.stages, script.layout) == \
            (want.workspace_floats, want.signals, want.stages, want.layout)


@pytest.mark.parametrize("per_item", [1, 2])
def test_script_loader_sends_a_script_larger_than_a_slot_through_the_pipe(monkeypatch, per_item):
    from persistrnn.dynamic import loader

    model, builder, trees, vocab, _ = sst_batch(6, hidden=13)
    batches = [trees[0:1], trees[1:6]]

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    def size(batch):
        g = dynamic.Graph(model)
        build(g, batch)
        s = dynamic.schedule(g, 7)
        return sum(-(-getattr(s, name).nbytes // 8) * 8 for name in ("program", "starts", "offsets", "losses"))

    small, large = size(batches[0]), size(batches[1])
    assert small < large
    monkeypatch.setattr(loader, "SLOT_BYTES", (small + large) // 2)  # the first batch's script fits, not the second's
    taken = []
    take = loader._Slots.take
    monkeypatch.setattr(loader._Slots, "take", lambda self, item: taken.append(item.index) or take(self, item))
    got = list(dynamic.script_loader(model, build, batches, 7, workers=1, per_item=per_item))
    assert taken == [0]
    _assert_same_scripts(got, model, build, batches, 7)


def test_script_loader_without_shared_memory_sends_scripts_through_the_pipe(monkeypatch, caplog):
    from persistrnn.dynamic import loader

    model, builder, trees, vocab, _ = sst_batch(3, hidden=13)
    batches = [trees[0:1], trees[1:3]]

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    def refused(workers, per_worker):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(loader, "_Slots", refused)
    with caplog.at_level("WARNING", logger="persistrnn"):
        got = list(dynamic.script_loader(model, build, batches, 7, workers=1))
    assert "no shared memory for 1 workers' slots" in caplog.text
    _assert_same_scripts(got, model, build, batches, 7)


@pytest.mark.parametrize("per_item", [1, 2])
def test_script_loader_makes_a_script_again_whose_slot_was_rewritten(monkeypatch, per_item):
    # One slot per worker, three items ahead, and a loop slower than the worker: the worker rewrites the
    # slot before the loop reads it; the loop sees another tag there and makes that batch itself.
    import time

    from persistrnn.dynamic import loader

    model, builder, trees, vocab, _ = sst_batch(4, hidden=13)
    batches = [trees[k:k + 1] for k in range(4)]

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    made_here = []
    script = loader._Scripts.script
    monkeypatch.setattr(loader._Scripts, "script", lambda self, i: made_here.append(i) or script(self, i))
    monkeypatch.setattr(loader, "_Slots", lambda workers, per_worker, slots=loader._Slots: slots(workers, 1))
    got = []
    for s in dynamic.script_loader(model, build, batches, 7, workers=1, prefetch=3, per_item=per_item):
        got.append(s)
        time.sleep(0.3)
    assert made_here and set(made_here) < {0, 1, 2, 3}, made_here  # this process made some, not all
    _assert_same_scripts(got, model, build, batches, 7)


def test_script_loader_workers_keep_what_they_inherited_out_of_the_collectors_passes():
    import gc

    model, builder, trees, vocab, _ = sst_batch(3, hidden=13)

    def build(g, batch):
        if gc.get_freeze_count() == 0:  # raised in the loop, with its message, if the worker froze nothing
            raise ArgumentError("the worker's inherited objects are not frozen")
        builder.build_batch(g, batch, vocab)

    got = list(dynamic.script_loader(model, build, [trees[:1], trees[1:]], 4, workers=1))
    assert [s.stages > 0 for s in got] == [True, True]


@pytest.mark.parametrize("per_item", [1, 2, 3])
def test_script_loader_raises_a_workers_failure_with_its_type_and_message(per_item):
    # The failing batch alone in its item, or after a good one in the same item (the worker hands back the
    # good script; this process makes the rest and raises there), or first in an item with a good one after.
    model, builder, trees, vocab, _ = sst_batch(3, hidden=13)
    bad = dynamic.parse_tree("(2 (1 a) (3 b) (2 c))")  # three children: not a binary tree

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    scripts = iter(dynamic.script_loader(model, build, [trees[:1], [bad], trees[1:2]], 4, workers=1,
                                         per_item=per_item))
    assert next(scripts).stages > 0
    with pytest.raises(ArgumentError, match="the binary Tree-LSTM takes nodes of 0 or 2 children"):
        next(scripts)


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=-1), "workers must be an int >= 0, got -1"),
    (dict(workers=True), "workers must be an int >= 0, got True"),
    (dict(prefetch=0), "prefetch must be an int >= 1, got 0"),
    (dict(per_item=0), "per_item must be an int >= 1, got 0"),
    (dict(placement="scatter"), "placement must be one of"),
    (dict(build=None), "build must be a callable"),
])
def test_script_loader_checks_its_arguments(kwargs, message):
    model, builder, trees, vocab, _ = sst_batch(1, hidden=13)
    args = dict(model=model, build=lambda g, b: builder.build_batch(g, b, vocab), batches=[trees], blocks=4)
    with pytest.raises(ArgumentError, match=message):
        dynamic.script_loader(**{**args, **kwargs})


def test_script_loader_fails_a_stuck_worker_instead_of_hanging(monkeypatch):
    import time

    from persistrnn.dynamic import loader

    model, builder, trees, vocab, _ = sst_batch(1, hidden=13)

    def stuck(g, batch):
        time.sleep(60)

    monkeypatch.setattr(loader, "WORKER_TIMEOUT_S", 0.3)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"):
        next(iter(dynamic.script_loader(model, stuck, [trees], 4, workers=1)))
    # the stuck worker is ended (torch's DataLoader joins it for up to 5 s, then terminates it), not waited for
    assert time.perf_counter() - started < 20


def test_the_interpreter_runs_its_launches_under_its_own_device(monkeypatch):
    # The kernels' loads, streams, scratch and launches read the current device: an interpreter on another GPU
    # than the current one enters torch.cuda.device of its own for each of them.
    import contextlib

    from persistrnn.dynamic import kernel

    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    class Params:  # the interpreter's parameters, on GPU `index`
        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # absent from CPU builds
    interp = kernel.Interpreter.__new__(kernel.Interpreter)
    interp.params, interp._pending = Params(1), None
    assert interp.sync() is None and entered == [1]
    interp.params = Params(0)
    assert interp.sync() is None and entered == [1]  # already there: no guard
    for name in ("load", "launch", "run", "step", "sync"):
        assert getattr(kernel.Interpreter, name).__wrapped__  # each entry point is wrapped
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        kernel.Interpreter(None, device="cpu")


def test_replicas_leave_room_for_the_kernels_static_shared_memory():
    # The greedy growth may stop within a few bytes of its bound: the bound leaves the kernel's static shared
    # memory (the failure flag, each matrix's rows of its block, the instrumented build's counters) out. Hidden
    # 64, embedding 48 on 20 blocks near 144 KB: without that room some bounds give a binary 572 bytes too large.
    from persistrnn.dynamic.kernel import PROFILE_SLOTS

    model = dynamic.Model(0)
    dynamic.TreeLSTM(model, 100, 48, 64)
    static = 4 + 20 * len(model.matrices) + 2 * 8 * PROFILE_SLOTS
    checked = 0
    for limit in range(140 * 1024, 148 * 1024, 12):
        lay = dynamic.kernel_layout(model, 20, "replicate", limit)
        assert dynamic.KernelSpec(lay, train=True).shared_bytes + static <= limit, limit
        checked += max(lay.replicas) > 1
    assert checked > 0
