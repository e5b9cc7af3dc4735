#!/bin/bash
# Run 8, fifth call (the H200): ncu of the folded forward kernels of fused.dpo and fused.kto (kto_ncu.py).
set -u
R=/tmp/r8e; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in dpo kto; do
  timeout -k 5 45 $NCU --clock-control none --kernel-name regex:"_(dpo|kto)_loss_kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg,smsp__inst_executed.sum \
    python3 bench/results/2026-11-27-h100-run8/kto_ncu.py $m > $R/ncu_$m.log 2>&1
  echo "== $m rc=$?"; grep -E "dram__|sm__cycles|inst_executed|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Theoretical Occ|Warp Cycles Per Issued|Executed Ipc" $R/ncu_$m.log
done
tar czf $OUT/r8e.tgz -C /tmp r8e
