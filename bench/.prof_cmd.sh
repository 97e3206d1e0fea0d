python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import sys; sys.path.insert(0, 'bench'); import serve, pathlib; r = pathlib.Path('/tmp/prepo'); serve.write_repository(r, 40, 128, 1); serve.write_stream_model(r, 40, 256, 2)"
python3 -m service.cli serve --repository /tmp/prepo --host 127.0.0.1 --http-port 18100 --grpc-port 18101 --device cuda --frontends 6 --log-level warning > $OUT/srv.log 2>&1 &
spid=$!
sleep 5
python3 -c "
import time, urllib.request
for _ in range(240):
    try:
        if urllib.request.urlopen('http://127.0.0.1:18100/v2/health/ready', timeout=2).status == 200: break
    except Exception: time.sleep(0.5)"
for run in 1:stateful 2:stateless 3:stateful; do mode=${run#*:}
  python3 bench/serve.py --url 127.0.0.1:18100 --grpc-url 127.0.0.1:18101 --scenario streams --device cuda --streams 256 --chunk-interval-ms 100 --paced-seconds 8 --clients 6 --stream-modes $mode 2>&1 | tail -1 | tee -a $OUT/prof_load.log &
  lpid=$!
  sleep 5
  /tmp/site/bin/py-spy record -p $spid -d 3 -r 500 --gil -f raw -o $OUT/gil_${run%%:*}_$mode.txt --nonblocking > /dev/null 2>&1
  wait $lpid
done
kill -TERM $spid; wait $spid
