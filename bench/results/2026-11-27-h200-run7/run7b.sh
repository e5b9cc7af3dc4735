#!/bin/bash
# Run 7, second call (what the first left: ~400 s of device time): the copy engines built into the sync
# (csrc multi_tensor_copy_engine: one cudaMemcpyBatchAsync hinted to overlap with compute), checked and measured.
# The probe again with its spin calibrated outside any timed window, the GPU tests of the sync's copy, bench sync's
# overlap rows (kernel, batched copy engines, copy_ per tensor), then bench e2e (sync and sync_ce against offline_ref).
set -u
R=/tmp/r7b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r7b.tgz -C /tmp r7b; }
trap pack EXIT
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; }
run ext 150 python3 -c "from humanline_kernels.sync._copy import load_extension as l; e = l(); print('extension:', e, hasattr(e, 'multi_tensor_copy_engine'))"
TAILN=12 run ce_probe 60 python3 bench/results/2026-11-27-h200-run7/ce_probe.py $R
TAILN=8 run gputests 90 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_sync_kernel.py tests/test_sync_gpu.py
TAILN=12 run sync 80 python3 -m bench sync --skip copy fsdp2 --out $R/sync
TAILN=45 run e2e $((310 - SECONDS)) python3 -m bench e2e --arms offline offline_ref sync sync_ce lookahead --out $R/e2e
exit 0
