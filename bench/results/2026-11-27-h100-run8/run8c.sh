#!/bin/bash
# Run 8, third call (an H200; bench/NOTES.md "Run 8, call 2 ran after all ... call 3"): is KTO's gap on the H200
# host time (graph_gap.py), does pacing the sync's copy hide more (pace_probe.py), what a copy costs GEMMs on this
# card (clock_probe.py), and bench sync's overlap rows with the copy engines as the default.
set -u
R=/tmp/r8c; mkdir -p $R
D=bench/results/2026-11-27-h100-run8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r8c.tgz -C /tmp r8c; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; pack; }
TAILN=10 run graph_gap 70 python3 $D/graph_gap.py $R
TAILN=8 run pace 60 python3 $D/pace_probe.py $R
TAILN=6 run clock 60 python3 $D/clock_probe.py $R
TAILN=10 run sync 80 python3 -m bench sync --skip copy fsdp2 --out $R/sync
exit 0
