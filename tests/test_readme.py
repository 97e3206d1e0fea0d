"""The README's commands run as written, so the README cannot rot.

Blocks after `<!-- readme-test -->` run against a real `rnnserve serve` on the bundled
models (localhost:8000/8001 replaced by the real ports); blocks after
`<!-- readme-test: convert -->` run in an empty folder, in order. Numbers a block's
comments or the JSON block after it promise are checked against what it printed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serving"))
from serving_support import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = re.compile(r"<!-- readme-test(?:: (\w+))? -->\n```(\w+)\n(.*?)```(?:\n\n[^\n]*\n\n```json\n(.*?)```)?", re.S)
NUMBER = re.compile(r"-?\d+\.\d+")


def blocks(kind: str | None) -> list[tuple[str, str, str | None]]:
    text = (ROOT / "README.md").read_text()
    return [(lang, code, answer) for k, lang, code, answer in BLOCK.findall(text) if (k or None) == kind]


def run(lang: str, code: str, cwd: Path) -> str:
    env = {**os.environ, "KERAS_BACKEND": "torch", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"README {lang} block failed:\n{code}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def numbers(text: str) -> list[float]:
    return [float(n) for n in NUMBER.findall(text)]


@pytest.fixture(scope="module")
def bundled_server():
    proc, http_url, grpc_url = start_server(ROOT / "models")
    try:
        yield http_url.split("://")[1], grpc_url.split("://")[1]
    finally:
        assert stop_server(proc) == 0


def test_readme_has_testable_blocks():
    assert len(blocks(None)) >= 4 and len(blocks("convert")) >= 2


def test_serving_examples(bundled_server, tmp_path):
    http, grpc = bundled_server
    for lang, code, answer in blocks(None):
        code = code.replace("localhost:8000", http).replace("localhost:8001", grpc)
        out = run(lang, code, tmp_path)
        if lang == "bash":
            reply = json.loads(out)
            assert "error" not in reply
            if answer:
                np.testing.assert_allclose(numbers(out), numbers(answer), atol=1e-3)
        else:
            printed = out.strip().splitlines()
            promised = [line.split("#", 1)[1].split(":")[0] for line in code.splitlines()
                        if line.startswith("print(") and "#" in line]
            assert len(printed) == len(promised)
            for got, want in zip(printed, promised):
                np.testing.assert_allclose(numbers(got), numbers(want), atol=2e-3)


def test_convert_examples(tmp_path):
    outputs = [run(lang, code, tmp_path) for lang, code, _ in blocks("convert")]
    assert outputs[-1].count("verified against") == 3
    for name in ("kws", "tagger", "gru"):
        assert (tmp_path / "models" / name / "1" / "model.safetensors").exists()
