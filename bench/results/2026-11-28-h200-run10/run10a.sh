#!/bin/bash
# Run 10, first call (2026-11-28, twenty-seventh session, an H200; bench/NOTES.md "Run 10 predictions"): issue 54's
# e2e gap on the H200 (every humanline arm ~1.03x offline_ref in run 9, lookahead too): e2e_gap.py (each difference
# taken away), e2e_profile.py (kernel families of offline_ref and lookahead steps), the sync's GPU tests, then
# `bench sync` with the drift row. Results: $OUT/r10a.tgz. Call B (run10b.sh): the whole suite.
. bench/probes/call.sh r10a
python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__, torch.cuda.get_device_name())" | tee $R/versions.txt
TAILN=14 run e2e_gap 200 python3 bench/probes/e2e_gap.py
TAILN=45 run e2e_profile 100 python3 bench/probes/e2e_profile.py $R
TAILN=10 run gputests_sync 90 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_sync_gpu.py
TAILN=16 run sync 110 python3 -m bench sync --skip copy fsdp2 --out $R
exit 0
