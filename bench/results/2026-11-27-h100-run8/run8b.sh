#!/bin/bash
# Run 8, second call (bench/NOTES.md "Run 8, call 2 predictions"; not run: loans were paused after call 1, so it
# is the next session's first call, on either card): issue 53's persistent-grid shapes after call 1's ncu (the
# sweeps pipelined through cp.async: HK_GIF_STAGES, HK_GIF_GRAD_STAGES), ncu of the 3/3-stage variant and its
# GPU test, issue 54's
# pacing probe (a copy spread over the GEMMs against one issued at once), then the sync's GPU tests with the copy
# engines now the default for same-dtype groups; graph_gap.py (is KTO's gap the host's?) (~400 s in all, estimated).
set -u
R=/tmp/r8b; mkdir -p $R
D=bench/results/2026-11-27-h100-run8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/r8b.tgz -C /tmp r8b; }
trap pack EXIT
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; pack; }
TAILN=30 run gif_sweep 180 python3 $D/gif_sweep.py $R
TAILN=8 run gputests_sync 70 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_sync_kernel.py tests/test_sync_gpu.py
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
TAILN=0 run ncu_gif3 50 env HK_GIF_STAGES=3 HK_GIF_GRAD_STAGES=3 $NCU --clock-control none --kernel-name regex:_grpo_loss_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum \
  python3 $D/gif_ncu.py gif
grep -E "dram__|lts__|Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|Registers|Dynamic Shared" $R/ncu_gif3.log
TAILN=10 run graph_gap 80 python3 $D/graph_gap.py $R
TAILN=8 run pace 60 python3 $D/pace_probe.py $R
TAILN=6 run gputest_fold3 80 env HK_GIF_STAGES=3 HK_GIF_GRAD_STAGES=3 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_fold.py
exit 0
