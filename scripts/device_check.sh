#!/usr/bin/env bash
# One prepared device check for a lent GPU (one H200, <= 8 minutes); everything goes under $OUT
# (default ./device-out). Runs hf_kvshare/bench/device_check.py:
#   (a) exactness on the device, fp32 tiny random Llama 3.1: NonShared == plain generate token for
#       token; re-positioned keys == keys computed at the new position (layer 0), round trip exact;
#   (b) single-stream TTFT / E2E / peak memory sweep, random:llama-3.1-8b in bf16, trace workload
#       (3 agents, 1 warm-up + 1 measured request, 8 output tokens), shared 4K/8K/16K/32K tokens:
#       nonshared fullshared fullshared:prefix_reuse=True kvcmas kvcomm cacheblend; prelrshared / rebaseshared-lp with random
#       q/v rank-8 LoRA adapters (one per agent) at 8K;
#   (c) device_check.json (raw numbers) and device_check.md (the table).
# Sizing (the estimate made before any run): an 8B prefill costs ~2 * 8e9 FLOPs per token plus attention
# 4 * 32 layers * 4096 * S^2; at 32K that is ~1.1e15 FLOPs, ~2-3 s on an H200 in bf16 (~400-500
# TFLOP/s achieved). Per measured request a method prefills at most ~3 agents x S tokens; the
# sweep runs 2 requests x 5 methods at 4 lengths, dominated by 32K (~10 NonShared-prefill
# equivalents, ~30 s) and 16K; with model builds (~10 s each, 3 of them), anchor SVDs and the 8K
# LoRA run the estimate was 3-5 minutes; measured on one H200: 225 s (docs/results/gpu.md).
#   bash scripts/device_check.sh            # full check on a GPU
#   bash scripts/device_check.sh --tiny     # CPU mode: random:tiny-llama, 256 tokens, seconds
# Stopped with SIGINT (e.g. `timeout -s INT 420 bash scripts/device_check.sh`), it still writes the
# tables of the configurations that finished (marked incomplete) and exits 1.
#
# --serving: concurrent serving on vLLM's GPU wheel (issue 51), through `hf-kvshare bench serve`:
#   random:llama-3.1-8b in bf16 (its config and the byte tokenizer written as an HF folder; vLLM's
#   --load-format dummy draws the weights: no 16 GB file to write), 8K and 32K shared tokens, arrivals
#   at 0.25, 2 and 8 QPS, plain vLLM / fullshared:prefix_reuse=True / kvcmas:tau=1.0, one server per method and
#   length (--enforce-eager), 3 agents x 4 tasks per rate, 8 output tokens, two warm-up tasks; each
#   server's peak GPU memory sampled with nvidia-smi. Rows: $OUT/serving/serving_gpu.md, copied to
#   docs/results/serving-gpu.md (the lent device returns only $OUT).
#   It first checks for vLLM (>= 0.32, a CUDA build) and a CUDA device and stops with what is missing
#   (exit 3): the lent device has torch 2.11, no vLLM and no internet, and a session carries at most
#   64 MiB to it (vLLM's GPU wheel alone is ~228 MiB), so today it cannot run there.
#   Sizing (estimated, never run): a 32K prefill ~2-3 s (above); per length and method ~30 s of
#   arrivals (--max-duration 30) plus the backlog (8 QPS x 32K: ~12 requests x ~2.5 s on plain vLLM)
#   and a server start (~40-60 s with dummy weights, no CUDA graphs); 6 servers: ~8-10 minutes. A
#   wall budget (--budget, default 600 s) splits the time left among the runs left (SIGINT at the cap:
#   bench serve keeps the rates that finished, marked incomplete).
#   bash scripts/device_check.sh --serving [--dry-run] [--tiny] [--budget S] [--shared-tokens "8192 32768"]
#       [--qps "0.25 2 8"]     # $VLLM_PYTHON: the Python with vLLM (default: $PYTHON)
#   --dry-run: the checks (reported, not enforced) and the commands, nothing run (exit 0);
#   --tiny: a CPU smoke run on vLLM's CPU wheel (a 2-layer Llama of 4 heads of 64, 256 shared tokens,
#   1 QPS, plain and fullshared; no CUDA check, nothing written to docs/).
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-./device-out}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's package, installed or not
# $PYTHON: the interpreter (the tests give theirs); default python, else python3 (GPU images may have only that)
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
if [ "${1:-}" != "--serving" ]; then
    exec "$PYTHON" -m hf_kvshare.bench.device_check --out "$OUT" "$@"
fi
shift

# ------------------------------------------------------------------------------------- --serving
ME="scripts/device_check.sh --serving"
VLLM_PYTHON="${VLLM_PYTHON:-$PYTHON}"
budget=600 dry=0 tiny=0 shared="8192 32768" qps="0.25 2 8"

usage() {
    echo "usage: bash $ME [--dry-run] [--tiny] [--budget SECONDS] [--shared-tokens \"N ...\"] [--qps \"Q ...\"]"
}
fail_usage() {
    echo "$ME: error: $1" >&2
    usage >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --tiny) tiny=1 ;;
        --budget | --shared-tokens | --qps)
            [ $# -ge 2 ] || fail_usage "$1 needs a value"
            case "$1" in
                --budget) budget="$2" ;;
                --shared-tokens) shared="${2//,/ }" ;;
                --qps) qps="${2//,/ }" ;;
            esac
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) fail_usage "unknown argument $1" ;;
    esac
    shift
done
[[ "$budget" =~ ^[1-9][0-9]*$ ]] || fail_usage "--budget $budget: a whole number of seconds"
for n in $shared; do [[ "$n" =~ ^[1-9][0-9]*$ ]] || fail_usage "--shared-tokens: $n is not a positive integer"; done
for q in $qps; do [[ "$q" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ && ! "$q" =~ ^[0.]+$ ]] || fail_usage "--qps: $q is not a positive number"; done
[ -n "${shared// /}" ] || fail_usage "--shared-tokens: no length"
[ -n "${qps// /}" ] || fail_usage "--qps: no rate"

# kvcmas:tau=1.0: every gate with two anchors accepts (random weights give no meaningful entropy), as in
# bench/device_check.py; two warm-up tasks give the gates their two anchors per slot
methods="plain fullshared:prefix_reuse=True kvcmas:tau=1.0"
model_name="llama-3.1-8b" overrides="{}" dtype="bfloat16" agents=3 tasks=4
if [ "$tiny" = 1 ]; then  # vLLM's CPU attention serves heads of 32 and more: a 2-layer Llama of 4 heads of 64
    methods="plain fullshared:prefix_reuse=True" model_name="tiny-llama" dtype="float32" agents=2 tasks=2
    overrides='{"head_dim": 64, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}'
    [ "$shared" = "8192 32768" ] && shared="256"
    [ "$qps" = "0.25 2 8" ] && qps="1"
fi
runs_dir="$OUT/serving"
model_dir="$runs_dir/model-$model_name"

# 1. what this needs: vLLM >= 0.32 built for CUDA and a CUDA device (vLLM's CPU wheel with --tiny)
check_prerequisites() {
    "$VLLM_PYTHON" - "$tiny" <<'PY'
import importlib.util
import sys

tiny = sys.argv[1] == "1"
missing = []
if importlib.util.find_spec("vllm") is None:
    missing.append(f"vLLM is not installed for {sys.executable}")
else:
    import torch
    import vllm
    from vllm.platforms import current_platform

    version = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < (0, 32):
        missing.append(f"vLLM {vllm.__version__} is older than 0.32 (the connector's API)")
    if not tiny and not current_platform.is_cuda():
        missing.append(f"vLLM {vllm.__version__} here is not a CUDA build (the CPU wheel?)")
    if not tiny and not torch.cuda.is_available():
        missing.append(f"torch {torch.__version__} sees no CUDA device")
if importlib.util.find_spec("transformers") is None:
    missing.append(f"transformers is not installed for {sys.executable}")
print("\n".join(missing))
sys.exit(3 if missing else 0)
PY
}
set +e
missing="$(check_prerequisites 2>&1)"
status=$?
set -e
if [ $status -ne 0 ]; then
    [ -n "$missing" ] || missing="the check itself failed ($VLLM_PYTHON)"
    cat >&2 <<EOF
$ME: cannot run: ${missing//$'\n'/; }.
It needs vLLM's GPU wheel (vllm>=0.32, a ~228 MiB wheel plus the CUDA torch it pins) in \$VLLM_PYTHON
($VLLM_PYTHON) and one CUDA GPU. The lent device has torch 2.11, no vLLM and no internet, and a
session carries at most 64 MiB to it, so it cannot run there today. To run it: install the wheel from a
local wheelhouse (pip install --no-index --find-links WHEELS 'vllm>=0.32'), or set VLLM_PYTHON to a
Python that has it; --dry-run prints the plan.
EOF
    if [ "$dry" = 0 ]; then
        exit 3
    fi
    echo "dry run: the checks failed (above); the plan:" >&2
fi

# 2. the plan: one bench serve per length and method, shortest length first (its unused time rolls on)
max_store=()
if grep -q -- '"--max-store-bytes"' hf_kvshare/bench/serve/cli.py; then  # an option of this checkout's bench
    max_store=(--max-store-bytes 64000000000)  # a 32K document's K/V is 4.3 GB (131 KB a token)
fi
commands=() names=()
for n in $shared; do
    for m in $methods; do
        out="$runs_dir/S$n-${m%%:*}"
        cmd=("$PYTHON" -m hf_kvshare.bench serve --methods "$m" --qps $qps --shared-tokens "$n"
            --agents "$agents" --tasks "$tasks" --output-tokens 8 --warmup-tasks 2 --explicit-layout
            --max-duration 30 --request-timeout 180 --startup-timeout 300 --model "$model_dir"
            --dtype "$dtype" --vllm-python "$VLLM_PYTHON" --vllm-arg=--load-format=dummy
            --vllm-arg=--enforce-eager --out "$out" --redo --no-plots "${max_store[@]}")
        if [ "$tiny" = 0 ]; then
            cmd+=(--vllm-arg=--gpu-memory-utilization=0.9)
        else
            cmd+=(--threads 1 --kv-cache-gib 1)
        fi
        commands+=("$(printf '%q ' "${cmd[@]}")")
        names+=("$(basename "$out")")
    done
done
if [ "$dry" = 1 ]; then
    echo "# model folder: $model_dir (random:$model_name config $overrides, the byte tokenizer)"
    printf '%s\n' "${commands[@]}"
    echo "# then: $runs_dir/serving_gpu.md from each run's summary.json, budget ${budget}s"
    exit 0
fi

# 3. the served model: the random model's config and the byte tokenizer as an HF folder (weights: dummy)
mkdir -p "$runs_dir"
"$PYTHON" - "$model_name" "$model_dir" "$overrides" "$dtype" <<'PY'
import json
import sys

from hf_kvshare.random_models import byte_tokenizer, random_config

name, target, overrides, dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
config = random_config(name)
for key, value in overrides.items():
    setattr(config, key, value)
config.dtype = dtype
config.save_pretrained(target)
byte_tokenizer().save_pretrained(target)
PY

# 4. the runs, each under its share of the budget, its server's peak GPU memory sampled
deadline=$(($(date +%s) + budget))
left=${#commands[@]}
: >"$runs_dir/runs.tsv"
for i in "${!commands[@]}"; do
    cmd="${commands[$i]}"
    now=$(date +%s)
    cap=$(((deadline - now) / left))
    left=$((left - 1))
    if [ "$cap" -lt 30 ]; then
        echo "$ME: out of budget; not run: $cmd" >&2
        printf '%s\t%s\t%s\n' "${names[$i]}" "not run (budget)" "" >>"$runs_dir/runs.tsv"
        continue
    fi
    sampler=""
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$runs_dir/gpu_memory.txt" &
        sampler=$!
    fi
    echo "$ME: (${cap}s) $cmd" >&2
    set +e
    eval "timeout -s INT -k 60 $cap $cmd"
    rc=$?
    set -e
    peak=""
    if [ -n "$sampler" ]; then
        kill "$sampler" 2>/dev/null || true
        wait "$sampler" 2>/dev/null || true
        peak=$(sort -n "$runs_dir/gpu_memory.txt" | tail -n 1)
    fi
    printf '%s\t%s\t%s\n' "${names[$i]}" "$rc" "$peak" >>"$runs_dir/runs.tsv"
done

# 5. the rows: every run's summary (finished or not) as one markdown table
"$PYTHON" - "$runs_dir" "$tiny" <<'PY'
import json
import platform
import subprocess
import sys
from pathlib import Path

runs_dir, tiny = Path(sys.argv[1]), sys.argv[2] == "1"
lines = []
for line in (runs_dir / "runs.tsv").read_text().splitlines():  # in run order: length, then method
    run, rc, peak = line.split("\t")  # bench serve's exit code, its server's peak GPU memory (MiB)
    summaries = sorted((runs_dir / run).glob("**/summary.json"))
    if not summaries:  # not run (the budget), or stopped before its first rate finished
        shared, method = run[1:].split("-", 1)
        lines.append([int(shared), method, 0, None, None, None, None, "0/0", peak or "n/a", f"{rc} (no rows)"])
    for summary in summaries:
        data = json.loads(summary.read_text())
        shared = data["config"]["workload"]["shared_tokens"]
        state = "" if data.get("complete", True) else f" (incomplete: {data.get('stopped', '')})"
        for row in data["rows"]:
            cells = [shared, row["method"], row["qps"], row.get("ttft_p50_s"), row.get("ttft_p90_s"),
                     row.get("reuse_ttft_p50_s"), row.get("rho"),
                     f"{row.get('completed')}/{row.get('requests')}", peak or "n/a", f"{rc}{state}"]
            lines.append(cells)
lines.sort(key=lambda c: (c[0], c[2]))  # stable: each rate's methods in run order
plain = {(c[0], c[2]): c[3] for c in lines if c[1] == "plain"}
for c in lines:  # TTFT p50 over plain vLLM's at the same length and rate
    base = plain.get((c[0], c[2]))
    c.insert(4, c[3] / base if c[3] is not None and base else None)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
try:
    import torch
    import vllm

    env = f"vLLM {vllm.__version__}, torch {torch.__version__}"
    env += f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", CPU"
except Exception as e:  # noqa: BLE001 - the table still gets written
    env = f"environment not read ({e})"
table = [
    f"## scripts/device_check.sh --serving{' --tiny' if tiny else ''} (commit {commit or '?'}, {env}, {platform.node()})",
    "",
    "| shared | method | QPS | TTFT p50 s | p50 / plain | p90 s | reuse p50 s | rho | completed | peak GPU MiB | exit |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]
fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
table += ["| " + " | ".join(fmt(c) for c in cells) + " |" for cells in lines]
text = "\n".join(table) + "\n"
(runs_dir / "serving_gpu.md").write_text(text)
print(text)
PY
if [ "$tiny" = 0 ]; then
    cp "$runs_dir/serving_gpu.md" docs/results/serving-gpu.md
fi
