// The emulation's runtime (cuda_emulation.h says what it models): a pool of OS threads that runs
// the threads of one block at a time under a schedule, failures, launches, the test controls.
// cuda_emulation_engine.h describes how the threads of a block wait and hand on.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cuda_emulation_engine.h"

namespace mbemu {
namespace detail {

Engine& engine() {
  static Engine* e = new Engine;  // never destroyed: pool threads wait on it until the process ends
  return *e;
}

namespace {

thread_local int tl_thread = -1;

std::string triple(unsigned x, unsigned y, unsigned z) {
  return "(" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
}

std::string thread_name(const Block& b, int t) {
  const unsigned x = b.dims.x, y = b.dims.y;
  return triple(t % x, (t / x) % y, t / (x * y));
}

void notify(int t) { engine().workers[t]->cv.notify_one(); }

}  // namespace


std::string where(Site s) {
  std::string f = s.file;
  for (const char* top : {"/csrc/", "/tests/"}) {
    const size_t at = f.rfind(top);
    if (at != std::string::npos) {
      f = f.substr(at + 1);
      break;
    }
  }
  return f + ":" + std::to_string(s.line);
}

void fail_locked(Block& b, int t, const std::string& what) {
  if (!b.aborted) {
    std::ostringstream os;
    os << "kernel " << b.kernel->name << ", block " << triple(b.index.x, b.index.y, b.index.z) << ", thread "
       << (t >= 0 ? thread_name(b, t) : std::string("-")) << ": " << what;
    b.failure = os.str();
    b.aborted = true;
  }
  for (int u = 0; u < b.threads; ++u)
    if (b.state[u] != State::Done) notify(u);
}

std::string waiting_summary(const Block& b) {
  int at_barrier = 0, at_shuffle = 0;
  for (State s : b.state) {
    at_barrier += s == State::AtBarrier;
    at_shuffle += s == State::AtShuffle;
  }
  std::ostringstream os;
  os << at_barrier << " thread(s) wait at __syncthreads";
  if (at_barrier > 0) os << " (" << where(b.barrier_site) << ")";
  os << ", " << at_shuffle << " at a warp shuffle";
  for (size_t w = 0; w < b.warps.size(); ++w)
    if (b.warps[w].arrived > 0) os << " (warp " << w << ": " << where(b.warps[w].site) << ")";
  os << ", " << b.done << " returned";
  return os.str();
}

namespace {

// Serialized schedules: the next thread to run, or -1 when none can.
int pick_next(Block& b) {
  const int n = b.threads;
  auto runnable = [&](int u) { return b.state[u] == State::NotStarted || b.state[u] == State::Ready; };
  if (b.schedule == Schedule::Forward) {
    for (int u = 0; u < n; ++u)
      if (runnable(u)) return u;
  } else if (b.schedule == Schedule::Reverse) {
    for (int u = n - 1; u >= 0; --u)
      if (runnable(u)) return u;
  } else {
    int count = 0;
    for (int u = 0; u < n; ++u) count += runnable(u);
    if (count == 0) return -1;
    int k = static_cast<int>(b.rng() % static_cast<uint64_t>(count));
    for (int u = 0; u < n; ++u)
      if (runnable(u) && k-- == 0) return u;
  }
  return -1;
}

// The current thread stops running (it waits, yields or returned): let another one run, or
// report the deadlock when none can.
void hand_on(Block& b, int t) {
  if (b.aborted) return;
  if (b.schedule == Schedule::Parallel) {
    if (--b.running == 0 && b.done < b.threads) fail_locked(b, t, "deadlock: " + waiting_summary(b));
    return;
  }
  if (b.holder != t) return;
  const int next = pick_next(b);
  b.holder = next;
  if (next >= 0) {
    b.state[next] = State::Running;
    notify(next);
  } else if (b.done < b.threads) {
    fail_locked(b, t, "deadlock: " + waiting_summary(b));
  }
}

}  // namespace

void make_runnable(Block& b, int u) {
  if (b.schedule == Schedule::Parallel) {
    b.state[u] = State::Running;
    ++b.running;
    notify(u);
  } else {
    b.state[u] = State::Ready;
  }
}

void wait_locked(Block& b, int t, State why, std::unique_lock<std::mutex>& lk) {
  b.state[t] = why;
  hand_on(b, t);
  engine().workers[t]->cv.wait(lk, [&] { return b.aborted || b.state[t] == State::Running; });
  if (b.aborted) throw Abort{};
}

void yield_locked(Block& b, int t, std::unique_lock<std::mutex>& lk) {
  if (b.schedule != Schedule::Parallel) wait_locked(b, t, State::Ready, lk);
}

Block& current_block(int* t) {
  *t = tl_thread;
  if (*t < 0) {
    std::fprintf(stderr, "cuda emulation: device code called outside a kernel\n");
    std::abort();
  }
  return engine().block;
}

[[noreturn]] void fail_here(Block& b, int t, const std::string& what) {
  fail_locked(b, t, what);
  throw Abort{};
}

namespace {

void thread_exit_locked(Block& b, int t) {
  b.state[t] = State::Done;
  ++b.done;
  Warp& w = b.warps[t / kWarpSize];
  ++w.done;
  if (!b.aborted && b.barrier_arrived > 0) {
    fail_locked(b, t, "returned while " + waiting_summary(b) + ": a __syncthreads that not every thread reaches");
  } else if (!b.aborted && w.arrived > 0) {
    fail_locked(b, t, "returned while lanes of its warp wait at a shuffle (" + where(w.site) + ")");
  }
  hand_on(b, t);
  if (b.done == b.threads) engine().host_cv.notify_one();
}

void run_thread(Block& b, int t, std::unique_lock<std::mutex>& lk) {
  if (!b.aborted) {
    lk.unlock();
    threadIdx = uint3{t % b.dims.x, (t / b.dims.x) % b.dims.y, t / (b.dims.x * b.dims.y)};
    blockIdx = b.index;
    blockDim = b.dims;
    gridDim = b.grid;
    tl_thread = t;
    std::string error;
    try {
      b.body(b.params);
    } catch (const Abort&) {
    } catch (const std::exception& e) {
      error = std::string("threw: ") + e.what();
    }
    tl_thread = -1;
    lk.lock();
    if (!error.empty()) fail_locked(b, t, error);
  }
  thread_exit_locked(b, t);
}

void* worker_main(void* arg) {
  const int t = static_cast<int>(reinterpret_cast<intptr_t>(arg));
  Engine& e = engine();
  std::unique_lock<std::mutex> lk(e.mu);
  uint64_t seen = 0;
  for (;;) {
    Block& b = e.block;
    e.workers[t]->cv.wait(lk, [&] {
      return e.epoch != seen && t < b.threads && (b.aborted || b.state[t] == State::Running);
    });
    seen = e.epoch;
    run_thread(b, t, lk);
  }
  return nullptr;
}

void ensure_workers(int n) {
  Engine& e = engine();
  std::lock_guard<std::mutex> g(e.mu);
  while (static_cast<int>(e.workers.size()) < n) {
    const intptr_t t = static_cast<intptr_t>(e.workers.size());
    e.workers.push_back(std::make_unique<Worker>());
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t id;
    const int rc = pthread_create(&id, &attr, worker_main, reinterpret_cast<void*>(t));
    pthread_attr_destroy(&attr);
    TORCH_CHECK(rc == 0, "cuda emulation: cannot start thread ", t, " of the pool (error ", rc, ")");
  }
}

double watchdog_seconds() {
  const char* s = std::getenv("MASKEDBRANCH_CUDA_EMU_TIMEOUT_S");
  return s != nullptr ? std::atof(s) : 600.0;
}

// One block; returns its failure ("" when none).
std::string run_block(KernelRecord* k, dim3 grid, dim3 dims, uint3 index, ThreadBody body, const void* params) {
  Engine& e = engine();
  const int n = static_cast<int>(dims.x * dims.y * dims.z);
  std::unique_lock<std::mutex> lk(e.mu);
  Block& b = e.block;
  b.kernel = k;
  b.grid = grid;
  b.dims = dims;
  b.index = index;
  b.threads = n;
  b.body = body;
  b.params = params;
  b.schedule = e.schedule;
  b.rng.seed(e.seed * 0x9E3779B97F4A7C15ull + e.blocks_run++);
  b.state.assign(n, e.schedule == Schedule::Parallel ? State::Running : State::NotStarted);
  b.running = n;
  b.holder = -1;
  b.done = 0;
  b.barrier_arrived = 0;
  b.warps.assign((n + kWarpSize - 1) / kWarpSize, Warp{});
  for (int w = 0; w < static_cast<int>(b.warps.size()); ++w) b.warps[w].size = std::min(kWarpSize, n - w * kWarpSize);
  b.shared.clear();
  b.shared_total = 0;
  b.aborted = false;
  b.failure.clear();
  ++e.epoch;
  if (b.schedule == Schedule::Parallel) {
    for (int t = 0; t < n; ++t) notify(t);
  } else {
    b.holder = pick_next(b);
    b.state[b.holder] = State::Running;
    notify(b.holder);
  }
  const auto limit = std::chrono::duration<double>(watchdog_seconds());
  if (!e.host_cv.wait_for(lk, limit, [&] { return b.done == n; })) {
    std::fprintf(stderr, "cuda emulation: kernel %s, block %s did not finish within %.0f s (%s); aborting\n",
                 k->name.c_str(), triple(index.x, index.y, index.z).c_str(), limit.count(), waiting_summary(b).c_str());
    std::abort();
  }
  b.shared.clear();
  b.threads = 0;
  return b.failure;
}

}  // namespace
}  // namespace detail

using namespace detail;

// ---- launches and controls ------------------------------------------------------------------

KernelRecord* register_kernel(const char* pretty_function) {
  std::string name = pretty_function;
  const size_t at = name.find("Kernel = ");
  if (at != std::string::npos) name = name.substr(at + 9, name.rfind(']') - at - 9);
  Engine& e = engine();
  std::lock_guard<std::mutex> g(e.mu);
  e.records.push_back(std::make_unique<KernelRecord>());
  e.records.back()->name = name;
  return e.records.back().get();
}

std::vector<const KernelRecord*> kernel_records() {
  Engine& e = engine();
  std::lock_guard<std::mutex> g(e.mu);
  std::vector<const KernelRecord*> out;
  for (const auto& r : e.records) out.push_back(r.get());
  return out;
}

void run_grid(KernelRecord* kernel, dim3 grid, dim3 block, size_t param_bytes, ThreadBody body, const void* params) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  const bool grid_ok = grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 2147483647u && grid.y <= 65535 &&
                       grid.z <= 65535;
  const bool block_ok = block.x >= 1 && block.y >= 1 && block.z >= 1 && block.x <= 1024 && block.y <= 1024 &&
                        block.z <= 64 && threads <= static_cast<uint64_t>(kMaxThreads);
  TORCH_CHECK(grid_ok && block_ok,
              "cuda emulation: kernel ", kernel->name, ": invalid configuration argument (grid ",
              triple(grid.x, grid.y, grid.z), ", block ", triple(block.x, block.y, block.z), ")");
  TORCH_CHECK(param_bytes <= kMaxParamBytes, "cuda emulation: kernel ", kernel->name, ": ", param_bytes,
              " bytes of parameters, above 4 KiB");
  Engine& e = engine();
  std::lock_guard<std::mutex> one_launch(e.launch_mu);
  ensure_workers(static_cast<int>(threads));
  {
    std::lock_guard<std::mutex> g(e.mu);
    ++kernel->launches;
  }
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        const std::string failure = run_block(kernel, grid, block, uint3{x, y, z}, body, params);
        {
          std::lock_guard<std::mutex> g(e.mu);
          ++kernel->blocks;
          kernel->threads += static_cast<int64_t>(threads);
        }
        TORCH_CHECK(failure.empty(), "cuda emulation: ", failure);
      }
    }
  }
}

void set_schedule(Schedule schedule, uint64_t seed) {
  Engine& e = engine();
  std::lock_guard<std::mutex> g(e.mu);
  e.schedule = schedule;
  e.seed = seed;
  e.blocks_run = 0;
}

Limits& limits() { return engine().limits; }

}  // namespace mbemu
