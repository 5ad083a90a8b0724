#!/bin/bash
# 2026-11-30, nvidia-h200 (device tool), carrying .whl/: the full `eg2 bench`, then bench_scale's
# in-process and `eg2 serve` phases. Writes $OUT/bench.tgz.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date -u; mkdir -p /tmp/res
python3 -m app.cli bench --out /tmp/res/bench 2>&1 | tail -45
date -u
python3 -m app.cli demo-model /tmp/full --size full >/dev/null
timeout 150 python3 -m app.bench_scale --model /tmp/full --phases inprocess,serve --seconds 6 --out /tmp/res/scale 2>&1 \
  | grep -E "^(inprocess|serve|  single|  batch32)"
date -u
tar czf $OUT/bench.tgz -C /tmp/res .
