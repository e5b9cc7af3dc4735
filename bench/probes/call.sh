# Sourced by a device call's script (run9a.sh, run9b.sh): `. bench/probes/call.sh NAME`. Installs the carried
# wheels (.whl) into /tmp/site, collects the call's files in /tmp/NAME and packs them into $OUT/NAME.tgz at exit
# and after each stage; `run STAGE SECONDS CMD ...` runs one stage under a time limit into /tmp/NAME/STAGE.log and
# prints its status and the last TAILN lines (a stage that fails or times out does not stop the call).
set -u
CALL=$1 R=/tmp/$1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
pack() { tar czf $OUT/$CALL.tgz -C /tmp $CALL; }
trap pack EXIT
nvidia-smi > $R/nvsmi.txt 2>&1
run() { local name=$1 t=$2; shift 2; local t0=$SECONDS; timeout -k 5 $t "$@" > $R/$name.log 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n ${TAILN:-20} $R/$name.log; pack; }
