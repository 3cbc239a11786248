// gate -> routing plan for a gate on a CUDA device. Same outputs, order and errors as the
// CPU kernel (csrc/cpu/plan.cpp); `offsets` lives on the host, the rest on the gate's device.
//
// One device->host readback per call, no atomics on positions. With index_t = int32 when
// B * N < 2^31 (else int64), and entry (b, i) = row b, branch i:
//   1. live_kernel writes the live matrix in both orders as index_t 0/1: row-major
//      Lr[b * N + i] and branch-major Lb[i * B + b], and records the first bad gate entry
//      (atomicMin on its index: deterministic); a one-thread kernel copies its raw value;
//   2. two flat inclusive scans (cub, through at::cumsum on 1-D tensors of index_t: no dtype
//      conversion, so no copy of the input):
//        pos = scan(Lb): pos[i * B + b] - 1 = packed position of (b, i) (CSR by branch)
//        ent = scan(Lr): ent[b * N + i] - 1 = CSR-by-row index of (b, i)
//      so offsets[i + 1] = pos[i * B + B - 1] and row_offsets[b + 1] = ent[b * N + N - 1]; each
//      live matrix is freed once scanned, and liveness is read back from pos (a step of 1);
//   3. one readback of [bad index, bad value, offsets[1..N]] into pinned memory + sync; raise
//      the CPU kernel's message if flagged;
//   4. fill_kernel writes rows / row_branch / row_pos / row_offsets (each element once).
// Temporary memory: at most 3 index words per (row, branch) at a time (Lb, Lr, pos; then Lr,
// pos, ent; then pos, ent), plus cub's scratch.
//
// Memory traffic: kernels 1 and 4 work on tiles of R rows x C branches (C = min(N, 64),
// R * C = 2048) and pass each tile through shared memory, so that both orders are read and
// written along their contiguous dimension: row-major with consecutive threads on consecutive
// (b, i) of a row group, branch-major with consecutive threads on consecutive rows b
// (R >= 32). The packed outputs are written in the order they are numbered (rows[] in branch
// order, row_branch[] / row_pos[] in row order), so consecutive threads write consecutive
// live entries.
//
// CUDA graphs: the readback cannot be captured, so this op refuses to run under stream
// capture (make a plan before capturing; gather and combine with it can be captured).
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <type_traits>

#include "../op_args.h"
#include "ops.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace cuda {
namespace {

constexpr long long kNoError = std::numeric_limits<long long>::max();
constexpr int kTileElems = 2048;  // (row, branch) entries per tile
constexpr int kTileCols = 64;     // at most this many branches per tile
// Shared-memory slots of a tile: rows of C entries padded to an odd stride (no bank conflicts
// in the branch-major pass); at most 1024 rows x 3 (C = 2).
constexpr int kTileSlots = 3 * kTileElems / 2;

struct Tile {
  int64_t rows;    // R
  int64_t cols;    // C
  int64_t stride;  // C or C + 1, odd
};

inline Tile make_tile(int64_t n) {
  Tile t;
  t.cols = std::min<int64_t>(n, kTileCols);
  t.rows = kTileElems / t.cols;
  t.stride = t.cols | 1;
  TORCH_INTERNAL_ASSERT(t.rows * t.stride <= kTileSlots);
  return t;
}

// A tile's coordinates: blockIdx.x picks the branch block, blockIdx.y (grid-stride) the row block.
struct TileGeometry {
  int64_t batch, n;
  Tile tile;
};

// status = [first bad index, raw bits of its value, offsets[1] .. offsets[N]]
__global__ void init_status_kernel(long long* status) {
  status[0] = kNoError;
  status[1] = 0;
}

// Whether (b, i) is live; flags a bad gate entry. Ids [B] (as int64): the first bad row, as
// the CPU kernel reports it (checked once per row, at branch 0). Masks [B, N]: the first
// non-finite entry in row-major order.
template <typename scalar_t, bool kIds>
__device__ __forceinline__ bool is_live(const scalar_t* gate, int64_t b, int64_t i, int64_t n, long long* status) {
  if constexpr (kIds) {
    const int64_t id = static_cast<int64_t>(gate[b]);
    const bool valid = id >= -1 && id < n;
    if (!valid && i == 0) atomicMin(status, static_cast<long long>(b));
    return valid && id == i;
  } else if constexpr (std::is_same_v<scalar_t, bool>) {
    return gate[b * n + i];
  } else {
    const auto v = static_cast<at::opmath_type<scalar_t>>(gate[b * n + i]);
    if (!isfinite(v)) atomicMin(status, static_cast<long long>(b * n + i));
    return v != 0;
  }
}

template <typename scalar_t, bool kIds, typename index_t>
__global__ void __launch_bounds__(kThreads)
    live_kernel(const scalar_t* __restrict__ gate, TileGeometry g, index_t* __restrict__ live_rm,
                index_t* __restrict__ live_bm, long long* status) {
  MB_SHARED(unsigned char, tile, kTileSlots);
  const Tile t = g.tile;
  const int64_t i0 = int64_t(blockIdx.x) * t.cols;
  const int cols = static_cast<int>(min64(t.cols, g.n - i0));  // a tile has at most kTileElems entries
  for (int64_t b0 = int64_t(blockIdx.y) * t.rows; b0 < g.batch; b0 += int64_t(gridDim.y) * t.rows) {
    const int rows = static_cast<int>(min64(t.rows, g.batch - b0));
    // Row-major: consecutive threads on consecutive branches of a row, then the next row.
    for (int j = static_cast<int>(threadIdx.x); j < rows * cols; j += static_cast<int>(blockDim.x)) {
      const int r = j / cols, c = j - r * cols;
      const bool live = is_live<scalar_t, kIds>(gate, b0 + r, i0 + c, g.n, status);
      live_rm[(b0 + r) * g.n + i0 + c] = live;
      tile[r * t.stride + c] = live;
    }
    __syncthreads();
    // Branch-major: consecutive threads on consecutive rows of a branch.
    for (int j = static_cast<int>(threadIdx.x); j < rows * cols; j += static_cast<int>(blockDim.x)) {
      const int c = j / rows, r = j - c * rows;
      live_bm[(i0 + c) * g.batch + b0 + r] = tile[r * t.stride + c];
    }
    __syncthreads();  // the tile is rewritten by the next row block
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
    fill_kernel(const index_t* __restrict__ pos, const index_t* __restrict__ ent, TileGeometry g,
                int64_t* __restrict__ rows_out, int64_t* __restrict__ row_offsets, int64_t* __restrict__ row_branch,
                int64_t* __restrict__ row_pos) {
  MB_SHARED(index_t, tile, kTileSlots);  // packed position of each live entry of the tile, -1 if dead
  const Tile t = g.tile;
  const int64_t i0 = int64_t(blockIdx.x) * t.cols;
  const int cols = static_cast<int>(min64(t.cols, g.n - i0));  // a tile has at most kTileElems entries
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) row_offsets[0] = 0;
  for (int64_t b0 = int64_t(blockIdx.y) * t.rows; b0 < g.batch; b0 += int64_t(gridDim.y) * t.rows) {
    const int rows = static_cast<int>(min64(t.rows, g.batch - b0));
    // Branch-major: read pos, write rows[] (consecutive live entries of a branch).
    for (int j = static_cast<int>(threadIdx.x); j < rows * cols; j += static_cast<int>(blockDim.x)) {
      const int c = j / rows, r = j - c * rows;
      const int64_t k = (i0 + c) * g.batch + b0 + r;
      const index_t v = pos[k];
      const index_t before = k > 0 ? pos[k - 1] : index_t(0);
      const bool live = v != before;
      if (live) rows_out[v - 1] = b0 + r;
      tile[r * t.stride + c] = live ? index_t(v - 1) : index_t(-1);
    }
    __syncthreads();
    // Row-major: read ent, write row_branch[] / row_pos[] (consecutive live entries of a row
    // group) and the row offsets.
    for (int j = static_cast<int>(threadIdx.x); j < rows * cols; j += static_cast<int>(blockDim.x)) {
      const int r = j / cols, c = j - r * cols;
      const int64_t b = b0 + r, i = i0 + c;
      const int64_t k = b * g.n + i;
      const index_t p = tile[r * t.stride + c];
      if (p >= 0) {
        const int64_t e = static_cast<int64_t>(ent[k]) - 1;
        row_branch[e] = i;
        row_pos[e] = p;
      }
      if (i == g.n - 1) row_offsets[b + 1] = static_cast<int64_t>(ent[k]);
    }
    __syncthreads();
  }
}

inline dim3 tile_grid(const TileGeometry& g) {
  const int64_t gx = ceil_div(g.n, g.tile.cols);
  const int64_t gy = std::max<int64_t>(1, std::min(ceil_div(g.batch, g.tile.rows), grid_limit(kMaxGridY)));
  TORCH_CHECK(gx <= std::numeric_limits<int32_t>::max(), "gate: too many branches for one launch");
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

// The message of the CPU kernel for a flagged gate entry k with raw value bits.
void raise_bad_gate(GateKind kind, const at::Tensor& values, int64_t k, int64_t bits, int64_t n) {
  if (kind == GateKind::Ids) {
    TORCH_CHECK_INDEX(false, "gate: branch id ", bits, " at row ", k, " is out of range; expected -1 (no branch) to ",
                      n - 1);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "maskedbranch_plan_cuda_error", [&] {
    scalar_t raw;
    std::memcpy(&raw, &bits, sizeof(scalar_t));
    const double v = static_cast<double>(raw);
    TORCH_CHECK_VALUE(false, "gate: weight ", v, " at row ", k / n, ", branch ", k % n, " is not finite");
  });
  TORCH_INTERNAL_ASSERT(false, "maskedbranch: plan flagged an error for a gate of dtype ", values.scalar_type());
}

template <typename index_t>
PlanTensors plan_with(const at::Tensor& values, GateKind kind, int64_t batch, int64_t n) {
  const Stream stream = current_stream();
  // (Explicit types: nvcc takes `auto` initialized from index_t as a dependent type.)
  const at::ScalarType index_dtype = c10::CppTypeToScalarType<index_t>::value;
  const at::TensorOptions long_opts = values.options().dtype(at::kLong);
  const at::TensorOptions index_opts = values.options().dtype(index_dtype);
  const int64_t total = batch * n;
  const TileGeometry g{batch, n, make_tile(n)};
  const dim3 grid = tile_grid(g);

  at::Tensor status = at::empty({n + 2}, long_opts);
  auto* st = reinterpret_cast<long long*>(status.data_ptr<int64_t>());
  launch<init_status_kernel>(dim3(1), dim3(1), stream, st);
  at::Tensor live_rm = at::empty({total}, index_opts);
  at::Tensor live_bm = at::empty({total}, index_opts);
  index_t* rm = live_rm.data_ptr<index_t>();
  index_t* bm = live_bm.data_ptr<index_t>();
  auto launch_live = [&](auto tag, auto ids) {
    using scalar_t = decltype(tag);
    constexpr bool kIds = decltype(ids)::value;
    const auto* gate = static_cast<const scalar_t*>(values.const_data_ptr());
    launch<live_kernel<scalar_t, kIds, index_t>>(grid, dim3(kThreads), stream, gate, g, rm, bm, st);
    launch<fetch_bad_value_kernel<scalar_t>>(dim3(1), dim3(1), stream, gate, st);
  };
  if (kind == GateKind::Ids) {
    launch_live(int64_t{}, std::true_type{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, values.scalar_type(), "maskedbranch_plan_cuda",
                                    [&] { launch_live(scalar_t{}, std::false_type{}); });
  }

  at::Tensor pos = at::cumsum(live_bm, 0, index_dtype);
  live_bm.reset();
  at::Tensor ent = at::cumsum(live_rm, 0, index_dtype);
  live_rm.reset();
  status.narrow(0, 2, n).copy_(pos.view({n, batch}).select(1, batch - 1));

  // The one readback.
  at::Tensor host_status = at::empty({n + 2}, readback_options());
  copy_to_host_and_sync(host_status.data_ptr<int64_t>(), status.const_data_ptr<int64_t>(),
                        static_cast<int64_t>((n + 2) * sizeof(int64_t)), stream);
  const int64_t* hs = host_status.const_data_ptr<int64_t>();
  if (hs[0] != kNoError) raise_bad_gate(kind, values, hs[0], hs[1], n);
  at::Tensor offsets = at::empty({n + 1}, at::TensorOptions().dtype(at::kLong));  // on the host
  auto* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t i = 0; i < n; ++i) off[i + 1] = hs[2 + i];
  const int64_t num_entries = off[n];

  at::Tensor rows = at::empty({num_entries}, long_opts);
  at::Tensor row_offsets = at::empty({batch + 1}, long_opts);
  at::Tensor row_branch = at::empty({num_entries}, long_opts);
  at::Tensor row_pos = at::empty({num_entries}, long_opts);
  launch<fill_kernel<index_t>>(grid, dim3(kThreads), stream, pos.const_data_ptr<index_t>(),
                               ent.const_data_ptr<index_t>(), g, rows.data_ptr<int64_t>(),
                               row_offsets.data_ptr<int64_t>(), row_branch.data_ptr<int64_t>(),
                               row_pos.data_ptr<int64_t>());
  return {offsets, rows, row_offsets, row_branch, row_pos};
}

}  // namespace

PlanTensors plan_cuda(const at::Tensor& gate, int64_t num_branches) {
  const GateKind kind = check_gate(gate, num_branches);
  DeviceGuard device_guard(gate.device());
  TORCH_CHECK(!stream_is_capturing(current_stream()),
              "plan: a gate on the GPU needs one readback of the branch counts, which CUDA graph capture "
              "does not allow. Make the plan before capturing (gather and combine with it can be captured), "
              "or route with a host gate outside the graph.");
  const int64_t n = num_branches;
  const int64_t batch = gate.size(0);
  const auto long_opts = gate.options().dtype(at::kLong);
  if (batch == 0) {
    // Nothing to count: no kernel, no readback.
    return {at::zeros({n + 1}, at::kLong), at::empty({0}, long_opts), at::zeros({1}, long_opts),
            at::empty({0}, long_opts), at::empty({0}, long_opts)};
  }
  // ids as int64, like the CPU kernel (uint8 255 is an out-of-range id, not -1)
  const at::Tensor values = kind == GateKind::Ids ? gate.to(at::kLong).contiguous() : gate.contiguous();
  // Running counts never exceed B * N.
  if (batch * n <= int32_plan_limit()) return plan_with<int32_t>(values, kind, batch, n);
  return plan_with<int64_t>(values, kind, batch, n);
}

}  // namespace cuda

#ifndef MASKEDBRANCH_CUDA_EMULATION
TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) { m.impl("plan", &cuda::plan_cuda); }
#endif

}  // namespace maskedbranch
