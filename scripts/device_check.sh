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
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-./device-out}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's package, installed or not
# $PYTHON: the interpreter (the tests give theirs); default python, else python3 (GPU images may have only that)
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PYTHON" -m hf_kvshare.bench.device_check --out "$OUT" "$@"
