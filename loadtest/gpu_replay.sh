#!/usr/bin/env bash
# Live replays in front of real engines on one CUDA GPU: reference workers running the torch
# engine (preset "gpu": ~0.8B parameters, bfloat16, random weights, paged prefix cache) instead
# of the simulated one, so every latency is real prefill on the accelerator. Each workload runs
# the gateway (default policy and round_robin) and sglang-router in front of the same workers,
# caches flushed between routers (python -m loadtest replay). One trace block is --block-chars
# characters, a quarter as many tokens. Prints progress on stderr; one JSON file per workload.
#
#   bash loadtest/gpu_replay.sh [OUT_DIR]          # from the repository root; default results/gpu
#
# Environment: PYTHON (a Python with torch+CUDA and the project's dependencies), DEVICE (cuda),
# MODEL (gpu), DTYPE (bfloat16), PEER (sglang-router; empty: none), BLOCK_CHARS (1024),
# R_SHARED / R_MOONCAKE / R_CHAT (requests per workload; 0 skips it), RUN_TIMEOUT_S (per
# workload). Nothing is downloaded; a CPU smoke run: DEVICE=cpu MODEL=tiny DTYPE=float32.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
OUT_DIR="${1:-results/gpu}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-gpu}"
DTYPE="${DTYPE:-bfloat16}"
PEER="${PEER-sglang-router}"
BLOCK_CHARS="${BLOCK_CHARS:-1024}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-240}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

COMMON=(--block-chars "$BLOCK_CHARS" --policy cache_aware,round_robin --json
        --worker-arg=--engine=torch "--worker-arg=--device=$DEVICE"
        "--worker-arg=--model-config=$MODEL" "--worker-arg=--model-dtype=$DTYPE")
[ -n "$PEER" ] && COMMON+=(--peer "$PEER")

replay() {  # NAME REQUESTS ARGS...: one workload, its JSON in OUT_DIR/NAME.json
  local name="$1" requests="$2"
  shift 2
  [ "$requests" -gt 0 ] || return 0
  echo "gpu_replay: $name ($requests requests)" >&2
  timeout "$RUN_TIMEOUT_S" "$PY" -m loadtest replay "$@" "${COMMON[@]}" \
    >"$OUT_DIR/$name.json" || echo "gpu_replay: $name exited with $?" >&2
}

if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"
print("gpu_replay: torch", torch.__version__, "on", torch.cuda.get_device_name(0))' >&2 || exit 2
  # The engine alone: a prefill of 8,000 tokens from nothing and from the cache.
  timeout 120 "$PY" -m worker.bench --engine torch --device cuda --model-config "$MODEL" \
    --model-dtype "$DTYPE" --trials 3 --decode-tokens 8 --prefix-tokens 8000 \
    --suffix-tokens 50 --json >"$OUT_DIR/engine.json" || echo "gpu_replay: bench failed" >&2
fi

# 20 shared prompts of 32 blocks + 3 unique blocks; 4 workers whose caches hold ~8 prompts.
replay shared "${R_SHARED:-1000}" --workload shared-prompts --requests "${R_SHARED:-1000}" \
  --workers 4 --cache-blocks 280 --concurrency 32
# The Mooncake conversation trace, its first R_MOONCAKE requests, 8 workers.
replay mooncake "${R_MOONCAKE:-1500}" --limit "${R_MOONCAKE:-1500}" --workers 8 \
  --cache-blocks 1000 --concurrency 64
# Multi-turn chat: histories that grow turn by turn.
replay chat "${R_CHAT:-1000}" --workload chat --requests "${R_CHAT:-1000}" --workers 8 \
  --cache-blocks 150 --concurrency 32
