#!/bin/bash
# Run 8, fourth call (the H200 again): each kernel's own time for fused.dpo and fused.kto (kernel_times.py).
set -u
R=/tmp/r8d; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout -k 5 90 python3 bench/results/2026-11-27-h100-run8/kernel_times.py $R 2>&1 | tee $R/kernel_times.log | tail -8
tar czf $OUT/r8d.tgz -C /tmp r8d
