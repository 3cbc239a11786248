// pick, pick_backward, put_ (CUDA): the tensors of a whole-batch choice's chosen branch, read
// out, given their gradient, and written back, without reading the index on the host (no
// synchronization; the kernels read it and assert its range, plan_asserts.cuh says why).
// Same outputs as csrc/cpu/pick.cpp: new contiguous tensors.
//
// Tensor j of every branch and its output are copied as bytes when they are all contiguous: one
// launch per tensor, the branches' pointers passed by value, 16 bytes a thread when every
// pointer and the size allow it. Other layouts, and more than kTableCapacity branches, take
// ATen ops that keep the index on the device (a stack and an index_select, or a where per
// branch).
#include <torch/library.h>

#include "../op_args.h"
#include "device_rows.cuh"
#include "ops.h"

namespace maskedbranch {
namespace cuda {
namespace {

struct ByteTable {
  char* ptr[kTableCapacity];
};

using Bytes16 = Vec<unsigned char, 16>;

// What each kernel does with the chosen branch i = *index.
enum class PickKind { Pick, Backward, Put };

__device__ __forceinline__ int64_t read_index(const int64_t* index, int64_t branches, bool allow_none) {
  const int64_t i = *index;
  CUDA_KERNEL_ASSERT_MSG((allow_none ? i >= -1 : i >= 0) && i < branches, "index: expected a branch in range");
  return i;
}

// Pick: out = table[i]. Put: table[i] = src (nothing when i == -1). Backward: table[b] = src for
// b == i, zeros for the others (b = blockIdx.y). `count` elements of V each.
template <typename V, PickKind Kind>
__global__ void __launch_bounds__(kThreads) pick_kernel(ByteTable table, char* out, const char* src,
                                                        const int64_t* index, int64_t branches, int64_t count) {
  const int64_t i = read_index(index, branches, Kind == PickKind::Put);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (Kind == PickKind::Pick) {
    const V* from = reinterpret_cast<const V*>(table.ptr[i]);
    V* to = reinterpret_cast<V*>(out);
    for (int64_t e = first; e < count; e += stride) to[e] = from[e];
  } else if (Kind == PickKind::Put) {
    if (i < 0) return;
    const V* from = reinterpret_cast<const V*>(src);
    V* to = reinterpret_cast<V*>(table.ptr[i]);
    for (int64_t e = first; e < count; e += stride) to[e] = from[e];
  } else {
    const int64_t b = blockIdx.y;
    const V* from = reinterpret_cast<const V*>(src);
    V* to = reinterpret_cast<V*>(table.ptr[b]);
    const V zero{};
    for (int64_t e = first; e < count; e += stride) to[e] = b == i ? from[e] : zero;
  }
}

// The range check of the ATen paths, which read the index only inside their own kernels.
__global__ void check_index_kernel(const int64_t* index, int64_t branches, bool allow_none) {
  read_index(index, branches, allow_none);
}

// The index as one int64 on the device.
at::Tensor index_on_device(const at::Tensor& index) { return index.reshape({1}).to(at::kLong).contiguous(); }

bool byte_path(const std::vector<at::Tensor>& tensors, int64_t branches) {
  if (branches > kTableCapacity) return false;
  for (const auto& t : tensors)
    if (!t.is_contiguous()) return false;
  return true;
}

// One launch for tensor j: `table` (one pointer per branch), `out` / `src` as the kind needs.
template <PickKind Kind>
void launch_pick(const std::vector<char*>& table, char* out, const char* src, const at::Tensor& index,
                 int64_t bytes) {
  if (bytes == 0) return;
  ByteTable t{};
  std::vector<const void*> ptrs(table.begin(), table.end());
  ptrs.push_back(out);
  ptrs.push_back(src);
  bool vec = bytes % 16 == 0;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned16(p)) vec = false;
  for (size_t b = 0; b < table.size(); ++b) t.ptr[b] = table[b];
  const int64_t count = vec ? bytes / 16 : bytes;
  const dim3 grid(grid_1d(count), Kind == PickKind::Backward ? static_cast<unsigned>(table.size()) : 1u);
  const int64_t branches = static_cast<int64_t>(table.size());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  if (vec) {
    launch<pick_kernel<Bytes16, Kind>>(grid, dim3(kThreads), current_stream(), t, out, src, idx, branches, count);
  } else {
    launch<pick_kernel<unsigned char, Kind>>(grid, dim3(kThreads), current_stream(), t, out, src, idx, branches, count);
  }
}

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.numel() > 0 ? t.data_ptr() : nullptr); }

at::Tensor empty_contiguous(const at::Tensor& like) {
  return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
}

void check_on_device(const at::Tensor& index, int64_t branches, bool allow_none) {
  launch<check_index_kernel>(dim3(1), dim3(1), current_stream(), index.const_data_ptr<int64_t>(), branches, allow_none);
}

}  // namespace

std::vector<at::Tensor> pick_cuda(at::TensorList tensors, const at::Tensor& index_in, int64_t branches) {
  const int64_t k = check_branch_tensors(tensors, branches, "tensors");
  check_choice_index(index_in, tensors);
  if (k == 0) return {};
  DeviceGuard device_guard(tensors[0].device());
  const at::Tensor index = index_on_device(index_in);
  std::vector<at::Tensor> out;
  out.reserve(k);
  for (int64_t j = 0; j < k; ++j) {
    std::vector<at::Tensor> group;
    for (int64_t b = 0; b < branches; ++b) group.push_back(tensors[b * k + j]);
    out.push_back(empty_contiguous(group[0]));
    if (byte_path(group, branches)) {
      std::vector<char*> table;
      for (const auto& t : group) table.push_back(bytes_of(t));
      launch_pick<PickKind::Pick>(table, bytes_of(out.back()), nullptr, index, out.back().nbytes());
    } else {
      check_on_device(index, branches, false);
      out.back().copy_(at::stack(group).index_select(0, index).select(0, 0));
    }
  }
  return out;
}

std::vector<at::Tensor> pick_backward_cuda(at::TensorList grads, const at::Tensor& index_in, int64_t branches) {
  TORCH_CHECK_VALUE(branches >= 1, "branches: expected at least 1, got ", branches);
  check_choice_index(index_in, grads);
  const int64_t k = static_cast<int64_t>(grads.size());
  std::vector<at::Tensor> out(branches * k);
  if (k == 0) return out;
  DeviceGuard device_guard(grads[0].device());
  const at::Tensor index = index_on_device(index_in);
  const at::Tensor chosen = index.reshape({});
  for (int64_t j = 0; j < k; ++j) {
    const at::Tensor& g = grads[j];
    for (int64_t b = 0; b < branches; ++b) out[b * k + j] = empty_contiguous(g);
    if (byte_path({g}, branches)) {
      std::vector<char*> table;
      for (int64_t b = 0; b < branches; ++b) table.push_back(bytes_of(out[b * k + j]));
      launch_pick<PickKind::Backward>(table, nullptr, bytes_of(g), index, g.nbytes());
    } else {
      check_on_device(index, branches, false);
      const at::Tensor zero = at::zeros({}, g.options());
      for (int64_t b = 0; b < branches; ++b) out[b * k + j].copy_(at::where(chosen.eq(b), g, zero));
    }
  }
  return out;
}

void put_cuda(at::TensorList tensors, const at::Tensor& index_in, int64_t branches, at::TensorList values) {
  const int64_t k = check_branch_tensors(tensors, branches, "tensors");
  check_choice_index(index_in, tensors);
  check_choice_values(values, tensors, k);
  if (k == 0) return;
  DeviceGuard device_guard(tensors[0].device());
  const at::Tensor index = index_on_device(index_in);
  const at::Tensor chosen = index.reshape({});
  for (int64_t j = 0; j < k; ++j) {
    std::vector<at::Tensor> group;
    for (int64_t b = 0; b < branches; ++b) group.push_back(tensors[b * k + j]);
    std::vector<at::Tensor> all = group;
    all.push_back(values[j]);
    if (byte_path(all, branches)) {
      std::vector<char*> table;
      for (const auto& t : group) table.push_back(bytes_of(t));
      launch_pick<PickKind::Put>(table, nullptr, bytes_of(values[j]), index, values[j].nbytes());
    } else {
      check_on_device(index, branches, true);
      for (int64_t b = 0; b < branches; ++b) group[b].copy_(at::where(chosen.eq(b), values[j], group[b]));
    }
  }
}

}  // namespace cuda

#ifndef MASKEDBRANCH_CUDA_EMULATION
TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) {
  m.impl("pick", &cuda::pick_cuda);
  m.impl("pick_backward", &cuda::pick_backward_cuda);
  m.impl("put_", &cuda::put_cuda);
}
#endif

}  // namespace maskedbranch
