#!/bin/bash
# Run 9, third call (2026-11-28, after run9a/run9b on an H200): why the paced-sync GPU test failed (pace_order.py,
# by copier and with eager module loading), what the clip costs at e2e's lm_head shape (clip_cost.py: every
# humanline e2e arm, lookahead too, was ~2.8 % over offline_ref), then every GPU-marked test. Results: $OUT/r9c.tgz.
. bench/probes/call.sh r9c
TAILN=12 run pace_kernel 40 python3 bench/probes/pace_order.py kernel
TAILN=12 run pace_foreach 40 python3 bench/probes/pace_order.py foreach
TAILN=12 run pace_eager 40 env CUDA_MODULE_LOADING=EAGER python3 bench/probes/pace_order.py kernel
TAILN=8 run clip_cost 70 python3 bench/probes/clip_cost.py
TAILN=25 run gputests 120 env HK_FAILURE_LOG=$R/failures.log python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu -n 8 tests
exit 0
