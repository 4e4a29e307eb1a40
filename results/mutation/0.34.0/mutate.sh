# Device run of make mutate on the device's CPUs for the vLLM 0.34.0 series
# (the GPU is not used). Usage: bash build/devprobe/mutate034.sh JOBS SECONDS [eval.mutate args]
REPO=$PWD
JOBS=${1:-12}; SECS=${2:-450}; shift 2
python3 -c "import sys; sys.path.insert(0, 'build/gpu-bundle'); import run; run.install()" || exit 1
mkdir -p .venv/lib/python3.12 && ln -sfn /tmp/k3-sppp-gpu/site .venv/lib/python3.12/site-packages
printf 'home = /usr/bin\nversion = 3.12.3\n' > .venv/pyvenv.cfg
export CUDA_VISIBLE_DEVICES= PYTHONPATH=$REPO/build/devprobe:/tmp/k3-sppp-gpu/site:$REPO K3_PROBE_STANDINS=1 K3_PROBE_REPO=$REPO VLLM_TARGET_DEVICE=cpu PYTHONUNBUFFERED=1
start=$SECONDS
python3 -m compileall -q -j 16 /tmp/k3-sppp-gpu/site/vllm > /dev/null 2>&1
echo "compileall: $((SECONDS - start)) s"
mkdir -p build/mutate results/mutation/0.34.0
cp build/devprobe/calls.json build/mutate/ 2>/dev/null
cp build/devprobe/mutants.jsonl results/mutation/0.34.0/ 2>/dev/null
python3 --version; python3 -c "import torch; print('torch', torch.__version__)"; nproc
timeout -s INT $SECS python3 -m eval.mutate --target /tmp/k3-sppp-gpu/site --results results/mutation/0.34.0 --jobs $JOBS "$@" 2>&1 \
  | grep -v "stand-in\]" | tee $OUT/mutate.log | grep -E "^mutate|killed|survived|Error|error" | tail -60
echo "total: $((SECONDS - start)) s"
cp results/mutation/0.34.0/mutants.jsonl results/mutation/0.34.0/summary.md $OUT/ 2>/dev/null
cp build/mutate/calls.json $OUT/ 2>/dev/null
ls -la $OUT
