#!/usr/bin/env bash
# Megatron backend check on one GPU (issue 18): see benchmarks/device/megatron_gpu_check.py. Not run by the CPU suite.
# Usage: bash benchmarks/device/megatron_gpu_check.sh   (from anywhere; prints one JSON object; < 8 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo '{"ok": false, "error": "no CUDA device: torch.cuda.is_available() is False; run this on a machine with a GPU"}'
  exit 2
fi
exec timeout 480 "$PY" benchmarks/device/megatron_gpu_check.py "$@"
