"""`rnnserve serve --frontends 2 [--engines 2]`: two front-end processes around one or two engine processes,
as a user runs it (every test on the shared server runs against both layouts)."""
from __future__ import annotations

import gc as gc_module
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from service import create_engine
from service.repository import load_model
from serving_support import LSTM, build_repository, make_model, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-engine", "two-engines"])
def frontends_server(tmp_path_factory, request):
    repo = build_repository(tmp_path_factory.mktemp("fe") / "models")
    proc, http_url, grpc_url = start_server(repo, "--frontends", "2", "--engines", request.param)
    try:
        yield repo, proc, http_url.split("://")[1], grpc_url.split("://")[1]
    finally:
        if proc.poll() is None:
            assert stop_server(proc) == 0


def _http_input(x):
    inp = th.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _grpc_input(x):
    inp = tg.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_requests_through_both_transports_match_the_engine(frontends_server):
    repo, _, http, grpc = frontends_server
    x = np.random.default_rng(3).standard_normal((3, 7, 4)).astype(np.float32)
    want = create_engine(load_model(repo / "lstm"), "cpu").forward(x)
    with th.InferenceServerClient(http) as hc, tg.InferenceServerClient(grpc) as gc:
        assert hc.is_server_ready() and gc.is_server_ready()
        assert hc.get_model_metadata("lstm")["platform"] == "rnnserve_reference"
        got_http = hc.infer("lstm", [_http_input(x)]).as_numpy("output")
        got_grpc = gc.infer("lstm", [_grpc_input(x)]).as_numpy("h_n")
        np.testing.assert_allclose(got_http, want.output, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_grpc, want.h_n, rtol=1e-5, atol=1e-5)
        # errors keep their status and message across the process boundary
        with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
            hc.infer("nope", [_http_input(x)])
        assert "404" in str(err.value.status())
        with pytest.raises(InferenceServerException, match="has 3 features, model 'lstm' expects 4"):
            gc.infer("lstm", [_grpc_input(x[:, :, :3].copy())])
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):  # a synchronous call
            hc.get_model_metadata("nope")
        with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
            gc.get_model_metadata("nope")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert {m["name"] for m in hc.get_model_repository_index()} == {"lstm", "gru_bi"}
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    assert 'rnnserve_requests_total{model="lstm",outcome="success",version="1"}' in text


def test_a_stream_continues_whichever_front_end_gets_the_chunk(frontends_server):
    repo, _, http, grpc = frontends_server
    x = np.random.default_rng(4).standard_normal((1, 12, 4)).astype(np.float32)
    want = create_engine(load_model(repo / "lstm"), "cpu").forward(x)
    outs = []
    # A new client per chunk: each opens its own connection, which the kernel may give to either front-end.
    for k, (a, b) in enumerate([(0, 4), (4, 9), (9, 12)]):
        chunk = np.ascontiguousarray(x[:, a:b])
        if k % 2:
            with tg.InferenceServerClient(grpc) as gc:
                res = gc.infer("lstm", [_grpc_input(chunk)], sequence_id=5, sequence_start=k == 0,
                               sequence_end=b == 12)
        else:
            with th.InferenceServerClient(http) as hc:
                res = hc.infer("lstm", [_http_input(chunk)], sequence_id=5, sequence_start=k == 0,
                               sequence_end=b == 12)
        outs.append(res.as_numpy("output"))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want.output, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.as_numpy("h_n"), want.h_n, rtol=1e-5, atol=1e-5)


def _successes(http: str) -> float:
    """Successful requests to lstm, all versions (0 before the first)."""
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(r'^rnnserve_requests_total\{model="lstm",outcome="success",version="\d+"\} (\S+)$', text, re.M))


def test_front_ends_serve_a_reloaded_model_with_its_new_weights(frontends_server):
    """Front-ends validate against a cached view of each model; after a reload they must not run the old one."""
    repo, _, http, grpc = frontends_server
    x = np.random.default_rng(5).standard_normal((2, 6, 4)).astype(np.float32)
    v1 = create_engine(load_model(repo / "lstm", 1), "cpu").forward(x).output
    before = _successes(http)
    answered = 0
    for k in range(4):  # new connections: the kernel spreads them over both front-ends, which cache views
        with th.InferenceServerClient(http) as hc, tg.InferenceServerClient(grpc) as gc:
            np.testing.assert_allclose(hc.infer("lstm", [_http_input(x)]).as_numpy("output"), v1, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(gc.infer("lstm", [_grpc_input(x)]).as_numpy("output"), v1, rtol=1e-5, atol=1e-5)
            answered += 2
    make_model(*LSTM, seed=7).save(repo, "lstm", 2)
    v2 = create_engine(load_model(repo / "lstm", 2), "cpu").forward(x).output
    assert not np.allclose(v1, v2)
    assert _successes(http) - before == answered  # each request counted once, retried or not
    with th.InferenceServerClient(http) as hc:
        hc.load_model("lstm")  # version_policy latest: version 2 replaces version 1
    # version 1 left the index, and its series with it (ServerMetrics.drop_version): count version 2's
    before, answered = 0, 0
    for k in range(4):
        with th.InferenceServerClient(http) as hc, tg.InferenceServerClient(grpc) as gc:
            res = hc.infer("lstm", [_http_input(x)])
            assert res.get_response()["model_version"] == "2"
            np.testing.assert_allclose(res.as_numpy("output"), v2, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(gc.infer("lstm", [_grpc_input(x)]).as_numpy("output"), v2, rtol=1e-5, atol=1e-5)
            answered += 2
    with th.InferenceServerClient(http) as hc, tg.InferenceServerClient(grpc) as gc:
        hc.unload_model("lstm")
        with pytest.raises(InferenceServerException, match="not ready"):
            gc.infer("lstm", [_grpc_input(x)])
        hc.load_model("lstm")
        np.testing.assert_allclose(gc.infer("lstm", [_grpc_input(x)]).as_numpy("output"), v2, rtol=1e-5, atol=1e-5)
        answered += 1
    assert _successes(http) - before == answered  # each request counted once, retried or not


def test_concurrent_requests_coalesced_by_front_ends_equal_their_single_answers(frontends_server):
    """Front-ends merge the requests that wait behind their in-flight work (service.dataplane.coalesce), and hand
    their arrays over in shared memory (service.dataplane.arena): the engine process maps each front-end's arena."""
    repo, proc, http, _ = frontends_server
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1 + k % 3, int(rng.integers(150, 400)), 4)).astype(np.float32) for k in range(64)]
    before = _successes(http)
    with th.InferenceServerClient(http) as hc:
        version = hc.get_model_metadata("lstm")["versions"][-1]

    def outputs(k: int) -> list:
        return [th.InferRequestedOutput(n) for n in (("output", "h_n") if k % 2 else ("output_last",))]

    # 32 connections, spread over both front-ends; one client on this thread (clients made on worker threads
    # were collected on others, where tritonclient's gevent pool refuses to close)
    with th.InferenceServerClient(http, concurrency=32) as client:
        pending = [client.async_infer("lstm", [_http_input(xs[k])], outputs=outputs(k)) for k in range(64)]
        results = [p.get_result() for p in pending]
    engine = create_engine(load_model(repo / "lstm", int(version)), "cpu")
    for k, (x, res) in enumerate(zip(xs, results)):
        want = engine.forward(x)
        if k % 2:
            np.testing.assert_allclose(res.as_numpy("output"), want.output, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(res.as_numpy("h_n"), want.h_n, rtol=1e-5, atol=1e-5)
            assert res.as_numpy("output_last") is None
        else:
            np.testing.assert_allclose(res.as_numpy("output_last"), want.output[:, -1], rtol=1e-5, atol=1e-5)
            assert res.as_numpy("output") is None
    assert _successes(http) - before == 64  # merged or not, each request counted once
    if os.path.isdir("/dev/shm"):
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert len(set(re.findall(r"/dev/shm/(rnnserve-\S+)", maps))) == 2  # both front-ends', files removed


def _frontend_waiting(http: str) -> float:
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "rnnserve_frontend_queue_depth" and s.labels.get("model") == "lstm")


def test_requests_waiting_in_the_front_ends_are_counted_and_go_back_to_zero(frontends_server):
    """rnnserve_queue_depth is the engine process's queue; what the front-ends hold back while their messages are
    out was counted nowhere (an autoscaler on the queue saw 0 with requests waiting)."""
    _, _, http, grpc = frontends_server
    gc_module.collect()  # earlier tests' HTTP clients: collected on a gRPC callback thread, gevent refuses to close them
    x = np.random.default_rng(8).standard_normal((1, 20_000, 4)).astype(np.float32)
    stop, lock, state = threading.Event(), threading.Lock(), {"out": 0, "errors": []}
    seen = []
    with tg.InferenceServerClient(grpc) as gc:
        def send() -> None:
            with lock:
                state["out"] += 1
            gc.async_infer("lstm", [_grpc_input(x)], again, outputs=[tg.InferRequestedOutput("h_n")])

        def again(result, error) -> None:  # a closed loop: 16 requests always open, so some always wait
            with lock:
                state["out"] -= 1
                if error is not None:
                    state["errors"].append(error)
            if not stop.is_set():
                send()

        for _ in range(16):
            send()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(seen[-3:]):
            seen.append(_frontend_waiting(http))
            time.sleep(0.05)
        stop.set()
        deadline = time.monotonic() + 30
        while state["out"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not state["errors"] and not state["out"], state
    assert max(seen) > 0, seen
    deadline = time.monotonic() + 5
    while _frontend_waiting(http) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _frontend_waiting(http) == 0


def _gru_gauges(http: str) -> dict[str, float]:
    """gru_bi version 1's per-version gauges in the exposition a front-end serves (every engine process's, merged)."""
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("model") == "gru_bi" and s.labels.get("version") == "1"
            and s.name in ("rnnserve_model_ready", "rnnserve_queue_depth", "rnnserve_model_engine")}


def test_an_unloaded_model_reads_not_ready_in_the_merged_metrics(frontends_server):
    """rnnserve_model_ready stays at 0 for an unloaded version in every engine process, so the front-ends' merged
    exposition shows 0 too (not a missing series), and 1 once the model is loaded again."""
    _, _, http, _ = frontends_server
    with th.InferenceServerClient(http) as hc:
        for _ in range(2):
            hc.unload_model("gru_bi")
            assert _gru_gauges(http) == {"rnnserve_model_ready": 0}
            hc.load_model("gru_bi")
            assert _gru_gauges(http) == {"rnnserve_model_ready": 1, "rnnserve_queue_depth": 0,
                                         "rnnserve_model_engine": 1}
            assert hc.is_model_ready("gru_bi")


def test_sigterm_stops_every_process(frontends_server):
    _, proc, _, _ = frontends_server
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    engines = int(proc.args[proc.args.index("--engines") + 1])
    assert len(children) >= 2 + engines - 1  # front-ends, engines (multiprocessing may add its resource tracker)
    assert stop_server(proc) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{c}").exists() for c in children):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{c}").exists() for c in children), "front-end processes outlived the server"


def test_front_ends_exit_when_the_engine_process_is_killed(tmp_path):
    repo = build_repository(tmp_path / "models")
    proc, _, _ = start_server(repo, "--frontends", "2")
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "front-end processes outlived a killed engine process"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_the_server_stops_with_an_error_when_an_engine_process_dies(tmp_path):
    """A dead engine process would fail every request and stream routed to it: the server exits non-zero, and
    no process outlives it."""
    repo = build_repository(tmp_path / "models")
    proc, http_url, _ = start_server(repo, "--frontends", "1", "--engines", "2")
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    engine = next(c for c in children if _listens_on(c, "engine-1.sock"))
    os.kill(engine, signal.SIGKILL)
    assert proc.wait(20) == 1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "child processes outlived the server"


def _listens_on(pid: int, socket_name: str) -> bool:
    """Whether process ``pid`` holds the listening Unix socket named ``socket_name`` (Linux /proc)."""
    inodes = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
              if len(line.split()) > 7 and line.split()[7].endswith("/" + socket_name)}
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except FileNotFoundError:  # closed meanwhile
            pass
    return any(link.startswith("socket:") and link.strip("socket:[]") in inodes for link in links)


def test_the_ports_line_is_one_write_so_child_logs_cannot_split_it(monkeypatch):
    from service import app
    from serving_support import LINE

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Recorder())
    app.announce("rnnserve: HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001")
    assert writes == ["rnnserve: HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001\n"]
    # and a line that was split anyway (an older server) is not read as a port
    assert LINE.search("rnnserve: HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:80012026-11-23 20:27:40 INFO x") is None
    assert LINE.search("rnnserve: HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001; 2 front-end").group(4) == "8001"


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent and int(entry) not in found:
                    found.add(int(entry))
                    todo.append(int(entry))
    return found


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_sigterm_after_large_json_stops_at_once_and_leaves_no_process(tmp_path, frontends):
    """A large JSON body starts the REST transport's JSON helper process; SIGTERM still stops the server at
    once, helpers included (a front-end waits for its children at exit: a helper left waiting for work held
    it until the drain timeout)."""
    repo = build_repository(tmp_path / "models")
    proc, http_url, _ = start_server(repo, "--frontends", frontends, "--drain-timeout-s", "25")
    x = np.random.default_rng(4).standard_normal((1, 9000, 4)).astype(np.float32)
    inp = th.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    with th.InferenceServerClient(http_url.split("://")[1], network_timeout=60) as client:
        want = create_engine(load_model(repo / "lstm"), "cpu").forward(x).output[0, -1]
        for _ in range(2 * int(frontends)):  # a front-end each, most likely
            got = client.infer("lstm", [inp], outputs=[th.InferRequestedOutput("output_last", binary_data=False)])
            np.testing.assert_allclose(got.as_numpy("output_last")[0], want, rtol=1e-5, atol=1e-6)
    children = _descendants(proc.pid)
    start = time.monotonic()
    assert stop_server(proc, timeout=30) == 0
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}") and
                "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()], "processes left after the server stopped"
