#!/usr/bin/env bash
# The tuned table's "grad_in_forward" entries (issue 91, target 3) from committed bench logits records; no GPU
# needed. Run from the repository root. The H200: runs 9 and 11, the newest records of the present kernels there.
# The H100: run 5, where the present kernels ran beside the then default under the name hk.fused[fold].
set -euo pipefail
out=bench/results/2026-11-29-grad-in-forward-table
python -m bench tune --from-logits bench/results/2026-11-28-h200-run9/logits.json \
    bench/results/2026-11-28-h200-run11/logits.json --out "$out/h200" --write
python -m bench tune --from-logits bench/results/2026-11-27-h100/logits.json --arm "hk.fused[fold]" \
    --out "$out/h100" --write
cp humanline_kernels/ops/tuned.json "$out/tuned.json"
