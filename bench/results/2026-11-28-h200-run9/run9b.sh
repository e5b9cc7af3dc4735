#!/bin/bash
# Run 9, second call (bench/NOTES.md "Run 9, prepared without a GPU"), ~330 s estimated (~200 s without quack), on
# the same warm machine as call A: issue 54 target 3, the sync paced through the step (ReferenceSyncer(slices=...)):
# bench sync's overlap rows (the paced rows beside the at-once ones) and e2e with the sync_paced arm (canonical
# names: sync_overlap.json, e2e.json); then issue 53's quack rows (carry .whl and .whlq2).
. bench/probes/call.sh r9b
TAILN=14 run sync 100 python3 -m bench sync --skip copy fsdp2 --out $R
TAILN=45 run e2e 220 python3 -m bench e2e --arms offline offline_ref sync sync_ce sync_paced lookahead --steps 25 --out $R
# issue 53: quack (CuTe DSL) beside ours and Liger at target 2's vocabularies. Its CUDA-13 libraries (a 92 MB wheel,
# over one call's carry) came as an xz tar in two halves: call A left the first in /tmp/q, this call carries the
# second with the small wheels (carry .whlq2). A --target install processes no .pth, so the DSL's package
# folder goes on PYTHONPATH by hand (nvidia_cutlass_dsl_packages.pth does that in a site-packages install).
Q=/tmp/siteq
if [ -f /tmp/q/cu13.tar.xz.part00 ] || [ -f .whlq1/cu13.tar.xz.part00 ]; then
  mkdir -p $Q
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $Q .whlq2/*.whl
  cat $( [ -f /tmp/q/cu13.tar.xz.part00 ] && echo /tmp/q/cu13.tar.xz.part00 || echo .whlq1/cu13.tar.xz.part00 ) \
    .whlq2/cu13.tar.xz.part01 | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" $Q
  export PYTHONPATH=/tmp/site:$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
  TAILN=6 run quack_import 60 python3 -c "import cutlass, quack, quack.cross_entropy; print('quack', quack.__version__ if hasattr(quack, '__version__') else '?', 'cutlass', cutlass.__file__)"
  TAILN=30 run logits_quack 170 python3 -m bench logits --vocab 128256 151936 \
    --only quack liger "hk.fused.grpo(grad_in_fwd)" "hk.token_logprobs" --out $R/quack
else
  echo "=== quack skipped: the first half (call A) is not on this machine"
fi
exit 0
