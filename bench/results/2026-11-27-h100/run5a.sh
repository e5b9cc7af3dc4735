#!/bin/bash
# Run 5 (issue 54's e2e first, then issue 53's fold check, issue 52's CUDA fuzz, issue 53's logits rows):
# one call of at most ~570 s on the lent card. Every stage under its own timeout; everything lands in /tmp/r,
# packed into $OUT/r.tgz at the end (more than 8 files come back only as an archive).
set -u
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext HK_FAILURE_LOG=$R/failures.log
pack() { tar czf $OUT/r.tgz -C /tmp r; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
stage() { local name=$1 t=$2; shift 2; echo "=== $name (budget $t s) $(date +%T)"; local t0=$SECONDS
  timeout -k 5 $t "$@" > $R/$name.log 2>&1; local rc=$?; tail -n ${TAILN:-25} $R/$name.log
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
# the sync copy kernel's JIT build (nvcc, CPU only) beside the first e2e arms, so the sync arm finds it built
( python3 -c "from humanline_kernels.sync._copy import load_extension as l; print('csrc extension:', l())" > $R/ext.log 2>&1 & )
TAILN=40 stage e2e 200 python3 -m bench e2e --out $R/e2e
cat $R/ext.log
stage fold 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fold.py
HK_FUZZ_EXAMPLES=100 HK_FUZZ_SANITIZER_EXAMPLES=4 stage fuzz 150 \
  python3 -m pytest -q -p no:cacheprovider -s -rs -m gpu tests/test_fuzz.py::test_fuzz_public_api_cuda
TAILN=70 stage logits 140 python3 -m bench logits --vocab 128256 151936 32000 --out $R/logits
