#!/bin/bash
# 2026-11-30, nvidia-h200 (device tool), carrying .whl/: the full `eg2 bench`, then bench_scale's
# in-process and `eg2 serve` phases. Writes $OUT/bench.tgz.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null
mkdir -p /tmp/res
python3 -m app.cli bench --out /tmp/res/bench 2>&1 | tail -45
date -u
tar czf $OUT/bench.tgz -C /tmp/res .
