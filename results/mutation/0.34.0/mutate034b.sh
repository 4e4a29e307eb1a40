# As mutate034.sh, but the results and the call map are written under $OUT
# as they are decided, so a run cut off by the device's limit keeps them.
# Usage: bash build/devprobe/mutate034b.sh JOBS SECONDS [eval.mutate args]
REPO=$PWD
JOBS=${1:-12}; SECS=${2:-450}; shift 2
python3 -c "import sys; sys.path.insert(0, 'build/gpu-bundle'); import run; run.install()" || exit 1
mkdir -p .venv/lib/python3.12 && ln -sfn /tmp/k3-sppp-gpu/site .venv/lib/python3.12/site-packages
printf 'home = /usr/bin\nversion = 3.12.3\n' > .venv/pyvenv.cfg
export CUDA_VISIBLE_DEVICES= PYTHONPATH=$REPO/build/devprobe:/tmp/k3-sppp-gpu/site:$REPO K3_PROBE_STANDINS=1 K3_PROBE_REPO=$REPO VLLM_TARGET_DEVICE=cpu PYTHONUNBUFFERED=1
start=$SECONDS
python3 -m compileall -q -j 16 /tmp/k3-sppp-gpu/site/vllm > /dev/null 2>&1
echo "compileall: $((SECONDS - start)) s"
mkdir -p build/mutate $OUT/res
cp build/devprobe/calls.json build/mutate/ 2>/dev/null
cp build/devprobe/mutants.jsonl $OUT/res/
cp results/mutation/0.34.0/equivalent.json $OUT/res/ 2>/dev/null
( while sleep 15; do cp build/mutate/calls.json $OUT/calls.json 2>/dev/null; done ) &
python3 --version; nproc
timeout -s INT $SECS python3 -m eval.mutate --target /tmp/k3-sppp-gpu/site --results $OUT/res --jobs $JOBS "$@" 2>&1 \
  | grep -v "stand-in\]" | tee $OUT/mutate.log | grep -E "^mutate|killed|survived|Error|error" | tail -40
echo "total: $((SECONDS - start)) s"
cp build/mutate/calls.json $OUT/ 2>/dev/null
ls -la $OUT $OUT/res
