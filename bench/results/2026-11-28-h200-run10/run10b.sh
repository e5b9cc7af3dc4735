#!/bin/bash
# Run 10, second call on the same warm machine: README's whole suite (issue 54 target 4), as run 6's run6b.sh runs
# it (-n 14, failure log), killed at S_T seconds so that its log comes back. Results: $OUT/r6b.tgz.
S_T=${S_T:-400} bash bench/results/2026-11-27-h100-run6/run6b.sh
