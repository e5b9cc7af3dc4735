#!/bin/bash
# Run 7, one call of at most ~590 s, meant for an H200 (bench/NOTES.md "Next GPU run (after run 6)", nsys being
# absent from the image): issue 54's copy-engine probe, issue 53's tune on this card (written into the package's
# table, so that the logits run that follows uses it) and logits at three vocabularies with Liger beside, then the
# whole suite last and bounded (run6b.sh, with what is left of the call).
set -u
R=/tmp/r7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r7.tgz -C /tmp r7; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; }
TAILN=40 run ce_probe 70 python3 bench/results/2026-11-27-h200-run7/ce_probe.py $R
TAILN=8 run tune 100 python3 -m bench tune --write --out $R/tune
cp humanline_kernels/ops/tuned.json $R/tuned_in_package.json
TAILN=60 run logits 120 python3 -m bench logits --vocab 32000 128256 151936 --out $R/logits
pack
rem=$((575 - SECONDS)); [ $rem -gt 420 ] && rem=420
echo "=== suite with $rem s"
S_T=$rem bash bench/results/2026-11-27-h100-run6/run6b.sh
exit 0
