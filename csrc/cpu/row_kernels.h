// Row-block loops shared by the CPU routing kernels. Each output row is written by exactly
// one task in a fixed order, so results are deterministic for any thread count.
#pragma once
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace maskedbranch {
namespace cpu {

// Rows per parallel task: enough work per task to amortize the scheduling.
inline int64_t row_grain(int64_t row_numel) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_numel));
}

// Packed entry p (branch i's slice [starts[i], starts[i + 1])) goes to row p - starts[i] of
// outs[i]: outs[i][k] = w * src[rows[p]]. Without weights w = 1 (a plain copy); with weights
// [B, N], w = weights[rows[p], i].
template <typename scalar_t>
void gather_rows(const std::vector<scalar_t*>& outs, const scalar_t* src, const int64_t* rows,
                 const std::vector<int64_t>& starts, int64_t row_numel, const at::opmath_type<scalar_t>* weights) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t num_branches = static_cast<int64_t>(starts.size()) - 1;
  const int64_t num_entries = starts.back();
  if (row_numel == 0) return;  // empty rows: nothing to copy (and memcpy must not see null)
  at::parallel_for(0, num_entries, row_grain(row_numel), [&](int64_t begin, int64_t end) {
    int64_t branch = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= starts[branch + 1]) ++branch;
      const scalar_t* in = src + rows[p] * row_numel;
      scalar_t* o = outs[branch] + (p - starts[branch]) * row_numel;
      if (weights == nullptr) {
        std::memcpy(o, in, row_numel * sizeof(scalar_t));
        continue;
      }
      const opmath_t w = weights[rows[p] * num_branches + branch];
      for (int64_t j = 0; j < row_numel; ++j) o[j] = static_cast<scalar_t>(w * static_cast<opmath_t>(in[j]));
    }
  });
}

// combine's segmented sum:
//   out[b] = base[b] + sum over e in [row_offsets[b], row_offsets[b+1]) of w_e * src_e
// where entry e reads row (row_pos[e] - starts[i]) of sources[i], i = row_branch[e], and
// w_e = weights[b, i] (or 1). Sums run in opmath precision and
// are rounded once.
template <typename scalar_t>
void segment_sum_rows(scalar_t* out, const scalar_t* base, const std::vector<const scalar_t*>& sources,
                      const std::vector<int64_t>& starts, const int64_t* row_offsets,
                      const int64_t* row_branch, const int64_t* row_pos, int64_t batch,
                      int64_t row_numel, const at::opmath_type<scalar_t>* weights) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr bool direct = std::is_same_v<opmath_t, scalar_t>;
  const int64_t num_branches = static_cast<int64_t>(sources.size());
  at::parallel_for(0, batch, row_grain(row_numel), [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> scratch(direct ? 0 : row_numel);
    for (int64_t b = begin; b < end; ++b) {
      opmath_t* acc = direct ? reinterpret_cast<opmath_t*>(out + b * row_numel) : scratch.data();
      if (base != nullptr) {
        const scalar_t* in = base + b * row_numel;
        for (int64_t j = 0; j < row_numel; ++j) acc[j] = static_cast<opmath_t>(in[j]);
      } else {
        std::fill(acc, acc + row_numel, opmath_t(0));
      }
      for (int64_t e = row_offsets[b]; e < row_offsets[b + 1]; ++e) {
        const int64_t i = row_branch[e];
        const scalar_t* in = sources[i] + (row_pos[e] - starts[i]) * row_numel;
        if (weights == nullptr) {
          for (int64_t j = 0; j < row_numel; ++j) acc[j] += static_cast<opmath_t>(in[j]);
        } else {
          const opmath_t w = weights[b * num_branches + i];
          for (int64_t j = 0; j < row_numel; ++j) acc[j] += w * static_cast<opmath_t>(in[j]);
        }
      }
      if constexpr (!direct) {
        scalar_t* o = out + b * row_numel;
        for (int64_t j = 0; j < row_numel; ++j) o[j] = static_cast<scalar_t>(acc[j]);
      }
    }
  });
}

}  // namespace cpu
}  // namespace maskedbranch
