#!/bin/bash
# Run 5, second call (only if the first leaves time on a warm machine): parity at the real shape, then fused
# linear (the dW-in-the-weight's-dtype change, never timed) against the GEMM floor and the peers.
set -u
R=/tmp/r5b; mkdir -p $R
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r5b.tgz -C /tmp r5b; }
trap pack EXIT
stage() { local name=$1 t=$2; shift 2; echo "=== $name (budget $t s) $(date +%T)"; local t0=$SECONDS
  timeout -k 5 $t "$@" > $R/$name.log 2>&1; local rc=$?; tail -n ${TAILN:-25} $R/$name.log
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAILN=45 stage parity ${P_T:-70} python3 -m bench gpu --skip tests demo host logits tune linear masks sync e2e --out $R/g
TAILN=40 stage linear ${L_T:-110} python3 -m bench linear --out $R/linear
