// A host emulation of the CUDA C++ that csrc/cuda uses, for tests only. The test build
// (tests/cuda_emu/build.py) compiles the .cu files with the host compiler, with
// MASKEDBRANCH_CUDA_EMULATION defined and this folder on the include path, so that
// csrc/cuda/runtime.cuh includes this header instead of the CUDA runtime's. Kernel bodies and
// launch code are the library's own; only what is below is emulated.
//
// What it models:
// * A launch runs to completion before it returns (one in-order stream). Its blocks run one after
//   another (x fastest, then y, z); the threads of a block run concurrently on OS threads of a
//   pool, each with its own threadIdx / blockIdx / blockDim / gridDim. Launch configurations that
//   CUDA refuses (a zero or too large grid, more than 1024 threads, gridDim.y > 65535, more than
//   48 KiB of shared memory, more than 4 KiB of parameters) fail.
// * __syncthreads is a real barrier over every thread of the block. A thread that returns while
//   others wait there, a barrier reached after some thread returned, threads waiting at different
//   __syncthreads, and any wait that can never end (a deadlock) are failures, reported with the
//   kernel, block and thread, not skipped and not a hang.
// * Warps are 32 consecutive linear thread ids. __shfl_{down,up,xor,}_sync exchange values
//   through per-warp slots and a barrier among the warp's lanes, with CUDA's rules for `width`
//   and for source lanes out of range. Only the full mask 0xffffffff is accepted, and every
//   lane of the warp must reach the same shuffle (as for __syncthreads above).
// * Shared arrays (MB_SHARED) are allocated per block with their exact size (AddressSanitizer
//   sees overruns) and filled with NaN (floating types) or 0xA5 bytes, so a read before the
//   write shows.
// * CUDA_KERNEL_ASSERT_MSG stops the launch like a device-side assert: every thread unwinds at its
//   next barrier or shuffle, and the launch raises a c10::Error naming kernel, block, thread and
//   message (the first failure of the launch; its later blocks do not run).
// * Schedules: "parallel" runs the threads of a block freely; "forward", "reverse" and
//   "shuffled" run one thread at a time and switch only at barriers, shuffles and exits, in
//   order of thread id, the reverse order, or a seeded random order. The serialized schedules
//   are deterministic (a failure repeats); some missing barriers show in one order only (one
//   warp running ahead of a single thread of another), so the kernel tests run under all three.
// * __fmul_rn / __dmul_rn are plain products (the build passes -ffp-contract=off, so no FMA),
//   atomicMin works on integers, device pointers are host pointers. The kernels' 16-byte vectors
//   are their own struct (device_rows.cuh), compiled as they are; loading one from a misaligned
//   address is what UndefinedBehaviorSanitizer reports.
// * Nothing else: __syncwarp, ballots, other atomics, cooperative groups, CUDA's vector types and
//   dynamic parallelism are absent (the kernels use none; code that does fails to compile here).
//
// What it does not model, so a GPU run must still check it: memory ordering beyond barriers and
// atomics (the host orders memory more strongly: a missing __threadfence or volatile passes);
// concurrency between blocks (they run one at a time); lockstep execution of a warp and the
// timing of divergence; asynchrony and streams; the device's own float conversions and
// intrinsics (host conversions round the same way, to nearest even); __launch_bounds__,
// registers, occupancy and performance; grids as large as the device's limits (the tests lower
// the launch code's grid limits instead, see runtime.cuh); CUDA graphs.
#pragma once
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// ---- the language ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

using std::isfinite;

inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }

template <typename T>
T atomicMin(T* address, T value) {
  static_assert(std::is_integral<T>::value, "the emulation's atomicMin takes integers");
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

namespace mbemu {

struct Site {
  const char* file;
  int line;
};

enum class ShuffleKind { Idx, Up, Down, Xor };

void syncthreads(Site site);
uint64_t shuffle_bits(unsigned mask, uint64_t bits, ShuffleKind kind, int lane_arg, int width, Site site);
[[noreturn]] void device_assert_failed(const char* message, const char* condition, Site site);
// A block's shared array for one declaration (site), allocated and poisoned by its first thread.
enum class Poison { Bytes, Float, Double };
void* shared_bytes(size_t bytes, Poison poison, Site site);

// Threads of a warp exchanging a value of up to 8 bytes.
struct Shuffle {
  Site site;
  template <typename T>
  T run(unsigned mask, T v, ShuffleKind kind, int lane_arg, int width) const {
    static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value, "shuffle of a big type");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = shuffle_bits(mask, bits, kind, lane_arg, width, site);
    std::memcpy(&v, &bits, sizeof(T));
    return v;
  }
  template <typename T>
  T down(unsigned mask, T v, unsigned delta, int width = 32) const {
    return run(mask, v, ShuffleKind::Down, static_cast<int>(delta), width);
  }
  template <typename T>
  T up(unsigned mask, T v, unsigned delta, int width = 32) const {
    return run(mask, v, ShuffleKind::Up, static_cast<int>(delta), width);
  }
  template <typename T>
  T xor_(unsigned mask, T v, int lane_mask, int width = 32) const {
    return run(mask, v, ShuffleKind::Xor, lane_mask, width);
  }
  template <typename T>
  T idx(unsigned mask, T v, int src_lane, int width = 32) const {
    return run(mask, v, ShuffleKind::Idx, src_lane, width);
  }
};

template <typename T>
T* shared_array(size_t count, const char* file, int line) {
  static_assert(alignof(T) <= 16, "shared arrays are 16-byte aligned");
  const Poison poison = std::is_same<T, float>::value ? Poison::Float
                        : std::is_same<T, double>::value ? Poison::Double
                                                          : Poison::Bytes;
  return static_cast<T*>(shared_bytes(count * sizeof(T), poison, Site{file, line}));
}

// ---- launches -------------------------------------------------------------------------------
struct Stream {};

// One kernel instantiation: its name (as the compiler spells it) and what ran.
struct KernelRecord {
  std::string name;
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t threads = 0;
};

KernelRecord* register_kernel(const char* pretty_function);
std::vector<const KernelRecord*> kernel_records();

// Runs `body` once per thread of every block of the grid; throws c10::Error on a failure.
using ThreadBody = void (*)(const void* params);
void run_grid(KernelRecord* kernel, dim3 grid, dim3 block, size_t param_bytes, ThreadBody body, const void* params);

template <auto Kernel>
const char* pretty_name() {
  return __PRETTY_FUNCTION__;
}

// Every kernel instantiation the compiled launch code can start registers itself when the library
// loads, so the tests can tell which ones never ran.
template <auto Kernel>
struct KernelEntry {
  static inline KernelRecord* const record = register_kernel(pretty_name<Kernel>());
};

template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, const Args&... args) {
  using Params = std::tuple<Args...>;
  const Params params(args...);  // the parameter space: one copy, read by every thread
  const ThreadBody body = [](const void* p) { std::apply(Kernel, *static_cast<const Params*>(p)); };
  run_grid(KernelEntry<Kernel>::record, grid, block, (sizeof(Args) + ... + 0), body, &params);
}

inline void copy_bytes(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// ---- test controls --------------------------------------------------------------------------
enum class Schedule { Parallel, Forward, Reverse, Shuffled };
void set_schedule(Schedule schedule, uint64_t seed);

struct Limits {
  int64_t grid_blocks = std::numeric_limits<int64_t>::max();
  int64_t int32_plan_entries = std::numeric_limits<int64_t>::max();
};
Limits& limits();

}  // namespace mbemu

#define __syncthreads() ::mbemu::syncthreads(::mbemu::Site{__FILE__, __LINE__})
#define __shfl_down_sync(...) ::mbemu::Shuffle{{__FILE__, __LINE__}}.down(__VA_ARGS__)
#define __shfl_up_sync(...) ::mbemu::Shuffle{{__FILE__, __LINE__}}.up(__VA_ARGS__)
#define __shfl_xor_sync(...) ::mbemu::Shuffle{{__FILE__, __LINE__}}.xor_(__VA_ARGS__)
#define __shfl_sync(...) ::mbemu::Shuffle{{__FILE__, __LINE__}}.idx(__VA_ARGS__)

#undef CUDA_KERNEL_ASSERT_MSG
#define CUDA_KERNEL_ASSERT_MSG(cond, msg)                                                     \
  do {                                                                                        \
    if (!(cond)) ::mbemu::device_assert_failed(msg, #cond, ::mbemu::Site{__FILE__, __LINE__}); \
  } while (0)
