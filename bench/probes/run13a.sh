#!/bin/bash
# Run 13, first call (prepared 2026-11-29 without a device; bench/NOTES.md "Next GPU run: the cluster kernel"),
# ~530 s typical on an H200 with run 12a's stages, ~200 s without (timeout_s 590; carry .whl, and .whlq1 for
# quack in call B): issue 91.
#   1. run12a.sh's stages (e2e at lr 1e-7, bench linear in rounds), unless `--skip-12a` (run 12a has run);
#   2. the cluster kernel's GPU tests (tests/ops/test_gif_cluster.py: against hk.reference, every option; NVRTC builds
#      it at first use from the image's torch wheels), then bench gpu's parity rows on it (N = 8192, V = 128256);
#   3. bench logits: GRPO with the gradient in the forward, Triton and the cluster kernel at each configuration,
#      beside the default 3-pass path and Liger's triton_grpo_loss, at V = 128256, 151936, 32000.
# quack's CUDA-13 libraries (over one call's carry) travel as in run 9: this call leaves the first half in /tmp/q,
# run13b.sh (the next call, carry .whl and .whlq2, same warm machine) joins them and times quack beside the
# cluster kernel. Canonical names under $OUT/r13a.tgz (logits.json) for `python -m bench report`.
. bench/probes/call.sh r13a
mkdir -p /tmp/q && cp .whlq1/cu13.tar.xz.part00 /tmp/q/ 2>/dev/null || echo "no .whlq1: quack needs it in a call before run13b.sh"
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee $R/versions.txt
if [ "${1:-}" != "--skip-12a" ]; then
  TAILN=16 run e2e_gap_lr1e-7 170 python3 bench/probes/e2e_gap.py --lr 1e-7
  TAILN=25 run linear 130 python3 -m bench linear --out $R
  TAILN=24 run masks 150 python3 -m bench linear --ignored 0 50 --out $R
fi
TAILN=25 run gputests_cluster 100 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/ops/test_gif_cluster.py
TAILN=30 run parity_cluster 100 python3 -c "
import json, sys
from bench.bench_gpu import parity
rows = parity(8192, 128256, 4096, only=['cluster', 'fused.grpo grad_in_forward clip', 'fused.grpo grad_in_forward noclip'])
json.dump(rows, open('$R/parity_cluster.json', 'w'), indent=1)
print(sum(r['ok'] for r in rows), '/', len(rows), 'within tolerance')
sys.exit(0 if rows and all(r['ok'] for r in rows) else 1)"
TAILN=70 run logits 120 python3 -m bench logits --vocab 128256 151936 32000 \
  --only "grad_in_fwd" "hk.fused.grpo" "liger triton_grpo_loss" --out $R
exit 0
