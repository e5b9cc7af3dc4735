#!/usr/bin/env bash
# The tuned table's "grad_in_forward" entries for the H200 (issue 91, target 3), from the two committed bench logits
# records of the current kernels on that card (runs 9 and 11); no GPU needed. Run from the repository root.
set -euo pipefail
python -m bench tune --from-logits bench/results/2026-11-28-h200-run9/logits.json \
    bench/results/2026-11-28-h200-run11/logits.json --out bench/results/2026-11-29-grad-in-forward-table --write
