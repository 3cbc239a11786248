#!/usr/bin/env bash
# The project's test command, in two sizes:
#
#   bash scripts/test.sh [--quick]    the contributor's loop (the default): builds the CPU kernels
#                                     in place against the torch of the current Python environment
#                                     and runs the pytest suite without the tests marked `slow`
#                                     (a few minutes on 2 cores). With no usable torch there, it
#                                     creates (or reuses) .venv-cpu with torch 2.13.0 (CPU) and the
#                                     test packages first. See quick() below.
#   bash scripts/test.sh --full       what CI runs (.ci/run): sets everything up on a fresh machine,
#                                     then the parts below, every test included.
#
# --full:
#   (a) builds the extension with its CUDA kernels (CUDA build of torch, .venv-cuda), checks with
#       cuobjdump that device code for every requested architecture is in it, and runs the whole
#       pytest suite (on the CPU unless a GPU is visible);
#   (b) builds the CMake/libtorch library and runs its C++ test with ctest;
#   (c) builds the CPU-only variant against torch 2.13.0 (a CPU-only torch, .venv-cpu) and runs the
#       whole suite there;
#   (d) builds the CPU kernels against torch 2.6.0, the declared floor (.venv-floor), and runs the
#       whole suite there;
#   (e) builds the CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer (out of tree,
#       in .venv-cpu) and runs the op, bad-input, MaskedBranch and fuzz tests under them; builds the
#       CUDA kernels (csrc/cuda) for the host against an emulation of the CUDA threads
#       (tests/cuda_emu) with the same sanitizers and runs every one of them against the CPU kernels
#       and the reference (scripts/sanitize.sh).
# Every part runs even when an earlier one fails; the exit status is non-zero if any failed.
# Default order a b c e d: each part reports the free disk space before it starts, and under CI
# (CI=true) an environment is deleted as soon as no later part needs it, so the peak is one CUDA
# build of torch (about 6 GB) plus the wheels being installed, not three environments at once.
#
# Knobs (environment):
#   MASKEDBRANCH_PARTS="a b c e d"  parts to run, in this order
#   MASKEDBRANCH_PRUNE_VENVS=0|1    delete each environment after its last part (default 1 under
#                                   CI=true, else 0)
#   PIP_NO_CACHE_DIR                default 1: no second copy of every wheel in pip's cache
#   TORCH_CUDA_ARCH_LIST            GPU architectures for (a) and (b); default "8.0;9.0+PTX"
#   MAX_JOBS                        parallel compile jobs; default: the number of cores
#   MASKEDBRANCH_CMAKE_CUDA=0|1     compile the CUDA kernels in the CMake build too (default 1
#                                   when a CUDA toolkit is found)
#   MASKEDBRANCH_VENV_CUDA / _CPU / _FLOOR   virtual environments to create or reuse
#                                   (default .venv-cuda / .venv-cpu / .venv-floor in the repository)
#   PYTHON                          interpreter used to create the environments (default python3)
#   PYTEST_ARGS                     extra pytest arguments, e.g. "-x -k combine"
#
# Tests import the *installed* build (a non-editable install into each environment, so the two
# builds never overwrite each other); pytest runs from outside the source tree (see run_pytest).
# To rerun one file by hand, from the repository root:
#   .venv-cuda/bin/pytest tests/test_ops.py      or      .venv-cpu/bin/pytest tests/test_ops.py
# (the `pytest` entry point does not put the working directory on sys.path, so the source
# tree's maskedbranch/ package, which holds no compiled _C, does not shadow the installed one;
# tests that add the working directory to sys.path and then spawn processes need the folder
# scripts/test.sh uses: cd .venv-cuda/pytest-cwd && ../bin/pytest --rootdir ../.. ../../tests/...).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

MODE=
for arg in "$@"; do
  case $arg in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    -h|--help) sed -n '2,/^set -uo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument '$arg' (use --quick or --full; pytest options go in PYTEST_ARGS)" >&2; exit 2 ;;
  esac
done
# No argument: --quick, unless MASKEDBRANCH_PARTS names parts of the full run.
[[ -z $MODE ]] && { [[ -n ${MASKEDBRANCH_PARTS:-} ]] && MODE=full || MODE=quick; }

PARTS=${MASKEDBRANCH_PARTS:-"a b c e d"}
PYTHON=${PYTHON:-python3}
VENV_CUDA=${MASKEDBRANCH_VENV_CUDA:-$ROOT/.venv-cuda}
VENV_CPU=${MASKEDBRANCH_VENV_CPU:-$ROOT/.venv-cpu}
VENV_FLOOR=${MASKEDBRANCH_VENV_FLOOR:-$ROOT/.venv-floor}
ARCHS=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0+PTX"}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
TORCH_CUDA_SPEC="torch==2.14.1"          # a CUDA 13.0 build
TORCH_CPU_SPEC="torch==2.13.0"           # a CPU-only build
TORCH_FLOOR_SPEC="torch==2.6.0"          # the floor declared in pyproject.toml
TEST_DEPS=(numpy pytest hypothesis expecttest ninja)
INTEGRATION_DEPS=(timm transformers accelerate lightning)  # optional: their tests skip without them
CMAKE_BUILD_DIR=$ROOT/cmake-build
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip keeps every wheel it downloads in its cache: a CUDA build of torch and its libraries twice
# over. The environments here are reused instead, so the cache only costs disk.
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
PRUNE_BY_DEFAULT=0
[[ ${CI:-} == true || ${CI:-} == 1 ]] && PRUNE_BY_DEFAULT=1
PRUNE_VENVS=${MASKEDBRANCH_PRUNE_VENVS:-$PRUNE_BY_DEFAULT}

banner() { printf '\n======== %s ========\n' "$*"; }
note() { printf -- '-- %s\n' "$*"; }

# The real CUDA toolkit (the nvcc on PATH may be a wrapper script that runs one elsewhere).
find_cuda_home() {
  local c nvcc p
  for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [[ -n $c && -x $c/bin/nvcc ]]; then echo "$c"; return 0; fi
  done
  nvcc=$(command -v nvcc || true)
  if [[ -n $nvcc ]]; then
    if [[ $(head -c 2 "$nvcc") == '#!' ]]; then
      for p in $(head -c 4096 "$nvcc" | grep -o "[^[:space:]\"']*/bin/nvcc"); do
        if [[ -x $p ]]; then dirname "$(dirname "$p")"; return 0; fi
      done
    else
      dirname "$(dirname "$(readlink -f "$nvcc")")"; return 0
    fi
  fi
  for c in $(ls -d /usr/local/cuda* 2>/dev/null | sort -r); do
    if [[ -x $c/bin/nvcc ]]; then echo "$c"; return 0; fi
  done
  return 1
}

# pip_get VENV ARG... : `pip install -q ARG...` from the index, tried up to three times. A wheel
# that arrives damaged fails pip's hash check (seen in CI for a CUDA library of torch 2.6), and
# the cache is off, so a second try downloads it afresh; a wrong pin fails all three.
pip_get() {
  local venv=$1 try; shift
  for try in 1 2 3; do
    "$venv/bin/python" -m pip install -q "$@" && return 0
    [[ $try -lt 3 ]] && note "pip install failed (try $try of 3); trying again in $((try * 15)) s" >&2 && sleep $((try * 15))
  done
  return 1
}

# ensure_venv DIR PACKAGE... : create DIR if needed (or if broken), then install what is missing.
ensure_venv() {
  local dir=$1; shift
  if [[ -x $dir/bin/python ]] && "$dir/bin/python" -c 'import sys' 2>/dev/null; then
    note "reusing $dir"
  else
    note "creating $dir"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir" || return 1
  fi
  pip_get "$dir" "setuptools>=64" wheel "$@" || return 1
  "$dir/bin/python" -c 'import sys, torch; print(f"-- python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}")'
}

# install_package VENV LOG [ENV=VALUE...] : non-editable build and install of this repository.
# Each environment has its own setuptools build folder, so the CUDA and CPU builds both stay
# incremental (ninja) and never mix objects.
install_package() {
  local venv=$1 log=$2; shift 2
  local cfg=$venv/maskedbranch-build.cfg
  printf '[build]\nbuild_base = %s\n' "$venv/build" > "$cfg"
  note "building and installing maskedbranch (log: $log)"
  if ! env DIST_EXTRA_CONFIG="$cfg" "$@" "$venv/bin/python" -m pip install -v --no-deps \
      --no-build-isolation "$ROOT" > "$log" 2>&1; then
    echo "!! build failed; first errors, then the last lines of $log:"
    grep -m 25 -E '(error|Error)[: ]' "$log" | cut -c 1-400
    echo "   ..."
    tail -n 25 "$log"
    return 1
  fi
  # What the build says about itself (setup.py prints the kernels it builds).
  grep -E '^ *maskedbranch:' "$log" | sed 's/^ */   /' | sort -u
  note "$(grep -cE '^ *\[[0-9]+/[0-9]+\] ' "$log") compile/link steps ran (ninja; 0 = nothing changed)"
  return 0
}

# show_install VENV EXPECTED_WITH_CUDA : print where maskedbranch is imported from; fail unless
# it is the installed build with the expected kind of kernels.
show_install() {
  local venv=$1 want=$2
  (cd / && "$venv/bin/python" - "$want" <<'EOF'
import os, sys, sysconfig
import glob, torch, maskedbranch
want = int(sys.argv[1])
print(f"-- maskedbranch.__file__ = {maskedbranch.__file__}")
print(f"-- library: {glob.glob(os.path.join(os.path.dirname(maskedbranch.__file__), '_C*.so'))}")
print(f"-- maskedbranch.WITH_CUDA = {maskedbranch.WITH_CUDA} (expected {want})")
sys.exit(0 if int(maskedbranch.WITH_CUDA) == want else 1)
EOF
  )
}

# find_cuobjdump VENV : the toolkit's cuobjdump, else one on PATH, else one shipped by a pip
# package of the environment (triton bundles one), else it installs nvidia-cuda-cuobjdump.
find_cuobjdump() {
  local venv=$1 c site
  for c in "${CUDA_HOME_FOUND:-}/bin/cuobjdump" "$(command -v cuobjdump || true)"; do
    if [[ -x $c ]]; then echo "$c"; return 0; fi
  done
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])') || return 1
  for attempt in 1 2; do
    c=$(find "$site" -path '*/bin/cuobjdump' -type f -perm -u+x 2>/dev/null | sort | head -n 1)
    if [[ -n $c ]]; then echo "$c"; return 0; fi
    [[ $attempt == 1 ]] && pip_get "$venv" "nvidia-cuda-cuobjdump<14" >&2
  done
  return 1
}

# check_device_code VENV SO : cuobjdump must list device code for every architecture in $ARCHS.
check_device_code() {
  local venv=$1 so=$2 cuobjdump elf ptx arch missing=0
  cuobjdump=$(find_cuobjdump "$venv") || { echo "!! no cuobjdump found"; return 1; }
  note "using $cuobjdump ($("$cuobjdump" --version | grep -o 'release [0-9.]*'))"
  elf=$("$cuobjdump" --list-elf "$so" 2>&1)
  ptx=$("$cuobjdump" --list-ptx "$so" 2>&1)
  note "cuobjdump --list-elf $(basename "$so"):"
  echo "$elf" | sed 's/^/   /'
  note "cuobjdump --list-ptx $(basename "$so"):"
  echo "$ptx" | sed 's/^/   /'
  for arch in ${ARCHS//;/ }; do
    local base=${arch%+PTX} sm
    sm="sm_${base//./}"
    if grep -q "\.${sm}\.cubin" <<<"$elf"; then
      note "device code for ${sm}: present ($(grep -c "\.${sm}\.cubin" <<<"$elf") cubins)"
    else
      echo "!! no device code (cubin) for ${sm} in $so"; missing=1
    fi
    if [[ $arch == *+PTX ]]; then
      if grep -q "\.${sm}\.ptx" <<<"$ptx"; then
        note "PTX for ${sm}: present"
      else
        echo "!! no PTX for ${sm} in $so"; missing=1
      fi
    fi
  done
  return $missing
}

# run_pytest VENV EXPECTED_WITH_CUDA PATHS... : pytest on the installed build (checked by
# scripts/pytest_check_installed.py). It runs from an empty folder outside the source tree: code
# that puts the working directory on sys.path (python -c / -m, or a CLI under test) and the worker
# processes that inherit that sys.path then cannot pick up the source tree's maskedbranch/ package,
# which has no compiled _C. Paths are relative to the repository root. Exit 5 (no tests) fails too.
run_pytest() {
  local venv=$1 want=$2 rc path; shift 2
  local cwd=$venv/pytest-cwd args=()
  mkdir -p "$cwd"
  for path in "$@"; do args+=("$ROOT/$path"); done
  note "pytest $* (from $cwd)"
  # shellcheck disable=SC2086
  (cd "$cwd" && PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" MASKEDBRANCH_EXPECT_WITH_CUDA=$want \
    "$venv/bin/pytest" -q -p no:cacheprovider -p pytest_check_installed --import-mode=append \
    --rootdir "$ROOT" ${PYTEST_ARGS:-} "${args[@]}")
  rc=$?
  if [[ $rc -eq 5 ]]; then echo "!! pytest collected no tests"; fi
  return $rc
}

part_a() {
  banner "Part (a): CUDA build (torch 2.14.1, archs $ARCHS) + full pytest suite"
  ensure_venv "$VENV_CUDA" "$TORCH_CUDA_SPEC" "${TEST_DEPS[@]}" matplotlib tqdm || return 1
  # Optional extras the tests and benchmarks use when present.
  if pip_get "$VENV_CUDA" "$TORCH_CUDA_SPEC" "torchvision==0.29.1" "${INTEGRATION_DEPS[@]}"; then
    note "$(cd / && "$VENV_CUDA/bin/python" -c 'import importlib; print(", ".join(f"{m} {importlib.import_module(m).__version__}" for m in ("torchvision", "timm", "transformers", "accelerate", "lightning")))' 2>&1 | tail -n 1)"
  else
    note "the integrations' packages could not be installed; tests that need them will skip"
  fi
  CUDA_HOME_FOUND=$(find_cuda_home) || { echo "!! no CUDA toolkit (nvcc) found"; return 1; }
  note "CUDA toolkit: $CUDA_HOME_FOUND ($("$CUDA_HOME_FOUND/bin/nvcc" --version | grep -o 'release [0-9.]*'))"
  local t0=$SECONDS
  install_package "$VENV_CUDA" "$VENV_CUDA/maskedbranch-build.log" \
    FORCE_CUDA=1 MASKEDBRANCH_CPU_ONLY=0 CUDA_HOME="$CUDA_HOME_FOUND" TORCH_CUDA_ARCH_LIST="$ARCHS" || return 1
  note "build took $((SECONDS - t0)) s"
  show_install "$VENV_CUDA" 1 || return 1
  local so
  so=$(cd / && "$VENV_CUDA/bin/python" -c 'import glob, os, maskedbranch; print(glob.glob(os.path.join(os.path.dirname(maskedbranch.__file__), "_C*.so"))[0])') || return 1
  check_device_code "$VENV_CUDA" "$so" || return 1
  run_pytest "$VENV_CUDA" 1 tests
}

part_b() {
  banner "Part (b): CMake/libtorch build + ctest"
  ensure_venv "$VENV_CUDA" "$TORCH_CUDA_SPEC" "${TEST_DEPS[@]}" || return 1
  command -v cmake >/dev/null || pip_get "$VENV_CUDA" cmake || return 1
  local cuda=OFF
  # The CUDA build of torch needs the toolkit for find_package(Torch) anyway (see CMakeLists.txt).
  CUDA_HOME_FOUND=$(find_cuda_home) || CUDA_HOME_FOUND=""
  if [[ -n $CUDA_HOME_FOUND && ${MASKEDBRANCH_CMAKE_CUDA:-1} == 1 ]]; then cuda=ON; fi
  note "MASKEDBRANCH_CUDA=$cuda, TORCH_CUDA_ARCH_LIST=$ARCHS, build folder $CMAKE_BUILD_DIR"
  mkdir -p "$CMAKE_BUILD_DIR"
  env ${CUDA_HOME_FOUND:+CUDA_HOME=$CUDA_HOME_FOUND} TORCH_CUDA_ARCH_LIST="$ARCHS" \
    cmake -S "$ROOT" -B "$CMAKE_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$VENV_CUDA/bin/python" -DMASKEDBRANCH_CUDA=$cuda \
    -DTORCH_CUDA_ARCH_LIST="$ARCHS" > "$CMAKE_BUILD_DIR/configure.log" 2>&1 \
    || { tail -n 60 "$CMAKE_BUILD_DIR/configure.log"; return 1; }
  grep -E 'maskedbranch:|CUDA NVCC flags' "$CMAKE_BUILD_DIR/configure.log" | sed 's/^/   /'
  local t0=$SECONDS
  cmake --build "$CMAKE_BUILD_DIR" -j "$MAX_JOBS" > "$CMAKE_BUILD_DIR/build.log" 2>&1 \
    || { grep -m 25 -E '(error|Error)[: ]' "$CMAKE_BUILD_DIR/build.log" | cut -c 1-400; echo "   ..."
         tail -n 25 "$CMAKE_BUILD_DIR/build.log"; return 1; }
  note "build took $((SECONDS - t0)) s"
  if [[ $cuda == ON ]]; then
    check_device_code "$VENV_CUDA" "$CMAKE_BUILD_DIR/libmaskedbranch.so" || return 1
  fi
  (cd "$CMAKE_BUILD_DIR" && ctest --output-on-failure -V | grep -vE '^(UpdateCTestConfiguration|Test project|Constructing|Checking|Parse|test [0-9]+$|Done constructing|Updating test list|Added 0 tests|[0-9]+: (Test command|Working Directory|Test timeout))')
}

# cpu_suite VENV TORCH_SPEC TITLE EXTRA_PACKAGES... : a CPU-only build against one torch release
# and the whole test suite on it (tests whose optional dependencies cannot be installed for that
# release skip, naming what is missing).
cpu_suite() {
  local venv=$1 spec=$2 title=$3; shift 3
  banner "$title"
  ensure_venv "$venv" "$spec" "${TEST_DEPS[@]}" || return 1
  if [[ $# -gt 0 ]]; then
    if pip_get "$venv" "$spec" "$@"; then
      note "$(cd / && "$venv/bin/python" -c 'import importlib; print(", ".join(f"{m} {importlib.import_module(m).__version__}" for m in ("torchvision", "timm", "transformers")))' 2>&1 | tail -n 1)"
    else
      note "optional packages ($*) could not be installed for $spec; tests that need them will skip"
    fi
  fi
  local t0=$SECONDS
  install_package "$venv" "$venv/maskedbranch-build.log" FORCE_CUDA=0 MASKEDBRANCH_CPU_ONLY=1 || return 1
  note "build took $((SECONDS - t0)) s"
  show_install "$venv" 0 || return 1
  run_pytest "$venv" 0 tests
}

# (c) A release between the floor and the newest: torch 2.13.0, a CPU-only build of torch (no
# torchvision is installable beside it, so timm-based tests skip here; (a) and (d) run them).
part_c() {
  cpu_suite "$VENV_CPU" "$TORCH_CPU_SPEC" "Part (c): CPU-only build (torch 2.13.0 CPU) + full pytest suite" \
    transformers accelerate lightning
}

# (d) The declared floor of pyproject.toml: torch 2.6.0, with the torchvision, timm and
# transformers releases that install beside it.
part_d() {
  cpu_suite "$VENV_FLOOR" "$TORCH_FLOOR_SPEC" "Part (d): CPU build at the torch floor (torch 2.6.0) + full pytest suite" \
    "torchvision==0.21.0" "${INTEGRATION_DEPS[@]}"
}

# (e) Sanitizers. Separate instrumented builds of the CPU kernels and of the CUDA kernels' host
# emulation (their own build folder; the installed build of (c) is untouched), the tests run
# against them; any report fails the part, and so does a CUDA kernel that never ran.
part_e() {
  banner "Part (e): ASan+UBSan builds of the CPU kernels and of the CUDA kernels on the host + op tests (scripts/sanitize.sh)"
  ensure_venv "$VENV_CPU" "$TORCH_CPU_SPEC" "${TEST_DEPS[@]}" || return 1
  PYTHON="$VENV_CPU/bin/python" SANITIZE_BUILD_DIR="$VENV_CPU/build-sanitize" bash "$ROOT/scripts/sanitize.sh"
}

# The environment each part works in, for pruning ((b) also builds into $CMAKE_BUILD_DIR).
declare -A VENV_OF=([a]=$VENV_CUDA [b]=$VENV_CUDA [c]=$VENV_CPU [d]=$VENV_FLOOR [e]=$VENV_CPU)

free_disk() { df -Ph "$ROOT" | awk 'NR == 2 {print $4 " free on " $6}'; }

# prune_after PART REMAINING_PARTS... : delete PART's environment when no remaining part uses it.
prune_after() {
  local part=$1 later; shift
  [[ $PRUNE_VENVS == 1 ]] || return 0
  for later in "$@"; do [[ ${VENV_OF[$later]} == "${VENV_OF[$part]}" ]] && return 0; done
  [[ $part == b ]] && rm -rf "$CMAKE_BUILD_DIR"
  rm -rf "${VENV_OF[$part]}"
  note "deleted ${VENV_OF[$part]} (no later part uses it); $(free_disk)"
}

# --quick: the suite less the tests marked `slow` (pyproject.toml registers the marker), on an
# in-place CPU build (maskedbranch/_C*.so, ignored by git) against the torch of
#   1. $PYTHON when set, else python3, if it imports torch, setuptools and the test packages
#      (pytest, hypothesis, numpy, expecttest): your environment, left as it is;
#   2. otherwise $MASKEDBRANCH_VENV_CPU (default .venv-cpu, the environment of part (c)), created
#      or reused with torch 2.13.0 (CPU), the test packages and transformers.
# MASKEDBRANCH_QUICK_ENV=current|venv forces one of the two. pytest runs from an empty folder
# outside the tree with the repository on PYTHONPATH, and stops unless the package it imports is
# this tree's (scripts/pytest_check_installed.py). PYTEST_ARGS adds pytest options; to run the
# slow tests too: PYTEST_ARGS='-m ""'.
quick_python_ok() {
  "$1" -c 'import torch, setuptools, pytest, hypothesis, numpy, expecttest' 2>/dev/null
}

quick() {
  local py want=${MASKEDBRANCH_QUICK_ENV:-} t0=$SECONDS t_env t_build t_tests rc
  banner "Quick: in-place CPU build + pytest -m 'not slow'"
  py=$(command -v "$PYTHON" || true)
  if [[ $want != venv && -n $py ]] && quick_python_ok "$py"; then
    note "using $py (it has torch and the test packages)"
  elif [[ $want == current ]]; then
    echo "!! $PYTHON lacks one of torch, setuptools, pytest, hypothesis, numpy, expecttest"; return 1
  else
    note "no environment with torch and the test packages at '$PYTHON': using $VENV_CPU"
    ensure_venv "$VENV_CPU" "$TORCH_CPU_SPEC" "${TEST_DEPS[@]}" transformers || return 1
    py=$VENV_CPU/bin/python
  fi
  (cd / && "$py" -c 'import sys, torch; print(f"-- python {sys.version.split()[0]}, torch {torch.__version__}")')
  t_env=$((SECONDS - t0))
  local log=$ROOT/build/quick-build.log
  mkdir -p "$ROOT/build"
  note "building the CPU kernels in place (log: $log)"
  if ! (cd "$ROOT" && env FORCE_CUDA=0 MASKEDBRANCH_CPU_ONLY=1 "$py" setup.py build_ext --inplace \
        --build-temp "$ROOT/build/quick-temp") > "$log" 2>&1; then
    echo "!! build failed; the last lines of $log:"; tail -n 40 "$log"; return 1
  fi
  t_build=$((SECONDS - t0 - t_env))
  note "build took $t_build s ($(grep -cE '^\[[0-9]+/[0-9]+\] ' "$log") compile/link steps; 0 = nothing changed)"
  local cwd=$ROOT/build/pytest-cwd
  mkdir -p "$cwd"
  note "pytest -m 'not slow' tests (from $cwd)"
  # shellcheck disable=SC2086
  (cd "$cwd" && PYTHONPATH="$ROOT/scripts:$ROOT${PYTHONPATH:+:$PYTHONPATH}" MASKEDBRANCH_EXPECT_FROM="$ROOT" \
    MASKEDBRANCH_EXPECT_WITH_CUDA=0 "$py" -m pytest -q -p no:cacheprovider -p pytest_check_installed \
    --import-mode=append --rootdir "$ROOT" -m "not slow" ${PYTEST_ARGS:-} "$ROOT/tests")
  rc=$?
  [[ $rc -eq 5 ]] && echo "!! pytest collected no tests"
  t_tests=$((SECONDS - t0 - t_env - t_build))
  banner "Quick: $([[ $rc -eq 0 ]] && echo passed || echo "FAILED (pytest exit $rc)") in $((SECONDS - t0)) s (environment $t_env s, build $t_build s, tests $t_tests s)"
  note "the whole matrix, every test included: bash scripts/test.sh --full"
  return $rc
}

if [[ $MODE == quick ]]; then
  quick
  exit $?
fi

declare -A STATUS SECS
ORDER=()
overall=0
read -r -a PART_LIST <<< "$PARTS"
for part in "${PART_LIST[@]}"; do
  case $part in a|b|c|d|e) ;; *) echo "unknown part '$part' in MASKEDBRANCH_PARTS (use a, b, c, d, e)"; exit 2 ;; esac
done
for i in "${!PART_LIST[@]}"; do
  part=${PART_LIST[$i]}
  start=$SECONDS
  note "disk: $(free_disk)"
  ( "part_$part" )
  rc=$?
  SECS[$part]=$((SECONDS - start))
  if [[ $rc -eq 0 ]]; then STATUS[$part]=passed; else STATUS[$part]="FAILED (exit $rc)"; overall=1; fi
  ORDER+=("$part")
  note "part ($part) ${STATUS[$part]} in ${SECS[$part]} s"
  prune_after "$part" "${PART_LIST[@]:$((i + 1))}"
done

declare -A TITLE=([a]="CUDA build + pytest suite" [b]="CMake/libtorch + ctest" [c]="torch 2.13 CPU + pytest suite"
                  [d]="torch 2.6 floor + pytest suite" [e]="ASan+UBSan build + op tests")
banner "Summary"
printf '%-6s %-28s %-18s %8s\n' part what status seconds
for part in "${ORDER[@]}"; do
  printf '%-6s %-28s %-18s %8s\n' "($part)" "${TITLE[$part]}" "${STATUS[$part]}" "${SECS[$part]}"
done
exit $overall
