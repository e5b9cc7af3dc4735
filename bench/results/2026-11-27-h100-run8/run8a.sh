#!/bin/bash
# Run 8, first call (H100; bench/NOTES.md "Run 8 predictions"): issue 54's copy-engine decision on the card where
# per-tensor copy_ saved nothing (bench sync twice, e2e with five arms), a clock probe of why a copy that takes no
# SM costs GEMMs time, then issue 53: ncu on the gradient-in-forward kernel and a host profile of one call.
set -u
R=/tmp/r8a; mkdir -p $R
D=bench/results/2026-11-27-h100-run8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r8a.tgz -C /tmp r8a; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1; nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >> $R/nvsmi.txt 2>&1
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; }
run ext 120 python3 -c "from humanline_kernels.sync._copy import load_extension as l; e = l(); print('extension:', e, hasattr(e, 'multi_tensor_copy_engine'))"
TAILN=12 run sync1 80 python3 -m bench sync --skip copy fsdp2 --out $R/sync1
TAILN=12 run sync2 80 python3 -m bench sync --skip copy fsdp2 --out $R/sync2
TAILN=45 run e2e 170 python3 -m bench e2e --arms offline offline_ref sync sync_ce lookahead --out $R/e2e
pack
TAILN=8 run clock 80 python3 $D/clock_probe.py $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
TAILN=70 run ncu_gif 100 $NCU --clock-control none --kernel-name regex:_grpo_loss_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum \
  python3 $D/gif_ncu.py gif
TAILN=40 run host_profile 90 python3 $D/host_profile.py $R
exit 0
