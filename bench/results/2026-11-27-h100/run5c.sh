#!/bin/bash
# Run 5, third call: after the first two calls' surprises. e2e with offline repeated (the run-to-run noise of the
# step-2 loss), the fold's GPU test against float64 and its CUDA-graph capture, the CUDA fuzz with a memcheck
# sample of kernel-launching cases, then the host cost of one call with the fold selected.
set -u
R=/tmp/r5c; mkdir -p $R
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext HK_FAILURE_LOG=$R/failures.log
pack() { tar czf $OUT/r5c.tgz -C /tmp r5c; }
trap pack EXIT
stage() { local name=$1 t=$2; shift 2; echo "=== $name (budget $t s) $(date +%T)"; local t0=$SECONDS
  timeout -k 5 $t "$@" > $R/$name.log 2>&1; local rc=$?; tail -n ${TAILN:-25} $R/$name.log
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAILN=32 stage e2e 110 python3 -m bench e2e --out $R/e2e
TAILN=50 stage fold 70 python3 -m pytest -q -p no:cacheprovider -s -m gpu tests/test_fold.py
HK_FOLD_FINALIZE=1 TAILN=6 stage graph_fold 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k cuda_graph
HK_FUZZ_EXAMPLES=150 HK_FUZZ_SANITIZER_EXAMPLES=24 TAILN=12 stage fuzz 130 \
  python3 -m pytest -q -p no:cacheprovider -s -rs -m gpu tests/test_fuzz.py::test_fuzz_public_api_cuda
HK_FOLD_FINALIZE=1 stage host_fold 50 python3 -m bench host --out $R/host_fold
