"""`make serve` takes its ports, repository and device from make variables or the server's own RNNSERVE_* variables.

The server's settings read RNNSERVE_* themselves, but `make serve` passes explicit flags, and flags win; so the
Makefile has to take the variables over, or `RNNSERVE_HTTP_PORT=9000 make serve` would quietly serve on 8000.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def serve_command(*args: str, **env: str) -> str:
    """The command line `make -n serve` would run (nothing is run or built)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    res = subprocess.run(["make", "-n", "serve", *args], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return next(line for line in res.stdout.splitlines() if "service.cli serve" in line)


def test_defaults():
    cmd = serve_command()
    assert "--http-port 8000 --grpc-port 8001" in cmd and "--repository models" in cmd and "--device auto" in cmd


def test_the_server_s_own_variables_reach_the_command():
    cmd = serve_command(RNNSERVE_HTTP_PORT="9000", RNNSERVE_GRPC_PORT="9001", RNNSERVE_DEVICE="cpu",
                        RNNSERVE_REPOSITORY="/srv/models")
    assert "--http-port 9000 --grpc-port 9001" in cmd and "--device cpu" in cmd and "--repository /srv/models" in cmd


def test_make_variables_win_over_the_environment():
    cmd = serve_command("HTTP_PORT=9100", RNNSERVE_HTTP_PORT="9000")
    assert "--http-port 9100" in cmd
