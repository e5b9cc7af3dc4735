#!/bin/bash
# Run 6, one call of at most ~570 s on the lent card, in bench/NOTES.md's "Next GPU run" order: issue 54's e2e
# (sync_ce arm, noise rule) and sync overlap (copy-engine rows), issue 53's GIF program sweep, issue 54's
# supervised-token masks, then the GPU tests (-n 8; failures rerun alone). Every stage under its own timeout;
# everything lands in /tmp/r6, packed into $OUT/r6.tgz at the end (more than 8 files come back only as an archive).
set -u
R=/tmp/r6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext HK_FAILURE_LOG=$R/failures.log
pack() { tar czf $OUT/r6.tgz -C /tmp r6; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
stage() { local name=$1 t=$2; shift 2; echo "=== $name (budget $t s) $(date +%T)"; local t0=$SECONDS
  timeout -k 5 $t "$@" > $R/$name.log 2>&1; local rc=$?; tail -n ${TAILN:-25} $R/$name.log
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
( python3 -c "from humanline_kernels.sync._copy import load_extension as l; print('csrc extension:', l())" > $R/ext.log 2>&1 & )
TAILN=45 stage e2e ${E_T:-140} python3 -m bench e2e --out $R/e2e
cat $R/ext.log
TAILN=30 stage sync ${S_T:-60} python3 -m bench sync --skip fsdp2 --out $R/sync
TAILN=14 stage gif ${G_T:-55} python3 -m bench logits --vocab 128256 --only grad_in_fwd --gif-programs 33 66 99 --out $R/gif
TAILN=30 stage masks ${M_T:-95} python3 -m bench linear --ignored 0 50 75 --out $R/masks
TAILN=30 stage gputests ${T_T:-130} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -n 8 tests
F=$(grep -oE '^FAILED [^ ]+' $R/gputests.log | cut -d' ' -f2 | sort -u)
[ -n "$F" ] && TAILN=30 stage rerun ${R_T:-45} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu $F
exit 0
