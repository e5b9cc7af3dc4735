#!/bin/bash
# Run 12, one call (prepared 2026-11-28 after run 11; bench/NOTES.md "Next GPU run (after run 11)"), ~330 s on an
# H200 (timeout_s 540; carry .whl): issue 54's e2e gap with every arm on theta_0's data (lr 1e-7: no bf16 weight
# moves), then bench linear dense and at 50 % ignored timed in interleaved rounds (target 2's time half; runs 3-11
# timed one call a row). Canonical names under $OUT/r12a.tgz (linear.json, linear_masks.json) for `bench report`.
. bench/probes/call.sh r12a
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
TAILN=16 run e2e_gap_lr1e-7 170 python3 bench/probes/e2e_gap.py --lr 1e-7
TAILN=25 run linear 130 python3 -m bench linear --out $R
TAILN=24 run masks 170 python3 -m bench linear --ignored 0 50 --out $R
exit 0
