#!/usr/bin/env bash
# TTFT miss vs hit of the torch engine on a CUDA GPU, with a larger model (preset "gpu":
# ~0.9B parameters, 16 layers, hidden 2048, GQA 16/4 heads, bfloat16). Prints one JSON object per
# configuration, one per line; takes well under 5 minutes on one H100/H200-class GPU.
#
#   bash worker/bench_gpu.sh                 # from the repository root
#   PYTHON=/path/to/python bash worker/bench_gpu.sh
#   WHEELS=/dir/with/wheels bash worker/bench_gpu.sh   # offline install of missing packages
#
# Nothing is downloaded: the script uses a Python that already has torch (with CUDA) and the
# worker's dependencies; if some are missing and WHEELS names a local directory of wheels, it
# installs them from there only (pip --no-index). Otherwise it stops and says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
[ -n "$PY" ] || { echo "bench_gpu.sh: no python found (set PYTHON)" >&2; exit 2; }

missing() {
  "$PY" - <<'PYEOF'
import importlib.util
need = ["torch", "aiohttp", "xxhash", "prometheus_client", "uhashring"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PYEOF
}

MISSING="$(missing)"
if [ -n "$MISSING" ]; then
  if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
    echo "bench_gpu.sh: installing from $WHEELS (offline): $MISSING" >&2
    pkgs="${MISSING//prometheus_client/prometheus-client}"
    # shellcheck disable=SC2086
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" $pkgs
    MISSING="$(missing)"
  fi
  if [ -n "$MISSING" ]; then
    echo "bench_gpu.sh: $PY lacks: $MISSING (set PYTHON, or WHEELS=<local wheel dir>)" >&2
    exit 2
  fi
fi

"$PY" - <<'PYEOF' >&2
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"bench_gpu.sh: torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
PYEOF

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--engine torch --device cuda --model-config gpu --model-dtype bfloat16 --trials 5
        --decode-tokens 64 --json)
# The issue's shape, then a longer prefix (where prefill dominates even on a GPU), then int8 KV.
timeout 120 "$PY" -m worker.bench "${COMMON[@]}" --prefix-tokens 2000 --suffix-tokens 50
timeout 120 "$PY" -m worker.bench "${COMMON[@]}" --prefix-tokens 8000 --suffix-tokens 50
timeout 120 "$PY" -m worker.bench "${COMMON[@]}" --prefix-tokens 8000 --suffix-tokens 50 \
  --kv-dtype int8
