#!/usr/bin/env bash
# One prepared check for a GPU machine (no internet needed), from the repository root:
#   bash benchmarks/gpu_check.sh
# 1. builds the extension in place (editable install, TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16)
#    and checks that the CUDA kernels load (cuobjdump --list-elf when available);
# 2. the GPU cases of the op tests (pytest -m cuda tests/test_ops.py tests/test_ops_checks.py
#    tests/test_pick.py),
#    first the checks of issue 17 by item, each its own step: (1) make_plan's devices, (2) hand-made
#    plans stopped by device asserts (child processes), (3) CUDA graph capture, (4) the plan
#    kernels against the reference at tile-crossing sizes; then all GPU cases (on a failure, once
#    more without -x for the full list);
# 3. the effective bandwidth of each kernel against a plain copy (inline, a few seconds), the
#    plan kernels' included;
# 4. side by side: the rest of the test suite, and compute-sanitizer memcheck and racecheck over
#    the GPU op tests (when compute-sanitizer exists);
# 5. the compiled cases on the GPU: every gate kind and the residual forms with fullgraph=True
#    through inductor against eager, a patched timm ViT, and kept="fixed" in a CUDA graph
#    (mode="reduce-overhead"), with the graphs counted and the cudagraph skips listed;
# 6. the GPU benchmarks: `python -m benchmarks --quick --device cuda` when benchmarks/ is a package,
#    else every benchmarks/bench_*.py with --device cuda (fewer repetitions than their default).
# Every step runs under `timeout` and inside one overall time budget (GPU_CHECK_BUDGET_S,
# default 480 s; the build alone is capped at GPU_CHECK_BUILD_S, default 300 s): a step that
# would start after the budget is spent is skipped and listed so.
# One failing step never stops the others. Logs and summary.txt go to $OUT (default
# ./gpu_results). The exit status is 0; read summary.txt.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-480}
START=$(date +%s)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
PY=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - $(elapsed))); }

# step NAME CAP_S CMD... : run CMD under timeout (CAP_S, or what is left of the budget),
# output to $OUT/NAME.log, one line in the summary.
step() {
  local name=$1 cap=$2
  shift 2
  local rem
  rem=$(left)
  if ((rem < 15)); then
    printf '%-16s %-22s %5s  %s\n' "SKIPPED" "$name" "-" "(time budget of ${BUDGET}s spent)" | tee -a "$SUMMARY"
    return 0
  fi
  local t=$((cap < rem ? cap : rem)) t0 rc status
  t0=$(date +%s)
  # through bash -c so that CMD may be one of the exported functions below
  timeout --kill-after=15 "$t" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  status=PASS
  if ((rc == 124 || rc == 137)); then status="TIMEOUT(${t}s)"; elif ((rc != 0)); then status="FAIL(rc=$rc)"; fi
  printf '%-16s %-22s %4ss  %s\n' "$status" "$name" "$(($(date +%s) - t0))" "$OUT/$name.log" | tee -a "$SUMMARY"
  return $rc
}

find_tool() {  # find_tool NAME: on PATH, in the CUDA toolkit, or in torch/triton's pip packages
  local name=$1 c
  c=$(command -v "$name" 2>/dev/null) && { echo "$c"; return 0; }
  for c in "${CUDA_HOME:-/usr/local/cuda}/bin/$name" /usr/local/cuda*/bin/"$name" \
    /usr/local/cuda*/compute-sanitizer/"$name"; do
    [[ -x $c ]] && { echo "$c"; return 0; }
  done
  c=$("$PY" - "$name" 2>/dev/null <<'EOF'
import glob, os, site, sys
for s in site.getsitepackages():
    for hit in glob.glob(os.path.join(s, "**", "bin", sys.argv[1]), recursive=True):
        print(hit); raise SystemExit
EOF
)
  [[ -n $c ]] && { echo "$c"; return 0; }
  return 1
}

export OUT PY
export -f find_tool

# ---------------------------------------------------------------------------------------------
environment() {
  date -u
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -40
  nvidia-smi || true
  command -v nvcc && nvcc --version | tail -2
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  nproc; free -g
}
export -f environment
step environment 30 environment

build() {
  # An editable install; if pip itself fails before compiling (e.g. no PEP 660 support in
  # this environment), an in-place build_ext (PYTHONPATH holds the repository root).
  try_build() {
    "$PY" -m pip install --no-build-isolation --no-deps -v -e . 2>&1 | tee "$OUT/build_attempt.log"
    ((PIPESTATUS[0] == 0)) && return 0
    grep -q "Error compiling objects" "$OUT/build_attempt.log" && return 1
    echo "== pip failed before compiling; building in place with setup.py build_ext --inplace"
    "$PY" setup.py build_ext --inplace
  }
  try_build
}
export -f build
step build "${GPU_CHECK_BUILD_S:-300}" build

check_import() {
  "$PY" - <<'EOF' || return 1
import os, torch, maskedbranch as mb
print("maskedbranch from", os.path.dirname(mb.__file__), "WITH_CUDA =", mb.WITH_CUDA)
assert mb.WITH_CUDA
x = torch.arange(12.0, device="cuda").view(6, 2)
plan = mb.make_plan(torch.tensor([1, 0, -1, 1, 0, 0], device="cuda"), 2)
parts = mb.gather(x, plan)
print("gather:", [p.cpu().tolist() for p in parts])
print("combine:", mb.combine(parts, plan).cpu().tolist())
EOF
  local cuobjdump
  if cuobjdump=$(find_tool cuobjdump); then "$cuobjdump" --list-elf maskedbranch/_C*.so; fi
}
export -f check_import
step import 60 check_import

# ---------------------------------------------------------------------------------------------
# The GPU cases of the op tests (the `cuda` mark: the device fixture's CUDA cases and the
# GPU-only tests). Issue 17's items first, each its own step, so the summary reads item by item.
OPS_TESTS="tests/test_ops.py tests/test_ops_checks.py tests/test_pick.py"
pytest_ops() { "$PY" -m pytest -q -p no:cacheprovider -rfs -m cuda $OPS_TESTS "$@"; }
export OPS_TESTS
export -f pytest_ops
step item1_devices 60 pytest_ops -k "make_plan or normalize or shipping"
step item2_hand_made 120 pytest_ops -k "hand_made"
step item3_graphs 60 pytest_ops -k "graph_capture"
step item4_plan 90 pytest_ops -k "plan_matches_reference or plan_integer or plan_stable or readback"
if ! step ops_cuda 240 pytest_ops -x --durations=15; then
  step ops_cuda_all 200 pytest_ops
fi

# Effective bandwidth of every kernel against a plain device copy (x.clone()), alone on the GPU.
kernel_bandwidth() {
  "$PY" - <<'PYEOF'
import torch, maskedbranch as mb
ops = torch.ops.maskedbranch

def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]

print(torch.cuda.get_device_name(0))
print(f"{'dtype':>9} {'B':>6} {'D':>6} {'N':>3} {'op':<28} {'ms':>8} {'GB/s':>8} {'vs copy':>8}")
for dtype in (torch.float32, torch.bfloat16):
    for B, D, N in ((32768, 1024, 4), (65536, 96, 2), (4096, 4099, 8), (8192, 256, 100)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, D, device="cuda", dtype=dtype, generator=g)
        gate = torch.rand(B, N, device="cuda", generator=g)
        gate = torch.where(gate < 0.6, torch.zeros_like(gate), gate)
        ids = torch.randint(-1, N, (B,), device="cuda", generator=g)
        plan = mb.make_plan(gate, N)
        M, ro, rb, rp = plan.num_entries, plan.row_offsets, plan.row_branch, plan.row_pos
        ys = ops.gather(x, plan.rows, None, plan.counts)
        e = x.element_size()
        # plan: the gate read once and its outputs written once (8 bytes an index); the
        # temporaries (live matrices, scans) are not counted, so this is a lower bound
        cases = [  # name, fn, bytes moved
            ("copy (x.clone())", lambda: x.clone(), 2 * B * D * e),
            ("plan (float gate)", lambda: ops.plan(gate, N), B * N * 4 + 24 * M + 8 * B),
            ("plan (ids gate)", lambda: ops.plan(ids, N), B * 8 + 24 * B + 8 * B),
            ("gather", lambda: ops.gather(x, plan.rows, None, plan.counts), 2 * M * D * e),
            ("gather (weights)", lambda: ops.gather(x, plan.rows, gate, plan.counts), 2 * M * D * e),
            ("combine (base, weights)", lambda: ops.combine(x, ys, gate, ro, rb, rp), (M + 2 * B) * D * e),
            ("combine (no base)", lambda: ops.combine(None, ys, None, ro, rb, rp), (M + B) * D * e),
            ("combine_weights_backward", lambda: ops.combine_weights_backward(x, ys, ro, rb, rp), (M + B) * D * e),
        ]
        copy_bw = None
        for name, fn, nbytes in cases:
            t = bench(fn)
            bw = nbytes / t / 1e9
            copy_bw = copy_bw or bw
            print(f"{str(dtype)[6:]:>9} {B:>6} {D:>6} {N:>3} {name:<28} {t * 1e3:8.3f} {bw:8.0f} {bw / copy_bw:8.2f}")
PYEOF
}
export -f kernel_bandwidth
step kernel_bandwidth 90 kernel_bandwidth

# torch.compile on the GPU: fullgraph through inductor against eager, and a CUDA graph.
compiled_cases() {
  "$PY" - <<'PYEOF'
import copy, torch, maskedbranch as mb
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
dev = "cuda"
def mlp(d=256):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(dev)
def check(name, module, calls, mode=None, steps=6, fullgraph=True):
    torch.compiler.reset(); counters.clear()
    twin = copy.deepcopy(module)
    compiled = torch.compile(twin, fullgraph=fullgraph, mode=mode)
    worst = 0.0
    for s in range(steps):
        args = calls(s)
        x = torch.randn(512, 256, device=dev)
        torch.manual_seed(s); want = module(x, *args)
        torch.manual_seed(s); got = compiled(x, *args)
        got.sum().backward(); want.sum().backward()
        worst = max(worst, float((got - want).abs().max()))
    print(f"{name:<34} max|compiled - eager| {worst:.2e}  graphs {counters['stats']['unique_graphs']}  "
          f"breaks {sum(counters['graph_break'].values())}  cudagraph skips {dict(counters['inductor']) and {k: v for k, v in counters['inductor'].items() if 'cudagraph' in k}}")
    assert worst < 1e-3, name
gen = torch.Generator().manual_seed(1)
experts = mb.MaskedBranch([mlp() for _ in range(8)])
check("ids gate (CPU gate, CUDA x)", experts, lambda s: (torch.randint(-1, 8, (512,), generator=gen),))
check("weights gate (device gate)", experts, lambda s: ((torch.rand(512, 8, device=dev) * (torch.rand(512, 8, device=dev) < 0.25)),))
check("int path", experts, lambda s: (s % 8,))
check("ResidualDropPath row 0.3", mb.ResidualDropPath(mlp(), 0.3), lambda s: ())
check("ResidualDropPath batch 0.3", mb.ResidualDropPath(mlp(), 0.3, mode="batch"), lambda s: ())
fixed = mb.ResidualDropPath(mlp(), 0.3, kept="fixed")
check("kept=fixed, reduce-overhead", fixed, lambda s: (), mode="reduce-overhead", steps=8)
try:
    import timm
    from maskedbranch.integrations import timm as mb_timm
    vit = timm.create_model("vit_tiny_patch16_224", drop_path_rate=0.3, img_size=64, num_classes=10).to(dev)
    mb_timm.patch(vit)
    torch.compiler.reset(); counters.clear()
    cv = torch.compile(copy.deepcopy(vit), fullgraph=True)
    for s in range(4):
        x = torch.randn(32, 3, 64, 64, device=dev)
        torch.manual_seed(s); a = cv(x); torch.manual_seed(s); b = vit(x)
        a.sum().backward(); b.sum().backward()
    print(f"{'patched timm ViT':<34} max|compiled - eager| {float((a - b).abs().max()):.2e}  graphs {counters['stats']['unique_graphs']}")
except ImportError as e:
    print("timm not installed:", e)
PYEOF
}
export -f compiled_cases
step compiled 150 compiled_cases

# The rest of the suite (the GPU op tests ran above); the sanitizers run beside it, over the GPU
# op tests without the slow ones (opcheck, gradcheck, >2^31 elements) and the child processes
# that trip device asserts on purpose.
SANITIZER=$(find_tool compute-sanitizer || true)
SAN_K="not opcheck and not gradcheck and not int64 and not hand_made"
if [[ -n $SANITIZER ]]; then
  # No caching allocator, so out-of-bounds accesses are not hidden inside pooled blocks.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 170 "$SANITIZER" --tool memcheck --error-exitcode 17 \
    --print-limit 50 "$PY" -m pytest -x -q -p no:cacheprovider -m cuda $OPS_TESTS -k "$SAN_K" &
  # Shared memory: the plan kernels' tiles and combine_weights_backward's reduction.
  step racecheck 170 "$SANITIZER" --tool racecheck --error-exitcode 17 --print-limit 50 \
    "$PY" -m pytest -x -q -p no:cacheprovider -m cuda $OPS_TESTS \
    -k "$SAN_K and (combine_weights_backward or deterministic or plan_matches_reference)" &
else
  echo "compute-sanitizer not found" | tee -a "$SUMMARY"
fi
step test_suite 200 "$PY" -m pytest -q -p no:cacheprovider -rf tests --ignore=tests/test_ops.py \
  --ignore=tests/test_ops_checks.py --ignore=tests/test_pick.py
wait

# ---------------------------------------------------------------------------------------------
mkdir -p "$OUT/bench"
if [[ -f benchmarks/__main__.py ]]; then
  # The benchmark package: python -m benchmarks [--quick] [--device cuda] [--out DIR]
  args=()
  grep -q -- '"--device"' benchmarks/__main__.py && args+=(--device cuda)
  grep -q -- '"--quick"' benchmarks/__main__.py && args+=(--quick)
  grep -q -- '"--out"' benchmarks/__main__.py && args+=(--out "$OUT/bench")
  step benchmarks 180 "$PY" -m benchmarks "${args[@]}"
else
  for bench in benchmarks/bench_*.py; do
    [[ -e $bench ]] || continue
    args=()
    grep -q -- '"--device"' "$bench" && args+=(--device cuda)
    # shorter runs than the defaults, where the benchmark has the knob
    grep -q -- '"--draws"' "$bench" && args+=(--draws 6)
    grep -q -- '"--reps"' "$bench" && args+=(--reps 6)
    step "bench_$(basename "$bench" .py)" 90 env MASKEDBRANCH_BENCH_OUT="$OUT/bench" "$PY" "$bench" "${args[@]}"
  done
fi

# ---------------------------------------------------------------------------------------------
{
  echo
  echo "total $(elapsed)s (budget ${BUDGET}s)"
  for log in "$OUT"/*.log; do
    name=$(basename "$log" .log)
    if grep -qE "^(FAIL|TIMEOUT)[^ ]* +$name " "$SUMMARY"; then
      echo
      echo "==== tail of $name.log ===="
      tail -40 "$log"
    fi
  done
} >>"$SUMMARY"
echo
cat "$SUMMARY"
exit 0
