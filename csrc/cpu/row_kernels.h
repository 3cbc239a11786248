// Row-block loops shared by the CPU routing kernels. Each output row is written by exactly
// one task in a fixed order, so results are deterministic for any thread count.
#pragma once
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace maskedbranch {
namespace cpu {

// Rows per parallel task: enough work per task to amortize the scheduling.
inline int64_t row_grain(int64_t row_numel) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_numel));
}

// The row loops run compiled for AVX2 where the CPU has it: twice the vector width of the
// baseline x86-64 code that extensions are built for, which the scaling loops need to keep up with
// memory (a weighted gather measured 1.4-1.8x an unweighted one with SSE2). No FMA: a + w * b
// still rounds twice, as the reference computes it, so the bits do not depend on the CPU.
#if defined(__x86_64__) && defined(__GNUC__)
#define MASKEDBRANCH_AVX2_ROWS 1
// MASKEDBRANCH_CPU_BASELINE=1 keeps the baseline code (tests compare the two for equal bits).
inline bool cpu_has_avx2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2")) &&
                          std::getenv("MASKEDBRANCH_CPU_BASELINE") == nullptr;
  return has;
}

template <typename F>
__attribute__((target("avx2"), flatten)) void run_avx2(const F& f, int64_t begin, int64_t end) {
  f(begin, end);
}
#endif

// at::parallel_for over [begin, end), each task's rows in the best compiled form.
template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
#ifdef MASKEDBRANCH_AVX2_ROWS
    if (cpu_has_avx2()) return run_avx2(f, b, e);
#endif
    f(b, e);
  });
}

// One pass over a row each, written so that the compiler vectorizes them: the rows never overlap
// (restrict), and a sum is formed where the row is read instead of in a second pass.
template <typename out_t, typename in_t, typename opmath_t>
inline void scaled_row(out_t* __restrict__ o, const in_t* __restrict__ in, opmath_t w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<out_t>(w * static_cast<opmath_t>(in[j]));
}

template <typename out_t, typename in_t, typename opmath_t>
inline void base_plus_scaled_row(out_t* __restrict__ o, const in_t* __restrict__ base, const in_t* __restrict__ in,
                                 opmath_t w, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    o[j] = static_cast<out_t>(static_cast<opmath_t>(base[j]) + w * static_cast<opmath_t>(in[j]));
}

template <typename in_t, typename opmath_t>
inline void add_scaled_row(opmath_t* __restrict__ acc, const in_t* __restrict__ in, opmath_t w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += w * static_cast<opmath_t>(in[j]);
}

template <typename in_t, typename opmath_t>
inline void add_row(opmath_t* __restrict__ acc, const in_t* __restrict__ in, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<opmath_t>(in[j]);
}

template <typename out_t, typename in_t>
inline void converted_row(out_t* __restrict__ o, const in_t* __restrict__ in, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<out_t>(in[j]);
}

// Rows read out of order: fetch a few rows ahead (the hardware prefetcher follows one stream).
constexpr int64_t kPrefetchRows = 4;

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(p + k);
}

// Whether each branch's source rows ascend (so in every plan made by `plan`).
inline bool rows_ascend_per_branch(const int64_t* rows, const std::vector<int64_t>& starts) {
  for (size_t i = 0; i + 1 < starts.size(); ++i)
    for (int64_t p = starts[i] + 1; p < starts[i + 1]; ++p)
      if (rows[p] < rows[p - 1]) return false;
  return true;
}

// Source rows per block of the blocked gather: about an L2 cache of x.
inline int64_t block_rows(int64_t row_bytes) { return std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, row_bytes)); }

// Packed entry p (branch i's slice [starts[i], starts[i + 1])) goes to row p - starts[i] of
// outs[i]: outs[i][k] = w * src[rows[p]]. Without weights w = 1 (a plain copy); with weights
// [B, N], w = weights[rows[p], i].
//
// Several branches with ascending rows (the usual case) are gathered by blocks of source rows:
// each task sweeps its share of x forward once, block by block, and copies every branch's
// entries of the block, where a walk in packed order would sweep x once per branch with gaps
// (a new page on almost every row). Tasks split the entries evenly (a binary search for their
// first source row). Other plans are copied in packed order.
template <typename scalar_t>
void gather_rows(const std::vector<scalar_t*>& outs, const scalar_t* src, int64_t src_rows, const int64_t* rows,
                 const std::vector<int64_t>& starts, int64_t row_numel, const at::opmath_type<scalar_t>* weights) {
  const int64_t num_branches = static_cast<int64_t>(starts.size()) - 1;
  const int64_t num_entries = starts.back();
  const int64_t row_bytes = row_numel * static_cast<int64_t>(sizeof(scalar_t));
  if (row_numel == 0 || num_entries == 0) return;  // nothing to copy (and memcpy must not see null)
  auto copy_entry = [&](int64_t branch, int64_t p) {
    const scalar_t* in = src + rows[p] * row_numel;
    scalar_t* o = outs[branch] + (p - starts[branch]) * row_numel;
    if (weights == nullptr) std::memcpy(o, in, row_bytes);
    else scaled_row(o, in, weights[rows[p] * num_branches + branch], row_numel);
  };
  if (num_branches > 1 && rows_ascend_per_branch(rows, starts)) {
    // first entry of branch i whose source row is >= r
    auto first_at = [&](int64_t i, int64_t r) { return std::lower_bound(rows + starts[i], rows + starts[i + 1], r) - rows; };
    auto entries_below = [&](int64_t r) {
      int64_t n = 0;
      for (int64_t i = 0; i < num_branches; ++i) n += first_at(i, r) - starts[i];
      return n;
    };
    const int64_t tasks = std::clamp<int64_t>(num_entries / row_grain(row_numel), 1, at::get_num_threads());
    std::vector<int64_t> bounds(tasks + 1, src_rows);
    bounds[0] = 0;
    for (int64_t k = 1; k < tasks; ++k) {  // the first source row with k / tasks of the entries below it
      int64_t lo = bounds[k - 1], hi = src_rows;
      const int64_t target = num_entries * k / tasks;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (entries_below(mid) >= target) hi = mid;
        else lo = mid + 1;
      }
      bounds[k] = lo;
    }
    const int64_t block = block_rows(row_bytes);
    parallel_rows(0, tasks, 1, [&](int64_t k0, int64_t k1) {
      std::vector<int64_t> next(num_branches);
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t i = 0; i < num_branches; ++i) next[i] = first_at(i, bounds[k]);
        for (int64_t r0 = bounds[k]; r0 < bounds[k + 1]; r0 += block) {
          const int64_t r1 = std::min(r0 + block, bounds[k + 1]);
          for (int64_t i = 0; i < num_branches; ++i) {
            int64_t p = next[i];
            for (; p < starts[i + 1] && rows[p] < r1; ++p) {
              if (p + kPrefetchRows < starts[i + 1]) prefetch_row(src + rows[p + kPrefetchRows] * row_numel, row_bytes);
              copy_entry(i, p);
            }
            next[i] = p;
          }
        }
      }
    });
    return;
  }
  parallel_rows(0, num_entries, row_grain(row_numel), [&](int64_t begin, int64_t end) {
    int64_t branch = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= starts[branch + 1]) ++branch;
      if (p + kPrefetchRows < end) prefetch_row(src + rows[p + kPrefetchRows] * row_numel, row_bytes);
      copy_entry(branch, p);
    }
  });
}

// combine's segmented sum:
//   out[b] = base[b] + sum over e in [row_offsets[b], row_offsets[b+1]) of w_e * src_e
// where entry e reads row (row_pos[e] - starts[i]) of sources[i], i = row_branch[e], and
// w_e = weights[b, i] (or 1). Sums run in opmath precision, left to right from base, and are
// rounded once. A row is written once when it has at most one entry (the common case: top-1
// routing, drop path), else accumulated in place (or in a float scratch row for half types).
template <typename scalar_t>
void segment_sum_rows(scalar_t* out, const scalar_t* base, const std::vector<const scalar_t*>& sources,
                      const std::vector<int64_t>& starts, const int64_t* row_offsets,
                      const int64_t* row_branch, const int64_t* row_pos, int64_t batch,
                      int64_t row_numel, const at::opmath_type<scalar_t>* weights) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr bool direct = std::is_same_v<opmath_t, scalar_t>;
  const int64_t num_branches = static_cast<int64_t>(sources.size());
  const int64_t row_bytes = row_numel * static_cast<int64_t>(sizeof(scalar_t));
  if (row_numel == 0) return;
  auto source_row = [&](int64_t e) {
    const int64_t i = row_branch[e];
    return sources[i] + (row_pos[e] - starts[i]) * row_numel;
  };
  auto weight = [&](int64_t b, int64_t e) { return weights == nullptr ? opmath_t(1) : weights[b * num_branches + row_branch[e]]; };
  parallel_rows(0, batch, row_grain(row_numel), [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> scratch(direct ? 0 : row_numel);
    for (int64_t b = begin; b < end; ++b) {
      scalar_t* o = out + b * row_numel;
      const scalar_t* base_row = base == nullptr ? nullptr : base + b * row_numel;
      const int64_t first = row_offsets[b], last = row_offsets[b + 1];
      if (first == last) {  // no entry: the base row, or zeros
        if (base_row != nullptr) std::memcpy(o, base_row, row_bytes);
        else std::fill(o, o + row_numel, scalar_t(0));
        continue;
      }
      const bool one = last - first == 1;
      opmath_t* acc = direct ? reinterpret_cast<opmath_t*>(o) : scratch.data();
      const scalar_t* in = source_row(first);
      const opmath_t w = weight(b, first);
      if (one && !direct) {  // written once, rounded once
        if (base_row != nullptr) base_plus_scaled_row(o, base_row, in, w, row_numel);
        else scaled_row(o, in, w, row_numel);
        continue;
      }
      if (base_row != nullptr) base_plus_scaled_row(acc, base_row, in, w, row_numel);
      else if (weights == nullptr && direct) std::memcpy(acc, in, row_bytes);
      else scaled_row(acc, in, w, row_numel);
      for (int64_t e = first + 1; e < last; ++e) {
        if (weights == nullptr) add_row(acc, source_row(e), row_numel);
        else add_scaled_row(acc, source_row(e), weight(b, e), row_numel);
      }
      if constexpr (!direct) converted_row(o, acc, row_numel);
    }
  });
}

}  // namespace cpu
}  // namespace maskedbranch
