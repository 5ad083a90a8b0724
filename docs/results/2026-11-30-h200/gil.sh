#!/bin/bash
# 2026-11-30, nvidia-h200 (device tool), carrying .whl/: is the service's GPU thread slowed by the
# GIL? `eg2 serve` on the full random checkpoint under bench_scale's two loads, with Python's GIL
# switch interval at its default (5 ms) and at 0.5 ms (set by a sitecustomize on PYTHONPATH, for
# this experiment only), and with 1 preprocessing thread instead of the default. Writes $OUT/gil-*.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date -u
python3 -m app.cli demo-model /tmp/full --size full >/dev/null
mkdir -p /tmp/si && cat > /tmp/si/sitecustomize.py <<'PY'
import os, sys
if os.environ.get("GIL_SWITCH_S"):
    sys.setswitchinterval(float(os.environ["GIL_SWITCH_S"]))
PY
run() {  # $1: name; the rest: environment
  name=$1; shift
  echo "== $name"
  env "$@" python3 -m app.bench_scale --model /tmp/full --phases "${PHASES:-serve}" --seconds 6 \
    --out "$OUT/gil-$name" 2>&1 | grep -E "^(inprocess|serve|  single|  batch32)"
}
PHASES=inprocess,serve run base
run si05 PYTHONPATH=/tmp/si:$PYTHONPATH GIL_SWITCH_S=0.0005
run w1 EG2_PREPROCESS_WORKERS=1
run si05w1 PYTHONPATH=/tmp/si:$PYTHONPATH GIL_SWITCH_S=0.0005 EG2_PREPROCESS_WORKERS=1
date -u
