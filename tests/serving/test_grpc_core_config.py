"""grpc's core settings reach grpc: set before the server's processes first import grpc."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from service.transports.grpc.core_config import DEFAULT_EXPERIMENTS

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**base, **env},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_server_imports_set_the_default_before_grpc_loads():
    out = _run("""
        import os, sys
        import service.cli, service.app, service.frontends
        loaded_before = 'grpc' in sys.modules
        from service.transports.grpc import create_grpc_server
        print(loaded_before, 'grpc' in sys.modules, os.environ['GRPC_EXPERIMENTS'])
    """)
    assert out == f"False True {DEFAULT_EXPERIMENTS}"


def test_a_value_the_user_set_is_kept_even_empty():
    code = """
        import os
        import service.transports.grpc
        print(repr(os.environ['GRPC_EXPERIMENTS']))
    """
    assert _run(code, GRPC_EXPERIMENTS="event_engine_listener") == "'event_engine_listener'"
    assert _run(code, GRPC_EXPERIMENTS="") == "''"
