#!/usr/bin/env bash
# GPU check of the Tinker server (issue 14): not run by the CPU suite, and not run yet (no GPU
# was lent to the task that wrote it). On a machine with one GPU (an H200: < 8 minutes):
#   bash benchmarks/device/tinker_gpu_check.sh
# The server's engine and backend default to device "auto" (CUDA when present), so the SDK-driven
# server tests and the batcher's tests run on CUDA here: training clients, continuous batching with
# per-row LoRA, R3 / kept-set replay, durability across a SIGKILL. Then the batcher benchmark.
# Prints one JSON object: each part's exit code, its output's tail and the benchmark's JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo '{"ok": false, "error": "no CUDA device: torch.cuda.is_available() is False; run this on a machine with a GPU"}'
  exit 2
fi
out=$(mktemp -d)
timeout 360 "$PY" -m pytest -q plugins/server/tests plugins/engines/tests/test_continuous.py >"$out/tests.txt" 2>&1
tests_rc=$?
timeout 100 "$PY" benchmarks/continuous_batching.py --requests 2048 --max-tokens 16 --repeats 3 >"$out/bench.json" 2>"$out/bench.err"
bench_rc=$?
"$PY" - "$out" "$tests_rc" "$bench_rc" <<'PY'
import json, pathlib, sys
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    bench = json.loads((out / "bench.json").read_text())
    bench.pop("runs", None)
except ValueError:
    bench = {"error": (out / "bench.err").read_text()[-2000:]}
import torch
print(json.dumps({"ok": tests_rc == 0 and bench_rc == 0, "device": torch.cuda.get_device_name(0),
                  "tests_rc": tests_rc, "tests_tail": (out / "tests.txt").read_text()[-3000:],
                  "bench_rc": bench_rc, "continuous_batching": bench}, indent=1))
PY
