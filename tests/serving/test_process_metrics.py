"""rnnserve_process_* metrics: each server process's CPU and memory, by name, from whichever process answers."""
from __future__ import annotations

import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_support import build_repository, start_server, stop_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _processes(http_url: str) -> dict[str, dict[str, float]]:
    text = urllib.request.urlopen(f"{http_url}/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("rnnserve_process_cpu_seconds_total", "rnnserve_process_resident_memory_bytes"):
                out.setdefault(s.name, {})[s.labels["process"]] = s.value
    return out


@pytest.mark.parametrize("layout, names", [
    ((), {"rnnserve"}),
    (("--frontends", "2", "--engines", "2"), {"rnnserve", "rnnserve-fe-0", "rnnserve-fe-1", "rnnserve-eng-1"}),
], ids=["one process", "front-ends and engines"])
def test_every_server_process_is_listed_by_name_from_any_front_end(tmp_path, layout, names):
    repo = build_repository(tmp_path / "models")
    proc, http_url, _ = start_server(repo, *layout)
    try:
        for _ in range(4):  # each scrape may reach another front-end: each sees the whole server
            got = _processes(http_url)
            assert set(got["rnnserve_process_cpu_seconds_total"]) == names, got
            assert set(got["rnnserve_process_resident_memory_bytes"]) == names
            assert all(v > 0 for v in got["rnnserve_process_cpu_seconds_total"].values())
            assert all(20e6 < v < 4e9 for v in got["rnnserve_process_resident_memory_bytes"].values())
    finally:
        assert stop_server(proc) == 0


def test_the_json_helper_is_named_after_its_front_end(tmp_path):
    import numpy as np

    repo = build_repository(tmp_path / "models")
    proc, http_url, _ = start_server(repo, "--frontends", "1", "--engines", "2")
    try:
        body = {"inputs": [{"name": "input", "shape": [1, 20_000, 4], "datatype": "FP32",
                            "data": np.zeros(80_000).tolist()}], "outputs": [{"name": "h_n"}]}
        import json

        request = urllib.request.Request(f"{http_url}/v2/models/lstm/infer", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(request, timeout=60).status == 200  # a large JSON body: the helper starts
        assert "rnnserve-js-0" in _processes(http_url)["rnnserve_process_cpu_seconds_total"]
    finally:
        assert stop_server(proc) == 0
