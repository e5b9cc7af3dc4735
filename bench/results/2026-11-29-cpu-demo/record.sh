#!/bin/bash
# The demo's record, remade from a clean checkout (run from anywhere; the repository is three folders up): the
# default runs; KTO's clamp alone (the reference never synced after the first step) and sync alone (a band that
# clamps nothing); GRPO without the clamp; then the default runs again with ATen's AVX2 and DEFAULT kernels, the
# stand-ins for another CPU's rounding that README's table needs before it calls a comparison. Load averages are
# logged: a shared machine's wall times mean little, each run's CPU time (cpu_s in the record) more.
set -u
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=$PWD
D=bench/results/2026-11-29-cpu-demo
R=$D/demo.json
rm -f $R $D/demo-*.png
{
echo "+ git rev-parse --short=12 HEAD: $(git rev-parse --short=12 HEAD); git status --porcelain --untracked-files=no: '$(git status --porcelain --untracked-files=no)'"
echo "+ $(grep -m1 'model name' /proc/cpuinfo); $(grep -m1 'cpu family' /proc/cpuinfo); $(grep -m1 '^model\s' /proc/cpuinfo); nproc $(nproc)"
run() {
  echo; echo "+ uptime: $(uptime)"; echo "+ $*"
  ( time "$@" ) 2>&1
  echo "+ uptime: $(uptime)"
}
run python -m humanline_kernels.demo --objective all --save $R --markdown --quiet
run python -m humanline_kernels.demo --objective kto --sync-every 1000 --save $R --markdown --quiet --no-plot
run python -m humanline_kernels.demo --objective kto --log-eps-p -100 --log-eps-r 100 --save $R --markdown --quiet --no-plot
run python -m humanline_kernels.demo --objective grpo --log-eps-p -100 --log-eps-r 100 --save $R --markdown --quiet --no-plot
export ATEN_CPU_CAPABILITY=avx2
run python -m humanline_kernels.demo --objective all --save $R --markdown --quiet --no-plot
export ATEN_CPU_CAPABILITY=default
run python -m humanline_kernels.demo --objective all --save $R --markdown --quiet --no-plot
echo "+ done $(date -u)"
} > $D/run.log 2>&1
