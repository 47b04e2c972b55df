#!/usr/bin/env bash
# Run HERE (a machine with the package registry), before a GPU is lent: downloads into .whl/
# exactly the wheels of benchmarks/device/wheels.txt (what the lent machine's Python 3.12
# lacks, manylinux x86-64), checks they are at most 60 MiB together and that with the lent
# machine's own packages (lent_machine.txt) they cover every requirement of the kit.
#   bash benchmarks/device/prepare.sh [--dest DIR]      (default .whl, git-ignored)
# Then, on the lent machine (the device tool, carry [".whl"]):  bash benchmarks/device/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
if [ "${1:-}" = "--dest" ]; then dest="$2"; fi
limit=$((60 * 1024 * 1024))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Only the pinned wheels, for the lent machine's interpreter and platform (pip matches each
# manylinux tag exactly, so name every one the list's wheels use).
python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" -r benchmarks/device/wheels.txt 2> >(grep -v "is ignored: it is neither" >&2)
wanted=$(grep -cv -e '^\s*#' -e '^\s*$' benchmarks/device/wheels.txt)
got=$(ls "$tmp"/*.whl | wc -l)
if [ "$got" -ne "$wanted" ]; then
  echo "prepare.sh: $got wheels downloaded for $wanted pinned in wheels.txt" >&2
  exit 1
fi
bytes=$(cat "$tmp"/*.whl | wc -c)
if [ "$bytes" -gt "$limit" ]; then
  echo "prepare.sh: the wheels take $((bytes / 1048576)) MiB, over the 60 MiB a call may carry beside the tree" >&2
  exit 1
fi
PY="${PYTHON:-python3}"
if ! "$PY" benchmarks/device/kit.py needs --wheels "$tmp" >"$tmp/needs.json"; then
  cat "$tmp/needs.json" >&2
  echo "prepare.sh: the lent machine's packages and these wheels leave requirements unmet (above)" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp"/*.whl "$dest"/
printf '{"ok": true, "wheels": %d, "mib": %.1f, "dest": "%s"}\n' "$got" "$(echo "$bytes / 1048576" | bc -l)" "$dest"
