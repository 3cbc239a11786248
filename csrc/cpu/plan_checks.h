// Host-side checks that plan tensors handed to an op directly are consistent, so that a
// hand-made plan raises instead of reading out of bounds. O(B + M) and cheap next to the
// row copies; plans from the plan op always pass.
#pragma once
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace maskedbranch {
namespace cpu {

inline void check_row_offsets(const int64_t* row_offsets, int64_t batch, int64_t num_entries) {
  TORCH_CHECK_VALUE(row_offsets[0] == 0 && row_offsets[batch] == num_entries,
                    "row_offsets: expected to run from 0 to ", num_entries, ", got ",
                    row_offsets[0], " to ", row_offsets[batch]);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(row_offsets[b] <= row_offsets[b + 1], "row_offsets: not ascending at row ", b);
}

inline void check_in_range(const int64_t* idx, int64_t n, int64_t lo, int64_t hi, const char* name) {
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK_INDEX(idx[k] >= lo && idx[k] < hi, name, ": entry ", k, " = ", idx[k],
                      " is out of range [", lo, ", ", hi, ")");
}

// Every entry's packed position lies in its own branch's slice.
inline void check_positions(const int64_t* row_branch, const int64_t* row_pos, int64_t num_entries,
                            const std::vector<int64_t>& starts) {
  const int64_t num_branches = static_cast<int64_t>(starts.size()) - 1;
  for (int64_t e = 0; e < num_entries; ++e) {
    const int64_t i = row_branch[e];
    TORCH_CHECK_INDEX(i >= 0 && i < num_branches, "row_branch: entry ", e, " = ", i,
                      " is out of range [0, ", num_branches, ")");
    TORCH_CHECK_INDEX(row_pos[e] >= starts[i] && row_pos[e] < starts[i + 1], "row_pos: entry ", e,
                      " = ", row_pos[e], " is outside branch ", i, "'s rows [", starts[i], ", ",
                      starts[i + 1], ")");
  }
}

}  // namespace cpu
}  // namespace maskedbranch
