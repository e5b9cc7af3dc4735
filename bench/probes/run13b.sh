#!/bin/bash
# Run 13, second call (bench/NOTES.md "Next GPU run: the cluster kernel"), ~210 s, on the machine run13a.sh left
# warm (carry .whl and .whlq2): quack's one-pass cross_entropy_fwd(return_dx) beside the cluster kernel and Triton's
# gradient in the forward in the same call (issue 91's target 2 compares them in one run), at V = 128256, 151936,
# 32000. The quack install is run9b.sh's (the halves joined, the DSL's package folder on PYTHONPATH by hand).
. bench/probes/call.sh r13b
Q=/tmp/siteq
if [ -f /tmp/q/cu13.tar.xz.part00 ] && [ -f .whlq2/cu13.tar.xz.part01 ]; then
  mkdir -p $Q
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $Q .whlq2/*.whl
  cat /tmp/q/cu13.tar.xz.part00 .whlq2/cu13.tar.xz.part01 \
    | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" $Q
  export PYTHONPATH=/tmp/site:$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
  TAILN=6 run quack_import 60 python3 -c "import cutlass, quack, quack.cross_entropy; print('quack ok')"
else
  echo "=== quack not installed: the first half (run13a.sh) or the second (.whlq2) is missing"
fi
TAILN=50 run logits_quack 150 python3 -m bench logits --vocab 128256 151936 32000 \
  --only quack "grad_in_fwd" "liger triton_grpo_loss" --out $R/quack
# issue 91's target 3 on this card: the default path, the Triton kernel and each cluster configuration, timed
# against each other; $R/tune/tuned.json is the table with this card's "grad_in_forward" entries
TAILN=30 run tune_paths 120 python3 -m bench tune --family grad_in_forward --out $R/tune
exit 0
