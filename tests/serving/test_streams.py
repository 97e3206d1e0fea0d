"""Stateful streams (Triton sequence_id/start/end): chunks continue from the server-kept state."""
from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service import create_engine
from service.dataplane import InferRequest, InferTensor
from service.engines.state_pool import StatePool
from service.errors import Unavailable
from service.scheduler.streams import StreamStore
from service.repository import load_model
from serving_support import metric_value, rest_client, write_config

pytestmark = pytest.mark.asyncio


def _chunk(x, seq_id, start=False, end=False, outputs=None):
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}],
            "parameters": {"sequence_id": seq_id, "sequence_start": start, "sequence_end": end}}
    if outputs:
        body["outputs"] = [{"name": o} for o in outputs]
    return body


def _request(x, seq_id, a, b, **params):
    """A dataplane request carrying steps a..b of ``x`` as a chunk of stream ``seq_id``."""
    return InferRequest("lstm", inputs=[InferTensor("input", "FP32", [1, b - a, x.shape[2]], x[:, a:b])],
                        parameters={"sequence_id": seq_id, **params})


def _answer_output(answers):
    return np.concatenate([next(t.data for t in a.outputs if t.name == "output") for a in answers], axis=1)


def _outputs(resp):
    assert resp.status_code == 200, resp.text
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in resp.json()["outputs"]}


async def test_chunks_equal_the_whole_sequence(repo):
    x = np.random.default_rng(0).standard_normal((1, 12, 4)).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    async with rest_client(repo) as (client, _):
        parts = [(0, 5, True, False), (5, 6, False, False), (6, 12, False, True)]
        got = [_outputs(await client.post("/v2/models/lstm/infer", json=_chunk(x[:, a:b], 7, s, e)))
               for a, b, s, e in parts]
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x[:, :1], 7))
        assert r.status_code == 404 and "stream 7 of model 'lstm' is not live" in r.json()["error"]
        r = await client.post("/v2/models/gru_bi/infer", json=_chunk(x[:, :1], 8, True))
        assert r.status_code == 400 and "model 'gru_bi' reads sequences backwards" in r.json()["error"]
    whole = engine.forward(x)
    np.testing.assert_allclose(np.concatenate([g["output"] for g in got], axis=1), whole.output, atol=1e-5)
    np.testing.assert_allclose(got[-1]["h_n"], whole.h_n, atol=1e-5)
    np.testing.assert_allclose(got[-1]["c_n"], whole.c_n, atol=1e-5)


async def test_a_chunk_whose_answer_is_too_large_is_refused_before_it_moves_the_stream(repo):
    """Refused before it runs: the stream's state stays where the last answered chunk left it."""
    x = (np.round(np.random.default_rng(2).standard_normal((1, 1100, 4)) * 4) / 4).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    async with rest_client(repo, max_request_bytes=64 * 1024) as (client, _):
        first = _outputs(await client.post("/v2/models/lstm/infer", json=_chunk(x[:, :100], 9, True)))
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x[:, 100:1100], 9))  # 8,000 output numbers as JSON
        assert r.status_code == 413 and "over the server's limit on JSON answers" in r.json()["error"]
        last = _outputs(await client.post("/v2/models/lstm/infer", json=_chunk(x[:, 1000:1100], 9, end=True)))
    # the last chunk continued from the first: as if the refused one had never been sent
    whole = engine.forward(np.concatenate([x[:, :100], x[:, 1000:1100]], axis=1))
    np.testing.assert_allclose(np.concatenate([first["output"], last["output"]], axis=1), whole.output, atol=1e-5)
    np.testing.assert_allclose(last["h_n"], whole.h_n, atol=1e-5)


async def test_interleaved_streams_batch_together(repo):
    rng = np.random.default_rng(1)
    seqs = {f"s{i}": rng.standard_normal((1, 9, 4)).astype(np.float32) for i in range(12)}
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    write_config(repo, "lstm", max_queue_delay_us=5000)
    async with rest_client(repo) as (client, _):
        last = {}
        for a, b in ((0, 3), (3, 7), (7, 9)):
            answers = await asyncio.gather(*(
                client.post("/v2/models/lstm/infer", json=_chunk(x[:, a:b], k, a == 0, b == 9, ["h_n"]))
                for k, x in seqs.items()))
            if a == 3:
                text = (await client.get("/metrics")).text
                active = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                          if s.name == "rnnserve_active_streams" and s.labels["model"] == "lstm"]
                assert active == [12]
            last = {k: _outputs(r)["h_n"] for k, r in zip(seqs, answers)}
    for k, x in seqs.items():
        np.testing.assert_allclose(last[k], engine.forward(x).h_n, atol=1e-5)


async def test_chunks_of_one_stream_run_in_order(repo):
    x = np.random.default_rng(2).standard_normal((1, 8, 4)).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    async with rest_client(repo) as (_, dataplane):
        answers = await asyncio.gather(dataplane.infer(_request(x, 99, 0, 2, sequence_start=True)),
                                       dataplane.infer(_request(x, 99, 2, 5)),
                                       dataplane.infer(_request(x, 99, 5, 8, sequence_end=True)))
    np.testing.assert_allclose(_answer_output(answers), engine.forward(x).output, atol=1e-5)


async def test_stream_limits(repo):
    # 1 s: the first two streams must outlive the third start even on a loaded 2-core CI machine
    write_config(repo, "lstm", max_streams=2, stream_idle_timeout_s=1.0)
    x = np.zeros((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, _):
        for k in (1, 2):
            assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, k, True))).status_code == 200
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 3, True))
        assert r.status_code == 503 and "2 live streams (max_streams 2," in r.json()["error"]
        await asyncio.sleep(1.3)
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 3, True))).status_code == 200
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))
        assert r.status_code == 404 and "expired after 1s without a chunk" in r.json()["error"]


async def test_a_cancelled_chunk_ends_its_stream_and_every_slot_comes_back(repo):
    # a 100 ms batching window keeps the cancelled chunk in the queue; 1 s idle timeout expires stream 3
    write_config(repo, "lstm", max_queue_delay_us=100_000, stream_idle_timeout_s=1.0)
    x = np.zeros((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        pool = dataplane.registry.serving("lstm").streams.pool
        for k in (1, 2, 3):
            assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, k, True))).status_code == 200
        assert pool.in_use == 3
        task = asyncio.create_task(dataplane.infer(_request(x, 1, 0, 2)))
        scheduler = dataplane.registry.serving("lstm").scheduler
        for _ in range(100):  # until the chunk waits in the batching window (not a fixed sleep: a busy CI host)
            if scheduler.depth:
                break
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))
        assert r.status_code == 404 and "cancelled before it was answered" in r.json()["error"]
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 2, end=True))).status_code == 200
        await asyncio.sleep(1.4)
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 3))
        assert r.status_code == 404 and "expired" in r.json()["error"]
        assert pool.in_use == 0  # cancelled, ended and expired streams gave their slots back
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 4, True))).status_code == 200
        assert pool.in_use == 1


async def test_end_stream_ends_a_live_stream_with_its_reason_and_ignores_the_rest(repo):
    # what the gRPC transport calls for a chunk it answered but could not deliver
    x = np.zeros((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        pool = dataplane.registry.serving("lstm").streams.pool
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 1, True))).status_code == 200
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, "b", True))).status_code == 200
        await dataplane.end_stream("lstm", "1", {"sequence_id": 1}, "was ended for the test", 7)
        # the last chunk did not come from that call (7): nothing happens
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))).status_code == 200
        await dataplane.end_stream("lstm", "1", {"sequence_id": 1}, "was ended for the test", 0)
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))
        assert r.status_code == 404 and "stream 1 of model 'lstm' is not live: it was ended for the test" \
            in r.json()["error"]
        assert pool.in_use == 1
        # not live, stateless, unknown model or version, a bad id: nothing happens, nothing raises
        for args in (("lstm", "1", {"sequence_id": 1}), ("lstm", "1", {}), ("nope", "1", {"sequence_id": 1}),
                     ("lstm", "7", {"sequence_id": "b"}), ("lstm", "1", {"sequence_id": True})):
            await dataplane.end_stream(*args, "x", 0)
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, "b", end=True))).status_code == 200
        assert pool.in_use == 0


async def test_end_stream_leaves_a_stream_restarted_from_another_call_alone(repo):
    # A gRPC call's chunk of stream 3 ran but its answer was never delivered; the client restarted stream 3 on
    # another call, and then the first call's cleanup ended the new stream (a verification probe found it).
    x = np.ones((1, 4, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        first = _request(x, 3, 0, 2, sequence_start=True)
        first.caller = 11  # the call that will not deliver its answer
        await dataplane.infer(first)
        restart = _request(x, 3, 0, 2, sequence_start=True)
        restart.caller = 12
        alone = await dataplane.infer(restart)
        await dataplane.end_stream("lstm", "1", {"sequence_id": 3}, "was ended for the test", 11)
        later = _request(x, 3, 2, 4)
        later.caller = 12
        await dataplane.infer(later)  # the restarted stream goes on
        # and the call that moved it last can still end it
        await dataplane.end_stream("lstm", "1", {"sequence_id": 3}, "was ended for the test", 12)
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 3))
        assert r.status_code == 404 and "it was ended for the test" in r.json()["error"]
        assert alone.outputs


async def test_restarting_one_id_while_its_chunks_are_queued_holds_at_most_one_more_slot(repo):
    # Each sequence_start for a live id whose chunk was still queued kept the old instance's slot until that chunk
    # ran: one id restarted in a loop took every slot of the model, refused other clients' new streams with "end
    # finished streams", and lost its own live stream to the refusal (a verification probe found it).
    spec = load_model(repo / "lstm" / "1").spec
    store = StreamStore("lstm", "1", 4, 60.0, StatePool(spec, np, np.float32, max_slots=8))
    first = store.open("7", start=True)
    first.running = True  # its chunk is queued
    second = store.open("7", start=True)  # a restart: the first instance keeps its slot while its chunk runs
    second.running = True
    assert first.ended and first.slot >= 0 and store.pool.in_use == 2
    for _ in range(3):
        with pytest.raises(Unavailable, match="stream 7 of model 'lstm' was restarted while a chunk of an earlier, "
                                              "already restarted instance of it is still queued or running"):
            store.open("7", start=True)
    assert not second.ended and store.open("7", start=False) is second  # the live stream is left alone
    assert store.pool.in_use == 2
    first.running = False
    store.settle(first)  # its chunk ran: the slot comes back, and the id may restart again
    third = store.open("7", start=True)
    assert second.ended and not third.ended and store.pool.in_use == 2


async def test_a_restart_that_finds_no_free_slot_keeps_the_live_stream(repo):
    spec = load_model(repo / "lstm" / "1").spec
    store = StreamStore("lstm", "1", 2, 60.0, StatePool(spec, np, np.float32, max_slots=2))
    a, b = store.open("a", start=True), store.open("b", start=True)
    a.running = True
    with pytest.raises(Unavailable, match="all 2 stream state slots of model 'lstm' are in use"):
        store.open("a", start=True)
    assert not a.ended and store.open("a", start=False) is a and not b.ended


async def test_no_stream_expires_while_front_ends_hold_requests_of_its_model(repo):
    # With --frontends a chunk sent in time waited in a front-end's lane while the engine process was busy, and
    # its stream had expired when it arrived (a verification probe found it).
    spec = load_model(repo / "lstm" / "1").spec
    store = StreamStore("lstm", "1", 4, 0.2, StatePool(spec, np, np.float32, max_slots=8), expiry_grace_s=0.5)
    live = store.open("7", start=True)
    now = live.last_used
    store._sweep(now + 0.5, force=True)  # past the timeout, within the grace: the chunk may still be on its way
    assert not live.ended
    store.frontends_waiting = 3
    store._sweep(now + 0.6, force=True)  # chunks wait in the front-ends: any of them may be its next chunk
    assert not live.ended and store.open("7", start=False) is live
    store._sweep(live.last_used + 0.95, force=True)  # but not for more than another timeout
    assert live.ended.startswith("expired after 0.2s")
    other = store.open("8", start=True)
    store.frontends_waiting = 0
    store._sweep(other.last_used + 0.8, force=True)
    assert other.ended.startswith("expired after 0.2s")


async def test_front_end_reports_reach_the_stream_store_and_front_end_layouts_get_the_grace(repo, tmp_path):
    from service.dataplane.remote import WAITING_REPORT_S
    from service.engine_processes import EngineHost
    from service.settings import ServeSettings
    host = EngineHost(ServeSettings(repository=repo, device="cpu"), str(tmp_path / "engine.sock"))
    assert host.dataplane.registry.stream_expiry_grace_s == 2 * WAITING_REPORT_S  # front-ends hold chunks unseen
    async with rest_client(repo) as (_, dataplane):
        assert dataplane.registry.stream_expiry_grace_s == 0  # one process: no chunk waits unseen
        dataplane.set_frontend_waiting("lstm", "1", 5, 2)  # plain requests do not hold expiry off: chunks do
        assert dataplane.registry.serving("lstm").streams.frontends_waiting == 2


async def test_a_chunk_reaching_a_reload_s_new_copy_while_the_old_drains_is_told_its_stream_ended(repo):
    # the new copy serves at once while the old one drains; a live stream's chunk then read "never started"
    x = np.zeros((1, 2, 4), np.float32)
    long = np.zeros((64, 20000, 4), np.float32)  # a batch that keeps the old copy draining (~1 s on a CI core)
    async with rest_client(repo) as (client, dataplane):
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, 1, True))).status_code == 200
        old = dataplane.registry.serving("lstm")
        held = asyncio.create_task(dataplane.infer(
            InferRequest("lstm", inputs=[InferTensor("input", "FP32", list(long.shape), long)])))
        await asyncio.sleep(0.05)
        reload = asyncio.create_task(dataplane.load_model("lstm"))
        while dataplane.registry.serving("lstm") is old:
            await asyncio.sleep(0.001)
        assert not reload.done()  # the old copy is still draining
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))
        assert r.status_code == 404 and r.json()["error"] == (
            "stream 1 of model 'lstm' is not live: it was ended when model 'lstm' version 1 was unloaded or "
            "reloaded; start a new stream with sequence_start")
        await reload
        await held
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, 1))
        assert r.status_code == 404 and "was ended when model 'lstm' version 1 was unloaded or reloaded" \
            in r.json()["error"]


async def test_a_chunk_cancelled_while_waiting_its_turn_changes_nothing(repo):
    # a 300 ms batching window keeps the first chunk running while the next ones wait behind it (long enough for a
    # busy CI host: the cancel below must come while the first chunk still holds the stream's turn)
    write_config(repo, "lstm", max_queue_delay_us=300_000)
    x = np.random.default_rng(5).standard_normal((1, 6, 4)).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    async with rest_client(repo) as (_, dataplane):
        store = dataplane.registry.serving("lstm").streams
        first = asyncio.create_task(dataplane.infer(_request(x, 31, 0, 2, sequence_start=True)))
        await asyncio.sleep(0.005)
        skipped = asyncio.create_task(dataplane.infer(_request(x, 31, 0, 3)))  # would move the state if it ran
        for _ in range(200):  # until it waits for the stream's turn
            if any(state.turn._waiters for state in store._streams.values()):
                break
            await asyncio.sleep(0.001)
        assert not first.done(), "the first chunk ended before the second waited behind it: a slower host than planned"
        skipped.cancel()
        last = asyncio.create_task(dataplane.infer(_request(x, 31, 2, 6, sequence_end=True)))
        answers = [await first, await last]
        with pytest.raises(asyncio.CancelledError):
            await skipped
        assert dataplane.registry.serving("lstm").streams.pool.in_use == 0
    np.testing.assert_allclose(_answer_output(answers), engine.forward(x).output, atol=1e-5)


async def test_a_streams_turn_goes_to_its_chunks_in_arrival_order():
    from service.scheduler.streams import Turn

    turn, order = Turn(), []
    assert turn.take_now() and not turn.take_now()  # the first chunk goes at once, the next one must wait

    async def chunk(k):
        await turn.take()
        order.append(k)
        await asyncio.sleep(0)
        turn.give()

    waiting = [asyncio.create_task(chunk(k)) for k in range(4)]
    await asyncio.sleep(0)
    waiting[1].cancel()  # cancelled while it waits: skipped, nothing else changes
    await asyncio.sleep(0)
    assert order == []
    turn.give()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert order == [0, 2, 3] and not turn.busy and turn.take_now()


async def test_a_chunk_handed_the_turn_then_cancelled_passes_it_on():
    from service.scheduler.streams import Turn

    turn = Turn()
    assert turn.take_now()
    first = asyncio.create_task(turn.take())
    second = asyncio.create_task(turn.take())
    await asyncio.sleep(0)
    turn.give()  # handed to `first`, which is cancelled before it runs
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)  # the turn went on to the next waiter
    assert turn.busy
    turn.give()
    assert not turn.busy


async def test_a_second_start_restarts_the_stream_and_refuses_its_waiting_chunks(repo):
    """As Triton: the live stream ends early and the new start runs from zeros; a chunk of the old stream that
    was still waiting for its turn is refused, saying why, rather than run on the new stream's state."""
    x = np.random.default_rng(4).standard_normal((1, 6, 4)).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    write_config(repo, "lstm", max_batch_size=8, max_queue_delay_us=300_000)  # chunks wait in the batch queue
    async with rest_client(repo) as (_, dataplane):
        await dataplane.infer(_request(x, 5, 0, 2, sequence_start=True))
        held = asyncio.ensure_future(dataplane.infer(_request(x, 5, 2, 4)))   # in the batch queue
        behind = asyncio.ensure_future(dataplane.infer(_request(x, 5, 4, 6)))  # waits for its stream's turn
        await asyncio.sleep(0.05)
        restarted = await dataplane.infer(_request(x, 5, 0, 3, sequence_start=True))
        with pytest.raises(Exception, match="stream 5 of model 'lstm' is not live: it was restarted"):
            await behind
        await held  # it had its turn: it runs and is answered
        after = await dataplane.infer(_request(x, 5, 3, 6, sequence_end=True))
    np.testing.assert_allclose(_answer_output([restarted, after]), engine.forward(x).output, atol=1e-5)


async def test_restarts_on_every_chunk_log_one_line_and_are_all_counted(repo, caplog):
    """A client restarting its stream with every chunk logged a warning each time (a probe's loop filled the log);
    now one line a period says how many went unlogged, and the metric counts every restart."""
    x = np.random.default_rng(5).standard_normal((1, 2, 4)).astype(np.float32)
    async with rest_client(repo) as (_, dataplane):
        with caplog.at_level(logging.WARNING, logger="rnnserve"):
            for _ in range(50):
                await dataplane.infer(_request(x, 9, 0, 2, sequence_start=True))
        restarts = [r for r in caplog.records if "second sequence_start" in r.getMessage()]
        assert len(restarts) == 1, [r.getMessage() for r in restarts]
        assert metric_value(dataplane, "rnnserve_stream_ends_total", model="lstm", reason="restart") == 49


async def test_a_restart_at_max_streams_while_its_chunk_runs_is_admitted(repo):
    """At max_streams, a second sequence_start of a live stream whose chunk was still queued got 503 "all slots in
    use" (the ended stream kept its slot while its chunk ran) and its live stream was ended all the same."""
    x = np.random.default_rng(6).standard_normal((1, 6, 4)).astype(np.float32)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    write_config(repo, "lstm", max_streams=2, max_batch_size=8, max_queue_delay_us=300_000)
    async with rest_client(repo) as (_, dataplane):
        await dataplane.infer(_request(x, 5, 0, 2, sequence_start=True))
        await dataplane.infer(_request(x, 6, 0, 2, sequence_start=True))
        held = asyncio.ensure_future(dataplane.infer(_request(x, 5, 2, 4)))  # in the batch queue: holds a slot
        await asyncio.sleep(0.05)
        restarted = await dataplane.infer(_request(x, 5, 0, 3, sequence_start=True))
        await held
        after = await dataplane.infer(_request(x, 5, 3, 6, sequence_end=True))
        np.testing.assert_allclose(_answer_output([restarted, after]), engine.forward(x).output, atol=1e-5)
        await dataplane.infer(_request(x, 7, 0, 2, sequence_start=True))  # 6 and 7 live: the limit holds
        with pytest.raises(Exception, match="2 live streams \\(max_streams 2"):
            await dataplane.infer(_request(x, 8, 0, 2, sequence_start=True))


async def test_a_string_sequence_id_is_a_short_key(repo):
    """The ids of ended streams are kept to answer their late chunks: a megabyte id held a megabyte each."""
    x = np.zeros((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", json=_chunk(x, "k" * 1025, True))
        assert r.status_code == 400 and "'sequence_id' is a string of 1025 characters; at most 1024" in r.json()["error"]
        assert (await client.post("/v2/models/lstm/infer", json=_chunk(x, "k" * 1024, True, True))).status_code == 200


async def test_chunks_waiting_for_their_streams_turn_are_bounded_by_max_queue_size(repo):
    """They wait outside the scheduler's queue: 3,000 concurrent chunks of one stream were all held (a probe)."""
    write_config(repo, "lstm", max_queue_delay_us=300_000, max_queue_size=3)  # the first chunk holds the turn
    x = np.random.default_rng(6).standard_normal((1, 4, 4)).astype(np.float32)
    async with rest_client(repo) as (_, dataplane):
        store = dataplane.registry.serving("lstm").streams
        first = asyncio.create_task(dataplane.infer(_request(x, 41, 0, 1, sequence_start=True)))
        await asyncio.sleep(0.005)
        waiting = [asyncio.create_task(dataplane.infer(_request(x, 41, k, k + 1))) for k in (1, 2, 3)]
        await asyncio.sleep(0.01)
        assert store.waiting_chunks == 3 and not first.done()
        with pytest.raises(Exception, match=r"3 stream chunks wait for their stream's earlier chunks \(max_queue_size 3\)"):
            await dataplane.infer(_request(x, 41, 3, 4))
        await asyncio.gather(first, *waiting)
        assert store.waiting_chunks == 0
        cancelled = asyncio.create_task(dataplane.infer(_request(x, 41, 0, 1, sequence_start=True)))
        await asyncio.sleep(0.005)
        behind = asyncio.create_task(dataplane.infer(_request(x, 41, 1, 2)))
        await asyncio.sleep(0)
        behind.cancel()  # cancelled while waiting: uncounted too
        await asyncio.gather(cancelled, behind, return_exceptions=True)
        assert store.waiting_chunks == 0
