"""Front-end coalescing (service.dataplane.coalesce): merged requests answer as they would alone."""
from __future__ import annotations

import asyncio
import logging
import pickle
import re

import numpy as np
import pytest
import pytest_asyncio

from service import create_engine
from service.dataplane import DataPlane
from service.dataplane.coalesce import MAX_IN_FLIGHT, Lane
from service.dataplane.view import Prepared
from service.errors import InvalidInput
from service.scheduler import SequenceWork
from serving_support import LSTM, lstm_dataplane, make_model, metric_value

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def dataplane(tmp_path):
    async with lstm_dataplane(tmp_path, seed=5, max_batch_size=6) as dp:
        yield dp


def _work(rng, batch: int, t: int, lengths: list[int], outputs: set[str], states: bool = False) -> SequenceWork:
    x = rng.standard_normal((batch, t, 4)).astype(np.float32)
    h0 = c0 = None
    if states:
        h0 = rng.standard_normal((batch, 2, 8)).astype(np.float32)
        c0 = rng.standard_normal((batch, 2, 8)).astype(np.float32)
    return SequenceWork(x, np.array(lengths, np.int64), h0, c0, frozenset(outputs))


class Recorder:
    """The lane's ``send``: records each message, then submits it to the real DataPlane."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.view = dataplane.model_view("lstm")
        self.sent: list[Prepared] = []

    def __call__(self, prepared: Prepared) -> asyncio.Future:
        self.sent.append(prepared)
        return self.dataplane.submit_prepared("lstm", "", self.view.generation, prepared)


async def test_requests_merged_in_one_message_answer_as_alone(dataplane):
    rng = np.random.default_rng(0)
    works = [
        _work(rng, 1, 9, [9], {"output_last"}),
        _work(rng, 1, 3, [2], {"output", "h_n"}),  # client padding past its length
        _work(rng, 2, 7, [7, 4], {"output", "output_last", "h_n", "c_n"}, states=True),
        _work(rng, 1, 1, [1], {"c_n"}),
        _work(rng, 1, 5, [5], {"output"}, states=True),
    ]
    send = Recorder(dataplane)
    lane = Lane(send.view, send)
    futures = [lane.submit(Prepared(w, None, None)) for w in works]  # one loop iteration: one message
    results = await asyncio.gather(*futures)
    assert [p.requests for p in send.sent] == [5]
    engine = create_engine(make_model(*LSTM, seed=5), "cpu")
    for work, got in zip(works, results):
        want = engine.forward(work.x, work.lengths, work.h0, work.c0)
        assert set(got) == set(work.outputs)
        if "output" in got:
            assert got["output"].shape == work.x.shape[:2] + (8,)
            np.testing.assert_allclose(got["output"], want.output, rtol=1e-5, atol=1e-6)
        if "output_last" in got:
            last = want.output[np.arange(work.sequences), work.lengths - 1]
            np.testing.assert_allclose(got["output_last"], last, rtol=1e-5, atol=1e-6)
        for name in ("h_n", "c_n"):
            if name in got:
                np.testing.assert_allclose(got[name], getattr(want, name), rtol=1e-5, atol=1e-6)
    # the engine process counts requests, not messages
    assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", outcome="success") == 5
    assert metric_value(dataplane, "rnnserve_request_duration_seconds_count", model="lstm") == 5


async def test_messages_respect_max_batch_size_and_the_in_flight_limit(dataplane):
    rng = np.random.default_rng(1)
    send = Recorder(dataplane)
    lane = Lane(send.view, send)
    works = [_work(rng, 1 + k % 2, 6, [6] * (1 + k % 2), {"output_last"}) for k in range(12)]  # 18 sequences
    futures = [lane.submit(Prepared(w, None, None)) for w in works]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    # max_batch_size 6 sequences per message, at most MAX_IN_FLIGHT messages before an answer
    assert len(send.sent) == MAX_IN_FLIGHT
    assert all(p.work.sequences <= 6 for p in send.sent)
    results = await asyncio.gather(*futures)
    assert sum(p.requests for p in send.sent) == 12
    assert all(p.work.sequences <= 6 for p in send.sent)
    assert [r["output_last"].shape[0] for r in results] == [w.sequences for w in works]


async def test_the_in_flight_limit_is_the_models_frontend_in_flight(tmp_path):
    """config.json's ``frontend_in_flight`` reaches the front-end's lane through the model's view."""
    async with lstm_dataplane(tmp_path, seed=5, max_batch_size=2, frontend_in_flight=5) as dp:
        send = Recorder(dp)
        assert send.view.frontend_in_flight == 5 and pickle.loads(pickle.dumps(send.view)) == send.view
        rng = np.random.default_rng(3)
        works = [_work(rng, 1, 6, [6], {"output_last"}) for _ in range(16)]
        lane = Lane(send.view, send)
        futures = [lane.submit(Prepared(w, None, None)) for w in works]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [p.requests for p in send.sent] == [2] * 5  # five messages out (not two) before an answer
        results = await asyncio.gather(*futures)
        assert sum(p.requests for p in send.sent) == 16 and len(results) == 16



async def test_messages_keep_to_the_models_memory_budget(tmp_path):
    """A merged message pads every row to its longest: rows x longest stays within max_batch_memory_mb."""
    async with lstm_dataplane(tmp_path, seed=5, max_batch_size=64, max_batch_memory_mb=1, frontend_in_flight=8) as dp:
        send = Recorder(dp)
        budget = send.view.budget.max_steps  # 2,048 sequence steps (1 MiB, 512 bytes a step)
        rng = np.random.default_rng(4)
        lengths = [1000, 40, 900, 600, 30, 20]
        works = [_work(rng, 1, t, [t], {"output_last"}) for t in lengths]
        lane = Lane(send.view, send)
        results = await asyncio.gather(*(lane.submit(Prepared(w, None, None)) for w in works))
        # oldest first: 1000 and 40 (2 x 1000); with 900, 3 x 1000 > 2,048. Then 900 and 600 (with 30: 3 x 900), then
        # the rest
        assert [p.requests for p in send.sent] == [2, 2, 2]
        assert all(p.work.sequences * p.work.steps <= budget for p in send.sent)
        engine = create_engine(make_model(*LSTM, seed=5), "cpu")
        for work, got in zip(works, results):
            want = engine.forward(work.x, work.lengths).output[:, -1]
            np.testing.assert_allclose(got["output_last"], want, rtol=1e-5, atol=1e-6)

async def test_an_error_fails_every_merged_request_and_a_cancelled_one_is_not_sent(dataplane):
    view = dataplane.model_view("lstm")
    sent: list[Prepared] = []

    def failing(prepared: Prepared) -> asyncio.Future:
        sent.append(prepared)
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(InvalidInput("refused"))
        return fut

    rng = np.random.default_rng(2)
    lane = Lane(view, failing)
    futures = [lane.submit(Prepared(_work(rng, 1, 4, [4], {"output_last"}), None, None)) for _ in range(3)]
    futures[1].cancel()
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert [p.requests for p in sent] == [2]
    assert isinstance(outcomes[0], InvalidInput) and isinstance(outcomes[2], InvalidInput)
    assert isinstance(outcomes[1], asyncio.CancelledError)


class ServerSide:
    """A ChunkLane's two sends into the engine process's DataPlaneServer, without a socket: each message's
    reply resolves the future the lane waits on, as RemoteDataPlane's would."""

    def __init__(self, dataplane: DataPlane) -> None:
        from service.dataplane.remote import DataPlaneServer

        self.server = DataPlaneServer(dataplane, "unused")
        self.generation = dataplane.model_view("lstm").generation
        self.messages: list[int] = []  # chunks per message

    def _call(self, method: str, payload) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()

        class Conn:
            @staticmethod
            def send(reply) -> None:
                _, ok, value = pickle.loads(pickle.dumps(reply, protocol=5))  # as over the socket
                fut.set_result(value) if ok else fut.set_exception(value)

        args = ("lstm", "", self.generation, payload)
        (self.server._submit if method == "submit" else self.server._submit_many)(Conn, 0, args)
        return fut

    def one(self, prepared: Prepared) -> asyncio.Future:
        self.messages.append(1)
        return self._call("submit", prepared)

    def many(self, prepared: list[Prepared]) -> asyncio.Future:
        self.messages.append(len(prepared))
        return self._call("submit_many", prepared)


async def test_stream_chunks_travel_together_and_each_answers_on_its_own(dataplane):
    from service.dataplane.coalesce import ChunkLane
    from service.dataplane.validation import StreamRequest
    from service.errors import NotFound

    rng = np.random.default_rng(7)
    whole = {s: rng.standard_normal((1, 9, 4)).astype(np.float32) for s in ("a", "b")}
    side = ServerSide(dataplane)
    lane = ChunkLane(side.one, side.many, lambda fut, index: None)

    def chunk(stream: str, lo: int, hi: int, start: bool, end: bool = False) -> asyncio.Future:
        x = whole[stream][:, lo:hi] if stream in whole else np.zeros((1, 2, 4), np.float32)
        work = SequenceWork(x, np.array([hi - lo]), outputs=frozenset({"output", "h_n", "c_n"}))
        return lane.submit(Prepared(work, None, StreamRequest(stream, start, end)))

    # one loop iteration: a's first two chunks (in order), b's first, and a chunk of a stream never started
    first = [chunk("a", 0, 3, True), chunk("b", 0, 5, True), chunk("a", 3, 7, False), chunk("zz", 0, 2, False)]
    got = await asyncio.gather(*first, return_exceptions=True)
    assert side.messages == [4]
    assert isinstance(got[3], NotFound) and "zz" in str(got[3])
    rest = await asyncio.gather(chunk("a", 7, 9, False, True), chunk("b", 5, 9, False, True))
    engine = create_engine(make_model(*LSTM, seed=5), "cpu")
    for stream, parts in (("a", [got[0], got[2], rest[0]]), ("b", [got[1], rest[1]])):
        want = engine.forward(whole[stream])
        np.testing.assert_allclose(np.concatenate([p["output"] for p in parts], axis=1), want.output,
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(parts[-1]["h_n"], want.h_n, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(parts[-1]["c_n"], want.c_n, rtol=1e-6, atol=1e-6)
    assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", outcome="success") == 5
    assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", outcome="not_found") == 1


async def test_a_lone_chunk_leaves_alone_and_a_cancelled_chunk_is_not_sent(dataplane):
    from service.dataplane.coalesce import ChunkLane
    from service.dataplane.validation import StreamRequest

    side = ServerSide(dataplane)
    lane = ChunkLane(side.one, side.many, lambda fut, index: None)
    x = np.ones((1, 3, 4), np.float32)

    def chunk(stream: str) -> asyncio.Future:
        work = SequenceWork(x, np.array([3]), outputs=frozenset({"output_last"}))
        return lane.submit(Prepared(work, None, StreamRequest(stream, True, True)))

    assert "output_last" in await chunk("solo")
    futures = [chunk("s1"), chunk("s2"), chunk("s3")]
    futures[1].cancel()
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert side.messages == [1, 2]
    assert isinstance(outcomes[1], asyncio.CancelledError) and "output_last" in outcomes[2]


async def test_a_slow_message_is_logged_at_debug_with_its_lane_wait_and_round_trip(caplog):
    """At debug level a message of 10 ms or more says where its time went: waiting in the lane for the
    in-flight limit, or to the engine process and back. Faster messages say nothing."""
    from service.dataplane.coalesce import ChunkLane, SLOW_NOTE_S

    loop = asyncio.get_running_loop()
    delays: list[float] = []

    def send(value):  # the engine process's answer after the next delay
        fut = loop.create_future()
        loop.call_later(delays.pop(0), fut.set_result, value)
        return fut

    lane = ChunkLane(lambda p: send({"h_n": p}), lambda ps: send([(True, {"h_n": p}) for p in ps]), lambda f, i: None)
    with caplog.at_level(logging.DEBUG, logger="rnnserve.dataplane.coalesce"):
        delays[:] = [0.0]
        assert await lane.submit("fast") == {"h_n": "fast"}
        assert not caplog.records
        # two slow messages fill the in-flight limit; the third request waits in the lane for one of them
        delays[:] = [2 * SLOW_NOTE_S, 2 * SLOW_NOTE_S, 0.0]
        futures = []
        for name in ("a", "b", "c"):
            futures.append(lane.submit(name))
            await asyncio.sleep(0)  # "a" and "b" leave as one message each, "c" waits
        assert [await f for f in futures] == [{"h_n": "a"}, {"h_n": "b"}, {"h_n": "c"}]
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3, notes
    trips = [float(re.search(r"([\d.]+) ms to the engine process and back", n).group(1)) for n in notes]
    lanes = [float(re.search(r"([\d.]+) ms waiting in its lane", n).group(1)) for n in notes]
    assert min(trips[:2]) >= 1e3 * 2 * SLOW_NOTE_S * 0.9  # the slow answers
    assert lanes[2] >= 1e3 * SLOW_NOTE_S and trips[2] < lanes[2]  # "c": most of its time went to the lane


async def test_the_engine_process_logs_a_slow_message_at_debug_from_its_read_to_its_answer(caplog):
    """The engine process's side of the note: a message answered 10 ms or more after its read is logged
    (one request or many), a fast one is not."""
    from service.dataplane import remote

    loop = asyncio.get_running_loop()

    class SlowDataPlane:  # answers each request after its delay
        delays: list[float] = []

        def submit_prepared(self, name, version, generation, prepared):
            fut = loop.create_future()
            loop.call_later(self.delays.pop(0), fut.set_result, {"h_n": np.zeros(1, np.float32)})
            return fut

    server = remote.DataPlaneServer(SlowDataPlane(), "unused")
    replies: list = []

    class Conn:
        @staticmethod
        def send(reply) -> None:
            replies.append(reply)

    with caplog.at_level(logging.DEBUG, logger="rnnserve.dataplane.remote"):
        SlowDataPlane.delays[:] = [0.0, 2 * remote.SLOW_NOTE_S, 0.0, 2 * remote.SLOW_NOTE_S, 3 * remote.SLOW_NOTE_S]
        server._submit(Conn, 1, ("m", "", 0, "fast"))
        server._submit(Conn, 2, ("m", "", 0, "slow"))
        server._submit_many(Conn, 3, ("m", "", 0, ["fast", "slow"]))  # answered when its slowest is
        server._submit(Conn, 4, ("m", "", 0, Prepared(None, None, None, 3)))  # a front-end's 3 merged requests
        while len(replies) < 4:
            await asyncio.sleep(0.005)
    notes = [r.getMessage() for r in caplog.records]
    assert [n.split(" took")[0] for n in notes] == ["a front-end message of 1 requests",
                                                     "a front-end message of 2 requests",
                                                     "a front-end message of 3 requests"], notes
    assert all(float(re.search(r"took ([\d.]+) ms", n).group(1)) >= 1e3 * 2 * remote.SLOW_NOTE_S * 0.9 for n in notes)
    assert [r[0] for r in replies] == [1, 2, 3, 4]
