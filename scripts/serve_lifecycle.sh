#!/bin/bash
# hf-kvshare serve as the README runs it (VLLM_CPU_KVCACHE_SPACE unset), on the embedded model: the time
# until /health answers, one chat request, then SIGTERM to the wrapper (and a second start, SIGKILL):
# prints how many vLLM processes are left 15 s later (expected: 0 and 0) and whether the port answers.
# Usage (in the vLLM venv, from the repository root): scripts/serve_lifecycle.sh [port]
set -u
port=${1:-8011}
unset VLLM_CPU_KVCACHE_SPACE
export OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind
for sig in TERM KILL; do
  start=$(date +%s)
  python -m hf_kvshare serve --model smollm2-135m --method fullshared:prefix_reuse=True --dtype float32 \
      --port "$port" > "serve_$sig.log" 2>&1 &
  wrapper=$!
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && break
    kill -0 "$wrapper" 2>/dev/null || break
    sleep 1
  done
  echo "[$sig] ready after $(( $(date +%s) - start )) s"
  model=$(curl -s "http://127.0.0.1:$port/v1/models" | python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Say hi\"}], \"max_tokens\": 5}" \
      | python -c "import json,sys; print('[reply]', json.load(sys.stdin)['choices'][0]['message']['content'])"
  kill -"$sig" "$wrapper"; wait "$wrapper" 2>/dev/null; echo "[$sig] wrapper exit code $?"
  sleep 15
  echo "[$sig] 15 s later: api servers $(pgrep -f vllm.entrypoints.openai.api_server | wc -l)," \
       "engine cores $(pgrep -f EngineCore | wc -l), /health: $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")"
done
