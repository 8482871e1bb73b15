"""The dynamic interpreter kernel on the GPU against the reference interpreter
(float64, the same float32 parameters, the same script) and against plain
PyTorch autograd in float64, on real SST trees and WikiNER sentences. The
workspace is poisoned (NaN) before every launch, so a value read before it
was written shows in the loss."""

import numpy as np
import pytest
from test_dynamic import (cell_matvecs_graph, cells_graph, rel, sst_batch, tagger_loss, torch_params, tree_lstm_loss,
                          wikiner_batch)

from persistrnn import dynamic
from persistrnn.errors import ArgumentError

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-5
"""fp32 against float64, relative norm (the issue's bound); the sums run in
another order (atomics), so the kernel is not bitwise the reference."""


def _sm_count() -> int:
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def _run_both(model, graph, blocks, optimizer, *, train=True, placement="partition"):
    import torch

    interp = dynamic.Interpreter(model, blocks=blocks, optimizer=optimizer, placement=placement)
    flat = interp.params.double().cpu().numpy()
    script = interp.schedule(graph, train=train)
    launched = interp.launch(script, poison=True)
    torch.cuda.synchronize()
    from persistrnn import runtime

    runtime.raise_reported_failure(0, "dynamic_interpreter")
    want = dynamic.run_script(script, flat, optimizer if train else None)
    return interp, launched, want, flat


def _check(interp, launched, want, train=True):
    got_loss = float(launched.loss.item())
    assert np.isfinite(got_loss)
    assert abs(got_loss - want.loss) <= TOLERANCE * abs(want.loss)
    assert rel(launched.values.double().cpu().numpy(), want.values) <= TOLERANCE
    if train:
        assert rel(interp.param_grads.double().cpu().numpy(), want.param_grads) <= TOLERANCE
        assert rel(interp.params.double().cpu().numpy(), want.params) <= TOLERANCE


@pytest.mark.parametrize("placement", dynamic.PLACEMENTS)
@pytest.mark.parametrize("variant", ["binary", "childsum"])
@pytest.mark.parametrize("blocks", [7, "sms"])
def test_tree_lstm_kernel_matches_reference_and_torch(variant, blocks, placement):
    # Hidden 61: odd rows per block; 12 trees: a matvec list longer than one group of 8 vectors.
    blocks = _sm_count() if blocks == "sms" else blocks
    model, builder, trees, vocab, graph = sst_batch(12, hidden=61, embedding=48, variant=variant, seed=blocks)
    interp, launched, want, flat = _run_both(model, graph, blocks, dynamic.SGD(0.2), placement=placement)
    _check(interp, launched, want)
    P = torch_params(model, flat)
    loss = sum(tree_lstm_loss(builder, P, t, vocab.ids) for t in trees)
    assert abs(float(launched.loss.item()) - loss.item()) <= TOLERANCE * loss.item()


@pytest.mark.parametrize("hidden, embedding", [(40, 33), (256, 256)])
def test_tagger_kernel_matches_reference_and_torch(hidden, embedding):
    # 256 / 256: the bench's sizes, whose four LSTM matrices (one shape) take their replicas side by side.
    model, builder, sentences, graph = wikiner_batch(6, hidden=hidden, embedding=embedding)
    interp, launched, want, flat = _run_both(model, graph, _sm_count(), dynamic.SGD(0.1), placement="replicate")
    if hidden == embedding == 256 and _sm_count() == 132:
        assert interp.layout.replicas[:4] == (2, 2, 2, 2)
    _check(interp, launched, want)
    P = torch_params(model, flat)
    loss = sum(tagger_loss(builder, P, w, t) for w, t in sentences)
    assert abs(float(launched.loss.item()) - loss.item()) <= TOLERANCE * loss.item()


@pytest.mark.parametrize("n", [7, 130])
def test_the_cells_match_the_reference_with_and_without_a_carried_cell(n):
    # lstm_cell and tree_cell, forward and backward, odd sizes and one wider than a block's threads per operand.
    model, biases, graph, _, _ = cells_graph(n)
    interp, launched, want, _ = _run_both(model, graph, 3, dynamic.SGD(0.1))
    _check(interp, launched, want)


@pytest.mark.parametrize("n, blocks, vectors", [(7, 3, 1), (7, 8, 1), (130, "sms", 1), (9, 5, 11), (40, 7, 3)])
def test_the_cell_matvecs_match_the_reference(n, blocks, vectors):
    # lstm_matvec and tree_matvec in every form, forward and backward: uneven units per block (7 on 3), one
    # unit on some blocks (7 on 8), more (vector, unit) pairs than a block's threads (130 units of 3-5 gates),
    # several groups of vectors (11) and a few vectors (3).
    blocks = _sm_count() if blocks == "sms" else blocks
    model, graph, _, _, _ = cell_matvecs_graph(n, width=33, copies=vectors)
    for train in (True, False):
        interp, launched, want, _ = _run_both(model, graph, blocks, dynamic.SGD(0.1) if train else None, train=train)
        _check(interp, launched, want, train=train)


def test_inference_kernel_matches_reference():
    model, builder, trees, vocab, graph = sst_batch(16, hidden=256, embedding=256)
    interp, launched, want, _ = _run_both(model, graph, _sm_count(), None, train=False)
    _check(interp, launched, want, train=False)


@pytest.mark.parametrize("train", [True, False])
def test_instrumented_build_counts_every_instruction_and_computes_the_same(train):
    import torch

    from persistrnn.dynamic.kernel import PROFILE_SLOTS

    model, builder, trees, vocab, graph = sst_batch(5, hidden=40, embedding=24)
    optimizer = dynamic.SGD(0.1) if train else None
    interp, launched, want, _ = _run_both(model, graph, 13, optimizer, train=train)
    instrumented = dynamic.Interpreter(model, blocks=13, optimizer=optimizer, profile=True)
    script = instrumented.schedule(graph, train=train)
    profiled = instrumented.launch(script, poison=True)
    torch.cuda.synchronize()
    _check(instrumented, profiled, want, train=train)
    counts = profiled.profile.cpu().numpy()
    for block in range(13):
        program = script.block_program(block)
        want_counts = np.bincount(program[:, 0], minlength=PROFILE_SLOTS)
        want_counts[0] = -(-len(program) // dynamic.KernelSpec(script.layout).chunk)  # the chunks fetched
        assert counts[block, 1:2 * PROFILE_SLOTS:2].tolist() == want_counts.tolist(), block
        assert (counts[block, 0:2 * PROFILE_SLOTS:2] > 0).tolist() == (want_counts > 0).tolist(), block
    assert (counts[:, -2:] > 0).all()  # the loop's cycles and nanoseconds
    rows = {row["op"]: row for row in dynamic.profile_table(profiled)}
    matvecs = script.program[:script.instructions, 0] == dynamic.script.OPCODES["matvec"]
    assert rows["matvec"]["instructions"] == int(matvecs.sum())


def test_adam_over_several_launches_matches_reference():
    import torch

    model, builder, trees, vocab, graph = sst_batch(4, hidden=32, embedding=24)
    optimizer = dynamic.Adam(0.01)
    interp = dynamic.Interpreter(model, blocks=11, optimizer=optimizer)
    flat = interp.params.double().cpu().numpy()
    script = interp.schedule(graph)
    state: dict = {}
    for step in range(1, 4):
        launched = interp.launch(script, poison=True)
        torch.cuda.synchronize()
        want = dynamic.run_script(script, flat, optimizer, step=step, state=state)
        _check(interp, launched, want)
        flat = interp.params.double().cpu().numpy()  # each step from the kernel's own parameters


def test_step_returns_the_previous_loss_and_sync_the_latest():
    model, builder, trees, vocab, _ = sst_batch(6, hidden=32, embedding=24)
    interp = dynamic.Interpreter(model, optimizer=dynamic.SGD(0.0))  # lr 0: every launch sees the same weights
    losses = []
    for t in trees[:3]:
        g = dynamic.Graph(model)
        builder.build(g, t, vocab)
        losses.append(dynamic.run_script(dynamic.schedule(g, interp.blocks), interp.params.double().cpu().numpy()).loss)
        got = interp.step(g)
        if len(losses) == 1:
            assert got is None
        else:
            assert abs(got - losses[-2]) <= TOLERANCE * losses[-2]
    assert abs(interp.sync() - losses[-1]) <= TOLERANCE * losses[-1]


def test_step_takes_scripts_made_ahead_by_worker_processes():
    model, builder, trees, vocab, _ = sst_batch(9, hidden=32, embedding=24)
    interp = dynamic.Interpreter(model, optimizer=dynamic.SGD(0.0))  # lr 0: every launch sees the same weights
    batches = [trees[0:1], trees[1:5], trees[5:9]]

    def build(g, batch):
        builder.build_batch(g, batch, vocab)

    params = interp.params.double().cpu().numpy()
    want = []
    for batch in batches:
        g = dynamic.Graph(model)
        build(g, batch)
        want.append(dynamic.run_script(dynamic.schedule(g, interp.blocks), params).loss)
    got = [interp.step(script) for script in interp.scripts(batches, build, workers=2)][1:] + [interp.sync()]
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(got, want)), (got, want)
    forward_only = next(iter(interp.scripts(batches[:1], build, train=False)))
    assert abs(interp.run(forward_only, train=False) - want[0]) <= TOLERANCE * abs(want[0])
    with pytest.raises(ArgumentError, match="scheduled with train=False, got train=True"):
        interp.step(forward_only)


def test_a_warm_start_compiles_nothing():
    from persistrnn import runtime

    model, builder, trees, vocab, graph = sst_batch(2, hidden=48, embedding=40)
    dynamic.Interpreter(model, blocks=9).run(graph)
    dynamic.compile_spec.cache_clear()  # in-process cache gone; the disk cache remains
    before = runtime.nvrtc_compiles()
    model2, _, _, _, graph2 = sst_batch(2, hidden=48, embedding=40)
    assert np.isfinite(dynamic.Interpreter(model2, blocks=9).run(graph2))
    assert runtime.nvrtc_compiles() == before
