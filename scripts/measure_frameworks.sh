#!/bin/bash
# An agent-framework example (examples/agents_sdk.py or examples/langgraph_agents.py), in both message
# styles, against plain vLLM and hf-kvshare serve per method: one server at a time on 127.0.0.1:$PORT,
# each example run writing its rows to $OUT/<server>_<style>.json, then one table of agents 2-4's median
# TTFT (tasks after the first) and the median prompt tokens the server supplied to them.
#
#   OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1 \
#   VLLM_PY=VENV/bin/python AGENTS_PY=AGENTS_VENV/bin/python \
#       scripts/measure_frameworks.sh [examples/langgraph_agents.py] [TASKS] [SERVERS...]
#
# VLLM_PY: a Python with vLLM (README, "Serving on vLLM"); AGENTS_PY: one with the framework
# (pip install 'hf_kvshare[agents]', examples/README.md). SERVERS: "plain" (plain vLLM) and methods
# (default: plain fullshared:prefix_reuse=True kvcmas). Run from the repository root (PYTHONPATH is set
# to it); OUT (default runs/frameworks) and PORT (default 8123) from the environment. Each server is
# stopped before the next starts; none outlives the script.
set -u
EXAMPLE=${1:-examples/langgraph_agents.py}
TASKS=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
SERVERS=("$@")
[ ${#SERVERS[@]} -gt 0 ] || SERVERS=(plain fullshared:prefix_reuse=True kvcmas)
VLLM_PY=${VLLM_PY:-python}
AGENTS_PY=${AGENTS_PY:-python}
OUT=${OUT:-runs/frameworks}
PORT=${PORT:-8123}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
MODEL_DIR=$("$VLLM_PY" -c "from hf_kvshare.serving.models import served_model_dir; print(served_model_dir('smollm2-135m'))")
server_pid=
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"; wait "$server_pid" 2>/dev/null
  fi
  server_pid=
}
trap stop_server EXIT INT TERM
seed=0
for server in "${SERVERS[@]}"; do
  tag=${server%%:*}
  reports="$OUT/reports_$tag.jsonl"
  rm -f "$reports"
  if [ "$server" = plain ]; then
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
      --dtype float32 --enforce-eager --max-model-len 4096 > "$OUT/server_$tag.log" 2>&1 &
  else
    HF_KVSHARE_REPORTS="$reports" "$VLLM_PY" -m hf_kvshare serve --model smollm2-135m --method "$server" \
      --port "$PORT" --dtype float32 --enforce-eager --max-model-len 4096 > "$OUT/server_$tag.log" 2>&1 &
  fi
  server_pid=$!
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")" = 200 ] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 1
  done
  for style in messages one-message; do
    echo "=== $server $style (seed $seed)"
    report_arg=()
    [ "$server" = plain ] || report_arg=(--reports "$reports")
    timeout 900 "$AGENTS_PY" "$EXAMPLE" --base-url "http://127.0.0.1:$PORT/v1" --style "$style" \
      --tasks "$TASKS" --seed "$seed" "${report_arg[@]}" --json "$OUT/${tag}_$style.json" 2>&1 | tail -3
    seed=$((seed + TASKS))
  done
  stop_server
  sleep 3
done
"$AGENTS_PY" - "$OUT" "${SERVERS[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path

out, servers = Path(sys.argv[1]), sys.argv[2:]
print("| server | style | agents 2-4 median TTFT | vs plain | shared (median, of prompt) |")
print("|---|---|---:|---:|---:|")
for style in ("messages", "one-message"):
    plain = None
    for server in servers:
        path = out / f"{server.split(':')[0]}_{style}.json"
        if not path.exists():
            print(f"| {server} | {style} | (no run) | | |")
            continue
        run = json.loads(path.read_text())
        median = run["median_s"]
        first = run["rows"][0]["agent"] if run["rows"] else None
        later = [r for r in run["rows"] if r["task"] > 1 and r["agent"] != first]
        supplied = [r["supplied_tokens"] for r in later if r.get("supplied_tokens") is not None]
        prompt = [r["prompt_tokens"] for r in later if r.get("prompt_tokens") is not None]
        shared = f"{statistics.median(supplied):.0f} of {statistics.median(prompt):.0f}" if supplied and prompt else "-"
        if server == "plain":
            plain = median
        ratio = f"{plain / median:.1f}x" if plain and median and server != "plain" else ""
        print(f"| {server} | {style} | {median:.2f} s | {ratio} | {shared} |" if median else f"| {server} | {style} | - | | {shared} |")
PY
echo "vLLM servers left: $(pgrep -f "vllm.entrypoints.openai.api_server.*--port $PORT" | wc -l)"
