#!/usr/bin/env bash
# The server's HTTP API with curl. Start it first:  vserve serve   (127.0.0.1:8000)
# Add  -H "Authorization: Bearer $VSERVE_API_KEY"  when the server runs with --api-key (it
# guards /v1, /tokenize and /detokenize).
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}

curl -s "$URL/health" -o /dev/null -w "health: %{http_code}\n"
curl -s "$URL/version"; echo
curl -s "$URL/v1/models"; echo

# completion (vLLM extras such as ignore_eos and top_k go at the top level)
curl -s "$URL/v1/completions" -H "Content-Type: application/json" -d '{
  "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "top_k": 1
}'; echo

# streamed chat with a final usage chunk; each event is "data: {json}", the last "data: [DONE]"
curl -sN "$URL/v1/chat/completions" -H "Content-Type: application/json" \
  -H "X-Request-Id: curl-demo-1" -d '{
  "messages": [{"role": "user", "content": "Say hello in French."}],
  "max_tokens": 24, "stream": true, "stream_options": {"include_usage": true}
}'

curl -s "$URL/tokenize" -H "Content-Type: application/json" -d '{"prompt": "Hello world"}'; echo
curl -s "$URL/detokenize" -H "Content-Type: application/json" -d '{"tokens": [9259, 1902]}'; echo
curl -s "$URL/metrics" | grep -E "^vserve:(num_requests|kv_cache|generation_tokens)"
