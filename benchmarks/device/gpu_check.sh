#!/usr/bin/env bash
# GPU placement check (issue 13): see benchmarks/device/gpu_check.py. Not run by the CPU suite.
# Usage: bash benchmarks/device/gpu_check.sh   (from anywhere; prints one JSON object)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo '{"ok": false, "error": "no CUDA device: torch.cuda.is_available() is False; run this on a machine with a GPU"}'
  exit 2
fi
exec timeout 480 "$PY" benchmarks/device/gpu_check.py "$@"
