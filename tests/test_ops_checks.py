"""What the compiled ops refuse, and where plans live, on every device (harness.DEVICES): bad gates
and arguments raise a Python exception naming the argument (the same on the CPU and CUDA), and
the ops keep working; unsupported dtypes (float8, float4, complex, integers); hand-made plans
(the CPU raises; a GPU stops the kernel with a device assert, checked in a child process);
make_plan's device handling (tested with device objects and meta tensors, no GPU needed); CUDA
graph capture, synchronization and streams (GPU only); a CPU-only build given CUDA tensors."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import maskedbranch as mb
from harness import GPU, random_gate
from maskedbranch import _ops
from maskedbranch import functional as F

ops = torch.ops.maskedbranch
def cuda_only(test):
    """GPU-only tests carry the `cuda` mark, like the CUDA cases of the device fixture."""
    return pytest.mark.cuda(pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")(test))


def error_of(fn):
    """(type, message without the C++ backtrace) of what fn raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared by the callers
        return type(e), str(e).split("\nException raised from")[0]
    return None


def good_call(device):
    """A small gather -> combine round trip, to show that the ops still work."""
    plan = mb.make_plan(torch.tensor([0, 1, -1], device=device), 2)
    out = F.combine([y * (i + 1) for i, y in enumerate(F.gather(torch.ones(3, 2, device=device), plan))], plan)
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]


# ---------------------------------------------------------------------------------------------
# bad gates: the same exception and message on every device


def _many_ids():
    ids = torch.randint(-1, 3, (100_000,), generator=torch.Generator().manual_seed(5))
    ids[[777, 50_000, 99_999]] = torch.tensor([9, -5, 3])
    return ids


def _many_weights():
    w = torch.rand(3000, 7, generator=torch.Generator().manual_seed(6))
    w[1234, 5], w[2000, 0], w[2999, 6] = float("inf"), float("nan"), float("-inf")
    return w


BAD_GATES = [
    (lambda: torch.zeros(3, 2, 2), 2, ValueError, r"gate: expected branch ids \[B\] or a mask/weights \[B, 2\]"),
    (lambda: torch.zeros(3, 3), 2, ValueError, r"gate: expected shape \[B, 2\] \(one column per branch\)"),
    (lambda: torch.tensor([0.0, 1.0]), 2, TypeError, "gate: a 1-D gate holds one integer branch id per row"),
    (lambda: torch.tensor([True, False]), 2, TypeError, "gate: a 1-D gate holds one integer"),
    (lambda: torch.zeros(2, 2, dtype=torch.int32), 2, TypeError, "gate: a 2-D gate must be bool or float64/"),
    (lambda: torch.zeros(2, dtype=torch.long), 0, ValueError, "num_branches: expected at least 1 branch, got 0"),
    (lambda: torch.tensor([0, 2]), 2, IndexError, r"gate: branch id 2 at row 1 is out of range; expected -1 \(no branch\) to 1"),
    (lambda: torch.tensor([0, -2, 5, 7]), 2, IndexError, "gate: branch id -2 at row 1 is out of range"),
    (lambda: torch.tensor([255, 0], dtype=torch.uint8), 3, IndexError, "gate: branch id 255 at row 0"),
    (lambda: torch.tensor([4, 1], dtype=torch.int8), 3, IndexError, "gate: branch id 4 at row 0"),
    (_many_ids, 3, IndexError, "gate: branch id 9 at row 777 is out of range"),
    (lambda: torch.tensor([[0.5, float("nan")]]), 2, ValueError, "gate: weight nan at row 0, branch 1 is not finite"),
    (lambda: torch.tensor([[float("inf"), 1.0]], dtype=torch.float64), 2, ValueError, "gate: weight inf at row 0, branch 0"),
    (_many_weights, 7, ValueError, "gate: weight inf at row 1234, branch 5 is not finite"),
    (lambda: _many_weights().half(), 7, ValueError, "gate: weight inf at row 1234, branch 5 is not finite"),
    (lambda: _many_weights().bfloat16(), 7, ValueError, "gate: weight inf at row 1234, branch 5 is not finite"),
]


@pytest.mark.parametrize("case", range(len(BAD_GATES)))
def test_bad_gates(device, case):
    make, n, exc, msg = BAD_GATES[case]
    gate = make()
    with pytest.raises(exc, match=msg):
        mb.make_plan(gate.to(device), n)
    assert error_of(lambda: ops.plan(gate.to(device), n)) == error_of(lambda: ops.plan(gate, n))
    good_call(device)


# ---------------------------------------------------------------------------------------------
# unsupported dtypes: refused with the documented message before any kernel runs

FLOATS = "expected float64, float32, float16 or bfloat16, got"
UNSUPPORTED = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")
               if hasattr(torch, name)] + [torch.complex64, torch.int32]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_unsupported_dtypes(device, dtype):
    offsets, rows, ro, rb, rp = ops.plan(torch.tensor([0, 1, 0], device=device), 2)
    converted = dtype in (torch.complex64, torch.int32)
    bad = torch.zeros(3, 4, device=device).to(dtype) if converted else torch.empty(3, 4, dtype=dtype, device=device)
    good = torch.zeros(3, 4, device=device)
    ys = [good[:2], good[:1]]
    name = {torch.complex64: "ComplexFloat", torch.int32: "Int"}.get(dtype, str(dtype).replace("torch.", ""))
    calls = [
        (lambda: ops.gather(bad, rows, None, [2, 1]), "x"),
        (lambda: ops.gather(good, rows, bad[:, :2], [2, 1]), "weights"),
        (lambda: ops.combine(bad, ys, None, ro, rb, rp), "base"),
        (lambda: ops.combine(None, [bad[:2], bad[:1]], None, ro, rb, rp), r"ys\[0\]"),
        (lambda: ops.combine(None, ys, bad[:, :2], ro, rb, rp), "weights"),
        (lambda: ops.combine_weights_backward(bad, ys, ro, rb, rp), "grad"),
    ]
    for call, arg in calls:
        with pytest.raises(TypeError, match=f"^{arg}: {FLOATS} (?i:{name})"):
            call()
    if not converted:
        with pytest.raises(TypeError, match=f"gate: a 2-D gate must be bool or float64/float32/float16/bfloat16, got dtype (?i:{name})"):
            ops.plan(torch.empty(3, 2, dtype=dtype, device=device), 2)
    good_call(device)


# ---------------------------------------------------------------------------------------------
# bad op arguments: an exception that names the argument, the same on every device


def test_bad_op_arguments(device):
    offsets, rows, ro, rb, rp = ops.plan(torch.tensor([0, 1, 1], device=device), 2)
    x = torch.randn(3, 4, device=device)
    ys = ops.gather(x, rows, None, [1, 2])
    cases = [
        (lambda: ops.gather(x, rows, None, [2, 2]), ValueError, "counts: they add up to 4 rows but rows holds 3"),
        (lambda: ops.gather(x, rows, None, [-1, 4]), ValueError, r"counts: expected non-negative row counts, got \[-1, 4\]"),
        (lambda: ops.gather(x, rows, None, []), ValueError, "counts: expected one row count per branch, got none"),
        (lambda: ops.gather(x, rows.int(), None, [1, 2]), TypeError, "rows: expected an int64 plan tensor, got Int"),
        (lambda: ops.gather(x, rows[None], None, [1, 2]), ValueError, "rows: expected a 1-D plan tensor"),
        (lambda: ops.gather(torch.tensor(1.0, device=device), rows, None, [1, 2]), ValueError, "x: expected at least one dimension"),
        (lambda: ops.gather(x, rows, torch.ones(3, 3, device=device), [1, 2]), ValueError, r"weights: expected shape \[3, 2\], got \[3, 3\]"),
        (lambda: ops.combine(None, [], None, ro, rb, rp), ValueError, "ys: expected one output per branch, got an empty list"),
        (lambda: ops.combine(None, [ys[0], ys[1].double()], None, ro, rb, rp), TypeError, r"ys\[1\]: expected dtype Float like ys\[0\], got Double"),
        (lambda: ops.combine(None, [ys[0], ys[1][:, :3]], None, ro, rb, rp), ValueError, r"ys\[1\]: expected trailing shape \[4\] like ys\[0\]"),
        (lambda: ops.combine(None, [ys[0], x], None, ro, rb, rp), ValueError, "ys: the branch outputs hold 4 rows in all but the plan routes 3"),
        (lambda: ops.combine(x.double(), ys, None, ro, rb, rp), TypeError, r"ys\[0\]: expected dtype Double like base, got Float"),
        (lambda: ops.combine(x[:2], ys, None, ro, rb, rp), ValueError, "base: the plan is for 3 rows but base has 2"),
        (lambda: ops.combine(None, ys, torch.ones(3, 3, device=device), ro, rb, rp), ValueError, r"weights: expected shape \[3, 2\]"),
        (lambda: ops.combine(None, ys, None, ro, rb[:2], rp), ValueError, "row_branch: expected 3 entries like row_pos, got 2"),
        (lambda: ops.combine(None, ys, None, ro[:0], rb, rp), ValueError, "row_offsets: expected B \\+ 1 entries, got none"),
        (lambda: ops.combine(None, ys, None, ro.float(), rb, rp), TypeError, "row_offsets: expected an int64 plan tensor"),
        (lambda: ops.combine_weights_backward(x[:2], ys, ro, rb, rp), ValueError, "grad: the plan is for 3 rows but grad has 2"),
        (lambda: ops.combine_weights_backward(x, ys[:1], ro, rb, rp), ValueError, "ys: the branch outputs hold 1 rows"),
    ]
    if device != "cpu":  # mixed devices name the argument
        cases += [
            (lambda: ops.gather(x, rows.cpu(), None, [1, 2]), ValueError, "rows: expected a tensor on cuda:0 like x, got one on cpu"),
            (lambda: ops.combine(None, ys, None, ro, rb, rp.cpu()), ValueError, r"row_pos: expected a tensor on cuda:0 like ys\[0\]"),
        ]
    for k, (call, exc, msg) in enumerate(cases):
        with pytest.raises(exc, match=msg):
            call()
        with pytest.raises(exc, match=msg):  # no state consumed by the failing call
            call()
    good_call(device)


# ---------------------------------------------------------------------------------------------
# hand-made plans: the CPU raises on the host; a GPU asserts on the device, which leaves the
# CUDA context unusable, so each GPU case runs in a child process.

# (op call on tensors made on `dev`, exception type on the CPU, CPU message, device assert message)
HAND_MADE = {
    # the plan ends before its last entry: an entry would be dropped silently without the check
    "ends": ("ops.combine(None, [t([[1.0], [2.0]])], None, i([0, 1, 1]), i([0, 0]), i([0, 1]))",
             ValueError, "row_offsets: expected to run from 0 to 2, got 0 to 1", "row_offsets: expected to end"),
    "start": ("ops.combine(t([[1.0], [2.0]]), [t([[1.0], [2.0]])], None, i([1, 1, 2]), i([0, 0]), i([0, 1]))",
              ValueError, "row_offsets: expected to run from 0 to 2, got 1 to 2", "row_offsets: expected to start at 0"),
    "descending": ("ops.combine(None, [t([[1.0], [2.0]])], None, i([0, 2, 1, 2]), i([0, 0]), i([0, 1]))",
                   ValueError, "row_offsets: not ascending at row 1", "row_offsets: not ascending"),
    "branch": ("ops.combine_weights_backward(t([[1.0], [2.0]]), [t([[1.0], [2.0]])], i([0, 1, 2]), i([0, 1]), i([0, 1]))",
               IndexError, r"row_branch: entry 1 = 1 is out of range \[0, 1\)", "row_branch: entry out of range"),
    "position": ("ops.combine(None, [t([[1.0]]), t([[2.0]])], None, i([0, 1, 2]), i([0, 1]), i([0, 0]))",
                 IndexError, r"row_pos: entry 1 = 0 is outside branch 1's rows \[1, 2\)", "row_pos: entry outside"),
    "rows": ("ops.gather(t([[1.0], [2.0]]), i([0, 2]), None, [1, 1])",
             IndexError, r"rows: entry 1 = 2 is out of range \[0, 2\)", "rows: entry out of range"),
    "empty rows": ("ops.gather(t([[], []]), i([5]), None, [1])",
                   IndexError, r"rows: entry 0 = 5 is out of range \[0, 2\)", "rows: entry out of range"),
    "no batch": ("ops.combine(None, [t([[1.0]])[:0]], None, i([1]), i([]), i([]))",
                 ValueError, "row_offsets: expected to run from 0 to 0, got 1 to 1", "row_offsets: expected to run from 0"),
}


def _run_hand_made(code, device):
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    i = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return eval(code, {"ops": ops, "t": t, "i": i})


@pytest.mark.parametrize("case", list(HAND_MADE))
def test_hand_made_plans_are_rejected(device, case):
    code, exc, cpu_msg, device_msg = HAND_MADE[case]
    if device == "cpu":
        with pytest.raises(exc, match=cpu_msg):
            _run_hand_made(code, device)
        good_call(device)
        return
    script = textwrap.dedent(f"""
        import torch, maskedbranch
        ops = torch.ops.maskedbranch
        t = lambda v: torch.tensor(v, device="cuda")
        i = lambda v: torch.tensor(v, dtype=torch.long, device="cuda")
        try:
            {code}
            torch.cuda.synchronize()
            print("NO ERROR")
        except RuntimeError as e:
            print("RAISED", str(e).splitlines()[0])
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(mb.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert "RAISED" in out and "device-side assert" in out, out
    assert device_msg in out, out


def test_hand_made_valid_plan_is_accepted(device):
    """A plan written by hand that the plan op would also produce (ids [1, 0, 1, -1, 0])."""
    i = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    x = torch.arange(10.0, device=device).view(5, 2)
    parts = ops.gather(x, i([1, 4, 0, 2]), None, [2, 2, 0])
    assert [p.tolist() for p in parts] == [[[2.0, 3.0], [8.0, 9.0]], [[0.0, 1.0], [4.0, 5.0]], []]
    out = ops.combine(None, parts, None, i([0, 1, 2, 3, 3, 4]), i([1, 0, 1, 0]), i([2, 0, 3, 1]))
    assert torch.equal(out, x * torch.tensor([[1.0], [1], [1], [0], [1]], device=device))


# ---------------------------------------------------------------------------------------------
# make_plan's devices, without a GPU: device objects, "cuda" vs "cuda:0", meta tensors


def test_normalize_device(monkeypatch):
    def no_cuda():
        raise AssertionError("an indexed device must not query the current CUDA device")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    cpu = torch.device("cpu")
    assert _ops.normalize_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert _ops.normalize_device("cpu", torch.device("cuda", 0)) == cpu
    assert _ops.normalize_device(torch.device("cuda", 1), cpu) == torch.device("cuda", 1)
    assert _ops.normalize_device("cuda:0", cpu) == torch.device("cuda", 0)
    assert _ops.normalize_device("meta", cpu) == torch.device("meta")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _ops.normalize_device("cuda", cpu) == torch.device("cuda", 3)
    assert _ops.normalize_device(torch.device("cuda"), cpu) == torch.device("cuda", 3)


def test_shipping_decisions():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert _ops.shipping([cpu] * 4, cuda0) == "pinned"  # host plan to a GPU: one async copy
    assert _ops.shipping([cuda0] * 4, cuda0) == "none"  # a GPU gate, device="cuda" (normalized)
    assert _ops.shipping([cuda0] * 4, cuda1) == "plain"  # GPU to GPU: never pinned
    assert _ops.shipping([cuda0] * 4, cpu) == "plain"  # a GPU plan to the host
    assert _ops.shipping([cpu, cuda0], cuda0) == "plain"
    assert _ops.shipping([cpu] * 4, cpu) == "none"
    assert _ops.shipping([cpu] * 4, meta) == "plain"
    assert _ops.shipping([meta] * 4, meta) == "none"


def test_make_plan_on_other_devices(gen):
    gate = random_gate("bool", 9, 3, gen)
    host = mb.make_plan(gate, 3)
    on_meta = mb.make_plan(gate, 3, device="meta")  # a non-CPU target: a plain .to
    assert on_meta.counts == host.counts
    for m, h in zip(on_meta[1:], host[1:]):
        assert m.device.type == "meta" and m.shape == h.shape and m.dtype == h.dtype
    same = [torch.empty(3, device="meta") for _ in range(2)]
    assert all(a is b for a, b in zip(_ops.to_device(same, torch.device("meta")), same))
    explicit = mb.make_plan(gate, 3, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(explicit[1:], host[1:]))


@cuda_only
@pytest.mark.parametrize("where", ["cuda", "cuda:0", "device", "cpu", None, "cuda:1"])
@pytest.mark.parametrize("gate_on", ["cpu", "cuda"])
def test_make_plan_gpu_devices(where, gate_on, gen):
    if where == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gate = random_gate("float", 50, 4, gen).to(gate_on)
    target = torch.device("cuda") if where == "device" else where
    plan = mb.make_plan(gate, 4, device=target)
    want = _ops.normalize_device(target, gate.device)
    host = mb.make_plan(gate.cpu(), 4)
    assert plan.counts == host.counts
    for got, ref in zip(plan[1:], host[1:]):
        assert got.device == want and torch.equal(got.cpu(), ref)


# ---------------------------------------------------------------------------------------------
# GPU only: CUDA graphs, one readback in plan and no synchronization elsewhere, side streams


@cuda_only
@pytest.mark.parametrize("n", [3, 100])
def test_cuda_graph_capture(n, gen):
    """gather, combine and combine_weights_backward capture with a plan made before (100
    branches: the device pointer table); plan and make_plan refuse capture clearly."""
    gate = random_gate("float", 64, n, gen).cuda()
    plan = mb.make_plan(gate, n)
    x = torch.randn(64, 24, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())

    def step():
        parts = ops.gather(x, plan.rows, gate, plan.counts)
        out = ops.combine(x, [p * 2 for p in parts], gate, plan.row_offsets, plan.row_branch, plan.row_pos)
        return out, ops.combine_weights_backward(out, parts, plan.row_offsets, plan.row_branch, plan.row_pos)

    with torch.cuda.stream(s):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn(64, 24, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
    for make in (lambda: ops.plan(gate, n), lambda: mb.make_plan(gate.cpu(), n, device="cuda")):
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                make()
    good_call("cuda")


@cuda_only
@pytest.mark.parametrize("n", [3, 100])
def test_one_readback_and_no_other_sync(n, gen):
    gate = random_gate("float", 64, n, gen).cuda()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            plan = mb.make_plan(gate, n)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    x = torch.randn(64, 24, device="cuda", requires_grad=True)
    weights = gate.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in (plan, mb.make_plan(gate.cpu(), n, device="cuda")):  # the host plan ships without a wait
            out = F.combine([y * 2 for y in F.gather(x, p)], p, weights=weights, base=x)
            out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert x.grad is not None and weights.grad is not None


@cuda_only
def test_side_stream(gen):
    gate = random_gate("bool", 64, 4, gen)
    x = torch.randn(64, 40, generator=gen)
    offsets, rows, ro, rb, rp = ops.plan(gate, 4)
    want = ops.combine(None, ops.gather(x, rows, None, offsets.diff().tolist()), None, ro, rb, rp)
    dx = x.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        d = ops.plan(gate.cuda(), 4)
        got = ops.combine(None, ops.gather(dx, d[1], None, d[0].diff().tolist()), None, *d[2:])
    stream.synchronize()
    assert torch.equal(got.cpu(), want)


@cuda_only
@pytest.mark.parametrize("d", [2**31 // 3 + 5, (2**31 // 24 + 1) * 8])  # scalar and vector paths
def test_int64_offsets(d):
    """Three rows hold more than 2^31 elements."""
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs about 24 GiB of free device memory")
    x = torch.randn(3, d, dtype=torch.float16, device="cuda")
    plan = mb.make_plan(torch.tensor([2, 0, 1], device="cuda"), 3)
    parts = ops.gather(x, plan.rows, None, plan.counts)
    assert all(torch.equal(p[0], x[r]) for p, r in zip(parts, [1, 2, 0]))
    back = ops.combine(None, parts, None, plan.row_offsets, plan.row_branch, plan.row_pos)
    assert torch.equal(back, x)


# ---------------------------------------------------------------------------------------------
# a CPU-only build answers CUDA tensors with a clear error


class _LooksCuda(torch.Tensor):
    """A host tensor that reports is_cuda, for the Python check of a CPU-only build on a machine
    without a GPU (the C++ stub that answers real CUDA tensors is tested in tests/cpp)."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.skipif(mb.WITH_CUDA, reason="this build has CUDA kernels")
def test_cpu_only_build_refuses_cuda_tensors():
    x = torch.ones(2, 2).as_subclass(_LooksCuda) if not torch.cuda.is_available() else torch.ones(2, 2, device="cuda")
    with pytest.raises(RuntimeError, match="x: got a CUDA tensor, but this maskedbranch build has no CUDA kernels"):
        F.gather(x, mb.make_plan(torch.tensor([0, 0]), 1))
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="this maskedbranch build has no CUDA kernels"):
            ops.plan(torch.tensor([0, 0], device="cuda"), 1)
