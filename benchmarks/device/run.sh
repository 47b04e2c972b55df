#!/usr/bin/env bash
# The device kit's one command, run THERE, on the lent GPU machine (its own python3, no network):
#   bash benchmarks/device/run.sh [--only NAME,...] [--budget SECONDS]
# or here, on the CPU at tiny sizes, to prove the wiring (tests/test_device_kit.py does):
#   PYTHON=.venv/bin/python bash benchmarks/device/run.sh --cpu
# 1. installs the wheels prepare.sh put in .whl/ into a folder of its own (pip --no-index
#    --no-deps --target; not with --cpu: the interpreter has them already);
# 2. writes the project's distribution metadata beside them (kit.py metadata) and puts both
#    and the project's source folders on PYTHONPATH: no install of the project;
# 3. runs every check (kit.py run: `kit.py list` names them), each under its own timeout,
#    and writes summary.json and logs.tar.gz under $OUT when it is set (the device tool's).
# Exit: 0 all passed, 1 one failed (see the summary), 2 bad arguments.
# SKYRL_KIT_RECORD_IMPORTS=DIR: every Python process of the checks writes the modules it
# imported into DIR (what tests/test_device_kit.py compares with the lent machine's packages).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
cpu=0
for arg in "$@"; do [ "$arg" = "--cpu" ] && cpu=1; done
site="${SKYRL_DEVICE_SITE:-${TMPDIR:-/tmp}/skyrl-device-site}"
mkdir -p "$site"
if [ "$cpu" = 0 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site/wheels" .whl/*.whl; then
      echo '{"ok": false, "error": "installing the carried wheels (.whl/) failed: see the lines above"}'
      exit 1
    fi
  else
    echo "run.sh: no wheels in .whl/: run benchmarks/device/prepare.sh where the registry answers and carry .whl;" \
         "the preflight check will name what is missing" >&2
  fi
fi
if ! sources=$("$PY" benchmarks/device/kit.py metadata "$site/dists"); then
  echo '{"ok": false, "error": "kit.py metadata failed: see the lines above"}'
  exit 1
fi
PYTHONPATH="$site/dists:$sources:$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${SKYRL_KIT_RECORD_IMPORTS:-}" ]; then
  PYTHONPATH="$PWD/benchmarks/device/record_imports:$PYTHONPATH"
fi
export PYTHONPATH
exec "$PY" benchmarks/device/kit.py run "$@" ${OUT:+--out "$OUT"}
