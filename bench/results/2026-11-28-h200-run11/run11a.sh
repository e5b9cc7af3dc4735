#!/bin/bash
# Run 11, one call (prepared 2026-11-28 without a device, after run 10; bench/NOTES.md "Next GPU run (after run
# 10)"), ~290 s typical on an H200, ~430 s on an H100 (timeout_s 570; carry .whl): issue 54's e2e gap (e2e_gap.py:
# each arm without transformers' mask sync, the lookahead without its mode switch, the SM clock and power of each
# arm), bench sync interleaved (target 3), bench linear dense and at 50 % ignored (target 2: never on the H200 since
# the dW change); on an H100 also issue 53's logits rows and the cluster probe. Canonical names under $OUT/r11a.tgz
# (linear.json, linear_masks.json, sync_overlap.json, logits.json) for `python -m bench report`.
. bench/probes/call.sh r11a
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
TAILN=20 run e2e_gap 240 python3 bench/probes/e2e_gap.py
TAILN=16 run sync 110 python3 -m bench sync --skip copy fsdp2 --out $R
TAILN=25 run linear 130 python3 -m bench linear --out $R
TAILN=12 run masks 120 python3 -m bench linear --ignored 0 50 --out $R
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
  *H100*) TAILN=60 run logits 130 python3 -m bench logits --vocab 128256 151936 32000 --out $R
          TAILN=30 run gif_cluster 90 python3 bench/probes/gif_cluster.py $R ;;
esac
exit 0
