// What device code calls (cuda_emulation.h): the block barrier, warp shuffles, device asserts,
// shared arrays, and the built-in variables.
#include <algorithm>
#include <cstring>
#include <limits>

#include "cuda_emulation_engine.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace mbemu {

using namespace detail;

namespace {
bool same_site(Site a, Site b) { return a.line == b.line && std::strcmp(a.file, b.file) == 0; }
}  // namespace

void syncthreads(Site site) {
  int t;
  Block& b = current_block(&t);
  std::unique_lock<std::mutex> lk(engine().mu);
  if (b.aborted) throw Abort{};
  if (b.barrier_arrived > 0 && !same_site(b.barrier_site, site)) {
    fail_here(b, t, "reached __syncthreads at " + where(site) + " while other threads wait at the one at " +
                        where(b.barrier_site));
  }
  if (b.done > 0) {
    fail_here(b, t, "reached __syncthreads (" + where(site) + ") after " + std::to_string(b.done) +
                        " thread(s) of the block returned: a barrier that not every thread reaches");
  }
  b.barrier_site = site;
  if (++b.barrier_arrived < b.threads) return wait_locked(b, t, State::AtBarrier, lk);
  b.barrier_arrived = 0;
  for (int u = 0; u < b.threads; ++u)
    if (b.state[u] == State::AtBarrier) make_runnable(b, u);
  yield_locked(b, t, lk);
}

uint64_t shuffle_bits(unsigned mask, uint64_t bits, ShuffleKind kind, int lane_arg, int width, Site site) {
  int t;
  Block& b = current_block(&t);
  std::unique_lock<std::mutex> lk(engine().mu);
  if (b.aborted) throw Abort{};
  if (mask != 0xffffffffu) {
    fail_here(b, t, "shuffle at " + where(site) + " with a mask other than 0xffffffff (not modelled)");
  }
  if (width <= 0 || width > kWarpSize || (width & (width - 1)) != 0) {
    fail_here(b, t, "shuffle width not a power of 2 up to 32");
  }
  Warp& w = b.warps[t / kWarpSize];
  const int lane = t % kWarpSize;
  if (w.arrived > 0 && !same_site(w.site, site)) {
    fail_here(b, t, "lanes of one warp at different shuffles: " + where(site) + " and " + where(w.site));
  }
  if (w.done > 0) fail_here(b, t, "shuffle at " + where(site) + " after lanes of its warp returned");
  const int buffer = static_cast<int>(w.generation & 1);
  w.site = site;
  w.slots[buffer][lane] = bits;
  if (++w.arrived < w.size) {
    wait_locked(b, t, State::AtShuffle, lk);
  } else {
    w.arrived = 0;
    ++w.generation;
    const int first = (t / kWarpSize) * kWarpSize;
    for (int u = first; u < first + w.size; ++u)
      if (b.state[u] == State::AtShuffle) make_runnable(b, u);
    yield_locked(b, t, lk);
  }
  // The slots of this round stay untouched until every lane has reached the next shuffle.
  const int base = lane - lane % width;
  int src = lane;
  switch (kind) {
    case ShuffleKind::Idx: src = base + ((lane_arg % width) + width) % width; break;
    case ShuffleKind::Up: src = lane % width >= lane_arg ? lane - lane_arg : lane; break;
    case ShuffleKind::Down: src = lane % width + lane_arg < width ? lane + lane_arg : lane; break;
    case ShuffleKind::Xor: src = (lane ^ lane_arg) < base + width ? lane ^ lane_arg : lane; break;
  }
  if (src >= w.size) src = lane;  // a lane the (partial) warp does not have
  return w.slots[buffer][src];
}

void device_assert_failed(const char* message, const char* condition, Site site) {
  int t;
  Block& b = current_block(&t);
  std::unique_lock<std::mutex> lk(engine().mu);
  if (b.aborted) throw Abort{};
  fail_here(b, t,
            std::string("device-side assert triggered: ") + message + " [" + condition + ", " + where(site) + "]");
}

void* shared_bytes(size_t bytes, Poison poison, Site site) {
  int t;
  Block& b = current_block(&t);
  std::unique_lock<std::mutex> lk(engine().mu);
  if (b.aborted) throw Abort{};
  auto& slot = b.shared[{site.file, site.line}];
  if (slot == nullptr) {
    b.shared_total += bytes;
    if (b.shared_total > kMaxSharedBytes) fail_here(b, t, "more than 48 KiB of static shared memory");
    slot.reset(new unsigned char[std::max<size_t>(bytes, 1)]);
    unsigned char* p = slot.get();
    if (poison == Poison::Float) {
      for (size_t i = 0; i + sizeof(float) <= bytes; i += sizeof(float)) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(p + i, &nan, sizeof nan);
      }
    } else if (poison == Poison::Double) {
      for (size_t i = 0; i + sizeof(double) <= bytes; i += sizeof(double)) {
        const double nan = std::numeric_limits<double>::quiet_NaN();
        std::memcpy(p + i, &nan, sizeof nan);
      }
    } else {
      std::memset(p, 0xA5, bytes);
    }
  }
  return slot.get();
}

}  // namespace mbemu
