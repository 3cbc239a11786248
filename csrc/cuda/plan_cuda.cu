// gate -> routing plan for a gate on a CUDA device. Same outputs, order and errors as the
// CPU kernel (csrc/cpu/plan.cpp); `offsets` lives on the host, the rest on the gate's device.
//
// One device->host readback per call, no atomics on positions:
//   1. a "live" kernel writes the live matrix twice, row-major L[b, i] and branch-major
//      Lt[i, b], and records the first bad entry (atomicMin on its index: deterministic);
//      a one-thread kernel then copies the bad entry's raw value next to it;
//   2. two flat inclusive cumsums (ATen, on the device, no sync):
//        pos[i * B + b] - 1 = packed position of entry (b, i)  (branch-major order = CSR by branch)
//        ent[b * N + i] - 1 = CSR-by-row index of entry (b, i) (row-major order)
//      so offsets[i + 1] = pos[i * B + B - 1] and row_offsets[b + 1] = ent[b * N + N - 1];
//   3. one readback of [bad index, bad value, offsets[1..N]] into pinned memory + sync; raise
//      the CPU kernel's message if flagged;
//   4. a fill kernel scatters rows / row_branch / row_pos / row_offsets (each written once).
// Temporary memory: 2 bytes + 2 index words (int32 when B * N < 2^31) per (row, branch).
#include <torch/library.h>

#include <c10/cuda/CUDAFunctions.h>

#include <cstring>
#include <limits>
#include <type_traits>

#include "../op_args.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace {

using namespace maskedbranch::cuda;
using PlanTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

constexpr long long kNoError = std::numeric_limits<long long>::max();

// status = [first bad index, raw bits of its value, offsets[1] .. offsets[N]]
__global__ void init_status_kernel(long long* status) {
  status[0] = kNoError;
  status[1] = 0;
}

// Branch ids [B] (as int64). Flat over branch-major k = i * B + b.
__global__ void __launch_bounds__(kThreads)
    ids_live_kernel(const int64_t* __restrict__ ids, int64_t batch, int64_t n, bool* __restrict__ live_rm,
                    bool* __restrict__ live_bm, long long* status) {
  const int64_t total = batch * n;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / batch;
    const int64_t b = k - i * batch;
    const int64_t id = ids[b];
    const bool valid = id >= -1 && id < n;
    if (!valid && i == 0) atomicMin(status, static_cast<long long>(b));
    const bool live = valid && id == i;
    live_bm[k] = live;
    live_rm[b * n + i] = live;
  }
}

// Mask or weights [B, N]. Flat over row-major k = b * N + i.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    mask_live_kernel(const scalar_t* __restrict__ gate, int64_t batch, int64_t n, bool* __restrict__ live_rm,
                     bool* __restrict__ live_bm, long long* status) {
  const int64_t total = batch * n;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = k / n;
    const int64_t i = k - b * n;
    bool live;
    if constexpr (std::is_same_v<scalar_t, bool>) {
      live = gate[k];
    } else {
      const auto v = static_cast<at::opmath_type<scalar_t>>(gate[k]);
      if (!isfinite(v)) atomicMin(status, static_cast<long long>(k));
      live = v != 0;
    }
    live_rm[k] = live;
    live_bm[i * batch + b] = live;
  }
}

// Raw bits of the first bad entry's value, for the host's message.
template <typename scalar_t>
__global__ void fetch_bad_value_kernel(const scalar_t* values, long long* status) {
  const long long k = status[0];
  if (k != kNoError) {
    long long bits = 0;
    memcpy(&bits, values + k, sizeof(scalar_t));
    status[1] = bits;
  }
}

template <typename index_t>
__global__ void __launch_bounds__(kThreads)
    fill_plan_kernel(const bool* __restrict__ live_bm, const index_t* __restrict__ pos_bm,
                     const index_t* __restrict__ ent_rm, int64_t batch, int64_t n, int64_t* __restrict__ rows,
                     int64_t* __restrict__ row_offsets, int64_t* __restrict__ row_branch,
                     int64_t* __restrict__ row_pos) {
  const int64_t total = batch * n;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / batch;
    const int64_t b = k - i * batch;
    if (k == 0) row_offsets[0] = 0;
    if (i == n - 1) row_offsets[b + 1] = static_cast<int64_t>(ent_rm[b * n + n - 1]);
    if (live_bm[k]) {
      const int64_t p = static_cast<int64_t>(pos_bm[k]) - 1;
      const int64_t e = static_cast<int64_t>(ent_rm[b * n + i]) - 1;
      rows[p] = b;
      row_branch[e] = i;
      row_pos[e] = p;
    }
  }
}

PlanTensors plan_cuda(const at::Tensor& gate, int64_t num_branches) {
  const GateKind kind = check_gate(gate, num_branches);
  c10::cuda::CUDAGuard device_guard(gate.device());
  const int64_t n = num_branches;
  const int64_t batch = gate.size(0);
  const auto index = gate.options().dtype(at::kLong);
  auto offsets = at::zeros({n + 1}, at::TensorOptions().dtype(at::kLong));  // on the host
  if (batch == 0) {
    // Nothing to count: no kernel, no readback.
    return {offsets, at::empty({0}, index), at::zeros({1}, index), at::empty({0}, index), at::empty({0}, index)};
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t total = batch * n;
  auto live_rm = at::empty({total}, gate.options().dtype(at::kBool));
  auto live_bm = at::empty({total}, gate.options().dtype(at::kBool));
  auto status = at::empty({n + 2}, index);
  auto* st = reinterpret_cast<long long*>(status.data_ptr<int64_t>());
  init_status_kernel<<<1, 1, 0, stream>>>(st);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor values;  // the gate as the live kernel read it (ids as int64, like the CPU kernel)
  if (kind == GateKind::Ids) {
    values = gate.to(at::kLong).contiguous();
    ids_live_kernel<<<grid_1d(total), kThreads, 0, stream>>>(values.const_data_ptr<int64_t>(), batch, n,
                                                             live_rm.data_ptr<bool>(), live_bm.data_ptr<bool>(), st);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fetch_bad_value_kernel<int64_t><<<1, 1, 0, stream>>>(values.const_data_ptr<int64_t>(), st);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    values = gate.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, values.scalar_type(), "maskedbranch_plan_cuda", [&] {
      mask_live_kernel<scalar_t><<<grid_1d(total), kThreads, 0, stream>>>(
          values.const_data_ptr<scalar_t>(), batch, n, live_rm.data_ptr<bool>(), live_bm.data_ptr<bool>(), st);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      fetch_bad_value_kernel<scalar_t><<<1, 1, 0, stream>>>(values.const_data_ptr<scalar_t>(), st);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  // Running counts never exceed B * N.
  const bool narrow = total <= std::numeric_limits<int32_t>::max();
  const auto index_dtype = narrow ? at::kInt : at::kLong;
  auto pos_bm = at::cumsum(live_bm, 0, index_dtype);
  auto ent_rm = at::cumsum(live_rm, 0, index_dtype);
  status.narrow(0, 2, n).copy_(pos_bm.view({n, batch}).select(1, batch - 1));

  // The one readback.
  auto host_status = at::empty({n + 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  c10::cuda::memcpy_and_sync(host_status.data_ptr<int64_t>(), status.const_data_ptr<int64_t>(),
                             static_cast<int64_t>((n + 2) * sizeof(int64_t)), cudaMemcpyDeviceToHost, stream);
  const int64_t* hs = host_status.const_data_ptr<int64_t>();
  if (hs[0] != kNoError) {
    const int64_t k = hs[0];
    const int64_t bits = hs[1];
    if (kind == GateKind::Ids) {
      TORCH_CHECK_INDEX(false, "gate: branch id ", bits, " at row ", k,
                        " is out of range; expected -1 (no branch) to ", n - 1);
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "maskedbranch_plan_cuda_error", [&] {
      scalar_t raw;
      std::memcpy(&raw, &bits, sizeof(scalar_t));
      const double v = static_cast<double>(raw);
      TORCH_CHECK_VALUE(false, "gate: weight ", v, " at row ", k / n, ", branch ", k % n, " is not finite");
    });
    TORCH_INTERNAL_ASSERT(false, "maskedbranch: plan flagged an error for a gate of dtype ", values.scalar_type());
  }
  auto* off = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) off[i + 1] = hs[2 + i];
  const int64_t num_entries = off[n];

  auto rows = at::empty({num_entries}, index);
  auto row_offsets = at::empty({batch + 1}, index);
  auto row_branch = at::empty({num_entries}, index);
  auto row_pos = at::empty({num_entries}, index);
  auto fill = [&](auto tag) {
    using index_t = decltype(tag);
    fill_plan_kernel<index_t><<<grid_1d(total), kThreads, 0, stream>>>(
        live_bm.const_data_ptr<bool>(), pos_bm.const_data_ptr<index_t>(), ent_rm.const_data_ptr<index_t>(), batch, n,
        rows.data_ptr<int64_t>(), row_offsets.data_ptr<int64_t>(), row_branch.data_ptr<int64_t>(),
        row_pos.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (narrow) fill(int32_t{}); else fill(int64_t{});
  return {offsets, rows, row_offsets, row_branch, row_pos};
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) { m.impl("plan", &plan_cuda); }

}  // namespace maskedbranch
