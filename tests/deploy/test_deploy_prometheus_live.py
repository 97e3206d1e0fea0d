"""A real Prometheus scrapes a real `rnnserve serve`; the metrics come back through its query API.

Also evaluates every Grafana dashboard query against that Prometheus, so a panel
that errors or charts a metric the server never exports fails here, not in Grafana.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from live_server import (TINY_MODEL, bound_ports, clean_env, free_port, http_json, infer_and_check, running,
                         wait_ready, wait_until, write_tiny_model)
from test_deploy_compose import PENDING_METRICS, dashboard_exprs, metric_names, promql

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    return binary


@pytest.fixture(scope="module")
def stack(prometheus_binary, tmp_path_factory):
    """rnnserve (CPU engine, tiny model) + Prometheus scraping it every second; yields their ports."""
    tmp = tmp_path_factory.mktemp("prometheus-live")
    repository = tmp / "models"
    write_tiny_model(repository)
    server_log = tmp / "rnnserve.log"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", str(repository), "--http-port", "0",
           "--grpc-port", "0", "--host", "127.0.0.1", "--device", "cpu"]
    with running(cmd, server_log, env=clean_env(), cwd=ROOT) as server:
        http_port, _ = bound_ports(server, server_log)
        wait_ready(server, http_port, server_log)
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rnnserve", "metrics_path": "/metrics",
                                "static_configs": [{"targets": [f"127.0.0.1:{http_port}"]}]}],
        }))
        prom_port = free_port()
        prom_log = tmp / "prometheus.log"
        prom_cmd = [prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h",
                    "--log.level=warn"]
        with running(prom_cmd, prom_log, cwd=tmp) as prom:
            wait_until(lambda: http_json(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2)[0] == 200,
                       60, "Prometheus to be ready", prom, prom_log)
            for batch in range(1, REQUESTS + 1):
                infer_and_check(http_port, repository, batch=batch)
            yield {"http_port": http_port, "prom_port": prom_port, "prom": prom, "prom_log": prom_log,
                   "server": server, "server_log": server_log}
            assert server.poll() is None, "rnnserve died during the test"


def query(prom_port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http_json(url)
    assert status == 200 and body["status"] == "success", f"{expr}: {status} {body}"
    return body["data"]["result"]


def test_prometheus_scrapes_rnnserve_and_sees_the_requests(stack):
    port = stack["prom_port"]
    wait_until(lambda: [r for r in query(port, 'up{job="rnnserve"}') if r["value"][1] == "1"], 30,
               "Prometheus to scrape rnnserve (up == 1)", stack["prom"], stack["prom_log"])
    expr = f'sum(rnnserve_requests_total{{model="{TINY_MODEL}", outcome="success"}})'
    result = wait_until(lambda: [r for r in query(port, expr) if float(r["value"][1]) >= REQUESTS], 30,
                        f"{expr} >= {REQUESTS}", stack["prom"], stack["prom_log"])
    assert float(result[0]["value"][1]) == REQUESTS
    (batches,) = query(port, f'sum(rnnserve_batch_size_count{{model="{TINY_MODEL}"}})')
    assert float(batches["value"][1]) >= 1
    (useful,) = query(port, f'sum(rnnserve_useful_timesteps_total{{model="{TINY_MODEL}"}})')
    (computed,) = query(port, f'sum(rnnserve_computed_timesteps_total{{model="{TINY_MODEL}"}})')
    assert 0 < float(useful["value"][1]) <= float(computed["value"][1])


def declared_sample_names(metrics_text: str) -> set[str]:
    """Sample names from the `# TYPE` lines of a /metrics page (declared even before a first sample)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created")}
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":  # the text format declares counters with their _total suffix
                name = name.removesuffix("_total")
            names |= {name + s for s in suffixes.get(kind, ("",))}
    return names


def test_every_dashboard_metric_is_exported_by_the_live_server(stack):
    status, text = http_json(f"http://127.0.0.1:{stack['http_port']}/metrics")
    assert status == 200
    exported = declared_sample_names(text)
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    missing = used - exported - set(PENDING_METRICS)
    assert not missing, f"dashboard queries metrics the running server does not export: {sorted(missing)}"


def test_every_dashboard_query_runs(stack):
    port = stack["prom_port"]
    wait_until(lambda: query(port, f'rnnserve_batch_size_count{{model="{TINY_MODEL}"}}'), 30,
               "batch metrics in Prometheus", stack["prom"], stack["prom_log"])
    # Every query must evaluate; those whose series exist (not e.g. the failure counter
    # of a server that never failed) must return data once two scrapes cover the requests.
    with_series = {r["metric"]["__name__"] for r in query(port, '{__name__=~"rnnserve_.+"}')}
    expect_data = [e for e in dashboard_exprs() if metric_names(e) <= with_series]
    for expr in dashboard_exprs():
        query(port, promql(expr))
    def without_data() -> list[str]:
        return [e for e in expect_data if not query(port, promql(e))]

    deadline = time.monotonic() + 20
    while (missing := without_data()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not missing, f"no data for {missing}"
    assert len(expect_data) >= len(dashboard_exprs()) - 3
