#!/bin/bash
# Run 9, second call (bench/NOTES.md "Run 9 predictions"), ~280 s estimated, on the same warm machine: issue 54
# target 3, the sync paced through the step (ReferenceSyncer(slices=...)): bench sync's overlap rows (the paced
# rows beside the at-once ones) and e2e with the sync_paced arm. Canonical names (sync_overlap.json, e2e.json).
set -u
R=/tmp/r9b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r9b.tgz -C /tmp r9b; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; pack; }
TAILN=14 run sync 100 python3 -m bench sync --skip copy fsdp2 --out $R
TAILN=45 run e2e 200 python3 -m bench e2e --arms offline offline_ref sync sync_ce sync_paced lookahead --out $R
exit 0
