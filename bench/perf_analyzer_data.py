"""Write an input-data file for Triton's ``perf_analyzer`` that drives an rnnserve model.

``perf_analyzer`` (shipped in the ``tritonclient`` wheel) shapes its requests from the
model's metadata and configuration. An rnnserve model's time dimension and its optional
``lengths`` and state inputs have no fixed shape, so it needs the requests spelled out:
this script reads the model's metadata from a running server and writes ``--count``
single-sequence requests (``input`` [1, T, I] of seeded random values, ``lengths`` [T]),
with T drawn from ``--min-len``..``--max-len``. perf_analyzer cycles through them::

    python bench/perf_analyzer_data.py --url localhost:8000 --model forecaster --out /tmp/forecaster.json
    perf_analyzer -m forecaster --input-data /tmp/forecaster.json --concurrency-range 8:64:8 [-i grpc -u localhost:8001]

Optional inputs without data (``h_0``, ``c_0``) are not sent. Standard library only.
:func:`perf_analyzer_env` finds perf_analyzer and the CUDA 12 runtime library it links.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import urllib.request
from pathlib import Path


def perf_analyzer_env() -> tuple[str, dict[str, str]]:
    """perf_analyzer's path and an environment in which it finds CUDA 12's runtime library."""
    exe = shutil.which("perf_analyzer", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    if exe is None:
        raise FileNotFoundError("perf_analyzer not found: pip install tritonclient")
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        lib = str(Path(nvidia.cuda_runtime.__path__[0]) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    except ImportError:
        pass
    return exe, env


def model_input_size(url: str, model: str) -> int:
    """The feature size I of ``model``'s ``input`` [B, T, I], from the server's metadata."""
    with urllib.request.urlopen(f"http://{url}/v2/models/{model}", timeout=10) as resp:
        meta = json.load(resp)
    for tensor in meta["inputs"]:
        if tensor["name"] == "input":
            return int(tensor["shape"][-1])
    raise SystemExit(f"model '{model}' has no input named 'input': {meta['inputs']}")


def requests_data(features: int, count: int, min_len: int, max_len: int, seed: int = 1) -> dict:
    """perf_analyzer's input-data document: ``count`` requests of one sequence each."""
    if not 1 <= min_len <= max_len:
        raise SystemExit(f"need 1 <= --min-len <= --max-len, got {min_len}..{max_len}")
    rng = random.Random(seed)
    data = []
    for _ in range(count):
        steps = rng.randint(min_len, max_len)
        data.append({
            "input": {"content": [round(rng.uniform(-1.0, 1.0), 4) for _ in range(steps * features)],
                      "shape": [1, steps, features]},
            "lengths": {"content": [steps], "shape": [1]},
        })
    return {"data": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8000", help="HTTP host:port of the server (default localhost:8000)")
    p.add_argument("--model", required=True)
    p.add_argument("--count", type=int, default=64, help="distinct requests (default 64)")
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="file to write (default: standard output)")
    args = p.parse_args(argv)
    doc = requests_data(model_input_size(args.url, args.model), max(1, args.count), args.min_len, args.max_len,
                        args.seed)
    text = json.dumps(doc)
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
