# The serve command of the upstream pull request (vllm#54347), verbatim:
# the reference tests/eval/test_serve.py reproduces for every arm and rank.
export MODEL=/path/to/Kimi-K3
export MASTER_ADDR=<rank-0-host>
export HOST_IP=<this-host>
export NODE_RANK=<0-or-1>
export HEADLESS=<empty-or---headless>

PYTHONPATH=/path/to/DeepGEMM \
VLLM_HOST_IP="$HOST_IP" \
VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT=1 \
VLLM_KIMI_K3_GEMM_RS=1 \
VLLM_USE_RUST_FRONTEND=1 \
VLLM_USE_V2_MODEL_RUNNER=1 \
vllm serve "$MODEL" \
  --served-model-name Kimi-K3 \
  --trust-remote-code \
  --max-model-len 1048576 \
  --gpu-memory-utilization 0.84 \
  --load-format fastsafetensors \
  --kv-cache-dtype fp8 \
  --attention-config '{"use_prefill_query_quantization":true,"mla_prefill_backend":"flashinfer"}' \
  --no-disable-hybrid-kv-cache-manager \
  --no-enable-flashinfer-autotune \
  --host 0.0.0.0 \
  --port 8691 \
  --tensor-parallel-size 8 \
  --pipeline-parallel-size 2 \
  --nnodes 2 \
  --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" \
  --master-port 29991 \
  --distributed-executor-backend mp \
  --enable-expert-parallel \
  --all2all-backend deepep_v2 \
  --decode-context-parallel-size 1 \
  --dcp-comm-backend a2a \
  --no-enable-prefix-caching \
  --max-num-seqs 128 \
  --max-num-batched-tokens 32768 \
  --max-cudagraph-capture-size 128 \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --kernel-config '{"moe_backend":"deep_gemm_mega_moe"}' \
  $HEADLESS
