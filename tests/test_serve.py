"""The serving engine (persistrnn.serve): every stream's outputs equal running
that stream alone through the module, under random arrival and departure
from many client threads; back-pressure, closing and errors never hang.

The CPU tests run the module's torch implementation; the ``gpu`` tests run the
same checks on CUDA, where batches are padded to powers of two and the
forward is the planner's path."""

import concurrent.futures
import contextlib
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

import persistrnn
from persistrnn import serve
from persistrnn.errors import ArgumentError, ArgumentTypeError, EngineFullError, InputShapeError, InputTypeError
from persistrnn.persistent.config import RESIDENT_CONTROL

TOLERANCES = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-5, atol=2e-6)}
"""fp32 rounding: a stream's rows in a batch and the same stream alone go
through GEMMs of different shapes, which sum in different orders."""

WAIT = 20.0  # seconds: a bound on every wait of a test, far above what a passing test takes


def make_model(cell: str, input_size: int = 7, hidden: int = 13, layers: int = 2, **kw):
    torch.manual_seed(0)
    if cell == "lstm":
        return persistrnn.LSTM(input_size, hidden, num_layers=layers, **kw).eval()
    if cell == "gru":
        return persistrnn.GRU(input_size, hidden, num_layers=layers, **kw).eval()
    if cell == "gru_reset_before":
        return persistrnn.GRU(input_size, hidden, num_layers=layers, reset_after=False, **kw).eval()
    return persistrnn.RNN(input_size, hidden, num_layers=layers, **kw).eval()


def alone(model, chunks):
    """The stream run alone through the module: all its steps in one call."""
    steps = torch.cat([c if c.dim() == 2 else c[None] for c in chunks])
    with torch.no_grad():
        return model(steps.to(model.weight_hh_l0.device))[0].cpu()


def random_streams(rng: random.Random, count: int, input_size: int, lengths=(1, 3), max_chunks: int = 12):
    """``count`` streams of 1..max_chunks chunks; each chunk (T, I) with T
    from ``lengths``, or (I,) (one step, unbatched) now and then."""
    streams = []
    for _ in range(count):
        chunks = []
        for _ in range(rng.randint(1, max_chunks)):
            T = rng.choice(lengths)
            chunks.append(torch.randn(input_size) if T == 1 and rng.random() < 0.3 else torch.randn(T, input_size))
        streams.append(chunks)
    return streams


def open_waiting(engine, deadline):
    """Open a stream, waiting (bounded) while the engine is full."""
    while True:
        try:
            return engine.open()
        except EngineFullError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def serve_clients(engine, streams, threads: int, seed: int, to_device=None):
    """Serve ``streams`` from ``threads`` client threads: each opens its
    streams as slots free up, pushes and pulls in a random interleaving (or
    submits and waits on futures), and closes; returns each stream's outputs."""
    outputs = [None] * len(streams)
    deadline = time.monotonic() + WAIT
    errors = []

    def client(k: int) -> None:
        rng = random.Random(seed + k)
        try:
            for i in range(k, len(streams), threads):
                chunks = streams[i] if to_device is None else [c.to(to_device) for c in streams[i]]
                stream = open_waiting(engine, deadline)
                got = []
                if rng.random() < 0.25:  # futures instead of pulls
                    futures = [stream.submit(c, timeout=WAIT) for c in chunks]
                    got = [f.result(timeout=WAIT) for f in futures]
                else:
                    pushed = 0
                    while len(got) < len(chunks):
                        ahead = pushed - len(got)
                        if pushed < len(chunks) and ahead < engine.max_pending and (ahead == 0 or rng.random() < 0.6):
                            stream.push(chunks[pushed])
                            pushed += 1
                        else:
                            got.append(stream.pull(timeout=WAIT))
                stream.close()
                outputs[i] = got
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    run_clients(client, threads, errors)
    return outputs


def run_clients(client, threads: int, errors: list) -> None:
    """``client(k)`` in ``threads`` threads, each bounded in time; re-raises a
    client's first failure (``client`` appends them to ``errors``)."""
    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT + 5)
    assert not any(w.is_alive() for w in workers), "a client thread did not finish"
    if errors:
        raise errors[0]


def serve_interleaved(engine, streams, threads: int, seed: int):
    """Many streams live at once: each client thread holds its share of
    ``streams`` open together, each joining at a random round and leaving
    after its last chunk; every round it pushes one chunk to each of its
    live streams, then pulls them all. Returns each stream's outputs."""
    outputs = [[] for _ in streams]
    errors = []

    def client(k: int) -> None:
        rng = random.Random(seed + k)
        mine = list(range(k, len(streams), threads))
        joins = {i: rng.randrange(4) for i in mine}
        live = {}
        try:
            for round_ in range(max(joins[i] + len(streams[i]) for i in mine) if mine else 0):
                for i in mine:
                    if joins[i] == round_:
                        live[i] = engine.open()
                for i, stream in live.items():
                    stream.push(streams[i][round_ - joins[i]])
                for i, stream in list(live.items()):
                    outputs[i].append(stream.pull(timeout=WAIT))
                    if len(outputs[i]) == len(streams[i]):
                        stream.close()
                        del live[i]
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    run_clients(client, threads, errors)
    return outputs


def check_outputs(model, streams, outputs, tolerance):
    for i, (chunks, got) in enumerate(zip(streams, outputs)):
        assert len(got) == len(chunks)
        for chunk, out in zip(chunks, got):  # each output has its chunk's shape: (T, H) or (H,)
            assert out.shape == (*chunk.shape[:-1], model.hidden_size), (i, chunk.shape, out.shape)
        joined = torch.cat([o.cpu() if o.dim() == 2 else o.cpu()[None] for o in got])
        torch.testing.assert_close(joined, alone(model, chunks), **tolerance, msg=lambda m, i=i: f"stream {i}: {m}")


# ---- outputs under random arrival and departure ------------------------------------------

@pytest.mark.parametrize("cell", ["lstm", "gru", "gru_reset_before", "rnn_tanh"])
def test_every_stream_equals_running_it_alone_under_random_arrival_and_departure(cell):
    model = make_model(cell)
    streams = random_streams(random.Random(1), count=48, input_size=7)
    # 6 slots for 48 streams: slots are reused many times, so a new stream's state must start from zero
    with serve.Engine(model, max_streams=6, max_pending=3, timeout=WAIT) as engine:
        outputs = serve_clients(engine, streams, threads=8, seed=2)
        assert engine.live_streams == 0
        assert engine.chunks_run == sum(len(s) for s in streams)
        assert engine.chunks_run > engine.ticks  # chunks of several streams did share ticks
    check_outputs(model, streams, outputs, TOLERANCES["cpu"])


def test_hundreds_of_streams_live_at_once_from_eight_threads():
    model = make_model("lstm", input_size=5, hidden=8, layers=1)
    streams = random_streams(random.Random(18), count=240, input_size=5, lengths=(1, 2), max_chunks=6)
    with serve.Engine(model, max_streams=240, max_pending=2) as engine:
        outputs = serve_interleaved(engine, streams, threads=8, seed=19)
        assert engine.chunks_run / engine.ticks > 8  # the live streams did share ticks
    check_outputs(model, streams, outputs, TOLERANCES["cpu"])


def test_a_torch_module_is_converted_and_batch_first_and_one_layer_work():
    torch.manual_seed(3)
    lstm = torch.nn.LSTM(5, 9, batch_first=True)
    streams = random_streams(random.Random(4), count=10, input_size=5, lengths=(1, 2, 5))
    with serve.Engine(lstm, max_streams=4) as engine:
        assert isinstance(engine.model, persistrnn.LSTM) and engine.model.weight_hh_l0 is lstm.weight_hh_l0
        outputs = serve_clients(engine, streams, threads=3, seed=5)
    with torch.no_grad():
        for chunks, got in zip(streams, outputs):  # alone, through torch's own batch_first module
            steps = torch.cat([c if c.dim() == 2 else c[None] for c in chunks])
            want = lstm(steps[None])[0][0]
            torch.testing.assert_close(torch.cat([o if o.dim() == 2 else o[None] for o in got]), want,
                                       **TOLERANCES["cpu"])


def check_an_engine_made_under_inference_mode(model, device, **engine_options):
    # Serving code often builds its engine inside torch.inference_mode(); the worker, another thread, runs
    # outside it and updates the engine's states in place. Chunks pushed under inference mode and outside it.
    streams = random_streams(random.Random(30), count=6, input_size=model.input_size, lengths=(1, 2))
    with torch.inference_mode():
        engine = serve.Engine(model, max_streams=3, timeout=WAIT, **engine_options)
    with engine:
        outputs = []
        for i, chunks in enumerate(streams):
            stream, got = engine.open(), []
            for chunk in chunks:
                with torch.inference_mode() if i % 2 else contextlib.nullcontext():
                    stream.push(chunk.to(device))
                got.append(stream.pull(timeout=WAIT))
            stream.close()
            outputs.append(got)
    check_outputs(model, streams, outputs, TOLERANCES[torch.device(device).type])


def test_an_engine_made_under_inference_mode_runs_its_worker_outside_it():
    check_an_engine_made_under_inference_mode(make_model("lstm"), "cpu")


def test_a_slot_without_input_does_not_advance():
    model = make_model("gru", layers=1)
    with serve.Engine(model, max_streams=2) as engine:
        idle, busy = engine.open(), engine.open()
        first = torch.randn(2, 7)
        idle.push(first)
        idle.pull(timeout=WAIT)
        for _ in range(20):  # the other slot runs 20 ticks
            busy.push(torch.randn(1, 7))
            busy.pull(timeout=WAIT)
        second = torch.randn(3, 7)
        idle.push(second)
        got = idle.pull(timeout=WAIT)
    torch.testing.assert_close(got, alone(model, [first, second])[2:], **TOLERANCES["cpu"])


def test_one_tick_of_single_steps_one_step_rows_and_longer_chunks_gives_each_its_own_shape():
    # (I,) and (1, I) chunks share one batch of length 1 and are split from it
    # each way; a (3, I) chunk runs as a second batch of the same tick.
    model = gated_model()
    with serve.Engine(model, max_streams=4) as engine:
        holder, single, row, longer = (engine.open() for _ in range(4))
        holder.push(torch.randn(1, 7))
        assert model.entered.wait(WAIT)  # the next tick takes the three chunks below together
        chunks = {single: torch.randn(7), row: torch.randn(1, 7), longer: torch.randn(3, 7)}
        for stream, chunk in chunks.items():
            stream.push(chunk)
        model.gate.set()
        holder.pull(timeout=WAIT)
        got = {stream: stream.pull(timeout=WAIT) for stream in chunks}
        assert engine.ticks == 2
    for stream, chunk in chunks.items():
        assert got[stream].shape == (*chunk.shape[:-1], 13)
        want = alone(model, [chunk])
        torch.testing.assert_close(got[stream], want[0] if chunk.dim() == 1 else want, **TOLERANCES["cpu"])


def test_a_waiting_pull_and_a_push_waiting_for_room_are_woken_when_a_chunk_runs():
    model = gated_model()
    with serve.Engine(model, max_streams=2, max_pending=1) as engine:
        pulled, submitted = engine.open(), engine.open()
        chunk = torch.randn(2, 7)
        pulled.push(chunk)
        first = submitted.submit(torch.randn(1, 7))  # holds the stream's one pending place until it has run
        assert model.entered.wait(WAIT)
        got, pushed = [], threading.Event()
        # Their own timeouts (2 WAIT) outlast the joins below: a waiter the tick did not wake fails the test.
        waiting_pull = threading.Thread(target=lambda: got.append(pulled.pull(timeout=2 * WAIT)))
        waiting_push = threading.Thread(target=lambda: (submitted.push(torch.randn(1, 7), timeout=2 * WAIT),
                                                        pushed.set()))
        waiting_pull.start()
        waiting_push.start()
        time.sleep(0.05)
        assert not got and not pushed.is_set()  # both wait on the running tick
        model.gate.set()
        waiting_pull.join(WAIT / 2)
        assert got
        waiting_push.join(WAIT / 2)
        assert pushed.is_set() and first.result(WAIT).shape == (1, 13)
        torch.testing.assert_close(got[0], alone(model, [chunk]), **TOLERANCES["cpu"])
        submitted.pull(timeout=WAIT)


# ---- groups: push_many and pull_many ---------------------------------------------------------

def serve_groups(engine, streams, threads: int, seed: int):
    """Serve ``streams`` from ``threads`` client threads, each holding its
    share open at once and, in random rounds, pushing the next chunk of a
    random subset of them (one ``push_many`` of a tensor, of a sequence of
    one shape or of mixed shapes, or single pushes), up to ``max_pending``
    ahead, and taking the outputs of another subset (``pull_many`` or single
    pulls). A group's tensor is overwritten once queued: the engine copied it.
    Returns each stream's outputs."""
    outputs = [[] for _ in streams]
    errors = []

    def client(k: int) -> None:
        rng = random.Random(seed + k)
        mine = list(range(k, len(streams), threads))
        opened = {i: engine.open() for i in mine}
        pushed = dict.fromkeys(mine, 0)
        try:
            while any(len(outputs[i]) < len(streams[i]) for i in mine):
                can_push = [i for i in mine if pushed[i] < len(streams[i])
                            and pushed[i] - len(outputs[i]) < engine.max_pending]
                group = rng.sample(can_push, rng.randint(0, len(can_push)))
                if group:
                    chunks = [streams[i][pushed[i]] for i in group]
                    how = rng.choice(("tensor", "sequence", "single"))
                    if how == "tensor":  # only the streams whose next chunk has the first one's shape and device
                        group = [i for i, c in zip(group, chunks)
                                 if (c.shape, c.device) == (chunks[0].shape, chunks[0].device)]
                        rows = torch.stack([streams[i][pushed[i]] for i in group])
                        engine.push_many([opened[i] for i in group], rows)
                        rows.fill_(float("nan"))
                    elif how == "sequence":
                        engine.push_many([opened[i] for i in group], chunks)
                    else:
                        for i, chunk in zip(group, chunks):
                            opened[i].push(chunk)
                    for i in group:
                        pushed[i] += 1
                can_pull = [i for i in mine if len(outputs[i]) < pushed[i]]
                if not can_pull:  # nothing pushed this round, nothing outstanding
                    continue
                group = rng.sample(can_pull, rng.randint(0 if group else 1, len(can_pull)))
                if rng.random() < 0.7:
                    got = engine.pull_many([opened[i] for i in group], timeout=WAIT)
                else:
                    got = [opened[i].pull(timeout=WAIT) for i in group]
                for i, out in zip(group, got):
                    assert isinstance(out, torch.Tensor), out
                    outputs[i].append(out)
            for stream in opened.values():
                stream.close()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    run_clients(client, threads, errors)
    return outputs


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_groups_mixed_with_single_pushes_give_every_stream_its_outputs_alone(cell):
    model = make_model(cell)
    streams = random_streams(random.Random(20), count=45, input_size=7, lengths=(1, 3), max_chunks=9)
    with serve.Engine(model, max_streams=45, max_pending=3, timeout=WAIT) as engine:
        outputs = serve_groups(engine, streams, threads=3, seed=21)
        assert engine.chunks_run == sum(len(s) for s in streams)
        assert engine.chunks_run > engine.ticks  # groups shared ticks
    check_outputs(model, streams, outputs, TOLERANCES["cpu"])


def test_a_streams_chunks_run_in_the_order_queued_across_groups_and_single_pushes():
    model = gated_model()
    with serve.Engine(model, max_streams=4, max_pending=4) as engine:
        holder, s, t, u = (engine.open() for _ in range(4))
        holder.push(torch.randn(1, 7))
        assert model.entered.wait(WAIT)  # everything below is queued before any of it runs
        chunks = {s: [torch.randn(2, 7), torch.randn(7), torch.randn(2, 7), torch.randn(1, 7)],
                  t: [torch.randn(7), torch.randn(5, 7)], u: [torch.randn(7)]}
        s.push(chunks[s][0])
        engine.push_many([t, s], torch.stack([chunks[t][0], chunks[s][1]]))  # (2, I): one step each
        engine.push_many([s, u, t], [chunks[s][2], chunks[u][0], chunks[t][1]])
        s.push(chunks[s][3])
        model.gate.set()
        holder.pull(timeout=WAIT)
        got = {stream: [] for stream in chunks}
        got[s].append(s.pull(timeout=WAIT))
        for order in ([t, s], [u, s, t], [s]):
            for stream, out in zip(order, engine.pull_many(order, timeout=WAIT)):
                got[stream].append(out)
    check_outputs(model, list(chunks.values()), list(got.values()), TOLERANCES["cpu"])


def test_a_group_with_a_full_stream_is_refused_whole_and_waits_for_room():
    model = make_model("lstm")
    with serve.Engine(model, max_streams=3, max_pending=2) as engine:
        a, full, c = (engine.open() for _ in range(3))
        first = [torch.randn(1, 7) for _ in range(2)]
        for chunk in first:
            full.push(chunk)
        with pytest.raises(EngineFullError, match=f"push_many: stream {full.number} holds 2 chunks.*max_pending=2.*"
                                                  "no chunk of the group was queued"):
            engine.push_many([a, full, c], torch.randn(3, 1, 7))
        assert (a.pending, full.pending, c.pending) == (0, 2, 0)
        group = torch.randn(3, 1, 7)
        pulled = []
        puller = threading.Timer(0.05, lambda: pulled.append(full.pull(timeout=WAIT)))
        puller.start()
        engine.push_many([a, full, c], group, timeout=WAIT)  # waits for the pull above to make room
        puller.join(WAIT)
        got_a, got_c = engine.pull_many([a, c], timeout=WAIT)
        pulled += [full.pull(timeout=WAIT) for _ in range(2)]
    # The refused group never ran: a and c start from their zero states at the accepted one.
    check_outputs(model, [[group[0]], first + [group[1]], [group[2]]], [[got_a], pulled, [got_c]],
                  TOLERANCES["cpu"])


def test_a_group_with_a_closed_failed_foreign_or_repeated_stream_is_refused_whole():
    torch.manual_seed(0)
    model = FailingLSTM(7, 13).eval()
    with serve.Engine(model, max_streams=4) as engine, serve.Engine(model, max_streams=1) as other:
        a, closed, bad = (engine.open() for _ in range(3))
        closed.close()
        bad.push(torch.full((1, 7), float("nan")))
        with pytest.raises(RuntimeError, match="the model saw a NaN"):
            bad.pull(timeout=WAIT)
        for group, error, message in (
                ([a, closed], ArgumentError, f"push_many: expected an open stream, got stream {closed.number} closed"),
                ([a, bad], ArgumentError, f"stream {bad.number} failed by RuntimeError"),
                ([a, other.open()], ArgumentError, "expected streams of Engine.*of another engine"),
                ([a, a], ArgumentError, f"expected distinct streams, got stream {a.number} twice"),
                ([a, 3], ArgumentTypeError, "expected Stream objects, got int")):
            with pytest.raises(error, match=message):
                engine.push_many(group, torch.randn(2, 7))
            assert a.pending == 0
        with pytest.raises(ArgumentError, match=f"pull_many: .*none left in stream {closed.number}, closed"):
            engine.pull_many([a, closed], timeout=WAIT)
        with pytest.raises(ArgumentError, match=f"got stream {a.number} twice"):
            engine.pull_many([a, a])
        chunk = torch.randn(7)
        engine.push_many([a], [chunk])
        torch.testing.assert_close(engine.pull_many([a], timeout=WAIT)[0], alone(model, [chunk])[0],
                                   **TOLERANCES["cpu"])
        ticks = engine.ticks
        engine.push_many([], torch.randn(0, 7))  # an empty group queues nothing and runs no tick
        assert engine.pull_many([]) == [] and a.pending == 0 and engine.ticks == ticks


def test_a_group_pull_that_times_out_takes_nothing_and_an_error_comes_back_in_its_place():
    model = gated_model()
    with serve.Engine(model, max_streams=4) as engine:
        holder, a, b, idle = (engine.open() for _ in range(4))
        holder.push(torch.randn(1, 7))
        assert model.entered.wait(WAIT)
        rows = torch.randn(2, 3, 7)
        engine.push_many([a, b], rows)
        with pytest.raises(TimeoutError, match=f"pull_many: stream {a.number}'s chunk did not run within 0.05 s; "
                                               "no chunk of the group was taken"):
            engine.pull_many([a, b], timeout=0.05)
        a.close()  # a's chunk is cancelled; b's runs
        model.gate.set()
        holder.pull(timeout=WAIT)
        with pytest.raises(TimeoutError, match=f"no chunk was pushed to stream {idle.number}"):
            engine.pull_many([b, idle], timeout=0.05)
        got_a, got_b = engine.pull_many([a, b], timeout=WAIT)  # b's output was left by the timed-out call
        assert isinstance(got_a, concurrent.futures.CancelledError)
        assert "the stream was closed before this chunk ran" in str(got_a)
        torch.testing.assert_close(got_b, alone(model, [rows[1]]), **TOLERANCES["cpu"])


def test_group_chunks_of_the_wrong_shape_kind_or_count_say_what_was_expected():
    with serve.Engine(make_model("lstm"), 3) as engine:
        streams = [engine.open() for _ in range(3)]
        for chunks, error, message in (
                (torch.randn(3, 2, 8), InputShapeError,
                 r"push_many: expected a chunk of shape \(3, T, 7\) with T >= 1 or \(3, 7\), got \(3, 2, 8\)"),
                (torch.randn(2, 7), InputShapeError, r"got \(2, 7\)"),
                (torch.randn(3, 0, 7), InputShapeError, r"got \(3, 0, 7\)"),
                (torch.ones(3, 7, dtype=torch.long), InputShapeError, "floating-point chunk, got torch.int64"),
                ([torch.randn(7)] * 2, InputShapeError, r"one chunk per stream \(3\), got 2"),
                ([torch.randn(7), torch.randn(1, 8), torch.randn(7)], InputShapeError,
                 r"push_many: chunk 1: expected a chunk of shape \(T, 7\).*got \(1, 8\)"),
                ([torch.randn(7), [0.0] * 7, torch.randn(7)], InputTypeError,
                 "chunk 1: expected a chunk tensor, got list"),
                (5, InputTypeError, r"expected a chunk tensor \(n, T, I\) or \(n, I\), or a sequence of chunks, "
                                    "got int")):
            with pytest.raises(error, match=message):
                engine.push_many(streams, chunks)
        assert [s.pending for s in streams] == [0, 0, 0]
        # float64 chunks of one shape: one stack, converted to the engine's dtype
        chunks = [torch.randn(2, 7, dtype=torch.float64) for _ in range(3)]
        engine.push_many(streams, chunks)
        for chunk, out in zip(chunks, engine.pull_many(streams, timeout=WAIT)):
            assert out.dtype == torch.float32 and out.shape == (2, 13)
            torch.testing.assert_close(out, alone(engine.model, [chunk.float()]), **TOLERANCES["cpu"])


# ---- limits and back-pressure ----------------------------------------------------------------

def test_a_full_engine_refuses_a_new_stream_and_takes_one_when_a_slot_frees():
    with serve.Engine(make_model("lstm"), max_streams=2) as engine:
        a, _ = engine.open(), engine.open()
        with pytest.raises(EngineFullError, match="all 2 slots taken"):
            engine.open()
        a.close()
        assert engine.open().slot == a.slot


def test_push_is_bounded_by_max_pending_and_waits_for_a_pull():
    model = make_model("lstm")
    with serve.Engine(model, max_streams=2, max_pending=3) as engine:
        stream = engine.open()
        chunks = [torch.randn(1, 7) for _ in range(4)]
        for c in chunks[:3]:
            stream.push(c)
        t0 = time.monotonic()
        with pytest.raises(EngineFullError, match="holds 3 chunks that were not pulled.*max_pending=3"):
            stream.push(chunks[3], timeout=0.1)
        assert 0.1 <= time.monotonic() - t0 < WAIT
        first = []
        puller = threading.Timer(0.1, lambda: first.append(stream.pull(timeout=WAIT)))
        puller.start()
        stream.push(chunks[3], timeout=WAIT)  # waits for the pull above to make room
        puller.join(WAIT)
        got = first + [stream.pull(timeout=WAIT) for _ in range(3)]
    check_outputs(model, [chunks], [got], TOLERANCES["cpu"])


def test_a_stream_that_never_pulls_does_not_stall_the_others():
    model = make_model("lstm")
    with serve.Engine(model, max_streams=3, max_pending=2) as engine:
        stuck = engine.open()
        stuck.push(torch.randn(1, 7))
        stuck.push(torch.randn(1, 7))
        with pytest.raises(EngineFullError):
            stuck.push(torch.randn(1, 7))
        streams = random_streams(random.Random(6), count=6, input_size=7)
        outputs = serve_clients(engine, streams, threads=2, seed=7)
    check_outputs(model, streams, outputs, TOLERANCES["cpu"])


# ---- closing -------------------------------------------------------------------------------

class GatedLSTM(persistrnn.LSTM):
    """An LSTM whose forward waits (bounded) for ``gate``: holds a tick running."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def forward(self, *args, **kw):
        self.entered.set()
        self.gate.wait(WAIT)
        return super().forward(*args, **kw)


def gated_model():
    torch.manual_seed(0)
    return GatedLSTM(7, 13).eval()


def test_closing_the_engine_cancels_what_has_not_run_and_pending_pulls_raise():
    model = gated_model()
    engine = serve.Engine(model, max_streams=2, timeout=WAIT)
    stream = engine.open()
    chunks = [torch.randn(1, 7) for _ in range(3)]
    for c in chunks:
        stream.push(c)
    assert model.entered.wait(WAIT)  # chunk 0 is in a running tick; 1 and 2 are queued
    threading.Timer(0.2, model.gate.set).start()
    engine.close()  # the running tick completes; the rest is cancelled
    torch.testing.assert_close(stream.pull(timeout=WAIT), alone(model, chunks[:1]), **TOLERANCES["cpu"])
    for _ in range(2):
        with pytest.raises(concurrent.futures.CancelledError, match="the engine was closed before this chunk ran"):
            stream.pull(timeout=WAIT)
    with pytest.raises(ArgumentError, match="none left in stream 0, closed"):
        stream.pull(timeout=WAIT)
    with pytest.raises(ArgumentError, match="expected an open stream, got stream 0 closed"):
        stream.push(chunks[0])
    with pytest.raises(ArgumentError, match="expected a running engine, got a closed one"):
        engine.open()
    engine.close()  # twice: nothing


def test_a_pull_times_out_and_leaves_the_chunk_for_a_later_pull():
    model = gated_model()
    with serve.Engine(model, max_streams=1) as engine:
        stream = engine.open()
        with pytest.raises(TimeoutError, match="no chunk was pushed"):
            stream.pull(timeout=0.05)
        chunk = torch.randn(2, 7)
        stream.push(chunk)
        with pytest.raises(TimeoutError, match="did not run within"):
            stream.pull(timeout=0.05)
        model.gate.set()
        torch.testing.assert_close(stream.pull(timeout=WAIT), alone(model, [chunk]), **TOLERANCES["cpu"])


def test_a_close_whose_worker_does_not_finish_raises_and_fails_the_running_tick():
    model = gated_model()
    engine = serve.Engine(model, max_streams=1, timeout=0.2)
    stream = engine.open()
    stream.push(torch.randn(1, 7))
    assert model.entered.wait(WAIT)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not stop within 0.2 s"):
        engine.close()
    with pytest.raises(TimeoutError, match="did not finish the running tick"):
        stream.pull(timeout=WAIT)
    assert time.monotonic() - t0 < WAIT
    model.gate.set()  # let the worker end


def test_closing_a_stream_frees_its_slot_and_cancels_its_queue_only():
    model = gated_model()
    with serve.Engine(model, max_streams=2) as engine:
        a, b = engine.open(), engine.open()
        a.push(torch.randn(1, 7))
        assert model.entered.wait(WAIT)
        a.push(torch.randn(1, 7))
        b_chunk = torch.randn(1, 7)
        b.push(b_chunk)
        a.close()
        # The slot is free at once, though a's chunk is still in the running tick; the tick writes a's states
        # back into it, and the new stream's first tick starts it from zeros all the same.
        c = engine.open()
        assert c.slot == a.slot
        c_chunk = torch.randn(2, 7)
        c.push(c_chunk)
        model.gate.set()
        a.pull(timeout=WAIT)  # ran before the close
        with pytest.raises(concurrent.futures.CancelledError, match="stream 0: the stream was closed"):
            a.pull(timeout=WAIT)
        torch.testing.assert_close(b.pull(timeout=WAIT), alone(model, [b_chunk]), **TOLERANCES["cpu"])
        torch.testing.assert_close(c.pull(timeout=WAIT), alone(model, [c_chunk]), **TOLERANCES["cpu"])


def test_closing_from_a_done_callback_stops_the_worker_and_a_later_close_waits_for_it():
    model = gated_model()  # the chunk runs only once the callback is in place: the worker then calls it
    engine = serve.Engine(model, max_streams=1)
    stream = engine.open()
    seen = []

    def on_done(_future):
        try:
            engine.close(cancel=False)  # the worker would wait for itself
        except ArgumentError as exc:
            seen.append(str(exc))
        engine.close()  # returns at once: the worker stops after this tick

    stream.submit(torch.randn(1, 7)).add_done_callback(on_done)
    model.gate.set()
    deadline = time.monotonic() + WAIT
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and "called on the engine's worker" in seen[0]
    engine.close()  # again, from this thread: waits for the worker, which has stopped
    assert not engine._worker.is_alive() and engine not in serve._LIVE_ENGINES


def test_timeouts_past_what_a_thread_can_wait_are_refused():
    import math

    for bad in (math.inf, 1e12):
        with pytest.raises(ArgumentError, match="at most threading.TIMEOUT_MAX"):
            serve.Engine(torch.nn.GRU(7, 5), max_streams=1, timeout=bad)
    with pytest.raises(ArgumentTypeError, match="expected a timeout in seconds \\(a number > 0"):
        serve.Engine(torch.nn.GRU(7, 5), max_streams=1, timeout="5")
    with serve.Engine(torch.nn.GRU(7, 5), max_streams=1) as engine:
        stream = engine.open()
        with pytest.raises(ArgumentError, match="pull: expected a timeout in seconds"):
            stream.pull(timeout=math.inf)


def test_an_engine_left_open_is_closed_at_exit():
    code = ("import torch, persistrnn; e = persistrnn.serve.Engine(torch.nn.GRU(3, 4), 2); s = e.open(); "
            "[s.push(torch.randn(1, 3)) for _ in range(3)]; print(s.pull(timeout=10).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([1, 4])"


# ---- errors --------------------------------------------------------------------------------

class FailingLSTM(persistrnn.LSTM):
    """An LSTM that raises on a batch holding a NaN."""

    def forward(self, input, hx=None):
        if torch.isnan(input).any():
            raise RuntimeError("the model saw a NaN")
        return super().forward(input, hx)


def test_an_error_in_the_model_is_delivered_and_fails_only_its_stream():
    torch.manual_seed(0)
    model = FailingLSTM(7, 13).eval()
    with serve.Engine(model, max_streams=2) as engine:
        bad, good = engine.open(), engine.open()
        bad.push(torch.full((1, 7), float("nan")))
        with pytest.raises(RuntimeError, match="the model saw a NaN"):
            bad.pull(timeout=WAIT)
        with pytest.raises(ArgumentError, match="stream 0 failed by RuntimeError"):
            bad.push(torch.randn(1, 7))
        chunks = [torch.randn(2, 7) for _ in range(3)]
        got = []
        for c in chunks:
            good.push(c)
            got.append(good.pull(timeout=WAIT))
        check_outputs(model, [chunks], [got], TOLERANCES["cpu"])


def test_a_failure_of_the_worker_itself_reaches_every_waiting_pull(monkeypatch):
    model = gated_model()
    engine = serve.Engine(model, max_streams=2)

    def broken(self):
        raise RuntimeError("the worker broke")

    monkeypatch.setattr(serve.Engine, "_take_chunks", broken)
    stream = engine.open()
    stream.push(torch.randn(1, 7))
    with pytest.raises(RuntimeError, match="the worker broke"):
        stream.pull(timeout=WAIT)
    with pytest.raises(ArgumentError, match="stopped by RuntimeError"):
        engine.open()
    engine.close()


def test_a_cancelled_future_skips_its_chunk():
    model = gated_model()
    with serve.Engine(model, max_streams=1) as engine:
        stream = engine.open()
        first = torch.randn(1, 7)
        running = stream.submit(first)
        assert model.entered.wait(WAIT)
        skipped = stream.submit(torch.randn(1, 7))
        assert skipped.cancel()
        last = torch.randn(1, 7)
        after = stream.submit(last)
        model.gate.set()
        got = [running.result(WAIT), after.result(WAIT)]
    check_outputs(model, [[first, last]], [got], TOLERANCES["cpu"])


def test_bad_arguments_and_chunks_say_what_was_expected():
    with pytest.raises(ArgumentTypeError, match="expected a persistrnn or torch.nn LSTM, GRU or RNN, got Linear"):
        serve.Engine(torch.nn.Linear(2, 2), 4)
    with pytest.raises(ArgumentError, match="unidirectional"):
        serve.Engine(torch.nn.LSTM(2, 2, bidirectional=True), 4)
    with pytest.raises(ArgumentError, match="eval mode"):
        serve.Engine(torch.nn.LSTM(2, 2, num_layers=2, dropout=0.5), 4)
    with pytest.raises(ArgumentError, match="positive int max_streams, got 0"):
        serve.Engine(torch.nn.LSTM(2, 2), 0)
    with serve.Engine(make_model("lstm"), 1) as engine:
        stream = engine.open()
        with pytest.raises(InputShapeError, match=r"expected a chunk of shape \(T, 7\) with T >= 1 or \(7,\), "
                                                  r"got \(3, 8\)"):
            stream.push(torch.randn(3, 8))
        with pytest.raises(InputShapeError, match="got \\(0, 7\\)"):
            stream.push(torch.randn(0, 7))
        with pytest.raises(InputTypeError, match="got list"):
            stream.push([0.0] * 7)
        # A wait's bound is checked when given, not first used when a stream is full.
        for bad, error in ((None, ArgumentTypeError), ("1", ArgumentTypeError), (True, ArgumentTypeError),
                           (-1.0, ArgumentError)):
            with pytest.raises(error, match="push: expected a timeout in seconds \\(a number >= 0 and at most "):
                stream.push(torch.randn(7), timeout=bad)
            with pytest.raises(error, match="push_many: expected a timeout in seconds"):
                engine.push_many([stream], torch.randn(1, 7), timeout=bad)
        with pytest.raises(ArgumentError, match="pull: expected a timeout in seconds"):
            stream.pull(timeout=-1)
        assert stream.pending == 0  # nothing was queued by a refused call
        for streams in ({stream}, stream):  # a set would pair rows with streams in hash order
            with pytest.raises(ArgumentTypeError, match="push_many: expected a sequence of Stream objects, got"):
                engine.push_many(streams, torch.randn(1, 7))


def test_resident_mode_says_what_it_needs():
    with pytest.raises(ArgumentError, match="resident=True\\): expected a 1-layer model, got 2 layers"):
        serve.Engine(make_model("lstm"), 4, resident=True)
    with pytest.raises(ArgumentError, match="expected a persistrnn module \\(convert=True\\), got torch's LSTM"):
        serve.Engine(torch.nn.LSTM(3, 4), 4, convert=False, resident=True)
    with pytest.raises(ArgumentError, match="expected a model on a CUDA device, got one on cpu"):
        serve.Engine(make_model("gru", layers=1), 4, resident=True)
    with pytest.raises(ArgumentTypeError, match="expected a bool resident, got str"):
        serve.Engine(make_model("gru", layers=1), 4, resident="yes")


# ---- the load generator (python -m persistrnn bench serve) -----------------------------------

def test_the_padding_peer_pads_to_every_live_stream_and_still_equals_each_stream_alone():
    from persistrnn.bench import serve as bench

    torch.manual_seed(0)
    model = torch.nn.GRU(7, 13).eval()
    streams = random_streams(random.Random(16), count=12, input_size=7)
    with bench._padding_engine_class()(model, max_streams=5, convert=False) as engine:
        assert engine.model is model
        outputs = serve_clients(engine, streams, threads=4, seed=17)
    check_outputs(model, streams, outputs, TOLERANCES["cpu"])


def test_the_load_runs_on_the_host_and_its_results_are_tabled(tmp_path, capsys):
    from persistrnn.bench import serve as bench
    from persistrnn.bench.__main__ import SUITES

    assert SUITES["serve"] == "persistrnn.bench.serve"
    settings = bench.Settings(seconds=0.5, warmup_seconds=0.2, mean_chunks=8, threads=2)
    model = torch.nn.LSTM(16, 16).eval()
    cases = []
    for provider, engine in (("persistrnn", serve.Engine(model, bench.slots_for(16))),
                             ("cudnn-padded", bench._padding_engine_class()(model, bench.slots_for(16),
                                                                            convert=False))):
        with engine:
            error = bench._refcheck(engine, model, settings.steps)
            for handover in bench.HANDOVERS:  # one after the other on the same engine, as run_case does
                load = bench._Load(engine, 16, settings, handover)
                load.run()
                assert all(stream.closed for stream in load.opened)  # their slots free for the next load
                # A machine that stalls the load for a few chunk periods leaves the engine behind: pushes and
                # streams are refused (EngineFullError) and the chunks still queued when their stream ends are
                # cancelled. Those are the table's to count, not faults; a chunk that failed is one.
                assert error < 1e-6 and load.latencies and load.delivered > 0, handover
                assert all(what == bench.CANCELLED or what.endswith("refused (EngineFullError)")
                           for what in load.counts), load.counts
                # Poisson arrivals keep ~16 live on average; over 0.5 s (~30 arrivals) on a machine that may delay
                # the clients' closes, within a factor of 3.
                assert 16 / 3 <= statistics.fmean(load.live_samples) <= 16 * 3, load.live_samples
                ms = [v * 1e3 for v in load.latencies]
                cases.append({"model": "lstm:16:1", "streams": 16, "provider": provider, "handover": handover,
                              "slots": 40, "status": "ok", "note": "", "rel_error": error, "mean_live": 16.0,
                              "chunks_per_s": load.delivered / 0.5, "measured_chunks": len(ms),
                              "p50_ms": bench._percentile(ms, 50), "p90_ms": 1.0, "p99_ms": bench._percentile(ms, 99),
                              "max_ms": max(ms), "mean_batch": 2.0, "counts": {}})
    cases.append({"model": "lstm:16:1", "streams": 64, "provider": "persistrnn", "slots": 104, "status": "ok",
                  "note": "", "rel_error": None, "mean_live": 64.0, "chunks_per_s": 2000.0, "measured_chunks": 1,
                  "p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0, "max_ms": 1.0, "mean_batch": 2.0,
                  "counts": {}})  # a case of a run from before the gateway hand-over: no "handover" key
    result = {"suite": "serve", "settings": dataclasses.asdict(settings), "cases": cases,
              "environment": {"torch": "t", "cuda_runtime": None, "cudnn": None, "cuda_core": None, "nvrtc": "n",
                              "persistrnn": "p", "commit": "c", "date": "d"}}
    table = bench.format_table(result)
    assert "| lstm:16:1 | 16 | cudnn-padded | gateway |" in table
    assert "| lstm:16:1 | 64 | persistrnn | stream |" in table  # no "handover": the stream hand-over
    assert "- lstm:16:1: persistrnn (stream) 64, persistrnn (gateway) " in table
    assert "`resident=True`" in bench.markdown(result) and "`Engine.push_many`" in bench.markdown(result)
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert bench.main(["--from-json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")]) == 0
    assert "| lstm:16:1 | 16 | persistrnn | gateway |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--models", "lstm:0:1"])
    with pytest.raises(SystemExit):
        bench.main(["--streams", "0"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_models_rows_by_numpy_and_by_one_call_equal_each_stream_alone(dtype):
    # Batches of a few chunks move their rows through NumPy views (bfloat16, which NumPy lacks, as its
    # 16-bit pattern); batches past serve._ROWS_BY_NUMPY by one torch call each way. Both give each stream
    # its own outputs, in the model's dtype.
    model = make_model("gru", input_size=5, hidden=6, layers=1).to(dtype)
    rng = random.Random(31)
    few, many = 3, serve._ROWS_BY_NUMPY + 5
    with serve.Engine(model, max_streams=many, timeout=WAIT) as engine:
        streams = [engine.open() for _ in range(many)]
        inputs = {s: [] for s in streams}
        outputs = {s: [] for s in streams}
        for size in (few, many, few, many):
            group = rng.sample(streams, size)
            shape = rng.choice([(2, 5), (5,)])  # one length per group: the group is one batch
            chunks = torch.randn(size, *shape).to(dtype)
            engine.push_many(group, chunks)
            for stream, chunk, out in zip(group, chunks, engine.pull_many(group)):
                assert out.dtype == dtype and out.shape == (*chunk.shape[:-1], 6)
                inputs[stream].append(chunk)
                outputs[stream].append(out)
    used = [s for s in streams if inputs[s]]
    check_outputs(model, [inputs[s] for s in used], [outputs[s] for s in used], dict(rtol=2e-2, atol=2e-2))


def test_warm_up_runs_each_given_batch_size_once_and_leaves_the_states_alone():
    # Uncaptured batches (the host, or capture_batches=False) are planned by one run each, every row on the
    # zero and spare slots: a stream's states are the same after a warm-up as before it.
    model = make_model("lstm", input_size=7, hidden=13, layers=1)
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    chunks = [torch.randn(2, 7) for _ in range(2)]
    with serve.Engine(model, max_streams=4, timeout=WAIT) as engine:
        stream = engine.open()
        stream.push(chunks[0])
        first = stream.pull()
        engine.warm_up(steps=(2,), batches=(1, 4))
        assert len(calls) == 3 and sorted(shape[1] for shape in calls[1:]) == [1, 4]
        stream.push(chunks[1])
        second = stream.pull()
    check_outputs(model, [chunks], [[first, second]], TOLERANCES["cpu"])


# ---- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_gpu_every_stream_equals_running_it_alone(cell, untuned):
    model = make_model(cell, input_size=32, hidden=64).cuda()
    streams = random_streams(random.Random(8), count=96, input_size=32)
    with serve.Engine(model, max_streams=24, max_pending=3, timeout=WAIT) as engine:
        engine.warm_up(steps=(1, 3))
        assert engine._batch_sizes() == [1, 2, 4, 8, 16, 24]
        outputs = serve_clients(engine, streams, threads=8, seed=9)
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [False, True])
def test_gpu_an_engine_made_under_inference_mode_runs_its_worker_outside_it(untuned, resident):
    model = make_model("lstm", input_size=32, hidden=64, layers=1).cuda()
    check_an_engine_made_under_inference_mode(model, "cpu", resident=resident)
    check_an_engine_made_under_inference_mode(model, "cuda", resident=resident)


@pytest.mark.gpu
def test_gpu_device_chunks_come_back_on_the_device(untuned):
    model = make_model("lstm", input_size=32, hidden=64, layers=1).cuda()
    streams = random_streams(random.Random(10), count=16, input_size=32)
    with serve.Engine(model, max_streams=8) as engine:
        outputs = serve_clients(engine, streams, threads=4, seed=11, to_device="cuda")
    assert all(o.is_cuda for got in outputs for o in got)
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


def check_groups_of_host_and_device_chunks(model: torch.nn.Module, count: int, seed: int, **engine_options) -> None:
    """``count`` streams, every other one's chunks on the GPU, pushed and pulled in groups from 3 threads:
    each output where its chunk came from and equal to its stream run alone."""
    streams = random_streams(random.Random(seed), count=count, input_size=model.input_size)
    streams = [[c.cuda() for c in chunks] if i % 2 else chunks for i, chunks in enumerate(streams)]
    with serve.Engine(model, max_streams=count, max_pending=3, timeout=WAIT, **engine_options) as engine:
        if not engine_options.get("resident"):
            engine.warm_up(steps=(1, 3))
        outputs = serve_groups(engine, streams, threads=3, seed=seed + 1)
    for chunks, got in zip(streams, outputs):
        assert all(o.is_cuda == c.is_cuda for c, o in zip(chunks, got))
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
def test_gpu_groups_of_host_and_device_chunks_equal_each_stream_alone(untuned):
    check_groups_of_host_and_device_chunks(make_model("lstm", input_size=32, hidden=64).cuda(), count=48, seed=22)


@pytest.mark.gpu
def test_gpu_a_thousand_streams_from_eight_threads(untuned):
    # One step per chunk (the voice-activity shape), 1,000 slots all live at once.
    model = make_model("lstm", input_size=40, hidden=128, layers=1).cuda()
    streams = random_streams(random.Random(12), count=1000, input_size=40, lengths=(1,), max_chunks=16)
    with serve.Engine(model, max_streams=1000, max_pending=4, timeout=WAIT) as engine:
        engine.warm_up(steps=(1,))
        outputs = serve_interleaved(engine, streams, threads=8, seed=13)
        assert engine.chunks_run == sum(len(s) for s in streams)
        assert engine.chunks_run / engine.ticks > 8  # the live streams did share ticks
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
def test_gpu_a_stream_that_never_pulls_and_an_error_do_not_stall_the_others(untuned):
    model = make_model("gru", input_size=32, hidden=64).cuda()
    with serve.Engine(model, max_streams=8, max_pending=2) as engine:
        stuck = engine.open()
        stuck.push(torch.randn(1, 32))
        stuck.push(torch.randn(1, 32))
        with pytest.raises(EngineFullError):
            stuck.push(torch.randn(1, 32), timeout=0.05)
        streams = random_streams(random.Random(14), count=24, input_size=32)
        outputs = serve_clients(engine, streams, threads=8, seed=15)
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
def test_gpu_a_kernel_failure_inside_a_captured_batch_fails_its_chunk_and_the_next_runs(untuned):
    # The batch runs as a captured graph, so no module call reads the failure report: the engine reads it
    # after the batch. A block of the cluster launch is abandoned (the test-only hook) while the batch is
    # captured; the hook is part of the batch's key, so the next batch without it is captured clean.
    from persistrnn import persistent, runtime
    from persistrnn.errors import KernelTimeoutError
    from persistrnn.plan import tuner

    model = persistrnn.LSTM(256, 256).cuda().eval()
    shape = model._shape(torch.float32)
    config = persistent.KernelConfig("lstm", 256, "cluster", 8)
    tuner.pin_plan(persistrnn.Plan(shape, 1, "persistent", config, "model", "pinned by the failure test"))
    assert model.plan_for(1).config == config
    saved = runtime.wait_timeout_ns()
    runtime.set_wait_timeout(0.05)
    chunks = [torch.randn(3, 256) for _ in range(2)]
    try:
        with serve.Engine(model, max_streams=1, timeout=WAIT) as engine:
            failing = engine.open()
            with runtime.inject_failure(1):
                failing.push(chunks[0])
                with pytest.raises(KernelTimeoutError, match="cluster exchange"):
                    failing.pull()
                # The batch's first, uncaptured run failed too, and may report after the pull raised: the
                # report holds one failure, so the second is read here, not by the next stream's batch.
                torch.cuda.synchronize()
                with contextlib.suppress(KernelTimeoutError):
                    runtime.raise_reported_failure(torch.cuda.current_device())
            with pytest.raises(ArgumentError, match="failed"):
                failing.push(chunks[1])  # its state missed a chunk
            failing.close()
            clean = engine.open()
            for chunk in chunks:
                clean.push(chunk)
            got = [clean.pull() for _ in chunks]
    finally:
        runtime.set_wait_timeout(saved / 1e9)
        tuner.clear_cached_plans()
    check_outputs(model, [chunks], [got], TOLERANCES["cuda"])


# ---- resident mode (GPU) ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru", "gru_reset_before", "rnn_tanh"])
def test_gpu_resident_every_stream_equals_running_it_alone(cell, untuned):
    model = make_model(cell, input_size=32, hidden=64, layers=1).cuda()
    streams = random_streams(random.Random(40), count=96, input_size=32)
    with serve.Engine(model, max_streams=24, max_pending=3, timeout=WAIT, resident=True) as engine:
        engine.warm_up(steps=(1, 3))
        outputs = serve_clients(engine, streams, threads=8, seed=41)
        layer = engine._resident
        assert engine.chunks_run > engine.ticks  # streams shared ticks
    assert layer.words[RESIDENT_CONTROL.index("exited")] == layer.generation  # closing stopped the launch
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
def test_gpu_resident_odd_sizes_and_groups_of_host_and_device_chunks(untuned):
    check_groups_of_host_and_device_chunks(make_model("lstm", input_size=7, hidden=13, layers=1).cuda(), count=29,
                                           seed=42, resident=True)


@pytest.mark.gpu
def test_gpu_resident_a_thousand_streams_run_as_ticks_of_the_kernels_rows(untuned):
    model = make_model("lstm", input_size=40, hidden=128, layers=1).cuda()
    streams = random_streams(random.Random(44), count=1000, input_size=40, lengths=(1,), max_chunks=16)
    with serve.Engine(model, max_streams=1000, max_pending=4, timeout=WAIT, resident=True) as engine:
        rows = engine._resident.rows
        assert 1 <= rows <= serve._RESIDENT_ROWS
        outputs = serve_interleaved(engine, streams, threads=8, seed=45)
        assert engine._resident.tick > engine.ticks  # some batches ran as several kernel ticks
    check_outputs(model, streams, outputs, TOLERANCES["cuda"])


@pytest.mark.gpu
def test_gpu_resident_bfloat16_and_a_pause_past_the_idle_bound(untuned):
    from persistrnn.persistent import resident

    model = make_model("gru", input_size=16, hidden=32, layers=1).cuda().to(torch.bfloat16)
    chunks = [torch.randn(2, 16).to(torch.bfloat16) for _ in range(4)]
    with serve.Engine(model, max_streams=4, timeout=WAIT, resident=True) as engine:
        stream = engine.open()
        got = []
        for chunk in chunks:
            stream.push(chunk)
            got.append(stream.pull())
            time.sleep(2 * resident.DEFAULT_IDLE_S)  # the kernel leaves; the next chunk launches it again
        assert engine._resident.launches == len(chunks)
    assert all(o.dtype == torch.bfloat16 for o in got)
    check_outputs(model, [chunks], [got], dict(rtol=2e-2, atol=2e-2))


@pytest.mark.gpu
def test_gpu_resident_a_tick_that_times_out_stops_the_engine_and_close_is_bounded(untuned):
    model = make_model("lstm", input_size=8, hidden=16, layers=1).cuda()
    engine = serve.Engine(model, max_streams=4, timeout=0.5, resident=True)
    # Every batch's buffers made first (a pinned allocation waits for the device, the sleep below included),
    # and the launch of the warm-up's ticks left by its idle bound.
    engine.warm_up()
    time.sleep(0.2)
    with torch.cuda.stream(engine._resident.stream):
        torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU cycles ahead of the next launch on its stream
    stream = engine.open()
    stream.push(torch.randn(1, 8))
    with pytest.raises(TimeoutError, match="did not finish"):
        stream.pull(timeout=WAIT)
    with pytest.raises(ArgumentError, match="failed"):
        stream.push(torch.randn(1, 8))
    engine._worker.join(WAIT)  # the worker stops the engine after delivering the batch's error
    with pytest.raises(ArgumentError, match="expected a running engine, got one stopped by"):
        engine.open()
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5.0
    torch.cuda.synchronize()  # the launch started late, saw its stop word and left
    assert engine._resident.words[RESIDENT_CONTROL.index("exited")] == engine._resident.generation
