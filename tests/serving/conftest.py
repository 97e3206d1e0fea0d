"""Fixtures for serving tests: a temporary repository of tiny random models, and a real
`rnnserve serve` process (``server_process``) that other test modules can reuse.
"""
from __future__ import annotations

import gc
from pathlib import Path

import pytest

from serving_support import build_repository, start_server, stop_server


@pytest.fixture(scope="module", autouse=True)
def _collect_clients_on_this_thread():
    """Collect each module's garbage on the main thread when it ends.

    A closed tritonclient.http client closes its gevent pool again in ``__del__``; if a later
    test's worker thread happens to run that collection, gevent refuses the foreign thread and
    pytest reports it as an unraisable-exception warning against an unrelated test."""
    yield
    gc.collect()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A fresh repository per test (tests may change configs, add broken folders)."""
    return build_repository(tmp_path / "models")


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """The repository the shared ``server_process`` serves (lstm, gru_bi)."""
    return build_repository(tmp_path_factory.mktemp("served") / "models")


@pytest.fixture(scope="session")
def server_process(model_repository: Path):
    """A real `rnnserve serve` process on free ports; yields (http_url, grpc_url).

    On teardown it sends SIGTERM and checks that the process drained and exited 0.
    grpc_url is None when the gRPC transport is not available.
    """
    proc, http_url, grpc_url = start_server(model_repository)
    try:
        yield http_url, grpc_url
    finally:
        if proc.poll() is None:
            rc = stop_server(proc)
            assert rc == 0, f"rnnserve exited {rc} on SIGTERM"
