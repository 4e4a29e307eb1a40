# The prefill sweep of the upstream pull request (vllm#54347), verbatim:
# the reference tests/eval/test_bench.py reproduces for every point.
run_point() {
  input_len="$1"
  concurrency="$2"
  warmups=4
  if ((concurrency > warmups)); then warmups="$concurrency"; fi

  vllm bench serve \
    --backend openai-chat \
    --base-url http://127.0.0.1:8691 \
    --endpoint /v1/chat/completions \
    --model Kimi-K3 \
    --tokenizer "$MODEL" \
    --trust-remote-code \
    --dataset-name random \
    --random-input-len "$input_len" \
    --random-output-len 1 \
    --random-range-ratio 0 \
    --num-prompts $((concurrency * 3)) \
    --num-warmups "$warmups" \
    --request-rate inf \
    --max-concurrency "$concurrency" \
    --ignore-eos \
    --temperature 0 \
    --percentile-metrics ttft,e2el \
    --metric-percentiles 50,90,95,99 \
    --seed 2026
}

for c in 1 8 32 64 128; do run_point 128 "$c"; done
for c in 1 2 4 8; do run_point 8192 "$c"; done
run_point 32768 1
