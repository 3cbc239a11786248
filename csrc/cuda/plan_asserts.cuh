// The checks of hand-made plans on the device, per row, shared by the gather and combine
// kernels (row_kernels.cuh) and the plan op.
//
// Hand-made plans (docs: why device asserts and not a host check). The CPU kernels check plan
// values on the host (csrc/cpu/plan_checks.h) and raise. Here the values live on the device,
// and checking them on the host would cost a device->host copy, that is a synchronization, in
// every op, which the routing path promises not to do (the plan's readback is the only one).
// So the kernels assert the same conditions on the device (CUDA_KERNEL_ASSERT_MSG, active in
// release builds), like ATen's own index ops do for out-of-range indices: a bad plan stops the
// kernel before it reads or writes out of bounds, and the error names the argument. A device
// assert leaves the CUDA context unusable, so it is for hand-made plans only: plans from the
// plan op (and make_plan) are valid by construction. To check a hand-made plan recoverably,
// call the op on CPU copies first (the same conditions, raised as Python exceptions).
// The per-row form of the CPU's conditions is in assert_row_span / checked_branch below; a plan
// passes them for every row iff it passes the CPU's whole-plan checks (see there).
#pragma once
#include "device_rows.cuh"

namespace maskedbranch {
namespace cuda {

// Plan checks, per row. The CPU (csrc/cpu/plan_checks.h) requires row_offsets[0] == 0,
// row_offsets[B] == M, row_offsets ascending, and for every entry e: 0 <= row_branch[e] < N and
// row_pos[e] in branch row_branch[e]'s slice. Per row b with entries [e0, e1) that is: 0 <= e0
// <= e1 <= M, e0 == 0 for the first row, e1 == M for the last. If every row passes, the offsets
// ascend from 0 to M and the rows' entries cover [0, M), so every entry is checked; if the CPU
// rejects a plan, some row (or some entry of a row) fails here. B == 0 has no rows: then
// check_row_plan_kernel checks row_offsets[0] == 0 == M with one thread.

__device__ __forceinline__ void assert_row_span(int64_t b, int64_t batch, int64_t e0, int64_t e1, int64_t m) {
  CUDA_KERNEL_ASSERT_MSG(0 <= e0 && e0 <= e1 && e1 <= m,
                         "row_offsets: not ascending within [0, number of entries] (hand-made plan)");
  CUDA_KERNEL_ASSERT_MSG(b != 0 || e0 == 0, "row_offsets: expected to start at 0 (hand-made plan)");
  CUDA_KERNEL_ASSERT_MSG(b != batch - 1 || e1 == m,
                         "row_offsets: expected to end at the number of entries (hand-made plan)");
}

// Entry e's branch, after checking it and its packed position.
template <typename P>
__device__ __forceinline__ int64_t checked_branch(const BranchTable<P>& t, const int64_t* row_branch,
                                                  const int64_t* row_pos, int64_t e) {
  const int64_t i = row_branch[e];
  CUDA_KERNEL_ASSERT_MSG(i >= 0 && i < t.n, "row_branch: entry out of range [0, number of branches) (hand-made plan)");
  const int64_t pos = row_pos[e];
  CUDA_KERNEL_ASSERT_MSG(pos >= t.first(i) && pos < t.first(i + 1),
                         "row_pos: entry outside its branch's rows (hand-made plan)");
  return i;
}

// The checks alone, for calls whose main kernel has nothing to compute (no rows, or rows of
// zero elements), so that the same plans are rejected as on the CPU.
template <typename P>
struct RowPlanCheck {
  const int64_t* row_offsets;
  const int64_t* row_branch;
  const int64_t* row_pos;
  int64_t batch;
  int64_t num_entries;
  BranchTable<P> table;
};

template <typename P>
__global__ void __launch_bounds__(kThreads) check_row_plan_kernel(const __grid_constant__ RowPlanCheck<P> c) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.batch == 0 && tid == 0) {
    CUDA_KERNEL_ASSERT_MSG(c.row_offsets[0] == 0 && c.num_entries == 0,
                           "row_offsets: expected to run from 0 to the number of entries (hand-made plan)");
  }
  for (int64_t b = tid; b < c.batch; b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e0 = c.row_offsets[b];
    const int64_t e1 = c.row_offsets[b + 1];
    assert_row_span(b, c.batch, e0, e1, c.num_entries);
    for (int64_t e = e0; e < e1; ++e) checked_branch(c.table, c.row_branch, c.row_pos, e);
  }
}

template <typename P>
void launch_check_row_plan(const int64_t* row_offsets, const int64_t* row_branch, const int64_t* row_pos,
                           int64_t batch, int64_t num_entries, const BranchTable<P>& table) {
  RowPlanCheck<P> c{row_offsets, row_branch, row_pos, batch, num_entries, table};
  launch<check_row_plan_kernel<P>>(dim3(grid_1d(batch)), dim3(kThreads), current_stream(), c);
}

// gather's rows, alone (rows of zero elements). A template on gather's dtype, for the reason
// given at write_table_kernel.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) check_rows_kernel(const int64_t* rows, int64_t num_entries, int64_t src_rows) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < num_entries; p += int64_t(gridDim.x) * blockDim.x) {
    CUDA_KERNEL_ASSERT_MSG(rows[p] >= 0 && rows[p] < src_rows, "rows: entry out of range [0, x.size(0)) (hand-made plan)");
  }
}

}  // namespace cuda
}  // namespace maskedbranch
