"""pick, pick_backward and put_'s kernels (csrc/cuda/pick_cuda.cu: pick_kernel for each kind at 16
bytes and at one byte a thread, check_index_kernel of the ATen paths) on the host: every dtype,
sizes that are and are not a whole number of 16-byte vectors, misaligned tensors, layouts that
take the ATen paths (channels_last, transposed, more than 64 branches), grid-stride rounds; equal
to the CPU kernels bit for bit; an index out of range stops the kernel with its assert."""
import pytest
import torch

from emu_support import DTYPES, assert_same_bits, cpu, cpu_error, limits, misaligned, run

ALL_DTYPES = DTYPES + [torch.int64, torch.int32, torch.bool]


def tensors_of(branches, dtype, layout, seed=0):
    """k = 3 tensors per branch (branch after branch): 48 elements, 5, and one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(branches):
        for shape in [(4, 3, 2, 2), (5,), ()]:
            t = (torch.randn(shape, generator=gen) * 10).to(dtype)
            if layout == "misaligned":
                t = misaligned(t)
            elif layout == "channels_last" and t.dim() == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            elif layout == "transposed" and t.dim() == 4:
                t = t.transpose(0, 1).contiguous().transpose(0, 1)
            out.append(t)
    return out


LAYOUTS = ["contiguous", "misaligned", "channels_last", "transposed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 3, 70])
def test_pick_equals_cpu(dtype, layout, branches, suite_schedule):
    tensors = tensors_of(branches, dtype, layout)
    for i in sorted({0, branches - 1}):
        index = torch.tensor(i)
        for g, w in zip(run("pick", tensors, index, branches), cpu.pick(tensors, index, branches)):
            assert_same_bits(g, w, f"pick of branch {i}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 3, 70])
def test_pick_backward_equals_cpu(dtype, layout, branches, suite_schedule):
    grads = tensors_of(1, dtype, layout)
    index = torch.tensor(branches - 1, dtype=torch.int32)
    got, want = run("pick_backward", grads, index, branches), cpu.pick_backward(grads, index, branches)
    assert len(got) == len(want) == 3 * branches
    for e, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"gradient {e}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 3, 70])
def test_put_equals_cpu(dtype, layout, branches, suite_schedule):
    for i in sorted({-1, 0, branches - 1}):
        emulated, on_cpu = tensors_of(branches, dtype, layout), tensors_of(branches, dtype, layout)
        values = tensors_of(1, dtype, "contiguous", seed=3)
        run("put_", emulated, torch.tensor(i), branches, values)
        cpu.put_(on_cpu, torch.tensor(i), branches, values)
        for e, (g, w) in enumerate(zip(emulated, on_cpu)):
            assert_same_bits(g, w, f"put_ of branch {i}, tensor {e}")


def test_grid_stride_rounds():
    tensors = [torch.randn(4096) for _ in range(3)]  # 1024 vectors of 16 bytes: 4 blocks, limited to 1
    with limits(grid_blocks=1):
        assert_same_bits(run("pick", tensors, torch.tensor(2), 3)[0], tensors[2], "pick")
        grads = run("pick_backward", [tensors[0]], torch.tensor(1), 3)
        assert_same_bits(grads[1], tensors[0], "pick_backward, chosen")
        assert not grads[0].any() and not grads[2].any()
        targets = [torch.zeros(4096) for _ in range(3)]
        run("put_", targets, torch.tensor(1), 3, [tensors[1]])
        assert_same_bits(targets[1], tensors[1], "put_")
        assert not targets[0].any() and not targets[2].any()


@pytest.mark.parametrize("op", ["pick", "pick_backward", "put_"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"], ids=["kernel", "aten path"])
@pytest.mark.parametrize("bad", [3, -2, -1])
def test_an_index_out_of_range_asserts_on_the_device(op, layout, bad):
    if bad == -1 and op == "put_":
        pytest.skip("-1 is put_'s 'no branch'")
    tensors = tensors_of(3, torch.float32, layout)
    args = {"pick": (tensors, torch.tensor(bad), 3), "pick_backward": (tensors[:3], torch.tensor(bad), 3),
            "put_": (tensors, torch.tensor(bad), 3, tensors_of(1, torch.float32, "contiguous"))}[op]
    assert cpu_error(lambda: getattr(cpu, op)(*args))[0] is ValueError
    with pytest.raises(RuntimeError, match="device-side assert triggered: index: expected a branch in range"):
        run(op, *args)
