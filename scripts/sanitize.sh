#!/usr/bin/env bash
# Sanitizer run: builds the CPU kernels with AddressSanitizer and UndefinedBehaviorSanitizer
# (-fsanitize=address,undefined, out of tree: nothing in the repository or in any installed
# build changes) and runs the op tests against that build; builds the CUDA kernels' host
# emulation the same way (tests/cuda_emu) and runs every CUDA kernel under the sanitizers. Fails
# on any sanitizer report.
#
#   bash scripts/sanitize.sh [TEST_FILE...]
#
# Default tests: tests/test_ops.py (the op tests), tests/test_bad_inputs.py (every error path of
# the kernels' argument checks), tests/test_masked_branch.py (the module's direct C++ entry
# points: anchors into history, shared dead-parameter nodes, signature capsules),
# tests/test_parameter_table.py (the data-parallel layer's loops over parameters, raw copies included),
# tests/test_fuzz.py at half its examples (odd shapes, layouts and gate patterns through the
# kernels; MASKEDBRANCH_FUZZ_SCALE overrides the 0.5), and tests/cuda_emu: csrc/cuda's kernels
# compiled for the host against tests/cuda_emu/cuda_emulation.h and compared with the CPU kernels
# and the reference; the run fails unless every __global__ function, and every instantiation
# the launch code can start, ran (tests/emu_hooks.py prints the count). The emulation is built only
# when a test under tests/cuda_emu is asked for.
#
# Knobs (environment):
#   PYTHON              interpreter with torch, pytest, hypothesis, expecttest and ninja
#                       (default: .venv-cpu/bin/python when it exists, else python3)
#   SANITIZE_BUILD_DIR  build folder (default: build/sanitize in the repository; reused, so a
#                       second run only recompiles what changed)
#   MAX_JOBS            parallel compile jobs (default: the number of cores)
#   CXX                 compiler (default: c++); gcc and clang both work
#
# How it works: Python itself is not instrumented, so the ASan runtime must be the first library
# loaded: it is preloaded (LD_PRELOAD), together with libstdc++ (ASan's __cxa_throw interceptor
# needs the real one resolved at start-up, or the first C++ exception aborts). Leak detection is
# off (the interpreter never frees everything); every other ASan/UBSan error halts the run with a
# non-zero status (-fno-sanitize-recover, halt_on_error). Before the real run, two canaries (a
# heap overflow and a signed-integer overflow in a small library loaded the same way) must be
# reported, so a silently broken set-up cannot pass. On a GPU, compute-sanitizer checks the CUDA
# kernels themselves (benchmarks/gpu_check.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $ROOT/.venv-cpu/bin/python ]]; then PYTHON=$ROOT/.venv-cpu/bin/python; else PYTHON=python3; fi
fi
BUILD=${SANITIZE_BUILD_DIR:-$ROOT/build/sanitize}
CXX=${CXX:-c++}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [[ $# -gt 0 ]]; then TESTS=("$@"); else TESTS=(tests/test_ops.py tests/test_ops_checks.py tests/test_bad_inputs.py tests/test_masked_branch.py tests/test_parameter_table.py tests/test_fuzz.py tests/cuda_emu); fi
export MASKEDBRANCH_FUZZ_SCALE=${MASKEDBRANCH_FUZZ_SCALE:-0.5}

note() { printf -- '-- %s\n' "$*"; }
die() { printf '!! %s\n' "$*" >&2; exit 1; }

SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
ASAN_LIB=$("$CXX" -print-file-name=libasan.so)
STDCXX_LIB=$("$CXX" -print-file-name=libstdc++.so)
[[ -f $ASAN_LIB ]] || die "$CXX has no AddressSanitizer runtime (libasan.so not found)"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0:print_summary=1:strict_init_order=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:report_error_type=1
SAN_PRELOAD="$ASAN_LIB $STDCXX_LIB"
REPORT='ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|AddressSanitizer: CHECK failed'

mkdir -p "$BUILD"
note "python: $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
note "compiler: $("$CXX" --version | head -n 1); build folder: $BUILD"

# 1. Canaries: the set-up must report a heap overflow and a signed overflow.
canary_dir=$BUILD/canary
mkdir -p "$canary_dir"
cat > "$canary_dir/canary.cpp" <<'EOF'
#include <climits>
#include <cstdlib>
extern "C" int heap_overflow(int i) {
  int* p = static_cast<int*>(std::malloc(4 * sizeof(int)));
  p[0] = 1;
  int v = p[i];  // i = 4: one past the end
  std::free(p);
  return v;
}
extern "C" int signed_overflow(int i) { return INT_MAX - 1 + i; }  // i = 2: overflow
EOF
"$CXX" $SAN_FLAGS -shared -fPIC -o "$canary_dir/libcanary.so" "$canary_dir/canary.cpp"
for fn in heap_overflow signed_overflow; do
  arg=$([[ $fn == heap_overflow ]] && echo 4 || echo 2)
  set +e
  out=$(cd "$canary_dir" && LD_PRELOAD="$SAN_PRELOAD" "$PYTHON" -c \
    "import ctypes; print(ctypes.CDLL('./libcanary.so').$fn($arg))" 2>&1)
  rc=$?
  set -e
  if [[ $rc -eq 0 ]] || ! grep -Eq "$REPORT" <<<"$out"; then
    echo "$out" | tail -n 20
    die "canary $fn was not reported (exit $rc): the sanitizer set-up does not work"
  fi
  note "canary $fn: reported ($(grep -Eo 'heap-buffer-overflow|signed integer overflow' <<<"$out" | head -n 1)), exit $rc"
done

# 2. Build the CPU kernels with the sanitizers, out of tree.
note "building the CPU kernels with $SAN_FLAGS (log: $BUILD/build.log)"
t0=$SECONDS
if ! (cd "$ROOT" && env CFLAGS="$SAN_FLAGS" LDFLAGS="-fsanitize=address,undefined" CC="${CC:-cc}" CXX="$CXX" \
      MASKEDBRANCH_CPU_ONLY=1 FORCE_CUDA=0 "$PYTHON" setup.py -q build_ext \
      --build-temp "$BUILD/temp" --build-lib "$BUILD/lib") > "$BUILD/build.log" 2>&1; then
  tail -n 60 "$BUILD/build.log"
  die "sanitizer build failed"
fi
note "build took $((SECONDS - t0)) s"
so=$(find "$BUILD/lib/maskedbranch" -maxdepth 1 -name '_C*.so' | head -n 1)
[[ -n $so ]] || die "no maskedbranch/_C*.so under $BUILD/lib"
nm -D "$so" | grep __asan_ > /dev/null || die "$so is not instrumented"  # (no grep -q: SIGPIPE + pipefail)

# 2b. The CUDA kernels' host emulation, with the same flags, when its tests are asked for.
emu_env=()
for t in "${TESTS[@]}"; do
  [[ $(cd "$ROOT" && realpath -m "$t") == "$ROOT/tests/cuda_emu"* ]] || continue
  note "building the CUDA kernels' host emulation with the sanitizers (log: $BUILD/cuda_emu.log)"
  t0=$SECONDS
  if ! "$PYTHON" "$ROOT/tests/cuda_emu/build.py" --out "$BUILD/cuda_emu" --cflags="$SAN_FLAGS" \
      --ldflags="-fsanitize=address,undefined" > "$BUILD/cuda_emu.log" 2>&1; then
    tail -n 60 "$BUILD/cuda_emu.log"
    die "emulation build failed"
  fi
  emu_lib=$(tail -n 1 "$BUILD/cuda_emu.log")
  [[ -f $emu_lib ]] || die "the emulation build named no library: $emu_lib"
  nm -D "$emu_lib" | grep __asan_ > /dev/null || die "$emu_lib is not instrumented"
  note "build took $((SECONDS - t0)) s: $emu_lib"
  # REQUIRED: a missing library fails instead of skipping; SANITIZED: the tests that expect an
  # AddressSanitizer report run; COVERAGE: when the whole folder runs, every kernel must have run.
  emu_env=(MASKEDBRANCH_CUDA_EMU_LIB="$emu_lib" MASKEDBRANCH_CUDA_EMU_REQUIRED=1 MASKEDBRANCH_CUDA_EMU_SANITIZED=1)
  for u in "${TESTS[@]}"; do
    if [[ $(cd "$ROOT" && realpath -m "$u") == "$ROOT/tests/cuda_emu" ]]; then emu_env+=(MASKEDBRANCH_CUDA_EMU_COVERAGE=1); fi
  done
  break
done

# 3. A package of the Python sources plus the instrumented library, imported ahead of any install.
pkg=$BUILD/pkg
rm -rf "$pkg" && mkdir -p "$pkg"
(cd "$ROOT" && find maskedbranch -name '*.py' -print0 | while IFS= read -r -d '' f; do
  mkdir -p "$pkg/$(dirname "$f")" && cp "$f" "$pkg/$f"; done)
cp "$so" "$pkg/maskedbranch/"

# 4. The tests, from outside the repository (its maskedbranch/ must not shadow the build).
run_dir=$BUILD/run
mkdir -p "$run_dir"
abs_tests=()
for t in "${TESTS[@]}"; do abs_tests+=("$(cd "$ROOT" && realpath "$t")"); done
# The library is loaded with torch.ops.load_library (no Python module): find it in the maps.
where=$(cd "$run_dir" && PYTHONPATH="$pkg" LD_PRELOAD="$SAN_PRELOAD" "$PYTHON" -c \
  'import maskedbranch; print(*sorted({l.split()[-1] for l in open("/proc/self/maps") if "/maskedbranch/_C" in l and l.rstrip().endswith(".so")}))')
[[ $where == "$pkg/maskedbranch/_C"*.so ]] || die "loaded the maskedbranch library from '$where', not from $pkg"
note "maskedbranch library = $where"
note "pytest ${TESTS[*]} (ASan + UBSan; log: $BUILD/test.log)"
# --capture=sys: pytest captures Python's output only, so a report (written to file descriptor
# 2 by the sanitizer runtime, just before it halts the process) reaches the log instead of
# vanishing with pytest's captured output.
set +e
(cd "$run_dir" && env PYTHONPATH="$pkg" LD_PRELOAD="$SAN_PRELOAD" "${emu_env[@]}" "$PYTHON" -m pytest -q \
  --capture=sys -p no:cacheprovider --rootdir="$ROOT" "${abs_tests[@]}") 2>&1 | tee "$BUILD/test.log"
rc=${PIPESTATUS[0]}
set -e
if grep -Eq "$REPORT" "$BUILD/test.log"; then
  grep -En -A 30 "$REPORT" "$BUILD/test.log" | head -n 80
  die "sanitizer report(s) above"
fi
[[ $rc -eq 0 ]] || die "pytest exited with $rc under the sanitizers"
note "clean: no AddressSanitizer or UndefinedBehaviorSanitizer report"
