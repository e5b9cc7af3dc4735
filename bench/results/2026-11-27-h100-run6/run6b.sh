#!/bin/bash
# Run 6, second call: the whole suite on the GPU machine (issue 54 target 4), README's test command with the
# machine's workers (-n 14 in place of --maxprocesses 4), every result named as it happens (-v), every failure's
# traceback in failures.log, the suite killed at ${S_T:-350} s so that its log comes back.
set -u
R=/tmp/r6b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext HK_FAILURE_LOG=$R/failures.log
pack() { tar czf $OUT/r6b.tgz -C /tmp r6b; }
trap pack EXIT
t0=$SECONDS
timeout -k 5 ${S_T:-350} python3 -m pytest -v -rfEs -n 14 --dist loadfile --no-loadscope-reorder -p no:cacheprovider \
  --durations=40 tests > $R/suite.log 2>&1
echo "suite rc=$? in $((SECONDS - t0)) s"
grep -cE '(PASSED|FAILED|ERROR|SKIPPED) tests/' $R/suite.log
grep -E '(FAILED|ERROR) tests/' $R/suite.log | head -40
tail -n 60 $R/suite.log | grep -vE '(PASSED|SKIPPED) tests/'
exit 0
