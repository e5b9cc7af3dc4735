#!/bin/bash
# Run 9, first call (prepared 2026-11-28 without a GPU; bench/NOTES.md "Run 9, prepared without a GPU"), ~310 s
# estimated on either card: issue 53 target 2 (gif_split.py: the row split over a group of programs; gif_cluster.py:
# the row held by a thread-block cluster), target 1 (the fold's register budget: bench logits at three V, then the
# fused rows again under the old budget, HK_FOLD_ROW_WARPS_PER_SM=4),
# and the sync's GPU tests with slices. Results under $OUT/r9a.tgz; canonical names (logits.json at the top) so that
# `python -m bench report` finds them once unpacked into bench/results/<date>-<card>-run9/.
. bench/probes/call.sh r9a
# quack's CUDA-13 libraries travel in two halves (bench/NOTES.md, "How the runs were made"): this call carries the
# first (carry .whlq1), kept on the warm machine for run9b.sh
mkdir -p /tmp/q && cp .whlq1/cu13.tar.xz.part00 /tmp/q/ 2>/dev/null || echo "no .whlq1: quack will not run in call B"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
TAILN=40 run gif_split 180 python3 bench/probes/gif_split.py $R
TAILN=30 run gif_cluster 90 python3 bench/probes/gif_cluster.py $R
TAILN=60 run logits 130 python3 -m bench logits --vocab 128256 151936 32000 --out $R
TAILN=20 run logits_oldbudget 80 env HK_FOLD_ROW_WARPS_PER_SM=4 python3 -m bench logits --vocab 128256 151936 \
  --only "hk.fused.grpo" "hk.fused.dpo" "hk.fused.kto" --out $R/oldbudget
TAILN=8 run gputests_sync 70 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_sync_gpu.py
exit 0
