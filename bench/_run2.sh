set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=torch
timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -15 > $OUT/gpu_tests.log
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/streams_ab2.log
for round in 1 2; do
  for side in new mid old; do
    echo "== round $round $side" >> $OUT/streams_ab2.log
    case $side in new) d=.;; mid) d=ab_mid;; old) d=ab_old;; esac
    (cd $d && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 bench/serve.py --device cuda --frontends 6 --scenario streams --streams 256 --chunk-interval-ms 100 --paced-seconds 5) 2>&1 | grep -E "^\| (stateful|stateless)" >> $OUT/streams_ab2.log
  done
done
