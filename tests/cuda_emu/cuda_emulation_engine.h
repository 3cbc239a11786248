// Internals of the emulation's runtime, shared by its two files: cuda_emulation.cpp (the pool,
// the schedules, launches) and cuda_emulation_device.cpp (what device code calls).
//
// All state of the running block is guarded by one mutex; each pool thread waits on its own
// condition variable. Parallel schedule: every thread not waiting is running, and a wait that
// leaves no thread running can never end (a deadlock). Serialized schedules: one token; the
// thread holding it runs, and hands it on (by the schedule's order) when it waits or returns.
#pragma once
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulation.h"

namespace mbemu {
namespace detail {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kMaxSharedBytes = 48 * 1024;
constexpr size_t kMaxParamBytes = 4096;

struct Abort {};  // unwinds an emulated thread after a failure; never leaves the pool

enum class State { NotStarted, Running, Ready, AtBarrier, AtShuffle, Done };

struct Warp {
  int size = 0;
  int arrived = 0;
  int done = 0;
  Site site{};
  uint64_t generation = 0;
  uint64_t slots[2][kWarpSize] = {};
};

struct Block {
  const KernelRecord* kernel = nullptr;
  dim3 grid, dims;
  uint3 index{};
  int threads = 0;
  ThreadBody body = nullptr;
  const void* params = nullptr;
  Schedule schedule = Schedule::Parallel;
  std::mt19937_64 rng;
  std::vector<State> state;
  int running = 0;  // parallel schedule
  int holder = -1;  // serialized schedules: the thread that may run
  int done = 0;
  int barrier_arrived = 0;
  Site barrier_site{};
  std::vector<Warp> warps;
  std::map<std::pair<std::string, int>, std::unique_ptr<unsigned char[]>> shared;
  size_t shared_total = 0;
  bool aborted = false;
  std::string failure;
};

struct Worker {
  std::condition_variable cv;
};

struct Engine {
  std::mutex mu;                  // guards everything below and the running block
  std::mutex launch_mu;           // one launch at a time
  std::condition_variable host_cv;
  std::vector<std::unique_ptr<Worker>> workers;
  Block block;
  uint64_t epoch = 0;             // one per block started
  Schedule schedule = Schedule::Shuffled;
  uint64_t seed = 0;
  uint64_t blocks_run = 0;
  Limits limits;
  std::vector<std::unique_ptr<KernelRecord>> records;
};

Engine& engine();

// The running block, and (in *thread) the linear id of the emulated thread this OS thread runs.
Block& current_block(int* thread);

std::string where(Site site);  // file:line, from the repository's folders on

// The first failure of a block is kept; every thread is woken to unwind.
void fail_locked(Block& b, int t, const std::string& what);
[[noreturn]] void fail_here(Block& b, int t, const std::string& what);
std::string waiting_summary(const Block& b);

// A released thread may run again (at once, or when the schedule picks it).
void make_runnable(Block& b, int u);
// Waits (as `why`) until another thread makes this one run again; throws Abort on a failure.
void wait_locked(Block& b, int t, State why, std::unique_lock<std::mutex>& lk);
// After releasing others, a serialized schedule lets its order decide who goes on first.
void yield_locked(Block& b, int t, std::unique_lock<std::mutex>& lk);

}  // namespace detail
}  // namespace mbemu
