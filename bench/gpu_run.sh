#!/usr/bin/env bash
# One full run on a lent GPU machine (see the device tool): the GPU test suite and the
# benchmarks, logs and JSON written to $OUT. The machine has no package index, so the
# wheels it lacks travel in .gpu-wheels (FastAPI, uvicorn, pydantic, tritonclient, grpcio...).
#   usage (device tool, carry .gpu-wheels):  bash bench/gpu_run.sh [tests|serve|engine|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=torch
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.log"
python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)" >> "$OUT/env.log" 2>&1
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [ "$what" = all ] || [ "$what" = serve ]; then
  timeout 240 python3 bench/serve.py --device cuda --out "$OUT/serve_gpu.json" 2>&1 | tee "$OUT/serve_gpu.log" || rc=1
fi
if [ "$what" = all ] || [ "$what" = engine ]; then
  timeout 200 python3 bench/gpu_engine.py --out "$OUT/gpu_engine.json" 2>&1 | tee "$OUT/gpu_engine.log" || rc=1
fi
exit $rc
