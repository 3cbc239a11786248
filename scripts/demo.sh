#!/usr/bin/env bash
# The main demo: sets up a CPU-only environment (torch 2.13.0 CPU, shared with the CPU test
# run), installs maskedbranch into it and launches examples/demo.py on NPROC processes (gloo).
#   NPROC=4                          number of processes (ranks)
#   MASKEDBRANCH_VENV_DEMO=.venv-cpu environment to create or reuse
#   PYTHON=python3                   interpreter used to create it
# Extra arguments are passed to examples/demo.py.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${MASKEDBRANCH_VENV_DEMO:-$ROOT/.venv-cpu}
NPROC=${NPROC:-4}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -f examples/demo.py ]]; then
  echo "examples/demo.py does not exist in this checkout" >&2
  exit 1
fi

if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  echo "-- reusing $VENV"
else
  echo "-- creating $VENV"
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# Tried up to three times: a wheel that arrives damaged fails pip's hash check; a later try
# downloads it afresh (no cache).
cache=()
for try in 1 2 3; do
  "$VENV/bin/python" -m pip install -q "${cache[@]}" "setuptools>=64" wheel ninja numpy "torch==2.13.0" && break
  [[ $try == 3 ]] && { echo "pip install failed three times" >&2; exit 1; }
  echo "-- pip install failed (try $try of 3); trying again in $((try * 15)) s" >&2
  sleep $((try * 15))
  cache=(--no-cache-dir)
done

# Non-editable install with a build folder of its own (as scripts/test.sh does).
cfg=$VENV/maskedbranch-build.cfg
log=$VENV/maskedbranch-build.log
printf '[build]\nbuild_base = %s\n' "$VENV/build" > "$cfg"
echo "-- building and installing maskedbranch (CPU kernels; log: $log)"
if ! env DIST_EXTRA_CONFIG="$cfg" FORCE_CUDA=0 MASKEDBRANCH_CPU_ONLY=1 \
    "$VENV/bin/python" -m pip install -v --no-deps --no-build-isolation "$ROOT" > "$log" 2>&1; then
  tail -n 60 "$log" >&2
  echo "build failed (full log: $log)" >&2
  exit 1
fi

echo "-- torchrun --standalone --nproc_per_node=$NPROC examples/demo.py $*"
exec "$VENV/bin/torchrun" --standalone --nproc_per_node="$NPROC" examples/demo.py "$@"
