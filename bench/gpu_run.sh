#!/usr/bin/env bash
# One full run on a lent GPU machine (see the device tool): the GPU test suite and the
# benchmarks, logs and JSON written to $OUT. The machine has no package index, so the
# wheels it lacks travel in .gpu-wheels (FastAPI, uvicorn, pydantic, tritonclient, grpcio...).
#   usage (device tool, carry .gpu-wheels):  bash bench/gpu_run.sh [tests|serve|engine|profile|cprofile|stalls|engines|all]
# ENGINES=N: engine processes of the servers started here (rnnserve serve --engines N; default 1).
# profile: py-spy samples (per thread) of the engine process of `rnnserve serve --frontends 8` under
# binary-HTTP and gRPC load at concurrency 64 (CONC=) and under 256 paced streams (py-spy wheel in .gpu-wheels): all
# threads, then only the thread holding the GIL (--gil). PROTOS picks the loads (default: all three);
# SPY_NATIVE=1 adds C frames (CPython, uvloop, CuPy, the CUDA driver) to the all-threads profile.
# cprofile: the engine process of `rnnserve serve --frontends 8` under cProfile (its event-loop thread) through
# binary-HTTP load at concurrency 64 on the batching and the non-batching model and 256 paced streams, then
# bench/engine_process.py (the engine process's cost per request with a stand-in engine, as on the CPU VM).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
[ -e /tmp/site/grpc/_cython ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=torch
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.log"
python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)" >> "$OUT/env.log" 2>&1
# the profiled server's repository (the benchmark's two models) and its readiness
profile_repository() {
  python3 -c "import sys; sys.path.insert(0, 'bench'); import serve, pathlib; r = pathlib.Path('/tmp/prepo'); \
serve.write_repository(r, 40, 128, 1); serve.write_stream_model(r, 40, 256, 2)"
}
wait_ready() {
  python3 -c "
import time, urllib.request
for _ in range(240):
    try:
        if urllib.request.urlopen('http://127.0.0.1:18000/v2/health/ready', timeout=2).status == 200: break
    except Exception: time.sleep(0.5)"
}
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [ "$what" = all ] || [ "$what" = serve ]; then
  timeout 400 python3 bench/serve.py --device cuda ${SERVE_ARGS:---frontends 8} --out "$OUT/serve_gpu.json" 2>&1 | tee "$OUT/serve_gpu.log" || rc=1
fi
if [ "$what" = all ] || [ "$what" = engine ]; then
  timeout 310 python3 bench/gpu_engine.py --out "$OUT/gpu_engine.json" 2>&1 | tee "$OUT/gpu_engine.log" || rc=1
fi
if [ "$what" = profile ]; then
  # py-spy travels in .gpu-wheels (installed into /tmp/site with the rest)
  spy=/tmp/site/bin/py-spy
  profile_repository
  python3 -m service.cli serve --repository /tmp/prepo --host 127.0.0.1 --http-port 18000 --grpc-port 18001 \
    --device cuda --frontends ${FRONTENDS:-8} --engines ${ENGINES:-1} --log-level warning > "$OUT/profile_server.log" 2>&1 &
  spid=$!
  wait_ready
  for proto in ${PROTOS:-http-binary grpc streams}; do
    if [ $proto = streams ]; then
      python3 bench/serve.py --url 127.0.0.1:18000 --grpc-url 127.0.0.1:18001 --scenario streams --device cuda \
        --streams 256 --chunk-interval-ms 100 --paced-seconds 10 --clients ${CLIENTS:-6} 2>&1 | tee -a "$OUT/profile_load.log" &
    else
      python3 bench/serve.py --url 127.0.0.1:18000 --grpc-url 127.0.0.1:18001 --no-compare --protocols $proto \
        --concurrency ${CONC:-64} --duration 8 --warmup 1 --clients ${CLIENTS:-4} --scenario requests 2>&1 | tee -a "$OUT/profile_load.log" &
    fi
    lpid=$!
    sleep 3
    { echo "== $proto"; top -b -n 1 -w 200 | head -30; } >> "$OUT/top.log"
    if [ -n "${SPY_NATIVE:-}" ]; then  # native frames need the process paused per sample: fewer samples
      $spy record -p $spid -d 3 -r 100 -t --native -f raw -o "$OUT/engine_$proto.txt" >> "$OUT/profile_load.log" 2>&1
    else
      $spy record -p $spid -d 3 -r 500 -t -f raw -o "$OUT/engine_$proto.txt" --nonblocking >> "$OUT/profile_load.log" 2>&1
    fi
    if [ -n "${SPY_FRONTENDS:-}" ]; then  # the front-end processes too, all at once (one file, pid per line)
      spies=()
      for c in $(pgrep -P $spid); do
        $spy record -p $c -d 3 -r 250 -f raw -o "/tmp/fe_$c.txt" --nonblocking > /dev/null 2>&1 &
        spies+=($!)
      done
      wait "${spies[@]}"
      for f in /tmp/fe_*.txt; do sed "s/^/$(basename $f .txt);/" "$f"; done > "$OUT/frontends_$proto.txt"; rm -f /tmp/fe_*.txt
    fi
    # --gil: only the thread holding the GIL, i.e. where the engine process's one Python core goes
    $spy record -p $spid -d 3 -r 500 -t --gil -f raw -o "$OUT/engine_gil_$proto.txt" --nonblocking >> "$OUT/profile_load.log" 2>&1
    wait $lpid
  done
  kill -TERM $spid; wait $spid
fi
if [ "$what" = cprofile ]; then
  profile_repository
  python3 -m cProfile -o "$OUT/engine.prof" -m service.cli serve --repository /tmp/prepo --host 127.0.0.1 \
    --http-port 18000 --grpc-port 18001 --device cuda --frontends ${FRONTENDS:-8} --engines ${ENGINES:-1} --log-level warning \
    > "$OUT/cprofile_server.log" 2>&1 &
  spid=$!
  wait_ready
  for model in bench bench_nobatch; do
    python3 bench/serve.py --url 127.0.0.1:18000 --grpc-url 127.0.0.1:18001 --no-compare --protocols http-binary \
      --model $model --concurrency 64 --duration 6 --warmup 1 --clients 4 --scenario requests 2>&1 | tee -a "$OUT/cprofile_load.log"
  done
  python3 bench/serve.py --url 127.0.0.1:18000 --grpc-url 127.0.0.1:18001 --scenario streams --device cuda \
    --streams 256 --chunk-interval-ms 100 --paced-seconds 8 --clients 6 2>&1 | tee -a "$OUT/cprofile_load.log"
  kill -TERM $spid; wait $spid
  python3 -c "
import pstats, sys
for key in ('tottime', 'cumtime'):
    pstats.Stats('$OUT/engine.prof', stream=sys.stdout).sort_stats(key).print_stats(60)" > "$OUT/engine_prof.txt" 2>&1
  timeout 120 python3 bench/engine_process.py 2>&1 | tee "$OUT/engine_process.log"
fi
if [ "$what" = engines ]; then
  # one and two engine processes (rnnserve serve --engines), alternately, twice, on this host: requests at
  # concurrency 1 and 64, batching on and off, binary HTTP and gRPC
  for round in 1 2; do
    for e in 1 2; do
      echo "== round $round, --engines $e" | tee -a "$OUT/engines_ab.log"
      timeout 150 python3 bench/serve.py --device cuda --frontends ${FRONTENDS:-8} --engines $e --scenario requests \
        --protocols ${PROTOS:-http-binary,grpc} --concurrency 1,64 2>&1 | tee -a "$OUT/engines_ab.log" || rc=1
    done
  done
fi
if [ "$what" = stalls ]; then
  # 256 paced streams twice against one server whose warnings (slow garbage collections, blocked event
  # loops, with timestamps and front-end pids) go to stalls_server.log; stalls_times.log: when each pass ended
  profile_repository
  python3 -m service.cli serve --repository /tmp/prepo --host 127.0.0.1 --http-port 18000 --grpc-port 18001 \
    --device cuda --frontends ${FRONTENDS:-8} --engines ${ENGINES:-1} --log-level ${LOG_LEVEL:-info} > "$OUT/stalls_server.log" 2>&1 &
  spid=$!
  wait_ready
  date +%T.%N > "$OUT/stalls_times.log"
  for pass in 1 2; do
    python3 bench/serve.py --url 127.0.0.1:18000 --grpc-url 127.0.0.1:18001 --scenario streams --device cuda \
      --streams 256 --chunk-interval-ms 100 --paced-seconds 6 --clients 6 2>&1 | tail -3 | tee -a "$OUT/stalls_load.log"
    date +%T.%N >> "$OUT/stalls_times.log"
  done
  kill -TERM $spid; wait $spid
  echo "slow collections: $(grep -c 'paused this process' "$OUT/stalls_server.log"), blocked loops: $(grep -c 'blocked for' "$OUT/stalls_server.log"), CUDA graph captures: $(grep -c 'captured a CUDA graph' "$OUT/stalls_server.log")"
fi
exit $rc
